"""The speculative algorithms, each described once: one :class:`AlgorithmTraits` per
:class:`SpecAlgorithm` in :data:`ALGORITHMS`.

Everything that differs between algorithms and that the policy, the operator or the
runtime's draft factory asks about is a field here (whether a draft model is needed,
whether trees grow, how wide a verify is by default, what LoRA refuses and why, whether
this image implements it). Torch-free: the operator's image imports it.

Adding an algorithm: a member of :class:`SpecAlgorithm`, its entry in :data:`ALGORITHMS`
(``package`` names the runtime package whose ``build_drafter`` builds its drafter), that
package, and the CRD's ``speculative.algorithm`` enum.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class SpecAlgorithm(enum.StrEnum):
    """Speculative-decoding algorithms a LoRAServe may name (traits: :data:`ALGORITHMS`)."""

    NONE = "NONE"
    NGRAM = "NGRAM"
    STANDALONE = "STANDALONE"
    EAGLE = "EAGLE"
    EAGLE3 = "EAGLE3"
    NEXTN = "NEXTN"
    DFLASH = "DFLASH"
    DSPARK = "DSPARK"
    FROZEN_KV_MTP = "FROZEN_KV_MTP"

    @property
    def traits(self) -> AlgorithmTraits:
        """This algorithm's entry in :data:`ALGORITHMS`."""
        return ALGORITHMS[self]

    @property
    def is_eagle_family(self) -> bool:
        """EAGLE-family heads (one layer over the target's hidden states; token maps, head
        draft adapters)."""
        return ALGORITHMS[self].eagle_head

    @property
    def shares_target_embeddings(self) -> bool:
        """Drafts that read the target's BASE embeddings and lm_head (never an adapter's)."""
        return ALGORITHMS[self].shares_target_embeddings

    @property
    def needs_draft_model(self) -> bool:
        """Drafts with a separate model (``speculative.draft_model_path``)."""
        return ALGORITHMS[self].needs_draft_model


class VerifyWidth(enum.StrEnum):
    """Where ``speculative.num_draft_tokens`` (the verify width) comes from when it is unset."""

    CHAIN = "chain"
    """``num_steps + 1``: the last committed token plus one draft per step (a tree states it)."""
    CHECKPOINT_BLOCK = "checkpoint-block"
    """The draft checkpoint's block (drafted in one forward; ``num_steps`` unused): known
    only once the runtime reads the checkpoint at start-up."""


@dataclass(frozen=True)
class AlgorithmTraits:
    """What one speculative algorithm is, needs and refuses; read by the policy (webhook and
    start-up alike), the operator and the runtime's draft factory."""

    summary: str
    """One line: how it drafts."""
    needs_draft_model: bool = False
    """Drafts with a separate model: ``speculative.draft_model_path`` is required."""
    model_free: bool = False
    """Has no draft model at all (nothing a draft adapter could adapt)."""
    grows_trees: bool = False
    """May draft a tree (``top_k > 1``); others draft chains (compatibility)."""
    trees_implemented: bool = False
    """This image grows trees for it (greedy requests; sampled ones verify a chain)."""
    verify_width: VerifyWidth = VerifyWidth.CHAIN
    """Where the default ``num_draft_tokens`` comes from."""
    shares_target_embeddings: bool = False
    """Reads the target's BASE embeddings and lm_head (never an adapter's): an adapter on
    those modules lowers its accept rate."""
    eagle_head: bool = False
    """An EAGLE-family head: token maps apply, and head draft adapters wrap its ``fc`` too."""
    draft_adapters: bool = False
    """Its draft takes draft adapters in this image (a pool over the draft's own layers)."""
    moe_target: bool = False
    """Served on a mixture-of-experts target (it reads only the target's logits and hidden
    states, which MoE layers produce as a dense layer does)."""
    implemented: bool = False
    """This image runs it (else the policy reports it *unavailable*)."""
    unimplemented_reason: str | None = None
    """What the runtime lacks to run it (None: implemented, or judged as ``resolves_to``)."""
    lora_refusal: str | None = None
    """Why LoRA adapters cannot be served beside it (None: its adapter-free draft stays
    lossless for every adapter)."""
    lora_static_verify: bool = False
    """With LoRA it needs static ragged verify (per-request verify widths would break the
    uniform-width LoRA segment layout of target-verify)."""
    resolves_to: SpecAlgorithm | None = None
    """The algorithm it runs as (judged as that one; None: itself)."""
    package: str | None = None
    """The runtime package (``loraserve.runtime.speculative.<name>``) whose ``build_drafter``
    builds its drafter; None where this image builds none."""


_SPEC = "loraserve.runtime.speculative."

ALGORITHMS: dict[SpecAlgorithm, AlgorithmTraits] = {
    SpecAlgorithm.NONE: AlgorithmTraits(
        "plain decoding: no draft", model_free=True, moe_target=True, implemented=True
    ),
    SpecAlgorithm.NGRAM: AlgorithmTraits(
        "drafts by matching the request's last n-gram in its own tokens",
        model_free=True,
        moe_target=True,
        implemented=True,
        package=_SPEC + "ngram",
    ),
    SpecAlgorithm.STANDALONE: AlgorithmTraits(
        "a whole small model with the target's tokenizer drafts one token per step",
        needs_draft_model=True,
        grows_trees=True,
        draft_adapters=True,
        moe_target=True,
        implemented=True,
        package=_SPEC + "standalone",
    ),
    SpecAlgorithm.EAGLE: AlgorithmTraits(
        "one decoder layer over the target's last hidden state drafts one token per step",
        needs_draft_model=True,
        grows_trees=True,
        trees_implemented=True,
        shares_target_embeddings=True,
        eagle_head=True,
        draft_adapters=True,
        moe_target=True,
        implemented=True,
        package=_SPEC + "eagle",
    ),
    SpecAlgorithm.EAGLE3: AlgorithmTraits(
        "an EAGLE head over three of the target's layers, with its own draft vocabulary",
        needs_draft_model=True,
        grows_trees=True,
        trees_implemented=True,
        shares_target_embeddings=True,
        eagle_head=True,
        draft_adapters=True,
        moe_target=True,
        implemented=True,
        package=_SPEC + "eagle",
    ),
    SpecAlgorithm.NEXTN: AlgorithmTraits(
        "the model's own next-n head (from the target checkpoint unless a draft is named)",
        eagle_head=True,
        shares_target_embeddings=True,
        resolves_to=SpecAlgorithm.EAGLE,
    ),
    SpecAlgorithm.DFLASH: AlgorithmTraits(
        "a block-diffusion draft over the target's hidden states drafts a whole block in one forward",
        needs_draft_model=True,
        verify_width=VerifyWidth.CHECKPOINT_BLOCK,
        shares_target_embeddings=True,
        moe_target=True,
        implemented=True,
        package=_SPEC + "dflash",
    ),
    SpecAlgorithm.DSPARK: AlgorithmTraits(
        "a DFLASH backbone with a Markov head and a confidence head, verified with a width per request",
        needs_draft_model=True,
        lora_static_verify=True,
        unimplemented_reason=(
            "what a DSPARK draft (SpecForge's DSparkDraftModel: a DFLASH backbone plus two heads) needs beyond "
            "the DFLASH drafter: its Markov head (markov_w1 [vocab, r] and markov_w2 [vocab, r], a bias on each "
            "block position's logits from the token drafted before it, so a block is drafted position by "
            "position), its confidence head (an acceptance estimate per position that cuts each request's "
            "verify), and dynamic ragged verify (a verify width per request; target-verify here is uniform "
            "width k, which the batch's LoRA segment layout relies on)"
        ),
    ),
    SpecAlgorithm.FROZEN_KV_MTP: AlgorithmTraits(
        "a Gemma-4 assistant drafts over the target's frozen KV cache",
        unimplemented_reason=(
            "a drafter that attends over the target's KV cache without writing it, and the Gemma-4 "
            "model family (policy.families maps no Gemma4 architecture)"
        ),
        lora_refusal=(
            "its draft is not independent of the target's adapter (it reads the target's KV cache, which "
            "the adapter wrote), so one adapter-free draft cannot stay lossless for every adapter"
        ),
    ),
}
"""Every algorithm's traits, in :class:`SpecAlgorithm`'s order."""


def chain_verify(algorithm: SpecAlgorithm | str) -> bool:
    """Whether ``algorithm``'s default verify width is a chain's (``num_steps + 1``); judged
    as the algorithm it resolves to. An unknown name counts as a chain: the policy refuses
    the name itself."""
    if algorithm not in SpecAlgorithm.__members__.values():
        return True
    traits = ALGORITHMS[SpecAlgorithm(algorithm)]
    if traits.resolves_to is not None:
        traits = ALGORITHMS[traits.resolves_to]
    return traits.verify_width is VerifyWidth.CHAIN


def having(trait: str, *, resolved: bool = True) -> frozenset[SpecAlgorithm]:
    """The algorithms whose ``trait`` is true (with ``resolved``, only those judged as
    themselves: an algorithm that resolves to another is left out)."""
    return frozenset(
        a
        for a, t in ALGORITHMS.items()
        if getattr(t, trait) and not (resolved and t.resolves_to is not None)
    )
