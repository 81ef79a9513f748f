"""The one shape of an HTTP refusal, for the workers and the front door alike: OpenAI's
``{"error": {"message", "type", "param", "code"}}``, so a client sees one kind of error whoever
answered."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class ApiError(Exception):
    """A request the API refuses: HTTP ``status`` with an OpenAI-style JSON error body."""

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
