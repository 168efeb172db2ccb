"""At most K replays in flight across the fleet: vLLM serves a replay on its publishing
thread, so many concurrent replays would stall the very engines being followed."""

from __future__ import annotations

from collections import deque
from typing import Protocol


class ReplayClient(Protocol):
    def grant_replay(self, now: float) -> None: ...


class ReplayLimiter:
    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("max_replays must be >= 1")
        self.limit = limit
        self.active: set[ReplayClient] = set()
        self.waiting: deque[ReplayClient] = deque()

    def acquire(self, client: ReplayClient) -> bool:
        """True if ``client`` may send now; otherwise it is queued and granted later."""
        if client in self.active:
            return True
        if len(self.active) < self.limit:
            self.active.add(client)
            return True
        if client not in self.waiting:
            self.waiting.append(client)
        return False

    def release(self, client: ReplayClient, now: float) -> None:
        """``client`` has no replay in flight (or gave its queued one up)."""
        self.active.discard(client)
        if client in self.waiting:
            self.waiting.remove(client)
        while self.waiting and len(self.active) < self.limit:
            nxt = self.waiting.popleft()
            self.active.add(nxt)
            nxt.grant_replay(now)

    def holds(self, client: ReplayClient) -> bool:
        return client in self.active
