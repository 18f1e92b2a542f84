"""Inline RoPE: :func:`apply_rope` rotates ``x [N, H, D]`` by per-row angles, in float32.

The semantics are those of :func:`linalg_prefill.runtime.rope.apply_rope` (its module docstring
lists every rope type), except that all arithmetic is float32 and the rotated value is rounded to
the input dtype at the end. Three ``linalg.generic`` ops are emitted:

    inverse frequencies  [D/2]      theta^(-2i/D) = exp2(-(2i/D) log2 theta), then the
                                    llama3/llama4/yarn adjustment (constants from rope_scaling),
                                    or LongRoPE's division by its per-pair ext_factors
    cos/sin table        [N, D/2]   c * cos(position * scale * freq) and c * sin(...), once per row
    rotation             [N, H, D]  cos * x + sin * x_rot, every head reading the same table row

so the transcendental cost is ``N * D``, not ``N * H * D``. For the rotation, ``x`` is expanded
to ``[N, H, 2, D/2]`` (rotate-half) or ``[N, H, D/2, 2]`` (interleaved) and the two pair members
``a`` and ``b`` are sliced out as ``[N, H, D/2]`` tensors; the rotation generic iterates over the
expanded output and picks, by the member index ``m``, ``(own, partner) = (a, -b)`` for ``m = 0``
and ``(b, a)`` for ``m = 1``. Every indexing map is a projected permutation.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Callable

import numpy as np

from .ir import (
    affine_map, arith_d, collapse, const_f32, const_i32, const_index, empty, expand, extract_slice, f32,
    generic, i32, insert_slice, ir, linalg_d, math_d, sizes_of, widened,
)
from .specs import INTERLEAVED_ROPE, ROPE_FIELDS

__all__ = ["apply_rope"]

# The rope types of linalg_prefill.runtime.rope; importing it here would be circular
# (runtime -> pipeline -> mlir). tests/test_rope_ir.py runs every type against it.

FreqAdjust = Callable[[ir.Value, ir.Value], ir.Value]


def apply_rope(
    x: ir.Value, positions: ir.Value, *, theta: ir.Value, scale: ir.Value, rope_scaling: Mapping[str, Any],
    rotary_dim: int | None = None,
) -> ir.Value:
    """``x`` rotated by RoPE; tensor ``[N, H, D]`` of x's element type.

    Parameters
    ----------
    x : tensor ``[N, H, D]`` of f32, f16 or bf16 (``N`` static or dynamic, ``H`` and ``D``
        static, ``D`` even).
    positions : tensor ``[N]`` of i32 (the RoPE position of each row), or an i32 scalar
        ``first`` meaning ``positions = first + row``.
    theta, scale : f32 scalars
        Runtime ``rope_theta`` and ``rope_scale`` (the angle uses ``position * scale``).
    rope_scaling : Hugging Face style dict (``{}`` for default RoPE); compile-time constants.
    rotary_dim : partial rotary embedding: only ``x[..., :rotary_dim]`` rotates, as a head of
        that size; the rest is unchanged. None: the whole head.
    """
    rows, heads, head_dim = sizes_of(x)
    if rotary_dim is not None and rotary_dim != head_dim:
        part = extract_slice(x, [0, 0, 0], [rows, heads, rotary_dim])
        rotated = apply_rope(part, positions, theta=theta, scale=scale, rope_scaling=rope_scaling)
        return insert_slice(rotated, x, [0, 0, 0], [rows, heads, rotary_dim])
    if not isinstance(heads, int) or not isinstance(head_dim, int) or head_dim % 2:
        raise ValueError(f"x must be [N, H, D] with static H and even static D, got {x.type}")
    rs = dict(rope_scaling or {})
    kind = _rope_type(rs)
    freqs = _inverse_frequencies(head_dim, theta, kind, rs)
    cos, sin = _cos_sin_table(positions, rows, freqs, scale, _multiplier(kind, rs))
    return _rotate(x, cos, sin, "interleaved" if kind in INTERLEAVED_ROPE else "half")


def _rope_type(rs: Mapping[str, Any]) -> str:
    """"default" when ``rope_type`` is absent or None; ValueError for an unknown type."""
    kind = rs.get("rope_type")
    if kind is None:
        return "default"
    if kind not in ROPE_FIELDS:
        raise ValueError(f"unsupported rope_scaling['rope_type']: {kind!r}")
    return kind


def _inverse_frequencies(head_dim: int, theta: ir.Value, kind: str, rs: Mapping[str, Any]) -> ir.Value:
    """f32 tensor ``[D/2]``: the angle per unit of scaled position for each pair ``i`` (LongRoPE's
    ``ext_factors``, a constant ``[D/2]``, divide it)."""
    log2_theta = math_d.log2(theta)
    adjust = _frequency_adjustment(head_dim, log2_theta, kind, rs)
    factors = rs.get("ext_factors") if kind == "longrope" else None
    if factors is not None and len(factors) != head_dim // 2:
        raise ValueError(f"rope_scaling: longrope ext_factors has {len(factors)} factors for {head_dim // 2} pairs")

    def body(*args):
        i = arith_d.uitofp(f32(), arith_d.index_cast(i32(), linalg_d.IndexOp(0).result))
        exponent = arith_d.divf(arith_d.addf(i, i), const_f32(float(head_dim)))
        base = _exp2(arith_d.negf(arith_d.mulf(exponent, log2_theta)))
        freq = adjust(i, base)
        return [freq if factors is None else arith_d.divf(freq, args[0])]

    out = empty([head_dim // 2], f32())
    if factors is None:
        return generic([], [out], [affine_map(1, (0,))], "p", body)[0]
    table_type = ir.RankedTensorType.get([head_dim // 2], f32())
    table = arith_d.constant(table_type, ir.DenseElementsAttr.get(np.asarray(factors, np.float32), type=table_type))
    return generic([table], [out], [affine_map(1, (0,))] * 2, "p", body)[0]


def _exp2(x: ir.Value) -> ir.Value:
    """``2^x`` for f32 ``x >= -126`` as ``exp2(x - n) * 2^n``, ``n = roundeven(x)``.

    IREE's ``math.exp2`` is within 1.4 half-ulps on [-0.5, 0.5] but drifts to 9.5 half-ulps on
    [-20, 0]; ``2^n`` is exact (built from its exponent bits).
    """
    n = math_d.roundeven(x)
    bits = arith_d.shli(arith_d.addi(arith_d.fptosi(i32(), n), const_i32(127)), const_i32(23))
    return arith_d.mulf(math_d.exp2(arith_d.subf(x, n)), arith_d.bitcast(f32(), bits))


def _frequency_adjustment(head_dim: int, log2_theta: ir.Value, kind: str, rs: Mapping[str, Any]) -> FreqAdjust:
    """``(i, base) -> freq`` for ``kind``; ``i`` is the f32 pair index, ``base = theta^(-2i/D)``."""
    if kind in ("llama3", "llama4"):
        return _llama_adjustment(rs)
    if kind == "yarn":
        return _yarn_adjustment(head_dim, log2_theta, rs)
    return lambda _i, base: base


def _llama_adjustment(rs: Mapping[str, Any]) -> FreqAdjust:
    """llama3/llama4: smooth blend of ``f`` and ``f / factor`` (or the step form if hff == lff)."""
    factor = const_f32(float(rs["factor"]))
    lff = float(rs["low_freq_factor"])
    hff = float(rs["high_freq_factor"])
    orig = float(rs["original_max_position_embeddings"])
    if hff == lff:
        two_pi, long_wave = const_f32(2.0 * math.pi), const_f32(orig / lff)

        def step(_i, f):
            is_long = arith_d.cmpf(arith_d.CmpFPredicate.OGT, arith_d.divf(two_pi, f), long_wave)
            return arith_d.select(is_long, arith_d.divf(f, factor), f)

        return step
    a = const_f32(orig / (2.0 * math.pi * (hff - lff)))
    b = const_f32(lff / (hff - lff))

    def smooth(_i, f):
        s = _clamp01(arith_d.subf(arith_d.mulf(a, f), b))
        return _blend(arith_d.divf(f, factor), f, s)

    return smooth


def _yarn_adjustment(head_dim: int, log2_theta: ir.Value, rs: Mapping[str, Any]) -> FreqAdjust:
    """yarn: ``f / factor`` blended into ``f`` by a linear ramp over the pair index."""
    factor = const_f32(float(rs["factor"]))
    low, high = _yarn_ramp_bounds(head_dim, log2_theta, rs)
    width = arith_d.subf(high, low)

    def ramp(i, f):
        mask = arith_d.subf(const_f32(1.0), _clamp01(arith_d.divf(arith_d.subf(i, low), width)))
        return _blend(arith_d.divf(f, factor), f, mask)

    return ramp


def _yarn_ramp_bounds(head_dim: int, log2_theta: ir.Value, rs: Mapping[str, Any]) -> tuple[ir.Value, ir.Value]:
    """f32 scalars ``(low, high)`` of the yarn ramp; runtime values when ilts depends on theta.

    With ``truncate`` the unclamped bounds are floored and ceiled (``math.floor`` / ``math.ceil``
    of the f32 values), as transformers does by default.
    """
    orig = float(rs["original_max_position_embeddings"])
    beta_fast = float(rs.get("beta_fast") or 32.0)
    beta_slow = float(rs.get("beta_slow") or 1.0)
    if rs.get("inv_theta_log_scale") is None:  # 1 / (2 ln theta)
        ilts = arith_d.divf(const_f32(1.0), arith_d.mulf(const_f32(2.0 * math.log(2.0)), log2_theta))
    else:
        ilts = const_f32(float(rs["inv_theta_log_scale"]))
    low = arith_d.mulf(const_f32(head_dim * math.log(orig / (2.0 * math.pi * beta_fast))), ilts)
    high = arith_d.mulf(const_f32(head_dim * math.log(orig / (2.0 * math.pi * beta_slow))), ilts)
    if rs.get("truncate"):
        low, high = math_d.floor(low), math_d.ceil(high)
    low = arith_d.maximumf(low, const_f32(0.0))
    high = arith_d.minimumf(high, const_f32(head_dim - 1.0))
    same = arith_d.cmpf(arith_d.CmpFPredicate.OEQ, low, high)
    return low, arith_d.select(same, arith_d.addf(high, const_f32(0.001)), high)


def _clamp01(v: ir.Value) -> ir.Value:
    return arith_d.minimumf(arith_d.maximumf(v, const_f32(0.0)), const_f32(1.0))


def _blend(f_low: ir.Value, f_high: ir.Value, weight: ir.Value) -> ir.Value:
    """``f_low * (1 - weight) + f_high * weight``."""
    keep = arith_d.subf(const_f32(1.0), weight)
    return arith_d.addf(arith_d.mulf(f_low, keep), arith_d.mulf(f_high, weight))


def _multiplier(kind: str, rs: Mapping[str, Any]) -> float:
    """The cos/sin magnitude ``c``: longrope and yarn attention factors (yarn's explicit
    ``attention_factor``, else ``0.1 ln(factor) + 1``), 1 otherwise."""
    if kind == "longrope":
        orig = float(rs["original_max_position_embeddings"])
        ratio = float(rs["max_position_embeddings"]) / orig
        return math.sqrt(1.0 + math.log(ratio) / math.log(orig)) if ratio > 1.0 else 1.0
    if kind == "yarn" and rs.get("attention_factor") is not None:
        return float(rs["attention_factor"])
    if kind == "yarn":
        factor = float(rs["factor"])
        return 0.1 * math.log(factor) + 1.0 if factor > 1.0 else 1.0
    return 1.0


def _cos_sin_table(
    positions: ir.Value, rows: int | ir.Value, freqs: ir.Value, scale: ir.Value, multiplier: float
) -> tuple[ir.Value, ir.Value]:
    """f32 tensors ``cos, sin [N, D/2]``: ``c * cos(position * scale * freqs[i])`` and its sin.

    ``positions`` is an i32 tensor ``[N]`` or an i32 scalar ``first`` (row ``n`` is at
    ``first + n``); ``rows`` is ``N`` (int or index Value); ``freqs`` is f32 ``[D/2]``.
    """
    pairs = ir.RankedTensorType(freqs.type).shape[0]
    per_row = isinstance(positions.type, ir.RankedTensorType)
    inputs = ([positions] if per_row else []) + [freqs]
    maps = ([affine_map(2, (0,))] if per_row else []) + [affine_map(2, (1,))] + [affine_map(2, (0, 1))] * 2
    c = const_f32(multiplier)

    def body(*args):
        pos, freq = args[:2] if per_row else (row_position(positions), args[0])
        s = arith_d.mulf(arith_d.sitofp(f32(), pos), scale)
        angle = _reduce_two_pi(arith_d.mulf(s, freq))
        cos, sin = math_d.cos(angle), math_d.sin(angle)
        return [cos, sin] if multiplier == 1.0 else [arith_d.mulf(c, cos), arith_d.mulf(c, sin)]

    outs = [empty([rows, pairs], f32()), empty([rows, pairs], f32())]
    cos, sin = generic(inputs, outs, maps, "pp", body)
    return cos, sin


def _two_pi_parts(bits: int = 8) -> tuple[float, float, float]:
    """2 pi as ``c1 + c2 + c3``: c1 and c2 with ``bits`` significant bits, c3 the f32 rest."""
    parts, rest = [], 2.0 * math.pi
    for _ in range(2):
        step = 2.0 ** (math.floor(math.log2(rest)) - bits + 1)
        parts.append(round(rest / step) * step)
        rest -= parts[-1]
    return parts[0], parts[1], rest


def _reduce_two_pi(angle: ir.Value) -> ir.Value:
    """``angle - 2 pi k`` in ``[-pi, pi]`` (f32, Cody-Waite with a three-part 2 pi).

    IREE's ``math.cos``/``math.sin`` lose accuracy for large arguments (measured 2.3e-4 at
    |angle| ~ 8e3 against 2e-7 on [0, 2 pi]). ``k * c1`` and ``k * c2`` are exact for
    ``|k| < 2^16``, so the reduction adds no error beyond the last, ~1e-7, term.
    """
    k = math_d.roundeven(arith_d.mulf(angle, const_f32(1.0 / (2.0 * math.pi))))
    for part in _two_pi_parts():
        angle = arith_d.subf(angle, arith_d.mulf(k, const_f32(part)))
    return angle


def row_position(first: ir.Value) -> ir.Value:
    """i32 ``first + n`` inside a generic whose loop 0 is the row ``n``."""
    return arith_d.addi(first, arith_d.index_cast(i32(), linalg_d.IndexOp(0).result))


def _rotate(x: ir.Value, cos: ir.Value, sin: ir.Value, pairing: str) -> ir.Value:
    """``cos * x + sin * x_rot`` of ``x [N, H, D]`` with tables ``[N, D/2]``; x's element type.

    ``x`` is viewed as ``[N, H, 2, D/2]`` (half) or ``[N, H, D/2, 2]`` (interleaved); loop
    ``member`` (2 or 3) walks the two members of each pair.
    """
    rows, heads, head_dim = sizes_of(x)
    elem = ir.RankedTensorType(x.type).element_type
    member = 2 if pairing == "half" else 3
    split = [rows, heads, 2, head_dim // 2] if member == 2 else [rows, heads, head_dim // 2, 2]
    x4 = expand(x, [[0], [1], [2, 3]], split)
    a, b = _pair_member(x4, member, 0), _pair_member(x4, member, 1)
    pair_dims = (0, 1, 5 - member)  # loops (n, h, pair index)
    maps = [affine_map(4, pair_dims)] * 2 + [affine_map(4, (0, 5 - member))] * 2
    maps.append(affine_map(4, (0, 1, 2, 3)))

    def body(xa, xb, cos_v, sin_v, _out):
        first = arith_d.cmpi(arith_d.CmpIPredicate.eq, linalg_d.IndexOp(member).result, const_index(0))
        xa, xb = widened(xa), widened(xb)
        own = arith_d.select(first, xa, xb)
        partner = arith_d.select(first, arith_d.negf(xb), xa)
        out = arith_d.addf(arith_d.mulf(cos_v, own), arith_d.mulf(sin_v, partner))
        return [out if elem == f32() else arith_d.truncf(elem, out)]

    rotated = generic([a, b, cos, sin], [empty(split, elem)], maps, "pppp", body)[0]
    return collapse(rotated, [[0], [1], [2, 3]])


def _pair_member(x4: ir.Value, member: int, which: int) -> ir.Value:
    """``[N, H, D/2]``: member ``which`` of every pair of the expanded ``x4`` (axis ``member``)."""
    sizes = sizes_of(x4)
    offsets = [0, 0, 0, 0]
    offsets[member] = which
    sizes[member] = 1
    groups = [[0], [1], [2, 3]]
    return collapse(extract_slice(x4, offsets, sizes), groups)

