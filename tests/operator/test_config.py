"""Operator settings from the environment: defaults, parsing, and errors that name the variable."""

from __future__ import annotations

import dataclasses

import pytest

from loraserve.operator.config import ConfigError, OperatorConfig


def test_defaults_match_documented_retry() -> None:
    """Defaults match the documented retry schedule."""
    config = OperatorConfig.from_env({})
    assert config == OperatorConfig()
    assert (config.adapter_max_tries, config.adapter_backoff_base_s, config.adapter_backoff_cap_s) == (
        5,
        5.0,
        300.0,
    )


def test_every_field_settable_from_env() -> None:
    """Every field is settable from its variable."""
    env = {
        "LORASERVE_RUNTIME_IMAGE": "registry.local/ls:dev",
        "LORASERVE_NAMESPACES": "team-a, team-b",
        "LORASERVE_PEERING_NAME": "loraserve",
        "LORASERVE_PEERING_CLUSTERWIDE": "false",
        "LORASERVE_ADAPTER_BACKOFF_BASE_S": "0.5",
        "LORASERVE_ADAPTER_MAX_TRIES": "3",
        "LORASERVE_WEBHOOK_ENABLED": "no",
        "LORASERVE_EXTRA_LABELS": "team=ml,tier=gold",
    }
    config = OperatorConfig.from_env(env)
    assert config.runtime_image == "registry.local/ls:dev"
    assert config.namespaces == ("team-a", "team-b")
    assert config.peering_name == "loraserve" and config.peering_clusterwide is False
    assert config.adapter_backoff_base_s == 0.5 and config.adapter_max_tries == 3
    assert config.webhook_enabled is False
    assert dict(config.extra_labels) == {"team": "ml", "tier": "gold"}
    names = {f"LORASERVE_{f.name.upper()}" for f in dataclasses.fields(OperatorConfig)}
    assert set(env) <= names


@pytest.mark.parametrize(
    "env,needle",
    [
        (
            {"LORASERVE_ADAPTER_MAX_TRIES": "many"},
            "LORASERVE_ADAPTER_MAX_TRIES='many' is not valid: expected an integer",
        ),
        (
            {"LORASERVE_WEBHOOK_ENABLED": "maybe"},
            "LORASERVE_WEBHOOK_ENABLED='maybe' is not valid: expected true or false",
        ),
        ({"LORASERVE_EXTRA_LABELS": "novalue"}, "expected comma-separated key=value pairs"),
        ({"LORASERVE_ADAPTER_BACKOFF_BASE_S": "0"}, "adapter_backoff_base_s must be > 0"),
        ({"LORASERVE_RUNTIME_IMAGE_PULL_POLICY": "Sometimes"}, "runtime_image_pull_policy must be"),
    ],
)
def test_bad_values_name_the_variable(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        OperatorConfig.from_env(env)
    assert needle in str(info.value)
