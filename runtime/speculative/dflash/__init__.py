"""DFLASH: a block-diffusion draft over the target's hidden states drafts a whole block in
one forward.

:mod:`.format` reads its checkpoints, :mod:`.model` is the draft, :mod:`.runner` runs it
with its own KV cache of context features, :mod:`.graphs` replays its uniform forwards
from CUDA graphs, :mod:`.drafter` proposes.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ...model.arch import ModelConfigError
from ..draft.settings import DraftSettings
from ..draft_config import SpeculativeConfigError

if TYPE_CHECKING:
    from ...contract.config import RuntimeConfig, SpecAlgorithm
    from ...sampling import Sampler
    from ..drafter import Drafter

log = logging.getLogger("loraserve.spec")


def build_drafter(config: RuntimeConfig, runner, sampler: Sampler, requested: SpecAlgorithm) -> Drafter:
    """A DFLASH drafter over the target's BASE embedding and lm_head, drafting blocks of
    ``speculative.num_draft_tokens`` (the checkpoint's block bounds it)."""
    from .drafter import DFlashDrafter
    from .runner import DFlashDraftRunner

    spec = config.speculative
    try:
        draft_runner = DFlashDraftRunner(DraftSettings.beside(config, runner))
        draft_runner.config.check_block(int(spec.num_draft_tokens))
    except ModelConfigError as exc:
        field = "speculative.num_draft_tokens" if "num_draft_tokens" in str(exc) else "speculative.draft_model_path"
        raise SpeculativeConfigError(field, str(exc)) from exc
    log.info(
        "DFLASH draft %s: block of %d (trained on %s), target layers %s, mask token %d (%s)",
        spec.draft_model_path,
        spec.num_draft_tokens,
        draft_runner.config.block_size,
        list(draft_runner.config.target_layer_ids),
        draft_runner.mask_token_id,
        draft_runner.mask_source,
    )
    return DFlashDrafter(draft_runner, sampler, runner.vocab_size)
