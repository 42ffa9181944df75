"""Triton kernels of the LoRA ops: segmented shrink, fused sliced expand, and both in one launch."""

from .configs import ExpandConfig, FusedConfig, ShrinkConfig, pick_expand, pick_fused, pick_shrink
from .expand import launch_expand
from .fused import launch_fused
from .shrink import launch_shrink

__all__ = [
    "ExpandConfig",
    "FusedConfig",
    "ShrinkConfig",
    "launch_expand",
    "launch_fused",
    "launch_shrink",
    "pick_expand",
    "pick_fused",
    "pick_shrink",
]
