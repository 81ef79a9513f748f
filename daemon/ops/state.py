"""What every op handler acts on: the coordinator and the budget above it, and the daemon's
version."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from vqpool.daemon.budget.accounting import BudgetAccounting
from vqpool.daemon.budget.reclaim_book import DEFAULT_RECLAIM_DEADLINE
from vqpool.daemon.budget.types import ModelSettings
from vqpool.daemon.core.coordinator import Coordinator
from vqpool.daemon.net.peer_auth import PeerAuthenticator
from vqpool.shared.allocator import PoolConfig

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

    @classmethod
    def create(
        cls,
        config: PoolConfig,
        *,
        lease: float,
        run_dir: Path,
        claim_grace: float = 0.0,
        boot_id: str | None = None,
        budget: int | None = None,
        models: Mapping[str, ModelSettings] | None = None,
        lend_reserves: bool = False,
        reclaim_deadline: float = DEFAULT_RECLAIM_DEADLINE,
    ) -> DaemonState:
        """A coordinator over a new pool of ``config`` (see :class:`Coordinator`), and its
        budget (see :class:`BudgetAccounting`).

        Raises:
            ValueError: Bad budget settings.
        """
        coord = Coordinator(
            config, lease=lease, run_dir=run_dir, claim_grace=claim_grace, boot_id=boot_id
        )
        accounting = BudgetAccounting(
            coord, budget, models, lend_reserves=lend_reserves, reclaim_deadline=reclaim_deadline
        )
        return cls(coord, accounting)
