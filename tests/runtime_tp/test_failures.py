"""A failed rank fails the pod, never hangs it.

Rank 0 runs in its own process (``rank0_main.py``, the runtime's launcher inside) so it
can exit the way a pod's rank 0 does. Killing a worker makes rank 0 report the failure
(what turns ``/ready`` to 503) and exit with ``EXIT_TP_FAILURE``; killing or freezing
rank 0 makes the worker exit the same way; a rank whose state diverges stops the group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from loraserve.runtime.distributed.errors import TensorParallelError
from loraserve.runtime.distributed.health import EXIT_TP_FAILURE
from loraserve.runtime.executor.launch import start_tensor_parallel
from loraserve.runtime.kv import KVCache
from loraserve.runtime.runner.model_runner import ModelRunner

from .conftest import TEST_OPTIONS, decode, extend, tp_config

SCRIPT = Path(__file__).with_name("rank0_main.py")
DEADLINE_S = 20.0  # every failure below must end its processes well within this


class Rank0:
    """The rank-0 process and what it prints (stdout: JSON lines; stderr: both ranks' logs)."""

    def __init__(self, model: Path, mode: str, control_timeout_s: float = 30.0):
        self.proc = subprocess.Popen(
            [sys.executable, "-P", str(SCRIPT), str(model), mode, str(control_timeout_s)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[dict] = []
        self.stderr: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read_stdout(self):
        for line in self.proc.stdout:
            self.lines.append(json.loads(line))
            if "ready" in self.lines[-1]:
                self._ready.set()

    def _read_stderr(self):
        for line in self.proc.stderr:
            self.stderr.append(line)

    def wait_ready(self) -> int:
        assert self._ready.wait(90), f"rank 0 never became ready:\n{''.join(self.stderr)}"
        return next(line for line in self.lines if "ready" in line)["workers"][0]

    def wait_stderr(self, text: str, timeout_s: float = DEADLINE_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(text in line for line in self.stderr):
                return
            time.sleep(0.05)
        raise AssertionError(f"{text!r} never appeared in:\n{''.join(self.stderr)}")

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _gone(pid: int) -> bool:
    """Exited (a zombie waiting for its new parent to reap it counts)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def _wait_gone(pid: int, timeout_s: float = DEADLINE_S) -> float:
    start = time.monotonic()
    while not _gone(pid):
        assert time.monotonic() - start < timeout_s, f"pid {pid} still running after {timeout_s}s"
        time.sleep(0.05)
    return time.monotonic() - start


@pytest.mark.parametrize("mode", ["idle", "busy"])
def test_killed_worker_fails_rank_0(tp_assets, mode):
    rank0 = Rank0(tp_assets.gqa, mode)
    try:
        worker = rank0.wait_ready()
        os.kill(worker, signal.SIGKILL)
        start = time.monotonic()
        code = rank0.proc.wait(timeout=DEADLINE_S)
        elapsed = time.monotonic() - start
    finally:
        rank0.close()
    time.sleep(0.2)  # let the readers drain the pipes
    assert code == EXIT_TP_FAILURE, "".join(rank0.stderr)
    assert elapsed < DEADLINE_S
    failures = [line["failure"] for line in rank0.lines if "failure" in line]
    assert len(failures) == 1  # the readiness hook fired, once
    log = "".join(rank0.stderr)
    assert "tensor-parallel group failed" in log
    assert f"rank 1 (pid {worker}) exited" in log  # the reason names the rank that died


def test_killed_rank_0_stops_the_worker(tp_assets):
    rank0 = Rank0(tp_assets.gqa, "idle")
    try:
        worker = rank0.wait_ready()
        rank0.proc.send_signal(signal.SIGKILL)
        rank0.proc.wait()
        assert _wait_gone(worker) < DEADLINE_S
        # The worker says why it stopped: its parent is gone, or the channel to it closed.
        rank0.wait_stderr("rank 1")
    finally:
        rank0.close()
    log = "".join(rank0.stderr)
    assert "rank 0 (pid" in log or "rank 1 lost rank 0" in log, log


def test_frozen_rank_0_times_out_the_worker(tp_assets):
    """Rank 0 alive but silent (no steps, no heartbeats): the worker's control timeout fires."""
    rank0 = Rank0(tp_assets.gqa, "idle", control_timeout_s=3.0)
    try:
        worker = rank0.wait_ready()
        rank0.proc.send_signal(signal.SIGSTOP)
        waited = _wait_gone(worker)
        rank0.wait_stderr("failed")
    finally:
        rank0.proc.send_signal(signal.SIGKILL)
        rank0.close()
    assert 2.0 < waited < DEADLINE_S  # not before the timeout, not much after
    log = "".join(rank0.stderr)
    assert "rank 1 lost rank 0: no step or heartbeat arrived" in log, log


def test_diverged_rank_stops_the_group(tp_assets, capfd):
    """Rank 0's KV changed behind the journal's back: rank 1 notices on the next step and
    stops; rank 0's next collective fails and the group reports the failure."""
    config = tp_config(tp_assets.gqa, 2)
    handle = start_tensor_parallel(config, options=TEST_OPTIONS, exit_on_failure=False)
    try:
        runner = ModelRunner(config)
        extend(runner, ["d"], [torch.arange(3, 12)])
        KVCache.free(runner.kv, "d")  # the base method: no journal entry for rank 1
        with pytest.raises(TensorParallelError):
            extend(runner, ["e"], [torch.arange(3, 7)])
            decode(runner, ["e"], [4])
        assert handle.health.failure is not None
        assert handle.workers[0].wait(timeout=DEADLINE_S) == EXIT_TP_FAILURE
        with pytest.raises(TensorParallelError, match="tensor parallelism failed"):
            decode(runner, ["e"], [5])  # refused at once: nothing is sent to a broken group
    finally:
        handle.shutdown()
    assert "diverged from rank 0" in capfd.readouterr().err
