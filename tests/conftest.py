"""Session-wide test settings and fixtures shared by every suite."""

import os
import ssl

import pytest

# Subprocesses started by tests (runtime servers, demos) run `python -m ...`; with the
# repository root as their working directory, the top-level folder operator/ would shadow
# the standard library. PYTHONSAFEPATH keeps the working directory off sys.path.
os.environ.setdefault("PYTHONSAFEPATH", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture
def tls(tmp_path) -> tuple[ssl.SSLContext, str]:
    """A server TLS context for 127.0.0.1 / localhost from a fresh private CA, and the CA's
    PEM file for clients (real TLS for the https:// source tests)."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(server_ctx)
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    return server_ctx, str(ca_file)
