"""Keeping a client's session across daemon restarts (re-sync and claims) and evictions
(re-open).

* **Restarts.** The daemon's boot id comes with every reply. When it changes (the daemon was
  killed or stopped and started again), the client re-syncs before anything else: it says
  hello to the new daemon and re-declares (``claim``) every owner it holds with its blocks'
  ids, streams, fill and format, then repeats the interrupted call. The heartbeat does the
  same for an idle worker. The daemon answers allocations with RETRY_LATER during its claim
  period, and the client retries those by itself. An owner whose claim the daemon refuses (a
  block already claimed by another worker or outside the new pool, its bytes over the budget,
  or a claim that came after the claim period) is *lost* (see
  :mod:`~vqpool.worker.pool.lost_owners`). A daemon restarted with another block size or
  stream split cannot take claims: the client is unusable from then on. See
  docs/reliability.md.
* **Eviction.** A session the daemon ended while this process lives (``vqpoolctl evict``, or
  an expired lease) freed every block it held: on the first NO_SESSION reply, to a call or to
  the heartbeat, every owner held becomes lost and a new session is opened.

Everything here runs under the client's lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from vqpool.shared.allocator import Owner
from vqpool.shared.errors import DaemonRestartedError, ErrorCode, NoSessionError
from vqpool.shared.protocol import MAX_BATCH, config_from_wire, encode_request, item_message
from vqpool.worker.pool.holdings import Holdings
from vqpool.worker.pool.lost_owners import LostOwners
from vqpool.worker.pool.session import DaemonSession

CLAIM_IDS_PER_MESSAGE = 16384
"""Block ids per claim message when re-declaring many blocks (well inside the 1 MiB frame)."""

MAX_RESYNCS_PER_CALL = 3
"""A call that meets this many daemon restarts in a row gives up with DaemonRestartedError."""


class SessionResync:
    """Re-syncs and re-opens one client's session (see the module docstring).

    Args:
        session: The client's session.
        holdings: What it holds (re-declared by the claims).
        lost: Where owners refused or evicted go.
        on_open: Called when a new session is adopted (after a re-sync or a re-open).
    """

    def __init__(
        self,
        session: DaemonSession,
        holdings: Holdings,
        lost: LostOwners,
        on_open: Callable[[], None],
    ) -> None:
        self._session = session
        self._holdings = holdings
        self._lost = lost
        self._on_open = on_open
        self.unusable: str | None = None
        """Why the client cannot go on (a restarted daemon with another pool), or None."""
        self.claims_due: list[tuple[int, list[list[Any]], bool]] = []
        """The claims of a re-sync not answered yet: (request id, owners, done) per message."""
        self.records: list[dict[str, Any]] = []
        """One record per re-sync: ``{boot, seconds, owners_claimed, owners_refused,
        blocks_claimed}``."""
        self._record: dict[str, Any] = {}
        self._started = 0.0

    def after_refusal(
        self, op: str, reply: dict[str, Any], boot: str | None, n_resyncs: int
    ) -> int | None:
        """The restart and eviction rules of a call.

        A reply from another daemon lifetime than ``boot`` (the one the request was sent to) or
        NO_SESSION means the request was refused, not applied: re-sync with the restarted
        daemon, or open a new session, and return the count of such refusals in this call, now
        ``n_resyncs + 1``; the caller checks for owners lost on the way and sends the call
        again. None: ``reply`` is the call's own answer.

        Raises:
            DaemonRestartedError: More than MAX_RESYNCS_PER_CALL restarts in one call, or a
                restarted daemon whose pool the blocks held here cannot be claimed in.
            NoSessionError: More than MAX_RESYNCS_PER_CALL sessions ended in a row.
            DaemonUnavailableError: The daemon did not answer hello.
        """
        if reply.get("boot") != boot:
            if n_resyncs >= MAX_RESYNCS_PER_CALL:
                raise DaemonRestartedError(
                    f"{op}: vqpoold restarted {n_resyncs + 1} times during one call; giving up"
                )
            self.resync()
            return n_resyncs + 1
        refused = not reply["ok"] and reply["error"]["code"] == ErrorCode.NO_SESSION
        if refused and not self._session.closed:
            if n_resyncs >= MAX_RESYNCS_PER_CALL:
                raise NoSessionError(f"{op}: the daemon ended {n_resyncs + 1} sessions in a row")
            self.reopen()
            return n_resyncs + 1
        return None

    def reopen(self) -> None:
        """The daemon ended this live session (an admin eviction, or its lease ran out) and
        freed its blocks: every owner held is lost, as in a restart conflict, and a new
        session is opened. Until it is, the session id is None.

        Raises:
            DaemonUnavailableError: The daemon did not answer hello (the next call retries).
        """
        for owner in list(self._holdings.owners):
            self._lose(
                owner,
                f"owner {owner!r} was lost: vqpoold ended this worker's session (evicted, or "
                f"its lease ran out) and freed its blocks; free_all({owner!r}) forgets it.",
            )
        session = self._session
        session.current = (None, session.boot_id)
        self._adopt(session.hello())

    def resync(self) -> None:
        """Open a session with the restarted daemon and claim back everything held here.
        Owners the daemon refuses become lost.

        Raises:
            DaemonRestartedError: The new daemon's pool has another block size or stream split:
                the blocks held here mean nothing to it (the client is unusable from now on).
            DaemonUnavailableError: The new daemon did not answer (claims not answered yet stay
                due: see :meth:`send_claims`).
        """
        session = self._session
        started = time.monotonic()
        hello = session.hello(resumes=session.session_id)
        config = config_from_wire(hello["config"])
        old = session.config
        if (config.block_size, config.separate_kv) != (old.block_size, old.separate_kv):
            self.unusable = (
                f"vqpoold restarted with another pool (block size {config.block_size}, "
                f"separate_kv {config.separate_kv}; was {old.block_size}, {old.separate_kv}): "
                f"the blocks this client held cannot be claimed back. Restart vqpoold with the "
                f"options it had, or open a new PoolClient for {session.run_dir}."
            )
            raise DaemonRestartedError(self.unusable)
        session.config = config
        self._adopt(hello)
        # Encoded once, ids fixed: a claim whose reply is lost is resent as the same request,
        # which the daemon answers from its reply cache instead of claiming twice.
        self.claims_due = [
            (session.next_id(), entries, done) for entries, done in self._claim_messages()
        ]
        self._record = {
            "boot": session.boot_id,
            "seconds": 0.0,
            "owners_claimed": 0,
            "owners_refused": 0,
            "blocks_claimed": 0,
        }
        self._started = started
        self.send_claims()

    def send_claims(self) -> None:
        """Send the claims of the current re-sync that are still unanswered.

        Until every claim is answered, the client must send nothing else: its blocks are free
        in the new daemon's eyes, so a free or fill update of one would be skipped there and the
        claim would then take it back unknown to the caller. A call that times out here leaves
        the rest due; the next call (or heartbeat) sends it.

        Raises:
            DaemonUnavailableError: A claim went unanswered (the rest stays due).
        """
        session = self._session
        record = self._record
        while self.claims_due:
            rid, entries, done = self.claims_due[0]
            payload = encode_request(
                rid, "claim", {"owners": entries, "done": done}, *session.current
            )
            reply = session.send(payload, rid, "claim")
            if reply.get("boot") != session.boot_id:
                self.resync()  # restarted again mid-way: start over with that one
                return
            del self.claims_due[0]
            # A refused message (not a per-owner refusal) loses every owner in it.
            results = reply["result"] if reply["ok"] else [reply["error"]] * len(entries)
            for (owner, groups), result in zip(entries, results, strict=True):
                if result is None:
                    record["owners_claimed"] += 1
                    record["blocks_claimed"] += sum(len(group[2]) for group in groups)
                else:
                    record["owners_refused"] += 1
                    self._mark_lost(owner, result["code"], item_message(results, result))
        record["seconds"] = time.monotonic() - self._started
        self.records.append(record)

    def _adopt(self, hello: dict[str, Any]) -> None:
        # NOTE: the preemption base first: a load reported once the new session is visible
        # counts for it, never folded into its base (the daemon would see it as no change).
        self._on_open()
        self._session.adopt(hello)

    def _claim_messages(self) -> Iterator[tuple[list[list[Any]], bool]]:
        """Claim messages re-declaring every owner held (one, empty, when none is)."""
        block_size = self._session.config.block_size
        held = self._holdings.blocks
        entries: list[list[Any]] = []
        n_ids = 0
        for owner, ids in self._holdings.owners.items():
            groups: dict[tuple[str, str], tuple[list[int], list[int]]] = {}
            for block_id in ids:
                block = held[block_id]
                group_ids, fills = groups.setdefault((block.stream, block.format), ([], []))
                group_ids.append(block_id)
                fills.append(block.n_used)
            wire = [
                [stream, fmt, group_ids, None if min(fills) == block_size else fills]
                for (stream, fmt), (group_ids, fills) in groups.items()
            ]
            if entries and (n_ids + len(ids) > CLAIM_IDS_PER_MESSAGE or len(entries) >= MAX_BATCH):
                yield entries, False
                entries, n_ids = [], 0
            entries.append([owner, wire])
            n_ids += len(ids)
        yield entries, True

    def _mark_lost(self, owner: Owner, code: int, message: str) -> None:
        """Forget ``owner``'s blocks: the restarted daemon did not give them back to us."""
        text = (
            f"owner {owner!r} was lost in a vqpoold restart: its claim was refused "
            f"({ErrorCode(code).name if code in ErrorCode._value2member_map_ else code}: "
            f"{message}). Its blocks are no longer this worker's; free_all({owner!r}) forgets it."
        )
        self._lose(owner, text)

    def _lose(self, owner: Owner, why: str) -> None:
        self._lost.add(owner, why, self._holdings.forget_owner(owner))
