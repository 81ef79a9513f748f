"""The client's heartbeat: a thread that pings the daemon on a socket of its own every
``heartbeat`` seconds, so the lease stays fresh while the caller's thread is busy (a long
prefill) without sharing its socket.

Each ping carries the worker's last reported load and prompt-cache counters, and a sample of its
process's memory taken at most once per heartbeat interval (:class:`LoadReport`); a new report
wakes the thread early. The answer may carry advice for the worker's prompt cache.
When a reply comes from a new daemon lifetime, the heartbeat has the client re-sync right away
(under the client's lock), so an idle worker re-declares its blocks inside the restarted
daemon's claim period; when the session is gone (evicted), it has the client open a new one the
same way; when allocations given up on wait to be settled, it has them settled. It calls the
client through :class:`HeartbeatHost`.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from vqpool.shared.errors import DaemonUnavailableError, ErrorCode
from vqpool.shared.protocol import encode_request
from vqpool.shared.transport import LazyPirateConnection
from vqpool.worker.pool.session import DaemonSession, Session

log = logging.getLogger("vqpool.worker")

LOAD_REPORT_GAP = 0.1
"""Seconds the heartbeat waits after a load change before sending it: changes in between go in
the same ping, so a busy worker sends at most ~10 extra pings a second."""


class LoadReport:
    """What the heartbeat tells the daemon about the worker, as last reported."""

    def __init__(self) -> None:
        self.load: tuple[int, int, int | None] | None = None
        """(running, queued, preemptions or None) as last given to report_load()."""
        self.preemptions_base = 0
        """The preemption count the daemon had been sent when the current session opened: it
        counts per session, so a new session (re-sync, reopen) is sent the count since then."""
        self._preemptions_sent = 0
        """The running count of preemptions the last ping carried (absolute, not per session)."""
        self.prompt_cache: dict[str, int] | None = None
        """The prompt cache's counters as last given to report_prompt_cache(); sent until a
        daemon older than the argument refuses it."""
        self.prompt_cache_refused = False
        self.memory_probe: Callable[[], dict[str, int]] | None = None
        """Samples the process's memory (the ``memory`` map); None: the worker reports none."""
        self.memory_interval = 0.0
        """Seconds a memory sample is sent again before a new one is taken (the heartbeat's
        interval: pings woken early by load changes reuse the last sample)."""
        self.memory_refused = False
        self._memory: dict[str, int] | None = None
        self._memory_taken = 0.0

    def session_opened(self) -> None:
        """A new session opened: its preemptions count from the ones the daemon was last sent.
        NOTE: not from the count reported now: preemptions reported while the session was
        being reopened were never sent, and would be folded into the base and lost."""
        self.preemptions_base = self._preemptions_sent

    def ping_args(self) -> dict[str, Any]:
        """The arguments of the next ping."""
        load = self.load
        args: dict[str, Any] = {}
        if load is not None:
            args = {"running": load[0], "queued": load[1]}
            if load[2] is not None:
                args["preemptions"] = max(0, load[2] - self.preemptions_base)
                self._preemptions_sent = max(load[2], self.preemptions_base)
        cached = self.prompt_cache
        if cached is not None and not self.prompt_cache_refused:
            args["prompt_cache"] = cached
        probe = self.memory_probe
        if probe is not None and not self.memory_refused:
            now = time.monotonic()
            if self._memory is None or now - self._memory_taken >= self.memory_interval:
                self._memory, self._memory_taken = probe(), now
            args["memory"] = self._memory
        return args

    def refuse_unknown(self, message: str) -> bool:
        """Stop sending the optional arguments a daemon older than them names as unknown in
        ``message``; whether it named any."""
        if "unknown argument" not in message:
            return False
        named = False
        if "'prompt_cache'" in message:
            self.prompt_cache_refused = named = True
        if "'memory'" in message:
            self.memory_refused = named = True
        return named


def listening(endpoint: str) -> bool | None:
    """Whether a process listens on the ``ipc://`` socket ``endpoint``: False when its file is
    gone or the connection is refused (no process holds it: a daemon that exited or was
    killed), True when it connects (a live daemon, maybe stopped or busy), None if unknown.
    Never blocks."""
    path = endpoint.removeprefix("ipc://")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.setblocking(False)
        error = probe.connect_ex(path)
    except OSError:
        return None
    finally:
        probe.close()
    if error in (errno.ENOENT, errno.ECONNREFUSED):
        return False
    return True if error in (0, errno.EAGAIN, errno.EINPROGRESS) else None


class HeartbeatHost(Protocol):
    """What the heartbeat asks of its client's calls."""

    def resync_due(self) -> bool:
        """Whether a re-sync was cut short (claims left to send)."""

    def settle_due(self) -> bool:
        """Whether allocations given up on wait to be settled."""

    def resync_from_heartbeat(self, seen_boot: object) -> None: ...

    def reopen_from_heartbeat(self, seen: Session) -> None: ...

    def settle_from_heartbeat(self) -> None: ...


class Heartbeat(threading.Thread):
    """Pings the daemon for ``host`` every ``session.heartbeat`` seconds until stopped (see
    the module docstring)."""

    def __init__(self, session: DaemonSession, report: LoadReport, host: HeartbeatHost) -> None:
        super().__init__(name=f"vqpool-heartbeat-{session.session_id}", daemon=True)
        self._session = session
        self._report = report
        self._host = host
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self.daemon_silent = False
        """Set when a ping goes unanswered, cleared by the next answered one."""
        self.daemon_listening: bool | None = None
        """While silent: whether a process listens on the daemon's socket (False: none does,
        vqpoold is not running; None: unknown)."""
        self.on_advice: Callable[[dict[str, Any]], None] | None = None
        """Called (on this thread, no lock held) with what the daemon's answer to a load
        report asks of this worker: ``{drop_cache: true}`` or ``{release_bytes: n}``."""

    def wake(self) -> None:
        """Ping soon (after LOAD_REPORT_GAP) instead of at the next interval."""
        self._wake.set()

    def _advise(self, advice: dict[str, Any]) -> None:
        handler = self.on_advice
        if handler is None:
            return
        try:
            handler(advice)
        except Exception:  # the heartbeat must go on whatever the handler does
            log.exception("following the daemon's advice %r failed", advice)

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self.is_alive():
            self.join()

    def run(self) -> None:
        session = self._session
        connection = LazyPirateConnection(
            session.context, session.endpoint, first_retry=min(0.5, session.heartbeat)
        )
        try:
            while True:
                if self._wake.wait(session.heartbeat):
                    self._stopping.wait(LOAD_REPORT_GAP)  # gather what else changes meanwhile
                if self._stopping.is_set():
                    return
                self._wake.clear()
                current = session.current
                rid = session.next_id()
                payload = encode_request(rid, "ping", self._report.ping_args(), *current)
                try:
                    reply = connection.request(payload, rid, session.heartbeat, "heartbeat")
                except DaemonUnavailableError:
                    self.daemon_listening = listening(session.endpoint)
                    self.daemon_silent = True  # /health says so (session_problem)
                    continue  # keep trying: a busy or restarting daemon may answer the next one
                self.daemon_silent = False
                self.daemon_listening = None
                self._answered(current, reply)
        finally:
            connection.close()

    def _answered(self, sent_in: Session, reply: Mapping[str, Any]) -> None:
        host = self._host
        if reply.get("boot") != sent_in[1] or host.resync_due():
            try:
                host.resync_from_heartbeat(reply.get("boot"))
            except ValueError as exc:
                # The new daemon refused this session (e.g. a budget now wants bytes per
                # block): callers get the refusal; keep beating for the next try.
                log.error("re-sync with the restarted vqpoold refused: %s", exc)
        elif not reply["ok"] and reply["error"]["code"] == ErrorCode.NO_SESSION:
            host.reopen_from_heartbeat(sent_in)  # evicted while alive
        elif not reply["ok"] and self._report.refuse_unknown(reply["error"]["message"]):
            self._wake.set()  # a daemon older than an argument: send the rest alone at once
        else:
            if reply["ok"] and isinstance(reply.get("result"), dict):
                self._advise(reply["result"])
            if host.settle_due():
                host.settle_from_heartbeat()  # the daemon answers again
