"""The settings a draft model beside the target is built from, taken from the target once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ...contract.config import LoRAConfig, RuntimeConfig
from ...model.arch import ModelArchConfig


def base_weight(module: nn.Module) -> torch.Tensor:
    """The base weight of an embedding / LM head, unwrapped from any adapter wrapper.

    Wrappers in the PEFT style keep the original module as ``base_layer``; the runtime's
    own layers keep adapters outside the module. Either way the returned tensor is the
    base model's weight, and a draft using it sees no adapter.
    """
    while hasattr(module, "base_layer"):
        module = module.base_layer
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{type(module).__name__} has no weight tensor to share with a draft")
    return weight


@dataclass(frozen=True)
class DraftSettings:
    """Everything a draft runner (:class:`~.runner.DraftRunner`) is built from: its
    checkpoint, the target's shape and BASE embedding / lm_head, and the target's dtype,
    device, KV limits, attention backend and graph batch sizes, so the draft can hold every
    token the target holds. Built once per serve by :meth:`beside`; algorithms read the
    fields they use."""

    path: str | Path
    """The draft's checkpoint directory."""
    target_arch: ModelArchConfig
    embed_weight: torch.Tensor
    """The target's BASE token embedding (never an adapter's)."""
    lm_head_weight: torch.Tensor
    """The target's BASE lm_head (never an adapter's)."""
    dtype: torch.dtype
    device: torch.device | str
    max_total_tokens: int
    """The draft's KV capacity in tokens: the target's."""
    max_requests: int
    max_context_len: int
    architecture: str | None = None
    """The draft's architecture when its config.json does not say (``speculative.draft_model_architecture``)."""
    load_format: str = "auto"
    """``auto`` / ``safetensors`` read the checkpoint, ``dummy`` draws random weights."""
    seed: int = 0
    """The seed of ``dummy`` weights."""
    attention_backend: str = "sdpa"
    """The target's attention backend (see :mod:`...model.layers.attention`)."""
    cuda_graph_max_bs: int = 0
    """Replay uniform draft forwards of up to this many requests from CUDA graphs (0: eager)."""
    target_dir: str | Path | None = None
    """The target's checkpoint directory (DFLASH reads its mask token there)."""
    verify_width: int | None = None
    """``speculative.num_draft_tokens`` (a DFLASH block's width, captured in its graphs)."""
    token_map: str | None = None
    """A file of token ids an EAGLE head predicts over (``speculative.token_map``)."""
    draft_lora: LoRAConfig | None = None
    """The draft adapter pool (``speculative.draft_lora_pool``; None: none)."""

    @classmethod
    def beside(cls, config: RuntimeConfig, runner) -> DraftSettings:
        """The settings of ``config``'s draft next to the target ``runner``: its BASE
        embedding and lm_head are unwrapped from any adapter wrapper here, the one place a
        draft takes them."""
        spec = config.speculative
        return cls(
            path=str(spec.draft_model_path),
            target_arch=runner.arch,
            embed_weight=base_weight(runner.embed_tokens),
            lm_head_weight=base_weight(runner.lm_head),
            dtype=runner.dtype,
            device=runner.device,
            max_total_tokens=runner.kv.capacity,
            max_requests=runner.kv.max_requests,
            max_context_len=runner.kv.max_context_len,
            architecture=spec.draft_model_architecture,
            load_format=spec.draft_load_format,
            seed=config.seed,
            attention_backend=runner.attention_backend,
            cuda_graph_max_bs=config.cuda_graph.max_bs if config.cuda_graph.enabled else 0,
            target_dir=runner.model_path,
            verify_width=None if spec.num_draft_tokens is None else int(spec.num_draft_tokens),
            token_map=spec.token_map,
            draft_lora=spec.draft_lora_pool(config.lora),
        )
