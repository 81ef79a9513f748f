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
all the same).

A worker that quantizes its KV (``--kv-bits``) is priced as it holds a sequence: in its
quantized format's bytes per block, but in full precision for the first prefill chunk with
``--quantized-kv-start`` 0, and for the first T tokens before it quantizes with T > 0
(:mod:`vqpool.shared.kv_sequence`; the line says "KV in q4g64 blocks"); a model the front door
serves with ``kv_bits`` set is priced so before it is loaded as well.

A model with no worker connected (not loaded) is priced from its files: its weights from its
safetensors headers (a built-in's config), its KV per token from its config.json, where the
front door (`vqpool serve`) serves it under that name, else MODEL as a directory, a cached hub id
or builtin:NAME. Its weights count beside the KV, and a last line says what a load would take:
"loading M needs 1.8 GiB of weights and 0.9 GiB of KV; 1.2 GiB free now; unloading idle X
(1.6 GiB) makes it fit" (idle models least recently used first, pinned ones never). Exits 4
when neither a worker nor its files tell its bytes per token.
"""

from __future__ import annotations

import argparse
from typing import Any

from vqpool.daemon.ctl.budgets import size
from vqpool.daemon.ctl.context import Ctl
from vqpool.daemon.ctl.exits import Exit
from vqpool.daemon.ctl.options import add_json, op_help, positive_int
from vqpool.shared.byte_sizes import format_bytes
from vqpool.shared.front_client import FrontDoorNotRunning
from vqpool.shared.kv_formats import parse_format
from vqpool.shared.kv_size import kv_token_bytes
from vqpool.shared.model_names import resolve_model
from vqpool.shared.model_weights import estimate_weights
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


def _served_rows(ctl: Ctl) -> list[dict[str, Any]]:
    """The front door's rows of its models, by its order (none when it does not run)."""
    try:
        rows: list[dict[str, Any]] = ctl.front_door().models()["models"]
    except FrontDoorNotRunning:
        return []
    return rows


def _served_row(rows: list[dict[str, Any]], given: str) -> dict[str, Any] | None:
    """The front door's row of the model ``given`` names (name, alias or label)."""
    by_name = {row["name"]: row for row in rows}
    for row in rows:
        if given in row["aliases"]:
            return row
    try:
        name = resolve_model(given, by_name)
    except ValueError:
        return None
    return None if name is None else by_name[name]


def _unpriced_fit(
    ctl: Ctl, args: argparse.Namespace, rows: list[dict[str, Any]]
) -> dict[str, Any] | None:
    """The ``fit`` answer for a model no connected worker prices, from its files; None when
    its files do not tell its KV per token either."""
    row = _served_row(rows, args.model)
    model, spec = (args.model, args.model) if row is None else (row["name"], row["path"])
    try:
        weights = estimate_weights(spec)
    except (ValueError, OSError):
        weights = None
    fmt = None if row is None else row.get("kv_format")
    quantization = None if fmt is None else parse_format(fmt)
    per_token = kv_token_bytes(spec)
    if per_token is None:
        return None
    quantized: dict[str, Any] = {}
    if quantization is not None:
        try:
            per_quantized = kv_token_bytes(spec, *quantization)
        except ValueError:  # heads its group does not divide: priced as its worker would fail
            return None
        assert row is not None  # a format comes from the front door's row
        holding = row.get("kv_holding") or {}
        quantized = {
            "quantized_bytes_per_token": per_quantized,
            "quantized_kv_start": holding.get("start", 0),
            "first_pass_slots": holding.get("first_pass_slots", 0),
        }
    # The front door charges its worker's overhead (its MLX buffer-cache limit) beside them.
    overhead = 0 if row is None else row.get("overhead_bytes") or 0
    parameters = 0 if weights is None else weights.nbytes
    answer: dict[str, Any] = ctl.call(
        "fit",
        model=model,
        context=args.context,
        concurrency=args.concurrency,
        weights=parameters + overhead,
        bytes_per_token=per_token,
        **quantized,
    )
    if answer.get("weights") == parameters + overhead:
        answer.update(weights=parameters, overhead=overhead)
    return {**answer, "format": fmt}


def load_line(answer: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """What loading a model that is not loaded takes: its weights and KV, what is free, and
    which idle models' unloads (least recently used first, never a pinned one) make it fit."""
    fb = format_bytes
    overhead = answer.get("overhead", 0)
    weights, kv, free = answer["weights"] + overhead, answer["need"], max(0, answer["free"])
    fixed = f"{fb(answer['weights'])} of weights"
    if overhead:
        fixed += f", {fb(overhead)} of overhead"
    text = f"loading {answer['model']} needs {fixed} and {fb(kv)} of KV; {fb(free)} free now"
    if weights + kv <= free:
        return text + ": it fits"
    served = {row["name"]: row for row in rows}
    candidates = [
        (name, model)
        for name, model in answer["models"].items()
        if model["idle"] and name != answer["model"] and not served.get(name, {}).get("pinned")
    ]
    candidates.sort(key=lambda item: served.get(item[0], {}).get("last_used") or 0.0)
    chosen, freed = [], 0
    for name, model in candidates:
        if free + freed >= weights + kv:
            break
        size_of = model["weights"] + model.get("overhead", 0) + model["held"]
        chosen.append(f"{name} ({fb(size_of)})")
        freed += size_of
    if chosen and free + freed >= weights + kv:
        return text + f"; unloading idle {' and '.join(chosen)} makes it fit"
    if chosen:
        return text + (
            f"; unloading every idle model ({fb(freed)}) is not enough: it waits for running "
            "requests to end"
        )
    return text + "; no idle model to unload: it waits for running requests to end"


def run(ctl: Ctl, args: argparse.Namespace) -> int:
    rows = _served_rows(ctl)
    row = _served_row(rows, args.model)
    answer = None
    if row is not None and row["state"] != "loaded":
        answer = _unpriced_fit(ctl, args, rows)
    if answer is None:
        try:
            answer = ctl.call(
                "fit", model=args.model, context=args.context, concurrency=args.concurrency
            )
        except ValueError:  # no worker connected: priced from its files, if they tell
            answer = _unpriced_fit(ctl, args, rows)
            if answer is None:
                raise
    words, status = VERDICTS[answer["verdict"]]
    if ctl.as_json:
        ctl.print_json(answer)
        return status
    if answer["verdict"] == "never":
        words = f"{words}: {_never_reason(answer)}"
    need, per_sequence = answer["need"], answer["bytes_per_sequence"]
    ctl.print(
        f"{answer['model']}: {args.concurrency} x {args.context} tokens need {format_bytes(need)} "
        f"({format_bytes(per_sequence)} per sequence"
        + (f", KV in {answer['format']} blocks)" if answer.get("format") else ")")
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
    if answer.get("models") is not None and answer["model"] not in answer["models"]:
        ctl.print(load_line(answer, rows))
    return status
