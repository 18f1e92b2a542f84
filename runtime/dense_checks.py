"""Host checks of the dense variants' calls (semantics §11.8): InputError naming the argument."""

from __future__ import annotations

import numpy as np

from .checks import check_int32, check_mask, check_range, check_same, check_tensor


def check_sequence(spec, q, k, v) -> tuple[np.ndarray, ...]:
    """q [B, Lq, h_q, d], k/v [B, Lk, h_kv, d], all in spec.dtype."""
    q = check_tensor("q", q, dtype=spec.dtype, shape=(None, None, spec.h_q, spec.d))
    k = check_tensor("k", k, dtype=spec.dtype, shape=(None, None, spec.h_kv, spec.d))
    v = check_tensor("v", v, dtype=spec.dtype, shape=(None, None, spec.h_kv, spec.d))
    check_same("k.shape[0]", k.shape[0], "q.shape[0] (batch)", q.shape[0])
    check_same("v.shape[0]", v.shape[0], "q.shape[0] (batch)", q.shape[0])
    check_same("v.shape[1]", v.shape[1], "k.shape[1] (kv_len)", k.shape[1])
    return q, k, v


def check_masked(spec, q, k, v, valid_lens) -> tuple[np.ndarray, ...]:
    """As :func:`check_sequence`, then valid_lens [B] in [0, min(Lq, Lk)], or with
    ``mask_mode="custom"`` (the argument is then custom_mask) a bool or uint8 [B, Lq, Lk] mask."""
    q, k, v = check_sequence(spec, q, k, v)
    if spec.mask_mode == "custom":
        return q, k, v, check_mask("custom_mask", valid_lens, shape=(q.shape[0], q.shape[1], k.shape[1]))
    valid_lens = check_int32("valid_lens", valid_lens, shape=(q.shape[0],))
    check_range("valid_lens", valid_lens, 0, min(q.shape[1], k.shape[1]))
    return q, k, v, valid_lens
