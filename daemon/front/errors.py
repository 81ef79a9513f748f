"""The front door's own refusals: 503 with ``Retry-After`` and 502 naming a worker's failure, in
the workers' error shape (:class:`~vqpool.shared.api_error.ApiError`)."""

from __future__ import annotations

from vqpool.shared.api_error import ApiError


def overloaded(message: str, retry_after: float = 1.0) -> ApiError:
    """A 503 with ``Retry-After`` (whole seconds, at least 1)."""
    seconds = str(max(1, round(retry_after)))
    return ApiError(503, message, kind="overloaded", headers={"Retry-After": seconds})


def bad_gateway(message: str, retry_after: float | None = None) -> ApiError:
    """A 502: the model's worker failed to load or exited."""
    headers = {} if retry_after is None else {"Retry-After": str(max(1, round(retry_after)))}
    return ApiError(502, message, kind="bad_gateway", headers=headers)


def bad_request(message: str) -> ApiError:
    """A 400: what was asked can never be done as things are configured (a model too large for
    the budget)."""
    return ApiError(400, message)
