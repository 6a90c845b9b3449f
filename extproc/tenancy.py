"""Tenant isolation down to vLLM: a per-tenant ``cache_salt`` set in the request body.

vLLM mixes a request's ``cache_salt`` into its first KV block's hash, so requests with different
salts never share cached blocks (its defence against prefix-cache timing side channels). kvroute
derives each tenant's salt as HMAC-SHA256(secret, tenant): stable across replicas and restarts
(routing history and the pods' caches stay valid), unguessable without the secret, so one tenant
cannot pick another's salt. The precise index keys the request with the same salt
(``precise_seed(req.cache_salt)``), so its predictions hold for salted requests too.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import replace

from extproc.config import TenancyConfig
from extproc.errors import MalformedBody
from extproc.request import InferenceRequest

# Domain separation: the secret may be shared with other uses.
_CONTEXT = b"kvroute cache_salt v1\x1f"


class TenantSalter:
    """Applies ``tenancy`` to parsed requests. Holds the secret; never logs or exposes it."""

    def __init__(self, cfg: TenancyConfig) -> None:
        self.cfg = cfg
        self._secret = cfg.read_secret() if cfg.cache_salt == "inject" else b""

    def __repr__(self) -> str:  # the secret stays out of any debug output
        return f"TenantSalter(cache_salt={self.cfg.cache_salt!r}, client_cache_salt={self.cfg.client_cache_salt!r})"

    def salt(self, tenant: str) -> str:
        return hmac.new(self._secret, _CONTEXT + tenant.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()

    def apply(self, req: InferenceRequest) -> InferenceRequest:
        """``req`` with the tenant's salt in its body (``rewritten``), left as it is, or MalformedBody."""
        if req.body is None or not req.is_inference:
            return req
        sent = "cache_salt" in req.body
        if sent and self.cfg.client_cache_salt == "refuse":
            raise MalformedBody("cache_salt is set by the gateway, not by clients", param="cache_salt")
        if self.cfg.cache_salt != "inject" or (sent and self.cfg.client_cache_salt == "keep"):
            return req
        salt = self.salt(req.tenant)
        return replace(req, cache_salt=salt, body={**req.body, "cache_salt": salt}, rewritten=True)
