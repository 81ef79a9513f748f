"""Worker sessions: who a worker is, what it owns, and whether it lives (its recent replies are
in ``daemon/core/replies.py``).

A session starts with ``hello`` and is named by a random session id the worker sends with every
request, not by its ZeroMQ connection: a client that reopens its socket (Lazy Pirate) keeps its
session, and a dropped connection says nothing about the process behind it. A session ends by
``goodbye``, by an admin ``evict_session``, or by reaping when its process is gone (exited,
killed, or its pid now belongs to another process) or stopped past its lease.

Sessions are grouped by process: liveness is one check per process per tick however many
sessions it holds, and a process may hold at most ``MAX_SESSIONS_PER_PROCESS`` of them (the
daemon at most ``MAX_SESSIONS``), so a client that says hello in a loop cannot make every tick
or every admin view cost more without bound.
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
from vqpool.shared.errors import TooManySessionsError, UnauthorizedError
from vqpool.shared.kv_sequence import SequenceQuantization

log = logging.getLogger("vqpoold")

MAX_SESSIONS_PER_PROCESS = 32
"""Sessions one process may hold: one per PoolClient, i.e. per model it serves."""

MAX_SESSIONS = 512
"""Sessions the daemon holds at once, all processes together."""

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
        bytes_per_format: Bytes one block of each stream holds in the worker, per format tag
            the worker declared (a block of another format costs ``bytes_per_block``).
        quantization: How the worker holds a sequence's blocks when it declared a quantized
            format (its ``--quantized-kv-start`` and first-pass slots, from hello): what
            ``fit`` prices a sequence with; None: full precision.
        client_version: vqpool version of the worker.
        nonce: The hello nonce (a repeated hello with it returns this session).
        started: Wall-clock time the session opened.
        last_heard: Monotonic time of the last request (heartbeats included).
        owners: Owner ids this session holds (registered or holding blocks).
        n_requests: Requests served.
        running: Requests the worker said it runs, in its last ``ping`` that said (None: never).
        queued: Requests the worker said it queues, likewise.
        prompt_cache: What the worker's prompt cache holds and did, in its last ``ping`` that
            said (bytes, blocks, entries, lookups, hits, tokens_reused, tokens_prefilled,
            evictions; None: never). Its blocks are among the session's blocks.
        memory: What the worker's process holds in bytes, in its last ``ping`` that said
            (weights, mlx_active, mlx_cache, mlx_peak, rss; None: never).
        overhead: Bytes the worker declared at hello that it may hold beyond its weights and
            KV blocks (its MLX buffer-cache limit): charged with its weights (0: none declared).
        drop_cache: ``cache_drop`` asked this worker to drop its prompt cache: said in the
            answer to its next ping, then cleared; ``drop_disk``: its disk tier too.
        release_cache: Bytes of its prompt cache a load asked back (``load_reserve``): said in
            the answer to its next ping, then cleared.
        cache_used_at: Monotonic time its prompt cache was last looked up (its reported
            lookups grew; 0: never): the order caches are asked back in.
        resumes: The session id this client held under the previous daemon lifetime, named in
            its hello after a restart (the claim period waits for every such session).
        on_roll: Whether the roll of workers (``daemon/core/claims.py``) lists this session yet.
        reclaimable: Whether it polls for reclaim asks (``daemon/budget/reclaim_service.py``): only
            such sessions are ever asked to give bytes back.
        preemptions: The worker's last reported running count of preemptions.
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
    prompt_cache: dict[str, int] | None = None
    memory: dict[str, int] | None = None
    overhead: int = 0
    drop_cache: bool = False
    drop_disk: bool = False
    release_cache: int = 0
    cache_used_at: float = 0.0
    resumes: int | None = None
    on_roll: bool = False
    reclaimable: bool = False
    preemptions: int = 0
    bytes_per_format: dict[str, dict[str, int]] = field(default_factory=dict)
    quantization: SequenceQuantization | None = None

    def block_bytes(self, stream: str, fmt: str) -> int:
        """Bytes one block of ``stream`` in format ``fmt`` holds in the worker: its format's
        declared bytes, else ``bytes_per_block`` (0 when neither declares the stream)."""
        cost = self.bytes_per_format.get(fmt)
        if cost is None:
            cost = self.bytes_per_block
        return cost.get(stream, 0)

    def lease_expired(self, now: float, lease: float) -> str | None:
        """Why this session of a stopped process is reaped now, or None within its lease."""
        if now - self.last_heard > lease:
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


@dataclass(eq=False, slots=True)
class ProcessSessions:
    """One worker process and its sessions, by session id."""

    process: psutil.Process
    sessions: dict[int, Session] = field(default_factory=dict)

    def reap_reasons(self, now: float, lease: float) -> list[tuple[Session, str]]:
        """The sessions to reap now, each with why: all of them once the process is gone.

        A running process is never reaped, however long it has been silent: a heartbeat thread
        starved by a long native call must not cost the worker its blocks (another worker would
        be handed ids whose memory the first still uses). A stopped process's sessions are
        reaped once their lease has run out. One look at the process, whatever its sessions.
        """
        process = self.process
        status = ""
        try:
            if not process.is_running():
                gone = "process exited (its pid belongs to another process now)"
            else:
                status = process.status()
                gone = "process exited" if status in _GONE else ""
        except psutil.NoSuchProcess:
            gone = "process exited"
        except psutil.AccessDenied:
            return []
        if gone:
            return [(session, gone) for session in self.sessions.values()]
        if status not in _STOPPED:
            return []
        expired = ((s, s.lease_expired(now, lease)) for s in self.sessions.values())
        return [(session, reason) for session, reason in expired if reason is not None]


class SessionTable:
    """The live sessions, by session id, by hello nonce and by process."""

    def __init__(self) -> None:
        self._by_sid: dict[int, Session] = {}
        self._by_nonce: dict[str, Session] = {}
        # psutil.Process hashes and compares by (pid, start time): a recycled pid is another key.
        self._by_process: dict[psutil.Process, ProcessSessions] = {}

    def __len__(self) -> int:
        return len(self._by_sid)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._by_sid.values()))

    def processes(self) -> list[ProcessSessions]:
        """Every process with a session, with its sessions."""
        return list(self._by_process.values())

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
        bytes_per_format: dict[str, dict[str, int]] | None = None,
        quantization: SequenceQuantization | None = None,
    ) -> Session:
        """A new session for a verified worker process.

        Raises:
            TooManySessionsError: The process holds MAX_SESSIONS_PER_PROCESS sessions, or the
                daemon MAX_SESSIONS; nothing was opened.
        """
        group = self._by_process.get(process)
        if group is not None and len(group.sessions) >= MAX_SESSIONS_PER_PROCESS:
            raise TooManySessionsError(
                f"hello: process {process.pid} already holds {MAX_SESSIONS_PER_PROCESS} sessions, "
                "the most one process may; close a PoolClient it no longer uses (goodbye) first"
            )
        if len(self._by_sid) >= MAX_SESSIONS:
            raise TooManySessionsError(
                f"hello: vqpoold already holds {MAX_SESSIONS} sessions, the most it serves at "
                "once; no session was opened"
            )
        if group is None:
            group = self._by_process[process] = ProcessSessions(process)
        sid = secrets.randbits(62)
        while sid in self._by_sid:
            sid = secrets.randbits(62)
        session = Session(
            sid=sid,
            pid=process.pid,
            process=group.process,
            model=model,
            bytes_per_block=bytes_per_block,
            client_version=client_version,
            nonce=nonce,
            started=time.time(),
            last_heard=now,
            bytes_per_format=bytes_per_format or {},
            quantization=quantization,
        )
        self._by_sid[sid] = session
        self._by_nonce[nonce] = session
        group.sessions[sid] = session
        return session

    def close(self, session: Session) -> None:
        """Forget ``session`` (its owners must have been released already)."""
        self._by_sid.pop(session.sid, None)
        self._by_nonce.pop(session.nonce, None)
        group = self._by_process.get(session.process)
        if group is not None:
            group.sessions.pop(session.sid, None)
            if not group.sessions:
                del self._by_process[session.process]
