"""The mask as an object: which (query row, KV column) pairs enter the softmax, one class per
rule, taken by every builder (both lowerings' prefill kernels and the serving passes).

    rule = mask_rule(spec)                       # from the spec's fields
    call = rule.bind({"causal": causal, ...})    # per call: IR built once, before the entry loop
    entry = call.entry(b)                        # per entry: the values it reads (valid_lens[b], ...)
    entry.valid(lengths, row, col)               # i1: the pair enters the softmax
    call.visible_tiles(lengths, last_row_end, kv_tile, every)   # KV tiles a query tile visits
    call.unmasked_tiles(lengths, first_row, kv_tile)            # leading tiles it sees whole

Rows and columns are index values local to one batch entry; ``row`` is passed as a callable so
that a rule which does not need the row (a non-causal length mask) emits no row arithmetic.
Causal masks are bottom-right aligned: ``col <= row + diagonal`` with ``diagonal = kv_len -
q_len`` (semantics §3). A rule names the kernel arguments it reads (``operands``; the builder
passes them to :meth:`MaskRule.bind` by name), the rows it adds to its variant's argument table
(``arguments``: mlir/abi.py appends them) and whether a KV-cache call's short entries may take
the one-pass serving kernels (``one_pass``: those know only the KV-cache causal mask).

A new mask is a class here, its host half in runtime/masks.py (checks, examples, a wrapper's
plan), its spec field and its reference; the builders and the table take it unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from .arg import Arg
from .ir import arith_d, ceil_div, const_index, dim, index, ir, is_one, le, logical_not, lt, tensor_d
from .online_softmax import unmasked_kv_tiles
from .specs import MaskedSequencePrefillSpec, SequencePrefillSpec

Row = Callable[[], ir.Value]


@dataclass(frozen=True)
class Lengths:
    """One entry's index values the rules read: its query rows ``q_len`` (qo_len), its KV length
    ``kv_len`` and ``diagonal = kv_len - q_len`` (causal: ``col <= row + diagonal``)."""

    q_len: ir.Value
    kv_len: ir.Value
    diagonal: ir.Value


def all_of(*conds: ir.Value) -> ir.Value:
    result = conds[0]
    for cond in conds[1:]:
        result = arith_d.andi(result, cond)
    return result


def causal_visible_tiles(causal, lengths: Lengths, last_row_end: Row, kv_tile: int, every: ir.Value) -> ir.Value:
    """KV tiles a query tile must visit: ``every`` (all of the entry's), or, when ``causal`` (a
    Python bool, or an i1 Value for kernels that take it at run time), up to the diagonal of its
    last row (``last_row_end() - 1``): the growing KV prefix that skips masked work."""
    if causal is False:
        return every
    causal_end = arith_d.maxsi(arith_d.minsi(arith_d.addi(last_row_end(), lengths.diagonal), lengths.kv_len),
                               const_index(0))
    limited = ceil_div(causal_end, kv_tile)
    return limited if causal is True else arith_d.select(causal, limited, every)


class MaskRule:
    """The base rule: every method but :meth:`valid` has the answer of a mask that may hide any
    pair (visit every tile, none seen whole); a rule overrides what it knows better."""

    #: The kernel arguments the rule reads, by their argument-table names.
    operands: tuple[str, ...] = ()
    #: The rows the rule adds to its variant's argument table (mlir/abi.py), after the variant's
    #: own (a rule may also read one of those: the KV-cache ``causal`` flag).
    arguments: tuple[Arg, ...] = ()
    #: Whether a KV-cache call's short entries may run in the one-pass serving kernels
    #: (mlir/decode.py, mlir/fused_decode.py), which apply the KV-cache causal mask only.
    one_pass: bool = False

    def bind(self, args: Mapping[str, ir.Value]) -> "CallMask":
        """The rule for one call: ``args`` holds (at least) the ``operands`` by name; the IR the
        call's entries share is built here."""
        return CallMask(self, self.call_values({name: args[name] for name in self.operands}))

    def call_values(self, args: dict) -> dict:
        """Per-call values (built where :meth:`bind` is called)."""
        return args

    def entry_values(self, call: dict, entry: ir.Value) -> dict:
        """Per-entry values of batch entry ``entry`` (built where :meth:`CallMask.entry` is called)."""
        return call

    def valid(self, values: dict, lengths: Lengths, row: Row, col: ir.Value) -> ir.Value:
        raise NotImplementedError

    def visible_tiles(self, call: dict, lengths: Lengths, last_row_end: Row, kv_tile: int,
                      every: ir.Value) -> ir.Value:
        return every

    def unmasked_tiles(self, call: dict, lengths: Lengths, first_row: ir.Value, kv_tile: int) -> ir.Value | None:
        return None


@dataclass(frozen=True)
class CallMask:
    """A rule bound to one call's arguments (:meth:`MaskRule.bind`)."""

    rule: MaskRule
    values: dict

    def entry(self, entry: ir.Value) -> "EntryMask":
        return EntryMask(self.rule, self.rule.entry_values(self.values, entry))

    def per_call(self) -> "EntryMask":
        """The rule for any entry, from the call's values alone: what the serving passes use
        (their arguments carry no per-entry mask values, so they take only ``one_pass`` rules)."""
        return EntryMask(self.rule, self.values)

    def visible_tiles(self, lengths: Lengths, last_row_end: Row, kv_tile: int, every: ir.Value) -> ir.Value:
        """KV tiles of ``kv_tile`` columns a query tile whose rows end at ``last_row_end()`` (an
        exclusive entry-local row, built only if the rule needs it) visits; ``every`` is the
        count of the entry's tiles."""
        return self.rule.visible_tiles(self.values, lengths, last_row_end, kv_tile, every)

    def unmasked_tiles(self, lengths: Lengths, first_row: ir.Value, kv_tile: int) -> ir.Value | None:
        """Leading KV tiles every row from ``first_row`` on sees whole (online_softmax's
        ``unmasked_tiles``), or None when the rule cannot tell."""
        return self.rule.unmasked_tiles(self.values, lengths, first_row, kv_tile)


@dataclass(frozen=True)
class EntryMask:
    """A rule bound to one batch entry (:meth:`CallMask.entry`)."""

    rule: MaskRule
    values: dict

    def valid(self, lengths: Lengths, row: Row, col: ir.Value) -> ir.Value:
        """i1: (``row()``, ``col``) enters the softmax."""
        return self.rule.valid(self.values, lengths, row, col)


# ---- dense and masked sequence prefill (semantics §3, §7) ----

@dataclass(frozen=True)
class SequenceRule(MaskRule):
    """Dense prefill: every column inside ``kv_len`` and, when ``causal``, on or left of the
    bottom-right diagonal."""

    causal: bool

    def valid(self, values, lengths, row, col):
        conds = [lt(col, lengths.kv_len)]
        if self.causal:
            conds.append(le(col, arith_d.addi(row(), lengths.diagonal)))
        return all_of(*conds)

    def visible_tiles(self, call, lengths, last_row_end, kv_tile, every):
        return causal_visible_tiles(self.causal, lengths, last_row_end, kv_tile, every)

    def unmasked_tiles(self, call, lengths, first_row, kv_tile):
        return unmasked_kv_tiles(lengths.kv_len, first_row, lengths.diagonal, kv_tile, self.causal)


class _ValidLength(MaskRule):
    """The masked-sequence modes with a per-entry ``valid_lens[b]`` (semantics §7)."""

    operands = ("valid_lens",)
    arguments = (Arg("valid_lens", "index", ("B",)),)

    def entry_values(self, call, entry):
        return {"valid_len": arith_d.index_cast(index(), tensor_d.extract(call["valid_lens"], [entry]))}


class PaddedRule(_ValidLength):
    """``padded``: rows and columns below ``valid_len`` (right padding, bidirectional)."""

    def valid(self, values, lengths, row, col):
        token, valid_len = row(), values["valid_len"]
        return all_of(lt(col, lengths.kv_len), lt(col, valid_len), lt(token, valid_len))


class CausalPaddedLeftRule(_ValidLength):
    """``causal_padded_left``: the last ``valid_len`` rows and columns (left padding), causal."""

    def valid(self, values, lengths, row, col):
        token, valid_len = row(), values["valid_len"]
        first_valid_row = arith_d.subi(lengths.q_len, valid_len)
        first_valid_col = arith_d.subi(lengths.kv_len, valid_len)
        return all_of(
            lt(col, lengths.kv_len),
            le(first_valid_row, token),
            le(first_valid_col, col),
            le(col, arith_d.addi(token, lengths.diagonal)),
        )

    def visible_tiles(self, call, lengths, last_row_end, kv_tile, every):
        return causal_visible_tiles(True, lengths, last_row_end, kv_tile, every)


# ---- KV-cache variants (semantics §3, §11) ----

class KvCacheCausalRule(MaskRule):
    """Inside the entry's (logical) KV length and, when the call's ``causal`` flag (i32) is 1, on
    or left of the bottom-right diagonal. The serving passes know this rule."""

    operands = ("causal",)
    one_pass = True

    def call_values(self, args):
        return {"causal": is_one(args["causal"])}

    def valid(self, values, lengths, row, col):
        in_diagonal = le(col, arith_d.addi(row(), lengths.diagonal))
        causal_ok = arith_d.ori(logical_not(values["causal"]), in_diagonal)
        return arith_d.andi(lt(col, lengths.kv_len), causal_ok)

    def visible_tiles(self, call, lengths, last_row_end, kv_tile, every):
        return causal_visible_tiles(call["causal"], lengths, last_row_end, kv_tile, every)

    def unmasked_tiles(self, call, lengths, first_row, kv_tile):
        return unmasked_kv_tiles(lengths.kv_len, first_row, lengths.diagonal, kv_tile, call["causal"])


# ---- custom masks (semantics §14) ----

def _clamped(value: ir.Value, last: ir.Value) -> ir.Value:
    """``value`` forced into [0, last]."""
    return arith_d.maxsi(arith_d.minsi(value, last), const_index(0))


def _allowed(bit: ir.Value) -> ir.Value:
    """An i8 mask element as i1 (non-zero: the query may see the key)."""
    return arith_d.cmpi(arith_d.CmpIPredicate.ne, bit, arith_d.constant(bit.type, 0))


class CustomMaskRule(MaskRule):
    """KV-cache custom mask: entry b's ``qo_len x kv_len`` block of ``custom_mask`` (i8, row-major,
    from ``mask_indptr[b]``); the ``causal`` flag is not read. Every tile is visited and masked;
    short entries run in the main kernel (the serving passes have no mask operand)."""

    operands = ("custom_mask", "mask_indptr")
    #: Each entry's qo_len x kv_len block, row-major, concatenated (``nnz_mask`` = sum of
    #: qo_len * kv_len), and the offsets of the blocks (semantics §14).
    arguments = (Arg("custom_mask", "mask", ("nnz_mask",)), Arg("mask_indptr", "index", ("B+1",)))

    def entry_values(self, call, entry):
        start = arith_d.index_cast(index(), tensor_d.extract(call["mask_indptr"], [entry]))
        return {**call, "start": start}

    def valid(self, values, lengths, row, col):
        # Rows past the entry (a tile's padding) and columns past kv_len read a clamped element
        # of the entry's own block; the host checks make every block exactly qo_len x kv_len.
        mask = values["custom_mask"]
        last_row = arith_d.subi(lengths.q_len, const_index(1))
        last_col = arith_d.subi(lengths.kv_len, const_index(1))
        offset = arith_d.addi(arith_d.muli(_clamped(row(), last_row), lengths.kv_len), _clamped(col, last_col))
        position = _clamped(arith_d.addi(values["start"], offset), arith_d.subi(dim(mask, 0), const_index(1)))
        return arith_d.andi(lt(col, lengths.kv_len), _allowed(tensor_d.extract(mask, [position])))


class DenseCustomMaskRule(MaskRule):
    """Masked sequence prefill with ``mask_mode="custom"``: ``custom_mask[b, row, col]`` (i8
    [B, Lq, Lk])."""

    operands = ("custom_mask",)
    arguments = (Arg("custom_mask", "mask", ("B", "Lq", "Lk")),)

    def entry_values(self, call, entry):
        return {**call, "entry": entry}

    def valid(self, values, lengths, row, col):
        mask = values["custom_mask"]
        last_row = arith_d.subi(lengths.q_len, const_index(1))
        last_col = arith_d.subi(lengths.kv_len, const_index(1))
        bit = tensor_d.extract(mask, [values["entry"], _clamped(row(), last_row), _clamped(col, last_col)])
        return arith_d.andi(lt(col, lengths.kv_len), _allowed(bit))


def mask_rule(spec) -> MaskRule:
    """The rule of a variant spec (a pass's: its base spec's)."""
    if isinstance(spec, SequencePrefillSpec):
        return SequenceRule(spec.causal)
    if isinstance(spec, MaskedSequencePrefillSpec):
        return {"padded": PaddedRule, "causal_padded_left": CausalPaddedLeftRule,
                "custom": DenseCustomMaskRule}[spec.mask_mode]()
    if getattr(spec, "custom_mask", False):
        return CustomMaskRule()
    return KvCacheCausalRule()
