"""``kvroute envoy-config``: options → config structure, readable errors, and the checked-in
``envoy/*.yaml`` equal to the output of the command in their header."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc import envoyconfig as ec
from extproc.cli import main

ROOT = Path(__file__).resolve().parents[2]
ENVOY_DIR = ROOT / "envoy"
PODS = "10.0.0.11:8000,10.0.0.12:8000"


def generate(*argv: str) -> dict[str, Any]:
    return ec.bootstrap(ec.options_from_command(argv))


def clusters(cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in cfg["static_resources"]["clusters"]}


def hosts(cluster: dict[str, Any]) -> list[str]:
    eps = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    return [f"{e['endpoint']['address']['socket_address']['address']}:"
            f"{e['endpoint']['address']['socket_address']['port_value']}" for e in eps]  # fmt: skip


def hcm(cfg: dict[str, Any]) -> dict[str, Any]:
    return cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def ext_proc(cfg: dict[str, Any]) -> dict[str, Any]:
    (f,) = [f for f in hcm(cfg)["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
    return dict(f["typed_config"])


def routes(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    return list(hcm(cfg)["route_config"]["virtual_hosts"][0]["routes"])


def write_config(tmp_path: Path, data: dict[str, Any]) -> str:
    p = tmp_path / "kvroute.yaml"
    p.write_text(yaml.safe_dump(data))
    return str(p)


def test_epp_defaults():
    cfg = generate("--endpoints", PODS)
    cs = clusters(cfg)
    assert list(cs) == ["vllm_pool", "kvroute"]
    assert hosts(cs["vllm_pool"]) == PODS.split(",") and cs["vllm_pool"]["type"] == "STATIC"
    # kvroute's ranked list (envoy.lb metadata, else the header) picks the pod; round robin without one.
    (policy,) = cs["vllm_pool"]["load_balancing_policy"]["policies"]
    override = policy["typed_extension_config"]["typed_config"]
    assert override["@type"] == ec.OVERRIDE_HOST_TYPE and "lb_policy" not in cs["vllm_pool"]
    assert override["override_host_sources"] == [
        {"metadata": {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint"}]}},
        {"header": "x-gateway-destination-endpoint"},
    ]
    (fallback_policy,) = override["fallback_policy"]["policies"]
    assert fallback_policy["typed_extension_config"]["name"] == "envoy.load_balancing_policies.round_robin"
    assert cs["vllm_pool"]["outlier_detection"]["consecutive_local_origin_failure"] == 2
    assert hosts(cs["kvroute"]) == ["127.0.0.1:9002"] and "transport_socket" not in cs["kvroute"]
    (route,) = routes(cfg)
    assert route["match"] == {"prefix": "/"} and route["route"]["cluster"] == "vllm_pool"
    retry = route["route"]["retry_policy"]
    assert retry["retry_on"] == "connect-failure,refused-stream,reset-before-request" and retry["num_retries"] == 3
    assert cfg["admin"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 9901}
    listen = cfg["static_resources"]["listeners"][0]["address"]["socket_address"]
    assert listen == {"address": "0.0.0.0", "port_value": 8080}
    ep = ext_proc(cfg)
    assert ep["failure_mode_allow"] is True and ep["message_timeout"] == "2s" and ep["max_message_timeout"] == "120s"
    assert ep["processing_mode"]["request_body_mode"] == "BUFFERED"
    assert ep["processing_mode"]["response_body_mode"] == "NONE"
    assert ep["metadata_options"] == {"receiving_namespaces": {"untyped": ["envoy.lb"]}}  # EPP's fallback list
    # Envoy strips every header kvroute itself strips, before ext_proc sees the request.
    strip = [m["remove"] for m in hcm(cfg)["http_filters"][0]["typed_config"]["mutations"]["request_mutations"]]
    assert strip == ec.HeadersConfig().routing_headers() and "x-prefiller-host-port" in strip


def test_cluster_mode_one_cluster_per_pod():
    cfg = generate("--mode", "cluster", "--endpoints", PODS, "--listen-port", "18080", "--admin-port", "none")
    cs = clusters(cfg)
    assert list(cs) == ["ep_10_0_0_11_8000", "ep_10_0_0_12_8000", "vllm_pool", "kvroute"]
    assert hosts(cs["ep_10_0_0_12_8000"]) == ["10.0.0.12:8000"] and "lb_policy" not in cs["ep_10_0_0_12_8000"]
    assert routes(cfg)[0]["route"]["cluster_header"] == "x-kvroute-cluster"
    assert "metadata_options" not in ext_proc(cfg)
    assert "admin" not in cfg
    assert cfg["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"] == 18080


def test_pd_cluster_prefill_and_decode_clusters():
    cfg = generate("--mode", "pd-cluster", "--prefill", "10.0.0.1:8000", "--decode", "10.0.0.2:8000,10.0.0.3:8000",
                   "--endpoints", "10.0.0.4:8000")  # fmt: skip
    cs = clusters(cfg)
    assert list(cs) == ["prefill", "decode", "vllm_pool", "kvroute"]
    # A pod of role both serves either leg.
    assert hosts(cs["prefill"]) == ["10.0.0.4:8000", "10.0.0.1:8000"]
    assert hosts(cs["decode"]) == ["10.0.0.4:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
    assert cs["prefill"]["lb_policy"] == cs["decode"]["lb_policy"] == "LEAST_REQUEST"
    assert len(hosts(cs["vllm_pool"])) == 4
    assert routes(cfg)[0]["route"]["cluster_header"] == "x-kvroute-cluster"


def test_dns_names_get_strict_dns_clusters():
    """The standalone-Envoy Kubernetes setup: kvroute and the pool by Service name."""
    cfg = generate("--kvroute", "kvroute.kvroute-system.svc.cluster.local:9002", "--endpoints", "vllm.llm.svc:8000")
    cs = clusters(cfg)
    for name, host in (
        ("kvroute", "kvroute.kvroute-system.svc.cluster.local:9002"),
        ("vllm_pool", "vllm.llm.svc:8000"),
    ):
        assert cs[name]["type"] == "STRICT_DNS" and hosts(cs[name]) == [host]
        assert cs[name]["dns_lookup_family"] == "V4_PREFERRED"
    v6 = clusters(generate("--kvroute", "[::1]:9002", "--endpoints", "[fd00::1]:8000"))
    assert v6["kvroute"]["type"] == "STATIC" and hosts(v6["kvroute"]) == ["::1:9002"]


@pytest.mark.parametrize(
    "argv,mode,trailers,fail_open,without_waiting",
    [
        ([], "BUFFERED", "SKIP", True, None),
        (["--processing-mode", "STREAMED"], "STREAMED", "SKIP", True, True),
        (["--processing-mode", "FULL_DUPLEX_STREAMED"], "FULL_DUPLEX_STREAMED", "SEND", False, None),
        (["--processing-mode", "STREAMED", "--no-failure-mode-allow"], "STREAMED", "SKIP", False, True),
    ],
)
def test_body_modes(argv, mode, trailers, fail_open, without_waiting):
    ep = ext_proc(generate("--endpoints", PODS, *argv))
    assert ep["processing_mode"]["request_body_mode"] == mode
    assert ep["processing_mode"]["request_trailer_mode"] == trailers
    assert ep["failure_mode_allow"] is fail_open
    assert ep.get("send_body_without_waiting_for_header_response") is without_waiting


def test_read_responses_and_timeouts():
    ep = ext_proc(generate("--endpoints", PODS, "--read-responses", "--message-timeout", "0.5",
                           "--max-message-timeout", "31"))  # fmt: skip
    assert ep["processing_mode"]["response_header_mode"] == "SEND"
    assert ep["processing_mode"]["response_body_mode"] == "STREAMED"
    assert (ep["message_timeout"], ep["max_message_timeout"]) == ("0.5s", "31s")


def test_tls_to_kvroute():
    cs = clusters(generate("--endpoints", PODS, "--tls-ca", "ca.crt", "--tls-cert", "e.crt", "--tls-key", "e.key",
                           "--tls-server-name", "kvroute.example"))  # fmt: skip
    tls = cs["kvroute"]["transport_socket"]["typed_config"]
    assert tls["sni"] == "kvroute.example"
    ctx = tls["common_tls_context"]
    assert ctx["tls_certificates"] == [
        {"certificate_chain": {"filename": "e.crt"}, "private_key": {"filename": "e.key"}}
    ]
    assert ctx["validation_context"]["trusted_ca"] == {"filename": "ca.crt"}
    assert ctx["validation_context"]["match_typed_subject_alt_names"][0]["matcher"] == {"exact": "kvroute.example"}
    # TLS without a client certificate (kvroute without client_ca_file): no tls_certificates.
    ctx = clusters(generate("--endpoints", PODS, "--tls-ca", "ca.crt"))["kvroute"]["transport_socket"]
    assert "tls_certificates" not in ctx["typed_config"]["common_tls_context"]


def test_tls_to_the_pods():
    """Every pod cluster dials over TLS (HTTP/1.1, no ALPN); kvroute's cluster and the mirror do not."""
    tls = ["--pods-tls-ca", "pods-ca.crt", "--pods-tls-cert", "e.crt", "--pods-tls-key", "e.key"]
    for argv in (["--endpoints", PODS], ["--mode", "cluster", "--endpoints", PODS],
                 ["--mode", "pd-cluster", "--prefill", "10.0.0.1:8000", "--decode", "10.0.0.2:8000"]):  # fmt: skip
        cs = clusters(generate(*argv, *tls, "--pods-tls-server-name", "vllm.pods", "--mirror-to", "shadow:80"))
        assert {n for n, c in cs.items() if "transport_socket" in c} == set(cs) - {"kvroute", "mirror"}
        socket = cs["vllm_pool"]["transport_socket"]["typed_config"]
        assert socket["@type"] == ec.UPSTREAM_TLS_TYPE and socket["sni"] == "vllm.pods"
        ctx = socket["common_tls_context"]
        assert "alpn_protocols" not in ctx
        assert ctx["tls_certificates"] == [{"certificate_chain": {"filename": "e.crt"},
                                            "private_key": {"filename": "e.key"}}]  # fmt: skip
        assert ctx["validation_context"] == {
            "trusted_ca": {"filename": "pods-ca.crt"},
            "match_typed_subject_alt_names": [{"san_type": "DNS", "matcher": {"exact": "vllm.pods"}}],
        }
    # No name: the chain alone is checked (Envoy cannot match each pod's IP SAN), no SNI sent.
    socket = clusters(generate("--endpoints", PODS, "--pods-tls-ca", "ca.crt"))["vllm_pool"]["transport_socket"]
    ctx = socket["typed_config"]["common_tls_context"]
    assert "sni" not in socket["typed_config"] and ctx == {"validation_context": {"trusted_ca": {"filename": "ca.crt"}}}
    assert "transport_socket" not in clusters(generate("--endpoints", PODS))["vllm_pool"]


def test_pods_tls_against_kvroutes_config(tmp_path):
    """Envoy and kvroute reach the same pods: both over https or neither; the name comes from pods.tls."""
    pool = {"p": {"endpoints": [{"address": "10.0.0.1:8000"}]}}
    https = write_config(tmp_path, {"pools": pool, "pods": {"tls": {"server_name": "vllm.pods"}}})
    cs = clusters(generate("--config", https, "--pods-tls-ca", "pods-ca.crt"))
    assert cs["vllm_pool"]["transport_socket"]["typed_config"]["sni"] == "vllm.pods"
    cs = clusters(generate("--config", https, "--pods-tls-ca", "pods-ca.crt", "--pods-tls-server-name", "other"))
    assert cs["vllm_pool"]["transport_socket"]["typed_config"]["sni"] == "other"
    with pytest.raises(ec.ConfigError, match=r"reaches every pod over https \(pods\.tls\): give --pods-tls-ca"):
        generate("--config", https)
    (tmp_path / "plain").mkdir()
    plain = write_config(tmp_path / "plain", {"pools": pool})
    with pytest.raises(ec.ConfigError, match=r"--pods-tls-ca: kvroute's config does not reach every pod over https"):
        generate("--config", plain, "--pods-tls-ca", "pods-ca.crt")


def test_streams_per_connection_to_kvroute(capsys):
    """Envoy opens another connection to kvroute past N streams: what --workers and replicas balance."""

    def h2(cfg: dict[str, Any]) -> dict[str, Any]:
        options = clusters(cfg)["kvroute"]["typed_extension_protocol_options"][ec.HTTP_OPTIONS]
        return dict(options["explicit_http_config"]["http2_protocol_options"])

    assert h2(generate("--endpoints", PODS)) == {"max_concurrent_streams": ec.DEFAULT_KVROUTE_STREAMS}
    assert h2(generate("--endpoints", PODS, "--kvroute-max-streams", "4")) == {"max_concurrent_streams": 4}
    for bad in ("0", "many", str(2**31)):
        with pytest.raises(SystemExit):
            main(["envoy-config", "--endpoints", PODS, "--kvroute-max-streams", bad])
        assert f"{bad!r} is not a number of streams 1..2147483647" in capsys.readouterr().err


def test_from_kvroute_config(tmp_path):
    """Pods, roles, cluster names, header names and the ext_proc port come from kvroute's config."""
    path = write_config(tmp_path, {
        "mode": "cluster",
        "server": {"grpc_port": 7000},
        "headers": {"cluster": "x-my-cluster", "destination": "x-my-dest"},
        "pools": {
            "a": {"endpoints": [{"address": "10.0.0.1:8000"}, {"address": "10.0.0.2:8000", "cluster": "pod2"}]},
            "b": {"cluster": "pool-b", "endpoints": [{"address": "10.0.1.1:8000"}, {"address": "10.0.1.2:8000"}]},
        },
    })  # fmt: skip
    cfg = generate("--config", path)  # mode from the config
    cs = clusters(cfg)
    assert list(cs) == ["ep_10_0_0_1_8000", "pod2", "ep_10_0_1_1_8000", "ep_10_0_1_2_8000", "pool-b", "vllm_pool",
                        "kvroute"]  # fmt: skip
    assert hosts(cs["pool-b"]) == ["10.0.1.1:8000", "10.0.1.2:8000"] and cs["pool-b"]["lb_policy"] == "LEAST_REQUEST"
    assert len(hosts(cs["vllm_pool"])) == 4 and hosts(cs["kvroute"]) == ["127.0.0.1:7000"]
    assert routes(cfg)[0]["route"]["cluster_header"] == "x-my-cluster"
    strip = [m["remove"] for m in hcm(cfg)["http_filters"][0]["typed_config"]["mutations"]["request_mutations"]]
    assert {"x-my-cluster", "x-my-dest"} <= set(strip)
    # --endpoints replace the config's pods; --kvroute its address.
    cs = clusters(generate("--config", path, "--endpoints", "10.9.9.9:8000", "--kvroute", "kv:1"))
    assert [n for n in cs if n.startswith("ep_")] == ["ep_10_9_9_9_8000"] and hosts(cs["kvroute"]) == ["kv:1"]


def test_ext_proc_dials_kvroutes_h2_port_when_its_config_has_one(tmp_path):
    """server.h2_port (kvroute's own HTTP/2 server) carries the ext_proc stream; ext_authz stays on gRPC."""
    path = write_config(tmp_path, {"server": {"grpc_port": 7000, "h2_port": 7005},
                                   "pools": {"a": {"endpoints": [{"address": "10.0.0.1:8000"}]}}})  # fmt: skip
    assert hosts(clusters(generate("--config", path))["kvroute"]) == ["127.0.0.1:7005"]
    assert hosts(clusters(generate("--config", path, "--api", "ext_authz"))["kvroute"]) == ["127.0.0.1:7000"]
    assert hosts(clusters(generate("--config", path, "--kvroute", "kv:9"))["kvroute"]) == ["kv:9"]


def test_the_streamed_body_modes_keep_the_stream_to_the_exchanges_end():
    """STREAMED and FULL_DUPLEX_STREAMED ask for the response trailers' event: without one still due, Envoy ends
    the ext_proc stream with the request and kvroute frees the pod's in-flight slot too early. BUFFERED needs none."""
    for mode, trailers in (("BUFFERED", "SKIP"), ("STREAMED", "SEND"), ("FULL_DUPLEX_STREAMED", "SEND")):
        ep = ext_proc(generate("--endpoints", PODS, "--processing-mode", mode))
        assert ep["processing_mode"]["response_trailer_mode"] == trailers, mode
    assert ext_proc(generate("--endpoints", PODS))["processing_mode"]["request_body_mode"] == "BUFFERED"


def test_pd_cluster_names_from_kvroute_config(tmp_path):
    path = write_config(tmp_path, {
        "mode": "cluster",
        "pd": {"disaggregation": "always", "handoff": "cluster", "prefill_cluster": "pf", "decode_cluster": "dc"},
        "pools": {"p": {"endpoints": [{"address": "10.0.0.1:8000", "role": "prefill"},
                                      {"address": "10.0.0.2:8000", "role": "decode"}]}},
    })  # fmt: skip
    cs = clusters(generate("--config", path, "--mode", "pd-cluster"))
    assert hosts(cs["pf"]) == ["10.0.0.1:8000"] and hosts(cs["dc"]) == ["10.0.0.2:8000"]


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--kvroute", "nonsense", "--endpoints", PODS], "--kvroute 'nonsense': expected host:port"),
        (["--kvroute", "kv route:9002", "--endpoints", PODS], "'kv route' is neither an IP address nor a DNS name"),
        (["--kvroute", "10.0.0:9002", "--endpoints", PODS], "'10.0.0' is neither an IP address nor a DNS name"),
        (["--kvroute", "kvroute:0", "--endpoints", PODS], "--kvroute 'kvroute:0': port must be 1..65535"),
        (["--endpoints", "10.0.0.1"], "--endpoints '10.0.0.1': expected host:port"),
        (["--endpoints", "10.0.0.1:8000,10.0.0.1:8000"], "given twice: 10.0.0.1:8000"),
        (["--mode", "cluster"], "no pods: give --endpoints"),
        (["--mode", "cluster", "--endpoints", "vllm.svc:8000"], "cluster mode: vllm.svc:8000 is not an IP address"),
        (["--mode", "pd-cluster", "--decode", "10.0.0.1:8000"], "pd-cluster mode: no prefill pods: give --prefill"),
        (["--endpoints", PODS, "--processing-mode", "FULL_DUPLEX_STREAMED", "--failure-mode-allow"],
         "FULL_DUPLEX_STREAMED cannot fail open"),
        (["--endpoints", PODS, "--message-timeout", "5", "--max-message-timeout", "3"],
         "--message-timeout 5 must be > 0 and at most --max-message-timeout 3"),
        (["--endpoints", PODS, "--tls-cert", "e.crt", "--tls-key", "e.key"], "need --tls-ca"),
        (["--endpoints", PODS, "--tls-ca", "ca.crt", "--tls-cert", "e.crt"], "--tls-cert and --tls-key go together"),
        (["--endpoints", PODS, "--listen-address", "any"], "--listen-address: 'any' is not an IP address"),
        (["--endpoints", PODS, "--pods-tls-server-name", "vllm"], "need --pods-tls-ca"),
        (["--endpoints", PODS, "--pods-tls-ca", "ca.crt", "--pods-tls-key", "e.key"],
         "--pods-tls-cert and --pods-tls-key go together"),
    ],
)  # fmt: skip
def test_bad_options_are_named_exit_2(argv, needle, capsys):
    assert main(["envoy-config", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvroute envoy-config: ") and needle in err, err


def test_config_that_kvroute_could_not_work_with(tmp_path):
    epp = write_config(tmp_path, {"pools": {"p": {"endpoints": [{"address": "10.0.0.1:8000"}]}}})
    with pytest.raises(ec.ConfigError, match="--mode cluster: kvroute's config says mode: epp"):
        generate("--config", epp, "--mode", "cluster")
    with pytest.raises(ec.ConfigError, match=r"--mode pd-cluster: kvroute's config needs pd\.handoff: cluster"):
        generate("--config", epp, "--mode", "pd-cluster")
    with pytest.raises(ec.ConfigError, match=r"no server\.tls"):
        generate("--config", epp, "--tls-ca", "ca.crt")
    # A request held (routing.hold) past what Envoy waits for its answer would go on unrouted: over ext_proc
    # kvroute asks for the hold and a second more (up to max_message_timeout), a Check waits message_timeout.
    pods = {"p": {"endpoints": [{"address": "10.0.0.1:8000"}]}}
    long_hold = write_config(tmp_path, {"pools": pods, "routing": {"hold": {"enabled": True, "max_s": 2}}})
    assert ext_proc(generate("--config", long_hold))["message_timeout"] == "2s"  # 120 s allowed by the override
    with pytest.raises(ec.ConfigError, match=r"routing\.hold\.max_s 2 s, not under --max-message-timeout 2"):
        generate("--config", long_hold, "--max-message-timeout", "3")
    with pytest.raises(ec.ConfigError, match=r"routing\.hold\.max_s 2 s, not under --message-timeout 2"):
        generate("--config", long_hold, "--api", "ext_authz")
    generate("--config", long_hold, "--api", "ext_authz", "--message-timeout", "3")
    no_hold = write_config(tmp_path, {"pools": pods, "routing": {"hold": {"max_s": 2}}})
    generate("--config", no_hold, "--api", "ext_authz")  # holding off (the default without scraping): any max_s
    scraped = write_config(tmp_path, {"pools": pods, "routing": {"hold": {"max_s": 2}}, "scrape": {"enabled": True}})
    with pytest.raises(ec.ConfigError, match=r"routing\.hold\.max_s 2 s"):
        generate("--config", scraped, "--api", "ext_authz")  # the default holds where the pods are scraped
    bad = write_config(tmp_path, {"pools": {"p": {"endpoints": [{"address": "x:1"}]}}})
    assert main(["envoy-config", "--config", bad]) == 2  # kvroute's own validation, field named


def test_flag_values_checked_by_argparse(capsys):
    with pytest.raises(SystemExit) as e:
        main(["envoy-config", "--endpoints", PODS, "--listen-port", "70000"])
    assert e.value.code == 2 and "'70000' is not a port 1..65535" in capsys.readouterr().err


def test_output_file_records_its_command(tmp_path, capsys):
    out = tmp_path / "envoy.yaml"
    argv = ["envoy-config", "--mode", "cluster", "--endpoints", PODS, "-o", str(out)]
    assert main(argv) == 0 and capsys.readouterr().out == ""
    text = out.read_text()
    assert ec.command_of(text) == argv[1:]
    assert main(argv[:-2]) == 0 and capsys.readouterr().out.split("\n", 1)[1] == text.split("\n", 1)[1]
    assert yaml.safe_load(text) == generate(*argv[1:-2])
    with pytest.raises(ec.ConfigError, match="not made by kvroute envoy-config"):
        ec.command_of("admin: {}\n")


@pytest.mark.parametrize("path", sorted(ENVOY_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_checked_in_configs_are_the_generators_output(path):
    """Each envoy/*.yaml is exactly what the command in its header prints: regenerate, don't edit."""
    text = path.read_text()
    argv = ec.command_of(text)
    command = ["kvroute", "envoy-config", *argv]
    assert ec.render(ec.options_from_command(argv), command) == text, f"regenerate it: {shlex.join(command)}"


def test_checked_in_configs_cover_every_mode():
    modes = {ec.options_from_command(ec.command_of(p.read_text())).mode for p in ENVOY_DIR.glob("*.yaml")}
    assert modes == set(ec.MODES)


def test_mtls_snippet_is_the_generators_transport_socket():
    snippet = yaml.safe_load((ENVOY_DIR / "snippets" / "kvroute-mtls.yaml").read_text())["transport_socket"]
    d = "/etc/kvroute/tls"
    files = ec.TLSFiles(ca=f"{d}/ca.crt", cert=f"{d}/envoy-client.crt", key=f"{d}/envoy-client.key")
    assert snippet == ec.tls_transport_socket(files)


def test_routes_with_their_own_ext_proc_setting():
    cfg = generate("--endpoints", PODS, "--route", "/v1/chat/completions:shadow", "--route", "/v1/embeddings:off")
    shadow, off, routed = routes(cfg)
    assert shadow["match"] == {"prefix": "/v1/chat/completions"} and shadow["route"]["cluster"] == "vllm_pool"
    per_route = shadow["typed_per_filter_config"]["envoy.filters.http.ext_proc"]
    assert per_route["overrides"]["grpc_initial_metadata"] == [{"key": "x-kvroute-rollout", "value": "shadow"}]
    mode = per_route["overrides"]["processing_mode"]  # kvroute learns the pod and usage of what it shadows
    assert (mode["response_header_mode"], mode["response_body_mode"]) == ("SEND", "STREAMED")
    assert shadow["response_headers_to_add"][0]["header"]["key"] == ec.UPSTREAM_HEADER
    assert off["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["disabled"] is True
    assert "response_headers_to_add" not in off  # nothing removes it there: no pod addresses to clients
    assert "response_headers_to_add" not in routed
    assert ext_proc(cfg)["processing_mode"]["response_body_mode"] == "NONE"  # other routes unchanged


def test_shadow_route_names_the_pod_in_the_configs_header(tmp_path):
    path = write_config(tmp_path, {"pools": {"p": {"endpoints": [{"address": "10.0.0.1:8000"}]}},
                                   "rollout": {"upstream_header": "x-pod"}})  # fmt: skip
    (shadow, *_) = routes(generate("--config", path, "--route", "/v1/completions:shadow"))
    assert shadow["response_headers_to_add"][0]["header"]["key"] == "x-pod"


def test_mirror_to_a_shadow_cluster():
    cfg = generate("--endpoints", PODS, "--mirror-to", "envoy.kvroute-shadow:80", "--mirror-fraction", "0.25",
                   "--route", "/v1/embeddings:off")  # fmt: skip
    mirror = clusters(cfg)["mirror"]
    assert hosts(mirror) == ["envoy.kvroute-shadow:80"] and mirror["type"] == "STRICT_DNS"
    for r in routes(cfg):  # every route, whatever kvroute does with it
        (policy,) = r["route"]["request_mirror_policies"]
        assert policy["cluster"] == "mirror"
        assert policy["runtime_fraction"]["default_value"] == {"numerator": 250000, "denominator": "MILLION"}
    assert "mirror" not in clusters(generate("--endpoints", PODS))


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--route", "v1/chat:off"], "--route 'v1/chat:off': expected PREFIX:off|shadow"),
        (["--route", "/v1/chat:maybe"], "expected PREFIX:off|shadow"),
        (["--route", "/v1:off", "--route", "/v1:shadow"], "a path prefix given twice"),
        (["--mirror-fraction", "0.5"], "--mirror-fraction needs --mirror-to"),
        (["--mirror-to", "shadow:80", "--mirror-fraction", "0"], "--mirror-fraction 0: must be > 0 and at most 1"),
        (["--mirror-to", "shadow"], "--mirror-to 'shadow': expected host:port"),
    ],
)
def test_bad_route_and_mirror_options(argv, needle, capsys):
    assert main(["envoy-config", "--endpoints", PODS, *argv]) == 2
    assert needle in capsys.readouterr().err


def test_retries_on_every_pod_route_and_off_with_zero():
    cfg = generate("--mode", "cluster", "--endpoints", PODS, "--retries", "1")
    assert all(r["route"]["retry_policy"]["num_retries"] == 1 for r in routes(cfg))
    assert "lb_policy" in clusters(cfg)["vllm_pool"]  # override_host is EPP mode's only
    assert all("retry_policy" not in r["route"] for r in routes(generate("--endpoints", PODS, "--retries", "0")))
    with pytest.raises(SystemExit):
        ec.options_from_command(["--endpoints", PODS, "--retries", "11"])


def ext_authz(cfg: dict[str, Any]) -> dict[str, Any]:
    (f,) = [f for f in hcm(cfg)["http_filters"] if f["name"] == ec.EXT_AUTHZ]
    return dict(f["typed_config"])


def test_ext_authz_epp_sends_the_whole_body_and_logs_each_request_to_kvroute(tmp_path):
    pools = {"default": {"endpoints": [{"address": "10.0.0.11:8000"}]}}
    config = write_config(tmp_path, {"server": {"max_body_bytes": 4096}, "pools": pools})
    cfg = generate("--api", "ext_authz", "--endpoints", PODS, "--config", config)
    names = [f["name"] for f in hcm(cfg)["http_filters"]]
    assert names == ["envoy.filters.http.header_mutation", ec.EXT_AUTHZ, "envoy.filters.http.router"]
    tc = ext_authz(cfg)
    assert tc["with_request_body"] == {"max_request_bytes": 4096, "allow_partial_message": False, "pack_as_bytes": True}
    assert tc["grpc_service"]["envoy_grpc"]["cluster_name"] == "kvroute" and tc["failure_mode_allow"] is True
    assert "clear_route_cache" not in tc  # EPP: the pool's override_host reads the header at host selection
    (log,) = hcm(cfg)["access_log"]
    common = log["typed_config"]["common_config"]
    assert common["grpc_service"]["envoy_grpc"]["cluster_name"] == "kvroute" and common["transport_api_version"] == "V3"
    # The fallback list comes as the ext_authz filter's own dynamic metadata.
    (policy,) = clusters(cfg)["vllm_pool"]["load_balancing_policy"]["policies"]
    sources = policy["typed_extension_config"]["typed_config"]["override_host_sources"]
    assert sources[0]["metadata"]["key"] == ec.EXT_AUTHZ
    assert sources[1] == {"header": "x-gateway-destination-endpoint"}


def test_ext_authz_cluster_mode_routes_again_on_the_answer():
    tc = ext_authz(generate("--api", "ext_authz", "--mode", "cluster", "--endpoints", PODS))
    assert tc["clear_route_cache"] is True


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--mode", "pd-cluster", "--prefill", PODS, "--decode", "10.0.0.13:8000"], "pd-cluster mode"),
        (["--endpoints", PODS, "--processing-mode", "STREAMED"], "--processing-mode STREAMED"),
        (["--endpoints", PODS, "--read-responses"], "responses are not read"),
        (["--endpoints", PODS, "--route", "/v1/completions:off"], "--route settings"),
    ],
)
def test_ext_authz_refuses_what_it_cannot_do(argv, needle):
    with pytest.raises(ec.ConfigError, match="--api ext_authz") as e:
        generate("--api", "ext_authz", *argv)
    assert needle in str(e.value)


def test_ext_proc_config_unchanged_by_the_api_option():
    assert generate("--endpoints", PODS) == generate("--api", "ext_proc", "--endpoints", PODS)


def test_ext_authz_http_asks_kvroutes_http_port_and_passes_only_routing_headers(tmp_path):
    pools = {"default": {"endpoints": [{"address": "10.0.0.11:8000"}]}}
    config = write_config(tmp_path, {"server": {"authz_http_port": 9010}, "pools": pools})
    cfg = generate("--api", "ext_authz_http", "--kvroute", "10.0.0.5:9002", "--config", config)
    tc = ext_authz(cfg)
    assert "grpc_service" not in tc
    http = tc["http_service"]
    assert http["server_uri"]["uri"] == "http://10.0.0.5:9010" and http["server_uri"]["cluster"] == "kvroute_http"
    response = http["authorization_response"]
    assert [p["exact"] for p in response["allowed_upstream_headers"]["patterns"]] == [
        "x-gateway-destination-endpoint", "x-kvroute-cluster"]  # fmt: skip
    assert [p["exact"] for p in response["dynamic_metadata_from_headers"]["patterns"]] == ["x-kvroute-endpoints"]
    cs = clusters(cfg)
    assert hosts(cs["kvroute_http"]) == ["10.0.0.5:9010"] and "kvroute" in cs  # the access log still uses gRPC
    (policy,) = cs["vllm_pool"]["load_balancing_policy"]["policies"]
    source = policy["typed_extension_config"]["typed_config"]["override_host_sources"][0]["metadata"]
    assert source["key"] == ec.EXT_AUTHZ and source["path"] == [{"key": "x-kvroute-endpoints"}]
    assert hcm(cfg)["access_log"]
    # --kvroute-http-port wins over the config's port
    flag = generate("--api", "ext_authz_http", "--kvroute-http-port", "9011", "--config", config)
    assert ext_authz(flag)["http_service"]["server_uri"]["uri"].endswith(":9011")


def test_ext_authz_http_needs_a_port_and_plain_http():
    with pytest.raises(ec.ConfigError, match="kvroute's HTTP port"):
        generate("--api", "ext_authz_http", "--endpoints", PODS)
    with pytest.raises(ec.ConfigError, match="--api ext_authz_http: pd-cluster mode"):  # each refusal names its api
        generate("--api", "ext_authz_http", "--kvroute-http-port", "9010", "--mode", "pd-cluster",
                 "--prefill", PODS, "--decode", "10.0.0.13:8000")  # fmt: skip
    with pytest.raises(ec.ConfigError, match="plain HTTP to kvroute"):
        generate("--api", "ext_authz_http", "--kvroute-http-port", "9010", "--endpoints", PODS,
                 "--tls-ca", "ca.crt")  # fmt: skip
