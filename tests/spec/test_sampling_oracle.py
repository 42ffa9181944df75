"""Sampling with speculation keeps the target's distribution, per adapter.

Thousands of seeded requests share one prompt and sample three tokens with top-k 6 (a
six-token vocabulary at every position). The first token comes from prefill, the next two
from speculative steps (accepted drafts, resampled residuals or bonus tokens). Their
empirical joint law is compared with the target's own ``p(x1) p(x2|x1) p(x3|x1,x2)``,
computed by plain target forwards with the request's adapter, with a chi-square test.

False-failure rate: each assertion rejects a correct sampler with probability 1e-3 for a
random seed (ALPHA); the seeds are fixed, so a run is reproducible.
"""

from __future__ import annotations

import pytest

from loraserve.runtime.runner.model_runner import ModelRunner
from loraserve.runtime.sampling import SamplingParams

from .joint_law import reference_law, sampled_counts

ALPHA = 1e-3
NUM_REQUESTS = 3000
PROMPT = [5, 6, 7, 5, 6, 7, 5, 6]  # repetitive, so n-gram drafts match


def _params(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=3, temperature=1.0, top_k=6, seed=seed)


@pytest.mark.slow
@pytest.mark.parametrize(
    "algorithm,draft,adapter",
    [
        ("NGRAM", None, None),
        ("STANDALONE", "small", "emb-head"),
        ("STANDALONE", "same", "attn-r8"),
        ("EAGLE3", "eagle3", "all-r16"),
        ("EAGLE3", "eagle3-d2t", "emb-head"),  # q is zero outside the draft's vocabulary
    ],
)
def test_sampled_joint_law(
    make_spec_config, engine_run, chi_square, algorithm, draft, adapter
):
    """Joint law of sampled tokens matches the target."""
    config = make_spec_config(algorithm, draft, max_running_requests=64)
    requests = [(f"s{i}", PROMPT, _params(1000 + i), adapter) for i in range(NUM_REQUESTS)]
    run = engine_run(config, requests, timeout_s=600)
    counts = sampled_counts(run, requests)
    snap = run.engine.decoder.metrics.snapshot()
    assert snap.overall.verify_steps >= NUM_REQUESTS  # the 2nd and 3rd tokens came from speculation
    if draft == "same" or algorithm == "NGRAM":
        assert snap.overall.accepted_tokens > 0  # resampling and bonus paths both ran

    reference = reference_law(ModelRunner(make_spec_config()), adapter, PROMPT, _params(0))
    support = reference > 0
    assert counts[~support].sum() == 0  # nothing outside the target's top-k support
    assert chi_square(counts[support], reference[support]) > ALPHA
