"""vqpoold's process: settings checked, the run directory taken (``server/run_dir.py``), the
sockets bound, the poll loop, and a clean stop.

One thread serves everything. The loop sleeps in ``poll(2)`` on the two ROUTER sockets' ZeroMQ
file descriptors and a self-pipe that signal handlers write to, so a SIGTERM wakes it at once
although the handler itself only records the signal. Every reply is sent non-blocking: when a
peer's queue is full (it does not read) its reply is dropped and counted, and nobody else waits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, cast

import zmq
from vqpool.daemon.budget.accounting import BudgetAccounting
from vqpool.daemon.budget.ledger import BudgetLedger
from vqpool.daemon.budget.live_settings import LiveSettings
from vqpool.daemon.budget.settings import models_from_toml
from vqpool.daemon.budget.types import ModelSettings
from vqpool.daemon.core.coordinator import Coordinator, new_boot_id
from vqpool.daemon.front.catalog import budget_tables
from vqpool.daemon.net.connection_guard import (
    LISTEN_BACKLOG,
    ConnectionGuard,
    describe_limit_change,
    hidden_path,
    raise_open_file_limit,
)
from vqpool.daemon.net.peer_auth import ADMIN_DOMAIN, WORKER_DOMAIN, PeerAuthenticator
from vqpool.daemon.net.peer_log import PeerLogLimiter
from vqpool.daemon.net.peer_process import RequestPeer
from vqpool.daemon.ops.admin_socket import AdminRequestHandler
from vqpool.daemon.ops.state import DAEMON_VERSION, DaemonState
from vqpool.daemon.ops.worker_socket import WorkerRequestHandler
from vqpool.daemon.server.exit_status import ExitStatus, StartupError
from vqpool.daemon.server.machine_memory import physical_memory
from vqpool.daemon.server.run_dir import prepare_run_dir, remove_stale_socket, take_lock
from vqpool.daemon.server.settings import DaemonSettings
from vqpool.shared.allocator import PoolConfig
from vqpool.shared.byte_sizes import MAX_BYTES, format_bytes, parse_budget
from vqpool.shared.config import (
    ADMIN_SOCKET_NAME,
    LOCK_FILE_NAME,
    WORKER_SOCKET_NAME,
    resolve_run_dir,
    socket_path,
)
from vqpool.shared.protocol import MAX_MESSAGE_BYTES

if TYPE_CHECKING:
    from vqpool.daemon.server.metrics import MetricsExporter

log = logging.getLogger("vqpoold")

LIVENESS_INTERVAL = 0.25
"""Seconds between two checks of every worker process (reaps a killed worker well inside the
promised 2 s at the cost of one /proc read per process per tick)."""

MAX_MESSAGES_PER_WAKE = 256
"""Requests served from one socket before looking at the other and at the clock."""

ZAP_BATCH = 16
"""Handshakes answered between two looks at the connection guard."""

SHUTDOWN_LINGER_MS = 200
"""How long closing a socket at shutdown may wait to flush the last replies."""

_send = zmq.backend.Socket.send
"""pyzmq's send() and send_multipart() are Python wrappers (argument checks, flag enums) around
this one, which costs a fifth as much per frame."""

# Flags and options as plain ints: an operation on pyzmq's enums runs Python code.
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)

Handle = Callable[[bytes, bytes, float], Any]
"""A socket's request handler: the reply frame, or (worker socket) a
:class:`~vqpool.daemon.budget.parking.Parked` request to answer later."""


def describe_pool(config: PoolConfig) -> str:
    """One line on a pool's shape, for the start line."""
    streams = config.streams
    per_stream = config.n_blocks // len(streams)
    split = f"streams {'+'.join(streams)} ({per_stream} each)" if len(streams) > 1 else "shared kv"
    if not config.grow_on_exhaustion:
        grow = "no growth"
    elif config.max_blocks is None:
        grow = "grows without cap"
    else:
        grow = f"grows up to {config.max_blocks}"
    return f"{per_stream * len(streams)} blocks x {config.block_size} tokens, {split}, {grow}"


def budget_settings(settings: DaemonSettings) -> tuple[int | None, dict[str, ModelSettings]]:
    """The budget in bytes (None: none) and the configured models' settings.

    Raises:
        ValueError: A bad budget or model entry, or reserves summing over the budget.
    """
    budget = None
    if settings.budget is not None:
        budget = parse_budget(settings.budget, physical_memory())
    models = models_from_toml(budget_tables(settings.models))
    BudgetLedger(MAX_BYTES if budget is None else budget, models)  # checks the reserves
    return budget, models


def describe_budget(budget: int | None, models: dict[str, ModelSettings]) -> str:
    """The budget and the configured models, for the start line."""
    text = "none" if budget is None else format_bytes(budget)
    if not models:
        return text
    shown = []
    for name, s in models.items():
        limit = "none" if s.limit is None else format_bytes(s.limit)
        shown.append(
            f"{name!r} (reserve {format_bytes(s.reserve)}, limit {limit}, weight {s.weight:g})"
        )
    return f"{text}, models {', '.join(shown)}"


class Server:
    """One vqpoold: bind, serve until SIGTERM/SIGINT, stop cleanly."""

    def __init__(self, settings: DaemonSettings) -> None:
        self.settings = settings
        self.run_dir = resolve_run_dir(settings.run_dir)
        self._stop_signal: int | None = None
        self._bad_frames = PeerLogLimiter()
        self._metrics: MetricsExporter | None = None
        self._peers: dict[str, RequestPeer] = {}
        # Called right after each reply is sent (the worker handler keeps it in its reply cache)
        self._settles: dict[str, Callable[[], None] | None] = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only record it: the self-pipe written by Python's C-level handler wakes the loop.
        self._stop_signal = signum

    def run(self) -> int:
        """Serve until stopped by a signal; the process exit status.

        Raises:
            StartupError: Bad settings, an unusable run directory, or another daemon running.
        """
        run_dir = self.run_dir
        try:
            worker_path = socket_path(run_dir, WORKER_SOCKET_NAME)
            admin_path = socket_path(run_dir, ADMIN_SOCKET_NAME)
        except ValueError as exc:
            raise StartupError(str(exc), ExitStatus.BAD_RUN_DIR) from exc
        try:
            budget, models = budget_settings(self.settings)
            pool_config = self.settings.pool_config(budget)
        except ValueError as exc:
            raise StartupError(str(exc)) from exc
        if self.settings.lease <= 0:
            raise StartupError(f"lease must be > 0 seconds, got {self.settings.lease}")
        if not 0 < self.settings.reclaim_deadline <= 60:
            raise StartupError(
                f"reclaim deadline must be in (0, 60] seconds, got {self.settings.reclaim_deadline}"
            )
        if self.settings.claim_grace < 0:
            raise StartupError(f"claim grace must be >= 0 seconds, got {self.settings.claim_grace}")
        metrics_port = self.settings.metrics_port
        if metrics_port is not None and not 0 <= metrics_port <= 65535:
            raise StartupError(f"metrics port must be in 0..65535, got {metrics_port}")
        prepare_run_dir(run_dir)
        boot_id = new_boot_id()
        lock_fd = take_lock(run_dir / LOCK_FILE_NAME, boot_id)
        # After the lock: the roll of the previous daemon's workers is ours to read only now.
        coord = Coordinator(
            pool_config,
            lease=self.settings.lease,
            run_dir=run_dir,
            claim_grace=self.settings.claim_grace,
            boot_id=boot_id,
        )
        # Settings made live before a restart, over the config file's (the pool keeps the
        # shape the config file's budget gives it, as before the restart).
        live = LiveSettings.load(run_dir, budget, models)
        budget, models = live.effective_budget(), live.effective_models()
        accounting = BudgetAccounting(
            coord,
            budget,
            models,
            lend_reserves=self.settings.lend_reserves,
            reclaim_deadline=self.settings.reclaim_deadline,
            live=live,
        )
        state = DaemonState(coord, accounting)
        fd_limit_before, fd_limit = raise_open_file_limit()
        context: zmq.Context[Any] = zmq.Context()
        # Handlers go in before the start line: a signal sent on seeing it must stop us cleanly.
        wake_fd = self._catch_stop_signals()
        # Bound before the sockets it guards: libzmq admits anyone while no ZAP handler is bound.
        auth = state.peer_auth = PeerAuthenticator(context)
        bound: list[tuple[zmq.Socket[bytes], Path]] = []  # closed and unlinked on the way out
        guard = ConnectionGuard(context, fd_limit)
        try:
            worker_handler, admin_handler = WorkerRequestHandler(state), AdminRequestHandler(state)
            self._peers = {"worker": worker_handler.peer, "admin": RequestPeer()}
            self._settles = {"worker": worker_handler.settle, "admin": None}
            handle_worker: Handle = worker_handler.handle
            handle_admin: Handle = admin_handler.handle
            # Before binding: a port in use must fail start-up with no socket to close.
            if metrics_port is not None:
                handle_worker, handle_admin = self._start_metrics(
                    state, metrics_port, worker_handler, admin_handler
                )
            # Only now, holding the lock, may a stale socket of a killed daemon be replaced.
            for path in (worker_path, admin_path):
                remove_stale_socket(path)
                remove_stale_socket(hidden_path(path))  # hidden by a killed daemon's guard
            worker = self._bind(context, worker_path, WORKER_DOMAIN, bound)
            admin = self._bind(context, admin_path, ADMIN_DOMAIN, bound)
            guard.watch(worker, worker_path, "worker")
            guard.watch(admin, admin_path, "admin")
            max_connections = guard.arm()
            log.info(
                "vqpoold %s (pid %d, boot %s) listening on ipc://%s (workers) and ipc://%s "
                "(admin); pool: %s; budget: %s; lease %gs; up to %d connections (open-file limit "
                "%d%s)",
                DAEMON_VERSION,
                coord.pid,
                coord.boot_id,
                worker_path,
                admin_path,
                describe_pool(pool_config),
                describe_budget(budget, models),
                coord.lease,
                max_connections,
                fd_limit,
                describe_limit_change(fd_limit_before, fd_limit),
            )
            self._loop(state, wake_fd, auth, guard, (worker, handle_worker), (admin, handle_admin))
            # Answer what was already queued before the signal, then let the replies flush.
            self._serve(worker, handle_worker, coord, "worker")
            self._serve(admin, handle_admin, coord, "admin")
            worker.close(linger=SHUTDOWN_LINGER_MS)
            admin.close(linger=SHUTDOWN_LINGER_MS)
        finally:
            if self._metrics is not None:
                self._metrics.stop()
            auth.close()
            guard.close()
            self._release_stop_signals()
            for sock, path in bound:
                sock.close(linger=0)  # no-op for those closed above; context.term() needs all
                path.unlink(missing_ok=True)
            context.term()
            os.close(lock_fd)  # releases the flock, after the sockets are gone
        signame = signal.Signals(self._stop_signal).name if self._stop_signal else "?"
        log.info("vqpoold stopped on %s after %.1fs", signame, coord.uptime())
        return ExitStatus.STOPPED

    def _start_metrics(
        self,
        state: DaemonState,
        port: int,
        worker_handler: WorkerRequestHandler,
        admin_handler: AdminRequestHandler,
    ) -> tuple[Handle, Handle]:
        """Serve /metrics over HTTP; the request handlers wrapped to count and time requests."""
        # Imported here: a daemon without --metrics-port never loads prometheus_client.
        from vqpool.daemon.server.metrics import MetricsExporter, RequestMetrics

        requests = RequestMetrics()
        exporter = MetricsExporter(state, requests, self._wake_loop, DAEMON_VERSION)
        try:
            served = exporter.start(port)
        except OSError as exc:
            raise StartupError(
                f"cannot serve metrics on 127.0.0.1:{port}: {exc}", ExitStatus.METRICS_PORT
            ) from exc
        self._metrics = exporter
        log.info("metrics on http://127.0.0.1:%d/metrics", served)
        return (
            requests.instrument("worker", worker_handler),
            requests.instrument("admin", admin_handler),
        )

    def _wake_loop(self) -> None:
        """Wake the loop from another thread (it drains the byte and looks at its work)."""
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_fds[1], b"\0")

    @staticmethod
    def _bind(
        context: zmq.Context[Any],
        path: Path,
        zap_domain: bytes,
        bound: list[tuple[zmq.Socket[bytes], Path]],
    ) -> zmq.Socket[bytes]:
        """A ROUTER bound on ``path``, appended to ``bound``.

        Raises:
            StartupError: libzmq cannot bind there (status 3).
        """
        sock: zmq.Socket[bytes] = context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        # Every connection is authenticated by the ZAP handler (daemon/net/peer_auth.py) before
        # any of its messages reaches us: peers of another uid and non-ZMTP-3 bytes stay out.
        sock.setsockopt(zmq.ZAP_DOMAIN, zap_domain)
        # Unroutable or queue-full sends fail (and are counted) instead of vanishing silently;
        # the sends are non-blocking, so a full queue never stalls the loop.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.BACKLOG, LISTEN_BACKLOG)
        try:
            sock.bind(f"ipc://{path}")
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise StartupError(f"cannot bind ipc://{path}: {exc}", ExitStatus.BAD_RUN_DIR) from None
        bound.append((sock, path))
        os.chmod(path, 0o600)
        return sock

    def _catch_stop_signals(self) -> int:
        """Route SIGTERM/SIGINT to the flag-only handler; the fd that wakes the loop on them."""
        wake_read, wake_write = os.pipe()
        for fd in (wake_read, wake_write):
            os.set_blocking(fd, False)
        self._wake_fds = (wake_read, wake_write)
        self._previous_wakeup = signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
        self._previous_handlers = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)
        }
        return wake_read

    def _release_stop_signals(self) -> None:
        signal.set_wakeup_fd(self._previous_wakeup)
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        for fd in self._wake_fds:
            os.close(fd)

    def _loop(
        self,
        state: DaemonState,
        wake_fd: int,
        auth: PeerAuthenticator,
        guard: ConnectionGuard,
        worker_side: tuple[zmq.Socket[bytes], Handle],
        admin_side: tuple[zmq.Socket[bytes], Handle],
    ) -> None:
        worker, handle_worker = worker_side
        admin, handle_admin = admin_side
        zap = auth.socket
        zap_fd = cast(int, zap.getsockopt(zmq.FD))
        worker_fd = cast(int, worker.getsockopt(zmq.FD))
        admin_fd = cast(int, admin.getsockopt(zmq.FD))
        guard_fds = {cast(int, sock.getsockopt(zmq.FD)) for sock in guard.sockets}
        poller = select.poll()
        for sock in (worker, admin, zap, *guard.sockets):
            poller.register(cast(int, sock.getsockopt(zmq.FD)), select.POLLIN)
        poller.register(wake_fd, select.POLLIN)
        next_check = time.monotonic() + LIVENESS_INTERVAL
        coord = state.coord
        budget = state.budget
        parking = budget.parking
        reclaim = budget.reclaim
        # Whether a socket may have input its fd does not tell of. ZeroMQ's fd is
        # edge-triggered, and any recv or send may take the signal of a request arriving: a
        # socket served until recv said EAGAIN or its state (ZMQ_EVENTS) said no input (its
        # last call) is clean, and its fd signals the next request; one stopped at
        # MAX_MESSAGES_PER_WAKE, or sent on since, is not, and is served without sleeping.
        # Reading a socket's state or a failed recv costs a system call each: a clean socket
        # whose fd is quiet is not looked at.
        # Likewise the ZAP socket (auth.serve() ends on a read of its state: clean) and the
        # guard's monitors (guard.serve() always drains them completely).
        worker_dirty = admin_dirty = zap_dirty = True
        while self._stop_signal is None:
            guard_ready = False
            if worker_dirty or admin_dirty or zap_dirty:
                timeout_ms = 0
            else:
                wake_at = next_check
                if parking.parked:  # a parked request's deadline may come first
                    deadline = budget.ledger.next_deadline()
                    if deadline is not None and deadline < wake_at:
                        wake_at = deadline
                if reclaim.active:  # a poll's or an ask's deadline, or the next plan
                    reclaim_at = reclaim.next_wake(time.monotonic())
                    if reclaim_at is not None and reclaim_at < wake_at:
                        wake_at = reclaim_at
                timeout_ms = max(0, int((wake_at - time.monotonic()) * 1000) + 1)
            for fd, _ in poller.poll(timeout_ms):
                if fd == wake_fd:
                    with contextlib.suppress(BlockingIOError):
                        os.read(wake_fd, 512)
                elif fd == worker_fd:
                    worker_dirty = True
                elif fd == admin_fd:
                    admin_dirty = True
                elif fd == zap_fd:
                    zap_dirty = True
                elif fd in guard_fds:
                    guard_ready = True
            if guard_ready:  # accepted or lost connections: count open files before anything
                guard.serve()
            if zap_dirty:  # new connections' handshakes, before their requests
                # In batches: a flood's handshakes must not keep the guard from counting.
                while auth.serve(ZAP_BATCH):
                    guard.serve()
                zap_dirty = False
            if worker_dirty:
                worker_dirty = self._serve(worker, handle_worker, coord, "worker")
            if admin_dirty:
                admin_dirty = self._serve(admin, handle_admin, coord, "admin")
            if parking.parked:
                parking.expire(time.monotonic())
                parking.hand_out()
            if reclaim.active:
                reclaim.tick(time.monotonic())
            if parking.outbox:
                self._send_late_replies(worker, parking.outbox, coord)
                worker_dirty = True
            coord.history_clock.stamp(coord.allocator)  # one look when nothing changed
            if self._metrics is not None:
                self._metrics.publish_if_wanted()
            now = time.monotonic()
            if now >= next_check:
                budget.reap_dead_sessions(now)
                budget.expire_loads(now)
                guard.check()
                coord.check_claim_period(now)
                coord.write_roll_if_changed()
                coord.timeline.sample(coord.allocator, coord.blocks_by_model)
                next_check = now + LIVENESS_INTERVAL

    def _serve(
        self, sock: zmq.Socket[bytes], handle: Handle, coord: Coordinator, name: str
    ) -> bool:
        """Answer up to MAX_MESSAGES_PER_WAKE requests waiting on ``sock``. Returns whether
        more may wait (it stopped at the limit), False once the socket said none waits."""
        peer = self._peers[name]  # given each request's routing-id frame while it is handled
        settle = self._settles[name]
        recv = sock.recv
        getsockopt = cast(Callable[[int], int], sock.getsockopt)  # ZMQ_EVENTS: an int
        send = _send
        monotonic = time.monotonic
        for _ in range(MAX_MESSAGES_PER_WAKE):
            try:
                # The routing-id frame carries the connection's properties (the peer's pid,
                # which hello checks: daemon/net/peer_process.py).
                routing_id = recv(_NOBLOCK, copy=False)
            except zmq.Again:
                return False
            # The rest (a message arrives whole; a ROUTER always has a part after the routing
            # id). recv_multipart by hand, frames asked whether more follow (getsockopt's
            # RCVMORE costs more: pyzmq looks the option up in an enum).
            part = recv(_NOBLOCK, copy=False)
            frames = [routing_id.bytes, part.bytes]
            while part.more:
                part = recv(_NOBLOCK, copy=False)
                frames.append(part.bytes)
            if len(frames) == 2:  # DEALER: [peer, request]
                envelope = frames[:1]
            elif len(frames) == 3 and not frames[1]:  # REQ: [peer, "", request]
                envelope = frames[:2]
            else:  # cannot be a request: nothing sensible to answer
                coord.n_bad_requests += 1
                self._bad_frames.note(frames[0], name, f"message of {len(frames)} frames dropped")
                continue
            peer.frame = routing_id
            reply = handle(frames[-1], frames[0], monotonic())
            if type(reply) is not bytes:  # parked: answered later on the newest envelope
                reply.envelope = envelope
            else:
                try:
                    for frame in envelope:  # frame by frame, as send_multipart() does
                        send(sock, frame, _SNDMORE_NOBLOCK)
                    send(sock, reply, _NOBLOCK)
                except zmq.ZMQError:  # EAGAIN: peer's queue full; EHOSTUNREACH: peer gone
                    coord.n_replies_dropped += 1
            if settle is not None:  # after the send: the client does not wait for it
                settle()
            # Whether another request waits, as the socket's state says: cheaper than a recv
            # that fails (its exception), and as good a promise that the fd signals the next.
            if not getsockopt(_EVENTS) & _POLLIN:
                return False
        return True

    @staticmethod
    def _send_late_replies(
        sock: zmq.Socket[bytes], outbox: list[tuple[list[bytes], bytes]], coord: Coordinator
    ) -> None:
        """Send the late replies of parked requests (``budget/parking.py``)."""
        for envelope, reply in outbox:
            try:
                sock.send_multipart([*envelope, reply], zmq.NOBLOCK)
            except zmq.ZMQError:
                coord.n_replies_dropped += 1
        outbox.clear()
