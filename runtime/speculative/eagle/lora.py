"""Draft adapters of an EAGLE / EAGLE3 head: its own LoRA pool over the head's linear layers.

A draft adapter is a PEFT LoRA for the head itself, named as the head's checkpoint names
its modules (:mod:`.format`): ``fc`` and ``layers.0.self_attn.{q,k,v,o}_proj`` /
``layers.0.mlp.{gate,up,down}_proj`` (peft prefixes ``base_model.model.``; a leading
``model.`` is ignored as in head checkpoints). It lives in a pool of its own, sized by the
serve's draft adapter settings (``speculative.draft_max_loras`` / ``draft_max_lora_rank``),
never holding one of the target's adapters: the head stays one draft for every adapter,
and only a request whose Adapter names a draft adapter drafts with it
(:class:`~..draft_adapters.DraftAdapterLeases`).

The token embedding and LM head the head shares with the target stay unwrapped: a draft
adapter that targets ``embed_tokens`` or ``lm_head`` is refused with the reason.

Layouts: a head forward carries ``width`` rows per request (1 for a draft step, ``k`` for
a verified feed or a tree frontier) or a ragged prefill chunk per request. Eager calls
build the LoRA segment layout per width on the host (:class:`HeadAdapterBatch`); graph
replays read it from fixed buffers updated before each replay (:class:`HeadGraphLoRA`,
over :class:`~loraserve.kernels.graph_metadata.GraphLoRAMetadata`, as the target's graphs do).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch

from loraserve.kernels import ForwardMode, GraphLoRAMetadata, LoRABackend, LoRABatchInfo

from ...contract.config import LoRAConfig
from ...lora import AdapterError
from ...lora.adapter import (
    WEIGHTS_FILE,
    AdapterWeights,
    adapter_dir,
    read_adapter_config,
    read_adapter_tensors,
    read_scaling,
)
from ...lora.manager import LoRAManager
from ...lora.pool import LinearLoRAHook, rank_major_b
from .format import EagleDraftConfig

if TYPE_CHECKING:
    from .model import EagleDraftModel

LAYER_MODULES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
HEAD_LORA_MODULES: tuple[str, ...] = (*LAYER_MODULES, "fc")
"""What a head draft adapter may adapt: the decoder layer's projections and the feature fc."""
SHARED_MODULES: tuple[str, ...] = ("embed_tokens", "lm_head")
"""The target's modules the head shares: never adapted by a draft adapter."""

_TENSOR_RE = re.compile(
    r"^(?:model\.)?(?:layers\.(\d+)\.(?:self_attn|mlp)\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
    r"|(fc))\.lora_(A|B)(?:\.[A-Za-z0-9_-]+)?\.weight$"
)
_SHARED_RE = re.compile(r"^(?:model\.)?(embed_tokens|lm_head)\.")


def _fail(message: str, field: str) -> AdapterError:
    return AdapterError(message, field=field)


def _shared_refusal(module: str, field: str) -> AdapterError:
    return _fail(
        f"the draft adapter adapts {module}: an EAGLE head shares the target's base {module}, which stays "
        f"unadapted for every request (draft adapters adapt the head's own layers only): retrain the draft "
        f"adapter without {module} (its modules may be {', '.join(HEAD_LORA_MODULES)})",
        field,
    )


def _checkpoint_name(module: str) -> str:
    """The head checkpoint's weight name of ``module`` (:mod:`.format`)."""
    if module == "fc":
        return "fc.weight"
    block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return f"layers.0.{block}.{module}.weight"


def check_head_modules(declared: object) -> None:
    """Refuse ``target_modules`` naming anything but the head's adaptable modules."""
    if not isinstance(declared, list):
        return  # a pattern string: the tensors decide
    names = [str(m).rsplit(".", 1)[-1] for m in declared]
    for name in names:
        if name in SHARED_MODULES:
            raise _shared_refusal(name, "target_modules")
    unknown = sorted(set(names) - set(HEAD_LORA_MODULES))
    if unknown:
        raise _fail(
            f"target_modules has {unknown}, not a module of an EAGLE head: a head draft adapter may adapt "
            f"{', '.join(HEAD_LORA_MODULES)}",
            "target_modules",
        )


def load_head_adapter(
    path: str | Path, config: EagleDraftConfig, *, max_rank: int, dtype: torch.dtype
) -> AdapterWeights:
    """Read and check a head draft adapter; raises :class:`AdapterError` naming the field.

    Weights are keyed as the pool writes them: ``(module, 0)`` for the decoder layer's
    projections, ``("fc", None)`` for the feature fc.
    """
    path = Path(path)
    raw = read_adapter_config(adapter_dir(path, "draft adapter"))
    rank, alpha, use_rslora = read_scaling(
        raw,
        max_rank=max_rank,
        limit="speculative.draft_max_lora_rank (--draft-max-lora-rank)",
        what="draft adapter",
    )
    check_head_modules(raw.get("target_modules"))
    tensors = read_adapter_tensors(path, "draft adapter")
    shapes = config.tensor_shapes()
    parts: dict[tuple[str, int | None], dict[str, torch.Tensor]] = {}
    for full_name, tensor in tensors.items():
        key, which = _parse(full_name)
        parts.setdefault(key, {})[which] = tensor
    if not parts:
        raise _fail(f"{path / WEIGHTS_FILE} holds no LoRA tensors (lora_A / lora_B)", WEIGHTS_FILE)
    weights: dict[tuple[str, int | None], tuple[torch.Tensor, torch.Tensor]] = {}
    for key, pair in parts.items():
        module = key[0]
        for which in ("A", "B"):
            if which not in pair:
                raise _fail(f"{module} has no lora_{which}: the file is incomplete", module)
        out_dim, in_dim = shapes[_checkpoint_name(module)]
        for which, want in (("A", (rank, in_dim)), ("B", (out_dim, rank))):
            got = tuple(pair[which].shape)
            if got != want:
                raise _fail(
                    f"{module} lora_{which} has shape {got}, expected {want} for r={rank} on this "
                    f"version-{config.version} head: the draft adapter was trained for another head or rank",
                    f"{module} lora_{which}",
                )
        weights[key] = (pair["A"].to(dtype).contiguous(), pair["B"].to(dtype).contiguous())
    modules = tuple(m for m in HEAD_LORA_MODULES if any(k[0] == m for k in weights))
    return AdapterWeights(
        path=path.resolve(),
        rank=rank,
        alpha=alpha,
        use_rslora=use_rslora,
        target_modules=modules,
        weights=weights,
    )


def _parse(full_name: str) -> tuple[tuple[str, int | None], str]:
    """``((module, layer), "A" | "B")`` of one tensor of a head draft adapter."""
    name = full_name.removeprefix("base_model.model.")
    shared = _SHARED_RE.match(name)
    if shared:
        raise _shared_refusal(shared.group(1), full_name)
    m = _TENSOR_RE.match(name)
    if m is None:
        raise _fail(
            f"tensor {full_name!r} is not a LoRA weight of an EAGLE head's modules (expected e.g. "
            "base_model.model.layers.0.self_attn.q_proj.lora_A.weight or base_model.model.fc.lora_A.weight)",
            full_name,
        )
    layer, module, fc, which = m.groups()
    if fc:
        return ("fc", None), which
    if int(layer) != 0:
        raise _fail(
            f"tensor {full_name!r} names layer {layer}, but an EAGLE head has one decoder layer (layers.0): "
            "the adapter was trained for another model",
            full_name,
        )
    return (module, 0), which


class HeadLoRAManager(LoRAManager):
    """The head's draft adapter pool: the adapter registry of the target, over the head.

    Starts empty and only ever holds draft adapters, loaded by Adapter name; the target's
    adapters have a pool of their own and never reach the head.
    """

    is_draft = True

    def __init__(
        self,
        config: LoRAConfig,
        model: EagleDraftModel,
        *,
        backend: LoRABackend,
        device: torch.device,
        dtype: torch.dtype,
    ):
        if config.adapters or config.pinned:
            raise ValueError(
                "a draft head's adapter pool starts empty: the target's adapters never reach the draft"
            )
        # The slot pool wraps a model's decoder layers; the head is a model of one layer
        # whose embeddings / lm_head stay outside the pool (the draft pool never wraps them).
        one_layer = SimpleNamespace(
            arch=model.config.layer, model=SimpleNamespace(layers=model.layers), embed_tokens=None
        )
        super().__init__(
            config, one_layer, backend=backend, device=device, dtype=dtype, base_tensor=lambda _m: None
        )  # type: ignore[arg-type]
        self.head_config = model.config
        fc = model.fc
        R = config.max_rank
        hook = LinearLoRAHook(
            self.ctx,
            torch.zeros(config.max_loras_per_batch, R, fc.in_features, dtype=dtype, device=device),
            rank_major_b(config.max_loras_per_batch, fc.out_features, R, dtype, device),
            fc.slice_offsets,
        )
        fc.lora = hook
        self.pool.hooks[("fc", None)] = hook
        self.modules = (*self.modules, "fc")

    def read_adapter(self, path: Path) -> AdapterWeights:
        return load_head_adapter(path, self.head_config, max_rank=self.config.max_rank, dtype=self.dtype)


def uniform_layout(width: int) -> tuple[ForwardMode, int | None]:
    """The LoRA mode of ``width`` rows per request: a decode's single row, else a verify's ``width``."""
    return (ForwardMode.DECODE, None) if width == 1 else (ForwardMode.TARGET_VERIFY, width)


class HeadGraphLoRA:
    """Fixed-buffer LoRA layouts for the head's graphs, one per row width (``max_bs`` requests)."""

    def __init__(self, manager: HeadLoRAManager, max_bs: int, device: torch.device):
        self.manager = manager
        self.max_bs = max_bs
        self.device = device
        self._meta: dict[int, GraphLoRAMetadata] = {}

    def meta(self, width: int) -> GraphLoRAMetadata:
        meta = self._meta.get(width)
        if meta is None:
            mode, k = uniform_layout(width)
            meta = self._meta[width] = GraphLoRAMetadata(
                mode, self.max_bs, self.manager.num_slots, num_draft_tokens=k, device=self.device
            )
        return meta

    def update(self, widths: Sequence[int], slots: Sequence[int], padded: int) -> None:
        """Write this replay's layouts (``slots`` padded with base rows to ``padded``) for ``widths``."""
        ranks, scalings = self.manager.slot_ranks(), self.manager.slot_scalings()
        for width in dict.fromkeys(widths):
            self.meta(width).update(list(slots), ranks, scalings, batch_size=padded)

    def capture(self, widths: Sequence[int], padded: int) -> None:
        """The capture-time layouts (the buffers' maxima) for ``widths``."""
        for width in dict.fromkeys(widths):
            self.meta(width).capture_info(padded)

    def info(self, width: int, padded: int) -> LoRABatchInfo:
        return self.meta(width).info_for(padded)


class HeadAdapterBatch:
    """The draft adapter of every request of one head call, as the LoRA layout of each forward.

    ``slots``: each real request's slot (-1: the base head). Eager calls lay them out on the
    host per width; graph calls (``graph`` and ``padded`` set) read the fixed buffers the
    graph runner updated before the replay.
    """

    def __init__(
        self,
        manager: HeadLoRAManager,
        slots: Sequence[int],
        *,
        graph: HeadGraphLoRA | None = None,
        padded: int | None = None,
    ):
        self.manager = manager
        self.slots = list(slots)
        self.graph = graph
        self.padded = padded
        self._eager: dict[object, LoRABatchInfo | None] = {}

    def apply(self, width: int, lens: Sequence[int] | None = None) -> None:
        """Set the layout of the next head forward: ``width`` rows per request, or the
        ragged ``lens`` of a prefill chunk."""
        self.manager.ctx.set(self._info(width, lens), None)

    def _info(self, width: int, lens: Sequence[int] | None) -> LoRABatchInfo | None:
        if self.graph is not None:
            assert self.padded is not None and lens is None, "graphs run uniform widths"
            return self.graph.info(width, self.padded)
        key = tuple(lens) if lens is not None else width
        if key not in self._eager:
            if lens is not None:
                info = self.manager.batch_info(ForwardMode.EXTEND, self.slots, extend_lens=list(lens))
            else:
                mode, k = uniform_layout(width)
                info = self.manager.batch_info(mode, self.slots, num_draft_tokens=k)
            self._eager[key] = info
        return self._eager[key]
