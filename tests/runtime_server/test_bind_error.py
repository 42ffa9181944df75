"""The runtime binds its port before anything else: a port in use is one clear line and a
non-zero exit, and "listening on" is logged only once the socket is bound. Real processes."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

from loraserve.runtime.cli import EXIT_BIND
from loraserve.runtime.dev.demo import free_port


def _runtime(assets, port: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "loraserve.runtime",
        "--model", str(assets.model_dir), "--device", "cpu",
        "--host", "127.0.0.1", "--port", str(port),
        "--max-total-tokens", "2048", "--no-enable-lora", *extra,
    ]  # fmt: skip


def test_port_in_use_exits_clearly(assets):
    """A port in use is one clear line and a non zero exit."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = subprocess.run(
            _runtime(assets, port),
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONSAFEPATH": "1"},
        )
    output = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_BIND != 0, output
    assert f"cannot listen on 127.0.0.1:{port}: the port is already in use" in proc.stderr
    assert "--port" in proc.stderr
    assert "listening on" not in output
    assert "Traceback" not in output
    # Nothing was started: the model never began to load.
    assert "runner:" not in output and "serving" not in output


def test_listening_logged_after_bind(assets, tmp_path):
    """Listening on is logged once the port is bound."""
    port = free_port()
    log = tmp_path / "log"
    proc = subprocess.Popen(
        _runtime(assets, port),
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONSAFEPATH": "1"},
    )
    try:
        deadline = time.monotonic() + 60
        match = None
        while match is None and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            match = re.search(rf"listening on 127\.0\.0\.1:{port}\b", log.read_text())
            time.sleep(0.05)
        assert match is not None, log.read_text()
        # Bound when logged: /health answers at once (the model may still be loading).
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as resp:
            assert resp.status == 200
    finally:
        proc.terminate()
        proc.wait(timeout=60)
