"""Load a model of the front door (`vqpool serve`) now, as a request for it would.

MODEL is a name the front door serves (its name, an alias, or the part of a path no other
model shares: `vqpoolctl ps` lists them). Waits at most --wait seconds for the model to load
(room under --max-loaded may need an idle model unloaded first), then prints its state, pid and
port. Its keep-alive counts from now. An unknown model, a load that fails (the worker's reason
is printed) or a wait that runs out exits 4; no `vqpool serve` on the run directory exits 3.
"""

from __future__ import annotations

import argparse

from vqpool.daemon.ctl.context import Ctl
from vqpool.daemon.ctl.exits import Exit
from vqpool.daemon.ctl.front_door import add_model_arguments, port


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, "load", 60.0, "the load")


def run(ctl: Ctl, args: argparse.Namespace) -> int:
    row = ctl.front_door(wait=args.wait).load(args.model, args.wait)
    if ctl.as_json:
        ctl.print_json(row)
        return Exit.OK
    ctl.print(f"{row['name']}: {row['state']}, pid {row['pid']}, port {port(row)}")
    return Exit.OK
