"""Greedy acceptance and rejection sampling, against per-row oracles and the target distribution."""

from __future__ import annotations

import pytest
import torch

from loraserve.runtime.speculative.acceptance import greedy_accept, rejection_accept, sample_from_probs

ALPHA = 1e-3
"""Significance of each chi-square assertion: a correct sampler fails one with probability 1e-3
for a random seed; the seeds are fixed, so the outcome is reproducible."""


def _greedy_oracle(drafts: list[int], logits: torch.Tensor) -> list[int]:
    """Plain decoding one token at a time: accept drafts while they equal the argmax."""
    out: list[int] = []
    for i in range(logits.shape[0]):
        token = int(logits[i].argmax())
        out.append(token)
        if i == len(drafts) or drafts[i] != token:
            break
    return out


@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_greedy_accept_matches_stepwise(k):
    """Greedy accept matches one token at a time."""
    gen = torch.Generator().manual_seed(k)
    bs, vocab = 33, 11
    logits = torch.randn(bs, k, vocab, generator=gen)
    target = logits.argmax(-1)
    drafts = torch.randint(0, vocab, (bs, k - 1), generator=gen)
    # Copy a random-length prefix of the target's choices so every accept length occurs.
    prefix = torch.randint(0, k, (bs,), generator=gen)
    for b in range(bs):
        drafts[b, : prefix[b]] = target[b, : prefix[b]]
        if prefix[b] < k - 1:
            drafts[b, prefix[b]] = (target[b, prefix[b]] + 1) % vocab
    result = greedy_accept(drafts, logits)
    got = result.new_tokens()
    for b in range(bs):
        want = _greedy_oracle(drafts[b].tolist(), logits[b])
        assert got[b] == want
        assert int(result.accept_lens[b]) == len(want) - 1
        assert (result.tokens[b, len(want) :] == -1).all()
    if k > 1:
        assert set(result.accept_lens.tolist()) == set(range(k))


def test_rejection_with_one_hot_target_is_greedy():
    """Greedy rows expressed as one-hot target probabilities give exactly greedy acceptance."""
    gen = torch.Generator().manual_seed(3)
    bs, k, vocab = 64, 5, 9
    logits = torch.randn(bs, k, vocab, generator=gen)
    target = logits.argmax(-1)
    drafts = torch.where(
        torch.rand(bs, k - 1, generator=gen) < 0.7, target[:, :-1], (target[:, :-1] + 1) % vocab
    )
    one_hot = torch.nn.functional.one_hot(target, vocab).double()
    u = torch.rand(bs, 2 * k - 1, generator=gen, dtype=torch.float64)
    result = rejection_accept(drafts, one_hot, u[:, : k - 1], u[:, k - 1 :])
    expected = greedy_accept(drafts, logits)
    assert torch.equal(result.accept_lens, expected.accept_lens)
    assert torch.equal(result.tokens, expected.tokens)


def _random_chain(vocab: int, gen: torch.Generator, concentration: float = 1.0) -> torch.Tensor:
    """A random Markov transition matrix [vocab, vocab] (rows on the simplex)."""
    gamma = torch.distributions.Gamma(torch.full((vocab, vocab), concentration), torch.ones(vocab, vocab))
    torch.manual_seed(int(torch.randint(0, 1 << 30, (1,), generator=gen)))
    rows = gamma.sample().double()
    return rows / rows.sum(-1, keepdim=True)


def _simulate(
    target: torch.Tensor,
    draft: torch.Tensor,
    *,
    start: int,
    n: int,
    length: int,
    k: int,
    one_hot_draft: bool,
    accept_all: bool = False,
) -> torch.Tensor:
    """Generate ``length`` tokens for ``n`` independent requests with speculative steps.

    The "target model" is the Markov chain ``target`` (its distribution for the next token
    depends on the previous token), the draft is the chain ``draft``: sampled from it, or
    its argmax when ``one_hot_draft``. Returns the generated tokens ``[n, length]``.
    """
    gen = torch.Generator().manual_seed(length * 1000 + k)
    out = torch.full((n, length), -1, dtype=torch.long)
    count = torch.zeros(n, dtype=torch.long)
    last = torch.full((n,), start, dtype=torch.long)
    rows = torch.arange(n)
    while bool((count < length).any()):
        drafts = []
        prev = last
        for _ in range(k - 1):
            if one_hot_draft:
                tok = draft[prev].argmax(-1)
            else:
                u = torch.rand(n, generator=gen, dtype=torch.float64)
                tok = sample_from_probs(draft[prev], u)
            drafts.append(tok)
            prev = tok
        d = torch.stack(drafts, 1) if drafts else torch.zeros(n, 0, dtype=torch.long)
        inputs = torch.cat([last[:, None], d], 1)  # [n, k]
        p = target[inputs]  # [n, k, V]
        q = None if one_hot_draft else draft[inputs[:, :-1]]
        acc_u = torch.rand(n, k - 1, generator=gen, dtype=torch.float64)
        if accept_all:
            acc_u = torch.zeros_like(acc_u) - 1.0
        sample_u = torch.rand(n, k, generator=gen, dtype=torch.float64)
        result = rejection_accept(d, p, acc_u, sample_u, q)
        new = result.num_new_tokens
        for j in range(k):
            write = (j < new) & (count + j < length)
            out[rows[write], (count + j)[write]] = result.tokens[write, j]
        last = result.tokens[rows, new - 1]
        count = count + new
    return out


@pytest.mark.parametrize("one_hot_draft", [False, True], ids=["sampled-draft", "one-hot-draft"])
@pytest.mark.parametrize("k", [2, 4])
def test_rejection_sampling_matches_target(chi_square, one_hot_draft, k):
    """Joint law of the first two generated tokens equals the target chain's, whatever the draft."""
    gen = torch.Generator().manual_seed(100 + k)
    vocab, start, n = 5, 0, 20000
    target = _random_chain(vocab, gen)
    draft = _random_chain(vocab, gen)
    out = _simulate(target, draft, start=start, n=n, length=3, k=k, one_hot_draft=one_hot_draft)
    assert (out >= 0).all()
    joint = torch.zeros(vocab, vocab, dtype=torch.float64)
    joint.index_put_((out[:, 0], out[:, 1]), torch.ones(n, dtype=torch.float64), accumulate=True)
    expected = target[start][:, None] * target  # P(x1=a) P(x2=b | a)
    assert chi_square(joint, expected) > ALPHA
    third = torch.bincount(out[:, 2], minlength=vocab)
    assert chi_square(third, (target[start] @ target @ target)) > ALPHA


def test_chi_square_rejects_keep_all(chi_square):
    """The distribution check has power: always accepting the draft is caught."""
    gen = torch.Generator().manual_seed(104)
    vocab, start, n = 5, 0, 20000
    target = _random_chain(vocab, gen)
    draft = _random_chain(vocab, gen)
    out = _simulate(target, draft, start=start, n=n, length=3, k=4, one_hot_draft=False, accept_all=True)
    joint = torch.zeros(vocab, vocab, dtype=torch.float64)
    joint.index_put_((out[:, 0], out[:, 1]), torch.ones(n, dtype=torch.float64), accumulate=True)
    assert chi_square(joint, target[start][:, None] * target) < ALPHA


def test_sample_from_probs_never_draws_zero_mass():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0, 2.0]])
    for u in [0.0, 0.25, 0.5, 0.999999, 1.0 - 2**-53]:
        got = sample_from_probs(probs, torch.tensor([u, u], dtype=torch.float64))
        assert got[0].item() in (1, 3)
        assert got[1].item() == 4


def test_shape_errors_name_the_argument():
    logits = torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match="draft_tokens must be"):
        greedy_accept(torch.zeros(2, 3, dtype=torch.long), logits)
    with pytest.raises(ValueError, match="accept_uniforms"):
        rejection_accept(
            torch.zeros(2, 2, dtype=torch.long), logits.softmax(-1), torch.rand(2, 3), torch.rand(2, 3)
        )
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_accept(
            torch.zeros(2, 2, dtype=torch.long),
            logits.softmax(-1),
            torch.rand(2, 2),
            torch.rand(2, 3),
            torch.rand(2, 3, 5),
        )


def _staging_case(device: str):
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(5, 4, 13, generator=gen)
    drafts = logits.argmax(-1)[:, :-1].clone()
    drafts[1, 0] = (drafts[1, 0] + 1) % 13  # one row rejects its first draft
    return drafts.to(device), logits.to(device)


def test_staging_keeps_what_the_host_reads():
    """``stage()`` before ``host()`` (a no-op off CUDA) reads the same lists as ``host()`` alone."""
    drafts, logits = _staging_case("cpu")
    staged = greedy_accept(drafts, logits)
    staged.stage()
    assert staged.host() == greedy_accept(drafts, logits).host()
    assert staged.host()[0][1] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_staged_acceptance_read_early():
    """The decoder stages the acceptance before the drafter queues its next proposal: reading
    it must wait for the verify only, so the host works while the proposal runs."""
    drafts, logits = _staging_case("cuda")
    expected = greedy_accept(drafts.cpu(), logits.cpu()).host()
    acceptance = greedy_accept(drafts, logits)
    acceptance.stage()
    torch.cuda._sleep(500_000_000)  # stands in for the draft's replay: ~0.25 s of device time
    assert acceptance.host() == expected
    assert not torch.cuda.current_stream().query(), "host() waited for work queued after stage()"
    torch.cuda.synchronize()
