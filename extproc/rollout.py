"""Shadow mode and gradual rollout: which requests kvroute steers ("enforced") and which it only
decides and measures ("shadow"), by a stable hash of the conversation.

A conversation is one route key: its explicit route/session id, else its prompt's first block (model,
tenant and the first characters or tokens), which every turn repeats. Hashing it against the enforced
fraction puts all of a conversation in one arm, in every replica, so a canary compares two arms of
the same traffic."""

from __future__ import annotations

from typing import Literal

from extproc.config import Config
from extproc.hashing import chain, seed_key
from extproc.request import InferenceRequest

Arm = Literal["enforced", "shadow"]
# gRPC metadata on Envoy's ext_proc stream (a route's ExtProcPerRoute grpc_initial_metadata, written by
# `kvroute envoy-config --route PREFIX:shadow`): "shadow" shadows the request whatever the config's
# fractions. Clients cannot set it: it is not a request header.
ROLLOUT_METADATA = "x-kvroute-rollout"
_SALT = b"kvroute-rollout-arm"  # decorrelates the arm from the key's other uses (rendezvous order)
_SCALE = float(1 << 64)


def arm_of(config: Config, req: InferenceRequest, route_key: int | None, keys: list[int]) -> Arm:
    fraction = config.enforce_fraction_for(req.model)
    if fraction >= 1.0:
        return "enforced"
    if fraction <= 0.0:
        return "shadow"
    key = route_key if route_key is not None else keys[0] if keys else seed_key("request", req.request_id)
    return "enforced" if chain(key, _SALT) / _SCALE < fraction else "shadow"
