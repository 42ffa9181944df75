"""The benchmark scripts run end to end on the CPU (``--smoke``), so a change that breaks
one is caught here rather than on the GPU, where device time is scarce. Each run also
carries the script's own correctness checks, asserted below; the speeds are not."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _bench(script: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-P", str(REPO / "bench" / script), "--smoke", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_runtime_bench_smoke(tmp_path):
    """Base vs multi-LoRA decode on both attention backends: the report has every batch row
    and the script's checks hold (graph = eager, chosen backend = torch reference, adapters
    change logits) on each."""
    out = tmp_path / "runtime.md"
    _bench("runtime.py", "--out", str(out), "--attention", "sdpa,triton")
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| smoke |")]
    assert [(row.split("|")[2].strip(), row.split("|")[3].strip(), row.split("|")[6].strip()) for row in rows] == [
        ("sdpa", "on", "1"), ("sdpa", "on", "4"), ("triton", "on", "1"), ("triton", "on", "4")
    ]
    checks = re.findall(r"(\w+_vs_\w+) ([0-9.e+-]+)", text)
    assert len(checks) == 6, text
    for name, value in checks:
        assert (float(value) > 1e-3) if name == "adapter_vs_base" else (float(value) < 1e-5), (name, value)


def test_tensor_parallel_bench_smoke(tmp_path):
    """TP=2 over gloo equals TP=1 (greedy agreement 1.0, float32 error at rounding level)."""
    out = tmp_path / "tp.md"
    _bench("tp.py", "--out", str(out))
    text = out.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| TP=2 vs TP=1"))
    max_diff, _, agreement = (cell.strip() for cell in row.split("|")[2:5])
    assert float(agreement) == 1.0
    assert float(max_diff) < 1e-4
    assert "| control message, verify-sized" in text  # the draft-placement measurement ran


def test_speculative_bench_smoke_with_both_drafts(tmp_path):
    """Train a tiny target, a STANDALONE draft and an EAGLE head, serve the expanded target
    with 4 adapters: both drafts run at every concurrency, the served target computes the
    trained one's function, and every speculative output equals the no-spec output; so does
    the EAGLE head's tree run (``--tree``). ``--phases`` times one more request per draft at concurrency 1, phase by phase."""
    out, phases = tmp_path / "spec.md", tmp_path / "phases"
    _bench(
        "speculative", "--draft", "standalone,eagle", "--out", str(out), "--phases", str(phases),
        "--c1-requests", "6", "--tree", "2:6", timeout=900,
    )  # fmt: skip
    text = out.read_text()
    assert "concurrency 1 runs 6 requests" in text
    details = json.loads(out.with_suffix(".json").read_text())
    for draft in ("eagle", "standalone"):
        table = (phases / f"phases-{draft}.md").read_text()
        for row in (
            "| `drafter.propose` |",
            "| `target.forward[TARGET_VERIFY]` |",
            "| `target.forward[DECODE]` |",
        ):
            assert row in table, (draft, table)
        assert "Outputs of the two runs identical: yes." in table
        assert "| (rest of the step) |" in table and "| **between steps** (engine) |" in table
        summary = details["1"]["spec"][draft]["phases"]
        assert summary["spec"]["steps"] > 0 and summary["plain"]["tokens_per_step"] == 1.0
    tree_table = (phases / "phases-eagle-t2-n6.md").read_text()
    for row in ("| `drafter.propose_tree` |", "| `target.kv.keep` |", "| `target.forward[TARGET_VERIFY]` |"):
        assert row in tree_table, tree_table
    assert "'argmax_agreement': 1.0" in text
    rows = [
        line.split("|") for line in text.splitlines() if re.match(r"\| \d+ \| (eagle|eagle-t2-n6|standalone) \|", line)
    ]
    context_rows = [r for r in rows if len(r) != 15]  # the context-length table's, after the results table's
    rows = [r for r in rows if len(r) == 15]
    assert {(r[1].strip(), r[2].strip()) for r in context_rows} == {(r[1].strip(), r[2].strip()) for r in rows}
    assert {(r[1].strip(), r[2].strip()) for r in rows} == {
        (c, d) for c in ("1", "2", "4") for d in ("eagle", "eagle-t2-n6", "standalone")
    }
    for row in rows:
        done, total = row[-2].strip().split("/")
        assert done == total and int(total) > 0, row
    # The agreement report: the batch-shape floor for each concurrency above the lowest, and
    # every draft identical to plain decoding for base-model and adapter requests alike.
    assert "| 2 | plain c=1 vs plain c=2 (floor) |" in text and "| 4 | plain c=1 vs plain c=4 (floor) |" in text
    kinds = [line.split("|")[3:5] for line in text.splitlines() if " vs plain |" in line]
    assert len(kinds) == 9, text
    for cells in kinds:
        for cell in cells:
            done, total = cell.strip().split("/")
            assert done == total and int(total) > 0, cells


def test_operator_bench_smoke(tmp_path):
    """Adapter creation to Loaded on every pod (real operator, stand-in cluster): the report
    has both rows, one load per adapter-pod pair and the target line."""
    out = tmp_path / "operator.md"
    _bench("operator.py", "--out", str(out), timeout=300)
    text = out.read_text()
    assert "| loaded on every ready pod | 2 |" in text and "| status Ready | 2 |" in text, text
    assert "Load requests sent by the operator: 6 for 6 adapter-pod pairs" in text, text


def test_operator_cluster_report(tmp_path):
    """``--scenario cluster``'s report from a made-up run (the scenario itself runs in
    tests/e2e/test_cluster_serving_e2e.py): failures are counted, listed and make it fail."""
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location("operator_bench_under_test", REPO / "bench" / "operator.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench._load("cluster")  # scenario.py and traffic.py import its siblings through it
    traffic = bench._load("traffic")
    scenario = bench._load("scenario")
    ok = traffic.Record(0, 0, "alpha", "p", "chat", True, 1.0, latency=0.2, status=200, text="x", pod="a")
    bad = traffic.Record(
        1, 1, "tiny", "p", "completions", False, 2.0, latency=0.1, status=502, error="refused"
    )
    gone = traffic.Record(2, 0, "gamma", "p", "completions", False, 9.0, latency=0.1, status=404, error="nf")
    moments = {"created": 5.0, "deleted": 6.0, "gone": 8.0, "ready": 7.0}
    outcome = scenario.sort_records([ok, bad, gone], created="omega", deleted="gamma", moments=moments)
    assert outcome.failed() == [bad] and outcome.deleted_after == [gone]
    args = argparse.Namespace(base_only=False, workers=4)
    result = {
        "records": [ok, bad, gone], "outcome": outcome, "steps": [("bring-up", 12.0)], "traffic_s": 10.0,
        "on_demand": [0.05, 0.07], "usable": [1.5], "timing_pods": 2, "total_s": 60.0, "load_average": (1.0, 1.0, 1.0),
    }  # fmt: skip
    text = bench.cluster_report(args, result)
    assert "failed: **1** (target 0)" in text and "#1 tiny completions" in text, text
    assert "| first request for an adapter on a pod that does not hold it (on-demand load) | 2 |" in text
    assert "1 answered 404" in text


def test_kernels_bench_smoke(tmp_path):
    """``bench/kernels --tiny`` (the interpreter): the module timings ran, and the report
    records the environment the docs promise."""
    result = subprocess.run(
        [sys.executable, "-P", str(REPO / "bench" / "kernels"), "--tiny", "--out", str(tmp_path),
         "--budget-s", "120", "--skip", "sweep,layer"],
        capture_output=True, text=True, cwd=REPO, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    record = json.loads((tmp_path / "kernels.json").read_text())
    assert record["modules"] and all(r["triton_us"] > 0 for r in record["modules"])
    text = (tmp_path / "kernels.md").read_text()
    for field in ("gpu", "torch", "triton", "python", "launch_floor_us"):
        assert f"- {field}: {record['env'][field]}" in text
