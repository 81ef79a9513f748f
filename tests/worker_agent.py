"""A worker process for the daemon tests: one PoolClient driven by JSON lines on stdin.

Run as ``python worker_agent.py RUN_DIR NAME [LEASE_HINT]``. Each stdin line is
``{"op": ..., "args": [...]}``; each stdout line is ``{"ok": true, "result": ...}`` or
``{"ok": false, "error": <exception class name>, "message": ...}``. Blocks cross as ids, so the
agent calls the client exactly as a worker would, with Block objects of those ids.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from vqpool.shared import AllocationRequest, Block
from vqpool.shared.protocol import stats_to_wire
from vqpool.worker import PoolClient


class ReclaimAgent:
    """A reclaim handler as a worker would have one: ``free`` gives back whole owners, the
    most recently allocated first (as a scheduler preempts its newest requests), until the
    bytes asked for are freed; ``stall`` frees nothing and returns only after the deadline
    (a worker stuck in a long step, or one that ignores asks)."""

    def __init__(self, pool: PoolClient, mode: str) -> None:
        self.pool = pool
        self.mode = mode
        self.asks: list[int] = []

    def __call__(self, n_bytes: int, deadline: float) -> None:
        self.asks.append(n_bytes)
        if self.mode == "stall":
            time.sleep(max(0.0, deadline - time.monotonic()) + 0.3)
            return
        freed = 0
        for owner in reversed(list(OWNERS)):
            if freed >= n_bytes:
                break
            before = self.pool.held_bytes()
            self.pool.free_all(owner)
            OWNERS.pop(owner, None)
            freed += before - self.pool.held_bytes()


OWNERS: dict[Any, None] = {}
"""Owners this agent allocated for, in allocation order (what a reclaim handler gives back)."""
RECLAIM: list[ReclaimAgent] = []


AGENT_BYTES_PER_FORMAT = {"q8g64": 2048, "q4g64": 1024}
"""Bytes of a block of each quantized format an agent started with ``--quantized-formats``
declares (fp16 and any other: 4096)."""


def run_op(pool: PoolClient, op: str, args: list[Any]) -> Any:
    if op == "allocate":
        blocks = [b.block_id for b in pool.allocate(*args)]
        OWNERS[args[2]] = None
        return blocks
    if op == "reclaim_handler":
        agent = ReclaimAgent(pool, args[0])
        RECLAIM[:] = [agent]
        pool.set_reclaim_handler(agent)
        return None
    if op == "reclaim_asks":
        return RECLAIM[0].asks if RECLAIM else []
    if op == "held_bytes":
        return pool.held_bytes()
    if op == "allocate_many":
        results = pool.allocate_many([AllocationRequest(*item) for item in args[0]])
        return [
            [b.block_id for b in r] if not isinstance(r, Exception) else type(r).__name__
            for r in results
        ]
    if op == "free":
        pool.free([Block(block_id) for block_id in args[0]])
        return None
    if op == "mark_used":
        pool.mark_used_many([(Block(block_id), n_used) for block_id, n_used in args[0]])
        return None
    if op == "blocks_for":
        return [[b.block_id, b.stream, b.format, b.n_used] for b in pool.blocks_for(*args)]
    if op == "free_all":
        OWNERS.pop(args[0], None)
    if op in ("free_all", "register_owner", "release_owner", "n_free", "ping", "report_load"):
        return getattr(pool, op)(*args)
    if op == "stats":
        return stats_to_wire(pool.stats)
    if op == "session":
        return {"sid": pool.session_id, "boot": pool.boot_id}
    if op == "lost_owners":
        return {str(owner): message for owner, message in pool.lost_owners().items()}
    if op == "resyncs":
        return pool.resyncs
    if op == "hog_gil":
        return hog_gil(args[0])
    if op == "close":
        pool.close()
        return None
    raise ValueError(f"worker_agent: unknown op {op!r}")


def hog_gil(seconds: float) -> float:
    """Hold the GIL for at least ``seconds`` (by the clock), as a long native prefill step
    does: the heartbeat thread cannot run meanwhile. The seconds it was held.

    Short C calls (``sum``) run until the clock says ``seconds`` have passed, with the switch
    interval raised so that a waiting thread never makes this one drop the GIL between them
    (nothing here blocks, which would drop it). Measured, not calibrated: a calibration on a
    busy machine held it for 1.98 s of 3 asked.
    """
    interval = sys.getswitchinterval()
    sys.setswitchinterval(10 * seconds + 60)
    try:
        started = time.perf_counter()
        while time.perf_counter() - started < seconds:
            sum(range(100_000))  # about a millisecond
        return time.perf_counter() - started
    finally:
        sys.setswitchinterval(interval)


def main() -> None:
    run_dir, name = sys.argv[1], sys.argv[2]
    quantized = "--quantized-formats" in sys.argv[3:]
    pool = PoolClient(
        run_dir,
        name=name,
        bytes_per_block=4096,
        bytes_per_format=AGENT_BYTES_PER_FORMAT if quantized else None,
        timeout=5.0,
    )
    print(json.dumps({"ok": True, "result": {"sid": pool.session_id}}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        try:
            reply = {"ok": True, "result": run_op(pool, command["op"], command.get("args", []))}
        except Exception as exc:
            reply = {"ok": False, "error": type(exc).__name__, "message": str(exc)}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
