"""MLXBlockStorage: block ids map to the right memory, bytes follow the blocks held, errors
change nothing, and dropped blocks really give their memory back."""

from __future__ import annotations

import dataclasses
import gc
from typing import cast

import mlx.core as mx
import mlx.nn as nn
import pytest
from vqpool.worker import KVLayout, MLXBlockStorage
from vqpool.worker.kv.storage import SequenceBuffers
from vqpool.worker.models.tiny_models import build_tiny_model, tiny_model_names

LAYOUT = KVLayout(n_layers=3, n_kv_heads=2, k_head_dim=8, v_head_dim=4, dtype=mx.float32)


def filled(
    storage: MLXBlockStorage, key: str, k_ids: list[int], v_ids: list[int]
) -> SequenceBuffers:
    """Open a sequence over these blocks and write distinct values into every slot:
    keys[layer][0, head, slot, :] = 1000 * layer + 100 * head + slot, values negated."""
    seq = storage.open(key)
    storage.extend(seq, k_ids, v_ids)
    n_slots = len(k_ids) * LAYOUT.block_size
    for layer in range(LAYOUT.n_layers):
        for name, dim, sign in (("keys", LAYOUT.k_head_dim, 1), ("values", LAYOUT.v_head_dim, -1)):
            buf = getattr(seq, name)[layer]
            pattern = (
                1000 * layer
                + 100 * mx.arange(LAYOUT.n_kv_heads)[:, None, None]
                + mx.arange(n_slots)[None, :, None]
                + mx.zeros((1, 1, dim))
            )
            buf[..., :n_slots, :] = sign * pattern[None]
    mx.eval(seq.keys, seq.values)
    return seq


def slot_values(block: mx.array, layer: int) -> list[int]:
    """The slot numbers stored in a block segment of head 0, as written by ``filled``."""
    column = mx.abs(block[0, 0, :, 0]).astype(mx.int32) - 1000 * layer
    return [int(cast(int, column[i].item())) for i in range(column.shape[0])]


def test_layout_bytes_per_block() -> None:
    per_k = 3 * 2 * 16 * 8 * 4
    per_v = 3 * 2 * 16 * 4 * 4
    assert LAYOUT.k_block_bytes == per_k
    assert LAYOUT.v_block_bytes == per_v
    assert LAYOUT.bytes_per_block("kv") == per_k + per_v
    assert LAYOUT.format == "fp32"
    assert KVLayout(1, 1, 1, 1, mx.bfloat16).format == "bf16"
    with pytest.raises(ValueError, match="stream"):
        LAYOUT.bytes_per_block("x")


@pytest.mark.parametrize(
    ("field", "value"),
    [("n_layers", 0), ("n_kv_heads", 0), ("k_head_dim", -1), ("block_size", 0)],
)
def test_layout_rejects_bad_sizes(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(LAYOUT, **{field: value})  # type: ignore[arg-type]


def test_layout_rejects_non_float_dtype() -> None:
    with pytest.raises(ValueError, match="dtype"):
        KVLayout(1, 1, 1, 1, mx.int8)


@pytest.mark.parametrize("name", [n for n in tiny_model_names() if n != "llama-1024x8"])
def test_layout_from_model_matches_what_layers_write(name: str) -> None:
    model, config = build_tiny_model(name)
    layout = KVLayout.from_model(model)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    assert layout == KVLayout(
        n_layers=config["num_hidden_layers"],
        n_kv_heads=config["num_key_value_heads"],
        k_head_dim=head_dim,
        v_head_dim=head_dim,
        dtype=mx.float32,
    )
    bf16_model, _ = build_tiny_model(name, dtype=mx.bfloat16)
    assert KVLayout.from_model(bf16_model).dtype == mx.bfloat16


def test_layout_from_model_refuses_unknown_layers() -> None:
    model = nn.Module()
    model.layers = [nn.Linear(2, 2)]
    with pytest.raises(ValueError, match="one-token forward pass failed"):
        KVLayout.from_model(model)


@pytest.mark.parametrize("separate_kv", [True, False])
def test_block_ids_map_to_their_slots_in_every_layer(separate_kv: bool) -> None:
    storage = MLXBlockStorage(LAYOUT, separate_kv=separate_kv)
    k_ids = [40, 7, 13]
    v_ids = [90, 91, 5] if separate_kv else []
    filled(storage, "a", k_ids, v_ids)
    for index, block_id in enumerate(k_ids):
        memory = storage.read_block(block_id)
        assert set(memory) == ({"k"} if separate_kv else {"k", "v"})
        for layer, segment in enumerate(memory["k"]):
            assert segment.shape == (1, 2, 16, 8)
            assert slot_values(segment, layer) == list(range(index * 16, (index + 1) * 16))
    for index, block_id in enumerate(v_ids):
        memory = storage.read_block(block_id)
        assert set(memory) == {"v"}
        for layer, segment in enumerate(memory["v"]):
            assert segment.shape == (1, 2, 16, 4)
            assert mx.all(segment <= 0).item()
            assert slot_values(segment, layer) == list(range(index * 16, (index + 1) * 16))
    with pytest.raises(KeyError, match="not held"):
        storage.read_block(1)


@pytest.mark.parametrize("separate_kv", [True, False])
def test_bytes_equal_blocks_held_times_bytes_per_block(separate_kv: bool) -> None:
    storage = MLXBlockStorage(LAYOUT, separate_kv=separate_kv)
    assert storage.nbytes == 0
    seq_a = storage.open("a")
    seq_b = storage.open("b")
    k_a, v_a = [1, 2], [3, 4]
    storage.extend(seq_a, k_a, v_a if separate_kv else ())
    storage.extend(seq_b, [5], [6] if separate_kv else ())
    storage.extend(seq_a, [7, 8, 9], [10, 11, 12] if separate_kv else ())
    mx.eval(seq_a.keys, seq_b.keys)

    def by_blocks() -> int:
        per_index = LAYOUT.bytes_per_block("kv")  # one K + one V block, or one "kv" block
        return sum(s.n_blocks for s in (seq_a, seq_b)) * per_index

    assert storage.n_blocks == (12 if separate_kv else 6)
    assert storage.nbytes == by_blocks() == storage.expected_nbytes()
    assert seq_a.keys[0].shape == (1, 2, 5 * 16, 8)
    storage.truncate(seq_a, 2)
    assert storage.nbytes == by_blocks() == storage.expected_nbytes()
    storage.close(seq_a)
    assert storage.nbytes == LAYOUT.bytes_per_block("kv")
    storage.close(seq_b)
    assert storage.nbytes == 0 and storage.n_blocks == 0 and storage.n_sequences == 0


def test_truncate_keeps_content_returns_dropped_ids_and_unmaps_them() -> None:
    storage = MLXBlockStorage(LAYOUT)
    seq = filled(storage, "a", [1, 2, 3, 4], [5, 6, 7, 8])
    dropped = storage.truncate(seq, 1)
    assert dropped == ([2, 3, 4], [6, 7, 8])
    assert [storage.holds(i) for i in range(1, 9)] == [True, False, False, False] * 2
    for layer, segment in enumerate(storage.read_block(1)["k"]):
        assert slot_values(segment, layer) == list(range(16))
    # A dropped id can be mapped again (the pool recycles ids), and new slots start at zero.
    storage.extend(seq, [3], [2])
    assert mx.all(storage.read_block(3)["k"][0] == 0).item()


def test_dropped_blocks_release_their_memory() -> None:
    big = KVLayout(n_layers=2, n_kv_heads=4, k_head_dim=64, v_head_dim=64, dtype=mx.float32)
    storage = MLXBlockStorage(big)
    seq = storage.open("a")
    ids = list(range(64))
    storage.extend(seq, ids, [i + 1000 for i in ids])
    mx.eval(seq.keys, seq.values)
    gc.collect()
    held = mx.get_active_memory()
    full = storage.nbytes
    assert full == 64 * big.bytes_per_block("kv")
    storage.truncate(seq, 8)
    mx.eval(seq.keys, seq.values)
    gc.collect()
    # The kept eighth was copied out; the old buffers were freed (not kept alive by a view).
    assert held - mx.get_active_memory() >= full * 7 // 8
    storage.close(seq)
    gc.collect()
    assert held - mx.get_active_memory() >= full


def test_bad_calls_change_nothing() -> None:
    storage = MLXBlockStorage(LAYOUT)
    seq = filled(storage, "a", [1, 2], [3, 4])
    before = (storage.nbytes, storage.n_blocks, list(seq.k_block_ids), list(seq.v_block_ids))

    def unchanged() -> bool:
        now = (storage.nbytes, storage.n_blocks, list(seq.k_block_ids), list(seq.v_block_ids))
        return now == before

    with pytest.raises(ValueError, match="already open"):
        storage.open("a")
    with pytest.raises(ValueError, match="already mapped"):
        storage.extend(seq, [9], [2])
    with pytest.raises(ValueError, match="twice"):
        storage.extend(seq, [9], [9])
    with pytest.raises(ValueError, match="V block"):
        storage.extend(seq, [9, 10], [11])
    with pytest.raises(ValueError, match="cannot keep"):
        storage.truncate(seq, 3)
    other = MLXBlockStorage(LAYOUT)
    with pytest.raises(ValueError, match="not open"):
        other.extend(seq, [20], [21])
    assert unchanged()
    shared = MLXBlockStorage(LAYOUT, separate_kv=False)
    shared_seq = shared.open("s")
    with pytest.raises(ValueError, match="one 'kv' id"):
        shared.extend(shared_seq, [1], [2])
    assert shared.n_blocks == 0
    storage.close(seq)
    storage.close(seq)  # closing twice is a no-op
    assert storage.nbytes == 0
