"""The prompt cache's disk tier: entries evicted from pool blocks are written to disk and read
back instead of recomputed, never a wrong hit.

In-process (a real tiny MLX model, the real scheduler, the local allocator): identity with a
recomputed turn, crash safety of a write, corrupt / truncated / foreign files, the fingerprint,
the cap, and a full write queue. Through real processes (``vqpool serve``, its vqpoold and
workers): a model unloaded and loaded again, and the whole stack restarted, hit from disk.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from ctl_harness import ctl_json, run_ctl
from daemon_harness import remove_tree, short_tmpdir, wait_until
from front_harness import FrontDoor
from serving_harness import run_worker_until_exit
from test_prompt_cache import BS, Worker, random_tokens, scored, start_worker
from test_quantized_kv import MODEL_ARGS
from vqpool.daemon.front.catalog import catalog_from_config
from vqpool.shared.front_client import FrontDoorRefused
from vqpool.worker.kv.disk_format import model_fingerprint, read_header
from vqpool.worker.kv.disk_store import DiskStore
from vqpool.worker.kv.disk_writer import DiskWriter
from vqpool.worker.kv.quantized import KVQuantization
from vqpool.worker.kv.storage import KVLayout
from vqpool.worker.models.loading import LoadedModel, load_model
from vqpool.worker.testing.launch import DaemonProcess
from vqpool.worker.testing.model_dirs import write_config_dir


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("builtin:llama")


@pytest.fixture
def disk_dir() -> Iterator[Path]:
    path = short_tmpdir("vqd")
    yield path
    remove_tree(path)


def fingerprint_of(loaded: LoadedModel) -> str:
    layout = KVLayout.from_model(loaded.model, block_size=BS)
    return model_fingerprint(loaded.model, layout, separate_kv=True)


def start_disk_worker(
    loaded: LoadedModel,
    directory: Path,
    cache_bytes: int = 1 << 30,
    disk_bytes: int = 1 << 30,
    writer: DiskWriter | None = None,
) -> Worker:
    """A scheduler whose prompt cache has a disk tier in ``directory``."""
    if writer is None:
        writer = DiskWriter(DiskStore(directory, disk_bytes, fingerprint_of(loaded), BS))
    return start_worker(loaded, cache_bytes, disk=writer)


def stop(worker: Worker) -> None:
    worker.scheduler.stop()
    if worker.cache is not None:
        worker.cache.close()


def entry_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.kv"))


def spill_to_disk(worker: Worker, directory: Path) -> Path:
    """Drop the worker's cached memory (its one entry goes to disk) and wait for the write;
    the entry's file."""
    assert worker.cache is not None and worker.cache.disk is not None
    worker.cache.drop()
    assert worker.cache.disk.flush(60)
    assert worker.cache.snapshot()["entries"] == 0
    (path,) = entry_files(directory)
    return path


def test_a_turn_read_back_from_disk_matches_one_recomputed(
    loaded: LoadedModel, disk_dir: Path
) -> None:
    rng = random.Random(3)
    turn1 = random_tokens(rng, 300, loaded.vocab_size)
    plain = start_worker(loaded, 0)
    worker = start_disk_worker(loaded, disk_dir)
    try:
        first, _, _ = worker.run(turn1)
        spill_to_disk(worker, disk_dir)  # memory given back: the entry goes to disk instead
        assert worker.cache is not None

        turn2 = turn1 + [t.token for t in first] + random_tokens(rng, 29, loaded.vocab_size)
        from_disk, cached, _ = worker.run(turn2)
        recomputed, _, _ = plain.run(turn2)
        assert cached == len(turn1) + len(first)
        assert scored(from_disk) == scored(recomputed)
        counters = worker.cache.snapshot()
        assert counters["disk_reads"] == 1
        assert counters["disk_hit_tokens"] == cached
        assert counters["disk_writes"] == 1
    finally:
        stop(worker)
    # A new worker on the same directory (a restart): the entries written at exit load back.
    restarted = start_disk_worker(loaded, disk_dir)
    try:
        again, cached, _ = restarted.run(turn2)
        assert cached == len(turn2) - 1
        assert scored(again) == scored(recomputed)
    finally:
        stop(restarted)
        plain.scheduler.stop()


def test_quantized_entries_come_back_from_disk_as_from_memory(disk_dir: Path) -> None:
    # KV in 4 bits from the first token, on a model whose 64-wide heads mx.quantize can group.
    model_dir = write_config_dir(disk_dir / "hd64", MODEL_ARGS, dtype=mx.bfloat16)
    loaded = load_model(str(model_dir))
    quantization = KVQuantization(4, 32)
    layout = KVLayout.from_model(loaded.model, block_size=BS)
    fingerprint = model_fingerprint(loaded.model, layout, True, quantization.format)
    assert fingerprint != model_fingerprint(loaded.model, layout, True)  # fp files never match
    store_dir = disk_dir / "kv"
    writer = DiskWriter(DiskStore(store_dir, 1 << 30, fingerprint, BS))
    rng = random.Random(5)
    turn1 = random_tokens(rng, 200, loaded.vocab_size)
    in_memory = start_worker(loaded, 1 << 30, quantization=quantization)
    on_disk = start_worker(loaded, 1 << 30, disk=writer, quantization=quantization)
    try:
        first, _, _ = on_disk.run(turn1)
        assert in_memory.run(turn1)[0] == first
        turn2 = turn1 + [t.token for t in first] + random_tokens(rng, 29, loaded.vocab_size)
        path = spill_to_disk(on_disk, store_dir)
        assert any(spec.name.startswith("keys.0.") for spec in read_header(path).arrays)
        from_memory, cached_memory, _ = in_memory.run(turn2)
        from_disk, cached_disk, _ = on_disk.run(turn2)
        assert cached_disk == cached_memory > 0
        assert scored(from_disk) == scored(from_memory)
        assert on_disk.cache is not None and on_disk.cache.snapshot()["disk_reads"] == 1
    finally:
        stop(on_disk)
        stop(in_memory)


_KILLED_WRITER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import mlx.core as mx
    from vqpool.worker.kv.disk_store import DiskStore

    store = DiskStore(Path(sys.argv[1]), 1 << 30, "fp", 16)

    def stall(temp):
        print(temp, flush=True)
        sys.stdin.read()  # held here, written and synced but not renamed, until killed

    store.before_rename = stall
    arrays = {"keys.0": mx.ones((1, 2, 32, 16)), "values.0": mx.ones((1, 2, 32, 16))}
    mx.eval(list(arrays.values()))
    store.put(list(range(32)), arrays, 8192)
    """
)


def test_a_writer_killed_before_its_rename_leaves_no_file_that_loads(disk_dir: Path) -> None:
    writer = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(disk_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None
        temp = Path(writer.stdout.readline().strip())
        assert temp.exists() and temp.parent == disk_dir  # the bytes are there, unnamed
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait(30)
    finally:
        if writer.poll() is None:
            writer.kill()
        writer.communicate()
    store = DiskStore(disk_dir, 1 << 30, "fp", 16)
    assert store.match(list(range(40)), 39) == (None, 0)
    assert list(disk_dir.iterdir()) == []  # the unfinished write is removed at start
    assert store.snapshot()["removed_bad"] == 1


def put_entry(store: DiskStore, tokens: list[int], seed: int) -> dict[str, mx.array]:
    n_slots = -(-len(tokens) // BS) * BS
    arrays = {
        f"{field}.{i}": mx.random.normal((1, 2, n_slots, 16), key=mx.random.key(seed + i))
        for field in ("keys", "values")
        for i in range(2)
    }
    mx.eval(list(arrays.values()))
    assert store.put(tokens, arrays, sum(a.nbytes for a in arrays.values()))
    return arrays


def test_corrupt_truncated_and_foreign_files_are_misses_and_removed(disk_dir: Path) -> None:
    store = DiskStore(disk_dir, 1 << 30, "fp", BS)
    prompts = [[n] * 40 + list(range(24)) for n in (1, 2, 3, 4, 5)]
    arrays = [put_entry(store, prompt, seed) for seed, prompt in enumerate(prompts)]
    corrupt, truncated, foreign, good, relabelled = (store.path_for(p) for p in prompts)
    data = bytearray(corrupt.read_bytes())
    data[-100] ^= 0x40  # one bit of the payload
    corrupt.write_bytes(bytes(data))
    (disk_dir / "garbage.kv").write_bytes(b"not an entry at all")

    # The corrupt payload passes the header checks: the read is a miss, and the file goes.
    entry, n = store.match(prompts[0] + [9], 64)
    assert entry is not None and n == 64
    assert store.load(entry) is None
    assert not corrupt.exists() and store.match(prompts[0] + [9], 64) == (None, 0)

    truncated.write_bytes(truncated.read_bytes()[:-7])
    # Another model's file (written by a store of another fingerprint) in this directory.
    foreign.unlink()
    put_entry(DiskStore(disk_dir / "other", 1 << 30, "xx", BS), prompts[2], 2)
    (written,) = (disk_dir / "other").glob("*.kv")
    written.rename(foreign)
    assert read_header(foreign).fingerprint == "xx"
    (disk_dir / "other").rmdir()
    # A header whose token ids changed: its payload's checksum holds, the header's does not.
    relabelled.write_bytes(relabelled.read_bytes().replace(b"[5,5,5", b"[6,5,5", 1))
    # A restart finds the truncated, foreign, relabelled and garbage files: removed, never
    # indexed.
    restarted = DiskStore(disk_dir, 1 << 30, "fp", BS)
    assert sorted(disk_dir.iterdir()) == [good]
    assert restarted.snapshot()["removed_bad"] == 4
    for prompt in [*prompts[:3], prompts[4], [6, *prompts[4][1:]]]:
        assert restarted.match([*prompt, 9], 64) == (None, 0)
    entry, _ = restarted.match(prompts[3] + [9], 64)
    assert entry is not None
    loaded_back = restarted.load(entry)
    assert loaded_back is not None
    for name, array in arrays[3].items():
        assert mx.array_equal(loaded_back[name], array).item()


def test_a_truncated_file_read_by_a_worker_is_a_miss_not_an_error(
    loaded: LoadedModel, disk_dir: Path
) -> None:
    rng = random.Random(5)
    prompt = random_tokens(rng, 200, loaded.vocab_size)
    plain = start_worker(loaded, 0)
    worker = start_disk_worker(loaded, disk_dir)
    try:
        worker.run(prompt)
        path = spill_to_disk(worker, disk_dir)
        assert worker.cache is not None
        path.write_bytes(path.read_bytes()[:-1000])  # truncated after the worker indexed it
        tokens, cached, end = worker.run(prompt)
        assert (cached, end.finish_reason) == (0, "length")
        assert scored(tokens) == scored(plain.run(prompt)[0])
        assert not path.exists()
        assert worker.cache.snapshot()["disk_removed_bad"] == 1
    finally:
        stop(worker)
        plain.scheduler.stop()


def test_a_changed_fingerprint_misses(loaded: LoadedModel, disk_dir: Path) -> None:
    layout = KVLayout.from_model(loaded.model, block_size=BS)
    base = model_fingerprint(loaded.model, layout, True)
    assert model_fingerprint(loaded.model, layout, True) == base
    other_weights = load_model("builtin:llama", seed=1)
    changed = [
        model_fingerprint(other_weights.model, layout, True),
        model_fingerprint(load_model("builtin:qwen3").model, layout, True),
        model_fingerprint(loaded.model, KVLayout.from_model(loaded.model, block_size=32), True),
        model_fingerprint(loaded.model, layout, False),
    ]
    assert len({base, *changed}) == 5
    store = DiskStore(disk_dir, 1 << 30, base, BS)
    prompt = list(range(48))
    put_entry(store, prompt, 0)
    other = DiskStore(disk_dir, 1 << 30, changed[0], BS)
    assert other.match(prompt, 47) == (None, 0)
    assert entry_files(disk_dir) == []  # another model's file in this model's directory goes


def test_the_cap_holds_least_recently_used_first(disk_dir: Path) -> None:
    store = DiskStore(disk_dir, 1 << 30, "fp", BS)
    put_entry(store, [7] * 32, 0)
    entry_bytes = store.nbytes
    store.drop()
    cap = 3 * entry_bytes + entry_bytes // 2
    store = DiskStore(disk_dir, cap, "fp", BS)
    prompts = [[n] * 32 for n in range(6)]
    put_entry(store, prompts[0], 0)
    put_entry(store, prompts[1], 1)
    put_entry(store, prompts[2], 2)
    entry, _ = store.match(prompts[0] + [1], 32)
    assert entry is not None and store.load(entry) is not None  # 0 is now the most recent
    for n in (3, 4):
        put_entry(store, prompts[n], n)
        assert store.nbytes <= cap
        assert sum(p.stat().st_size for p in entry_files(disk_dir)) == store.nbytes
    held = [n for n, p in enumerate(prompts) if store.holds(p)]
    assert held == [0, 3, 4]
    assert store.snapshot()["evictions"] == 2


def test_a_full_write_queue_drops_the_oldest_write_and_never_delays_a_token(
    loaded: LoadedModel, disk_dir: Path
) -> None:
    entered, release = threading.Event(), threading.Event()

    def slow_disk() -> None:
        entered.set()
        release.wait(60)

    store = DiskStore(disk_dir, 1 << 30, fingerprint_of(loaded), BS)
    writer = DiskWriter(store, max_pending=2, before_write=slow_disk)
    rng = random.Random(11)
    prompts = [random_tokens(rng, 100, loaded.vocab_size) for _ in range(6)]
    # A cache of one entry: each request's store evicts the previous one, a write to disk.
    worker = start_disk_worker(loaded, disk_dir, cache_bytes=60_000, writer=writer)
    try:
        assert worker.cache is not None
        worker.run(prompts[0])
        worker.run(prompts[1])  # evicts prompts[0]: the writer takes it and stalls
        assert entered.wait(30)
        for prompt in prompts[2:]:
            tokens, _, end = worker.run(prompt)  # served while the disk is stuck
            assert len(tokens) == 12 and end.finish_reason == "length"
        # Evicted: prompts 0..4, while the writer stalls on the first; room for 2 pending.
        counters = worker.cache.snapshot()
        assert counters["disk_dropped_writes"] == 3
        assert writer.n_pending == 2
        release.set()
        assert writer.flush(60)
        held = [n for n, p in enumerate(prompts) if store.holds(p)]
        assert held == [3, 4]  # the oldest writes were dropped, the newest written
        assert worker.cache.snapshot()["disk_writes"] == 2
    finally:
        release.set()
        stop(worker)


LLAMA_CONFIG = """
[models."llama"]
path = "builtin:llama"
kv_disk_bytes = "64MiB"
kv_disk_dir = "{disk}"

[models."plain"]
path = "builtin:llama"
prompt_cache_bytes = 0

[models."qwen"]
path = "builtin:qwen3"
"""


def ask(front: FrontDoor, model: str, prompt: str) -> dict[str, Any]:
    reply = front.post(
        "/v1/completions",
        {"model": model, "prompt": prompt, "max_tokens": 8, "logprobs": True},
    )
    assert reply.status == 200, reply
    choice = reply.body["choices"][0]
    return {
        "text": choice["text"],
        "logprobs": [x["logprob"] for x in choice["logprobs"]["content"]],
        "cached": reply.body["usage"]["prompt_tokens_details"]["cached_tokens"],
    }


def disk_figures(front: FrontDoor, model: str) -> dict[str, int]:
    (session,) = front.sessions_of(model)
    cache: dict[str, int] = session["prompt_cache"] or {}
    return cache


def test_unload_reload_and_a_restart_of_worker_and_daemon_hit_from_disk(disk_dir: Path) -> None:
    config = LLAMA_CONFIG.format(disk=disk_dir)
    prompt = "The history of a long chat, told once and then continued. " * 5
    with FrontDoor("--kv-disk-bytes", "64MiB", config=config) as front:
        # [serve]'s kv_disk_bytes reaches a model whose table sets none: its default directory.
        ask(front, "qwen", prompt)
        assert front.control().unload("qwen", wait=60)["unloaded"]
        assert len(entry_files(front.run_dir / "kv-disk" / "qwen")) == 1

        first = ask(front, "llama", prompt)
        recomputed = ask(front, "plain", prompt)
        assert first["cached"] == 0
        assert (first["text"], first["logprobs"]) == (recomputed["text"], recomputed["logprobs"])
        assert front.control().unload("llama", wait=60)["unloaded"]
        assert len(entry_files(disk_dir)) == 1  # written as the worker stopped

        again = ask(front, "llama", prompt)  # a new worker: its memory is empty
        assert again["cached"] > 0
        assert (again["text"], again["logprobs"]) == (recomputed["text"], recomputed["logprobs"])
        wait_until(lambda: disk_figures(front, "llama").get("disk_reads") == 1, 30)
        figures = ctl_json(front.run_dir, "cache", "list")["llama"]
        assert figures["disk_hit_tokens"] == again["cached"]
        assert figures["disk_entries"] == 1 and figures["disk_bytes"] > 0
        table = run_ctl(front.run_dir, "cache", "list").stdout
        assert "ON DISK" in table and "DISK TOKENS" in table
    # Everything stops (daemon and workers) and starts again on another run directory.
    with FrontDoor(config=config) as front:
        after = ask(front, "llama", prompt)
        assert after["cached"] > 0
        assert (after["text"], after["logprobs"]) == (recomputed["text"], recomputed["logprobs"])

        dropped = run_ctl(front.run_dir, "cache", "drop", "llama", "--disk")
        assert dropped.returncode == 0 and "disk tier" in dropped.stdout, dropped
        wait_until(lambda: entry_files(disk_dir) == [], 30)
        wait_until(lambda: disk_figures(front, "llama").get("disk_entries") == 0, 30)


def test_cache_drop_disk_removes_the_files_of_a_model_serve_has_not_loaded(
    disk_dir: Path,
) -> None:
    twin = f'[models."twin"]\npath = "builtin:llama"\nkv_disk_dir = "{disk_dir}"\n'
    config = LLAMA_CONFIG.format(disk=disk_dir) + twin
    prompt = "A chat whose model went idle and was unloaded, its history kept on disk. " * 4
    with FrontDoor("--kv-disk-bytes", "64MiB", config=config) as front:
        qwen_dir = front.run_dir / "kv-disk" / "qwen"
        ask(front, "llama", prompt)
        ask(front, "qwen", prompt)
        # Loaded: its worker writes the files; the front door leaves them to it.
        with pytest.raises(FrontDoorRefused) as refused:
            front.control().drop_disk("llama")
        assert refused.value.status == 409
        # Not loaded, but its directory is the running llama worker's: refused, with why.
        shared = run_ctl(front.run_dir, "cache", "drop", "twin", "--disk")
        assert shared.returncode == 4 and "whose worker runs" in shared.stderr, shared
        for model in ("llama", "qwen"):
            assert front.control().unload(model, wait=60)["unloaded"]
        assert len(entry_files(disk_dir)) == 1 and len(entry_files(qwen_dir)) == 1
        kept = disk_dir / "notes.txt"  # not an entry file: never removed
        kept.write_text("mine")

        dropped = run_ctl(front.run_dir, "cache", "drop", "llama", "--disk")
        assert dropped.returncode == 0, dropped
        assert "not loaded" in dropped.stdout and "1 entries" in dropped.stdout
        assert entry_files(disk_dir) == [] and kept.read_text() == "mine"
        assert len(entry_files(qwen_dir)) == 1  # another model's files stay
        removed = ctl_json(front.run_dir, "cache", "drop", "qwen", "--disk")  # its default dir
        assert removed["entries"] == 1 and removed["bytes"] > 0
        assert entry_files(qwen_dir) == []
        assert front.row("llama")["state"] == "not_loaded"
        assert ask(front, "llama", prompt)["cached"] == 0  # nothing left to read back
        # Without --disk there is nothing to drop for a model no worker serves: as before.
        assert run_ctl(front.run_dir, "cache", "drop", "qwen").returncode == 4


def test_serve_gives_every_model_the_disk_tier_unless_its_table_sets_its_own() -> None:
    models = {
        "a": {"path": "builtin:llama"},
        "b": {"path": "builtin:qwen3", "kv_disk_bytes": "1GiB", "kv_disk_dir": "/tmp/b"},
    }
    catalog = catalog_from_config(models, [], 300.0, {"--kv-disk-bytes": "8GiB"})
    assert catalog.entries["a"].worker_args == ("--kv-disk-bytes", "8GiB")
    assert catalog.entries["b"].worker_option("--kv-disk-bytes") == "1GiB"
    assert catalog.entries["b"].worker_option("--kv-disk-dir") == "/tmp/b"
    assert catalog_from_config(models, [], 300.0).entries["a"].worker_args == ()


def test_a_disk_directory_that_cannot_be_made_stops_the_worker_with_one_line(
    disk_dir: Path,
) -> None:
    not_a_dir = disk_dir / "file"
    not_a_dir.write_text("")
    with DaemonProcess(disk_dir / "run") as daemon:
        result = run_worker_until_exit(
            daemon.run_dir, "--kv-disk-bytes", "1MiB", "--kv-disk-dir", str(not_a_dir / "llama")
        )
        assert result.returncode == 2, result.stderr
        (line,) = [x for x in result.stderr.splitlines() if " ERROR " in x]
        assert "--kv-disk-dir" in line and str(not_a_dir) in line
        assert daemon.admin("sessions") == []  # its session went with it
