"""Speculative decoding rules: the n-gram window and batch-size switches, the draft model
and its checkpoint format, and the shape of a draft (chain or tree, its steps and tokens)."""

from __future__ import annotations

from ..algorithms import chain_verify
from ..config import DRAFT_LOAD_FORMATS, RuntimeConfig, SpecAlgorithm, SpeculativeConfig, chain_draft_tokens
from .algorithms import TREE_ALGORITHMS, named, resolve_speculative
from .bounds import MINIMUM, tree_draft_tokens_limit
from .cel import CelRule, cel_list, words
from .fields import at_least, at_most, one_of
from .findings import Kind, Violation


def speculative(config: RuntimeConfig, effective: RuntimeConfig, note: str | None) -> list[Violation]:
    """Every speculative rule: the switches whatever the algorithm, then the draft and its shape."""
    spec = config.speculative
    requested = SpecAlgorithm(spec.algorithm)
    algorithm = SpecAlgorithm(effective.speculative.algorithm)
    out = _switches(spec)
    if requested is SpecAlgorithm.NONE:
        return out
    out += _draft_model(spec, requested, algorithm, note)
    out += _draft_shape_bounds(spec)
    out += _chain_or_tree(spec, algorithm, note)
    return out


NGRAM_WINDOW = CelRule(
    "!has(self.minMatch) || self.minMatch <= self.maxMatch",
    "ngram.minMatch must not exceed ngram.maxMatch",
    field_path=".minMatch",
    mirrors="ngram-window",
)
"""On a LoRAServe's spec.speculative.ngram."""


def _switches(spec: SpeculativeConfig) -> list[Violation]:
    """The n-gram window and the batch sizes that switch speculation, checked whatever the algorithm."""
    out: list[Violation] = []
    if not 1 <= spec.ngram_min <= spec.ngram_max:
        # Checked whatever the algorithm, as the CRD does: a window is never empty.
        out.append(
            Violation(
                "ngram-window",
                "speculative.ngram_min",
                f"the n-gram window {spec.ngram_min}..{spec.ngram_max} is empty",
                "set 1 <= {speculative.ngram_min} <= {speculative.ngram_max}",
                related=("speculative.ngram_max",),
            )
        )
    # Checked whatever the algorithm, as the CRD does; a nonzero value with NONE is harmless.
    out += at_least(
        "speculative.disable_batch_size", spec.disable_batch_size, "speculative-disable-batch-size"
    )
    out += at_least(
        "speculative.tree_max_batch_size", spec.tree_max_batch_size, "speculative-tree-max-batch-size"
    )
    return out


def _draft_model(
    spec: SpeculativeConfig, requested: SpecAlgorithm, algorithm: SpecAlgorithm, note: str | None
) -> list[Violation]:
    """The draft model an algorithm needs, its checkpoint format, and a token map it can use."""
    out: list[Violation] = []
    if requested.needs_draft_model and not spec.draft_model_path:
        out.append(
            Violation(
                "draft-required",
                "speculative.draft_model_path",
                f"{requested.value} drafts with a separate model and none is set",
                "set {speculative.draft_model_path} to the draft model",
                related=("speculative.algorithm",),
            )
        )
    out += one_of(
        "speculative.draft_load_format", spec.draft_load_format, DRAFT_LOAD_FORMATS, "draft-load-format"
    )
    if spec.draft_load_format == "pt":
        # Pickle checkpoints run arbitrary code on load; the runtime reads safetensors only.
        out.append(
            Violation(
                "draft-load-format-pickle",
                "speculative.draft_load_format",
                "pickle (.bin / .pt) draft checkpoints are refused: loading one can run arbitrary code",
                "convert the draft to safetensors and set {speculative.draft_load_format} to safetensors or auto",
                kind=Kind.UNAVAILABLE,
            )
        )
    if spec.token_map and not algorithm.is_eagle_family:
        out.append(
            Violation(
                "token-map-algorithm",
                "speculative.token_map",
                f"a token map selects rows of the target's lm_head for an EAGLE-family draft; "
                f"{named(algorithm, note)} drafts without the target's lm_head",
                "unset {speculative.token_map}, or use EAGLE or EAGLE3",
                related=("speculative.algorithm",),
            )
        )
    return out


_DRAFTED = [a for a in SpecAlgorithm if a.needs_draft_model]
DRAFT_REQUIRED = CelRule(
    f"!has(self.algorithm) || !(self.algorithm in {cel_list(_DRAFTED)}) || has(self.draftModel)",
    f"speculative.draftModel is required for algorithms {words(_DRAFTED)}",
    field_path=".draftModel",
    reason="FieldValueRequired",
    mirrors="draft-required",
)
"""On a LoRAServe's spec.speculative, as the rules below."""


def _draft_shape_bounds(spec: SpeculativeConfig) -> list[Violation]:
    """The draft's steps, branching and verified tokens within their bounds."""
    out: list[Violation] = []
    out += at_least("speculative.num_steps", spec.num_steps, "num-steps")
    out += at_least("speculative.top_k", spec.top_k, "top-k")
    out += at_least("speculative.num_draft_tokens", spec.num_draft_tokens, "num-draft-tokens")
    out += at_most("speculative.num_steps", spec.num_steps, "num-steps-max", "one draft forward per step")
    out += at_most("speculative.top_k", spec.top_k, "top-k-max", "each tree level scores top_k² nodes")
    out += at_most(
        "speculative.num_draft_tokens",
        spec.num_draft_tokens,
        "num-draft-tokens-max",
        "every request verifies that many rows each step",
    )
    return out


def _chain_or_tree(spec: SpeculativeConfig, algorithm: SpecAlgorithm, note: str | None) -> list[Violation]:
    """The verified tokens a chain or a tree holds, and a tree only where the algorithm grows one."""
    out: list[Violation] = []
    chain = chain_draft_tokens(spec.num_steps)
    # A block (DFLASH) is drafted in one forward: num_draft_tokens is the block, num_steps unused.
    chained = chain_verify(algorithm)
    if chained and spec.top_k == 1 and spec.num_steps >= 1 and spec.num_draft_tokens != chain:
        out.append(
            Violation(
                "chain-draft-tokens",
                "speculative.num_draft_tokens",
                f"with {{speculative.top_k}} 1 (a chain) each request verifies {{speculative.num_steps}} + 1 = "
                f"{chain} tokens, "
                f"got {spec.num_draft_tokens}",
                f"set {{speculative.num_draft_tokens}} to {chain} (or leave it unset)",
                related=("speculative.num_steps", "speculative.top_k"),
            )
        )
    if spec.top_k > 1 and spec.num_steps >= 1:
        most = tree_draft_tokens_limit(spec.top_k, spec.num_steps)
        width = spec.num_draft_tokens  # None: a DFLASH block the start-up reads (refused below as a tree)
        if width is not None and not MINIMUM["speculative.num_draft_tokens"] <= width <= most:
            out.append(
                Violation(
                    "tree-draft-tokens",
                    "speculative.num_draft_tokens",
                    f"a tree of {{speculative.top_k}} {spec.top_k} and {{speculative.num_steps}} {spec.num_steps} offers "
                    f"{most - 1} candidates, "
                    f"so at most {most} tokens can be verified, got {spec.num_draft_tokens}",
                    f"set {{speculative.num_draft_tokens}} between 2 and {most}",
                    related=("speculative.top_k", "speculative.num_steps"),
                )
            )
        if algorithm not in TREE_ALGORITHMS:
            out.append(
                Violation(
                    "tree-algorithm",
                    "speculative.top_k",
                    f"{named(algorithm, note)} drafts a chain, not a tree",
                    "set {speculative.top_k} to 1, or use STANDALONE, EAGLE or EAGLE3",
                    related=("speculative.algorithm",),
                )
            )
    return out


# The CEL rules of a chain's and a tree's shape, on a LoRAServe's spec.speculative. The API
# server judges the requested algorithm; NEXTN resolves to EAGLE, and a Gemma-4 assistant's
# refusals are the webhook's.
_UNCHAINED = [SpecAlgorithm.NONE, *(a for a in SpecAlgorithm if not chain_verify(a))]
_TREES = [a for a in SpecAlgorithm if a is SpecAlgorithm.NONE or resolve_speculative(a)[0] in TREE_ALGORITHMS]
CHAIN_DRAFT_TOKENS = CelRule(
    f"!has(self.algorithm) || self.algorithm in {cel_list(_UNCHAINED)} || self.topK != 1 || "
    "!has(self.numDraftTokens) || self.numDraftTokens == self.numSteps + 1",
    "numDraftTokens must equal numSteps + 1 when topK is 1 (a chain verifies its numSteps drafted tokens "
    "plus one; DFLASH: numDraftTokens is the block)",
    field_path=".numDraftTokens",
    mirrors="chain-draft-tokens",
)
TREE_DRAFT_TOKENS = CelRule(
    "!has(self.algorithm) || self.algorithm == 'NONE' || self.topK == 1 || !has(self.numDraftTokens) || "
    "self.numDraftTokens <= 1 + self.topK + (self.numSteps - 1) * self.topK * self.topK",
    "numDraftTokens must be at most 1 + topK + (numSteps - 1) * topK^2, the number of tree candidates plus one",
    field_path=".numDraftTokens",
    mirrors="tree-draft-tokens",
)
TREE_ALGORITHM = CelRule(
    f"!has(self.algorithm) || self.topK == 1 || self.algorithm in {cel_list(_TREES)}",
    f"topK > 1 (tree drafts) is only supported by {words(_TREES[1:])}; set topK: 1",
    field_path=".topK",
    mirrors="tree-algorithm",
)
