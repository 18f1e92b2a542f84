"""Reading index arrays and page tables inside the kernels (semantics §2): the helpers every
KV-cache lowering shares (kv_layouts.py, kv_cache.py, fused_kernels.py, decode.py).

An entry's pages are ``page_values[page_indptr[b]:page_indptr[b + 1]]``; its logical row ``r``
is physical row ``r`` (``r < sink_tokens``) or ``r - sink_tokens + window_offset``, at (page,
slot) = (``page_values[first_page + physical // page_size]``, ``physical % page_size``). Every index
is clamped into range, so a row past the entry's length never reads out of bounds (its result is
zeroed or masked by the caller).
"""

from __future__ import annotations

from dataclasses import dataclass

from .ir import affine_map, arith_d, const_index, dim, empty, generic, index, ir, linalg_d, lt, storage_tiles, tensor_d


@dataclass(frozen=True)
class PageTable:
    """Index values locating one entry's rows in the page table (§2)."""

    first_page: ir.Value  # position of the entry's first page in page_values
    physical_len: ir.Value  # rows stored in its pages
    kv_len: ir.Value  # logical rows (after the sink-token/window remap)
    window_offset: ir.Value  # physical row of logical row ``sink_tokens`` (0 without sliding window)
    sink_tokens: ir.Value  # attention-sink tokens kept before the window (length_info[2]; 0 without)


def read_element(array: ir.Value, indices: list) -> ir.Value:
    """``array[indices]`` of an i32 tensor, as an index (read where the code runs)."""
    return arith_d.index_cast(index(), tensor_d.extract(array, indices))


def index_at(array: ir.Value, position: ir.Value) -> ir.Value:
    """``array[position]`` of an i32 tensor, as an index."""
    return read_element(array, [position])


def page_table(spec, b, page_indptr, length_info, read=read_element) -> PageTable:
    """Entry ``b``'s page-table geometry; ``read(array, indices)`` reads an element of
    ``page_indptr`` or ``length_info`` as an index (the fused lowering's host side passes
    ``HostReadable`` arrays and their loads)."""
    first_page = read(page_indptr, [b])
    num_pages = arith_d.subi(read(page_indptr, [arith_d.addi(b, const_index(1))]), first_page)
    has_pages = arith_d.cmpi(arith_d.CmpIPredicate.sgt, num_pages, const_index(0))
    zero = const_index(0)
    if spec.sliding_window:
        def info(row):
            return read(length_info, [const_index(row), b])
        last_page_len, window_offset, sink_tokens = info(0), info(1), info(2)
    else:
        last_page_len, window_offset, sink_tokens = read(length_info, [b]), zero, zero
    full_pages = arith_d.muli(arith_d.subi(num_pages, const_index(1)), const_index(spec.page_size))
    physical_len = arith_d.select(has_pages, arith_d.addi(full_pages, last_page_len), zero)
    logical_len = arith_d.addi(arith_d.subi(physical_len, window_offset), sink_tokens)
    kv_len = arith_d.select(has_pages, arith_d.maxsi(logical_len, zero), zero)
    return PageTable(first_page, physical_len, kv_len, window_offset, sink_tokens)


def gather_rows(spec, table: PageTable, page_values, fetch, shape, elem) -> ir.Value:
    """A token-major tensor [kv_pad, *shape] of rows gathered through the page table.

    ``fetch(page, slot, out_indices)`` returns the scalar for logical row ``r`` whose physical
    position is ``(page, slot)``; every index is clamped into range, so rows past ``kv_len``
    (whose result is zeroed later) never read out of bounds. One generic per tensor: a
    multi-result gather fused with its consumer fails to compile for h_kv == 1 ("write affecting
    operations on global resources", IREE 3.13).
    """
    kv_pad = arith_d.muli(storage_tiles(table.kv_len, spec.kv_tile), const_index(spec.kv_tile))
    out = empty([kv_pad, *shape], elem)
    rank = 1 + len(shape)
    bounds = page_bounds(table, page_values)

    def body(_out):
        page, slot = physical_row(spec, table, page_values, linalg_d.IndexOp(0).result, bounds)
        out_indices = [linalg_d.IndexOp(i).result for i in range(1, rank)]
        return [fetch(page, slot, out_indices)]

    return generic([], [out], [affine_map(rank, range(rank))], "p" * rank, body)[0]


def page_bounds(table: PageTable, page_values: ir.Value) -> tuple[ir.Value, ir.Value]:
    """(last page slot of page_values, last physical row of the entry), both at least 0: the
    clamps of :func:`physical_row`."""
    last_page_slot = arith_d.maxsi(arith_d.subi(dim(page_values, 0), const_index(1)), const_index(0))
    last_row = arith_d.maxsi(arith_d.subi(table.physical_len, const_index(1)), const_index(0))
    return last_page_slot, last_row


def physical_row(spec, table: PageTable, page_values: ir.Value, r: ir.Value,
                 bounds: tuple[ir.Value, ir.Value]) -> tuple[ir.Value, ir.Value]:
    """(page id, slot) of the entry's logical row ``r`` (§2): the sink-token rows [0, sink_tokens)
    are the first physical rows, the rest start at ``window_offset``; every index is clamped into range
    (``bounds`` from :func:`page_bounds`), so rows past kv_len never read out of bounds."""
    last_page_slot, last_row = bounds
    remapped = arith_d.addi(arith_d.subi(r, table.sink_tokens), table.window_offset)
    physical = arith_d.select(lt(r, table.sink_tokens), r, remapped)
    physical = arith_d.maxsi(arith_d.minsi(physical, last_row), const_index(0))
    page_slot = arith_d.addi(table.first_page, arith_d.divui(physical, const_index(spec.page_size)))
    page_slot = arith_d.minsi(page_slot, last_page_slot)
    page = arith_d.index_cast(index(), tensor_d.extract(page_values, [page_slot]))
    slot = arith_d.remui(physical, const_index(spec.page_size))
    return page, slot


def clamped_page(page: ir.Value, pages: ir.Value) -> ir.Value:
    """A page id forced into [0, P): the host checks reject bad ids; this only guarantees no
    out-of-bounds read if a caller bypasses them."""
    last = arith_d.subi(dim(pages, 0), const_index(1))
    return arith_d.maxsi(arith_d.minsi(page, last), const_index(0))
