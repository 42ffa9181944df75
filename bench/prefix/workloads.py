"""The request streams: who sends what, and what the next request of a user depends on."""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Shape:
    """Sizes of the workloads (the full run's defaults follow the issue)."""

    adapters: int = 8
    system_tokens: int = 1500
    users: int = 64
    question_tokens: int = 100
    rounds: int = 4  # questions per user
    output_tokens: int = 128
    chats: int = 16
    turns: int = 6
    turn_tokens: int = 60

    @classmethod
    def smoke(cls) -> Shape:
        return cls(
            adapters=4, system_tokens=96, users=8, question_tokens=12, rounds=2, output_tokens=6,
            chats=4, turns=3, turn_tokens=10,
        )  # fmt: skip


@dataclass
class Session:
    """One user's stream of requests, sent one after another (a closed loop).

    ``parts[i]`` is what the user adds before request ``i``; with ``carry`` the previous
    prompt and the model's answer stay in front of it (a chat resending its history).
    ``waits[i]`` is how long the user waits before sending request ``i``: for ``i = 0``
    when it joins, then the time it takes to read an answer and write the next question
    (:func:`with_think_time`; empty: none)."""

    adapter: str | None
    prefix: list[int]
    parts: list[list[int]]
    carry: bool = False
    history: list[int] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)

    def wait_before(self, turn: int) -> float:
        return self.waits[turn] if self.waits else 0.0

    def prompt(self, turn: int, last_answer: list[int]) -> list[int]:
        if not self.carry:
            return [*self.prefix, *self.parts[turn]]
        if turn == 0:
            self.history = [*self.prefix, *self.parts[0]]
        else:
            self.history = [*self.history, *last_answer, *self.parts[turn]]
        return list(self.history)


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def adapter_names(shape: Shape) -> list[str]:
    return [f"tenant-{i}" for i in range(shape.adapters)]


def system_prompts(shape: Shape, vocab: int, seed: int = 0) -> list[Session]:
    """Every user talks to one tenant's adapter behind that tenant's system prompt."""
    rng = random.Random(seed)
    names = adapter_names(shape)
    systems = {name: _tokens(rng, shape.system_tokens, vocab) for name in names}
    sessions = []
    for u in range(shape.users):
        name = names[u % len(names)]
        parts = [_tokens(rng, shape.question_tokens, vocab) for _ in range(shape.rounds)]
        sessions.append(Session(name, systems[name], parts))
    return sessions


def chat_replay(shape: Shape, vocab: int, seed: int = 1) -> list[Session]:
    """Conversations that resend their whole history each turn, behind the tenant's system prompt."""
    rng = random.Random(seed)
    names = adapter_names(shape)
    systems = {name: _tokens(rng, shape.system_tokens, vocab) for name in names}
    return [
        Session(
            names[c % len(names)],
            systems[names[c % len(names)]],
            [_tokens(rng, shape.turn_tokens, vocab) for _ in range(shape.turns)],
            carry=True,
        )
        for c in range(shape.chats)
    ]


def unique_prompts(shape: Shape, vocab: int, seed: int = 2) -> list[Session]:
    """As many users and tokens as the system-prompt workload, but nothing shared."""
    rng = random.Random(seed)
    names = adapter_names(shape)
    n = shape.system_tokens + shape.question_tokens
    return [
        Session(names[u % len(names)], [], [_tokens(rng, n, vocab) for _ in range(shape.rounds)])
        for u in range(shape.users)
    ]


def with_think_time(sessions: list[Session], mean_s: float, seed: int = 7) -> list[Session]:
    """Users who think: each joins at a uniform moment of the first ``mean_s`` seconds and
    waits an exponential time of mean ``mean_s`` before each later request. Drawn from
    ``seed`` alone, so the cache-off and cache-on runs see the same users.

    Without thinking (``mean_s`` 0) every user sends its next request the instant its
    answer ends; users whose answers end in the same step then stay in lockstep, and a
    request's time to first token is that of the whole wave's prefill rather than its own.
    """
    if mean_s <= 0:
        return sessions
    rng = random.Random(seed)
    for s in sessions:
        s.waits = [rng.uniform(0.0, mean_s), *(rng.expovariate(1.0 / mean_s) for _ in s.parts[1:])]
    return sessions


WORKLOADS = {"system-prompts": system_prompts, "chat-replay": chat_replay, "no-shared-prefix": unique_prompts}
