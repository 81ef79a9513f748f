"""A fault-injecting ZeroMQ forwarder between worker clients and vqpoold, for tests.

It stands where the daemon's worker socket would be (``<proxy dir>/worker.sock``, so a
``PoolClient(proxy_dir)`` talks through it) and forwards each client's frames to the real daemon
on a DEALER of that client's own (the daemon tells sessions apart by their session id, and
replies must find their way back). Every request and every reply independently may be dropped,
duplicated, or delayed (which also reorders it behind later messages), with the given
probabilities; requests whose op is in ``drop_ops`` are always dropped, and those whose op is
a key of ``delay_ops`` are held that many seconds (faults aimed at one step). It runs in a
thread of the test process; ``counts`` says what it did.
"""

from __future__ import annotations

import heapq
import itertools
import random
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgpack
import zmq
from vqpool.shared.config import WORKER_SOCKET_NAME


class FaultyProxy(threading.Thread):
    def __init__(
        self,
        proxy_dir: Path,
        daemon_run_dir: Path,
        *,
        drop: float,
        duplicate: float,
        delay: float,
        max_delay: float = 0.3,
        seed: int = 0,
    ) -> None:
        super().__init__(name="faulty-proxy", daemon=True)
        self.frontend_endpoint = f"ipc://{proxy_dir / WORKER_SOCKET_NAME}"
        self.backend_endpoint = f"ipc://{daemon_run_dir / WORKER_SOCKET_NAME}"
        self.drop, self.duplicate, self.delay = drop, duplicate, delay
        self.max_delay = max_delay
        self.rng = random.Random(seed)
        self.counts: Counter[str] = Counter()
        self.drop_ops: set[str] = set()
        self.delay_ops: dict[str, float] = {}
        self._stopping = threading.Event()
        self._ready = threading.Event()

    def start_and_wait(self) -> FaultyProxy:
        self.start()
        self._ready.wait(5)
        return self

    def stop(self) -> None:
        self._stopping.set()
        self.join(5)

    def run(self) -> None:
        context: zmq.Context[Any] = zmq.Context()
        frontend = context.socket(zmq.ROUTER)
        frontend.setsockopt(zmq.LINGER, 0)
        frontend.bind(self.frontend_endpoint)
        backends: dict[bytes, zmq.Socket[bytes]] = {}
        clients: dict[zmq.Socket[bytes], bytes] = {}
        pending: list[tuple[float, int, str, bytes, bytes]] = []  # due, seq, way, client, frame
        seq = itertools.count()
        poller = zmq.Poller()
        poller.register(frontend, zmq.POLLIN)
        self._ready.set()

        def deliver(way: str, client: bytes, frame: bytes) -> None:
            if way == "request":
                backends[client].send(frame, zmq.NOBLOCK)
            else:
                frontend.send_multipart([client, frame], zmq.NOBLOCK)

        def forward(way: str, client: bytes, frame: bytes, now: float) -> None:
            kind = "requests" if way == "request" else "replies"
            if way == "request" and self.drop_ops and msgpack.unpackb(frame)["op"] in self.drop_ops:
                self.counts[f"{kind} dropped"] += 1
                return
            held = None
            if way == "request" and self.delay_ops:
                held = self.delay_ops.get(msgpack.unpackb(frame)["op"])
            if held is not None:
                self.counts[f"{kind} held"] += 1
                heapq.heappush(pending, (now + held, next(seq), way, client, frame))
                return
            roll = self.rng.random()
            if roll < self.drop:
                self.counts[f"{kind} dropped"] += 1
                return
            copies = 1
            if roll < self.drop + self.duplicate:
                self.counts[f"{kind} duplicated"] += 1
                copies = 2
            for _ in range(copies):
                if self.rng.random() < self.delay:
                    self.counts[f"{kind} delayed"] += 1
                    due = now + self.rng.uniform(0, self.max_delay)
                    heapq.heappush(pending, (due, next(seq), way, client, frame))
                else:
                    deliver(way, client, frame)
            self.counts[f"{kind} forwarded"] += 1

        try:
            while not self._stopping.is_set():
                timeout = 20
                if pending:
                    timeout = max(0, min(timeout, int((pending[0][0] - time.monotonic()) * 1000)))
                for sock, _ in poller.poll(timeout):
                    if sock is frontend:
                        client, frame = frontend.recv_multipart()
                        if client not in backends:
                            backend = context.socket(zmq.DEALER)
                            backend.setsockopt(zmq.LINGER, 0)
                            backend.connect(self.backend_endpoint)
                            backends[client] = backend
                            clients[backend] = client
                            poller.register(backend, zmq.POLLIN)
                        forward("request", client, frame, time.monotonic())
                    else:
                        frame = sock.recv()
                        forward("reply", clients[sock], frame, time.monotonic())  # type: ignore[index]
                now = time.monotonic()
                while pending and pending[0][0] <= now:
                    _, _, way, client, frame = heapq.heappop(pending)
                    deliver(way, client, frame)
        finally:
            for sock in [frontend, *backends.values()]:
                sock.close(linger=0)
            context.term()
