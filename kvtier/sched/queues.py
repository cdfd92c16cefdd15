"""Waiting-queue policies: the order in which waiting requests are admitted.

Contract: `ordered()` lists waiting requests, most deserving first; `remove` takes one out;
`push_front` is for preempted requests, which should resume before newcomers of equal rank.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Protocol

from kvtier.sched.request import Request


class WaitingQueue(Protocol):
    def push(self, req: Request) -> None: ...
    def push_front(self, req: Request) -> None: ...
    def remove(self, req: Request) -> None: ...
    def ordered(self) -> list[Request]: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue:
    """First come, first served; a preempted request goes back to the head."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def push(self, req: Request) -> None:
        self._q.append(req)

    def push_front(self, req: Request) -> None:
        self._q.appendleft(req)

    def remove(self, req: Request) -> None:
        self._q.remove(req)

    def ordered(self) -> list[Request]:
        return list(self._q)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue:
    """Lower `priority` value first, then earlier arrival. Aging prevents starvation: every
    `aging_steps` steps spent waiting raise a request's effective priority by one level."""

    def __init__(self, aging_steps: int = 64) -> None:
        if aging_steps < 1:
            raise ValueError("aging_steps must be >= 1")
        self.aging_steps = aging_steps
        self._items: list[Request] = []

    def _key(self, req: Request) -> tuple[int, int]:
        return (req.priority - req.waited_steps // self.aging_steps, req.arrival_seq)

    def push(self, req: Request) -> None:
        self._items.append(req)

    push_front = push  # the key already puts an earlier arrival first

    def remove(self, req: Request) -> None:
        self._items.remove(req)

    def ordered(self) -> list[Request]:
        self._items.sort(key=self._key)
        return list(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)


def make_queue(policy: str, aging_steps: int = 64) -> WaitingQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue(aging_steps)
    raise ValueError(f"unknown scheduling policy {policy!r}; choose 'fcfs' or 'priority'")
