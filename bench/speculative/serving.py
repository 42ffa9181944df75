"""The serving side: the target's directory, the EAGLE head's, the adapters and the runner."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from loraserve.runtime.contract.config import DEFAULT_LORA_MODULES, RuntimeConfig
from loraserve.runtime.dev.devmodels import copy_tokenizer
from loraserve.runtime.model import load_arch_config
from loraserve.runtime.runner.model_runner import ModelRunner
from loraserve.runtime.tools.distill.dflash_draft import dflash_config, save_dflash
from loraserve.runtime.tools.distill.eagle_head import eagle_config, save_eagle_head

from ..harness import log
from ..runtime import write_random_adapter
from .expansion import expand_dflash, expand_eagle_head, expand_into
from .models import TrainedModels
from .settings import Settings
from .shapes import SHAPES, llama_config


@dataclass
class Serving:
    """The runner serving the target, the runtime configuration it was built from, and the
    EAGLE head's and the DFLASH draft's directories (None without those drafts)."""

    config: RuntimeConfig
    runner: ModelRunner
    target_params: int
    head_dir: Path | None
    dflash_dir: Path | None = None


def build_serving(s: Settings, trained: TrainedModels) -> Serving:
    """Write the serving target (``--target-shape``), the EAGLE head for it and 4 adapters,
    then build the runner; an expanded target gets the trained weights placed in it."""
    target_dir, raw, expanded = serving_target_dir(s, trained)
    head_dir = eagle_dir(s, trained, raw)
    dflash_dir = _dflash_dir(s, trained, raw)
    arch = load_arch_config(target_dir)
    adapters = {
        f"ad{i}": write_random_adapter(trained.work / f"ad{i}", arch, rank=16, seed=10 + i, b_std=s.args.adapter_b_std)
        for i in range(4)
    }
    config = runtime_config(s, target_dir, adapters)
    runner, target_params = build_target_runner(s, trained, config, expanded)
    return Serving(config, runner, target_params, head_dir, dflash_dir)


def build_target_runner(
    s: Settings, trained: TrainedModels, config: RuntimeConfig, expanded: bool, note: str = ""
) -> tuple[ModelRunner, int]:
    """The serving target's runner built from ``config`` and its parameter count; an
    ``expanded`` target (``serving_target_dir``) gets the trained weights placed in it. Logs
    the build time, with ``note`` (``", adapters [...]"``) after the attention backend."""
    t0 = time.monotonic()
    runner = ModelRunner(config, random_weights=expanded)
    if expanded:
        expand_into(runner, trained.small_state, s.small_shape)
    params = sum(p.numel() for p in runner.model.parameters())
    log(
        f"target runner ({s.target_shape}, {params / 1e9:.2f} B params, attention {runner.attention_backend}{note})"
        f" built in {time.monotonic() - t0:.1f} s"
    )
    return runner, params


def serving_target_dir(s: Settings, trained: TrainedModels) -> tuple[Path, dict, bool]:
    """The serving target's directory, its config.json and whether its weights are to be
    expanded from the small model's (``trained``: the small model's own directory)."""
    small_dir = trained.small_dir
    if s.target_shape == "trained":
        return small_dir, json.loads((small_dir / "config.json").read_text()), False
    hs, hb = SHAPES[s.small_shape][0], SHAPES[s.target_shape][0]
    small_eps = json.loads((small_dir / "config.json").read_text()).get("rms_norm_eps", 1e-5)
    # RMSNorm over the padded width sees hs/hb of the mean square: eps scales with it
    raw = llama_config(s.target_shape, s.vocab, eps=small_eps * hs / hb)
    target_dir = trained.work / f"target-{s.target_shape}"
    target_dir.mkdir()
    (target_dir / "config.json").write_text(json.dumps(raw, indent=1))
    copy_tokenizer(trained.tokenizer_dir, target_dir)
    return target_dir, raw, True


def eagle_dir(s: Settings, trained: TrainedModels, raw: dict) -> Path | None:
    """The trained EAGLE head written for the serving target (expanded to its shape), or None."""
    if trained.head is None:
        return None
    tensors = trained.head.checkpoint()
    if s.target_shape != "trained":
        tensors = expand_eagle_head(tensors, s.small_shape, s.target_shape)
    return save_eagle_head(tensors, eagle_config(raw, raw["intermediate_size"]), trained.work / "eagle")


def _dflash_dir(s: Settings, trained: TrainedModels, raw: dict) -> Path | None:
    """The trained DFLASH draft written for the serving target (expanded to its shape), or None."""
    draft = trained.dflash
    if draft is None:
        return None
    tensors = draft.checkpoint()
    layers = len(draft.layers)
    if s.target_shape != "trained":
        tensors = expand_dflash(
            tensors, s.small_shape, s.target_shape, num_layers=layers, num_features=len(draft.layer_ids)
        )
    config = dflash_config(
        raw, intermediate=raw["intermediate_size"], num_layers=layers, layer_ids=draft.layer_ids, block=draft.block, mask_id=draft.mask_id,
    )  # fmt: skip
    return save_dflash(tensors, config, trained.work / "dflash")


def runtime_config(s: Settings, target_dir: Path, adapters: dict[str, Path]) -> RuntimeConfig:
    """The runtime configuration of the plain (no speculation) serving target."""
    max_c = max(s.concurrency)
    config = RuntimeConfig()
    config.model.path = str(target_dir)
    config.model.dtype = "float32" if s.device.type == "cpu" else "bfloat16"
    config.device = str(s.device)
    config.seed = 0
    config.lora.max_rank = 16
    config.lora.max_loras_per_batch = 4
    config.lora.max_loaded_loras = 4
    config.lora.target_modules = DEFAULT_LORA_MODULES
    config.lora.adapters = {n: str(p) for n, p in adapters.items()}
    config.scheduler.max_running_requests = max_c
    widest = max([s.k, s.dflash_block] + [tokens for _, tokens in s.trees])
    config.scheduler.max_total_tokens = max_c * (s.prompt_len + s.gen_tokens + 2 * widest + 16) + 4096
    # Every run prefills its prompts whole. The drafts' timed runs repeat the baseline's prompts
    # (and above concurrency 1 their own warm-up's): a prefix cache would turn their prefills
    # into hits that the baseline's first run never had.
    config.scheduler.prefix_cache = False
    config.cuda_graph.enabled = s.device.type == "cuda"
    config.cuda_graph.max_bs = max_c
    config.attention_backend = s.args.attention_backend
    return config
