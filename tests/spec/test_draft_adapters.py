"""Draft adapters: a request drafts with its Adapter's draft adapter; output never changes.

The strongest setting: the draft is a copy of the target, and the draft adapter of
``attn-r8`` is ``attn-r8`` itself. The adapted draft then IS the adapted target, so every
greedy draft of an ``attn-r8`` request is accepted; without the draft adapter the same draft
misses. Oracle: output with speculation and draft adapters = output without speculation, per
adapter, in one mixed batch where other requests (another adapter, the base) draft unadapted.
"""

from __future__ import annotations

import pytest

from loraserve.runtime.engine.errors import EngineError
from loraserve.runtime.lora import AdapterError
from loraserve.runtime.sampling import SamplingParams

ADAPTED = "attn-r8"


def _requests():
    prompts = [[5, 9, 33, 7, 81, 4], [12, 400, 77, 3], [66, 67, 68, 69, 70, 71, 72], [8, 8, 9, 9]]
    names = [ADAPTED, "all-r16", None, ADAPTED]
    return [
        (f"r{i}", prompt, SamplingParams(max_tokens=14, temperature=0.0), names[i % len(names)])
        for i, prompt in enumerate(prompts * 2)
    ]


def _config(make_spec_config, draft_max_loras: int):
    config = make_spec_config("STANDALONE", "same", max_running_requests=8)
    config.speculative.draft_max_loras = draft_max_loras
    config.speculative.draft_max_lora_rank = 16
    return config


def _loading(spec_assets, names=(ADAPTED,)):
    def hook(decoder):
        for name in names:
            decoder.drafter.lora.load(name, spec_assets.adapters[name])

    return hook


@pytest.fixture(scope="module")
def expected(make_spec_config, engine_run):
    run = engine_run(make_spec_config(), _requests())
    return {rid: run.outputs[rid].tokens for rid, *_ in _requests()}


def _accept_rate(run, adapter):
    stats = run.engine.decoder.metrics.snapshot().per_adapter[adapter]
    return stats.accepted_tokens / stats.draft_tokens


def test_draft_adapter_lifts_acceptance(
    make_spec_config, engine_run, spec_assets, expected
):
    """A draft adapter lifts its requests acceptance and changes no output."""
    with_draft = engine_run(_config(make_spec_config, 2), _requests(), decoder_hook=_loading(spec_assets))
    without = engine_run(_config(make_spec_config, 0), _requests())
    for run in (with_draft, without):
        for rid, *_ in _requests():
            assert run.outputs[rid].error is None
            assert run.outputs[rid].tokens == expected[rid], rid
    # The adapted draft is the adapted target: every greedy draft is accepted.
    assert _accept_rate(with_draft, ADAPTED) == 1.0
    assert _accept_rate(without, ADAPTED) < 0.9
    # Requests of an Adapter without a draft adapter draft exactly as before.
    assert _accept_rate(with_draft, "all-r16") == _accept_rate(without, "all-r16")
    assert with_draft.engine.decoder.drafter.runner.lora.list()[0].refcount == 0  # leases released


def test_draft_pool_excludes_targets(make_spec_config, engine_run):
    """The draft pool never holds the target adapters."""
    run = engine_run(_config(make_spec_config, 2), _requests()[:1])
    pool = run.engine.draft_pool
    assert pool is not None and pool.list() == []  # lora.adapters stays with the target
    assert run.engine.runner.lora is not pool
    assert sorted(i.name for i in run.engine.list_adapters()) == sorted(run.engine.config.lora.adapters)


def test_draft_outside_pool_refused(
    make_spec_config, engine_run, spec_assets
):
    """Draft adapters outside the draft pool are refused with the field."""
    run = engine_run(_config(make_spec_config, 2), _requests()[:1])
    with pytest.raises(AdapterError) as err:  # embed_tokens / lm_head: not draft-pool modules
        run.engine.load_draft_adapter("emb-head", spec_assets.adapters["emb-head"])
    assert "embed_tokens" in str(err.value) or "lm_head" in str(err.value)
    small = _config(make_spec_config, 2)
    small.speculative.draft_max_lora_rank = 4
    tight = engine_run(small, _requests()[:1])
    with pytest.raises(AdapterError) as err:
        tight.engine.load_draft_adapter(ADAPTED, spec_assets.adapters[ADAPTED])  # rank 8 > 4
    assert "rank" in str(err.value)
    none = engine_run(_config(make_spec_config, 0), _requests()[:1])
    with pytest.raises(EngineError) as err:
        none.engine.load_draft_adapter(ADAPTED, spec_assets.adapters[ADAPTED])
    assert err.value.error.param == "draft" and "--draft-max-loras" in err.value.error.message
