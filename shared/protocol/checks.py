"""Protocol v1 between vqpoold and its clients: message shapes, limits, validation, codec.

Every message is one msgpack map in one ZeroMQ frame (docs/protocol.md has the full text).

Request::

    {"v": 1, "id": <int>, "op": <str>, "sid": <int>, "boot": <str>, "args": {...}}

``sid`` (the session id from ``hello``) and ``boot`` (the daemon boot id from ``hello``) are
required on every worker op except ``hello``; admin requests carry neither.

Reply::

    {"id": <same int>, "boot": <daemon boot id>, "ok": true, "result": ...}
    {"id": <same int or nil>, "boot": <daemon boot id>, "ok": false,
     "error": {"code": <ErrorCode>, "message": <str>}}

Decoding never trusts a length the sender claims: msgpack runs with explicit ``max_*_len``
limits, the frame size is capped by ``ZMQ_MAXMSGSIZE`` (:data:`MAX_MESSAGE_BYTES`), and every
field is checked for type and range before the daemon acts on it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
from vqpool.shared.allocator import AllocationStats, Block, Owner, PoolConfig
from vqpool.shared.errors import BadRequestError, UnsupportedVersionError, error_code_for

PROTOCOL_VERSION = 1

# -- limits ----------------------------------------------------------------------------------------

MAX_MESSAGE_BYTES = 1 << 20
"""Largest request frame the daemon accepts (``ZMQ_MAXMSGSIZE``); larger ones drop the peer's
connection inside libzmq before any byte is buffered."""

MAX_REPLY_BYTES = 256 << 20
"""Largest reply a client accepts (blocks_for of a huge owner, history, metrics)."""

MAX_ITEMS = 65536
"""Longest array in a request: block ids of one free, updates of one mark_used."""

MAX_BATCH = 4096
"""Most allocations in one allocate_many."""

MAX_BLOCKS_PER_ALLOCATE = 65536
"""Most blocks one allocation may ask for (bounds growth and the reply size)."""

MAX_BLOCKS_PER_REQUEST = 65536
"""Most blocks one request may ask for, all items of an allocate_many together: without it,
4,096 items of MAX_BLOCKS_PER_ALLOCATE could grow a growable pool by 268 M blocks at once."""

MAX_BYTES_PER_BLOCK = 1 << 32
"""Largest ``bytes_per_block`` a hello may announce (4 GiB: a block of 16 tokens of a
405B-parameter model holds ~4 MiB per stream). The admin views multiply it by the blocks a
session holds: with this bound no product or sum reaches 2**63 before the pool holds 2**31
blocks, far more than a daemon can track."""

MAX_ERROR_MESSAGE_LEN = 256
"""Longest error message the daemon sends; longer ones are cut (a message may quote an owner id
and a model name, each a few hundred characters at most)."""

MAX_OWNER_LEN = 128
"""Longest string owner id, in characters."""

MAX_TAG_LEN = 32
"""Longest stream or format tag."""

MAX_TEXT_LEN = 256
"""Longest free text in a request (model name, client version, boot id, nonce)."""

MAX_LOAD = (1 << 31) - 1
"""Largest running or queued request count a worker may report in ``ping``."""

MAX_CLAIM_GROUPS = 16
"""Most (stream, format) groups of blocks one owner may claim."""

_MAX_MAP_LEN = 64
_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1

_UNPACK_LIMITS: dict[str, Any] = {
    "raw": False,
    "strict_map_key": True,
    "use_list": True,
    "max_str_len": 4 * MAX_TEXT_LEN,
    "max_bin_len": 0,
    "max_ext_len": 0,
    "max_array_len": MAX_ITEMS,
    "max_map_len": _MAX_MAP_LEN,
}

# -- ops -------------------------------------------------------------------------------------------

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

WORKER_OPS = frozenset(
    {
        HELLO,
        GOODBYE,
        PING,
        ALLOCATE,
        ALLOCATE_MANY,
        FREE,
        FREE_ALL,
        REGISTER_OWNER,
        RELEASE_OWNER,
        BLOCKS_FOR,
        N_FREE,
        MARK_USED,
        STATS,
        HISTORY,
        METRICS,
        CLAIM,
        FIT,
        RECLAIM_POLL,
        RECLAIM_DONE,
    }
)

MUTATING_OPS = frozenset(
    {ALLOCATE, ALLOCATE_MANY, FREE, FREE_ALL, REGISTER_OWNER, RELEASE_OWNER, MARK_USED, CLAIM}
)
"""Worker ops whose replies the daemon caches per (session, request id): applying one twice
would change state twice, so a retry must get the first reply instead."""

ADMIN_OPS = frozenset(
    {
        "shrink",
        "sessions",
        "owners",
        "evict_session",
        "stats",
        "history",
        "metrics",
        "audit",
        "ping",
        "budget",
        "model_set",
        "model_list",
        "fit",
        "cache_drop",
    }
)


# -- field checks ----------------------------------------------------------------------------------


def check_int(value: Any, name: str, lo: int = _INT64_MIN, hi: int = _INT64_MAX) -> int:
    """``value`` if it is an int (not a bool) in lo..hi, else BadRequestError."""
    if type(value) is not int or not lo <= value <= hi:
        raise BadRequestError(f"{name} must be an integer in {lo}..{hi}, got {_show(value)}")
    return value


def check_number(value: Any, name: str, lo: float, hi: float) -> float:
    """``value`` as a float if it is an int or float (not a bool) in lo..hi, else
    BadRequestError."""
    if type(value) not in (int, float) or not lo <= value <= hi:
        raise BadRequestError(f"{name} must be a number in {lo:g}..{hi:g}, got {_show(value)}")
    return float(value)


def check_str(value: Any, name: str, max_len: int = MAX_TEXT_LEN) -> str:
    """``value`` if it is a string of at most ``max_len`` characters, else BadRequestError."""
    if type(value) is not str or len(value) > max_len:
        raise BadRequestError(f"{name} must be a string of <= {max_len} chars, got {_show(value)}")
    return value


def check_bool(value: Any, name: str) -> bool:
    """``value`` if it is a bool, else BadRequestError."""
    if type(value) is not bool:
        raise BadRequestError(f"{name} must be true or false, got {_show(value)}")
    return value


def check_owner(value: Any, name: str = "owner") -> Owner:
    """An owner id: a 64-bit int or a non-empty string of at most MAX_OWNER_LEN chars."""
    kind = type(value)
    if kind is int:
        if _INT64_MIN <= value <= _INT64_MAX:
            return value
    elif kind is str and 0 < len(value) <= MAX_OWNER_LEN:
        return value
    raise BadRequestError(
        f"{name} must be a 64-bit integer or a string of 1..{MAX_OWNER_LEN} chars, "
        f"got {_show(value)}"
    )


def check_tag(value: Any, name: str) -> str:
    """A stream or format tag: a non-empty string of at most MAX_TAG_LEN chars."""
    if type(value) is not str or not 0 < len(value) <= MAX_TAG_LEN:
        raise BadRequestError(
            f"{name} must be a string of 1..{MAX_TAG_LEN} chars, got {_show(value)}"
        )
    return value


def check_list(value: Any, name: str, max_len: int = MAX_ITEMS) -> list[Any]:
    """``value`` if it is an array of at most ``max_len`` items, else BadRequestError."""
    if type(value) is not list or len(value) > max_len:
        raise BadRequestError(f"{name} must be an array of <= {max_len} items, got {_show(value)}")
    return value


def check_block_ids(value: Any, name: str = "block_ids") -> list[int]:
    """An array of block ids (non-negative ints)."""
    ids = check_list(value, name)
    for block_id in ids:
        if type(block_id) is not int or not 0 <= block_id <= _INT64_MAX:
            raise BadRequestError(f"{name} must hold block ids (ints >= 0), got {_show(block_id)}")
    return ids


def check_updates(value: Any, name: str = "updates") -> list[tuple[int, int]]:
    """An array of ``[block_id, n_used]`` pairs (ranges of n_used are the allocator's to judge)."""
    pairs = check_list(value, name)
    updates: list[tuple[int, int]] = []
    for pair in pairs:
        if (
            type(pair) is not list
            or len(pair) != 2
            or type(pair[0]) is not int
            or type(pair[1]) is not int
            or not 0 <= pair[0] <= _INT64_MAX
            or not _INT64_MIN <= pair[1] <= _INT64_MAX
        ):
            raise BadRequestError(
                f"{name} items must be [block_id, n_used] ints, got {_show(pair)}"
            )
        updates.append((pair[0], pair[1]))
    return updates


def check_allocations(value: Any, name: str = "items") -> list[tuple[str, int, Owner, str]]:
    """An array of ``[stream, n_tokens, owner, format]`` allocation items."""
    items = check_list(value, name, MAX_BATCH)
    parsed: list[tuple[str, int, Owner, str]] = []
    append = parsed.append
    for item in items:
        # One decode step may carry thousands of items: test the well-formed case inline and
        # leave the detailed message to the field checks.
        if type(item) is list and len(item) == 4:
            stream, n_tokens, owner, fmt = item
            if (
                type(stream) is str
                and 0 < len(stream) <= MAX_TAG_LEN
                and type(n_tokens) is int
                and _INT64_MIN <= n_tokens <= _INT64_MAX
                and type(fmt) is str
                and 0 < len(fmt) <= MAX_TAG_LEN
                and (
                    (type(owner) is int and _INT64_MIN <= owner <= _INT64_MAX)
                    or (type(owner) is str and 0 < len(owner) <= MAX_OWNER_LEN)
                )
            ):
                append((stream, n_tokens, owner, fmt))
                continue
            check_tag(stream, "stream")
            check_int(n_tokens, "n_tokens")
            check_owner(owner)
            check_tag(fmt, "format")
        raise BadRequestError(
            f"{name} items must be [stream, n_tokens, owner, format], got {_show(item)}"
        )
    return parsed


ClaimGroup = tuple[str, str, list[int], list[int] | None]
"""Blocks of one owner claimed together: stream, format, block ids, fills (None: all full)."""


def check_claims(value: Any, name: str = "owners") -> list[tuple[Owner, list[ClaimGroup]]]:
    """An array of ``[owner, [[stream, format, block_ids, fills or nil], ...]]`` claims.

    An owner with no group re-declares a registered owner that holds no block. At most
    MAX_ITEMS block ids in one message, all groups together.
    """
    entries = check_list(value, name, MAX_BATCH)
    parsed: list[tuple[Owner, list[ClaimGroup]]] = []
    n_ids = 0
    for entry in entries:
        if type(entry) is not list or len(entry) != 2:
            raise BadRequestError(f"{name} items must be [owner, groups], got {_show(entry)}")
        owner = check_owner(entry[0], f"{name}.owner")
        groups: list[ClaimGroup] = []
        for group in check_list(entry[1], f"{name}.groups", MAX_CLAIM_GROUPS):
            if type(group) is not list or len(group) != 4:
                raise BadRequestError(
                    f"{name} groups must be [stream, format, block_ids, fills], got {_show(group)}"
                )
            ids = check_block_ids(group[2], f"{name}.block_ids")
            fills = group[3]
            if fills is not None:
                fills = check_list(fills, f"{name}.fills")
                for n_used in fills:
                    check_int(n_used, f"{name}.fills", 0, _INT64_MAX)
            n_ids += len(ids)
            groups.append(
                (check_tag(group[0], "stream"), check_tag(group[1], "format"), ids, fills)
            )
        parsed.append((owner, groups))
    if n_ids > MAX_ITEMS:
        raise BadRequestError(f"{name}: {n_ids} block ids in one claim; at most {MAX_ITEMS}")
    return parsed


def check_bytes_per_block(value: Any, name: str = "bytes_per_block") -> int | dict[str, int]:
    """Bytes one block holds in the worker (0..MAX_BYTES_PER_BLOCK): one int for every stream,
    or a map stream -> int."""
    if type(value) is int:
        return check_int(value, name, 0, MAX_BYTES_PER_BLOCK)
    if type(value) is not dict or len(value) > 8:
        raise BadRequestError(f"{name} must be an int or a map of <= 8 streams, got {_show(value)}")
    return {
        check_tag(k, f"{name} key"): check_int(v, f"{name}[{k}]", 0, MAX_BYTES_PER_BLOCK)
        for k, v in value.items()
    }


PROMPT_CACHE_COUNTERS = (
    "bytes",
    "blocks",
    "entries",
    "lookups",
    "hits",
    "tokens_reused",
    "tokens_prefilled",
    "evictions",
)
"""What a worker's load report may say of its prompt cache (``ping``'s ``prompt_cache``)."""


def check_prompt_cache(value: Any, name: str = "prompt_cache") -> dict[str, int]:
    """A worker's prompt-cache report: a map of names of PROMPT_CACHE_COUNTERS to ints >= 0
    (absent names read 0)."""
    if type(value) is not dict:
        raise BadRequestError(f"{name} must be a map, got {_show(value)}")
    unknown = sorted(str(k) for k in value.keys() - set(PROMPT_CACHE_COUNTERS))
    if unknown:
        raise BadRequestError(f"{name}: unknown counter(s) {unknown}")
    return {k: check_int(value.get(k, 0), f"{name}.{k}", 0) for k in PROMPT_CACHE_COUNTERS}


def _show(value: Any) -> str:
    """A short description of a bad value for an error message (never the whole payload)."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def session_label(sid: int) -> str:
    """How a session id is shown to people: hex, the same in the daemon's log, its error
    messages, vqpoolctl and the worker's ``/health`` (the wire carries the int)."""
    return f"{sid:x}"


# -- argument schemas ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Field:
    """One argument of an op: its name, its check, whether it is required, and its help."""

    name: str
    check: Callable[[Any, str], Any]
    required: bool = True
    default: Any = None
    help: str = ""


def parse_args(op: str, args: Any, schema: tuple[Field, ...]) -> dict[str, Any]:
    """``args`` checked against ``schema``: every required field present, no unknown field.

    Raises:
        BadRequestError: A missing, unknown or malformed argument.
    """
    if type(args) is not dict:
        raise BadRequestError(f"{op}: args must be a map, got {_show(args)}")
    parsed: dict[str, Any] = {}
    n_known = 0
    for field in schema:
        if field.name in args:
            parsed[field.name] = field.check(args[field.name], f"{op}.{field.name}")
            n_known += 1
        elif field.required:
            raise BadRequestError(f"{op}: missing argument {field.name!r}")
        else:
            parsed[field.name] = field.default
    if len(args) != n_known:
        unknown = sorted(str(k) for k in args.keys() - {f.name for f in schema})
        raise BadRequestError(f"{op}: unknown argument(s) {unknown}")
    return parsed


def _text(value: Any, name: str) -> str:
    return check_str(value, name)


def _stream(value: Any, name: str) -> str:
    return check_tag(value, name)


MAX_WAIT_SECONDS = 60.0
"""Longest an allocation may wait at the daemon for memory (``wait``)."""

MAX_RECLAIM_POLL_SECONDS = 30.0
"""Longest a ``reclaim_poll`` may wait at the daemon for an ask."""

MAX_RECLAIM_BYTES = 1 << 50
"""Largest byte count a ``reclaim_done`` may claim (the budget's own bound)."""

WAIT_FIELD = Field(
    "wait",
    lambda v, n: check_number(v, n, 0.0, MAX_WAIT_SECONDS),
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

WORKER_ARGS: dict[str, tuple[Field, ...]] = {
    HELLO: (
        Field("pid", lambda v, n: check_int(v, n, 1, 1 << 31), help="the worker's process id"),
        Field("model", _text, help="model name, for the admin's eyes"),
        Field(
            "nonce",
            _text,
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
        Field("client_version", _text, required=False, default=""),
        Field(
            "resumes",
            lambda v, n: check_int(v, n, 0),
            required=False,
            help="after a daemon restart: the session id this client held before it",
        ),
    ),
    GOODBYE: (),
    PING: (
        Field(
            "running",
            lambda v, n: check_int(v, n, 0, MAX_LOAD),
            required=False,
            help="requests the worker is running now",
        ),
        Field(
            "queued",
            lambda v, n: check_int(v, n, 0, MAX_LOAD),
            required=False,
            help="requests waiting in the worker's queue now",
        ),
        Field(
            "preemptions",
            lambda v, n: check_int(v, n, 0, MAX_LOAD),
            required=False,
            help="requests the worker preempted since its session opened (a running count)",
        ),
        Field(
            "prompt_cache",
            check_prompt_cache,
            required=False,
            help="what the worker's prompt cache holds and did (PROMPT_CACHE_COUNTERS)",
        ),
    ),
    ALLOCATE: (
        Field("stream", _stream),
        Field("n_tokens", check_int),
        Field("owner", check_owner),
        Field("format", check_tag, required=False, default="fp16"),
        WAIT_FIELD,
        GROWTH_FIELD,
    ),
    ALLOCATE_MANY: (Field("items", check_allocations), WAIT_FIELD, GROWTH_FIELD),
    FREE: (Field("block_ids", check_block_ids),),
    FREE_ALL: (Field("owner", check_owner),),
    REGISTER_OWNER: (Field("owner", check_owner),),
    RELEASE_OWNER: (Field("owner", check_owner),),
    BLOCKS_FOR: (Field("owner", check_owner),),
    N_FREE: (Field("stream", _stream, required=False, default="k"),),
    MARK_USED: (Field("updates", check_updates),),
    CLAIM: (
        Field("owners", check_claims, help="what this worker holds: owners and their blocks"),
        Field(
            "done",
            check_bool,
            required=False,
            default=True,
            help="last claim of this re-sync (ends the claim period early once all are done)",
        ),
    ),
    STATS: (),
    HISTORY: (),
    METRICS: (),
    RECLAIM_POLL: (
        Field(
            "wait",
            lambda v, n: check_number(v, n, 0.0, MAX_RECLAIM_POLL_SECONDS),
            help="seconds to wait at the daemon for an ask to give bytes back",
        ),
    ),
    RECLAIM_DONE: (
        Field("ask", lambda v, n: check_int(v, n, 1), help="the ask's id, from reclaim_poll"),
        Field(
            "freed",
            lambda v, n: check_int(v, n, 0, MAX_RECLAIM_BYTES),
            help="bytes the worker freed for it (the daemon's ledger decides what counts)",
        ),
    ),
    FIT: (
        Field("context", lambda v, n: check_int(v, n, 1), help="tokens of one sequence"),
        Field(
            "concurrency",
            lambda v, n: check_int(v, n, 1, MAX_ITEMS),
            required=False,
            default=1,
            help="sequences of that size at once",
        ),
    ),
}


# -- envelope --------------------------------------------------------------------------------------


@dataclass(slots=True)
class Request:
    """A request whose envelope is valid (its args are checked by the op's schema later)."""

    id: int
    op: str
    sid: int | None
    boot: str | None
    args: Any


_ENVELOPE_KEYS = frozenset({"v", "id", "op", "sid", "boot", "args"})


def decode_request(payload: bytes) -> Any:
    """The msgpack object in ``payload``, decoded within the request limits.

    Raises:
        BadRequestError: Not msgpack, truncated, trailing bytes, or over a limit.
    """
    try:
        return msgpack.unpackb(payload, **_UNPACK_LIMITS)
    except Exception as exc:  # unpackb raises ValueError, TypeError, UnpackException, ...
        raise BadRequestError(f"request is not valid msgpack within limits ({exc})") from None


def request_id_of(message: Any) -> int | None:
    """The request id of a decoded message, if it has a usable one (for the error reply)."""
    if type(message) is dict:
        rid = message.get("id")
        if type(rid) is int and 0 <= rid <= _INT64_MAX:
            return rid
    return None


def parse_envelope(message: Any) -> Request:
    """The envelope of a decoded request, checked.

    Raises:
        BadRequestError: The envelope is malformed.
        UnsupportedVersionError: The request speaks another protocol version.
    """
    if type(message) is not dict:
        raise BadRequestError(f"a request must be a map, got {type(message).__name__}")
    if not message.keys() <= _ENVELOPE_KEYS:
        unknown = sorted(str(k) for k in message.keys() - _ENVELOPE_KEYS)
        raise BadRequestError(f"unknown envelope field(s) {unknown}")
    version = message.get("v")
    if version != PROTOCOL_VERSION or type(version) is not int:
        raise UnsupportedVersionError(
            f"protocol version {_show(version)} is not spoken here; this daemon speaks "
            f"{PROTOCOL_VERSION}"
        )
    rid = check_int(message.get("id"), "id", 0)
    op = check_tag(message.get("op"), "op")
    sid = message.get("sid")
    if sid is not None:
        check_int(sid, "sid")
    boot = message.get("boot")
    if boot is not None:
        check_str(boot, "boot")
    return Request(rid, op, sid, boot, message.get("args", {}))


def encode_request(
    rid: int, op: str, args: Mapping[str, Any], sid: int | None = None, boot: str | None = None
) -> bytes:
    """A request frame (the client side of :func:`parse_envelope`)."""
    message: dict[str, Any] = {"v": PROTOCOL_VERSION, "id": rid, "op": op, "args": args}
    if sid is not None:
        message["sid"] = sid
    if boot is not None:
        message["boot"] = boot
    payload: bytes = msgpack.packb(message)
    return payload


def encode_result(rid: int | None, boot: str, result: Any) -> bytes:
    """A success reply frame."""
    payload: bytes = msgpack.packb({"id": rid, "boot": boot, "ok": True, "result": result})
    return payload


def compact_message(message: str) -> str:
    """``message`` cut to MAX_ERROR_MESSAGE_LEN characters."""
    if len(message) <= MAX_ERROR_MESSAGE_LEN:
        return message
    return f"{message[: MAX_ERROR_MESSAGE_LEN - 3]}..."


class ItemErrors:
    """The per-item errors of one reply (``allocate_many`` items, ``claim`` owners), compact.

    Each error is ``{code, message}``. An error equal to an earlier item's is sent as
    ``{code, message: "as item <i>", same_as: <i>}``: 4,096 items refused for one reason carry
    its message once, not 4,096 times. :func:`item_message` reads either form.
    """

    def __init__(self) -> None:
        self._first: dict[tuple[int, str], int] = {}

    def entry(self, index: int, exc: BaseException) -> dict[str, Any]:
        """The wire form of ``exc``, raised for item ``index``."""
        code = int(error_code_for(exc))
        message = compact_message(str(exc))
        first = self._first.setdefault((code, message), index)
        if first == index:
            return {"code": code, "message": message}
        return {"code": code, "message": f"as item {first}", "same_as": first}


def item_message(results: Sequence[Any], error: Mapping[str, Any]) -> str:
    """The message of a per-item ``error`` of ``results``, following ``same_as``."""
    first = error.get("same_as")
    message: str = error["message"] if first is None else results[first]["message"]
    return message


def encode_error(rid: int | None, boot: str, code: int, message: str) -> bytes:
    """An error reply frame (the message cut to MAX_ERROR_MESSAGE_LEN characters)."""
    error = {"code": int(code), "message": compact_message(message)}
    payload: bytes = msgpack.packb({"id": rid, "boot": boot, "ok": False, "error": error})
    return payload


def decode_reply(payload: bytes) -> dict[str, Any]:
    """A reply frame, decoded (the daemon is trusted for shape, not for size).

    Raises:
        BadRequestError: The frame is not a reply map.
    """
    try:
        reply = msgpack.unpackb(payload, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:
        raise BadRequestError(f"reply is not valid msgpack ({exc})") from None
    if type(reply) is not dict or "ok" not in reply:
        raise BadRequestError(f"reply is not a reply map: {_show(reply)}")
    return reply


# -- payload shapes shared by both ends ------------------------------------------------------------

_STATS_FIELDS = (
    "n_blocks",
    "n_allocations",
    "n_frees",
    "n_reused",
    "n_exhausted",
    "n_grown",
    "n_retired",
    "peak_blocks_in_use",
    "fragmented_count",
)


def stats_to_wire(stats: AllocationStats) -> dict[str, int]:
    """An AllocationStats as a map (``fragmented_count`` is the seed's private counter)."""
    return {
        "n_blocks": stats.n_blocks,
        "n_allocations": stats.n_allocations,
        "n_frees": stats.n_frees,
        "n_reused": stats.n_reused,
        "n_exhausted": stats.n_exhausted,
        "n_grown": stats.n_grown,
        "n_retired": stats.n_retired,
        "peak_blocks_in_use": stats.peak_blocks_in_use,
        "fragmented_count": stats._fragmented_count,
    }


def stats_from_wire(data: Mapping[str, int]) -> AllocationStats:
    """The AllocationStats a :func:`stats_to_wire` map describes."""
    return AllocationStats(*(data[name] for name in _STATS_FIELDS))


def config_to_wire(config: PoolConfig) -> dict[str, Any]:
    """A PoolConfig as a map."""
    return {
        "block_size": config.block_size,
        "n_blocks": config.n_blocks,
        "separate_kv": config.separate_kv,
        "grow_on_exhaustion": config.grow_on_exhaustion,
        "max_blocks": config.max_blocks,
    }


def config_from_wire(data: Mapping[str, Any]) -> PoolConfig:
    """The PoolConfig a :func:`config_to_wire` map describes."""
    return PoolConfig(
        block_size=data["block_size"],
        n_blocks=data["n_blocks"],
        separate_kv=data["separate_kv"],
        grow_on_exhaustion=data["grow_on_exhaustion"],
        max_blocks=data["max_blocks"],
    )


def block_rows(blocks: Iterable[Block]) -> list[list[Any]]:
    """Blocks as ``[block_id, stream, format, n_used]`` rows (the owner is implied)."""
    return [[b.block_id, b.stream, b.format, b.n_used] for b in blocks]
