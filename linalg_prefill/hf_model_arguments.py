"""What some model families hand transformers' attention interface beyond the common arguments,
turned into what :mod:`linalg_prefill.hf` runs (or refused by name).

* **DeepSeek Sparse Attention** (DeepSeek V3.2, GLM-MoE-DSA, HunYuan V4, Mistral Large 4; their
  ``indexed_attention`` layers): under an attention other than eager and sdpa the model passes
  its indexer's choice as ``indices [B, S_q, top_k]`` (int, key positions) beside the causal
  mask, where eager folds it into the mask. :func:`with_selected_keys` folds it the same way:
  a query sees a key where the mask allows it and the indexer chose it. A prefill then runs the
  mask as a custom mask (every key computed, the unchosen masked); a decode step attends the
  chosen keys gathered (:func:`chosen_keys`: top_k keys read, not the whole cache).
* **Masks the model extends as eager's additive float masks** (DeepSeek V4 appends its
  compressed KV slots' bias, 0 / -inf, to the mask it is given, cast to the mask's dtype: a
  boolean mask would turn the bias inside out, and no mask would drop it):
  :func:`wants_additive_mask` tells :func:`linalg_prefill.hf.attention_mask` to build eager's.
* **Refused** (an InputError naming the argument before any kernel runs): ``position_bias`` (a
  relative-position bias added to the scores), ``block_indices`` (block-sparse attention),
  ``sinks`` that are not one logit a query head (Inkling's per-token sinks), ``indices`` with
  packed sequences; and, when it asks for its mask, a model whose own code computes attention
  without the interface (:func:`check_model`: Bloom, MPT, XGLM would run their eager code on
  this implementation's boolean mask, and never call the kernels).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from .runtime import InputError
from .runtime.key_ranges import rule_ranges

__all__ = ["ADDITIVE_MASK_MODELS", "boolean", "check_model", "chosen_keys", "gathered", "refused_arguments",
           "sinks_argument", "wants_additive_mask", "with_selected_keys"]

#: model_type -> why its attention code needs eager's additive float mask.
ADDITIVE_MASK_MODELS = {
    "deepseek_v4": "its compressed KV slots' bias (0 / -inf) is concatenated to the mask, cast to the mask's dtype",
}

#: Keyword arguments that change what attention computes and that these kernels do not run.
_REFUSED = {
    "position_bias": "a bias added to the scores (relative positions) is not supported",
    "block_indices": "block-sparse attention is not supported",
}


def wants_additive_mask(config) -> bool:
    """Whether the model of ``config`` (a transformers config, or None) computes with its mask as
    eager's additive float mask (:data:`ADDITIVE_MASK_MODELS`)."""
    return getattr(config, "model_type", None) in ADDITIVE_MASK_MODELS


def check_model(config) -> None:
    """InputError naming ``attn_implementation`` for a model (its transformers ``config``) whose
    code computes attention itself: its class supports neither transformers' attention interface
    (``_supports_attention_backend``) nor sdpa, so it reads the mask as eager's and calls no
    attention function (Bloom, MPT, XGLM: their logits silently differed from eager's). A config
    transformers does not map to a model class passes."""
    if config is not None and _computes_attention_itself(type(config)):
        raise InputError(f"attn_implementation: {getattr(config, 'model_type', type(config).__name__)}'s model "
                         "supports neither transformers' attention interface nor sdpa (its class's "
                         "_supports_attention_backend and _supports_sdpa are False): it computes attention in its "
                         "own code and would not run these kernels; load it with attn_implementation='eager'")


@lru_cache(maxsize=None)
def _computes_attention_itself(config_class) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_MAPPING
    try:
        model_class = MODEL_MAPPING[config_class]
    except Exception:  # noqa: BLE001 - not mapped, or its module fails to import: not refused here
        return False
    if isinstance(model_class, (tuple, list)):
        model_class = model_class[0]
    return not model_class.is_backend_compatible() and not getattr(model_class, "_supports_sdpa", False)


def refused_arguments(kwargs: dict) -> None:
    """InputError for a keyword argument of :data:`_REFUSED` that is set."""
    for name, why in _REFUSED.items():
        if kwargs.get(name) is not None:
            raise InputError(f"{name}: {why} by these kernels")


def sinks_argument(s_aux, kwargs: dict, h_q: int):
    """The per-head sink logits of a call: gpt-oss's ``s_aux``, or ``sinks`` where a model names
    them so; ``sinks`` that are not ``h_q`` logits (one a query head) are refused."""
    sinks = kwargs.get("sinks")
    if sinks is None:
        return s_aux
    if s_aux is not None:
        raise InputError("sinks: given with s_aux; expected one of them")
    if not isinstance(sinks, torch.Tensor) or sinks.numel() != h_q:
        raise InputError(f"sinks: expected {h_q} per-head sink logits, got shape "
                         f"{tuple(getattr(sinks, 'shape', ()))} (per-token sinks are not supported)")
    return sinks


def with_selected_keys(indices, attention_mask, batch: int, q_len: int, kv_len: int, *, causal: bool,
                       window: int | None):
    """The boolean mask ``[B, 1, S_q, S_kv]`` of a DeepSeek Sparse Attention call: query ``i`` of
    row ``b`` sees key ``j`` where ``attention_mask`` allows it (a boolean or additive mask, or,
    when None, the bottom-right causal rule with ``window``) and ``j`` is among
    ``indices[b, i]`` (``[B, S_q, top_k]`` key positions; the indexer may list keys the mask
    hides, as eager's fold does, so those stay hidden; -1 lists none, as sparse-attention
    kernels pad a row with fewer keys)."""
    if not isinstance(indices, torch.Tensor) or indices.dim() != 3 or tuple(indices.shape[:2]) != (batch, q_len):
        raise InputError(f"indices: expected [B, S_q, top_k] = [{batch}, {q_len}, top_k] key positions, got "
                         f"{tuple(getattr(indices, 'shape', ()))}")
    if indices.dtype.is_floating_point or indices.dtype == torch.bool:
        raise InputError(f"indices: expected integer key positions, got {indices.dtype}")
    chosen = indices.detach().to(device="cpu", dtype=torch.int64)
    if chosen.numel() and (int(chosen.min()) < -1 or int(chosen.max()) >= kv_len):
        raise InputError(f"indices: key positions must lie in [0, {kv_len}) (or be -1: none), got "
                         f"[{int(chosen.min())}, {int(chosen.max())}]")
    # -1 (none) lands in an extra column, dropped
    selected = torch.zeros((batch, q_len, kv_len + 1), dtype=torch.bool).scatter_(2, chosen % (kv_len + 1), True)
    selected = selected[..., :kv_len]
    return (_allowed(attention_mask, batch, q_len, kv_len, causal, window) & selected).unsqueeze(1)


def chosen_keys(allowed) -> tuple | None:
    """A decode step's chosen keys: ``(order [B, K], counts [B])``, row b's keys that ``allowed
    [B, 1, 1, S_kv]`` lets its query see first, in order (``counts[b]`` of them; the rest of the
    K unread), for :func:`gathered`; None where no row leaves a key out (the call is then one
    over the cache as it lies, read in place). A decode step over more keys than the indexer
    keeps reads top_k of them, not S_kv."""
    seen = allowed[:, 0, 0, :]
    counts = seen.sum(dim=1)
    if int(counts.min()) == seen.shape[1]:
        return None
    width = max(int(counts.max()), 1)
    order = torch.argsort((~seen).to(torch.int8), dim=1, stable=True)[:, :width]   # the seen keys first
    return order, counts.numpy().astype(np.int64)


def gathered(states, order):
    """``states [B, H, S, D]``'s keys ``order [B, K]``: ``[B, H, K, D]``, whole rows
    (``index_select``: 2.5-4x torch's ``gather`` of expanded indices on a Zen 4)."""
    return torch.stack([states[b].index_select(1, order[b]) for b in range(states.shape[0])])


def _allowed(mask, batch: int, q_len: int, kv_len: int, causal: bool, window: int | None) -> torch.Tensor:
    """bool ``[B, S_q, S_kv]``: what ``mask`` (boolean, or additive 0 / very negative; None: the
    causal rule) lets each query see."""
    if mask is None:
        lo, hi = rule_ranges(batch, q_len, kv_len, causal=causal, window=window)
        keys = np.arange(kv_len)
        return torch.from_numpy((keys >= lo[..., None]) & (keys < hi[..., None]))
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[3] < kv_len:
        raise InputError(f"attention_mask: expected [B, 1, S_q, >= S_kv] with indices, got "
                         f"{tuple(getattr(mask, 'shape', ()))}")
    return boolean(mask[:, 0, :, :kv_len].detach().cpu()).expand(batch, q_len, kv_len)


def boolean(mask):
    """A transformers mask as booleans (True: the key is seen): a boolean mask as it is, an
    additive one's 0s; InputError for an additive mask with other values than 0 and very
    negative ones (a bias on the scores)."""
    if mask.dtype == torch.bool:
        return mask
    allowed = mask == 0
    if not bool(((mask <= torch.finfo(mask.dtype).min / 2) | allowed).all()):
        raise InputError("attention_mask: an additive mask with values other than 0 and -inf (a bias) is "
                         "not supported")
    return allowed
