"""The prompt cache's entries on disk: one directory per model, capped in bytes, least recently
used evicted first.

:class:`DiskStore` indexes the entry files of one model's directory by their tokens' block chain
keys (:mod:`~vqpool.worker.kv.prefix_index`), as the memory tier indexes its entries, so a
lookup is a few dict looks and reads no file. At start it reads every file's header: temporary
files (a writer died before its rename), unreadable or truncated files and files of another
model fingerprint (another model, version or layout) are removed and logged, never used. Least
recently used is the file's modification time, set again on each hit, so the order survives a
restart. :meth:`load` reads and checks an entry (:func:`~vqpool.worker.kv.disk_format.read_entry`):
a file that fails is removed and logged and the lookup is a miss, never an error.

Thread-safe: one lock guards the index; file reads and writes happen outside it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from vqpool.shared.kv_disk import ENTRY_SUFFIX, TEMP_SUFFIX
from vqpool.worker.kv.disk_format import (
    DiskEntryError,
    read_entry,
    read_header,
    write_entry,
)
from vqpool.worker.kv.prefix_index import (
    block_keys,
    index_add,
    index_remove,
    longest_match,
    prefixes_of,
)

log = logging.getLogger("vqpool.worker")


@dataclass(eq=False)
class DiskEntry:
    """One entry file: its path, token ids, whole-block keys and size in bytes."""

    path: Path
    tokens: tuple[int, ...]
    keys: list[int]
    nbytes: int


class DiskStore:
    """One model's entry files in ``directory``, at most ``max_bytes`` of them (see the module
    docstring).

    Args:
        directory: The model's own directory (made if missing).
        max_bytes: Most bytes of entry files kept; 0 keeps none.
        fingerprint: The model's (:func:`~vqpool.worker.kv.disk_format.model_fingerprint`).
        block_size: Token slots per block.
    """

    def __init__(self, directory: Path, max_bytes: int, fingerprint: str, block_size: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"DiskStore: max_bytes must be >= 0, got {max_bytes}")
        self.directory = directory
        self.max_bytes = max_bytes
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.before_rename: Callable[[Path], None] | None = None
        """Tests: called with a write's temporary path before its rename."""
        self._lock = threading.Lock()
        self._lru: OrderedDict[Path, DiskEntry] = OrderedDict()  # least recently used first
        self._index: dict[int, dict[DiskEntry, None]] = {}
        self.nbytes = 0
        self.counters: dict[str, int] = dict.fromkeys(
            ("reads", "writes", "removed_bad", "evictions"), 0
        )
        directory.mkdir(parents=True, exist_ok=True)
        self._scan()

    # -- start ----------------------------------------------------------------------------------

    def _scan(self) -> None:
        found: list[tuple[float, DiskEntry]] = []
        for path in self.directory.iterdir():
            if path.name.endswith(TEMP_SUFFIX):
                self._discard(path, "an unfinished write (its writer stopped before the rename)")
                continue
            if not path.name.endswith(ENTRY_SUFFIX) or not path.is_file():
                continue
            try:
                header = read_header(path)
                stat = path.stat()
            except (DiskEntryError, OSError) as exc:
                self._discard(path, str(exc))
                continue
            if header.fingerprint != self.fingerprint:
                self._discard(path, "written for another model, version or cache layout")
                continue
            found.append((stat.st_mtime, self._entry(path, header.tokens, stat.st_size)))
        with self._lock:
            for _, entry in sorted(found, key=lambda item: item[0]):
                self._add(entry)
            self._evict_to(self.max_bytes)
        if found:
            log.info(
                "prompt cache on disk: %d entries, %d bytes in %s",
                len(self._lru),
                self.nbytes,
                self.directory,
            )

    def _entry(self, path: Path, tokens: tuple[int, ...], nbytes: int) -> DiskEntry:
        keys = block_keys(tokens, len(tokens) // self.block_size, self.block_size)
        return DiskEntry(path, tokens, keys, nbytes)

    def _discard(self, path: Path, why: str) -> None:
        log.warning("prompt cache on disk: removed %s: %s", path.name, why)
        self.counters["removed_bad"] += 1
        path.unlink(missing_ok=True)

    # -- lookups --------------------------------------------------------------------------------

    def match(self, tokens: Sequence[int], max_tokens: int) -> tuple[DiskEntry | None, int]:
        """The entry holding the longest prefix of ``tokens`` (at most ``max_tokens``, at least
        one whole block) and its length; (None, 0) when none. Reads no file."""
        with self._lock:
            return longest_match(self._index, tokens, max_tokens, self.block_size)

    def load(self, entry: DiskEntry) -> dict[str, mx.array] | None:
        """The arrays of ``entry``, checked (None: the file failed a check or is gone; it is
        removed and logged). A hit makes it the most recently used."""
        try:
            _, arrays = read_entry(entry.path, self.fingerprint, entry.tokens)
        except (DiskEntryError, OSError) as exc:
            with self._lock:
                if self._lru.get(entry.path) is entry:
                    self._remove(entry)
                    self._discard(entry.path, str(exc))
            return None
        with self._lock:
            self.counters["reads"] += 1
            if self._lru.get(entry.path) is entry:
                self._lru.move_to_end(entry.path)
        with contextlib.suppress(OSError):
            os.utime(entry.path)
        return arrays

    # -- writes ---------------------------------------------------------------------------------

    def path_for(self, tokens: Sequence[int]) -> Path:
        digest = hashlib.sha256(self.fingerprint.encode())
        digest.update(b"".join(t.to_bytes(4, "little") for t in tokens))
        return self.directory / f"{digest.hexdigest()[:40]}{ENTRY_SUFFIX}"

    def holds(self, tokens: Sequence[int]) -> bool:
        """Whether an entry holds all of ``tokens`` already."""
        found, n = self.match(tokens, len(tokens))
        return found is not None and n == len(tokens)

    def put(self, tokens: Sequence[int], arrays: Mapping[str, mx.array], nbytes: int) -> bool:
        """Write an entry for ``tokens`` (``arrays`` evaluated, ``nbytes`` their size); whether
        one was written (not when an entry holds them all, or it is larger than the cap).
        Least recently used entries are removed first to keep the cap; entries whose tokens are
        a prefix of these are removed after (this one answers every lookup they did)."""
        kept = tuple(tokens)
        if nbytes > self.max_bytes or self.holds(kept):
            return False
        with self._lock:
            self._evict_to(self.max_bytes - nbytes)
        path = self.path_for(kept)
        size = write_entry(path, self.fingerprint, kept, arrays, self.before_rename)
        entry = self._entry(path, kept, size)
        with self._lock:
            older = self._lru.get(path)
            if older is not None:
                self._remove(older)
            self._add(entry)
            self.counters["writes"] += 1
            for prefix in prefixes_of(self._index, kept, entry.keys, self.block_size):
                self._remove(prefix)
                prefix.path.unlink(missing_ok=True)
            self._evict_to(self.max_bytes)
        return True

    # -- the index (the caller holds the lock) -------------------------------------------------

    def _add(self, entry: DiskEntry) -> None:
        self._lru[entry.path] = entry
        index_add(self._index, entry, entry.keys)
        self.nbytes += entry.nbytes

    def _remove(self, entry: DiskEntry) -> None:
        del self._lru[entry.path]
        index_remove(self._index, entry, entry.keys)
        self.nbytes -= entry.nbytes

    def _evict_to(self, n_bytes: int) -> None:
        while self._lru and self.nbytes > n_bytes:
            entry = next(iter(self._lru.values()))
            self._remove(entry)
            entry.path.unlink(missing_ok=True)
            self.counters["evictions"] += 1

    def drop(self) -> int:
        """Remove every entry file; the bytes freed."""
        with self._lock:
            freed = self.nbytes
            for entry in list(self._lru.values()):
                self._remove(entry)
                entry.path.unlink(missing_ok=True)
        log.info("prompt cache on disk: dropped %d bytes in %s", freed, self.directory)
        return freed

    def snapshot(self) -> dict[str, int]:
        """``bytes``, ``entries`` and the counters (reads, writes, removed_bad, evictions)."""
        with self._lock:
            return {"bytes": self.nbytes, "entries": len(self._lru), **self.counters}
