"""Fair admission's preemption is lossless under speculation: a big call's request that
gives back its slot to a small call (retracted, its draft state dropped, recomputed later)
produces exactly the tokens it produces without speculation or preemption."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from loraserve.runtime.engine import EngineObserver
from loraserve.runtime.sampling import SamplingParams

ADAPTERS = (None, "attn-r8", "all-r16", "emb-head")


class Retractions(EngineObserver):
    def __init__(self) -> None:
        self.count = 0

    def on_retract(self, request) -> None:
        self.count += 1


def _requests():
    gen = torch.Generator().manual_seed(5)
    out = []
    for i in range(10):
        prompt = torch.randint(
            3, 500, (int(torch.randint(4, 20, (1,), generator=gen)),), generator=gen
        ).tolist()
        out.append(
            (f"big{i}", prompt, SamplingParams(max_tokens=24, temperature=0.0), ADAPTERS[i % 4], "call-big")
        )
    out.append(
        ("small", [7, 8, 9, 10, 11], SamplingParams(max_tokens=6, temperature=0.0), "all-r16", "call-small")
    )
    return out


@pytest.mark.parametrize(("algorithm", "draft"), [("NGRAM", None), ("EAGLE3", "eagle3")])
def test_preempted_keep_tokens(
    make_spec_config, engine_run, algorithm, draft
):
    """Preempted requests keep their tokens under speculation."""
    from loraserve.runtime.engine.engine import Engine
    from loraserve.runtime.engine.request import Request
    from loraserve.runtime.runner.model_runner import ModelRunner
    from loraserve.runtime.speculative import build_decoder

    requests = _requests()
    plain = engine_run(make_spec_config(), [(rid, p, params, a) for rid, p, params, a, _ in requests])
    expected = {rid: plain.outputs[rid].tokens for rid, *_ in requests}

    config = make_spec_config(algorithm, draft, max_running_requests=4)
    observer = Retractions()
    engine = Engine(config, ModelRunner(config), observer=observer, decoder_factory=build_decoder)
    engine.refresh_adapters()
    got: dict[str, list[int]] = {rid: [] for rid, *_ in requests}
    done = {rid: threading.Event() for rid, *_ in requests}

    def sink_for(rid):
        def sink(out):
            got[rid].extend(out.token_ids)
            if out.finished:
                assert out.error is None, out.error
                done[rid].set()

        return sink

    engine.start()
    try:
        for rid, prompt, params, adapter, group in requests[:-1]:
            engine.submit(
                Request(
                    rid=rid,
                    prompt_ids=prompt,
                    params=params,
                    adapter=adapter,
                    sink=sink_for(rid),
                    group=group,
                )
            )
        deadline = time.monotonic() + 120
        while not any(got[rid] for rid, *_ in requests[:-1]):  # the big call is decoding
            assert time.monotonic() < deadline
            time.sleep(0.001)
        rid, prompt, params, adapter, group = requests[-1]
        engine.submit(
            Request(
                rid=rid, prompt_ids=prompt, params=params, adapter=adapter, sink=sink_for(rid), group=group
            )
        )
        for event in done.values():
            assert event.wait(300)
    finally:
        engine.shutdown(drain_timeout_s=1.0)
    assert observer.count >= 1, "the small call took a slot from the big one"
    assert got == expected
