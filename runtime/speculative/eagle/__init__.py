"""EAGLE / EAGLE3 (and NEXTN, which runs as EAGLE): one decoder layer over the target's
hidden states drafts each step, as a chain or a tree.

:mod:`.format` reads head checkpoints, :mod:`.model` is the head, :mod:`.lora` its draft
adapter pool, :mod:`.runner` runs it with its own KV cache, :mod:`.graphs` replays its
steps from CUDA graphs, :mod:`.drafter` proposes, :mod:`.builder` writes test heads.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ...contract.config import SpecAlgorithm
from ...model.arch import ModelConfigError
from ..draft.settings import DraftSettings
from ..draft_config import SpeculativeConfigError

if TYPE_CHECKING:
    from ...contract.config import RuntimeConfig
    from ...sampling import Sampler
    from ..drafter import Drafter

log = logging.getLogger("loraserve.spec")

_VERSIONS = {SpecAlgorithm.EAGLE: 1, SpecAlgorithm.EAGLE3: 3}
"""The head checkpoint version each algorithm reads."""


def build_drafter(config: RuntimeConfig, runner, sampler: Sampler, requested: SpecAlgorithm) -> Drafter:
    """A head drafter for ``config`` (effective: NEXTN already EAGLE) beside the target
    ``runner``; ``requested`` is the algorithm as configured, for the messages."""
    from ..draft_vocab import TokenMapError
    from ..tree import TreeShape
    from .drafter import EagleDrafter
    from .runner import EagleDraftRunner

    spec = config.speculative
    algorithm = SpecAlgorithm(spec.algorithm)
    try:
        # The head's own draft adapter pool only (never the target's adapters).
        draft_runner = EagleDraftRunner(DraftSettings.beside(config, runner))
    except TokenMapError as exc:
        raise SpeculativeConfigError("speculative.token_map", str(exc)) from exc
    except ModelConfigError as exc:
        hint = ""
        if requested.traits.resolves_to is not None:
            hint = (
                f" ({requested.value} runs as {algorithm.value}: point speculative.draft_model_path at an "
                "EAGLE-format next-n head)"
            )
        raise SpeculativeConfigError("speculative.draft_model_path", f"{exc}{hint}") from exc
    if draft_runner.version != _VERSIONS[algorithm]:
        have = "EAGLE3" if draft_runner.version == 3 else "EAGLE"
        raise SpeculativeConfigError(
            "speculative.algorithm",
            f"speculative.algorithm is {requested.value} but {spec.draft_model_path} is an {have} draft: "
            f"set speculative.algorithm to {have}",
        )
    log.info("%s draft %s predicts over %s", algorithm.value, spec.draft_model_path, draft_runner.vocab.source)
    tree = TreeShape(spec.top_k, spec.num_steps, spec.num_draft_tokens) if spec.top_k > 1 else None
    return EagleDrafter(draft_runner, sampler, runner.vocab_size, tree=tree)
