"""Prefix indexes: which endpoint holds how many leading blocks of a request."""

from extproc.index.base import EndpointId, PrefixIndex

__all__ = ["EndpointId", "PrefixIndex"]
