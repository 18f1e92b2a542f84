"""Every variant as a torch custom op, ``torch.ops.linalg_prefill.*``, with a fake implementation
so ``torch.compile(fullgraph=True)`` traces through it.

    import linalg_prefill.torch_ops  # registers the ops
    out, lse = torch.ops.linalg_prefill.sequence_prefill(q, k, v, True, 0.125, 0.0)

Each op takes the variant's arguments in the seed's order (README, "The seed's arguments") and
the spec's compile-time fields after them; head counts, head dims and dtype come from the tensors.
``rope_scaling`` is a JSON object string (``"{}"``: plain RoPE), ``rotary_dim`` 0 means the
whole head. The ops run the llvm-cpu kernels on CPU tensors (compiled once per spec, cached on
disk) and return ``(output, lse)``: output like q with ``d_v`` columns, lse float32 without the
head-dim axis.
"""

from __future__ import annotations

try:
    import torch
except ImportError as err:  # pragma: no cover
    raise ImportError(f"linalg_prefill.torch_ops needs torch: pip install 'linalg-prefill[hf]' ({err})") from err

import json

from .mlir import (
    MaskedSequencePrefillSpec, MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec, SequencePrefillSpec,
)
from .runtime import shared_kernel
from .runtime.dtypes import HOST_DTYPES

__all__ = ["sequence_prefill", "sequence_prefill_masked", "ragged_prefill", "paged_prefill", "mla_paged_prefill",
           "kernel_for", "DTYPES"]

#: The kernels' dtype of each torch dtype they take (runtime/dtypes.py).
DTYPES = {getattr(torch, dtype.torch): name for name, dtype in HOST_DTYPES.items()}

def kernel_for(spec):
    """The llvm-cpu kernel of ``spec``, compiled (or read from the disk cache) once per process
    (runtime.shared_kernel: the library's one kernel memo)."""
    return shared_kernel(spec, "llvm-cpu")


def _results_like(q, d_v: int):
    """Empty ``(output, lse)`` of a call with query ``q [..., h_q, d]``: the fake implementation."""
    return q.new_empty((*q.shape[:-1], d_v)), q.new_empty(q.shape[:-1], dtype=torch.float32)


def _run(spec, *args):
    return kernel_for(spec)(*args)


@torch.library.custom_op("linalg_prefill::sequence_prefill", mutates_args=())
def sequence_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, sm_scale: float,
                     logits_soft_cap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_sequence_prefill_kv``: q [B, Lq, h_q, d], k/v [B, Lk, h_kv, d]."""
    spec = SequencePrefillSpec(q.shape[2], k.shape[2], q.shape[3], DTYPES[q.dtype], causal=causal, sm_scale=sm_scale,
                               logits_soft_cap=logits_soft_cap)
    return _run(spec, q, k, v)


@torch.library.custom_op("linalg_prefill::sequence_prefill_masked", mutates_args=())
def sequence_prefill_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid_lens: torch.Tensor,
                            mask_mode: str, sm_scale: float,
                            logits_soft_cap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_sequence_prefill_kv_masked``: as sequence_prefill plus valid_lens [B]."""
    spec = MaskedSequencePrefillSpec(q.shape[2], k.shape[2], q.shape[3], DTYPES[q.dtype], mask_mode=mask_mode,
                                     sm_scale=sm_scale, logits_soft_cap=logits_soft_cap)
    return _run(spec, q, k, v, valid_lens)


@torch.library.custom_op("linalg_prefill::ragged_prefill", mutates_args=())
def ragged_prefill(q: torch.Tensor, q_indptr: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   kv_indptr: torch.Tensor, q_rope_position: torch.Tensor, k_rope_pos_offset: torch.Tensor,
                   causal: int, rotary_mode: int, rope_scale: float, rope_theta: float, sm_scale: float,
                   rope_scaling: str = "{}", logits_soft_cap: float = 0.0,
                   rotary_dim: int = 0, kv_order: str = "nhd") -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_prefill_ragged_kv``: q [Lq, h_q, d_qk], k [Lk, h_kv, d_qk], v [Lk, h_kv, d_v]
    (``kv_order`` "hnd": k [h_kv, Lk, d_qk], v [h_kv, Lk, d_v])."""
    h_kv = k.shape[1] if kv_order == "nhd" else k.shape[0]
    spec = RaggedPrefillSpec(q.shape[1], h_kv, q.shape[2], v.shape[2], DTYPES[q.dtype],
                             json.loads(rope_scaling), logits_soft_cap=logits_soft_cap, rotary_dim=rotary_dim or None,
                             kv_order=kv_order)
    return _run(spec, q, q_indptr, k, v, kv_indptr, q_rope_position, k_rope_pos_offset, causal, rotary_mode,
                rope_scale, rope_theta, sm_scale)


@torch.library.custom_op("linalg_prefill::paged_prefill", mutates_args=())
def paged_prefill(q: torch.Tensor, q_indptr: torch.Tensor, pages: torch.Tensor, page_indptr: torch.Tensor,
                  page_values: torch.Tensor, length_info: torch.Tensor, k_rope_pos_offset: torch.Tensor,
                  q_rope_position: torch.Tensor, causal: int, rotary_mode: int, rope_scale: float, rope_theta: float,
                  sm_scale: float, rope_scaling: str = "{}", logits_soft_cap: float = 0.0,
                  rotary_dim: int = 0, kv_order: str = "hnd") -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_prefill_paged_kv[_sliding_window]``: pages [P, 2, h_kv, page_size, d] (``kv_order``
    "nhd": [P, 2, page_size, h_kv, d]); length_info [B] or, for the sliding-window variant, [3, B]."""
    h_kv, page_size = (pages.shape[2], pages.shape[3]) if kv_order == "hnd" else (pages.shape[3], pages.shape[2])
    spec = PagedPrefillSpec(q.shape[1], h_kv, q.shape[2], DTYPES[q.dtype], page_size=page_size,
                            rope_scaling=json.loads(rope_scaling), sliding_window=length_info.dim() == 2,
                            logits_soft_cap=logits_soft_cap, rotary_dim=rotary_dim or None, kv_order=kv_order)
    return _run(spec, q, q_indptr, pages, page_indptr, page_values, length_info, k_rope_pos_offset, q_rope_position,
                causal, rotary_mode, rope_scale, rope_theta, sm_scale)


@torch.library.custom_op("linalg_prefill::mla_paged_prefill", mutates_args=())
def mla_paged_prefill(q: torch.Tensor, q_indptr: torch.Tensor, pages: torch.Tensor, page_indptr: torch.Tensor,
                      page_values: torch.Tensor, length_info: torch.Tensor, causal: int, sm_scale: float,
                      d_latent: int, logits_soft_cap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_prefill_paged_kv_mla[_sliding_window]``: q [Lq, h_q, d_latent + d_rope], pages
    [P, page_size, d_latent + d_rope]; output [Lq, h_q, d_latent]."""
    spec = MlaPagedPrefillSpec(q.shape[1], d_latent, q.shape[2] - d_latent, DTYPES[q.dtype], page_size=pages.shape[1],
                               sliding_window=length_info.dim() == 2, logits_soft_cap=logits_soft_cap)
    return _run(spec, q, q_indptr, pages, page_indptr, page_values, length_info, causal, sm_scale)


@sequence_prefill.register_fake
def _(q, k, v, causal, sm_scale, logits_soft_cap=0.0):
    return _results_like(q, v.shape[-1])


@sequence_prefill_masked.register_fake
def _(q, k, v, valid_lens, mask_mode, sm_scale, logits_soft_cap=0.0):
    return _results_like(q, v.shape[-1])


@ragged_prefill.register_fake
def _(q, q_indptr, k, v, kv_indptr, *rest, **named):
    return _results_like(q, v.shape[-1])


@paged_prefill.register_fake
def _(q, *rest, **named):
    return _results_like(q, q.shape[-1])


@mla_paged_prefill.register_fake
def _(q, q_indptr, pages, page_indptr, page_values, length_info, causal, sm_scale, d_latent, logits_soft_cap=0.0):
    return _results_like(q, d_latent)
