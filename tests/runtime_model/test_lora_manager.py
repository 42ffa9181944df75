"""Adapter validation and the manager's slot, pin, refcount and unload behaviour."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraserve.runtime.dev.devmodels import build_adapter, build_tiny_model
from loraserve.runtime.lora import (
    AdapterCapacityError,
    AdapterConflictError,
    AdapterError,
    AdapterNotFoundError,
    AdapterState,
)

WEIGHTS = "adapter_model.safetensors"


def _copy(src, dest):
    shutil.copytree(src, dest)
    return dest


def _edit_config(path, **changes):
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(cfg))


def _edit_tensors(path, fn):
    tensors = load_file(str(path / WEIGHTS))
    save_file(fn(dict(tensors)), str(path / WEIGHTS))


def _probe(runner, ops, name, rid):
    out = ops.extend(runner, [rid], [torch.arange(3, 13)], names=[name])
    runner.kv.free(rid)
    return out.logits


@pytest.fixture(scope="module")
def foreign_adapter(tmp_path_factory):
    """An adapter for a model of a different width: every shape is wrong for llama-gqa."""
    root = tmp_path_factory.mktemp("foreign")
    base = build_tiny_model(root / "narrow", hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64)
    return build_adapter(root / "adapter", base, rank=8, target_modules=("q_proj", "v_proj"))


def _bad_adapters(assets, foreign_adapter, tmp):
    """(case, path, expected field substring, message substring) for every refusal."""
    good = assets.adapters["attn-r8"]
    cases = []

    cases.append(("rank too high", assets.adapters["all-r16"], "r", "exceeds lora.max_rank=8"))

    p = _copy(good, tmp / "unknown-module")
    _edit_config(p, target_modules=["q_proj", "foo_proj"])
    cases.append(("unknown module", p, "target_modules", "foo_proj"))

    cases.append(("outside the pool", assets.adapters["mlp-r4-rs"], "target_modules", "not in lora.target_modules"))

    cases.append(("wrong shapes", foreign_adapter, "lora_A", "different base model"))

    p = _copy(good, tmp / "bad-name")
    _edit_tensors(
        p,
        lambda t: {k.replace("layers.1.self_attn.o_proj.lora_A", "layers.1.self_attn.o_proj.lora_X"): v for k, v in t.items()},
    )
    cases.append(("bad tensor name", p, "lora_X", "does not map"))

    p = _copy(good, tmp / "bad-layer")
    _edit_tensors(p, lambda t: {k.replace("layers.1.", "layers.7."): v for k, v in t.items()})
    cases.append(("layer out of range", p, "layers.7", "has 2 layers"))

    p = _copy(good, tmp / "missing-b")
    _edit_tensors(p, lambda t: {k: v for k, v in t.items() if "layers.0.self_attn.k_proj.lora_B" not in k})
    cases.append(("missing lora_B", p, "layer 0 k_proj", "no lora_B"))

    p = _copy(good, tmp / "pickle")
    torch.save(load_file(str(p / WEIGHTS)), p / "adapter_model.bin")
    (p / WEIGHTS).unlink()
    cases.append(("pickle file", p, "adapter_model.bin", "pickle"))

    p = _copy(good, tmp / "no-config")
    (p / "adapter_config.json").unlink()
    cases.append(("missing config", p, "adapter_config.json", "missing"))

    p = _copy(good, tmp / "dora")
    _edit_config(p, use_dora=True)
    cases.append(("dora", p, "use_dora", "not supported"))

    p = _copy(good, tmp / "modules-to-save")
    _edit_config(p, modules_to_save=["lm_head"])
    cases.append(("modules_to_save", p, "modules_to_save", "retrain"))

    p = _copy(good, tmp / "bad-json")
    (p / "adapter_config.json").write_text("{not json")
    cases.append(("bad json", p, "adapter_config.json", "not valid JSON"))

    cases.append(("not a directory", tmp / "does-not-exist", "path", "not a directory"))
    return cases


def test_bad_adapters_refused(
    assets, foreign_adapter, make_runner, ops, tmp_path
):
    """Every bad adapter is refused and the manager keeps serving."""
    runner = make_runner(
        assets.models["llama-gqa"],
        max_rank=8,
        target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "embed_tokens", "lm_head"),
    )
    runner.lora.load("good", assets.adapters["attn-r8"])
    before = _probe(runner, ops, "good", "p0")
    listing = runner.lora.list()
    for case, path, field, message in _bad_adapters(assets, foreign_adapter, tmp_path):
        with pytest.raises(AdapterError) as err:
            runner.lora.load(f"bad-{case.replace(' ', '-')}", path)
        assert field in (err.value.field or ""), (case, err.value.field, str(err.value))
        assert message in str(err.value), (case, str(err.value))
        assert err.value.adapter == f"bad-{case.replace(' ', '-')}"
        assert runner.lora.list() == listing, case
    torch.testing.assert_close(_probe(runner, ops, "good", "p1"), before, atol=0, rtol=0)


def test_embedding_copies_must_equal_base(assets, make_runner, tmp_path):
    """Full embedding copies accepted only when equal to base."""
    runner = make_runner(assets.models["llama-gqa"])
    p = _copy(assets.adapters["emb-head"], tmp_path / "with-copy")
    base = runner.embed_tokens.weight.detach().clone()
    _edit_tensors(p, lambda t: {**t, "base_model.model.model.embed_tokens.weight": base})
    assert runner.lora.load("copy", p).state is AdapterState.LOADED
    q = _copy(assets.adapters["emb-head"], tmp_path / "resized")
    _edit_tensors(q, lambda t: {**t, "base_model.model.model.embed_tokens.weight": base + 1})
    with pytest.raises(AdapterError, match="save_embedding_layers=False"):
        runner.lora.load("resized", q)


def test_load_is_idempotent_and_names_are_unique(assets, make_runner):
    runner = make_runner(assets.models["llama-gqa"], max_loaded_loras=2)
    lora = runner.lora
    info = lora.load("a", assets.adapters["attn-r8"])
    assert info.rank == 8 and info.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert info.scaling == pytest.approx(16 / 8)
    assert lora.load("a", assets.adapters["attn-r8"]) == info
    with pytest.raises(AdapterConflictError, match="already loaded from"):
        lora.load("a", assets.adapters["all-r16"])
    rs = lora.load("rs", assets.adapters["mlp-r4-rs"])
    assert rs.scaling == pytest.approx(8 / 4**0.5)  # rsLoRA: alpha / sqrt(r)
    with pytest.raises(AdapterCapacityError, match="max_loaded_loras=2"):
        lora.load("c", assets.adapters["all-r16"])
    lora.unload("a")
    assert lora.load("a", assets.adapters["all-r16"]).rank == 16  # the name is free again
    assert [i.name for i in lora.list()] == ["a", "rs"]


def test_lru_eviction_keeps_batch(assets, make_runner, ops):
    """Lru eviction keeps the current batch and reloads correctly."""
    runner = make_runner(assets.models["llama-gqa"], max_loras_per_batch=2)
    lora = runner.lora
    for name in ("attn-r8", "all-r16", "mlp-r4-rs"):
        lora.load(name, assets.adapters[name])
    first = {name: _probe(runner, ops, name, f"first-{name}") for name in ("attn-r8", "all-r16", "mlp-r4-rs")}
    # after three single-adapter batches on two slots the first one was evicted
    states = {i.name: i.state for i in lora.list()}
    assert states == {"attn-r8": AdapterState.LOADED, "all-r16": AdapterState.ACTIVE, "mlp-r4-rs": AdapterState.ACTIVE}
    # a batch using the two resident ones, then one that needs the evicted one: the LRU goes
    lora.prepare_batch(["mlp-r4-rs", "all-r16"])
    lora.prepare_batch(["attn-r8", "all-r16"])
    assert lora.get("mlp-r4-rs").state is AdapterState.LOADED
    # an adapter placed into a slot that held a different rank gives the same logits as before
    for name, logits in first.items():
        torch.testing.assert_close(_probe(runner, ops, name, f"again-{name}"), logits, atol=0, rtol=0)
    with pytest.raises(AdapterCapacityError, match="3 distinct adapters"):
        lora.prepare_batch(["attn-r8", "all-r16", "mlp-r4-rs"])
    assert lora.prepare_batch([None, None]) == [-1, -1]


def test_pinned_adapters_are_never_evicted(assets, make_runner):
    runner = make_runner(assets.models["llama-gqa"], max_loras_per_batch=3)
    lora = runner.lora
    pinned = lora.load("pin", assets.adapters["attn-r8"], pinned=True)
    assert pinned.pinned and pinned.state is AdapterState.ACTIVE
    lora.load("b", assets.adapters["all-r16"])
    lora.load("c", assets.adapters["mlp-r4-rs"])
    lora.load("d", assets.adapters["emb-head"])
    for batch in (["b"], ["c"], ["d"], ["b", "c"], ["d", "c"], ["b", "d"]):
        lora.prepare_batch(batch)
        assert lora.get("pin").slot == pinned.slot
    with pytest.raises(AdapterCapacityError, match="only 2 of"):
        lora.prepare_batch(["b", "c", "d"])
    lora.load("b", assets.adapters["all-r16"], pinned=True)  # pin an existing adapter
    with pytest.raises(AdapterCapacityError, match="no slot for unpinned"):
        lora.load("c", assets.adapters["mlp-r4-rs"], pinned=True)
    assert not lora.get("c").pinned
    with pytest.raises(AdapterCapacityError, match="only 1 of"):
        lora.prepare_batch(["c", "d"])
    assert lora.prepare_batch(["pin", "b", "c"])[2] not in (lora.get("pin").slot, lora.get("b").slot)


def test_unload_while_in_flight(assets, make_runner, ops):
    runner = make_runner(assets.models["llama-gqa"])
    lora = runner.lora
    lora.load("a", assets.adapters["attn-r8"])
    expected = _probe(runner, ops, "a", "warm")
    lora.acquire("a")
    lora.acquire("a")
    assert lora.get("a").refcount == 2
    lora.unload("a")
    lora.unload("a")  # idempotent
    info = lora.get("a")
    assert info.state is AdapterState.UNLOADING and "a" not in lora
    with pytest.raises(AdapterNotFoundError, match="being unloaded"):
        lora.acquire("a")
    # requests already in flight keep running with the adapter's weights
    torch.testing.assert_close(_probe(runner, ops, "a", "inflight"), expected, atol=0, rtol=0)
    lora.release("a")
    assert lora.get("a").refcount == 1
    lora.release("a")
    assert [i.name for i in lora.list()] == []
    assert all(r == 0 for r in lora.slot_ranks())
    with pytest.raises(AdapterNotFoundError):
        lora.prepare_batch(["a"])
    with pytest.raises(AdapterError, match="without a matching acquire"):
        lora.release("a")
    lora.unload("never-loaded")  # idempotent for unknown names too


def test_reload_during_unload_revives_the_adapter(assets, make_runner):
    lora = make_runner(assets.models["llama-gqa"]).lora
    lora.load("a", assets.adapters["attn-r8"])
    lora.acquire("a")
    lora.unload("a")
    assert lora.load("a", assets.adapters["attn-r8"]).state is not AdapterState.UNLOADING
    lora.acquire("a")
    lora.release("a")
    lora.release("a")
    assert lora.get("a").refcount == 0


def test_bad_pool_config_is_refused(assets, make_config):
    from loraserve.runtime.runner.model_runner import ModelRunner

    config = make_config(assets.models["llama-gqa"])
    config.lora.target_modules = ("q_proj", "qkv")
    with pytest.raises(AdapterError, match=r"lora\.target_modules") as err:
        ModelRunner(config)
    assert err.value.field == "lora.target_modules"
    config = make_config(assets.models["llama-gqa"])
    config.lora.max_loras_per_batch = 0
    with pytest.raises(AdapterError, match="max_loras_per_batch must be >= 1"):
        ModelRunner(config)


def test_startup_adapters_and_pins_from_config(assets, make_config):
    from loraserve.runtime.runner.model_runner import ModelRunner

    config = make_config(assets.models["llama-gqa"])
    config.lora.adapters = {"a": str(assets.adapters["attn-r8"]), "b": str(assets.adapters["all-r16"])}
    config.lora.pinned = ("b",)
    runner = ModelRunner(config)
    infos = {i.name: i for i in runner.lora.list()}
    assert set(infos) == {"a", "b"} and infos["b"].pinned and not infos["a"].pinned
    assert infos["b"].state is AdapterState.ACTIVE


def test_threaded_loads_keep_serving(assets, make_runner, ops):
    """Loads and unloads from another thread do not disturb serving."""
    import threading

    runner = make_runner(assets.models["llama-gqa"], max_loras_per_batch=3)
    lora = runner.lora
    lora.load("steady", assets.adapters["attn-r8"])
    lora.load("other", assets.adapters["mlp-r4-rs"])
    expected = _probe(runner, ops, "steady", "warm")
    stop, errors, cycles = threading.Event(), [], [0]

    def churn():
        while not stop.is_set():
            name = f"churn{cycles[0] % 3}"
            try:
                # a pinned load takes a device slot at once, evicting what the running
                # batch does not use
                lora.load(name, assets.adapters["all-r16"], pinned=True)
                lora.unload(name)
            except Exception as exc:  # any error here is a failure of the manager
                errors.append(exc)
                return
            cycles[0] += 1

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        for i in range(8):
            lora.acquire("steady")
            try:
                torch.testing.assert_close(_probe(runner, ops, "steady", f"t{i}"), expected, atol=0, rtol=0)
                _probe(runner, ops, "other", f"o{i}")  # keeps a second slot busy
            finally:
                lora.release("steady")
    finally:
        stop.set()
        thread.join()
    assert not errors, errors
    assert cycles[0] > 0
    assert [i.name for i in lora.list()] == ["other", "steady"]
