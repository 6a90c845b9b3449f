"""A kvroute policy with one setting changed (``POLICY~VARIANT``), run side by side with the default."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from bench import __main__ as bench_main
from bench import harness
from extproc.config import build_config


def test_the_variant_is_split_off_last():
    assert harness.config_variant("kvroute-approx:h2~hold") == ("kvroute-approx:h2", harness.CONFIG_VARIANTS["hold"])
    assert harness.config_variant("kvroute-precise@2+redis~hold-m20")[0] == "kvroute-precise@2+redis"
    assert harness.config_variant("sglang-router") == ("sglang-router", {})
    with pytest.raises(ValueError, match="VARIANT one of hold"):
        harness.config_variant("kvroute-approx~nope")
    with pytest.raises(ValueError, match="KVROUTE_POLICY"):
        harness.config_variant("sglang-router~hold")  # a peer has no kvroute settings


def test_the_cli_takes_variants_of_kvroute_policies_only():
    names = "kvroute-approx:h2~hold,kvroute-precise:authz@2~hold-m20,kvroute-approx"
    assert bench_main._policies(names) == names.split(",")
    with pytest.raises(SystemExit, match="KVROUTE_POLICY"):
        bench_main._policies("round-robin~hold")
    with pytest.raises(SystemExit, match="ext_authz over HTTP runs one kvroute"):
        bench_main._policies("kvroute-approx:authz_http@2~hold")


def test_the_variant_reaches_kvroutes_config(tmp_path: Path):
    """As open_router writes it: the variant's settings merged into the user's file's sections (not over
    them), the run's settings last."""
    user = tmp_path / "user.yaml"
    user.write_text(yaml.safe_dump({"routing": {"block_chars": 128, "hold": {"max_s": 0.5}}}))
    own = {"pools": {"p": {"endpoints": [{"address": "10.0.0.1:8000"}]}}}
    for key in harness.CONFIG_VARIANTS:
        path = tmp_path / f"{key}.yaml"
        harness._write_config(own, path, str(user), chars_per_token=5.0,
                              variant=harness.config_variant(f"kvroute-approx~{key}")[1])  # fmt: skip
        cfg = build_config(yaml.safe_load(path.read_text()))
        held = True if key.startswith("hold") else False if key == "no-hold" else None
        assert cfg.routing.hold.enabled is held and cfg.routing.chars_per_token == 5.0
        assert cfg.routing.block_chars == 128 and cfg.routing.hold.max_s == 0.5  # the user's settings kept
        assert cfg.headers.route_id_fields == (["prompt_cache_key"] if key == "cache-key" else [])
    assert build_config(own).routing.hold.enabled is None  # the default the plain policy runs: on where scraped
    assert harness.CONFIG_VARIANTS["hold-m20"]["routing"]["hold"]["margin"] == 0.2
