"""`make demo` end to end: the demo script runs against a real server process and passes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path):
    env = {**os.environ, "PYTHONSAFEPATH": "1", "LORASERVE_DEMO_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, "-m", "loraserve.runtime.demo"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "load chat-r16 again -> 200 already_loaded" in out
    assert "load without the token -> 401" in out
    assert "identical: True" in out
    assert "max_tokens: 0 -> 400" in out
    assert "vllm:lora_requests_info" in out
    assert "exit code 0" in out
    # Speculation with an adapter-free draft leaves every model's greedy output unchanged.
    same = [line for line in out.splitlines() if "same output as without speculation" in line]
    assert len(same) == 3 and all("without speculation: True" in line for line in same), same
    assert "mean 3.00 per step" in same[0], "the base model accepts every draft of its own copy"
    assert (tmp_path / "cache" / "model" / ".complete").is_file(), "assets are cached for the next run"
