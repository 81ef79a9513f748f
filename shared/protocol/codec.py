"""Protocol v1 on the wire: the request envelope and the reply frames, in msgpack.

Every message is one msgpack map in one ZeroMQ frame (docs/protocol.md has the full text).

Request::

    {"v": 1, "id": <int>, "op": <str>, "sid": <int>, "boot": <str>, "args": {...}}

``sid`` (the session id from ``hello``) and ``boot`` (the daemon boot id from ``hello``) are
required on every worker op except ``hello``; admin requests carry neither.

Reply::

    {"id": <same int>, "boot": <daemon boot id>, "ok": true, "result": ...}
    {"id": <same int or nil>, "boot": <daemon boot id>, "ok": false,
     "error": {"code": <ErrorCode>, "message": <str>}}

A request is decoded within the limits of :mod:`vqpool.shared.protocol.limits`; its args are
checked against its op's declaration later (:func:`vqpool.shared.protocol.ops.parse_args`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import msgpack
from vqpool.shared.errors import BadRequestError, UnsupportedVersionError, error_code_for
from vqpool.shared.protocol.checks import check_int, check_str, check_tag, short_repr
from vqpool.shared.protocol.limits import (
    INT64_MAX,
    INT64_MIN,
    MAX_ERROR_MESSAGE_LEN,
    MAX_ITEMS,
    MAX_MAP_LEN,
    MAX_TAG_LEN,
    MAX_TEXT_LEN,
)

PROTOCOL_VERSION = 1

_UNPACK_LIMITS: dict[str, Any] = {
    "raw": False,
    "strict_map_key": True,
    "use_list": True,
    "max_str_len": 4 * MAX_TEXT_LEN,
    "max_bin_len": 0,
    "max_ext_len": 0,
    "max_array_len": MAX_ITEMS,
    "max_map_len": MAX_MAP_LEN,
}


class Request(NamedTuple):
    """A request whose envelope is valid (its args are checked by the op's schema later).

    A named tuple, made by parse_envelope with ``tuple.__new__`` (in C: a dataclass's
    ``__init__`` is one more Python call per request)."""

    id: int
    op: str
    sid: int | None
    boot: str | None
    args: Any


_new_tuple = tuple.__new__

_ENVELOPE_KEYS = frozenset({"v", "id", "op", "sid", "boot", "args"})
_is_envelope_key_set = _ENVELOPE_KEYS.issuperset
"""Whether a map's keys are all envelope fields (cheaper than comparing its keys view)."""


def decode_request(payload: bytes) -> Any:
    """The msgpack object in ``payload``, decoded within the request limits.

    Raises:
        BadRequestError: Not msgpack, truncated, trailing bytes, or over a limit.
    """
    try:
        return msgpack.unpackb(payload, **_UNPACK_LIMITS)
    except Exception as exc:  # unpackb raises ValueError, TypeError, UnpackException, ...
        raise BadRequestError(f"request is not valid msgpack within limits ({exc})") from None


class SocketCodec:
    """:func:`decode_request` and :func:`encode_result` for one server socket, cheaper per
    message: one ``Unpacker`` and one ``Packer`` kept for the socket's life instead of made per
    call, and the part of a reply that is the same for every reply of one daemon lifetime
    (``boot``, ``ok``) packed once. Same objects in, same bytes out, same errors as those
    functions. Not thread-safe: one per socket, used by the thread serving it.
    """

    def __init__(self, boot: str) -> None:
        self._unpacker = msgpack.Unpacker(**_UNPACK_LIMITS)
        self._consumed = 0  # bytes the unpacker has read so far (its tell())
        self._pack = msgpack.Packer().pack
        self._boot = boot
        # A reply map, as packb writes {"id": .., "boot": boot, "ok": True, "result": ..}:
        # header and first key, then (after the id) everything up to the result's value.
        self._head = b"\x84" + self._pack("id")
        self._middle = self._pack("boot") + self._pack(boot) + self._pack("ok") + self._pack(True)
        self._middle += self._pack("result")

    def decode(self, payload: bytes) -> Any:
        """:func:`decode_request` of ``payload``."""
        unpacker = self._unpacker
        expected = self._consumed + len(payload)
        try:
            unpacker.feed(payload)
            message = unpacker.unpack()
            if unpacker.tell() == expected:  # exactly one object, nothing after it
                self._consumed = expected
                return message
        except Exception:  # told apart below, by the function itself
            pass
        # Bad input (or more than one object): start afresh, and let decode_request() say what
        # is wrong exactly as it always has.
        self._unpacker = msgpack.Unpacker(**_UNPACK_LIMITS)
        self._consumed = 0
        return decode_request(payload)

    def result(self, rid: int | None, boot: str, result: Any) -> bytes:
        """:func:`encode_result` of ``rid``, ``boot`` and ``result``."""
        if boot != self._boot:
            return encode_result(rid, boot, result)
        pack = self._pack
        return b"".join((self._head, pack(rid), self._middle, pack(result)))


def request_id_of(message: Any) -> int | None:
    """The request id of a decoded message, if it has a usable one (for the error reply)."""
    if type(message) is dict:
        rid = message.get("id")
        if type(rid) is int and 0 <= rid <= INT64_MAX:
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
    if not _is_envelope_key_set(message):
        unknown = sorted(str(k) for k in message.keys() - _ENVELOPE_KEYS)
        raise BadRequestError(f"unknown envelope field(s) {unknown}")
    get = message.get
    version = get("v")
    if version != PROTOCOL_VERSION or type(version) is not int:
        raise UnsupportedVersionError(
            f"protocol version {short_repr(version)} is not spoken here; this daemon speaks "
            f"{PROTOCOL_VERSION}"
        )
    # Each field's check inlined (every request passes here): the check itself is called only
    # to raise its error.
    rid: Any = get("id")
    if type(rid) is not int or not 0 <= rid <= INT64_MAX:
        check_int(rid, "id", 0)
    op: Any = get("op")
    if type(op) is not str or not 0 < len(op) <= MAX_TAG_LEN:
        check_tag(op, "op")
    sid = get("sid")
    if sid is not None and (type(sid) is not int or not INT64_MIN <= sid <= INT64_MAX):
        check_int(sid, "sid")
    boot = get("boot")
    if boot is not None and (type(boot) is not str or len(boot) > MAX_TEXT_LEN):
        check_str(boot, "boot")
    return _new_tuple(Request, (rid, op, sid, boot, get("args", {})))


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
        raise BadRequestError(f"reply is not a reply map: {short_repr(reply)}")
    return reply
