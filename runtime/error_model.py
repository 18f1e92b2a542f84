"""How far a kernel's results may be from the float64 reference: a bound on every output element
and every lse value of one call, derived from that call's inputs and the arithmetic the kernels
do (docs/semantics.md §12 states the model and why each term is there).

    bound = compare.error_bound(spec, args, want)                # the spec's CallFacts filled in
    out_excess, lse_excess = bound.excess(kernel(*args), want)   # both <= 0: within the bound

This module needs numpy and the float64 reference only (``reference.py``, ``rope.py`` and
``kv_layouts.py`` beside it), so the GPU bundle carries it too (bench/gpu_bundle.py).

The kernels compute in float32 from inputs in the spec's dtype (unit roundoff ``u``: 2^-24,
2^-11, 2^-8); RoPE rotates q and k in float32 and rounds the rotated values to the dtype
(§4). For a query row i that sees n_i keys, the error of each of its scores (natural units,
after sm_scale) is at most

    delta_i = S_i (D + 3) u32                          products, sums, scale and log2 e
            + S_rot_i (2 u + u^2)                      rotated q and k rounded to the dtype
            + scale c^2 sum_p |q_ip| K_p 2 dtheta_p    the f32 rotation angle of pair p
            + 4 u32 cap                                soft cap (cap * tanh(s / cap))
            + (n_tiles + 3) 8 u32                      exp2 of every weight, online rescaling

with S_i = scale |q~_i| max_j |k~_j| (Cauchy-Schwarz over the rotated rows; S_rot_i the same
over their rotated dims, c the rope multiplier, K_p the largest key pair norm), and the softmax
weights move by a factor within exp(+-2 delta_i). Then

    |output - reference| <= (exp(2 delta_i) - 1 + 2 gamma_n + u_P) A_id + (u + 2 u32) |o_id| + s/2
                            + n_i t32 max_j |v_jd|
    |lse - reference|    <= log2(e) (delta_i + 2 gamma_n + 4 u32) + 2 u32 |lse_i|

where A_id = sum_j p_ij |v_jd| (the reference with |v|; max |v| for MLA, whose values are part
of its keys), n_i comes from the reference with q = 0 (its lse is log2 n_i), gamma_n =
n u32 / (1 - n u32) (the f32 sums over n keys), u_P = u for f16/bf16 (the fused lowering feeds
the softmax weights to the tensor cores in the dtype, the llvm-cpu packed bf16 tiles to a bf16 mmt4d), (u + 2 u32) |o_id| + s/2 is the
result's rounding to the dtype (s its smallest subnormal: float16's 2^-24, so a float16 output
of 9e-11 is stored as 0); t32 = 2^-126, the smallest normal f32: a weight below it (relative to
the row's largest, which is 1) may be flushed to 0 (the CPUs' kernels run with denormals
flushed), which moves an output by less than t32 |v_jd| per key, invisible unless the weighted
values are themselves that small (peaked scores over an 8-bit cache's exact zeros: an output of
1e-38 computed as 0). Rows without a visible key are exact (output 0, lse -5e4, §11.3) and
carry no bound.

Per-head sinks (§13) add one positive term w_s = 2^(sink log2 e - m) to each row's denominator,
in the final normalisation only. Its exponent is sink log2 e (the product rounded: u32 of it)
less the row max (u32 of the difference), so w_s moves by a factor within
exp(delta_s), delta_s = (2 |sink| + 2 |m| + 4) u32 natural units with exp2's own error, and
|m| <= S_i + |cap| is already inside delta_i's S_i (D + 3) u32 term; adding 2 |sink| u32 + 4 u32
to delta_i therefore moves every weight of the row, w_s included, within exp(+-2 delta_i) as
before. The normalised weights p_ij = w_ij / (sum w + w_s) then sum to less than 1, so the
output term (exp(2 delta_i) - 1) A_id still bounds the weights' share, with A_id the reference's
sum_j p_ij |v_jd| (sink included: it only shrinks it); the denominator has n_i + 1 terms
(gamma_{n+1}), and the lse's log2 of that sum keeps its terms. n_i is counted without the sink.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from .dtypes import HOST_DTYPES
from .kv_layouts import host_layout
from .reference import EMPTY_ROW_LSE
from .rope import rope_pair_angles, rope_pairing

__all__ = ["CallFacts", "ErrorBound", "UNIT_ROUNDOFF", "bound_of_call", "merge_bound", "rotation_bound",
           "sinks_bound"]

#: Each spec dtype's unit roundoff (runtime/dtypes.py).
UNIT_ROUNDOFF = {name: dtype.unit_roundoff for name, dtype in HOST_DTYPES.items()}
U32 = UNIT_ROUNDOFF["float32"]
#: The smallest normal float32: weights below it may be flushed to 0.
TINY32 = float(np.finfo(np.float32).tiny)
LOG2E = 1.0 / math.log(2.0)
#: The shortest KV tile of any lowering (spec tiles, serving-pass chunks, fused bands): the
#: online softmax rescales its running sums at most once per this many keys.
SHORTEST_KV_TILE = 16

#: (output, lse) of a call given its arguments by ABI name: the float64 reference.
Reference = Callable[[dict], tuple]


@dataclass(frozen=True)
class CallFacts:
    """What the model needs of a call's spec (plain values, so a GPU bundle can carry them):
    ``kv_layout`` (a name in kv_layouts.HOST_LAYOUTS: dense, ragged, paged, latent), ``d_v``,
    the compile-time ``sm_scale`` of the dense variants (None: the call's argument),
    ``logits_soft_cap``, ``rope_scaling`` (a dict) and ``rotary_dim`` (None: the whole head), and
    the spec's ``kv_tile`` (None for a pass)."""

    dtype: str
    kv_layout: str
    d_v: int
    sm_scale: float | None = None
    logits_soft_cap: float = 0.0
    rope_scaling: Mapping | None = None
    rotary_dim: int | None = None
    kv_tile: int | None = None


@dataclass(frozen=True)
class ErrorBound:
    """``output`` and ``lse``: float64 arrays shaped like the reference's, the largest
    |result - reference| each element may show (0 on rows without a visible key, which must be
    exact). ``valid``: bool like lse, the rows with a visible key."""

    output: np.ndarray
    lse: np.ndarray
    valid: np.ndarray

    def excess(self, got, want) -> tuple[float, float]:
        """max(|got - want| - bound) of output and of lse over the rows with a visible key: at
        most 0 when the call is within its bound (-inf when no row has a key)."""
        out, lse = _errors(got, want)
        return (float(np.max((out - self.output)[self.valid], initial=-np.inf)),
                float(np.max((lse - self.lse)[self.valid], initial=-np.inf)))

    def holds(self, got, want) -> bool:
        """Whether every element of ``got`` is within the bound of ``want`` (NaN is not)."""
        return all(excess <= 0 for excess in self.excess(got, want))

    def worst(self, got, want) -> float:
        """The largest error / bound of output and lse (NaN when any error is)."""
        return float(np.max(self.ratio(got, want)))

    def ratio(self, got, want) -> tuple[float, float]:
        """max(|got - want| / bound) of output and lse over the rows with a visible key."""
        out, lse = _errors(got, want)
        return (float(np.max(out[self.valid] / self.output[self.valid], initial=0.0)),
                float(np.max(lse[self.valid] / self.lse[self.valid], initial=0.0)))


def _errors(got, want) -> tuple[np.ndarray, np.ndarray]:
    (got_out, got_lse), (want_out, want_lse) = ((np.asarray(x, np.float64) for x in pair) for pair in (got, want))
    return np.abs(got_out - want_out), np.abs(got_lse - want_lse)


def bound_of_call(named: dict, facts: CallFacts, reference: Reference, want=None) -> ErrorBound:
    """The bound of one call: its arguments by ABI name (numpy arrays and scalars), its spec's
    ``facts``, its ``reference`` and (optionally) the reference's (output, lse) of ``named``."""
    want_out, want_lse = (np.asarray(x, np.float64) for x in (reference(named) if want is None else want))
    u = UNIT_ROUNDOFF[facts.dtype]
    keys, values = _keys_and_values(named, facts)
    n = _keys_seen(named, reference)
    terms = n + 1 if "sinks" in named else n  # the sink is one more term of the sum
    gamma = terms * U32 / (1.0 - terms * U32)
    delta = _score_error(named, facts, keys, n) + _sink_error(named)
    weights = _weighted_values(named, facts, values, reference, want_out.shape)
    u_p = 0.0 if u <= U32 else u  # probabilities rounded to the dtype: none in float32
    spread = np.expm1(2.0 * delta) + 2.0 * gamma + u_p
    flushed = n[..., None] * TINY32 * float(np.nanmax(np.abs(values), initial=0.0))   # weights under TINY32
    rounded = (u + 2.0 * U32) * np.abs(want_out) + _half_subnormal(facts.dtype)   # to the dtype, gradual underflow
    output = spread[..., None] * weights + rounded + flushed
    lse = LOG2E * (delta + 2.0 * gamma + 4.0 * U32) + 2.0 * U32 * np.abs(want_lse)
    valid = want_lse != EMPTY_ROW_LSE
    return ErrorBound(np.where(valid[..., None], output, 0.0), np.where(valid, lse, 0.0), valid)


def _half_subnormal(dtype: str) -> float:
    """Half the smallest positive subnormal of ``dtype``: the absolute error of rounding a value
    below its normal range (float16's 2^-25: an output of 9e-11 is stored as 0)."""
    import ml_dtypes   # its finfo knows bfloat16 too; imported when a bound is asked for, as dtypes.py does

    return float(ml_dtypes.finfo(HOST_DTYPES[dtype].numpy).smallest_subnormal) / 2.0


# ----------------------------------------------------------------------------- the call's pieces


def _keys_and_values(named: dict, facts: CallFacts) -> tuple[np.ndarray, np.ndarray]:
    """Every key row [N, d_qk] and value row [N, d_v] the call's cache holds (all heads, pages
    in use or not), in float64; the maxima below skip NaN (a cache's unused slots may hold it)."""
    k, v = host_layout(facts.kv_layout).keys_and_values(named, facts.d_v)
    return tuple(np.asarray(x, np.float64).reshape(-1, x.shape[-1]) for x in (k, v))


def _sink_error(named: dict) -> float:
    """The sink's share of delta_i (module docstring): (2 max_h |sink_h| + 4) u32, 0 without
    sinks (the largest sink for every row: a serving pass's rows are not in head order)."""
    if "sinks" not in named:
        return 0.0
    return (2.0 * float(np.max(np.abs(np.asarray(named["sinks"], np.float64)), initial=0.0)) + 4.0) * U32


def _keys_seen(named: dict, reference: Reference) -> np.ndarray:
    """n_i, shaped like lse: the keys each query row sees (its lse with q = 0 and no sink is
    log2 n_i; at least 1: rows without a key carry no bound). RoPE is off in that run: with q = 0
    every score is 0 (NaN where a key is not finite) rotated or not, so the rotation is waste."""
    no_sink = {"sinks": np.full(np.shape(named["sinks"]), -np.inf)} if "sinks" in named else {}
    no_rope = {"rotary_mode": 0} if "rotary_mode" in named else {}
    _, lse = reference(dict(named, q=np.zeros_like(named["q"]), **no_sink, **no_rope))
    return np.maximum(np.rint(np.exp2(np.asarray(lse, np.float64))), 1.0)


def _score_error(named: dict, facts: CallFacts, keys: np.ndarray, n: np.ndarray) -> np.ndarray:
    """delta_i (module docstring), shaped like lse: the largest error of a score of row i."""
    q = np.asarray(named["q"], np.float64)
    scale = float(named["sm_scale"]) if facts.sm_scale is None else facts.sm_scale
    d_qk = q.shape[-1]
    n_tiles = np.ceil(n / min(facts.kv_tile or SHORTEST_KV_TILE, SHORTEST_KV_TILE))
    delta = (n_tiles + 3) * 8.0 * U32 + 4.0 * U32 * facts.logits_soft_cap
    if int(named.get("rotary_mode", 0)) != 1:
        return delta + scale * np.linalg.norm(q, axis=-1) * _largest_norm(keys) * (d_qk + 3) * U32
    return delta + scale * _rotated_score_error(named, facts, q, keys, n)


def _rotated_score_error(named: dict, facts: CallFacts, q: np.ndarray, keys: np.ndarray, n: np.ndarray):
    """The score error of a rotating call over sm_scale: products and sums, the rotated values'
    rounding and the rotation angles (module docstring)."""
    u, d_qk = UNIT_ROUNDOFF[facts.dtype], q.shape[-1]
    rot = facts.rotary_dim or d_qk
    theta = float(named["rope_theta"])
    unit_angles, mult = rope_pair_angles(np.ones(1), head_dim=rot, rope_theta=theta,
                                         rope_scale=float(named["rope_scale"]), rope_scaling=facts.rope_scaling)
    pairing = rope_pairing(facts.rope_scaling)
    q_pairs, k_pairs = _pair_norms(q[..., :rot], pairing), _pair_norms(keys[:, :rot], pairing)
    rot_q = mult * np.sqrt(np.sum(q_pairs ** 2, axis=-1))
    rot_k = mult * np.sqrt(np.sum(k_pairs ** 2, axis=-1))
    q_norm = np.sqrt(rot_q ** 2 + np.sum(q[..., rot:] ** 2, axis=-1))
    k_norm = np.nanmax(np.sqrt(rot_k ** 2 + np.sum(keys[:, rot:] ** 2, axis=-1)), initial=0.0)
    angle_error = _angle_errors(_largest_position(named, n) * np.abs(unit_angles[0]), float(named["rope_scale"]), theta,
                                facts.rope_scaling)
    angles = mult ** 2 * np.sum(q_pairs * (np.nanmax(k_pairs, axis=0, initial=0.0) * 2.0 * angle_error), axis=-1)
    rounding = 2.0 * u + u * u  # the rotated q and k rounded to the dtype
    return q_norm * k_norm * (d_qk + 3) * U32 + rot_q * np.nanmax(rot_k, initial=0.0) * rounding + angles


def _angle_errors(angles: np.ndarray, rope_scale: float, rope_theta: float, rope_scaling) -> np.ndarray:
    """The error of the f32 angle of each pair p ([..., D/2], ``angles`` the exact ones): the
    angle is s * f_p with s = position * rope_scale (rounded unless rope_scale is a power of
    two) and f_p = 2^-x_p, x_p = (2p / D) log2 theta, whose exp2 and frequency adjustments cost
    (3 + ln2 x_p) u32 relative, times what llama3's smoothing amplifies (f_0 = 1 exactly, and
    s * f_0 is exact), LongRoPE's division by its f32-rounded ext_factors 1 u32 more (f_0 too),
    then the mod-2 pi reduction, cos and sin 4 u32."""
    pairs = angles.shape[-1]
    x_p = 2.0 * np.arange(pairs) / (2 * pairs) * math.log2(max(rope_theta, 2.0))
    mantissa, _ = math.frexp(abs(rope_scale)) if rope_scale else (0.5, 0)
    scaled = 0.0 if mantissa == 0.5 else 0.5
    relative = (3.0 + math.log(2.0) * x_p) * _smoothing_gain(2.0 ** -x_p, rope_scaling) + 0.5
    frequency = np.where(np.arange(pairs) == 0, 0.0, relative)
    if dict(rope_scaling or {}).get("ext_factors") is not None:  # LongRoPE's divisors: rounded to f32, a division
        frequency = frequency + 1.0
    return np.abs(angles) * (scaled + frequency) * U32 + 4.0 * U32


def _smoothing_gain(base: np.ndarray, rope_scaling) -> np.ndarray:
    """[D/2]: how much llama3's (and llama4's) smoothed frequency f' = f ((1 - s) / factor + s),
    s = a f - b, magnifies a relative error of the base frequency f (1 elsewhere)."""
    rs = dict(rope_scaling or {})
    if rs.get("rope_type") not in ("llama3", "llama4") or rs["high_freq_factor"] == rs["low_freq_factor"]:
        return np.ones_like(base)
    factor, lff, hff = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
    a = float(rs["original_max_position_embeddings"]) / (2.0 * math.pi * (hff - lff))
    smooth = a * base - lff / (hff - lff)
    inside = (smooth > 0.0) & (smooth < 1.0)
    ratio = (1.0 - smooth) / factor + smooth
    return np.where(inside, 1.0 + a * base * (1.0 - 1.0 / factor) / np.where(inside, ratio, 1.0), 1.0)


def rotation_bound(x, positions, *, dtype: str, rope_theta: float, rope_scale: float, rope_scaling=None,
                   exact=None) -> np.ndarray:
    """The largest |kernel - reference| of each element of RoPE applied to ``x [N, ..., D]`` at
    ``positions [N]`` (mlir/rope.py against runtime/rope.py, which gives ``exact``): each pair
    rotated by an angle off by :func:`_angle_errors`, in f32 (4 u32 of the pair's norm), the
    result rounded to ``dtype``."""
    x = np.asarray(x, np.float64)
    head_dim = x.shape[-1]
    angles, mult = rope_pair_angles(positions, head_dim=head_dim, rope_theta=rope_theta, rope_scale=rope_scale,
                                    rope_scaling=rope_scaling)
    pairing = rope_pairing(rope_scaling)
    pair_norms = _pair_norms(x, pairing)  # [N, ..., D/2]
    errors = _angle_errors(angles.reshape(angles.shape[0], *([1] * (x.ndim - 2)), -1), rope_scale, rope_theta,
                           rope_scaling)
    per_pair = mult * pair_norms * (errors + 4.0 * U32)
    per_element = np.concatenate([per_pair, per_pair], axis=-1) if pairing == "half" else np.repeat(per_pair, 2, axis=-1)
    return per_element + UNIT_ROUNDOFF[dtype] * (np.abs(np.asarray(exact, np.float64)) + per_element)


def _largest_norm(rows: np.ndarray) -> float:
    return float(np.nanmax(np.linalg.norm(rows, axis=-1), initial=0.0))


def _pair_norms(x: np.ndarray, pairing: str) -> np.ndarray:
    """|x_p| of every rotation pair p of ``x [..., D]`` ([..., D/2])."""
    if pairing == "half":
        half = x.shape[-1] // 2
        first, second = x[..., :half], x[..., half:]
    else:
        first, second = x[..., 0::2], x[..., 1::2]
    return np.sqrt(first ** 2 + second ** 2)


def _largest_position(named: dict, n: np.ndarray) -> float:
    """The largest RoPE position of any row: a query's, or an entry's offset plus its keys."""
    q_pos = np.abs(np.asarray(named["q_rope_position"], np.int64))
    k_off = np.abs(np.asarray(named["k_rope_pos_offset"], np.int64))
    return float(max(q_pos.max(initial=0), k_off.max(initial=0) + n.max(initial=0)))


def _weighted_values(named: dict, facts: CallFacts, values: np.ndarray, reference: Reference,
                     shape: tuple) -> np.ndarray:
    """A_id = sum_j p_ij |v_jd|, shaped like the output: the reference run with |v| where the
    layout's values are a tensor of their own, else max |v| (MLA)."""
    absolute = host_layout(facts.kv_layout).with_absolute_values(named)
    if absolute is None:
        return np.full(shape, float(np.nanmax(np.abs(values), initial=0.0)))
    return np.asarray(reference(absolute)[0], np.float64)


def merge_bound(outs, lses) -> tuple[np.ndarray, np.ndarray]:
    """(output, lse) bounds of merging the states ``outs`` [..., d] / ``lses`` [...] one after
    the other (runtime/merge.py, f32) against the float64 merge of the same states: each merge
    takes two exp2 weights (2 u32 each), their sum, two products and a division (8 u32 of the
    merged |out| in all) and log2 of the sum (4 u32 + u32 |lse|); an error e already in the lse
    of a state moves its weight by a factor within 2^(+-e)."""
    outs = [np.asarray(x, np.float64) for x in outs]
    lses = [np.asarray(x, np.float64) for x in lses]
    largest_out = np.max([np.abs(x) for x in outs], axis=0)
    largest_lse = np.max([np.abs(x) for x in lses], axis=0)
    lse = np.zeros_like(largest_lse)
    out = np.zeros_like(largest_out)
    for _ in range(len(outs) - 1):
        out = out + (8.0 * U32 + np.expm1(2.0 * math.log(2.0) * lse)[..., None]) * largest_out
        lse = lse + 4.0 * U32 + 2.0 * U32 * largest_lse
    return out, lse


def sinks_bound(out_bound, lse_bound, out, lse, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(output, lse) bounds after runtime/merge.apply_sinks of a state whose output and lse are
    off by at most ``out_bound`` [..., d] and ``lse_bound`` [...] (base 2); ``out`` and ``lse``
    are the state's after the sinks, ``dtype`` the output's. apply_sinks scales the output by
    f = 2^lse / (2^lse + e^sink) in (0, 1], in float64: an output error stays at most what it
    was, an lse error e moves f by a factor within 2^(+-e) (so the output by (2^e - 1) |out|)
    and the new lse by at most e; then the results are rounded (u of the dtype, u32 for lse)."""
    lse_bound = np.asarray(lse_bound, np.float64)
    spread = np.expm1(math.log(2.0) * lse_bound)[..., None]
    out_abs, lse_abs = np.abs(np.asarray(out, np.float64)), np.abs(np.asarray(lse, np.float64))
    return (np.asarray(out_bound, np.float64) + (spread + UNIT_ROUNDOFF[dtype]) * out_abs,
            lse_bound + U32 * lse_abs)
