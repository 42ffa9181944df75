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
# One intra-op thread per process (this one, and the runtimes and ranks it starts): the
# models here are tiny, and a second thread spinning beside other workers on two cores cost
# about three times the CPU time for the same tests. Set before anything imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# `pytest -n N --dist loadfile` (make test) runs each test file whole on one worker, so its
# module-scoped fixtures (servers, runtime processes) start once. These folders run whole on
# one worker each: their files share one build under .cache/ that two processes must not make
# at once (e2e/ and cluster/ both build .cache/operator-e2e), or one control plane. They run
# first: each is a long chain of tests that nothing else can shorten.
SHARED_FOLDERS = {"e2e": "tests/e2e+cluster", "cluster": "tests/e2e+cluster", "real_model": "tests/real_model"}


def work_unit(nodeid: str) -> str:
    """The unit of work (of ``--dist loadfile``) that the test ``nodeid`` belongs to: its folder's
    in :data:`SHARED_FOLDERS`, else its file."""
    path = nodeid.split("::", 1)[0]
    parts = path.split("/")
    if len(parts) > 2 and parts[0] == "tests" and parts[1] in SHARED_FOLDERS:
        return SHARED_FOLDERS[parts[1]]
    return path


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before xdist's own scheduler choice
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadfile`` by :func:`work_unit`, the shared folders handed out first."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedFolderScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

        def _assign_work_unit(self, node) -> None:
            first = [unit for unit in self.workqueue if unit in SHARED_FOLDERS.values()]
            if first:
                self.workqueue.move_to_end(first[0], last=False)
            super()._assign_work_unit(node)

    return SharedFolderScheduling(config, log)


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
