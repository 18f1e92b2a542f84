"""Merging partial attention states in base 2 (semantics §1.6), as TVM's ``_merge_state_inplace``.

A serving stack attends the new tokens to themselves with the ragged kernel and to the cached
prefix with the paged (or MLA) kernel, then merges the two partial results by their lse:

    out_prefix, lse_prefix = paged(q, ..., causal=0, ...)
    out_new, lse_new       = ragged(q, ..., causal=1, ...)
    out, lse = merge_state(out_prefix, lse_prefix, out_new, lse_new)   # == attention over both

With ``s_max = max(s_a, s_b)`` and ``w_i = 2^(s_i - s_max)``:
``out = (w_a out_a + w_b out_b) / (w_a + w_b)`` and ``lse = s_max + log2(w_a + w_b)``.
A state whose lse is at most -5e4 (a row that saw no valid key, §11.3) weighs exactly 0, so
merging it with anything returns the other state unchanged, and two empty states merge to an
empty state (output 0, lse -5e4), never NaN.

Per-head sinks (semantics §13) enter a row's denominator once, so a stack that splits the KV
merges the partial states of kernels without ``head_sinks`` first, then applies the sinks:

    out, lse = apply_sinks(*merge_state(out_prefix, lse_prefix, out_new, lse_new), sinks)
"""

from __future__ import annotations

import numpy as np

from ..mlir.specs import EMPTY_ROW_LSE as SPEC_EMPTY_ROW_LSE
from .checks import as_array
from .errors import InputError

EMPTY_ROW_LSE = np.float32(SPEC_EMPTY_ROW_LSE)


def merge_state(out_a, lse_a, out_b, lse_b) -> tuple[np.ndarray, np.ndarray]:
    """Merge two partial states of the same rows.

    Parameters
    ----------
    out_a, out_b : ``[..., d]`` float32, float16 or bfloat16 (same shape and dtype)
    lse_a, lse_b : ``[...]`` float32, base 2

    Returns
    -------
    out : ``[..., d]`` in the dtype of ``out_a`` (computed in float32)
    lse : ``[...]`` float32
    """
    out_a, out_b = as_array("out_a", out_a), as_array("out_b", out_b)
    lse_a, lse_b = _lse("lse_a", lse_a, out_a), _lse("lse_b", lse_b, out_a)
    if out_b.shape != out_a.shape or out_b.dtype != out_a.dtype:
        raise InputError(f"out_b: expected shape {out_a.shape} and dtype {out_a.dtype} like out_a, "
                         f"got {out_b.shape} {out_b.dtype}")
    if lse_b.shape != lse_a.shape:
        raise InputError(f"lse_b: expected shape {lse_a.shape} like lse_a, got {lse_b.shape}")
    weight_a, weight_b, s_max = _weights(lse_a, lse_b)
    total = weight_a + weight_b
    both_empty = total == 0
    safe_total = np.where(both_empty, np.float32(1), total)
    merged = (weight_a[..., None] * _zeroed(out_a, weight_a) + weight_b[..., None] * _zeroed(out_b, weight_b))
    out = merged / safe_total[..., None]
    lse = np.where(both_empty, EMPTY_ROW_LSE, s_max + np.log2(safe_total)).astype(np.float32)
    return out.astype(out_a.dtype), lse


def merge_states(outs, lses) -> tuple[np.ndarray, np.ndarray]:
    """Merge any number of partial states (e.g. one per shared-prefix depth), left to right."""
    if len(outs) != len(lses) or not outs:
        raise InputError(f"outs/lses: expected the same non-zero number of states, got {len(outs)} and {len(lses)}")
    out, lse = outs[0], lses[0]
    for out_next, lse_next in zip(outs[1:], lses[1:]):
        out, lse = merge_state(out, lse, out_next, lse_next)
    return as_array("outs[0]", out), as_array("lses[0]", lse)


def _lse(name: str, value, out: np.ndarray) -> np.ndarray:
    lse = as_array(name, value)
    if lse.dtype != np.float32:
        raise InputError(f"{name}: expected dtype float32, got {lse.dtype}")
    if lse.shape != out.shape[:-1]:
        raise InputError(f"{name}: expected shape {out.shape[:-1]} (the output without its last dim), got {lse.shape}")
    return lse


def _weights(lse_a: np.ndarray, lse_b: np.ndarray):
    """Base-2 weights relative to the larger non-empty lse; an empty state gets weight 0."""
    empty_a, empty_b = lse_a <= EMPTY_ROW_LSE, lse_b <= EMPTY_ROW_LSE
    s_a = np.where(empty_a, -np.inf, lse_a).astype(np.float32)
    s_b = np.where(empty_b, -np.inf, lse_b).astype(np.float32)
    s_max = np.maximum(s_a, s_b)
    s_max = np.where(empty_a & empty_b, np.float32(0), s_max)
    with np.errstate(invalid="ignore", over="ignore"):
        weight_a = np.where(empty_a, np.float32(0), np.exp2(s_a - s_max)).astype(np.float32)
        weight_b = np.where(empty_b, np.float32(0), np.exp2(s_b - s_max)).astype(np.float32)
    return weight_a, weight_b, s_max


def _zeroed(out: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """``out`` in float32 with rows of weight 0 set to 0 (so NaN in an empty state cannot leak)."""
    return np.where(weight[..., None] == 0, np.float32(0), out.astype(np.float32))


def apply_sinks(out, lse, sinks) -> tuple[np.ndarray, np.ndarray]:
    """A merged state with per-head sink logits in its denominator (§13), once.

    Parameters
    ----------
    out : ``[..., h_q, d_v]`` float32, float16 or bfloat16
    lse : ``[..., h_q]`` float32, base 2
    sinks : ``[h_q]`` float32, natural-log logits (finite)

    Returns
    -------
    out : ``out 2^lse / (2^lse + e^sink)`` in the dtype of ``out``
    lse : ``log2(2^lse + e^sink)`` float32

    Computed in float64 relative to ``top = max(lse, sink log2 e)``, so neither a large lse nor a
    large sink overflows; a row whose lse is at most -5e4 (no valid key, §11.3) stays as it is.
    """
    out = as_array("out", out)
    lse = _lse("lse", lse, out)
    sinks = as_array("sinks", sinks)
    if sinks.dtype != np.float32 or sinks.shape != lse.shape[-1:]:
        raise InputError(f"sinks: expected float32 of shape {lse.shape[-1:]} (lse's heads), got "
                         f"{sinks.dtype} {sinks.shape}")
    if not np.all(np.isfinite(sinks)):
        raise InputError("sinks: values must be finite")
    state = lse.astype(np.float64)
    sink = sinks.astype(np.float64) / np.log(2.0)
    empty = state <= EMPTY_ROW_LSE
    top = np.where(empty, 0.0, np.maximum(state, sink))
    kept = np.where(empty, 1.0, np.exp2(np.where(empty, 0.0, state - top)))
    total = kept + np.where(empty, 0.0, np.exp2(sink - top))
    new_out = np.where(empty[..., None], out.astype(np.float64), out.astype(np.float64) * (kept / total)[..., None])
    new_lse = np.where(empty, lse, top + np.log2(total)).astype(np.float32)
    return new_out.astype(out.dtype), new_lse
