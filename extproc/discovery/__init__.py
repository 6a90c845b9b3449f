"""Where endpoints come from: one provider per file (static, file, kubernetes) behind ``Provider``.

A provider publishes whole pools (``publish(pool, endpoints)`` replaces that pool's endpoints); the
registry diffs each set against what it has and nothing else knows where endpoints come from.
"""

from extproc.discovery.base import DiscoveryError, Provider, Publish, make_provider

__all__ = ["DiscoveryError", "Provider", "Publish", "make_provider"]
