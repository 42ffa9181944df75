"""The speculative decoder: draft without adapters, verify with each request's adapter.

One step, for a batch of decoding requests:

1. the drafter proposes ``width - 1`` tokens per request (no adapter anywhere);
2. the target runs ONE target-verify forward of ``bs × width`` rows, each request's last
   committed token followed by its drafts, with the request's own adapter: every request
   carries exactly ``width`` rows (the verify width), so the LoRA segments stay uniform (token counts from
   :func:`loraserve.kernels.token_counts`);
3. acceptance: greedy (the target's argmax) or rejection sampling (the target's exact
   distribution after temperature / top-k / top-p);
4. rejected tokens are dropped from both caches; the accept length of every request is
   recorded (per request in its :class:`StepOutput`, overall and per adapter in
   :class:`SpecMetrics`).

A request too close to the context limit to verify ``width`` tokens decodes one token
without speculation in the same step. A step of at least
``speculative.disable_batch_size`` requests (when set) skips drafting altogether: one
ordinary decode forward, whose results the drafter still sees (``on_decode``), so
speculation resumes where it left off once the batch is smaller again. Large batches are
where a verify of ``bs × width`` rows stops being nearly free. With
``speculative.auto_disable`` each batch-size bucket takes the step shape (a tree where one
is configured, a chain, or no drafting) with the best measured throughput (:mod:`.switch`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from loraserve.kernels import ForwardMode

from ..contract.config import RuntimeConfig, SpecAlgorithm
from ..engine.decoder import StepOutput, chunk_ids, prefill_outputs, sample_rows
from ..engine.logits import processed_verify, token_logprobs, wants_prompt_logprobs
from ..engine.request import FinishReason, Request
from ..runner.forward_batch import ForwardBatch
from ..sampling import Sampler, processed_probs
from .acceptance import Acceptance, greedy_accept, rejection_accept
from .drafter import Drafter
from .metrics import SpecMetrics
from .switch import SpeculationSwitch, StepShape
from .tree import TreeShape, greedy_tree_accept

log = logging.getLogger("loraserve.spec")


class SpeculativeDecoder:
    """Implements the engine's ``Decoder`` protocol with a drafter and target-verify."""

    def __init__(
        self,
        config: RuntimeConfig,
        runner,
        sampler: Sampler,
        drafter: Drafter,
        *,
        algorithm: SpecAlgorithm,
    ):
        self.runner = runner
        self.sampler = sampler
        self.drafter = drafter
        self.algorithm = algorithm
        spec = config.speculative
        # Tree drafts verify num_draft_tokens nodes; a batch with a sampled request verifies a
        # chain of num_steps drafts instead (rejection sampling runs over chains).
        self.tree: TreeShape | None = None
        if spec.top_k > 1 and getattr(drafter, "supports_trees", False):
            self.tree = TreeShape(int(spec.top_k), int(spec.num_steps), int(spec.num_draft_tokens))
        # The verify width of a chain step: the last committed token and its drafts.
        self.width = int(spec.num_steps) + 1 if self.tree is not None else int(spec.num_draft_tokens)
        self.tree_max_batch_size = int(spec.tree_max_batch_size)  # 0: trees at every size
        self.disable_batch_size = int(spec.disable_batch_size)
        self.switch = SpeculationSwitch() if spec.auto_disable else None
        # KV rows a step may append to one request (the larger of the two verify widths)
        self.tokens_per_step = max(self.width, self.tree.num_nodes if self.tree is not None else 0)
        self.device = getattr(runner, "device", torch.device("cpu"))
        self.metrics = SpecMetrics(algorithm.value, self.width)

    # ------------------------------------------------------------------ prefill
    def _target_batch(
        self, mode: ForwardMode, requests: Sequence[Request], input_ids: torch.Tensor, *, features: bool = True, **kw
    ):
        """A target batch; ``features``: with the hidden states the drafter reads."""
        return ForwardBatch(
            mode=mode,
            request_ids=[r.rid for r in requests],
            input_ids=input_ids,
            lora_names=[r.adapter for r in requests],
            return_hidden=features and self.drafter.needs_hidden,
            hidden_layers=self.drafter.hidden_layers if features else None,
            **kw,
        )

    def extend(self, chunks: Sequence[tuple[Request, int]]) -> list[StepOutput | None]:
        """Target prefill chunks (with the features a drafter needs), then the drafter's."""
        requests = [r for r, _ in chunks]
        every_position = wants_prompt_logprobs(chunks)
        batch = self._target_batch(
            ForwardMode.EXTEND,
            requests,
            torch.tensor(chunk_ids(chunks), dtype=torch.int64, device=self.device),
            extend_lens=[n for _, n in chunks],
            return_all_logits=every_position,
        )
        output = self.runner.forward(batch)
        # The drafters see the usual one row per chunk.
        output.logits, results = prefill_outputs(self.sampler, chunks, output.logits, every_position)
        first = [None if out is None else out.token_ids[0] for out in results]
        try:
            self.drafter.on_extend(chunks, output, first)
        except Exception:
            # The target's work stands; the draft re-syncs (or drafts blind) for these requests.
            log.exception("draft prefill failed; drafting resumes from the next step")
            for req in requests:
                self.drafter.release(req)
        return results

    # ------------------------------------------------------------------ decode
    def step(self, requests: Sequence[Request]) -> list[StepOutput]:
        """Draft, verify and accept for every request; 1..width new tokens each."""
        limit = self.runner.kv.max_context_len
        fits = [r.num_tokens - 1 + self.tokens_per_step <= limit for r in requests]
        spec_rows = [i for i, ok in enumerate(fits) if ok]
        plain_rows = [i for i, ok in enumerate(fits) if not ok]
        outputs: list[StepOutput | None] = [None] * len(requests)
        start = time.perf_counter()
        bs = len(requests)
        pure = not (spec_rows and plain_rows)  # one kind of step: its timing says something
        shape = self._shape(bs, [requests[i] for i in spec_rows]) if spec_rows else StepShape.PLAIN
        if spec_rows and shape is StepShape.PLAIN:
            plain_rows = list(range(bs))
            spec_rows = []
            self.metrics.record_undrafted(bs)
        try:
            if spec_rows:
                drafted = self._speculate([requests[i] for i in spec_rows], tree=shape is StepShape.TREE)
                for i, out in zip(spec_rows, drafted, strict=True):
                    outputs[i] = out
            if plain_rows:
                plain = [requests[i] for i in plain_rows]
                outs = self._plain(plain, keep_drafting=[fits[i] for i in plain_rows])
                for i, out in zip(plain_rows, outs, strict=True):
                    outputs[i] = out
        except BaseException:
            # The engine restores the target's cache and retries request by request; the
            # draft state of this batch can no longer be trusted.
            for req in requests:
                self.drafter.release(req)
            raise
        if self.switch is not None and pure:
            self.switch.record(
                bs,
                shape,
                tokens=sum(len(out.token_ids) for out in outputs if out is not None),
                seconds=time.perf_counter() - start,
            )
        return outputs  # type: ignore[return-value]

    def _shape(self, bs: int, requests: Sequence[Request]) -> StepShape:
        """What this step of ``bs`` requests verifies (``requests``: those that may draft)."""
        if 0 < self.disable_batch_size <= bs:
            return StepShape.PLAIN
        shapes = self.shapes(requests)
        if self.switch is None:
            return shapes[0]
        return self.switch.choose(bs, shapes, adapters=[r.adapter for r in requests])

    def shapes(self, requests: Sequence[Request]) -> list[StepShape]:
        """The shapes a step of ``requests`` may take, the configured one first: a tree where
        one is configured and the batch allows it, a chain always, no drafting where
        ``speculative.auto_disable`` lets the switch measure it."""
        shapes = [StepShape.TREE] if self.tree is not None and self._tree_fits(requests) else []
        shapes.append(StepShape.CHAIN)
        if self.switch is not None:
            shapes.append(StepShape.PLAIN)
        return shapes

    def _plain(self, requests: Sequence[Request], keep_drafting: Sequence[bool]) -> list[StepOutput]:
        """One ordinary decode step. Requests within ``width`` tokens of the context limit
        (``keep_drafting`` False) never speculate again and drop their draft state; the
        others (a batch too large to draft for) hand the drafter what it needs to resume."""
        for req, keep in zip(requests, keep_drafting, strict=True):
            if not keep:
                self.drafter.release(req)
        synced = [i for i, keep in enumerate(keep_drafting) if keep]
        ids = torch.tensor([r.last_token for r in requests], dtype=torch.int64, device=self.device)
        output = self.runner.forward(self._target_batch(ForwardMode.DECODE, requests, ids, features=bool(synced)))
        outs = sample_rows(self.sampler, output.logits, requests)
        if synced:
            kept = [requests[i] for i in synced]
            try:
                self.drafter.on_decode(
                    kept,
                    [outs[i].token_ids[0] for i in synced],
                    output.select_rows(synced) if len(synced) < len(requests) else output,
                )
            except Exception:
                # As after a prefill: the target's tokens stand; these drafts start over.
                log.exception("draft update after a step without drafting failed; drafting resumes afresh")
                for req in kept:
                    self.drafter.release(req)
        return outs

    def _speculate(self, requests: Sequence[Request], *, tree: bool) -> list[StepOutput]:
        if tree:
            assert self.tree is not None
            return self._speculate_tree(requests, self.tree)
        start = time.perf_counter()
        width = self.width
        # Host list -> device without a blocking copy: the drafts are still being computed.
        last = torch.tensor([r.last_token for r in requests], dtype=torch.int64)
        proposal = self.drafter.propose(requests, width - 1)
        drafts = proposal.tokens.to(self.device)
        last = last.to(self.device, non_blocking=True)
        verify_ids = torch.cat([last[:, None], drafts], dim=1).reshape(-1)
        timer = _VerifyTimer(self.device)
        output = self.runner.forward(
            self._target_batch(ForwardMode.TARGET_VERIFY, requests, verify_ids, num_draft_tokens=width)
        )
        acceptance = self._accept(requests, drafts, output.logits, proposal.probs)
        timer.stop()
        # The acceptance's copy to the host is queued here, so reading it waits for the
        # verify only. The drafter then queues its next work right behind the verify (EAGLE:
        # the feed and the next proposal), and the device runs it while the host does this
        # step's bookkeeping and queues the next verify behind it.
        acceptance.stage()
        self.drafter.on_verify(requests, acceptance, output)
        accept_lens = acceptance.host_accept_lens()  # the step's one wait for the device
        verify_seconds = timer.seconds()
        for req, accepted in zip(requests, accept_lens, strict=True):
            self.runner.kv.truncate(req.rid, width - 1 - accepted)
        logprobs = token_logprobs(output.logits, acceptance.tokens, requests)
        return self._outputs(
            requests, acceptance, logprobs, width, width - 1, verify_seconds, time.perf_counter() - start,
            StepShape.CHAIN,
        )

    def _outputs(
        self,
        requests: Sequence[Request],
        acceptance: Acceptance,
        logprobs: tuple[list | None, list | None],
        width: int,
        max_accept: int,
        verify_seconds: float,
        step_seconds: float,
        shape: StepShape,
    ) -> list[StepOutput]:
        """A verify step's outputs (``width`` rows verified per request: ``width - 1`` drafts),
        recorded in the metrics as accept lengths out of ``max_accept`` positions."""
        accept_lens, token_rows = acceptance.host()
        chosen, tops = logprobs
        outs = [
            StepOutput(
                token_ids=row[: accepted + 1],
                logprobs=None if chosen is None or chosen[i] is None else chosen[i][: accepted + 1],
                num_draft_tokens=width - 1,
                num_accepted=accepted,
                top_logprobs=None if tops is None or tops[i] is None else tops[i][: accepted + 1],
            )
            for i, (row, accepted) in enumerate(zip(token_rows, accept_lens, strict=True))
        ]
        self.metrics.record_step(
            [r.adapter for r in requests], accept_lens, max_accept, contexts=[r.num_tokens for r in requests],
            verify_seconds=verify_seconds, step_seconds=step_seconds,
            shape=shape, bucket_of=len(requests),
        )  # fmt: skip
        return outs

    def _tree_fits(self, requests: Sequence[Request]) -> bool:
        """Whether this step verifies a tree: an all-greedy batch (rejection sampling runs
        over chains) no larger than ``speculative.tree_max_batch_size`` (when set), where no
        request processes its logits (a node's processing depends on its path: chains only;
        a ``min_tokens`` mask stops mattering once that many tokens are out)."""
        limit = self.tree_max_batch_size
        return (limit == 0 or len(requests) <= limit) and all(
            r.params.greedy and not r.params.processes_logits_after(len(r.output_ids)) for r in requests
        )

    def _speculate_tree(self, requests: Sequence[Request], shape: TreeShape) -> list[StepOutput]:
        """A greedy tree step: grow, verify every node at once, keep the accepted path."""
        start = time.perf_counter()
        bs, width = len(requests), shape.num_nodes  # a tree verifies every node
        last = torch.tensor([r.last_token for r in requests], dtype=torch.int64)
        tree = self.drafter.propose_tree(requests, shape)  # type: ignore[attr-defined]
        verify_ids = tree.with_root(last.to(self.device, non_blocking=True)).reshape(-1)
        timer = _VerifyTimer(self.device)
        output = self.runner.forward(
            self._target_batch(
                ForwardMode.TARGET_VERIFY, requests, verify_ids, num_draft_tokens=width,
                tree_depths=tree.depths, tree_ancestors=tree.ancestors,
            )
        )  # fmt: skip
        logits = output.logits.view(bs, width, -1)
        acceptance = greedy_tree_accept(tree, logits)
        timer.stop()
        acceptance.stage()  # as in a chain step: the host waits for the verify only
        self.drafter.on_verify(requests, acceptance, output)
        accept_lens, paths = acceptance.host_accept_lens(), acceptance.host_path()
        verify_seconds = timer.seconds()
        kv = self.runner.kv
        kv.keep(
            [
                (req.rid, kv.seq_len(req.rid) - width, path[: accepted + 1])
                for req, path, accepted in zip(requests, paths, accept_lens, strict=True)
            ]
        )
        logprobs = token_logprobs(
            acceptance.along_path(logits).reshape(-1, logits.shape[-1]), acceptance.tokens, requests
        )
        return self._outputs(
            requests, acceptance, logprobs, width, shape.num_steps, verify_seconds, time.perf_counter() - start,
            StepShape.TREE,
        )

    def _accept(
        self,
        requests: Sequence[Request],
        drafts: torch.Tensor,
        logits: torch.Tensor,
        draft_probs: torch.Tensor | None,
    ) -> Acceptance:
        bs, width = len(requests), self.width
        params = [r.params for r in requests]
        # Each position as a plain step would see it (penalties, biases, grammar masks).
        logits = processed_verify(logits, requests, drafts)
        if all(p.greedy for p in params):
            return greedy_accept(drafts, logits.view(bs, width, -1))
        # The target's sampling distribution of every row, exactly as the sampler builds it.
        target = processed_probs(logits, [p for p in params for _ in range(width)]).view(bs, width, -1)
        accept_u = torch.zeros(bs, width - 1, dtype=torch.float64)
        sample_u = torch.zeros(bs, width, dtype=torch.float64)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        # Greedy rows keep u = 0: with a one-hot target that accepts exactly the argmax.
        draws = self.sampler.uniform([requests[i].generator for i in sampled], 2 * width - 1)
        accept_u[sampled] = draws[:, : width - 1]
        sample_u[sampled] = draws[:, width - 1 :]
        return rejection_accept(
            drafts, target, accept_u.to(logits.device), sample_u.to(logits.device), draft_probs
        )

    # ------------------------------------------------------------------ lifecycle
    def on_add(self, request: Request) -> None:
        self.drafter.release(request)  # nothing from an earlier run of this request is valid

    def on_finish(self, request: Request) -> None:
        # A drafter may keep what a request leaves (a STANDALONE draft's prefix cache), but
        # never a failed request's state.
        finish = getattr(self.drafter, "finish", None)
        if finish is not None and request.finish_reason is not FinishReason.ERROR:
            finish(request)
        else:
            self.drafter.release(request)


class _VerifyTimer:
    """Time of the target-verify forward plus acceptance.

    On CUDA, events on the stream: the host may queue the drafter's next work behind the
    verify before it waits, so the host's clock would count that work too. Elsewhere the
    work is synchronous and the host's clock is the measure."""

    def __init__(self, device: torch.device):
        self._cuda = device.type == "cuda"
        self._t0 = time.perf_counter()
        self._t1: float | None = None
        if self._cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._start.record()

    def stop(self) -> None:
        if self._cuda:
            self._end.record()
        else:
            self._t1 = time.perf_counter()

    def seconds(self) -> float:
        """Call once the host has waited for the device past :meth:`stop`."""
        if self._cuda:
            return self._start.elapsed_time(self._end) / 1000.0
        assert self._t1 is not None
        return self._t1 - self._t0
