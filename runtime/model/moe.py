"""The sparse mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE, Mixtral): the torch path.

Per token the router's float32 softmax over all experts picks the ``top_k`` largest
(renormalised to sum to one where the config says); each picked expert is a gated SiLU
MLP, and the token's output is the routing-weighted sum of its experts' outputs. The
forward gathers each expert's tokens, runs the expert on them and scatters the weighted
result back with ``index_add_``: clear and CPU-friendly, with data-dependent shapes (so
not capturable by CUDA graphs). On CUDA the layer runs the fused Triton path instead
(``loraserve.kernels.moe``, the switch of the decoder's fused ops): routing metadata on the
device, grouped expert GEMMs and each row's expert LoRA delta in its kernels, fixed shapes
for a fixed number of token rows; :attr:`MoEExperts.buffers` holds the routing buffers a
CUDA graph replays with, sized in token rows.

Weights live fused, as transformers 5 holds them: ``experts.gate_up_proj [E, 2I, H]``
(gate rows first) and ``experts.down_proj [E, H, I]``; the router is ``gate [E, H]``.
Checkpoints in the per-expert layout (``mlp.experts.N.gate_proj.weight``, Mixtral's
``block_sparse_moe.experts.N.w1/w3/w2.weight``) are routed into slices of them by
:func:`moe_destination`.

Qwen2-MoE adds a shared expert: a dense gated SiLU MLP (``shared_expert``, built by the
decoder as its dense MLP is, so its Linear layers take ordinary LoRA hooks) that every token
runs, its output scaled by ``sigmoid(shared_expert_gate(x))`` (a :class:`Linear` H -> 1) and
added to the routed experts' sum, on both paths (the shared expert is dense: it runs outside
the fused kernels).

LoRA: the router is a :class:`Linear` and takes the ordinary hook; each expert part
(``gate_up``, ``down``) takes an :class:`ExpertLoRAHook` that adds, for the rows an
expert runs on, the delta of each row's own adapter for that expert only.

Tensor parallelism (``shard`` and ``group`` given): every rank holds every expert, cut along
the intermediate dimension (its gate rows, its up rows, its down columns; see
``loraserve.runtime.distributed.sharding``), and the router whole. The residual stream is
the same on every rank, so every rank picks the same experts; each rank's output (expert
LoRA deltas included, the down delta from this rank's A columns) is a partial sum, completed
by one all-reduce per layer as a row-parallel projection's. The shared expert is cut as a
dense MLP (its gate and up rows, its down columns; no all-reduce of its own) and its gate is
whole: the gate's scalar scales each rank's partial output alike, so the shared expert's
partials join the same all-reduce. Both paths, torch and fused, read the intermediate size
from the weights they are given.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from loraserve.kernels import ForwardMode, model_ops
from loraserve.kernels import moe as moe_kernels

from .arch import ModelArchConfig
from .layers import Linear
from .layers.parallel import Collectives

if TYPE_CHECKING:
    from ..distributed.sharding import ShardPlan

EXPERT_PARTS = ("gate_up", "down")
"""The LoRA-targetable parts of every expert, in the order of the forward."""

# A per-expert checkpoint tensor: (layer prefix, expert, projection). Mixtral's published
# names (block_sparse_moe, w1 = gate, w3 = up, w2 = down) read as the Qwen names.
_PER_EXPERT = re.compile(
    r"^(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$"
)
_FUSED = re.compile(r"^(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)$")
_ROUTER = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.gate\.weight$")
MIXTRAL_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
"""Mixtral's published expert projection names -> the Qwen (and transformers) names."""


class ExpertLoRAHook(Protocol):
    def add(self, expert: int, x: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> None:
        """Add, in place into ``out``, the LoRA delta of ``expert`` for its input rows ``x``;
        ``rows``: those rows' indices in the batch (which adapter each row uses)."""

    def fused(self) -> tuple[torch.Tensor, torch.Tensor, moe_kernels.ExpertLoRA] | None:
        """``(token slots, scalings, this part's weights)`` for the fused kernels; None when
        no row of the batch uses an adapter."""


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k] float32, expert ids [T, k])`` from router logits: softmax in float32
    over every expert, the ``top_k`` largest, renormalised to sum to one when asked."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class MoEExperts(nn.Module):
    """``num_experts`` gated SiLU MLPs in two stacked weights, plus optional LoRA hooks
    (``lora_gate_up``, ``lora_down``) attached by the adapter pool."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, *, dtype: torch.dtype, device):
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden, intermediate
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate, hidden, dtype=dtype, device=device), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden, intermediate, dtype=dtype, device=device), requires_grad=False
        )
        self.lora_gate_up: ExpertLoRAHook | None = None
        self.lora_down: ExpertLoRAHook | None = None
        # persistent routing buffers (CUDA graphs); None: the fused path allocates per step
        self.buffers: moe_kernels.MoEBuffers | None = None

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``sum_k weights[t, k] * expert[ids[t, k]](x[t])`` for every row ``t``."""
        if moe_kernels.use_triton(x):
            return moe_kernels.fused_moe(
                x, self.gate_up_proj, self.down_proj, weights, ids, self._fused_lora(), self.buffers
            )
        out = torch.zeros_like(x)
        top_k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (row, k) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        flat_weights = weights.reshape(-1)
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            pairs = order[start : start + n]
            start += n
            rows = pairs // top_k
            y = self._expert(expert, x.index_select(0, rows), rows)
            y = (y.float() * flat_weights.index_select(0, pairs)[:, None]).to(out.dtype)
            out.index_add_(0, rows, y)
        return out

    def _fused_lora(self) -> moe_kernels.MoELoRA | None:
        """The batch's expert LoRA for the fused kernels (None: no row uses an adapter)."""
        parts: dict[str, moe_kernels.ExpertLoRA] = {}
        batch = None
        for name, hook in (("gate_up", self.lora_gate_up), ("down", self.lora_down)):
            got = None if hook is None else hook.fused()
            if got is not None:
                batch, parts[name] = got[:2], got[2]
        return None if batch is None else moe_kernels.MoELoRA(batch[0], batch[1], **parts)

    def _expert(self, expert: int, xe: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """One expert on its rows, each row's adapter delta included."""
        gate_up = F.linear(xe, self.gate_up_proj[expert])
        if self.lora_gate_up is not None:
            self.lora_gate_up.add(expert, xe, rows, gate_up)
        h = model_ops.silu_mul(gate_up)
        y = F.linear(h, self.down_proj[expert])
        if self.lora_down is not None:
            self.lora_down.add(expert, h, rows, y)
        return y


class SparseMoE(nn.Module):
    """Router (``gate``) plus experts: the MLP of an MoE layer.

    ``shard`` / ``group``: this rank's slice of every expert's intermediate dimension and the
    group whose all-reduce sums the ranks' partial outputs; without them, the whole layer.
    ``shared_expert``: the dense MLP every token runs beside its routed experts (Qwen2-MoE;
    required exactly when the config has one), whose output is this rank's partial sum
    under tensor parallelism (its down projection does not reduce).
    """

    def __init__(
        self,
        arch: ModelArchConfig,
        *,
        dtype: torch.dtype,
        device,
        shard: ShardPlan | None = None,
        group: Collectives | None = None,
        shared_expert: nn.Module | None = None,
    ):
        super().__init__()
        spec = arch.moe
        if spec is None:
            raise ValueError(f"{arch.architecture} has no mixture-of-experts block")
        if (shard is None) != (group is None):
            raise ValueError("a tensor-parallel MoE layer needs both its shard plan and its group")
        self.top_k, self.renormalize = spec.top_k, spec.norm_topk_prob
        self.gate = Linear(arch.hidden_size, (spec.num_experts,), bias=False, dtype=dtype, device=device)
        inter = spec.intermediate_size if shard is None else shard.local_moe_intermediate
        self.experts = MoEExperts(spec.num_experts, arch.hidden_size, inter, dtype=dtype, device=device)
        if (shared_expert is None) != (spec.shared_intermediate_size == 0):
            raise ValueError(
                f"{arch.architecture}: a shared expert is built exactly when the config has one "
                f"(shared_intermediate_size={spec.shared_intermediate_size})"
            )
        self.shared_expert = shared_expert
        self.shared_expert_gate = None
        if spec.shared_gated:
            self.shared_expert_gate = Linear(arch.hidden_size, (1,), bias=False, dtype=dtype, device=device)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        if self.group is not None:
            out = self.group.all_reduce(out)  # partial expert outputs (and their LoRA deltas) summed
        return out


def graph_buffers(
    model: nn.Module, mode: ForwardMode, max_bs: int, width: int, num_slots: int
) -> moe_kernels.MoEBuffers | None:
    """Routing buffers for every MoE layer of ``model`` (the layers run one after another)
    in a graph of ``max_bs`` requests of ``width`` rows, sized in token rows (a verify graph
    feeds ``max_bs * width``); None for a model without MoE layers."""
    layer = next((m for m in model.modules() if isinstance(m, SparseMoE)), None)
    if layer is None:
        return None
    experts = layer.experts
    return moe_kernels.MoEBuffers.for_graph(
        mode, max_bs, width, top_k=layer.top_k, num_experts=experts.num_experts, num_slots=num_slots,
        device=experts.gate_up_proj.device,
    )  # fmt: skip


@contextlib.contextmanager
def using_buffers(model: nn.Module, buffers: moe_kernels.MoEBuffers | None) -> Iterator[None]:
    """Every MoE layer of ``model`` routes into ``buffers`` inside the block (a graph's
    capture); eager forwards outside it size their own."""
    layers = [m.experts for m in model.modules() if isinstance(m, SparseMoE)]
    for experts in layers:
        experts.buffers = buffers
    try:
        yield
    finally:
        for experts in layers:
            experts.buffers = None


def moe_destination(params: dict[str, nn.Parameter], name: str) -> torch.Tensor | None:
    """Where a checkpoint's MoE tensor goes: a fused expert weight, one expert's slice of
    it (per-expert layouts), or the router; None for a name that is no MoE tensor here."""
    m = _ROUTER.match(name)
    if m:
        param = params.get(f"{m.group(1)}.mlp.gate.weight")
        return None if param is None else param.data
    m = _FUSED.match(name)
    if m:
        param = params.get(f"{m.group(1)}.mlp.experts.{m.group(2)}")
        return None if param is None else param.data
    m = _PER_EXPERT.match(name)
    if not m:
        return None
    prefix, expert, proj = m.group(1), int(m.group(2)), MIXTRAL_NAMES.get(m.group(3), m.group(3))
    fused = "down_proj" if proj == "down_proj" else "gate_up_proj"
    param = params.get(f"{prefix}.mlp.experts.{fused}")
    if param is None or expert >= param.shape[0]:
        return None
    if fused == "down_proj":
        return param.data[expert]
    half = param.shape[1] // 2
    return param.data[expert, :half] if proj == "gate_proj" else param.data[expert, half:]


def shard_moe_tensor(plan: ShardPlan, name: str, full: torch.Tensor) -> torch.Tensor | None:
    """This rank's slice of a checkpoint's (or a model's) expert tensor ``name``, in either
    layout (per expert, Mixtral's w1/w3/w2 included, or fused 3-D); None for any other name
    (the router among them: it is whole on every rank)."""
    m = _FUSED.match(name)
    if m:
        return plan.shard_expert_weight(m.group(2), full)
    m = _PER_EXPERT.match(name)
    if m:
        return plan.shard_expert_weight(MIXTRAL_NAMES.get(m.group(3), m.group(3)), full)
    return None


def moe_checkpoint_names(name: str, num_experts: int) -> list[str] | None:
    """The per-expert checkpoint names (Qwen spelling) a tensor ``name`` provides, so a
    checkpoint is complete in either layout; None for a name that is no expert weight."""
    m = _FUSED.match(name)
    if m:
        prefix, fused = m.group(1), m.group(2)
        projs = ("down_proj",) if fused == "down_proj" else ("gate_proj", "up_proj")
        return [f"{prefix}.mlp.experts.{e}.{p}.weight" for e in range(num_experts) for p in projs]
    m = _PER_EXPERT.match(name)
    if m:
        proj = MIXTRAL_NAMES.get(m.group(3), m.group(3))
        return [f"{m.group(1)}.mlp.experts.{m.group(2)}.{proj}.weight"]
    m = _ROUTER.match(name)
    if m:
        return [f"{m.group(1)}.mlp.gate.weight"]
    return None
