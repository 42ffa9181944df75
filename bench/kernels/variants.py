"""The backend variants a timing can force, by name, and how a call's path is described."""

from __future__ import annotations

from dataclasses import asdict, replace

from loraserve.kernels.overlap import OverlapMode
from loraserve.kernels.triton_backend import TritonLoRABackend
from loraserve.kernels.triton_ops import ExpandConfig, ShrinkConfig

# variant -> the join beside the base GEMM (None: the runtime's policy); default backend
OVERLAPS = {
    "overlap-auto": None,
    "overlap-delta": OverlapMode.DELTA,
    "overlap-shrink": OverlapMode.SHRINK,
    "overlap-mixed": "mixed",  # delta where the GEMM is long (gate_up, down), shrink elsewhere
    "overlap-auto-wide": None,  # the runtime's join with every tile at the pool's rank step (before run 9)
    "overlap-delta-carve16": OverlapMode.DELTA,  # cuBLAS told to leave 16 SMs to the side stream
    "overlap-delta-carve32": OverlapMode.DELTA,
    "overlap-shrink-carve16": OverlapMode.SHRINK,
    "tuned-shrink": OverlapMode.SHRINK,  # the tune phase's configurations, shrink join
}

# variants that take each module's configuration from the tune phase of the same run
TUNED = ("tuned", "tuned-shrink")

# variant -> SMs the base GEMMs leave free (torch's experimental cuBLAS SM carve-out); the
# base-only timing keeps every SM, so what the GEMMs lose shows in the increment
CARVEOUTS = {"overlap-delta-carve16": 16, "overlap-delta-carve32": 32, "overlap-shrink-carve16": 16}

MIXED_DELTA = ("gate_up", "down")  # the modules overlap-mixed joins by delta (their GEMMs are long)

# variants whose base GEMM is the Triton kernel (triton_ops/gemm_expand.py) instead of cuBLAS:
# "gemm-only" without LoRA (the kernel's own cost against cuBLAS), "epilogue" the shrink then
# the GEMM with the expand in its epilogue, "epilogue-auto" the delta join at <= 2 tiles (the
# runtime's choice there) and the epilogue above
TRITON_GEMM = ("gemm-only", "epilogue", "epilogue-auto")

EPILOGUE = ("default", "overlap-auto", *TRITON_GEMM)


class TweakedBackend(TritonLoRABackend):
    """The default backend with fields of its chosen shrink/expand configurations replaced."""

    def __init__(self, shrink: dict | None = None, expand: dict | None = None) -> None:
        super().__init__()
        self.shrink_tweak, self.expand_tweak = shrink or {}, expand or {}

    def shrink_config(self, *args, **kwargs) -> ShrinkConfig:
        """The default shrink configuration with the tweaked fields."""
        return replace(super().shrink_config(*args, **kwargs), **self.shrink_tweak)

    def expand_config(self, *args, **kwargs) -> ExpandConfig:
        """The default expand configuration with the tweaked fields."""
        return replace(super().expand_config(*args, **kwargs), **self.expand_tweak)


# The expand's column loop: the register prefetch of one block (reg, the default before run
# 10; still the single-launch kernel's loop) against Triton's pipeliner (cp.async, STAGES-1
# blocks ahead; the default since, extend tiles too since run 11), with other column groups
# or 256-wide blocks. Forced variants apply to every tile. Run 11 removed run 10's own
# choice (run10) and the CUDA-core expands for tiles of 1 / 4 live rows (row, row4): all
# three lost (bench/results/2026-12-06-kernels-h100-run11.md).
PIPELINED = {
    "reg": {"expand": {"pipeline_stages": 0}},
    "pipe2": {"expand": {"pipeline_stages": 2}},
    "pipe3": {"expand": {"pipeline_stages": 3}},
    "pipe4": {"expand": {"pipeline_stages": 4}},
    "pipe3-g1": {"expand": {"pipeline_stages": 3, "col_blocks": 1}},
    "pipe3-g4": {"expand": {"pipeline_stages": 3, "col_blocks": 4}},
    "pipe3-g8": {"expand": {"pipeline_stages": 3, "col_blocks": 8}},
    "pipe3-n256w8": {"expand": {"pipeline_stages": 3, "block_n": 256, "num_warps": 8}},
}

LAYER_PIPELINED = ("reg",)

OVERLAPS.update({f"overlap-auto-{name}": None for name in PIPELINED})

BACKENDS = {
    **{name: (lambda t=t: TweakedBackend(**t)) for name, t in PIPELINED.items()},
    **{f"overlap-auto-{name}": (lambda t=t: TweakedBackend(**t)) for name, t in PIPELINED.items()},
    "default": lambda: TritonLoRABackend(),
    "two-launch": lambda: TritonLoRABackend(fused=False),
    "fused": lambda: TritonLoRABackend(fused=True),
    "wide-rank": lambda: TritonLoRABackend(
        small_rank_block=0
    ),  # every tile at the pool's rank step (before run 9)
    "overlap-auto-wide": lambda: TritonLoRABackend(small_rank_block=0),
}


def describe(cfg) -> str:
    """A launch configuration as ``field=value`` pairs."""
    return ",".join(f"{k}={v}" for k, v in asdict(cfg).items())


def path_of(backend: TritonLoRABackend, info, x, B, offsets) -> str:
    """Which path ``apply`` takes for this module and batch: its configuration, described."""
    fc = backend.fused_config(info, x, B, offsets)
    if fc is not None:
        return "fused " + describe(fc)
    sc = backend.shrink_config(info, x, len(offsets) - 1, B.shape[2])
    ec = backend.expand_config(info, B, offsets)
    return f"two-launch shrink[{describe(sc)}] expand[{describe(ec)}]"
