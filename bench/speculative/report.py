"""The markdown report of a run: setup, one row per (concurrency, draft), agreement and time."""

from __future__ import annotations

import datetime
import sys

from loraserve.runtime.speculative.metrics import context_bucket_start
from loraserve.runtime.tools.distill.dflash_train import format_walk_by_context

from ..harness import environment, environment_line, write_report
from .concurrency import Results
from .measure import Row
from .models import TrainedModels
from .settings import Settings
from .shapes import SHAPES


def write_run_report(
    s: Settings, trained: TrainedModels, target_params: int, check: dict, results: Results
) -> str:
    """The report as it stands; with ``--out``, also written there (markdown) and beside it
    (``.json``: every run's details and the setup). Called after every concurrency level, so
    a run cut short keeps what it measured."""
    lines = report_lines(s, target_params, trained.target_info, trained.infos, check, results)
    text = "\n".join(lines) + "\n"
    meta = {"target": trained.target_info, "drafts": trained.infos, "k": s.k, "check": check,
            "argv": s.argv or sys.argv[1:], "env": environment(s.device)}  # fmt: skip
    record = {**results.details, "setup": meta}
    write_report(text, record, out=s.args.out, json_to=s.args.json, name="speculative")
    return text


def report_lines(
    s: Settings, target_params: int, t_info: dict, infos: dict, check: dict, results: Results
) -> list[str]:
    """The whole report: setup, results table, agreement and time tables, notes."""
    lines = _setup_lines(s, target_params, t_info, check)
    if infos.get("standalone"):
        lines.append(_standalone_line(s, infos["standalone"]))
    if infos.get("eagle"):
        lines.append(_eagle_line(s, infos["eagle"]))
    if infos.get("dflash"):
        lines.append(_dflash_line(s, infos["dflash"]))
    lines += _results_table(s, results.rows)
    lines += _context_table(results.rows)
    lines += identity_table(results.rows, results.details)
    lines += _time_table(results.details)
    lines += [""] + [f"- {n}" for n in results.notes]
    return lines


def _setup_lines(s: Settings, target_params: int, t_info: dict, check: dict) -> list[str]:
    """Title, software, the command and the serving and trained targets."""
    device = s.device
    env = environment(device)
    argv = s.argv if s.argv is not None else sys.argv[1:]
    return [
        f"# Speculative decoding with co-batched LoRA adapters ({datetime.date.today().isoformat()})",
        "",
        f"- {environment_line(env)}",
        f"- command: `python bench/speculative {' '.join(argv)}`",
        f"- serving target: {s.target_shape} shape, {target_params / 1e9:.2f} B parameters,"
        f" {'bf16, CUDA graphs on' if device.type == 'cuda' else 'float32, no CUDA graphs'};"
        " computes the trained small target's function"
        f" (check on a held-out prompt: {check})",
        f"- trained small target: {SHAPES[s.small_shape]} (hidden, layers, heads, kv, head_dim, mlp);"
        f" {_count(t_info['params'])} params, {t_info['steps']} steps, {t_info['tokens'] / 1e6:.1f} M tokens, final loss {t_info['final_loss']:.2f}",
    ]


def _standalone_line(s: Settings, d_info: dict) -> str:
    """The STANDALONE draft: shape, training and, when distilled, its teacher data."""
    return (
        f"- draft STANDALONE ({d_info['training']} training): {SHAPES[s.draft_shape]};"
        f" {_count(d_info['params'])} params,"
        f" {d_info['steps']} steps, {d_info['tokens'] / 1e6:.1f} M tokens, final loss {d_info['final_loss']:.2f}"
        + (
            f"; teacher continuations {d_info['teacher_sequences']} of {d_info['teacher_prompts']}"
            f" ({d_info['teacher_seconds']} s), {d_info['teacher_fraction']:.0%} of each batch, sequences of {d_info['seq']}"
            if "teacher_prompts" in d_info
            else ""
        )
    )


def _eagle_line(s: Settings, e_info: dict) -> str:
    """The EAGLE head: how it was trained, its held-out agreement and the serving check."""
    served = (
        "expanded function-preservingly to the serving shape" if s.target_shape != "trained" else "as trained"
    )
    return (
        f"- draft EAGLE: one Llama layer of the small target's shape over its final normed hidden state"
        f" (shares its embeddings and lm_head), {served}; {_count(e_info['params'])} trained params,"
        f" {e_info['steps']} steps, {e_info['tokens'] / 1e6:.1f} M tokens, final loss {e_info['final_loss']:.2f};"
        f" KL to the target + {e_info['feature_weight']} x smooth-L1 on the feature, unrolled steps"
        f" {e_info['unroll']}, feature noise {e_info['noise']}, teacher continuations"
        f" {e_info['teacher_fraction']:.0%} of each batch, sequences of {e_info['seq']}{_short_windows(s, e_info['seq'])};"
        f" held-out top-1 agreement with the target per draft step {e_info['heldout_top1']};"
        f" served head vs trained head: {e_info.get('check')}"
    )


def _dflash_line(s: Settings, f_info: dict) -> str:
    """The DFLASH draft: shape, training, held-out agreement and the serving check."""
    served = (
        "expanded function-preservingly to the serving shape" if s.target_shape != "trained" else "as trained"
    )
    return (
        f"- draft DFLASH: {f_info['layers']} layer(s) of the small target's shape over its layer outputs"
        f" {f_info['target_layer_ids']} (shares its embeddings and lm_head), block {f_info['block']}, {served};"
        f" {_count(f_info['params'])} trained params, {f_info['steps']} steps, {f_info['windows']} windows of"
        f" {f_info['seq']}{_short_windows(s, f_info['seq'])} with {f_info['blocks_per_window']} blocks each,"
        f" final loss {f_info['final_loss']:.2f};"
        f" masked block prediction, {_LABELS.get(f_info.get('labels'), 'KL to the target')} weighted"
        f" exp(-j/{f_info['decay']:g}) by block position"
        " (a position's label counts only after the target's own greedy tokens, what serving verifies),"
        f" teacher continuations {f_info['teacher_fraction']:.0%} of each batch{_teacher_use(f_info)};"
        " held-out top-1 agreement per"
        f" block position {f_info['heldout_top1']}, mean leading agreeing positions {f_info['heldout_leading']}"
        f" of {f_info['max_leading']}{_walk(f_info)}; served draft vs trained draft: {f_info.get('check')}"
    )


def _short_windows(s: Settings, seq: int) -> str:
    """A warning where a draft trained on windows shorter than a served request reads: it
    accepts less past its training length (``distillation.serving_window``)."""
    if seq >= s.serving_reach:
        return ""
    return f" (SHORTER than the {s.serving_reach} tokens a served request reads: it accepts less past {seq})"


def _teacher_use(f_info: dict) -> str:
    """Where the teacher windows' blocks went and where their target outputs came from, where
    the run chose other than the defaults (older records lack both)."""
    parts = []
    if f_info.get("anchor_from", "window") != "window":
        parts.append("their blocks only after the prompt")
    if f_info.get("teacher_outputs", "cache") == "stream":
        parts.append("their target outputs computed each step, so every one is trained on")
    return f" ({'; '.join(parts)})" if parts else ""


_LABELS = {"greedy": "cross-entropy to the target's greedy token", "distribution": "KL to the target"}


def _walk(f_info: dict) -> str:
    """The held-out walk over the target's continuations, blocks placed as greedy serving
    places them (what a served step should accept), where the run measured it."""
    if "heldout_walk_mean" not in f_info:
        return ""
    count = f" {f_info['heldout_count']} of" if "heldout_count" in f_info else ""  # older records: unsaid
    return (
        f"; walking{count} the target's held-out continuations as greedy serving does,"
        f" {f_info['heldout_walk_mean']} drafts accepted a block (per position {f_info['heldout_walk_accept']}"
        + _by_context(f_info.get("heldout_walk_by_context"))
        + ")"
    )


def _by_context(buckets: dict | None) -> str:
    """``; by context 128-255 2.31 (540), ...``: the walk by the tokens before the block (older records: unsaid)."""
    return f"; by context {format_walk_by_context(buckets)}" if buckets else ""


def _results_table(s: Settings, rows: list[Row]) -> list[str]:
    """The workload line, then one row per (concurrency, draft) run."""
    k, args = s.k, s.args
    lines = [
        f"- verify width k = {k} (num_steps {k - 1}); greedy; prompts {s.prompt_len} held-out stdlib tokens; {s.gen_tokens} new tokens per request;"
        f" 4 adapters (rank 16, all linear modules, B ~ N(0, {args.adapter_b_std}^2)) + base, request i uses base or adapter i % 5;"
        f" concurrency 1 runs {args.c1_requests} requests one after another, concurrency c runs"
        f" {s.waves} x c requests, c at a time",
        "",
        "| concurrency | draft | no spec tok/s | spec tok/s | speedup | mean accepted drafts / step"
        " | accepted at draft position 1.. | accept rate | per-adapter mean accepted | verify ms | step ms"
        " | undrafted steps | identical outputs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        summary = r.summary
        per = ", ".join(f"{n} {v}" for n, v in summary["per_adapter_mean_accept"].items())
        pos = " / ".join(str(p) for p in summary["per_position"])
        lines.append(
            f"| {r.concurrency} | {r.draft} | {r.off_tps:,.1f} | {r.on_tps:,.1f} | {r.speedup:.2f}x |"
            f" {summary['mean_accept']} of {len(summary['per_position'])} | {pos} | {summary['accept_rate']} | {per} |"
            f" {summary['verify_ms']} | {summary['step_ms']} | {summary.get('undrafted_steps', 0)} | {r.same}/{r.count} |"
        )
    return lines


def _context_table(rows: list[Row]) -> list[str]:
    """Mean accepted drafts per step by the request's context length (tokens before the step;
    verify steps in brackets): a draft trained on shorter windows than it serves falls off."""
    buckets = sorted({b for r in rows for b in r.summary.get("per_context", {})}, key=context_bucket_start)
    if not buckets:
        return []
    lines = [
        "",
        "Mean accepted drafts per step by the request's context length (tokens before the step; verify steps):",
        "",
        "| concurrency | draft | " + " | ".join(buckets) + " |",
        "|---|---|" + "---|" * len(buckets),
    ]
    for r in rows:
        got = r.summary.get("per_context", {})
        cells = [f"{got[b][0]} ({got[b][1]})" if b in got else "–" for b in buckets]
        lines.append(f"| {r.concurrency} | {r.draft} | " + " | ".join(cells) + " |")
    return lines


def identity_table(rows: list[Row], details: dict) -> list[str]:
    """Identical outputs split into base-model and adapter requests, beside the floor that
    batch shape alone gives plain decoding."""

    def cell(d: dict | None) -> str:
        if not d:
            return "–"
        first, gap = d["mean_first_divergence"], d.get("max_gap")
        if first is None:
            return f"{d['identical']}/{d['count']}"
        return (
            f"{d['identical']}/{d['count']} (first diff at {first}"
            + ("" if gap is None else f"; gap ≤ {gap}")
            + ")"
        )

    lines = [
        "",
        "Identical outputs by request kind (identical / requests, mean token index of the first difference"
        " among those that differ; gap: the largest |logit difference| the target, with the request's adapter,"
        " puts between the two runs' tokens at a first difference: rounding flips near-ties, a bug picks"
        " tokens far apart); the floor compares plain decoding at the lowest concurrency with plain"
        " decoding at this one, on the prompts both ran:",
        "",
        "| concurrency | comparison | base-model requests | adapter requests |",
        "|---|---|---|---|",
    ]
    for c, d in details.items():
        floor = d.get("floor")
        if floor:
            lines.append(f"| {c} | plain c={floor['against']} vs plain c={c} (floor) | {cell(floor.get('base'))} |"
                         f" {cell(floor.get('adapter'))} |")  # fmt: skip
        for r in rows:
            if r.concurrency == c and r.identity:
                lines.append(
                    f"| {c} | {r.draft} vs plain | {cell(r.identity.get('base'))} | {cell(r.identity.get('adapter'))} |"
                )
    return lines


def _count(n: int) -> str:
    """A parameter count for the report: 139.6 k, 9.5 M."""
    return f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n / 1e3:.1f} k"


def _time_table(details: dict) -> list[str]:
    """Where each timed run's wall time went, from the engine's step counters."""
    lines = [
        "",
        "Where the time went (engine counters; decoder seconds by step kind, engine = host work outside"
        " the decoder; graphs = CUDA graphs the timed run itself had to capture):",
        "",
        "| concurrency | run | wall s | extend steps (during decode) | ms / extend | decode steps | mean batch |"
        " ms / decode step | tokens / decode step | engine s | deferred steps | graphs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c, d in details.items():
        runs = [("no spec", d.get("off_s"), d.get("off_steps"))]
        for name, spec in d.get("spec", {}).items():
            runs.append((f"spec {name}", spec.get("on_s"), spec.get("on_steps")))
            if "on_nodefer_steps" in spec:
                runs.append(
                    (f"spec {name}, admission at once", spec["on_nodefer_s"], spec["on_nodefer_steps"])
                )
        for name, wall, st in runs:
            if not st:
                continue
            lines.append(
                f"| {c} | {name} | {wall:.2f} | {st['extend_steps']} ({st['extends_during_decode']}) |"
                f" {st['extend_ms_per_step']} | {st['decode_steps']} | {st['mean_decode_batch']} |"
                f" {st['decode_ms_per_step']} | {st['tokens_per_decode_step']} | {st['engine_s']} |"
                f" {st['deferred_admission_steps']} | {st['graphs_captured']} |"
            )
    return lines
