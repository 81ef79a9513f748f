"""Show whether vqpoold runs and the state of its pool.

Prints the daemon's pid, uptime, boot id and version, the pool's configuration, blocks in use,
free and total per stream, fragmentation, what the workers of each model hold (blocks and
bytes, and how many of those bytes their prompt caches hold: see `vqpoolctl cache list`; when
some model's blocks are quantized (`vqpool-worker --kv-bits`), its blocks and bytes per block
format, each block at its format's bytes, as the budget charges it; their
weights and the memory their processes hold, measured, as `vqpoolctl model list`), and
the memory budget: the budget, bytes held and free, reserves (lent) and requests waiting,
reclaims (asked, answered, late, bytes given back, answer p50/p99) and preemptions, and per
model its bytes held, reserve, limit, weight, bytes borrowed above its reserve, entitlement and
requests waiting (as `vqpoolctl model list`). When a front door (`vqpool serve`) runs on the
run directory, then its URL and pid and each of its models' state and requests running and
queued (as `vqpoolctl ps`; in --json its answer as "front_door", null when none runs). Exits 3
when no daemon answers on the run directory.
"""

from __future__ import annotations

import argparse

from vqpool.daemon.ctl.budgets import budget_report, measured, weights
from vqpool.daemon.ctl.context import Ctl
from vqpool.daemon.ctl.exits import Exit
from vqpool.daemon.ctl.front_door import front_door_or_none, models_table
from vqpool.daemon.ctl.options import add_json
from vqpool.daemon.ctl.render import duration, human_bytes, percent, table
from vqpool.daemon.ctl.summaries import (
    formats_text,
    in_use,
    per_model,
    pool_line,
    shows_formats,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_json(parser)


def run(ctl: Ctl, args: argparse.Namespace) -> int:
    stats = ctl.call("stats")
    models = per_model(ctl.call("sessions"))
    listing = ctl.call("model_list")
    front_door = front_door_or_none(ctl)
    if ctl.as_json:
        budget = {**listing["budget"], "models": listing["models"]}
        ctl.print_json(
            {
                **stats,
                "in_use": in_use(stats),
                "models": models,
                "budget": budget,
                "front_door": front_door,
            }
        )
        return Exit.OK
    st = stats["stats"]
    used = in_use(stats)
    ctl.print(
        f"vqpoold {stats['version']} running: pid {stats['pid']}, up "
        f"{duration(stats['uptime_s'])}, boot {stats['boot_id']}, protocol {stats['protocol']}"
    )
    ctl.print(f"run dir: {stats['run_dir']}")
    ctl.print(f"pool:    {pool_line(stats)}")
    ctl.print()
    rows = [
        [s, used[s], c["free"], c["total"], percent(used[s] / c["total"]) if c["total"] else "-"]
        for s, c in stats["streams"].items()
    ]
    ctl.print(table(["STREAM", "IN USE", "FREE", "TOTAL", "USED"], rows, right={"USED"}))
    ctl.print()
    ctl.print(
        f"fragmentation {st['fragmentation']:.4f} ({st['fragmented_count']} partly filled "
        f"blocks); peak in use {st['peak_blocks_in_use']}; exhausted {st['n_exhausted']}, "
        f"grown {st['n_grown']}, retired {st['n_retired']}"
    )
    ctl.print(
        f"sessions {stats['sessions']} (opened {stats['sessions_opened']}, reaped "
        f"{stats['sessions_reaped']}, evicted {stats['sessions_evicted']}); owners "
        f"{stats['owners']}; requests {stats['requests']} (bad {stats['bad_requests']}, "
        f"replies dropped {stats['replies_dropped']})"
    )
    if models:
        ctl.print()
        streams = list(stats["streams"])
        views = {view["model"]: view for view in listing["models"]}
        # Weights and measured memory when a worker reports them (raw clients report none).
        memory = any(view.get("memory") is not None for view in views.values())
        formats = shows_formats(m["formats"] for m in models.values())
        rows = [
            [
                name,
                m["sessions"],
                *(m["blocks"].get(s, 0) for s in streams),
                human_bytes(m["bytes_total"]),
                "-" if m["prompt_cache"] is None else human_bytes(m["prompt_cache"]["bytes"]),
                *((weights(views.get(name, {})), measured(views.get(name, {}))) if memory else ()),
                *((formats_text(m["formats"]),) if formats else ()),
            ]
            for name, m in models.items()
        ]
        headers = [
            "MODEL",
            "SESSIONS",
            *(f"BLOCKS {s.upper()}" for s in streams),
            "BYTES HELD",
            "OF WHICH CACHED",
            *(("WEIGHTS", "MEASURED") if memory else ()),
            *(("KV FORMATS",) if formats else ()),
        ]
        right = {"BYTES HELD", "OF WHICH CACHED", "WEIGHTS", "MEASURED"}
        ctl.print(table(headers, rows, right=right))
    ctl.print()
    for line in budget_report(listing):
        ctl.print(line)
    if front_door is not None:
        ctl.print()
        ctl.print(models_table(front_door))
    return Exit.OK
