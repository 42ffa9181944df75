"""STANDALONE: a whole small model with the target's tokenizer drafts (:mod:`.drafter`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from ..draft_config import SpeculativeConfigError, build_draft_config

if TYPE_CHECKING:
    from ...contract.config import RuntimeConfig, SpecAlgorithm
    from ...sampling import Sampler
    from ..drafter import Drafter


def build_drafter(config: RuntimeConfig, runner, sampler: Sampler, requested: SpecAlgorithm) -> Drafter:
    """A draft model runner of its own (``config``'s draft, no target adapters) beside the
    target ``runner``, holding at most as many tokens as the target at its verify peak."""
    from ...runner.model_runner import ModelRunner
    from .drafter import StandaloneDrafter

    draft_config = build_draft_config(config, context_length=runner.context_len)
    draft_config.scheduler.max_total_tokens = runner.kv.capacity
    draft_runner = ModelRunner(
        draft_config,
        is_draft=True,
        device=runner.device,
        random_weights=config.speculative.draft_load_format == "dummy",
    )
    _check_same_tokenizer(runner.model_path, draft_runner.model_path)
    return StandaloneDrafter(draft_runner, sampler, runner.vocab_size)


def _vocabulary(model_dir: Path) -> tuple | None:
    file = model_dir / "tokenizer.json"
    if not file.is_file():
        return None
    raw = json.loads(file.read_text())
    model = raw.get("model") or {}
    added = sorted((t.get("id"), t.get("content")) for t in raw.get("added_tokens") or [])
    return json.dumps(model.get("vocab"), sort_keys=True), json.dumps(added)


def _check_same_tokenizer(target_dir: Path, draft_dir: Path) -> None:
    """A STANDALONE draft proposes token ids: they must mean what they mean to the target."""
    target, draft = _vocabulary(Path(target_dir)), _vocabulary(Path(draft_dir))
    if target is not None and draft is not None and target != draft:
        raise SpeculativeConfigError(
            "speculative.draft_model_path",
            f"the STANDALONE draft at {draft_dir} has a different tokenizer vocabulary from the target at "
            f"{target_dir}: use a draft trained with the target's tokenizer",
        )
