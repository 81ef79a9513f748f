"""Admission that waits at the daemon: one helper thread parks the queue head's allocation.

With a budget, the daemon decides who gets freed memory (its fair queue: reserves first, then
weighted max-min between models, first come first served within one), so a worker whose head
of queue cannot start asks once with ``wait`` instead of retrying every few milliseconds. That
call may block for up to its wait, and the generation thread must keep decoding the running
jobs meanwhile: :class:`AdmissionWaiter` makes the call on its own thread, one job at a time
(FIFO is kept: only the queue head is ever parked), and the generation thread polls
:meth:`AdmissionWaiter.outcome` each round and adopts the granted blocks itself (the storage
is the generation thread's).

A job that goes away while parked (cancelled, timed out, the worker stopping) is
:meth:`AdmissionWaiter.abandon`-ed: its call is cancelled at the daemon (the ``cancel`` op, sent
by the call's own thread within a slice of its wait), so the allocation leaves its model's queue
at once and neither holds up the model's later requests there nor keeps this waiter busy until
its wait runs out; blocks the daemon granted before the cancel are freed here as soon as the
reply comes, so nothing leaks; blocks granted before the abandon are recorded under the job's
owner and go back with the release of its cache.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vqpool.shared.errors import BlockPoolExhaustedError
from vqpool.worker.kv.cache_source import CacheSource

log = logging.getLogger("vqpool.worker")


@dataclass(frozen=True)
class Admission:
    """How a parked allocation ended: ``taken`` blocks (for ``CacheSource.adopt``), the wait
    ran out (``exhausted``), or ``error``."""

    taken: Any = None
    exhausted: bool = False
    error: Exception | None = None


@dataclass
class _Parked:
    job: object
    cache: list[Any]
    n_tokens: int
    wait: float
    outcome: Admission | None = None
    abandoned: bool = False
    sent: bool = False
    cancel: threading.Event = field(default_factory=threading.Event)


class AdmissionWaiter:
    """Parks one allocation at a time at the daemon, off the generation thread.

    Args:
        source: The cache source (its ``take`` may wait; ``free_taken`` gives blocks back).
        wake: Called when an outcome is ready (wakes the generation thread).
    """

    def __init__(self, source: CacheSource, wake: Callable[[], None]) -> None:
        self._source = source
        self._wake = wake
        self._cond = threading.Condition()
        self._parked: _Parked | None = None  # guarded by _cond
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="vqpool-admission", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """Whether a job is parked (or its abandoned call has not returned yet)."""
        with self._cond:
            return self._parked is not None

    def park(self, job: object, cache: list[Any], n_tokens: int, wait: float) -> None:
        """Ask for ``n_tokens`` slots of ``job``'s ``cache``, waiting up to ``wait`` seconds."""
        with self._cond:
            if self._parked is not None:
                raise RuntimeError("AdmissionWaiter: a job is parked already")
            self._parked = _Parked(job, cache, n_tokens, wait)
            self._cond.notify()

    def outcome(self, job: object) -> Admission | None:
        """``job``'s outcome once its call returned (then the waiter is free), else None."""
        with self._cond:
            parked = self._parked
            if parked is None or parked.job is not job or parked.outcome is None:
                return None
            self._parked = None
            return parked.outcome

    def abandon(self, job: object) -> None:
        """``job`` went away: its call is cancelled at the daemon (or never sent), and blocks
        it returns from now on are freed, not handed over.

        Blocks granted already are the job owner's and go with the release of its cache.
        """
        with self._cond:
            parked = self._parked
            if parked is None or parked.job is not job:
                return
            if parked.outcome is not None:
                self._parked = None
            else:
                parked.abandoned = True
                parked.cancel.set()  # the call's own thread sends the cancel

    def stop(self) -> None:
        """End the thread after its current call (a parked call ends when the pool closes)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and (self._parked is None or self._parked.sent):
                    self._cond.wait()
                if self._stopping:
                    return
                parked = self._parked
                assert parked is not None
                parked.sent = True
            try:
                outcome = Admission(
                    self._source.take(parked.cache, parked.n_tokens, parked.wait, parked.cancel)
                )
            except BlockPoolExhaustedError:
                outcome = Admission(exhausted=True)
            except Exception as exc:
                outcome = Admission(error=exc)
            with self._cond:
                if parked.abandoned:
                    self._parked = None
                    unwanted = outcome.taken
                else:
                    parked.outcome = outcome
                    unwanted = None
            if unwanted is not None:
                try:
                    self._source.free_taken(unwanted)
                except Exception as exc:  # the session is gone: the daemon freed them
                    log.info("freeing blocks of a request that went away: %s", exc)
            self._wake()
