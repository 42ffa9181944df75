"""Read and validate a PEFT LoRA adapter directory against the base model and the pool.

Accepted: ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``,
``use_rslora``) plus ``adapter_model.safetensors``. Pickle weights are refused: loading
them can run arbitrary code. Every check runs before anything is handed to the
manager, so a rejected adapter leaves the pool untouched.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import LORA_MODULES
from ..model.arch import ModelArchConfig
from .errors import AdapterError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")

_LAYER_RE = re.compile(
    r"^model\.layers\.(\d+)\.(?:self_attn|mlp)\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
    r"\.lora_(A|B)(?:\.[A-Za-z0-9_-]+)?\.weight$"
)
_EMBED_RE = re.compile(r"^model\.embed_tokens\.lora_embedding_(A|B)(?:\.[A-Za-z0-9_-]+)?$")
_LM_HEAD_RE = re.compile(r"^lm_head\.lora_(A|B)(?:\.[A-Za-z0-9_-]+)?\.weight$")
_FULL_COPIES = {"model.embed_tokens.weight": "embed_tokens", "lm_head.weight": "lm_head"}
_ATTN = {"q_proj", "k_proj", "v_proj", "o_proj"}


@dataclass
class AdapterWeights:
    """A validated adapter, on the host, in the model's dtype.

    ``weights[(module, layer)] = (A [r, in], B [out, r])`` for linear modules (``layer``
    is None for ``lm_head``); ``embed_tokens`` is stored as ``(A [vocab, r], B [hidden, r])``
    (PEFT's ``lora_embedding_A`` transposed, so a token's row is contiguous).
    """

    path: Path
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    weights: dict[tuple[str, int | None], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def scaling(self) -> float:
        return self.alpha / math.sqrt(self.rank) if self.use_rslora else self.alpha / self.rank

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def _fail(message: str, field: str) -> AdapterError:
    return AdapterError(message, field=field)


def read_adapter_config(path: Path) -> dict:
    """Parse and sanity-check ``adapter_config.json``; returns the raw dict."""
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise _fail(
            f"{config_path} is missing: an adapter directory needs {CONFIG_FILE} and {WEIGHTS_FILE} "
            "(as written by peft's save_pretrained)",
            CONFIG_FILE,
        )
    try:
        raw = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _fail(f"{config_path} is not valid JSON ({exc}): rewrite it with peft's save_pretrained", CONFIG_FILE) from exc
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
    for key in ("rank_pattern", "alpha_pattern"):
        if raw.get(key):
            raise _fail(
                f"{key} is set: per-module ranks/alphas are not supported; retrain with one r and lora_alpha",
                key,
            )
    if raw.get("modules_to_save"):
        raise _fail(
            f"modules_to_save={raw['modules_to_save']} replaces base layers, which a shared base model "
            "cannot serve: retrain without modules_to_save",
            "modules_to_save",
        )
    if raw.get("bias", "none") not in ("none", None):
        raise _fail(f"bias={raw['bias']!r}: trained bias terms are not supported; retrain with bias='none'", "bias")
    if raw.get("trainable_token_indices"):
        raise _fail("trainable_token_indices is set: trainable-token adapters are not supported", "trainable_token_indices")
    return raw


def load_adapter(
    path: str | Path,
    *,
    arch: ModelArchConfig,
    max_rank: int,
    pool_modules: Iterable[str],
    dtype: torch.dtype,
    base_tensor: Callable[[str], torch.Tensor] | None = None,
) -> AdapterWeights:
    """Read and validate an adapter; raises :class:`AdapterError` naming the field/tensor.

    ``pool_modules``: the modules the slot pool has buffers for (``lora.target_modules``).
    ``base_tensor(module)`` returns the base ``embed_tokens``/``lm_head`` weight, used to
    accept full copies of those that peft saves next to embedding adapters.
    """
    path = Path(path)
    if not path.is_dir():
        raise _fail(f"adapter path {str(path)!r} is not a directory: give the folder holding {CONFIG_FILE}", "path")
    raw = read_adapter_config(path)
    pool = tuple(pool_modules)

    rank = raw.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _fail(f"r must be a positive integer, got {rank!r}", "r")
    if rank > max_rank:
        raise _fail(
            f"adapter rank r={rank} exceeds lora.max_rank={max_rank}: raise lora.max_rank to at least {rank} "
            "or use an adapter of lower rank",
            "r",
        )
    alpha = raw.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise _fail(f"lora_alpha must be a number, got {alpha!r}", "lora_alpha")
    use_rslora = bool(raw.get("use_rslora", False))

    declared = raw.get("target_modules")
    if isinstance(declared, list):
        names = [str(m).rsplit(".", 1)[-1] for m in declared]
        unknown = sorted(set(names) - set(LORA_MODULES))
        if unknown:
            raise _fail(
                f"target_modules has {unknown}, not a module of a Llama-family model: "
                f"adapters may target {list(LORA_MODULES)}",
                "target_modules",
            )
        outside = sorted(set(names) - set(pool))
        if outside:
            raise _fail(
                f"target_modules {outside} are not in lora.target_modules {list(pool)}: add them to "
                "lora.target_modules or use an adapter without them",
                "target_modules",
            )
    elif declared is not None and not isinstance(declared, str):
        raise _fail(f"target_modules must be a list of names or a pattern string, got {declared!r}", "target_modules")
    # A pattern string (e.g. "all-linear" or a regex) is resolved from the tensors below.

    weights_path = path / WEIGHTS_FILE
    if not weights_path.is_file():
        pickles = [p for p in PICKLE_FILES if (path / p).is_file()]
        if pickles:
            raise _fail(
                f"{path / pickles[0]} is a pickle file, which can run arbitrary code when loaded, and is refused: "
                f"re-save the adapter with safetensors (peft save_pretrained(..., safe_serialization=True))",
                pickles[0],
            )
        raise _fail(f"{weights_path} is missing: the adapter needs its weights in {WEIGHTS_FILE}", WEIGHTS_FILE)
    tensors = _read_safetensors(weights_path)

    parts: dict[tuple[str, int | None], dict[str, torch.Tensor]] = {}
    for full_name, tensor in tensors.items():
        name = full_name.removeprefix("base_model.model.")
        if name in _FULL_COPIES:
            _check_full_copy(full_name, tensor, _FULL_COPIES[name], base_tensor)
            continue
        key, which = _parse_name(full_name, name, arch)
        module = key[0]
        if module not in pool:
            raise _fail(
                f"tensor {full_name!r} adapts {module}, which is not in lora.target_modules {list(pool)}: "
                f"add {module} to lora.target_modules or use an adapter without it",
                full_name,
            )
        parts.setdefault(key, {})[which] = tensor
    if not parts:
        raise _fail(f"{weights_path} holds no LoRA tensors (lora_A / lora_B)", WEIGHTS_FILE)

    weights: dict[tuple[str, int | None], tuple[torch.Tensor, torch.Tensor]] = {}
    for key in sorted(parts, key=lambda k: (k[1] if k[1] is not None else -1, k[0])):
        module, layer = key
        pair = parts[key]
        where = module if layer is None else f"layer {layer} {module}"
        for which in ("A", "B"):
            if which not in pair:
                raise _fail(f"{where} has lora_{'BA'[which == 'B']} but no lora_{which}: the file is incomplete", where)
        a, b = pair["A"], pair["B"]
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
    modules = tuple(sorted({m for m, _ in weights}, key=LORA_MODULES.index))
    if isinstance(declared, list):
        names = {str(m).rsplit(".", 1)[-1] for m in declared}
        extra = sorted(set(modules) - names)
        if extra:
            raise _fail(
                f"the weights adapt {extra}, which target_modules does not declare: the config and weights disagree",
                "target_modules",
            )
    return AdapterWeights(
        path=path.resolve(),
        rank=rank,
        alpha=float(alpha),
        use_rslora=use_rslora,
        target_modules=modules,
        weights=weights,
    )


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise _fail(f"{path} is not a readable safetensors file ({exc})", WEIGHTS_FILE) from exc


def _parse_name(full_name: str, name: str, arch: ModelArchConfig) -> tuple[tuple[str, int | None], str]:
    m = _LAYER_RE.match(name)
    if m:
        layer = int(m.group(1))
        if layer >= arch.num_layers:
            raise _fail(
                f"tensor {full_name!r} names layer {layer}, but the base model has {arch.num_layers} layers: "
                "the adapter was trained for a different base model",
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
    full_name: str, tensor: torch.Tensor, module: str, base_tensor: Callable[[str], torch.Tensor] | None
) -> None:
    """peft may save the whole embedding next to an embedding adapter; accept only the base's own."""
    base = base_tensor(module) if base_tensor is not None else None
    if (
        base is not None
        and tuple(base.shape) == tuple(tensor.shape)
        and torch.equal(tensor.to(base.dtype), base.detach().to("cpu"))
    ):
        return
    raise _fail(
        f"tensor {full_name!r} replaces the base model's {module} weights, which a shared base cannot serve: "
        "re-save the adapter with save_embedding_layers=False (or train without resizing the vocabulary)",
        full_name,
    )
