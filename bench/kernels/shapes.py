"""Llama-3-8B's LoRA modules, the batches the kernels see, and their batch metadata."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraserve.kernels import ForwardMode, LoRABatchInfo, build_batch_info
from loraserve.kernels.graph_metadata import GraphLoRAMetadata


@dataclass(frozen=True)
class Module:
    """A (possibly fused) linear module: its input width and the widths of its output slices."""

    name: str
    in_dim: int
    widths: tuple[int, ...]

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where each output slice starts, and the total width last."""
        offs = [0]
        for w in self.widths:
            offs.append(offs[-1] + w)
        return tuple(offs)

    @property
    def out_dim(self) -> int:
        """The output width: all slices together."""
        return sum(self.widths)


def llama_modules(tiny: bool) -> dict[str, Module]:
    """Llama-3-8B's four LoRA'd linear calls per layer (``tiny``: small stand-ins)."""
    if tiny:
        h, kv, ff = 64, 16, 96
    else:
        h, kv, ff = 4096, 1024, 14336
    return {
        "qkv": Module("qkv", h, (h, kv, kv)),
        "o": Module("o", h, (h,)),
        "gate_up": Module("gate_up", h, (ff, ff)),
        "down": Module("down", ff, (h,)),
    }


@dataclass(frozen=True)
class Workload:
    """A batch as the kernels see it: mode, requests, adapters, rank and rows per request."""

    mode: str  # decode | verify | extend
    bs: int  # requests (extend: segments)
    adapters: int
    rank: int
    width: int = 1  # rows per request: 1, k, or the extend segment length
    max_rank: int = 0  # pool rank (0: = rank)
    rank_major_b: bool = False  # B stored [slots, max_rank, out] and passed as a transposed view
    graph: bool = (
        False  # metadata as the runtime's CUDA graphs see it: tile capacity for bs, live tiles fewer
    )

    @property
    def tokens(self) -> int:
        """Rows of the batch."""
        return self.bs * self.width

    @property
    def pool_rank(self) -> int:
        """The adapter pool's rank (the adapters' own when not set)."""
        return self.max_rank or self.rank

    def label(self) -> str:
        """A short name for tables, e.g. ``ver4 bs32 a32 r16 Bᵀ``."""
        tag = {"decode": "dec", "verify": f"ver{self.width}", "extend": f"ext{self.width}"}[self.mode]
        pool = f"/R{self.max_rank}" if self.max_rank else ""
        layout = " Bᵀ" if self.rank_major_b else ""
        graph = " [graph]" if self.graph else ""
        return f"{tag} bs{self.bs} a{self.adapters} r{self.rank}{pool}{layout}{graph}"


def forward_mode(mode: str) -> ForwardMode:
    """The runtime's forward mode of ``decode``, ``verify`` or ``extend``."""
    return {"decode": ForwardMode.DECODE, "verify": ForwardMode.TARGET_VERIFY, "extend": ForwardMode.EXTEND}[
        mode
    ]


def request_slots(w: Workload, gen: torch.Generator) -> list[int]:
    """Adapters spread over requests in a shuffled order, so grouping has work to do."""
    slots = [i % w.adapters for i in range(w.bs)]
    order = torch.randperm(w.bs, generator=gen).tolist()
    return [slots[i] for i in order]


def batch_info(
    w: Workload, slots: list[int], ranks: list[int], scalings: list[float], device
) -> LoRABatchInfo:
    """The batch metadata of ``w``: built directly, or through graph metadata for ``w.graph``."""
    mode = forward_mode(w.mode)
    if w.graph:
        k = w.width if mode is ForwardMode.TARGET_VERIFY else None
        meta = GraphLoRAMetadata(mode, w.bs, len(ranks), num_draft_tokens=k, device=device)
        meta.capture_info(w.bs)
        info = meta.update(slots, ranks, scalings, num_draft_tokens=k, batch_size=w.bs)
        info._meta = meta  # keep the buffers' owner alive with the info
        return info
    kwargs: dict = {}
    if mode is ForwardMode.TARGET_VERIFY:
        kwargs["num_draft_tokens"] = w.width
    if mode is ForwardMode.EXTEND:
        kwargs["extend_lens"] = [w.width] * w.bs
    return build_batch_info(mode, slots, ranks, scalings, device=device, **kwargs)


def make_b(slots: int, out_dim: int, rank: int, rank_major: bool, **kw) -> torch.Tensor:
    """B ``[slots, out, rank]``; rank-major storage is a transposed view of ``[slots, rank, out]``."""
    if rank_major:
        return torch.randn(slots, rank, out_dim, **kw).transpose(1, 2)
    return torch.randn(slots, out_dim, rank, **kw)
