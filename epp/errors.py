"""Errors that end a request with an HTTP reply from the EPP itself.

Each carries its status code and renders an OpenAI-style JSON body (the shape vLLM uses),
so clients see the same error format whether the gateway or the engine refused them.
"""

from __future__ import annotations

import json
from typing import ClassVar

DROPPED_REASON_HEADER = "x-llm-d-request-dropped-reason"


class RequestError(Exception):
    status: ClassVar[int] = 500
    error_type: ClassVar[str] = "InternalServerError"
    dropped_reason: ClassVar[str | None] = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> bytes:
        error = {"message": self.message, "type": self.error_type, "param": self.param, "code": self.status}
        return json.dumps({"error": error}).encode()

    def headers(self) -> dict[str, str]:
        headers = {"content-type": "application/json"}
        if self.dropped_reason:
            headers[DROPPED_REASON_HEADER] = self.dropped_reason
        return headers


class BadRequest(RequestError):
    status = 400
    error_type = "BadRequestError"


class PayloadTooLarge(RequestError):
    status = 413
    error_type = "PayloadTooLargeError"


class NoEndpointAvailable(RequestError):
    status = 503
    error_type = "ServiceUnavailableError"
    dropped_reason = "rejected-no-endpoints"


class RequestShed(RequestError):
    """A sheddable request refused because no endpoint can serve it in its SLO; retry later."""

    status = 429
    error_type = "TooManyRequestsError"
    dropped_reason = "rejected-saturated"

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {**super().headers(), "retry-after": str(self.retry_after_s)}
