"""From a handler's outcome to a reply frame: the one place error types become wire codes.

Handlers raise the same exceptions the local allocator raises (``ValueError``,
``BlockPoolExhaustedError``, ``OwnerAlreadyActiveError``) or the wire's own
(:mod:`vqpool.shared.errors`); :func:`error_reply` maps each to its numbered code. Anything else
is a daemon bug: it is logged with its traceback and answered as INTERNAL.
"""

from __future__ import annotations

import logging

from vqpool.shared.errors import ErrorCode, error_code_for
from vqpool.shared.protocol import encode_error

log = logging.getLogger("vqpoold")


def error_reply(rid: int | None, boot: str, exc: BaseException) -> bytes:
    """The error reply frame for ``exc`` raised while handling request ``rid``."""
    code = error_code_for(exc)
    if code == ErrorCode.INTERNAL:
        log.error("internal error handling request %s", rid, exc_info=exc)
    return encode_error(rid, boot, code, str(exc) or type(exc).__name__)
