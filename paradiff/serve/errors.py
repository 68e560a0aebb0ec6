"""The errors the server answers, in OpenAI's envelope: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

#: OpenAI's error ``type`` and a ``code`` per HTTP status the server answers.
KINDS = {
    400: ("invalid_request_error", "invalid_request"),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    500: ("server_error", "internal_error"),
    503: ("server_error", "service_unavailable"),
    504: ("server_error", "timeout"),
}


class ApiError(Exception):
    """A reply other than success: its HTTP status, message, the request field at fault and extra headers."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}

    def body(self) -> dict:
        kind, code = KINDS.get(self.status, ("server_error", "error"))
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": code}}
