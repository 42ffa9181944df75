"""The batched sampler against its definition: distributions, filters, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from loraserve.runtime.sampling import (
    Sampler,
    SamplingParams,
    SamplingParamsError,
    make_generator,
    processed_probs,
)


def _chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of observed counts against expected probabilities."""
    n = counts.sum().item()
    keep = probs > 0
    expected = probs[keep].double() * n
    stat = ((counts[keep].double() - expected) ** 2 / expected).sum()
    dof = int(keep.sum().item()) - 1
    return torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2).item()


def _reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Straightforward float64 filter: temperature, keep top-k, keep smallest nucleus >= top_p."""
    x = logits.double() / temperature
    order = torch.argsort(x, descending=True)
    p = torch.softmax(x, dim=-1)
    keep = torch.zeros_like(p, dtype=torch.bool)
    mass = 0.0
    for rank, idx in enumerate(order.tolist()):
        if top_k > 0 and rank >= top_k:
            break
        if rank > 0 and mass >= top_p:
            break
        keep[idx] = True
        mass += p[idx].item()
    out = torch.where(keep, p, torch.zeros_like(p))
    return out / out.sum()


def test_greedy_and_sampled_rows():
    """Greedy rows are argmax and sampled rows follow their params."""
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=0.7, seed=3),
        SamplingParams(temperature=0.0, logprobs=True),
    ]
    out = Sampler(seed=1).sample(logits, params, [make_generator(p.seed) for p in params])
    argmax = logits.argmax(dim=-1).tolist()
    assert out.token_ids[0] == argmax[0]
    assert out.token_ids[1] == argmax[1]
    assert out.token_ids[3] == argmax[3]
    assert out.logprobs is not None
    expected = torch.log_softmax(logits, dim=-1)
    for row, token in enumerate(out.token_ids):
        assert out.logprobs[row] == pytest.approx(expected[row, token].item(), abs=1e-5)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8), (0.9, 6, 0.7)],
)
def test_empirical_matches_softmax(temperature, top_k, top_p):
    """Chi-square goodness of fit with fixed seeds; false-failure rate 1e-4 per case."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(12, generator=gen) * 1.5
    draws = 6000
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)] * draws
    sampler = Sampler(seed=11)
    out = sampler.sample(logits.expand(draws, -1).contiguous(), params, [None] * draws)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=12)
    ref = _reference_probs(logits, temperature, top_k, top_p)
    assert counts[ref == 0].sum().item() == 0, "a filtered-out token was sampled"
    assert _chi_square_pvalue(counts, ref) > 1e-4
    got = processed_probs(logits[None], [params[0]])[0]
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-4)


def test_seeded_request_reproducible():
    """Seeded request is reproducible whatever shares its batch."""
    torch.manual_seed(0)
    steps = [torch.randn(6, 40) for _ in range(8)]
    target = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)

    def run(row: int, neighbours_seed: int | None) -> list[int]:
        sampler = Sampler(seed=neighbours_seed or 0)
        gens = [make_generator(neighbours_seed if i != row else target.seed) for i in range(6)]
        params = [SamplingParams(temperature=1.0, seed=neighbours_seed) for _ in range(6)]
        params[row] = target
        tokens = []
        for logits in steps:
            batch = logits.clone()
            batch[row] = logits[0]  # the target row sees the same logits in every layout
            tokens.append(sampler.sample(batch, params, gens).token_ids[row])
        return tokens

    alone = run(0, None)
    assert run(3, 99) == alone
    assert run(5, None) == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=4321)
    sampler = Sampler()
    gen = make_generator(other_seed.seed)
    different = [sampler.sample(s[:1], [other_seed], [gen]).token_ids[0] for s in steps]
    assert different != alone


def test_unseeded_requests_vary():
    logits = torch.zeros(1, 1000)
    sampler = Sampler(seed=5)
    tokens = {sampler.sample(logits, [SamplingParams()], [None]).token_ids[0] for _ in range(20)}
    assert len(tokens) > 10


def test_processed_probs_normalised():
    """Processed probs rows sum to one and greedy is one hot."""
    logits = torch.randn(3, 30)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=4), SamplingParams(top_p=0.5)]
    probs = processed_probs(logits, params)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))
    assert probs[0].argmax().item() == logits[0].argmax().item()
    assert probs[0].max().item() == 1.0
    assert int((probs[1] > 0).sum()) == 4


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": "x"}, "seed"),
        ({"stop": ("",)}, "stop"),
        ({"stop": tuple(f"s{i}" for i in range(17))}, "stop"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"stop_token_ids": (10_000,)}, "stop_token_ids"),
    ],
)
def test_validation_names_the_field(kwargs, field):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs).validate(vocab_size=512)
    assert info.value.field == field
    assert field in str(info.value)


def test_valid_params_pass():
    p = SamplingParams(
        max_tokens=5, temperature=0.0, top_p=1.0, top_k=-1, seed=0, stop=("x",), stop_token_ids=(3,)
    )
    assert p.validate(vocab_size=512) is p
    assert p.greedy
