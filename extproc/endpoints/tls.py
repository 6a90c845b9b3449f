"""kvroute's own HTTP to the pods (/metrics scrapes, gateway prefill legs): plain or TLS, as
``pods.tls`` and each endpoint's ``scheme`` say, and TLS failures told apart from a pod being down
so that the log names what to fix."""

from __future__ import annotations

import logging
import ssl
from typing import Any

import aiohttp

from extproc.config import EndpointConfig, PodTLSConfig, Scheme

log = logging.getLogger("kvroute.tls")


class PodTLS:
    """The TLS side of pods.tls: which scheme an endpoint is reached by, and the aiohttp request
    options (client context, server name) for an https URL."""

    def __init__(self, cfg: PodTLSConfig | None) -> None:
        self.config = cfg
        self.required = cfg is not None and cfg.enabled
        # Without pods.tls, an endpoint that says https is verified against the system's CAs.
        self.context = cfg.context() if cfg is not None else ssl.create_default_context()
        self.server_name = cfg.server_name if cfg is not None else None
        self.client_cert = cfg is not None and cfg.cert_file is not None
        self._upgraded: set[str] = set()
        if cfg is not None and cfg.insecure_skip_verify:
            log.warning(
                "pods.tls.insecure_skip_verify is ON: kvroute does NOT check the pods' certificates, so anyone "
                "on the path can pose as a pod (its /metrics, its prefill legs' KV hand-off). Testing only."
            )

    def scheme(self, ec: EndpointConfig | None) -> Scheme:
        """https when pods.tls is enabled (an endpoint cannot opt out of it), else the endpoint's own."""
        if self.required:
            if ec is not None and ec.scheme == "http" and ec.address not in self._upgraded:
                self._upgraded.add(ec.address)  # discovery only: a static config with it does not load
                log.warning(
                    "endpoint says scheme http but pods.tls is enabled: reached over https",
                    extra={"fields": {"endpoint": ec.address}},
                )
            return "https"
        return (ec.scheme if ec is not None else None) or "http"

    def request_options(self, url: str) -> dict[str, Any]:
        """aiohttp request keywords for ``url``: the client context (and server name) for https."""
        if not url.startswith("https:"):
            return {}
        opts: dict[str, Any] = {"ssl": self.context}
        if self.server_name is not None:
            opts["server_hostname"] = self.server_name
        return opts

    def failure(self, exc: BaseException) -> str | None:
        """Why a request failed, when TLS is the reason (None otherwise): OpenSSL's words plus the
        setting to look at."""
        reason = tls_reason(exc)
        if reason is None:
            return None
        if "WRONG_VERSION_NUMBER" in reason:
            return f"{reason} (does the pod serve https? pods.tls / the endpoint's scheme)"
        if "CERTIFICATE_REQUIRED" in reason:  # the pod's alert, when it arrives before the hang-up
            return f"{reason} (the pod requires a client certificate: pods.tls.cert_file / key_file)"
        if "certificate verify failed" in reason:
            return f"{reason} (pods.tls: ca_file, server_name)"
        return f"{reason} (pods.tls)"

    def hint(self, url: str, exc: BaseException) -> str:
        """A likely cause of a failure that does not name TLS, to append to its log line."""
        if url.startswith("https:") and isinstance(exc, aiohttp.ServerDisconnectedError) and not self.client_cert:
            # TLS 1.3: a pod that requires a client certificate completes the handshake, then hangs up.
            return " (a pod that requires a client certificate hangs up like this: pods.tls.cert_file / key_file)"
        return ""


def tls_reason(exc: BaseException) -> str | None:
    """The ssl error behind ``exc`` (an aiohttp client error wraps it), as OpenSSL words it; None
    when the failure was not TLS."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        # aiohttp's connector errors subclass the ssl errors they wrap: unwrap them first.
        if isinstance(e, aiohttp.ClientConnectorCertificateError):
            e = e.certificate_error
        elif isinstance(e, aiohttp.ClientConnectorError):
            e = e.os_error
        elif isinstance(e, ssl.SSLCertVerificationError):
            return f"certificate verify failed: {e.verify_message}"
        elif isinstance(e, ssl.SSLError):
            return e.reason or str(e)
        else:
            e = e.__cause__ or e.__context__
    return None
