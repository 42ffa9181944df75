"""Programmatic dependent launch (Hopper and newer): overlap a kernel's launch with the
tail of the kernel before it.

A kernel launched with ``launch_pdl=True`` may start while its predecessor still runs;
it must call :func:`gdc_wait` before touching anything the predecessor (or, through the
same rule, anything earlier) produces or reads. The LoRA kernels call it first thing, so
only the launch latency is overlapped and stream-order semantics are kept.
"""

from __future__ import annotations

import torch
import triton

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_GDC = True
except ImportError:  # a Triton without grid-dependency control: PDL stays off
    HAS_GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


def pdl_supported(device: torch.device) -> bool:
    """PDL needs a CUDA device of compute capability 9.0+ and Triton's GDC ops."""
    if not HAS_GDC or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


__all__ = ["HAS_GDC", "gdc_launch_dependents", "gdc_wait", "pdl_supported"]
