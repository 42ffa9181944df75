"""Oracle: the paged attention kernel (the CUDA default under ``auto``) on two
tensor-parallel ranks gives the single-device SDPA runner's logits.

Its own module: a process runs one tensor-parallel group at a time, and test_parity's
group lives for that whole module.
"""

from __future__ import annotations

import torch

from loraserve.runtime.runner.model_runner import ModelRunner

from .conftest import Pair, both, decode, extend, tp_config, tp_group, verify


def test_paged_two_ranks_match_sdpa(tp_assets):
    """``auto`` takes the paged kernel on CUDA, tensor-parallel groups included: each rank's
    kernel reads its own KV head (1 of 2 here, with its 2 query heads) from its own cache. Two
    ranks on the kernel (under the Triton interpreter) against one device on SDPA, through
    extend (SDPA on both), decode, verify and a rejected-draft truncation."""
    adapters = {n: tp_assets.adapters[n] for n in ("attn-r8", "all-r16")}
    with tp_group(tp_config(tp_assets.gqa, 2, adapters, attention="triton")) as (handle, runner):
        assert runner.attention_backend == "triton"
        pair = Pair(tp=runner, ref=ModelRunner(tp_config(tp_assets.gqa, 1, adapters)), handle=handle)
        assert pair.ref.attention_backend == "sdpa"
        gen = torch.Generator().manual_seed(11)
        rids, names = ["p0", "p1", "p2"], ["attn-r8", None, "all-r16"]
        prompts = [torch.randint(3, 512, (n,), generator=gen) for n in (7, 12, 3)]
        both(pair, extend, rids, prompts, names)
        both(pair, decode, rids, torch.randint(3, 512, (3,), generator=gen), names)
        both(pair, verify, rids, [torch.randint(3, 512, (4,), generator=gen) for _ in rids], names)
        for rid, rejected in zip(rids, (2, 0, 3), strict=True):
            pair.tp.kv.truncate(rid, rejected)
            pair.ref.kv.truncate(rid, rejected)
        both(pair, decode, rids, torch.randint(3, 512, (3,), generator=gen), names)
        for rid in rids:
            pair.tp.kv.free(rid)
            pair.ref.kv.free(rid)
