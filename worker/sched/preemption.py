"""Preemption for the scheduler: which request gives way, where it waits, and reclaim asks.

When the pool refuses a growth step, or the daemon asks this worker to give bytes back (a
reclaim), the generation thread preempts requests at a step boundary instead of ending them
(vLLM's recompute preemption): the request's row leaves the batch (its blocks go back at once),
its prompt and generated token ids are kept, and it waits at the head of the queue. On resume
its KV is recomputed by prefilling prompt + generated tokens but the last, which becomes the
next input (as mlx-lm continues a sequence), so its next tokens are those it would have made.

* **The victim** is the most recently admitted started request (:func:`most_recently_admitted`;
  a request keeps its first admission's rank when it resumes, so a resumed request does not
  become everybody's victim).
* **Where it waits**: the head of the queue (:func:`requeue_position`), except behind an
  admission parked at the daemon: the daemon serves a model's allocations in order, so that
  one is granted first anyway, and jumping it would leave its grant unclaimed.
* **No churn**: after a preemption the scheduler starts nothing until one of its running
  requests ends or none runs (:class:`AdmissionHold`): a request that just gave way would else
  be restarted at once, prefilled, and preempted again.
* **Reclaim asks** (:class:`ReclaimDesk`): the reclaim listener's thread hands the bytes
  wanted to the generation thread and waits until its next step boundary has preempted
  enough (or the deadline passed).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any


def most_recently_admitted(jobs: Iterable[Any]) -> Any:
    """The job with the highest ``admission`` rank (the newest first admission)."""
    return max(jobs, key=lambda job: job.admission)


def requeue_position(waiting: Sequence[Any]) -> int:
    """Where a preempted job goes in the waiting queue: the head, or just behind a head whose
    admission is parked at the daemon (see the module docstring)."""
    return 1 if waiting and waiting[0].parked else 0


class AdmissionHold:
    """After a preemption, no job starts until fewer than ``running`` jobs run (one ended) or
    none runs. Generation-thread only."""

    def __init__(self) -> None:
        self._running: int | None = None

    def hold(self, running: int) -> None:
        """A job was preempted; ``running`` jobs run now."""
        self._running = running if self._running is None else min(self._running, running)

    def allows(self, running: int) -> bool:
        """Whether a job may start with ``running`` jobs running."""
        if self._running is not None and (running == 0 or running < self._running):
            self._running = None
        return self._running is None


@dataclass(eq=False)
class ReclaimAsk:
    """Bytes the daemon asked back, for the generation thread to free by ``deadline``."""

    n_bytes: int
    deadline: float
    freed: int = 0
    done: threading.Event = field(default_factory=threading.Event)


class ReclaimDesk:
    """Reclaim asks on their way from the listener's thread to the generation thread.

    Args:
        wake: Called after an ask is filed, to wake the generation thread if it sleeps.
    """

    def __init__(self, wake: Any) -> None:
        self._wake = wake
        self._lock = threading.Lock()
        self._asks: list[ReclaimAsk] = []

    def ask(self, n_bytes: int, deadline: float) -> int:
        """File an ask and wait until the generation thread answered it or ``deadline``
        passed; returns the bytes it freed so far (the reclaim handler's body)."""
        ask = ReclaimAsk(n_bytes, deadline)
        with self._lock:
            self._asks.append(ask)
        self._wake()
        ask.done.wait(max(0.0, deadline - time.monotonic()))
        with self._lock:
            if ask in self._asks:  # late: the generation thread has not reached it
                self._asks.remove(ask)
        return ask.freed

    def take(self) -> list[ReclaimAsk]:
        """The asks filed since the last call (generation thread)."""
        with self._lock:
            asks, self._asks = self._asks, []
        return asks

    def pending(self) -> bool:
        with self._lock:
            return bool(self._asks)
