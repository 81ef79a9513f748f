"""What a model's weights cost in bytes, known before any process loads it.

``estimate_weights(spec)`` takes what ``vqpool-worker --model`` takes:

* a local directory: the sum of the tensor sizes its ``model*.safetensors`` headers declare (the
  files mlx-lm's ``load`` reads). Only each file's header is read (8 bytes of length, then JSON);
  no tensor data. Quantized weights count as they load: the packed weights, their scales and
  biases are tensors in the files like any other.
* a Hugging Face id (``org/name``): the same, in the local Hugging Face cache's snapshot of its
  ``main`` revision (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``).
  Nothing is downloaded: an id not in the cache is unknown.
* ``builtin:NAME``: the built-in tiny model's parameter bytes, counted from its config.

Unknown (None): an id not cached, a directory without weights, or shards that a
``model.safetensors.index.json`` names but that are missing (a partial download). A header that
is not a safetensors header is a ValueError naming the file.

Used by the front door (no MLX in that process) and by the worker, so it imports neither MLX,
mlx-lm nor huggingface_hub.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vqpool.shared.tiny_configs import (
    BUILTIN_PARAMETER_BYTES,
    BUILTIN_PREFIX,
    TINY_CONFIGS,
    builtin_names,
    parameter_shapes,
)

SAFETENSORS_HEADERS = "safetensors headers"
BUILTIN_CONFIG = "built-in config"

WEIGHT_FILES = "model*.safetensors"
"""The files mlx-lm's ``load`` reads its weights from (``mlx_lm.utils.load_model``)."""
INDEX_FILE = "model.safetensors.index.json"

MAX_HEADER_BYTES = 100_000_000
"""The largest header accepted, as the safetensors library's own bound: a real header is a few
hundred bytes per tensor, so a larger length is a corrupt or foreign file, not one to read."""

# Bytes per element of each safetensors dtype.
DTYPE_BYTES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}

ADAPTER_WEIGHTS = "adapters.safetensors"
"""The file of LoRA adapters' weights in an adapter directory (mlx-lm's layout)."""

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclass(frozen=True)
class WeightsEstimate:
    """A model's weights before it loads.

    Attributes:
        nbytes: Bytes of all its weight tensors, as loaded (what its parameters' ``nbytes`` sum
            to once loaded).
        tensors: How many tensors (a built-in's: its parameter arrays).
        source: Where the numbers come from: :data:`SAFETENSORS_HEADERS` or
            :data:`BUILTIN_CONFIG`.
    """

    nbytes: int
    tensors: int
    source: str


MAX_SERVE_CACHE_LIMIT = 64 << 20
"""The most MLX buffer cache ``vqpool serve`` gives a worker by default: the worker's own
default (``--mlx-cache-limit``, 64 MiB)."""
SERVE_CACHE_SHARE = 8
"""``vqpool serve`` gives a worker an MLX buffer cache of its weights over this by default."""


RUNTIME_GROWTH = 8 << 20
"""Bytes a worker's runtime grows by while it serves, beyond its state when idle (Python
objects, request threads, the allocator's slack): charged in its overhead. scripts/bench_models.py
measured its workers' memory outside MLX at up to 7 MiB above an idle worker's."""


def worker_overhead(cache_limit: int) -> int:
    """The overhead a worker with an MLX buffer-cache limit of ``cache_limit`` bytes declares
    (``--charge-mlx-cache``): what it may hold beyond its weights and KV blocks, that limit
    plus :data:`RUNTIME_GROWTH`."""
    return cache_limit + RUNTIME_GROWTH


def serve_cache_limit(weights: int | None) -> int:
    """The MLX buffer-cache limit ``vqpool serve`` gives the worker of a model of ``weights``
    bytes (None: unknown) when its table sets none: an eighth of the weights, at most 64 MiB.
    It is charged with the weights (the worker's overhead), so it scales with the model: a
    decode step's transients, which the cache keeps for reuse, grow with the model too, and a
    tiny model's few MiB of weights do not carry 64 MiB of idle buffers."""
    if weights is None:
        return MAX_SERVE_CACHE_LIMIT
    return min(MAX_SERVE_CACHE_LIMIT, weights // SERVE_CACHE_SHARE)


def estimate_weights(spec: str) -> WeightsEstimate | None:
    """What the weights of the model ``spec`` names cost (see the module docstring); None when
    unknown.

    Raises:
        ValueError: A weight file's header is malformed (the message names the file).
        OSError: A weight file cannot be read.
    """
    if spec.startswith(BUILTIN_PREFIX):
        name = spec.removeprefix(BUILTIN_PREFIX)
        if name not in builtin_names():
            return None
        shapes = parameter_shapes(TINY_CONFIGS[name]).values()
        nbytes = sum(math.prod(shape) for shape in shapes) * BUILTIN_PARAMETER_BYTES
        return WeightsEstimate(nbytes, len(shapes), BUILTIN_CONFIG)
    directory = local_model_dir(spec)
    return None if directory is None else directory_weights(directory)


def local_model_dir(spec: str) -> Path | None:
    """The local directory of the model ``spec`` names: the directory itself, or a hub id's
    snapshot in the local cache; None for neither (a built-in, an id not cached)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if _HUB_ID.fullmatch(spec) and not path.exists():
        return cached_snapshot(spec)
    return None


def directory_weights(directory: Path) -> WeightsEstimate | None:
    """The weights in a model directory's ``model*.safetensors`` files; None when it has none or
    its index names a shard it lacks.

    Raises:
        ValueError: A malformed header.
    """
    files = sorted(directory.glob(WEIGHT_FILES))
    if not files or _missing_shards(directory):
        return None
    nbytes = tensors = 0
    for file in files:
        sizes = safetensors_tensor_bytes(file)
        nbytes += sum(sizes.values())
        tensors += len(sizes)
    return WeightsEstimate(nbytes, tensors, SAFETENSORS_HEADERS)


def _missing_shards(directory: Path) -> bool:
    index = directory / INDEX_FILE
    if not index.is_file():
        return False
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = set(weight_map.values())
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(
            f"{index}: not a safetensors index (no weight_map of tensor -> file)"
        ) from None
    return any(not (directory / shard).is_file() for shard in shards)


def safetensors_tensor_bytes(file: Path) -> dict[str, int]:
    """Each tensor's bytes in a safetensors file, from its header alone.

    Raises:
        ValueError: Not a safetensors header: shorter than its length field, a length over
            :data:`MAX_HEADER_BYTES` or past the end of the file, not a JSON object, or a tensor
            whose offsets do not match its dtype and shape or lie outside the file's data.
    """
    with open(file, "rb") as f:
        file_size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{file}: not a safetensors file (no 8-byte header length)")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES or 8 + length > file_size:
            raise ValueError(
                f"{file}: not a safetensors file (header length {length} in a file of "
                f"{file_size} bytes; at most {MAX_HEADER_BYTES})"
            )
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        raise ValueError(f"{file}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file}: not a safetensors file (its header is not a JSON object)")
    data_size = file_size - 8 - length
    return {
        name: _tensor_bytes(file, name, info, data_size)
        for name, info in header.items()
        if name != "__metadata__"
    }


def _tensor_bytes(file: Path, name: str, info: Any, data_size: int) -> int:
    try:
        dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        if not all(isinstance(n, int) and n >= 0 for n in (*shape, begin, end)):
            raise TypeError
    except (TypeError, KeyError, ValueError):
        raise ValueError(
            f"{file}: tensor {name!r} has no dtype, shape and data_offsets of non-negative ints"
        ) from None
    nbytes = end - begin
    if not 0 <= begin <= end <= data_size:
        raise ValueError(
            f"{file}: tensor {name!r} lies at bytes {begin}..{end}, outside the file's "
            f"{data_size} bytes of data (truncated?)"
        )
    element = DTYPE_BYTES.get(dtype)
    if element is not None and nbytes != math.prod(shape) * element:
        raise ValueError(
            f"{file}: tensor {name!r} of {dtype} {shape} should take "
            f"{math.prod(shape) * element} bytes, its offsets say {nbytes}"
        )
    return nbytes


def hub_cache_dir() -> Path:
    """Where the Hugging Face hub caches models, as huggingface_hub resolves it."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path("~/.cache/huggingface/hub").expanduser()


def cached_snapshot(repo_id: str, revision: str = "main") -> Path | None:
    """The local cache's snapshot directory of ``repo_id`` at ``revision``; None when not
    cached."""
    repo = hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))
    try:
        commit = (repo / "refs" / revision).read_text().strip()
    except OSError:
        return None
    snapshot = repo / "snapshots" / commit
    return snapshot if commit and snapshot.is_dir() else None
