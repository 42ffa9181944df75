"""The Triton paged attention (decode and target-verify) against the SDPA path, and both
against a float64 reference with soft-capped scores (Gemma 2).

Both paths run through the same :class:`Attention` layer on copies of one random paged
cache: the SDPA path gathers each request's context and masks it, the kernel reads the
keys in place through the token table. Real Triton: compiled on a CUDA device when there
is one, under the interpreter on the CPU otherwise.
"""

from __future__ import annotations

import pytest
import torch

from loraserve.runtime.model.layers import Attention, build_attention_metadata
from loraserve.runtime.model.layers.attention import check_attention_backend
from loraserve.runtime.model.layers.paged_attention import BLOCK_N, choose_splits

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="a serving-sized case; needs a CUDA device"
)


def _case(gen, *, prefixes, width, heads, kv_heads, head_dim, dtype, context_cap, poison=True):
    """A cache with random keys, a token table whose rows hold random distinct slots, and
    this step's q/k/v. Entries past each request's context point at poisoned slots."""
    bs = len(prefixes)
    slots_total = 1 + sum(p + width for p in prefixes) + 64
    k_cache = torch.randn(slots_total, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(slots_total, kv_heads, head_dim, generator=gen).to(dtype)
    table = torch.zeros(bs + 2, context_cap, dtype=torch.int64)
    free = (torch.randperm(slots_total - 65, generator=gen) + 1).tolist()
    poisoned = list(range(slots_total - 64, slots_total))
    if poison:  # keys a kernel reading past a request's length would pick up
        k_cache[poisoned] = 1e4
        v_cache[poisoned] = 1e4
    rows = torch.randperm(bs, generator=gen) + 1  # row 0 stays the padding row
    out_loc = []
    for i, p in enumerate(prefixes):
        row = int(rows[i])
        n = p + width
        table[row, :n] = torch.tensor(free[:n])
        free = free[n:]
        table[row, n:] = torch.tensor(poisoned * (context_cap // 64 + 1))[: context_cap - n]
        out_loc.append(table[row, p:n])
    tokens = bs * width
    q = torch.randn(tokens, heads * head_dim, generator=gen).to(dtype)
    k = torch.randn(tokens, kv_heads * head_dim, generator=gen).to(dtype)
    v = torch.randn(tokens, kv_heads * head_dim, generator=gen).to(dtype)
    return k_cache, v_cache, table, rows, torch.tensor(prefixes), torch.cat(out_loc), q, k, v


def _run(backend, case, *, width, heads, kv_heads, head_dim, max_ctx, window=None):
    k_cache, v_cache, table, rows, prefixes, out_loc, q, k, v = (t.to(DEVICE) for t in case)
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    meta = build_attention_metadata(
        req_to_token=table,
        rows=rows,
        prefix_lens=prefixes,
        out_cache_loc=out_loc,
        max_q=width,
        max_ctx=max_ctx,
        groups=heads // kv_heads,
        sliding_window=window,
        backend=backend,
    )
    assert (meta.paged is not None) == (backend == "triton")
    out = Attention(heads, kv_heads, head_dim)(q, k, v, k_cache, v_cache, meta)
    return out, k_cache, v_cache


SHAPES = [
    # prefixes, width, heads, kv_heads, head_dim
    pytest.param([5], 1, 4, 2, 16, id="decode-bs1-gqa2"),
    pytest.param([0, 37, 130, 70], 1, 4, 1, 32, id="decode-bs4-mqa-multiblock"),
    pytest.param([3, 150, 64], 4, 4, 2, 16, id="verify4-gqa2"),
    pytest.param([90, 1], 6, 2, 2, 24, id="verify6-mha-headdim24"),
    pytest.param([200], 3, 8, 2, 16, id="verify3-groups4-long"),
    # Llama-3-8B's attention shape over long and short contexts in one batch
    pytest.param([3000, 900, 17], 6, 32, 8, 128, id="verify6-8b-shape", marks=ON_CUDA),
    pytest.param([3000, 1, 510, 64], 1, 32, 8, 128, id="decode-8b-shape", marks=ON_CUDA),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("prefixes", "width", "heads", "kv_heads", "head_dim"), SHAPES)
def test_paged_kernel_matches_sdpa(gen, dtype, prefixes, width, heads, kv_heads, head_dim):
    """Same outputs and the same cache writes as the SDPA path; keys past a request's
    length (poisoned with 1e4) never leak in, though the context bucket covers them."""
    cap = 4096 if DEVICE.type == "cuda" else 256
    case = _case(gen, prefixes=prefixes, width=width, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                 dtype=dtype, context_cap=cap)  # fmt: skip
    bucket = max(p + width for p in prefixes)
    bucket = 1 << (bucket - 1).bit_length()
    shape = dict(width=width, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    ref, k_ref, v_ref = _run("sdpa", case, max_ctx=bucket, **shape)
    got, k_got, v_got = _run("triton", case, max_ctx=bucket, **shape)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert torch.isfinite(got.float()).all()
    err = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < TOL[dtype], f"relative error {err:.2e}"
    assert torch.equal(k_got, k_ref) and torch.equal(v_got, v_ref)


def test_verify_queries_see_earlier_only(gen):
    """Query j of a verify block attends to the prefix and drafts 0..j: changing the value
    of the last draft changes the last query's output only."""
    shape = dict(width=4, heads=2, kv_heads=1, head_dim=16)
    case = _case(
        gen,
        prefixes=[9, 20],
        dtype=torch.float32,
        context_cap=64,
        **{k: shape[k] for k in ("width", "heads", "kv_heads", "head_dim")},
    )
    out_a, _, _ = _run("triton", case, max_ctx=32, **shape)
    k_cache, v_cache, table, rows, prefixes, out_loc, q, k, v = case
    v2 = v.clone()
    v2.view(2, 4, -1)[:, 3] += 5.0  # the last draft's value, both requests
    out_b, _, _ = _run(
        "triton", (k_cache, v_cache, table, rows, prefixes, out_loc, q, k, v2), max_ctx=32, **shape
    )
    diff = (out_a - out_b).abs().view(2, 4, -1).amax(-1)
    assert (diff[:, :3] == 0).all(), "an earlier query saw a later draft"
    assert (diff[:, 3] > 0).all()


def test_sliding_window_matches_sdpa(gen):
    shape = dict(width=3, heads=4, kv_heads=2, head_dim=16)
    case = _case(gen, prefixes=[150, 20], dtype=torch.float32, context_cap=256, **shape)
    ref, _, _ = _run("sdpa", case, max_ctx=256, window=40, **shape)
    got, _, _ = _run("triton", case, max_ctx=256, window=40, **shape)
    full, _, _ = _run("triton", case, max_ctx=256, **shape)
    assert ((got - ref).norm() / ref.norm()).item() < TOL[torch.float32]
    assert not torch.allclose(got, full), "the window changed nothing: it is not applied"


def test_splits_cover_context(gen, monkeypatch):
    """The context is cut into ranges combined by their log-sum-exp: one range or many give
    the same output."""
    import loraserve.runtime.model.layers.paged_attention as pa

    shape = dict(width=2, heads=2, kv_heads=1, head_dim=16)
    case = _case(gen, prefixes=[300], dtype=torch.float32, context_cap=512, **shape)
    outs = []
    for sms in (1, 64):
        monkeypatch.setattr(pa, "_INTERPRETER_SMS", sms)
        outs.append(_run("triton", case, max_ctx=512, **shape)[0])
    assert choose_splits(1, 1, 512, torch.device("cpu")) == 512 // BLOCK_N
    assert ((outs[0] - outs[1]).norm() / outs[0].norm()).item() < 1e-5


def test_backend_choice_checked(monkeypatch):
    """Backend choice is checked naming the field."""
    with pytest.raises(ValueError, match="attention_backend must be one of auto, sdpa, triton"):
        check_attention_backend("flash", torch.device("cpu"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(
        ValueError, match=r"attention_backend=triton needs a CUDA device.*use attention_backend=sdpa"
    ):
        check_attention_backend("triton", torch.device("cpu"))
    check_attention_backend("sdpa", torch.device("cpu"))


@pytest.mark.parametrize("architecture", ["llama", "mistral"])
def test_paged_runner_matches_sdpa(tmp_path, architecture):
    """Whole forwards (prefill on SDPA for both, then decode and target-verify) give the
    same logits on either backend; mistral with a 6-token window shorter than the prompts."""
    import json

    from loraserve.kernels import ForwardMode
    from loraserve.runtime.contract.config import RuntimeConfig
    from loraserve.runtime.dev.devmodels import build_tiny_model
    from loraserve.runtime.runner.forward_batch import ForwardBatch
    from loraserve.runtime.runner.model_runner import ModelRunner

    model = build_tiny_model(tmp_path / architecture, architecture=architecture, seed=5)
    if architecture == "mistral":
        cfg = json.loads((model / "config.json").read_text())
        cfg["sliding_window"] = 6
        (model / "config.json").write_text(json.dumps(cfg))
    logits = {}
    for backend in ("sdpa", "triton"):
        config = RuntimeConfig()
        config.model.path = str(model)
        config.device = DEVICE.type
        config.model.dtype = "float32"
        config.attention_backend = backend
        config.scheduler.max_total_tokens = 512
        runner = ModelRunner(config)
        gen = torch.Generator().manual_seed(3)
        prompts = [torch.randint(0, 512, (n,), generator=gen) for n in (9, 70)]
        rids = ["a", "b"]
        runner.forward(ForwardBatch(ForwardMode.EXTEND, rids, torch.cat(prompts), extend_lens=[9, 70]))
        dec = runner.forward(ForwardBatch(ForwardMode.DECODE, rids, torch.tensor([7, 8]))).logits
        block = torch.randint(0, 512, (2 * 4,), generator=gen)
        ver = runner.forward(ForwardBatch(ForwardMode.TARGET_VERIFY, rids, block, num_draft_tokens=4)).logits
        logits[backend] = (dec, ver)
    for ref, got in zip(logits["sdpa"], logits["triton"], strict=True):
        torch.testing.assert_close(got, ref, atol=2e-4, rtol=0)


def _random_tree(gen, bs: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random trees of ``width`` nodes (node 0 the root, parents before children): their
    depths ``[bs, width]`` and ancestor masks ``[bs, width, width]`` (a node sees itself)."""
    from loraserve.runtime.speculative.tree import ancestor_closure

    parents = torch.full((bs, width), -1, dtype=torch.long)
    for n in range(1, width):
        parents[:, n] = torch.randint(0, n, (bs,), generator=gen)
    depths = torch.zeros_like(parents)
    for n in range(1, width):
        depths[:, n] = depths.gather(1, parents[:, n : n + 1]).squeeze(1) + 1
    return depths, ancestor_closure(parents, int(depths.max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("prefixes", "width", "heads", "kv_heads"), [([4, 90, 33], 7, 4, 2), ([130], 16, 8, 2)]
)
def test_paged_tree_verify_matches_sdpa(gen, dtype, prefixes, width, heads, kv_heads):
    """A draft tree's verify: each node sees the prefix and its own ancestors (not its
    siblings, not later nodes); the kernel gives the SDPA tree path's outputs and positions."""
    head_dim = 16
    case = _case(gen, prefixes=prefixes, width=width, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                 dtype=dtype, context_cap=256)  # fmt: skip
    depths, ancestors = _random_tree(gen, len(prefixes), width)
    causal = torch.ones(width, width, dtype=torch.bool).tril().expand_as(ancestors)
    assert not torch.equal(ancestors, causal), "the trees are chains: nothing is tested beyond causality"
    k_cache, v_cache, table, rows, prefix_lens, out_loc, q, k, v = (t.to(DEVICE) for t in case)
    outs, positions = {}, {}
    for backend in ("sdpa", "triton"):
        meta = build_attention_metadata(
            req_to_token=table, rows=rows, prefix_lens=prefix_lens, out_cache_loc=out_loc, max_q=width,
            max_ctx=256, groups=heads // kv_heads, backend=backend,
            tree_depths=depths.to(DEVICE), tree_ancestors=ancestors.to(DEVICE),
        )  # fmt: skip
        assert (meta.paged is not None) == (backend == "triton")
        attn = Attention(heads, kv_heads, head_dim)
        outs[backend] = attn(q, k, v, k_cache.clone(), v_cache.clone(), meta)
        positions[backend] = meta.positions
    assert torch.equal(positions["triton"], positions["sdpa"])
    ref, got = outs["sdpa"].double(), outs["triton"].double()
    assert torch.isfinite(got).all()
    assert ((got - ref).norm() / ref.norm()).item() < TOL[dtype]
    # and it is not the causal chain's attention over the same block
    chain, _, _ = _run(
        "triton", case, width=width, heads=heads, kv_heads=kv_heads, head_dim=head_dim, max_ctx=256
    )
    differs = (ancestors != causal).any(-1).reshape(-1).to(ref.device)  # the rows a tree changes
    off = ((chain.double() - ref)[differs].norm() / ref[differs].norm()).item()
    assert off > 10 * TOL[dtype]


def test_wide_uniform_batches_take_the_sdpa_path(gen):
    """A single-request prefill captured as a uniform batch (512 new tokens) would give one
    program thousands of query rows: under ``triton`` it takes the SDPA path and still
    attends causally, and the kernel itself refuses it with the reason named."""
    from loraserve.runtime.model.layers.paged_attention import (
        MAX_QUERY_ROWS,
        PagedAttentionInputs,
        fits,
        paged_attention,
    )

    heads, kv_heads, head_dim = 4, 1, 16
    width = MAX_QUERY_ROWS // (heads // kv_heads) + 1
    assert fits(heads // kv_heads, width - 1) and not fits(heads // kv_heads, width)
    case = _case(gen, prefixes=[7], width=width, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                 dtype=torch.float32, context_cap=256)  # fmt: skip
    k_cache, v_cache, table, rows, prefixes, out_loc, q, k, v = (t.to(DEVICE) for t in case)
    meta = build_attention_metadata(
        req_to_token=table, rows=rows, prefix_lens=prefixes, out_cache_loc=out_loc, max_q=width, max_ctx=256,
        groups=heads // kv_heads, backend="triton",
    )  # fmt: skip
    assert meta.paged is None and meta.mask is not None
    wide = PagedAttentionInputs(
        req_to_token=table, rows=rows, prefix_lens=prefixes, width=width, max_context=256
    )
    with pytest.raises(ValueError, match="query rows exceed"):
        paged_attention(q.view(width, heads, head_dim), k_cache, v_cache, wide, scale=head_dim**-0.5)
    # The first token sees only the prefix and itself: changing the last token's value leaves it alone.
    out_a = Attention(heads, kv_heads, head_dim)(q, k, v, k_cache.clone(), v_cache.clone(), meta)
    v2 = v.clone()
    v2[-1] += 5.0
    out_b = Attention(heads, kv_heads, head_dim)(q, k, v2, k_cache.clone(), v_cache.clone(), meta)
    assert torch.equal(out_a[:-1], out_b[:-1]) and not torch.equal(out_a[-1], out_b[-1])


def test_auto_takes_the_paged_kernel_on_cuda_only(monkeypatch):
    """``auto`` (the default) resolves to the paged kernel on a CUDA device with triton
    installed and to SDPA on the CPU, even under the interpreter; explicit choices stay."""
    from loraserve.runtime.model.layers import attention

    assert attention.resolve_attention_backend("auto", torch.device("cuda", 0)) == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert attention.resolve_attention_backend("auto", torch.device("cpu")) == "sdpa"
    assert attention.resolve_attention_backend("triton", torch.device("cpu")) == "triton"
    monkeypatch.setattr(attention.importlib.util, "find_spec", lambda name: None)
    assert attention.resolve_attention_backend("auto", torch.device("cuda", 0)) == "sdpa"
    check_attention_backend("auto", torch.device("cpu"))


def _capped_reference(case, *, width, heads, kv_heads, head_dim, scale, softcap, window=None, ancestors=None):
    """Soft-capped attention in float64, one request at a time: scores ``c * tanh(s / c)``,
    then the causal (or tree) mask and the window, softmax, values. ``[bs * width, heads * hd]``."""
    k_cache, v_cache, table, rows, prefixes, out_loc, q, k, v = case
    k_cache, v_cache = k_cache.double().clone(), v_cache.double().clone()
    k_cache[out_loc] = k.double().view(-1, kv_heads, head_dim)
    v_cache[out_loc] = v.double().view(-1, kv_heads, head_dim)
    g = heads // kv_heads
    outs = []
    for b, p in enumerate(prefixes.tolist()):
        slots = table[int(rows[b]), : p + width]
        keys = k_cache[slots].repeat_interleave(g, dim=1)  # [n, heads, hd]
        values = v_cache[slots].repeat_interleave(g, dim=1)
        qb = q.double().view(-1, width, heads, head_dim)[b]  # [width, heads, hd]
        s = torch.einsum("qhd,khd->hqk", qb, keys) * scale
        s = torch.tanh(s / softcap) * softcap
        key = torch.arange(p + width)
        if ancestors is None:
            q_pos = p + torch.arange(width)
            allowed = key[None, :] <= q_pos[:, None]
        else:
            node = (key - p).clamp(min=0)
            q_pos = p + torch.arange(width)  # unused by trees (no window there)
            allowed = (key[None, :] < p) | ancestors[b][:, node]
        if window is not None:
            allowed &= key[None, :] > q_pos[:, None] - window
        s = s.masked_fill(~allowed[None], float("-inf"))
        out = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), values)
        outs.append(out.reshape(width, heads * head_dim))
    return torch.cat(outs)


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
@pytest.mark.parametrize(
    ("prefixes", "width", "window"),
    [
        pytest.param([5, 130], 1, None, id="decode"),
        pytest.param([0, 70], 6, None, id="verify6-and-extend-from-0"),
        pytest.param([150, 20], 3, 40, id="verify3-window"),
    ],
)
def test_softcap_matches_float64_reference(gen, backend, prefixes, width, window):
    """Scores capped at ``c * tanh(s / c)`` before the mask, in the SDPA path and the paged
    kernel alike; a cap this small bends them: the uncapped outputs are far off."""
    shape = dict(width=width, heads=4, kv_heads=2, head_dim=16)
    case = _case(gen, prefixes=prefixes, dtype=torch.float32, context_cap=256, **shape)
    ref = _capped_reference(case, scale=0.25, softcap=1.0, window=window, **shape)
    k_cache, v_cache, table, rows, prefix_lens, out_loc, q, k, v = (t.to(DEVICE) for t in case)
    meta = build_attention_metadata(
        req_to_token=table, rows=rows, prefix_lens=prefix_lens, out_cache_loc=out_loc, max_q=width,
        max_ctx=256, groups=2, sliding_window=window, backend=backend,
    )  # fmt: skip
    assert (meta.paged is not None) == (backend == "triton")
    attn = Attention(4, 2, 16)
    attn.scale, attn.softcap = 0.25, 1.0
    got = attn(q, k, v, k_cache.clone(), v_cache.clone(), meta).double().cpu()
    assert ((got - ref).norm() / ref.norm()).item() < TOL[torch.float32]
    attn.softcap = None
    plain = attn(q, k, v, k_cache.clone(), v_cache.clone(), meta).double().cpu()
    assert ((plain - ref).norm() / ref.norm()).item() > 100 * TOL[torch.float32]


def test_softcap_tree_verify_matches_float64_reference(gen):
    """A draft tree's verify through the paged kernel, scores capped before the tree mask."""
    prefixes, width, heads, kv_heads, head_dim = [4, 90], 7, 4, 2, 16
    case = _case(gen, prefixes=prefixes, width=width, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                 dtype=torch.float32, context_cap=256)  # fmt: skip
    depths, ancestors = _random_tree(gen, len(prefixes), width)
    ref = _capped_reference(case, width=width, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                            scale=0.25, softcap=1.0, ancestors=ancestors)  # fmt: skip
    k_cache, v_cache, table, rows, prefix_lens, out_loc, q, k, v = (t.to(DEVICE) for t in case)
    meta = build_attention_metadata(
        req_to_token=table, rows=rows, prefix_lens=prefix_lens, out_cache_loc=out_loc, max_q=width,
        max_ctx=256, groups=heads // kv_heads, backend="triton",
        tree_depths=depths.to(DEVICE), tree_ancestors=ancestors.to(DEVICE),
    )  # fmt: skip
    assert meta.paged is not None
    attn = Attention(heads, kv_heads, head_dim)
    attn.scale, attn.softcap = 0.25, 1.0
    got = attn(q, k, v, k_cache.clone(), v_cache.clone(), meta).double().cpu()
    assert ((got - ref).norm() / ref.norm()).item() < TOL[torch.float32]
