"""The draft-adapter benchmark end to end on the CPU (``--smoke``): task adapters trained on
two distinct corpora, a draft adapter distilled for each by ``loraserve-distill-draft``,
both served (the task adapters expanded to the 8B-stand-in shape), every request kind timed
with the shared draft and with the draft adapters; once with the STANDALONE draft and once
with the EAGLE head (``--draft eagle``). At these sizes accept lengths are noise; what must
hold is what the GPU run's numbers rest on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ADAPTERS = ("cpp", "sympy")
KINDS = {"base", *ADAPTERS, "mixed"}  # mixed: every kind in the same batches


def run_smoke(tmp_path: Path, *extra: str) -> tuple[dict, str]:
    """The smoke run with ``extra`` options: its JSON record and markdown report. rc 0 means
    every speculative output equals plain decoding's, the served adapters (and head) compute
    what was trained or distilled, and every distillation brought the draft closer to its
    adapted target (``benchmark.smoke_verdict``)."""
    out, record_file = tmp_path / "da.md", tmp_path / "da.json"
    result = subprocess.run(
        [sys.executable, "-P", str(REPO / "bench" / "draft_adapters"), "--smoke", "--adapters", ",".join(ADAPTERS),
         "--out", str(out), "--json", str(record_file), *extra],
        capture_output=True, text=True, cwd=REPO, timeout=300,
        # one intra-op thread: the smoke's matrices are tiny, and on a busy two-core machine torch's
        # threads waiting on each other made the run 5-7x slower (17 s against 100-125 s)
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(record_file.read_text()), out.read_text()


def check_runs(record: dict) -> None:
    """Every (concurrency, kind) ran through the three decoders, speculative outputs equal to
    plain decoding's token for token, the mixed batches' accept lengths per kind."""
    assert {(r["concurrency"], r["kind"]) for r in record["results"]} == {
        (c, k) for c in (1, 4) for k in KINDS
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


def check_task_adapters(record: dict) -> None:
    """The task adapters moved the target, are served as trained, and their draft adapters'
    distillation lowered the held-out KL to the adapted target."""
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


def check_report(record: dict, text: str, first_phase: str) -> None:
    """The verdicts per adapter, the phases, and the markdown's sections and rows."""
    verdicts = {v["name"]: v for v in record["verdicts"]}
    assert set(verdicts) == set(ADAPTERS)
    for v in verdicts.values():
        assert set(v["met"]) == {"recovery", "c1_gain", "no_loss_top"}
        assert v["c1"] == 1 and v["top"] == 4 and v["top_ratio"] > 0
    assert set(record["phases"]) >= {first_phase, "task adapters", "draft adapters", "total"}
    for heading in ("## Task adapters and their draft adapters", "## Runs", "## Targets"):
        assert heading in text
    rows = [line for line in text.splitlines() if line.startswith(("| 1 |", "| 4 |"))]
    assert len(rows) == 2 * len(KINDS), text
    assert "- c = 1: base " in text and "- c = 4: base " in text  # the mixed batches' accept lengths per kind
    assert "Every adapter: recovery" in text and "Time per phase (s):" in text


def test_draft_adapters_bench_smoke(tmp_path):
    record, text = run_smoke(tmp_path)
    assert record["setup"]["draft_kind"] == "standalone"
    check_runs(record)
    check_task_adapters(record)
    for name in ADAPTERS:
        check = record["adapters"][name]["draft_check"]
        # the draft's pool serves the distilled LoRA as written, and it changes the draft
        assert check["argmax_agreement"] == 1.0 and check["rel_logit_diff"] < 1e-4, check
        assert check["adapter_shift"] > 0
    check_report(record, text, "target and STANDALONE draft")


def test_draft_adapters_bench_eagle_smoke(tmp_path):
    record, text = run_smoke(tmp_path, "--draft", "eagle")
    assert record["setup"]["draft_kind"] == "eagle"
    # the head as served (expanded to the 8B-stand-in shape) proposes what the trained head does
    head = record["setup"]["head_check"]
    assert head["proposal_agreement"] == 1.0 and head["rel_feature_diff"] < 1e-4 and head["padded_norm"] == 0
    check_runs(record)
    check_task_adapters(record)
    for name in ADAPTERS:
        a = record["adapters"][name]
        # a head adapter adapts the head's own layers, the fc over the target's features included
        assert "fc" in a["draft"]["modules"] and "q_proj" in a["draft"]["modules"]
        # the head's pool serving the expanded head adapter, on the served target's adapted features,
        # proposes what the trained head with the distilled adapter proposes on the small target's:
        # every proposal, the same output features, nothing written into the padded dimensions
        check = a["draft_check"]
        assert check["proposal_agreement"] == 1.0 and check["rel_feature_diff"] < 1e-4, check
        assert check["padded_norm"] == 0
        assert check["adapter_shift"] > 0  # the adapter ran, and it moves the head
    check_report(record, text, "target and EAGLE head")
    assert "EAGLE head" in text and "proposals 1.0" in text
