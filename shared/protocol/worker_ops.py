"""The worker ops: what a worker (``PoolClient``) asks of vqpoold on the worker socket.

docs/protocol.md, "Worker ops", has their results and errors.
"""

from __future__ import annotations

from vqpool.shared.byte_sizes import MAX_BYTES
from vqpool.shared.protocol.checks import (
    check_allocations,
    check_block_ids,
    check_bool,
    check_bytes_per_block,
    check_bytes_per_format,
    check_claims,
    check_int,
    check_owner,
    check_str,
    check_tag,
    check_updates,
    int_in,
    number_in,
)
from vqpool.shared.protocol.counters import check_memory, check_prompt_cache
from vqpool.shared.protocol.limits import (
    MAX_FIT_CONCURRENCY,
    MAX_FIT_CONTEXT,
    MAX_LOAD,
    MAX_RECLAIM_BYTES,
    MAX_RECLAIM_POLL_SECONDS,
    MAX_WAIT_SECONDS,
)
from vqpool.shared.protocol.ops import Field, OpSpec, args_of, op_table

HELLO = "hello"
GOODBYE = "goodbye"
PING = "ping"
ALLOCATE = "allocate"
ALLOCATE_MANY = "allocate_many"
FREE = "free"
FREE_ALL = "free_all"
REGISTER_OWNER = "register_owner"
RELEASE_OWNER = "release_owner"
BLOCKS_FOR = "blocks_for"
N_FREE = "n_free"
MARK_USED = "mark_used"
STATS = "stats"
HISTORY = "history"
METRICS = "metrics"
CLAIM = "claim"
FIT = "fit"
RECLAIM_POLL = "reclaim_poll"
RECLAIM_DONE = "reclaim_done"
CANCEL = "cancel"


WAIT_FIELD = Field(
    "wait",
    number_in(0.0, MAX_WAIT_SECONDS),
    required=False,
    default=0.0,
    help="seconds the request may wait at the daemon for memory of the budget (0: answer now)",
)

GROWTH_FIELD = Field(
    "growth",
    check_bool,
    required=False,
    default=False,
    help="a growth of memory the session's running requests hold: it goes ahead of the "
    "model's waiting admissions, waits only while the model is below its fair share, and at "
    "most one per session waits",
)

OWNER_ARGS = (Field("owner", check_owner),)
"""The one argument of the ops on one owner."""

FIT_ARGS = (
    Field(
        "context",
        int_in(1, MAX_FIT_CONTEXT),
        help="tokens per sequence: prompt plus tokens to generate",
    ),
    Field(
        "concurrency",
        int_in(1, MAX_FIT_CONCURRENCY),
        required=False,
        default=1,
        help="sequences of that size at once (default 1)",
    ),
)
"""What ``fit`` asks about, as the worker op and the admin op take it."""

WORKER_OP_SPECS = op_table(
    OpSpec(
        HELLO,
        "Open a session for the calling worker process (a repeated nonce returns the same "
        "session): its id, the daemon's boot id, the pool's shape, the lease and heartbeat.",
        (
            Field("pid", int_in(1, 1 << 31), help="the worker's process id"),
            Field("model", check_str, help="model name, for the admin's eyes"),
            Field(
                "nonce",
                check_str,
                help="random per-client token: a repeated hello returns the same "
                "session instead of opening a second one",
            ),
            Field(
                "bytes_per_block",
                check_bytes_per_block,
                required=False,
                default={},
                help="bytes one block of each stream holds in this worker",
            ),
            Field(
                "bytes_per_format",
                check_bytes_per_format,
                required=False,
                default={},
                help="bytes one block of each format (tag -> int or map stream -> int) holds "
                "in this worker; a block of an undeclared format costs bytes_per_block",
            ),
            Field(
                "quantized_kv_start",
                int_in(0),
                required=False,
                default=0,
                help="with a quantized format in bytes_per_format: the tokens a sequence holds "
                "in full precision before it is quantized (--quantized-kv-start); fit prices "
                "a sequence so (vqpool.shared.kv_sequence)",
            ),
            Field(
                "first_pass_slots",
                int_in(0),
                required=False,
                default=0,
                help="with a quantized format and quantized_kv_start 0: the most token slots a "
                "sequence's admission takes in full precision beside its quantized ones (its "
                "first prefill chunk); fit prices a sequence so",
            ),
            Field("client_version", check_str, required=False, default=""),
            Field(
                "weights",
                int_in(0, MAX_BYTES),
                required=False,
                help="bytes of the model's weights as loaded: charged to the session in the "
                "budget (taking over a pending load reservation of the model)",
            ),
            Field(
                "overhead",
                int_in(0, MAX_BYTES),
                required=False,
                help="bytes the worker may hold beyond its weights and KV blocks (its MLX "
                "buffer-cache limit): charged with its weights, as the model's fixed cost",
            ),
            Field(
                "resumes",
                int_in(0),
                required=False,
                help="after a daemon restart: the session id this client held before it",
            ),
        ),
    ),
    OpSpec(GOODBYE, "End the session: free every block of its owners and release their ids."),
    OpSpec(
        PING,
        "Keep the session's lease, and report the worker's load. Answers nil, or advice for "
        "its prompt cache (drop it, or release bytes others wait for).",
        (
            Field(
                "running",
                int_in(0, MAX_LOAD),
                required=False,
                help="requests the worker is running now",
            ),
            Field(
                "queued",
                int_in(0, MAX_LOAD),
                required=False,
                help="requests waiting in the worker's queue now",
            ),
            Field(
                "preemptions",
                int_in(0, MAX_LOAD),
                required=False,
                help="requests the worker preempted since its session opened (a running count)",
            ),
            Field(
                "prompt_cache",
                check_prompt_cache,
                required=False,
                help="what the worker's prompt cache holds and did (PROMPT_CACHE_COUNTERS)",
            ),
            Field(
                "memory",
                check_memory,
                required=False,
                help="what the worker's process holds, in bytes (MEMORY_KEYS: its model's "
                "weights, MLX's active, cache and peak memory, its resident set)",
            ),
        ),
    ),
    OpSpec(
        ALLOCATE,
        "Blocks for n_tokens tokens of one owner's stream, in allocation order (all full but "
        "the last); may wait for memory of the budget.",
        (
            Field("stream", check_tag),
            Field("n_tokens", check_int),
            Field("owner", check_owner),
            Field("format", check_tag, required=False, default="fp16"),
            WAIT_FIELD,
            GROWTH_FIELD,
        ),
    ),
    OpSpec(
        ALLOCATE_MANY,
        "Several allocations in one request, each applied on its own: per item its block ids "
        "or its error.",
        (Field("items", check_allocations), WAIT_FIELD, GROWTH_FIELD),
    ),
    OpSpec(
        CANCEL,
        "Stop waiting for one of the session's own allocations parked at the daemon: it is "
        "answered CANCELLED ({cancelled: true}); one answered already (granted or refused) is "
        "left as it is ({cancelled: false}: the session frees what was granted). A request "
        "id this session has no waiting or answered allocation under is refused.",
        (
            Field(
                "request",
                int_in(0),
                help="the request id of the waiting allocate / allocate_many",
            ),
        ),
    ),
    OpSpec(
        FREE,
        "Give blocks back to the pool (free or unknown ids are skipped).",
        (Field("block_ids", check_block_ids),),
    ),
    OpSpec(FREE_ALL, "Give back every block of an owner and release its id.", OWNER_ARGS),
    OpSpec(REGISTER_OWNER, "Bind an owner id to the session before it holds a block.", OWNER_ARGS),
    OpSpec(RELEASE_OWNER, "Release an owner id that holds no block.", OWNER_ARGS),
    OpSpec(BLOCKS_FOR, "An owner's blocks as [block_id, stream, format, n_used] rows.", OWNER_ARGS),
    OpSpec(
        N_FREE,
        "Free blocks of a stream.",
        (Field("stream", check_tag, required=False, default="k"),),
    ),
    OpSpec(
        MARK_USED,
        "Set how many token slots of each block are used.",
        (Field("updates", check_updates),),
    ),
    OpSpec(STATS, "The allocator's counters."),
    OpSpec(HISTORY, "The allocator's counters after each recent change, oldest first."),
    OpSpec(METRICS, "The allocator's counters in the Prometheus text exposition format."),
    OpSpec(
        CLAIM,
        "After a daemon restart: take back the owners and blocks this worker holds (per "
        "owner: nil, or the error that refused it).",
        (
            Field("owners", check_claims, help="what this worker holds: owners and their blocks"),
            Field(
                "done",
                check_bool,
                required=False,
                default=True,
                help="last claim of this re-sync (ends the claim period early once all are done)",
            ),
        ),
    ),
    OpSpec(
        FIT,
        "Would concurrency sequences of context tokens of the session's model fit the memory "
        "budget? Priced with the session's bytes per block.",
        FIT_ARGS,
    ),
    OpSpec(
        RECLAIM_POLL,
        "Wait for an ask to give bytes back to the budget (the request may be parked until "
        "one comes).",
        (
            Field(
                "wait",
                number_in(0.0, MAX_RECLAIM_POLL_SECONDS),
                help="seconds to wait at the daemon for an ask to give bytes back",
            ),
        ),
    ),
    OpSpec(
        RECLAIM_DONE,
        "Tell the daemon how many bytes the worker freed for an ask.",
        (
            Field("ask", int_in(1), help="the ask's id, from reclaim_poll"),
            Field(
                "freed",
                int_in(0, MAX_RECLAIM_BYTES),
                help="bytes the worker freed for it (the daemon's ledger decides what counts)",
            ),
        ),
    ),
)
"""Every worker op, by name."""

WORKER_OPS = frozenset(WORKER_OP_SPECS)

WORKER_ARGS = args_of(WORKER_OP_SPECS.values())
"""Each worker op's arguments, by op name."""

MUTATING_OPS = frozenset(
    {ALLOCATE, ALLOCATE_MANY, FREE, FREE_ALL, REGISTER_OWNER, RELEASE_OWNER, MARK_USED, CLAIM}
)
"""Worker ops whose replies the daemon caches per (session, request id): applying one twice
would change state twice, so a retry must get the first reply instead."""
