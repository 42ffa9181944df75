"""The benchmark from start to end: train, distill, serve, time every level, report."""

from __future__ import annotations

from pathlib import Path

import torch

from ..harness import PhaseClock, log
from ..speculative.checks import eagle_check, expansion_check
from ..speculative.models import TrainedModels, train_models
from ..speculative.serving import Serving
from ..speculative.workloads import prompt_pool
from . import cli
from .checks import served_adapter_checks
from .cli import DRAFT_LABELS
from .corpora import load_task_corpus
from .decoders import Decoders, build_decoders
from .draft_distillation import distill_draft_adapter, small_head_dir
from .head_checks import served_head_adapter_checks
from .measure import BASE, MIXED, LevelOptions, measure_kind, warm_up
from .report import Record, write_report
from .serving import build_serving, served_draft_adapters
from .task_adapters import TaskAdapter, train_task_adapter
from .verdict import verdicts


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark on ``argv``; with ``--smoke``, 1 when a check of the flow failed."""
    s = cli.parse(argv)
    spec = s.spec
    clock, record = PhaseClock(), Record()
    with clock.phase(f"target and {DRAFT_LABELS[s.draft]}"):
        trained = train_models(spec)
    record.setup.update(target=trained.target_info, draft=trained.infos[s.draft], draft_kind=s.draft)
    adapters = train_adapters(s, trained, clock)
    for a in adapters:
        record.adapters[a.name] = {"training": a.info}
    with clock.phase("draft adapters"):
        draft_adapters = distill_all(s, trained, adapters, record)
    if spec.device.type == "cuda":
        torch.cuda.empty_cache()
    with clock.phase("serving"):
        serving = build_serving(spec, trained, adapters, max(s.adapter_training.rank, 16))
        pools = {BASE: prompt_pool(trained.held_ids, spec.prompt_len)}
        pools.update({a.name: prompt_pool(a.corpus.held_ids, spec.prompt_len) for a in adapters})
        record.setup.update(params=serving.target_params)
        record.setup["check"] = expansion_check(
            serving.runner, trained.small_dir, pools[BASE][0], spec.device
        )
        if trained.head is not None and serving.head_dir is not None:  # as bench/speculative checks it
            try:  # a failed check is reported; the timed runs still measure
                record.setup["head_check"] = eagle_check(
                    serving.runner,
                    serving.head_dir,
                    trained.head,
                    trained.small_dir,
                    pools[BASE][:4],
                    spec.k - 1,
                )
                log(f"served EAGLE head vs trained head on held-out prompts: {record.setup['head_check']}")
            except Exception as exc:
                _note(record, f"EAGLE head check failed: {type(exc).__name__}: {exc}")
        served = served_draft_adapters(spec, trained, draft_adapters)
        decoders = build_decoders(spec, serving, trained.draft_dir, served, s.draft_training.rank, s.draft)
        try:  # a failed check is reported; the timed runs still measure
            check_served(s, trained, adapters, draft_adapters, serving, decoders, pools, record)
        except Exception as exc:
            _note(record, f"serving checks failed: {type(exc).__name__}: {exc}")
    measure_levels(s, pools, serving, decoders, record, clock, adapters)
    print(_update(s, record, clock, adapters))
    log(f"total {clock.elapsed():.0f} s")
    return smoke_verdict(s, record)


def measure_levels(s: cli.Settings, pools: dict[str, list[list[int]]], serving: Serving, decoders: Decoders,
                   record: Record, clock: PhaseClock, adapters: list[TaskAdapter]) -> None:  # fmt: skip
    """Every concurrency level (the warm-ups, then each kind), while ``--deadline-s`` leaves
    time for one more level as long as the longest so far; the report rewritten after each."""
    spec = s.spec
    opts = LevelOptions(spec.gen_tokens, spec.waves, spec.args.c1_requests)
    kinds = [*pools, *([MIXED] if s.args.mixed else [])]
    longest = 0.0
    for c in spec.concurrency:
        if clock.elapsed() + 1.2 * longest > s.deadline_s:
            _note(record, f"concurrency {c} skipped: the --deadline-s {s.deadline_s:.0f} s budget is spent")
            continue
        started = clock.elapsed()
        with clock.phase(f"concurrency {c}"):
            for kind in ["warm-up", *kinds]:
                try:  # keep what was measured; say what failed
                    if kind == "warm-up":
                        warm_up(c, pools, serving, decoders, opts)
                    else:
                        record.results.append(measure_kind(c, kind, pools, serving, decoders, opts, spec.k))
                except Exception as exc:
                    _note(record, f"concurrency {c} {kind} failed: {type(exc).__name__}: {exc}")
        longest = max(longest, clock.elapsed() - started)
        _update(s, record, clock, adapters)


def _note(record: Record, message: str) -> None:
    """``message`` into the report's notes, and logged."""
    record.notes.append(message)
    log(message)


def train_adapters(s: cli.Settings, trained: TrainedModels, clock: PhaseClock) -> list[TaskAdapter]:
    """Each task corpus read and tokenized, then its LoRA trained on the small target."""
    with clock.phase("task corpora"):
        corpora = [
            load_task_corpus(name, trained.tokenizer_dir, trained.work, train_bytes=s.train_bytes,
                             held_bytes=s.held_bytes, distill_bytes=s.distill_bytes)
            for name in s.adapters
        ]  # fmt: skip
    for c in corpora:
        log(f"task corpus {c.name}: {c.info()}")
    with clock.phase("task adapters"):
        return [
            train_task_adapter(trained.small_dir, corpus, trained.work / f"adapter-{corpus.name}", s.spec.device,
                               s.adapter_training, seed=20 + i, tokenizer_dir=trained.tokenizer_dir)
            for i, corpus in enumerate(corpora)
        ]  # fmt: skip


def check_served(s: cli.Settings, trained: TrainedModels, adapters: list[TaskAdapter],
                 draft_adapters: dict[str, Path], serving: Serving, decoders: Decoders,
                 pools: dict[str, list[list[int]]], record: Record) -> None:  # fmt: skip
    """The served task adapters against the small adapted target, and the draft adapters in
    the draft's pool against the distilled ones (``draft_adapters``, as written by the
    distillation), each on its adapter's prompts: a STANDALONE draft's on one prompt, every
    position; an EAGLE head's on the proposals after four (``head_checks``)."""
    prompts = {a.name: pools[a.name][0] for a in adapters}
    task_dirs = {a.name: a.small_dir for a in adapters}
    target = served_adapter_checks(serving.runner, trained.small_dir, task_dirs, prompts)
    drafter = decoders.spec["adapted"].drafter.runner
    if s.draft == "eagle":
        assert trained.head is not None
        draft = served_head_adapter_checks(
            serving.runner, drafter, trained.head, trained.small_dir, task_dirs, draft_adapters,
            {a.name: pools[a.name][:4] for a in adapters}, s.spec.k - 1,
        )  # fmt: skip
    else:
        draft = served_adapter_checks(drafter, trained.draft_dir, draft_adapters, prompts)
    for a in adapters:
        record.adapters[a.name]["check"] = target[a.name]
        record.adapters[a.name]["draft_check"] = draft.get(a.name)
        log(f"{a.name}: served target vs small target, both adapted: {target[a.name]}; served draft adapter vs"
            f" distilled: {draft.get(a.name)}")  # fmt: skip


def distill_all(
    s: cli.Settings, trained: TrainedModels, adapters: list[TaskAdapter], record: Record
) -> dict[str, Path]:
    """Each task adapter's draft adapter (by the adapter's name), for the draft as trained (an
    EAGLE head over the small target: ``draft_distillation`` says why); one whose distillation
    fails is noted and left out (its requests then draft unadapted in the draft-adapter runs too)."""
    head = s.draft == "eagle"
    if head:
        assert trained.head is not None
        draft_dir = small_head_dir(trained.head, trained.small_dir, trained.work / "eagle-small")
    else:
        assert trained.draft_dir is not None
        draft_dir = trained.draft_dir
    out = {}
    for a in adapters:
        try:
            out[a.name], record.adapters[a.name]["draft"] = distill_draft_adapter(
                a, trained.small_dir, draft_dir, trained.work / f"draft-adapter-{a.name}", s.spec.device,
                s.draft_training, head=head,
            )  # fmt: skip
        except Exception as exc:  # the other adapters still measure
            _note(record, f"draft adapter {a.name}: distillation failed: {type(exc).__name__}: {exc}")
    return out


def _update(s: cli.Settings, record: Record, clock: PhaseClock, adapters: list[TaskAdapter]) -> str:
    """The verdicts and phases as they stand, the report written: a run cut short keeps what it measured."""
    record.verdicts = verdicts(record.results, [a.name for a in adapters], s.args.no_loss_tolerance)
    record.phases = clock.record()
    return write_report(s, record)


def smoke_verdict(s: cli.Settings, record: Record) -> int:
    """0, except for a ``--smoke`` run (float32, exact) where a speculative output differs from
    the plain one, a run failed, a served adapter (or head) computes other than the trained or
    distilled one, or a draft adapter's distillation did not bring the draft closer to its
    adapted target."""
    if not s.spec.smoke:
        return 0
    bad = [
        (r.concurrency, r.kind, name)
        for r in record.results
        for name in ("shared", "adapted")
        if r.identical(name)[0] != r.identical(name)[1] or r.identical(name)[1] == 0
    ]
    head_check = record.setup.get("head_check")
    if head_check is not None and not _exact(head_check):
        bad.append(("EAGLE head", "head_check", head_check))
    for name, a in record.adapters.items():
        draft = a.get("draft", {})
        for what in ("check", "draft_check"):
            check = a.get(what) or {}
            if not _exact(check) or (what == "draft_check" and not check.get("adapter_shift", 0) > 0):
                bad.append((name, what, check))
        if not draft.get("kl_after", float("inf")) < draft.get("kl_before", 0.0):
            bad.append((name, "distillation", draft))
    if bad or record.notes:
        print(f"smoke: checks failed: {bad} {record.notes}")
        return 1
    return 0


def _exact(check: dict) -> bool:
    """Whether a served-against-trained check holds exactly (float32): every argmax or
    proposal agrees and logits or features differ by float rounding only."""
    if "proposal_agreement" in check:  # an EAGLE head's: its proposals and output features
        return (
            check["proposal_agreement"] == 1.0
            and check.get("rel_feature_diff", 1.0) <= 1e-4
            and check.get("padded_norm", 0.0) <= 1e-5  # the expansion's padded dimensions stay zero
        )
    return check.get("argmax_agreement") == 1.0 and check.get("rel_logit_diff", 1.0) <= 1e-4
