"""The front door's refusals, in the workers' error shape (OpenAI's ``{"error": {...}}``) so a
client sees one kind of error whoever answered."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class FrontError(Exception):
    """A request the front door answers itself: HTTP ``status`` and a JSON error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.status,
            }
        }


def overloaded(message: str, retry_after: float = 1.0) -> FrontError:
    """A 503 with ``Retry-After`` (whole seconds, at least 1)."""
    seconds = str(max(1, round(retry_after)))
    return FrontError(503, message, kind="overloaded", headers={"Retry-After": seconds})


def bad_gateway(message: str, retry_after: float | None = None) -> FrontError:
    """A 502: the model's worker failed to load or exited."""
    headers = {} if retry_after is None else {"Retry-After": str(max(1, round(retry_after)))}
    return FrontError(502, message, kind="bad_gateway", headers=headers)
