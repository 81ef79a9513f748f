"""The admin ops: what ``vqpoolctl`` (and any AdminClient) asks of vqpoold on the admin socket.

Declared as the worker ops are (:class:`~vqpool.shared.protocol.ops.OpSpec`); the daemon serves
each from one module of ``daemon/ops/admin/``. docs/protocol.md, "Admin ops", has their results.
"""

from __future__ import annotations

import math

from vqpool.shared.byte_sizes import MAX_BYTES
from vqpool.shared.protocol.checks import (
    check_bool,
    check_int,
    check_str,
    check_tag,
    int_in,
    number_in,
)
from vqpool.shared.protocol.ops import Field, OpSpec, args_of, op_table
from vqpool.shared.protocol.worker_ops import FIT, FIT_ARGS, HISTORY, METRICS, PING, STATS

SHRINK = "shrink"
SESSIONS = "sessions"
OWNERS = "owners"
EVICT_SESSION = "evict_session"
AUDIT = "audit"
BUDGET = "budget"
MODEL_SET = "model_set"
MODEL_LIST = "model_list"
MODEL_UNSET = "model_unset"
CACHE_DROP = "cache_drop"
LOAD_RESERVE = "load_reserve"
LOAD_RELEASE = "load_release"

MAX_LOAD_TTL = 600.0
"""Seconds a load reservation may stay unclaimed (no worker's hello took it over) at most."""

MAX_LOAD_RESERVATIONS = 64
"""Load reservations pending at once, in all: a front door loads a few models at a time."""

NO_MODEL_LIMIT = -1
"""``model_set``'s ``limit`` for "no limit of its own"."""

MODEL_FIELD = Field(
    "model",
    check_str,
    help="the model's name, as its workers give it, or a short label of it that names only it "
    "(as `vqpoolctl model list` shows it)",
)


def _optional_bytes(name: str, lo: int, what: str) -> Field:
    """An optional argument of a byte count in lo..MAX_BYTES, saying ``what`` it is."""
    return Field(name, int_in(lo, MAX_BYTES), required=False, help=what)


ADMIN_OP_SPECS = op_table(
    OpSpec(
        SHRINK,
        "Retire free blocks of one stream until at most TARGET_FREE stay free. Blocks in use "
        "are never touched; retired block ids never come back, so workers may drop their "
        "buffers. Returns how many blocks were retired and the stream's free and total counts "
        "after. Refused (retry later) during a restarted daemon's claim period: a free block "
        "may be one a worker is about to claim back.",
        (
            Field(
                "stream",
                check_tag,
                help='stream to shrink: "k", "v" (or "kv" in a shared-kv pool)',
            ),
            Field("target_free", check_int, help="free blocks to keep in that stream"),
        ),
    ),
    OpSpec(
        SESSIONS,
        "List worker sessions: pid, model, process state, blocks and bytes held per stream, "
        "owners, seconds since last heard and lease state.",
    ),
    OpSpec(
        OWNERS,
        "List active owners: session, pid and model holding each, blocks per stream, token "
        "slots of its sequence marked used (K and V counted once) and fill (those slots / the "
        "slots of the blocks holding the sequence). With SID, only that session's owners.",
        (Field("sid", check_int, required=False, help="only this session's owners"),),
    ),
    OpSpec(
        EVICT_SESSION,
        "Force-end a worker session: free every block of every owner it holds and release the "
        "owner ids. The worker's next call fails with a no-session error. Use for a hung worker "
        "that is still running (the daemon never reaps a running process on its own).",
        (Field("sid", check_int, help="session id, as `sessions` lists it"),),
    ),
    OpSpec(
        STATS,
        "Pool and daemon state: allocator counters, free and total blocks per stream, pool "
        "config, boot id, pid, version, uptime, sessions and owners, request and error "
        "counters, and what a restart's claim period took back.",
    ),
    OpSpec(
        HISTORY,
        "Recent allocator stats snapshots, oldest first: one per mutating call (allocate, "
        "free, free_all, shrink), at most the last 256, each with the wall-clock TIME the "
        "daemon recorded it at (the end of the loop turn that made it). With LIMIT, only the "
        "newest LIMIT. With "
        "TIMELINE, the daemon's per-stream timeline instead: blocks in use and total per stream "
        "with wall-clock times, sampled every 0.25 s while the pool changes (at most 3600 "
        "samples).",
        (
            Field("limit", int_in(1), required=False, help="newest snapshots to return"),
            Field(
                "timeline",
                check_bool,
                required=False,
                default=False,
                help="return the per-stream timeline instead of the allocator snapshots",
            ),
        ),
    ),
    OpSpec(
        METRICS,
        "The pool's gauges and counters in the Prometheus text exposition format (blocks "
        "total, in use and peak, fragmentation; blocks allocated, freed, reused, grown and "
        "retired, allocations refused), named veloxquant_block_pool_* as the VeloxQuant block "
        "pool exports them.",
    ),
    OpSpec(
        AUDIT,
        "Recount the whole pool and cross-check it: free plus in use equals total per stream, "
        "no block free twice or held by two owners, every active owner held by exactly one "
        "live session. Returns ok and the list of problems found (empty when all is well), "
        "and the budget's breaches: bytes held past the budget, a model's limit or other "
        "models' reserves (a live change below what is held makes one until reclaim is done). "
        "O(pool size).",
    ),
    OpSpec(PING, "Check that the daemon answers: its boot id, pid and uptime."),
    OpSpec(
        BUDGET,
        "Show the memory budget, or set it live with BYTES: bytes held in all, free, reserved, "
        "unused reserves (protected), requests waiting. Lowering it below what is held takes "
        "nothing back: nothing more is granted until holdings fall under it. Waiting requests "
        "the change made impossible are refused (OVER_BUDGET); ``refused`` says how many.",
        (
            Field(
                "bytes",
                int_in(0, MAX_BYTES),
                required=False,
                default=0,
                help="the new budget in bytes (absent or 0: just show it)",
            ),
        ),
    ),
    OpSpec(
        MODEL_SET,
        "Set one model's budget settings live: RESERVE (bytes kept for it), LIMIT (bytes it "
        "may hold at most; -1: no limit of its own) and WEIGHT (its share of spare bytes). "
        "Fields not given keep their value; the settings outlive a restart. Invalid settings "
        "(reserves over the budget, a reserve over the limit, a weight outside [0.001, 1000]) "
        "are refused and nothing changes; so is a MODEL no connected worker, config file or "
        "earlier setting names, unless CREATE (a model configured ahead of its workers, named "
        "in full). Returns the model's view, as in ``model_list``.",
        (
            MODEL_FIELD,
            Field(
                "create",
                check_bool,
                required=False,
                default=False,
                help="set a model nobody knows yet (no worker connected, not configured), "
                "taking MODEL as its full name",
            ),
            Field(
                "reserve",
                check_int,
                required=False,
                help="bytes kept for the model that no other model may take",
            ),
            Field(
                "limit",
                check_int,
                required=False,
                help=f"most bytes the model may hold ({NO_MODEL_LIMIT}: no limit of its own)",
            ),
            # Ranges are the daemon's to judge: a wrong value is INVALID_VALUE, a wrong type
            # BAD_REQUEST.
            Field(
                "weight",
                number_in(-math.inf, math.inf),
                required=False,
                help="the model's share of spare bytes while models wait, relative to the "
                "others' (default 1)",
            ),
        ),
    ),
    OpSpec(
        MODEL_UNSET,
        "Remove the settings made live for MODEL: it falls back to its config file's settings, "
        "or to the defaults (and leaves ``model_list`` when no worker of it is connected and it "
        "holds nothing). Refused, changing nothing, for a model without live settings, or when "
        "its config file's reserve would no longer fit the budget. Returns the model's full "
        "name and its view as in ``model_list`` (null when it left the list).",
        (MODEL_FIELD,),
    ),
    OpSpec(
        MODEL_LIST,
        "Every model the budget knows (configured, or served by a live worker): bytes held, "
        "reserve, limit, weight, borrowed (held above the reserve), entitlement, waiting "
        "requests and their bytes, and its workers' sessions and load; with the budget's own "
        "view.",
    ),
    OpSpec(
        FIT,
        "Would CONCURRENCY sequences of CONTEXT tokens of MODEL fit? Verdict ``now``, "
        "``within_reserve``, ``after_others_return`` or ``never``, with the numbers behind it "
        "and the largest concurrency that fits now and ever. Priced with the bytes per block a "
        "live worker of that model declared, or for a model with no worker connected with "
        "BYTES_PER_TOKEN or BYTES_PER_BLOCK and its WEIGHTS. The answer adds weights, free and, "
        "per loaded model, {weights, overhead, held, cached, idle}: what unloading it would free.",
        (
            MODEL_FIELD,
            *FIT_ARGS,
            _optional_bytes(
                "weights", 0, "bytes of the model's weights, for a model with no worker connected"
            ),
            _optional_bytes(
                "bytes_per_token",
                1,
                "bytes of KV one token takes (all layers, k and v), for a model with no worker "
                "connected",
            ),
            _optional_bytes(
                "bytes_per_block",
                1,
                "bytes of KV one block takes (all streams), for a model with no worker connected",
            ),
            _optional_bytes(
                "quantized_bytes_per_token",
                1,
                "with bytes_per_token (then in full precision), for a model whose worker will "
                "quantize its KV: bytes of KV one token takes in its quantized format",
            ),
            Field(
                "quantized_kv_start",
                int_in(0),
                required=False,
                default=0,
                help="with quantized_bytes_per_token: its worker's --quantized-kv-start",
            ),
            Field(
                "first_pass_slots",
                int_in(0),
                required=False,
                default=0,
                help="with quantized_bytes_per_token and quantized_kv_start 0: the full-precision "
                "slots a sequence's admission takes (its worker's --prefill-step-size)",
            ),
        ),
    ),
    OpSpec(
        LOAD_RESERVE,
        "Before loading MODEL: charge its WEIGHTS (and OVERHEAD) to it now if they and KV_MIN "
        "bytes of KV fit "
        "({granted: true, ticket, free}); the first hello of a worker of MODEL takes the "
        "reservation over (its weights become the session's), or it expires after TTL "
        "seconds, or load_release gives it back. Not now: {granted: false, short, free, "
        "weights, overhead, kv_min, cached}, where cached is the prompt-cache bytes the daemon "
        "just asked workers to give back (least recently used first, across models, up to short). "
        "Refused (bad request, naming the numbers) when it could never fit, or when "
        f"{MAX_LOAD_RESERVATIONS} reservations are pending.",
        (
            Field("model", check_str, help="the model's full name, as its worker will give it"),
            Field("weights", int_in(0, MAX_BYTES), help="bytes of its weights"),
            Field(
                "overhead",
                int_in(0, MAX_BYTES),
                required=False,
                default=0,
                help="bytes its worker may hold beyond weights and KV (its MLX buffer-cache "
                "limit), charged beside the weights",
            ),
            Field(
                "kv_min",
                int_in(0, MAX_BYTES),
                help="bytes of KV it needs at least (one request at its smallest, or its reserve)",
            ),
            Field(
                "ttl",
                number_in(1e-3, MAX_LOAD_TTL),
                help=f"seconds the reservation waits for the worker's hello (at most "
                f"{MAX_LOAD_TTL:g})",
            ),
        ),
    ),
    OpSpec(
        LOAD_RELEASE,
        "Give back a pending load reservation (the load failed or was cancelled): "
        "{released: bool} (false: no such ticket pending, taken over by a hello or expired).",
        (Field("ticket", check_str, help="the ticket load_reserve granted"),),
    ),
    OpSpec(
        CACHE_DROP,
        "Make the workers of MODEL drop their prompt cache: every cached entry's blocks go back "
        "to the pool. The daemon never waits for a worker: each is told in the answer to its "
        "next load report (its heartbeat, within a quarter of the lease), so the bytes come "
        "back within that time; the answer says how many sessions were told and the cached "
        "bytes they last reported.",
        (
            MODEL_FIELD,
            Field(
                "disk",
                check_bool,
                required=False,
                default=False,
                help="remove the entries of their disk tier (--kv-disk-bytes) too",
            ),
        ),
    ),
)
"""Every admin op, by name."""

ADMIN_OPS = frozenset(ADMIN_OP_SPECS)

ADMIN_ARGS = args_of(ADMIN_OP_SPECS.values())
"""Each admin op's arguments, by op name."""
