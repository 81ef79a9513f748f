"""Show the memory budget shared by all models, or set it live: budget [SIZE].

Without SIZE, prints the budget, the bytes all models hold and the bytes free, the sum of the
models' reserves and the part of it unused (kept free for those models: no other model gets it),
and the requests parked at the daemon waiting for memory; "no budget" when the daemon runs
without one (then nothing binds). SIZE sets it: 6GiB, 512MiB, 1.5GB (decimal), or 40% of this
machine's physical memory. Prints the change and how many parked requests were refused because
the new budget can never satisfy them. Lowering the budget below what is held takes nothing
back: no request is granted until holdings fall under it. A budget smaller than the sum of the
reserves is refused (exit 4) and nothing changes. A budget set here outlives a restart of the
daemon (it keeps it in its run directory, over its config file's). --json prints the daemon's
budget map (with SIZE: the map before and after the change).
"""

from __future__ import annotations

import argparse
from typing import Any

from vqpool.daemon.ctl.budgets import budget_fields, budget_line, size
from vqpool.daemon.ctl.context import Ctl
from vqpool.daemon.ctl.exits import Exit
from vqpool.daemon.ctl.options import add_json
from vqpool.shared.byte_sizes import parse_budget


def budget_size(text: str) -> int:
    """An argparse type: a budget in bytes, a size or a percentage of physical memory."""
    # Imported here: psutil takes ~20 ms to import, which every other command (and --help)
    # would pay at start-up.
    import psutil

    try:
        return parse_budget(text, psutil.virtual_memory().total)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "size",
        nargs="?",
        type=budget_size,
        metavar="SIZE",
        help="the new budget: 6GiB, 512MiB, 1.5GB, or 40%% of physical memory (default: show it)",
    )
    add_json(parser)


def _show(ctl: Ctl, budget: dict[str, Any]) -> None:
    for field in budget_fields(budget):
        ctl.print(field)


def run(ctl: Ctl, args: argparse.Namespace) -> int:
    if args.size is None:
        budget = ctl.call("budget")
        if ctl.as_json:
            ctl.print_json(budget)
        else:
            _show(ctl, budget)
        return Exit.OK
    before = ctl.call("budget")
    after = ctl.call("budget", bytes=args.size)
    if ctl.as_json:
        ctl.print_json({"before": before, "after": after})
        return Exit.OK
    ctl.print(f"budget: {size(before['budget'], 'none')} -> {size(after['budget'], 'none')}")
    ctl.print(budget_line(after))
    refused = after["refused"]
    if refused:
        ctl.print(
            f"refused {refused} parked request(s) that can never fit the new budget "
            "(their workers got an over-budget error)"
        )
    else:
        ctl.print("no parked request refused")
    return Exit.OK
