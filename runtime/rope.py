"""RoPE frequency math in float64 numpy (semantics §4 with the §11.5 decisions).

This is the reference RoPE used by :mod:`linalg_prefill.runtime.reference` and by the tests.
Everything is computed in float64; nothing is rounded to float32.

Notation
--------
``D`` is the rotary dimension (the head dim, or ``rotary_dim`` for partial rotary), ``j`` in
``[0, D)`` an element index, ``i`` in ``[0, D/2)`` a pair index, ``theta`` the runtime
``rope_theta`` and ``s = position * rope_scale`` the scaled position (the position is
**multiplied** by ``rope_scale``).

Every variant is written as ``out = cos * x + sin * x_rot`` where ``cos``/``sin`` are the
per-element tables returned by :func:`rope_cos_sin` (any magnitude multiplier is already folded
into them) and ``x_rot`` depends on the pairing (:func:`rope_pairing`):

* ``"half"`` (rotate-half / NeoX), pairs ``(j, j + D/2)``::

      x_rot[j] = -x[j + D/2]   if j < D/2
               =  x[j - D/2]   otherwise
      pair index of j: i = j mod D/2

* ``"interleaved"`` (GPT-J), pairs ``(2i, 2i + 1)``::

      x_rot[2i]     = -x[2i + 1]
      x_rot[2i + 1] =  x[2i]
      pair index of j: i = j // 2

In both layouts the two members of a pair get the same angle, so every pair is rotated by
``angle(s, i)`` (and scaled by the multiplier ``c``, 1 except for longrope and yarn).

Frequencies per ``rope_scaling["rope_type"]`` (``e(i) = 2i / D``)::

    absent / "default"  half         angle = s * theta^-e(i)
    "gptj"              interleaved  angle = s * theta^-e(i)
    "llama3"            half         f = theta^-e(i)
                                     if hff != lff:
                                         a = orig / (2 pi (hff - lff)),  b = lff / (hff - lff)
                                         smooth = clamp(a f - b, 0, 1)
                                         angle = s * ((1 - smooth) f / factor + smooth f)
                                     else (step form, as HF):
                                         angle = s * (f / factor if 2 pi / f > orig / lff else f)
    "llama4"            interleaved  same formulas as llama3 (interleaved pair index)
    "longrope"          half         angle = s * theta^-e(i) / ext_factors[i]  (ext_factors: 1 if absent)
                                     c = sqrt(1 + ln(M / orig) / ln(orig)) if M / orig > 1 else 1
    "yarn"              half         p = theta^e(i), f_extra = 1 / p, f_inter = 1 / (factor p)
                                     lo = D ln(orig / (2 pi beta_fast)) * ilts
                                     hi = D ln(orig / (2 pi beta_slow)) * ilts
                                     lo, hi = floor(lo), ceil(hi)  only if truncate
                                     low = max(lo, 0),  high = min(hi, D - 1)
                                     high += 0.001 if low == high
                                     mask = 1 - clamp((i - low) / (high - low), 0, 1)
                                     angle = s * (f_inter (1 - mask) + f_extra mask)
                                     c = attention_factor if given,
                                         else 0.1 ln(factor) + 1 if factor > 1 else 1

with ``factor``, ``low_freq_factor`` (lff), ``high_freq_factor`` (hff),
``original_max_position_embeddings`` (orig), ``max_position_embeddings`` (M), ``beta_fast``,
``beta_slow`` and ``inv_theta_log_scale`` (ilts) read from ``rope_scaling``.  For yarn, ``ilts``
defaults to ``1 / (2 ln theta)`` computed from the ``rope_theta`` passed here (it is a runtime
argument), and ``beta_fast``/``beta_slow`` default to 32 and 1 as in HF (a 0 or None too).
``truncate`` (default False, the seed's ramp) and ``attention_factor`` (default
``0.1 ln(factor) + 1``, the seed's multiplier) are optional; the Hugging Face loader
(``pipeline/model_config.py``) always writes both, which gives transformers' yarn exactly:
``truncate`` True unless the config says false, and ``attention_factor`` as transformers derives
it (given, else from ``mscale``/``mscale_all_dim``, else ``0.1 ln(factor) + 1``).  The yarn ramp uses the
pair index ``i = j mod D/2`` (§11.5), not the raw ``j`` of the seed (§9.6).  The seed's gptj,
llama4 and yarn forms differ from these on purpose (§11.5); default, llama3 and longrope match it.
Any other ``rope_type`` raises :class:`ValueError`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np

__all__ = [
    "ROPE_TYPES",
    "rope_type",
    "rope_pairing",
    "rope_pair_angles",
    "rope_cos_sin",
    "rotate",
    "apply_rope",
]

#: rope_type values accepted in ``rope_scaling`` (``None`` stands for "key absent"), and those
#: that pair dims (2i, 2i+1): mlir/specs.py's, stated again for the oracle (reference.py).
ROPE_TYPES = (None, "default", "gptj", "llama3", "llama4", "longrope", "yarn")
INTERLEAVED_ROPE = frozenset({"gptj", "llama4"})

Pairing = Literal["half", "interleaved"]


def rope_type(rope_scaling: Mapping[str, Any] | None) -> str:
    """Normalised rope type of ``rope_scaling``.

    ``None``, a dict without ``"rope_type"`` (or with ``None`` there) and ``"default"`` all give
    ``"default"``.
    Raises ``ValueError`` for an unknown type.
    """
    if not rope_scaling or rope_scaling.get("rope_type") is None:
        return "default"
    kind = rope_scaling["rope_type"]
    if kind not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_scaling['rope_type']: {kind!r}")
    return kind


def rope_pairing(rope_scaling: Mapping[str, Any] | None) -> Pairing:
    """``"interleaved"`` for gptj/llama4, ``"half"`` (rotate-half) for every other type."""
    return "interleaved" if rope_type(rope_scaling) in INTERLEAVED_ROPE else "half"


def _llama_freqs(f: np.ndarray, rs: Mapping[str, Any]) -> np.ndarray:
    factor = float(rs["factor"])
    lff = float(rs["low_freq_factor"])
    hff = float(rs["high_freq_factor"])
    orig = float(rs["original_max_position_embeddings"])
    if hff == lff:
        wavelength = 2.0 * math.pi / f
        return np.where(wavelength > orig / lff, f / factor, f)
    a = orig / (2.0 * math.pi * (hff - lff))
    b = lff / (hff - lff)
    smooth = np.clip(a * f - b, 0.0, 1.0)
    return (1.0 - smooth) * f / factor + smooth * f


def _yarn_freqs(i: np.ndarray, head_dim: int, theta: float, rs: Mapping[str, Any]):
    """(frequencies ``[D/2]``, multiplier) of yarn; see the module docstring."""
    factor = float(rs["factor"])
    orig = float(rs["original_max_position_embeddings"])
    beta_fast = float(rs.get("beta_fast") or 32.0)
    beta_slow = float(rs.get("beta_slow") or 1.0)
    ilts = rs.get("inv_theta_log_scale")
    ilts = 1.0 / (2.0 * math.log(theta)) if ilts is None else float(ilts)
    p = theta ** (2.0 * i / head_dim)
    f_extra = 1.0 / p
    f_inter = 1.0 / (factor * p)
    low = head_dim * math.log(orig / (2.0 * math.pi * beta_fast)) * ilts
    high = head_dim * math.log(orig / (2.0 * math.pi * beta_slow)) * ilts
    if rs.get("truncate"):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0.0), min(high, head_dim - 1.0)
    if low == high:
        high += 0.001
    mask = 1.0 - np.clip((i - low) / (high - low), 0.0, 1.0)
    freqs = f_inter * (1.0 - mask) + f_extra * mask
    if rs.get("attention_factor") is not None:
        return freqs, float(rs["attention_factor"])
    return freqs, 0.1 * math.log(factor) + 1.0 if factor > 1.0 else 1.0


def rope_pair_angles(
    positions: np.ndarray,
    *,
    head_dim: int,
    rope_theta: float,
    rope_scale: float,
    rope_scaling: Mapping[str, Any] | None,
) -> tuple[np.ndarray, float]:
    """Rotation angle of every pair, and the cos/sin multiplier.

    Parameters
    ----------
    positions : int array ``[n]``
        RoPE positions (before ``rope_scale``).
    head_dim : int
        ``D``, even.

    Returns
    -------
    angles : float64 ``[n, D/2]``
        ``angles[t, i] = positions[t] * rope_scale * inv_freq[i]`` for pair ``i``.
    mult : float
        Multiplier applied to both cos and sin (longrope / yarn attention factor, else 1).
    """
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
    kind = rope_type(rope_scaling)
    rs = rope_scaling or {}
    theta = float(rope_theta)
    i = np.arange(head_dim // 2, dtype=np.float64)
    base = theta ** (-2.0 * i / head_dim)
    mult = 1.0
    if kind in ("default", "gptj"):
        freqs = base
    elif kind in ("llama3", "llama4"):
        freqs = _llama_freqs(base, rs)
    elif kind == "longrope":
        factors = rs.get("ext_factors")
        if factors is not None and len(factors) != head_dim // 2:
            raise ValueError(f"rope_scaling: longrope ext_factors has {len(factors)} factors for {head_dim // 2} pairs")
        freqs = base if factors is None else base / np.asarray(factors, dtype=np.float64)
        ratio = float(rs["max_position_embeddings"]) / float(rs["original_max_position_embeddings"])
        if ratio > 1.0:
            orig = float(rs["original_max_position_embeddings"])
            mult = math.sqrt(1.0 + math.log(ratio) / math.log(orig))
    elif kind == "yarn":
        freqs, mult = _yarn_freqs(i, head_dim, theta, rs)
    else:  # pragma: no cover - rope_type() already rejected it
        raise ValueError(f"unsupported rope_type {kind!r}")
    s = np.asarray(positions, dtype=np.float64).reshape(-1) * float(rope_scale)
    return s[:, None] * freqs[None, :], mult


def rope_cos_sin(
    positions: np.ndarray,
    *,
    head_dim: int,
    rope_theta: float,
    rope_scale: float,
    rope_scaling: Mapping[str, Any] | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Per-element cos/sin tables such that ``out = cos * x + sin * rotate(x)``.

    Parameters
    ----------
    positions : int array ``[n]``
    head_dim : int
        ``D``.
    rope_theta, rope_scale : float
        Runtime scalars; the angle uses ``positions * rope_scale``.
    rope_scaling : dict or None
        See the module docstring.

    Returns
    -------
    cos, sin : float64 ``[n, D]``
        Element ``j`` holds ``mult * cos(angle(pair(j)))`` (resp. sin), with
        ``pair(j) = j mod D/2`` for rotate-half and ``j // 2`` for interleaved pairing.
    """
    angles, mult = rope_pair_angles(
        positions,
        head_dim=head_dim,
        rope_theta=rope_theta,
        rope_scale=rope_scale,
        rope_scaling=rope_scaling,
    )
    if rope_pairing(rope_scaling) == "half":
        per_elem = np.concatenate([angles, angles], axis=-1)
    else:
        per_elem = np.repeat(angles, 2, axis=-1)
    return mult * np.cos(per_elem), mult * np.sin(per_elem)


def rotate(x: np.ndarray, pairing: Pairing) -> np.ndarray:
    """``x_rot`` of ``x [..., D]`` for the given pairing (see the module docstring)."""
    x = np.asarray(x, dtype=np.float64)
    d = x.shape[-1]
    if pairing == "half":
        h = d // 2
        return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)
    if pairing == "interleaved":
        out = np.empty_like(x)
        out[..., 0::2] = -x[..., 1::2]
        out[..., 1::2] = x[..., 0::2]
        return out
    raise ValueError(f"unknown pairing {pairing!r}")


def apply_rope(
    x: np.ndarray,
    positions: np.ndarray,
    *,
    rope_theta: float,
    rope_scale: float,
    rope_scaling: Mapping[str, Any] | None,
    rotary_dim: int | None = None,
) -> np.ndarray:
    """Rotate ``x`` in float64.

    Parameters
    ----------
    x : array ``[n, heads, D]``
        Any float dtype (float16, bfloat16, float32, float64); converted to float64.
    positions : int array ``[n]``
        Position of each row; multiplied by ``rope_scale``.
    rotary_dim : int or None
        Partial rotary embedding (Hugging Face's ``partial_rotary_factor * head_dim``): only the
        first ``rotary_dim`` elements rotate, as a head of that size (its frequencies computed
        over ``rotary_dim``); the rest pass unchanged. None: the whole head.

    Returns
    -------
    float64 ``[n, heads, D]``: ``cos[:, None, :] * x + sin[:, None, :] * rotate(x)``.
    """
    x = np.asarray(x).astype(np.float64)
    if x.ndim != 3:
        raise ValueError(f"x must be [n, heads, D], got shape {x.shape}")
    if rotary_dim is not None and rotary_dim != x.shape[-1]:
        rotated = apply_rope(x[..., :rotary_dim], positions, rope_theta=rope_theta, rope_scale=rope_scale,
                             rope_scaling=rope_scaling)
        return np.concatenate([rotated, x[..., rotary_dim:]], axis=-1)
    positions = np.asarray(positions).reshape(-1)
    if positions.shape[0] != x.shape[0]:
        raise ValueError(f"positions has {positions.shape[0]} rows, x has {x.shape[0]}")
    cos, sin = rope_cos_sin(
        positions,
        head_dim=x.shape[-1],
        rope_theta=rope_theta,
        rope_scale=rope_scale,
        rope_scaling=rope_scaling,
    )
    return cos[:, None, :] * x + sin[:, None, :] * rotate(x, rope_pairing(rope_scaling))
