"""How both sockets serve their ops: a table maps each op name to its :class:`Op`, the
parameters its arguments are checked against and the handler that serves it.

A socket's dispatcher looks the op up, checks its arguments with
:func:`~vqpool.shared.protocol.parse_args` against ``params``, and calls ``handler``:

- admin ops (``ops/admin/``, one module per op): ``handler(state, args)``;
- worker ops (``ops/worker/``, handler functions grouped by concern):
  ``handler(state, session, args, rid, now)``, for the session the request belongs to, its
  request id and the time it arrived. A handler returns the result to send, or a
  :class:`~vqpool.daemon.budget.parking.Parked` request answered later.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from vqpool.daemon.core.sessions import Session
from vqpool.daemon.ops.state import DaemonState
from vqpool.shared.protocol import Field

Args = dict[str, Any]
"""An op's arguments, checked against its parameters."""

AdminHandler = Callable[[DaemonState, Args], Any]
"""An admin op's handler: (state, args) -> result."""

WorkerHandler = Callable[[DaemonState, Session, Args, int, float], Any]
"""A worker op's handler: (state, session, args, request id, now) -> result or Parked."""

H = TypeVar("H")


@dataclass(frozen=True, slots=True)
class Op(Generic[H]):
    """One op a socket serves."""

    name: str
    params: tuple[Field, ...]
    handler: H


def op_table(
    names: Collection[str],
    params: Mapping[str, tuple[Field, ...]],
    handlers: Mapping[str, H],
) -> dict[str, Op[H]]:
    """The table of a socket's ``names``: each with its parameters and its handler.

    Raises:
        ValueError: An op without a handler, or a handler for an op not in ``names``.
    """
    if handlers.keys() != set(names):
        raise ValueError(
            f"op handlers do not match the ops: missing {sorted(set(names) - handlers.keys())}, "
            f"unknown {sorted(handlers.keys() - set(names))}"
        )
    return {name: Op(name, params[name], handlers[name]) for name in handlers}
