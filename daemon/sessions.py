"""Worker sessions: who a worker is, what it owns, and whether it lives (its recent replies are
in ``daemon/replies.py``).

A session starts with ``hello`` and is named by a random session id the worker sends with every
request, not by its ZeroMQ connection: a client that reopens its socket (Lazy Pirate) keeps its
session, and a dropped connection says nothing about the process behind it. A session ends by
``goodbye``, by an admin ``evict_session``, or by reaping when its process is gone (exited,
killed, or its pid now belongs to another process) or stopped past its lease.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import psutil
from vqpool.shared.allocator import Owner
from vqpool.shared.errors import UnauthorizedError

log = logging.getLogger("vqpoold")

_GONE = frozenset({psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD})
_STOPPED = frozenset({psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP})


@dataclass(eq=False, slots=True)
class Session:
    """One worker process's session.

    Attributes:
        sid: Random session id, carried by every request after hello.
        pid: The worker's process id, verified at hello.
        process: The psutil handle, which remembers the process start time so that a recycled
            pid is not taken for the worker.
        model: Model name the worker announced (for the admin's eyes).
        bytes_per_block: Bytes one block of each stream holds in the worker.
        client_version: vqpool version of the worker.
        nonce: The hello nonce (a repeated hello with it returns this session).
        started: Wall-clock time the session opened.
        last_heard: Monotonic time of the last request (heartbeats included).
        owners: Owner ids this session holds (registered or holding blocks).
        n_requests: Requests served.
        running: Requests the worker said it runs, in its last ``ping`` that said (None: never).
        queued: Requests the worker said it queues, likewise.
    """

    sid: int
    pid: int
    process: psutil.Process
    model: str
    bytes_per_block: dict[str, int]
    client_version: str
    nonce: str
    started: float
    last_heard: float
    owners: set[Owner] = field(default_factory=set)
    n_requests: int = 0
    running: int | None = None
    queued: int | None = None

    def reap_reason(self, now: float, lease: float) -> str | None:
        """Why this session should be reaped now, or None while its worker lives.

        A running process is never reaped, however long it has been silent: a heartbeat thread
        starved by a long native call must not cost the worker its blocks (another worker would
        be handed ids whose memory the first still uses). A stopped process is reaped once its
        lease has run out.
        """
        try:
            if not self.process.is_running():
                return "process exited (its pid belongs to another process now)"
            status = self.process.status()
        except psutil.NoSuchProcess:
            return "process exited"
        except psutil.AccessDenied:
            return None
        if status in _GONE:
            return "process exited"
        if status in _STOPPED and now - self.last_heard > lease:
            return f"process stopped and silent for {now - self.last_heard:.1f}s (lease {lease:g}s)"
        return None

    def process_status(self) -> str:
        """The worker process's state as psutil names it ("running", "sleeping", "stopped"...)."""
        try:
            return str(self.process.status()) if self.process.is_running() else "exited"
        except psutil.Error:
            return "exited"


def verify_worker_process(pid: int) -> psutil.Process:
    """The live process ``pid`` names, if it is a process of this daemon's user.

    Raises:
        ValueError: No such process (or it has exited).
        UnauthorizedError: The process belongs to another user.
    """
    try:
        process = psutil.Process(pid)
        status = process.status()
        uid = process.uids().real
    except psutil.NoSuchProcess:
        raise ValueError(f"hello: pid {pid} is not a running process") from None
    except psutil.AccessDenied:
        raise UnauthorizedError(f"hello: cannot inspect pid {pid}") from None
    if status in _GONE:
        raise ValueError(f"hello: pid {pid} has exited")
    if uid != os.getuid():
        raise UnauthorizedError(f"hello: pid {pid} runs as uid {uid}, not this daemon's user")
    return process


class SessionTable:
    """The live sessions, by session id and by hello nonce."""

    def __init__(self) -> None:
        self._by_sid: dict[int, Session] = {}
        self._by_nonce: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._by_sid)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._by_sid.values()))

    def get(self, sid: int | None) -> Session | None:
        """The session ``sid`` names, or None."""
        return self._by_sid.get(sid)  # type: ignore[arg-type]

    def by_nonce(self, nonce: str) -> Session | None:
        """The session a hello with ``nonce`` opened, or None."""
        return self._by_nonce.get(nonce)

    def open(
        self,
        process: psutil.Process,
        model: str,
        bytes_per_block: dict[str, int],
        client_version: str,
        nonce: str,
        now: float,
    ) -> Session:
        """A new session for a verified worker process."""
        sid = secrets.randbits(62)
        while sid in self._by_sid:
            sid = secrets.randbits(62)
        session = Session(
            sid=sid,
            pid=process.pid,
            process=process,
            model=model,
            bytes_per_block=bytes_per_block,
            client_version=client_version,
            nonce=nonce,
            started=time.time(),
            last_heard=now,
        )
        self._by_sid[sid] = session
        self._by_nonce[nonce] = session
        return session

    def close(self, session: Session) -> None:
        """Forget ``session`` (its owners must have been released already)."""
        self._by_sid.pop(session.sid, None)
        self._by_nonce.pop(session.nonce, None)
