"""tenancy.cache_salt: a per-tenant salt (HMAC of the tenant with a server-side secret) in every
inference request's body, a client's own salt kept, replaced or refused, and the secret never shown."""

from __future__ import annotations

import hashlib
import hmac
import logging

import orjson
import pytest
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm

from extproc.config import build_config
from extproc.errors import ConfigError
from extproc.keys import route_keys
from extproc.observability import Metrics
from extproc.reload import requires_restart
from extproc.router import Router
from extproc.server import ExternalProcessor
from extproc.tenancy import TenantSalter
from tests.unit.test_server_stream import PODS, body_msgs, chat, headers_msg, run, set_headers

SECRET = "s3cret-for-tests-0123456789"
ENV = "KVROUTE_CACHE_SALT_SECRET"


def config(tenancy=None, **extra):
    return build_config(
        {"pools": {"p": {"endpoints": [{"address": a} for a in PODS]}}, "tenancy": tenancy or {}, **extra}
    )


@pytest.fixture
def secret(monkeypatch):
    monkeypatch.setenv(ENV, SECRET)
    return SECRET


def make(tenancy):
    router = Router(config(tenancy), Metrics())
    return ExternalProcessor(router), router


def expected_salt(tenant: str, secret: str = SECRET) -> str:
    return hmac.new(secret.encode(), b"kvroute cache_salt v1\x1f" + tenant.encode(), hashlib.sha256).hexdigest()


def sent_body(out) -> dict:
    """The body the pod gets: kvroute's replacement (BUFFERED body answer)."""
    mut = out[-1].request_body.response.body_mutation
    assert mut.HasField("body"), "kvroute sent no body mutation"
    return orjson.loads(mut.body)


def test_inject_needs_a_secret_and_never_shows_it(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(ConfigError, match=f"tenancy: cache_salt inject: environment variable {ENV} must hold"):
        config({"cache_salt": "inject"})
    monkeypatch.setenv(ENV, "short")
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        config({"cache_salt": "inject"})
    with pytest.raises(ConfigError, match="secret_file: cannot read"):
        config({"cache_salt": "inject", "secret_file": str(tmp_path / "absent")})
    (tmp_path / "salt").write_text(SECRET + "\n")  # a mounted Secret's trailing newline is not part of it
    cfg = config({"cache_salt": "inject", "secret_file": str(tmp_path / "salt")})
    salter = TenantSalter(cfg.tenancy)
    assert salter.salt("acme") == expected_salt("acme")
    assert SECRET not in repr(salter) + cfg.model_dump_json() + repr(cfg)
    assert requires_restart("tenancy.cache_salt") and requires_restart("tenancy.secret_env")


def test_salt_is_per_tenant_and_per_secret(secret, monkeypatch):
    cfg = config({"cache_salt": "inject"}).tenancy
    a = TenantSalter(cfg)
    assert a.salt("t1") == a.salt("t1") == expected_salt("t1")
    assert a.salt("t1") != a.salt("t2")
    monkeypatch.setenv(ENV, "another-secret-0123456789")
    assert TenantSalter(cfg).salt("t1") != a.salt("t1")  # unguessable without the secret


@pytest.mark.parametrize("mode", ["buffered", "streamed", "full-duplex"])
async def test_each_tenant_salt_reaches_the_pod_in_every_body_mode(secret, mode):
    proc, router = make({"cache_salt": "inject"})
    raw = chat(stream=True)
    hdrs = {"x-tenant-id": "acme", "content-length": str(len(raw))}
    kw = {
        "buffered": {},
        "streamed": {"no_wait": True},
        "full-duplex": {"mode": pm.ProcessingMode.FULL_DUPLEX_STREAMED},
    }
    cuts = () if mode == "buffered" else (7,)  # BUFFERED: the whole body in one message
    out = await run(proc, [headers_msg(extra=hdrs, **kw[mode]), *body_msgs(raw, cuts=cuts)])
    if mode == "buffered":
        common = out[-1].request_body.response
        body = sent_body(out)
    elif mode == "streamed":  # the replacement rides on the first held chunk's answer, the rest is emptied
        common = out[0].request_headers.response
        body = orjson.loads(out[1].request_body.response.body_mutation.body)
        assert out[2].request_body.response.body_mutation.clear_body
    else:
        common = out[0].request_headers.response
        body = orjson.loads(b"".join(r.request_body.response.body_mutation.streamed_response.body for r in out[1:]))
    assert body == {**orjson.loads(raw), "cache_salt": expected_salt("acme")}
    hs = set_headers(common)
    assert hs["content-length"] == str(len(orjson.dumps(body))) and hs["x-gateway-destination-endpoint"] in PODS
    assert all(e.inflight == 0 for e in router.registry.by_address.values())


async def test_requests_without_a_tenant_share_the_default_tenants_salt(secret):
    proc, _ = make({"cache_salt": "inject"})
    out = await run(proc, [headers_msg(), *body_msgs(chat())])
    assert sent_body(out)["cache_salt"] == expected_salt("default")
    # Not an inference request: its body is nobody's prompt and goes on untouched.
    out = await run(proc, [headers_msg(path="/v1/embeddings"), *body_msgs(chat())])
    assert not out[-1].request_body.response.HasField("body_mutation")


@pytest.mark.parametrize(
    "policy,sent,status", [("keep", "mine", None), ("replace", expected_salt("acme"), None), ("refuse", None, 400)]
)
async def test_client_cache_salt_policy(secret, policy, sent, status):
    proc, _ = make({"cache_salt": "inject", "client_cache_salt": policy})
    out = await run(proc, [headers_msg(extra={"x-tenant-id": "acme"}), *body_msgs(chat(cache_salt="mine"))])
    if status is not None:
        imm = out[-1].immediate_response
        assert imm.status.code == status and orjson.loads(imm.body)["error"]["param"] == "cache_salt"
    elif policy == "keep":  # left as the client sent it: no body mutation at all
        assert not out[-1].request_body.response.HasField("body_mutation")
    else:
        assert sent_body(out)["cache_salt"] == sent


async def test_refuse_without_inject_and_off_leaves_bodies_alone():
    proc, _ = make({"client_cache_salt": "refuse"})
    out = await run(proc, [headers_msg(), *body_msgs(chat(cache_salt="x"))])
    assert out[-1].immediate_response.status.code == 400
    proc, _ = make({})
    out = await run(proc, [headers_msg(), *body_msgs(chat(cache_salt="x"))])
    assert not out[-1].request_body.response.HasField("body_mutation")


def test_routing_keys_use_the_injected_salt(secret):
    """Affinity follows the salt the pod will use: two tenants' equal prompts get different keys."""
    router = Router(config({"cache_salt": "inject"}), Metrics())
    body = chat("a long shared document " * 50)
    a = router.parse("/v1/chat/completions", "POST", {"x-tenant-id": "a"}, body)
    b = router.parse("/v1/chat/completions", "POST", {"x-tenant-id": "b"}, body)
    assert a.cache_salt == expected_salt("a") and b.cache_salt == expected_salt("b")
    ka, kb = (route_keys(r, 256, 64) for r in (a, b))
    assert ka and not set(ka) & set(kb)


async def test_body_already_streamed_upstream_is_refused_not_sent_unsalted(secret):
    """STREAMED without send_body_without_waiting_for_header_response: chunks pass before the
    decision, so the salt cannot be set; the request fails closed rather than go unsalted."""
    proc, router = make({"cache_salt": "inject"})
    raw = chat()
    msgs = [headers_msg(), *body_msgs(raw, cuts=(10,))]
    out = await run(proc, msgs)
    assert out[1].WhichOneof("response") == "request_body"  # the first chunk went on
    assert out[-1].immediate_response.status.code == 500
    assert router.metrics.registry.get_sample_value("kvroute_errors_total", {"kind": "body_already_sent"}) == 1


async def test_gateway_pd_legs_carry_the_salt(secret):
    """The prefill leg and a local-prefill fallback both send the salted body."""
    eps = [{"address": PODS[0], "role": "prefill"}, {"address": PODS[1], "role": "decode"}]
    pd = {"disaggregation": "always", "handoff": "gateway", "prefill_timeout_s": 5}
    router = Router(config({"cache_salt": "inject"}, pools={"p": {"endpoints": eps}}, pd=pd), Metrics())
    legs = []

    async def prefill(outcome):  # the leg failed: the decode pod prefills locally
        legs.append(outcome.request.body["cache_salt"])
        return None

    router.prefill = prefill
    out = await run(ExternalProcessor(router), [headers_msg(extra={"x-tenant-id": "acme"}), *body_msgs(chat())])
    assert legs == [expected_salt("acme")] and sent_body(out)["cache_salt"] == expected_salt("acme")


async def test_secret_and_salts_never_logged(secret, caplog):
    caplog.set_level(logging.DEBUG)
    proc, _ = make({"cache_salt": "inject", "client_cache_salt": "refuse"})
    await run(proc, [headers_msg(extra={"x-tenant-id": "acme"}), *body_msgs(chat())])
    await run(proc, [headers_msg(extra={"x-tenant-id": "acme"}), *body_msgs(chat(cache_salt="x"))])
    text = caplog.text + "".join(repr(getattr(r, "fields", "")) for r in caplog.records)
    assert "routed" in text and "rejected" in text
    assert SECRET not in text and expected_salt("acme") not in text


async def test_a_body_too_deep_to_rewrite_is_a_400(secret):
    """orjson parses 1024 levels and writes 254: a salted body kvroute cannot write back was an
    internal error (found by bench/fuzz.py)."""
    proc, router = make({"cache_salt": "inject"})
    raw = chat()[:-1] + b',"x":' + b"[" * 300 + b"]" * 300 + b"}"
    out = await run(proc, [headers_msg(), *body_msgs(raw)])
    assert out[-1].immediate_response.status.code == 400
    assert "nested too deeply" in orjson.loads(out[-1].immediate_response.body)["error"]["message"]
    assert router.metrics.registry.get_sample_value("kvroute_errors_total", {"kind": "internal"}) is None


def test_a_body_route_id_pins_a_conversation_within_its_tenant():
    """headers.route_id_fields [prompt_cache_key]: Codex's later turns follow the first wherever their text
    leads; the same key from another tenant is another conversation."""
    router = Router(config(headers={"route_id_fields": ["prompt_cache_key"]}), Metrics())

    def turn(text: str, tenant: str = "a") -> tuple[str, str]:
        body = {"model": "m", "input": text * 40, "prompt_cache_key": "conv-1"}
        out = router.route(router.parse("/v1/responses", "POST", {"x-tenant-id": tenant}, orjson.dumps(body)))
        router.release(out.endpoint)
        return out.endpoint, out.decision.reason

    first, reason = turn("first question ")
    assert reason != "route-id"  # the first turn decides by its prompt, and pins
    later = [turn(q) for q in ("unrelated text ", "more unrelated words ", "yet another topic ")]
    assert later == [(first, "route-id")] * 3
    assert turn("unrelated text ", tenant="b")[1] != "route-id"  # tenant b's conv-1 is not tenant a's
