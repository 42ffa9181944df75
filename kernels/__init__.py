"""LoRA ops for multi-adapter batches: batch metadata, one backend interface, two backends.

``get_backend("torch")`` is the reference (any device); ``get_backend("triton")`` runs the
Triton kernels (CUDA, or CPU under ``TRITON_INTERPRET=1``). Knows nothing of requests,
HTTP or Kubernetes.
"""

from .backend import LoRABackend
from .forward_mode import ForwardMode, token_counts
from .graph_metadata import GraphLoRAMetadata
from .metadata import LoRABatchInfo, build_batch_info
from .overlap import OverlapMode, OverlapPolicy, linear_with_lora
from .reference import TorchLoRABackend

__all__ = [
    "ForwardMode",
    "GraphLoRAMetadata",
    "LoRABackend",
    "LoRABatchInfo",
    "OverlapMode",
    "OverlapPolicy",
    "TorchLoRABackend",
    "build_batch_info",
    "get_backend",
    "linear_with_lora",
    "token_counts",
]


def get_backend(name: str = "auto", device: str = "cpu") -> LoRABackend:
    """Return a backend by name; ``auto`` picks Triton on CUDA, the torch reference elsewhere."""
    if name == "auto":
        name = "triton" if str(device).startswith("cuda") else "torch"
    if name == "torch":
        return TorchLoRABackend()
    if name == "triton":
        from .triton_backend import TritonLoRABackend  # imports triton lazily

        return TritonLoRABackend()
    raise ValueError(f"unknown LoRA backend {name!r}: use 'auto', 'torch' or 'triton'")
