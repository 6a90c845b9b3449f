"""Named exception types. Each carries what the client (or operator) should be told."""

from __future__ import annotations


class KVRouteError(Exception):
    """Base class for every error kvroute raises on purpose."""


class ConfigError(KVRouteError):
    """The configuration is invalid; the message names the offending field."""


class StartupError(KVRouteError):
    """kvroute cannot start serving (a port it must listen on is taken, or cannot be bound)."""


class RequestError(KVRouteError):
    """The client request cannot be routed; becomes an OpenAI-shaped ImmediateResponse."""

    status: int = 400
    error_type: str = "invalid_request_error"
    kind: str = "bad_request"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class MalformedBody(RequestError):
    kind = "malformed_body"


class MalformedHeader(RequestError):
    kind = "malformed_header"


class BodyTooLarge(RequestError):
    status = 413
    kind = "body_too_large"

    @classmethod
    def over(cls, limit: int) -> BodyTooLarge:
        return cls(f"request body exceeds the limit of {limit} bytes")


class BodyAlreadySent(RequestError):
    """kvroute must change the body (tenancy's cache_salt) but Envoy's body mode passed it on already."""

    status = 500
    error_type = "server_error"
    kind = "body_already_sent"


class UnknownModel(RequestError):
    status = 404
    error_type = "not_found_error"
    kind = "unknown_model"


class NoEndpoint(RequestError):
    status = 503
    error_type = "service_unavailable"
    kind = "no_endpoint"


class Shed(RequestError):
    status = 429
    error_type = "rate_limit_error"
    kind = "shed"
