"""``python -m loraserve.operator.dev.demo_admission`` runs to the end with every verdict as annotated.

It starts kmock's KubernetesEmulator (no API server exists on these machines), kopf and
the HTTPS webhook server in a fresh process, outside the repository.
"""

from __future__ import annotations

import os
import subprocess
import sys


def test_demo_verdicts_match(tmp_path):
    """Demo runs and every verdict matches its annotation."""
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "loraserve.operator.dev.demo_admission"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert out.rstrip().endswith("all verdicts as annotated")
    assert "ADMITTED       LoRAServe llama3-1b" in out
    assert "add /spec/model/servedName" in out
    assert "existing Adapter 'brand-voice' spec.rank: rank 8 exceeds spec.lora.maxRank (4)" in out
    assert "NOT as annotated" not in out
    assert out.count("REFUSED (422)") >= 10
