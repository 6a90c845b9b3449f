"""The registry's per-decision lookups (which pool serves a model, which pods serve a model in a role)
are computed once per pool change, and follow every change."""

from __future__ import annotations

from extproc.config import EndpointConfig, build_config
from extproc.endpoints.pool import MEMO_MAX, Registry


def _registry() -> Registry:
    return Registry(build_config({"pools": {"a": {"endpoints": [{"address": "10.0.0.1:80"}]}}}))


def test_lookups_follow_pool_changes() -> None:
    reg = _registry()
    a = reg.pools["a"]
    assert reg.pool_serving("llama") is None
    assert [e.address for e in reg.candidates(a, "llama", "decode")] == ["10.0.0.1:80"]
    reg.apply("b", [EndpointConfig(address="10.0.0.2:80", model="llama", role="prefill"),
                    EndpointConfig(address="10.0.0.3:80", model="llama", role="decode")])  # fmt: skip
    b = reg.pools["b"]
    assert reg.pool_serving("llama") == "b"  # not the answer remembered before the change
    assert [e.address for e in reg.candidates(b, "llama", "decode")] == ["10.0.0.3:80"]
    assert [e.address for e in reg.candidates(b, "llama", "prefill")] == ["10.0.0.2:80"]
    assert reg.candidates(b, "llama", "decode") is reg.candidates(b, "llama", "decode")  # one scan per change
    reg.apply("b", [EndpointConfig(address="10.0.0.2:80", model="llama", role="both")])  # relabelled in place
    assert [e.address for e in reg.candidates(b, "llama", "decode")] == ["10.0.0.2:80"]
    assert reg.candidates(b, "mistral", "decode") == []


def test_model_names_from_clients_do_not_grow_the_lookups_without_bound() -> None:
    reg = _registry()
    a = reg.pools["a"]
    for i in range(3 * MEMO_MAX):
        reg.pool_serving(f"model-{i}")
        reg.candidates(a, f"model-{i}", "decode")
    assert len(reg._serving) <= MEMO_MAX and len(reg._candidates) <= MEMO_MAX
