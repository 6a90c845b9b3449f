"""Discovery: the registry follows published endpoint sets; the file provider; the discovery flags."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import yaml

from extproc.cli import _parser, build
from extproc.config import ConfigError, EndpointConfig, load_config
from extproc.discovery import DiscoveryError
from extproc.discovery.file import FileProvider
from extproc.endpoints.pool import Change
from extproc.errors import NoEndpoint
from extproc.observability import Metrics
from extproc.request import InferenceRequest
from extproc.router import Router

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"


def ep(address: str, **kw) -> EndpointConfig:
    return EndpointConfig(address=address, **kw)


def file_config(path, **extra):
    return load_config(None, {"discovery": {"provider": "file", "file": {"path": str(path), "poll_interval_s": 0.02}},
                              **extra})  # fmt: skip


def chat(model: str = "m", doc: str = "a shared document " * 40) -> InferenceRequest:
    return InferenceRequest(
        path="/v1/chat/completions",
        method="POST",
        request_id="r",
        tenant="t",
        model=model,
        prompt_text=doc,
        body={"model": model, "messages": [{"role": "user", "content": doc}]},
    )


@pytest.fixture
def router(tmp_path):
    r = Router(file_config(tmp_path / "none.yaml"), Metrics())
    changes: list[Change] = []
    r.registry.subscribe(changes.append)
    r.changes = changes  # type: ignore[attr-defined]
    return r


def test_added_removed_restarted_and_drained_endpoints(router):
    reg = router.registry
    reg.apply("p", [ep(A, uid="a1"), ep(B, uid="b1")])
    assert [e.address for e in reg.pools["p"].endpoints] == [A, B]
    # A request records its prefix on the pod it went to.
    out = router.route(chat())
    home = out.endpoint
    assert router.index.blocks(home) > 0
    other = B if home == A else A

    # Same address, new uid: the pod restarted; what kvroute knew of its cache is gone, the state stays.
    state = reg.by_address[home]
    state.inflight = 2
    change = reg.apply("p", [ep(home, uid="new"), ep(other, uid=reg.configs[other].uid)])
    assert [c.address for c in change.restarted] == [home] and not change.added and not change.removed
    assert router.index.blocks(home) == 0 and reg.by_address[home] is state and state.inflight == 2

    # Not ready: draining, no new request goes there; ready again: it takes requests.
    change = reg.apply("p", [ep(home, uid="new", ready=False), ep(other, uid=reg.configs[other].uid)])
    assert change.drained == (home,)
    assert {router.route(chat(doc=f"doc {i} " * 50)).endpoint for i in range(8)} == {other}
    change = reg.apply("p", [ep(home, uid="new"), ep(other, uid=reg.configs[other].uid)])
    assert change.undrained == (home,)

    # Removed: its state, index entries and pins go; a late release of a request to it is harmless.
    router.route(chat(doc="pinned " * 50))
    change = reg.apply("p", [ep(C)])
    assert set(change.removed) == {A, B} and [c.address for c in change.added] == [C]
    assert A not in reg.by_address and router.index.blocks(A) == router.index.blocks(B) == 0
    router.release(A)
    assert router.route(chat()).endpoint == C
    assert [bool(c.added) for c in router.changes] == [True, False, False, False, True]


def test_every_endpoint_draining_means_no_endpoint(router):
    router.registry.apply("p", [ep(A, ready=False)])
    with pytest.raises(NoEndpoint, match="healthy"):
        router.route(chat())


def test_a_pod_in_two_pools_keeps_one_state_until_it_leaves_both(router):
    reg = router.registry
    reg.apply("p", [ep(A)])
    reg.apply("q", [ep(A), ep(B)])
    assert reg.pools["p"].endpoints[0] is reg.pools["q"].endpoints[0]
    assert reg.apply("p", []).removed == ()  # still in q
    assert reg.apply("q", [ep(B)]).removed == (A,)


def test_model_label_picks_the_pool_and_the_pods(tmp_path):
    r = Router(file_config(tmp_path / "f.yaml", unknown_model="reject"), Metrics())
    r.registry.apply("llama", [ep(A, model="llama-8b"), ep(B)])
    r.registry.apply("qwen", [ep(C, model="qwen-7b")])
    assert r.route(chat(model="qwen-7b")).endpoint == C
    assert {r.route(chat(model="llama-8b", doc=f"d{i} " * 60)).endpoint for i in range(10)} <= {A, B}
    assert r.route(chat(model="llama-8b", doc="x " * 60)).decision.pool == "llama"


def test_static_config_is_one_publish_that_changes_nothing():
    cfg = load_config(None, {"pools": {"p": {"endpoints": [{"address": A}, {"address": B}]}}})
    r = Router(cfg, Metrics())
    assert [e.address for e in r.registry.pools["p"].endpoints] == [A, B]

    async def run():
        await r.start()
        changes = r.registry.changes
        await r.discovery.start(r.registry.apply)  # the static provider republishes: no change
        assert r.registry.changes == changes
        await r.aclose()

    asyncio.run(run())


# -- file provider ---------------------------------------------------------------------------------


def write(path, pools: dict) -> None:
    path.write_text(yaml.safe_dump({"pools": {n: {"endpoints": e} for n, e in pools.items()}}))


async def test_file_provider_publishes_and_follows_changes(tmp_path):
    path = tmp_path / "endpoints.yaml"
    write(path, {"p": [{"address": A}, {"address": B, "role": "decode", "model": "m"}]})
    seen: dict[str, list[EndpointConfig]] = {}
    changed = asyncio.Event()

    def publish(pool, eps):
        seen[pool] = list(eps)
        changed.set()

    prov = FileProvider(file_config(path).discovery.file)
    await prov.start(publish)
    try:
        assert [e.address for e in seen["p"]] == [A, B] and seen["p"][1].role == "decode"
        changed.clear()
        write(path, {"q": [{"address": C, "ready": False}]})
        await asyncio.wait_for(changed.wait(), 5)  # one reload publishes every pool at once
        assert seen["p"] == [] and seen["q"][0].address == C and not seen["q"][0].ready

        # An invalid file keeps the last endpoints; the error is counted, and a fixed file is read.
        changed.clear()
        path.write_text("pools: {q: {endpoints: [{address: nonsense}]}}")
        async with asyncio.timeout(5):
            while prov.stats()["errors"] == 0:
                await asyncio.sleep(0.01)
        assert not changed.is_set() and prov.stats()["valid"] == 0
        write(path, {"q": [{"address": C}]})
        await asyncio.wait_for(changed.wait(), 5)
        assert seen["q"][0].ready and prov.stats()["valid"] == 1
    finally:
        await prov.aclose()


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (None, "cannot read"),
        ("pools: [", "not valid YAML/JSON"),
        ("pools: {p: {endpoints: [{address: '10.0.0.1'}]}}", "pools.p.endpoints.0.address"),
        ("pools: {p: {endpoints: [{address: '10.0.0.1:1', role: chef}]}}", "pools.p.endpoints.0.role"),
    ],
)
async def test_file_provider_start_errors_name_the_problem(tmp_path, text, needle):
    path = tmp_path / "endpoints.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(DiscoveryError, match=needle.replace(".", r"\.")):
        await FileProvider(file_config(path).discovery.file).start(lambda p, e: None)


def test_serve_with_an_unreadable_endpoints_file_exits_3_naming_it(tmp_path):
    missing = tmp_path / "nope.yaml"
    r = subprocess.run(
        [sys.executable, "-m", "extproc.cli", "serve", "--listen", "127.0.0.1", "--grpc-port", "0",
         "--health-port", "0", "--metrics-port", "0", "--endpoints-file", str(missing)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert r.returncode == 3, r.stderr
    assert f"discovery.file: cannot read {missing}" in r.stderr and "Traceback" not in r.stderr


# -- config and flags ------------------------------------------------------------------------------


def args(*argv):
    return build(_parser().parse_args(["serve", *argv]))


def test_discovery_flags_become_the_discovery_section(tmp_path):
    c = args("--pool-name", "llama", "--pool-name", "qwen", "--pool-namespace", "llm", "--model", "m")
    k = c.discovery.kubernetes
    assert c.discovery.provider == "kubernetes" and k is not None and k.namespace == "llm"
    assert [(p.name, p.inference_pool) for p in k.pools] == [("llama", "llama"), ("qwen", "qwen")]
    assert c.models["m"].pool == "llama" and c.pool_names == ["llama", "qwen"]

    c = args("--selector", "app=vllm,tier=gpu", "--target-port", "8000", "--kubeconfig", str(tmp_path / "kc"))
    k = c.discovery.kubernetes
    assert k is not None and k.pools[0].selector == {"app": "vllm", "tier": "gpu"} and k.pools[0].target_port == 8000
    assert c.fallback_pool == "default"

    c = args("--endpoints-file", str(tmp_path / "e.yaml"))
    assert c.discovery.provider == "file" and c.discovery.file is not None


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--selector", "app"], "--selector: 'app' is not key=value"),
        (["--target-port", "80"], "--target-port: needs --selector"),
        (["--selector", "app=x"], "set inference_pool, or selector and target_port"),
    ],
)
def test_bad_discovery_flags_are_readable_errors(argv, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        args(*argv)


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"discovery": {"provider": "file"}}, "provider file needs discovery.file.path"),
        ({"discovery": {"provider": "kubernetes"}}, "provider kubernetes needs discovery.kubernetes"),
        (
            {"discovery": {"provider": "file", "file": {"path": "x"}}, "pools": {"p": {"endpoints": [{"address": A}]}}},
            "endpoints are listed here only with discovery.provider static",
        ),
        (
            {
                "discovery": {
                    "provider": "kubernetes",
                    "kubernetes": {"pools": [{"name": "a", "inference_pool": "a"}]},
                },
                "models": {"m": {"pool": "b"}},
            },
            "models.m.pool: no pool named 'b' (have: a)",
        ),
        (
            {
                "discovery": {
                    "provider": "kubernetes",
                    "kubernetes": {
                        "pools": [
                            {"name": "a", "inference_pool": "a"},
                            {"name": "a", "selector": {"x": "y"}, "target_port": 1},
                        ]
                    },
                }
            },
            "duplicate pool name(s): a",
        ),
        ({"pools": {"p": {"endpoints": []}}}, "pools.p.endpoints: a static pool needs at least one endpoint"),
    ],
)
def test_discovery_config_errors_name_the_field(data, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, data)
    assert needle in str(e.value)
