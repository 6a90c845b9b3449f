"""A vLLM-faithful fleet simulator: OpenAI HTTP API, prefix cache, KV events, metrics, P/D, faults.

Run ``python -m bench.sim --help``; from Python::

    async with Fleet(FleetConfig(pods=4, profile="fast")) as fleet:
        fleet.pods[0].url, fleet.pods[0].kv_events_endpoint, fleet.stats()
"""

from bench.sim.cache import PrefixCache, block_hashes
from bench.sim.engine import Engine, SimRequest
from bench.sim.fleet import Fleet, FleetConfig, parse_roles
from bench.sim.pod import PodConfig, SimPod, TLSFiles
from bench.sim.profiles import PROFILES, LatencyProfile, get_profile
from bench.sim.tokenizer import SimTokenizer

__all__ = [
    "PROFILES",
    "Engine",
    "Fleet",
    "FleetConfig",
    "LatencyProfile",
    "PodConfig",
    "PrefixCache",
    "SimPod",
    "SimRequest",
    "SimTokenizer",
    "TLSFiles",
    "block_hashes",
    "get_profile",
    "parse_roles",
]
