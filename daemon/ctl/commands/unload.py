"""Unload a model of the front door (`vqpool serve`) as soon as its requests end.

MODEL is named as for `load`. A model with no request running or queued unloads now: its
worker stops and its memory returns to vqpoold. One still serving requests goes once they end
(requests that come meanwhile are still served); unload waits at most --wait seconds for that,
then says how many requests it waits for. An unknown model exits 4; no `vqpool serve` on the
run directory exits 3.
"""

from __future__ import annotations

import argparse

from vqpool.daemon.ctl.context import Ctl
from vqpool.daemon.ctl.exits import Exit
from vqpool.daemon.ctl.front_door import add_model_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, "unload", 30.0, "its requests to end")


def _requests(n: int, what: str) -> str:
    return f"{n} {what} request{'' if n == 1 else 's'}"


def run(ctl: Ctl, args: argparse.Namespace) -> int:
    front_door = ctl.front_door(wait=args.wait)
    states = {row["name"]: row["state"] for row in front_door.models()["models"]}
    row = front_door.unload(args.model, args.wait)
    if ctl.as_json:
        ctl.print_json(row)
        return Exit.OK
    name = row["name"]
    if not row["unloaded"] and not (row["running"] or row["queued"]):
        ctl.print(f"{name}: still {row['state']}; it unloads once that ends")
    elif not row["unloaded"]:
        pending = [_requests(row["running"], "running")]
        if row["queued"]:
            pending.append(_requests(row["queued"], "queued"))
        ctl.print(f"{name}: will unload when its {' and '.join(pending)} end")
    elif states.get(name) == "not_loaded":
        ctl.print(f"{name}: was not loaded")
    else:
        ctl.print(f"{name}: unloaded")
    return Exit.OK
