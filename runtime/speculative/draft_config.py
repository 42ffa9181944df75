"""The draft's own configuration, derived from the target's without touching it.

A draft runs in the same process as the target but is a different model: its own path,
its own load format, no LoRA pool (drafts never see adapters, which is what keeps one
draft valid for every adapter). Everything else (dtype, device, context length, KV
budget, graphs) follows the target, so the draft can hold every token the target holds.
The target's :class:`RuntimeConfig` is deep-copied first and never mutated.
"""

from __future__ import annotations

from ..contract.capabilities import CAPABILITIES, Capabilities
from ..contract.config import RuntimeConfig
from ..contract.policy import check_speculation


class SpeculativeConfigError(ValueError):
    """A speculative setting cannot run; ``field`` is its config path."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def check_speculative(config: RuntimeConfig, capabilities: Capabilities = CAPABILITIES) -> RuntimeConfig:
    """``config``'s effective form (the algorithm resolved) for building a drafter, judged
    by the speculative rules of the one compatibility policy
    (:func:`~..contract.policy.check_speculation`: the rules the admission webhook and the
    runtime's start-up judge by in ``check_config``), so what starts also drafts.

    Raises :class:`SpeculativeConfigError` naming the first refused field, with every
    violation's reason and fix, or when speculation is off.
    """
    report = check_speculation(config, capabilities)
    if report.violations:
        first = report.violations[0]
        raise SpeculativeConfigError(first.field, "; ".join(v.render() for v in report.violations))
    if not report.effective.speculative.enabled:
        raise SpeculativeConfigError(
            "speculative.algorithm", "speculative decoding is disabled (speculative.algorithm is NONE)"
        )
    return report.effective


def build_draft_config(target: RuntimeConfig, *, context_length: int | None = None) -> RuntimeConfig:
    """The draft model's own :class:`RuntimeConfig`; ``target`` is left untouched.

    ``context_length``: the target's resolved context length (its model's maximum when
    the configuration leaves it unset); the draft follows it so that every position the
    target can reach, the draft can too.
    """
    draft = check_speculative(target)  # a copy: the target is never changed
    spec = draft.speculative
    if spec.draft_model_path:
        draft.model.path = spec.draft_model_path
    draft.model.architecture = spec.draft_model_architecture
    draft.model.revision = None
    draft.model.served_name = None
    draft.model.context_length = context_length if context_length is not None else target.model.context_length
    if hasattr(draft.model, "load_format"):
        draft.model.load_format = spec.draft_load_format
    # None of the target's adapters in the draft: one draft serves every adapter, and its
    # proposals never depend on which target adapters are loaded. Its own pool (draft
    # adapters, by Adapter name) exists only with speculative.draft_max_loras.
    pool = spec.draft_lora_pool(target.lora)
    if pool is not None:
        draft.lora = pool
    else:
        draft.lora.enabled = False
        draft.lora.adapters = {}
        draft.lora.pinned = ()
    return draft
