"""`make demo` on the real model: SmolLM2 and its trained adapters (from the suite's cache, so
nothing is converted or trained twice), a real server process, real HTTP."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_demo_on_the_real_model(real_assets, tmp_path):
    env = {
        **os.environ,
        "PYTHONSAFEPATH": "1",
        "LORASERVE_DEMO_MODEL": "real",
        "LORASERVE_REAL_MODEL_CACHE": str(real_assets.model_dir.parent),
        "LORASERVE_DEMO_CACHE": str(tmp_path / "tiny"),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "loraserve.runtime.dev.demo"],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "model and 2 adapters ready" in out and "converting" not in out, "reused from the cache"
    assert "distinct answers: 3 of 3" in out, out
    assert "Berlin" in out  # the base model's answer to the demo question
    assert '\'{"answer": "Berlin", "sure": true}\'' in out, out  # the json-answer adapter
    assert "Arr, matey!" in out  # the pirate adapter, chat and streamed
    same = [line for line in out.splitlines() if "same output as without speculation" in line]
    assert len(same) == 3 and all("without speculation: True" in line for line in same), same
    assert "accepted 0 of" not in same[0], "the base model accepts n-gram drafts of a repeating prompt"
    assert "STANDALONE skipped:" in out
    assert "vllm:lora_requests_info" in out and "exit code 0" in out
    assert not (tmp_path / "tiny").exists(), "the tiny fallback was not used"
