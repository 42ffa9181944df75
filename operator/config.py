"""Operator settings: what one operator process is told by its environment (or its caller).

Every knob has a production default; the chart sets the environment variables, tests build
an :class:`OperatorConfig` directly (for instance with a short adapter backoff). A bad value
is reported with the variable's name and the expected form, never silently replaced.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

DEFAULT_IMAGE = "ghcr.io/loraserve/loraserve:0.1.0"
"""The one image that holds both the runtime and the operator (see the Dockerfile)."""

ENV_PREFIX = "LORASERVE_"


class ConfigError(ValueError):
    """A setting from the environment has a value the operator cannot use."""


@dataclass(frozen=True)
class OperatorConfig:
    """Settings of one operator process."""

    runtime_image: str = DEFAULT_IMAGE
    """Image for runtime pods when a LoRAServe names none (the operator's own image)."""
    runtime_image_pull_policy: str = "IfNotPresent"
    namespaces: tuple[str, ...] = ()
    """Namespaces (or kopf glob patterns) to watch; empty: the whole cluster."""
    peering_name: str | None = None
    """kopf peering object name; None: standalone (one replica)."""
    peering_clusterwide: bool = True
    peering_lifetime_s: int = 60
    log_level: str = "info"
    """debug, info or warning."""
    adapter_backoff_base_s: float = 5.0
    """Transient adapter-load failures wait ``base * 2**n`` seconds before try n+1."""
    adapter_backoff_cap_s: float = 300.0
    adapter_max_tries: int = 5
    resync_interval_s: float = 60.0
    """Each serve and adapter is re-checked at least this often, events or not."""
    runtime_request_timeout_s: float = 600.0
    """Upper bound of one admin call; a load fetches and verifies the adapter first."""
    runtime_probe_timeout_s: float = 10.0
    """Upper bound of one ``GET /v1/models`` / unload call."""
    unload_max_tries: int = 5
    """Tries per pod to unload a deleted adapter before giving the pod up as unreachable."""
    adapter_metrics_interval_s: float = 30.0
    """How often an Adapter's live accept length is read from its pods' /metrics (at most)."""
    conflict_retries: int = 5
    liveness_endpoint: str | None = None
    """kopf's health endpoint, e.g. ``http://0.0.0.0:8080/healthz``; None: off."""
    webhook_enabled: bool = True
    """Serve the admission webhook; its address and certificate are read by
    ``loraserve.operator.webhooks.WebhookServerConfig`` (``LORASERVE_WEBHOOK_*``)."""
    extra_labels: Mapping[str, str] = field(default_factory=dict)
    """Labels added to every object the operator creates."""

    def __post_init__(self) -> None:
        problems = []
        if self.adapter_backoff_base_s <= 0:
            problems.append(f"adapter_backoff_base_s must be > 0, got {self.adapter_backoff_base_s}")
        if self.adapter_backoff_cap_s < self.adapter_backoff_base_s:
            problems.append("adapter_backoff_cap_s must be >= adapter_backoff_base_s")
        if self.adapter_max_tries < 1:
            problems.append(f"adapter_max_tries must be >= 1, got {self.adapter_max_tries}")
        if self.resync_interval_s <= 0:
            problems.append(f"resync_interval_s must be > 0, got {self.resync_interval_s}")
        if self.adapter_metrics_interval_s <= 0:
            problems.append(f"adapter_metrics_interval_s must be > 0, got {self.adapter_metrics_interval_s}")
        if self.unload_max_tries < 1:
            problems.append(f"unload_max_tries must be >= 1, got {self.unload_max_tries}")
        if self.runtime_image_pull_policy not in ("Always", "IfNotPresent", "Never"):
            problems.append(
                f"runtime_image_pull_policy must be Always, IfNotPresent or Never, got {self.runtime_image_pull_policy!r}"
            )
        if self.log_level not in ("debug", "info", "warning"):
            problems.append(f"log_level must be debug, info or warning, got {self.log_level!r}")
        if problems:
            raise ConfigError("; ".join(problems))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> OperatorConfig:
        """Read ``LORASERVE_*`` variables; unset ones keep their defaults."""
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for f in dataclasses.fields(cls):
            name = ENV_PREFIX + f.name.upper()
            if name not in env:
                continue
            raw = env[name]
            values[f.name] = _parse(name, raw, f.type)
        return cls(**values)  # type: ignore[arg-type]


def _parse(name: str, raw: str, kind: object) -> object:
    kind = str(kind)
    try:
        if kind.startswith("float"):
            return float(raw)
        if kind.startswith("int"):
            return int(raw)
        if kind.startswith("bool"):
            lowered = raw.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if kind.startswith("tuple"):
            return tuple(part.strip() for part in raw.split(",") if part.strip())
        if kind.startswith("Mapping"):
            pairs = [part.strip() for part in raw.split(",") if part.strip()]
            out = {}
            for pair in pairs:
                key, sep, value = pair.partition("=")
                if not sep or not key:
                    raise ValueError(pair)
                out[key.strip()] = value.strip()
            return out
        if kind == "str | None":
            return raw or None
        return raw
    except ValueError:
        forms = {
            "float": "a number",
            "int": "an integer",
            "bool": "true or false",
            "Mapping": "comma-separated key=value pairs",
        }
        expected = next((v for k, v in forms.items() if kind.startswith(k)), "a string")
        raise ConfigError(f"{name}={raw!r} is not valid: expected {expected}") from None
