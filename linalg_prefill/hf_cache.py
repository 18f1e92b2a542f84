"""A transformers cache whose decode steps write their keys in place (:class:`KvCache`).

transformers' ``DynamicCache`` grows each layer's ``[B, H_kv, S, D]`` keys and values by
``torch.cat`` at every step: a copy of the whole cache per layer per step (two 4 MiB copies a
layer for 2048 cached bf16 keys of 8 heads of 128; docs/performance.md). A
:class:`KvCache` layer keeps its states in buffers ``[B, H_kv, C, D]`` with room for more tokens
and hands the attention views ``[B, H_kv, S, D]`` of their first S rows: a step writes its own
rows only. :func:`linalg_prefill.hf.attention` reads such a view where it lies (the ragged
kernel over the buffer's ``C`` rows a head, the rows past S an entry without queries); any other
attention gets an ordinary strided tensor (torch SDPA and eager read it as they are).

    cache = linalg_prefill.hf.KvCache(model.config)
    model.generate(ids, cache=cache, ...)
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

__all__ = ["KvCache", "ROOM_ROWS", "capacity"]

#: A buffer's rows are a multiple of this, and it leaves at least this much room (or a quarter of
#: its tokens, whichever is more) when it is made: a new buffer (a copy of the cache) every 256
#: steps or more, a quarter more memory at most.
ROOM_ROWS = 256


def capacity(tokens: int) -> int:
    """Rows of a new buffer for ``tokens`` tokens: room for ``max(ROOM_ROWS, tokens // 4)`` more,
    rounded up to a multiple of ROOM_ROWS."""
    wanted = tokens + max(ROOM_ROWS, tokens // 4)
    return -(-wanted // ROOM_ROWS) * ROOM_ROWS


def appended(states: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``states [B, H, S, D]`` with ``new [B, H, n, D]`` after its S rows, as a view of the first
    S + n rows of a buffer ``[B, H, C, D]``: written into the room of the buffer ``states`` is a
    view of, or into a new buffer (of :func:`capacity` rows) that the S rows are copied to first
    (``states`` empty, a buffer full, or states that are not such a view: DynamicLayer's beam
    reordering replaces them with a copy)."""
    tokens = 0 if states.dim() != 4 else states.shape[2]
    buffer = states._base if tokens else None
    if (buffer is None or buffer.dim() != 4 or buffer.data_ptr() != states.data_ptr()
            or buffer.stride() != states.stride() or buffer.shape[:2] != states.shape[:2]
            or buffer.shape[3] != states.shape[3] or buffer.dtype != new.dtype
            or buffer.shape[2] < tokens + new.shape[2]):
        batch, heads, _, dim = new.shape
        buffer = new.new_zeros((batch, heads, capacity(tokens + new.shape[2]), dim))  # the room holds zeros
        if tokens:
            buffer[:, :, :tokens].copy_(states)
    buffer[:, :, tokens:tokens + new.shape[2]].copy_(new)
    return buffer[:, :, :tokens + new.shape[2]]


class InPlaceLayer(DynamicLayer):
    """transformers' ``DynamicLayer`` with its states grown in place (:func:`appended`) instead
    of by concatenation; its other methods (crop, beam reordering, batch selection) work on the
    views as on DynamicLayer's tensors."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = appended(self.keys, key_states)
        self.values = appended(self.values, value_states)
        return self.keys, self.values


class KvCache(DynamicCache):
    """transformers' ``DynamicCache(config=config)`` whose full-attention layers grow in place
    (module docstring); sliding-window layers stay transformers' own. Its tokens are those of a
    DynamicCache: the same keys and values, in other memory."""

    def __init__(self, config):
        super().__init__(config=config)
        self.layers = [InPlaceLayer() if type(layer) is DynamicLayer else layer for layer in self.layers]
