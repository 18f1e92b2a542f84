"""Which (query row, KV column) pairs enter the softmax, per variant family: the one definition
both lowerings use (online_softmax's score generic on llvm-cpu, attention_op's mask on CUDA).

Rows and columns are index values local to one batch entry; ``row`` is passed as a callable so
that a rule which does not need the row (a non-causal length mask) emits no row arithmetic.
Causal masks are bottom-right aligned: ``col <= row + diagonal`` with ``diagonal = kv_len -
q_len`` (semantics §3).
"""

from __future__ import annotations

from typing import Callable

from .ir import arith_d, ir, le, logical_not, lt


def all_of(*conds: ir.Value) -> ir.Value:
    result = conds[0]
    for cond in conds[1:]:
        result = arith_d.andi(result, cond)
    return result


def sequence_validity(spec, col: ir.Value, row: Callable[[], ir.Value], *, q_len: ir.Value, kv_len: ir.Value,
                      diagonal: ir.Value, valid_len: ir.Value | None) -> ir.Value:
    """Dense (``valid_len`` None: length, and causal when ``spec.causal``) or masked sequence
    prefill (``spec.mask_mode``: ``padded`` keeps rows and columns below ``valid_len``;
    ``causal_padded_left`` keeps the last ``valid_len`` rows and columns, causal), semantics §7."""
    if valid_len is None:
        conds = [lt(col, kv_len)]
        if spec.causal:
            conds.append(le(col, arith_d.addi(row(), diagonal)))
        return all_of(*conds)
    token = row()
    if spec.mask_mode == "padded":
        return all_of(lt(col, kv_len), lt(col, valid_len), lt(token, valid_len))
    first_valid_row = arith_d.subi(q_len, valid_len)
    first_valid_col = arith_d.subi(kv_len, valid_len)
    return all_of(
        lt(col, kv_len),
        le(first_valid_row, token),
        le(first_valid_col, col),
        le(col, arith_d.addi(token, diagonal)),
    )


def kv_cache_validity(col: ir.Value, row: Callable[[], ir.Value], *, kv_len: ir.Value, diagonal: ir.Value,
                      causal: ir.Value) -> ir.Value:
    """KV-cache variants: inside the entry's (logical) KV length and, when the runtime flag
    ``causal`` (i1) holds, on or left of the bottom-right diagonal."""
    in_diagonal = le(col, arith_d.addi(row(), diagonal))
    causal_ok = arith_d.ori(logical_not(causal), in_diagonal)
    return arith_d.andi(lt(col, kv_len), causal_ok)
