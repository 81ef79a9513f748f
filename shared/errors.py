"""Every error vqpool raises, and the numbered codes that carry them over the wire.

The local allocator and the remote client raise the same classes, so code written against one
runs unchanged against the other. Each class has one numbered, named code (as in supervisor's
faults): the daemon's dispatcher turns an exception into ``{code, message}`` with
:func:`error_code_for`, and the client turns it back with :func:`error_from_wire`.
"""

from __future__ import annotations

from enum import IntEnum


class ErrorCode(IntEnum):
    """Wire error codes. Numbers are part of protocol v1: never renumber, only append."""

    BAD_REQUEST = 1
    UNKNOWN_OP = 2
    UNSUPPORTED_VERSION = 3
    INVALID_VALUE = 10
    POOL_EXHAUSTED = 20
    OWNER_ALREADY_ACTIVE = 21
    NOT_OWNER = 22
    OVER_BUDGET = 24
    CANCELLED = 25
    NO_SESSION = 30
    UNAUTHORIZED = 31
    DAEMON_RESTARTED = 32
    RETRY_LATER = 33
    CLAIM_CONFLICT = 34
    TOO_MANY_SESSIONS = 35
    INTERNAL = 99


class VqpoolError(Exception):
    """Base of vqpool's own errors (``ValueError`` is used as-is for bad arguments)."""

    code: ErrorCode = ErrorCode.INTERNAL


class BlockPoolExhaustedError(VqpoolError):
    """Not enough free blocks (and no room to grow) for an allocation; nothing was allocated."""

    code = ErrorCode.POOL_EXHAUSTED


class OwnerAlreadyActiveError(VqpoolError):
    """The owner id is already active (in this pool, or held by another worker session)."""

    code = ErrorCode.OWNER_ALREADY_ACTIVE


class NotOwnerError(VqpoolError):
    """The caller's session does not hold the owner or block it named; nothing was changed."""

    code = ErrorCode.NOT_OWNER


class OverBudgetError(VqpoolError, ValueError):
    """An allocation that can never fit the memory budget (over its model's limit, or over the
    budget minus the other models' reserves); nothing was allocated. A ``ValueError`` too: the
    request asks for something impossible, not for something scarce right now."""

    code = ErrorCode.OVER_BUDGET


class RequestCancelledError(VqpoolError):
    """A waiting allocation its own session cancelled (the ``cancel`` worker op) before it was
    granted; nothing was allocated."""

    code = ErrorCode.CANCELLED


class BadRequestError(VqpoolError):
    """A request that does not match the protocol schema; nothing was changed."""

    code = ErrorCode.BAD_REQUEST


class UnknownOpError(BadRequestError):
    """A request naming an op this daemon does not have."""

    code = ErrorCode.UNKNOWN_OP


class UnsupportedVersionError(BadRequestError):
    """A request speaking a protocol version this daemon does not speak."""

    code = ErrorCode.UNSUPPORTED_VERSION


class NoSessionError(VqpoolError):
    """A request from a peer that has not said ``hello`` (or whose session was ended)."""

    code = ErrorCode.NO_SESSION


class UnauthorizedError(VqpoolError):
    """An op this socket or peer may not use (e.g. an admin op on the worker socket)."""

    code = ErrorCode.UNAUTHORIZED


class DaemonRestartedError(VqpoolError):
    """The daemon restarted since this client's session began; its blocks are not the same."""

    code = ErrorCode.DAEMON_RESTARTED


class RetryLaterError(VqpoolError):
    """The daemon cannot serve this now (e.g. a restart's claim period); retrying will work."""

    code = ErrorCode.RETRY_LATER


class ClaimConflictError(VqpoolError):
    """A block claimed after a daemon restart is already claimed by another owner or unknown."""

    code = ErrorCode.CLAIM_CONFLICT


class TooManySessionsError(VqpoolError):
    """A hello refused: the process, or the daemon as a whole, has as many sessions as allowed."""

    code = ErrorCode.TOO_MANY_SESSIONS


class DaemonUnavailableError(VqpoolError):
    """The daemon did not answer in time. Raised by the client only, never sent on the wire."""


class InternalError(VqpoolError):
    """A daemon bug; the request was not applied."""

    code = ErrorCode.INTERNAL


_CLASS_FOR_CODE: dict[int, type[Exception]] = {
    ErrorCode.BAD_REQUEST: BadRequestError,
    ErrorCode.UNKNOWN_OP: UnknownOpError,
    ErrorCode.UNSUPPORTED_VERSION: UnsupportedVersionError,
    ErrorCode.INVALID_VALUE: ValueError,
    ErrorCode.POOL_EXHAUSTED: BlockPoolExhaustedError,
    ErrorCode.OWNER_ALREADY_ACTIVE: OwnerAlreadyActiveError,
    ErrorCode.NOT_OWNER: NotOwnerError,
    ErrorCode.OVER_BUDGET: OverBudgetError,
    ErrorCode.CANCELLED: RequestCancelledError,
    ErrorCode.NO_SESSION: NoSessionError,
    ErrorCode.UNAUTHORIZED: UnauthorizedError,
    ErrorCode.DAEMON_RESTARTED: DaemonRestartedError,
    ErrorCode.RETRY_LATER: RetryLaterError,
    ErrorCode.CLAIM_CONFLICT: ClaimConflictError,
    ErrorCode.TOO_MANY_SESSIONS: TooManySessionsError,
    ErrorCode.INTERNAL: InternalError,
}


def error_code_for(exc: BaseException) -> ErrorCode:
    """The wire code for an exception raised while handling a request."""
    if isinstance(exc, VqpoolError):
        return exc.code
    if isinstance(exc, ValueError):
        return ErrorCode.INVALID_VALUE
    return ErrorCode.INTERNAL


def error_from_wire(code: int, message: str) -> Exception:
    """The exception a client raises for an error reply (unknown codes become InternalError)."""
    cls = _CLASS_FOR_CODE.get(code, InternalError)
    return cls(message)
