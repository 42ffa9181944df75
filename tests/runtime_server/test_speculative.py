"""Speculative decoding through the whole server: the engine's decoder seam picks the
speculative decoder from the configuration, greedy answers per adapter are identical with
and without speculation, and usage and /metrics carry the accept statistics."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraserve.runtime.contract.capabilities import CAPABILITIES
from loraserve.runtime.contract.config import SpecAlgorithm

from .conftest import make_config, running_server

pytestmark = pytest.mark.skipif(
    not CAPABILITIES.implements(SpecAlgorithm.NGRAM), reason="this image does not implement NGRAM speculation"
)

PROMPTS = [
    "for item in items:\n    total += item\nfor item in items:\n    total",
    "x = x + 1\ny = y + 1\nx = x + 1\ny",
]


async def _answers(server) -> list[tuple[str, str, dict]]:
    out = []
    for model in ("tiny-base", "sql-r8", "chat-r16"):
        for prompt in PROMPTS:
            status, body = await server.post(
                "/v1/completions",
                {"model": model, "prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True},
            )
            assert status == 200, body
            out.append((model, body["choices"][0]["text"], body["usage"]))
    return out


async def test_ngram_lossless_and_reported(assets, tmp_path):
    """N-gram speculation is lossless per adapter and reported."""
    plain_cfg = make_config(assets)
    async with running_server(plain_cfg, tmp_path / "plain") as plain:
        reference = await _answers(plain)
    spec_cfg = make_config(assets)
    spec_cfg.speculative.algorithm = SpecAlgorithm.NGRAM
    spec_cfg.speculative.num_steps = 3
    spec_cfg.speculative.num_draft_tokens = 4
    async with running_server(spec_cfg, tmp_path / "spec") as spec:
        assert type(spec.engine.decoder).__name__ == "SpeculativeDecoder"
        got = await _answers(spec)
        assert [(m, t) for m, t, _ in got] == [(m, t) for m, t, _ in reference]
        stats = [u["speculative"] for _, _, u in got]
        assert all(s["verify_steps"] >= 1 for s in stats)
        assert sum(s["accepted_tokens"] for s in stats) > 0, "repetitive text lets n-gram drafts be accepted"
        for s in stats:
            assert s["accepted_tokens"] <= s["draft_tokens"] == 3 * s["verify_steps"]
        async with spec.session.get(spec.url + "/metrics") as resp:
            text = await resp.text()
    samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    accepted = sum(s["accepted_tokens"] for s in stats)
    assert samples["vllm:spec_decode_num_accepted_tokens_total"].value == accepted
    assert samples["vllm:spec_decode_num_draft_tokens_total"].value == sum(s["draft_tokens"] for s in stats)
    assert any(name.startswith("loraserve:spec_step_") for name in samples), "the decoder's live counters"
