"""The background thread that writes evicted prompt-cache entries to disk, off the generation
thread, through a bounded queue that never blocks.

:meth:`DiskWriter.submit` queues an entry's token ids and arrays (evaluated MLX arrays: the
writer only reads their bytes) and returns at once; the thread writes them with
:meth:`DiskStore.put`. When ``max_pending`` writes wait already, the **oldest** pending write
is dropped and counted (``dropped``): a slow disk loses old entries, it never delays a token
nor holds more memory than the queue bounds (a pending entry's arrays stay alive until
written; their pool blocks went back when it was evicted). :meth:`flush` waits until the queue
is empty (a worker stopping writes what it has).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import mlx.core as mx
from vqpool.worker.kv.disk_store import DiskStore

log = logging.getLogger("vqpool.worker")

DEFAULT_MAX_PENDING = 4
"""Entries waiting to be written at most, by default."""


@dataclass
class _PendingWrite:
    tokens: tuple[int, ...]
    arrays: Mapping[str, mx.array]
    nbytes: int


class DiskWriter:
    """Writes entries to ``store`` on a thread of its own (see the module docstring).

    Args:
        store: Where entries go.
        max_pending: Writes queued at most; a new one beyond drops the oldest.
        before_write: Tests: called on the writer thread before each write (a test blocks it
            on an event to make the disk "slow").
    """

    def __init__(
        self,
        store: DiskStore,
        max_pending: int = DEFAULT_MAX_PENDING,
        before_write: Callable[[], None] | None = None,
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"DiskWriter: max_pending must be >= 1, got {max_pending}")
        self.store = store
        self.max_pending = max_pending
        self.before_write = before_write
        self._cond = threading.Condition()
        self._pending: deque[_PendingWrite] = deque()
        self._busy = False
        self._closing = False
        self.dropped = 0
        self.failed = 0
        self._thread = threading.Thread(target=self._run, name="vqpool-kv-disk-writer", daemon=True)
        self._thread.start()

    def submit(self, tokens: Sequence[int], arrays: Mapping[str, mx.array], nbytes: int) -> None:
        """Queue a write; never blocks (a full queue drops its oldest write, counted)."""
        with self._cond:
            if self._closing:
                return
            if len(self._pending) >= self.max_pending:
                self._pending.popleft()
                self.dropped += 1
            self._pending.append(_PendingWrite(tuple(tokens), arrays, nbytes))
            self._cond.notify_all()

    @property
    def n_pending(self) -> int:
        with self._cond:
            return len(self._pending)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if not self._pending:
                    return
                self._busy = True
            if self.before_write is not None:
                self.before_write()
            with self._cond:
                # The hook may have let the queue change (drops): take the oldest left.
                write = self._pending.popleft() if self._pending else None
            try:
                if write is not None:
                    self.store.put(write.tokens, write.arrays, write.nbytes)
            except Exception as exc:  # a full or failing disk loses the entry, nothing else
                self.failed += 1
                log.warning("prompt cache on disk: a write failed: %s", exc)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done; False if ``timeout`` seconds passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._busy, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Write what is queued (up to ``timeout`` seconds), then end the thread."""
        self.flush(timeout)
        with self._cond:
            self._closing = True
            self._pending.clear()
            self._cond.notify_all()
        self._thread.join(timeout)
