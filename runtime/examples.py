"""Valid seed-ABI calls built from a variant's argument table (mlir/abi.py), and the one page-table
generator the demo, compare, bench and tests draw paged calls from (runtime/kv_layouts.py's).

    args = example_inputs(spec, np.random.default_rng(0))          # a mixed batch, RoPE on
    args = example_inputs(spec, rng, entries=[(128, 128)] * 4)      # four 128-token prefills
    table = page_table(rng, physical_lens=[40, 0, 9], page_size=16)  # shuffled, 2 spare pages
"""

from __future__ import annotations

import numpy as np

from ..mlir.abi import argument_names, arguments, concrete_dims, ordered
from ..mlir.dtypes import kv_dtype_of
from .checks import NUMPY_DTYPES
from .kv_checks import natural_positions
from .masks import host_mask
from .kv_layouts import CacheHostLayout, PageTable, host_layout, indptr, page_table

__all__ = ["EXAMPLE_ENTRIES", "PageTable", "draw_tensors", "example_inputs", "indptr", "page_table", "uniform"]

# (qo_len, kv_len) per entry of the KV-cache examples: causal rows with no key, several pages, a
# single row, an entry with no KV.
EXAMPLE_ENTRIES = ((5, 3), (12, 40), (1, 9), (3, 0))
# (B, Lq, Lk) of the default dense examples: qo_len > kv_len, so causal rows with no key; the
# masked variant's valid_lens are [17, 5, 0] (whole, partial, empty).
DENSE_EXAMPLE = (3, 20, 17)
# Per-head sink logits (``head_sinks``, the ``f32`` arguments) are drawn uniform in this range:
# from below the scores of [-1, 1) inputs to well above them, so the sink changes every row.
SINK_RANGE = (-2.0, 4.0)
# The per-KV-head scales of an 8-bit KV cache (``k_scale``, ``v_scale``) are drawn uniform in this
# range, after the sinks: the dequantised keys and values lie in (-4, 4).
SCALE_RANGE = (0.25, 4.0)


def example_inputs(spec, rng: np.random.Generator, entries=EXAMPLE_ENTRIES, *, window=None, **given) -> tuple:
    """A valid seed-ABI call for ``spec``, built from its argument table: values in [-1, 1),
    causal, RoPE on where the variant has it (and ``d_qk`` is even), sm_scale 1/sqrt(d_qk).

    ``entries``: (qo_len, kv_len) per batch entry. KV-cache variants get random RoPE offsets
    (queries at the end of their entry's KV) and shuffled pages with 2 unused ones. A
    sliding-window table keeps EXAMPLE_SINKS sinks and evicts EXAMPLE_EVICTED rows per entry
    (runtime/kv_layouts.py), or follows ``window``: (sw_offset, sink) per entry; ``sinks``
    (``head_sinks``) are uniform in SINK_RANGE, then an 8-bit cache's scales in SCALE_RANGE. The
    dense variants take B = len(entries) and the first entry's lengths (DENSE_EXAMPLE for the default entries), the masked
    variant valid_lens min(Lq, Lk) each. A custom mask (semantics §14) lets each query see a key
    with probability 3/4. ``given``: arguments by name that replace the drawn ones
    (``rotary_mode=0``, ``sm_scale=0.125``); tensors are drawn after the index arrays, in the
    table's order, then the custom mask.
    """
    unknown = sorted(set(given) - set(argument_names(spec)))
    if unknown:
        raise TypeError(f"{unknown[0]}: not an argument of {spec.symbol}")
    layout = host_layout(spec)
    if isinstance(layout, CacheHostLayout):
        named, sizes = _kv_cache_batch(spec, layout, rng, entries, window)
    else:
        named, sizes = _dense_batch(entries)
    named.update(causal=1, rotary_mode=1 - spec.d_qk % 2, rope_scale=1.0, rope_theta=1e4, sm_scale=spec.d_qk ** -0.5)
    named.update(draw_tensors(spec, rng, sizes, skip=tuple(given)))
    named.update({arg.name: rng.uniform(*SINK_RANGE, concrete_dims(spec, arg, sizes)).astype(np.float32)
                  for arg in arguments(spec) if arg.kind == "f32" and arg.name not in given})
    named.update({arg.name: rng.uniform(*SCALE_RANGE, concrete_dims(spec, arg, sizes)).astype(np.float32)
                  for arg in arguments(spec) if arg.kind == "scale" and arg.name not in given})
    if "v_scale" in named and "v_scale" not in given and spec.layout.one_scale:
        named["v_scale"] = named["k_scale"]  # keys and values are the same elements (MLA's latent rows)
    if "custom_mask" not in given:
        named.update(host_mask(spec).example(rng, sizes))  # runtime/masks.py
    return ordered(spec, {**named, **given})


def draw_tensors(spec, rng: np.random.Generator, sizes: dict, skip: tuple[str, ...] = ()) -> dict:
    """The call's tensor arguments by name (except ``skip``), uniform in [-1, 1) in the spec's
    dtype (K and V in its KV-cache dtype: an 8-bit cache's values are those rounded to it), drawn
    in the table's order with the table's dims; ``sizes`` gives the symbols (``"B"``, ``"Lq"``,
    ``"Lk"``, ``"P"``)."""
    dtypes = {"tensor": spec.dtype, "kv": kv_dtype_of(spec)}
    return {arg.name: uniform(rng, concrete_dims(spec, arg, sizes), dtypes[arg.kind])
            for arg in arguments(spec) if arg.kind in dtypes and arg.name not in skip}


def uniform(rng: np.random.Generator, shape, dtype: str) -> np.ndarray:
    """Values in [-1, 1) drawn in float64, rounded to ``dtype`` (a spec dtype name)."""
    return rng.uniform(-1.0, 1.0, shape).astype(NUMPY_DTYPES[dtype])


def _dense_batch(entries) -> tuple[dict, dict]:
    batch, qo_len, kv_len = DENSE_EXAMPLE if entries is EXAMPLE_ENTRIES else (len(entries), *entries[0])
    full = min(qo_len, kv_len)
    valid = [full, min(full, 5), 0] if entries is EXAMPLE_ENTRIES else [full] * batch
    return {"valid_lens": np.array(valid, np.int32)}, {"B": batch, "Lq": qo_len, "Lk": kv_len}


def _kv_cache_batch(spec, layout: CacheHostLayout, rng, entries, window) -> tuple[dict, dict]:
    """The index arrays of a KV-cache call by ABI name: the entries' (q_indptr, RoPE positions)
    and the layout's (runtime/kv_layouts.py, ``example_arrays``)."""
    qo_lens, kv_lens = (np.array(x, np.int64).reshape(-1) for x in zip(*entries))
    q_indptr = indptr(qo_lens)
    k_off = (rng.integers(0, 64, len(kv_lens)) + np.maximum(qo_lens - kv_lens, 0)).astype(np.int32)
    q_pos, k_off = natural_positions(q_indptr, kv_lens, k_rope_pos_offset=k_off)
    own, own_sizes = layout.example_arrays(spec, rng, kv_lens, window)
    return ({"q_indptr": q_indptr, "q_rope_position": q_pos, "k_rope_pos_offset": k_off, **own},
            {"Lq": int(q_indptr[-1]), "blocks": qo_lens * kv_lens, **own_sizes})
