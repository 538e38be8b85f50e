"""A cache layer over a preallocated KV buffer: new tokens are written in place.

transformers' ``DynamicLayer`` appends by concatenation, which copies the
whole layer on every forward pass: for a 4K-token context in fp32 that is
188 MB per generated token, and as much again when the prompt's suffix is
prefilled on top of a loaded prefix. Here the layer's keys and values are
views of a buffer sized for the whole request (prompt plus ``max_tokens``),
so a prefix decoded straight into the buffer becomes the cache without a
copy, and each step writes only its own tokens. A request that outgrows the
buffer gets a larger one (one copy), so the capacity is a hint, not a limit.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer


class BufferLayer(DynamicLayer):
    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """``keys``/``values``: (1, kv_heads, capacity, head_dim); the first ``length`` tokens are valid."""
        super().__init__()
        self._key_buffer, self._value_buffer = keys, values
        self.device = keys.device
        self.is_initialized = True
        self._expose(length)

    def _expose(self, length: int) -> None:
        self.keys = self._key_buffer[:, :, :length]
        self.values = self._value_buffer[:, :, :length]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.keys.shape[-2]
        end = start + key_states.shape[-2]
        if end > self._key_buffer.shape[-2]:
            self._grow(max(end, 2 * self._key_buffer.shape[-2]), start)
        self._key_buffer[:, :, start:end] = key_states
        self._value_buffer[:, :, start:end] = value_states
        self._expose(end)
        return self.keys, self.values

    def _grow(self, capacity: int, length: int) -> None:
        def grown(buffer: torch.Tensor) -> torch.Tensor:
            shape = (*buffer.shape[:2], capacity, buffer.shape[3])
            new = torch.empty(shape, dtype=buffer.dtype, device=buffer.device)
            new[:, :, :length] = buffer[:, :, :length]
            return new

        self._key_buffer, self._value_buffer = grown(self._key_buffer), grown(self._value_buffer)
