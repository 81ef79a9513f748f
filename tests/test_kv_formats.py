"""KV block formats (shared/kv_formats.py): tags, the bytes of a token of each format against
what ``mx.quantize`` really holds, and the hello's ``bytes_per_format`` (checked and bounded:
a bad map is refused and opens no session); what a sequence of a quantizing worker needs at its
smallest (shared/kv_sequence.py)."""

from __future__ import annotations

import os

import mlx.core as mx
import pytest
from daemon_harness import RawClient
from vqpool.shared.errors import BadRequestError, ErrorCode
from vqpool.shared.kv_formats import (
    MAX_FORMATS,
    QUANTIZED_BITS,
    QUANTIZED_GROUP_SIZES,
    is_format,
    parse_format,
    quantized_format,
    token_bytes,
)
from vqpool.shared.kv_sequence import SequenceQuantization, sequence_bytes
from vqpool.shared.kv_size import kv_block_bytes, kv_token_bytes
from vqpool.shared.protocol import MAX_BYTES_PER_BLOCK
from vqpool.shared.protocol.checks import check_bytes_per_format
from vqpool.worker.testing.launch import DaemonProcess


def test_tags_round_trip() -> None:
    for bits in QUANTIZED_BITS:
        for group_size in QUANTIZED_GROUP_SIZES:
            tag = quantized_format(bits, group_size)
            assert tag == f"q{bits}g{group_size}"
            assert parse_format(tag) == (bits, group_size)
    for tag in ("fp16", "bf16", "fp32"):
        assert parse_format(tag) is None and is_format(tag)
    for bits, group_size in ((2, 64), (8, 16), (True, 64), (4, 65)):
        with pytest.raises(ValueError):
            quantized_format(bits, group_size)
    for tag in ("int2", "q2g64", "q4g16", "q08g64", "q4g064", "Q4G64", "", "fp8"):
        assert not is_format(tag)
        with pytest.raises(ValueError, match="unknown KV format"):
            parse_format(tag)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
@pytest.mark.parametrize("group_size", QUANTIZED_GROUP_SIZES)
@pytest.mark.parametrize("bits", QUANTIZED_BITS)
def test_token_bytes_are_what_mx_quantize_holds(
    bits: int, group_size: int, dtype: mx.Dtype
) -> None:
    heads, tokens, head_dim = 4, 16, 128
    keys = mx.random.normal((1, heads, tokens, head_dim)).astype(dtype)
    packed, scales, biases = mx.quantize(keys, group_size=group_size, bits=bits)
    held = (packed.nbytes + scales.nbytes + biases.nbytes) * 2  # keys and values alike
    assert token_bytes(heads, head_dim, head_dim, dtype.size, bits, group_size) * tokens == held
    assert token_bytes(heads, head_dim, head_dim, dtype.size) * tokens == keys.nbytes * 2


def test_token_bytes_refuse_what_mx_quantize_refuses() -> None:
    with pytest.raises(ValueError, match="groups of 64"):
        token_bytes(2, 96, 96, 2, 4, 64)
    with pytest.raises(ValueError):
        token_bytes(2, 64, 64, 2, 3, 64)
    assert token_bytes(2, 96, 96, 2, 4, 32) == 2 * 2 * (48 + 2 * 3 * 2)


def test_kv_size_prices_quantized_formats() -> None:
    full = kv_token_bytes("builtin:qwen3")  # one KV head of 32 dims
    q8 = kv_token_bytes("builtin:qwen3", 8, 32)
    q4 = kv_token_bytes("builtin:qwen3", 4, 32)
    assert full is not None and q8 is not None and q4 is not None
    assert full > q8 > q4
    assert kv_block_bytes("builtin:qwen3", 16, 4, 32) == 16 * q4
    with pytest.raises(ValueError, match="groups of 64"):
        kv_token_bytes("builtin:qwen3", 4, 64)
    with pytest.raises(ValueError, match="16 dims"):  # builtin:llama's heads are too small
        kv_token_bytes("builtin:llama", 4, 32)


def test_check_bytes_per_format() -> None:
    assert check_bytes_per_format({"q4g64": 10, "bf16": {"k": 1, "v": 2}}) == {
        "q4g64": 10,
        "bf16": {"k": 1, "v": 2},
    }
    bad = [
        ([], "map of <= 8"),
        (
            {f"q4g{g}": 1 for g in (32, 64, 128)}
            | {"fp16": 1, "bf16": 1, "fp32": 1, "q8g32": 1, "q8g64": 1, "q8g128": 1},
            "map of <= 8",
        ),
        ({"int2": 1}, "no KV format"),
        ({"q4g64": -1}, "bytes_per_format\\[q4g64\\]"),
        ({"q4g64": MAX_BYTES_PER_BLOCK + 1}, str(MAX_BYTES_PER_BLOCK)),
        ({"q4g64": {"k": 1.5}}, "bytes_per_format\\[q4g64\\]"),
        ({"q4g64": True}, "bytes_per_format\\[q4g64\\]"),
        ({1: 2}, "bytes_per_format key"),
    ]
    assert len(bad[1][0]) == MAX_FORMATS + 1
    for value, message in bad:
        with pytest.raises(BadRequestError, match=message):
            check_bytes_per_format(value)


def test_hello_refuses_a_bad_bytes_per_format_and_opens_no_session(daemon: DaemonProcess) -> None:
    client = RawClient(daemon.run_dir)
    try:
        for bytes_per_format in ({"int2": 100}, {"q4g64": MAX_BYTES_PER_BLOCK + 1}, [1, 2]):
            reply = client.call(
                "hello",
                {
                    "pid": os.getpid(),
                    "model": "bad",
                    "nonce": os.urandom(8).hex(),
                    "bytes_per_block": 512,
                    "bytes_per_format": bytes_per_format,
                },
            )
            assert reply["error"]["code"] == ErrorCode.BAD_REQUEST, reply
            assert "bytes_per_format" in reply["error"]["message"]
        assert daemon.admin("stats")["sessions"] == 0
        client.hello(model="good", bytes_per_block=512, bytes_per_format={"q4g64": 144})
        assert daemon.admin("stats")["sessions"] == 1
    finally:
        client.close()


def test_a_sequence_is_priced_as_its_worker_holds_it() -> None:
    # Blocks of 16 tokens, 100 bytes in full precision, 30 quantized.
    def price(n_tokens: int, holding: SequenceQuantization | None) -> int:
        return sequence_bytes(n_tokens, 16, 100, 30, holding)

    assert price(100, None) == 7 * 100  # full precision
    assert price(100, SequenceQuantization()) == 7 * 30  # every block quantized
    first_pass = SequenceQuantization.of(0, 32)  # start 0: the first chunk in fp
    assert first_pass == SequenceQuantization(0, 32)
    assert price(100, first_pass) == 2 * 100 + 5 * 30
    assert price(20, first_pass) == 2 * 100  # all of it its first pass
    late = SequenceQuantization.of(64, 32)  # start 64: no first-pass slots
    assert late == SequenceQuantization(64, 0)
    assert price(50, late) == 4 * 100  # below the start: full precision
    assert price(70, late) == 4 * 100  # 64 fp tokens before it is quantized: more than 5 x 30
    assert price(300, late) == 19 * 30
    assert sequence_bytes(100, 16, 100, None, first_pass) == 7 * 100  # no quantized format
    for bad in ((0, 16), (5, 0)):
        with pytest.raises(ValueError, match="must be >= 1"):
            sequence_bytes(*bad, 100)
    with pytest.raises(ValueError, match=">= 0"):
        SequenceQuantization(-1)
    with pytest.raises(ValueError, match="only with a quantized KV start of 0"):
        SequenceQuantization(8, 16)
