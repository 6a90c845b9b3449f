"""extproc/app.py Health: the statuses its HTTP/2 Check (extproc/h2.py's port) answers, as grpcio's Check does."""

import grpc
from grpc_health.v1 import health_pb2

from extproc.app import HEALTH_SERVICES, Health
from extproc.h2 import INVALID_ARGUMENT, NOT_FOUND, OK

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class _Aborted(Exception):
    pass


class _Context:
    """What grpcio's Check uses of its context."""

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise _Aborted(code)


def _h2(health: Health, service: str) -> tuple[int, int | None]:
    code, data, _ = health.check(health_pb2.HealthCheckRequest(service=service).SerializeToString())
    return code, health_pb2.HealthCheckResponse.FromString(data).status if data is not None else None


async def _grpc(health: Health, service: str) -> tuple[int, int | None]:
    try:
        got = await health.Check(health_pb2.HealthCheckRequest(service=service), _Context())
    except _Aborted:
        return NOT_FOUND, None
    return OK, got.status


async def test_h2_check_answers_what_grpcios_check_does_through_set_and_shutdown():
    health = Health()
    for service in ("", "readiness", "nope"):
        assert _h2(health, service) == await _grpc(health, service)
    assert _h2(health, "") == (OK, SERVING) and _h2(health, "readiness") == (NOT_FOUND, None)
    for service in HEALTH_SERVICES:
        await health.set(service, NOT_SERVING)
    await health.set("readiness", SERVING)
    for service in (*HEALTH_SERVICES, "nope"):
        assert _h2(health, service) == await _grpc(health, service)
    assert _h2(health, "readiness") == (OK, SERVING) and _h2(health, "liveness") == (OK, NOT_SERVING)
    await health.enter_graceful_shutdown()
    await health.set("readiness", SERVING)  # ignored once shutting down, as grpcio ignores it
    for service in (*HEALTH_SERVICES, "nope"):
        assert _h2(health, service) == await _grpc(health, service)
    assert {_h2(health, s)[1] for s in HEALTH_SERVICES} == {NOT_SERVING}


def test_a_request_that_is_not_a_health_check_is_refused():
    code, data, message = Health().check(b"\xff\xff\xff")
    assert (code, data) == (INVALID_ARGUMENT, None) and message
