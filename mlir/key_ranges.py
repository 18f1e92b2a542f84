"""The keys [lo, hi) a query row sees, as i64 index maths inside a hand-written dispatch: the
variant logic the x86 dispatches (mlir/x86_attention.py, x86_kv_cache.py, x86_decode.py) and the
CUDA one (mlir/cuda_attention.py) share. The linalg and fused lowerings take the same rules as
element masks (mlir/mask_rules.py); docs/semantics.md §7 states them."""

from __future__ import annotations

from .amx import const_i64
from .ir import arith_d, ir

#: The masks the kernels take: which keys [lo, hi) a query token t sees, diag = kv_len - q_len,
#: vl = valid_lens[b] (semantics §7, mlir/mask_rules.py: SequenceRule, PaddedRule,
#: CausalPaddedLeftRule):
#:   full                [0, kv_len)
#:   causal              [0, min(kv_len, t + diag + 1))
#:   padded              [0, min(kv_len, vl)) where t < vl, else none
#:   causal_padded_left  [kv_len - vl, min(kv_len, t + diag + 1)) where t >= q_len - vl, else none
MASKS = ("full", "causal", "padded", "causal_padded_left")


def causal_end(token, diag, end) -> ir.Value:
    """min(end, max(0, token + diag + 1)): the end of the keys query token ``token`` sees under
    the bottom-right causal mask (diag = kv_len - q_len), within ``end`` (i64 Values)."""
    return arith_d.minsi(end, arith_d.maxsi(const_i64(0), arith_d.addi(token, arith_d.addi(diag, const_i64(1)))))


class KeyRange:
    """The keys [lo, hi) a row sees (i64 Values), per :data:`MASKS`."""

    def __init__(self, mask: str, q_len, kv_len, valid_len):
        self.mask, self.q_len, self.kv_len, self.valid_len = mask, q_len, kv_len, valid_len
        self.diag = arith_d.subi(kv_len, q_len)

    @property
    def has_lower_bound(self) -> bool:
        return self.mask == "causal_padded_left"

    def lo(self):
        if self.mask != "causal_padded_left":
            return const_i64(0)
        return arith_d.maxsi(const_i64(0), arith_d.subi(self.kv_len, self.valid_len))

    def _causal_end(self, token):
        return causal_end(token, self.diag, self.kv_len)

    def hi(self, token):
        if self.mask == "full":
            return self.kv_len
        if self.mask == "causal":
            return self._causal_end(token)
        if self.mask == "padded":
            seen = arith_d.cmpi(arith_d.CmpIPredicate.slt, token, self.valid_len)
            return arith_d.select(seen, arith_d.minsi(self.kv_len, self.valid_len), const_i64(0))
        seen = arith_d.cmpi(arith_d.CmpIPredicate.sge, token, arith_d.subi(self.q_len, self.valid_len))
        return arith_d.select(seen, self._causal_end(token), const_i64(0))


class FlagCausalKeys:
    """The keys [0, hi) a row sees under the KV-cache causal rule with the call's runtime
    ``causal`` flag (i1; mask_rules.KvCacheCausalRule): below ``end`` (a serving pass's chunk end
    or kv_len) and kv_len and, when causal, on or left of the bottom-right diagonal (i64 Values)."""

    has_lower_bound = False

    def __init__(self, kv_len, qo_len, causal, end):
        self.end = arith_d.minsi(kv_len, end)
        self.diag = arith_d.subi(kv_len, qo_len)
        self.causal = causal

    def lo(self):
        return const_i64(0)

    def hi(self, token):
        return arith_d.select(self.causal, causal_end(token, self.diag, self.end), self.end)
