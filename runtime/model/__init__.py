"""The runtime's Llama-family model: config parsing, layers and weights.

What one forward is asked to do (``ForwardBatch``) lives with the engine core, in
``loraserve.runtime.runner.forward_batch``."""

from .arch import ModelArchConfig, ModelConfigError, RopeSpec, load_arch_config
from .llama import LlamaForCausalLM, WeightLoadError
from .loader import build_model, checkpoint_files, read_checkpoint_tensor

__all__ = [
    "LlamaForCausalLM",
    "ModelArchConfig",
    "ModelConfigError",
    "RopeSpec",
    "WeightLoadError",
    "build_model",
    "checkpoint_files",
    "load_arch_config",
    "read_checkpoint_tensor",
]
