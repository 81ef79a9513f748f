"""The daemon's side of the admin op ``load_release``; what it does and takes is declared in
:mod:`vqpool.shared.protocol.admin_ops`."""

from __future__ import annotations

from typing import Any

from vqpool.daemon.ops.state import DaemonState
from vqpool.shared.protocol import ADMIN_ARGS, LOAD_RELEASE

PARAMS = ADMIN_ARGS[LOAD_RELEASE]


def run(state: DaemonState, args: dict[str, Any]) -> dict[str, bool]:
    return {"released": state.budget.release_load(args["ticket"])}
