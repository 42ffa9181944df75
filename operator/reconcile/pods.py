"""Runtime pods as the adapter reconcile sees them (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..desired import SERVE_LABEL, SERVE_NAME_ANNOTATION, runtime_port


@dataclass(frozen=True)
class PodView:
    """One runtime pod: where its admin API is and whether it may take adapters now."""

    name: str
    namespace: str
    uid: str
    serve: str
    """The serve's name (from the pod's annotation; the label may be shortened)."""
    ip: str | None
    port: int
    ready: bool
    terminating: bool
    running: bool = True
    """The pod's phase is Running (its containers started; the runtime may be loading its model)."""

    @property
    def usable(self) -> bool:
        """Ready, addressed, and not on its way out: it can load adapters."""
        return self.ready and bool(self.ip) and not self.terminating

    @property
    def pushable(self) -> bool:
        """Running, addressed and not on its way out, Ready or not: it may take the catalog.
        A runtime started with ``--catalog-confirm`` turns Ready only after that push."""
        return self.running and bool(self.ip) and not self.terminating

    @property
    def starting(self) -> bool:
        """Pushable but not Ready yet: the serve's pass looks at it again within seconds."""
        return self.pushable and not self.ready

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{self.port}"


def pod_view(body: Mapping) -> PodView | None:
    """Read a Pod object; None when it is not a LoRAServe runtime pod."""
    meta = body.get("metadata") or {}
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    serve = annotations.get(SERVE_NAME_ANNOTATION) or labels.get(SERVE_LABEL)
    if not serve:
        return None
    status = body.get("status") or {}
    running = status.get("phase", "Running") == "Running"
    ready = running and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )
    return PodView(
        name=str(meta.get("name")),
        namespace=str(meta.get("namespace") or ""),
        uid=str(meta.get("uid") or ""),
        serve=str(serve),
        ip=status.get("podIP") or None,
        port=runtime_port(body),
        ready=ready,
        terminating=bool(meta.get("deletionTimestamp")),
        running=running,
    )
