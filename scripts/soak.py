#!/usr/bin/env python3
"""Chaos soak of vqpoold: workers churn blocks while workers and the daemon are killed.

N worker processes (this script in ``--worker`` mode, each one PoolClient) allocate, grow,
free, mark_used and free_all on random owner ids drawn from one namespace (so owners collide
across workers), and check now and then that the daemon's view of an owner equals their own.
Meanwhile, at random times, this script SIGKILLs a worker and starts a replacement, SIGKILLs
the daemon and starts it again on the same run directory (the workers re-sync), or shrinks a
stream through the admin socket. Every second it audits the daemon: the allocator's recount
(free + in use = total per stream, no block free twice or held twice), the owner-to-session
map, and that every block is held by a session whose process is alive (a killed worker's
session must be gone within 2 s).

At the end the workers stop cleanly, freeing what they hold, and the daemon must hold no block:
anything left is a leak. The report gives operations, faults injected, audits passed, blocks
leaked, the daemon's memory growth, and per restart the time until the claim period was over
and allocations were served again, with the claims accepted and refused.

    scripts/soak.py --minutes 30 --workers 4
    scripts/soak.py --minutes 0.5 --workers 3 --json /tmp/soak.json   # the test suite's run

Exit status 0 when nothing leaked and every audit passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil
from vqpool.shared.admin_client import AdminClient
from vqpool.shared.config import ADMIN_SOCKET_NAME, WORKER_SOCKET_NAME
from vqpool.shared.errors import DaemonUnavailableError

DAEMON_OPTIONS = ("--n-blocks", "512", "--lease", "2", "--claim-grace", "3")
REAP_ALLOWANCE = 2.0
"""Seconds a killed worker's session may outlive it (the daemon promises 2 s)."""
STATUS_INTERVAL = 0.5

# -- worker mode -----------------------------------------------------------------------------------


def worker_main(run_dir: str, seed: int, status_path: str, n_owner_ids: int) -> int:
    """Churn blocks until SIGTERM; then free everything and close. Counters go to status_path."""
    from vqpool.shared import (
        Block,
        BlockPoolExhaustedError,
        ClaimConflictError,
        OwnerAlreadyActiveError,
    )
    from vqpool.worker import PoolClient

    stopping = False

    def on_term(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    rng = random.Random(seed)
    counts: Counter[str] = Counter()
    pool = PoolClient(run_dir, name=f"soak-{seed}", timeout=30.0, first_retry=0.2)
    held: dict[str, list[Block]] = {}
    last_status = 0.0

    def write_status() -> None:
        tmp = f"{status_path}.tmp"
        with open(tmp, "w") as f:
            json.dump({**counts, "resyncs": len(pool.resyncs), "pid": os.getpid()}, f)
        os.replace(tmp, status_path)

    while not stopping:
        op = rng.choices(
            ["allocate", "grow", "free", "mark_used", "free_all", "verify"], [4, 3, 3, 3, 2, 1]
        )[0]
        try:
            if op in ("grow", "free", "mark_used", "free_all", "verify") and not held:
                op = "allocate"
            if op == "allocate":
                owner = f"o{rng.randrange(n_owner_ids)}"
                if owner in held:
                    op = "grow"
                else:
                    held[owner] = list(pool.allocate(rng.choice("kv"), rng.randint(1, 64), owner))
            if op == "grow":
                owner = rng.choice(list(held))
                held[owner] += pool.allocate(rng.choice("kv"), rng.randint(1, 48), owner)
            elif op == "free":
                owner = rng.choice(list(held))
                chosen = rng.sample(held[owner], rng.randint(1, len(held[owner])))
                pool.free(chosen)
                held[owner] = [b for b in held[owner] if b.owner is not None]
                if not held[owner]:
                    del held[owner]
            elif op == "mark_used":
                owner = rng.choice(list(held))
                pool.mark_used_many([(b, rng.randint(0, 16)) for b in held[owner][:4]])
            elif op == "free_all":
                owner = rng.choice(list(held))
                pool.free_all(owner)
                del held[owner]
            elif op == "verify":
                owner = rng.choice(list(held))
                theirs = sorted(b.block_id for b in pool.blocks_for(owner))
                if theirs != sorted(b.block_id for b in held[owner]):
                    counts["consistency errors"] += 1
            counts[f"op {op}"] += 1
        except OwnerAlreadyActiveError:
            counts["owner collisions"] += 1
        except BlockPoolExhaustedError:
            counts["exhausted"] += 1
            if held:  # make room
                owner = rng.choice(list(held))
                pool.free_all(owner)
                del held[owner]
        except ClaimConflictError:
            counts["owners lost in a restart"] += 1
            for owner in pool.lost_owners():
                pool.free_all(owner)  # forgets it
                held.pop(str(owner), None)
        except Exception as exc:  # anything else is a finding
            counts[f"unexpected {type(exc).__name__}"] += 1
            print(f"soak worker {seed}: {type(exc).__name__}: {exc}", file=sys.stderr)
        now = time.monotonic()
        if now - last_status > STATUS_INTERVAL:
            write_status()
            last_status = now
    for owner in list(held):
        try:
            pool.free_all(owner)
        except Exception as exc:
            counts[f"unexpected {type(exc).__name__}"] += 1
    pool.close()
    write_status()
    return 0


# -- the soak --------------------------------------------------------------------------------------


class Daemon:
    """The vqpoold under test; restarted on the same run directory."""

    def __init__(self, run_dir: Path, log_path: Path) -> None:
        self.run_dir = run_dir
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None
        self.started = 0.0
        self.rss_samples: list[int] = []
        self.lifetimes: list[dict[str, Any]] = []

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "vqpool.daemon",
                    "--run-dir",
                    str(self.run_dir),
                    *DAEMON_OPTIONS,
                ],
                stdout=log,
                stderr=log,
            )
        self.started = time.monotonic()
        self.rss_samples = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if (self.run_dir / ADMIN_SOCKET_NAME).exists() and (
                self.run_dir / WORKER_SOCKET_NAME
            ).exists():
                try:
                    admin("ping", self.run_dir, timeout=0.5)
                    return
                except DaemonUnavailableError:
                    pass
            time.sleep(0.01)
        raise RuntimeError(f"vqpoold did not start; see {self.log_path}")

    def sample_rss(self) -> None:
        assert self.process is not None
        with contextlib.suppress(psutil.Error):
            self.rss_samples.append(psutil.Process(self.process.pid).memory_info().rss)

    def end_lifetime(self) -> None:
        if len(self.rss_samples) >= 2:
            self.lifetimes.append(
                {
                    "seconds": time.monotonic() - self.started,
                    "rss_first": self.rss_samples[0],
                    "rss_last": self.rss_samples[-1],
                    "rss_max": max(self.rss_samples),
                }
            )

    def kill(self) -> None:
        assert self.process is not None
        self.end_lifetime()
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        assert self.process is not None
        self.end_lifetime()
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def admin(op: str, run_dir: Path, timeout: float = 3.0, **args: Any) -> Any:
    with AdminClient(run_dir, timeout=timeout) as client:
        return client.call(op, **args)


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.base = Path(tempfile.mkdtemp(prefix="vqsoak", dir="/tmp"))
        self.run_dir = self.base / "run"
        self.daemon = Daemon(self.run_dir, self.base / "vqpoold.log")
        self.workers: dict[int, subprocess.Popen[bytes]] = {}
        self.killed: dict[int, float] = {}  # pid -> when it was SIGKILLed
        self.next_seed = args.seed * 1000
        self.faults: Counter[str] = Counter()
        self.audits: Counter[str] = Counter()
        self.problems: list[str] = []
        self.restarts: list[dict[str, Any]] = []

    # workers

    def spawn_worker(self) -> None:
        seed = self.next_seed
        self.next_seed += 1
        status = self.base / f"worker-{seed}.json"
        process = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                str(self.run_dir),
                str(seed),
                str(status),
                str(4 * self.args.workers),
            ],
            stderr=open(self.base / f"worker-{seed}.log", "wb"),  # noqa: SIM115
        )
        self.workers[process.pid] = process

    def kill_worker(self) -> None:
        pid = self.rng.choice(list(self.workers))
        self.workers.pop(pid).kill()
        self.killed[pid] = time.monotonic()
        self.faults["worker SIGKILLed and replaced"] += 1
        self.spawn_worker()

    # daemon

    def restart_daemon(self) -> None:
        self.daemon.kill()
        self.faults["daemon SIGKILLed and restarted"] += 1
        down = time.monotonic()
        self.daemon.start()
        while True:  # until the claim period is over: allocations are served again
            claims = admin("stats", self.run_dir)["claims"]
            if not claims["active"]:
                break
            time.sleep(0.01)
        self.restarts.append(
            {
                "served_after_kill_s": round(time.monotonic() - down, 3),
                "claim_period_s": round(claims["period_s"], 3),
                "expected": claims["expected"],
                "resynced": claims["resynced"],
                "owners_claimed": claims["owners_claimed"],
                "owners_refused": claims["owners_refused"],
                "blocks_claimed": claims["blocks_claimed"],
                "end_reason": claims["end_reason"],
            }
        )

    def shrink(self) -> None:
        stats = admin("stats", self.run_dir)
        stream = self.rng.choice(sorted(stats["streams"]))
        free = stats["streams"][stream]["free"]
        retired = admin(
            "shrink", self.run_dir, stream=stream, target_free=max(0, free - self.rng.randint(1, 8))
        )["retired"]
        self.faults["admin shrink"] += 1
        self.faults["blocks retired by shrink"] += retired

    # audit

    def audit(self) -> None:
        try:
            report = admin("audit", self.run_dir, timeout=2.0)
            stats = admin("stats", self.run_dir, timeout=2.0)
            sessions = admin("sessions", self.run_dir, timeout=2.0)
        except DaemonUnavailableError:
            self.audits["skipped (daemon unavailable)"] += 1
            return
        problems = list(report["problems"])
        in_use = stats["stats"]["blocks_in_use"]
        free_total = sum(s["free"] for s in stats["streams"].values())
        total = sum(s["total"] for s in stats["streams"].values())
        if free_total + in_use != total:
            problems.append(f"free {free_total} + in use {in_use} != total {total}")
        now = time.monotonic()
        for session in sessions:
            pid = session["pid"]
            if session["n_blocks"] and not psutil.pid_exists(pid):
                killed_at = self.killed.get(pid)
                if killed_at is None or now - killed_at > REAP_ALLOWANCE:
                    problems.append(f"{session['n_blocks']} block(s) held by dead pid {pid}")
        self.daemon.sample_rss()
        if problems:
            self.audits["failed"] += 1
            self.problems += problems[:5]
        else:
            self.audits["passed"] += 1

    # run

    def run(self) -> dict[str, Any]:
        args = self.args
        self.daemon.start()
        for _ in range(args.workers):
            self.spawn_worker()
        started = time.monotonic()
        end = started + args.minutes * 60
        # The first three faults are one of each kind, so even a short run injects all of them.
        kinds = ["shrink", "kill_worker", "restart_daemon"]
        next_fault = started + self.rng.uniform(0.5, 1.5) * args.fault_interval
        next_audit = started + 1.0
        while time.monotonic() < end:
            now = time.monotonic()
            if now >= next_audit:
                self.audit()
                next_audit = now + 1.0
            if now >= next_fault:
                kind = (
                    kinds.pop(0)
                    if kinds
                    else self.rng.choices(["shrink", "kill_worker", "restart_daemon"], [2, 3, 1])[0]
                )
                getattr(self, kind)()
                next_fault = time.monotonic() + self.rng.uniform(0.5, 1.5) * args.fault_interval
            for pid, process in list(self.workers.items()):
                if process.poll() is not None:  # a worker that died on its own is a finding
                    self.problems.append(f"worker {pid} exited with {process.returncode}")
                    del self.workers[pid]
                    self.spawn_worker()
            time.sleep(0.05)
        return self.finish(time.monotonic() - started)

    def finish(self, seconds: float) -> dict[str, Any]:
        for process in self.workers.values():
            process.send_signal(signal.SIGTERM)
        for process in self.workers.values():
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                self.problems.append(f"worker {process.pid} did not stop on SIGTERM")
        time.sleep(REAP_ALLOWANCE)
        self.audit()
        final = admin("stats", self.run_dir)
        leaked = final["stats"]["blocks_in_use"]
        self.daemon.sample_rss()
        self.daemon.stop()
        ops: Counter[str] = Counter()
        for status in self.base.glob("worker-*.json"):
            ops.update(json.loads(status.read_text()))
        ops.pop("pid", None)
        lifetimes = self.daemon.lifetimes
        longest = max(lifetimes, key=lambda x: x["seconds"]) if lifetimes else None
        served = [r["served_after_kill_s"] for r in self.restarts]
        report = {
            "minutes": round(seconds / 60, 2),
            "workers": self.args.workers,
            "operations": sum(v for k, v in ops.items() if k.startswith("op ")),
            "operations_by_kind": {k: v for k, v in sorted(ops.items())},
            "faults": dict(self.faults),
            "audits": dict(self.audits),
            "problems": self.problems[:20],
            "blocks_leaked": leaked,
            "owners_left": final["owners"],
            "sessions_left": final["sessions"],
            "restarts": self.restarts,
            "served_after_restart_s": {
                "median": statistics.median(served) if served else None,
                "max": max(served) if served else None,
            },
            "claims": {
                "owners_claimed": sum(r["owners_claimed"] for r in self.restarts),
                "owners_refused": sum(r["owners_refused"] for r in self.restarts),
                "blocks_claimed": sum(r["blocks_claimed"] for r in self.restarts),
            },
            "daemon_memory": {
                "longest_lifetime_s": round(longest["seconds"], 1) if longest else None,
                "growth_in_longest_lifetime_kib": (
                    (longest["rss_last"] - longest["rss_first"]) // 1024 if longest else None
                ),
                "max_rss_mib": round(max(x["rss_max"] for x in lifetimes) / 2**20, 1)
                if lifetimes
                else None,
            },
            "daemon_log": str(self.daemon.log_path),
        }
        report["ok"] = (
            leaked == 0
            and not self.audits["failed"]
            and not self.problems
            and not ops["consistency errors"]
            and not any(k.startswith("unexpected") for k in ops)
        )
        return report


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _, _, run_dir, seed, status, n_owner_ids = sys.argv
        return worker_main(run_dir, int(seed), status, int(n_owner_ids))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument(
        "--fault-interval", type=float, default=6.0, help="mean seconds between faults"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, help="also write the report here")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (logs)")
    args = parser.parse_args()
    soak = Soak(args)
    try:
        report = soak.run()
    finally:
        for process in soak.workers.values():
            if process.poll() is None:
                process.kill()
        if soak.daemon.process is not None and soak.daemon.process.poll() is None:
            soak.daemon.process.kill()
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)
    if report["ok"] and not args.keep:
        shutil.rmtree(soak.base, ignore_errors=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
