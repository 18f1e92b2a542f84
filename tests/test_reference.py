"""Brute-force checks of the float64 reference (``linalg_prefill.runtime.reference``) and of the
RoPE math (``linalg_prefill.runtime.rope``).

Every expected value here comes from code written independently inside this file: plain Python
loops over (row, head, key), ``math.exp``/``math.cos``, the natural-log softmax converted to
base 2 at the end, and the RoPE closed forms of semantics §4/§11.5 written in the HF style
(piecewise wavelength rules, correction dims).  Sizes are tiny so the loops stay fast.
"""

from __future__ import annotations

import math
import zlib

import ml_dtypes
import numpy as np
import pytest

from linalg_prefill.runtime.examples import page_table
from linalg_prefill.runtime import reference as R
from linalg_prefill.runtime import rope as rope_mod
from support import LLAMA3_64, LLAMA4_64, YARN

EMPTY = -5e4
TOL = dict(rtol=1e-10, atol=1e-10)

LLAMA3, LLAMA4 = LLAMA3_64, LLAMA4_64
LONGROPE = {"rope_type": "longrope", "max_position_embeddings": 4096, "original_max_position_embeddings": 256}
ROPE_CASES = {
    "none": None,
    "empty": {},
    "default": {"rope_type": "default"},
    "gptj": {"rope_type": "gptj"},
    "llama3": LLAMA3,
    "llama4": LLAMA4,
    "longrope": LONGROPE,
    "yarn": YARN,
}


# --------------------------------------------------------------------------- brute force


def seed_of(*args) -> int:
    """Deterministic seed (``hash`` of strings varies between processes)."""
    return zlib.crc32(repr(args).encode())


def bf_inv_freqs(dim: int, theta: float, rs) -> tuple[list[float], float, str]:
    """Per-pair inverse frequency, cos/sin multiplier and pairing, HF style."""
    kind = (rs or {}).get("rope_type") or "default"
    inv, mult = [], 1.0
    pairing = "interleaved" if kind in ("gptj", "llama4") else "half"
    for i in range(dim // 2):
        base = 1.0 / (theta ** (2.0 * i / dim))
        if kind in ("default", "gptj", "longrope"):
            f = base
        elif kind in ("llama3", "llama4"):
            factor, lff, hff = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
            orig = rs["original_max_position_embeddings"]
            wavelen = 2.0 * math.pi / base
            if wavelen < orig / hff:
                f = base
            elif wavelen > orig / lff:
                f = base / factor
            else:
                smooth = (orig / wavelen - lff) / (hff - lff)
                f = (1.0 - smooth) * base / factor + smooth * base
        elif kind == "yarn":
            factor, orig = rs["factor"], rs["original_max_position_embeddings"]

            def corr_dim(n_rot):
                return dim * math.log(orig / (n_rot * 2.0 * math.pi)) / (2.0 * math.log(theta))

            low = max(corr_dim(rs["beta_fast"]), 0.0)
            high = min(corr_dim(rs["beta_slow"]), dim - 1.0)
            if low == high:
                high += 0.001
            ramp = min(max((i - low) / (high - low), 0.0), 1.0)
            extrapolation_weight = 1.0 - ramp
            f = base / factor * (1.0 - extrapolation_weight) + base * extrapolation_weight
        else:
            raise AssertionError(kind)
        inv.append(f)
    if kind == "longrope":
        ratio = rs["max_position_embeddings"] / rs["original_max_position_embeddings"]
        if ratio > 1:
            mult = math.sqrt(1.0 + math.log(ratio) / math.log(rs["original_max_position_embeddings"]))
    if kind == "yarn":
        mult = 0.1 * math.log(rs["factor"]) + 1.0
    return inv, mult, pairing


def bf_rope(vec, pos, theta, scale, rs):
    """Rotate one head vector (list of floats) at ``pos`` with plain loops."""
    dim = len(vec)
    inv, mult, pairing = bf_inv_freqs(dim, theta, rs)
    out = [0.0] * dim
    for i in range(dim // 2):
        a, b = (i, i + dim // 2) if pairing == "half" else (2 * i, 2 * i + 1)
        ang = pos * scale * inv[i]
        c, s = math.cos(ang), math.sin(ang)
        out[a] = mult * (vec[a] * c - vec[b] * s)
        out[b] = mult * (vec[b] * c + vec[a] * s)
    return out


def bf_row(qv, keys, vals, sm_scale, d_v):
    """Softmax attention of one query over the given (already filtered) keys, natural log."""
    if not keys:
        return [0.0] * d_v, EMPTY
    scores = [sm_scale * sum(x * y for x, y in zip(qv, kv)) for kv in keys]
    mx = max(scores)
    ws = [math.exp(s - mx) for s in scores]
    tot = sum(ws)
    out = [sum(w * vv[j] for w, vv in zip(ws, vals)) / tot for j in range(d_v)]
    return out, (mx + math.log(tot)) / math.log(2.0)


def lst(x):
    return [float(t) for t in np.asarray(x, dtype=np.float64).reshape(-1)]


def bf_entries(q, q_indptr, kv_rows, k_pos, q_pos, causal, rope, sm_scale, h_kv, d_v, row_ok=None):
    """Generic brute force.  ``kv_rows[b]`` is a list of (k [h_kv, d_qk], v [h_kv, d_v]) per
    logical KV row; ``k_pos[b][r]`` its RoPE position; ``rope`` is None or (theta, scale, rs)."""
    total, h_q, _ = q.shape
    g = h_q // h_kv
    out = np.zeros((total, h_q, d_v))
    lse = np.zeros((total, h_q))
    for b in range(len(q_indptr) - 1):
        qo = int(q_indptr[b + 1] - q_indptr[b])
        rows = kv_rows[b]
        kv_len = len(rows)
        for i in range(qo):
            t = int(q_indptr[b]) + i
            for h in range(h_q):
                qv = lst(q[t, h])
                if rope:
                    qv = bf_rope(qv, int(q_pos[t]), *rope)
                keys, vals = [], []
                for r, (kr, vr) in enumerate(rows):
                    if causal and not r <= i + kv_len - qo:
                        continue
                    if row_ok is not None and not row_ok(b, i, r):
                        continue
                    kv = lst(kr[h // g])
                    if rope:
                        kv = bf_rope(kv, int(k_pos[b][r]), *rope)
                    keys.append(kv)
                    vals.append(lst(vr[h // g]))
                o, s = bf_row(qv, keys, vals, sm_scale, d_v)
                out[t, h], lse[t, h] = o, s
    return out, lse


def bf_paged_rows(pages, page_indptr, page_values, length_info, sliding):
    """Logical KV rows of every entry of a paged cache, by walking §2 literally."""
    ps = pages.shape[3]
    result = []
    for b in range(len(page_indptr) - 1):
        n = int(page_indptr[b + 1] - page_indptr[b])
        if sliding:
            last, off, sink = (int(length_info[i][b]) for i in range(3))
        else:
            last, off, sink = int(length_info[b]), 0, 0
        kv_len = 0 if n == 0 else (n - 1) * ps + last - off + sink
        rows = []
        for r in range(kv_len):
            phys = r if r < sink else r - sink + off
            page = int(page_values[int(page_indptr[b]) + phys // ps])
            slot = phys % ps
            rows.append((pages[page, 0, :, slot, :], pages[page, 1, :, slot, :]))
        result.append(rows)
    return result


# --------------------------------------------------------------------------- layouts


def make_paged(rng, qo_lens, phys_lens, page_size, h_q, h_kv, d, extra_pages=3, sw=None):
    """Paged inputs with shuffled page ids.  ``sw``: list of (sw_off, sink) per entry."""
    # an entry without pages keeps (last, off, sink) = (0, 0, 0)
    window = None if sw is None else [(o, s) if L else (0, 0) for (o, s), L in zip(sw, phys_lens)]
    table = page_table(rng, phys_lens, page_size, spare_pages=extra_pages, window=window, empty_last=0)
    kv_lens = list(phys_lens) if sw is None else [0 if L == 0 else L - o + s for (o, s), L in zip(window, phys_lens)]
    page_indptr, page_values, length_info = table.page_indptr, table.page_values, table.length_info
    q_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    total = int(q_indptr[-1])
    q = rng.uniform(-1, 1, (total, h_q, d)).astype(np.float32)
    pages = rng.uniform(-1, 1, (table.num_pages, 2, h_kv, page_size, d)).astype(np.float32)
    k_off = rng.integers(0, 50, len(qo_lens)).astype(np.int32)
    q_pos = rng.integers(0, 80, total).astype(np.int32)
    return dict(
        q=q,
        q_indptr=q_indptr,
        pages=pages,
        page_indptr=page_indptr,
        page_values=page_values,
        length_info=length_info,
        k_rope_pos_offset=k_off,
        q_rope_position=q_pos,
    ), kv_lens


def call_paged(inp, causal, rotary, rope_scale, rope_theta, sm_scale, rs, sliding):
    return R.batch_prefill_paged_kv(
        inp["q"],
        inp["q_indptr"],
        inp["pages"],
        inp["page_indptr"],
        inp["page_values"],
        inp["length_info"],
        inp["k_rope_pos_offset"],
        inp["q_rope_position"],
        causal,
        rotary,
        rope_scale,
        rope_theta,
        sm_scale,
        rope_scaling=rs,
        sliding_window=sliding,
    )


def brute_paged(inp, causal, rotary, rope_scale, rope_theta, sm_scale, rs, sliding):
    rows = bf_paged_rows(inp["pages"], inp["page_indptr"], inp["page_values"], inp["length_info"], sliding)
    k_pos = [[int(inp["k_rope_pos_offset"][b]) + r for r in range(len(rows[b]))] for b in range(len(rows))]
    return bf_entries(
        inp["q"],
        inp["q_indptr"],
        rows,
        k_pos,
        inp["q_rope_position"],
        causal,
        (rope_theta, rope_scale, rs) if rotary else None,
        sm_scale,
        inp["pages"].shape[2],
        inp["pages"].shape[4],
    )


def empty_rows(q_indptr, kv_lens, causal):
    """(global row) indices with no valid key."""
    res = []
    for b in range(len(q_indptr) - 1):
        qo = int(q_indptr[b + 1] - q_indptr[b])
        for i in range(qo):
            if kv_lens[b] == 0 or (causal and i < qo - kv_lens[b]):
                res.append(int(q_indptr[b]) + i)
    return res


def check(got, want, empty):
    out, lse = got
    w_out, w_lse = want
    np.testing.assert_allclose(out, w_out, **TOL)
    np.testing.assert_allclose(lse, w_lse, **TOL)
    assert out.dtype == np.float64 and lse.dtype == np.float64
    for t in empty:
        assert np.array_equal(out[t], np.zeros_like(out[t])), f"row {t} not exactly 0"
        assert np.all(lse[t] == EMPTY), f"row {t} lse {lse[t]}"
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))


# --------------------------------------------------------------------------- paged


# qo_len > kv_len (entry 1), no pages (entry 2), qo_len 0 (entry 3), partial last pages.
PAGED_QO = [4, 7, 3, 0, 5]
PAGED_KV = [11, 3, 0, 6, 13]


@pytest.mark.parametrize("heads", [(2, 2), (4, 1), (4, 2)])
@pytest.mark.parametrize("page_size", [4, 8])
@pytest.mark.parametrize("causal", [0, 1])
def test_paged_matches_brute(heads, page_size, causal):
    rng = np.random.default_rng(seed_of(heads, page_size, causal))
    h_q, h_kv = heads
    inp, kv_lens = make_paged(rng, PAGED_QO, PAGED_KV, page_size, h_q, h_kv, 8)
    args = (causal, 0, 1.0, 1e4, 0.4, None, False)
    empty = empty_rows(inp["q_indptr"], kv_lens, causal)
    assert empty, "layout must contain rows without a valid key"
    check(call_paged(inp, *args), brute_paged(inp, *args), empty)


@pytest.mark.parametrize("rope_name", list(ROPE_CASES))
@pytest.mark.parametrize("rope_scale", [0.5, 1.0, 2.0])
def test_paged_rope_matches_brute(rope_name, rope_scale):
    rng = np.random.default_rng(7)
    rs = ROPE_CASES[rope_name]
    inp, kv_lens = make_paged(rng, [3, 5, 2], [9, 4, 0], 4, 4, 2, 8)
    args = (1, 1, rope_scale, 1e4, 0.35, rs, False)
    check(call_paged(inp, *args), brute_paged(inp, *args), empty_rows(inp["q_indptr"], kv_lens, 1))


def test_paged_rope_changes_result():
    """Guard against a silently ignored rotary_mode / rope_scale."""
    rng = np.random.default_rng(3)
    inp, _ = make_paged(rng, [3], [9], 4, 2, 2, 8)
    base = call_paged(inp, 0, 0, 1.0, 1e4, 0.35, None, False)[0]
    on = call_paged(inp, 0, 1, 1.0, 1e4, 0.35, None, False)[0]
    scaled = call_paged(inp, 0, 1, 2.0, 1e4, 0.35, None, False)[0]
    assert np.abs(base - on).max() > 1e-3
    assert np.abs(on - scaled).max() > 1e-3


@pytest.mark.parametrize("seed", range(30))
def test_paged_random_layouts(seed):
    """Random batch layouts, page sizes, GQA groups, masks and rope types (seeded)."""
    rng = np.random.default_rng(seed_of("random-layout", seed))
    qo = [int(x) for x in rng.integers(0, 6, rng.integers(1, 4))]
    kv = [int(x) for x in rng.integers(0, 10, len(qo))]
    page_size = int(rng.choice([1, 2, 4]))
    heads = [(1, 1), (2, 1), (4, 2), (3, 3)][rng.integers(0, 4)]
    causal, rotary = int(rng.integers(0, 2)), int(rng.integers(0, 2))
    rope_name = list(ROPE_CASES)[rng.integers(0, len(ROPE_CASES))]
    inp, kv_lens = make_paged(rng, qo, kv, page_size, heads[0], heads[1], 4)
    args = (causal, rotary, 1.5, 500.0, 0.6, ROPE_CASES[rope_name], False)
    check(call_paged(inp, *args), brute_paged(inp, *args), empty_rows(inp["q_indptr"], kv_lens, causal))


# --------------------------------------------------------------------------- sliding window


def test_sliding_window_worked_example():
    """§2: page_size 16, sink 4, sw_off 10, 2 pages, last_page_len 5 -> kv_len 15, logical rows
    0..3 -> physical 0..3, rows 4..14 -> physical 10..20."""
    ps, h = 16, 1
    pages = np.zeros((3, 2, h, ps, 2), np.float32)
    page_values = np.array([2, 0], np.int32)  # logical page 0 -> physical page 2, 1 -> 0
    for lp, pp in enumerate(page_values):
        for slot in range(ps):
            pages[pp, 1, 0, slot, 0] = lp * ps + slot  # V[0] = physical position in the entry
            pages[pp, 1, 0, slot, 1] = 1.0
    expected_phys = [0, 1, 2, 3] + list(range(10, 21))
    qo = 15
    q = np.zeros((qo, h, 2), np.float32)  # sm_scale irrelevant: uniform weights
    args = dict(
        q=q,
        q_indptr=np.array([0, qo], np.int32),
        pages=pages,
        page_indptr=np.array([0, 2], np.int32),
        page_values=page_values,
        length_info=np.array([[5], [10], [4]], np.int32),
        k_rope_pos_offset=np.zeros(1, np.int32),
        q_rope_position=np.zeros(qo, np.int32),
    )
    out, lse = call_paged(args, 1, 0, 1.0, 1e4, 1.0, None, True)
    for i in range(qo):  # causal, qo == kv_len: row i sees logical rows 0..i
        seen = expected_phys[: i + 1]
        assert out[i, 0, 0] == pytest.approx(sum(seen) / len(seen), abs=1e-12)
        assert lse[i, 0] == pytest.approx(math.log2(i + 1), abs=1e-12)
    out, lse = call_paged(args, 0, 0, 1.0, 1e4, 1.0, None, True)
    assert np.allclose(out[:, 0, 0], np.mean(expected_phys))
    assert np.allclose(lse, math.log2(15))


@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize("rope_name", ["none", "llama3", "yarn", "gptj"])
def test_sliding_window_matches_brute(causal, rope_name):
    rng = np.random.default_rng(11 + causal)
    # physical lengths, (sw_off, sink); entry 2 has no pages; entry 3: sink 0; entry 4: off == sink
    phys = [21, 9, 0, 12, 7]
    sw = [(10, 4), (5, 2), (0, 0), (6, 0), (3, 3)]
    qo = [4, 9, 2, 3, 2]
    inp, kv_lens = make_paged(rng, qo, phys, 8, 4, 2, 8, sw=sw)
    assert kv_lens == [15, 6, 0, 6, 7]
    args = (causal, 0 if rope_name == "none" else 1, 0.75, 1e4, 0.3, ROPE_CASES[rope_name], True)
    check(call_paged(inp, *args), brute_paged(inp, *args), empty_rows(inp["q_indptr"], kv_lens, causal))


# --------------------------------------------------------------------------- ragged


def make_ragged(rng, qo, kv, h_q, h_kv, d_qk, d_v):
    q_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(kv)]).astype(np.int32)
    return dict(
        q=rng.uniform(-1, 1, (q_indptr[-1], h_q, d_qk)).astype(np.float32),
        q_indptr=q_indptr,
        k=rng.uniform(-1, 1, (kv_indptr[-1], h_kv, d_qk)).astype(np.float32),
        v=rng.uniform(-1, 1, (kv_indptr[-1], h_kv, d_v)).astype(np.float32),
        kv_indptr=kv_indptr,
        q_rope_position=rng.integers(0, 60, q_indptr[-1]).astype(np.int32),
        k_rope_pos_offset=rng.integers(0, 40, len(qo)).astype(np.int32),
    )


def call_ragged(inp, causal, rotary, rope_scale, rope_theta, sm_scale, rs):
    return R.batch_prefill_ragged_kv(
        inp["q"],
        inp["q_indptr"],
        inp["k"],
        inp["v"],
        inp["kv_indptr"],
        inp["q_rope_position"],
        inp["k_rope_pos_offset"],
        causal,
        rotary,
        rope_scale,
        rope_theta,
        sm_scale,
        rope_scaling=rs,
    )


def brute_ragged(inp, causal, rotary, rope_scale, rope_theta, sm_scale, rs):
    kvi = inp["kv_indptr"]
    rows = [[(inp["k"][t], inp["v"][t]) for t in range(kvi[b], kvi[b + 1])] for b in range(len(kvi) - 1)]
    k_pos = [[int(inp["k_rope_pos_offset"][b]) + r for r in range(len(rows[b]))] for b in range(len(rows))]
    return bf_entries(
        inp["q"],
        inp["q_indptr"],
        rows,
        k_pos,
        inp["q_rope_position"],
        causal,
        (rope_theta, rope_scale, rs) if rotary else None,
        sm_scale,
        inp["k"].shape[1],
        inp["v"].shape[2],
    )


RAGGED_QO = [5, 6, 2, 0, 3]
RAGGED_KV = [5, 2, 0, 4, 8]


@pytest.mark.parametrize("dims", [(8, 8), (12, 4), (6, 10)])
@pytest.mark.parametrize("heads", [(2, 2), (4, 1), (6, 3)])
@pytest.mark.parametrize("causal", [0, 1])
def test_ragged_matches_brute(dims, heads, causal):
    rng = np.random.default_rng(seed_of(dims, heads, causal))
    inp = make_ragged(rng, RAGGED_QO, RAGGED_KV, heads[0], heads[1], *dims)
    args = (causal, 1, 1.25, 1e4, 0.5, LLAMA3)
    got = call_ragged(inp, *args)
    assert got[0].shape == (sum(RAGGED_QO), heads[0], dims[1])
    check(got, brute_ragged(inp, *args), empty_rows(inp["q_indptr"], RAGGED_KV, causal))


@pytest.mark.parametrize("rope_name", list(ROPE_CASES))
def test_ragged_rope_matches_brute(rope_name):
    rng = np.random.default_rng(5)
    inp = make_ragged(rng, [4, 3], [4, 6], 2, 1, 8, 6)
    args = (1, 1, 2.0, 1e4, 0.4, ROPE_CASES[rope_name])
    check(call_ragged(inp, *args), brute_ragged(inp, *args), [])


def test_ragged_chunking(monkeypatch):
    """Small chunks (and the causal column trimming) give the same result."""
    rng = np.random.default_rng(9)
    inp = make_ragged(rng, [23, 9], [17, 9], 4, 2, 8, 8)
    args = (1, 0, 1.0, 1e4, 0.5, None)
    want = brute_ragged(inp, *args)
    empty = empty_rows(inp["q_indptr"], [17, 9], 1)
    assert len(empty) == 6
    for rows in (1, 3, 5, 128):
        monkeypatch.setattr(R, "_CHUNK_ROWS", rows)
        check(call_ragged(inp, *args), want, empty)


# --------------------------------------------------------------------------- MLA


@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize("sliding", [False, True])
def test_mla_matches_brute(causal, sliding):
    rng = np.random.default_rng(21 + causal + 2 * sliding)
    d_latent, d_rope, h_q, ps = 8, 4, 3, 4
    d_qk = d_latent + d_rope
    phys, qo = [10, 0, 5, 7], [3, 2, 6, 2]
    sw = [(6, 2), (0, 0), (1, 1), (0, 3)] if sliding else None
    paged, kv_lens = make_paged(rng, qo, phys, ps, h_q, 1, d_qk, sw=sw)
    latent = rng.uniform(-1, 1, (paged["pages"].shape[0], ps, d_qk)).astype(np.float32)
    got = R.batch_prefill_paged_kv_mla(
        paged["q"],
        paged["q_indptr"],
        latent,
        paged["page_indptr"],
        paged["page_values"],
        paged["length_info"],
        causal,
        0.3,
        d_latent=d_latent,
        sliding_window=sliding,
    )
    assert got[0].shape == (sum(qo), h_q, d_latent)
    # brute: a [P, 2, 1, ps, d_qk] view where K = row, V = row with only the latent columns
    as_pages = np.zeros((latent.shape[0], 2, 1, ps, d_qk))
    as_pages[:, 0, 0] = latent
    as_pages[:, 1, 0] = latent
    rows = bf_paged_rows(as_pages, paged["page_indptr"], paged["page_values"], paged["length_info"], sliding)
    rows = [[(k, v[:, :d_latent]) for k, v in entry] for entry in rows]
    want = bf_entries(paged["q"], paged["q_indptr"], rows, None, None, causal, None, 0.3, 1, d_latent)
    check(got, want, empty_rows(paged["q_indptr"], kv_lens, causal))


# --------------------------------------------------------------------------- dense sequence


@pytest.mark.parametrize("lens", [(5, 5), (3, 7), (7, 3)])
@pytest.mark.parametrize("heads", [(2, 2), (4, 2)])
@pytest.mark.parametrize("causal", [0, 1])
def test_sequence_matches_brute(lens, heads, causal):
    rng = np.random.default_rng(seed_of(lens, heads, causal))
    qo, kv = lens
    batch, d = 2, 8
    q = rng.uniform(-1, 1, (batch, qo, heads[0], d)).astype(np.float32)
    k = rng.uniform(-1, 1, (batch, kv, heads[1], d)).astype(np.float32)
    v = rng.uniform(-1, 1, (batch, kv, heads[1], d)).astype(np.float32)
    out, lse = R.batch_sequence_prefill_kv(q, k, v, causal=causal, sm_scale=0.4)
    assert out.shape == q.shape and lse.shape == (batch, qo, heads[0])
    for b in range(batch):
        rows = [[(k[b, r], v[b, r]) for r in range(kv)]]
        want = bf_entries(q[b], [0, qo], rows, None, None, causal, None, 0.4, heads[1], d)
        empty = empty_rows([0, qo], [kv], causal)
        assert bool(empty) == (causal == 1 and qo > kv)
        check((out[b], lse[b]), want, empty)


# --------------------------------------------------------------------------- masked sequence


def bf_masked_ok(mode, qo, kv, vl):
    if mode == "padded":
        return lambda b, i, r: i < vl[b] and r < vl[b]
    return lambda b, i, r: i >= qo - vl[b] and kv - vl[b] <= r <= i + (kv - qo)


@pytest.mark.parametrize("mode", ["padded", "causal_padded_left"])
@pytest.mark.parametrize("lens", [(6, 6), (5, 8)])
@pytest.mark.parametrize("heads", [(2, 2), (4, 1)])
def test_masked_matches_brute(mode, lens, heads):
    rng = np.random.default_rng(seed_of(mode, lens, heads))
    qo, kv = lens
    d = 8
    valid_lens = np.array([0, min(qo, kv), 3, 1], np.int32)  # empty, full, partial
    batch = len(valid_lens)
    q = rng.uniform(-1, 1, (batch, qo, heads[0], d)).astype(np.float32)
    k = rng.uniform(-1, 1, (batch, kv, heads[1], d)).astype(np.float32)
    v = rng.uniform(-1, 1, (batch, kv, heads[1], d)).astype(np.float32)
    out, lse = R.batch_sequence_prefill_kv_masked(q, k, v, valid_lens, mask_mode=mode, sm_scale=0.5)
    assert lse.shape == (batch, qo, heads[0])
    ok = bf_masked_ok(mode, qo, kv, valid_lens)
    for b in range(batch):
        rows = [[(k[b, r], v[b, r]) for r in range(kv)]]
        want = bf_entries(
            q[b], [0, qo], rows, None, None, False, None, 0.5, heads[1], d, row_ok=lambda _b, i, r: ok(b, i, r)
        )
        vl = int(valid_lens[b])
        pad = [i for i in range(qo) if not (i < vl if mode == "padded" else i >= qo - vl)]
        assert len(pad) == qo - vl
        check((out[b], lse[b]), want, pad)


def test_masked_equals_plain_attention_on_valid_block():
    """§7: padded == bidirectional attention on the valid prefix; causal_padded_left == causal
    attention on the L x L valid suffix, even when qo_len != kv_len."""
    rng = np.random.default_rng(4)
    qo, kv, d, L = 6, 9, 8, 4
    q = rng.uniform(-1, 1, (1, qo, 2, d))
    k = rng.uniform(-1, 1, (1, kv, 1, d))
    v = rng.uniform(-1, 1, (1, kv, 1, d))
    vl = np.array([L])
    out, lse = R.batch_sequence_prefill_kv_masked(q, k, v, vl, mask_mode="padded", sm_scale=0.3)
    ref = R.batch_sequence_prefill_kv(q[:, :L], k[:, :L], v[:, :L], causal=0, sm_scale=0.3)
    np.testing.assert_allclose(out[:, :L], ref[0], **TOL)
    np.testing.assert_allclose(lse[:, :L], ref[1], **TOL)
    out, lse = R.batch_sequence_prefill_kv_masked(q, k, v, vl, mask_mode="causal_padded_left", sm_scale=0.3)
    ref = R.batch_sequence_prefill_kv(q[:, -L:], k[:, -L:], v[:, -L:], causal=1, sm_scale=0.3)
    np.testing.assert_allclose(out[:, -L:], ref[0], **TOL)
    np.testing.assert_allclose(lse[:, -L:], ref[1], **TOL)
    assert np.all(out[:, :-L] == 0) and np.all(lse[:, :-L] == EMPTY)


# --------------------------------------------------------------------------- merge_state


@pytest.mark.parametrize("rotary", [0, 1])
def test_merge_identity_split_kv(rotary):
    """Split each entry's KV in two (split points 0, middle, end), merge == one call."""
    rng = np.random.default_rng(13 + rotary)
    qo, kv = [3, 4, 2, 2], [7, 5, 6, 0]
    split = [3, 0, 6, 0]
    full = make_ragged(rng, qo, kv, 4, 2, 8, 6)
    parts = []
    for lo, hi in (([0] * len(kv), split), (split, kv)):
        part = dict(full)
        part["k"] = np.concatenate([full["k"][full["kv_indptr"][b] + lo[b] : full["kv_indptr"][b] + hi[b]] for b in range(len(kv))])
        part["v"] = np.concatenate([full["v"][full["kv_indptr"][b] + lo[b] : full["kv_indptr"][b] + hi[b]] for b in range(len(kv))])
        lens = [h - l for l, h in zip(lo, hi)]
        part["kv_indptr"] = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        part["k_rope_pos_offset"] = full["k_rope_pos_offset"] + np.array(lo, np.int32)
        parts.append(part)
    assert [int(x) for x in np.diff(parts[0]["kv_indptr"])] == [3, 0, 6, 0]
    assert [int(x) for x in np.diff(parts[1]["kv_indptr"])] == [4, 5, 0, 0]
    args = (0, rotary, 1.5, 1e4, 0.45, LLAMA3)
    o1, s1 = call_ragged(parts[0], *args)
    o2, s2 = call_ragged(parts[1], *args)
    om, sm = R.merge_state(o1, s1, o2, s2)
    of, sf = call_ragged(full, *args)
    np.testing.assert_allclose(om, of, **TOL)
    np.testing.assert_allclose(sm, sf, **TOL)
    last = slice(full["q_indptr"][3], full["q_indptr"][4])  # kv_len 0 in both halves
    assert np.all(om[last] == 0) and np.all(sm[last] == EMPTY)


def test_merge_paged_prefix_with_ragged_causal():
    """The runtime's pipeline (§1.6): paged prefix (causal 0) merged with ragged self-attention
    (causal 1) == one causal ragged call over prefix ++ new tokens (bottom-right mask)."""
    rng = np.random.default_rng(17)
    prefix, new, h_q, h_kv, d, ps = 9, 5, 4, 2, 8, 4
    inp, _ = make_paged(rng, [new], [prefix], ps, h_q, h_kv, d)
    inp["k_rope_pos_offset"] = np.array([0], np.int32)
    inp["q_rope_position"] = np.arange(prefix, prefix + new, dtype=np.int32)
    k_new = rng.uniform(-1, 1, (new, h_kv, d))
    v_new = rng.uniform(-1, 1, (new, h_kv, d))
    scal = (1.0, 1e4, 0.35)
    o_p, s_p = call_paged(inp, 0, 1, *scal, None, False)
    ind = np.array([0, new], np.int32)
    o_r, s_r = R.batch_prefill_ragged_kv(
        inp["q"], ind, k_new, v_new, ind, inp["q_rope_position"], np.array([prefix]), 1, 1, *scal
    )
    o_m, s_m = R.merge_state(o_p, s_p, o_r, s_r)
    rows = bf_paged_rows(inp["pages"], inp["page_indptr"], inp["page_values"], inp["length_info"], False)[0]
    k_all = np.concatenate([np.stack([r[0] for r in rows]), k_new])
    v_all = np.concatenate([np.stack([r[1] for r in rows]), v_new])
    o_f, s_f = R.batch_prefill_ragged_kv(
        inp["q"], ind, k_all, v_all, np.array([0, prefix + new]), inp["q_rope_position"], np.array([0]), 1, 1, *scal
    )
    np.testing.assert_allclose(o_m, o_f, **TOL)
    np.testing.assert_allclose(s_m, s_f, **TOL)


def test_merge_state_empty_and_extremes():
    v = np.array([[1.0, -2.0], [3.0, 4.0], [0.5, 0.5], [7.0, 7.0]])
    s = np.array([2.0, EMPTY, -np.inf, 1e4])
    zero = np.zeros_like(v)
    e = np.full(4, EMPTY)
    # empty acts as identity on either side
    for vm, sm in (R.merge_state(v[:1], s[:1], zero[:1], e[:1]), R.merge_state(zero[:1], e[:1], v[:1], s[:1])):
        np.testing.assert_allclose(vm, v[:1], rtol=0, atol=0)
        assert sm[0] == s[0]
    # empty + empty stays exactly empty; -inf counts as empty; no NaN / overflow
    vm, sm = R.merge_state(zero, e, v, s)
    assert np.all(np.isfinite(vm)) and np.all(np.isfinite(sm))
    assert np.all(vm[1:3] == 0) and np.all(sm[1:3] == EMPTY)
    # an empty state's output is ignored, whatever it holds, on either side
    vm, sm = R.merge_state(v, e, v[::-1], e)
    assert np.all(vm == 0) and np.all(sm == EMPTY)
    # hand-computed merge: w_a = 1, w_b = 2^-1
    vm, sm = R.merge_state(np.array([[1.0]]), np.array([3.0]), np.array([[4.0]]), np.array([2.0]))
    assert vm[0, 0] == pytest.approx((1.0 + 0.5 * 4.0) / 1.5)
    assert sm[0] == pytest.approx(3.0 + math.log2(1.5))
    # very different magnitudes
    vm, sm = R.merge_state(np.array([[1.0]]), np.array([1e4]), np.array([[9.0]]), np.array([-1e4]))
    assert vm[0, 0] == 1.0 and sm[0] == 1e4


# --------------------------------------------------------------------------- lse / core


def test_lse_is_base2_with_sm_scale():
    rng = np.random.default_rng(2)
    kv = 7
    # q = 0: every score is 0, so lse = log2(#valid keys) exactly
    q = np.zeros((1, kv, 2, 4))
    k = rng.uniform(-1, 1, (1, kv, 1, 4))
    v = rng.uniform(-1, 1, (1, kv, 1, 4))
    _, lse = R.batch_sequence_prefill_kv(q, k, v, causal=1, sm_scale=0.7)
    assert np.all(lse[0, :, 0] == np.log2(np.arange(1, kv + 1)))
    # constant scores c: lse = sm_scale * c * log2(e) + log2(n)
    q = np.ones((1, 1, 1, 4)) * 0.5
    k = np.ones((1, kv, 1, 4)) * 2.0
    _, lse = R.batch_sequence_prefill_kv(q, k, k, causal=0, sm_scale=0.7)
    assert lse[0, 0, 0] == pytest.approx(0.7 * 4.0 / math.log(2) + math.log2(kv), rel=1e-14)
    # generic: lse * ln 2 == natural logsumexp of sm_scale * q.k, summed with math.exp
    q = rng.uniform(-2, 2, (1, 3, 1, 4))
    k = rng.uniform(-2, 2, (1, kv, 1, 4))
    _, lse = R.batch_sequence_prefill_kv(q, k, v, causal=0, sm_scale=1.3)
    for i in range(3):
        tot = sum(math.exp(1.3 * sum(q[0, i, 0, j] * k[0, r, 0, j] for j in range(4))) for r in range(kv))
        assert lse[0, i, 0] * math.log(2) == pytest.approx(math.log(tot), rel=1e-13)


def test_attend_masked_keys_weigh_zero():
    """A masked key with an enormous score must not leak (§11.2)."""
    q = np.array([[1.0, 0.0]])
    k = np.array([[1e6, 0.0], [0.5, 0.0], [0.0, 1.0]])
    v = np.array([[1e9], [1.0], [3.0]])
    valid = np.array([[False, True, True]])
    out, lse = R.attend(q, k, v, valid, 1.0)
    w = [math.exp(0.5), math.exp(0.0)]
    assert out[0, 0] == pytest.approx((w[0] * 1.0 + w[1] * 3.0) / sum(w), rel=1e-14)
    assert lse[0] == pytest.approx(math.log2(sum(w)), rel=1e-14)
    out, lse = R.attend(q, k, v, np.zeros((1, 3), bool), 1.0)
    assert out[0, 0] == 0.0 and lse[0] == EMPTY
    out, lse = R.attend(q, k[:0], v[:0], np.zeros((1, 0), bool), 1.0)
    assert out.shape == (1, 1) and out[0, 0] == 0.0 and lse[0] == EMPTY


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_low_precision_inputs_are_upcast(dtype):
    rng = np.random.default_rng(1)
    inp = make_ragged(rng, [3, 2], [4, 3], 2, 1, 8, 8)
    low = dict(inp, q=inp["q"].astype(dtype), k=inp["k"].astype(dtype), v=inp["v"].astype(dtype))
    up = dict(inp, **{n: low[n].astype(np.float64) for n in ("q", "k", "v")})
    args = (1, 1, 1.0, 1e4, 0.4, None)
    got = call_ragged(low, *args)
    want = call_ragged(up, *args)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    check(got, brute_ragged(up, *args), [])


# --------------------------------------------------------------------------- validation


def test_errors():
    rng = np.random.default_rng(0)
    inp = make_ragged(rng, [2], [2], 3, 2, 4, 4)
    with pytest.raises(ValueError, match="h_kv"):
        call_ragged(inp, 1, 0, 1.0, 1e4, 1.0, None)
    inp = make_ragged(rng, [2], [2], 2, 1, 4, 4)
    with pytest.raises(ValueError, match="rotary_mode"):
        call_ragged(inp, 1, 2, 1.0, 1e4, 1.0, None)
    with pytest.raises(ValueError, match="rope_type"):
        call_ragged(inp, 1, 1, 1.0, 1e4, 1.0, {"rope_type": "dynamic"})
    paged, _ = make_paged(rng, [2], [5], 4, 3, 2, 4)
    with pytest.raises(ValueError, match="h_kv"):
        call_paged(paged, 0, 0, 1.0, 1e4, 1.0, None, False)
    paged, _ = make_paged(rng, [2], [5], 4, 2, 2, 4)
    bad = dict(paged, page_values=paged["page_values"] + 100)
    with pytest.raises(ValueError, match="page_values"):
        call_paged(bad, 0, 0, 1.0, 1e4, 1.0, None, False)
    bad = dict(paged, length_info=np.array([5], np.int32))
    with pytest.raises(ValueError, match="last_page_len"):
        call_paged(bad, 0, 0, 1.0, 1e4, 1.0, None, False)
    bad = dict(paged, length_info=np.array([[1], [9], [0]], np.int32))
    with pytest.raises(ValueError, match="length_info"):
        call_paged(bad, 0, 0, 1.0, 1e4, 1.0, None, True)
    bad = dict(paged, q_indptr=np.array([0, 1], np.int32))
    with pytest.raises(ValueError, match="q_indptr"):
        call_paged(bad, 0, 0, 1.0, 1e4, 1.0, None, False)
    q = np.zeros((1, 3, 2, 4))
    k = np.zeros((1, 3, 1, 4))
    with pytest.raises(ValueError, match="mask_mode"):
        R.batch_sequence_prefill_kv_masked(q, k, k, np.array([1]), mask_mode="causal", sm_scale=1.0)
    with pytest.raises(ValueError, match="valid_lens"):
        R.batch_sequence_prefill_kv_masked(q, k, k, np.array([4]), mask_mode="padded", sm_scale=1.0)
    with pytest.raises(ValueError, match="h_kv"):
        R.batch_sequence_prefill_kv(q, np.zeros((1, 3, 3, 4)), np.zeros((1, 3, 3, 4)), causal=0, sm_scale=1.0)


# --------------------------------------------------------------------------- RoPE


def rand_heads(rng, n, heads, d):
    return rng.uniform(-1, 1, (n, heads, d))


@pytest.mark.parametrize("rope_name", list(ROPE_CASES))
@pytest.mark.parametrize("rope_scale", [0.25, 1.0, 3.0])
def test_rope_matches_closed_form(rope_name, rope_scale):
    rs = ROPE_CASES[rope_name]
    rng = np.random.default_rng(0)
    d, theta = 16, 1e4
    x = rand_heads(rng, 6, 2, d)
    pos = np.array([0, 1, 5, 63, 200, 4095])
    got = rope_mod.apply_rope(x, pos, rope_theta=theta, rope_scale=rope_scale, rope_scaling=rs)
    assert got.dtype == np.float64 and got.shape == x.shape
    for t in range(len(pos)):
        for h in range(2):
            want = bf_rope(lst(x[t, h]), int(pos[t]), theta, rope_scale, rs)
            np.testing.assert_allclose(got[t, h], want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rope_name", list(ROPE_CASES))
def test_rope_pair_norms_identity_and_relative_position(rope_name):
    rs = ROPE_CASES[rope_name]
    rng = np.random.default_rng(1)
    d, theta, scale = 16, 5e5, 1.75
    _, mult, pairing = bf_inv_freqs(d, theta, rs)
    assert rope_mod.rope_pairing(rs) == pairing
    kw = dict(rope_theta=theta, rope_scale=scale, rope_scaling=rs)
    x = rand_heads(rng, 5, 3, d)
    pos = np.array([0, 3, 17, 250, 9999])
    y = rope_mod.apply_rope(x, pos, **kw)
    pairs = [(i, i + d // 2) if pairing == "half" else (2 * i, 2 * i + 1) for i in range(d // 2)]
    for a, b in pairs:  # each pair's norm is scaled by the cos/sin multiplier only
        np.testing.assert_allclose(np.hypot(y[..., a], y[..., b]), mult * np.hypot(x[..., a], x[..., b]), rtol=1e-12)
    np.testing.assert_allclose(y[0], mult * x[0], rtol=0, atol=1e-15)  # position 0: identity
    # the score depends on the position difference only (both members of a pair share an angle)
    qv, kv = rand_heads(rng, 1, 1, d), rand_heads(rng, 1, 1, d)

    def score(m, n):
        return float(np.sum(rope_mod.apply_rope(qv, [m], **kw) * rope_mod.apply_rope(kv, [n], **kw)))

    assert score(40, 13) == pytest.approx(score(27, 0), rel=1e-9, abs=1e-12)
    assert score(1000, 990) == pytest.approx(score(10, 0), rel=1e-9, abs=1e-12)
    assert abs(score(40, 13) - score(13, 13)) > 1e-6  # and it does depend on it


def test_rope_frequency_regions_are_exercised():
    """The llama3 and yarn parameters used above reach every branch of their formulas."""
    d, theta = 16, 5e5
    inv, _, _ = bf_inv_freqs(d, theta, LLAMA3)
    base = [theta ** (-2 * i / d) for i in range(d // 2)]
    ratios = [f / b for f, b in zip(inv, base)]
    assert any(r == 1.0 for r in ratios) and any(r == 1 / 8 for r in ratios)
    assert any(1 / 8 < r < 1 for r in ratios)
    inv, _, _ = bf_inv_freqs(d, 1e4, YARN)
    ratios = [f / theta_b for f, theta_b in zip(inv, [1e4 ** (-2 * i / d) for i in range(d // 2)])]
    assert ratios[0] == 1.0 and ratios[-1] == pytest.approx(0.25) and any(0.25 < r < 1 for r in ratios)


def test_rope_cos_sin_layout():
    d = 8
    pos = np.array([3, 7])
    for rs, expect_dup in (({}, "half"), ({"rope_type": "gptj"}, "interleaved")):
        cos, sin = rope_mod.rope_cos_sin(pos, head_dim=d, rope_theta=100.0, rope_scale=0.5, rope_scaling=rs)
        assert cos.shape == (2, d) and sin.shape == (2, d)
        for t in range(2):
            for i in range(d // 2):
                ang = pos[t] * 0.5 * 100.0 ** (-2 * i / d)
                idx = (i, i + d // 2) if expect_dup == "half" else (2 * i, 2 * i + 1)
                for j in idx:
                    assert cos[t, j] == pytest.approx(math.cos(ang), abs=1e-14)
                    assert sin[t, j] == pytest.approx(math.sin(ang), abs=1e-14)


def test_rope_aliases_and_yarn_defaults():
    rng = np.random.default_rng(3)
    x = rand_heads(rng, 4, 1, 16)
    pos = np.array([1, 9, 77, 300])
    kw = dict(rope_theta=1e4, rope_scale=1.5)
    ref = rope_mod.apply_rope(x, pos, rope_scaling=None, **kw)
    for alias in ({}, {"rope_type": "default"}, {"rope_type": None}):
        assert np.array_equal(rope_mod.apply_rope(x, pos, rope_scaling=alias, **kw), ref)
    explicit = dict(YARN, inv_theta_log_scale=1.0 / (2.0 * math.log(1e4)))
    np.testing.assert_allclose(
        rope_mod.apply_rope(x, pos, rope_scaling=YARN, **kw),
        rope_mod.apply_rope(x, pos, rope_scaling=explicit, **kw),
        rtol=1e-15,
        atol=1e-15,
    )
    # the default ilts follows the theta passed at run time
    other = rope_mod.apply_rope(x, pos, rope_scaling=YARN, rope_theta=5e5, rope_scale=1.5)
    pinned = rope_mod.apply_rope(x, pos, rope_scaling=explicit, rope_theta=5e5, rope_scale=1.5)
    assert np.abs(other - pinned).max() > 1e-6
    with pytest.raises(ValueError):
        rope_mod.apply_rope(x, pos, rope_scaling={"rope_type": "linear"}, **kw)


def test_yarn_ramp_uses_pair_index():
    """§11.5: both halves of a rotate-half pair share the yarn angle (j mod D/2 in the ramp)."""
    d = 16
    cos, sin = rope_mod.rope_cos_sin(np.array([123]), head_dim=d, rope_theta=1e4, rope_scale=1.0, rope_scaling=YARN)
    np.testing.assert_array_equal(cos[:, : d // 2], cos[:, d // 2 :])
    np.testing.assert_array_equal(sin[:, : d // 2], sin[:, d // 2 :])
    mult = 0.1 * math.log(4.0) + 1.0
    np.testing.assert_allclose(cos**2 + sin**2, mult**2, rtol=1e-14)


def test_docstring_examples():
    import doctest

    result = doctest.testmod(R)
    assert result.attempted > 0 and result.failed == 0


def test_the_oracle_states_the_contract_constants_as_the_builders_do():
    """reference.py and rope.py restate them (the GPU bundle runs them without the package)."""
    from linalg_prefill.mlir import specs

    assert R.EMPTY_ROW_LSE == specs.EMPTY_ROW_LSE and R.MASK_MODES == specs.MASK_MODES
    assert rope_mod.ROPE_TYPES == (None, *specs.ROPE_FIELDS)
    assert rope_mod.INTERLEAVED_ROPE == specs.INTERLEAVED_ROPE
