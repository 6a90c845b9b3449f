import subprocess
import sys

import pytest

from extproc.cli import main
from extproc.config import ConfigError, load_config


def write(tmp_path, text):
    p = tmp_path / "kvroute.yaml"
    p.write_text(text)
    return p


def test_full_config_file(tmp_path):
    p = write(
        tmp_path,
        """
mode: cluster
pools:
  gpu:
    endpoints:
      - {address: "10.0.0.1:8000"}
      - {address: "10.0.0.2:8000", role: decode, cluster: pod2}
models:
  llama: {pool: gpu}
unknown_model: passthrough
routing: {block_chars: 128, weights: {prefix: 5, kv_usage: 0}}
headers: {tenant: X-Org}
server: {grpc_port: 7000}
""",
    )
    c = load_config(p)
    assert c.mode == "cluster" and c.routing.block_chars == 128 and c.routing.weights.prefix == 5
    assert c.headers.tenant == "x-org" and c.server.grpc_port == 7000
    assert [e.cluster_name for e in c.pools["gpu"].endpoints] == ["ep_10_0_0_1_8000", "pod2"]
    assert c.fallback_pool == "gpu"


@pytest.mark.parametrize(
    "text,needle",
    [
        ("pools: {a: {endpoints: [{address: 'x:1'}]}}", "pools.a.endpoints.0.address"),
        ("pools: {a: {endpoints: []}}", "pools.a.endpoints"),
        ("pools: {a: {endpoints: [{address: '1.1.1.1:1'}]}}\nmodels: {m: {pool: b}}", "models.m.pool"),
        ("pools: {a: {endpoints: [{address: '1.1.1.1:1'}]}}\nrouting: {bogus: 1}", "routing.bogus"),
        ("pools: {a: {endpoints: [{address: '1.1.1.1:1', role: x}]}}", "role"),
        ("pools: {a: {endpoints: [{address: '1.1.1.1:1'}, {address: '1.1.1.1:1'}]}}", "duplicate"),
        ("[1, 2]", "top level must be a mapping"),
        ("a: [", "not valid YAML"),
        ("mode: epp", "no endpoints configured"),
    ],
)
def test_bad_config_names_the_field(tmp_path, text, needle):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    assert needle in str(e.value)


def test_cli_bad_config_exit_2(tmp_path, capsys):
    assert main(["serve", "--endpoints", "1.2.3.4:80,nope"]) == 2
    err = capsys.readouterr().err
    assert "pools.default.endpoints.1.address" in err
    assert main(["check-config", str(tmp_path / "missing.yaml")]) == 2


def test_cli_flags_override_file(tmp_path, capsys):
    p = write(tmp_path, "pools: {a: {endpoints: [{address: '1.1.1.1:1'}]}}\nserver: {grpc_port: 1}")
    assert main(["check-config", str(p)]) == 0
    assert '"grpc_port": 1' in capsys.readouterr().out


def test_event_loop_default_and_flag():
    from extproc.cli import _parser, build

    def loop(*flags: str) -> str:
        return build(_parser().parse_args(["serve", "--endpoints", "1.1.1.1:1", *flags])).server.event_loop

    assert loop() == "uvloop"
    assert loop("--event-loop", "asyncio") == "asyncio"


def test_help_explains():
    out = subprocess.run([sys.executable, "-m", "extproc.cli", "serve", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for flag in ("--endpoints", "--grpc-port", "--health-port", "--metrics-port", "--mode", "--config"):
        assert flag in out.stdout


def test_example_config_is_valid_and_documents_every_field():
    from pathlib import Path

    import yaml

    from extproc.config import Config

    path = Path(__file__).resolve().parents[2] / "deploy" / "kvroute.example.yaml"
    cfg = load_config(path)
    assert cfg.models and cfg.pools
    text = yaml.safe_load(path.read_text())
    # Every top-level section of the schema appears in the example.
    assert set(Config.model_fields) <= set(text)


def test_h2_port_from_the_command_line_and_checked_against_the_others():
    from extproc.cli import _parser, overrides_from_args
    from extproc.config import ConfigError

    args = _parser().parse_args(["serve", "--endpoints", "127.0.0.1:9", "--h2-port", "9005"])
    assert overrides_from_args(args)["server"]["h2_port"] == 9005
    base = {"pools": {"p": {"endpoints": [{"address": "127.0.0.1:9"}]}}}
    assert load_config(None, {**base, "server": {"h2_port": 9005}}).server.h2_port == 9005
    with pytest.raises(ConfigError, match=r"h2_port 9002: the same port as \['grpc_port'\]"):
        load_config(None, {**base, "server": {"h2_port": 9002}})
    for port, other in ((9003, "health_port"), (9090, "metrics_port")):
        with pytest.raises(ConfigError, match=rf"h2_port {port}: the same port as \['{other}'\]"):
            load_config(None, {**base, "server": {"h2_port": port}})
    # deploy/'s layout: ext_proc on the h2 port, grpcio's elsewhere; Envoy's ext_proc goes to the h2 port.
    layout = load_config(None, {**base, "server": {"h2_port": 9002, "grpc_port": 9001}}).server
    assert layout.ext_proc_port == 9002
    assert load_config(None, base).server.ext_proc_port == 9002  # no h2_port: grpcio's port


@pytest.mark.parametrize("setting", ["metrics", "grpc", "health", "h2"])
def test_a_taken_port_stops_serve_with_exit_3_naming_it(setting):
    """A port kvroute must listen on is in use: exit 3 and one line naming the setting and address (no
    traceback)."""
    import socket

    with socket.socket() as taken, socket.socket() as spare:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        spare.bind(("127.0.0.1", 0))
        ports = {"metrics": 0, "grpc": 0, "health": 0}
        ports[setting] = taken.getsockname()[1]
        others = [s for s in ports if s != setting]
        ports[others[0]] = spare.getsockname()[1]
        spare.close()  # free for kvroute to bind, then (after it gives up) for us again
        args = ["serve", "--listen", "127.0.0.1", "--endpoints", "127.0.0.1:9"]
        for s, p in ports.items():
            args += [f"--{s}-port", str(p)]
        r = subprocess.run([sys.executable, "-m", "extproc.cli", *args], capture_output=True, text=True, timeout=30)
    assert r.returncode == 3, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    want = f"server.{setting}_port: cannot listen on 127.0.0.1:{ports[setting]}: Address already in use"
    assert last == f"kvroute: cannot start: {want}"
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(("taken", "bound"), [("health", "grpc"), ("grpc", "metrics"), ("admin", "h2")])
async def test_a_failed_start_releases_the_ports_it_bound(taken, bound):
    """In process: a port bound before another one failed is free again (a supervisor retrying in
    the same process, or a test, can use it). Ports bind metrics, then gRPC, health, h2 and admin."""
    import socket

    from extproc.app import KVRouteServer
    from extproc.errors import StartupError

    with socket.socket() as held, socket.socket() as spare:
        held.bind(("127.0.0.1", 0))
        held.listen()
        spare.bind(("127.0.0.1", 0))
        ports = {"grpc_port": 0, "health_port": 0, "metrics_port": 0}
        ports[f"{taken}_port"] = held.getsockname()[1]
        ports[f"{bound}_port"] = free = spare.getsockname()[1]
        spare.close()
        cfg = load_config(None, {"pools": {"p": {"endpoints": [{"address": "127.0.0.1:9"}]}},
                                 "server": {"listen": "127.0.0.1", **ports}})  # fmt: skip
        with pytest.raises(StartupError, match=f"server.{taken}_port"):
            await KVRouteServer(cfg).start()
    with socket.socket() as again:
        again.bind(("127.0.0.1", free))


async def test_serving_is_reported_only_once_before_serving_has_run():
    """``serve`` freezes startup's heap in ``before_serving`` (a full collection, the loop stopped): the
    readiness and ext_proc health statuses say SERVING only after it, so no request is let in to wait
    it out."""
    from grpc_health.v1 import health_pb2

    from extproc.app import HEALTH_SERVICES, KVRouteServer

    cfg = load_config(None, {"pools": {"p": {"endpoints": [{"address": "127.0.0.1:9"}]}},
                             "server": {"listen": "127.0.0.1", "grpc_port": 0, "health_port": 0,
                                        "metrics_port": 0}})  # fmt: skip
    server = KVRouteServer(cfg)

    def statuses() -> dict[str, object]:
        return {name: server.health.check(health_pb2.HealthCheckRequest(service=name).SerializeToString())[:2]
                for name in HEALTH_SERVICES if name}  # fmt: skip

    seen: list[dict[str, object]] = []
    await server.start(before_serving=lambda: seen.append(statuses()))
    try:
        serving = (0, health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING).SerializeToString())
        assert len(seen) == 1 and all(v != serving for v in seen[0].values()), seen
        assert all(v == serving for v in statuses().values())
    finally:
        await server.stop()
