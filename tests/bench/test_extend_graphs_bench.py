"""``python bench/extend_graphs --smoke`` runs end to end on the CPU: every batch size of
requests on a prefix-cache hit takes the graph runner's (static) path at the expected
padded shape, with the eager step's logits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def test_extend_graphs_bench_smoke(tmp_path):
    out, js = tmp_path / "extend.md", tmp_path / "extend.json"
    result = subprocess.run(
        [
            sys.executable,
            "-P",
            str(REPO / "bench" / "extend_graphs"),
            "--smoke",
            "--out",
            str(out),
            "--json",
            str(js),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    record = json.loads(js.read_text())
    assert record["env"]["torch"] == torch.__version__ and record["env"]["gpu"].startswith("cpu")
    rows = record["rows"]
    assert [(r["requests"], r["shape"]) for r in rows] == [(1, [16, 1]), (2, [16, 2]), (4, [16, 4])]
    assert all(r["rel_err"] < 1e-5 and r["eager_ms"] > 0 and r["graph_ms"] > 0 for r in rows)
    text = out.read_text()
    assert text.count("| 16 x ") == 3 and "0 failed captures" in text
