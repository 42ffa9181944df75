"""The runtime's Llama-family model: config parsing, layers, weights and batch types."""

from .arch import ModelArchConfig, ModelConfigError, RopeSpec, load_arch_config
from .forward_batch import ForwardBatch, ForwardBatchError, ForwardOutput
from .llama import LlamaForCausalLM, WeightLoadError
from .loader import build_model, checkpoint_files, read_checkpoint_tensor

__all__ = [
    "ForwardBatch",
    "ForwardBatchError",
    "ForwardOutput",
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
