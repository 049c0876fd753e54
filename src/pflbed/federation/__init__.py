"""Partitions of a dataset into clients, and which clients take part."""

from pflbed.federation.build import build_federation
from pflbed.federation.federation import ClientSplit, Federation, sample_clients

__all__ = ["ClientSplit", "Federation", "build_federation", "sample_clients"]
