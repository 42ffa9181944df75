"""LoRA on the experts and router of a mixture-of-experts model, in the layouts users have.

- peft with transformers 5 (``target_parameters``): one LoRA per fused 3-D parameter,
  saved as ``model.layers.L.mlp.experts[.base_layer...].lora_A/B.weight`` with
  ``lora_A [r·E, in]`` (expert-major rows) and ``lora_B [out, r·E]`` (expert-minor
  columns), the nesting telling nothing about which parameter is which: the shapes do
  (``gate_up_proj``: in H, out 2I; ``down_proj``: in I, out H; never both). peft converts
  ``target_modules`` gate_proj + up_proj into ``gate_up_proj`` at double rank, with
  ``rank_pattern`` / ``alpha_pattern`` entries for it.
- Adapters saved earlier: one LoRA per expert module, ``mlp.experts.N.gate_proj`` (Qwen)
  or ``block_sparse_moe.experts.N.w1/w3/w2`` (Mixtral).
- The router (``mlp.gate``, ``block_sparse_moe.gate``): an ordinary ``[r, H]`` / ``[E, r]``
  pair, served (it changes the experts a token picks, per adapter).

Each becomes ``weights[(module, layer)]``: experts' ``(A [E, r, in], B [E, out, r])`` under
gate_proj / up_proj / down_proj, the router's ``(A [r, H], B [E, r])`` under ``gate``, with
a parameter's own scaling (``alpha_pattern``) folded into its B relative to the adapter's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

import torch

from ..model.arch import ModelArchConfig
from ..model.moe import MIXTRAL_NAMES
from .errors import AdapterError

ROUTER = "gate"
EXPERT_MODULES = ("gate_proj", "up_proj", "down_proj")
_NAME = r"(?:\.[A-Za-z0-9_-]+)?"
_FUSED_RE = re.compile(rf"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts((?:\.base_layer)*)\.lora_(A|B){_NAME}\.weight$")
_PER_EXPERT_RE = re.compile(
    rf"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)"
    rf"\.lora_(A|B){_NAME}\.weight$"
)
_ROUTER_RE = re.compile(rf"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.gate(?:\.base_layer)*\.lora_(A|B){_NAME}\.weight$")
# target_parameters an MoE model serves -> the modules they adapt
_PARAMETERS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",), "gate.weight": (ROUTER,)}
_SERVED = "the experts' gate_up_proj and down_proj and the router's gate.weight"


def _fail(message: str, field: str) -> AdapterError:
    return AdapterError(message, field=field)


def declared_modules(raw: dict, arch: ModelArchConfig) -> set[str]:
    """The modules ``target_parameters`` adapts (checked), plus Mixtral's w1/w3/w2 and the
    router among ``target_modules`` read as gate_proj/up_proj/down_proj and ``gate``."""
    out: set[str] = set()
    declared = raw.get("target_modules")
    if isinstance(declared, list) and arch.moe is not None:
        for name in (str(m).rsplit(".", 1)[-1] for m in declared):
            if name in MIXTRAL_NAMES or name == ROUTER:
                out.add(MIXTRAL_NAMES.get(name, name))
    params = raw.get("target_parameters")
    if not params:
        return out
    if arch.moe is None:
        raise _fail(
            f"target_parameters={params!r}: LoRA on parameters is served only for the experts of a "
            f"mixture-of-experts model, and {arch.architecture} has none: target modules instead",
            "target_parameters",
        )
    if not isinstance(params, list) or not all(isinstance(p, str) for p in params):
        raise _fail(f"target_parameters must be a list of parameter names, got {params!r}", "target_parameters")
    for param in params:
        leaf = next((k for k in _PARAMETERS if param == k or param.endswith("." + k)), None)
        if leaf is None:
            raise _fail(
                f"target_parameters entry {param!r}: LoRA on that parameter is not served; an MoE model "
                f"serves {_SERVED}: retrain without it",
                "target_parameters",
            )
        out.update(_PARAMETERS[leaf])
    return out


def check_patterns(raw: dict, arch: ModelArchConfig) -> None:
    """``rank_pattern`` / ``alpha_pattern`` are served only where they name the fused expert
    or router parameters (peft writes them so for gate_up_proj at double rank)."""
    fused = ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj", "model.layers.0.mlp.gate.weight")
    modules = [f"model.layers.0.self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj", "o_proj")]
    modules += [f"model.layers.0.mlp.{m}" for m in EXPERT_MODULES]
    for key in ("rank_pattern", "alpha_pattern"):
        patterns = raw.get(key) or {}
        for pattern in patterns:
            hits_fused = any(_matches(pattern, k) for k in fused)
            if arch.moe is None or not hits_fused or any(_matches(pattern, k) for k in modules):
                raise _fail(
                    f"{key} is set ({pattern!r}): per-module ranks/alphas are served only for {_SERVED} of an "
                    "MoE model (as peft writes them); retrain with one r and lora_alpha",
                    key,
                )


def _matches(pattern: str, key: str) -> bool:
    """peft's rule (``get_pattern_key``): the pattern matches the end of the key."""
    try:
        return re.match(rf"(.*\.)?({pattern})$", key) is not None
    except re.error:
        return False


def _pattern_value(raw: dict, key: str, names: Iterable[str]):
    patterns = raw.get(key) or {}
    for pattern, value in patterns.items():
        if any(_matches(pattern, name) for name in names):
            return value
    return None


def is_moe_tensor(name: str) -> bool:
    """Whether an adapter tensor name (``base_model.model.`` stripped) is an expert's or a router's."""
    return any(r.match(name) for r in (_FUSED_RE, _PER_EXPERT_RE, _ROUTER_RE))


def take_moe_weights(
    tensors: dict[str, torch.Tensor],
    raw: dict,
    arch: ModelArchConfig,
    *,
    scaling: float,
    use_rslora: bool,
    dtype: torch.dtype,
) -> dict[tuple[str, int | None], tuple[torch.Tensor, torch.Tensor]]:
    """Expert and router weights of an adapter, validated; ``tensors`` maps names with
    ``base_model.model.`` stripped (to their full names for errors: ``name -> (full, tensor)``)."""
    fused: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {}
    per_expert: dict[tuple[int, str], dict[int, dict[str, tuple[str, torch.Tensor]]]] = {}
    router: dict[int, dict[str, tuple[str, torch.Tensor]]] = {}
    for name, (full, tensor) in tensors.items():
        if m := _FUSED_RE.match(name):
            layer = _moe_layer(full, int(m.group(1)), arch)
            fused.setdefault((layer, m.group(2)), {})[m.group(3)] = (full, tensor)
        elif m := _PER_EXPERT_RE.match(name):
            layer = _moe_layer(full, int(m.group(1)), arch)
            module = MIXTRAL_NAMES.get(m.group(3), m.group(3))
            per_expert.setdefault((layer, module), {}).setdefault(int(m.group(2)), {})[m.group(4)] = (full, tensor)
        elif m := _ROUTER_RE.match(name):
            router.setdefault(_moe_layer(full, int(m.group(1)), arch), {})[m.group(2)] = (full, tensor)
    out: dict[tuple[str, int | None], tuple[torch.Tensor, torch.Tensor]] = {}
    ctx = (raw, scaling, use_rslora)
    for (layer, _), pair in fused.items():
        for module, a, b in _fused_pair(pair, layer, arch, ctx):
            _put(out, (module, layer), a, b, dtype)
    for (layer, module), experts in per_expert.items():
        _put(out, (module, layer), *_per_expert(experts, layer, module, arch, ctx), dtype)
    for layer, pair in router.items():
        _put(out, (ROUTER, layer), *_router(pair, layer, arch, ctx), dtype)
    return out


def _put(out: dict, key: tuple[str, int], a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    if key in out:
        raise _fail(
            f"layer {key[1]} {key[0]} is adapted twice (per expert and fused): the file mixes two layouts",
            f"layer {key[1]} {key[0]}",
        )
    out[key] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())


def _moe_layer(full: str, layer: int, arch: ModelArchConfig) -> int:
    if layer >= arch.num_layers:
        raise _fail(
            f"tensor {full!r} names layer {layer}, but the base model has {arch.num_layers} layers: "
            "the adapter was trained for a different base model",
            full,
        )
    if not arch.is_moe_layer(layer):
        raise _fail(
            f"tensor {full!r} adapts experts or a router of layer {layer}, whose MLP is dense in this "
            f"{arch.architecture}: the adapter was trained for a different base model",
            full,
        )
    return layer


def _both(pair: dict[str, tuple[str, torch.Tensor]], where: str) -> tuple[str, torch.Tensor, torch.Tensor]:
    for which in ("A", "B"):
        if which not in pair:
            raise _fail(f"{where} has lora_{'BA'[which == 'B']} but no lora_{which}: the file is incomplete", where)
    return pair["A"][0], pair["A"][1], pair["B"][1]


def _scale(ctx: tuple, rank: int, names: list[str], where: str) -> float:
    """This parameter's scaling over the adapter's (its alpha_pattern / rank_pattern entry)."""
    raw, scaling, use_rslora = ctx
    pattern_rank = _pattern_value(raw, "rank_pattern", names)
    if pattern_rank is not None and pattern_rank != rank:
        raise _fail(
            f"{where} has rank {rank} but rank_pattern says {pattern_rank}: the config and weights disagree",
            "rank_pattern",
        )
    alpha = _pattern_value(raw, "alpha_pattern", names)
    alpha = float(raw.get("lora_alpha", raw.get("r")) if alpha is None else alpha)
    own = alpha / math.sqrt(rank) if use_rslora else alpha / rank
    return own / scaling


def _fused_pair(pair, layer: int, arch: ModelArchConfig, ctx: tuple):
    """A peft ParamWrapper pair on ``gate_up_proj`` or ``down_proj``, told apart by shape."""
    spec = arch.moe
    assert spec is not None
    num, h, i = spec.num_experts, arch.hidden_size, spec.intermediate_size
    full, a, b = _both(pair, f"layer {layer} experts")
    shapes = {"gate_up_proj": (h, 2 * i), "down_proj": (i, h)}
    param = next(
        (p for p, (n_in, n_out) in shapes.items() if a.dim() == 2 and b.dim() == 2 and a.shape[1] == n_in
         and b.shape[0] == n_out and a.shape[0] == b.shape[1] and a.shape[0] % num == 0),
        None,
    )  # fmt: skip
    if param is None:
        raise _fail(
            f"tensor {full!r} (lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)}) fits neither fused expert "
            f"parameter of this model: gate_up_proj takes lora_A [r*{num}, {h}] and lora_B [{2 * i}, r*{num}], "
            f"down_proj lora_A [r*{num}, {i}] and lora_B [{h}, r*{num}]: the adapter was trained for a "
            "different base model",
            full,
        )
    rank = a.shape[0] // num
    a3 = a.reshape(num, rank, a.shape[1])
    b3 = b.reshape(b.shape[0], rank, num).permute(2, 0, 1)  # peft's column order: rank-major, expert-minor
    names = [f"model.layers.{layer}.mlp.experts.{param}", f"model.layers.{layer}.mlp.experts"]
    b3 = b3 * _scale(ctx, rank, names, f"layer {layer} experts.{param}")
    if param == "down_proj":
        return [("down_proj", a3, b3)]
    return [("gate_proj", a3, b3[:, :i]), ("up_proj", a3, b3[:, i:])]


def _per_expert(experts: dict, layer: int, module: str, arch: ModelArchConfig, ctx: tuple):
    """One LoRA per expert module, stacked; experts the file leaves out get zeros."""
    spec = arch.moe
    assert spec is not None
    n_in, n_out = arch.expert_dims(module)
    first = None
    for expert in sorted(experts):
        where = f"layer {layer} expert {expert} {module}"
        full, a, b = _both(experts[expert], where)
        if expert >= spec.num_experts:
            raise _fail(f"tensor {full!r} names expert {expert}, but the model has {spec.num_experts}", full)
        rank = a.shape[0] if a.dim() == 2 else -1
        if first is None:
            first = rank
        for which, tensor, want in (("A", a, (first, n_in)), ("B", b, (n_out, first))):
            if tuple(tensor.shape) != want:
                raise _fail(
                    f"{where} lora_{which} has shape {tuple(tensor.shape)}, expected {want}: the adapter was "
                    "trained for a different base model, or its experts have different ranks",
                    f"{where} lora_{which}",
                )
    assert first is not None
    a3 = torch.zeros(spec.num_experts, first, n_in)
    b3 = torch.zeros(spec.num_experts, n_out, first)
    for expert, pair in experts.items():
        a3[expert], b3[expert] = pair["A"][1], pair["B"][1]
    names = [f"model.layers.{layer}.mlp.experts.{e}.{module}" for e in sorted(experts)]
    return a3, b3 * _scale(ctx, first, names, f"layer {layer} experts {module}")


def _router(pair, layer: int, arch: ModelArchConfig, ctx: tuple):
    spec = arch.moe
    assert spec is not None
    where = f"layer {layer} router (mlp.gate)"
    _, a, b = _both(pair, where)
    rank = a.shape[0] if a.dim() == 2 else -1
    for which, tensor, want in (("A", a, (rank, arch.hidden_size)), ("B", b, (spec.num_experts, rank))):
        if tuple(tensor.shape) != want:
            raise _fail(
                f"{where} lora_{which} has shape {tuple(tensor.shape)}, expected {want}: the adapter was trained "
                "for a different base model",
                f"{where} lora_{which}",
            )
    names = [f"model.layers.{layer}.mlp.gate.weight", f"model.layers.{layer}.mlp.gate"]
    return a, b * _scale(ctx, rank, names, where)
