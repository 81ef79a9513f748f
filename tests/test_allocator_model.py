"""Model-based test: random sequences of every allocator operation against ReferencePool.

After every step the two must agree on every result (block ids, fill, errors, counters, history)
and the allocator's invariants must hold, checked twice: by the allocator's own recount and by an
independent recount here through the public API.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from reference_pool import ReferencePool
from vqpool.shared import (
    AllocationRequest,
    Block,
    BlockPoolAllocator,
    BlockPoolExhaustedError,
    ClaimConflictError,
    OwnerAlreadyActiveError,
    PoolConfig,
)
from vqpool.shared.allocator import BlockList

OWNERS = st.sampled_from([1, 2, 3, 4, "req-a", "req-b"])
STREAMS = st.sampled_from(["k", "v", "kv", "x"])
FORMATS = st.sampled_from(["fp16", "int4"])
LIST_CHANGES = [
    "pop",
    "sort",
    "reverse",
    "append",
    "extend",
    "+=",
    "insert",
    "del slice",
    "set slice",
    "clear",
]


def error_name(exc: Exception) -> str:
    """One name for an allocator error and the model's stand-in for it."""
    if isinstance(exc, ValueError):
        return "ValueError"
    if isinstance(exc, OwnerAlreadyActiveError | KeyError):
        return "OwnerActive"
    if isinstance(exc, BlockPoolExhaustedError | MemoryError):
        return "Exhausted"
    if isinstance(exc, ClaimConflictError | LookupError):
        return "Conflict"
    raise exc


def outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    """Run ``call`` and name what happened, so allocator and model outcomes compare directly."""
    try:
        return ("ok", call())
    except Exception as exc:
        return (error_name(exc), None)


class AllocatorMachine(RuleBasedStateMachine):
    handed_out = Bundle("handed_out")

    @initialize(
        block_size=st.integers(1, 8),
        n_blocks=st.integers(1, 24),
        separate_kv=st.booleans(),
        grow=st.booleans(),
        extra_cap=st.none() | st.integers(0, 16),
    )
    def build(
        self, block_size: int, n_blocks: int, separate_kv: bool, grow: bool, extra_cap: int | None
    ) -> None:
        max_blocks = None if extra_cap is None else n_blocks + extra_cap
        config = PoolConfig(block_size, n_blocks, separate_kv, grow, max_blocks)
        self.pool = BlockPoolAllocator(config)
        self.model = ReferencePool(config)
        # The Block objects the public path handed out, by id (one per id, as the seed), and
        # the ids a public allocation or claim holds: those the objects must show.
        self.objects: dict[int, Block] = {}
        self.public: set[int] = set()

    def _handed_out(self, blocks: Sequence[Block]) -> None:
        for block in blocks:
            assert self.objects.setdefault(block.block_id, block) is block, "two Blocks, one id"
            self.public.add(block.block_id)

    def _resolved(self, stream: str) -> str:
        return self.model.stream_of(stream)

    @rule(
        target=handed_out,
        stream=STREAMS,
        n_tokens=st.integers(-1, 40),
        owner=OWNERS,
        f=FORMATS,
        look=st.booleans(),
        ids_only=st.booleans(),
    )
    def allocate(
        self, stream: str, n_tokens: int, owner: object, f: str, look: bool, ids_only: bool
    ) -> list[Block]:
        """Allocate; with ``look`` False the list is handed on unread. ``ids_only`` takes the
        daemon's path (allocate_ids) and hands on copies rebuilt from the ids, as from a wire
        message."""
        allocate = self.pool.allocate_ids if ids_only else self.pool.allocate
        got = outcome(lambda: allocate(stream, n_tokens, owner, f))  # type: ignore[arg-type]
        want = outcome(lambda: self.model.allocate(stream, n_tokens, owner, f))  # type: ignore[arg-type]
        assert got[0] == want[0], (got, want)
        if got[0] != "ok":
            return []
        if ids_only:
            assert type(got[1]) is tuple and list(got[1]) == want[1]
            return [Block(block_id) for block_id in got[1]]
        blocks: BlockList = got[1]
        assert isinstance(blocks, list) and len(blocks) == len(want[1])
        assert list(blocks.block_ids) == want[1]
        self._handed_out(blocks)  # reads it: the list is filled before it is handed out
        if not look:
            return blocks
        assert [b.block_id for b in blocks] == want[1]
        for b in blocks:
            ref = self.model.blocks[b.block_id]
            assert (b.stream, b.owner, b.n_used, b.format) == (ref.stream, owner, ref.n_used, f)
            assert b.ever_allocated
        return blocks

    @rule(items=st.lists(st.tuples(STREAMS, st.integers(0, 20), OWNERS), max_size=4))
    def allocate_many(self, items: list[tuple[str, int, object]]) -> None:
        requests = [AllocationRequest(s, n, o) for s, n, o in items]  # type: ignore[arg-type]
        results = self.pool.allocate_many(requests)
        for (s, n, o), result in zip(items, results, strict=True):
            want = outcome(lambda s=s, n=n, o=o: self.model.allocate(s, n, o, "fp16"))  # type: ignore[misc]
            if isinstance(result, Exception):
                assert error_name(result) == want[0]
            else:
                assert want[0] == "ok" and [b.block_id for b in result] == want[1]
                self._handed_out(result)

    @rule(
        target=handed_out,
        data=st.data(),
        stream=STREAMS,
        owner=OWNERS,
        f=FORMATS,
        ids_only=st.booleans(),
    )
    def claim(
        self, data: st.DataObject, stream: str, owner: object, f: str, ids_only: bool
    ) -> Sequence[Block]:
        """Claim ids by number, as a restarted daemon does: mostly free ones, sometimes held,
        retired, another stream's or out-of-pool ones, sometimes with bad fills."""
        model = self.model
        try:
            free_ids = [
                b for b in model.free[model.stream_of(stream)] if model.blocks[b].owner is None
            ]
        except ValueError:
            free_ids = []
        any_id = st.integers(-1, model.next_id + 2)
        one_id = st.one_of(st.sampled_from(free_ids), any_id) if free_ids else any_id
        ids = data.draw(st.lists(one_id, min_size=1, max_size=4) | st.just([]))
        size = model.config.block_size
        good_fills = st.lists(st.integers(0, size), min_size=len(ids), max_size=len(ids))
        bad_fills = st.lists(st.integers(-1, size + 1), max_size=5)
        fills = data.draw(st.one_of(st.none(), st.none(), good_fills, bad_fills))
        claim = self.pool.claim_ids if ids_only else self.pool.claim
        got = outcome(lambda: claim(owner, stream, ids, fills, f))  # type: ignore[arg-type]
        want = outcome(lambda: model.claim(owner, stream, ids, fills, f))  # type: ignore[arg-type]
        assert got[0] == want[0], (got, want)
        if got[0] != "ok":
            return []
        if ids_only:
            assert got[1] == tuple(ids)
            return [Block(block_id) for block_id in ids]
        blocks: Sequence[Block] = got[1]
        assert [b.block_id for b in blocks] == ids
        self._handed_out(blocks)
        for b in blocks:
            ref = model.blocks[b.block_id]
            assert (b.stream, b.owner, b.n_used, b.format) == (ref.stream, owner, ref.n_used, f)
        return blocks

    @rule(owner=OWNERS)
    def register_owner(self, owner: object) -> None:
        got = outcome(lambda: self.pool.register_owner(owner))  # type: ignore[arg-type]
        want = outcome(lambda: self.model.register(owner))  # type: ignore[arg-type]
        assert got[0] == want[0]

    @rule(owner=OWNERS)
    def release_owner(self, owner: object) -> None:
        self.pool.release_owner(owner)  # type: ignore[arg-type]
        self.model.active.discard(owner)  # type: ignore[arg-type]

    @rule(blocks=handed_out, donor=handed_out, data=st.data(), op=st.sampled_from(LIST_CHANGES))
    def change_list(
        self, blocks: list[Block], donor: list[Block], data: st.DataObject, op: str
    ) -> None:
        """Change a handed-out list as a caller of the seed's list-returning allocate() may. The
        allocator's record of the allocation must not move (the invariants compare it with the
        model), and a later free of this list frees what it lists then."""

        def index() -> int:
            return data.draw(st.integers(-len(blocks), len(blocks) - 1))

        def part() -> slice:
            return slice(data.draw(st.integers(0, len(blocks))), data.draw(st.integers(0, 4)))

        if op == "pop" and blocks:
            blocks.pop(index())
        elif op == "sort":
            blocks.sort(key=lambda b: b.block_id, reverse=data.draw(st.booleans()))
        elif op == "reverse":
            blocks.reverse()
        elif op == "append" and donor:
            blocks.append(donor[0])
        elif op == "extend":
            blocks.extend(donor)
        elif op == "+=":
            blocks += donor
        elif op == "insert" and donor:
            blocks.insert(index() if blocks else 0, donor[-1])
        elif op == "del slice":
            del blocks[part()]
        elif op == "set slice":
            blocks[part()] = donor[:2]
        elif op == "clear":
            blocks.clear()

    @rule(blocks=handed_out, data=st.data())
    def free_some(self, blocks: Sequence[Block], data: st.DataObject) -> None:
        """Free a random subset in random order; stale (already freed) blocks are allowed."""
        chosen = data.draw(st.permutations(blocks)) if blocks else []
        chosen = chosen[: data.draw(st.integers(0, len(chosen)))]
        self.pool.free(chosen)
        self.model.free_ids([b.block_id for b in chosen])

    @rule(blocks=handed_out)
    def free_allocation(self, blocks: Sequence[Block]) -> None:
        """Free a list allocate() returned, as it lists now (possibly changed or stale)."""
        self.pool.free(blocks)
        self.model.free_ids([b.block_id for b in blocks])

    @rule(blocks=handed_out)
    def free_ids(self, blocks: Sequence[Block]) -> None:
        """Free by id what a handed-out list lists now, as the daemon does (a whole unchanged
        allocation takes free_ids' fast path)."""
        self.pool.free_ids([b.block_id for b in blocks])
        self.model.free_ids([b.block_id for b in blocks])

    @rule(owner=OWNERS)
    def free_all(self, owner: object) -> None:
        self.pool.free_all(owner)  # type: ignore[arg-type]
        self.model.free_all(owner)  # type: ignore[arg-type]

    @rule(stream=STREAMS, target_free=st.integers(-1, 30))
    def shrink(self, stream: str, target_free: int) -> None:
        got = outcome(lambda: self.pool.shrink(stream, target_free))
        want = outcome(lambda: self.model.shrink(stream, target_free))
        assert got == want

    @precondition(lambda self: self.model.owner_blocks)
    @rule(data=st.data(), n_used=st.integers(-1, 9))
    def mark_used(self, data: st.DataObject, n_used: int) -> None:
        owner = data.draw(st.sampled_from(sorted(self.model.owner_blocks, key=str)))
        block = data.draw(st.sampled_from(self.pool.blocks_for(owner)))
        got = outcome(lambda: self.pool.mark_used(block, n_used))
        want = outcome(lambda: self.model.mark_used(block.block_id, n_used))
        assert got[0] == want[0]

    @invariant()
    def agrees_with_model(self) -> None:
        if not hasattr(self, "pool"):
            return
        pool, model = self.pool, self.model
        c = model.counters
        st_ = pool.stats
        assert (
            st_.n_blocks,
            st_.n_allocations,
            st_.n_frees,
            st_.n_reused,
            st_.n_exhausted,
            st_.n_grown,
            st_.n_retired,
            st_.peak_blocks_in_use,
        ) == (
            c.n_blocks,
            c.n_allocations,
            c.n_frees,
            c.n_reused,
            c.n_exhausted,
            c.n_grown,
            c.n_retired,
            c.peak_blocks_in_use,
        )
        assert st_.fragmentation() == (model.fragmented() / c.n_blocks if c.n_blocks else 0.0)
        history = pool.history
        assert [h.snapshot() for h in history] == [
            h.snapshot() for h in history
        ]  # snapshots are independent copies
        want_history = c.history[-len(history) :] if history else []
        assert [
            (
                h.n_blocks,
                h.n_allocations,
                h.n_frees,
                h.n_reused,
                h.n_exhausted,
                h.n_grown,
                h.n_retired,
                h.peak_blocks_in_use,
                h._fragmented_count,
            )
            for h in history
        ] == want_history
        assert len(history) == min(len(c.history), 256)
        for owner, ids in model.owner_blocks.items():
            assert [b.block_id for b in pool.blocks_for(owner)] == ids
        assert model.active == set(pool.active_owners())
        assert model.active | set(model.owner_blocks) == set(pool.owners())

    @invariant()
    def block_objects_agree_with_model(self) -> None:
        """Every Block the public path handed out shows its id as it is now, while a public
        allocation holds the id (a held Block of a freed allocation shows the next owner, as in
        the seed), and free otherwise (the ids path leaves the objects as they were)."""
        if not hasattr(self, "pool"):
            return
        blocks = self.model.blocks
        self.public = {i for i in self.public if i in blocks and blocks[i].owner is not None}
        for block_id, block in self.objects.items():
            if block_id in self.public:
                ref = blocks[block_id]
                assert (block.owner, block.n_used, block.format) == (
                    ref.owner,
                    ref.n_used,
                    ref.format,
                ), block_id
            else:
                assert (block.owner, block.n_used) == (None, 0), block_id

    @invariant()
    def invariants_hold(self) -> None:
        if not hasattr(self, "pool"):
            return
        pool = self.pool
        pool.check_invariants()
        # An independent recount through the public API.
        holders: dict[int, object] = {}
        in_use = dict.fromkeys(pool.streams, 0)
        partial = 0
        for owner in pool.owners():
            for block in pool.blocks_for(owner):
                assert block.block_id not in holders, f"block {block.block_id} held twice"
                holders[block.block_id] = owner
                assert block.owner == owner
                in_use[block.stream] += 1
                partial += block.n_used < pool.config.block_size
        for s in pool.streams:
            assert pool.n_free(s) + in_use[s] == pool.n_total(s), f"stream {s}: free+used != total"
        assert sum(pool.n_total(s) for s in pool.streams) == pool.stats.n_blocks
        assert pool.stats.blocks_in_use() == len(holders)
        assert pool.stats._fragmented_count == partial


# 200 examples of 40 steps (was 300): 8,000 allocator steps a run, in about 4 s; every run
# draws new examples, so the suite's runs keep exploring.
AllocatorMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestAllocatorModel = AllocatorMachine.TestCase
