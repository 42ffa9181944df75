"""The MoE layer benchmark runs end to end on the CPU (``--smoke``, the Triton interpreter):
every batch row reported, its checks hold (kernels = float64, the adapters act); and its
GPU script parses. Speeds are not asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def test_moe_bench_smoke(tmp_path):
    out = tmp_path / "moe.json"
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    result = subprocess.run(
        [sys.executable, "-P", str(REPO / "bench" / "moe.py"), "--smoke", "--out", str(out)],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["shape"] == "smoke" and [r["bs"] for r in record["rows"]] == [1, 4]
    for row in record["rows"]:
        assert row["checks_ok"] and row["lora_vs_float64"] < 1e-4 and row["lora_vs_base"] > 1e-3, row
        assert row["base_eager_ms"] > 0 and row["lora_eager_ms"] > 0
    table = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert len(table) == 3 and table[0].startswith("| bs | adapters | base_eager_ms")


def test_gpu_script_parses_and_runs_each_bench():
    """The one device call (bench/gpu/all.sh) parses and runs every part it names."""
    script = REPO / "bench" / "gpu" / "all.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    for part in ("bench/moe.py", "bench/profile_step.py", "bench/runtime.py", "tests/runtime_model/test_moe_fused.py"):
        assert part in text, part
