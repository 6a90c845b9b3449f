"""tenancy.cache_salt inject with real vLLM behind Envoy: kvroute sets each tenant's salt in the body;
identical prompts from two tenants get 0 cached tokens across tenants and full hits within a tenant,
and kvroute's precise index predicts both (it keys the request with the salt vLLM uses)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.vllm_pods import VLLMPod
from tests.vllm.test_through_envoy import ask, document, kvroute_config, through_envoy

SECRET = "vllm-test-secret-0123456789"


@pytest.fixture(scope="module")
def salted(pods: list[VLLMPod], model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    workdir = Path(tmp_path_factory.mktemp("tenancy"))
    (workdir / "secret").write_text(SECRET)
    tenancy = {"cache_salt": "inject", "secret_file": str(workdir / "secret")}
    with through_envoy(pods, kvroute_config(pods, model_dir, tenancy=tenancy), workdir) as r:
        yield r


def test_tenants_share_no_cached_tokens_on_vllm(salted: tuple) -> None:
    doc = document(3000)

    decisions: list[dict] = []

    def as_tenant(t: str) -> tuple[int, int]:
        predicted, reported, _ = ask(salted, doc, "the same question", headers={"x-tenant-id": t}, decisions=decisions)
        return predicted, reported

    def why() -> str:  # kvroute's decisions so far, and what its KV-event intake counted
        fields = ("endpoint", "reason", "matches", "predicted_cached_tokens", "precise", "head", "total_blocks")
        seen = [{f: d.get("fields", d).get(f) for f in fields} for d in decisions]
        intake = [line for line in salted[1].log().splitlines() if "kv-events" in line][-10:]
        return f"decisions {seen}; kv-events log {intake}"

    assert as_tenant("acme") == (0, 0), why()
    predicted, reported = as_tenant("acme")
    assert predicted == reported > 0, why()  # a full hit within the tenant
    assert as_tenant("globex") == (0, 0), why()  # the same prompt, another tenant: nothing shared
    predicted, reported = as_tenant("globex")
    assert predicted == reported > 0, why()
    assert SECRET not in salted[1].log()
