"""The draft-adapter benchmark end to end on the CPU (``--smoke``): task adapters trained on
two distinct corpora, a draft adapter distilled for each by ``loraserve-distill-draft``,
both served (the task adapters expanded to the 8B-stand-in shape), every request kind timed
with the shared draft and with the draft adapters. At these sizes accept lengths are noise;
what must hold is what the GPU run's numbers rest on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ADAPTERS = ("cpp", "sympy")


def test_draft_adapters_bench_smoke(tmp_path):
    out, record_file = tmp_path / "da.md", tmp_path / "da.json"
    result = subprocess.run(
        [sys.executable, "-P", str(REPO / "bench" / "draft_adapters"), "--smoke", "--adapters", ",".join(ADAPTERS),
         "--out", str(out), "--json", str(record_file)],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )  # fmt: skip
    # rc 0: every speculative output equals plain decoding's, the served adapters compute what
    # was trained, and every distillation brought the draft closer to its adapted target
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    record = json.loads(record_file.read_text())

    kinds = {"base", *ADAPTERS, "mixed"}  # mixed: every kind in the same batches
    assert {(r["concurrency"], r["kind"]) for r in record["results"]} == {
        (c, k) for c in (1, 4) for k in kinds
    }
    for r in record["results"]:
        assert set(r["runs"]) == {"plain", "shared", "adapted"}, r
        for name in ("shared", "adapted"):
            run = r["runs"][name]
            assert run["generated"] == r["runs"]["plain"]["generated"] > 0
            for kind in run["identity"].values():
                assert kind["identical"] == kind["count"] > 0, (r["concurrency"], r["kind"], name)
            assert run["summary"]["mean_accept"] >= 0
        if r["kind"] == "mixed":  # each kind's accept length measured in the same batches
            for name in ("shared", "adapted"):
                assert set(r["runs"][name]["summary"]["per_adapter_mean_accept"]) == {"base", *ADAPTERS}
        if r["kind"] == "mixed":  # each kind's accept length measured in the same batches
            for name in ("shared", "adapted"):
                assert set(r["runs"][name]["summary"]["per_adapter_mean_accept"]) == {"base", *ADAPTERS}

    for name in ADAPTERS:
        a = record["adapters"][name]
        # the task adapter moved the target towards its corpus, on files it never trained on
        assert a["training"]["heldout_loss_adapted"] < a["training"]["heldout_loss_base"], a["training"]
        assert a["training"]["top1_changed"] >= 0
        # the 8B-stand-in target serving the expanded adapter computes the small adapted target
        assert a["check"]["argmax_agreement"] == 1.0 and a["check"]["rel_logit_diff"] < 1e-4, a["check"]
        assert a["check"]["adapter_shift"] > 0
        # distillation pulled the draft towards the adapted target on held-out text
        assert a["draft"]["kl_after"] < a["draft"]["kl_before"], a["draft"]
        # the draft's pool serves the distilled LoRA as written, and it changes the draft
        assert a["draft_check"]["argmax_agreement"] == 1.0 and a["draft_check"]["rel_logit_diff"] < 1e-4
        assert a["draft_check"]["adapter_shift"] > 0

    verdicts = {v["name"]: v for v in record["verdicts"]}
    assert set(verdicts) == set(ADAPTERS)
    for v in verdicts.values():
        assert set(v["met"]) == {"recovery", "c1_gain", "no_loss_top"}
        assert v["c1"] == 1 and v["top"] == 4 and v["top_ratio"] > 0
    assert set(record["phases"]) >= {
        "target and STANDALONE draft",
        "task adapters",
        "draft adapters",
        "total",
    }

    text = out.read_text()
    for heading in ("## Task adapters and their draft adapters", "## Runs", "## Targets"):
        assert heading in text
    rows = [line for line in text.splitlines() if line.startswith(("| 1 |", "| 4 |"))]
    assert len(rows) == 2 * len(kinds), text
    assert "- c = 1: base " in text and "- c = 4: base " in text  # the mixed batches' accept lengths per kind
    assert "- c = 1: base " in text and "- c = 4: base " in text  # the mixed batches' accept lengths per kind
    assert "Every adapter: recovery" in text and "Time per phase (s):" in text
