"""Benchmark the prompt cache's disk tier: a chat's next turn from memory, from disk after its
model was unloaded and loaded again, and recomputed; and a run of lookups on damaged files.

On the test-written medium model (hidden 1024 x 8 layers, 8 KV heads of 128, bf16; written by
:func:`vqpool.worker.testing.model_dirs.write_config_dir`) served by real ``vqpool-worker``s on
a private ``vqpoold``, for each history length and round (kinds in turn within a round, each
round on a history of its own):

* (a) **memory**: the worker with the disk tier serves the history (1 token), then the next
  turn (history + 32 new tokens): its TTFT, the history found in pool blocks;
* (b) **disk after reload**: that worker is stopped (SIGTERM: it writes its entries to disk) and
  started again (the model loads again, its memory is empty), serves a 4-token warm-up request
  (a new process's first forward pass costs extra, whatever the cache), then the next turn
  (another 32 new tokens): its TTFT, the history read from disk into pool blocks;
* (c) **recomputed**: a worker without prompt cache serves the same next turn: its TTFT.

TTFT is measured by the client (streamed, ``max_tokens`` 1). The disk's own sequential read
speed is measured in the same run with ``dd`` of a file of the entry's size (written then read
with ``iflag=direct`` where the file system allows it, else through the page cache, as the entry
is read), beside the restore rate of the entry files themselves (``read_entry``: read, checksum,
arrays). Then ``--lookups`` mixed lookups against a disk store whose files get random
truncations and corruptions injected: every hit's token ids and arrays are compared with what
was stored; a wrong hit is counted (the target is zero).

    .venv/bin/python scripts/bench_disk_cache.py                 # medium, 1K 4K 8K, 3 rounds
    .venv/bin/python scripts/bench_disk_cache.py --quick         # small, 1K 4K, 2 rounds
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from bench_vs_mlx_server import MODELS
from vqpool.worker.kv.disk_format import read_entry, read_header
from vqpool.worker.kv.disk_store import DiskStore
from vqpool.worker.testing.http_client import stream_events
from vqpool.worker.testing.launch import DaemonProcess, WorkerProcess
from vqpool.worker.testing.model_dirs import write_config_dir

NEW_TOKENS = 32
WARM_UP_PROMPT = [5, 6, 7, 8]
STOP_TIMEOUT = 300.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--histories", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lookups", type=int, default=1000)
    parser.add_argument(
        "--model", choices=["small", "medium"], default="medium", help="bench_vs_mlx_server's"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the small model (256 x 4, fp32), 1K and 4K histories, 2 rounds: under 10 minutes "
        "on 2 shared CPU cores, where the medium model prefills 4K tokens in minutes",
    )
    args = parser.parse_args()
    if args.quick:
        args.model, args.histories, args.rounds = "small", [1024, 4096], 2
    return args


def ttft(url: str, prompt: list[int], model: str = "m") -> tuple[float, int]:
    """Seconds to the first streamed token, and the cached prompt tokens the usage reports."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 1,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = None
    cached = -1
    for event in stream_events(url, "/v1/completions", body, timeout=900):
        if first is None and event.get("choices"):
            first = time.perf_counter() - start
        if event.get("usage"):
            cached = event["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first is not None
    return first, cached


class Stack:
    """A vqpoold, a worker with the disk tier (restartable) and one without a prompt cache."""

    def __init__(self, base: Path, model_dir: Path) -> None:
        self.base = base
        self.run_dir = base / "run"
        self.disk_dir = base / "kv-disk"
        self.model_dir = model_dir
        self.daemon = DaemonProcess(self.run_dir, "--budget", "6GiB").start()
        self.starts = 0
        self.disk = self._start_disk_worker()
        self.plain = WorkerProcess(
            str(model_dir),
            base / "plain.log",
            run_dir=self.run_dir,
            args=["--served-model-name", "plain", "--prompt-cache-bytes", "0"],
        ).start(timeout=600)

    def _start_disk_worker(self) -> WorkerProcess:
        self.starts += 1
        return WorkerProcess(
            str(self.model_dir),
            self.base / f"disk-{self.starts}.log",
            run_dir=self.run_dir,
            args=[
                "--served-model-name",
                "m",
                "--prompt-cache-bytes",
                "2GiB",
                "--kv-disk-bytes",
                "8GiB",
                "--kv-disk-dir",
                str(self.disk_dir),
            ],
        ).start(timeout=600)

    def reload(self) -> None:
        self.disk.stop(timeout=STOP_TIMEOUT)
        self.disk = self._start_disk_worker()
        self.warm_up()

    def warm_up(self) -> None:
        """One short request per worker: a fresh process's first forward pass pays one-time
        costs (MLX's first evaluations) that are neither the disk's nor the prefill's."""
        ttft(self.disk.url, WARM_UP_PROMPT)
        ttft(self.plain.url, WARM_UP_PROMPT, "plain")

    def close(self) -> None:
        for process in (self.disk, self.plain):
            process.stop(timeout=STOP_TIMEOUT)
        self.daemon.stop()


def dd_read_rate(directory: Path, n_bytes: int) -> tuple[float, str]:
    """Bytes per second ``dd`` reads a freshly written file of ``n_bytes`` at (the median of
    three reads), and how."""
    path = directory / "dd-probe.bin"
    mib = max(1, n_bytes >> 20)
    subprocess.run(
        ["dd", "if=/dev/urandom", f"of={path}", "bs=1M", f"count={mib}", "conv=fsync"],
        check=True,
        capture_output=True,
    )
    for flags, how in ((["iflag=direct"], "O_DIRECT"), ([], "page cache")):
        rates = []
        for _ in range(3):
            start = time.perf_counter()
            done = subprocess.run(
                ["dd", f"if={path}", "of=/dev/null", "bs=4M", *flags], capture_output=True
            )
            if done.returncode != 0:
                break
            rates.append((mib << 20) / (time.perf_counter() - start))
        if rates:
            path.unlink()
            return statistics.median(rates), how
    path.unlink()
    raise RuntimeError("dd could not read its file")


def restore_rate(directory: Path) -> tuple[float, int]:
    """Bytes per second the largest entry file restores at (read, checksum, arrays; the median
    of five after one uncounted), and its size."""
    path = max(directory.glob("*.kv"), key=lambda p: p.stat().st_size)
    header = read_header(path)
    rates = []
    for _ in range(6):
        start = time.perf_counter()
        _, arrays = read_entry(path, header.fingerprint, header.tokens)
        mx.eval(list(arrays.values()))
        rates.append(path.stat().st_size / (time.perf_counter() - start))
    return statistics.median(rates[1:]), path.stat().st_size


def bench_turns(args: argparse.Namespace, base: Path) -> None:
    model_args, dtype = MODELS[args.model]
    model_dir = write_config_dir(base / args.model, model_args, 0, dtype)
    stack = Stack(base, model_dir)
    stack.warm_up()
    rng = random.Random(0)
    results: dict[int, dict[str, list[float]]] = {}
    try:
        for n in args.histories:
            kinds: dict[str, list[float]] = {"memory": [], "disk": [], "recompute": []}
            for round_ in range(args.rounds):
                history = [rng.randrange(3, 250) for _ in range(n)]
                turn = history + [rng.randrange(3, 250) for _ in range(NEW_TOKENS)]
                ttft(stack.disk.url, history)  # the entry: the history (and one token)
                seconds, cached = ttft(stack.disk.url, turn)
                assert cached >= n - 1, cached
                kinds["memory"].append(seconds)
                stack.reload()
                turn2 = history + [rng.randrange(3, 250) for _ in range(NEW_TOKENS)]
                seconds, cached = ttft(stack.disk.url, turn2)
                assert cached >= n - 1, f"no disk hit: {cached}"
                kinds["disk"].append(seconds)
                seconds, cached = ttft(stack.plain.url, turn2, "plain")
                assert cached == 0
                kinds["recompute"].append(seconds)
                print(
                    f"history {n} round {round_ + 1}: "
                    + ", ".join(f"{k} {v[-1] * 1000:.0f} ms" for k, v in kinds.items()),
                    flush=True,
                )
            results[n] = kinds
        rate, size = restore_rate(stack.disk_dir)
        dd_rate, how = dd_read_rate(base, size)
    finally:
        stack.close()
    print()
    print("| history | memory TTFT | disk after reload TTFT | recomputed TTFT | recompute / disk |")
    print("|---|---|---|---|---|")
    for n, kinds in results.items():
        med = {k: statistics.median(v) for k, v in kinds.items()}
        spread = {k: f"{min(v) * 1000:.0f}-{max(v) * 1000:.0f}" for k, v in kinds.items()}
        print(
            f"| {n} | {med['memory'] * 1000:.0f} ms ({spread['memory']}) "
            f"| {med['disk'] * 1000:.0f} ms ({spread['disk']}) "
            f"| {med['recompute'] * 1000:.0f} ms ({spread['recompute']}) "
            f"| {med['recompute'] / med['disk']:.1f}x |"
        )
    print()
    print(
        f"entry file of {size / 2**20:.0f} MiB restored (read, CRC-32, arrays) at "
        f"{rate / 1e9:.2f} GB/s; dd read a {size / 2**20:.0f} MiB file at {dd_rate / 1e9:.2f} GB/s "
        f"({how}): restore / dd = {rate / dd_rate:.2f}"
    )


def bench_wrong_hits(n_lookups: int, base: Path) -> None:
    """Mixed lookups on a store whose files are damaged at random; every hit is checked."""
    directory = base / "wrong-hits"
    rng = random.Random(1)
    store = DiskStore(directory, 1 << 30, "fp", 16)
    stored: dict[tuple[int, ...], dict[str, mx.array]] = {}

    def put(tokens: list[int]) -> None:
        slots = -(-len(tokens) // 16) * 16
        arrays = {
            name: mx.random.normal((1, 2, slots, 8), key=mx.random.key(rng.randrange(1 << 30)))
            for name in ("keys.0", "values.0")
        }
        mx.eval(list(arrays.values()))
        if store.put(tokens, arrays, sum(a.nbytes for a in arrays.values())):
            stored[tuple(tokens)] = arrays

    prefixes = [[rng.randrange(256) for _ in range(48)] for _ in range(8)]
    for _ in range(40):  # entries sharing prefixes, so lookups land on several candidates
        put(rng.choice(prefixes) + [rng.randrange(256) for _ in range(rng.randrange(1, 80))])
    counts = dict.fromkeys(("hits", "misses", "wrong_hits", "damaged", "restarts"), 0)
    for i in range(n_lookups):
        files = sorted(directory.glob("*.kv"))
        action = rng.random()
        if action < 0.15 and files:
            victim = rng.choice(files)
            data = bytearray(victim.read_bytes())
            if rng.random() < 0.5:
                data = data[: rng.randrange(len(data))]
            else:
                for _ in range(rng.randrange(1, 4)):
                    data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            victim.write_bytes(bytes(data))
            counts["damaged"] += 1
        elif action < 0.2:
            store = DiskStore(directory, 1 << 30, "fp", 16)
            counts["restarts"] += 1
        elif action < 0.3:
            put(rng.choice(prefixes) + [rng.randrange(256) for _ in range(rng.randrange(1, 80))])
        choice = rng.random()
        if choice < 0.6 and stored:
            prompt = list(rng.choice(list(stored)))
            prompt = prompt[: rng.randrange(17, len(prompt) + 1)] + [rng.randrange(256)] * 5
        elif choice < 0.8:
            prompt = rng.choice(prefixes) + [rng.randrange(256) for _ in range(30)]
        else:
            prompt = [rng.randrange(256) for _ in range(rng.randrange(20, 120))]
        entry, n = store.match(prompt, len(prompt) - 1)
        arrays = None if entry is None else store.load(entry)
        if entry is None or arrays is None:
            counts["misses"] += 1
        else:
            truth = stored.get(entry.tokens)
            right = (
                entry.tokens[:n] == tuple(prompt[:n])
                and truth is not None
                and truth.keys() == arrays.keys()
                and all(mx.array_equal(truth[k], arrays[k]).item() for k in truth)
            )
            counts["hits" if right else "wrong_hits"] += 1
        if i % 250 == 249:
            print(f"lookup {i + 1}: {counts}", flush=True)
    print(f"{n_lookups} lookups: {counts}", flush=True)


def main() -> None:
    args = parse_args()
    # The damaged files' removals are logged as warnings: counted here, not printed.
    logging.getLogger("vqpool.worker").setLevel(logging.ERROR)
    base = Path(tempfile.mkdtemp(prefix="vqdb", dir="/tmp"))
    try:
        bench_wrong_hits(args.lookups, base)
        bench_turns(args, base)
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=False)


if __name__ == "__main__":
    main()
