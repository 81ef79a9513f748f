"""Preemption for the scheduler: every decision of who gives way and when, where it waits, and
reclaim asks.

When the pool refuses a growth step, or the daemon asks this worker to give bytes back (a
reclaim), the generation thread preempts requests at a step boundary instead of ending them
(vLLM's recompute preemption): the request's row leaves the batch (its blocks go back at once),
its prompt and generated token ids are kept, and it waits at the head of the queue. On resume
its KV is recomputed by prefilling prompt + generated tokens but the last, which becomes the
next input (as mlx-lm continues a sequence), so its next tokens are those it would have made.

The decisions are :class:`PreemptionPolicy`'s, which the continuous batch and the scheduler
ask; they carry them out:

* **The victim** of a refused growth is the cheapest started request to give way
  (:meth:`PreemptionPolicy.growth_victim`, :func:`victim_order`): the fewest tokens to
  recompute on resume (``recompute_cost``: a request still in its prefill loses only what it
  prefilled, a row in the batch what the prompt cache will not give back), then the furthest
  from finishing (its ``max_tokens``), then the most recently admitted. A request within
  :data:`NEAR_FINISH_STEPS` steps of its ``max_tokens`` gives way only when every candidate is,
  and so does one resumed less than a block of tokens ago (no ping-pong: it paid a recompute
  already). With no other started request to give way, the one refused is taken out of the
  batch; it is preempted if it could fit alone (another model or a reclaim took the room) and
  ends only if it never can (:meth:`PreemptionPolicy.preempts_alone`).
* **A reclaim ask** preempts running requests in the same order until its bytes are freed
  (:meth:`PreemptionPolicy.reclaim_victim`), after the prompt cache gave what it could.
* **Where it waits**: the head of the queue (:meth:`PreemptionPolicy.requeue_position`),
  except behind an admission parked at the daemon: the daemon serves a model's allocations in
  order, so that one is granted first anyway, and jumping it would leave its grant unclaimed.
* **No churn (no ping-pong)**: a preemption (a refused growth or a reclaim ask: the pool, or
  the model's share of the budget, holds fewer rows than ran) sets a window: the scheduler runs
  at most as many requests as were left running (:meth:`PreemptionPolicy.admits`; at least
  one), and the window opens by one each time a request ends with no preemption since it last
  moved (:meth:`PreemptionPolicy.ended`). Without it the request that just gave way would be
  restarted as soon as one ended, prefilled, and preempted again: a model above its share
  whose growth was refused would be refilled at once to be refused again.
* **Reclaim asks** reach the generation thread through a :class:`ReclaimDesk`: the reclaim
  listener's thread hands the bytes wanted over and waits until the next step boundary has
  preempted enough (or the deadline passed).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

NEAR_FINISH_STEPS = 8
"""A request this few steps from its ``max_tokens`` is not preempted while another can be."""


def recompute_everything(job: Any) -> int:
    """The recompute cost of a job with no prompt cache: its prompt and generated tokens."""
    return len(job.prompt) + len(job.generated)


def victim_order(
    recompute_cost: Callable[[Any], int], block_size: int
) -> Callable[[Any], tuple[int, int, int, int]]:
    """The sort key of candidates to give way, the first the cheapest (module docstring).
    Jobs need ``prompt``, ``generated``, ``max_tokens``, ``admission``, ``preemptions`` and
    ``resumed_from`` (how many tokens it had generated at its last preemption)."""

    def key(job: Any) -> tuple[int, int, int, int]:
        steps_left = job.max_tokens - len(job.generated)
        just_resumed = job.preemptions > 0 and len(job.generated) - job.resumed_from < block_size
        protected = steps_left <= NEAR_FINISH_STEPS or just_resumed
        return (int(protected), recompute_cost(job), -steps_left, -job.admission)

    return key


class PreemptionPolicy:
    """Every preemption decision of one scheduler (see the module docstring). Jobs need what
    :func:`victim_order` reads and, queued, ``parked``. Generation-thread only.

    Args:
        fits_alone: Whether a job of that many token slots could fit the pool (or the
            model's share of the budget) with nothing else of this worker running.
        recompute_cost: Tokens a job would prefill again if it gave way now.
        block_size: Token slots per block (a job resumed less than a block ago is spared).
    """

    def __init__(
        self,
        fits_alone: Callable[[int], bool],
        recompute_cost: Callable[[Any], int] = recompute_everything,
        block_size: int = 16,
    ) -> None:
        self._fits_alone = fits_alone
        self._order = victim_order(recompute_cost, block_size)
        self._window: int | None = None  # most jobs running since the last preemption
        self._calm = False  # no preemption since the window last moved

    def growth_victim(self, started: Sequence[Any]) -> Any:
        """The pool refused to grow a started job: the job of ``started`` that gives way (the
        first in :func:`victim_order`), or None when fewer than two are started (the refused
        job is taken out: no other job could give way)."""
        if len(started) < 2:
            return None
        return min(started, key=self._order)

    def preempts_alone(self, n_slots: int) -> bool:
        """A job was taken out because the pool could not grow it while it was the only one
        started: whether it is preempted (it could fit alone, in ``n_slots`` token slots:
        another model or a reclaim took the room) rather than ended (it never can)."""
        return self._fits_alone(n_slots)

    def reclaim_victim(self, running: Sequence[Any], freed: int, wanted: int) -> Any:
        """For a reclaim ask of ``wanted`` bytes of which ``freed`` are given back so far: the
        running job to preempt next (the first in :func:`victim_order`), or None (enough is
        freed, or none runs)."""
        if not running or freed >= wanted:
            return None
        return min(running, key=self._order)

    def requeue_position(self, waiting: Sequence[Any]) -> int:
        """Where a preempted job goes in the waiting queue: the head, or just behind a head
        whose admission is parked at the daemon (see the module docstring)."""
        return 1 if waiting and waiting[0].parked else 0

    def preempted(self, running: int) -> None:
        """A job was preempted; ``running`` jobs run now: the window closes to that many."""
        self._window = running if self._window is None else min(self._window, running)
        self._calm = False

    def ended(self) -> None:
        """A running job ended (not preempted): the window opens by one if no preemption
        came since it last moved."""
        if self._window is None:
            return
        if self._calm:
            self._window += 1
        self._calm = True

    def admits(self, running: int) -> bool:
        """Whether a job may start with ``running`` jobs running (the window; one may always
        run)."""
        return self._window is None or running < max(1, self._window)


@dataclass(eq=False)
class GiveBackTask:
    """Bytes the daemon asked back (a reclaim ask), handed to the generation thread to free by
    ``deadline``; ``freed`` and ``done`` are its answer."""

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
        self._asks: list[GiveBackTask] = []

    def ask(self, n_bytes: int, deadline: float) -> int:
        """File an ask and wait until the generation thread answered it or ``deadline``
        passed; returns the bytes it freed so far (the reclaim handler's body)."""
        ask = GiveBackTask(n_bytes, deadline)
        with self._lock:
            self._asks.append(ask)
        self._wake()
        ask.done.wait(max(0.0, deadline - time.monotonic()))
        with self._lock:
            if ask in self._asks:  # late: the generation thread has not reached it
                self._asks.remove(ask)
        return ask.freed

    def take(self) -> list[GiveBackTask]:
        """The asks filed since the last call (generation thread)."""
        with self._lock:
            asks, self._asks = self._asks, []
        return asks

    def pending(self) -> bool:
        with self._lock:
            return bool(self._asks)
