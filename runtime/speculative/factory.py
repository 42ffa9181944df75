"""Builds the drafter and the speculative decoder for a configuration.

The draft is built next to an already-built target runner: it follows the target's
device, dtype, context length and KV capacity, and takes the target's BASE embeddings
and (unless the checkpoint has its own) LM head (EAGLE family). Settings that cannot run raise
:class:`~.draft_config.SpeculativeConfigError` naming the field and the fix.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ..contract.config import RuntimeConfig, SpecAlgorithm
from ..model.arch import ModelConfigError
from ..sampling import Sampler
from .decoder import SpeculativeDecoder
from .draft_config import SpeculativeConfigError, build_draft_config, check_speculative
from .drafter import Drafter
from .tree import TreeShape

log = logging.getLogger("loraserve.spec")


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


def build_drafter(config: RuntimeConfig, runner, sampler: Sampler) -> tuple[Drafter, SpecAlgorithm]:
    """The drafter for ``config.speculative`` next to the target ``runner``, and the algorithm it runs."""
    effective = check_speculative(config)  # NEXTN as EAGLE, with its draft path
    requested, config = SpecAlgorithm(config.speculative.algorithm), effective
    spec = config.speculative
    algorithm = SpecAlgorithm(spec.algorithm)
    if algorithm is SpecAlgorithm.NGRAM:
        from .ngram_drafter import NgramDrafter

        return NgramDrafter(spec.ngram_min, spec.ngram_max, device=runner.device), algorithm
    draft_config = build_draft_config(config, context_length=runner.context_len)
    # The draft holds at most as many tokens as the target at its verify peak.
    draft_config.scheduler.max_total_tokens = runner.kv.capacity
    if algorithm is SpecAlgorithm.STANDALONE:
        from ..runner.model_runner import ModelRunner
        from .standalone import StandaloneDrafter

        draft_runner = ModelRunner(
            draft_config,
            is_draft=True,
            device=runner.device,
            random_weights=spec.draft_load_format == "dummy",
        )
        _check_same_tokenizer(runner.model_path, draft_runner.model_path)
        return StandaloneDrafter(draft_runner, sampler, runner.vocab_size), algorithm
    if algorithm is SpecAlgorithm.DFLASH:
        return _dflash_drafter(config, runner, sampler), algorithm

    from .draft_vocab import TokenMapError
    from .eagle_drafter import EagleDrafter
    from .eagle_runner import EagleDraftRunner

    try:
        draft_runner = EagleDraftRunner(
            **_head_runner_args(config, runner),
            cuda_graph_max_bs=config.cuda_graph.max_bs if config.cuda_graph.enabled else 0,
            token_map=spec.token_map,
            # The head's own draft adapter pool (never the target's adapters).
            draft_lora=spec.draft_lora_pool(config.lora),
        )
    except TokenMapError as exc:
        raise SpeculativeConfigError("speculative.token_map", str(exc)) from exc
    except ModelConfigError as exc:
        hint = ""
        if requested is SpecAlgorithm.NEXTN:
            hint = " (NEXTN runs as EAGLE: point speculative.draft_model_path at an EAGLE-format next-n head)"
        raise SpeculativeConfigError("speculative.draft_model_path", f"{exc}{hint}") from exc
    wanted = 3 if algorithm is SpecAlgorithm.EAGLE3 else 1
    if draft_runner.version != wanted:
        have = "EAGLE3" if draft_runner.version == 3 else "EAGLE"
        raise SpeculativeConfigError(
            "speculative.algorithm",
            f"speculative.algorithm is {requested.value} but {spec.draft_model_path} is an {have} draft: "
            f"set speculative.algorithm to {have}",
        )
    log.info(
        "%s draft %s predicts over %s", algorithm.value, spec.draft_model_path, draft_runner.vocab.source
    )
    tree = TreeShape(spec.top_k, spec.num_steps, spec.num_draft_tokens) if spec.top_k > 1 else None
    return EagleDrafter(draft_runner, sampler, runner.vocab_size, tree=tree), algorithm


def _head_runner_args(config: RuntimeConfig, runner) -> dict:
    """What every draft head beside the target is built from: its checkpoint, the target's
    shape, the target's BASE embedding and lm_head (unwrapped from any adapter wrapper here,
    the one place a head takes them), and the target's KV limits and attention backend."""
    from .eagle_model import base_weight

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


def _dflash_drafter(config: RuntimeConfig, runner, sampler: Sampler) -> Drafter:
    """A DFLASH drafter over the target's BASE embedding and lm_head (unwrapped from any
    adapter wrapper here, the one place the draft takes them)."""
    from .dflash_drafter import DFlashDrafter
    from .dflash_runner import DFlashDraftRunner

    spec = config.speculative
    try:
        draft_runner = DFlashDraftRunner(
            **_head_runner_args(config, runner),
            target_dir=runner.model_path,
            cuda_graph_max_bs=config.cuda_graph.max_bs if config.cuda_graph.enabled else 0,
            block_width=int(spec.num_draft_tokens),
        )
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


def build_decoder(*, config: RuntimeConfig, runner, sampler: Sampler) -> SpeculativeDecoder:
    """The engine's entry point: a :class:`SpeculativeDecoder` for ``config``."""
    drafter, algorithm = build_drafter(config, runner, sampler)
    return SpeculativeDecoder(config, runner, sampler, drafter, algorithm=algorithm)
