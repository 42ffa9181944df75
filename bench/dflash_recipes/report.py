"""The study's markdown: the setup, then one row per recipe."""

from __future__ import annotations

from loraserve.runtime.tools.distill.dflash_train import format_walk_by_context

from ..harness import environment, environment_line
from ..speculative.settings import Settings as SpecSettings


def _per_position(values: list[float]) -> str:
    return " / ".join(f"{v:.2f}" for v in values)


def _by_context(r: dict) -> str:
    """The walk by the tokens before each block (runtime buckets); records before it: "–"."""
    return format_walk_by_context(r.get("heldout_walk_by_context")) or "–"


def report(record: dict, spec: SpecSettings) -> str:
    """Markdown for ``record`` (``study.main``'s): the device, the shared setup, each recipe's draft."""
    setup = record["setup"]
    lines = [
        "# DFLASH draft recipes",
        "",
        f"- {environment_line(environment(spec.device))}.",
        f"- Target: {spec.small_shape} trained {setup['target'].get('steps')} steps"
        f" (final loss {setup['target'].get('final_loss')}); teacher continuations"
        f" {setup['teacher']['teacher_sequences']} in {setup['teacher']['teacher_seconds']} s.",
        f"- Each recipe: {setup['recipe_s']} s of training"
        + (f" (at most {setup['max_steps']} steps)" if setup["max_steps"] else "")
        + f", block {setup['block']}; walked on {setup['heldout_count']} held-out continuations"
        + (f" of {setup['teacher']['seq']} tokens" if "seq" in setup["teacher"] else "")
        + ".",
    ]
    if "seconds" in setup:
        lines.append(f"- Whole run: {setup['seconds']} s.")
    lines += [
        "",
        "| recipe | target layers | params | teacher windows (cached) | steps | train top-1 per position"
        " | held-out top-1 per position | walk: accepted at position 1.. | walk by context (steps)"
        " | walk: accepted drafts / block |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in record["recipes"]:
        cached = r.get("cached_teacher_windows", "uncached")
        lines.append(
            f"| {r['recipe']} | {r['target_layer_ids']} | {r['params'] / 1e6:.1f} M | {r['teacher_windows']} ({cached})"
            f" | {r['steps']} | {_per_position(r['train_top1'])} | {_per_position(r['heldout_top1'])}"
            f" | {_per_position(r['heldout_walk_accept'])} | {_by_context(r)}"
            f" | **{r['heldout_walk_mean']}** of {r['max_leading']} |"
        )
    return "\n".join(lines) + "\n"
