"""The host half of each mask rule (mlir/mask_rules.py holds the IR half and the argument rows):
how a call's mask arguments are checked, drawn for an example, and taken by a wrapper's ``plan``
(and, for the dense masked wrapper, each layer checked against the plan: ``check_layer``).
``host_mask(spec)`` is the object of the spec's rule; a new mask is a class there and one here,
keyed by the IR rule's class in :data:`HOST_MASKS`.

A mask sees a call's lengths as :class:`CallLengths`: each entry's qo_len and kv_len, and for the
dense variants the padded (B, Lq, Lk).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..mlir.mask_rules import (
    CausalPaddedLeftRule, CustomMaskRule, DenseCustomMaskRule, KvCacheCausalRule, PaddedRule, SequenceRule, mask_rule,
)
from .checks import INT32_MAX, check_indptr, check_int32, check_mask, check_range
from .errors import InputError
from .kv_layouts import indptr


@dataclass(frozen=True)
class CallLengths:
    """A call's lengths: ``qo_lens`` int64 [B], ``kv_lens()`` int64 [B] (computed when a mask
    needs them: a paged table's lengths take work), ``padded`` (B, Lq, Lk) of a dense call."""

    qo_lens: np.ndarray
    kv_lens: Callable[[], np.ndarray]
    padded: tuple[int, int, int] | None = None

    @classmethod
    def dense(cls, batch: int, rows: int, cols: int) -> "CallLengths":
        return cls(np.full(batch, rows, np.int64), lambda: np.full(batch, cols, np.int64), (batch, rows, cols))


class HostMask:
    """A rule with no arguments of its own (the causal flag is the variant's scalar): nothing to
    check or draw, and a plan given mask arguments refuses them by name."""

    def check(self, named: Mapping, lengths: CallLengths) -> dict:
        """The rule's arguments of ``named``, checked, by name (InputError naming one otherwise)."""
        return {}

    def example(self, rng: np.random.Generator, sizes: dict) -> dict:
        """Example values of the rule's arguments by name (``sizes``: runtime/examples.py's)."""
        return {}

    def plan(self, spec, given: Mapping, lengths: CallLengths) -> dict:
        """A wrapper's ``plan`` keywords for the mask (``given``: name -> value or None), checked."""
        for name, value in given.items():
            if value is not None:
                raise InputError(f"{name}: {spec.name} has no custom mask; build the spec with custom_mask=True")
        return {}


class ValidLengths(HostMask):
    """``valid_lens`` int32 [B] in [0, min(Lq, Lk)] (padded and causal_padded_left; the dense
    examples draw it with the batch: runtime/examples.py)."""

    def check(self, named, lengths):
        batch, rows, cols = lengths.padded
        valid_lens = check_int32("valid_lens", named["valid_lens"], shape=(batch,))
        check_range("valid_lens", valid_lens, 0, min(rows, cols))
        return {"valid_lens": valid_lens}

    def plan_dense(self, spec, given: Mapping) -> tuple[dict, np.ndarray, np.ndarray, int, int]:
        """A dense wrapper's ``plan(valid_lens, custom_mask=)``: (arrays by name, qo_lens, kv_lens
        int64 [B], rows, cols; 0 rows and cols: any q and k of those lengths)."""
        if given.get("custom_mask") is not None:
            raise InputError(f"custom_mask: mask_mode {spec.mask_mode!r} takes valid_lens; build the spec "
                             "with mask_mode='custom' for a custom mask")
        if given.get("valid_lens") is None:
            raise InputError("valid_lens: required (int32 [B])")
        valid_lens = check_int32("valid_lens", given["valid_lens"], shape=(None,))
        check_range("valid_lens", valid_lens, 0, INT32_MAX)
        lens = valid_lens.astype(np.int64)
        return {"valid_lens": valid_lens}, lens, lens.copy(), 0, 0

    def check_layer(self, plan, rows: int, cols: int) -> None:
        """A layer's q and k (Lq ``rows``, Lk ``cols``) against the plan: the planned lengths fit."""
        limit, longest = min(rows, cols), int(plan.kv_lens.max(initial=0))
        if longest > limit:
            raise InputError(f"valid_lens: planned lengths must lie in [0, min(Lq, Lk)] = [0, {limit}] "
                             f"for this layer's q and k, found {longest}")


class DenseCustomMask(HostMask):
    """``custom_mask`` bool or uint8 [B, Lq, Lk] (semantics §14.2)."""

    def check(self, named, lengths):
        return {"custom_mask": check_mask("custom_mask", named["custom_mask"], shape=lengths.padded)}

    def plan_dense(self, spec, given: Mapping) -> tuple[dict, np.ndarray, np.ndarray, int, int]:
        """As :meth:`ValidLengths.plan_dense`: the mask's shape [B, Lq, Lk] gives the lengths."""
        if given.get("valid_lens") is not None:
            raise InputError("valid_lens: a mask_mode='custom' spec takes custom_mask [B, Lq, Lk], not valid_lens")
        if given.get("custom_mask") is None:
            raise InputError("custom_mask: a mask_mode='custom' spec needs custom_mask [B, Lq, Lk] (bool or uint8)")
        mask = check_mask("custom_mask", given["custom_mask"], shape=(None, None, None))
        batch, rows, cols = mask.shape
        return {"custom_mask": mask}, np.full(batch, rows, np.int64), np.full(batch, cols, np.int64), rows, cols

    def check_layer(self, plan, rows: int, cols: int) -> None:
        """A layer's q and k (Lq ``rows``, Lk ``cols``) against the plan: the mask's own shape."""
        if (rows, cols) != (plan.rows, plan.kv_rows):
            raise InputError(f"q: Lq {rows} and Lk {cols} (k) differ from the planned custom_mask's "
                             f"[B, Lq, Lk] = [{plan.qo_lens.shape[0]}, {plan.rows}, {plan.kv_rows}]")

    def example(self, rng, sizes):
        return {"custom_mask": rng.random((sizes["B"], sizes["Lq"], sizes["Lk"])) < 0.75}


class KvCustomMask(HostMask):
    """A KV-cache custom mask (semantics §14): ``custom_mask`` bool or uint8 (values 0 or 1)
    [sum of qo_len * kv_len], checked as int8; ``mask_indptr`` int32 [B+1] with
    mask_indptr[b + 1] - mask_indptr[b] = qo_len(b) * kv_len(b)."""

    def check(self, named, lengths):
        sizes = lengths.qo_lens * lengths.kv_lens()
        total = int(sizes.sum())
        custom_mask = check_mask("custom_mask", named["custom_mask"], shape=(None,))
        if custom_mask.shape[0] != total:
            raise InputError(f"custom_mask: expected sum of qo_len * kv_len = {total} elements, "
                             f"got {custom_mask.shape[0]}")
        mask_indptr = check_indptr("mask_indptr", named["mask_indptr"], sizes.shape[0], total,
                                   "the sum of qo_len * kv_len")
        wrong = np.nonzero(np.diff(mask_indptr.astype(np.int64)) != sizes)[0]
        if wrong.size:
            b = int(wrong[0])
            raise InputError(f"mask_indptr: entry {b} spans {mask_indptr[b + 1] - mask_indptr[b]} elements, "
                             f"expected qo_len * kv_len = {sizes[b]}")
        return {"custom_mask": custom_mask, "mask_indptr": mask_indptr}

    def example(self, rng, sizes):
        blocks = sizes["blocks"]  # qo_len * kv_len per entry
        return {"custom_mask": rng.random(int(blocks.sum())) < 0.75, "mask_indptr": indptr(blocks)}

    def plan(self, spec, given, lengths):
        """``custom_mask`` required; ``mask_indptr`` defaults to the cumulative qo_len * kv_len (§14.4)."""
        if given.get("custom_mask") is None:
            raise InputError(f"custom_mask: {spec.name} has custom_mask; plan needs custom_mask "
                             "[sum of qo_len * kv_len] (bool or uint8)")
        mask_indptr = given.get("mask_indptr")
        if mask_indptr is None:  # int64: a sum past int32 fails the check by name
            mask_indptr = np.concatenate([[0], np.cumsum(lengths.qo_lens * lengths.kv_lens())])
        return self.check({"custom_mask": given["custom_mask"], "mask_indptr": mask_indptr}, lengths)


#: The host half of each IR rule, by the rule's class.
HOST_MASKS: dict[type, HostMask] = {
    SequenceRule: HostMask(), KvCacheCausalRule: HostMask(), PaddedRule: ValidLengths(),
    CausalPaddedLeftRule: ValidLengths(), DenseCustomMaskRule: DenseCustomMask(), CustomMaskRule: KvCustomMask(),
}


def host_mask(spec) -> HostMask:
    """The host half of ``spec``'s mask rule (a pass's: its base spec's)."""
    return HOST_MASKS[type(mask_rule(spec))]
