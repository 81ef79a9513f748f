"""A model's KV bytes per token from its config (shared/kv_size.py) against what the worker's
probe of the loaded model finds (worker/kv/storage.py KVLayout): equal, for the built-in models
and test-written directories of each architecture and dtype."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from vqpool.shared.kv_size import kv_block_bytes, kv_token_bytes
from vqpool.shared.tiny_configs import builtin_names
from vqpool.worker.kv.storage import KVLayout
from vqpool.worker.models.loading import load_model
from vqpool.worker.testing.model_dirs import ARCHITECTURES, write_config_dir


def probed_block_bytes(spec: str, block_size: int) -> int:
    return KVLayout.from_model(load_model(spec).model, block_size).bytes_per_block("kv")


@pytest.mark.parametrize("name", builtin_names())
def test_builtin_models(name: str) -> None:
    spec = f"builtin:{name}"
    assert kv_block_bytes(spec, 16) == probed_block_bytes(spec, 16)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_written_directories(tmp_path: Path, arch: str, dtype: mx.Dtype) -> None:
    spec = str(write_config_dir(tmp_path / arch, ARCHITECTURES[arch], dtype=dtype))
    assert kv_block_bytes(spec, 8) == probed_block_bytes(spec, 8)


def test_unknown_models(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "mamba"}')
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("not json")
    for spec in ("builtin:nope", str(tmp_path), str(tmp_path / "bad"), "org/not-cached"):
        assert kv_token_bytes(spec) is None
