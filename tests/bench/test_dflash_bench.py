"""The speculative benchmark's DFLASH draft end to end on the CPU (``--smoke``): trained on
the tiny target, expanded to the serving shape, served by the runtime and timed, with a
block (5) wider than the chain drafts' k (4)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_speculative_bench_smoke_with_dflash(tmp_path):
    out = tmp_path / "spec.md"
    result = subprocess.run(
        [sys.executable, "-P", str(REPO / "bench" / "speculative"), "--smoke", "--draft", "dflash",
         "--dflash-block", "5", "--concurrency", "1,2", "--c1-requests", "4", "--out", str(out),
         # the training recipe's options reach the draft's training (its record says so)
         "--dflash-layers", "2", "--dflash-anchors", "12", "--dflash-decay", "2", "--dflash-init", "target",
         "--dflash-weight-decay", "0.01", "--dflash-lr", "0.003", "--dflash-probe-steps", "5",
         # steps, not seconds, end its training: a busy machine still makes them (the budget is a bound)
         "--dflash-train-s", "120", "--max-steps", "0,0,12"],
        capture_output=True, text=True, cwd=REPO, timeout=900,
    )  # fmt: skip
    # rc 0: every output identical to plain decoding and the served draft proposes what the trained one does
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = out.read_text()
    assert "- draft DFLASH:" in text and "'proposal_agreement': 1.0" in text
    rows = [line.split("|") for line in text.splitlines() if re.match(r"\| \d+ \| dflash \|", line)]
    rows = [r for r in rows if len(r) == 15]  # the results table's (the context table's rows are shorter)
    assert [r[1].strip() for r in rows] == ["1", "2"]
    for row in rows:
        assert row[6].strip().endswith("of 4"), row  # a block of 5: four drafts a step
        done, total = row[-2].strip().split("/")
        assert done == total and int(total) > 0, row
    details = json.loads(out.with_suffix(".json").read_text())
    # acceptance by context length: every verify step in one bucket (prompts of 32 tokens, 24 new)
    assert "by the request's context length" in text
    for c in ("1", "2"):
        summary = details[c]["spec"]["dflash"]
        assert {b: n for b, (_, n) in summary["per_context"].items()} == {"0-127": sum(summary["histogram"])}
    trained = details["setup"]["drafts"]["dflash"]
    assert trained["block"] == 5 and trained["layers"] == 2
    assert (trained["blocks_per_window"], trained["decay"], trained["init"]) == (12, 2.0, "target")
    assert (trained["weight_decay"], trained["lr"]) == (0.01, 0.003)
    assert trained["seconds"] == 120.0  # --dflash-train-s, not --train-draft-s (the EAGLE head's)
    assert trained["steps"] == 12  # --max-steps' third cap
    assert trained["heldout_count"] == 16 and "walking 16 of the target's held-out continuations" in text
    # the learning curve: the served (rounded) draft walked every 5 steps of training
    probes = trained["probes"]
    assert probes and all(0 < p["heldout_walk_mean"] <= 4 and len(p["heldout_top1"]) == 4 for p in probes), probes
    assert [p["steps"] for p in probes] == [5, 10]  # after every 5th step
