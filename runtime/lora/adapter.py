"""Read and validate a PEFT LoRA adapter directory against the base model and the pool.

Accepted: ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``,
``use_rslora``) plus ``adapter_model.safetensors``. Pickle weights are refused: loading
them can run arbitrary code. Whole copies of the base ``embed_tokens`` / ``lm_head``
(peft's ``save_embedding_layers``, "auto" by default) are compared with the served
model's weight and dropped when equal, refused when not; options that make the adapter
compute something other than ``W + s·B·A`` on the shared base (``modules_to_save``,
DoRA, layer replication, ...) are refused, naming the option. Every check runs before anything is handed to the
manager, so a rejected adapter leaves the pool untouched. On a mixture-of-experts base, LoRA on
the experts and the router is read in every layout peft writes (:mod:`.experts`). On Phi-3, whose
checkpoints fuse q/k/v (``qkv_proj``) and gate/up (``gate_up_proj``), a fused module's LoRA is
split into the slots of its parts: each part keeps the one ``A [r, in]`` and takes its rows of
``B`` (``B·A`` row-sliced is the part's delta exactly), at rank r. Qwen2-MoE's shared expert
(``mlp.shared_expert.gate_proj`` ...) is held under ``("shared_expert.gate_proj", layer)`` and
served by the gate_proj / up_proj / down_proj slots; its gate ``mlp.shared_expert_gate``
under ``("shared_expert_gate", layer)``, always slotted as the router is.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..contract.config import FUSED_PROJECTIONS, LORA_MODULES
from ..model.arch import ModelArchConfig
from ..model.moe import MIXTRAL_NAMES
from .errors import AdapterError
from .experts import ROUTER, check_patterns, declared_modules, is_moe_tensor, take_moe_weights

SHARED = "shared_expert."
"""The prefix of a Qwen2-MoE shared expert's modules among an adapter's weights."""
SHARED_GATE = "shared_expert_gate"
"""Qwen2-MoE's shared expert gate (a Linear H -> 1), slotted in every layer that has one."""
ALWAYS_SLOTTED = (ROUTER, SHARED_GATE)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")

_LAYER_RE = re.compile(
    r"^model\.layers\.(\d+)\.(?:self_attn|mlp)\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|qkv_proj|gate_up_proj)"
    r"\.lora_(A|B)(?:\.[A-Za-z0-9_-]+)?\.weight$"
)
_SHARED_RE = re.compile(
    r"^model\.layers\.(\d+)\.mlp\.(shared_expert\.(?:gate_proj|up_proj|down_proj)|shared_expert_gate)"
    r"\.lora_(A|B)(?:\.[A-Za-z0-9_-]+)?\.weight$"
)
_EMBED_RE = re.compile(r"^model\.embed_tokens\.lora_embedding_(A|B)(?:\.[A-Za-z0-9_-]+)?$")
_LM_HEAD_RE = re.compile(r"^lm_head\.lora_(A|B)(?:\.[A-Za-z0-9_-]+)?\.weight$")
_FULL_COPIES = {
    # peft's names for a whole base embedding / output weight saved beside the adapter
    # (save_embedding_layers=True, or "auto", the default, when the module is targeted):
    # ".base_layer.weight" when the module carries LoRA, the plain name when it does not.
    "model.embed_tokens.base_layer.weight": "embed_tokens",
    "lm_head.base_layer.weight": "lm_head",
    "model.embed_tokens.weight": "embed_tokens",
    "lm_head.weight": "lm_head",
}
_ATTN = {"q_proj", "k_proj", "v_proj", "o_proj"}
_TIED_PAIR = {"embed_tokens", "lm_head"}
# adapter_config.json options that change what the adapter computes beyond W + s·B·A on
# the shared base: served as a plain LoRA the output would silently differ from peft's.
_PLAIN = "a LoRA variant this runtime does not implement: retrain as a plain LoRA"
_UNSERVED_OPTIONS = (
    (
        "layer_replication",
        "the adapter is for a model whose layers peft replicated; the served model has no such layers: "
        "merge the adapter into that model and serve it as the base",
    ),
    (
        "alora_invocation_tokens",
        "activated LoRA (aLoRA) applies the adapter only after its invocation tokens, which this runtime "
        "does not implement: retrain as a plain LoRA",
    ),
    ("use_qalora", f"QA-LoRA pools lora_A's input by groups, {_PLAIN}"),
    (
        "target_parameters",
        "LoRA on parameters is served only for the experts of a mixture-of-experts base model: target modules instead",
    ),
    ("use_bdlora", _PLAIN),
    ("monteclora_config", _PLAIN),
    ("velora_config", _PLAIN),
    ("kasa_config", _PLAIN),
    ("arrow_config", "Arrow routing over several adapters is not supported: serve the adapters one by one"),
)
# init_lora_weights values whose training starts from modified base weights.
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq")


@dataclass
class AdapterWeights:
    """A validated adapter, on the host, in the model's dtype.

    ``weights[(module, layer)] = (A [r, in], B [out, r])`` for linear modules (``layer``
    is None for ``lm_head``); ``embed_tokens`` is stored as ``(A [vocab, r], B [hidden, r])``
    (PEFT's ``lora_embedding_A`` transposed, so a token's row is contiguous).
    """

    path: Path
    rank: int  # the slot rank: the largest module's (peft's fused MoE gate_up_proj may double r)
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    weights: dict[tuple[str, int | None], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    declared_rank: int | None = None  # adapter_config.json's r where it differs from ``rank``

    @property
    def scaling(self) -> float:
        rank = self.declared_rank or self.rank
        return self.alpha / math.sqrt(rank) if self.use_rslora else self.alpha / rank

    @property
    def num_bytes(self) -> int:
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values()
        )


def _fail(message: str, field: str) -> AdapterError:
    return AdapterError(message, field=field)


def _outside(message: str, field: str, modules: list[str]) -> AdapterError:
    """An adapter over ``modules``, which the pool does not wrap; ``outside`` lets a draft
    pool's caller replace the fix (a draft pool's modules are not ``lora.target_modules``)."""
    err = AdapterError(message, field=field)
    err.outside = tuple(modules)  # type: ignore[attr-defined]
    return err


def read_adapter_config(path: Path, *, moe: ModelArchConfig | None = None) -> dict:
    """Parse and sanity-check ``adapter_config.json``; returns the raw dict. ``moe``: the
    base model, when it is a mixture of experts (its expert options are judged by
    :mod:`.experts` instead)."""
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        # peft saves an adapter not named "default" in a folder of its name
        named = sorted(p.parent.name for p in path.glob(f"*/{CONFIG_FILE}")) if path.is_dir() else []
        hint = (
            f"; it holds peft adapters named {named}: give the folder of one, e.g. {str(path / named[0])!r}"
            if named
            else ""
        )
        raise _fail(
            f"{config_path} is missing: an adapter directory needs {CONFIG_FILE} and {WEIGHTS_FILE} "
            f"(as written by peft's save_pretrained){hint}",
            CONFIG_FILE,
        )
    try:
        raw = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _fail(
            f"{config_path} is not valid JSON ({exc}): rewrite it with peft's save_pretrained", CONFIG_FILE
        ) from exc
    if not isinstance(raw, dict):
        raise _fail(f"{config_path} must hold a JSON object", CONFIG_FILE)
    peft_type = raw.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise _fail(f"peft_type is {peft_type!r}: only LoRA adapters are served", "peft_type")
    for key, what in (
        ("use_dora", "DoRA adapters"),
        ("lora_bias", "LoRA bias terms"),
    ):
        if raw.get(key):
            raise _fail(f"{key} is set: {what} are not supported; retrain without {key}", key)
    if moe is not None:
        check_patterns(raw, moe)
    elif raw.get("target_parameters"):  # named before the rank_pattern peft writes beside it
        raise _fail(f"target_parameters={raw['target_parameters']!r}: {dict(_UNSERVED_OPTIONS)['target_parameters']}", "target_parameters")
    for key in ("rank_pattern", "alpha_pattern") if moe is None else ():
        if raw.get(key):
            raise _fail(
                f"{key} is set: per-module ranks/alphas are not supported; retrain with one r and lora_alpha",
                key,
            )
    saved_modules = raw.get("modules_to_save")
    if saved_modules:
        names = [saved_modules] if isinstance(saved_modules, str) else list(saved_modules)
        raise _fail(
            f"modules_to_save={names}: the adapter carries its own trained full copy of "
            f"{', '.join(map(str, names))}, which replaces the base model's for this adapter only; a base "
            "model shared by every adapter cannot serve that: retrain with those modules in target_modules "
            "(LoRA) instead of modules_to_save, or merge the adapter into the model and serve the merged "
            "model as the base",
            "modules_to_save",
        )
    for key, reason in _UNSERVED_OPTIONS:
        if raw.get(key) and not (moe is not None and key == "target_parameters"):
            raise _fail(f"{key}={raw[key]!r}: {reason}", key)
    init = raw.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise _fail(
            f"init_lora_weights={init!r} changes the base model's weights when training starts, so the adapter "
            "is only right on that changed base, not on the served one: convert it to a plain LoRA when saving "
            "(peft save_pretrained(..., path_initial_model_for_weight_conversion=...)) or serve the changed base",
            "init_lora_weights",
        )
    if raw.get("bias", "none") not in ("none", None):
        raise _fail(
            f"bias={raw['bias']!r}: trained bias terms are not supported; retrain with bias='none'", "bias"
        )
    if raw.get("trainable_token_indices"):
        raise _fail(
            "trainable_token_indices is set: trainable-token adapters are not supported",
            "trainable_token_indices",
        )
    return raw


def load_adapter(
    path: str | Path,
    *,
    arch: ModelArchConfig,
    max_rank: int,
    pool_modules: Iterable[str],
    dtype: torch.dtype,
    base_tensor: Callable[[str], torch.Tensor | None] | None = None,
) -> AdapterWeights:
    """Read and validate an adapter; raises :class:`AdapterError` naming the field/tensor.

    ``pool_modules``: the modules the slot pool has buffers for (``lora.target_modules``).
    ``base_tensor(module)`` returns the served model's whole ``embed_tokens``/``lm_head``
    weight: the full copies peft saves beside adapters of those modules
    (``save_embedding_layers``, "auto" by default) are compared with it and dropped when
    equal, refused when not.
    """
    path = Path(path)
    raw = read_adapter_config(adapter_dir(path, "adapter"), moe=arch if arch.moe is not None else None)
    pool = tuple(pool_modules)
    rank, alpha, use_rslora = read_scaling(raw, max_rank=max_rank, limit="lora.max_rank", what="adapter")
    moe_declared = declared_modules(raw, arch)

    declared = raw.get("target_modules")
    if isinstance(declared, list):
        names = [str(m).rsplit(".", 1)[-1] for m in declared]
        if arch.moe is not None:  # Mixtral's w1/w3/w2 and the router: read by declared_modules
            names = [n for n in names if n not in (*MIXTRAL_NAMES, ROUTER)]
        unknown = sorted(set(names) - set(LORA_MODULES))
        if unknown:
            raise _fail(
                f"target_modules has {unknown}, not a module of a Llama-family model: "
                f"adapters may target {list(LORA_MODULES)}",
                "target_modules",
            )
        outside = sorted((_slots(names, arch) | moe_declared) - set(pool) - set(ALWAYS_SLOTTED))
        if outside:
            raise _outside(
                f"target_modules {outside} are not in lora.target_modules {list(pool)}: add them to "
                "lora.target_modules or use an adapter without them",
                "target_modules",
                outside,
            )
    elif declared is not None and not isinstance(declared, str):
        raise _fail(
            f"target_modules must be a list of names or a pattern string, got {declared!r}", "target_modules"
        )
    # A pattern string (e.g. "all-linear" or a regex) is resolved from the tensors below.

    weights_path = path / WEIGHTS_FILE
    tensors = read_adapter_tensors(path, "adapter")

    # Full copies of the base embedding / lm_head first (a resized vocabulary is named as
    # such, before the LoRA shapes disagree): checked against the served weights, then dropped.
    for full_name in sorted(tensors):
        module = _FULL_COPIES.get(full_name.removeprefix("base_model.model."))
        if module is not None:
            _check_full_copy(full_name, tensors.pop(full_name), module, base_tensor)

    moe_tensors = {
        full.removeprefix("base_model.model."): (full, t)
        for full, t in tensors.items()
        if arch.moe is not None and is_moe_tensor(full.removeprefix("base_model.model."))
    }
    scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank
    moe_weights = take_moe_weights(moe_tensors, raw, arch, scaling=scaling, use_rslora=use_rslora, dtype=dtype)
    parts: dict[tuple[str, int | None], dict[str, torch.Tensor]] = {}
    for full_name, tensor in tensors.items():
        name = full_name.removeprefix("base_model.model.")
        if name in moe_tensors:
            continue
        key, which = _parse_name(full_name, name, arch)
        module = key[0]
        slot = slot_module(module)
        absent = [m for m in FUSED_PROJECTIONS.get(slot, (slot,)) if m not in pool and m not in ALWAYS_SLOTTED]
        if absent:
            raise _outside(
                f"tensor {full_name!r} adapts {module}, whose {', '.join(absent)} is not in lora.target_modules "
                f"{list(pool)}: add {', '.join(absent)} to lora.target_modules or use an adapter without it",
                full_name,
                absent,
            )
        parts.setdefault(key, {})[which] = tensor
    _split_fused(parts, arch, rank)
    for module, _ in moe_weights:
        if module != ROUTER and module not in pool:
            raise _outside(
                f"the adapter adapts the experts' {module}, which is not in lora.target_modules {list(pool)}: "
                f"add {module} to lora.target_modules or use an adapter without it",
                "target_modules",
                [module],
            )
    if not parts and not moe_weights:
        raise _fail(f"{weights_path} holds no LoRA tensors (lora_A / lora_B)", WEIGHTS_FILE)

    weights: dict[tuple[str, int | None], tuple[torch.Tensor, torch.Tensor]] = {}
    for key in sorted(parts, key=lambda k: (k[1] if k[1] is not None else -1, k[0])):
        module, layer = key
        pair = parts[key]
        where = module if layer is None else f"layer {layer} {module}"
        for which in ("A", "B"):
            if which not in pair:
                raise _fail(
                    f"{where} has lora_{'BA'[which == 'B']} but no lora_{which}: the file is incomplete",
                    where,
                )
        a, b = pair["A"], pair["B"]
        if module.startswith(SHARED) or module == SHARED_GATE:
            in_dim, out_dim = arch.shared_expert_dims(module.removeprefix(SHARED))
        else:
            in_dim, out_dim = arch.module_dims(module)
        if module == "embed_tokens":
            want_a, want_b = (rank, arch.vocab_size), (arch.hidden_size, rank)
        else:
            want_a, want_b = (rank, in_dim), (out_dim, rank)
        for which, tensor, want in (("A", a, want_a), ("B", b, want_b)):
            if tuple(tensor.shape) != want:
                raise _fail(
                    f"{where} lora_{which} has shape {tuple(tensor.shape)}, expected {want} for r={rank} on this "
                    "base model: the adapter was trained for a different base model or rank",
                    f"{where} lora_{which}",
                )
        if module == "embed_tokens":
            a = a.t()
        weights[key] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
    weights.update(moe_weights)
    order = (*LORA_MODULES, ROUTER)
    modules = tuple(sorted({slot_module(m) for m, _ in weights}, key=order.index))
    slot_rank = max(b.shape[-1] for _, b in weights.values())
    if slot_rank > max_rank:
        raise _fail(
            f"the adapter's fused expert gate_up_proj has rank {slot_rank} (peft fuses gate_proj and up_proj at "
            f"twice r={rank}), which exceeds lora.max_rank={max_rank}: raise lora.max_rank to at least {slot_rank}",
            "r",
        )
    if isinstance(declared, list) or moe_declared:
        names = set()
        if isinstance(declared, list):
            names = _slots([str(m).rsplit(".", 1)[-1] for m in declared], arch)
        names |= moe_declared
        if raw.get("ensure_weight_tying") and names & _TIED_PAIR:
            # peft ties the lm_head adapter to the embed_tokens one (or the reverse) on a model
            # with tied embeddings and saves both, declaring only one: each is served as saved.
            names |= _TIED_PAIR
        extra = sorted(set(modules) - names)
        if extra:
            raise _fail(
                f"the weights adapt {extra}, which target_modules does not declare: the config and weights disagree",
                "target_modules",
            )
    return AdapterWeights(
        path=path.resolve(),
        rank=max(rank, slot_rank),
        alpha=float(alpha),
        use_rslora=use_rslora,
        target_modules=modules,
        weights=weights,
        declared_rank=rank if slot_rank > rank else None,
    )


def slot_module(module: str) -> str:
    """The module name whose slot serves an adapter weight's ``module``: a Qwen2-MoE shared
    expert's ``shared_expert.gate_proj`` is served by the ``gate_proj`` slot."""
    return module.removeprefix(SHARED)


def _slots(names: Iterable[str], arch: ModelArchConfig) -> set[str]:
    """Declared module names as the slots that serve them: on Phi-3 a fused name is its parts."""
    if arch.family != "phi3":
        return set(names)
    return {slot for name in names for slot in FUSED_PROJECTIONS.get(name, (name,))}


def _split_fused(
    parts: dict[tuple[str, int | None], dict[str, torch.Tensor]], arch: ModelArchConfig, rank: int
) -> None:
    """Replace each fused module's ``{A, B}`` in ``parts`` by its parts' (Phi-3): the same A for
    every part, B cut into the parts' rows. Shapes are checked against the fused module's."""
    for key in [k for k in parts if k[0] in FUSED_PROJECTIONS]:
        fused, layer = key
        pair = parts.pop(key)
        where = f"layer {layer} {fused}"
        for which in ("A", "B"):
            if which not in pair:
                raise _fail(
                    f"{where} has lora_{'BA'[which == 'B']} but no lora_{which}: the file is incomplete",
                    where,
                )
        sizes = [arch.module_dims(part)[1] for part in FUSED_PROJECTIONS[fused]]
        want = {"A": (rank, arch.hidden_size), "B": (sum(sizes), rank)}
        for which in ("A", "B"):
            if tuple(pair[which].shape) != want[which]:
                raise _fail(
                    f"{where} lora_{which} has shape {tuple(pair[which].shape)}, expected {want[which]} for r={rank} "
                    "on this base model: the adapter was trained for a different base model or rank",
                    f"{where} lora_{which}",
                )
        for part, b in zip(FUSED_PROJECTIONS[fused], pair["B"].split(sizes, dim=0), strict=True):
            if (part, layer) in parts:
                raise _fail(
                    f"{where} and layer {layer} {part} both carry LoRA: the adapter adapts {part} twice",
                    where,
                )
            parts[(part, layer)] = {"A": pair["A"], "B": b}


def adapter_dir(path: Path, what: str) -> Path:
    """``path`` if it is a directory, else the error naming it (``what``: "adapter",
    "draft adapter")."""
    if not path.is_dir():
        raise _fail(
            f"{what} path {str(path)!r} is not a directory: give the folder holding {CONFIG_FILE}", "path"
        )
    return path


def read_scaling(raw: dict, *, max_rank: int, limit: str, what: str) -> tuple[int, float, bool]:
    """An adapter config's rank, ``lora_alpha`` and ``use_rslora``, checked; ``limit`` is
    the setting that bounds the rank (named in the fix), ``what`` the kind of adapter."""
    rank = raw.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _fail(f"r must be a positive integer, got {rank!r}", "r")
    if rank > max_rank:
        raise _fail(
            f"{what} rank r={rank} exceeds {limit}={max_rank}: raise {limit} to at least {rank} "
            f"or use a {what} of lower rank",
            "r",
        )
    alpha = raw.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise _fail(f"lora_alpha must be a number, got {alpha!r}", "lora_alpha")
    return rank, float(alpha), bool(raw.get("use_rslora", False))


def read_adapter_tensors(path: Path, what: str) -> dict[str, torch.Tensor]:
    """The tensors of ``path``'s safetensors file; a pickle file is refused (it can run code
    when loaded), a missing or unreadable file named."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = path / WEIGHTS_FILE
    if not file.is_file():
        pickles = [p for p in PICKLE_FILES if (path / p).is_file()]
        if pickles:
            raise _fail(
                f"{path / pickles[0]} is a pickle file, which can run arbitrary code when loaded, and is refused: "
                f"re-save the {what} with safetensors (peft save_pretrained(..., safe_serialization=True))",
                pickles[0],
            )
        raise _fail(f"{file} is missing: the {what} needs its weights in {WEIGHTS_FILE}", WEIGHTS_FILE)
    try:
        return load_file(str(file), device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise _fail(f"{file} is not a readable safetensors file ({exc})", WEIGHTS_FILE) from exc


def _parse_name(full_name: str, name: str, arch: ModelArchConfig) -> tuple[tuple[str, int | None], str]:
    m = _SHARED_RE.match(name)
    if m:
        layer = int(m.group(1))
        if not (arch.is_moe_layer(layer) and arch.moe is not None and arch.moe.shared_intermediate_size):
            raise _fail(
                f"tensor {full_name!r} adapts a shared expert, which layer {layer} of this {arch.architecture} "
                "does not have: the adapter was trained for a different base model",
                full_name,
            )
        return (m.group(2), layer), m.group(3)
    m = _LAYER_RE.match(name)
    if m:
        layer = int(m.group(1))
        if layer >= arch.num_layers:
            raise _fail(
                f"tensor {full_name!r} names layer {layer}, but the base model has {arch.num_layers} layers: "
                "the adapter was trained for a different base model",
                full_name,
            )
        if arch.is_moe_layer(layer) and m.group(2) in ("gate_proj", "up_proj", "down_proj"):
            raise _fail(
                f"tensor {full_name!r} adapts a dense MLP module, but layer {layer} of this {arch.architecture} is "
                "a mixture of experts: expert LoRA is read per expert (mlp.experts.N.gate_proj) or fused "
                "(peft target_parameters mlp.experts.gate_up_proj / down_proj); the adapter was trained for a "
                "different base model",
                full_name,
            )
        if m.group(2) in FUSED_PROJECTIONS and arch.family != "phi3":
            raise _fail(
                f"tensor {full_name!r} adapts a fused {m.group(2)}, which a {arch.architecture} does not have "
                "(its checkpoints name the parts: q_proj/k_proj/v_proj, gate_proj/up_proj): the adapter was "
                "trained for a different base model",
                full_name,
            )
        return (m.group(2), layer), m.group(3)
    m = _EMBED_RE.match(name)
    if m:
        return ("embed_tokens", None), m.group(1)
    m = _LM_HEAD_RE.match(name)
    if m:
        return ("lm_head", None), m.group(1)
    raise _fail(
        f"tensor {full_name!r} does not map to a LoRA weight of a Llama-family layer "
        "(expected e.g. base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight)",
        full_name,
    )


def _check_full_copy(
    full_name: str,
    tensor: torch.Tensor,
    module: str,
    base_tensor: Callable[[str], torch.Tensor | None] | None,
) -> None:
    """Accept peft's copy of the whole base ``embed_tokens`` / ``lm_head`` weight only when it
    is the served model's own: same shape and every value equal, compared in the coarser of
    the two dtypes (an adapter saved in bfloat16 beside a float32 base, or the reverse, still
    matches). Anything else is refused, naming the tensor and what to do."""
    base = base_tensor(module) if base_tensor is not None else None
    if base is None:
        raise _fail(
            f"tensor {full_name!r} is a full copy of the base model's {module} weight, and the served "
            f"{module} is not available here to check it against: re-save the adapter with "
            "save_embedding_layers=False (peft save_pretrained) if it was trained on this base model",
            full_name,
        )
    saved, served = tuple(tensor.shape), tuple(base.shape)
    if saved != served:
        raise _fail(
            f"tensor {full_name!r} is the adapter's copy of the base model's {module} weight with shape {saved}, "
            f"but the served model's {module} has shape {served}: the adapter was trained on a resized vocabulary "
            "(or another base model) and needs those weights, which a base model shared by every adapter cannot "
            f"serve: serve the model with the resized {module} (the one the adapter was trained on) as the base, "
            "or retrain the adapter on this model",
            full_name,
        )
    base = base.detach().to("cpu")
    differing = _count_differing(tensor, base)
    if differing:
        raise _fail(
            f"tensor {full_name!r} is the adapter's copy of the base model's {module} weight, and {differing} of its "
            f"{tensor.numel()} values differ from the served model's: the adapter was trained with retrained "
            f"{module} weights or on another base model, which a base model shared by every adapter cannot serve: "
            f"serve the model holding those {module} weights as the base, or, if {module} was not trained and the "
            "adapter was trained on this base model, re-save it with save_embedding_layers=False (peft "
            "save_pretrained)",
            full_name,
        )


def _count_differing(saved: torch.Tensor, base: torch.Tensor) -> int:
    """Values that differ, compared in the coarser dtype (the larger machine epsilon)."""
    if not (saved.is_floating_point() and base.is_floating_point()):
        return saved.numel() if saved.dtype != base.dtype else int((saved != base).sum())
    dtype = max((saved.dtype, base.dtype), key=lambda d: torch.finfo(d).eps)
    if saved.dim() == 0:
        return int(saved.to(dtype) != base.to(dtype))
    rows = 4096  # a vocabulary of 128k x 4096 is compared a slice at a time, not in whole copies
    return sum(
        int((saved[i : i + rows].to(dtype) != base[i : i + rows].to(dtype)).sum())
        for i in range(0, saved.shape[0], rows)
    )
