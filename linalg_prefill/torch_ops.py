"""Every variant as a torch custom op, ``torch.ops.linalg_prefill.*``, with a fake implementation
so ``torch.compile(fullgraph=True)`` traces through it.

    import linalg_prefill.torch_ops  # registers the ops
    out, lse = torch.ops.linalg_prefill.sequence_prefill(q, k, v, True, 0.125, 0.0)

Each op's schema is generated from the variant's argument table (mlir/abi.py): its arguments by
the table's names, in its order (README, "The seed's arguments"), then the spec's compile-time
fields (:data:`OPS`); head counts, head dims and dtype come from the tensors. ``rope_scaling`` is
a JSON object string (``"{}"``: plain RoPE), ``rotary_dim`` 0 means the whole head. The ops run
the llvm-cpu kernels on CPU tensors (compiled once per spec, cached on disk), by argument name,
and return ``(output, lse)``: output like q with ``d_v`` columns, lse float32 without the
head-dim axis.
"""

from __future__ import annotations

try:
    import torch
except ImportError as err:  # pragma: no cover
    raise ImportError(f"linalg_prefill.torch_ops needs torch: pip install 'linalg-prefill[hf]' ({err})") from err

import json
from dataclasses import dataclass
from typing import Callable

from .mlir import (
    MaskedSequencePrefillSpec, MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec, SequencePrefillSpec,
)
from .mlir.abi import arguments
from .runtime import shared_kernel
from .runtime.dtypes import HOST_DTYPES

__all__ = ["OPS", "kernel_for", "DTYPES"]

#: The kernels' dtype of each torch dtype they take (runtime/dtypes.py).
DTYPES = {getattr(torch, dtype.torch): name for name, dtype in HOST_DTYPES.items()}
#: The schema type of each argument kind of the table (mlir/abi.py).
_SCHEMA_TYPES = {"tensor": "Tensor", "kv": "Tensor", "index": "Tensor", "mask": "Tensor", "f32": "Tensor",
                 "scale": "Tensor", "int": "int", "float": "float"}


def kernel_for(spec):
    """The llvm-cpu kernel of ``spec``, compiled (or read from the disk cache) once per process
    (runtime.shared_kernel: the library's one kernel memo)."""
    return shared_kernel(spec, "llvm-cpu")


@dataclass(frozen=True)
class Op:
    """One op: the variant's ``table`` spec (any spec of it without options: the argument table
    names its arguments), its compile-time ``fields`` (name, schema type, default or None),
    ``spec_of(args)``, the spec of a call from its arguments by name, ``d_v_of(args)``, its
    output's head dim (the fake implementation's), and ``shapes``, its tensors' shapes in words."""

    name: str
    table: object
    fields: tuple
    spec_of: Callable[[dict], object]
    d_v_of: Callable[[dict], int]
    shapes: str

    @property
    def argument_names(self) -> tuple[str, ...]:
        return (*(arg.name for arg in arguments(self.table)), *(name for name, _, _ in self.fields))

    def schema(self) -> str:
        """The op's schema: the table's arguments, then the fields."""
        table = [f"{_SCHEMA_TYPES[arg.kind]} {arg.name}" for arg in arguments(self.table)]
        fields = [f"{kind} {name}" + ("" if default is None else f"={json.dumps(default)}")
                  for name, kind, default in self.fields]
        return f"({', '.join(table + fields)}) -> (Tensor, Tensor)"

    def named(self, args: tuple, kwargs: dict) -> dict:
        """A call's arguments by name, the fields it leaves out at their defaults."""
        defaults = {name: default for name, _, default in self.fields if default is not None}
        return {**defaults, **dict(zip(self.argument_names, args)), **kwargs}


def _dense(named) -> dict:
    q, k = named["q"], named["k"]
    return dict(h_q=q.shape[2], h_kv=k.shape[2], d=q.shape[3], dtype=DTYPES[q.dtype])


def _ragged(named) -> RaggedPrefillSpec:
    q, k, v, order = named["q"], named["k"], named["v"], named["kv_order"]
    return RaggedPrefillSpec(q.shape[1], k.shape[1] if order == "nhd" else k.shape[0], q.shape[2], v.shape[2],
                             DTYPES[q.dtype], json.loads(named["rope_scaling"]),
                             logits_soft_cap=named["logits_soft_cap"], rotary_dim=named["rotary_dim"] or None,
                             kv_order=order)


def _paged(named) -> PagedPrefillSpec:
    q, pages, order = named["q"], named["pages"], named["kv_order"]
    h_kv, page_size = (pages.shape[2], pages.shape[3]) if order == "hnd" else (pages.shape[3], pages.shape[2])
    return PagedPrefillSpec(q.shape[1], h_kv, q.shape[2], DTYPES[q.dtype], page_size=page_size,
                            rope_scaling=json.loads(named["rope_scaling"]),
                            sliding_window=named["length_info"].dim() == 2, logits_soft_cap=named["logits_soft_cap"],
                            rotary_dim=named["rotary_dim"] or None, kv_order=order)


def _mla(named) -> MlaPagedPrefillSpec:
    q, d_latent = named["q"], named["d_latent"]
    return MlaPagedPrefillSpec(q.shape[1], d_latent, q.shape[2] - d_latent, DTYPES[q.dtype],
                               page_size=named["pages"].shape[1], sliding_window=named["length_info"].dim() == 2,
                               logits_soft_cap=named["logits_soft_cap"])


def _v_columns(named) -> int:
    return named["v"].shape[-1]


_CAP = ("logits_soft_cap", "float", 0.0)
_ROPE = (("rope_scaling", "str", "{}"), _CAP, ("rotary_dim", "int", 0))
#: Every op, by name: ``torch.ops.linalg_prefill.<name>``.
OPS = {op.name: op for op in (
    Op("sequence_prefill", SequencePrefillSpec(1, 1, 1, "float32", causal=True, sm_scale=1.0),
       (("causal", "bool", None), ("sm_scale", "float", None), _CAP),
       lambda n: SequencePrefillSpec(**_dense(n), causal=n["causal"], sm_scale=n["sm_scale"],
                                     logits_soft_cap=n["logits_soft_cap"]), _v_columns,
       "batch_sequence_prefill_kv: q [B, Lq, h_q, d], k/v [B, Lk, h_kv, d]"),
    Op("sequence_prefill_masked", MaskedSequencePrefillSpec(1, 1, 1, "float32", "padded", 1.0),
       (("mask_mode", "str", None), ("sm_scale", "float", None), _CAP),
       lambda n: MaskedSequencePrefillSpec(**_dense(n), mask_mode=n["mask_mode"], sm_scale=n["sm_scale"],
                                           logits_soft_cap=n["logits_soft_cap"]), _v_columns,
       "batch_sequence_prefill_kv_masked: as sequence_prefill, valid_lens [B] int32"),
    Op("ragged_prefill", RaggedPrefillSpec(1, 1, 1, 1, "float32"), (*_ROPE, ("kv_order", "str", "nhd")), _ragged,
       _v_columns, "batch_prefill_ragged_kv: q [Lq, h_q, d_qk], k [Lk, h_kv, d_qk], v [Lk, h_kv, d_v] "
                   "(kv_order 'hnd': k [h_kv, Lk, d_qk], v [h_kv, Lk, d_v])"),
    Op("paged_prefill", PagedPrefillSpec(1, 1, 1, "float32"), (*_ROPE, ("kv_order", "str", "hnd")), _paged,
       lambda n: n["q"].shape[-1],
       "batch_prefill_paged_kv[_sliding_window]: pages [P, 2, h_kv, page_size, d] (kv_order 'nhd': "
       "[P, 2, page_size, h_kv, d]); length_info [B], or [3, B] for the sliding window"),
    Op("mla_paged_prefill", MlaPagedPrefillSpec(1, 1, 0, "float32"), (("d_latent", "int", None), _CAP), _mla,
       lambda n: n["d_latent"],
       "batch_prefill_paged_kv_mla[_sliding_window]: q [Lq, h_q, d_latent + d_rope], pages "
       "[P, page_size, d_latent + d_rope]; output [Lq, h_q, d_latent]"),
)}


def _register(op: Op) -> None:
    """Defines ``linalg_prefill::<name>`` from its schema, its CPU implementation (the kernel of the
    call's spec, by argument name) and its fake implementation (results shaped like q's)."""
    qualified = f"linalg_prefill::{op.name}"
    torch.library.define(qualified, op.schema())

    def run(*args, **kwargs):
        named = op.named(args, kwargs)
        return kernel_for(op.spec_of(named))(**{arg.name: named[arg.name] for arg in arguments(op.table)})

    def fake(*args, **kwargs):
        named = op.named(args, kwargs)
        q = named["q"]
        return q.new_empty((*q.shape[:-1], op.d_v_of(named))), q.new_empty(q.shape[:-1], dtype=torch.float32)

    torch.library.impl(qualified, "CPU", run)
    torch.library.register_fake(qualified, fake)


for _op in OPS.values():
    _register(_op)
