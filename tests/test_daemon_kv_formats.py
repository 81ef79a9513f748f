"""Blocks of several formats in one vqpoold (fp16 beside 8- and 4-bit quantized ones): the ledger
charges each block the bytes its session declared for its format (``bytes_per_format`` at hello),
at every step and through a daemon restart; mixed formats fill a budget to the byte; the views,
metrics and ``fit`` answer per format. Real daemons, hand-driven PoolClient sessions (no MLX)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from ctl_harness import ctl_json, run_ctl
from daemon_harness import RawClient, scrape_metrics, wait_until
from front_harness import FrontDoor
from vqpool.daemon.front.catalog import entry_from_table
from vqpool.daemon.front.ledger_calls import LedgerCalls
from vqpool.shared import AllocationRequest
from vqpool.shared.byte_sizes import format_bytes
from vqpool.shared.errors import BlockPoolExhaustedError
from vqpool.shared.kv_formats import quantized_format
from vqpool.shared.kv_sequence import SequenceQuantization, sequence_bytes
from vqpool.shared.kv_size import kv_block_bytes, kv_token_bytes
from vqpool.shared.model_weights import estimate_weights, serve_cache_limit, worker_overhead
from vqpool.worker import PoolClient
from vqpool.worker.testing.launch import DaemonProcess

BLOCK = 16
FP16 = {"k": 2048, "v": 2048}
"""Bytes per block of each stream of the test's model in fp16, and quantized below."""
Q8 = {"k": 1088, "v": 1088}
Q4 = {"k": 576, "v": 576}
PER_FORMAT = {"q8g64": Q8, "q4g64": Q4}
PRICED: dict[str, dict[str, dict[str, int]]] = {}
"""Each test session's declared bytes per format, by model name."""

StartDaemon = Callable[..., DaemonProcess]


@pytest.fixture
def pools() -> Iterator[Callable[..., PoolClient]]:
    opened: list[PoolClient] = []

    def connect(daemon: DaemonProcess, name: str, **hello: Any) -> PoolClient:
        hello.setdefault("bytes_per_block", FP16)
        hello.setdefault("bytes_per_format", PER_FORMAT)
        PRICED[name] = hello["bytes_per_format"] or {}
        pool = PoolClient(daemon.run_dir, name=name, timeout=10.0, **hello)
        opened.append(pool)
        return pool

    yield connect
    for pool in opened:
        pool.close()


def expected(pool: PoolClient) -> dict[str, dict[str, int]]:
    """What ``pool`` holds per format, priced as it declared (a format it did not declare at
    its bytes per block): ``{format: {blocks, bytes}}``."""
    declared = {"fp16": FP16, **PRICED[pool.name]}
    held: dict[str, dict[str, int]] = {}
    for block in pool.held_blocks():
        row = held.setdefault(block.format, {"blocks": 0, "bytes": 0})
        row["blocks"] += 1
        row["bytes"] += declared.get(block.format, FP16)[block.stream]
    return dict(sorted(held.items()))


def check_charges(daemon: DaemonProcess, pools: dict[str, PoolClient]) -> None:
    """The ledger, the model and session views and the audit agree with the sum over held
    blocks of their format's bytes."""
    views = {view["model"]: view for view in daemon.admin("model_list")["models"]}
    for name, pool in pools.items():
        want = expected(pool)
        total = sum(row["bytes"] for row in want.values())
        assert views[name]["held"] == total == pool.held_bytes(), (name, views[name])
        assert views[name]["formats"] == want, name
    sessions = {s["model"]: s for s in daemon.admin("sessions")}
    for name, pool in pools.items():
        assert sessions[name]["formats"] == expected(pool)
        assert sessions[name]["bytes_total"] == pool.held_bytes()
    daemon.audit()


def test_the_ledger_charges_each_block_its_formats_bytes_at_every_step(
    start_daemon: StartDaemon, pools: Callable[..., PoolClient]
) -> None:
    daemon = start_daemon("--n-blocks", "512", "--budget", "1MiB", "--metrics-port", "0")
    mixed = pools(daemon, "mixed")
    plain = pools(daemon, "plain", bytes_per_format=None)
    everyone = {"mixed": mixed, "plain": plain}
    steps: list[Callable[[], Any]] = [
        lambda: mixed.allocate("k", 40, "a", "fp16"),
        lambda: mixed.allocate("v", 40, "a", "fp16"),
        lambda: mixed.allocate("k", 100, "b", "q4g64"),
        lambda: mixed.allocate("v", 100, "b", "q4g64"),
        lambda: mixed.allocate("k", 17, "c", "q8g64"),
        lambda: mixed.allocate("k", 16, "a", "q8g64"),  # one owner, two formats
        lambda: plain.allocate("k", 33, "p", "q4g64"),  # not declared: its bytes_per_block
        lambda: mixed.free(mixed.blocks_for("b")[:3]),
        lambda: mixed.free([b for b in mixed.blocks_for("a") if b.format == "fp16"][:2]),
        lambda: mixed.free_all("c"),
        lambda: mixed.allocate_many(
            [
                AllocationRequest("k", 16 * n, f"many{n}", fmt)
                for n, fmt in enumerate(("q4g64", "q8g64", "fp16"), start=1)
            ]
        ),
    ]
    for step in steps:
        step()
        check_charges(daemon, everyone)
    formats = {fmt for fmt in expected(mixed)}
    assert formats == {"fp16", "q8g64", "q4g64"}
    samples = scrape_metrics(daemon.log())
    for fmt, row in expected(mixed).items():
        labels = (("format", fmt), ("model", "mixed"))
        assert samples[("vqpool_model_kv_bytes", labels)] == row["bytes"]
        assert samples[("vqpool_model_kv_blocks", labels)] == row["blocks"]
    held_k = samples[("vqpool_model_bytes_held", (("model", "mixed"), ("stream", "k")))]
    cost = {"fp16": FP16, **PER_FORMAT}
    assert held_k == sum(cost[b.format]["k"] for b in mixed.held_blocks() if b.stream == "k")
    for owner in ("a", "b", "many1", "many2", "many3"):
        mixed.free_all(owner)
    plain.free_all("p")
    check_charges(daemon, everyone)
    assert daemon.admin("budget")["total_held"] == 0


def test_mixed_formats_fill_a_budget_to_the_byte(
    start_daemon: StartDaemon, pools: Callable[..., PoolClient]
) -> None:
    # Two models, one quantizing to 4 bits and one mixing fp16 and 8-bit blocks: 3 fp16 + 5
    # q8 blocks of one, 7 q4 blocks of the other, to the byte.
    budget = 3 * 2048 + 5 * 1088 + 7 * 576
    daemon = start_daemon("--n-blocks", "512", "--budget", str(budget))
    eight = pools(daemon, "eight")
    four = pools(daemon, "four", bytes_per_format={"q4g64": Q4})
    eight.allocate("k", 3 * BLOCK, "fp", "fp16")
    eight.allocate("v", 5 * BLOCK, "q8", "q8g64")
    four.allocate("k", 7 * BLOCK, "q4", "q4g64")
    view = daemon.admin("budget")
    assert (view["total_held"], view["free"]) == (budget, 0)
    for pool, fmt in ((eight, "q8g64"), (eight, "fp16"), (four, "q4g64")):
        with pytest.raises(BlockPoolExhaustedError):
            pool.allocate("k", 1, "more", fmt)
    # A freed q4 block makes room for exactly one q4 block, not for a larger one.
    four.free(four.blocks_for("q4")[:1])
    with pytest.raises(BlockPoolExhaustedError):
        eight.allocate("k", 1, "more", "q8g64")
    eight.allocate("k", 1, "more", "q4g64")
    assert daemon.admin("budget")["free"] == 0
    check_charges(daemon, {"eight": eight, "four": four})


def test_a_restart_keeps_each_blocks_format_and_charge(
    start_daemon: StartDaemon, pools: Callable[..., PoolClient]
) -> None:
    options = ("--n-blocks", "512", "--budget", "1MiB", "--lease", "30", "--claim-grace", "5")
    daemon = start_daemon(*options)
    pool = pools(daemon, "kept")
    pool.allocate("k", 50, "fp", "fp16")
    pool.allocate("k", 70, "q4", "q4g64")
    pool.allocate("v", 70, "q4", "q4g64")
    pool.allocate("k", 20, "q8", "q8g64")
    check_charges(daemon, {"kept": pool})
    before = daemon.admin("model_list")["models"]
    daemon.stop(signal.SIGKILL)
    daemon = start_daemon(*options, run_dir=daemon.run_dir)
    pool.ping()  # re-syncs: hello (with its bytes per format) and claims
    assert pool.lost_owners() == {}
    assert daemon.admin("stats")["claims"]["owners_claimed"] == 3
    after = daemon.admin("model_list")["models"]
    assert [(v["held"], v["formats"]) for v in after] == [(v["held"], v["formats"]) for v in before]
    check_charges(daemon, {"kept": pool})
    pool.free_all("q4")
    check_charges(daemon, {"kept": pool})


def test_fit_prices_a_quantizing_worker_at_its_quantized_format(
    start_daemon: StartDaemon, pools: Callable[..., PoolClient]
) -> None:
    daemon = start_daemon("--n-blocks", "512", "--budget", "1MiB")
    pool = pools(daemon, "quantized")
    answer = pool.fit(1000, 2)
    per_sequence = -(-1000 // BLOCK) * (Q8["k"] + Q8["v"])  # the costlier quantized format
    assert answer["format"] == "q8g64" and answer["bytes_per_sequence"] == per_sequence
    assert answer["need"] == 2 * per_sequence
    admin = daemon.admin("fit", model="quantized", context=1000, concurrency=2)
    assert (admin["format"], admin["need"]) == ("q8g64", 2 * per_sequence)
    plain = pools(daemon, "plain", bytes_per_format=None)
    assert plain.fit(1000)["format"] is None
    assert plain.fit(1000)["bytes_per_sequence"] == -(-1000 // BLOCK) * 4096


@pytest.mark.parametrize(
    ("holding", "context", "fp_blocks", "q_blocks"),
    [
        # Start 0: the first pass's 256 slots (16 blocks) in fp16 beside the rest quantized.
        (SequenceQuantization(0, 256), 1000, 16, 63 - 16),
        (SequenceQuantization(0, 256), 100, 7, 0),  # the whole sequence is its first pass
        # Start 500: fp16 for 500 tokens before it is quantized, then all quantized: the larger.
        (SequenceQuantization(500, 0), 400, 25, 0),
        (SequenceQuantization(500, 0), 600, 32, 0),  # 32 fp16 blocks > 38 quantized ones
        (SequenceQuantization(500, 0), 2000, 0, 125),
    ],
)
def test_fit_counts_the_full_precision_blocks_a_quantizing_sequence_holds(
    start_daemon: StartDaemon,
    pools: Callable[..., PoolClient],
    holding: SequenceQuantization,
    context: int,
    fp_blocks: int,
    q_blocks: int,
) -> None:
    # The worker op, the admin op on a live worker and the admin op for a model not loaded
    # (priced from its bytes per token) answer the same need.
    daemon = start_daemon("--n-blocks", "512", "--budget", "1MiB")
    pool = pools(daemon, "quantized", quantization=holding)
    per_sequence = fp_blocks * 4096 + q_blocks * (Q8["k"] + Q8["v"])
    answer = pool.fit(context, 2)
    assert answer["bytes_per_sequence"] == per_sequence and answer["need"] == 2 * per_sequence
    assert answer["format"] == "q8g64"
    admin = daemon.admin("fit", model="quantized", context=context, concurrency=2)
    assert (admin["bytes_per_sequence"], admin["format"]) == (per_sequence, "q8g64")
    unloaded = daemon.admin(
        "fit",
        model="not-loaded",
        context=context,
        concurrency=2,
        bytes_per_token=4096 // BLOCK,
        quantized_bytes_per_token=(Q8["k"] + Q8["v"]) // BLOCK,
        quantized_kv_start=holding.start,
        first_pass_slots=holding.first_pass_slots,
    )
    assert unloaded["bytes_per_sequence"] == per_sequence


def test_a_sequence_whose_first_pass_is_over_the_room_never_fits(
    start_daemon: StartDaemon, pools: Callable[..., PoolClient]
) -> None:
    # Quantized alone it fits the budget; with its first pass's fp16 blocks it never does.
    q_pair = Q8["k"] + Q8["v"]
    daemon = start_daemon("--n-blocks", "4096", "--budget", str(400 * q_pair))
    pool = pools(daemon, "quantized", quantization=SequenceQuantization(0, 512))
    most = pool.fit(16)["most_ever"]
    n_blocks = most // q_pair
    assert n_blocks > 32  # the premise: longer than its first pass
    answer = pool.fit(n_blocks * BLOCK)
    assert answer["verdict"] == "never"
    assert answer["need"] == 32 * 4096 + (n_blocks - 32) * q_pair > most >= n_blocks * q_pair
    with pytest.raises(ValueError, match="first-pass slots are held only with"):
        SequenceQuantization(5, 16)
    raw = RawClient(daemon.run_dir)
    try:
        args = {"pid": os.getpid(), "model": "bad", "nonce": "n1"}
        reply = raw.call(
            "hello",
            {
                **args,
                "bytes_per_block": FP16,
                "bytes_per_format": PER_FORMAT,
                "quantized_kv_start": 5,
                "first_pass_slots": 16,
            },
        )
    finally:
        raw.close()
    assert not reply["ok"] and "first-pass slots" in reply["error"]["message"]


def test_vqpoolctl_shows_bytes_per_format(
    start_daemon: StartDaemon, pools: Callable[..., PoolClient]
) -> None:
    daemon = start_daemon("--n-blocks", "512", "--budget", "1MiB")
    pool = pools(daemon, "mixed")
    pool.allocate("k", 32, "a", "q4g64")
    pool.allocate("k", 16, "b", "fp16")
    status = run_ctl(daemon.run_dir, "status")
    assert status.returncode == 0, status.stderr
    assert "KV FORMATS" in status.stdout
    assert "fp16 1 blk 2.0 KiB, q4g64 2 blk 1.1 KiB" in status.stdout
    listing = run_ctl(daemon.run_dir, "model", "list")
    assert "fp16 1 blk 2.0 KiB, q4g64 2 blk 1.1 KiB" in listing.stdout
    cache = run_ctl(daemon.run_dir, "cache", "list")
    assert "fp16 1 blk 2.0 KiB, q4g64 2 blk 1.1 KiB" in cache.stdout
    watch = run_ctl(daemon.run_dir, "watch", "--count", "1")
    assert "formats fp16 1 blk 2.0 KiB, q4g64 2 blk 1.1 KiB" in watch.stdout, watch.stdout
    models = ctl_json(daemon.run_dir, "status")["models"]
    assert models["mixed"]["formats"] == {
        "fp16": {"blocks": 1, "bytes": 2048},
        "q4g64": {"blocks": 2, "bytes": 1152},
    }
    pool.free_all("a")
    plain_status = run_ctl(daemon.run_dir, "status")
    assert "KV FORMATS" not in plain_status.stdout  # only full-precision blocks: as before


def test_the_front_door_prices_a_quantized_models_load_and_fit(start_daemon) -> None:
    spec = "builtin:qwen3"  # one KV head of 32 dims: quantizable in groups of 32
    entry = entry_from_table("q", {"path": spec, "kv_bits": 4, "kv_group_size": 32}, 60.0)
    assert entry is not None and entry.kv_quantization() == (4, 32)
    assert entry.kv_format() == quantized_format(4, 32)
    assert entry.worker_option("--kv-bits") == "4"
    for table, message in (
        ({"path": spec, "kv_bits": 3}, "KV bits must be one of"),
        ({"path": spec, "kv_bits": 4, "kv_group_size": 48}, "group size must be one of"),
        ({"path": spec, "kv_group_size": 32}, "needs kv_bits"),
    ):
        with pytest.raises(ValueError, match=message):
            entry_from_table("q", table, 60.0)

    daemon = start_daemon("--n-blocks", "512", "--budget", "64MiB")
    calls = LedgerCalls(daemon.run_dir)
    fp_block, q_block = kv_block_bytes(spec, BLOCK), kv_block_bytes(spec, BLOCK, 4, 32)
    assert fp_block is not None and q_block is not None
    full = asyncio.run(calls.need("q", spec, 0, 2048))
    assert full.kv_min == 128 * fp_block
    # The load's KV minimum is one sequence of 2048 tokens at its smallest: its first pass
    # (one prefill chunk) in full precision beside the rest quantized, or all of it in full
    # precision below --quantized-kv-start.
    for table, n_fp in (
        ({"prefill_step_size": 512}, 32),
        ({}, 128),  # the default chunk (2048) is the whole sequence
        ({"quantized_kv_start": 4096}, 128),
        ({"quantized_kv_start": 1000}, 63),  # fp16 for 1000 tokens, then all quantized
    ):
        served = entry_from_table(
            "q", {"path": spec, "kv_bits": 4, "kv_group_size": 32, **table}, 60.0
        )
        assert served is not None
        need = asyncio.run(
            calls.need(
                "q", spec, 0, 2048, quantization=(4, 32), holding=served.sequence_quantization()
            )
        )
        want = (
            max(n_fp * fp_block, 128 * q_block)
            if table.get("quantized_kv_start")
            else (n_fp * fp_block + (128 - n_fp) * q_block)
        )
        assert need.kv_min == want, table
    first_pass = entry_from_table("q", {"path": spec, "kv_bits": 4, "prefill_step_size": 512}, 60.0)
    assert first_pass is not None and first_pass.sequence_quantization() == SequenceQuantization(
        0, 512
    )
    with pytest.raises(ValueError, match="quantized_kv_start must be >= 0"):
        entry_from_table("q", {"path": spec, "kv_bits": 4, "quantized_kv_start": -1}, 60.0)


def test_vqpoolctl_fit_prices_a_not_loaded_quantized_model(tmp_path) -> None:
    config = """
[models."q4"]
path = "builtin:qwen3"
kv_bits = 4
kv_group_size = 32
prefill_step_size = 256
"""
    with FrontDoor(config=config) as front:
        assert front.row("q4")["kv_format"] == "q4g32"
        answer = ctl_json(front.run_dir, "fit", "--model", "q4", "--context", "1000")
        per_token = kv_token_bytes("builtin:qwen3", 4, 32)
        fp_token = kv_token_bytes("builtin:qwen3")
        assert per_token is not None and fp_token is not None
        assert answer["format"] == "q4g32"
        # Its first pass (256 slots: 16 blocks) in full precision, the other 47 blocks quantized.
        assert answer["bytes_per_sequence"] == BLOCK * (16 * fp_token + 47 * per_token)
        text = run_ctl(front.run_dir, "fit", "--model", "q4", "--context", "1000")
        assert "KV in q4g32 blocks" in text.stdout, text.stdout


def test_a_parked_allocation_is_charged_its_formats_bytes_when_granted(
    start_daemon: StartDaemon, pools: Callable[..., PoolClient]
) -> None:
    # The budget holds 4 fp16 blocks of "big"; "small" waits for 3 q4 blocks (3 x 576 bytes)
    # until one fp16 block (2048 bytes) is freed, and is charged exactly its q4 bytes.
    daemon = start_daemon("--n-blocks", "512", "--budget", str(4 * 2048))
    big = pools(daemon, "big")
    big.allocate("k", 2 * BLOCK, "fp", "fp16")
    big.allocate("v", 2 * BLOCK, "fp", "fp16")
    small = RawClient(daemon.run_dir)
    try:
        small.hello(model="small", bytes_per_block=FP16, bytes_per_format=PER_FORMAT)
        args = {"stream": "k", "n_tokens": 3 * BLOCK, "owner": "q", "format": "q4g64"}
        small.send(small.encode("allocate", {**args, "wait": 10.0}))
        wait_until(lambda: daemon.admin("budget")["waiting"] == 1, timeout=5.0)
        big.free(big.blocks_for("fp")[:1])
        reply = small.recv()
        assert reply["ok"] and len(reply["result"]) == 3, reply
        held = {view["model"]: view for view in daemon.admin("model_list")["models"]}
        assert held["small"]["held"] == 3 * Q4["k"]
        assert held["small"]["formats"] == {"q4g64": {"blocks": 3, "bytes": 3 * Q4["k"]}}
        assert held["big"]["held"] == 3 * 2048
        daemon.audit()
    finally:
        small.close()


def test_a_quantized_load_asks_for_its_first_pass_in_full_precision() -> None:
    # The front door's load minimum is one sequence of load_kv_tokens at its smallest: its
    # first pass (512 slots) in full precision beside the rest quantized. A budget that holds
    # the weights and the minimum all quantized, but not with the first pass, refuses the
    # load at once, naming the minimum.
    spec = "builtin:qwen3"
    estimate = estimate_weights(spec)
    assert estimate is not None
    fixed = estimate.nbytes + worker_overhead(serve_cache_limit(estimate.nbytes))
    fp_block, q_block = kv_block_bytes(spec, BLOCK), kv_block_bytes(spec, BLOCK, 4, 32)
    assert fp_block is not None and q_block is not None
    kv_min = sequence_bytes(1024, BLOCK, fp_block, q_block, SequenceQuantization(0, 512))
    assert kv_min == 32 * fp_block + 32 * q_block
    budget = fixed + (kv_min + 64 * q_block) // 2
    config = f"""
[serve]
budget = {budget}
load_kv_tokens = 1024

[models."q"]
path = "{spec}"
kv_bits = 4
kv_group_size = 32
prefill_step_size = 512
"""
    with FrontDoor(config=config) as front:
        reply = front.complete("q")
        assert reply.status == 400, reply.body
        message = reply.body["error"]["message"]
        assert f"and {format_bytes(kv_min)} of KV" in message and "never fit" in message, message
        assert front.row("q")["kv_holding"] == {"start": 0, "first_pass_slots": 512}
