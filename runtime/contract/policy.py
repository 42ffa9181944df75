"""The one compatibility policy: is a :class:`RuntimeConfig` servable, and as what?

Pure functions over the typed configuration, no I/O. The operator's admission webhook
calls them on a LoRAServe translated to a ``RuntimeConfig``; the runtime calls the same
functions at start-up. Each finding names a configuration field path
(``lora.max_rank``); callers render it under their own names (the webhook as
``spec.lora.maxRank``) with ``render(namer)``. Texts refer to other fields as
``{lora.max_rank}`` so that they are renamed too.

Every violation is collected (never stop at the first), with a reason, a fix and a kind:
``incompatible`` (no runtime will run it) or ``unavailable`` (this runtime image does not
implement it yet; see ``loraserve.runtime.contract.capabilities``).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .capabilities import CAPABILITIES, Capabilities
from .config import (
    ATTENTION_BACKENDS,
    DEFAULT_LORA_MODULES,
    DEVICES,
    DRAFT_LOAD_FORMATS,
    DTYPES,
    LORA_BACKENDS,
    LORA_MODULES,
    RaggedVerify,
    RuntimeConfig,
    SpecAlgorithm,
    chain_draft_tokens,
)

LORA_SPEC_ALGORITHMS: frozenset[SpecAlgorithm] = frozenset(
    {
        SpecAlgorithm.NONE,
        SpecAlgorithm.NGRAM,
        SpecAlgorithm.STANDALONE,
        SpecAlgorithm.EAGLE,
        SpecAlgorithm.EAGLE3,
        SpecAlgorithm.DFLASH,
        SpecAlgorithm.DSPARK,
    }
)
"""Effective algorithms whose adapter-free draft stays valid for every adapter."""

TREE_ALGORITHMS: frozenset[SpecAlgorithm] = frozenset(
    {SpecAlgorithm.STANDALONE, SpecAlgorithm.EAGLE, SpecAlgorithm.EAGLE3}
)
"""Effective algorithms that can draft a tree (``top_k > 1``)."""

FROZEN_KV_MTP_DRAFT_ARCHITECTURES: frozenset[str] = frozenset({"Gemma4AssistantForCausalLM"})
"""Draft architectures that run as FROZEN_KV_MTP when named under EAGLE or NEXTN."""

DRAFT_ADAPTER_ALGORITHMS: frozenset[SpecAlgorithm] = frozenset(
    {SpecAlgorithm.STANDALONE, SpecAlgorithm.EAGLE, SpecAlgorithm.EAGLE3}
)
"""Effective algorithms whose draft takes draft adapters in this runtime: a STANDALONE draft
(a whole model with its own adapter pool) and an EAGLE / EAGLE3 head (a pool over the
head's own linear layers; NEXTN resolves to EAGLE). DFLASH / DSPARK drafts and the
FROZEN_KV_MTP assistant take none in this version."""
NO_DRAFT_MODEL_ALGORITHMS: frozenset[SpecAlgorithm] = frozenset({SpecAlgorithm.NONE, SpecAlgorithm.NGRAM})
"""Algorithms with no draft model at all: nothing a draft adapter could adapt."""
DRAFT_LORA_MODULES: tuple[str, ...] = DEFAULT_LORA_MODULES
"""The modules of the draft's adapter pool (``SpeculativeConfig.draft_lora_pool``): never the
embeddings or lm_head."""
HEAD_DRAFT_LORA_MODULES: tuple[str, ...] = (*DRAFT_LORA_MODULES, "fc")
"""The modules of an EAGLE / EAGLE3 head's draft adapter pool: its decoder layer's
projections and the fc that fuses the target's features, as the head's checkpoint names
them. The embed_tokens / lm_head it shares with the target are never adapted."""
DRAFT_ADAPTER_MODULE_NAMES: tuple[str, ...] = (*LORA_MODULES, "fc")
"""Every module name an Adapter's ``spec.draft.targetModules`` may declare (the policy then
judges them against the serve's draft)."""


def draft_lora_modules(algorithm: SpecAlgorithm) -> tuple[str, ...]:
    """The modules the draft adapter pool of an ``algorithm`` serve (the effective one) wraps."""
    return HEAD_DRAFT_LORA_MODULES if algorithm.is_eagle_family else DRAFT_LORA_MODULES


MAX_DRAFT_LORAS = 64
"""The most draft adapter slots (``speculative.draft_max_loras``): each holds A and B at the
draft rank for every draft module, beside the target's slots."""

EMBEDDING_MODULES: tuple[str, ...] = ("embed_tokens", "lm_head")
LARGE_RANK = 256
MAX_LORA_RANK = 512
"""The largest ``lora.max_rank``: every GPU slot reserves A and B at this rank for every
target module (a rank-512 pool of an 8B model already holds ~0.3 GiB per slot)."""
MAX_NUM_STEPS = 32
"""The most draft forward passes per step: accept lengths fall with depth (a draft rarely
stays right 32 tokens in a row) while each step costs a forward."""
MAX_TOP_K = 16
"""The widest tree branching (a level scores top_k² candidates)."""
MAX_NUM_DRAFT_TOKENS = 256
"""The most tokens verified per request and step (a chain verifies num_steps + 1 ≤ 33; a
tree at most this many nodes): every decode request verifies that many rows."""
# Tree drafts verify num_draft_tokens rows per request; at 8 requests a 16-node tree was
# already slower than a chain on the H200 (bench/results/2026-12-04-spec-h200.md).
TREE_COSTLY_BATCH = 8

MINIMUM: dict[str, int] = {
    "model.context_length": 1,
    "parallel.tensor_parallel_size": 1,
    "scheduler.max_running_requests": 1,
    "scheduler.max_total_tokens": 1,
    "scheduler.chunked_prefill_size": 1,
    "scheduler.max_prefill_tokens": 1,
    "scheduler.max_admission_defer_steps": 0,
    "cuda_graph.max_bs": 1,
    "cuda_graph.max_prefill_tokens": 0,
    "lora.max_loras_per_batch": 1,
    "lora.max_loaded_loras": 1,
    "lora.max_rank": 1,
    "speculative.num_steps": 1,
    "speculative.top_k": 1,
    "speculative.num_draft_tokens": 2,
    "speculative.ngram_min": 1,
    "speculative.disable_batch_size": 0,
    "speculative.tree_max_batch_size": 0,
    "speculative.draft_max_loras": 0,
    "speculative.draft_max_lora_rank": 1,
}
"""The smallest value of each numeric field the policy bounds: the one statement of these
bounds (the operator's spec model takes them from here; a test holds the CRD's equal)."""
MAXIMUM: dict[str, int] = {
    "lora.max_rank": MAX_LORA_RANK,
    "speculative.num_steps": MAX_NUM_STEPS,
    "speculative.top_k": MAX_TOP_K,
    "speculative.num_draft_tokens": MAX_NUM_DRAFT_TOKENS,
    "speculative.draft_max_loras": MAX_DRAFT_LORAS,
    "speculative.draft_max_lora_rank": MAX_LORA_RANK,
}
"""The largest value of each numeric field the policy bounds above (as :data:`MINIMUM`)."""


def tree_draft_tokens_limit(top_k: int, num_steps: int) -> int:
    """The most tokens a tree of ``top_k`` over ``num_steps`` can verify per request: its
    root plus ``top_k`` first-level nodes plus ``top_k²`` candidates per further step."""
    return 1 + top_k + (num_steps - 1) * top_k**2

_FIELD_REF = re.compile(r"\{([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+)\}")


class Kind(enum.StrEnum):
    INCOMPATIBLE = "incompatible"
    UNAVAILABLE = "unavailable"


Namer = Callable[[str], str]


def _same(path: str) -> str:
    return path


def _fill(text: str, name: Namer) -> str:
    return _FIELD_REF.sub(lambda m: name(m.group(1)), text)


@dataclass(frozen=True)
class Violation:
    """A configuration the runtime refuses. ``field`` is the one to change; ``related``
    the other fields of the combination."""

    rule: str
    field: str
    reason: str
    fix: str
    kind: Kind = Kind.INCOMPATIBLE
    related: tuple[str, ...] = ()

    @property
    def fields(self) -> tuple[str, ...]:
        return (self.field, *self.related)

    def render(self, name: Namer = _same) -> str:
        """``<field>: <reason>; fix: <fix>`` with every field path passed through ``name``."""
        prefix = "not available in this runtime: " if self.kind is Kind.UNAVAILABLE else ""
        return f"{name(self.field)}: {prefix}{_fill(self.reason, name)}; fix: {_fill(self.fix, name)}"

    def __str__(self) -> str:
        return self.render()


@dataclass(frozen=True)
class PolicyWarning:
    """A legal configuration with a cost worth knowing."""

    rule: str
    field: str
    reason: str

    def render(self, name: Namer = _same) -> str:
        return f"{name(self.field)}: {_fill(self.reason, name)}"

    def __str__(self) -> str:
        return self.render()


@dataclass(frozen=True)
class Report:
    """Every violation and warning of one check, and the configuration that would run."""

    violations: tuple[Violation, ...]
    warnings: tuple[PolicyWarning, ...]
    effective: RuntimeConfig | None = None
    """The configuration after resolution (NEXTN as EAGLE...); None for adapter checks."""
    resolution: str | None = None
    """How the requested algorithm resolved, when it did (e.g. ``NEXTN resolves to EAGLE``)."""
    requested: SpecAlgorithm | None = None
    """The algorithm as configured, before resolution; None for adapter checks."""

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def incompatible(self) -> tuple[Violation, ...]:
        return tuple(v for v in self.violations if v.kind is Kind.INCOMPATIBLE)

    @property
    def unavailable(self) -> tuple[Violation, ...]:
        return tuple(v for v in self.violations if v.kind is Kind.UNAVAILABLE)

    def rules(self) -> set[str]:
        return {v.rule for v in self.violations}

    def warning_rules(self) -> set[str]:
        return {w.rule for w in self.warnings}

    def raise_for_violations(self) -> None:
        """Raise :class:`PolicyError` listing every violation, if there is any."""
        if self.violations:
            raise PolicyError(self)


class PolicyError(ValueError):
    """A configuration the policy refuses; the message lists every violation."""

    def __init__(self, report: Report) -> None:
        self.report = report
        super().__init__("; ".join(v.render() for v in report.violations))


@dataclass(frozen=True)
class DraftAdapterDeclaration:
    """An adapter's draft adapter (a LoRA for the serve's draft), as far as it is known."""

    rank: int | None = None
    target_modules: tuple[str, ...] | None = None


@dataclass(frozen=True)
class AdapterDeclaration:
    """What is known of an adapter before (or after) its file is read."""

    name: str
    rank: int | None = None
    target_modules: tuple[str, ...] | None = None
    pinned: bool = False
    draft: DraftAdapterDeclaration | None = None
    """Its draft adapter, when it names one (None: requests draft unadapted)."""


_HF_COMMIT = re.compile(r"[0-9a-f]{40}")


def check_source_revision(
    field: str,
    source: str | None,
    *,
    revision: str | None = None,
    sha256: str | None = None,
    revision_field: str | None = None,
) -> PolicyWarning | None:
    """A warning for an ``hf://`` source that is not pinned to a commit: without
    ``@<revision>`` (or a separate ``revision``) it follows the repository's main branch, so
    a new pod, a restart or a reload may fetch other weights than the running ones; a branch
    or tag can move too. None for other schemes and for a commit sha."""
    if not source or not source.startswith("hf://"):
        return None
    repo, _, pinned = source.partition("@")
    rev = pinned or revision
    if rev and _HF_COMMIT.fullmatch(rev):
        return None
    if not rev:
        effect = (
            "a change there makes the sha256 check fail, so new pods stop loading it"
            if sha256
            else "a new pod, a restart or a reload may fetch other weights than the running ones"
        )
        return PolicyWarning(
            "source-floating-revision",
            field,
            f"{source} names no revision, so it follows the repository's main branch: {effect}; "
            f"pin a commit: {repo}@<40-character commit sha>",
        )
    if not pinned and revision_field:
        return PolicyWarning(
            "source-floating-revision",
            revision_field,
            f"{rev!r} is a branch or tag, which can move: set it to a 40-character commit sha",
        )
    return PolicyWarning(
        "source-floating-revision",
        field,
        f"{source if pinned else f'{source} at revision {rev}'}: {rev!r} is a branch or tag, which can move; "
        f"pin a commit: {repo}@<40-character commit sha>",
    )


def source_path_problem(source: str | None) -> str | None:
    """Why a ``pvc://<claim>/<path>`` or absolute-path source would leave its volume, else None.

    The path after ``pvc://<claim>/`` must be relative and plain: no ``..`` segment, no
    empty segment (``//``) and no leading ``/`` (joined onto a mount path, an absolute tail
    replaces the mount). An absolute path may hold no ``..`` segment. One rule for the CRD
    (CEL), the webhook, the operator's path mapping and the runtime.
    """
    if not source:
        return None
    if source.startswith("pvc://"):
        claim, _, tail = source[len("pvc://") :].partition("/")
        segments = (tail[:-1] if tail.endswith("/") else tail).split("/")
        if tail.startswith("/"):
            why = "an absolute path after the claim"
        elif "" in segments:
            why = "an empty path segment ('//')"
        elif ".." in segments:
            why = "a '..' segment"
        else:
            return None
        return (
            f"{source!r} leaves the claim's mount ({why}); fix: write pvc://{claim or '<claim>'}/<relative path> "
            "with no '..', '//' or leading '/'"
        )
    if source.startswith("/") and ".." in source.split("/"):
        return f"{source!r} has a '..' segment; fix: write the absolute path without '..'"
    return None


def host_allowed(host: str, allowed: Iterable[str]) -> bool:
    """Whether ``host`` is one of ``allowed`` (``*.example.com``: any subdomain of example.com,
    not example.com itself); case and a trailing dot do not matter."""
    host = host.lower().rstrip(".")
    for entry in allowed:
        entry = entry.lower().rstrip(".")
        if entry.startswith("*.") and host.endswith(entry[1:]) and len(host) > len(entry) - 1:
            return True
        if host == entry:
            return True
    return False


# --------------------------------------------------------------------------- resolution


def resolve_speculative(
    requested: SpecAlgorithm | str, draft_architecture: str | None = None
) -> tuple[SpecAlgorithm, str | None]:
    """The algorithm that runs for ``requested`` with a draft of ``draft_architecture``,
    and a note saying how it was resolved (or None).

    NEXTN (a model's own next-n head) runs as EAGLE; EAGLE or NEXTN with a Gemma-4
    assistant draft runs as FROZEN_KV_MTP. Raises ``ValueError`` on an unknown name.
    """
    requested = SpecAlgorithm(requested)
    if (
        requested in (SpecAlgorithm.EAGLE, SpecAlgorithm.NEXTN)
        and draft_architecture in FROZEN_KV_MTP_DRAFT_ARCHITECTURES
    ):
        return SpecAlgorithm.FROZEN_KV_MTP, (
            f"{requested.value} with the Gemma-4 assistant draft {draft_architecture} resolves to FROZEN_KV_MTP"
        )
    if requested is SpecAlgorithm.NEXTN:
        return SpecAlgorithm.EAGLE, "NEXTN resolves to EAGLE"
    return requested, None


def resolve_algorithm(config: RuntimeConfig) -> tuple[SpecAlgorithm, str | None]:
    """The algorithm that actually runs for ``config``, and the resolution note (or None).

    ``speculative.draft_model_architecture`` must be known for the Gemma-4 case (the
    runtime reads it from the draft's config.json first).
    """
    spec = config.speculative
    return resolve_speculative(spec.algorithm, spec.draft_model_architecture)


def effective_config(config: RuntimeConfig) -> tuple[RuntimeConfig, str | None]:
    """A resolved copy of ``config`` (the input is never changed) and the resolution note."""
    algorithm, note = resolve_algorithm(config)
    effective = config.copy()
    if (
        SpecAlgorithm(config.speculative.algorithm) is SpecAlgorithm.NEXTN
        and not config.speculative.draft_model_path
    ):
        # NEXTN without a separate draft reads the next-n layers from the target checkpoint.
        effective.speculative.draft_model_path = config.model.path
    effective.speculative.algorithm = algorithm
    return effective, note


# --------------------------------------------------------------------------- the rules


def check_config(config: RuntimeConfig, capabilities: Capabilities = CAPABILITIES) -> Report:
    """Judge a whole runtime configuration: every violation, every warning, the effective form."""
    config, violations = _normalized(config)
    effective, note = effective_config(config)
    warnings: list[PolicyWarning] = []
    violations += _basic(config)
    violations += _speculative(config, effective, note)
    violations += _lora(config, effective, note, capabilities)
    violations += _cuda_graph(config)
    violations += _availability(config, effective, note, capabilities)
    violations += _draft_lora(config, effective, note)
    warnings += _warnings(config, effective)
    return Report(tuple(violations), tuple(warnings), effective, note, config.speculative.algorithm)


def _normalized(config: RuntimeConfig) -> tuple[RuntimeConfig, list[Violation]]:
    """Enum fields as enums (a configuration built from flags may hold plain strings);
    an unknown value is a violation, judged as the default for the remaining rules."""
    config = config.copy()
    spec = config.speculative
    out: list[Violation] = []
    try:
        spec.algorithm = SpecAlgorithm(spec.algorithm)
    except ValueError:
        out += _one_of(
            "speculative.algorithm", spec.algorithm, tuple(a.value for a in SpecAlgorithm), "algorithm"
        )
        spec.algorithm = SpecAlgorithm.NONE
    try:
        spec.ragged_verify = RaggedVerify(spec.ragged_verify)
    except ValueError:
        out += _one_of(
            "speculative.ragged_verify", spec.ragged_verify, tuple(r.value for r in RaggedVerify), "ragged"
        )
        spec.ragged_verify = RaggedVerify.STATIC
    return config, out


def _at_least(path: str, value: int | float | None, rule: str) -> Iterable[Violation]:
    minimum = MINIMUM[path]
    if value is not None and value < minimum:
        yield Violation(
            rule, path, f"must be at least {minimum}, got {value}", f"set {{{path}}} to {minimum} or more"
        )


def _at_most(path: str, value: int | None, rule: str, why: str) -> Iterable[Violation]:
    maximum = MAXIMUM[path]
    if value is not None and value > maximum:
        yield Violation(
            rule, path, f"must be at most {maximum}, got {value} ({why})", f"set {{{path}}} to {maximum} or less"
        )


def _one_of(path: str, value: object, allowed: tuple[str, ...], rule: str) -> Iterable[Violation]:
    plain = value.value if isinstance(value, enum.Enum) else value
    if plain not in allowed:
        yield Violation(rule, path, f"unknown value {plain!r}", f"use one of {', '.join(allowed)}")


def _basic(config: RuntimeConfig) -> list[Violation]:
    out: list[Violation] = []
    if not config.model.path:
        out.append(
            Violation("model-required", "model.path", "the base model is not set", "name the base model")
        )
    out += _one_of("model.dtype", config.model.dtype, DTYPES, "model-dtype")
    out += _at_least("model.context_length", config.model.context_length, "context-length")
    out += _at_least(
        "parallel.tensor_parallel_size", config.parallel.tensor_parallel_size, "tensor-parallel"
    )
    out += _one_of("device", config.device, DEVICES, "device")
    out += _one_of("attention_backend", config.attention_backend, ATTENTION_BACKENDS, "attention-backend")
    out += _at_least(
        "scheduler.max_running_requests", config.scheduler.max_running_requests, "max-running"
    )
    out += _at_least("scheduler.max_total_tokens", config.scheduler.max_total_tokens, "max-total-tokens")
    out += _at_least(
        "scheduler.chunked_prefill_size", config.scheduler.chunked_prefill_size, "chunked-prefill"
    )
    out += _at_least("scheduler.max_prefill_tokens", config.scheduler.max_prefill_tokens, "max-prefill")
    out += _at_least(
        "scheduler.max_admission_defer_steps",
        config.scheduler.max_admission_defer_steps,
        "max-admission-defer",
    )
    fraction = config.scheduler.kv_memory_fraction
    if not 0 < fraction <= 1:
        out.append(
            Violation(
                "kv-fraction",
                "scheduler.kv_memory_fraction",
                f"must be in (0, 1], got {fraction}",
                "set {scheduler.kv_memory_fraction} to a fraction such as 0.85",
            )
        )
    if not 1 <= config.server.port <= 65535:
        out.append(
            Violation("port", "server.port", f"must be a TCP port, got {config.server.port}", "use 1-65535")
        )
    out += _at_least("cuda_graph.max_bs", config.cuda_graph.max_bs, "cuda-graph-bs")
    if config.cuda_graph.max_prefill_tokens < MINIMUM["cuda_graph.max_prefill_tokens"]:
        out.append(
            Violation(
                "cuda-graph-prefill",
                "cuda_graph.max_prefill_tokens",
                f"must be at least 0, got {config.cuda_graph.max_prefill_tokens}",
                "set {cuda_graph.max_prefill_tokens} to 0 (prefills run eagerly) or to the longest single "
                "prefill chunk to replay from CUDA graphs, such as 512",
            )
        )
    if config.cuda_graph.enabled and config.device == "cpu":
        out.append(
            Violation(
                "cuda-graph-cpu",
                "cuda_graph.enabled",
                "CUDA graphs need a GPU and this configuration runs on CPU",
                "set {cuda_graph.enabled} to false, or run on a GPU",
                related=("device",),
            )
        )
    if config.attention_backend == "triton" and config.device == "cpu":
        out.append(
            Violation(
                "attention-triton-cpu",
                "attention_backend",
                "the paged Triton attention needs a GPU and this configuration runs on CPU",
                "set {attention_backend} to auto (SDPA on a CPU) or sdpa, or run on a GPU",
                related=("device",),
            )
        )
    lora = config.lora
    out += _at_least("lora.max_loras_per_batch", lora.max_loras_per_batch, "lora-slots")
    out += _at_least("lora.max_loaded_loras", lora.max_loaded_loras, "lora-cache")
    out += _at_least("lora.max_rank", lora.max_rank, "lora-rank")
    out += _at_most(
        "lora.max_rank", lora.max_rank, "lora-rank-max", "every slot reserves GPU memory for it"
    )
    if lora.max_loras_per_batch > lora.max_loaded_loras >= 1:
        out.append(
            Violation(
                "lora-slots-cache",
                "lora.max_loras_per_batch",
                f"{lora.max_loras_per_batch} GPU slots exceed the {lora.max_loaded_loras} adapters cached in host "
                "memory ({lora.max_loaded_loras}); every adapter on the GPU is also cached on the host",
                "lower {lora.max_loras_per_batch} or raise {lora.max_loaded_loras}",
                related=("lora.max_loaded_loras",),
            )
        )
    out += _modules("lora.target_modules", lora.target_modules, "lora-modules")
    out += _one_of("lora.backend", lora.backend, LORA_BACKENDS, "lora-backend")
    unknown_pinned = sorted(set(lora.pinned) - set(lora.adapters))
    if unknown_pinned:
        out.append(
            Violation(
                "lora-pinned-unknown",
                "lora.pinned",
                f"pinned adapters {', '.join(unknown_pinned)} are not loaded",
                "pin only adapters listed in {lora.adapters}",
                related=("lora.adapters",),
            )
        )
    if len(set(lora.pinned)) > lora.max_loras_per_batch:
        out.append(
            Violation(
                "lora-pinned-slots",
                "lora.pinned",
                f"{len(set(lora.pinned))} pinned adapters need more GPU slots than {{lora.max_loras_per_batch}} "
                f"({lora.max_loras_per_batch})",
                "pin fewer adapters or raise {lora.max_loras_per_batch}",
                related=("lora.max_loras_per_batch",),
            )
        )
    if len(lora.adapters) > lora.max_loaded_loras:
        out.append(
            Violation(
                "lora-preload-cache",
                "lora.adapters",
                f"{len(lora.adapters)} start-up adapters exceed the host cache {{lora.max_loaded_loras}} "
                f"({lora.max_loaded_loras})",
                "load fewer adapters at start-up or raise {lora.max_loaded_loras}",
                related=("lora.max_loaded_loras",),
            )
        )
    return out


def _modules(
    path: str, modules: Iterable[str], rule: str, *, known: tuple[str, ...] = LORA_MODULES
) -> list[Violation]:
    modules = tuple(modules)
    out: list[Violation] = []
    if not modules:
        out.append(Violation(rule, path, "no target modules", f"list at least one of {', '.join(known)}"))
    unknown = sorted(set(modules) - set(known))
    if unknown:
        out.append(
            Violation(
                rule,
                path,
                f"unknown modules {', '.join(unknown)}",
                f"use modules from {', '.join(known)}",
            )
        )
    if len(set(modules)) != len(modules):
        out.append(Violation(rule, path, "a module is listed twice", "list each module once"))
    return out


def _speculative(config: RuntimeConfig, effective: RuntimeConfig, note: str | None) -> list[Violation]:
    spec = config.speculative
    requested = SpecAlgorithm(spec.algorithm)
    algorithm = SpecAlgorithm(effective.speculative.algorithm)
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
    out += _at_least(
        "speculative.disable_batch_size", spec.disable_batch_size, "speculative-disable-batch-size"
    )
    out += _at_least(
        "speculative.tree_max_batch_size", spec.tree_max_batch_size, "speculative-tree-max-batch-size"
    )
    if requested is SpecAlgorithm.NONE:
        return out
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
    out += _one_of(
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
                f"{_named(algorithm, note)} drafts without the target's lm_head",
                "unset {speculative.token_map}, or use EAGLE or EAGLE3",
                related=("speculative.algorithm",),
            )
        )
    out += _at_least("speculative.num_steps", spec.num_steps, "num-steps")
    out += _at_least("speculative.top_k", spec.top_k, "top-k")
    out += _at_least("speculative.num_draft_tokens", spec.num_draft_tokens, "num-draft-tokens")
    out += _at_most(
        "speculative.num_steps", spec.num_steps, "num-steps-max", "one draft forward per step"
    )
    out += _at_most("speculative.top_k", spec.top_k, "top-k-max", "each tree level scores top_k² nodes")
    out += _at_most(
        "speculative.num_draft_tokens",
        spec.num_draft_tokens,
        "num-draft-tokens-max",
        "every request verifies that many rows each step",
    )
    chain = chain_draft_tokens(spec.num_steps)
    # A DFLASH block is drafted in one forward: num_draft_tokens is the block, num_steps unused.
    chained = algorithm is not SpecAlgorithm.DFLASH
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
        if not MINIMUM["speculative.num_draft_tokens"] <= spec.num_draft_tokens <= most:
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
                    f"{_named(algorithm, note)} drafts a chain, not a tree",
                    "set {speculative.top_k} to 1, or use STANDALONE, EAGLE or EAGLE3",
                    related=("speculative.algorithm",),
                )
            )
    return out


def _named(algorithm: SpecAlgorithm, note: str | None) -> str:
    return f"{algorithm.value} ({note})" if note else algorithm.value


def _lora(
    config: RuntimeConfig, effective: RuntimeConfig, note: str | None, caps: Capabilities
) -> list[Violation]:
    if not config.lora.enabled:
        return []
    spec = config.speculative
    algorithm = SpecAlgorithm(effective.speculative.algorithm)
    out: list[Violation] = []
    if algorithm not in LORA_SPEC_ALGORITHMS:
        allowed = ", ".join(a.value for a in sorted(LORA_SPEC_ALGORITHMS - {SpecAlgorithm.NONE}, key=_order))
        out.append(
            Violation(
                "lora-algorithm",
                "speculative.algorithm",
                f"LoRA adapters cannot be served with speculative algorithm {_named(algorithm, note)}: its draft is "
                "not independent of the target's adapter, so one adapter-free draft cannot stay lossless for "
                "every adapter",
                f"use one of {allowed} (or NONE), or set {{lora.enabled}} to false",
                related=("lora.enabled", "speculative.draft_model_architecture")
                if note
                else ("lora.enabled",),
            )
        )
    if algorithm is SpecAlgorithm.DSPARK and spec.ragged_verify is RaggedVerify.DYNAMIC:
        out.append(
            Violation(
                "lora-dspark-ragged",
                "speculative.ragged_verify",
                "DSPARK with LoRA needs static ragged verify: per-request verify lengths break the uniform-width "
                "LoRA segment layout of target-verify",
                "set {speculative.ragged_verify} to static",
                related=("speculative.algorithm", "lora.enabled"),
            )
        )
    if spec.adaptive and algorithm is not SpecAlgorithm.NONE and not caps.lora_graph_width_rebuild:
        out.append(
            Violation(
                "lora-adaptive",
                "speculative.adaptive",
                "adaptive speculation changes the verify width at run time, and the runtime cannot rebuild its "
                "LoRA graph metadata on a width change",
                "set {speculative.adaptive} to false, or {lora.enabled} to false",
                related=("lora.enabled",),
            )
        )
    if config.scheduler.overlap_schedule:
        out.append(
            Violation(
                "lora-overlap-schedule",
                "scheduler.overlap_schedule",
                "the overlap schedule prepares the next batch's adapter slots unordered against the forward in "
                "flight, which may still read them",
                "set {scheduler.overlap_schedule} to false, or {lora.enabled} to false",
                related=("lora.enabled",),
            )
        )
    if config.scheduler.two_batch_overlap:
        out.append(
            Violation(
                "lora-two-batch-overlap",
                "scheduler.two_batch_overlap",
                "two-batch overlap splits a batch into micro-batches that the LoRA segment metadata does not follow",
                "set {scheduler.two_batch_overlap} to false, or {lora.enabled} to false",
                related=("lora.enabled",),
            )
        )
    if config.lora.overlap_loading:
        out.append(
            Violation(
                "lora-overlap-loading",
                "lora.overlap_loading",
                "overlapped adapter loading fails silently: a batch can run before its adapter's weights land",
                "set {lora.overlap_loading} to false",
                related=("lora.enabled",),
            )
        )
    return out


def _cuda_graph(config: RuntimeConfig) -> list[Violation]:
    spec = config.speculative
    if not config.cuda_graph.enabled or SpecAlgorithm(spec.algorithm) is SpecAlgorithm.NONE:
        return []
    out: list[Violation] = []
    if spec.ragged_verify is RaggedVerify.DYNAMIC:
        out.append(
            Violation(
                "cuda-graph-ragged",
                "cuda_graph.enabled",
                "CUDA graphs are captured for one verify width, and dynamic ragged verify gives each request its own",
                "set {cuda_graph.enabled} to false or {speculative.ragged_verify} to static",
                related=("speculative.ragged_verify",),
            )
        )
    if spec.adaptive:
        out.append(
            Violation(
                "cuda-graph-adaptive",
                "cuda_graph.enabled",
                "CUDA graphs are captured for one verify width, and adaptive speculation changes it at run time",
                "set {cuda_graph.enabled} to false or {speculative.adaptive} to false",
                related=("speculative.adaptive",),
            )
        )
    return out


def _availability(
    config: RuntimeConfig, effective: RuntimeConfig, note: str | None, caps: Capabilities
) -> list[Violation]:
    spec = config.speculative
    algorithm = SpecAlgorithm(effective.speculative.algorithm)
    out: list[Violation] = []
    if not caps.implements(algorithm):
        implemented = ", ".join(a.value for a in sorted(caps.algorithms, key=_order)) or "none"
        out.append(
            Violation(
                "algorithm-unavailable",
                "speculative.algorithm",
                f"speculative algorithm {_named(algorithm, note)}; this image implements {implemented}",
                "choose an implemented algorithm, or upgrade the runtime image",
                kind=Kind.UNAVAILABLE,
            )
        )
    if (
        algorithm in TREE_ALGORITHMS
        and spec.top_k > 1
        and algorithm not in caps.tree_algorithms
    ):
        trees = ", ".join(a.value for a in sorted(caps.tree_algorithms, key=_order)) or "no algorithm"
        out.append(
            Violation(
                "tree-unavailable",
                "speculative.top_k",
                f"tree drafts ({{speculative.top_k}} > 1) with {_named(algorithm, note)}; this image grows "
                f"trees for {trees}",
                "set {speculative.top_k} to 1 (a chain draft)",
                kind=Kind.UNAVAILABLE,
            )
        )
    if algorithm is not SpecAlgorithm.NONE and spec.top_k > 1 and config.parallel.tensor_parallel_size > 1:
        out.append(
            Violation(
                "tree-tensor-parallel",
                "speculative.top_k",
                "tree drafts ({speculative.top_k} > 1) with tensor parallelism",
                "set {speculative.top_k} to 1 (a chain draft), or {parallel.tensor_parallel_size} to 1",
                related=("parallel.tensor_parallel_size",),
                kind=Kind.UNAVAILABLE,
            )
        )
    if (
        algorithm is not SpecAlgorithm.NONE
        and spec.ragged_verify is RaggedVerify.DYNAMIC
        and not caps.dynamic_ragged_verify
    ):
        out.append(
            Violation(
                "ragged-unavailable",
                "speculative.ragged_verify",
                "dynamic ragged verify",
                "set {speculative.ragged_verify} to static",
                kind=Kind.UNAVAILABLE,
            )
        )
    return out


def _draft_lora(config: RuntimeConfig, effective: RuntimeConfig, note: str | None) -> list[Violation]:
    """The draft adapter pool (``speculative.draft_max_loras`` / ``draft_max_lora_rank``).

    A pool serves STANDALONE drafts and EAGLE / EAGLE3 heads. On a serve whose draft is a
    DFLASH / DSPARK draft or the FROZEN_KV_MTP assistant it is refused (not available yet):
    those drafts would run unadapted while the serve's Adapters name draft adapters for
    them. NONE / NGRAM have no draft at all, so a pool there is only a warning
    (``_warnings``), as a draft model named for NGRAM is.
    """
    spec = config.speculative
    out: list[Violation] = []
    out += _at_least("speculative.draft_max_loras", spec.draft_max_loras, "draft-lora-slots")
    out += _at_most(
        "speculative.draft_max_loras", spec.draft_max_loras, "draft-lora-slots-max", "each slot reserves GPU memory"
    )
    out += _at_least("speculative.draft_max_lora_rank", spec.draft_max_lora_rank, "draft-lora-rank")
    out += _at_most(
        "speculative.draft_max_lora_rank",
        spec.draft_max_lora_rank,
        "draft-lora-rank-max",
        "every draft slot reserves GPU memory for it",
    )
    algorithm = SpecAlgorithm(effective.speculative.algorithm)
    if spec.draft_max_loras <= 0 or algorithm in NO_DRAFT_MODEL_ALGORITHMS:
        return out
    if algorithm not in DRAFT_ADAPTER_ALGORITHMS:
        out.append(
            Violation(
                "draft-lora-algorithm",
                "speculative.draft_max_loras",
                f"a draft adapter pool for the {_named(algorithm, note)} draft: {_NO_DRAFT_ADAPTERS}",
                "set {speculative.draft_max_loras} to 0, or draft with STANDALONE, EAGLE or EAGLE3",
                related=("speculative.algorithm",),
                kind=Kind.UNAVAILABLE,
            )
        )
    if config.lora.enabled and spec.draft_max_loras > config.lora.max_loaded_loras >= 1:
        out.append(
            Violation(
                "draft-lora-slots-cache",
                "speculative.draft_max_loras",
                f"{spec.draft_max_loras} draft adapter slots exceed the {config.lora.max_loaded_loras} adapters "
                "cached in host memory ({lora.max_loaded_loras}); a draft adapter is cached beside its adapter",
                "lower {speculative.draft_max_loras} or raise {lora.max_loaded_loras}",
                related=("lora.max_loaded_loras",),
            )
        )
    return out


def _order(algorithm: SpecAlgorithm) -> int:
    return list(SpecAlgorithm).index(algorithm)


def _warnings(config: RuntimeConfig, effective: RuntimeConfig) -> list[PolicyWarning]:
    spec = config.speculative
    requested = SpecAlgorithm(spec.algorithm)
    algorithm = SpecAlgorithm(effective.speculative.algorithm)
    out: list[PolicyWarning] = []
    if config.lora.enabled and algorithm.is_eagle_family:
        touched = [m for m in EMBEDDING_MODULES if m in config.lora.target_modules]
        if touched:
            out.append(
                PolicyWarning(
                    "eagle-embeddings",
                    "lora.target_modules",
                    f"adapters may change {' and '.join(touched)}, but the shared {algorithm.value} draft uses the "
                    "base model's; the accept rate drops for such adapters (output is unaffected)",
                )
            )
    if config.lora.enabled and config.lora.max_rank > LARGE_RANK:
        out.append(
            PolicyWarning(
                "large-rank",
                "lora.max_rank",
                f"max rank {config.lora.max_rank} reserves GPU memory for that rank in every one of the "
                f"{config.lora.max_loras_per_batch} slots, whatever the adapters' own ranks",
            )
        )
    if requested in (SpecAlgorithm.NONE, SpecAlgorithm.NGRAM) and spec.draft_model_path:
        out.append(
            PolicyWarning(
                "draft-ignored",
                "speculative.draft_model_path",
                f"{requested.value} uses no draft model; it is ignored",
            )
        )
    if spec.draft_max_loras > 0 and requested in NO_DRAFT_MODEL_ALGORITHMS:
        out.append(
            PolicyWarning(
                "draft-lora-ignored",
                "speculative.draft_max_loras",
                _no_draft_model(requested) + "; the draft adapter pool is ignored",
            )
        )
    elif spec.draft_max_loras > 0 and not config.lora.enabled:
        out.append(
            PolicyWarning(
                "draft-lora-ignored",
                "speculative.draft_max_loras",
                "draft adapters come with adapters, and {lora.enabled} is false; the draft adapter pool is ignored",
            )
        )
    if requested is SpecAlgorithm.NONE and spec.token_map:
        out.append(
            PolicyWarning("token-map-ignored", "speculative.token_map", "ignored without speculative decoding")
        )
    if requested is SpecAlgorithm.NONE and spec.adaptive:
        out.append(
            PolicyWarning("adaptive-ignored", "speculative.adaptive", "ignored without speculative decoding")
        )
    if requested is not SpecAlgorithm.NONE and spec.disable_batch_size > config.scheduler.max_running_requests:
        out.append(
            PolicyWarning(
                "disable-batch-size-unreachable",
                "speculative.disable_batch_size",
                f"{spec.disable_batch_size} is above {{scheduler.max_running_requests}} "
                f"({config.scheduler.max_running_requests}): no step is that large, so every step drafts",
            )
        )
    tree_batches = spec.tree_max_batch_size or config.scheduler.max_running_requests
    if requested is not SpecAlgorithm.NONE and spec.top_k > 1 and tree_batches >= TREE_COSTLY_BATCH:
        out.append(
            PolicyWarning(
                "tree-large-batches",
                "speculative.tree_max_batch_size",
                f"tree drafts verify {{speculative.num_draft_tokens}} ({spec.num_draft_tokens}) rows per request in "
                f"steps of up to {tree_batches} requests; from {TREE_COSTLY_BATCH} requests on a chain was faster "
                "in the benchmark: set {speculative.tree_max_batch_size} to the batch size where trees stop paying",
            )
        )
    if requested is not SpecAlgorithm.NONE and spec.tree_max_batch_size and spec.top_k == 1:
        out.append(
            PolicyWarning(
                "tree-batch-size-ignored",
                "speculative.tree_max_batch_size",
                "only tree drafts ({speculative.top_k} > 1) switch to chains by batch size; with top_k 1 it is ignored",
            )
        )
    if requested is SpecAlgorithm.NONE and (spec.disable_batch_size or spec.auto_disable):
        field = "speculative.auto_disable" if spec.auto_disable else "speculative.disable_batch_size"
        out.append(PolicyWarning("spec-switch-ignored", field, "ignored without speculative decoding"))
    if not config.lora.enabled and config.lora.overlap_loading:
        out.append(
            PolicyWarning("overlap-loading-ignored", "lora.overlap_loading", "ignored with LoRA disabled")
        )
    if config.attention_backend == "sdpa" and config.device == "cuda":
        out.append(
            PolicyWarning(
                "attention-sdpa-gpu",
                "attention_backend",
                "sdpa gathers each request's whole context into a padded block for every layer; on an H200 the "
                "paged Triton kernel decoded 1.2x (1 request) to 3.4x (64) faster at a 512-token context and "
                "2.6-4.0x at 4096: set {attention_backend} to auto",
            )
        )
    if config.cuda_graph.enabled and config.cuda_graph.max_bs < config.scheduler.max_running_requests:
        out.append(
            PolicyWarning(
                "cuda-graph-partial",
                "cuda_graph.max_bs",
                f"batches above {config.cuda_graph.max_bs} requests run without CUDA graphs "
                f"({{scheduler.max_running_requests}} is {config.scheduler.max_running_requests})",
            )
        )
    return out


# --------------------------------------------------------------------------- adapters


def check_adapter(
    config: RuntimeConfig,
    adapter: AdapterDeclaration,
    *,
    other_pinned: int = 0,
) -> Report:
    """Judge one adapter against the serve configuration it is meant for.

    ``other_pinned``: how many other adapters of the same serve are pinned. Field paths
    of the adapter are ``adapter.name``, ``adapter.serve``, ``adapter.rank``,
    ``adapter.target_modules``, ``adapter.pinned`` and, for its draft adapter,
    ``adapter.draft``, ``adapter.draft.rank`` and ``adapter.draft.target_modules``; the
    serve's are the configuration's own.
    """
    effective, note = effective_config(config)
    algorithm = SpecAlgorithm(effective.speculative.algorithm)
    lora = config.lora
    violations: list[Violation] = []
    warnings: list[PolicyWarning] = []
    if not lora.enabled:
        violations.append(
            Violation(
                "adapter-lora-disabled",
                "adapter.serve",
                "the serve has LoRA disabled",
                "set {lora.enabled} to true, or serve this adapter elsewhere",
                related=("lora.enabled",),
            )
        )
    if config.model.served_name and adapter.name == config.model.served_name:
        violations.append(
            Violation(
                "adapter-name-clash",
                "adapter.name",
                f"{adapter.name!r} is the base model's served name, so requests could not tell them apart",
                "rename the adapter, or change {model.served_name}",
                related=("model.served_name",),
            )
        )
    if adapter.rank is not None:
        if adapter.rank < 1:
            violations.append(
                Violation(
                    "adapter-rank",
                    "adapter.rank",
                    f"must be at least 1, got {adapter.rank}",
                    "use the adapter's rank",
                )
            )
        elif adapter.rank > lora.max_rank:
            violations.append(
                Violation(
                    "adapter-rank-too-large",
                    "adapter.rank",
                    f"rank {adapter.rank} exceeds {{lora.max_rank}} ({lora.max_rank})",
                    f"raise {{lora.max_rank}} to at least {adapter.rank}, or use a lower-rank adapter",
                    related=("lora.max_rank",),
                )
            )
    if adapter.target_modules is not None:
        modules = tuple(adapter.target_modules)
        violations += _modules("adapter.target_modules", modules, "adapter-modules")
        missing = [m for m in dict.fromkeys(modules) if m in LORA_MODULES and m not in lora.target_modules]
        if missing:
            violations.append(
                Violation(
                    "adapter-modules-not-served",
                    "adapter.target_modules",
                    f"targets {', '.join(missing)}, which {{lora.target_modules}} "
                    f"({', '.join(lora.target_modules)}) does not wrap",
                    f"add {', '.join(missing)} to {{lora.target_modules}}, or retrain without them",
                    related=("lora.target_modules",),
                )
            )
        touched = [m for m in EMBEDDING_MODULES if m in modules]
        if touched and algorithm.is_eagle_family:
            warnings.append(
                PolicyWarning(
                    "adapter-eagle-embeddings",
                    "adapter.target_modules",
                    f"this adapter changes {' and '.join(touched)}, but the shared {algorithm.value} draft uses the "
                    "base model's; its accept rate drops (output is unaffected)",
                )
            )
    violations += _draft_adapter(config, adapter.draft, algorithm, note)
    if adapter.pinned:
        pinned = other_pinned + 1
        if pinned > lora.max_loras_per_batch:
            violations.append(
                Violation(
                    "adapter-pinned-slots",
                    "adapter.pinned",
                    f"{pinned} pinned adapters would need more GPU slots than {{lora.max_loras_per_batch}} "
                    f"({lora.max_loras_per_batch})",
                    "unpin an adapter, or raise {lora.max_loras_per_batch}",
                    related=("lora.max_loras_per_batch",),
                )
            )
        elif pinned == lora.max_loras_per_batch:
            warnings.append(
                PolicyWarning(
                    "adapter-pinned-all-slots",
                    "adapter.pinned",
                    f"pinned adapters now hold all {lora.max_loras_per_batch} GPU slots ({{lora.max_loras_per_batch}}); "
                    "requests for unpinned adapters will wait",
                )
            )
    return Report(tuple(violations), tuple(warnings))


def _no_draft_model(algorithm: SpecAlgorithm) -> str:
    """Why a serve of ``algorithm`` (NONE or NGRAM) has nothing a draft adapter could adapt."""
    if algorithm is SpecAlgorithm.NGRAM:
        return "NGRAM drafts from the prompt: there is no draft model to adapt"
    return "the serve does not speculate ({speculative.algorithm} NONE): there is no draft model to adapt"


_NO_DRAFT_ADAPTERS = (
    "draft adapters serve STANDALONE drafts and EAGLE / EAGLE3 heads in this version (this draft's layers "
    "have no draft adapter pool)"
)


def _draft_adapter(
    config: RuntimeConfig,
    draft: DraftAdapterDeclaration | None,
    algorithm: SpecAlgorithm,
    note: str | None,
) -> list[Violation]:
    """An adapter's draft adapter against the serve's draft (``algorithm`` is the effective one).

    The draft adapter only changes what is proposed, never the output (the target verifies
    with the adapter itself), but a draft adapter the serve cannot load fails its Adapter's
    load, all or nothing: so every misfit is refused here, with the fix.
    """
    if draft is None:
        return []
    spec = config.speculative
    if algorithm in NO_DRAFT_MODEL_ALGORITHMS:
        return [
            Violation(
                "adapter-draft-no-draft-model",
                "adapter.draft",
                _no_draft_model(algorithm),
                "remove {adapter.draft}, or serve the adapter from a STANDALONE, EAGLE or EAGLE3 serve",
                related=("speculative.algorithm",),
            )
        ]
    if algorithm not in DRAFT_ADAPTER_ALGORITHMS:
        return [
            Violation(
                "adapter-draft-algorithm",
                "adapter.draft",
                f"the serve's {_named(algorithm, note)} draft cannot take adapters: {_NO_DRAFT_ADAPTERS}",
                "remove {adapter.draft}, or serve the adapter from a STANDALONE, EAGLE or EAGLE3 serve",
                related=("speculative.algorithm",),
                kind=Kind.UNAVAILABLE,
            )
        ]
    out: list[Violation] = []
    if spec.draft_max_loras <= 0:
        out.append(
            Violation(
                "adapter-draft-no-pool",
                "adapter.draft",
                "the serve has no draft adapter pool ({speculative.draft_max_loras} is 0)",
                "set {speculative.draft_max_loras} to 1 or more (draft adapters per batch), or remove {adapter.draft}",
                related=("speculative.draft_max_loras",),
            )
        )
    if draft.rank is not None:
        if draft.rank < 1:
            out.append(
                Violation(
                    "adapter-draft-rank",
                    "adapter.draft.rank",
                    f"must be at least 1, got {draft.rank}",
                    "use the draft adapter's rank",
                )
            )
        elif draft.rank > spec.draft_max_lora_rank:
            out.append(
                Violation(
                    "adapter-draft-rank-too-large",
                    "adapter.draft.rank",
                    f"draft rank {draft.rank} exceeds {{speculative.draft_max_lora_rank}} ({spec.draft_max_lora_rank})",
                    f"raise {{speculative.draft_max_lora_rank}} to at least {draft.rank}, or use a lower-rank "
                    "draft adapter",
                    related=("speculative.draft_max_lora_rank",),
                )
            )
    if draft.target_modules is not None:
        out += _draft_modules(tuple(draft.target_modules), algorithm)
    return out


def _draft_modules(modules: tuple[str, ...], algorithm: SpecAlgorithm) -> list[Violation]:
    """Declared draft adapter modules against the pool of the serve's draft: a STANDALONE
    draft's linears, or an EAGLE head's (its layer's projections and its fc; the head
    shares the target's embed_tokens / lm_head, which stay unadapted)."""
    served = draft_lora_modules(algorithm)
    out = _modules("adapter.draft.target_modules", modules, "adapter-draft-modules", known=DRAFT_ADAPTER_MODULE_NAMES)
    outside = [m for m in dict.fromkeys(modules) if m in DRAFT_ADAPTER_MODULE_NAMES and m not in served]
    if not outside:
        return out
    if algorithm.is_eagle_family:
        why = (
            f"targets {', '.join(outside)}, which an {algorithm.value} head's draft adapter pool does not wrap "
            f"(it wraps {', '.join(served)}; the head shares the target's base embed_tokens and lm_head, "
            "which stay unadapted for every request)"
        )
    else:
        why = (
            f"targets {', '.join(outside)}, which the draft adapter pool does not wrap (it wraps "
            f"{', '.join(served)})"
        )
    out.append(
        Violation(
            "adapter-draft-modules-not-served",
            "adapter.draft.target_modules",
            why,
            f"retrain the draft adapter without {', '.join(outside)}",
        )
    )
    return out
