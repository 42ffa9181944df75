"""The markdown report and the JSON record: setup, task adapters and their draft adapters,
one row per (concurrency, request kind), the targets per adapter, the time per phase."""

from __future__ import annotations

import dataclasses
import datetime
import sys
from dataclasses import dataclass, field

from .. import harness
from ..harness import environment, environment_line
from ..speculative.shapes import SHAPES
from .cli import Settings
from .measure import MIXED, KindResult
from .verdict import C1_GAIN_TARGET, RECOVERY_TARGET, AdapterVerdict


@dataclass
class Record:
    """Everything the report is written from; filled in as the run goes."""

    setup: dict = field(default_factory=dict)  # target, draft, serving checks
    adapters: dict[str, dict] = field(default_factory=dict)  # per task adapter: training, moves, check, draft
    results: list[KindResult] = field(default_factory=list)
    verdicts: list[AdapterVerdict] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def write_report(s: Settings, record: Record) -> str:
    """The report as it stands, written to ``--out`` (and the JSON to ``--json``, or beside it)."""
    text = "\n".join(report_lines(s, record)) + "\n"
    harness.write_report(text, json_record(s, record), out=s.args.out, json_to=s.args.json, name="draft_adapters")
    return text


def json_record(s: Settings, record: Record) -> dict:
    """The run as JSON: setup, adapters, every run, the verdicts and the phases."""
    return {
        "argv": s.argv if s.argv is not None else sys.argv[1:],
        "setup": record.setup,
        "adapters": record.adapters,
        "results": [dataclasses.asdict(r) for r in record.results],
        "verdicts": [verdict_record(v) for v in record.verdicts],
        "phases": record.phases,
        "notes": record.notes,
    }


def verdict_record(v: AdapterVerdict) -> dict:
    """One adapter's verdict as JSON, with the derived numbers and each target's outcome."""
    return {**dataclasses.asdict(v), "lost": v.lost, "c1_gain": v.c1_gain, "met": v.met()}


def report_lines(s: Settings, record: Record) -> list[str]:
    """Setup, adapters, results, targets, phases, notes."""
    lines = _setup_lines(s, record.setup)
    lines += adapter_table(record.adapters, head=s.draft == "eagle")
    lines += results_table(s, record.results)
    lines += targets_table(record.verdicts)
    lines += ["", "Time per phase (s): " + ", ".join(f"{k} {v}" for k, v in record.phases.items())]
    lines += [""] + [f"- {n}" for n in record.notes]
    return lines


def _setup_lines(s: Settings, setup: dict) -> list[str]:
    spec = s.spec
    argv = s.argv if s.argv is not None else sys.argv[1:]
    target, draft = setup.get("target", {}), setup.get("draft", {})
    lines = [
        f"# Draft adapters: accept length of adapted requests with the shared draft and with their own"
        f" ({datetime.date.today().isoformat()})",
        "",
        f"- {environment_line(environment(spec.device))}",
        f"- command: `python bench/draft_adapters {' '.join(argv)}`",
    ]
    if "params" in setup:
        lines.append(
            f"- serving target: {spec.target_shape} shape, {setup['params'] / 1e9:.2f} B parameters,"
            f" {'bf16, CUDA graphs on' if spec.device.type == 'cuda' else 'float32, no CUDA graphs'};"
            f" computes the trained small target's function (check on a held-out prompt: {setup.get('check')})"
        )
    if target:
        lines.append(
            f"- small target {SHAPES[spec.small_shape]} (hidden, layers, heads, kv, head_dim, mlp) trained"
            f" {target['steps']} steps on the standard library's Python, final loss {target['final_loss']}"
        )
    if draft and s.draft == "eagle":
        lines.append(
            f"- EAGLE head (one decoder layer of the small target's shape over its final normed features, its"
            f" embeddings and LM head shared) trained {draft['steps']} steps as `bench/speculative` trains it"
            f" (final loss {draft['final_loss']}, held-out top-1 per draft step {draft.get('heldout_top1')});"
            f" served expanded to the target's shape as an EAGLE chain (check against the trained head on"
            f" held-out prompts: {_head_check(setup.get('head_check'))})"
        )
    elif draft:
        lines.append(
            f"- STANDALONE draft {SHAPES[spec.draft_shape]}, distilled from the target {draft['steps']} steps"
            f" (final KL {draft['final_loss']}); served as trained, beside the served target"
        )
    lines.append(
        f"- verify width k = {spec.k}; greedy; prompts of {spec.prompt_len} tokens from held-out files (base:"
        f" the standard library's; an adapter's: its corpus's); {spec.gen_tokens} new tokens; each kind's"
        f" requests run on their own: {spec.args.c1_requests} one after another at concurrency 1,"
        f" {spec.waves} x c at concurrency c"
    )
    return lines


def adapter_table(adapters: dict[str, dict], head: bool = False) -> list[str]:
    """Per task adapter: its corpus, training, how far it moved the target, the served check
    and its draft adapter's distillation (``head``: the draft is an EAGLE head)."""
    if head:
        draft_text = (
            " EAGLE head: draft adapters on the head's fc and projections, distilled over the small target with its"
            " task adapter (the head reads its features), then expanded as the head is; draft check = the served"
            " head with its adapter (the head's pool, the served target's features) vs the trained head with the"
            " distilled adapter merged (the small target's features): proposals after held-out prompts, output"
            " features, padded dimensions, and how far the adapter moves the served head's logits."
        )
    else:
        draft_text = (
            " draft check = the draft adapter as served from the draft's pool vs the distilled one (peft), and how"
            " far it moves the draft's logits."
        )
    lines = [
        "",
        "## Task adapters and their draft adapters",
        "",
        "Task adapters: LoRA on every linear module of the small target, next-token loss on their corpus, expanded"
        " to the served shape; moved = held-out loss of the target without -> with the adapter and the share of"
        " positions whose top-1 token it changes; served check = served adapted target vs small adapted target on a"
        " held-out prompt. Draft adapters: `loraserve-distill-draft` (KL to the adapted target, draft frozen) on a"
        " slice of the adapter's corpus and the adapted target's greedy answers to prompts from it, scored on a"
        " held-out slice before -> after;" + draft_text,
        "",
        "| adapter | corpus | trained | held-out loss | top-1 changed | served check | draft adapter trained"
        " | KL(adapted target, draft) | top-1 agreement | draft check |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, a in adapters.items():
        t, d, c, dc = (
            a.get("training", {}),
            a.get("draft", {}),
            a.get("check", {}),
            a.get("draft_check") or {},
        )
        lines.append(
            f"| {name} | {t.get('source')} ({t.get('train_tokens', 0) / 1e6:.1f} M tokens) |"
            f" {t.get('steps')} steps, {t.get('seconds')} s, loss {t.get('final_loss')} |"
            f" {t.get('heldout_loss_base')} -> {t.get('heldout_loss_adapted')} | {_pct(t.get('top1_changed'))} |"
            f" rel {c.get('rel_logit_diff')}, argmax {c.get('argmax_agreement')} |"
            f" {d.get('steps')} steps, {d.get('seconds')} s, {d.get('train_sequences')} sequences"
            f" ({t.get('answers', 0)} answers) | {d.get('kl_before')} -> {d.get('kl_after')} |"
            f" {_pct(d.get('agreement_before'))} -> {_pct(d.get('agreement_after'))} |"
            f" {_head_check(dc) if head else _draft_check(dc)} |"
        )
    return lines


def results_table(s: Settings, results: list[KindResult]) -> list[str]:
    """One row per (concurrency, kind): plain, shared draft, draft adapter."""
    lines = [
        "",
        "## Runs",
        "",
        f"Accepted = mean accepted drafts a step (of {s.spec.k - 1}; tokens a step = 1 + that). Identical ="
        " outputs equal to the plain run's, token for token (bf16 on a GPU flips near-ties). Step ms: a speculative"
        " decode step, drafting and verify.",
        "",
        "| c | kind | requests | no spec tok/s | shared draft tok/s | speedup | accepted | draft adapter tok/s"
        " | speedup | accepted | step ms (shared, adapter) | identical (shared, adapter) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        plain, shared, adapted = (r.runs.get(n) for n in ("plain", "shared", "adapted"))
        cells = [f"{plain.tokens_per_s:,.1f}" if plain else "–"]
        for name, run in (("shared", shared), ("adapted", adapted)):
            speed = r.speedup(name)
            cells += [f"{run.tokens_per_s:,.1f}" if run else "–", f"{speed:.2f}x" if speed else "–",
                      str(r.accept(name))]  # fmt: skip
        steps = ", ".join(
            str(run.summary["step_ms"]) if run and run.summary else "–" for run in (shared, adapted)
        )
        same = ", ".join("/".join(map(str, r.identical(n))) for n in ("shared", "adapted"))
        lines.append(
            f"| {r.concurrency} | {r.kind} | {r.requests} | {' | '.join(cells)} | {steps} | {same} |"
        )
    mixed = [r for r in results if r.kind == MIXED and r.runs.get("shared") and r.runs.get("adapted")]
    if mixed:
        lines += ["", "Mixed batches (every kind in the same batches), accepted drafts a step per kind, shared draft ->"
                  " draft adapters:", ""]  # fmt: skip
        for r in mixed:
            shared = r.runs["shared"].summary["per_adapter_mean_accept"]
            adapted = r.runs["adapted"].summary["per_adapter_mean_accept"]
            per = ", ".join(f"{kind} {shared[kind]} -> {adapted.get(kind)}" for kind in shared)
            lines.append(f"- c = {r.concurrency}: {per}")
    return lines


def targets_table(verdicts: list[AdapterVerdict]) -> list[str]:
    """Each adapter against issue 25's targets, and whether every adapter meets each."""
    if not verdicts:
        return []
    top = verdicts[0].top
    tol = verdicts[0].tolerance
    lines = [
        "",
        "## Targets",
        "",
        "Accepted drafts a step, mean over the concurrency levels: base requests and this adapter's requests with the"
        f" shared draft, then with the adapter's draft adapter; recovered = the share of the lost accept length won"
        f" back (target >= {RECOVERY_TARGET:.0%}); c = 1 speedup with the shared draft -> with the draft adapter (target:"
        f" >= {C1_GAIN_TARGET:.0%} higher); c = {top}: the draft adapter's tokens/s over the shared draft's (target:"
        f" no loss, >= {1 - tol:.2f}).",
        "",
        "| adapter | base | adapted, shared draft | adapted, draft adapter | lost | recovered | c=1 speedup"
        f" | gain | c={top} ratio | met |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v in verdicts:
        met = v.met()
        c1 = f"{v.c1_speedups[0]:.2f}x -> {v.c1_speedups[1]:.2f}x" if v.c1_speedups else "–"
        lines.append(
            f"| {v.name} | {_num(v.base_accept)} | {_num(v.shared_accept)} | {_num(v.adapted_accept)} |"
            f" {_num(v.lost)} | {_pct(v.recovered)} | {c1} | {_pct(v.c1_gain)} | {_num(v.top_ratio, 3)} |"
            f" {', '.join(f'{k} {_yes(m)}' for k, m in met.items())} |"
        )
    overall = {k: [v.met()[k] for v in verdicts] for k in verdicts[0].met()}
    lines += ["", "Every adapter: " + ", ".join(
        f"{k} **{'met' if all(x is True for x in ms) else 'not met' if any(x is False for x in ms) else 'not shown'}**"
        for k, ms in overall.items()
    )]  # fmt: skip
    return lines


def _draft_check(check: dict) -> str:
    """A STANDALONE draft adapter's served check: logits against the distilled adapter's."""
    return f"rel {check.get('rel_logit_diff')}, argmax {check.get('argmax_agreement')}, shift {check.get('adapter_shift')}"


def _head_check(check: dict | None) -> str:
    """An EAGLE head's served check (with or without a draft adapter): proposals and features."""
    if not check:
        return "–"
    text = (
        f"proposals {check.get('proposal_agreement')}, features rel {check.get('rel_feature_diff')},"
        f" padded {check.get('padded_norm')}"
    )
    if check.get("disagreeing_margin") is not None:
        text += f", smallest margin of a differing proposal {check['disagreeing_margin']}"
    return text + (f", shift {check['adapter_shift']}" if "adapter_shift" in check else "")


def _num(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value:.0%}"


def _yes(met: bool | None) -> str:
    return {True: "yes", False: "NO", None: "n/a"}[met]
