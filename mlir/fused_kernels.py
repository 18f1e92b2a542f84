"""The fused lowering of every variant: the KV loop inside one ``online_attention`` dispatch per
query band (attention_op.py), the lowering the CUDA target uses (pipeline/tuning.py).

Same function signatures and semantics as the linalg lowering (sequence.py, kv_cache.py), and the
same variant logic: the mask rules (``mask_rules.py``), RoPE (``rope.py``, rotated values rounded to the
input dtype) and the layouts' KV reads (``kv_layouts.py``: ``batch_kv``, the page remap of
``paging.py``). What differs is the structure:

* Operands stay in the input dtype (f16/bf16 reach the tensor cores); accumulation is f32.
* K and V are laid out once per call, before any loop, as tile-major ``[T, h_kv, TILE, d]``
  (dense: per batch entry; KV cache: every entry's rows at a tile boundary of one batch-wide
  buffer, ``tile_offset(b) = base(b) // TILE + b`` with ``base`` the entry's first row of storage,
  so an entry of n rows owns at least ceil(n / TILE) tiles and no entry-dependent buffer is
  allocated inside a loop). Rows past an entry's length are zero, so nothing another entry holds
  (NaN included) reaches it.
* The host walks batch entries and query bands of ``BAND_TILES * TILE`` tokens (``TILE`` tokens
  for a call or entry with at most ``TILE`` queries); a band attends to the KV prefix it can see
  (causal bands stop at their last row's diagonal) in one dispatch and writes its rows in place
  into the carried, token-order output. A band that runs past its entry writes rows that belong
  to later entries (or the padding); the later entry, processed after it, writes them again.
* Nothing the host reads inside a loop comes from the device: the KV-cache kernels take the index
  arrays the host reads (q_indptr, kv_indptr / page_indptr, length_info) as host-readable buffer
  views (``ir.HostReadable``, allocated host-local by the runtime), so loop bounds and offsets are
  plain host values: no loop waits on the device, and every band is written in place.
"""

from __future__ import annotations

from .abi import function_module, operands
from .attention_op import TILE, attend_band
from .ir import (
    DYN, HostReadable, affine_map, arith_d, ceil_div, collapse, const_index, dim, element_type,
    empty, expand, extract_slice, f32, generic, i32, index, insert_slice, ir, le, linalg_d,
    one_of, own_dispatch, sizes_of, storage_tiles, tensor_d, tensor_type, tie_dims,
)
from .kv_cache import RopeArgs, rope_arguments, rotated_if
from .kv_layouts import DENSE, BatchKv, Reader, RowSource, device_read, host_read
from .mask_rules import Lengths, MaskRule, mask_rule
from .online_softmax import row_sinks
from .paging import index_at
from .query_tiles import QueryTiles

#: Query tiles per band of a long call or entry: 256 tokens, the band size of the measured CUDA
#: example (notes: one execute and one dispatch per band, no host wait).
BAND_TILES = 4
#: Bands a step of a dense call's band loop attends (each its own dispatch over its own KV
#: prefix, none reading another's result), joined and written into the output once: one command
#: buffer and one submission a step instead of a band. IREE 3.13 still puts an execution barrier
#: after each of the step's dispatches (it binds the joined result as one resource range, the
#: bands' offsets as constants), so they do not run at once. 1: a band a step (the committed IR).
#: A candidate of the CUDA sweep (bench/gpu_sweep.py), not measured on a GPU yet.
BAND_GROUP = 1


def _zero(elem: ir.Type) -> ir.Value:
    return arith_d.constant(elem, 0.0)


def _pad_rows(x: ir.Value, axis: int, padded: ir.Value) -> ir.Value:
    """``x`` zero-padded along ``axis`` to ``padded`` rows (``tensor.pad`` at the high end)."""
    sizes = sizes_of(x)
    rank = len(sizes)
    high_static = [0] * rank
    high_static[axis] = DYN
    result = tensor_type([DYN if i == axis else (s if isinstance(s, int) else DYN) for i, s in enumerate(sizes)],
                         ir.RankedTensorType(x.type).element_type)
    pad = tensor_d.PadOp(result, x, [], [arith_d.subi(padded, sizes[axis])], [0] * rank, high_static)
    with ir.InsertionPoint(pad.region.blocks.append(*[index()] * rank)):
        tensor_d.YieldOp(_zero(ir.RankedTensorType(x.type).element_type))
    return pad.result


def _band(q_rows: ir.Value, offsets: list, band: int) -> ir.Value:
    """[band, h_kv, G, d] of the token-major ``q_rows`` [..., L, h_kv, G, d] at ``offsets`` (the
    token offset last)."""
    h_kv, group, d = ir.RankedTensorType(q_rows.type).shape[-3:]
    lead = len(offsets) - 1
    rows = extract_slice(q_rows, [*offsets, 0, 0, 0], [*[1] * lead, band, h_kv, group, d])
    return collapse(rows, [list(range(lead + 1)), [lead + 1], [lead + 2], [lead + 3]]) if lead else rows


def _kv_prefix(tiles: ir.Value, offsets: list, count: ir.Value) -> ir.Value:
    """[count, h_kv, TILE, d]: ``count`` tiles of ``tiles`` [..., T, h_kv, TILE, d] from ``offsets``."""
    shape = ir.RankedTensorType(tiles.type).shape
    lead = len(offsets) - 1
    part = extract_slice(tiles, [*offsets, 0, 0, 0], [*[1] * lead, count, *shape[-3:]])
    return collapse(part, [list(range(lead + 1)), [lead + 1], [lead + 2], [lead + 3]]) if lead else part


def _write_band(result: ir.Value, dest: ir.Value, offsets: list) -> ir.Value:
    """``dest`` [..., L_pad, h_q, ...] with the band ``result`` [band, h_kv, G, ...] written in
    token order at ``offsets`` (the token offset last)."""
    shape = ir.RankedTensorType(result.type).shape
    tail = list(shape[3:])
    flat = collapse(result, [[0], [1, 2], *[[3 + i] for i in range(len(tail))]])
    rows = [shape[0], shape[1] * shape[2], *tail]
    lead = len(offsets) - 1
    if lead:
        flat = expand(flat, [[0, 1], *[[i + 1] for i in range(1, len(rows))]], [1, *rows])
        rows = [1, *rows]
    return insert_slice(flat, dest, [*offsets, *[0] * (len(tail) + 1)], rows)


def _joined(bands: list[ir.Value]) -> ir.Value:
    """The bands [band, ...] one after another along their first axis (one band: itself)."""
    if len(bands) == 1:
        return bands[0]
    kind = ir.RankedTensorType(bands[0].type)
    shape = [kind.shape[0] * len(bands), *kind.shape[1:]]
    return tensor_d.concat(tensor_type(shape, kind.element_type), 0, bands)


# ---- dense and masked sequence prefill ----

def build_fused_sequence_prefill(spec, rule: MaskRule | None = None) -> ir.Module:
    """``batch_sequence_prefill_kv[_masked](q, k, v[, valid_lens or custom_mask][, sinks]) -> (output,
    lse)``, fused; ``rule``: the mask (default: the spec's, mask_rules.mask_rule)."""
    rule = rule or mask_rule(spec)

    def emit(args):
        q, k, v, sinks = args["q"], args["k"], args["v"], args.get("sinks")
        scales = (args.get("k_scale"), args.get("v_scale"))  # an 8-bit k and v's, else Nones
        mask = rule.bind(args)
        sizes = [sizes_of(q), sizes_of(q)[:3]]

        def tied(values):
            return [tie_dims(value, size) for value, size in zip(values, sizes)]

        def body(band_tiles, grouped):
            return lambda _unused: tied(_sequence_body(spec, band_tiles, grouped, q, k, v, mask, sinks, scales))

        is_short = le(dim(q, 1), const_index(TILE))
        placeholders = [empty(sizes[0], element_type(spec.dtype)), empty(sizes[1], f32())]
        return one_of(is_short, body(1, 1), body(BAND_TILES, BAND_GROUP), placeholders, tied)

    return function_module(spec, emit)


def _dense_tiles(x: ir.Value, stored_tiles: ir.Value, scales: ir.Value | None, elem: ir.Type) -> ir.Value:
    """[B, L, h_kv, d] -> [B, stored_tiles, h_kv, TILE, d] in the compute dtype ``elem`` (an 8-bit
    ``x`` read through its KV head's ``scales``: kv_layouts.dequantized), rows at or past L zero
    (a zero fill when L == 0: there is no row to read)."""
    batch, length, h_kv, d = sizes_of(x)

    def source(loops):
        b, t, h, i, j = loops
        return b, h, arith_d.addi(arith_d.muli(t, const_index(TILE)), i), j

    return DENSE.stored(x, length, [batch, stored_tiles, h_kv, TILE, d], source, scales, elem, elem)


def _sequence_body(spec, band_tiles: int, grouped: int, q, k, v, mask, sinks, scales):
    """Entries one at a time, query bands of ``band_tiles * TILE`` tokens, ``grouped`` bands a
    step of the band loop (BAND_GROUP); ``mask``: the rule
    bound to the call; ``sinks`` [h_q] f32 or None (semantics §13); ``scales`` (k_scale, v_scale)
    [h_kv] of an 8-bit k and v, else Nones."""
    group, h_kv, d = spec.group_size, spec.h_kv, spec.d
    batch, q_len, kv_len = dim(q, 0), dim(q, 1), dim(k, 1)
    band = band_tiles * TILE
    num_steps = ceil_div(q_len, band)
    if grouped > 1:
        num_steps = ceil_div(num_steps, const_index(grouped))
    padded = arith_d.muli(num_steps, const_index(grouped * band))
    q5 = expand(q, [[0], [1], [2, 3], [4]], [batch, q_len, h_kv, group, d])
    q_rows = _pad_rows(q5, 1, padded)
    stored = storage_tiles(kv_len, TILE)
    elem = element_type(spec.dtype)
    keys, values = _dense_tiles(k, stored, scales[0], elem), _dense_tiles(v, stored, scales[1], elem)
    lengths = Lengths(q_len, kv_len, arith_d.subi(kv_len, q_len))
    driver = QueryTiles([batch, padded, spec.h_q, d], [batch, padded, spec.h_q], group, h_kv, fenced=False)
    head_sinks = None if sinks is None else row_sinks(sinks, h_kv, group, 1)

    def entry(b, carried):
        def valid(row, col):
            return mask.entry(b).valid(lengths, lambda: row, col)

        def attended(first):
            """(output, lse) of the band whose first token is ``first`` (one past the call's
            rows, in the padding of a step's last bands, attends the whole prefix: rows that are
            cut off at the end)."""
            last_row_end = arith_d.minsi(arith_d.addi(first, const_index(band)), q_len)
            visible = mask.visible_tiles(lengths, lambda: last_row_end, TILE, ceil_div(kv_len, TILE))
            return attend_band(_band(q_rows, [b, first], band), _kv_prefix(keys, [b, 0], visible),
                               _kv_prefix(values, [b, 0], visible), first_row=first, valid=valid,
                               sm_scale=spec.sm_scale, soft_cap=spec.logits_soft_cap, sinks=head_sinks)

        def step_of(first, carried):
            out_acc, lse_acc = carried
            starts = [first, *(arith_d.addi(first, const_index(i * band)) for i in range(1, grouped))]
            results = [attended(start) for start in starts]
            # the step's bands joined at static offsets of a new tensor, written once: bands
            # written one by one into the output at offsets the compiler cannot tell apart were
            # ordered one after another (an execution barrier after each dispatch)
            out, lse = (_joined([r[i] for r in results]) for i in (0, 1))
            return [_write_band(out, out_acc, [b, first]), _write_band(lse, lse_acc, [b, first])]

        return driver.tiles(num_steps, grouped * band, carried, step_of)

    out, lse = driver.entries(batch, ir.RankedTensorType(q.type).element_type, entry)
    return [extract_slice(out, [0, 0, 0, 0], [batch, q_len, spec.h_q, d]),
            extract_slice(lse, [0, 0, 0], [batch, q_len, spec.h_q])]


# ---- KV-cache variants: ragged, paged, MLA ----

def tile_offset(kv: BatchKv, read: Reader, b: ir.Value) -> ir.Value:
    return arith_d.addi(arith_d.divsi(kv.base(read, b), const_index(TILE)), b)


def _tile_entries(kv: BatchKv, num_tiles: ir.Value) -> ir.Value:
    """[T] i32: the entry owning each tile, the largest b < B with tile_offset(b) <= t (a binary
    search unrolled over 32 halvings, enough for any batch an int32 indptr describes)."""
    last_entry = arith_d.maxsi(arith_d.subi(kv.batch, const_index(1)), const_index(0))

    def body(_out):
        t = linalg_d.IndexOp(0).result
        lo, hi = const_index(0), last_entry
        for _ in range(32):
            mid = arith_d.divsi(arith_d.addi(arith_d.addi(lo, hi), const_index(1)), const_index(2))
            fits = le(tile_offset(kv, device_read, mid), t)
            lo = arith_d.select(fits, mid, lo)
            hi = arith_d.select(fits, hi, arith_d.maxsi(arith_d.subi(mid, const_index(1)), lo))
        return [arith_d.index_cast(i32(), lo)]

    return generic([], [empty([num_tiles], i32())], [affine_map(1, (0,))], "p", body)[0]


def _locate(kv: BatchKv, entries: ir.Value) -> tuple[ir.Value, ir.Value]:
    """(entry, entry-local row) of loop 0's storage row, inside a generic."""
    row = linalg_d.IndexOp(0).result
    e = index_at(entries, arith_d.divsi(row, const_index(TILE)))
    return e, arith_d.subi(row, arith_d.muli(tile_offset(kv, device_read, e), const_index(TILE)))


def _batch_rows(kv: BatchKv, source: RowSource, columns: int, entries: ir.Value, num_tiles: ir.Value,
                elem: ir.Type) -> ir.Value:
    """Token-major rows [T * TILE, heads, columns] of every entry, zero past each entry's length."""

    def gather(_out):
        e, local = _locate(kv, entries)

        def head_and_column():
            return [linalg_d.IndexOp(1).result, linalg_d.IndexOp(2).result]

        return [kv.row_or_zero(source, e, local, head_and_column, kv.kv_len(device_read, e), elem)]

    rows = arith_d.muli(num_tiles, const_index(TILE))
    return generic([], [empty([rows, kv.heads, columns], elem)], [affine_map(3, range(3))], "ppp", gather)[0]


def _key_positions(kv: BatchKv, entries: ir.Value, num_tiles: ir.Value) -> ir.Value:
    """[T * TILE] i32: ``rope_offset[e] + r`` of each storage row."""

    def position(_out):
        e, local = _locate(kv, entries)
        return [arith_d.addi(tensor_d.extract(kv.rope_offset, [e]), arith_d.index_cast(i32(), local))]

    rows = arith_d.muli(num_tiles, const_index(TILE))
    return generic([], [empty([rows], i32())], [affine_map(1, (0,))], "p", position)[0]


def _tile_major(rows: ir.Value, num_tiles: ir.Value) -> ir.Value:
    """[T * TILE, h, d] -> [T, h, TILE, d]."""
    _, h, d = ir.RankedTensorType(rows.type).shape
    elem = ir.RankedTensorType(rows.type).element_type
    maps = [affine_map(4, (0, 2, 1, 3)), affine_map(4, range(4))]

    def transpose():
        tiled = expand(rows, [[0, 1], [2], [3]], [num_tiles, TILE, h, d])
        return generic([tiled], [empty([num_tiles, h, TILE, d], elem)], maps, "pppp", lambda x, _out: [x])[0]

    # Its own dispatch: left to fusion, IREE 3.13 moved this transpose (and the gather and RoPE
    # before it) into the band loop and recomputed a transient copy for every band.
    return own_dispatch(transpose, tensor_type([DYN, h, TILE, d], elem), [num_tiles, h, TILE, d])


def batch_tiles(kv: BatchKv, num_tiles: ir.Value, rope: RopeArgs | None, elem: ir.Type) -> tuple[ir.Value, ir.Value]:
    """Keys [T, h, TILE, d_qk] (rotated when ``rotary_mode == 1``) and values [T, h, TILE, d_v]."""
    entries = _tile_entries(kv, num_tiles)
    key_rows = _batch_rows(kv, kv.keys, kv.d_qk, entries, num_tiles, elem)
    if kv.rope_offset is not None:
        key_rows = rotated_if(rope, key_rows, _key_positions(kv, entries, num_tiles))
    value_rows = _batch_rows(kv, kv.values, kv.d_v, entries, num_tiles, elem)
    return _tile_major(key_rows, num_tiles), _tile_major(value_rows, num_tiles)


def _kv_cache_body(spec, q, q_indptr: HostReadable, kv: BatchKv, *, mask_args: dict, rule: MaskRule,
                   sm_scale: ir.Value, rope: RopeArgs | None, sinks: ir.Value | None) -> list[ir.Value]:
    """Output [Lq, h_q, d_v] and lse [Lq, h_q] for q [Lq, h_q, d_qk] (already rotated), masked
    by ``rule`` (its operands read from ``mask_args``, the call's arguments by name), with the heads'
    ``sinks`` [h_q] f32 (semantics §13) or None.

    Every value the host needs (loop bounds, offsets) comes from host reads of the index
    arguments (HostReadable): no loop waits on the device, and bands are written in place."""
    group, h_kv, d_qk, d_v = spec.group_size, kv.heads, kv.d_qk, kv.d_v
    dt = ir.RankedTensorType(q.type).element_type
    total_q = dim(q, 0)
    padded = arith_d.addi(total_q, const_index(BAND_TILES * TILE))
    q_rows = _pad_rows(expand(q, [[0], [1, 2], [3]], [total_q, h_kv, group, d_qk]), 0, padded)
    num_tiles = arith_d.maxsi(tile_offset(kv, host_read, kv.batch), const_index(1))
    keys, values = batch_tiles(kv, num_tiles, rope, dt)
    mask = rule.bind(mask_args)
    driver = QueryTiles([padded, spec.h_q, d_v], [padded, spec.h_q], group, h_kv, fenced=False)
    head_sinks = None if sinks is None else row_sinks(sinks, h_kv, group, 1)

    def entry(b, carried):
        q_start = q_indptr.load([b])
        qo_len = arith_d.subi(q_indptr.load([arith_d.addi(b, const_index(1))]), q_start)
        kv_len, first_tile = kv.kv_len(host_read, b), tile_offset(kv, host_read, b)
        lengths = Lengths(qo_len, kv_len, arith_d.subi(kv_len, qo_len))

        def valid(row, col):
            return mask.entry(b).valid(lengths, lambda: row, col)

        def bands_of(band_tiles: int):
            band = band_tiles * TILE

            def band_of(first, carried):
                out_acc, lse_acc = carried
                last_row_end = arith_d.minsi(arith_d.addi(first, const_index(band)), qo_len)
                visible = mask.visible_tiles(lengths, lambda: last_row_end, TILE, ceil_div(kv_len, TILE))
                token = arith_d.addi(q_start, first)
                out, lse = attend_band(_band(q_rows, [token], band), _kv_prefix(keys, [first_tile], visible),
                                       _kv_prefix(values, [first_tile], visible), first_row=first, valid=valid,
                                       sm_scale=sm_scale, soft_cap=spec.logits_soft_cap, sinks=head_sinks)
                return [_write_band(out, out_acc, [token]), _write_band(lse, lse_acc, [token])]

            return lambda carried: driver.tiles(ceil_div(qo_len, band), band, carried, band_of)

        is_short = le(qo_len, const_index(TILE))
        return one_of(is_short, bands_of(1), bands_of(BAND_TILES), driver.tied(carried), driver.tied)

    out, lse = driver.entries(kv.batch, dt, entry)
    return [extract_slice(out, [0, 0, 0], [total_q, spec.h_q, d_v]),
            extract_slice(lse, [0, 0], [total_q, spec.h_q])]


def build_fused_kv_cache_prefill(spec, rule: MaskRule | None = None) -> ir.Module:
    """A KV-cache variant's kernel (kv_cache.build_kv_cache_prefill's signature; q_indptr and the
    layout's host-readable index arguments arrive as buffer views), fused; ``rule``: the mask
    (default: the spec's, mask_rules.mask_rule)."""
    rule = rule or mask_rule(spec)

    def emit(args):
        rope = rope_arguments(spec, args)
        q_indptr = HostReadable(args["q_indptr"], 1, "q_indptr")
        kv = spec.layout.batch_kv(spec, **operands(spec.layout, args))
        q = args["q"] if rope is None else rotated_if(rope, args["q"], args["q_rope_position"])
        return _kv_cache_body(spec, q, q_indptr, kv, mask_args=args, rule=rule, sm_scale=args["sm_scale"], rope=rope,
                              sinks=args.get("sinks"))

    return function_module(spec, emit, host_readable=("q_indptr", *spec.layout.host_readable))
