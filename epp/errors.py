"""Errors that end a request with an HTTP reply from the EPP itself.

Each carries its status code and renders an OpenAI-style JSON body (the shape vLLM uses),
so clients see the same error format whether the gateway or the engine refused them.
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Sequence
from typing import Any, ClassVar

from epp.vllm_wording import VALIDATION_ERROR_TYPE, validation_error_text

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

    def log_message(self) -> str:
        """What the EPP's log line says about this error (never the prompt)."""
        return self.message[:300]

    def headers(self) -> dict[str, str]:
        headers = {"content-type": "application/json"}
        if self.dropped_reason:
            headers[DROPPED_REASON_HEADER] = self.dropped_reason
        return headers


class BadRequest(RequestError):
    status = 400
    error_type = "BadRequestError"


class InvalidBody(BadRequest):
    """A body that fails validation of its JSON or its fields' types, in vLLM's words: the
    errors (pydantic's, ``loc`` starting with ``"body"``) listed in the message."""

    error_type = VALIDATION_ERROR_TYPE

    def __init__(self, errors: Sequence[dict[str, Any]]) -> None:
        message, param = validation_error_text(errors)
        super().__init__(message, param=param)


class PayloadTooLarge(RequestError):
    status = 413
    error_type = "PayloadTooLargeError"


class HeadersTooLarge(RequestError):
    status = 431
    error_type = "RequestHeaderFieldsTooLargeError"


class InternalServerError(RequestError):
    """A bug in the EPP, not the client's doing: the request is answered, the EPP stays up.
    The client is told no more than that; the log line names the exception and where it rose."""

    status = 500
    error_type = "InternalServerError"

    def __init__(self, cause: Exception) -> None:
        super().__init__("internal error in the endpoint picker")
        self.cause = cause

    def log_message(self) -> str:
        where = traceback.extract_tb(self.cause.__traceback__)[-1]
        return (
            f"{self.message}: {type(self.cause).__name__}: {str(self.cause)[:300]} "
            f"(at {where.filename}:{where.lineno} in {where.name})"
        )


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
