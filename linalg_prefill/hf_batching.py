"""transformers' continuous batching (``generate_batch``, ``init_continuous_batching``) on the
kernels, reading the engine's own paged cache in place.

transformers 5.24 runs continuous batching only with ``paged|eager``, ``sdpa`` or a flash
implementation (a name containing "flash", which its flash loader then fetches from the FA
packages or the Hub's ``kernels``): a third-party attention registered with ``AttentionInterface``
is refused, and before each attention call the paged cache copies out every key and value the
batch reads (``index_select`` over ``read_index``). :func:`install` (run by
``linalg_prefill.hf.register()``) adds three hooks, each a wrapper that leaves every other
implementation as it was:

1. ``ContinuousBatchingManager.switch_to_cb_friendly_attn`` keeps a registered linalg_prefill
   implementation (instead of refusing it);
2. ``attn_mask_is_needed`` (continuous_batching/input_outputs.py) is False for it: like flash
   attention, the kernels mask from ``cu_seq_lens_q/k`` (no [T, T + cached] mask is built);
3. ``PagedAttentionCache.update``: for a full-attention layer of ours, transformers writes the new
   rows (its own ``index_copy_``) but reads nothing; the attention then reads the layer's pages
   where they are. A sliding-window layer keeps transformers' read (its ring buffer holds at most
   ``sliding_window - 1`` keys a request, a copy bounded by the window).

The layer's cache is FlashInfer's NHD layout: transformers stores a block of each full-attention
layer as ``[layer 0 K page | layer 0 V page | layer 1 K page | ...]`` (continuous_batching/
cache_allocators/full_attention.py), so from layer ``i``'s first K row the cache tensor is pages
``[P, 2, page_size, h_kv, d]`` and block ``b``'s page of the layer is ``b * layers``: the paged
kernel with ``kv_order="nhd"`` (mlir/kv_layouts.py) reads it through a page table built from
``read_index`` once per batch.

Each call of :func:`varlen_attention` runs one of:

* the paged kernel over the layer's pages (bottom-right causal, decode steps in the serving
  passes), for a full-attention layer whose batch reads cached keys;
* the ragged kernel over the K/V it is given (``cu_seq_lens_k``): a batch of first prefill chunks
  (nothing cached yet), a sliding-window layer (with the window as a custom mask where it binds),
  or a packed varlen call outside continuous batching.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from dataclasses import dataclass

import numpy as np
import torch
from transformers.generation.continuous_batching import continuous_api, input_outputs
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.generation.continuous_batching.cache_allocators import FullAttentionCacheAllocator

from .mlir import PagedPrefillSpec, RaggedPrefillSpec
from .runtime import InputError, PagedPrefillWrapper, RaggedPrefillWrapper
from .torch_ops import DTYPES, kernel_for

__all__ = ["install", "varlen_attention", "LayerPages"]

#: Names registered by linalg_prefill.hf.register(): continuous batching accepts them.
NAMES: set[str] = set()
#: The kwarg the cache hook hands a layer's pages to the attention under.
PAGES_KWARG = "linalg_prefill_pages"


@dataclass(frozen=True)
class LayerPages:
    """A full-attention layer's cache as the paged kernel reads it: ``pages`` [P, 2, page_size,
    h_kv, d] (a view of transformers' cache tensor, no copy), ``read_index`` the batch's
    physical rows of the layer's keys (int64, transformers' own), ``page_size``."""

    pages: torch.Tensor
    read_index: torch.Tensor
    page_size: int


def install(name: str) -> None:
    """Lets continuous batching run implementation ``name`` (module docstring); the hooks are
    installed once per process, the names they know added to :data:`NAMES`."""
    with _install_lock:
        NAMES.add(name)
        if _installed:
            return
        _installed.append(True)
        switch = continuous_api.ContinuousBatchingManager.switch_to_cb_friendly_attn
        mask_needed = input_outputs.attn_mask_is_needed
        update = PagedAttentionCache.update

        def switch_to_cb_friendly_attn(self, model, auto_switch_to_flash: bool = True):
            if model.config._attn_implementation in NAMES:
                return None  # ours runs continuous batching as it is
            return switch(self, model, auto_switch_to_flash)

        def attn_mask_is_needed(config) -> bool:
            return False if config._attn_implementation in NAMES else mask_needed(config)

        def paged_update(self, key_states, value_states, layer_idx: int, kwargs: dict):
            if self.config._attn_implementation not in NAMES or kwargs.get("block_table") is not None:
                return update(self, key_states, value_states, layer_idx, kwargs)
            allocator = self.layer_to_allocator[layer_idx]
            pages = layer_pages(allocator, layer_idx)
            if pages is None:  # a sliding window's ring buffer: transformers reads it
                return update(self, key_states, value_states, layer_idx, kwargs)
            reads = kwargs["read_index"]
            kwargs["read_index"] = [index[:0] for index in reads]  # transformers writes, reads nothing
            try:
                result = update(self, key_states, value_states, layer_idx, kwargs)
            finally:
                kwargs["read_index"] = reads
            read_index = reads[allocator.index]
            if read_index.numel():  # else no request has cached keys: the new K/V are all there is
                kwargs[PAGES_KWARG] = LayerPages(pages, read_index, allocator.tokens_per_page)
            return result

        paged_update.__wrapped__ = update
        continuous_api.ContinuousBatchingManager.switch_to_cb_friendly_attn = switch_to_cb_friendly_attn
        input_outputs.attn_mask_is_needed = attn_mask_is_needed
        PagedAttentionCache.update = paged_update


_install_lock = threading.Lock()
_installed: list = []
_layer_pages: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def layer_pages(allocator, layer_idx: int) -> torch.Tensor | None:
    """Layer ``layer_idx``'s pages [P, 2, page_size, h_kv, d] in ``allocator``'s cache tensor
    (module docstring), or None for an allocator of another layout (a sliding window's)."""
    if type(allocator) is not FullAttentionCacheAllocator:
        return None
    views = _layer_pages.setdefault(allocator, {})
    if layer_idx not in views:
        page, layers = allocator.tokens_per_page, len(allocator.layer_indices)
        if allocator.block_physical_stride != 2 * page * layers:
            return None  # not the block layout this module reads
        rows = allocator.cache_tensor.view(-1, allocator.num_key_value_heads, allocator.head_dim)
        rows = rows[2 * page * allocator.layer_indices.index(layer_idx):]
        views[layer_idx] = rows[:rows.shape[0] // (2 * page) * 2 * page].view(
            -1, 2, page, allocator.num_key_value_heads, allocator.head_dim)
    return views[layer_idx]


def varlen_attention(module, query, key, value, *, cu_seq_lens_q, cu_seq_lens_k, scaling: float,
                     softcap: float | None = None, sliding_window: int | None = None, sinks=None,
                     pages: LayerPages | None = None):
    """Attention of packed sequences: ``query [1, H_q, T, D]`` (request r's queries at rows
    ``cu_seq_lens_q[r]:cu_seq_lens_q[r + 1]``), bottom-right causal per request, ``sliding_window``
    keys at most (transformers': a query sees itself and the ``window - 1`` keys before it).
    Keys come from ``pages`` (a full-attention layer's cache, read in place) or from ``key`` /
    ``value [1, H_kv, T_k, D_v]`` at ``cu_seq_lens_k`` (D_v may differ from D: then from them, not
    from ``pages``). ``sinks``: [H_q] float32 (gpt-oss's s_aux). Returns the output ``[1, T, H_q, D_v]``."""
    _, h_q, total, d = query.shape
    d_v = value.shape[3]
    dtype = DTYPES.get(query.dtype)
    if dtype is None:
        raise InputError(f"query: dtype {query.dtype}; expected one of {sorted(map(str, DTYPES))}")
    q = query.transpose(1, 2).reshape(total, h_q, d)
    cu_q = _int32("cu_seq_lens_q", cu_seq_lens_q)
    cu_k = _int32("cu_seq_lens_k", cu_seq_lens_k)
    cap = float(softcap or 0.0)
    extra = {} if sinks is None else {"sinks": sinks}
    if pages is not None and d_v == d:
        spec = PagedPrefillSpec(h_q, pages.pages.shape[3], d, dtype, page_size=pages.page_size, logits_soft_cap=cap,
                                head_sinks=sinks is not None, kv_order="nhd")
        wrapper = _wrapper(PagedPrefillWrapper, spec)
        key_ = ("paged", pages.read_index.data_ptr(), pages.read_index._version, cu_q.tobytes(), cu_k.tobytes(),
                scaling)
        _plan(wrapper, key_, lambda: _paged_plan(wrapper, pages, cu_q, cu_k, scaling))
        output, _ = wrapper.run(q, pages.pages, **extra)
    else:
        k = key[0].transpose(0, 1)
        v = value[0].transpose(0, 1)
        mask = _window_mask(cu_q, cu_k, sliding_window)
        spec = RaggedPrefillSpec(h_q, k.shape[1], d, d_v, dtype, logits_soft_cap=cap, head_sinks=sinks is not None,
                                 custom_mask=mask is not None)
        wrapper = _wrapper(RaggedPrefillWrapper, spec)
        key_ = ("ragged", cu_q.tobytes(), cu_k.tobytes(), None if mask is None else sliding_window, scaling)
        _plan(wrapper, key_, lambda: wrapper.plan(cu_q, cu_k, causal=True, sm_scale=scaling, custom_mask=mask))
        output, _ = wrapper.run(q, k.contiguous(), v.contiguous(), **extra)
    return output.view(1, total, h_q, d_v)


def planned_decode(spec: RaggedPrefillSpec, args: tuple):
    """The output of a ragged call given in the seed's order (hf._decode_call's: RoPE off, no
    custom mask), run as its wrapper's ``run`` under a plan kept while the index arrays and
    scalars stay the same (the layers of a decode step)."""
    q, q_indptr, k, v, kv_indptr, _q_pos, _k_off, causal, _rotary, _scale, _theta, sm_scale, *rest = args
    scales = dict(zip(("k_scale", "v_scale"), rest[:2])) if spec.kv_dtype else {}  # an 8-bit cache's
    sinks = rest[len(scales):]
    wrapper = _wrapper(RaggedPrefillWrapper, spec)
    key = ("decode", q_indptr.tobytes(), kv_indptr.tobytes(), causal, sm_scale)
    _plan(wrapper, key, lambda: wrapper.plan(q_indptr, kv_indptr, causal=bool(causal), sm_scale=sm_scale))
    output, _ = wrapper.run(q, k, v, **scales, **({"sinks": sinks[0]} if sinks else {}))
    return output


def planned_lane(spec: RaggedPrefillSpec) -> tuple | None:
    """``(wrapper, lane)``: ``spec``'s decode wrapper (:func:`planned_decode`) and its kernel's
    PassLane of the wrapper's current plan (runtime/pass_lane.py), or None where it has none (its
    plan's calls are not one in-order pass call)."""
    wrapper = _wrappers.get(spec)
    plan = None if wrapper is None else wrapper.current_plan
    lane = None if plan is None else wrapper.kernel.lane(plan)
    return None if lane is None else (wrapper, lane)


def _int32(name: str, tensor) -> np.ndarray:
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 1:
        raise InputError(f"{name}: expected a 1-D tensor of cumulative lengths, got {getattr(tensor, 'shape', tensor)}")
    return tensor.detach().to(device="cpu", dtype=torch.int32).numpy()


def _paged_plan(wrapper: PagedPrefillWrapper, pages: LayerPages, cu_q: np.ndarray, cu_k: np.ndarray, scaling: float):
    """The page table of a batch whose request r reads its ``cu_k[r + 1] - cu_k[r]`` keys (cached
    and new, in order) at the rows ``read_index[cu_k[r]:cu_k[r + 1]]`` of the layer's K view: a
    page of the NHD pages every ``page_size`` keys (row // (2 page_size): the layer's K and V
    pages of a block are one page there)."""
    page = pages.page_size
    read_index = pages.read_index.numpy()
    kv_lens = np.diff(cu_k.astype(np.int64))
    counts = -(-kv_lens // page)
    page_indptr = np.concatenate([[0], np.cumsum(counts)])
    within = np.arange(page_indptr[-1]) - np.repeat(page_indptr[:-1], counts)
    first_rows = read_index[np.repeat(cu_k[:-1].astype(np.int64), counts) + within * page]
    page_values = first_rows // (2 * page)
    if np.any(first_rows % (2 * page)):
        raise InputError("read_index: a request's keys do not start its pages (not transformers' full-attention "
                         "block layout)")
    last_page_len = np.where(counts > 0, kv_lens - (counts - 1) * page, 1)
    return wrapper.plan(cu_q, page_indptr.astype(np.int32), page_values.astype(np.int32),
                        last_page_len.astype(np.int32), causal=True, sm_scale=scaling)


def _window_mask(cu_q: np.ndarray, cu_k: np.ndarray, window: int | None) -> np.ndarray | None:
    """The custom mask (semantics §14) of bottom-right causal attention within ``window`` keys,
    each request's [q_len, kv_len] block row-major, or None where the window binds no query (the
    plain causal mask is then the same)."""
    q_lens, kv_lens = np.diff(cu_q.astype(np.int64)), np.diff(cu_k.astype(np.int64))
    if not window or np.all(kv_lens <= window):
        return None
    blocks = []
    for q_len, kv_len in zip(q_lens, kv_lens):
        position = kv_len - q_len + np.arange(q_len)[:, None]
        column = np.arange(kv_len)[None, :]
        blocks.append(((column <= position) & (column > position - window)).reshape(-1))
    return np.concatenate(blocks) if blocks else np.zeros(0, bool)


_wrappers: dict = {}
_plans: dict = {}
_lock = threading.Lock()


def _release() -> None:
    """Drops the wrappers (and their kernels) at exit, before runtime.kernels.release_shared
    (atexit runs the later registration first)."""
    with _lock:
        _wrappers.clear()
        _plans.clear()


atexit.register(_release)


def _wrapper(kind, spec):
    """One wrapper per spec, over the process's kernel of it (torch_ops.kernel_for)."""
    with _lock:
        if spec not in _wrappers:
            _wrappers[spec] = kind(spec, kernel=kernel_for(spec))
        return _wrappers[spec]


def _plan(wrapper, key, make) -> None:
    """Plans ``wrapper`` for the batch ``key`` stands for, unless its current plan is the one
    made for that batch (every layer of a forward shares one plan)."""
    kept = _plans.get(id(wrapper))
    if kept is None or kept[0] != key or kept[1] is not wrapper.current_plan:
        make()
        _plans[id(wrapper)] = (key, wrapper.current_plan)
