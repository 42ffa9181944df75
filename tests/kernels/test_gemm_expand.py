"""The base GEMM with the LoRA expand in its epilogue, against float64 (interpreter on CPU, GPU if present).

Small but odd shapes: N and K that no block divides, column tiles that straddle slice
boundaries, ranks below the pool rank, base-model rows mixed into every tile, several row
tiles, non-contiguous views, both B layouts, and the shrink's split-K partial sums with
NaN wherever they are unwritten (rows of slot -1, columns past a slot's rank).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from loraserve.kernels import ForwardMode, build_batch_info
from loraserve.kernels.triton_backend import TritonLoRABackend
from loraserve.kernels.triton_ops import ShrinkConfig
from loraserve.kernels.triton_ops.configs import GEMM_SMEM_BYTES, GemmConfig, cdiv, gemm_config
from loraserve.kernels.triton_ops.gemm_expand import gemm_linear, launch_gemm_expand

TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}
SMALL = GemmConfig(block_m=16, block_n=16, block_k=32)


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


class Case:
    """Random inputs for one module: x, W, bias, B, the batch info and a poisoned stage."""

    def __init__(
        self, gen, device, *, mode, slots, widths, ranks, max_rank, in_dim, dtype=torch.float32, split=1,
        rank_major=False, bias=True, strided_x=False, **kwargs,
    ):  # fmt: skip
        self.dtype = dtype
        self.offsets = tuple(itertools.accumulate(widths, initial=0))
        self.max_rank = max_rank
        self.ranks = list(ranks)
        n, k, num_slices = self.offsets[-1], in_dim, len(widths)
        scalings = [0.25 + torch.rand(1, generator=gen).item() for _ in ranks]
        self.info = build_batch_info(mode, slots, ranks, scalings, device=device, **kwargs)
        T = self.info.total_tokens
        x = torch.randn(T, k + 7 if strided_x else k, generator=gen).to(device, dtype)
        self.x = x[:, 3 : 3 + k] if strided_x else x  # a column slice: row stride != K
        self.W = (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)
        self.bias = torch.randn(n, generator=gen).to(device, dtype) if bias else None
        B = (torch.randn(len(ranks), n, max_rank, generator=gen) / max_rank**0.5).to(device, dtype)
        # Rank-major storage B_phys[slots, R, N], passed transposed as the runtime does.
        self.B = B.transpose(1, 2).contiguous().transpose(1, 2) if rank_major else B
        # Split-K partials where the shrink writes them (live rows, columns below the rank), NaN elsewhere.
        stage = torch.full((split, T, num_slices * max_rank), float("nan"))
        for t, slot in enumerate(self.info.token_slots.tolist()):
            if slot >= 0:
                for s in range(num_slices):
                    cols = slice(s * max_rank, s * max_rank + ranks[slot])
                    stage[:, t, cols] = torch.randn(split, ranks[slot], generator=gen)
        self.stage = stage.to(device)

    def reference(self, stage: torch.Tensor | None = None) -> torch.Tensor:
        """float64 ``x @ Wᵀ + bias + delta``, the delta row by row from each row's slot alone."""
        ref = self.x.double().cpu() @ self.W.double().cpu().T
        if self.bias is not None:
            ref += self.bias.double().cpu()
        stage = self.stage if stage is None else stage
        xa = stage.double().cpu()
        xa = xa.sum(0) if xa.dim() == 3 else xa
        B = self.B.double().cpu()
        scalings = self.info.scalings.double().cpu()
        R = self.max_rank
        for t, slot in enumerate(self.info.token_slots.tolist()):
            if slot < 0 or self.ranks[slot] == 0:
                continue
            r = self.ranks[slot]
            for s, (lo, hi) in enumerate(itertools.pairwise(self.offsets)):
                ref[t, lo:hi] += scalings[slot] * (xa[t, s * R : s * R + r] @ B[slot, lo:hi, :r].T)
        return ref

    def run(self, config: GemmConfig = SMALL, stage: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        stage = self.stage if stage is None else stage
        return launch_gemm_expand(
            self.x, self.W, self.bias, stage, self.B, self.info, self.offsets, config, **kwargs
        )

    def check(self, out: torch.Tensor, tol: float | None = None) -> None:
        tol = tol or TOL[self.dtype]
        ref = self.reference()
        assert out.dtype == self.dtype and out.shape == ref.shape
        assert torch.isfinite(out).all(), "a NaN of the stage's unwritten entries was read"
        assert rel_error(out, ref) < tol
        row_err = (out.double().cpu() - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-30)
        assert row_err.max().item() < 4 * tol, f"a row is wrong (row error {row_err.max().item():.2e})"


SCENARIOS = {
    # Decode: mixed slots in original row order (rank 4 and 8 in a rank-8 pool, base rows),
    # odd N and K, a row tile and a half.
    "decode": dict(
        mode=ForwardMode.DECODE, slots=[1, -1, 0, 2, 0, -1, 1, 1, 2, 0, -1, 0, 2, 1, -1, 0, 2, 1, 0],
        widths=(37,), ranks=[4, 8, 8], max_rank=8, in_dim=45,
    ),
    # Verify: uniform segments of k = 3; QKV of unequal widths, boundaries inside column tiles.
    "verify-qkv": dict(
        mode=ForwardMode.TARGET_VERIFY, num_draft_tokens=3, slots=[0, 2, -1, 1, 0, 2, 1],
        widths=(37, 13, 11), ranks=[8, 4, 8], max_rank=8, in_dim=40,
    ),
    # Extend: uneven segments (one empty), a rank-0 slot, rank 16 and 3 in a rank-16 pool
    # (two unrolled rank groups), gate/up's two equal slices.
    "extend-gate-up": dict(
        mode=ForwardMode.EXTEND, extend_lens=[7, 0, 9, 3, 5], slots=[0, 1, 2, -1, 1],
        widths=(24, 24), ranks=[16, 3, 0], max_rank=16, in_dim=33,
    ),
}  # fmt: skip


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_matches_float64(name, dtype, gen, device):
    case = Case(gen, device, dtype=dtype, **SCENARIOS[name])
    case.check(case.run())


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("rank_major", [False, True], ids=["row-major-B", "rank-major-B"])
def test_stage_splits_and_b_layouts(rank_major, split, gen, device):
    """The partial sums are added as they are loaded; both B layouts give one function."""
    case = Case(gen, device, split=split, rank_major=rank_major, **SCENARIOS["verify-qkv"])
    assert case.B.stride(1) == (1 if rank_major else case.max_rank)
    case.check(case.run(GemmConfig(block_m=16, block_n=32, block_k=16)))


def test_two_dimensional_xa(gen, device):
    """``xa`` itself ``[T, slices*rank]`` (split 1 without the leading dim), NaN where unwritten."""
    case = Case(gen, device, **SCENARIOS["extend-gate-up"])
    case.stage = case.stage[0]
    case.check(case.run())


@pytest.mark.parametrize(
    "config",
    [GemmConfig(block_m=32, block_n=64, block_k=64), GemmConfig(block_m=16, block_n=16, block_k=16)],
    ids=["one-row-tile-wide-cols", "small-blocks"],
)
def test_configs_and_views(config, gen, device):
    """Non-contiguous x, no bias, K not a multiple of the block (or one masked step), and
    ``out=`` a column slice of a wider buffer whose other columns stay untouched."""
    case = Case(gen, device, bias=False, strided_x=True, rank_major=True, split=3, **SCENARIOS["decode"])
    assert not case.x.is_contiguous()
    wide = torch.randn(case.info.total_tokens, 50, generator=gen).to(device, case.dtype)
    before = wide.clone()
    out = case.run(config, out=wide[:, 5:42])
    assert out.data_ptr() == wide[:, 5:42].data_ptr()
    case.check(out)
    assert torch.equal(wide[:, :5], before[:, :5]) and torch.equal(wide[:, 42:], before[:, 42:])


def test_default_config(gen, device):
    case = Case(gen, device, dtype=torch.bfloat16, **SCENARIOS["verify-qkv"])
    n, k = case.W.shape
    case.check(case.run(gemm_config(case.info.total_tokens, n, k, case.dtype, num_sms=4)))


def test_base_only_rows_equal_the_plain_gemm(gen, device):
    """All rows on the base model: no epilogue work, output bit-equal to ``gemm_linear``."""
    case = Case(gen, device, dtype=torch.bfloat16, **{**SCENARIOS["verify-qkv"], "slots": [-1] * 5})
    assert case.stage.isnan().all()
    out = case.run()
    case.check(out)
    assert torch.equal(out, gemm_linear(case.x, case.W, case.bias, SMALL))


def test_with_the_backends_shrink_stage(gen, device, oracle):
    """End to end: the real shrink's split-K partial sums feed the epilogue."""
    case = Case(gen, device, **SCENARIOS["verify-qkv"])
    num_slices = len(case.offsets) - 1
    A = (torch.randn(3, num_slices * case.max_rank, case.x.shape[1], generator=gen) / 8).to(device)
    backend = TritonLoRABackend(shrink_config=ShrinkConfig(block_n=16, block_k=16, split_k=2))
    stage = backend.shrink_stage(case.x, A, case.info, num_slices)
    assert stage.shape[0] == 2
    out = case.run(stage=stage)
    ref = case.x.double().cpu() @ case.W.double().cpu().T + case.bias.double().cpu()
    ref += oracle(case.x, A, case.B, case.info.token_slots.tolist(), case.ranks,
                  case.info.scalings.tolist(), case.offsets)  # fmt: skip
    assert rel_error(out, ref) < TOL[torch.float32]


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)
def test_gemm_linear_matches_float64(dtype, gen, device):
    """No LoRA: ``x @ Wᵀ (+ bias)`` with odd shapes, a strided x and a row slice of a wider W."""
    x = torch.randn(21, 60, generator=gen).to(device, dtype)[:, 5:56]
    W = (torch.randn(80, 51, generator=gen) / 7).to(device, dtype)[3:70]
    bias = torch.randn(67, generator=gen).to(device, dtype)
    ref = x.double().cpu() @ W.double().cpu().T
    for b in (None, bias):
        out = gemm_linear(x, W, b, GemmConfig(block_m=16, block_n=32, block_k=32))
        assert out.shape == (21, 67) and out.dtype == dtype
        assert rel_error(out, ref + (0 if b is None else b.double().cpu())) < TOL[dtype]


def test_empty_batch(gen, device):
    x = torch.randn(0, 16, generator=gen).to(device)
    W = torch.randn(8, 16, generator=gen).to(device)
    assert gemm_linear(x, W, None, SMALL).shape == (0, 8)


def test_bad_arguments_are_named(gen, device):
    case = Case(gen, device, **SCENARIOS["verify-qkv"])
    n = case.W.shape[0]
    args = (case.x, case.W, case.bias, case.stage, case.B, case.info, case.offsets, SMALL)

    def call(**changes):
        names = ["x", "weight", "bias", "stage", "B", "info", "slice_offsets", "config"]
        kw = dict(zip(names, args, strict=True)) | changes
        return launch_gemm_expand(*(kw[k] for k in names), out=kw.get("out"))

    with pytest.raises(ValueError, match="weight must be"):
        call(weight=case.W[:, :-1])
    with pytest.raises(ValueError, match="bias must be"):
        call(bias=case.bias[:-1])
    with pytest.raises(ValueError, match="out must be"):
        call(out=torch.empty(case.info.total_tokens, n + 1, device=device))
    with pytest.raises(ValueError, match="xa must be"):
        call(stage=case.stage[..., :-1])
    with pytest.raises(ValueError, match="B must be"):
        call(B=case.B[0])
    with pytest.raises(ValueError, match="slice_offsets"):
        call(slice_offsets=(0, 10, n - 1))
    with pytest.raises(ValueError, match="1 to 3"):
        call(slice_offsets=(0, 10, 20, 30, n), stage=torch.zeros(case.info.total_tokens, 32, device=device))
    with pytest.raises(ValueError, match="weight dtype"):
        call(weight=case.W.half())
    with pytest.raises(ValueError, match="max_rank is 4"):
        call(B=case.B[..., :4].contiguous(), stage=case.stage[..., :12])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 8, 16, 32, 64, 128, 256])
def test_gemm_config_heuristic(tokens, dtype):
    """Pure: tiles ``tl.dot`` accepts; >= 2 programs per SM unless the column tile is at
    its floor (half the tokens, so x's L2 re-reads stay within twice W); pipeline buffers
    within the shared-memory budget; at the serving shapes."""
    sms = 132
    elem = 4 if dtype == torch.float32 else 2
    for n, k in itertools.product([1024, 4096, 6144, 14336, 28672], [4096, 14336]):
        cfg = gemm_config(tokens, n, k, dtype, sms)
        assert cfg.block_m in (16, 32, 64, 128) and cfg.block_m >= min(tokens, 128)
        assert cfg.block_n in (16, 32, 64, 128) and cfg.block_n >= min(128, tokens // 2)
        assert 16 <= cfg.block_k <= 256
        floor = max(16, min(128, tokens // 2))
        programs = cdiv(tokens, cfg.block_m) * cdiv(n, cfg.block_n)
        assert programs >= 2 * sms or cfg.block_n == floor
        smem = cfg.num_stages * (cfg.block_m + cfg.block_n) * cfg.block_k * elem
        assert cfg.num_stages >= 2 and smem <= GEMM_SMEM_BYTES
