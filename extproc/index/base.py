"""The one interface every prefix index implements (approximate, event-driven, Redis-shared)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

EndpointId = str
"""An endpoint is named by its ``ip:port`` address, exactly as Envoy sees it (the EPP protocol's
x-gateway-destination-endpoint, matched by override_host)."""


class PrefixIndex(Protocol):
    """Maps chained block keys to the endpoints that (probably) hold them in their KV cache."""

    def match(self, keys: Sequence[int], endpoints: Iterable[EndpointId]) -> dict[EndpointId, int]:
        """Number of *leading* blocks of ``keys`` each endpoint holds (endpoints with 0 may be absent)."""
        ...

    def record(self, keys: Sequence[int], endpoint: EndpointId, ended: bool = True) -> None:
        """Note that ``endpoint`` is about to hold ``keys`` (it was just routed this prefix). ``ended``:
        the prompt ends with these keys (False: a head decided on before the rest was tokenized, whose
        last block is not where the prompt ended; index/ends.py)."""
        ...

    def continues(self, keys: Sequence[int], held: int) -> bool:
        """Whether the first ``held`` blocks of ``keys`` run to where a recorded prompt ended (a
        conversation's next turn), not to where prompts sharing a prefix branch apart (index/ends.py)."""
        ...

    def remove_endpoint(self, endpoint: EndpointId) -> None:
        """Forget everything about an endpoint (removed from the pool, or restarted)."""
        ...
