"""The served target: the 8B-shaped expansion of the small target, with the task adapters
expanded the same way (``lora_expansion``); with ``--draft eagle`` the EAGLE head and its
draft adapters too, expanded as ``bench/speculative`` expands the head."""

from __future__ import annotations

from pathlib import Path

from ..speculative.models import TrainedModels
from ..speculative.serving import (
    Serving,
    build_target_runner,
    eagle_dir,
    runtime_config,
    serving_target_dir,
)
from ..speculative.settings import Settings
from .lora_expansion import expand_lora
from .task_adapters import TaskAdapter


def build_serving(s: Settings, trained: TrainedModels, adapters: list[TaskAdapter], rank: int) -> Serving:
    """Write the serving target and its adapters (expanded unless ``--target-shape trained``)
    and the EAGLE head for it when one was trained, then build the runner with the trained
    weights placed in it."""
    target_dir, raw, expanded = serving_target_dir(s, trained)
    served = {
        a.name: expand_lora(a.small_dir, trained.work / f"served-{a.name}", s.small_shape, s.target_shape)
        if expanded
        else a.small_dir
        for a in adapters
    }
    head_dir = eagle_dir(s, trained, raw)  # as bench/speculative serves it
    config = runtime_config(s, target_dir, served)
    config.lora.max_rank = max(config.lora.max_rank, rank)
    config.lora.max_loras_per_batch = config.lora.max_loaded_loras = max(len(served), 1)
    runner, params = build_target_runner(s, trained, config, expanded, note=f", adapters {sorted(served)}")
    return Serving(config, runner, params, head_dir, None)


def served_draft_adapters(
    s: Settings, trained: TrainedModels, draft_adapters: dict[str, Path]
) -> dict[str, Path]:
    """The draft adapters as the draft's pool loads them. A STANDALONE draft is served as
    trained, so its adapters are too; an EAGLE head is served expanded to the target's shape,
    so its adapters are expanded the same way (``lora_expansion.expand_head_lora_tensors``)."""
    if trained.head is None or s.target_shape == "trained":
        return dict(draft_adapters)
    return {
        name: expand_lora(
            path, trained.work / f"served-draft-{name}", s.small_shape, s.target_shape, head=True
        )
        for name, path in draft_adapters.items()
    }
