"""List the models' shares of the memory budget, or change a model's reserve, limit and weight.

model list: one row per model (those with workers connected and those configured): bytes
held (its KV), its weights and what its worker processes hold, measured (MLX's active and
cached memory, or their resident set; DRIFT when it differs from held plus weights by more than
25% and 128 MiB, see docs/budget.md; "-" when no worker reports it), its reserve (a floor no
other model may take), its limit (a cap on what it may hold; "none": only the budget bounds
it), its weight (how spare bytes are shared while models wait),
bytes borrowed (held above the reserve), its entitlement (its fair share now), requests waiting
for memory (their bytes, and how long the oldest has waited), its sessions, and requests its
workers run and queue, and where its settings come from (the config file, set live, or the
defaults); when some model's blocks are quantized (`vqpool-worker --kv-bits`), its blocks and
bytes per block format (KV FORMATS). Above the table, the budget line as `vqpoolctl budget`
prints it. Model
names lose the prefix they do not need (as in `watch`); --json has the full names.

model set NAME [--reserve SIZE] [--limit SIZE|none] [--weight W] [--create]: change the
settings of model NAME (the name its workers give, as `vqpoolctl sessions` shows it, or the
short label `model list` shows when no other model has it), live, and print what changed. A
name no connected worker, config file or earlier setting knows is refused (a typo must not leave
a phantom model behind): --create sets it all the same, for a model configured ahead of its
workers (NAME in full). The daemon refuses a value it cannot honour (reserves that would not fit
the budget together, a weight <= 0...) or an ambiguous label with exit 4 and changes nothing.
Settings set here outlive a restart of the daemon (it keeps them in its run directory, over its
config file's; the SETTINGS column of `model list` says which settings are whose).

model unset NAME: remove the settings set live for model NAME (full name or label, as for set):
it falls back to its config file's settings, or to the defaults; a model no worker serves that
holds nothing and has no config file settings leaves `model list`. Exit 4, nothing changed, for
a model without live settings.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from vqpool.daemon.ctl.budgets import budget_report, settings_source, size, weight
from vqpool.daemon.ctl.context import Ctl
from vqpool.daemon.ctl.exits import CtlError, Exit
from vqpool.daemon.ctl.options import add_action, add_actions, op_help
from vqpool.shared.byte_sizes import parse_bytes
from vqpool.shared.protocol import MODEL_SET, MODEL_UNSET, NO_MODEL_LIMIT

LIST_HELP, SET_HELP, UNSET_HELP = (part.strip() for part in (__doc__ or "").split("\n\n")[1:4])

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
    actions = add_actions(parser)
    add_action(actions, "list", "the models' budget figures, one row each", LIST_HELP)
    setting = add_action(actions, "set", "change a model's reserve, limit or weight", SET_HELP)
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
    setting.add_argument("--create", action="store_true", help=op_help(MODEL_SET, "create"))
    unsetting = add_action(actions, "unset", "remove a model's live settings", UNSET_HELP)
    unsetting.add_argument("name", metavar="NAME", help=op_help(MODEL_UNSET, "model"))


def _list(ctl: Ctl) -> int:
    listing = ctl.call("model_list")
    if ctl.as_json:
        ctl.print_json(listing)
        return Exit.OK
    for line in budget_report(listing):
        ctl.print(line)
    return Exit.OK


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
    after = ctl.call("model_set", model=args.name, create=args.create, **settings)
    if ctl.as_json:
        ctl.print_json(after)
        return Exit.OK
    name = after["model"]
    changes = _changes(views.get(name, DEFAULTS), after)
    ctl.print(f"model {name}: {', '.join(changes) if changes else 'unchanged'}")
    _print_now(ctl, after)
    if not after["sessions"]:
        print(
            f"vqpoolctl: note: no worker of model {name!r} is connected; "
            "its settings apply when one is",
            file=sys.stderr,
        )
    return Exit.OK


def _print_now(ctl: Ctl, view: dict[str, Any]) -> None:
    ctl.print(
        f"now: reserve {size(view['reserve'])}, limit {size(view['limit'])}, weight "
        f"{weight(view['weight'])} ({settings_source(view)}); holds {size(view['held'])}, "
        f"entitled to {size(view['entitlement'])}"
    )


def _unset(ctl: Ctl, args: argparse.Namespace) -> int:
    result = ctl.call("model_unset", model=args.name)
    if ctl.as_json:
        ctl.print_json(result)
        return Exit.OK
    view = result["view"]
    if view is None:
        ctl.print(
            f"model {result['model']}: live settings removed; no worker serves it and it holds "
            "nothing: it left the list"
        )
        return Exit.OK
    ctl.print(f"model {result['model']}: live settings removed")
    _print_now(ctl, view)
    return Exit.OK


def run(ctl: Ctl, args: argparse.Namespace) -> int:
    if args.action == "list":
        return _list(ctl)
    if args.action == "unset":
        return _unset(ctl, args)
    return _set(ctl, args)
