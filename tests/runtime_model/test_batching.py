"""Batching oracles: a request's logits do not depend on what else is in its batch or how
its tokens were split across forwards."""

from __future__ import annotations

import pytest
import torch

from loraserve.kernels import ForwardMode
from loraserve.runtime.kv import KVCacheError
from loraserve.runtime.runner.forward_batch import ForwardBatch, ForwardBatchError

TOL = 1e-5


@pytest.fixture
def runner(assets, make_runner):
    names = ("attn-r8", "all-r16", "mlp-r4-rs")
    return make_runner(assets.models["llama-gqa"], adapters={n: assets.adapters[n] for n in names})


def _prompts(n_list, seed=0, vocab=512):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen) for n in n_list]


def test_mixed_batch_equals_each_request_alone(runner, ops):
    """3 adapters + base with different prompt lengths: batch == solo, in every mode."""
    names = ["attn-r8", None, "all-r16", "mlp-r4-rs", "attn-r8"]
    prompts = _prompts([7, 3, 12, 5, 9])
    rids = [f"m{i}" for i in range(5)]
    gen = torch.Generator().manual_seed(5)
    steps = [torch.randint(3, 512, (5,), generator=gen) for _ in range(2)]
    blocks = [torch.randint(3, 512, (4,), generator=gen) for _ in range(5)]

    batched = [ops.extend(runner, rids, prompts, names=names).logits]
    batched += [ops.decode(runner, rids, s, names=names).logits for s in steps]
    batched.append(ops.verify(runner, rids, blocks, names=names).logits.view(5, 4, -1))

    for i, name in enumerate(names):
        solo_id = f"solo{i}"
        solo = [ops.extend(runner, [solo_id], [prompts[i]], names=[name]).logits[0]]
        solo += [ops.decode(runner, [solo_id], s[i : i + 1], names=[name]).logits[0] for s in steps]
        solo.append(ops.verify(runner, [solo_id], [blocks[i]], names=[name]).logits)
        torch.testing.assert_close(batched[0][i], solo[0], atol=TOL, rtol=0)
        torch.testing.assert_close(batched[1][i], solo[1], atol=TOL, rtol=0)
        torch.testing.assert_close(batched[2][i], solo[2], atol=TOL, rtol=0)
        torch.testing.assert_close(batched[3][i], solo[3], atol=TOL, rtol=0)
    # the adapters matter: request 0 (attn-r8) and the same prompt on the base differ
    base = ops.extend(runner, ["b0"], [prompts[0]]).logits[0]
    assert (base - batched[0][0]).abs().max() > 1e-2


def test_chunked_extend_equals_one_shot(runner, ops):
    prompt = _prompts([23], seed=1)[0]
    one = ops.extend(runner, ["one"], [prompt], names=["all-r16"], all_logits=True).logits
    chunks = [prompt[:7], prompt[7:8], prompt[8:23]]
    outs = [ops.extend(runner, ["chunk"], [c], names=["all-r16"], all_logits=True).logits for c in chunks]
    torch.testing.assert_close(torch.cat(outs), one, atol=TOL, rtol=0)
    # a chunk batched with another request's first chunk behaves the same
    more = _prompts([6], seed=2)[0]
    nxt = torch.tensor([42])
    a = ops.decode(runner, ["one"], nxt, names=["all-r16"]).logits
    mixed = ops.extend(runner, ["chunk", "other"], [nxt, more], names=["all-r16", None]).logits
    torch.testing.assert_close(mixed[0], a[0], atol=TOL, rtol=0)
    assert runner.kv.seq_len("chunk") == runner.kv.seq_len("one") == 24


def test_verify_k_equals_k_decodes(runner, ops):
    prompts = _prompts([6, 10], seed=3)
    names = ["mlp-r4-rs", None]
    ops.extend(runner, ["v0", "v1"], prompts, names=names)
    ops.extend(runner, ["d0", "d1"], prompts, names=names)
    block = [torch.tensor([5, 9, 13, 17]), torch.tensor([100, 200, 300, 400])]
    ver = ops.verify(runner, ["v0", "v1"], block, names=names).logits.view(2, 4, -1)
    for j in range(4):
        dec = ops.decode(runner, ["d0", "d1"], torch.stack([block[0][j], block[1][j]]), names=names).logits
        torch.testing.assert_close(ver[:, j], dec, atol=TOL, rtol=0)


def test_truncate_reextend_equals_fresh(runner, ops):
    """Truncate then reextend equals never appended."""
    prompt = _prompts([8], seed=4)[0]
    ops.extend(runner, ["t"], [prompt], names=["attn-r8"])
    ops.extend(runner, ["ref"], [prompt], names=["attn-r8"])
    free_before = runner.kv.num_free_tokens
    ops.verify(runner, ["t"], [torch.tensor([11, 12, 13, 14])], names=["attn-r8"])  # all rejected
    runner.kv.truncate("t", 4)
    assert runner.kv.num_free_tokens == free_before
    accepted = torch.tensor([21, 22, 23])
    got = ops.extend(runner, ["t"], [accepted], names=["attn-r8"], all_logits=True).logits
    want = ops.extend(runner, ["ref"], [accepted], names=["attn-r8"], all_logits=True).logits
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)
    # partial acceptance: keep 2 of 4 verified tokens, then decode
    ops.verify(runner, ["t"], [torch.tensor([31, 32, 33, 34])], names=["attn-r8"])
    runner.kv.truncate("t", 2)
    ops.extend(runner, ["ref"], [torch.tensor([31, 32])], names=["attn-r8"])
    torch.testing.assert_close(
        ops.decode(runner, ["t"], [7], names=["attn-r8"]).logits,
        ops.decode(runner, ["ref"], [7], names=["attn-r8"]).logits,
        atol=TOL,
        rtol=0,
    )


def test_free_returns_every_token(runner, ops):
    free0 = runner.kv.num_free_tokens
    ops.extend(runner, ["f0", "f1"], _prompts([5, 9], seed=6))
    ops.decode(runner, ["f0", "f1"], [3, 4])
    assert runner.kv.num_free_tokens == free0 - 16
    runner.kv.free("f0")
    runner.kv.free("f0")  # idempotent
    runner.kv.free("f1")
    assert runner.kv.num_free_tokens == free0 and runner.kv.request_ids() == []


def test_bad_batches_refused(runner, ops):
    """Bad batches are refused and change nothing."""
    ops.extend(runner, ["keep"], [torch.tensor([4, 5, 6])])
    free = runner.kv.num_free_tokens
    cases = [
        ForwardBatch(ForwardMode.DECODE, ["keep"], torch.tensor([1, 2])),  # 2 ids for 1 request
        ForwardBatch(ForwardMode.TARGET_VERIFY, ["keep"], torch.tensor([1, 2])),  # no k
        ForwardBatch(ForwardMode.DECODE, ["keep"], torch.tensor([1]), extend_lens=[1]),  # extend_lens on decode
        ForwardBatch(ForwardMode.EXTEND, ["keep", "x"], torch.tensor([1]), extend_lens=[1, 0]),  # empty extend
        ForwardBatch(ForwardMode.DECODE, ["keep"], torch.tensor([10_000])),  # out of vocabulary
        ForwardBatch(ForwardMode.DECODE, ["keep", "keep"], torch.tensor([1, 2])),  # duplicate id
        ForwardBatch(ForwardMode.DECODE, ["keep"], torch.tensor([1]), hidden_layers=(9,)),  # no such layer
    ]
    for batch in cases:
        with pytest.raises(ForwardBatchError):
            runner.forward(batch)
    from loraserve.runtime.lora import AdapterNotFoundError

    with pytest.raises(AdapterNotFoundError):
        ops.decode(runner, ["keep"], [1], names=["nope"])
    with pytest.raises(KVCacheError, match="context limit"):
        ops.extend(runner, ["keep"], [torch.zeros(runner.kv.max_context_len, dtype=torch.int64)])
    assert runner.kv.num_free_tokens == free and runner.kv.request_ids() == ["keep"]
    assert runner.kv.seq_len("keep") == 3
