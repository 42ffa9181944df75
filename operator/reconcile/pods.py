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

    @property
    def usable(self) -> bool:
        """Ready, addressed, and not on its way out: it can load adapters."""
        return self.ready and bool(self.ip) and not self.terminating

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
    ready = (
        any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
        and status.get("phase", "Running") == "Running"
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
    )
