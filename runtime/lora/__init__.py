"""Multi-LoRA serving: adapter validation, the device slot pool and the manager."""

from .adapter import AdapterWeights, load_adapter
from .errors import (
    AdapterCapacityError,
    AdapterConflictError,
    AdapterDrainingError,
    AdapterError,
    AdapterNotFoundError,
)
from .manager import AdapterInfo, AdapterState, LoRAManager, SlotEvent, validate_lora_config
from .pool import LoRAContext, SlotPool

__all__ = [
    "AdapterCapacityError",
    "AdapterConflictError",
    "AdapterDrainingError",
    "AdapterError",
    "AdapterInfo",
    "AdapterNotFoundError",
    "AdapterState",
    "AdapterWeights",
    "LoRAContext",
    "LoRAManager",
    "SlotEvent",
    "SlotPool",
    "load_adapter",
    "validate_lora_config",
]
