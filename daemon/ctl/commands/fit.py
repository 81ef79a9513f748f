"""Will C more sequences of N tokens fit a model's memory? fit --model NAME --context N.

Answers for --concurrency sequences (default 1) of --context tokens each (prompt plus tokens to
generate), on top of what the model holds now, with the bytes per block of a connected worker
of that model. The verdict, best first:

  fits now                  the bytes are free for this model now (exit 0)
  fits within its reserve   not free now, but within the model's reserve: no other model can
                            keep them; they come as the model's own work ends (exit 10)
  fits once others return   fits once other models give back the memory they borrowed above
                            their reserves (exit 11)
  never                     over the model's limit, or over the budget less the other models'
                            reserves, even with the model holding nothing (exit 12)

Prints the bytes needed and per sequence, what the model holds, the bytes it could get now
(its own idle prompt cache counted: its workers give that back before a request waits; how
much of "now" it is, if any), once others return, and at most; and the largest concurrency
that fits now and ever. --json prints the daemon's answer (the exit status is the verdict's
all the same). Exits 4 when no worker of the model is connected (its bytes per block are
unknown).
"""

from __future__ import annotations

import argparse
from typing import Any

from vqpool.daemon.ctl.budgets import size
from vqpool.daemon.ctl.context import Ctl
from vqpool.daemon.ctl.exits import Exit
from vqpool.daemon.ctl.options import add_json, op_help, positive_int
from vqpool.shared.byte_sizes import format_bytes
from vqpool.shared.protocol import FIT

VERDICTS: dict[str, tuple[str, Exit]] = {
    "now": ("fits now", Exit.OK),
    "within_reserve": (
        "fits within its reserve: not free now, but no other model can keep these bytes; "
        "they come as its own running sequences end",
        Exit.FIT_WITHIN_RESERVE,
    ),
    "after_others_return": (
        "fits once other models give back the memory they borrowed above their reserves",
        Exit.FIT_AFTER_OTHERS_RETURN,
    ),
    "never": ("never fits", Exit.FIT_NEVER),
}
"""Each verdict of the ``fit`` op in words, and vqpoolctl's exit status for it."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="NAME", help=op_help(FIT, "model"))
    parser.add_argument(
        "--context",
        required=True,
        type=positive_int,
        metavar="N",
        help=op_help(FIT, "context"),
    )
    parser.add_argument(
        "--concurrency",
        type=positive_int,
        default=1,
        metavar="C",
        help=op_help(FIT, "concurrency"),
    )
    add_json(parser)


def _never_reason(answer: dict[str, Any]) -> str:
    """Why a ``never`` answer can never fit: the model's own limit, or the budget."""
    limit, budget = answer["limit"], answer["budget"]
    if limit is not None and limit <= answer["most_ever"] and (budget is None or limit < budget):
        return f"over the model's limit of {format_bytes(limit)}"
    return (
        f"over the {format_bytes(answer['most_ever'])} it may ever hold (the budget of "
        f"{size(budget)} less the other models' reserves)"
    )


def run(ctl: Ctl, args: argparse.Namespace) -> int:
    answer = ctl.call("fit", model=args.model, context=args.context, concurrency=args.concurrency)
    words, status = VERDICTS[answer["verdict"]]
    if ctl.as_json:
        ctl.print_json(answer)
        return status
    if answer["verdict"] == "never":
        words = f"{words}: {_never_reason(answer)}"
    need, per_sequence = answer["need"], answer["bytes_per_sequence"]
    ctl.print(
        f"{answer['model']}: {args.concurrency} x {args.context} tokens need {format_bytes(need)} "
        f"({format_bytes(per_sequence)} per sequence)"
    )
    ctl.print(words)
    own_cache = answer.get("own_cache_now", 0)  # a daemon before this field sends none
    of_it = f" ({format_bytes(own_cache)} of it its own idle prompt cache)" if own_cache else ""
    ctl.print(
        f"holds {format_bytes(answer['held'])}; could get {format_bytes(answer['available_now'])} "
        f"now{of_it}, {format_bytes(answer['available_after_return'])} once others return, at "
        f"most {format_bytes(answer['most_ever'])} ever"
    )
    ctl.print(
        f"reserve {format_bytes(answer['reserve'])}, limit {size(answer['limit'])}, budget "
        f"{size(answer['budget'])}"
    )
    ctl.print(
        f"largest concurrency of {args.context} tokens: {answer['max_concurrency_now']} now, "
        f"{answer['max_concurrency_ever']} ever"
    )
    return status
