"""kvroute: a KV-cache-aware Envoy ext_proc router for vLLM fleets."""

__version__ = "0.1.0"
