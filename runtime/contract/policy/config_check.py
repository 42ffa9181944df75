"""The configuration check: a whole :class:`RuntimeConfig` judged by every rule, in order,
into one :class:`Report` with its effective (resolved) form; and the speculative rules
alone, which the runtime's draft factory judges by."""

from __future__ import annotations

from ..capabilities import CAPABILITIES, Capabilities
from ..config import RuntimeConfig
from .algorithms import effective_config
from .availability import availability
from .basic import model_and_placement, normalized, scheduler_and_server
from .config_warnings import config_warnings
from .cuda_graphs import gpu_fields, graph_verify_width
from .draft_adapters import draft_lora_pool
from .drafts import draft_layout
from .families import model_family
from .findings import Report
from .lora import lora_compatibility, lora_pool
from .speculative import speculative


def check_config(config: RuntimeConfig, capabilities: Capabilities = CAPABILITIES) -> Report:
    """Judge a whole runtime configuration: every violation, every warning, the effective form."""
    config, violations = normalized(config)
    effective, note = effective_config(config)
    violations += model_and_placement(config)
    violations += model_family(config)
    violations += scheduler_and_server(config)
    violations += gpu_fields(config)
    violations += lora_pool(config)
    violations += speculative(config, effective, note)
    violations += draft_layout(config, effective)
    violations += lora_compatibility(config, effective, note, capabilities)
    violations += graph_verify_width(config, capabilities)
    violations += availability(config, effective, note, capabilities)
    violations += draft_lora_pool(config, effective, note)
    warnings = config_warnings(config, effective)
    return Report(tuple(violations), tuple(warnings), effective, note, config.speculative.algorithm)


def check_speculation(config: RuntimeConfig, capabilities: Capabilities = CAPABILITIES) -> Report:
    """The speculative rules of :func:`check_config` alone (the draft, its shape, what this
    image implements for it): what the runtime's draft factory judges a draft by, so that
    a configuration the start-up admits always builds its drafter."""
    config, violations = normalized(config)
    effective, note = effective_config(config)
    violations += speculative(config, effective, note)
    violations += availability(config, effective, note, capabilities)
    return Report(tuple(violations), (), effective, note, config.speculative.algorithm)
