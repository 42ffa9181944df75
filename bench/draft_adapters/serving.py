"""The served target: the 8B-shaped expansion of the small target, with the task adapters
expanded the same way (``lora_expansion``)."""

from __future__ import annotations

import time

from loraserve.runtime.runner.model_runner import ModelRunner

from ..speculative.expansion import expand_into
from ..speculative.log import log
from ..speculative.models import TrainedModels
from ..speculative.serving import Serving, runtime_config, serving_target_dir
from ..speculative.settings import Settings
from .lora_expansion import expand_lora
from .task_adapters import TaskAdapter


def build_serving(s: Settings, trained: TrainedModels, adapters: list[TaskAdapter], rank: int) -> Serving:
    """Write the serving target and its adapters (expanded unless ``--target-shape trained``),
    then build the runner with the trained weights placed in it."""
    target_dir, _raw, expanded = serving_target_dir(s, trained)
    served = {
        a.name: expand_lora(a.small_dir, trained.work / f"served-{a.name}", s.small_shape, s.target_shape)
        if expanded
        else a.small_dir
        for a in adapters
    }
    config = runtime_config(s, target_dir, served)
    config.lora.max_rank = max(config.lora.max_rank, rank)
    config.lora.max_loras_per_batch = config.lora.max_loaded_loras = max(len(served), 1)
    t0 = time.monotonic()
    runner = ModelRunner(config, random_weights=expanded)
    if expanded:
        expand_into(runner, trained.small_state, s.small_shape)
    params = sum(p.numel() for p in runner.model.parameters())
    log(
        f"target runner ({s.target_shape}, {params / 1e9:.2f} B params, attention {runner.attention_backend},"
        f" adapters {sorted(served)}) built in {time.monotonic() - t0:.1f} s"
    )
    return Serving(config, runner, params, None, None)
