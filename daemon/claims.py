"""The claim period of a restarted daemon: who is expected back, and until when.

A daemon that dies (SIGKILL included) loses its bookkeeping, but its workers still hold blocks
and keep using them. When it starts again on the same run directory, its workers see the new
boot id in a reply, say hello again and re-declare what they hold (``claim``). Until they have,
the daemon must not hand out a single block: it could be one a worker is about to claim. So:

* The daemon keeps a **roll** of its workers' processes (pid and start time) in the run
  directory, rewritten when a session opens or ends (never on the request hot path).
* At start it reads the roll its predecessor left. If a listed process is still alive, a
  **claim period** begins: claims are accepted, allocations are refused with RETRY_LATER (the
  client retries by itself), frees and fill updates of claimed blocks proceed.
* The period ends when every expected worker has finished its claims (``done``) or exited, or
  when the grace time (``--claim-grace``) runs out, whichever comes first. A first start, or a
  restart after every worker left, has no claim period at all.

Blocks of workers that never come back were never claimed: they are simply free. Claims after
the period are still accepted if their blocks are still free (they are taken by id, so a block
can never go to two owners); if not, they are refused as conflicts.
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
"""File in the run directory listing the worker processes of the daemon that wrote it."""


def read_roll(run_dir: Path) -> dict[int, psutil.Process]:
    """The processes the previous daemon's roll lists that are still alive, by pid.

    A pid now used by another process (start time differs) is not taken for the worker.
    """
    try:
        entries = json.loads((run_dir / ROLL_FILE_NAME).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable %s: %s", run_dir / ROLL_FILE_NAME, exc)
        return {}
    alive: dict[int, psutil.Process] = {}
    for entry in entries if isinstance(entries, list) else []:
        try:
            pid, started = int(entry[0]), float(entry[1])
            process = psutil.Process(pid)
            if abs(process.create_time() - started) < 0.01 and _alive(process):
                alive[pid] = process
        except (psutil.Error, TypeError, ValueError, IndexError):
            continue
    return alive


def write_roll(run_dir: Path, processes: Iterable[psutil.Process]) -> None:
    """Replace the roll with ``processes`` (atomically: a daemon killed mid-write leaves the old
    roll or the new one, never half of one)."""
    entries = []
    for process in processes:
        with contextlib.suppress(psutil.Error):
            entries.append([process.pid, process.create_time()])
    path = run_dir / ROLL_FILE_NAME
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps(entries))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cannot write %s: %s (a restart will not wait for claims)", path, exc)


class ClaimPeriod:
    """The claim period of one daemon start, with the counters of what was claimed.

    Attributes:
        grace: Longest the period may last, in seconds.
        started: Monotonic time the period began.
        until: Monotonic time it ends at the latest.
        expected: Live processes of the previous daemon's workers that have not finished
            claiming yet, by pid.
        resynced: Pids that finished claiming.
        ended: Monotonic time it ended, or None while it runs.
    """

    def __init__(self, expected: dict[int, psutil.Process], grace: float, now: float) -> None:
        self.grace = grace
        self.started = now
        self.until = now + grace
        self.expected = dict(expected)
        self.n_expected = len(expected)
        self.resynced: set[int] = set()
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
                f"({waiting} worker(s) not re-synced yet); new allocations start within "
                f"{max(0.0, self.until - now):.2f}s: retry"
            )

    def note_done(self, pid: int, now: float) -> None:
        """Worker ``pid`` finished its claims."""
        self.resynced.add(pid)
        self.expected.pop(pid, None)
        self.check(now)

    def check(self, now: float) -> bool:
        """End the period if it is over; whether it has ended."""
        if self.ended is not None:
            return True
        for pid, process in list(self.expected.items()):
            if not _alive(process):
                del self.expected[pid]
        if not self.expected:
            self._end(now, "every expected worker re-synced or exited")
        elif now >= self.until:
            self._end(
                now,
                f"grace of {self.grace:g}s ran out; {len(self.expected)} expected "
                f"worker(s) never re-synced (pids {sorted(self.expected)})",
            )
        return self.ended is not None

    def _end(self, now: float, reason: str) -> None:
        self.ended = now
        self.end_reason = reason
        log.info(
            "claim period over after %.3fs (%s): %d of %d expected worker(s) re-synced; "
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
