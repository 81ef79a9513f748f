"""The prompt cache's disk entry file, and the model fingerprint that says which files a worker
may use.

One file holds one cached token sequence: its token ids and the arrays the storage holds for
its blocks, by name (``keys.0``, ``values.0``, ...; whatever arrays a block format has), each
as raw bytes with its dtype and shape::

    MAGIC (8 bytes) | header length, header CRC-32 (4 bytes each, little endian) | header (JSON)
    | payload

The header says the format version, the model fingerprint, the token ids, each array's name,
dtype and shape, the payload's length and its CRC-32; its own CRC-32 covers it (a damaged token
id must not make a file answer for tokens it was not computed from). A file is written to a
temporary name in the same directory, flushed, fsynced and renamed, so a writer killed at any
point leaves either no file under the final name or a whole one. A reader checks everything
before it trusts a file (:func:`read_entry` raises :class:`DiskEntryError`): magic, version,
lengths (a truncated file), both checksums (a corrupted header or payload), the fingerprint
(another model, version, layout, dtype, block size or format), the token ids the caller
expects, and every array's dtype, shape and size.

The fingerprint (:func:`model_fingerprint`) is a SHA-256 of the model's configuration, a sample
of every weight (name, shape, dtype and CRC-32s of its first, middle and last 4 KiB: another
checkpoint or fine-tune differs there), the KV layout (layers, heads, head sizes, dtype, block
size, block format, K/V streams) and this file format's version.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from vqpool.shared.kv_disk import TEMP_SUFFIX
from vqpool.worker.kv.storage import KVLayout

MAGIC = b"VQKVDSK\x00"
FORMAT_VERSION = 1
_LENGTH = struct.Struct("<II")  # header length, header CRC-32
_MAX_HEADER_BYTES = 64 << 20
_SAMPLE_BYTES = 4096
_READ_CHUNK = 4 << 20

# Array dtypes a file may hold, by name: read as unsigned ints of the same size, then viewed.
_DTYPES: dict[str, mx.Dtype] = {
    str(dtype).removeprefix("mlx.core."): dtype
    for dtype in (
        mx.float32,
        mx.float16,
        mx.bfloat16,
        mx.uint8,
        mx.uint16,
        mx.uint32,
        mx.int8,
        mx.int16,
        mx.int32,
    )
}


class DiskEntryError(Exception):
    """A file that is not a usable entry: truncated, corrupt, foreign, or not what was asked."""


@dataclass(frozen=True)
class ArraySpec:
    """One array of an entry: its name, dtype name and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = _DTYPES[self.dtype].size
        for dim in self.shape:
            n *= dim
        return n


@dataclass(frozen=True)
class EntryHeader:
    """What a file's header says."""

    fingerprint: str
    tokens: tuple[int, ...]
    arrays: tuple[ArraySpec, ...]
    payload_bytes: int
    checksum: int
    payload_offset: int


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def write_entry(
    path: Path,
    fingerprint: str,
    tokens: Sequence[int],
    arrays: Mapping[str, mx.array],
    before_rename: Callable[[Path], None] | None = None,
) -> int:
    """Write an entry file at ``path`` (temporary name, fsync, rename); its size in bytes.
    ``arrays`` must be evaluated (their bytes are read as they are). ``before_rename`` (tests)
    is called with the temporary path once it is written and synced."""
    views = {name: _bytes_of(array) for name, array in arrays.items()}
    checksum = 0
    for view in views.values():
        checksum = zlib.crc32(view, checksum)
    header = json.dumps(
        {
            "version": FORMAT_VERSION,
            "fingerprint": fingerprint,
            "tokens": list(tokens),
            "arrays": [
                {"name": name, "dtype": dtype_name(array.dtype), "shape": list(array.shape)}
                for name, array in arrays.items()
            ],
            "payload_bytes": sum(view.nbytes for view in views.values()),
            "crc32": checksum,
        },
        separators=(",", ":"),
    ).encode()
    temp = path.with_name(f".{path.name}.{os.getpid()}{TEMP_SUFFIX}")
    try:
        with open(temp, "wb") as out:
            out.write(MAGIC)
            out.write(_LENGTH.pack(len(header), zlib.crc32(header)))
            out.write(header)
            for view in views.values():
                out.write(view)
            out.flush()
            os.fsync(out.fileno())
            size = out.tell()
        if before_rename is not None:
            before_rename(temp)
        os.rename(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    _sync_directory(path.parent)
    return size


def _sync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (best effort where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _bytes_of(array: mx.array) -> memoryview:
    """The bytes of an evaluated array, row-major (MLX arrays export the buffer protocol)."""
    view = memoryview(cast(Any, array))
    if not view.c_contiguous:
        view = memoryview(cast(Any, mx.contiguous(array)))
    return view.cast("B")


def read_header(path: Path) -> EntryHeader:
    """The header of the file at ``path``, checked against the file's length.

    Raises:
        DiskEntryError: Not an entry of this format, or truncated.
        OSError: The file cannot be read.
    """
    with open(path, "rb") as src:
        head = src.read(len(MAGIC) + _LENGTH.size)
        if len(head) < len(MAGIC) + _LENGTH.size or head[: len(MAGIC)] != MAGIC:
            raise DiskEntryError("not an entry file (bad magic or too short)")
        length, header_crc = _LENGTH.unpack(head[len(MAGIC) :])
        if length > _MAX_HEADER_BYTES:
            raise DiskEntryError(f"header of {length} bytes")
        raw = src.read(length)
        size = os.fstat(src.fileno()).st_size
    if len(raw) < length:
        raise DiskEntryError("truncated header")
    if zlib.crc32(raw) != header_crc:
        raise DiskEntryError("header checksum mismatch (corrupt header)")
    header = _parse_header(raw, len(head) + length)
    if size != header.payload_offset + header.payload_bytes:
        raise DiskEntryError(
            f"file is {size} bytes, its header says {header.payload_offset + header.payload_bytes}"
        )
    return header


def _parse_header(raw: bytes, payload_offset: int) -> EntryHeader:
    try:
        doc: Any = json.loads(raw)
        if doc["version"] != FORMAT_VERSION:
            raise DiskEntryError(f"format version {doc['version']!r}, not {FORMAT_VERSION}")
        tokens = tuple(int(t) for t in doc["tokens"])
        arrays = tuple(
            ArraySpec(str(a["name"]), str(a["dtype"]), tuple(int(d) for d in a["shape"]))
            for a in doc["arrays"]
        )
        header = EntryHeader(
            fingerprint=str(doc["fingerprint"]),
            tokens=tokens,
            arrays=arrays,
            payload_bytes=int(doc["payload_bytes"]),
            checksum=int(doc["crc32"]),
            payload_offset=payload_offset,
        )
    except DiskEntryError:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise DiskEntryError(f"unreadable header: {exc}") from None
    unknown = sorted({a.dtype for a in arrays} - set(_DTYPES))
    if unknown:
        raise DiskEntryError(f"unknown dtype(s) {unknown}")
    if sum(a.nbytes for a in arrays) != header.payload_bytes:
        raise DiskEntryError("the arrays' sizes do not add up to the payload's")
    return header


def read_entry(
    path: Path, fingerprint: str, tokens: Sequence[int]
) -> tuple[EntryHeader, dict[str, mx.array]]:
    """The header and arrays of the entry at ``path``, checked to be this model's entry for
    exactly ``tokens`` (the arrays are lazy views of freshly read bytes).

    Raises:
        DiskEntryError: The file is truncated, corrupt, of another model, or for other tokens.
        OSError: The file cannot be read.
    """
    header = read_header(path)
    if header.fingerprint != fingerprint:
        raise DiskEntryError("written for another model, version or cache layout")
    if header.tokens != tuple(tokens):
        raise DiskEntryError("its token ids are not the ones indexed")
    payload = bytearray(header.payload_bytes)
    view = memoryview(payload)
    checksum = 0
    done = 0
    with open(path, "rb") as src:
        src.seek(header.payload_offset)
        # In chunks, each checksummed while it is still in the CPU's caches.
        while done < header.payload_bytes:
            got = src.readinto(view[done : done + _READ_CHUNK])
            if not got:
                raise DiskEntryError("truncated payload")
            checksum = zlib.crc32(view[done : done + got], checksum)
            done += got
    if checksum != header.checksum:
        raise DiskEntryError("checksum mismatch (corrupt payload)")
    arrays: dict[str, mx.array] = {}
    offset = 0
    for spec in header.arrays:
        dtype = _DTYPES[spec.dtype]
        raw = np.frombuffer(
            payload, dtype=f"<u{dtype.size}", count=spec.nbytes // dtype.size, offset=offset
        )
        arrays[spec.name] = mx.array(raw.reshape(spec.shape)).view(dtype)
        offset += spec.nbytes
    return header, arrays


def model_fingerprint(
    model: nn.Module, layout: KVLayout, separate_kv: bool, quantized_format: str | None = None
) -> str:
    """Which model, weights and KV layout an entry belongs to (see the module docstring);
    ``quantized_format``: the format tag a worker quantizing its KV (``--kv-bits``) holds
    sequences in past ``--quantized-kv-start``."""
    digest = hashlib.sha256()
    digest.update(
        json.dumps(
            {
                "file_format": FORMAT_VERSION,
                "config": repr(getattr(model, "args", None)),
                "layout": {
                    "n_layers": layout.n_layers,
                    "n_kv_heads": layout.n_kv_heads,
                    "k_head_dim": layout.k_head_dim,
                    "v_head_dim": layout.v_head_dim,
                    "dtype": dtype_name(layout.dtype),
                    "block_size": layout.block_size,
                    "format": layout.format,
                    "quantized_format": quantized_format,
                    "separate_kv": separate_kv,
                },
            },
            sort_keys=True,
        ).encode()
    )
    params = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    for name, param in sorted(params, key=lambda item: item[0]):
        raw = np.frombuffer(_bytes_of(param), dtype=np.uint8)
        middle = max(0, raw.size // 2 - _SAMPLE_BYTES // 2)
        samples = (raw[:_SAMPLE_BYTES], raw[middle : middle + _SAMPLE_BYTES], raw[-_SAMPLE_BYTES:])
        crcs = [zlib.crc32(sample.tobytes()) for sample in samples]
        digest.update(f"{name}|{param.shape}|{param.dtype}|{crcs}\n".encode())
    return digest.hexdigest()
