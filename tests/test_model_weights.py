"""A model's weights known before it loads (vqpool.shared.model_weights), checked against what
really loads: the parameters' bytes after ``mlx_lm.load`` of a written directory (fp32, bf16,
quantized, sharded) and after the worker's ``load_model`` of each built-in, exactly. A malformed
header is a clear error; a model the machine does not have is unknown (None)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from vqpool.shared.model_weights import (
    BUILTIN_CONFIG,
    MAX_HEADER_BYTES,
    SAFETENSORS_HEADERS,
    estimate_weights,
)
from vqpool.shared.tiny_configs import BUILTIN_PREFIX, TINY_CONFIGS, builtin_names
from vqpool.worker.models.loading import load_model
from vqpool.worker.testing.model_dirs import ARCHITECTURES, write_config_dir


def loaded_parameters(model: Any) -> tuple[int, int]:
    """(bytes, arrays) of a loaded model's parameters."""
    flat = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    return sum(value.nbytes for _, value in flat), len(flat)


def mlx_lm_loaded(path: Path) -> tuple[int, int]:
    from mlx_lm import load

    model = load(str(path))[0]
    return loaded_parameters(model)


@pytest.mark.parametrize("name", builtin_names())
def test_builtin_estimate_is_its_parameters_bytes(name: str) -> None:
    estimate = estimate_weights(BUILTIN_PREFIX + name)
    assert estimate is not None and estimate.source == BUILTIN_CONFIG
    assert (estimate.nbytes, estimate.tensors) == loaded_parameters(
        load_model(BUILTIN_PREFIX + name).model
    )


def test_tiny_config_that_is_not_a_builtin_is_unknown() -> None:
    (not_builtin,) = set(TINY_CONFIGS) - set(builtin_names())
    assert estimate_weights(BUILTIN_PREFIX + not_builtin) is None
    assert estimate_weights("builtin:nope") is None


@pytest.mark.parametrize(
    ("arch", "dtype", "bits"),
    [
        ("llama", mx.float32, None),
        ("qwen2", mx.bfloat16, None),
        # Quantized: packed uint32 weights plus their scales and biases, all tensors in the file.
        ("qwen3", mx.float16, 4),
        ("llama", mx.float32, 8),
    ],
)
def test_directory_estimate_is_the_loaded_parameters_bytes(
    tmp_path: Path, arch: str, dtype: mx.Dtype, bits: int | None
) -> None:
    path = write_config_dir(tmp_path / arch, ARCHITECTURES[arch], dtype=dtype, bits=bits)
    estimate = estimate_weights(str(path))
    assert estimate is not None and estimate.source == SAFETENSORS_HEADERS
    assert (estimate.nbytes, estimate.tensors) == mlx_lm_loaded(path)


def split_into_shards(path: Path) -> list[str]:
    """Rewrite a directory's model.safetensors as two shards and an index, as the hub has
    them; the shard file names."""
    weights = cast(dict[str, mx.array], mx.load(str(path / "model.safetensors")))
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2]}
    shards["model-00002-of-00002.safetensors"] = names[1::2]
    weight_map = {}
    for shard, shard_names in shards.items():
        mx.save_safetensors(str(path / shard), {n: weights[n] for n in shard_names})
        weight_map.update(dict.fromkeys(shard_names, shard))
    (path / "model.safetensors").unlink()
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return list(shards)


def test_sharded_directory_sums_its_shards_and_a_missing_shard_is_unknown(tmp_path: Path) -> None:
    path = write_config_dir(tmp_path / "llama", ARCHITECTURES["llama"])
    whole = estimate_weights(str(path))
    shards = split_into_shards(path)
    estimate = estimate_weights(str(path))
    assert estimate == whole
    assert estimate is not None and (estimate.nbytes, estimate.tensors) == mlx_lm_loaded(path)
    (path / shards[1]).unlink()  # a download cut short
    assert estimate_weights(str(path)) is None


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hub"
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def test_hub_id_is_read_from_the_cache_snapshot_of_main(hub_cache: Path) -> None:
    repo = hub_cache / "models--tiny-org--tiny-llama"
    snapshot = write_config_dir(repo / "snapshots" / "abc123", ARCHITECTURES["llama"])
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    assert estimate_weights("tiny-org/tiny-llama") == estimate_weights(str(snapshot))


def test_hub_id_not_cached_is_unknown(hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert estimate_weights("tiny-org/not-downloaded") is None
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(hub_cache.parent / "nowhere"))
    assert estimate_weights("mlx-community/Llama-3.2-3B-Instruct-4bit") is None


def test_directory_without_weights_is_unknown(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert estimate_weights(str(tmp_path)) is None
    assert estimate_weights(str(tmp_path / "missing")) is None


def write_weights_file(directory: Path, header: bytes, declared: int | None, data: bytes) -> Path:
    file = directory / "model.safetensors"
    length = len(header) if declared is None else declared
    file.write_bytes(struct.pack("<Q", length) + header + data)
    return file


def one_tensor_header(**info: Any) -> bytes:
    tensor = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16], **info}
    return json.dumps({"__metadata__": {"format": "mlx"}, "w": tensor}).encode()


SIXTEEN_BYTES = bytes(16)


@pytest.mark.parametrize(
    ("header", "declared", "data", "says"),
    [
        (b"", None, b"", "no 8-byte header length"),
        (b"{}", MAX_HEADER_BYTES + 1, b"", "header length"),
        (b"{}", 1000, b"", "header length 1000 in a file of 10 bytes"),
        (b"\xff\xfe{", None, b"", "its header is not JSON"),
        (b"[1, 2]", None, b"", "not a JSON object"),
        (one_tensor_header(), None, b"", "outside the file's 0 bytes of data (truncated?)"),
        (
            one_tensor_header(data_offsets=[0, 8]),
            None,
            SIXTEEN_BYTES,
            "should take 16 bytes, its offsets say 8",
        ),
        (one_tensor_header(shape=[-1]), None, SIXTEEN_BYTES, "non-negative ints"),
        (json.dumps({"w": {"dtype": "F32"}}).encode(), None, b"", "no dtype, shape and"),
    ],
)
def test_malformed_header_is_a_clear_error(
    tmp_path: Path, header: bytes, declared: int | None, data: bytes, says: str
) -> None:
    if header:
        file = write_weights_file(tmp_path, header, declared, data)
    else:  # shorter than the length field
        file = tmp_path / "model.safetensors"
        file.write_bytes(b"\x01\x02")
    with pytest.raises(ValueError) as caught:
        estimate_weights(str(tmp_path))
    assert str(caught.value).startswith(f"{file}: ") and says in str(caught.value)


def test_truncated_file_is_a_clear_error(tmp_path: Path) -> None:
    path = write_config_dir(tmp_path / "llama", ARCHITECTURES["llama"])
    file = path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(ValueError, match="truncated"):
        estimate_weights(str(path))
