"""Host checks of the dense variants' calls (semantics §11.8): InputError naming the argument."""

from __future__ import annotations

from collections.abc import Mapping

from ..mlir.dtypes import kv_dtype_of
from .checks import check_same, check_tensor
from .masks import CallLengths, host_mask


def check_sequence(spec, named: Mapping) -> dict:
    """q [B, Lq, h_q, d], k/v [B, Lk, h_kv, d] in spec.dtype (k/v in its ``kv_dtype`` where it has
    one), by name; returns them checked."""
    q = check_tensor("q", named["q"], dtype=spec.dtype, shape=(None, None, spec.h_q, spec.d))
    k = check_tensor("k", named["k"], dtype=kv_dtype_of(spec), shape=(None, None, spec.h_kv, spec.d))
    v = check_tensor("v", named["v"], dtype=kv_dtype_of(spec), shape=(None, None, spec.h_kv, spec.d))
    check_same("k.shape[0]", k.shape[0], "q.shape[0] (batch)", q.shape[0])
    check_same("v.shape[0]", v.shape[0], "q.shape[0] (batch)", q.shape[0])
    check_same("v.shape[1]", v.shape[1], "k.shape[1] (kv_len)", k.shape[1])
    return {**named, "q": q, "k": k, "v": v}


def check_masked(spec, named: Mapping) -> dict:
    """As :func:`check_sequence`, then the mask rule's arguments (runtime/masks.py): valid_lens [B]
    in [0, min(Lq, Lk)], or with ``mask_mode="custom"`` custom_mask, a bool or uint8 [B, Lq, Lk]
    mask."""
    checked = check_sequence(spec, named)
    q, k = checked["q"], checked["k"]
    return {**checked, **host_mask(spec).check(named, CallLengths.dense(q.shape[0], q.shape[1], k.shape[1]))}
