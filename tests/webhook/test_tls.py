"""The webhook's TLS: mounted certificates (from trustme) served over real HTTPS, the
self-signed fallback, and the errors a bad mount or setting produces.

As in test_admission.py, kmock's KubernetesEmulator stands in for the API server (none
exists on these machines); kopf and its HTTPS webhook server are real.
"""

from __future__ import annotations

import ssl
import stat

import aiohttp
import kopf
import pytest
import trustme
from cryptography import x509

from loraserve.operator import tls, webhooks
from loraserve.operator.dev.demo_admission import AdmissionLab
from loraserve.operator.specs import API_VERSION


@pytest.fixture
def mounted(tmp_path):
    """Certificate files as a Secret mount would hold them, issued by a trustme CA."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "loraserve-webhook.loraserve.svc")
    files = tls.TLSFiles(tmp_path / "tls.crt", tmp_path / "tls.key", tmp_path / "ca.crt")
    cert.cert_chain_pems[0].write_to_path(files.certfile)
    cert.private_key_pem.write_to_path(files.keyfile)
    ca.cert_pem.write_to_path(files.cafile)
    return ca, files


async def test_mounted_cert_served(mounted):
    """Mounted certificate is served and verified."""
    _, files = mounted
    obj = {
        "apiVersion": API_VERSION,
        "kind": "LoRAServe",
        "metadata": {"name": "s"},
        "spec": {"model": {"source": "/m"}},
    }
    async with AdmissionLab(namespace="tls", certificate=files) as lab:
        # The lab's client trusts only the mounted ca.crt: this succeeding is the verification.
        assert lab.tls.cafile == files.cafile
        review = await lab.review(obj, path=webhooks.VALIDATE_LORASERVE)
        assert review.allowed
        async with aiohttp.ClientSession() as http:
            # A client without that CA refuses the server's certificate.
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                await http.post(
                    f"{lab.webhook_url}/{webhooks.VALIDATE_LORASERVE}",
                    json={},
                    ssl=ssl.create_default_context(),
                )


def test_self_signed_cert_verifies(tmp_path):
    """Self signed certificate covers its names and verifies."""
    files = tls.generate_self_signed(tmp_path, ["loraserve-webhook.loraserve.svc", "127.0.0.1"])
    assert stat.S_IMODE(files.keyfile.stat().st_mode) == 0o600
    leaf = x509.load_pem_x509_certificates(files.certfile.read_bytes())[0]
    names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["loraserve-webhook.loraserve.svc"]
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    ca = x509.load_pem_x509_certificate(files.cafile.read_bytes())
    leaf.verify_directly_issued_by(ca)
    assert tls.check_files(files.certfile, files.keyfile, files.cafile) == files


def test_bad_mounts_name_the_file(tmp_path, mounted):
    _, files = mounted
    with pytest.raises(tls.TLSConfigError, match=r"certificate file '.*missing.crt' does not exist"):
        tls.check_files(tmp_path / "missing.crt", files.keyfile)
    other = trustme.CA().issue_cert("x")
    other.private_key_pem.write_to_path(tmp_path / "other.key")
    with pytest.raises(tls.TLSConfigError, match="do not load as a pair"):
        tls.check_files(files.certfile, tmp_path / "other.key")
    with pytest.raises(tls.TLSConfigError, match="at least one hostname"):
        tls.generate_self_signed(tmp_path / "none", [])


def test_settings_from_the_environment(tmp_path, mounted):
    _, files = mounted
    env = {
        "LORASERVE_WEBHOOK_PORT": "8443",
        "LORASERVE_WEBHOOK_HOST": "loraserve-webhook.loraserve.svc",
        "LORASERVE_WEBHOOK_CERT_FILE": str(files.certfile),
        "LORASERVE_WEBHOOK_KEY_FILE": str(files.keyfile),
        "LORASERVE_WEBHOOK_MANAGED": "loraserve.io",
    }
    config = webhooks.WebhookServerConfig.from_env(env)
    assert (config.port, config.host, config.addr, config.managed) == (
        8443,
        "loraserve-webhook.loraserve.svc",
        "0.0.0.0",
        "loraserve.io",
    )
    settings = kopf.OperatorSettings()
    used = webhooks.configure_webhook_server(settings, config)
    server = settings.admission.server
    assert isinstance(server, kopf.WebhookServer)
    assert (server.port, server.certfile, server.pkeyfile) == (8443, str(files.certfile), str(files.keyfile))
    assert settings.admission.managed == "loraserve.io" and used.certfile == files.certfile
    # Without files: a self-signed CA for the configured host.
    generated = webhooks.configure_webhook_server(
        kopf.OperatorSettings(),
        webhooks.WebhookServerConfig(host="webhook.local", cert_dir=str(tmp_path / "gen")),
    )
    assert generated.cafile.is_file() and "webhook.local" in str(
        x509.load_pem_x509_certificates(generated.certfile.read_bytes())[0].subject
    )


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"LORASERVE_WEBHOOK_PORT": "http"}, "LORASERVE_WEBHOOK_PORT must be a TCP port"),
        ({"LORASERVE_WEBHOOK_PORT": "70000"}, "LORASERVE_WEBHOOK_PORT must be a TCP port"),
        ({"LORASERVE_WEBHOOK_CERT_FILE": "/tls/tls.crt"}, "set both LORASERVE_WEBHOOK_CERT_FILE and"),
    ],
)
def test_bad_settings_name_the_variable(env, message):
    with pytest.raises(ValueError, match=message):
        webhooks.WebhookServerConfig.from_env(env)


def test_bad_mounted_files_stop_config(tmp_path):
    """Mounted files that do not load stop configuration."""
    config = webhooks.WebhookServerConfig(
        certfile=str(tmp_path / "tls.crt"), keyfile=str(tmp_path / "tls.key")
    )
    with pytest.raises(tls.TLSConfigError, match="does not exist"):
        webhooks.configure_webhook_server(kopf.OperatorSettings(), config)


async def test_operator_runs_without_webhooks():
    """kopf refuses to run registered admission handlers without a server; the disabled
    server lets an operator run with the chart's webhook turned off."""
    obj = {
        "apiVersion": API_VERSION,
        "kind": "LoRAServe",
        "metadata": {"name": "s"},
        "spec": {"model": {"source": "/m"}},
    }
    async with AdmissionLab(namespace="off", serve_webhooks=False) as lab:
        assert lab.webhook_url == "" and lab.running
        await lab.store(obj)
        await lab.wait_seen(obj)  # the watch and indexes work
        assert lab.running
