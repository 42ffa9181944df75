"""The settings a draft model beside the target is built from, taken from the target once."""

from __future__ import annotations

from ...contract.config import RuntimeConfig


def head_runner_args(config: RuntimeConfig, runner) -> dict:
    """What every draft head beside the target is built from: its checkpoint, the target's
    shape, the target's BASE embedding and lm_head (unwrapped from any adapter wrapper here,
    the one place a head takes them), and the target's KV limits and attention backend."""
    from ..eagle.model import base_weight

    spec = config.speculative
    return dict(
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
    )
