"""Keep every pod's adapter catalog equal to the serve's (observe, diff, act).

The ConfigMap gives a pod the catalog as it was when the pod started (and the kubelet
refreshes that volume only every minute or so); Adapters created, changed or deleted
later reach pods here: ``GET /v1/lora_catalog`` on each pod, and ``PUT`` the serve's
catalog where the digest differs or the pod has not been confirmed since it started.
Pods still starting (running, addressed, not Ready) are pushed too: a runtime started with
``--catalog-confirm`` turns Ready only after that push, so it never answers 404 for an
Adapter created while it loaded its model. A pod that does not answer, or that is still
starting, is left for the next pass, which the caller runs within seconds
(:attr:`CatalogSync.again_soon`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from loraserve.runtime.contract.catalog import CatalogEntry, catalog_digest

from ..runtime_client import RuntimeCallError
from .context import OperatorContext
from .pods import PodView

logger = logging.getLogger(__name__)


@dataclass
class CatalogSync:
    """What one pass did: pods already current, pods pushed, pods that failed (and why)."""

    current: list[str] = field(default_factory=list)
    pushed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    """Ready pods that did not take the push (and why)."""
    starting: dict[str, str] = field(default_factory=dict)
    """Pods not Ready yet whose runtime did not take the push yet (still loading its model)."""
    waiting: list[str] = field(default_factory=list)
    """Pods not Ready yet that hold the catalog: their readiness probe has yet to pass (its
    flip is a pod event, which wakes the passes; no polling needed)."""

    @property
    def again_soon(self) -> bool:
        """Whether a pod still needs the push: pass again within seconds. A starting pod's
        model load ends with no pod event (it is not Ready until pushed), so it is polled."""
        return bool(self.failed or self.starting)


async def _sync_pod(
    ctx: OperatorContext, pod: PodView, token: str | None, entries: Sequence[CatalogEntry], digest: str
) -> str:
    runtime = ctx.runtime(pod, token)
    held = await runtime.catalog()
    # An unconfirmed pod (started with --catalog-confirm) waits for a PUT even when the
    # ConfigMap already gave it this digest.
    if held.digest == digest and held.confirmed is not False:
        return "current"
    await runtime.put_catalog(entries)
    return "pushed"


async def sync_catalog(
    ctx: OperatorContext, pods: Sequence[PodView], token: str | None, entries: Sequence[CatalogEntry]
) -> CatalogSync:
    """Bring every pushable pod's catalog (Ready or starting) to ``entries``."""
    digest = catalog_digest(entries)
    pushable = sorted((p for p in pods if p.pushable), key=lambda p: p.name)
    answers = await asyncio.gather(
        *(_sync_pod(ctx, pod, token, entries, digest) for pod in pushable), return_exceptions=True
    )
    sync = CatalogSync()
    for pod, answer in zip(pushable, answers, strict=True):
        if isinstance(answer, BaseException) and not isinstance(answer, Exception):
            raise answer  # cancellation and the like
        if isinstance(answer, Exception):
            why = (
                answer.message
                if isinstance(answer, RuntimeCallError)
                else f"{answer.__class__.__name__}: {answer}"
            )
            (sync.starting if pod.starting else sync.failed)[pod.name] = why
            continue
        (sync.current if answer == "current" else sync.pushed).append(pod.name)
        if pod.starting:
            sync.waiting.append(pod.name)
    if sync.failed:
        logger.info("catalog %s not pushed to %s", digest, sorted(sync.failed))
    return sync


async def pods_still_listing(
    ctx: OperatorContext, pods: Sequence[PodView], token: str | None, name: str
) -> dict[str, str]:
    """Usable pods whose catalog still lists ``name`` (or that did not answer), with why."""
    usable = [p for p in pods if p.usable]
    answers = await asyncio.gather(*(ctx.runtime(p, token).models() for p in usable), return_exceptions=True)
    left: dict[str, str] = {}
    for pod, answer in zip(usable, answers, strict=True):
        if isinstance(answer, BaseException):
            if not isinstance(answer, Exception):
                raise answer
            left[pod.name] = getattr(answer, "message", None) or str(answer)
        elif name in answer.adapters:
            left[pod.name] = f"still lists {name!r} ({answer.adapters[name].state})"
    return left
