"""Rank 0 of a 2-rank group in a process of its own, for the failure tests.

Run as ``python rank0_main.py MODEL_DIR {idle|busy} CONTROL_TIMEOUT_S``. Prints one JSON
line when serving (``{"ready": ..., "workers": [pids]}``) and one when the group fails
(``{"failure": reason}``, what the HTTP server's readiness hook receives). Busy: runs
decode steps back to back, catching failures the way the engine does; idle: sleeps.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from loraserve.kernels import ForwardMode
from loraserve.runtime.contract.config import RuntimeConfig
from loraserve.runtime.distributed.errors import TensorParallelError
from loraserve.runtime.distributed.health import health
from loraserve.runtime.executor.launch import TPOptions, start_tensor_parallel
from loraserve.runtime.runner.forward_batch import ForwardBatch
from loraserve.runtime.runner.model_runner import ModelRunner


def main() -> None:
    model, mode, control_timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
    config = RuntimeConfig()
    config.model.path = model
    config.device = "cpu"
    config.parallel.tensor_parallel_size = 2
    config.scheduler.max_total_tokens = 100_000
    config.lora.enabled = False
    options = TPOptions(
        collective_timeout_s=30.0,
        control_timeout_s=control_timeout,
        heartbeat_s=control_timeout / 4,
        startup_timeout_s=60.0,
        failure_grace_s=1.0,
    )
    handle = start_tensor_parallel(config, options=options)
    health().on_failure(lambda reason: print(json.dumps({"failure": reason}), flush=True))
    runner = ModelRunner(config)
    runner.forward(ForwardBatch(ForwardMode.EXTEND, ["r"], torch.arange(3, 9), extend_lens=[6]))
    print(json.dumps({"ready": True, "workers": handle.worker_pids}), flush=True)
    step = 0
    while True:
        if mode == "busy":
            try:
                runner.forward(ForwardBatch(ForwardMode.DECODE, ["r"], torch.tensor([5 + step % 100])))
                step += 1
            except TensorParallelError:
                time.sleep(0.05)  # the engine keeps running; the health timer ends the process
        else:
            time.sleep(0.05)


if __name__ == "__main__":
    main()
