"""The operator's spec model (and the CRD generated from it) and the runtime configuration
agree on every setting.

A setting is written in two places (the spec model, the config field; see the docstring
of ``loraserve.runtime.contract.config``); the CRD, its defaults (the configuration's) and
bounds (the policy's) are derived. Here:

- every CRD ``spec`` field either sets a runtime field (through the translation) or is
  named as configuring the pod rather than the process;
- each runtime setting of the CRD, changed from its default, reaches the configuration the
  runtime parses from the operator's argv;
- every configuration field has a flag (or says why not), and every flag parses back to
  the value it was written from;
- every flag the runtime ever took is still accepted.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import random
import typing
from typing import Any

import pytest

from loraserve.operator import specs, translate
from loraserve.runtime import cli
from loraserve.runtime.contract import flags
from loraserve.runtime.contract.config import GROUP, LORA_MODULES, RuntimeConfig, SpecAlgorithm

NOT_THE_PROCESS = (
    "spec.replicas",
    "spec.resources",
    "spec.scheduling",
    "spec.storage",  # volumes; the paths they give reach the runtime through the sources
    "spec.service",
    "spec.routing",
    "spec.autoscaling",
    "spec.runtime.image",
    "spec.runtime.imagePullPolicy",
    "spec.runtime.env",
    "spec.runtime.extraArgs",  # passed through verbatim after the generated flags
    "spec.speculative.draftModel.revision",  # where the fetch puts the draft (its path)
)
"""CRD fields that shape the pod, not the runtime process's configuration."""

BASE = {
    "model": {"source": "/models/base"},
    # Gated flags are written only while their section is on: turn every section on.
    "speculative": {"algorithm": "EAGLE", "draftModel": {"source": "/models/draft"}},
    "runtime": {"cudaGraph": {"enabled": True}},
}

EVERY_FLAG_EVER = (
    "--adapter-ca-file",
    "--adapter-cache-dir",
    "--adapter-catalog",
    "--adapter-load-timeout",
    "--adaptive-speculation",
    "--admin-token-file",
    "--allowed-local-roots",
    "--architecture",
    "--attention-backend",
    "--check-config",
    "--chunked-prefill-size",
    "--context-length",
    "--cuda-graph",
    "--cuda-graph-max-bs",
    "--cuda-graph-max-prefill-tokens",
    "--device",
    "--draft-load-format",
    "--draft-model",
    "--draft-model-architecture",
    "--drain-timeout",
    "--dtype",
    "--enable-lora",
    "--host",
    "--kv-memory-fraction",
    "--log-level",
    "--lora",
    "--lora-backend",
    "--lora-target-modules",
    "--max-admission-defer-steps",
    "--max-body-bytes",
    "--max-loaded-loras",
    "--max-lora-rank",
    "--max-loras-per-batch",
    "--max-prefill-tokens",
    "--max-running-requests",
    "--max-total-tokens",
    "--model",
    "--ngram-max",
    "--ngram-min",
    "--num-draft-tokens",
    "--num-steps",
    "--overlap-lora-loading",
    "--overlap-schedule",
    "--pinned-loras",
    "--port",
    "--pvc-root",
    "--ragged-verify",
    "--remote-source-hosts",
    "--revision",
    "--seed",
    "--served-model-name",
    "--speculative-algorithm",
    "--speculative-auto-disable",
    "--speculative-disable-batch-size",
    "--speculative-token-map",
    "--speculative-tree-max-batch-size",
    "--tensor-parallel-size",
    "--top-k",
    "--two-batch-overlap",
)
"""The runtime's flags before they were generated from the configuration (commit 658f075)."""


def _crd_spec(kit) -> dict:
    return kit.crd_schema(kit.load_crd("LoRAServe"))["properties"]["spec"]


def _leaves(node: dict, path: str) -> typing.Iterator[str]:
    """The CRD's leaf fields (objects with properties are walked into)."""
    props = node.get("properties")
    if node.get("type") == "object" and props:
        for name, sub in props.items():
            yield from _leaves(sub, f"{path}.{name}")
    else:
        yield path


def _config_field(config: RuntimeConfig, path: str) -> Any:
    return functools.reduce(getattr, path.split("."), config)


def _within(path: str, prefixes: typing.Iterable[str]) -> bool:
    return any(path == p or path.startswith(p + ".") for p in prefixes)


# --------------------------------------------------------------------------- CRD -> runtime


def test_every_crd_field_is_used(kit):
    """Every CRD field sets the runtime or shapes the pod."""
    settings = {s.crd_path for s in translate.spec_settings()}
    special = {p for p in translate.SPECIAL_FIELD_PATHS.values() if p.startswith("spec.")}
    unaccounted = [
        leaf
        for leaf in _leaves(_crd_spec(kit), "spec")
        if leaf not in settings and not _within(leaf, special) and not _within(leaf, NOT_THE_PROCESS)
    ]
    assert unaccounted == [], (
        "mark each with specs.sets('<config path>') or, if it does not configure the runtime "
        "process, list it in NOT_THE_PROCESS"
    )
    # And the other way: every marked spec field is in the CRD.
    assert {s.crd_path for s in translate.spec_settings()} <= set(_leaves(_crd_spec(kit), "spec"))


def _spec_field(setting: translate.SpecSetting):
    model: Any = specs.LoRAServeSpec
    for attr in setting.attrs[:-1]:
        model = translate._model_of(model.model_fields[attr].annotation)
    return model.model_fields[setting.attrs[-1]]


STRINGS = {
    "model.architecture": "MistralForCausalLM",
    "speculative.draft_model_architecture": "LlamaForCausalLMEagle3",
    "speculative.token_map": "maps/hot.json",
}


@functools.cache
def _base_config() -> RuntimeConfig:
    return translate.to_runtime_config(specs.parse_loraserve_spec(_raw()))


def _other(setting: translate.SpecSetting) -> Any:
    """A valid CRD value for the field that is not its default (nor the base spec's)."""
    info = _spec_field(setting)
    default, hint = info.default, info.annotation
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    inner = args[0] if len(args) == 1 and typing.get_origin(hint) is not list else hint
    if setting.config_path in STRINGS:
        return STRINGS[setting.config_path]
    if setting.config_path == "speculative.algorithm":
        return SpecAlgorithm.EAGLE3.value  # the base spec runs EAGLE
    if setting.config_path == "server.remote_source_hosts":
        return ["models.example.com", "*.s3.example.com"]
    if setting.config_path == "lora.target_modules":
        return ["q_proj", "lm_head"]
    if inner is bool:  # the opposite of the base spec's, which turns sections on
        return not _config_field(_base_config(), setting.config_path)
    if isinstance(inner, type) and issubclass(inner, enum.Enum):
        return next(m.value for m in inner if m != default)
    if typing.get_origin(inner) is typing.Literal:
        return next(v for v in typing.get_args(inner) if v != default)
    if inner is float:
        return 0.5
    bounds = {type(m).__name__: m for m in info.metadata}
    low = bounds["Ge"].ge if "Ge" in bounds else 1
    high = bounds["Le"].le if "Le" in bounds else None
    value = (low + 4) if default is None else default + 1
    return value if high is None or value <= high else default - 1


def _raw(**changes: Any) -> dict:
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in BASE.items()}
    raw["speculative"]["draftModel"] = dict(BASE["speculative"]["draftModel"])
    raw["runtime"]["cudaGraph"] = dict(BASE["runtime"]["cudaGraph"])
    for crd_path, value in changes.items():
        node = raw
        *parents, leaf = crd_path.removeprefix("spec.").split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return raw


def _runtime_parses(config: RuntimeConfig) -> RuntimeConfig:
    """What the runtime makes of the operator's argv for ``config``."""
    return cli.config_from_args(cli.build_parser().parse_args(flags.to_argv(config)), env={})


def test_the_base_spec_reaches_the_runtime_whole():
    config = translate.to_runtime_config(specs.parse_loraserve_spec(_raw()))
    assert _runtime_parses(config) == config


@pytest.mark.parametrize("setting", translate.spec_settings(), ids=lambda s: s.crd_path)
def test_each_crd_setting_reaches_the_runtime(setting):
    value = _other(setting)
    before = translate.to_runtime_config(specs.parse_loraserve_spec(_raw()))
    after = translate.to_runtime_config(specs.parse_loraserve_spec(_raw(**{setting.crd_path: value})))
    assert _config_field(after, setting.config_path) != _config_field(before, setting.config_path), (
        "the perturbation must change the runtime field"
    )
    parsed = _runtime_parses(after)
    assert _config_field(parsed, setting.config_path) == _config_field(after, setting.config_path)
    if setting.config_path not in ("lora.enabled", "cuda_graph.enabled", "speculative.algorithm"):
        assert parsed == after  # the whole configuration, not just the field


def test_all_crd_settings_reach_runtime():
    """All CRD settings changed at once reach the runtime."""
    keep_on = {"lora.enabled", "cuda_graph.enabled"}  # switching a section off drops its flags
    changes = {s.crd_path: _other(s) for s in translate.spec_settings() if s.config_path not in keep_on}
    config = translate.to_runtime_config(specs.parse_loraserve_spec(_raw(**changes)))
    assert _runtime_parses(config) == config


# --------------------------------------------------------------------------- config <-> flags


def _sections() -> typing.Iterator[tuple[str | None, type]]:
    hints = typing.get_type_hints(RuntimeConfig)
    yield None, RuntimeConfig
    for f in dataclasses.fields(RuntimeConfig):
        if GROUP in f.metadata:
            yield f.name, hints[f.name]


def test_every_config_field_has_flag():
    """Every config field has a flag or says why not."""
    paths = set()
    for section, cls in _sections():
        for f in dataclasses.fields(cls):
            if GROUP not in f.metadata:
                paths.add(f"{section}.{f.name}" if section else f.name)
    flagged = {s.path for s in flags.settings()}
    assert paths == flagged | set(flags.unflagged())
    assert not flagged & set(flags.unflagged())
    assert set(flags.unflagged()) == {"server.admin_token"}  # a secret stays off command lines
    names = [s.flag.name for s in flags.settings()]
    assert len(names) == len(set(names)), "a flag names two fields"
    assert all(s.flag.help for s in flags.settings()), "every flag has help text (the field's doc)"


def _non_default(setting: flags.Setting, rng: random.Random) -> Any:
    """A value of the field's type that differs from its default and survives its flag."""
    default = setting.default
    if setting.shape is flags.Shape.SWITCH:
        return not default
    if setting.shape is flags.Shape.PAIRS:
        return {f"adapter-{i}": f"/adapters/{i}" for i in range(rng.randint(1, 3))}
    if setting.shape is flags.Shape.VALUES:
        pool = (
            LORA_MODULES
            if setting.path == "lora.target_modules"
            else ("/models", "/adapters")
            if setting.path == "server.allowed_local_roots"
            else ("a.example", "*.b.example", "c")
        )
        return tuple(rng.sample(pool, rng.randint(1, 2)))
    if issubclass(setting.kind, enum.Enum):
        return rng.choice([m for m in setting.kind if m != default])
    if setting.flag.choices:
        return rng.choice([c for c in setting.flag.choices if c != default])
    if setting.kind is bool:
        return not default
    if setting.kind is int:
        return rng.choice([v for v in (0, 1, 7, 300, 70000) if v != default])
    if setting.kind is float:
        # Six significant digits: --adapter-load-timeout is written with %g, as before.
        return rng.choice([v for v in (0.5, 2.25, 90.0, 0.123457) if v != default])
    return rng.choice(["/x/y", "abc", "Mixed-Case_1"])


def _turn_on(config: RuntimeConfig, setting: flags.Setting) -> None:
    """Enable the field's section, so that a gated flag is written."""
    if setting.section == "speculative" and setting.name != "algorithm":
        config.speculative.algorithm = SpecAlgorithm.NGRAM
    if setting.section == "cuda_graph":
        config.cuda_graph.enabled = True


def _flags_parse(config: RuntimeConfig) -> RuntimeConfig:
    return flags.config_from_namespace(cli.build_parser().parse_args(flags.to_argv(config)))


@pytest.mark.parametrize("setting", flags.settings(), ids=lambda s: s.flag.name)
def test_each_flag_round_trips(setting):
    """Each flag round trips a non default value."""
    rng = random.Random(setting.flag.name)
    for _ in range(5):
        config = RuntimeConfig()
        config.model.path = "/models/base"  # --model is required
        _turn_on(config, setting)
        holder = config if setting.section is None else getattr(config, setting.section)
        if setting.path == "speculative.algorithm":
            value = rng.choice([a for a in SpecAlgorithm if a is not SpecAlgorithm.NONE])
        else:
            value = _non_default(setting, rng)
        setattr(holder, setting.name, value)
        assert _flags_parse(config) == config


def test_random_configs_round_trip():
    """Random configurations round trip through the flags."""
    rng = random.Random(20261206)
    for _ in range(300):
        config = RuntimeConfig()
        for setting in flags.settings():
            if rng.random() < 0.5:
                holder = config if setting.section is None else getattr(config, setting.section)
                setattr(holder, setting.name, _non_default(setting, rng))
        config.model.path = config.model.path or "/models/base"
        config.speculative.algorithm = rng.choice([a for a in SpecAlgorithm if a is not SpecAlgorithm.NONE])
        config.lora.enabled = config.cuda_graph.enabled = True
        assert _flags_parse(config) == config


def test_absent_num_draft_tokens_derived():
    """An absent num draft tokens is derived as everywhere."""
    config = flags.config_from_namespace(cli.build_parser().parse_args(["--model", "m", "--num-steps", "6"]))
    assert config.speculative.num_draft_tokens == 7
    spec = specs.parse_loraserve_spec(_raw(**{"spec.speculative.numSteps": 6}))
    assert translate.to_runtime_config(spec).speculative.num_draft_tokens == 7


def test_old_flags_still_accepted():
    """Every flag the runtime ever took is still accepted."""
    parser = cli.build_parser()
    known = {option for action in parser._actions for option in action.option_strings}
    assert set(EVERY_FLAG_EVER) <= known
    switches = [s.flag.name for s in flags.settings() if s.shape is flags.Shape.SWITCH]
    for name in switches:  # --x and --no-x, as BooleanOptionalAction gave before
        assert "--no-" + name.removeprefix("--") in known
