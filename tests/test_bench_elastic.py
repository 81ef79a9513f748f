"""The tier-1 simulator of scripts/bench_elastic.py (issue 13): it drives the real ledger and
reclaim book on a virtual clock; here a short seeded trace is played under each policy with the
simulator's own checks after every event (the ledger's recount, holdings within the budget and
each static part, the ledger's bytes equal to the blocks the simulated requests hold), and the
outcome is checked for conservation and determinism, not for speed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_elastic.py"


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_elastic", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_elastic"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


bench = load_bench()

POLICIES = {
    "elastic": bench.elastic_policy,
    "static": lambda: bench.static_policy((0.3, 0.3, 0.4)),
    "shared today": bench.shared_policy,
    "shared+grow": lambda: bench.shared_policy(False),
}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_trace_plays_to_the_end_with_every_invariant_held(name: str) -> None:
    trace = bench.make_trace(seed=3, duration=20.0, load=1.0)
    sim = bench.Simulation(POLICIES[name](), trace, check=True)
    result = sim.run()
    assert sim.ledger.total_held == 0, "bytes left held after every request ended"
    assert sim.ledger.n_waiting == 0
    finished = [r for r in result.requests if r.finished is not None]
    refused = [r for r in result.requests if r.first_token is None]
    assert len(finished) + len(refused) == len(trace), "a request neither finished nor refused"
    for request in finished:
        assert request.generated == request.output
        assert request.arrival <= request.first_token <= request.finished
        assert request.held_blocks == 0
    assert result.tokens == sum(r.output for r in finished)
    if name != "elastic":
        assert not result.reclaim_latencies and result.reclaims_late == 0
    if "today" in name:
        assert result.preemptions == 0, "a full reservation never grows, so never preempts"
    stats = sim.book.stats
    assert stats.answered + stats.late >= len(result.reclaim_latencies)
    assert stats.bytes_reclaimed <= stats.bytes_asked or stats.answered


def test_elastic_lends_reserves_and_takes_them_back() -> None:
    trace = bench.make_trace(seed=3, duration=20.0, load=1.0)
    result = bench.simulate(bench.elastic_policy(), trace, check=True)
    assert result.reclaim_latencies, "the trace never needed a lent reserve back"
    assert max(result.reclaim_latencies) <= bench.RECLAIM_DEADLINE or result.reclaims_late


def test_the_same_seed_plays_the_same_run() -> None:
    trace = bench.make_trace(seed=5, duration=15.0, load=0.8)
    first = bench.simulate(bench.elastic_policy(), trace)
    second = bench.simulate(bench.elastic_policy(), bench.make_trace(5, 15.0, 0.8))
    assert [r.first_token for r in first.requests] == [r.first_token for r in second.requests]
    assert first.reclaim_latencies == second.reclaim_latencies


def test_static_splits_cover_the_grid() -> None:
    splits = list(bench.static_splits(4))
    assert splits == [(0.25, 0.25, 0.5), (0.25, 0.5, 0.25), (0.5, 0.25, 0.25)]
    assert all(abs(sum(s) - 1.0) < 1e-9 for s in bench.static_splits(8))
