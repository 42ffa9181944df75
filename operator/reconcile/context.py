"""What the reconcile loops of one operator process share: clients, settings, wake-ups."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Hashable
from dataclasses import dataclass, field

import aiohttp

from ..adapter_state import RetryPolicy
from ..config import OperatorConfig
from ..desired import DesiredSettings
from ..runtime_client import RuntimeClient
from .kube import KubeClient
from .pods import PodView


class Wakers:
    """One wake-up flag per reconciled object: events set it, the object's loop waits on it."""

    def __init__(self) -> None:
        self._flags: dict[Hashable, asyncio.Event] = {}

    def flag(self, key: Hashable) -> asyncio.Event:
        """The flag of ``key`` (created on first use)."""
        if key not in self._flags:
            self._flags[key] = asyncio.Event()
        return self._flags[key]

    def wake(self, key: Hashable) -> None:
        """Ask the loop of ``key`` for a pass now (it coalesces many wake-ups into one pass)."""
        self.flag(key).set()

    def drop(self, key: Hashable) -> None:
        self._flags.pop(key, None)


def serve_key(namespace: str, name: str) -> tuple[str, str, str]:
    return ("LoRAServe", namespace, name)


def adapter_key(namespace: str, name: str) -> tuple[str, str, str]:
    return ("Adapter", namespace, name)


@dataclass
class Counters:
    """What the operator asked of runtime pods (for logs, tests and the benchmark)."""

    loads: collections.Counter = field(default_factory=collections.Counter)
    """(namespace, pod, adapter) -> load requests sent."""
    unloads: collections.Counter = field(default_factory=collections.Counter)


@dataclass
class OperatorContext:
    """Kept in kopf's memo: one per running operator."""

    config: OperatorConfig
    kube: KubeClient
    http: aiohttp.ClientSession
    settings: DesiredSettings
    retry: RetryPolicy
    wakers: Wakers = field(default_factory=Wakers)
    adapter_locks: dict[Hashable, asyncio.Lock] = field(default_factory=dict)
    synced_generation: dict[Hashable, int | None] = field(default_factory=dict)
    counters: Counters = field(default_factory=Counters)
    tokens: dict[tuple[str, str], tuple[str, float]] = field(default_factory=dict)
    """(namespace, Secret) -> (admin token, monotonic expiry)."""

    def runtime(self, pod: PodView, token: str | None) -> RuntimeClient:
        """An admin client for one runtime pod, with the operator's timeouts."""
        return RuntimeClient(
            self.http,
            pod.url,
            token,
            request_timeout_s=self.config.runtime_request_timeout_s,
            probe_timeout_s=self.config.runtime_probe_timeout_s,
        )

    def adapter_lock(self, key: Hashable) -> asyncio.Lock:
        """Serialises an Adapter's reconcile passes with its deletion (no load after an unload)."""
        if key not in self.adapter_locks:
            self.adapter_locks[key] = asyncio.Lock()
        return self.adapter_locks[key]

    @classmethod
    def from_config(cls, config: OperatorConfig, kube: KubeClient) -> OperatorContext:
        # One connection pool for every runtime pod; no total cap, a small per-host cap.
        http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, limit_per_host=8))
        return cls(
            config=config,
            kube=kube,
            http=http,
            settings=DesiredSettings(
                image=config.runtime_image,
                image_pull_policy=config.runtime_image_pull_policy,
                extra_labels=dict(config.extra_labels),
            ),
            retry=RetryPolicy(
                max_tries=config.adapter_max_tries,
                base_s=config.adapter_backoff_base_s,
                cap_s=config.adapter_backoff_cap_s,
            ),
        )

    async def close(self) -> None:
        await self.http.close()
        await self.kube.close()
