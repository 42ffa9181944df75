"""A renewed webhook certificate is served without a restart.

The certificate files sit in a directory laid out as the kubelet lays out a mounted Secret
(files are symlinks through ``..data``; an update writes a new directory and swaps
``..data`` atomically), issued by trustme CAs. As in test_admission.py, kmock's
KubernetesEmulator stands in for the API server (none exists on these machines); kopf, its
HTTPS webhook server and the TLS handshakes are real.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import datetime
import itertools
import json
import logging
import os
import shutil
import ssl
import subprocess
import sys
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import kopf
import pytest
import trustme
import yaml
from cryptography import x509

from loraserve.operator import tls, webhooks
from loraserve.operator.dev.demo_admission import AdmissionLab
from loraserve.operator.specs import API_VERSION, GROUP, LORASERVE_PLURAL, VERSION

RELOAD_S = 0.2
DEADLINE_S = 10.0
TLS_LOGGER = "loraserve.operator.tls"
REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- helpers


@dataclasses.dataclass(frozen=True)
class Issued:
    """A server certificate (chain PEM), its key and its CA, from trustme."""

    ca: trustme.CA
    chain: bytes
    key: bytes
    serial: int

    @classmethod
    def by(cls, ca: trustme.CA, **kwargs: Any) -> Issued:
        leaf = ca.issue_cert("127.0.0.1", **kwargs)
        chain = b"".join(blob.bytes() for blob in leaf.cert_chain_pems)
        serial = x509.load_pem_x509_certificate(chain).serial_number
        return cls(ca, chain, leaf.private_key_pem.bytes(), serial)

    def files(self, *, key: bytes | None = None) -> dict[str, bytes]:
        """The Secret's keys; ``key`` replaces the matching key (a mismatched pair)."""
        return {
            "tls.crt": self.chain,
            "tls.key": self.key if key is None else key,
            "ca.crt": self.ca.cert_pem.bytes(),
        }


class SecretMount:
    """A directory updated the way the kubelet updates a mounted Secret."""

    _serial = itertools.count()

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.tls_files = tls.TLSFiles(root / "tls.crt", root / "tls.key", root / "ca.crt")

    def publish(self, files: Mapping[str, bytes]) -> None:
        """Write ``files`` into a new timestamped directory, then swap ``..data`` to it."""
        data = self.root / "..data"
        old = data.resolve() if data.is_symlink() else None
        fresh = self.root / f"..{datetime.datetime.now():%Y_%m_%d_%H_%M_%S}.{next(self._serial)}"
        fresh.mkdir()
        for name, content in files.items():
            (fresh / name).write_bytes(content)
        staged = self.root / "..data_tmp"
        staged.symlink_to(fresh.name)
        os.replace(staged, data)  # rename(2) of a symlink: atomic, as the kubelet does it
        for name in ("tls.crt", "tls.key", "ca.crt"):
            link = self.root / name
            if not link.is_symlink():
                link.symlink_to(f"..data/{name}")
        if old is not None:
            shutil.rmtree(old)


def trusting(*cas: trustme.CA) -> ssl.SSLContext:
    context = ssl.create_default_context()
    for ca in cas:
        ca.configure_trust(context)
    return context


async def presented(port: int, context: ssl.SSLContext) -> x509.Certificate:
    """The certificate a new TLS connection to ``port`` is shown (verified by ``context``)."""
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    finally:
        writer.close()
        await writer.wait_closed()
    return x509.load_der_x509_certificate(der)


async def until(condition: Callable[[], Any], what: str, timeout: float = DEADLINE_S) -> Any:
    """Poll ``condition`` (sync or async) until it is truthy; fail naming ``what``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(RELOAD_S / 4)


class Connection:
    """One HTTP/1.1 keep-alive connection over TLS: every request rides the same handshake."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int, context: ssl.SSLContext) -> Connection:
        return cls(*await asyncio.open_connection("127.0.0.1", port, ssl=context))

    @property
    def peer(self) -> x509.Certificate:
        return x509.load_der_x509_certificate(
            self.writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        )

    async def review(self, obj: Mapping[str, Any], path: str = webhooks.VALIDATE_LORASERVE) -> dict[str, Any]:
        """POST an AdmissionReview v1 for creating ``obj``; the webhook's ``response``."""
        uid = str(uuid.uuid4())
        resource = {"group": GROUP, "version": VERSION, "resource": LORASERVE_PLURAL}
        kind = {"group": GROUP, "version": VERSION, "kind": obj["kind"]}
        body = json.dumps(
            {
                "apiVersion": "admission.k8s.io/v1",
                "kind": "AdmissionReview",
                "request": {
                    "uid": uid,
                    "kind": kind,
                    "resource": resource,
                    "requestKind": kind,
                    "requestResource": resource,
                    "name": obj["metadata"]["name"],
                    "namespace": obj["metadata"]["namespace"],
                    "operation": "CREATE",
                    "userInfo": {"username": "kubernetes-admin", "groups": ["system:masters"]},
                    "object": obj,
                    "oldObject": None,
                    "dryRun": False,
                    "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
                },
            }
        ).encode()
        head = (
            f"POST /{path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        self.writer.write(head.encode() + body)
        await self.writer.drain()
        status = (await self.reader.readline()).decode()
        assert status.startswith("HTTP/1.1 200"), status
        length = 0
        while (line := (await self.reader.readline()).decode().strip()) != "":
            name, _, value = line.partition(":")
            if name.lower() == "content-length":
                length = int(value)
        payload = json.loads(await self.reader.readexactly(length))
        assert payload["response"]["uid"] == uid
        return payload["response"]

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


def serve(namespace: str, name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "LoRAServe",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"model": {"source": "/models/m"}, **spec},
    }


def tls_records(caplog: pytest.LogCaptureFixture, level: int, text: str) -> list[logging.LogRecord]:
    return [
        r for r in caplog.records if r.name == TLS_LOGGER and r.levelno == level and text in r.getMessage()
    ]


@pytest.fixture
def fast_reload(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lab's webhook server rereads its files every RELOAD_S instead of the default."""
    configure = webhooks.configure_webhook_server

    def with_fast_reload(
        settings: kopf.OperatorSettings, config: webhooks.WebhookServerConfig | None = None
    ) -> tls.TLSFiles:
        config = config or webhooks.WebhookServerConfig.from_env()
        return configure(settings, dataclasses.replace(config, cert_reload_s=RELOAD_S))

    monkeypatch.setattr(webhooks, "configure_webhook_server", with_fast_reload)


# --------------------------------------------------------------------------- the operator's server


async def test_renewed_cert_served(tmp_path, fast_reload, caplog):
    """Renewed certificate is served without a restart."""
    caplog.set_level(logging.INFO, logger=TLS_LOGGER)
    ca1, ca2, ca3 = trustme.CA(), trustme.CA(), trustme.CA()
    first, second, third = Issued.by(ca1), Issued.by(ca2), Issued.by(ca3)
    mount = SecretMount(tmp_path / "webhook-tls")
    mount.publish(first.files())

    async with AdmissionLab(namespace="rotation", certificate=mount.tls_files) as lab:
        port = int(lab.webhook_url.rsplit(":", 1)[1])
        everyone = trusting(ca1, ca2, ca3)  # trusts all three: the test reads which is shown

        # A client trusting CA #1 connects, and keeps its connection open throughout.
        kept = await Connection.open(port, trusting(ca1))
        assert kept.peer.serial_number == first.serial
        assert (await kept.review(serve("rotation", "before")))["allowed"] is True

        # Renewal by CA #2, published as the kubelet does.
        mount.publish(second.files())

        async def shows_second() -> bool:
            return (await presented(port, everyone)).serial_number == second.serial

        await until(shows_second, "a new connection is shown CA #2's certificate")
        cert = await presented(port, trusting(ca2))  # verified against CA #2 alone
        assert cert.issuer == x509.load_pem_x509_certificate(ca2.cert_pem.bytes()).subject
        renewed = await Connection.open(port, trusting(ca2))
        verdict = await renewed.review(serve("rotation", "after"))
        assert verdict["allowed"] is True
        refused = await renewed.review(serve("rotation", "refused", speculative={"algorithm": "TELEPATHY"}))
        assert refused["allowed"] is False and refused["status"]["code"] == webhooks.ADMISSION_ERROR_CODE
        await renewed.close()
        applied = tls_records(caplog, logging.INFO, f"serial {second.serial:#x}")
        assert applied and "notAfter" in applied[0].getMessage()

        # Half a renewal: CA #3's certificate with CA #2's key. Not applied; warned once.
        mount.publish(third.files(key=second.key))
        await until(
            lambda: tls_records(caplog, logging.WARNING, "are not a pair"),
            "a warning about the mismatched pair",
        )
        await asyncio.sleep(5 * RELOAD_S)  # several more checks of the same files
        warnings = tls_records(caplog, logging.WARNING, "are not a pair")
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        assert f"serial {second.serial:#x}" in warnings[0].getMessage()  # names what is still served
        assert (await presented(port, everyone)).serial_number == second.serial
        assert lab.running

        # The connection opened before any of this still works, on its original handshake.
        assert (await kept.review(serve("rotation", "kept")))["allowed"] is True
        assert kept.peer.serial_number == first.serial
        await kept.close()

        # The complete pair arrives: applied on a later check.
        mount.publish(third.files())

        async def shows_third() -> bool:
            return (await presented(port, everyone)).serial_number == third.serial

        await until(shows_third, "CA #3's complete pair is served once it arrives")
        late = await Connection.open(port, trusting(ca3))
        assert (await late.review(serve("rotation", "late")))["allowed"] is True
        await late.close()


async def test_bad_files_keep_served_pair(tmp_path, caplog):
    """The reloader alone, serving a real TLS listener from its context."""
    caplog.set_level(logging.INFO, logger=TLS_LOGGER)
    ca1, ca2 = trustme.CA(), trustme.CA()
    first, second = Issued.by(ca1), Issued.by(ca2)
    mount = SecretMount(tmp_path / "webhook-tls")
    mount.publish(first.files())
    reloader = tls.CertificateReloader(mount.tls_files)
    assert reloader.load().info.serial == first.serial
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0, ssl=reloader.context)
    port = server.sockets[0].getsockname()[1]
    everyone = trusting(ca1, ca2)
    try:
        bad = {
            "cannot be read": {k: v for k, v in second.files().items() if k != "tls.key"},
            "does not parse as PEM certificates": second.files()
            | {"tls.crt": second.chain[: len(second.chain) // 2]},
            "does not parse as an unencrypted PEM private key": second.files() | {"tls.key": b"-----BEGIN"},
        }
        for reason, files in bad.items():
            mount.publish(files)
            assert reloader.poll() is tls.Reload.REJECTED
            assert reloader.poll() is tls.Reload.REJECTED
            assert len(tls_records(caplog, logging.WARNING, reason)) == 1, reason
            assert reloader.current.info.serial == first.serial
            assert (await presented(port, everyone)).serial_number == first.serial
        mount.publish(second.files())
        assert reloader.poll() is tls.Reload.APPLIED
        assert reloader.poll() is tls.Reload.UNCHANGED
        assert (await presented(port, trusting(ca2))).serial_number == second.serial
    finally:
        server.close()
        await server.wait_closed()


async def test_changed_ca_bundle_yielded(tmp_path):
    """kopf patches a yielded caBundle into the webhook configurations it manages."""
    ca1, ca2 = trustme.CA(), trustme.CA()
    mount = SecretMount(tmp_path / "webhook-tls")
    mount.publish(Issued.by(ca1).files())
    reloader = tls.CertificateReloader(mount.tls_files)
    reloader.load()
    server = webhooks.ReloadingWebhookServer(
        addr="127.0.0.1", port=0, host="127.0.0.1", reloader=reloader, reload_interval_s=RELOAD_S
    )

    async def verdict(request: Any, **_: Any) -> dict[str, Any]:
        return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": {"allowed": True}}

    configs = server(verdict)
    try:
        first = await anext(configs)
        assert base64.b64decode(first["caBundle"]) == ca1.cert_pem.bytes()
        mount.publish(Issued.by(ca2).files())
        second = await asyncio.wait_for(anext(configs), DEADLINE_S)
        assert base64.b64decode(second["caBundle"]) == ca2.cert_pem.bytes()
        assert second["url"] == first["url"]
    finally:
        await configs.aclose()


def test_expiry_warned_once(tmp_path, caplog):
    """Expiry is warned once per certificate and state."""
    caplog.set_level(logging.INFO, logger=TLS_LOGGER)
    ca = trustme.CA()
    now = datetime.datetime.now(datetime.UTC)
    soon = Issued.by(ca, not_after=now + datetime.timedelta(days=3))
    mount = SecretMount(tmp_path / "webhook-tls")
    mount.publish(soon.files())
    clock = [now]
    reloader = tls.CertificateReloader(mount.tls_files, clock=lambda: clock[0])
    reloader.load()
    reloader.poll()
    expiring = tls_records(caplog, logging.WARNING, "expires in 3.0 days")
    assert len(expiring) == 1 and f"serial {soon.serial:#x}" in expiring[0].getMessage()
    clock[0] = now + datetime.timedelta(days=4)
    reloader.poll()
    reloader.poll()
    assert len(tls_records(caplog, logging.WARNING, "has EXPIRED")) == 1
    # A renewed certificate far from expiry is not warned about.
    caplog.clear()
    mount.publish(Issued.by(ca).files())
    assert reloader.poll() is tls.Reload.APPLIED
    assert reloader.check_expiry() > datetime.timedelta(days=7)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# --------------------------------------------------------------------------- settings


def test_reload_interval_setting(tmp_path):
    assert webhooks.WebhookServerConfig.from_env({}).cert_reload_s == webhooks.DEFAULT_CERT_RELOAD_S
    assert 10 <= webhooks.DEFAULT_CERT_RELOAD_S <= 30
    env = {"LORASERVE_WEBHOOK_CERT_RELOAD_S": "0.5"}
    assert webhooks.WebhookServerConfig.from_env(env).cert_reload_s == 0.5
    for text in ("soon", "0", "-3", "inf", "nan"):
        with pytest.raises(ValueError, match=r"LORASERVE_WEBHOOK_CERT_RELOAD_S must be a number of seconds"):
            webhooks.WebhookServerConfig.from_env({"LORASERVE_WEBHOOK_CERT_RELOAD_S": text})
    with pytest.raises(ValueError, match="cert_reload_s"):
        webhooks.WebhookServerConfig(cert_reload_s=0)

    mount = SecretMount(tmp_path / "webhook-tls")
    mount.publish(Issued.by(trustme.CA()).files())
    settings = kopf.OperatorSettings()
    webhooks.configure_webhook_server(
        settings,
        webhooks.WebhookServerConfig(
            certfile=str(mount.tls_files.certfile), keyfile=str(mount.tls_files.keyfile), cert_reload_s=7.5
        ),
    )
    server = settings.admission.server
    assert isinstance(server, webhooks.ReloadingWebhookServer) and server.reload_interval_s == 7.5
    # A self-signed certificate is never renewed: kopf's plain server.
    settings = kopf.OperatorSettings()
    webhooks.configure_webhook_server(settings, webhooks.WebhookServerConfig(cert_dir=str(tmp_path / "gen")))
    assert type(settings.admission.server) is kopf.WebhookServer


def test_chart_mounts_cert_directory():
    """A subPath mount never sees a renewed Secret: the files must come from a directory mount."""
    helm = REPO / ".tools" / "helm"
    if not helm.exists():
        subprocess.run([sys.executable, str(REPO / "scripts" / "get_helm.py"), str(helm)], check=True)
    for flags in ([], ["--set", "webhook.certManager.enabled=true"]):
        rendered = subprocess.run(
            [
                str(helm),
                "template",
                "ls",
                str(REPO / "charts" / "loraserve"),
                "-n",
                "loraserve-system",
                *flags,
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        docs = [doc for doc in yaml.safe_load_all(rendered) if doc]
        deployment = next(d for d in docs if d["kind"] == "Deployment")
        pod = deployment["spec"]["template"]["spec"]
        container = pod["containers"][0]
        env = {e["name"]: e.get("value") for e in container["env"]}
        files = [env[f"LORASERVE_WEBHOOK_{key}_FILE"] for key in ("CERT", "KEY", "CA")]
        mounts = [m for m in container["volumeMounts"] if m["mountPath"] == str(Path(files[0]).parent)]
        assert len(mounts) == 1 and "subPath" not in mounts[0] and "subPathExpr" not in mounts[0], mounts
        assert {str(Path(f).parent) for f in files} == {mounts[0]["mountPath"]}
        volume = next(v for v in pod["volumes"] if v["name"] == mounts[0]["name"])
        secrets = {d["spec"]["secretName"] for d in docs if d["kind"] == "Certificate"} or {
            d["metadata"]["name"]
            for d in docs
            if d["kind"] == "Secret" and "tls.crt" in (d.get("data") or {})
        }
        assert volume["secret"]["secretName"] in secrets
