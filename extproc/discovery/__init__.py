"""Where endpoints come from: one provider per file (static, file, kubernetes) behind ``Provider``.

A provider publishes whole pools (``publish(pool, endpoints)`` replaces that pool's endpoints); the
registry diffs each set against what it has and nothing else knows where endpoints come from.
"""

from extproc.config import Config
from extproc.discovery.base import DiscoveryError, Provider, Publish

__all__ = ["DiscoveryError", "Provider", "Publish", "make_provider"]


def make_provider(config: Config) -> Provider:
    d = config.discovery
    if d.provider == "file":
        from extproc.discovery.file import FileProvider

        assert d.file is not None
        return FileProvider(d.file)
    if d.provider == "kubernetes":
        from extproc.discovery.kubernetes import KubernetesProvider

        assert d.kubernetes is not None
        return KubernetesProvider(d.kubernetes, config.kv_events)
    from extproc.discovery.static import StaticProvider

    return StaticProvider(config)
