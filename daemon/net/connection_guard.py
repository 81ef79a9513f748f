"""Keep vqpoold alive through connection floods: open-file headroom, and a bound on connections.

libzmq 4.3 accepts every pending connection on its I/O thread as fast as they come, before any
handshake or ZAP request, and its ipc listener aborts the whole process when ``accept()`` fails
with EMFILE (src/ipc_listener.cpp tolerates EAGAIN, EINTR, ECONNABORTED, EPROTO and ENFILE
only). About a thousand idle connections under the common soft limit of 1,024 files killed the
daemon. Refusing connections in the ZAP handler comes too late (the file is already taken), and
a listener cannot be paused: unbinding it closes every connection it accepted. So:

1. :func:`raise_open_file_limit` lifts the soft RLIMIT_NOFILE towards the hard limit at start.
2. :class:`ConnectionGuard` watches the sockets' accept and disconnect events (socket monitors)
   and keeps a running count of the process's open files (checked against the real one before
   acting, and on the liveness tick). When they near the limit it renames the
   socket file to a hidden name: ``connect()`` goes by path, so no new connection reaches the
   listener (clients get ENOENT and retry, as when the daemon is down), while the connections
   already made are served as before. Once enough have closed, the name comes back. (Taking
   away the file's write permission would not stop a daemon running as root.) The headroom left
   covers what the kernel has already queued (a small listen backlog), what is accepted while
   the guard reacts, and the daemon's own files. The admin socket closes last, so vqpoolctl
   still gets in while a flood fills the worker socket.
"""

from __future__ import annotations

import logging
import os
import resource
import struct
import sys
from pathlib import Path
from typing import Any, cast

import zmq

log = logging.getLogger("vqpoold")

WANTED_OPEN_FILES = 8192
"""The soft open-file limit asked for at start (less where the hard limit is lower). Higher would
only admit more connections than a daemon serving one machine's workers ever needs, each costing
libzmq buffers."""

LISTEN_BACKLOG = 16
"""Connections the kernel queues for each listener before libzmq accepts them; a client finding
it full retries. Small, because every queued one may still be accepted after the gate closes."""

OWN_FILES = 32
"""Files kept free for the daemon itself: process liveness reads, the workers roll, metrics
scrapes."""

REACTION_SLACK = 48
"""Connections libzmq may still accept between crossing a bound and the guard hiding the socket:
the loop must notice first, and libzmq's I/O thread accepts on while the loop waits for a CPU
(on 2 busy vCPUs it was 150 late, about one scheduler slice at flood rate). At least this, or a
quarter of the limit where that is more: a daemon serving one machine's workers needs far fewer
connections than the files it may open."""

ADMIN_ROOM = 16
"""Connections the admin socket still takes after the worker socket stops accepting, beyond
what a worker flood may overshoot by, so vqpoolctl gets in during a flood."""

REOPEN_GAP = 16
"""How far below its bound the count must fall before a socket accepts again (no flapping)."""

_FD_DIR = "/proc/self/fd" if sys.platform.startswith("linux") else "/dev/fd"
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
_EVENT_ID = struct.Struct("=H")  # first field of a monitor event's first frame


def hidden_path(path: Path) -> Path:
    """Where a socket file waits while its gate is closed."""
    return path.with_name(f".{path.name}.full")


def raise_open_file_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE towards WANTED_OPEN_FILES; (limit before, limit now).

    The hard limit caps it; a finite soft limit already that high is kept. macOS may report an
    unlimited hard (or even soft) limit yet refuse a soft one above ``kern.maxfilesperproc``: an
    unlimited soft limit is made finite (the guard needs the real number) and a refused value
    is halved until one is accepted.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    unlimited = resource.RLIM_INFINITY
    target = WANTED_OPEN_FILES if hard == unlimited else min(hard, WANTED_OPEN_FILES)
    while target > 0 and (soft == unlimited or target > soft):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return soft, target
        except (ValueError, OSError):
            target //= 2
    return soft, soft


def describe_limit_change(before: int, now: int) -> str:
    """How the start line tells what :func:`raise_open_file_limit` did ('' when nothing)."""
    if before == now:
        return ""
    return ", was unlimited" if before == resource.RLIM_INFINITY else f", raised from {before}"


def open_file_count(limit: int) -> int:
    """Files the process has open now (the listing's own descriptor excluded); ``limit`` when
    not even the listing can be opened."""
    try:
        return len(os.listdir(_FD_DIR)) - 1
    except OSError:  # EMFILE
        return limit


class _Gate:
    """One listening socket: its file, hidden while it must take no new connection."""

    def __init__(self, name: str, path: Path, bound: int, monitor: zmq.Socket[bytes]) -> None:
        self.name = name
        self.path = path
        self.bound = bound
        self.monitor = monitor
        self.closed = False


class ConnectionGuard:
    """Stops new connections to the daemon's sockets before its open files run out.

    Attributes:
        limit: The soft open-file limit the bounds derive from.
    """

    def __init__(self, context: zmq.Context[Any], limit: int) -> None:
        self.context = context
        self.limit = limit
        self._gates: list[_Gate] = []
        # Open files: the real count when last taken, plus accepts, minus disconnects since.
        # Listing them costs ~0.4 us per file, too slow to repeat on every event of a flood.
        self._in_use = 0

    def watch(self, sock: zmq.Socket[bytes], path: Path, name: str) -> None:
        """Guard the listener ``sock`` bound on ``path``; sockets watched later close later."""
        address = f"inproc://vqpoold-monitor-{name}"
        sock.monitor(address, _EVENTS)
        monitor: zmq.Socket[bytes] = self.context.socket(zmq.PAIR)
        # Unbounded: libzmq's I/O thread must never wait on a monitor queue we have not drained.
        monitor.setsockopt(zmq.RCVHWM, 0)
        monitor.setsockopt(zmq.LINGER, 0)
        monitor.connect(address)
        self._gates.append(_Gate(name, path, 0, monitor))

    def arm(self) -> int:
        """Fix each socket's bound from the limit and the files open now; how many connections
        the first (worker) socket takes before it stops accepting.

        The last socket (admin) stops OWN_FILES plus one overshoot (a full backlog and the
        reaction slack) below the limit; each earlier one ADMIN_ROOM plus one overshoot below the
        next. Under a low limit that margin shrinks to 3/4 of the files not yet in use, so the
        daemon still serves; below half the full margin a warning says that a flood may then
        outrun the guard.
        """
        # A monitor pipe nobody has read yet counts as being read: its first events would not
        # signal the fd. Draining it once makes every later event signal.
        self.serve()
        in_use = self._in_use = open_file_count(self.limit)
        overshoot = LISTEN_BACKLOG + 1 + max(REACTION_SLACK, self.limit // 4)
        step = ADMIN_ROOM + overshoot
        full_margin = OWN_FILES + overshoot + (len(self._gates) - 1) * step
        margin = min(full_margin, max(0, self.limit - in_use) * 3 // 4)
        scale = margin / full_margin
        last_bound = self.limit - round((OWN_FILES + overshoot) * scale)
        for position, gate in enumerate(reversed(self._gates)):
            gate.bound = last_bound - round(position * step * scale)
        room = max(0, self._gates[0].bound - in_use)
        if 2 * margin < full_margin:
            log.warning(
                "open-file limit %d is low: room for %d connections, and a connection flood may "
                "outrun the guard (raise it: ulimit -n, LimitNOFILE=, launchd's NumberOfFiles)",
                self.limit,
                room,
            )
        return room

    @property
    def sockets(self) -> list[zmq.Socket[bytes]]:
        """The monitor sockets the loop polls (serve() when one's fd signals: it drains them
        all, so ZeroMQ's edge-triggered fd signals again on the next event)."""
        return [gate.monitor for gate in self._gates]

    def serve(self) -> None:
        """Drain the connection events and open or close the gates on the open-file count."""
        change = 0
        for gate in self._gates:
            while cast(int, gate.monitor.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                event = _EVENT_ID.unpack_from(gate.monitor.recv_multipart()[0])[0]
                change += 1 if event == zmq.EVENT_ACCEPTED else -1
        if change:
            self._in_use += change
            self._open_or_close()

    def check(self) -> None:
        """Take the real open-file count, then open or close the gates (on the liveness tick
        while a gate is closed or the count is past half a bound, so neither a missed event nor
        the daemon's own files can leave the running count wrong for long)."""
        if self.any_closed or 2 * self._in_use >= self._gates[0].bound:
            self._in_use = open_file_count(self.limit)
            self._open_or_close()

    def _open_or_close(self) -> None:
        for gate in self._gates:
            if not gate.closed and self._in_use >= gate.bound:
                self._in_use = open_file_count(self.limit)  # the real count, before acting
                if self._in_use < gate.bound or not self._set(gate, closed=True):
                    continue
                log.warning(
                    "%d of %d open files in use: refusing new connections to the %s socket until "
                    "some close (connections already made are served)",
                    self._in_use,
                    self.limit,
                    gate.name,
                )
            elif gate.closed and self._in_use <= gate.bound - REOPEN_GAP:
                self._in_use = open_file_count(self.limit)
                if self._in_use > gate.bound - REOPEN_GAP or not self._set(gate, closed=False):
                    continue
                log.info(
                    "%d of %d open files in use: the %s socket accepts new connections again",
                    self._in_use,
                    self.limit,
                    gate.name,
                )

    @property
    def any_closed(self) -> bool:
        return any(gate.closed for gate in self._gates)

    @staticmethod
    def _set(gate: _Gate, closed: bool) -> bool:
        """Hide or restore the socket file; False (and a log line) when the rename fails."""
        hidden = hidden_path(gate.path)
        source, target = (gate.path, hidden) if closed else (hidden, gate.path)
        try:
            os.rename(source, target)
        except OSError as exc:
            log.error("cannot rename %s to %s: %s", source, target, exc)
            return False
        gate.closed = closed
        return True

    def close(self) -> None:
        """Stop watching; every socket file back under its own name (for the caller to unlink)."""
        for gate in self._gates:
            if gate.closed:
                self._set(gate, closed=False)
            gate.monitor.close(linger=0)
