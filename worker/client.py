"""PoolClient: the daemon's block pool, seen from one worker process.

A :class:`PoolClient` has the methods, signatures, return types and exceptions of the local
:class:`~vqpool.shared.allocator.BlockPoolAllocator` (it satisfies
:class:`~vqpool.shared.pool.BlockPool`), so a pooled KV cache runs unchanged on either. Each
call is one request to ``vqpoold``:

* **Deadline and retries.** A call waits for its reply a bounded time; on silence it reopens its
  socket and resends the same request id (Lazy Pirate). The daemon answers a repeated id from
  its reply cache, so a lost reply costs a resend, never a leaked or doubled allocation. When
  ``timeout`` runs out the call raises :class:`DaemonUnavailableError` naming the run directory.
* **Lease.** A background thread pings the daemon on its own socket every lease / 4, so the
  lease stays fresh while the caller's thread is busy (a long prefill) without sharing its
  socket.
* **Threads.** Calls from several threads are serialized on one lock: each call's request and
  the local bookkeeping it implies happen in daemon order.
* **Restarts.** The daemon's boot id comes with every reply. Once it differs from the one hello
  returned, every call raises :class:`DaemonRestartedError`: blocks of two daemon lifetimes are
  never mixed.

The client keeps the :class:`Block` objects it handed out, as the local allocator does, so
``free``/``free_all``/``mark_used`` update the caller's objects the same way.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import threading
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import zmq
from vqpool.shared.allocator import (
    DEFAULT_HISTORY_SIZE,
    AllocationStats,
    Block,
    Owner,
    PoolConfig,
)
from vqpool.shared.config import WORKER_SOCKET_NAME, endpoint, resolve_run_dir
from vqpool.shared.errors import (
    DaemonRestartedError,
    DaemonUnavailableError,
    ErrorCode,
    NoSessionError,
    error_from_wire,
)
from vqpool.shared.pool import AllocationRequest, AllocationResult
from vqpool.shared.protocol import (
    config_from_wire,
    encode_request,
    stats_from_wire,
)
from vqpool.shared.transport import LazyPirateConnection

try:
    CLIENT_VERSION = version("vqpool")
except PackageNotFoundError:  # a source tree that is not installed
    CLIENT_VERSION = "unknown"

DEFAULT_TIMEOUT = 10.0
"""Seconds a call may take, retries included, before DaemonUnavailableError."""

_GOODBYE_TIMEOUT = 1.0


class PoolClient:
    """A session with ``vqpoold`` that behaves as a :class:`~vqpool.shared.pool.BlockPool`.

    Example::

        with PoolClient(name="llama-3b") as pool:
            blocks = pool.allocate("k", 40, owner="req-1")
            ...
            pool.free_all("req-1")

    Args:
        run_dir: The daemon's run directory; None resolves it as the daemon does
            (``VQPOOL_RUN_DIR``, then ``$XDG_RUNTIME_DIR/vqpool`` or ``$TMPDIR/vqpool``).
        name: Model name this worker serves (shown by the admin ``sessions`` op).
        bytes_per_block: Bytes one block holds in this worker, for all streams (int) or per
            stream (map); lets the admin report memory held. None reports 0.
        timeout: Seconds each call may take, retries included.

    Raises (from the constructor):
        DaemonUnavailableError: The daemon did not answer hello in ``timeout``.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str] | None = None,
        *,
        name: str,
        bytes_per_block: int | Mapping[str, int] | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        self.run_dir = resolve_run_dir(run_dir)
        self.name = name
        self.timeout = timeout
        self._endpoint = endpoint(self.run_dir, WORKER_SOCKET_NAME)
        self._context: zmq.Context[Any] = zmq.Context()
        self._connection = LazyPirateConnection(self._context, self._endpoint)
        self._lock = threading.Lock()
        # One counter for the caller's requests and the heartbeat's (next() on it is atomic).
        self._ids = itertools.count(1)
        self._blocks: dict[int, Block] = {}
        self._owner_blocks: dict[Owner, dict[int, None]] = {}
        self._restarted: str | None = None
        self._closed = False
        self.session_id: int | None = None
        self.boot_id: str | None = None
        try:
            hello = self._hello(bytes_per_block)
        except BaseException:
            self._connection.close()
            self._context.term()
            raise
        self.session_id = hello["sid"]
        self.boot_id = hello["boot"]
        self._config = config_from_wire(hello["config"])
        self._streams: tuple[str, ...] = tuple(hello["streams"])
        self.lease: float = hello["lease"]
        self._heartbeat = _Heartbeat(self, hello["heartbeat"])
        self._heartbeat.start()

    # -- plumbing --------------------------------------------------------------------------------

    def _hello(self, bytes_per_block: int | Mapping[str, int] | None) -> dict[str, Any]:
        args: dict[str, Any] = {
            "pid": os.getpid(),
            "model": self.name,
            "nonce": secrets.token_hex(16),
            "client_version": CLIENT_VERSION,
        }
        if bytes_per_block is not None:
            args["bytes_per_block"] = (
                bytes_per_block if isinstance(bytes_per_block, int) else dict(bytes_per_block)
            )
        rid = next(self._ids)
        reply = self._send(encode_request(rid, "hello", args), rid, "hello")
        result: dict[str, Any] = self._result(reply, expect_boot=False)
        return result

    def _send(self, payload: bytes, rid: int, op: str) -> dict[str, Any]:
        try:
            return self._connection.request(payload, rid, self.timeout, op)
        except DaemonUnavailableError:
            where = self._endpoint.removeprefix("ipc://")
            hint = "" if os.path.exists(where) else f" (there is no socket at {where})"
            raise DaemonUnavailableError(
                f"vqpoold did not answer {op} within {self.timeout:g}s on {self._endpoint}"
                f"{hint}. Is vqpoold running with --run-dir {self.run_dir} (or "
                f"VQPOOL_RUN_DIR)? Check the daemon's log and `vqpoolctl --run-dir "
                f"{self.run_dir} stats`."
            ) from None

    def _result(self, reply: dict[str, Any], expect_boot: bool = True) -> Any:
        """The result of a reply, or the exception its error names."""
        if expect_boot and reply.get("boot") != self.boot_id:
            raise DaemonRestartedError(self._mark_restarted(reply.get("boot")))
        if reply["ok"]:
            return reply.get("result")
        error = reply["error"]
        if error["code"] == ErrorCode.DAEMON_RESTARTED:
            self._restarted = error["message"]
        raise error_from_wire(error["code"], error["message"])

    def _mark_restarted(self, new_boot: object) -> str:
        """Remember for good that the daemon restarted; the message every call will raise."""
        self._restarted = (
            f"vqpoold restarted (boot id {self.boot_id} -> {new_boot}) since this client's "
            f"session began; blocks of the old daemon lifetime are gone. Open a new PoolClient "
            f"for {self.run_dir}."
        )
        return self._restarted

    def _call(self, op: str, args: Mapping[str, Any]) -> Any:
        """One request/reply; the caller holds ``self._lock``."""
        if self._restarted is not None:
            raise DaemonRestartedError(self._restarted)
        if self._closed:
            raise NoSessionError(f"PoolClient for {self.run_dir} is closed")
        rid = next(self._ids)
        payload = encode_request(rid, op, args, self.session_id, self.boot_id)
        return self._result(self._send(payload, rid, op))

    def _blocks_from_ids(
        self, block_ids: list[int], stream: str, n_tokens: int, owner: Owner, fmt: str
    ) -> list[Block]:
        """The Block objects of an allocate reply (fill is implied: full but the last)."""
        block_size = self._config.block_size
        resolved = stream if self._config.separate_kv else "kv"
        blocks = [Block(bid, resolved, fmt, block_size, owner, True) for bid in block_ids]
        if blocks:
            blocks[-1].n_used = n_tokens - (len(blocks) - 1) * block_size
        held = self._blocks
        owned = self._owner_blocks.setdefault(owner, {})
        for block in blocks:
            held[block.block_id] = block
            owned[block.block_id] = None
        return blocks

    def _forget(self, block_id: int) -> Block | None:
        block = self._blocks.pop(block_id, None)
        if block is not None:
            owned = self._owner_blocks.get(block.owner)  # type: ignore[arg-type]
            if owned is not None:
                owned.pop(block_id, None)
                if not owned:
                    del self._owner_blocks[block.owner]  # type: ignore[arg-type]
            block.owner = None
            block.n_used = 0
        return block

    # -- the BlockPool interface -----------------------------------------------------------------

    @property
    def config(self) -> PoolConfig:
        """The daemon's pool configuration (as of hello; n_blocks is the starting size)."""
        return self._config

    @property
    def streams(self) -> tuple[str, ...]:
        """The pool's streams: ("k", "v") or ("kv",)."""
        return self._streams

    @property
    def stats(self) -> AllocationStats:
        """The daemon's allocator counters, fetched now."""
        with self._lock:
            return stats_from_wire(self._call("stats", {}))

    @property
    def history(self) -> deque[AllocationStats]:
        """The daemon's recent stats snapshots, oldest first, fetched now."""
        with self._lock:
            rows = self._call("history", {})
        return deque((stats_from_wire(r) for r in rows), maxlen=DEFAULT_HISTORY_SIZE)

    def metrics(self) -> str:
        """The daemon's pool counters in the Prometheus text format."""
        with self._lock:
            text: str = self._call("metrics", {})
        return text

    def allocate(
        self, stream: str, n_tokens: int, owner: Owner, format: str = "fp16"
    ) -> list[Block]:
        """Allocate ceil(n_tokens / block_size) blocks to ``owner``, all or nothing.

        Raises:
            ValueError: ``n_tokens`` <= 0, or a stream this pool does not have.
            BlockPoolExhaustedError: Too few free blocks; nothing allocated.
            OwnerAlreadyActiveError: Another worker session holds ``owner``.
        """
        args = {"stream": stream, "n_tokens": n_tokens, "owner": owner, "format": format}
        with self._lock:
            block_ids = self._call("allocate", args)
            return self._blocks_from_ids(block_ids, stream, n_tokens, owner, format)

    def allocate_many(self, requests: Sequence[AllocationRequest]) -> list[AllocationResult]:
        """Several allocate() calls in one message; per item, its blocks or its exception."""
        items = [AllocationRequest(*request) for request in requests]
        wire = [[r.stream, r.n_tokens, r.owner, r.format] for r in items]
        with self._lock:
            replies = self._call("allocate_many", {"items": wire})
            results: list[AllocationResult] = []
            for request, reply in zip(items, replies, strict=True):
                if isinstance(reply, list):
                    results.append(
                        self._blocks_from_ids(
                            reply, request.stream, request.n_tokens, request.owner, request.format
                        )
                    )
                else:
                    results.append(error_from_wire(reply["code"], reply["message"]))
            return results

    def free(self, blocks: Iterable[Block]) -> None:
        """Return blocks to the pool; already-free blocks are skipped.

        Raises:
            NotOwnerError: A block is held by another worker session; nothing was freed.
        """
        blocks = list(blocks)
        with self._lock:
            self._call("free", {"block_ids": [block.block_id for block in blocks]})
            for block in blocks:
                if self._forget(block.block_id) is not None:
                    block.owner = None
                    block.n_used = 0

    def free_all(self, owner: Owner) -> None:
        """Free every block ``owner`` holds and release the owner id.

        Raises:
            NotOwnerError: Another worker session holds ``owner``; nothing was freed.
        """
        with self._lock:
            self._call("free_all", {"owner": owner})
            for block_id in list(self._owner_blocks.get(owner, ())):
                self._forget(block_id)

    def register_owner(self, owner: Owner) -> None:
        """Mark ``owner`` active for this session.

        Raises:
            OwnerAlreadyActiveError: ``owner`` is active here or in another worker session.
        """
        with self._lock:
            self._call("register_owner", {"owner": owner})

    def release_owner(self, owner: Owner) -> None:
        """Release an owner that holds no block (one that holds blocks: use free_all).

        Raises:
            ValueError: ``owner`` still holds blocks.
            NotOwnerError: Another worker session holds ``owner``.
        """
        with self._lock:
            self._call("release_owner", {"owner": owner})

    def blocks_for(self, owner: Owner) -> list[Block]:
        """The blocks ``owner`` holds now, in allocation order (the daemon's view).

        Raises:
            NotOwnerError: Another worker session holds ``owner``.
        """
        with self._lock:
            rows = self._call("blocks_for", {"owner": owner})
            blocks: list[Block] = []
            for block_id, stream, fmt, n_used in rows:
                block = self._blocks.get(block_id)
                if block is None:
                    block = Block(block_id, stream, fmt, n_used, owner, True)
                else:
                    block.n_used = n_used
                blocks.append(block)
            return blocks

    def n_free(self, stream: str = "k") -> int:
        """Free blocks left in ``stream``.

        Raises:
            ValueError: A stream this pool does not have.
        """
        with self._lock:
            n: int = self._call("n_free", {"stream": stream})
            return n

    def mark_used(self, block: Block, n_used: int) -> None:
        """Set how many token slots of ``block`` are filled.

        Raises:
            ValueError: ``n_used`` outside 0..block_size.
            NotOwnerError: Another worker session holds the block.
        """
        self.mark_used_many([(block, n_used)])

    def mark_used_many(self, updates: Sequence[tuple[Block, int]]) -> None:
        """mark_used() for several blocks in one message; all checked before any is applied."""
        block_size = self._config.block_size
        for _, n_used in updates:
            if not 0 <= n_used <= block_size:
                raise ValueError(
                    f"BlockPoolAllocator: n_used must be in 0..{block_size}, got {n_used}"
                )
        with self._lock:
            self._call("mark_used", {"updates": [[b.block_id, n] for b, n in updates]})
            for block, n_used in updates:
                block.n_used = n_used
                live = self._blocks.get(block.block_id)
                if live is not None:
                    live.n_used = n_used

    # -- session ---------------------------------------------------------------------------------

    def ping(self) -> None:
        """One round trip to the daemon (it also refreshes the lease)."""
        with self._lock:
            self._call("ping", {})

    def held_blocks(self) -> Iterator[Block]:
        """The blocks this client holds, as it knows them (no round trip)."""
        return iter(list(self._blocks.values()))

    def close(self) -> None:
        """End the session: the daemon frees whatever this client still holds. Idempotent."""
        if self._closed:
            return
        self._heartbeat.stop()
        with self._lock:
            if self._restarted is None:
                rid = next(self._ids)
                payload = encode_request(rid, "goodbye", {}, self.session_id, self.boot_id)
                # Unanswered: the daemon reaps the session when this process exits.
                with contextlib.suppress(DaemonUnavailableError):
                    self._connection.request(payload, rid, _GOODBYE_TIMEOUT, "goodbye")
            self._closed = True
            self._blocks.clear()
            self._owner_blocks.clear()
            self._connection.close()
        self._context.term()

    def __enter__(self) -> PoolClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"PoolClient(run_dir={str(self.run_dir)!r}, name={self.name!r}, "
            f"session={self.session_id}, boot={self.boot_id})"
        )


class _Heartbeat(threading.Thread):
    """Pings the daemon every ``interval`` seconds on a socket of its own, keeping the lease.

    Stops when the client closes, when the session is gone (evicted), or when it sees a new
    daemon boot id, which it records so the caller's next call raises DaemonRestartedError.
    """

    def __init__(self, client: PoolClient, interval: float) -> None:
        super().__init__(name=f"vqpool-heartbeat-{client.session_id}", daemon=True)
        self._client = client
        self._interval = interval
        self._stopping = threading.Event()

    def stop(self) -> None:
        self._stopping.set()
        if self.is_alive():
            self.join()

    def run(self) -> None:
        client = self._client
        connection = LazyPirateConnection(
            client._context, client._endpoint, first_retry=min(0.5, self._interval)
        )
        try:
            while not self._stopping.wait(self._interval):
                rid = next(client._ids)
                payload = encode_request(rid, "ping", {}, client.session_id, client.boot_id)
                try:
                    reply = connection.request(payload, rid, self._interval, "heartbeat")
                except DaemonUnavailableError:
                    continue  # keep trying: a busy or restarting daemon may answer the next one
                if reply.get("boot") != client.boot_id:
                    # Sticky from now on: the caller's next call raises without sending.
                    client._mark_restarted(reply.get("boot"))
                    return
                if not reply["ok"] and reply["error"]["code"] == ErrorCode.NO_SESSION:
                    return  # evicted: the caller's next call gets NO_SESSION from the daemon
        finally:
            connection.close()
