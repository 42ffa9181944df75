"""The decode-strategy seam: how a batch of running requests gains tokens.

The engine owns requests, scheduling, KV accounting and output; a :class:`Decoder` owns
the model calls. :class:`StandardDecoder` runs one target forward per step and samples
one token per request. A speculative decoder (``loraserve.runtime.speculative``) drafts and
verifies, returning up to ``k`` tokens per request per step; when ``config.speculative.enabled``
the engine builds one with the factory its builder hands in (:class:`DecoderFactory`).

Contract every decoder keeps:

- ``extend(chunks)`` runs prefill chunks ``(request, n)``: the next ``n`` tokens of
  ``request.all_ids`` from ``request.num_cached``. For a request whose prefill completes
  in this chunk it returns a :class:`StepOutput` with the first new token; ``None`` for
  the others. The engine advances ``num_cached``.
- ``step(requests)`` returns one :class:`StepOutput` per request (1 token for plain
  decoding, up to ``k`` for speculation). On return the request's KV cache (target and
  any draft) holds every token of ``all_ids + new tokens`` except the last new one.
- ``tokens_per_step`` is the most KV tokens a step appends to one request (1 for plain
  decoding, the verify width for speculation): the scheduler reserves it.
- ``on_add(request)`` when a request enters the running set (again, after a retraction);
  ``on_finish(request)`` whenever it leaves it (finished, aborted, failed or retracted:
  ``request.state`` says which) — free any per-request state (a draft's KV) there. The
  engine frees the target's KV itself, after ``on_finish``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from loraserve.kernels import ForwardMode

from ..contract.config import RuntimeConfig
from ..sampling import Sampler
from .logits import gather_prompt_logprobs, last_rows, processed, token_logprobs, wants_prompt_logprobs
from .request import Request, TopLogprobs


@dataclass
class StepOutput:
    """New tokens for one request from one step, with optional chosen-token logprobs."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    num_draft_tokens: int = 0  # speculation: drafts proposed this step
    num_accepted: int = 0  # speculation: drafts accepted this step
    top_logprobs: list[TopLogprobs] | None = None  # per token, when params.top_logprobs


@runtime_checkable
class Decoder(Protocol):
    tokens_per_step: int

    def extend(self, chunks: Sequence[tuple[Request, int]]) -> list[StepOutput | None]: ...

    def step(self, requests: Sequence[Request]) -> list[StepOutput]: ...

    def on_add(self, request: Request) -> None: ...

    def on_finish(self, request: Request) -> None: ...


def chunk_ids(chunks: Sequence[tuple[Request, int]]) -> list[int]:
    """The token ids a prefill batch runs: each request's next ``n`` tokens of ``all_ids``."""
    ids: list[int] = []
    for req, n in chunks:
        ids.extend(req.all_ids[req.num_cached : req.num_cached + n])
    return ids


def prefill_outputs(
    sampler: Sampler, chunks: Sequence[tuple[Request, int]], logits: torch.Tensor, every_position: bool
) -> tuple[torch.Tensor, list[StepOutput | None]]:
    """After a prefill forward: record prompt logprobs (``every_position``: ``logits`` holds
    every row), then sample the first token of each request whose prompt is now complete.
    Returns the chunks' last-row logits and one output per chunk (None: still prefilling)."""
    if every_position:
        gather_prompt_logprobs(chunks, logits)
        logits = last_rows(chunks, logits)
    results: list[StepOutput | None] = [None] * len(chunks)
    done = [i for i, (req, n) in enumerate(chunks) if req.num_cached + n >= req.prefill_target]
    if done:
        rows = logits.index_select(0, torch.tensor(done, device=logits.device))
        for i, out in zip(done, sample_rows(sampler, rows, [chunks[i][0] for i in done]), strict=True):
            results[i] = out
    return logits, results


def sample_rows(sampler: Sampler, logits: torch.Tensor, requests: Sequence[Request]) -> list[StepOutput]:
    """One sampled token per row of ``logits``, row ``i`` for ``requests[i]``, after each
    request's logit processing; log-probabilities from the raw logits."""
    chosen = processed(logits, requests)
    out = sampler.sample(chosen, [r.params for r in requests], [r.generator for r in requests])
    tokens = torch.tensor(out.token_ids, dtype=torch.int64, device=logits.device)[:, None]
    logprobs, tops = token_logprobs(logits, tokens, requests)
    return [
        StepOutput(
            [tok],
            None if logprobs is None else logprobs[i],
            top_logprobs=None if tops is None else tops[i],
        )
        for i, tok in enumerate(out.token_ids)
    ]


class StandardDecoder:
    """One target forward per step, one sampled token per request."""

    tokens_per_step = 1

    def __init__(self, runner, sampler: Sampler) -> None:
        self.runner = runner
        self.sampler = sampler

    def _device(self) -> torch.device:
        return getattr(self.runner, "device", torch.device("cpu"))

    def extend(self, chunks: Sequence[tuple[Request, int]]) -> list[StepOutput | None]:
        from ..runner.forward_batch import ForwardBatch

        requests = [r for r, _ in chunks]
        every_position = wants_prompt_logprobs(chunks)
        batch = ForwardBatch(
            mode=ForwardMode.EXTEND,
            request_ids=[r.rid for r in requests],
            input_ids=torch.tensor(chunk_ids(chunks), dtype=torch.int64, device=self._device()),
            extend_lens=[n for _, n in chunks],
            lora_names=[r.adapter for r in requests],
            return_all_logits=every_position,
        )
        logits = self.runner.forward(batch).logits
        return prefill_outputs(self.sampler, chunks, logits, every_position)[1]

    def step(self, requests: Sequence[Request]) -> list[StepOutput]:
        from ..runner.forward_batch import ForwardBatch

        batch = ForwardBatch(
            mode=ForwardMode.DECODE,
            request_ids=[r.rid for r in requests],
            input_ids=torch.tensor(
                [r.last_token for r in requests], dtype=torch.int64, device=self._device()
            ),
            lora_names=[r.adapter for r in requests],
        )
        logits = self.runner.forward(batch).logits
        return sample_rows(self.sampler, logits, requests)

    def on_add(self, request: Request) -> None:
        return None

    def on_finish(self, request: Request) -> None:
        return None


class DecoderFactory(Protocol):
    """Builds the decoder of a speculative configuration (``loraserve.runtime.speculative.build_decoder``)."""

    def __call__(self, *, config: RuntimeConfig, runner, sampler: Sampler) -> Decoder: ...


class DecoderUnavailableError(RuntimeError):
    """Speculative decoding was asked for but the engine was given no way to build its decoder."""


def build_decoder(
    config: RuntimeConfig, runner, sampler: Sampler, speculative: DecoderFactory | None = None
) -> Decoder:
    """The decoder for a configuration: standard, or the one ``speculative`` builds when
    ``config.speculative.enabled``.

    The engine never imports the speculative package (it sits above the engine): whoever
    builds the engine hands its factory in (``loraserve.runtime.builder.build_engine`` does).
    """
    if not config.speculative.enabled:
        return StandardDecoder(runner, sampler)
    if speculative is None:
        raise DecoderUnavailableError(
            f"speculative.algorithm={config.speculative.algorithm.value} needs a speculative decoder and "
            "this engine was built without one: build it with loraserve.runtime.builder.build_engine "
            "(or pass decoder_factory=loraserve.runtime.speculative.build_decoder), "
            "or use --speculative-algorithm NONE"
        )
    decoder = speculative(config=config, runner=runner, sampler=sampler)
    if not isinstance(decoder, Decoder):
        raise DecoderUnavailableError(f"the speculative decoder factory returned {type(decoder).__name__}, not a Decoder")
    return decoder
