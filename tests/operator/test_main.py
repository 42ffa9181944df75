"""The operator command: settings errors and missing credentials stop it at once, named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from loraserve.operator import main

COMMAND = str(Path(sys.executable).parent / "loraserve-operator")


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LORASERVE_") and k != "KUBECONFIG"}
    clean.update({"HOME": str(tmp_path), **env})
    return subprocess.run(
        [COMMAND, "--no-webhook"], env=clean, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )


def test_bad_setting_exits_2(tmp_path: Path) -> None:
    """A bad setting exits 2 naming the variable."""
    result = _run(tmp_path, LORASERVE_RESYNC_INTERVAL_S="often")
    assert result.returncode == 2
    assert "LORASERVE_RESYNC_INTERVAL_S='often' is not valid: expected a number" in result.stderr


def test_missing_credentials_exit_2(tmp_path: Path) -> None:
    """Missing credentials exit 2 with the reason."""
    result = _run(tmp_path, KUBECONFIG=str(tmp_path / "absent"))
    assert (
        result.returncode == 2
        and "cannot read the credentials" in result.stderr
        and "absent" in result.stderr
    )
    result = _run(tmp_path)
    assert result.returncode == 2 and "no kubeconfig (set KUBECONFIG)" in result.stderr


def test_no_webhook_drops_admission() -> None:
    """Without the webhook only admission handlers are left out."""
    full = main.operator_registry(webhooks_enabled=True)
    lean = main.operator_registry(webhooks_enabled=False)
    assert full._webhooks.get_all_handlers() and not lean._webhooks.get_all_handlers()
    for part in ("_activities", "_indexing", "_watching", "_spawning", "_changing"):
        ids = sorted(h.id for h in getattr(full, part).get_all_handlers())
        assert ids == sorted(h.id for h in getattr(lean, part).get_all_handlers())
    spawned = {h.id for h in lean._spawning.get_all_handlers()}
    assert spawned == {"reconcile"}, "one reconcile daemon per LoRAServe and per Adapter"


def test_kopf_keeps_its_state_in_our_annotations() -> None:
    settings = main.build_settings(main.OperatorConfig())
    assert settings.persistence.finalizer == "loraserve.io/finalizer"
    assert settings.peering.standalone is True
    peered = main.build_settings(main.OperatorConfig(peering_name="loraserve", peering_clusterwide=False))
    assert peered.peering.name == "loraserve" and peered.peering.mandatory and not peered.peering.clusterwide
