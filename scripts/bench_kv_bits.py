#!/usr/bin/env python3
"""Quantized KV: context per GiB of budget and serving speed at 16, 8 and 4 bits, vqpool-worker
against stock mlx_lm.server with the same ``--kv-bits``, in the same run.

Builds the medium model directory of ``bench_vs_mlx_server.py`` (hidden 1024 x 8 layers, 8 KV
heads of 64 dims, bf16, random weights whose EOS never wins so every request generates exactly
``--max-tokens`` tokens) and serves it, for each KV setting (16 bits: the model's bf16; 8 and 4
bits: ``--kv-bits B --kv-group-size G --quantized-kv-start 0``, quantized from the first token,
on both servers), with ``vqpool-worker`` drawing its blocks from a live ``vqpoold`` and with
``python -m mlx_lm.server``.

Context per GiB: the bytes per block the worker declared at hello for its format (what the
daemon's ledger charges each block of it: tests/test_daemon_kv_formats.py holds it to that at
every step), checked against shared/kv_formats.py's formula and against a block the ledger
charged during a request (``model_list``'s bytes per format over its blocks); tokens per GiB are
whole blocks of ``block_size`` tokens in 2**30 bytes, and the ratio is against 16 bits.

Speed, per round and setting, the two servers started side by side (one busy at a time, their
order alternating from round to round): a batch of each ``--concurrency`` (1 always) of
simultaneous requests of ``--context``-token prompts: aggregate generated tokens per second
over the batch's wall time (mlx_lm.server serves requests one at a time when ``--kv-bits`` is
set), and of the one request at concurrency 1 its TTFT and decode rate (tokens after the first
over the time after the first).
Prompts differ between requests, batches and rounds (no prompt cache reuse). Reported as
medians over rounds with the per-round ratios vqpool / mlx_lm.server (median, and min-max).

The issue's full run (a 4K prefill takes minutes here: hours on this shared 2-core machine):

    .venv/bin/python scripts/bench_kv_bits.py --context 4096 --concurrency 1 8 --rounds 3

A short one: ``--short`` (context 128, concurrency 1 and 2, 2 rounds, 16 tokens; under 10
minutes on an idle 2-core machine): its speed ratios are at short context, where the KV is a
small part of the work; the context per GiB is exact either way. The defaults are the full run.

Context per GiB alone: ``--context-only`` (no speed part, no mlx_lm.server; a minute): the
medium model at ``--group-size``, and a model with Llama-3.2-3B's head (128 dims, bf16; 2 layers
of one KV head, since the ratios depend only on the head's width and dtype) at groups 64 and
128, each format's bytes per block as a live worker declared them at hello:

    .venv/bin/python scripts/bench_kv_bits.py --context-only
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench_vs_mlx_server import (
    MODELS,
    READY_TIMEOUT,
    Batch,
    MlxLmServer,
    _load,
    make_prompts,
    never_emit_eos,
    run_batch,
)
from vqpool.shared.admin_client import AdminClient
from vqpool.shared.kv_formats import parse_format, quantized_format
from vqpool.shared.kv_size import kv_block_bytes
from vqpool.worker.testing.launch import DaemonProcess, WorkerProcess
from vqpool.worker.testing.model_dirs import write_config_dir

GIB = 1 << 30
SERVERS = ("mlx_lm.server", "vqpool-worker")
MEDIUM_TITLE = "medium model, 1024 x 8 layers, 8 KV heads x 64, bf16"
HEAD_128: dict[str, Any] = {
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "intermediate_size": 512,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}
"""Llama-3.2-3B's head (128 dims, bf16) on a model kept tiny: the ratios to 16 bits depend
only on the head's width and the dtype, not on the layers or heads."""
HEAD_128_TITLE = "Llama-3.2-3B's head: 128 dims, bf16; 2 layers x 1 KV head"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Full run (the issue's): --context 4096 --concurrency 1 8 --rounds 3 (the "
        "defaults; hours on this shared machine). Short run: --short (context 128, concurrency "
        "1 2, 2 rounds, 16 tokens; under 10 minutes on an idle 2-core machine).",
    )
    parser.add_argument("--bits", type=int, nargs="+", default=[16, 8, 4], choices=[16, 8, 4])
    parser.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128])
    parser.add_argument(
        "--context", type=int, default=4096, help="prompt tokens per request (default 4096)"
    )
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 8],
        help="simultaneous requests per batch (default: 1 8)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument(
        "--max-tokens", type=int, default=64, help="tokens generated per request (default 64)"
    )
    parser.add_argument(
        "--short", action="store_true",
        help="context 128, concurrency 1 2, 2 rounds, 16 tokens",
    )  # fmt: skip
    parser.add_argument(
        "--context-only", action="store_true",
        help="only the context per GiB (no speed part): the medium model at --group-size and "
        "a 128-dim head (Llama-3.2-3B's) at groups 64 and 128, from live workers' declarations",
    )  # fmt: skip
    args = parser.parse_args()
    if args.short:
        args.context, args.concurrency, args.rounds, args.max_tokens = 128, [1, 2], 2, 16
    if min(args.rounds, args.max_tokens, args.context, *args.concurrency) < 1:
        parser.error("--rounds, --max-tokens, --context and --concurrency must be >= 1")
    args.concurrency = sorted({1, *args.concurrency})  # c=1 gives the TTFT and decode rate
    return args


def kv_args(bits: int, group_size: int) -> list[str]:
    """The KV options both servers get for ``bits`` (none for 16: the model's own dtype)."""
    if bits == 16:
        return []
    return ["--kv-bits", str(bits), "--kv-group-size", str(group_size), "--quantized-kv-start", "0"]


def start(kind: str, model_dir: Path, log: Path, run_dir: Path, extra: list[str], c: int) -> Any:
    """A ready server of ``kind``: an object with ``url`` and ``stop()``."""
    if kind == "mlx_lm.server":
        server = MlxLmServer(model_dir, log, extra)
        try:
            server.wait_ready()
        except BaseException:
            server.stop()
            raise
        return server
    worker = WorkerProcess(
        str(model_dir),
        log,
        run_dir=run_dir,
        args=["--max-concurrent", str(c), "--log-level", "WARNING", *extra],
    )
    try:
        worker.start(timeout=READY_TIMEOUT)
    except BaseException:
        worker.stop()
        raise
    return worker


def declared_block_bytes(run_dir: Path, fmt: str, pid: int | None = None) -> int:
    """Bytes per block (all streams) the connected worker (the one of ``pid``, or the only
    one) declared for ``fmt``."""
    with AdminClient(run_dir, timeout=5.0) as admin:
        sessions = admin.call("sessions")
    (session,) = [s for s in sessions if pid is None or s["pid"] == pid]
    costs = session["bytes_per_format"].get(fmt) or session["bytes_per_block"]
    return int(costs["k"] + costs["v"])  # (its "kv" entry prices a shared-kv pool's block)


def charged_block_bytes(run_dir: Path, fmt: str) -> int | None:
    """Bytes per block the ledger charges the worker's blocks of ``fmt`` now (None: none held)."""
    with AdminClient(run_dir, timeout=5.0) as admin:
        models = admin.call("model_list")["models"]
    for view in models:
        held = view["formats"].get(fmt)
        if held and held["blocks"]:  # as many k blocks as v blocks, each half a block's bytes
            return int(2 * held["bytes"] // held["blocks"])
    return None


class Setting:
    """What one KV setting measured, over rounds."""

    def __init__(self, bits: int) -> None:
        self.bits = bits
        self.fmt = ""
        self.block_bytes = 0
        self.charged: int | None = None
        self.ttft: dict[str, list[float]] = {kind: [] for kind in SERVERS}
        self.decode: dict[str, list[float]] = {kind: [] for kind in SERVERS}
        self.batches: dict[tuple[str, int], list[Batch]] = {}


def bench_setting(
    setting: Setting,
    round_no: int,
    model_dir: Path,
    args: argparse.Namespace,
    base: Path,
    run_dir: Path,
) -> None:
    extra = kv_args(setting.bits, args.group_size)
    order = SERVERS if round_no % 2 == 0 else SERVERS[::-1]
    servers: dict[str, Any] = {}
    try:
        for kind in order:
            log = base / f"{setting.bits}-{round_no}-{kind}.log"
            servers[kind] = start(kind, model_dir, log, run_dir, extra, max(args.concurrency))
            run_batch(servers[kind].url, make_prompts(model_dir, 1, 8, seed=-1 - round_no), 4)
        if not setting.fmt:
            with AdminClient(run_dir, timeout=5.0) as admin:
                (session,) = admin.call("sessions")
            quantized = [f for f in session["bytes_per_format"] if parse_format(f) is not None]
            setting.fmt = quantized[0] if quantized else "bf16"  # the model's dtype
            setting.block_bytes = declared_block_bytes(run_dir, setting.fmt)
        seed = 100_000 * setting.bits + 1000 * round_no
        for c in args.concurrency:
            prompts = make_prompts(model_dir, c, args.context, seed=seed + 10 * c)
            for kind in order:
                if kind == "vqpool-worker" and setting.charged is None:
                    sample: list[int | None] = []
                    batch = _batch_sampling(
                        servers[kind].url, prompts, args, run_dir, setting, sample
                    )
                    setting.charged = next((s for s in sample if s), None)
                else:
                    batch = run_batch(servers[kind].url, prompts, args.max_tokens)
                setting.batches.setdefault((kind, c), []).append(batch)
                text = f"c={c} {batch.tokens_per_s:7.1f} tok/s"
                if c == 1:  # one request: its TTFT, and its decode rate after the first token
                    decode = (batch.completion_tokens - 1) / (batch.latency_p50 - batch.ttft_p50)
                    setting.ttft[kind].append(batch.ttft_p50)
                    setting.decode[kind].append(decode)
                    text += f", TTFT {batch.ttft_p50:6.2f} s, decode {decode:6.1f} tok/s"
                log_line(setting, round_no, kind, text)
    finally:
        for server in servers.values():
            server.stop()


def _batch_sampling(
    url: str,
    prompts: list[str],
    args: argparse.Namespace,
    run_dir: Path,
    setting: Setting,
    sample: list[int | None],
) -> Batch:
    """run_batch, sampling the ledger's charge per block of the setting's format meanwhile."""
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            sample.append(charged_block_bytes(run_dir, setting.fmt))
            done.wait(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        return run_batch(url, prompts, args.max_tokens)
    finally:
        done.set()
        watcher.join()


def log_line(setting: Setting, round_no: int, kind: str, text: str) -> None:
    print(
        f"  {setting.bits:>2}-bit round {round_no + 1} {kind:14} {text}",
        file=sys.stderr,
        flush=True,
    )


def ratio(top: list[float], bottom: list[float]) -> str:
    """Median of the per-round ratios, with their min-max."""
    ratios = [t / b for t, b in zip(top, bottom, strict=True)]
    text = f"{statistics.median(ratios):.2f}x"
    if len(ratios) > 1:
        text += f" ({min(ratios):.2f}-{max(ratios):.2f})"
    return text


def spread(values: list[float], digits: int = 1) -> str:
    """Median with min-max."""
    text = f"{statistics.median(values):.{digits}f}"
    if len(values) > 1:
        text += f" ({min(values):.{digits}f}-{max(values):.{digits}f})"
    return text


def context_table(
    title: str, rows: list[tuple[int, int, str, int, int | None]], spec: str, block_size: int
) -> None:
    """The context-per-GiB table of ``rows`` (bits, group size, format, bytes per block
    declared, charged or None), 16 bits first: whole blocks of ``block_size`` tokens in a GiB,
    each declaration checked against shared/kv_formats.py's formula."""
    base_tokens = GIB // rows[0][3] * block_size
    print(f"\n### Context per GiB of budget ({title})\n")
    print(
        "| KV | format | bytes per block (k+v, declared) | formula | charged "
        "| tokens per GiB | vs 16-bit |"
    )
    print("|---|---|---|---|---|---|---|")
    for bits, group_size, fmt, declared, charged in rows:
        formula = kv_block_bytes(spec, block_size, None if bits == 16 else bits, group_size)
        tokens = GIB // declared * block_size
        print(
            f"| {bits}-bit | {fmt} | {declared} | {formula} | {charged or '-'} "
            f"| {tokens:,} | {tokens / base_tokens:.2f}x |"
        )


def report(settings: list[Setting], args: argparse.Namespace, spec: str, block_size: int) -> None:
    ordered = sorted(settings, key=lambda s: s.bits != 16)
    context_table(
        MEDIUM_TITLE,
        [(s.bits, args.group_size, s.fmt, s.block_bytes, s.charged) for s in ordered],
        spec,
        block_size,
    )
    print(
        f"\n### Speed at {args.context}-token prompts, {args.max_tokens} tokens generated "
        f"(medians over {args.rounds} round(s); ratios: vqpool / mlx_lm.server, median (min-max))\n"
    )
    print("| KV | measure | mlx_lm.server | vqpool-worker | ratio |")
    print("|---|---|---|---|---|")
    mlx, ours = SERVERS
    for s in settings:
        print(
            f"| {s.bits}-bit | TTFT (s), c=1 | {spread(s.ttft[mlx], 2)} "
            f"| {spread(s.ttft[ours], 2)} | {ratio(s.ttft[ours], s.ttft[mlx])} |"
        )
        print(
            f"| {s.bits}-bit | decode tok/s, c=1 | {spread(s.decode[mlx])} "
            f"| {spread(s.decode[ours])} | {ratio(s.decode[ours], s.decode[mlx])} |"
        )
        for c in args.concurrency:
            top = [b.tokens_per_s for b in s.batches[(ours, c)]]
            bottom = [b.tokens_per_s for b in s.batches[(mlx, c)]]
            print(
                f"| {s.bits}-bit | batch tok/s, c={c} | {spread(bottom)} | {spread(top)} "
                f"| {ratio(top, bottom)} |"
            )


def declared_by_worker(
    model_dir: Path, run_dir: Path, log: Path, bits: int, group_size: int, dtype_tag: str
) -> tuple[str, int]:
    """The format and bytes per block a live worker serving ``model_dir`` with ``bits`` (16:
    the model's dtype) in groups of ``group_size`` declared at hello."""
    fmt = dtype_tag if bits == 16 else quantized_format(bits, group_size)
    worker = start("vqpool-worker", model_dir, log, run_dir, kv_args(bits, group_size), 1)
    try:
        return fmt, declared_block_bytes(run_dir, fmt, worker.pid)
    finally:
        worker.stop()


def context_only(args: argparse.Namespace, base: Path, run_dir: Path, block_size: int) -> None:
    """The context-per-GiB tables alone (``--context-only``): the medium model and the
    128-dim head."""
    medium, dtype = MODELS["medium"]
    models = [
        ("medium", medium, [args.group_size], MEDIUM_TITLE),
        ("head128", {**medium, **HEAD_128}, [64, 128], HEAD_128_TITLE),
    ]
    quantized_bits = [b for b in args.bits if b != 16]
    for name, config, groups, title in models:
        model_dir = write_config_dir(base / name, config, seed=0, dtype=dtype)
        rows: list[tuple[int, int, str, int, int | None]] = []
        for bits, group_size in [(16, groups[0])] + [
            (b, g) for g in groups for b in quantized_bits
        ]:
            log = base / f"{name}-{bits}-{group_size}.log"
            fmt, declared = declared_by_worker(model_dir, run_dir, log, bits, group_size, "bf16")
            rows.append((bits, group_size, fmt, declared, None))
        context_table(title, rows, str(model_dir), block_size)


def main() -> int:
    args = parse_args()
    base = Path(tempfile.mkdtemp(prefix="vqkvbits-", dir="/tmp"))
    run_dir = base / "run"
    config, dtype = MODELS["medium"]
    config = {**config, "max_position_embeddings": max(4096, 2 * (args.context + args.max_tokens))}
    daemon = DaemonProcess(run_dir, "--n-blocks", "65536", "--log-level", "WARNING")
    started = time.monotonic()
    try:
        daemon.start()
        model_dir = write_config_dir(base / "medium", config, seed=0, dtype=dtype)
        never_emit_eos(model_dir)
        with AdminClient(run_dir, timeout=5.0) as admin:
            block_size = admin.call("stats")["config"]["block_size"]
        if args.context_only:
            print(f"KV bits {args.bits}: context per GiB only; load average {_load()} at start")
            context_only(args, base, run_dir, block_size)
            print(f"\n{time.monotonic() - started:.0f} s in all; load average {_load()} at the end")
            return 0
        print(
            f"KV bits {args.bits} (group {args.group_size}, quantized from the first token), "
            f"{args.context}-token prompts, {args.max_tokens} tokens, concurrency "
            f"{args.concurrency}, {args.rounds} round(s); load average {_load()} at start",
            flush=True,
        )
        settings = [Setting(bits) for bits in args.bits]
        for round_no in range(args.rounds):
            for setting in settings:
                bench_setting(setting, round_no, model_dir, args, base, run_dir)
        report(settings, args, str(model_dir), block_size)
        quantized_names = [quantized_format(b, args.group_size) for b in args.bits if b != 16]
        print(
            f"\nformats {quantized_names}; {time.monotonic() - started:.0f} s in all; load "
            f"average {_load()} at the end (2 vCPUs shared: read ratios, not absolutes)"
        )
        return 0
    finally:
        daemon.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
