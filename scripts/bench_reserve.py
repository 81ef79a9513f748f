#!/usr/bin/env python3
"""Growth on demand against whole reservations on the demo's load: ``scripts/demo.py`` run in
rounds, each running every mode once (the workers' ``--reserve``), in an order that rotates
from round to round and reverses every other cycle, so that each mode runs first, middle and
last as often and the noise of a shared machine falls on all. With ``--together`` a round's
modes run at once instead, their loads starting at the same second: on a machine whose load
from others moves a run's tokens by 10-40%, runs one after the other see different machines,
runs together the same one (each also takes part of the CPU from the others, alike).

Per mode: medians over the rounds, with the spread (lowest-highest), of tokens generated (both
models), tokens per second of load, preemptions per second, p99 TTFT per model, and where the
workers' time went (``GET /v1/stats``: mean batch, busy seconds in growth calls, tokens
prefilled again after preemptions, admission wait, requests started on average over the
load, seconds requests waited with ``--max-concurrent`` started and with fewer, i.e. for
memory) and the CPU seconds per second of load of each process. Then each mode against full:
the ratio of the medians, the rounds' ratios (median, lowest-highest: a round's modes ran
back to back, so its ratio sees one machine load) and the ratio of the sums. Each round's
line and the summary give the one-minute load average.

    .venv/bin/python scripts/bench_reserve.py --rounds 4 --duration 25 [--together]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEMO = Path(__file__).with_name("demo.py")
START_SECONDS = 45.0
"""With ``--together``, the runs' loads start this long after they are launched: time for
every run's front door, vqpoold and workers to start on a busy machine."""


def demo_command(mode: str, duration: float, out: Path, extra: list[str]) -> list[str]:
    """The demo run of ``mode`` (``RESERVE`` or ``RESERVE:GROWTH_WAIT``, the workers'
    ``--reserve`` and ``--growth-wait``), writing its ``--json`` figures to ``out``."""
    reserve, _, growth_wait = mode.partition(":")
    command = [sys.executable, str(DEMO), "--duration", str(duration), "--reserve", reserve]
    if growth_wait:
        command += ["--growth-wait", growth_wait]
    return [*command, "--json", str(out), *extra]


def run_round(
    modes: list[str], duration: float, extra: list[str], together: bool
) -> dict[str, dict[str, Any]]:
    """Each mode's demo figures: one run after the other, or all at once with their loads
    starting at the same second (``together``)."""
    figures: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="vqreserve-") as tmp:
        outs = {mode: Path(tmp) / f"{i}.json" for i, mode in enumerate(modes)}
        batches = [modes] if together else [[mode] for mode in modes]
        for batch in batches:
            start = ["--load-at", str(time.time() + START_SECONDS)] if together else []
            running = {
                mode: subprocess.Popen(
                    demo_command(mode, duration, outs[mode], [*extra, *start]),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
                for mode in batch
            }
            for mode, process in running.items():
                output, _ = process.communicate()
                if process.returncode != 0 or not outs[mode].exists():
                    sys.stderr.write(output[-4000:])
                    raise SystemExit(
                        f"demo.py --reserve {mode} failed (exit status {process.returncode})"
                    )
                figures[mode] = json.loads(outs[mode].read_text())
    return figures


def derived(run: dict[str, Any]) -> dict[str, float]:
    """The figures of one run that the table shows."""
    seconds = run["seconds"]
    models = run["models"]
    row: dict[str, float] = {
        "tokens": sum(m["stats"]["completion_tokens"] for m in models.values()),
        "preemptions/s": run["preemptions"] / seconds,
    }
    row["tokens/s"] = row["tokens"] / seconds
    for role, cpu in run.get("cpu_seconds", {}).items():
        row[f"cpu/s {role.split(':')[-1]}"] = cpu / seconds
    for name, m in models.items():
        s = m["stats"]
        short = name.split(":")[-1]
        row[f"tokens/s {short}"] = s["completion_tokens"] / seconds
        row[f"decode steps/s {short}"] = s["decode_steps"] / seconds
        row[f"mean started {short}"] = s["row_seconds"] / seconds
        row[f"blocks per started {short}"] = s["block_seconds"] / max(1e-9, s["row_seconds"])
        row[f"queued at cap s {short}"] = s["queued_at_most_seconds"]
        row[f"queued below cap s {short}"] = s["queued_below_most_seconds"]
        row[f"p99 TTFT {short} s"] = m["p99_ttft"] if m["p99_ttft"] is not None else float("nan")
        row[f"mean batch {short}"] = s["decode_rows"] / max(1, s["decode_steps"])
        row[f"grow s {short}"] = s["grow_seconds"]
        row[f"recomputed {short}"] = s["recompute_tokens"]
        row[f"admission wait s {short}"] = s["admission_wait_seconds"] / max(1, s["admitted"])
        row[f"reserved whole {short}"] = s["reserved_whole"] / max(1, s["admitted"])
        row[f"ended at max_tokens {short}"] = s["ended_length"] / max(
            1, s["ended_length"] + s["ended_stop"]
        )
    return row


def round_order(modes: list[str], i: int) -> list[str]:
    """The order of round ``i``'s modes: rotated by one each round, reversed every other
    cycle of rotations."""
    n = len(modes)
    rotated = modes[i % n :] + modes[: i % n]
    return rotated[::-1] if (i // n) % 2 else rotated


def spread(values: list[float]) -> str:
    median = statistics.median(values)
    return f"{median:,.2f} ({min(values):,.2f}-{max(values):,.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="runs of each mode (default 3)")
    parser.add_argument("--duration", type=float, default=25.0, help="demo.py --duration")
    parser.add_argument(
        "--modes",
        default="auto,full,on-demand",
        help="the modes to alternate: --reserve values, each maybe with :GROWTH_WAIT (seconds)",
    )
    parser.add_argument(
        "--together",
        action="store_true",
        help="run a round's modes at once, their loads starting at the same second, so that "
        "they share the machine's load (each takes part of the CPU from the others: read "
        "their ratios, not their tokens, against separate runs)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write every run's figures there")
    args, extra = parser.parse_known_args()
    modes = args.modes.split(",")
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    loads: list[float] = []
    for i in range(args.rounds):
        order = round_order(modes, i)
        figures = run_round(order, args.duration, extra, args.together)
        starts = [figures[mode]["load_started"] for mode in order]
        if args.together:
            print(f"round {i + 1}: loads started within {max(starts) - min(starts):.1f} s")
        for mode in order:
            run = figures[mode]
            runs[mode].append(run)
            row = derived(run)
            loads.append(run["load_average"])
            print(
                f"round {i + 1} {mode:<9} tokens {row['tokens']:,.0f} ({row['tokens/s']:,.0f}/s) "
                f"preemptions {row['preemptions/s']:.1f}/s  load average "
                f"{run['load_average']:.1f}",
                flush=True,
            )
    table = {m: [derived(r) for r in runs[m]] for m in modes}
    keys = list(table[modes[0]][0])
    print(
        f"\nmedians over {args.rounds} rounds (lowest-highest), demo.py --duration "
        f"{args.duration:g} {' '.join(extra)}; load average {spread(loads)}:"
    )
    for key in keys:
        cells = "  ".join(f"{m}: {spread([r[key] for r in table[m]]):<28}" for m in modes)
        print(f"  {key:<28} {cells}")
    if "full" in table:
        full = table["full"]
        for mode in modes:
            if mode == "full":
                continue
            rows = table[mode]
            ratios = [a["tokens"] / b["tokens"] for a, b in zip(rows, full, strict=True)]
            rates = [a["tokens/s"] / b["tokens/s"] for a, b in zip(rows, full, strict=True)]
            medians = statistics.median(r["tokens"] for r in rows) / statistics.median(
                r["tokens"] for r in full
            )
            summed = sum(r["tokens"] for r in rows) / sum(r["tokens"] for r in full)
            print(
                f"{mode} / full tokens: {medians:.3f} (ratio of medians); rounds' ratios "
                f"{spread(ratios)}; summed {summed:.3f}; rounds' ratios of tokens/s "
                f"{spread(rates)}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
