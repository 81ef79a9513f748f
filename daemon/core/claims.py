"""The claim period of a restarted daemon: who is expected back, and until when.

A daemon that dies (SIGKILL included) loses its bookkeeping, but its workers still hold blocks
and keep using them. When it starts again on the same run directory, its workers see the new
boot id in a reply, say hello again and re-declare what they hold (``claim``). Until they have,
the daemon must not hand out a single block: it could be one a worker is about to claim. So:

* The daemon keeps a **roll** of its workers' sessions (pid, process start time, session id)
  in the run directory. It is rewritten at most once per loop tick when sessions opened or
  ended, and before the first mutating request of a session it does not list yet is applied:
  a session is on the roll before it can hold a block, and a burst of hellos costs one write.
* At start it reads the roll its predecessor left. If a listed process is still alive, a
  **claim period** begins: claims are accepted, allocations are refused with RETRY_LATER (the
  client retries by itself), frees and fill updates of claimed blocks proceed.
* A re-synced client names the session id it held (``resumes`` in its hello), so the period
  waits for every session of every live process: one process may hold several (two models,
  two PoolClients), and the first to finish says nothing about the others.
* The period ends when every expected session has finished its claims (``done``) or its
  process exited, or when the grace time (``--claim-grace``) runs out, whichever comes first.
  A first start, or a restart after every worker left, has no claim period at all.

Blocks of workers that never come back were never claimed: they are simply free. A claim is
taken only during the period, and only from a session that resumes an expected session and has
not finished its claims (:meth:`ClaimPeriod.claimant`): any other claim is refused as a
conflict, or a session could take free blocks by id, past the budget's checks, at any time.
The budget layer checks each claim against its ledger too (``daemon/budget/holdings.py``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

import psutil
from vqpool.shared.errors import RetryLaterError

log = logging.getLogger("vqpoold")

ROLL_FILE_NAME = "workers.json"
"""File in the run directory listing the worker sessions of the daemon that wrote it."""


SessionKey = tuple[int, int | None]
"""A worker session on the roll: (pid, session id). The session id is None for an entry of a
roll written before sessions were listed: it stands for every session of that process."""


def read_roll(run_dir: Path) -> dict[SessionKey, psutil.Process]:
    """The sessions the previous daemon's roll lists whose process is still alive.

    A pid now used by another process (start time differs) is not taken for the worker. Each
    process is looked at once, however many sessions it had.
    """
    try:
        entries = json.loads((run_dir / ROLL_FILE_NAME).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable %s: %s", run_dir / ROLL_FILE_NAME, exc)
        return {}
    alive: dict[SessionKey, psutil.Process] = {}
    looked_at: dict[tuple[int, float], psutil.Process | None] = {}
    for entry in entries if isinstance(entries, list) else []:
        try:
            pid, started = int(entry[0]), float(entry[1])
            sid = int(entry[2]) if len(entry) > 2 else None
            if (pid, started) not in looked_at:
                looked_at[pid, started] = _worker_process(pid, started)
            process = looked_at[pid, started]
            if process is not None:
                alive[pid, sid] = process
        except (TypeError, ValueError, IndexError):
            continue
    return alive


def _worker_process(pid: int, started: float) -> psutil.Process | None:
    """The live process ``pid`` if it started at ``started`` (else the pid was recycled)."""
    try:
        process = psutil.Process(pid)
        if abs(process.create_time() - started) < 0.01 and _alive(process):
            return process
    except psutil.Error:
        pass
    return None


def write_roll(run_dir: Path, sessions: Iterable[tuple[psutil.Process, int | None]]) -> None:
    """Replace the roll with ``sessions``, (process, session id) pairs (atomically: a daemon
    killed mid-write leaves the old roll or the new one, never half of one)."""
    entries = []
    for process, sid in sessions:
        with contextlib.suppress(psutil.Error):
            entries.append([process.pid, process.create_time(), sid])
    path = run_dir / ROLL_FILE_NAME
    tmp = path.with_suffix(".tmp")
    try:
        # 0600 like the lock file: the roll names the user's processes (the 0700 run directory
        # already keeps others out; this keeps it private if the file is copied elsewhere).
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(json.dumps(entries))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cannot write %s: %s (a restart will not wait for claims)", path, exc)


class ClaimPeriod:
    """The claim period of one daemon start, with the counters of what was claimed.

    Attributes:
        grace: Longest the period may last, in seconds.
        started: Monotonic time the period began.
        until: Monotonic time it ends at the latest.
        expected: Sessions of the previous daemon, in live processes, that have not finished
            claiming yet (a process with two PoolClients has two).
        resynced: Sessions that finished claiming.
        ended: Monotonic time it ended, or None while it runs.
    """

    def __init__(
        self, expected: dict[SessionKey, psutil.Process], grace: float, now: float
    ) -> None:
        self.grace = grace
        self.started = now
        self.until = now + grace
        self.expected = dict(expected)
        self.n_expected = len(expected)
        self.resynced: set[SessionKey] = set()
        self.ended: float | None = None
        self.end_reason = ""

    def refuse_allocation(self, op: str, now: float) -> None:
        """Raise RetryLaterError while the period runs (it may end here, if its time is up).

        Raises:
            RetryLaterError: The period runs: allocating now could hand out a block that a
                worker is about to claim.
        """
        if self.ended is None and not self.check(now):
            waiting = len(self.expected)
            raise RetryLaterError(
                f"{op}: vqpoold restarted and is taking back blocks its workers still hold "
                f"({waiting} session(s) not re-synced yet); new allocations start within "
                f"{max(0.0, self.until - now):.2f}s: retry"
            )

    def claimant(self, pid: int, resumes: int | None, now: float) -> SessionKey | None:
        """The expected session that a session of process ``pid`` whose hello named
        ``resumes`` re-declares, if it may claim now: the period runs and that session has
        not finished its claims. None: its claims must be refused."""
        if self.check(now):
            return None
        return self._expected_key(pid, resumes)

    def note_done(self, pid: int, resumes: int | None, now: float) -> None:
        """A session of process ``pid`` finished its claims; ``resumes`` is the session id it
        held before the restart, as its hello named it (None from a client that names none)."""
        key = self._expected_key(pid, resumes)
        if key is not None:
            self.resynced.add(key)
            del self.expected[key]
        self.check(now)

    def _expected_key(self, pid: int, resumes: int | None) -> SessionKey | None:
        """The expected session a done from ``pid`` naming ``resumes`` ends, if any.

        The session it names; else the process-wide entry of an older roll; else, for a client
        that names no session (an older client), the process's one expected session, if it has
        exactly one: a done that could be any of several sessions' ends none of them.
        """
        for key in ((pid, resumes), (pid, None)):
            if key in self.expected:
                return key
        if resumes is None:
            keys = [key for key in self.expected if key[0] == pid]
            if len(keys) == 1:
                return keys[0]
        return None

    def check(self, now: float) -> bool:
        """End the period if it is over; whether it has ended."""
        if self.ended is not None:
            return True
        alive: dict[int, bool] = {}  # one look per process, however many sessions it had
        for key, process in list(self.expected.items()):
            pid = key[0]
            if pid not in alive:
                alive[pid] = _alive(process)
            if not alive[pid]:
                del self.expected[key]
        if not self.expected:
            self._end(now, "every expected session re-synced or its process exited")
        elif now >= self.until:
            pids = sorted({pid for pid, _ in self.expected})
            self._end(
                now,
                f"grace of {self.grace:g}s ran out; {len(self.expected)} expected "
                f"session(s) never re-synced (pids {pids})",
            )
        return self.ended is not None

    def _end(self, now: float, reason: str) -> None:
        self.ended = now
        self.end_reason = reason
        log.info(
            "claim period over after %.3fs (%s): %d of %d expected session(s) re-synced; "
            "serving allocations",
            now - self.started,
            reason,
            len(self.resynced),
            self.n_expected,
        )

    def duration(self, now: float) -> float:
        """Seconds the period lasted (so far, while it runs)."""
        return (self.ended if self.ended is not None else now) - self.started


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() not in (
            psutil.STATUS_ZOMBIE,
            psutil.STATUS_DEAD,
        )
    except psutil.Error:
        return False
