"""List the models' shares of the memory budget, or change a model's reserve, limit and weight.

model list: one row per model (those with workers connected and those configured): bytes
held, its reserve (a floor no other model may take), its limit (a cap on what it may hold;
"none": only the budget bounds it), its weight (how spare bytes are shared while models wait),
bytes borrowed (held above the reserve), its entitlement (its fair share now), requests waiting
for memory (their bytes, and how long the oldest has waited), its sessions, and requests its
workers run and queue, and where its settings come from (the config file, set live, or the
defaults). Above the table, the budget line as `vqpoolctl budget` prints it. Model
names lose the prefix they do not need (as in `watch`); --json has the full names.

model set NAME [--reserve SIZE] [--limit SIZE|none] [--weight W]: change the settings of model
NAME (the name its workers give, in full, as `vqpoolctl sessions` shows it), live, and print
what changed. A model without workers may be configured ahead of them. The daemon refuses a
value it cannot honour (reserves that would not fit the budget together, a weight <= 0...) with
exit 4 and changes nothing. Settings set here outlive a restart of the daemon (it keeps them
in its run directory, over its config file's; the SETTINGS column of `model list` says which
settings are whose).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from vqpool.daemon.ctl.budgets import budget_report, size, weight
from vqpool.daemon.ctl.context import Ctl
from vqpool.daemon.ctl.exits import EXIT_CODES_HELP, CtlError, Exit
from vqpool.daemon.ctl.labels import model_labels
from vqpool.daemon.ctl.options import add_json, common_options, op_help
from vqpool.shared.byte_sizes import parse_bytes
from vqpool.shared.protocol import MODEL_SET, NO_MODEL_LIMIT

LIST_HELP, SET_HELP = (part.strip() for part in (__doc__ or "").split("\n\n")[1:3])

DEFAULTS = {"reserve": 0, "limit": None, "weight": 1.0}
"""The settings of a model nobody configured (docs/budget.md)."""


def _reserve(text: str) -> int:
    try:
        return parse_bytes(text, what="reserve", allow_zero=True)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _limit(text: str) -> int:
    if text.strip().lower() == "none":
        return NO_MODEL_LIMIT
    try:
        return parse_bytes(text, what="limit", allow_zero=True)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}, or none") from None


def _weight(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"weight {text!r} is not a number") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    common = common_options()
    listing = actions.add_parser(
        "list",
        help="the models' budget figures, one row each",
        description=LIST_HELP,
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[common],
    )
    add_json(listing)
    setting = actions.add_parser(
        "set",
        help="change a model's reserve, limit or weight",
        description=SET_HELP,
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[common],
    )
    setting.add_argument("name", metavar="NAME", help=op_help(MODEL_SET, "model"))
    setting.add_argument(
        "--reserve",
        type=_reserve,
        metavar="SIZE",
        help=f"{op_help(MODEL_SET, 'reserve')} (e.g. 2GiB; 0 for none)",
    )
    setting.add_argument(
        "--limit",
        type=_limit,
        metavar="SIZE|none",
        help="the most this model may hold (e.g. 6GiB); none: only the budget bounds it",
    )
    setting.add_argument(
        "--weight",
        type=_weight,
        metavar="W",
        help=op_help(MODEL_SET, "weight"),
    )
    add_json(setting)


def _list(ctl: Ctl) -> int:
    listing = ctl.call("model_list")
    if ctl.as_json:
        ctl.print_json(listing)
        return Exit.OK
    for line in budget_report(listing):
        ctl.print(line)
    return Exit.OK


def _check_name(name: str, known: list[str]) -> None:
    """Refuse a short label (as `model list` shows it) given for a model's full name: the
    settings would go to a model no worker is named after."""
    if name in known:
        return
    full = [other for other, label in model_labels(known, 10**6).items() if label == name]
    if full:
        raise CtlError(
            f"{name!r} is the short label of model {full[0]!r}: give its full name",
            Exit.BAD_ARGUMENTS,
        )
    print(
        f"vqpoolctl: note: no worker of model {name!r} is connected; "
        "its settings apply when one is",
        file=sys.stderr,
    )


def _changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    shown: dict[str, Callable[[Any], str]] = {"reserve": size, "limit": size, "weight": weight}
    return [
        f"{field} {show(before[field])} -> {show(after[field])}"
        for field, show in shown.items()
        if before[field] != after[field]
    ]


def _set(ctl: Ctl, args: argparse.Namespace) -> int:
    settings = {
        field: getattr(args, field)
        for field in ("reserve", "limit", "weight")
        if getattr(args, field) is not None
    }
    if not settings:
        raise CtlError(
            "model set: give at least one of --reserve, --limit, --weight", Exit.BAD_ARGUMENTS
        )
    views = {v["model"]: v for v in ctl.call("model_list")["models"]}
    _check_name(args.name, list(views))
    before = views.get(args.name, DEFAULTS)
    after = ctl.call("model_set", model=args.name, **settings)
    if ctl.as_json:
        ctl.print_json(after)
        return Exit.OK
    changes = _changes(before, after)
    ctl.print(f"model {args.name}: {', '.join(changes) if changes else 'unchanged'}")
    ctl.print(
        f"now: reserve {size(after['reserve'])}, limit {size(after['limit'])}, weight "
        f"{weight(after['weight'])}; holds {size(after['held'])}, entitled to "
        f"{size(after['entitlement'])}"
    )
    return Exit.OK


def run(ctl: Ctl, args: argparse.Namespace) -> int:
    if args.action == "list":
        return _list(ctl)
    return _set(ctl, args)
