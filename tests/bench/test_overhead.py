"""bench.overhead's variants: what each runs, checked without starting anything."""

import pytest

from bench.overhead import KVROUTE, NOOP, PLAIN, PRESETS, Variant, _envoy_patch, _server_args, parse_variants


def test_default_run_keeps_the_three_routers_results_imports():
    assert [v.name for v in parse_variants("noop,kvroute")] == [PLAIN, NOOP, KVROUTE]


def test_presets_expand_and_repeats_collapse():
    names = [v.name for v in parse_variants("product,noop,noop/google_grpc")]
    assert names[0] == PLAIN and len(names) == len(set(names))
    assert f"{KVROUTE}/uvloop" in names and f"{NOOP}/google_grpc" in names
    assert all(parse_variants(p) for p in PRESETS)  # every preset is valid


def test_each_kvroute_variant_sits_on_the_floor_with_its_options():
    v = Variant("kvroute", frozenset({"uvloop", "google_grpc"}))
    assert v.name == f"{KVROUTE}/google_grpc/uvloop" and v.floor == f"{NOOP}/google_grpc/uvloop"


@pytest.mark.parametrize(
    "spec,needle",
    [
        ("nginx", "the server is noop or kvroute"),
        ("noop/fast", "unknown option(s) ['fast']"),
        ("kvroute/sync", "kvroute cannot run with ['sync']"),
        ("kvroute/body-only", "kvroute cannot run with ['body-only']"),
        ("noop/sync/uvloop", "one of ['sync', 'uvloop'] at most"),
    ],
)
def test_bad_variants_are_named(spec, needle):
    with pytest.raises(ValueError, match="variant") as e:
        parse_variants(spec)
    assert needle in str(e.value)


def test_options_reach_envoy_and_the_servers():
    body_only = _envoy_patch(Variant("noop", frozenset({"body-only", "partial"})), 9)
    assert body_only["processing_mode"] == {"request_header_mode": "SKIP", "request_body_mode": "BUFFERED_PARTIAL"}
    google = _envoy_patch(Variant("kvroute", frozenset({"google_grpc"})), 9)["ext_proc"]["grpc_service"]
    assert google["google_grpc"]["target_uri"] == "127.0.0.1:9"
    assert _envoy_patch(Variant("kvroute"), 9) == {"processing_mode": {}, "ext_proc": {}}
    assert _server_args(Variant("noop", frozenset({"sync", "nobdp"}))) == [
        "--server", "sync", "--grpc-arg", "grpc.http2.bdp_probe=0"]  # fmt: skip
    assert _server_args(Variant("kvroute")) == ["--event-loop", "asyncio"]  # the old default, named
    assert _server_args(Variant("kvroute", frozenset({"uvloop"}))) == ["--event-loop", "uvloop"]
