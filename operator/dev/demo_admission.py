"""Admission, end to end on one machine: ``python -m loraserve.operator.dev.demo_admission``.

Starts a stand-in Kubernetes API (kmock's ``KubernetesEmulator``: this machine has no API
server), kopf with the LoRAServe admission webhooks behind HTTPS with a freshly generated
self-signed CA, then plays the API server's part: each manifest goes through the mutating
webhook, then the validating webhook, over real AdmissionReview v1 requests, and is stored
only when admitted (so kopf's indexes see it, as in a cluster). It applies ``examples/``,
then every negative example of ``examples/invalid/`` and a few changes to live objects,
printing each verdict with its reasons and warnings.

What the API server itself would do before the webhooks (CRD defaulting, schema and CEL
validation) is not simulated here; negative examples that the CRD refuses say so.

:class:`AdmissionLab` is the reusable part (the webhook tests drive it too).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import json
import logging
import re
import socket
import sys
import tempfile
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import jsonpatch
import kopf
import yaml

from .. import webhooks
from ..specs import ADAPTER_KIND, ADAPTER_PLURAL, GROUP, LORASERVE_KIND, LORASERVE_PLURAL, VERSION
from ..tls import TLSFiles

PLURALS = {LORASERVE_KIND: LORASERVE_PLURAL, ADAPTER_KIND: ADAPTER_PLURAL}
BACKBONE = (
    "v1/namespaces",
    "v1/events",
    "apiextensions.k8s.io/v1/customresourcedefinitions",
)
"""Resources kopf waits for before it watches anything."""


@dataclass
class Review:
    """The webhook's answer to one AdmissionReview."""

    allowed: bool
    code: int | None = None
    message: str = ""
    warnings: list[str] = field(default_factory=list)
    patch: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_response(cls, payload: Mapping[str, Any]) -> Review:
        response = payload["response"]
        status = response.get("status") or {}
        patch = json.loads(base64.b64decode(response["patch"])) if response.get("patch") else []
        return cls(
            allowed=bool(response["allowed"]),
            code=status.get("code"),
            message=status.get("message", ""),
            warnings=list(response.get("warnings") or ()),
            patch=patch,
        )


@dataclass
class Applied:
    """One object through mutation, validation and (if admitted) storage."""

    object: dict[str, Any]
    mutation: Review
    validation: Review

    @property
    def allowed(self) -> bool:
        return self.mutation.allowed and self.validation.allowed

    @property
    def warnings(self) -> list[str]:
        return self.mutation.warnings + self.validation.warnings


def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _OperatorThread:
    """``kopf.operator`` on an event loop of its own thread, stoppable from any loop."""

    def __init__(self, registry: kopf.OperatorRegistry, settings: kopf.OperatorSettings) -> None:
        self._registry = registry
        self._settings = settings
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kopf-admission-lab", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as error:
            self._error = error

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._ready.set()
        await kopf.operator(
            registry=self._registry,
            settings=self._settings,
            standalone=True,
            clusterwide=True,
            stop_flag=self._stop,
        )

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def raise_if_stopped(self) -> None:
        if not self._thread.is_alive():
            raise RuntimeError(f"kopf stopped: {self._error!r}") from self._error

    async def stop(self, timeout: float = 15.0) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        await asyncio.to_thread(self._thread.join, timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"kopf did not stop within {timeout} s")


class AdmissionLab:
    """kmock's Kubernetes emulator + kopf with the admission webhooks over HTTPS.

    ``apply()`` does what the API server does with a create or update: the mutating
    webhook, its JSONPatch, the validating webhook, then storage (which feeds kopf's
    watch and so the indexes). ``review()`` sends one AdmissionReview as it is.
    """

    def __init__(
        self,
        *,
        namespace: str = "default",
        cert_dir: Path | None = None,
        certificate: TLSFiles | None = None,
        serve_webhooks: bool = True,
    ) -> None:
        """``certificate``: mounted-style PEM files to serve (checked as the operator checks
        them); None generates a self-signed CA into ``cert_dir`` (or a temporary directory).
        ``serve_webhooks=False`` runs kopf with the handlers registered but no server."""
        self.namespace = namespace
        self._serve_webhooks = serve_webhooks
        self._cert_dir = cert_dir
        self._certificate = certificate
        self._stack = contextlib.AsyncExitStack()
        self._seen: dict[tuple[str, str, str], Any] = {}  # written on kopf's thread
        self.api_url = ""
        self.webhook_url = ""
        self.tls: TLSFiles | None = None
        self._operator: _OperatorThread | None = None

    @property
    def running(self) -> bool:
        """Whether kopf is still running (it stops on an unrecoverable error)."""
        return self._operator is not None and self._operator.alive

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> AdmissionLab:
        import kmock  # a development dependency: only the lab needs it

        try:
            emulator = await self._stack.enter_async_context(kmock.KubernetesEmulator())
            for resource in BACKBONE:
                emulator.resources[resource] = {}
            verbs = {"list", "watch", "get", "create", "patch", "update", "delete"}
            for kind, plural in PLURALS.items():
                emulator.resources[f"{GROUP}/{VERSION}/{plural}"] = kmock.ResourceInfo(
                    kind=kind, singular=kind.lower(), namespaced=True, verbs=verbs, subresources={"status"}
                )
            server = await self._stack.enter_async_context(kmock.Server(emulator))
            self.api_url = str(server.url).rstrip("/")
            self._emulator = emulator

            registry = kopf.OperatorRegistry()
            webhooks.register(registry)
            kopf.on.login(registry=registry)(self._login)
            for plural in PLURALS.values():
                kopf.on.event(GROUP, VERSION, plural, registry=registry)(self._record)

            settings = kopf.OperatorSettings()
            settings.posting.enabled = False
            settings.watching.server_timeout = 30
            port = _free_port()
            cert_dir = self._cert_dir or Path(self._stack.enter_context(tempfile.TemporaryDirectory()))
            files = self._certificate
            config = webhooks.WebhookServerConfig(
                addr="127.0.0.1",
                port=port,
                host="127.0.0.1",
                cert_dir=str(cert_dir),
                certfile=str(files.certfile) if files else None,
                keyfile=str(files.keyfile) if files else None,
                cafile=str(files.cafile) if files and files.cafile else None,
            )
            if self._serve_webhooks:
                self.tls = webhooks.configure_webhook_server(settings, config)
                self.webhook_url = f"https://127.0.0.1:{port}"
            else:
                webhooks.disable_webhook_server(settings)

            # kopf runs on its own loop in a thread: on shutdown it cancels every task of its
            # loop that it did not start with, which must not include the caller's.
            operator = _OperatorThread(registry, settings)
            operator.start()
            self._operator = operator
            self._stack.push_async_callback(operator.stop)
            self._http = await self._stack.enter_async_context(aiohttp.ClientSession())
            self._ssl = self.tls.client_context() if self.tls else None
            await self._wait_ready(operator)
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._stack.aclose()

    async def _login(self, **_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=self.api_url, insecure=True)

    async def _wait_ready(self, operator: _OperatorThread, timeout: float = 30.0) -> None:
        """Until the webhook answers over HTTPS and kopf watches both resources."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self._serve_webhooks:
            operator.raise_if_stopped()
            try:
                await self.review(self._sample(LORASERVE_KIND), path=webhooks.VALIDATE_LORASERVE)
                break
            except (aiohttp.ClientError, OSError):
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.1)
        # A sentinel object proves the watch streams (hence the indexes) are live.
        for kind in PLURALS:
            sentinel = self._sample(kind, name=f"sentinel-{uuid.uuid4().hex[:6]}", namespace="loraserve-lab")
            await self.store(sentinel)
            await self.wait_seen(sentinel, timeout=max(1.0, deadline - asyncio.get_running_loop().time()))

    def _sample(self, kind: str, *, name: str = "probe", namespace: str | None = None) -> dict[str, Any]:
        spec = (
            {"model": {"source": "/models/probe"}}
            if kind == LORASERVE_KIND
            else {"serve": "probe", "source": "/a"}
        )
        return {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": kind,
            "metadata": {"name": name, "namespace": namespace or self.namespace},
            "spec": spec,
        }

    # ------------------------------------------------------------------ the watch

    async def _record(self, type: str | None, body: Mapping[str, Any], **_: Any) -> None:
        key = (body.get("kind", ""), body["metadata"].get("namespace", ""), body["metadata"]["name"])
        self._seen[key] = None if type == "DELETED" else copy.deepcopy(dict(body.get("spec") or {}))

    async def wait_seen(
        self, obj: Mapping[str, Any], *, deleted: bool = False, timeout: float = 10.0
    ) -> None:
        """Until kopf has processed ``obj`` as stored (or its deletion): its indexes hold it."""
        meta = obj["metadata"]
        key = (obj["kind"], meta.get("namespace") or self.namespace, meta["name"])
        expected = None if deleted else dict(obj.get("spec") or {})

        deadline = asyncio.get_running_loop().time() + timeout
        while not (key in self._seen and self._seen[key] == expected):
            if self._operator is not None:
                self._operator.raise_if_stopped()
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"kopf did not see {key} {'deleted' if deleted else 'as stored'}")
            await asyncio.sleep(0.02)

    # ------------------------------------------------------------------ requests

    async def _request(self, method: str, path: str, body: Any = None, **kwargs: Any) -> Any:
        async with self._http.request(method, self.api_url + path, json=body, **kwargs) as response:
            payload = await response.json(content_type=None)
            if response.status >= 400:
                raise RuntimeError(f"{method} {path}: {response.status} {payload}")
            return payload

    def _path(self, obj: Mapping[str, Any], *, name: bool) -> str:
        plural = PLURALS[obj["kind"]]
        namespace = obj["metadata"].get("namespace") or self.namespace
        path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{plural}"
        return f"{path}/{obj['metadata']['name']}" if name else path

    async def review(
        self,
        obj: Mapping[str, Any] | None,
        *,
        path: str,
        operation: str = "CREATE",
        old: Mapping[str, Any] | None = None,
    ) -> Review:
        """POST one AdmissionReview v1 to ``/<path>`` and return the webhook's answer."""
        subject = obj if obj is not None else old
        assert subject is not None
        meta = subject["metadata"]
        request = {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": str(uuid.uuid4()),
                "kind": {"group": GROUP, "version": VERSION, "kind": subject["kind"]},
                "resource": {"group": GROUP, "version": VERSION, "resource": PLURALS[subject["kind"]]},
                "requestKind": {"group": GROUP, "version": VERSION, "kind": subject["kind"]},
                "requestResource": {"group": GROUP, "version": VERSION, "resource": PLURALS[subject["kind"]]},
                "name": meta["name"],
                "namespace": meta.get("namespace") or self.namespace,
                "operation": operation,
                "userInfo": {"username": "kubernetes-admin", "groups": ["system:masters"]},
                "object": obj,
                "oldObject": old,
                "dryRun": False,
                "options": {"apiVersion": "meta.k8s.io/v1", "kind": f"{operation.title()}Options"},
            },
        }
        async with self._http.post(f"{self.webhook_url}/{path}", json=request, ssl=self._ssl) as response:
            response.raise_for_status()
            payload = await response.json()
        assert payload["response"]["uid"] == request["request"]["uid"]
        return Review.from_response(payload)

    async def store(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Write ``obj`` to the emulator, as the API server does after admission."""
        obj = copy.deepcopy(dict(obj))
        obj["metadata"].setdefault("namespace", self.namespace)
        try:
            current = await self._request("GET", self._path(obj, name=True))
        except RuntimeError:
            current = None
        if current is None:
            return await self._request("POST", self._path(obj, name=False), obj)
        # The emulator merges patches; replacing the spec whole makes it an update.
        await self._request(
            "PATCH",
            self._path(obj, name=True),
            {"spec": None},
            headers={"Content-Type": "application/merge-patch+json"},
        )
        return await self._request(
            "PATCH",
            self._path(obj, name=True),
            {"metadata": {"labels": obj["metadata"].get("labels")}, "spec": obj["spec"]},
            headers={"Content-Type": "application/merge-patch+json"},
        )

    async def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        obj = {"kind": kind, "metadata": {"name": name, "namespace": namespace or self.namespace}}
        try:
            return await self._request("GET", self._path(obj, name=True))
        except RuntimeError:
            return None

    async def delete(self, obj: Mapping[str, Any]) -> None:
        await self._request("DELETE", self._path(obj, name=True))
        await self.wait_seen(obj, deleted=True)

    async def apply(self, obj: Mapping[str, Any]) -> Applied:
        """Create or update ``obj`` through both webhooks; stored (and indexed) if admitted."""
        obj = copy.deepcopy(dict(obj))
        obj.setdefault("metadata", {}).setdefault("namespace", self.namespace)
        old = await self.get(obj["kind"], obj["metadata"]["name"], obj["metadata"]["namespace"])
        operation = "UPDATE" if old is not None else "CREATE"
        kind_id = "loraserve" if obj["kind"] == LORASERVE_KIND else "adapter"
        mutation = await self.review(obj, path=f"mutate-{kind_id}", operation=operation, old=old)
        if mutation.patch:
            obj = jsonpatch.apply_patch(obj, mutation.patch)
        validation = Review(allowed=False, message="refused by the mutating webhook")
        if mutation.allowed:
            validation = await self.review(obj, path=f"validate-{kind_id}", operation=operation, old=old)
        if mutation.allowed and validation.allowed:
            await self.store(obj)
            await self.wait_seen(obj)
        return Applied(obj, mutation, validation)


# --------------------------------------------------------------------------- the demo

ROOT = Path(__file__).resolve().parents[2]


def _examples_dir() -> Path:
    for candidate in (ROOT / "examples", Path.cwd() / "examples"):
        if candidate.is_dir():
            return candidate
    raise SystemExit("examples/ not found: run from the repository root")


def _expectation(path: Path) -> tuple[str, str]:
    found = dict(re.findall(r"^#\s*expect-(rejected-by|message):\s*(.+)$", path.read_text(), flags=re.M))
    return found.get("rejected-by", "?"), str(yaml.safe_load(found.get("message", "''")))


def _patch_text(patch: list[dict[str, Any]]) -> str:
    return ", ".join(f"{op['op']} {op['path']} = {json.dumps(op.get('value'))}" for op in patch)


def _print(applied: Applied, label: str = "") -> None:
    kind, name = applied.object["kind"], applied.object["metadata"]["name"]
    verdict = "ADMITTED" if applied.allowed else f"REFUSED ({applied.validation.code})"
    print(f"  {verdict:<14} {kind} {name}{label}")
    if applied.mutation.patch:
        print(f"      mutated:  {_patch_text(applied.mutation.patch)}")
    if not applied.allowed:
        for line in applied.validation.message.splitlines():
            if not re.match(r"^\d+ problems:$", line):
                print(f"      reason:   {line.removeprefix('- ')}")
    for warning in applied.warnings:
        print(f"      warning:  {warning}")


async def run_demo() -> int:
    """Apply every example and negative example; 1 if a verdict contradicts its annotation."""
    from loraserve.runtime.contract.capabilities import CAPABILITIES

    examples = _examples_dir()
    failures = 0
    docs = [yaml.safe_load(p.read_text()) for p in sorted(examples.glob("*.yaml"))]
    docs.sort(key=lambda d: d["kind"] != LORASERVE_KIND)  # serves first, as an installer would
    async with AdmissionLab(namespace="demo") as lab:
        implemented = ", ".join(sorted(a.value for a in CAPABILITIES.algorithms))
        print("LoRAServe admission demo")
        print(f"  API stand-in  {lab.api_url} (kmock KubernetesEmulator)")
        print(
            f"  webhooks      {lab.webhook_url}/{{mutate,validate}}-{{loraserve,adapter}} (CA {lab.tls.cafile})"
        )
        print(f"  runtime image implements speculative algorithms: {implemented}\n")

        print("== examples/ (serves, then adapters)")
        for doc in docs:
            _print(await lab.apply(doc))

        print("\n== examples/invalid/ (each annotated with the message it must produce)")
        for path in sorted((examples / "invalid").glob("*.yaml")):
            stage, message = _expectation(path)
            applied = await lab.apply(yaml.safe_load(path.read_text()))
            said = [applied.validation.message, *applied.warnings]
            if stage == "webhook":
                ok = not applied.allowed and any(message in text for text in said)
                failures += not ok
                _print(applied, f"  [{path.name}: {'as annotated' if ok else 'NOT as annotated'}]")
            else:
                _print(applied, f"  [{path.name}: the API server's {stage} check refuses it first]")
                print(f"      CRD says: {message}")

        print("\n== changes to live objects")
        plain = await lab.get(LORASERVE_KIND, "llama3-1b")
        lowered = copy.deepcopy(plain)
        lowered["spec"]["lora"]["maxRank"] = 4
        applied = await lab.apply(lowered)
        _print(applied, "  [maxRank 16 -> 4 with Adapter brand-voice at rank 8]")
        failures += applied.allowed or "brand-voice" not in applied.validation.message
        narrowed = copy.deepcopy(plain)
        narrowed["spec"]["lora"]["targetModules"] = ["q_proj"]
        applied = await lab.apply(narrowed)
        _print(applied, "  [targetModules drop v_proj, which brand-voice targets]")
        failures += applied.allowed
        raised = copy.deepcopy(plain)
        raised["spec"]["lora"]["maxRank"] = 32
        applied = await lab.apply(raised)
        _print(applied, "  [maxRank 16 -> 32]")
        failures += not applied.allowed
        late = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": ADAPTER_KIND,
            "metadata": {"name": "early-bird"},
            "spec": {"serve": "mistral-7b", "source": "hf://acme/mistral-7b-lora", "rank": 8},
        }
        _print(await lab.apply(late), "  [its LoRAServe is not applied yet]")
    print(f"\n{'all verdicts as annotated' if not failures else f'{failures} verdict(s) NOT as annotated'}")
    return 1 if failures else 0


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # kopf logs each refused admission as a handler failure; the demo prints the verdicts itself.
    logging.getLogger("kopf").setLevel(logging.CRITICAL)
    sys.exit(asyncio.run(run_demo()))


if __name__ == "__main__":
    main()
