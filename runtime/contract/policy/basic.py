"""The basic field rules: enum fields read as enums, and the model, placement, scheduler
and server fields each within its bounds."""

from __future__ import annotations

import enum
from typing import TypeVar

from ..config import ATTENTION_BACKENDS, DEVICES, DTYPES, RaggedVerify, RuntimeConfig, SpecAlgorithm
from .fields import at_least, one_of
from .findings import Violation

E = TypeVar("E", bound=enum.Enum)


def normalized(config: RuntimeConfig) -> tuple[RuntimeConfig, list[Violation]]:
    """Enum fields as enums (a configuration built from flags may hold plain strings);
    an unknown value is a violation, judged as the default for the remaining rules."""
    config = config.copy()
    spec = config.speculative
    spec.algorithm, out = _as_enum("speculative.algorithm", spec.algorithm, SpecAlgorithm.NONE, "algorithm")
    spec.ragged_verify, ragged = _as_enum(
        "speculative.ragged_verify", spec.ragged_verify, RaggedVerify.STATIC, "ragged"
    )
    return config, out + ragged


def _as_enum(path: str, value: object, default: E, rule: str) -> tuple[E, list[Violation]]:
    """``value`` as a member of ``default``'s enum; an unknown value reads as ``default``,
    with a violation naming the values allowed."""
    kind = type(default)
    try:
        return kind(value), []
    except ValueError:
        return default, list(one_of(path, value, tuple(member.value for member in kind), rule))


def model_and_placement(config: RuntimeConfig) -> list[Violation]:
    """The base model, its dtype and context, and where it runs (tensor parallel, device, attention)."""
    out: list[Violation] = []
    if not config.model.path:
        out.append(
            Violation("model-required", "model.path", "the base model is not set", "name the base model")
        )
    out += one_of("model.dtype", config.model.dtype, DTYPES, "model-dtype")
    out += at_least("model.context_length", config.model.context_length, "context-length")
    out += at_least("parallel.tensor_parallel_size", config.parallel.tensor_parallel_size, "tensor-parallel")
    out += one_of("device", config.device, DEVICES, "device")
    out += one_of("attention_backend", config.attention_backend, ATTENTION_BACKENDS, "attention-backend")
    return out


def scheduler_and_server(config: RuntimeConfig) -> list[Violation]:
    """The scheduler's batch and token bounds, its KV memory fraction, and the server's port."""
    scheduler = config.scheduler
    out: list[Violation] = []
    out += at_least("scheduler.max_running_requests", scheduler.max_running_requests, "max-running")
    out += at_least("scheduler.max_total_tokens", scheduler.max_total_tokens, "max-total-tokens")
    out += at_least("scheduler.chunked_prefill_size", scheduler.chunked_prefill_size, "chunked-prefill")
    out += at_least("scheduler.max_prefill_tokens", scheduler.max_prefill_tokens, "max-prefill")
    out += at_least(
        "scheduler.max_admission_defer_steps", scheduler.max_admission_defer_steps, "max-admission-defer"
    )
    fraction = scheduler.kv_memory_fraction
    if not 0 < fraction <= 1:
        out.append(
            Violation(
                "kv-fraction",
                "scheduler.kv_memory_fraction",
                f"must be in (0, 1], got {fraction}",
                "set {scheduler.kv_memory_fraction} to a fraction such as 0.85",
            )
        )
    if not 1 <= config.server.port <= 65535:
        out.append(
            Violation("port", "server.port", f"must be a TCP port, got {config.server.port}", "use 1-65535")
        )
    return out
