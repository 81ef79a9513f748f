"""Show the workers' prompt caches per model, or make a model's workers drop theirs.

cache list: one row per model: cached bytes and blocks (part of the bytes its workers hold),
entries, lookups, hits, hit rate, prompt tokens reused from the cache and prefilled, and entries
evicted; then its disk tier (--kv-disk-bytes): bytes and entries on disk, entries read back and
written, writes dropped (the writer's queue was full) and prompt tokens answered from disk; as
the workers last reported them in their heartbeat ("-" for a model none of whose workers reports
a prompt cache); when some model's blocks are quantized (`vqpool-worker --kv-bits`), the blocks
and bytes its workers hold per block format (KV FORMATS).

cache drop MODEL: tell every worker of MODEL (its name as `vqpoolctl sessions` shows it, or a
label naming only it, as in `model list`) to drop its prompt cache. The daemon tells each worker
in the answer to its next heartbeat (within a quarter of the lease), so the blocks come back
within that time, not at once. With --disk the entries of their disk tier are removed too;
for a model `vqpool serve` serves and has not loaded, it removes the files of the model's disk
tier itself (no worker writes them). Exits 4 when no worker of MODEL is connected (and, with
--disk, no `vqpool serve` serves it unloaded).
"""

from __future__ import annotations

import argparse
from typing import Any

from vqpool.daemon.ctl.context import Ctl
from vqpool.daemon.ctl.exits import Exit
from vqpool.daemon.ctl.options import add_action, add_actions, op_help
from vqpool.daemon.ctl.render import human_bytes, percent, table
from vqpool.daemon.ctl.summaries import formats_text, per_model, shows_formats
from vqpool.shared.errors import VqpoolError
from vqpool.shared.front_client import FrontDoorNotRunning, FrontDoorRefused
from vqpool.shared.protocol import CACHE_DROP

LIST_HELP, DROP_HELP = (part.strip() for part in (__doc__ or "").split("\n\n")[1:3])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = add_actions(parser)
    add_action(actions, "list", "the prompt caches per model", LIST_HELP)
    dropping = add_action(
        actions, "drop", "make a model's workers drop their prompt cache", DROP_HELP
    )
    dropping.add_argument("name", metavar="MODEL", help=op_help(CACHE_DROP, "model"))
    dropping.add_argument("--disk", action="store_true", help=op_help(CACHE_DROP, "disk"))


def _list(ctl: Ctl) -> int:
    held = per_model(ctl.call("sessions"))
    models = {name: model["prompt_cache"] for name, model in held.items()}
    if ctl.as_json:
        ctl.print_json(models)
        return Exit.OK
    formats = shows_formats(model["formats"] for model in held.values())
    rows = []
    for name, cache in models.items():
        kv_formats = [formats_text(held[name]["formats"])] if formats else []
        if cache is None:
            rows.append([name, *["-"] * 15, *kv_formats])
            continue
        rate = percent(cache["hits"] / cache["lookups"]) if cache["lookups"] else "-"
        rows.append(
            [
                name,
                human_bytes(cache["bytes"]),
                cache["blocks"],
                cache["entries"],
                cache["lookups"],
                cache["hits"],
                rate,
                cache["tokens_reused"],
                cache["tokens_prefilled"],
                cache["evictions"],
                human_bytes(cache["disk_bytes"]),
                cache["disk_entries"],
                cache["disk_reads"],
                cache["disk_writes"],
                cache["disk_dropped_writes"],
                cache["disk_hit_tokens"],
                *kv_formats,
            ]
        )
    headers = [
        "MODEL",
        "CACHED",
        "BLOCKS",
        "ENTRIES",
        "LOOKUPS",
        "HITS",
        "HIT RATE",
        "TOKENS REUSED",
        "PREFILLED",
        "EVICTED",
        "ON DISK",
        "DISK ENTRIES",
        "READ",
        "WRITTEN",
        "DROPPED",
        "DISK TOKENS",
        *(["KV FORMATS"] if formats else []),
    ]
    right = set(headers[1:]) - {"KV FORMATS"}
    ctl.print(table(headers, rows, right=right) if rows else "no worker sessions")
    return Exit.OK


def _drop_unloaded(ctl: Ctl, name: str) -> dict[str, Any] | FrontDoorRefused | None:
    """The front door's removal of the disk tier of ``name``, which it serves and has not
    loaded; its refusal when a worker runs (of the model, or of another model sharing the
    directory; a loaded model's worker drops its files, told by vqpoold); None when no front
    door runs or it does not serve ``name``."""
    try:
        return ctl.front_door().drop_disk(name)
    except FrontDoorNotRunning:
        return None
    except FrontDoorRefused as exc:
        if exc.status == 404:
            return None
        if exc.status == 409:
            return exc
        raise


def _drop(ctl: Ctl, args: argparse.Namespace) -> int:
    removed = _drop_unloaded(ctl, args.name) if args.disk else None
    if isinstance(removed, dict):
        if ctl.as_json:
            ctl.print_json(removed)
        else:
            ctl.print(
                f"model {removed['model']} (not loaded): removed {removed['entries']} entries "
                f"({human_bytes(removed['bytes'])}) of its disk tier in {removed['directory']}"
            )
        return Exit.OK
    try:
        result = ctl.call("cache_drop", model=args.name, disk=args.disk)
    except (VqpoolError, ValueError):
        if removed is not None:  # the front door's reason says more (a load under way...)
            raise removed from None
        raise
    if ctl.as_json:
        ctl.print_json(result)
        return Exit.OK
    ctl.print(
        f"model {result['model']}: {result['sessions']} worker session(s) told to drop their "
        f"prompt cache{' and its disk tier' if args.disk else ''} "
        f"({human_bytes(result['cached_bytes'])} cached as last reported); they do at their "
        "next heartbeat"
    )
    return Exit.OK


def run(ctl: Ctl, args: argparse.Namespace) -> int:
    if args.action == "list":
        return _list(ctl)
    return _drop(ctl, args)
