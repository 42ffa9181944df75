"""``python bench/prefix --smoke`` runs end to end on the CPU: every workload, cache off
and on, the same tokens either way, hits where prefixes are shared and none where not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def test_prefix_bench_smoke(tmp_path):
    out, js = tmp_path / "prefix.md", tmp_path / "prefix.json"
    result = subprocess.run(
        [sys.executable, "-P", str(REPO / "bench" / "prefix"), "--smoke", "--out", str(out), "--json", str(js), "--think-s", "0,0.02"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    record = json.loads(js.read_text())
    assert record["env"]["torch"] == torch.__version__ and record["env"]["gpu"].startswith("cpu")
    summaries = {s["workload"]: s for s in record["workloads"]}
    names = ("system-prompts", "chat-replay", "no-shared-prefix")
    assert set(summaries) == {*names, *(f"{n}, think 0.02 s" for n in names)}
    for s in summaries.values():
        done, total = (int(x) for x in s["same_tokens"].split("/"))
        assert done == total == s["requests"], s
        assert s["off_hit_rate"] == 0.0
    for think in ("", ", think 0.02 s"):
        assert summaries[f"system-prompts{think}"]["hit_rate"] > 0.5
        assert summaries[f"chat-replay{think}"]["hit_rate"] > 0.5
        assert summaries[f"no-shared-prefix{think}"]["hit_rate"] < 0.05
    text = out.read_text()
    assert text.count("| system-prompts |") == 2 and "TTFT p99 ms" in text
