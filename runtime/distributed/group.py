"""The tensor-parallel process group of one pod: who this rank is and the collectives it runs.

One process per GPU (NCCL), or per CPU rank (gloo). Three communicators:

- the *device* group (NCCL on GPU, gloo on CPU) carries the model's collectives: an
  all-reduce after every row-parallel layer and the embedding, an all-gather of logits;
- the *control* group (gloo, always on the host) carries rank 0's step descriptions to
  the other ranks; its timeout bounds how long a follower waits for the next one (rank 0
  sends heartbeats while idle);
- the *startup* group (gloo) carries the few exchanges made while loading, whose timeout
  must cover the slowest rank's weight loading.

Every collective has a timeout, so a dead or stuck rank surfaces as an error, never a hang.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .errors import TensorParallelError

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class TPGroup:
    """This process's place in the pod's tensor-parallel group."""

    rank: int
    size: int
    device: torch.device
    device_group: dist.ProcessGroup | None  # None: the default (world) group
    control_group: dist.ProcessGroup
    startup_group: dist.ProcessGroup

    @property
    def is_driver(self) -> bool:
        """Rank 0 schedules, samples and serves HTTP; the others follow it."""
        return self.rank == 0

    # ------------------------------------------------------------------ model collectives
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it."""
        dist.all_reduce(tensor, group=self.device_group)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """``[T, n]`` on every rank -> ``[T, size * n]``, rank r's columns at ``r*n:(r+1)*n``."""
        tensor = tensor.contiguous()
        out = tensor.new_empty(self.size * tensor.shape[0], *tensor.shape[1:])
        _all_gather_single(out, tensor, group=self.device_group)
        rows = tensor.shape[0]
        return out.view(self.size, rows, -1).permute(1, 0, 2).reshape(rows, -1)

    def all_gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """``[n, ...]`` on every rank -> ``[size * n, ...]``, rank r's rows at ``r*n:(r+1)*n``."""
        tensor = tensor.contiguous()
        out = tensor.new_empty(self.size * tensor.shape[0], *tensor.shape[1:])
        _all_gather_single(out, tensor, group=self.device_group)
        return out

    def broadcast_from_driver(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``tensor`` on every rank (in place), over the device group."""
        dist.broadcast(tensor, src=0, group=self.device_group)
        return tensor

    # ------------------------------------------------------------------ start-up exchanges
    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the ranks (e.g. the KV budget every rank can hold)."""
        t = torch.tensor([int(value)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.startup_group)
        return int(t.item())

    def check_same(self, what: str, value: int) -> None:
        """Raise unless every rank passes the same ``value`` (a cheap consistency check)."""
        t = torch.tensor([int(value), -int(value)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.startup_group)
        lo, hi = int(t[0]), -int(t[1])
        if lo != hi:
            raise TensorParallelError(f"tensor-parallel ranks disagree on {what}: values range {lo}..{hi}")


def init_group(
    *,
    rank: int,
    size: int,
    store: dist.Store,
    device: torch.device,
    collective_timeout_s: float,
    control_timeout_s: float,
    startup_timeout_s: float,
) -> TPGroup:
    """Join the pod's process group (blocks until every rank has joined, or times out)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device  # eager NCCL communicator set-up, on this rank's GPU
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=collective_timeout_s),
        **kwargs,
    )
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=control_timeout_s))
    startup = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=startup_timeout_s))
    return TPGroup(
        rank=rank, size=size, device=device, device_group=None, control_group=control, startup_group=startup
    )


def destroy_group() -> None:
    """Leave the process group (idempotent)."""
    if dist.is_initialized():
        dist.destroy_process_group()
