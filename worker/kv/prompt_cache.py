"""The worker's prompt cache: the KV of ended requests, kept in pool blocks and reused by requests
that start with the same tokens.

A chat's next turn starts with the previous turn's prompt and answer, users of one deployment
share a system prompt, a client retries a request: each of those prompts starts with tokens whose
keys and values a request computed already. :class:`PromptCache` keeps them and gives them back:

* **Entries.** An entry is the KV of one token sequence of at least one block (``block_size`` =
  16 tokens), held as a :class:`~vqpool.worker.kv.cache.PooledSequence` of its own under the
  owner id ``{owner_prefix}-cache-{n}`` in the worker's shared :class:`MLXBlockStorage`. Its
  blocks are pool blocks like a request's: the daemon counts them in the model's bytes, claims
  them back after a restart, and the storage's bytes are blocks held x bytes per block, cache
  included.
* **Keys.** Entries are found by token ids at block granularity: block ``i`` of a sequence has
  the key ``hash((key of block i-1, its 16 token ids))``, and the index maps each key to the
  entries holding that prefix. The longest cached prefix of a prompt is found with one dict look
  per whole block, then extended token by token into the next block of the entries found, and
  checked token by token once (a hash collision is a miss, never a wrong hit).
* **Reuse** (:meth:`PromptCache.reuse`, when a request starts): the longest cached prefix, at
  least one whole block and at most ``len(prompt) - 1`` tokens (mlx-lm computes the logits of
  the next token from at least one prefilled token), is **copied** into the request's own
  cache through mlx-lm's cache protocol (``update_and_fetch`` per layer); the request prefills
  only the rest. The request keeps its own blocks and the entry stays (docs/cache.md: why).
* **Store** (:meth:`PromptCache.store`, when a request ended, and while it runs when a request
  sharing more of its prompt than the cache holds begins its prefill): its token ids with their
  KV are copied into a new entry, unless an entry holds them all already; entries whose tokens
  are a prefix of the new one are then given back (the new entry answers every lookup they
  answered: a chat keeps one entry, its latest turn).
* **Memory.** At most ``max_bytes`` (LRU eviction makes room; an entry larger than that is not
  kept). An entry is allocated without waiting: when the pool or the budget is short, nothing is
  stored. :meth:`release_bytes` gives entries back, least recently used first; the storage
  calls it (``MLXBlockStorage.reclaim``) when an allocation of this worker is refused, before
  the allocation is retried, waits or fails: cached memory goes first. :meth:`follow_advice`
  obeys the daemon's answer to a load report (``drop_cache``, ``release_bytes``).
* **Disk tier** (``disk``, optional; docs/cache.md "The disk tier"). Evicted entries are queued
  for the disk writer (``disk_writer.py``) instead of dropped, and the entries a stopping worker
  holds are written by :meth:`close`. :meth:`prefetch`, when a request is submitted, reads a
  longer prefix than memory holds back from disk (``disk_store.py``) into a new entry, on a
  reader thread of its own, so the request's :meth:`reuse` finds it in memory.

Thread-safe: one lock around every entry change; the generation thread reuses and stores, the
admission and heartbeat threads may release. Entries whose owner the pool lost (a daemon
restart conflict, an eviction of the session) are dropped before a lookup: a miss, never a hit
on blocks that are no longer this worker's.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from vqpool.shared.pool import BlockPool
from vqpool.shared.protocol import PROMPT_CACHE_COUNTERS
from vqpool.worker.defaults import DEFAULT_PROMPT_CACHE_BYTES
from vqpool.worker.kv.cache import PooledSequence
from vqpool.worker.kv.disk_format import DiskEntryError
from vqpool.worker.kv.disk_store import DiskEntry
from vqpool.worker.kv.disk_writer import DiskWriter
from vqpool.worker.kv.prefix_index import (
    block_keys,
    index_add,
    index_remove,
    longest_match,
    prefixes_of,
)
from vqpool.worker.kv.quantized import (
    KVBuffer,
    QuantizedBlockStorage,
    buffer_slots,
    buffer_write,
    prefix,
)
from vqpool.worker.kv.storage import MLXBlockStorage, SequenceBuffers

log = logging.getLogger("vqpool.worker")


@dataclass(eq=False)
class CacheEntry:
    """One cached token sequence and the pool sequence holding its KV (its last block may be
    partly filled; ``keys`` are those of its whole blocks)."""

    number: int
    tokens: tuple[int, ...]
    keys: list[int]
    sequence: PooledSequence
    nbytes: int
    n_blocks: int


class PromptCache:
    """Cached KV of one model's token sequences in pool blocks (see the module docstring).

    Args:
        pool: Where entry blocks come from (the worker's ``PoolClient``, or a local allocator).
        storage: The worker's storage for this model (requests' sequences live there too).
        owner_prefix: Entry owner ids are ``{owner_prefix}-cache-{n}``.
        max_bytes: Most bytes the entries may hold; 0 keeps nothing.
        report: Called with the counters (:data:`PROMPT_CACHE_COUNTERS`) after each change, without
            blocking (``PoolClient.report_prompt_cache`` sends them with the next heartbeat).
        lost_owners: The pool's owners that are no longer this worker's (``PoolClient``).
        quantized_storage: Where entries of quantized KV (``--kv-bits``) live, in blocks of the
            quantized format; None when the model's KV is never quantized.
        disk: The disk tier (``--kv-disk-dir``): evicted entries are written there, and a
            prompt that misses here and hits there is loaded back (:meth:`prefetch`).
    """

    def __init__(
        self,
        pool: BlockPool,
        storage: MLXBlockStorage,
        *,
        owner_prefix: str,
        max_bytes: int = DEFAULT_PROMPT_CACHE_BYTES,
        report: Callable[[dict[str, int]], None] | None = None,
        lost_owners: Callable[[], Mapping[Any, str]] | None = None,
        quantized_storage: QuantizedBlockStorage | None = None,
        disk: DiskWriter | None = None,
    ) -> None:
        if max_bytes < 0:
            raise ValueError(f"PromptCache: max_bytes must be >= 0, got {max_bytes}")
        self.pool = pool
        self.storage = storage
        self.quantized_storage = quantized_storage
        self.owner_prefix = owner_prefix
        self.max_bytes = max_bytes
        self.block_size = storage.layout.block_size
        self._report = report
        self._lost_owners = lost_owners
        self._lock = threading.Lock()
        self._numbers = itertools.count(1)
        self._lru: OrderedDict[int, CacheEntry] = OrderedDict()  # least recently used first
        self._index: dict[int, dict[CacheEntry, None]] = {}
        self.nbytes = 0
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "lookups",
                "hits",
                "tokens_reused",
                "tokens_prefilled",
                "evictions",
                "stores",
                "stores_skipped",
                "superseded",
                "disk_hit_tokens",
            ),
            0,
        )
        self._disk = disk
        # Disk loads evaluate MLX arrays on a thread of their own, never the generation thread
        # nor the short-lived HTTP threads (MLX wants a thread's streams cleared before it ends).
        self._reader = (
            None
            if disk is None
            else ThreadPoolExecutor(max_workers=1, thread_name_prefix="vqpool-kv-disk-reader")
        )

    # -- lookups ---------------------------------------------------------------------------------

    def _match(self, tokens: Sequence[int], max_tokens: int) -> tuple[CacheEntry | None, int]:
        """The entry holding the longest prefix of ``tokens`` (at most ``max_tokens``, at least
        one whole block) and that prefix's length; (None, 0) when none. The caller holds the
        lock."""
        return longest_match(self._index, tokens, max_tokens, self.block_size)

    @property
    def disk(self) -> DiskWriter | None:
        """The disk tier's writer (its ``store`` holds the files), or None."""
        return self._disk

    def prefetch(self, prompt: Sequence[int]) -> int:
        """Before a request is queued (on its HTTP thread): when the disk tier holds a longer
        prefix of ``prompt`` than memory does, read it back into a new entry in pool blocks,
        so that the request's :meth:`reuse` finds it. Returns the tokens loaded (0: none). The
        read runs on the disk reader thread; the generation thread never waits for it. A file
        that fails its checks, or a pool too short for the entry, is a miss, never an error."""
        if self._disk is None or self._reader is None or self.max_bytes == 0:
            return 0
        max_tokens = len(prompt) - 1
        with self._lock:
            self._drop_lost()
            _, in_memory = self._match(prompt, max_tokens)
        found, n = self._disk.store.match(prompt, max_tokens)
        if found is None or n <= in_memory:
            return 0
        try:
            loaded = self._reader.submit(self._load_from_disk, found).result()
        except Exception:
            log.exception("prompt cache: loading an entry from disk failed")
            return 0
        if not loaded:
            return 0
        with self._lock:
            self.counters["disk_hit_tokens"] += n
        self.report()
        return n

    def _load_from_disk(self, found: DiskEntry) -> bool:
        """The disk reader thread's half of :meth:`prefetch`: whether ``found`` is in memory
        now."""
        assert self._disk is not None
        arrays = self._disk.store.load(found)
        if arrays is None:
            return False
        mx.eval(list(arrays.values()))
        tokens = found.tokens
        n_blocks = -(-len(tokens) // self.block_size)
        storage = self.storage
        if any(name.count(".") == 2 for name in arrays):  # (packed, scales, biases) parts
            if self.quantized_storage is None:
                return False  # written by a worker that quantized: not this one's KV
            storage = self.quantized_storage
        need = n_blocks * (storage.bytes_per_block("k") + storage.bytes_per_block("v"))
        if need > self.max_bytes:
            return False
        with self._lock:
            entry, held = self._match(tokens, len(tokens))
            if entry is not None and held == len(tokens):
                self._lru.move_to_end(entry.number)
                return True
            while self._lru and self.nbytes + need > self.max_bytes:
                self._evict(next(iter(self._lru.values())))
            created = self._create(
                tokens, n_blocks, need, storage, lambda buffers: _install(buffers, arrays)
            )
        self.report()
        return created

    def cached_prefix_length(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of ``tokens`` (at most all but the last) :meth:`reuse` would
        give now; no counter changes."""
        with self._lock:
            self._drop_lost()
            return self._match(tokens, len(tokens) - 1)[1]

    def touch(self, tokens: Sequence[int]) -> None:
        """Make the entry :meth:`reuse` would take for ``tokens`` the most recently used: a
        preempted request about to resume reserves its memory first, and a refused reservation
        takes the other entries before the one it is about to reuse."""
        with self._lock:
            self._drop_lost()
            entry, _ = self._match(tokens, len(tokens) - 1)
            if entry is not None:
                self._lru.move_to_end(entry.number)

    def reuse(self, prompt: Sequence[int], cache: Sequence[Any]) -> int:
        """Copy the longest cached prefix of ``prompt`` into ``cache`` (a fresh per-layer mlx-lm
        cache list, empty, backed for the prompt) and return its length in tokens (0: a miss).

        The request then prefills ``prompt[n:]``. The copy is evaluated before this returns, so
        the entry may be evicted at once after.
        """
        with self._lock:
            self._drop_lost()
            self.counters["lookups"] += 1
            entry, n = self._match(prompt, len(prompt) - 1)
            if entry is not None:
                buffers = entry.sequence.buffers
                for i, layer in enumerate(cache):
                    layer.update_and_fetch(prefix(buffers.keys[i], n), prefix(buffers.values[i], n))
                mx.eval([layer.state for layer in cache])
                self._lru.move_to_end(entry.number)
                self.counters["hits"] += 1
                self.counters["tokens_reused"] += n
            self.counters["tokens_prefilled"] += len(prompt) - n
        self.report()
        return n

    # -- stores ----------------------------------------------------------------------------------

    def store(self, tokens: Sequence[int], layers: Sequence[tuple[KVBuffer, KVBuffer]]) -> bool:
        """Keep the KV of ``tokens``: ``layers`` is (keys, values) per layer, shaped
        (1, n_kv_heads, T, head_dim), position i holding token i (mlx-lm's ``state`` of a
        cache; quantized triples of T slots each once ``--kv-bits`` quantized them, kept in
        quantized blocks). The first min(T, len(tokens)) tokens are kept (at least one whole
        block, else nothing). Whether a new entry was made (not when an entry holds them all,
        nothing is kept, or the pool is short: a store never waits for memory and never fails
        the caller).
        """
        if not layers or self.max_bytes == 0:
            return False
        first = layers[0][0]
        storage: MLXBlockStorage = self.storage
        if isinstance(first, tuple):
            if self.quantized_storage is None:
                return False  # not a quantizing model's KV: nowhere to keep it
            storage = self.quantized_storage
        n = min(len(tokens), buffer_slots(first))
        if n < self.block_size:
            return False
        kept = tuple(tokens[:n])
        n_blocks = -(-n // self.block_size)
        need = n_blocks * (storage.bytes_per_block("k") + storage.bytes_per_block("v"))
        with self._lock:
            entry, held = self._match(kept, n)
            if entry is not None and held == n:
                self._lru.move_to_end(entry.number)
                return False
            if need > self.max_bytes:
                self.counters["stores_skipped"] += 1
                return False
            while self._lru and self.nbytes + need > self.max_bytes:
                self._evict(next(iter(self._lru.values())))
            created = self._create(
                kept, n_blocks, need, storage, lambda buffers: _copy(buffers, layers, n)
            )
        self.report()
        return created

    def _create(
        self,
        tokens: tuple[int, ...],
        n_blocks: int,
        need: int,
        storage: MLXBlockStorage,
        fill: Callable[[SequenceBuffers], None],
    ) -> bool:
        """A new entry for ``tokens`` in ``storage``, its buffers filled by ``fill`` (a copy of
        their KV, or arrays read from disk); the caller holds the lock."""
        n = len(tokens)
        number = next(self._numbers)
        try:
            owner = f"{self.owner_prefix}-cache-{number}"
            sequence = PooledSequence(self.pool, owner, storage)
            try:
                # Never waits and never reclaims: an entry takes no memory from anyone.
                sequence.reserve_exactly(n_blocks)
                fill(sequence.buffers)
                sequence.offsets = [n] * len(sequence.offsets)
                sequence.sync_usage(n)  # the last block's fill, when partial
            except BaseException:
                sequence.release()
                raise
        except Exception as exc:  # the pool is short (or gone): the request is not affected
            log.debug("prompt cache: not storing %d tokens: %s", n, exc)
            self.counters["stores_skipped"] += 1
            return False
        keys = block_keys(tokens, n // self.block_size, self.block_size)
        entry = CacheEntry(number, tokens, keys, sequence, need, n_blocks)
        self._lru[number] = entry
        index_add(self._index, entry, keys)
        self.nbytes += need
        self.counters["stores"] += 1
        # Entries whose tokens are a prefix of these answer no lookup the new one does not.
        for older in prefixes_of(self._index, tokens, keys, self.block_size):
            self._remove(older)
            self.counters["superseded"] += 1
        return True

    # -- giving memory back ----------------------------------------------------------------------

    def _remove(self, entry: CacheEntry) -> int:
        """Forget ``entry`` and give its blocks back; its bytes. The caller holds the lock."""
        del self._lru[entry.number]
        index_remove(self._index, entry, entry.keys)
        self.nbytes -= entry.nbytes
        try:
            entry.sequence.release()
        except Exception as exc:  # the storage dropped the memory; the daemon reclaims the rest
            log.warning("prompt cache: releasing %s failed: %s", entry.sequence.owner, exc)
        return entry.nbytes

    def _evict(self, entry: CacheEntry) -> int:
        """Give ``entry`` back, written to the disk tier first (unless it holds its tokens)."""
        self.counters["evictions"] += 1
        if self._disk is not None and not self._disk.store.holds(entry.tokens):
            # The arrays stay alive (not charged) until written: the queue bounds them.
            self._disk.submit(entry.tokens, named_arrays(entry.sequence.buffers), entry.nbytes)
        return self._remove(entry)

    def release_bytes(self, n_bytes: int) -> int:
        """Give back entries, least recently used first, until ``n_bytes`` are freed (or none is
        left); the bytes freed."""
        with self._lock:
            freed = 0
            while self._lru and freed < n_bytes:
                freed += self._evict(next(iter(self._lru.values())))
        if freed:
            log.info("prompt cache: released %d bytes for memory asked elsewhere", freed)
            self.report()
        return freed

    def drop(self, disk: bool = False) -> int:
        """Give back every entry (written to the disk tier, unless ``disk``: then the disk
        tier's entries are removed too); the bytes of memory freed."""
        with self._lock:
            if disk and self._disk is not None:
                freed = sum(self._remove(entry) for entry in list(self._lru.values()))
            else:
                freed = sum(self._evict(entry) for entry in list(self._lru.values()))
        if disk and self._disk is not None:
            self._disk.flush()
            self._disk.store.drop()
        self.report()
        return freed

    def close(self, timeout: float = 120.0) -> None:
        """The worker stops: write every entry the disk tier lacks (least recently used first,
        so the newest stay under its cap), then end the disk threads. Nothing without one."""
        if self._disk is None or self._reader is None:
            return
        with self._lock:
            entries = list(self._lru.values())
        self._disk.flush(timeout)
        for entry in entries:
            if not self._disk.store.holds(entry.tokens):
                try:
                    arrays = named_arrays(entry.sequence.buffers)
                    self._disk.store.put(entry.tokens, arrays, entry.nbytes)
                except Exception as exc:
                    log.warning("prompt cache: writing an entry at exit failed: %s", exc)
        self._disk.close(timeout)
        self._reader.submit(mx.clear_streams).result()
        self._reader.shutdown()

    def follow_advice(self, advice: Mapping[str, Any]) -> None:
        """What the daemon's answer to a load report asks: ``drop_cache`` (``vqpoolctl cache
        drop``) gives every entry back, ``release_bytes`` (memory is wanted elsewhere) that many
        bytes, least recently used first."""
        if advice.get("drop_cache"):
            freed = self.drop(disk=bool(advice.get("drop_disk")))
            log.info("prompt cache dropped on the daemon's request: %d bytes freed", freed)
        elif isinstance(advice.get("release_bytes"), int) and advice["release_bytes"] > 0:
            self.release_bytes(advice["release_bytes"])

    def _drop_lost(self) -> None:
        """Drop entries whose owner the pool lost; the caller holds the lock."""
        lost = self._lost_owners() if self._lost_owners is not None else None
        if not lost:
            return
        for entry in list(self._lru.values()):
            if entry.sequence.owner in lost:
                log.warning("prompt cache: entry %s was lost: dropped", entry.sequence.owner)
                self._evict(entry)

    # -- reading ---------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, int]:
        """Counters and levels: ``bytes``, ``blocks`` (K and V counted apart, as the daemon
        does), ``entries``, ``max_bytes``, and the counters (lookups, hits, tokens_reused,
        tokens_prefilled, evictions, stores, stores_skipped, superseded)."""
        with self._lock:
            streams = 2 if self.storage.separate_kv else 1
            return {
                "bytes": self.nbytes,
                "blocks": streams * sum(e.n_blocks for e in self._lru.values()),
                "entries": len(self._lru),
                "max_bytes": self.max_bytes,
                **self.counters,
                **self._disk_snapshot(),
            }

    def _disk_snapshot(self) -> dict[str, int]:
        if self._disk is None:
            return dict.fromkeys(DISK_FIGURES, 0)
        store = self._disk.store.snapshot()
        return {
            "disk_bytes": store["bytes"],
            "disk_entries": store["entries"],
            "disk_max_bytes": self._disk.store.max_bytes,
            "disk_reads": store["reads"],
            "disk_writes": store["writes"],
            "disk_dropped_writes": self._disk.dropped,
            "disk_removed_bad": store["removed_bad"],
            "disk_evictions": store["evictions"],
        }

    def report(self) -> None:
        """Pass the counters the daemon shows to ``report`` (if any)."""
        if self._report is not None:
            snapshot = self.snapshot()
            self._report({name: snapshot[name] for name in PROMPT_CACHE_COUNTERS})


DISK_FIGURES = (
    "disk_bytes",
    "disk_entries",
    "disk_max_bytes",
    "disk_reads",
    "disk_writes",
    "disk_dropped_writes",
    "disk_removed_bad",
    "disk_evictions",
)
"""What :meth:`PromptCache.snapshot` says of the disk tier (zeros without one)."""

# The arrays a sequence's buffers hold for its blocks, one per layer each; a block format with
# more arrays per block lists them here, and the disk tier writes and reads them all by name.
BUFFER_FIELDS = ("keys", "values")


def named_arrays(buffers: SequenceBuffers) -> dict[str, mx.array]:
    """Every array of ``buffers``, by name: ``keys.0``, ``values.0``, ... per layer, and
    ``keys.0.0``, ``keys.0.1``, ``keys.0.2`` for the (packed, scales, biases) parts of a
    quantized layer."""
    named: dict[str, mx.array] = {}
    for field in BUFFER_FIELDS:
        for i, buf in enumerate(getattr(buffers, field)):
            if isinstance(buf, tuple):
                named.update((f"{field}.{i}.{j}", part) for j, part in enumerate(buf))
            else:
                named[f"{field}.{i}"] = buf
    return named


def _copy(buffers: SequenceBuffers, layers: Sequence[tuple[KVBuffer, KVBuffer]], n: int) -> None:
    """Fill an entry's fresh buffers with the KV of its ``n`` tokens, position i holding token
    i."""
    slots = (Ellipsis, slice(0, n), slice(None))
    for i, (layer_keys, layer_values) in enumerate(layers):
        buffer_write(buffers.keys[i], slots, prefix(layer_keys, n))
        buffer_write(buffers.values[i], slots, prefix(layer_values, n))
    mx.eval(buffers.keys, buffers.values)


def _install(buffers: SequenceBuffers, arrays: Mapping[str, mx.array]) -> None:
    """Make arrays read from disk an entry's fresh buffers (same names, shapes and dtypes).

    Raises:
        DiskEntryError: They do not match (the fingerprint should have said so).
    """
    expected = named_arrays(buffers)
    if expected.keys() != arrays.keys():
        raise DiskEntryError(f"arrays {sorted(arrays)} where {sorted(expected)} were expected")
    for name, array in arrays.items():
        if array.shape != expected[name].shape or array.dtype != expected[name].dtype:
            want = expected[name]
            raise DiskEntryError(
                f"{name} is {array.shape} {array.dtype}, not {want.shape} {want.dtype}"
            )
    for field in BUFFER_FIELDS:
        layers = getattr(buffers, field)
        for i, buf in enumerate(layers):
            if isinstance(buf, tuple):
                layers[i] = tuple(arrays[f"{field}.{i}.{j}"] for j in range(len(buf)))
            else:
                layers[i] = arrays[f"{field}.{i}"]
