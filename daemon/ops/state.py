"""What every op handler acts on: the coordinator and the budget above it, and the daemon's
version."""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from vqpool.daemon.budget.accounting import BudgetAccounting
from vqpool.daemon.core.coordinator import Coordinator
from vqpool.daemon.net.peer_auth import PeerAuthenticator

try:
    DAEMON_VERSION = version("vqpool")
except PackageNotFoundError:  # running from a source tree that is not installed
    DAEMON_VERSION = "unknown"


@dataclass(slots=True)
class DaemonState:
    """The daemon's state as the ops see it.

    Attributes:
        coord: The pool, the sessions and who holds what (``daemon/core/``): ops that change
            no holdings call it directly.
        budget: The memory budget above it (``daemon/budget/``): every change of holdings goes
            through it (allocations, frees, claims, session ends).
        peer_auth: The connections' authenticator, for its counts (set by the server once its
            ZeroMQ context exists; None in process).
    """

    coord: Coordinator
    budget: BudgetAccounting
    peer_auth: PeerAuthenticator | None = None
