"""The shape a model's KV chunks must have; decoded chunks are checked against it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVGeometry:
    layers: int
    kv_heads: int
    head_dim: int

    def chunk_shape(self, tokens: int) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.kv_heads, tokens, self.head_dim)
