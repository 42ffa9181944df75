"""Triton kernels of the LoRA ops: segmented shrink and fused, sliced expand."""

from .configs import ExpandConfig, ShrinkConfig, pick_expand, pick_shrink
from .expand import launch_expand
from .shrink import launch_shrink

__all__ = ["ExpandConfig", "ShrinkConfig", "launch_expand", "launch_shrink", "pick_expand", "pick_shrink"]
