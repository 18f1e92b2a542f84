"""FlashInfer-style plan/run wrappers over the prefill kernels.

``plan(...)`` runs once per batch: it checks the index arrays on the host (semantics §11.8),
derives the defaults (natural RoPE positions, ``sm_scale = 1/sqrt(d_qk)`` §11.10), keeps host
metadata (query/KV lengths per entry) and uploads the index arrays to the kernel's device once.
``run(...)`` runs once per layer with that layer's tensors, checks them against the plan and
returns ``(output, lse)`` like its tensors (numpy, torch tensors, or IREE ``DeviceArray``s that
stay on the device; runtime/interop.py), ``to_host=True``/``False`` overriding where::

    wrapper = RaggedPrefillWrapper(spec)                       # or artifacts=open_artifacts(dir)
    wrapper.plan(q_indptr, kv_indptr, causal=True, rope=dict(rope_theta=5e5))
    for layer in layers:
        output, lse = wrapper.run(q[layer], k[layer], v[layer])

The spec's options take their arguments as FlashInfer's wrappers do: a ``custom_mask`` spec
(semantics §14) its flattened per-entry masks in ``plan(..., custom_mask=)`` (``mask_indptr``
computed from the planned lengths unless given, as FlashInfer computes ``qk_indptr``); a
``head_sinks`` spec (§13) its per-head logits ``sinks [h_q]`` float32 in ``run(..., sinks=)``
(per layer, as gpt-oss has them; FlashInfer's ``run`` takes ``sinks`` too) or once in
``plan(..., sinks=)`` when every layer shares them.

Tensors may be numpy arrays, torch CPU tensors, or ``DeviceArray``s on the kernel's device
(passed through without a copy). A wrapper may be shared by threads: each ``plan`` builds a new
frozen :class:`Plan` and swaps it in with one assignment, and every ``run`` uses the plan that was
current when it started; kernel calls are serialised by the kernel's lock.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from ..mlir.specs import (
    MaskedSequencePrefillSpec, MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec, SequencePrefillSpec,
)
from ..mlir.abi import ordered
from ..mlir.dtypes import kv_dtype_of, quantized_kv
from ..pipeline import target_for
from .checks import (
    NUMPY_DTYPES, check_f32, check_int32, check_on_device, check_one_scale, check_range, check_scale, check_tensor,
)
from .errors import InputError
from .dense_checks import check_sequence
from .kernels import Kernel, open_kernel
from .masks import CallLengths, host_mask
from .kv_checks import (
    INT32_MAX, check_choice, check_float, check_length_info, check_positions,
    check_rope_scalars, check_indptr, kv_shape, natural_positions, page_shape, paged_kv_lengths,
)
from .interop import returns_like_inputs
from .module import as_device_arrays, is_local
from .outputs import caller_outputs

__all__ = ["MaskedSequencePrefillWrapper", "MlaPagedPrefillWrapper", "PagedPrefillWrapper", "Plan",
           "RaggedPrefillWrapper", "SequencePrefillWrapper"]

DEFAULT_ROPE_THETA = 1e4


@dataclass(frozen=True)
class Plan:
    """One batch, as ``plan`` checked it; read-only (a new plan replaces it, never mutates it).

    ``arrays``: read-only copies of the checked host arrays by ABI name (int32 index arrays, the
    int8 ``custom_mask``, float32 ``sinks`` when ``plan`` took them); ``device``: the same arrays on
    the kernel's device (on the CPU drivers, private numpy copies its calls read in place); ``scalars``: the runtime scalars by ABI name; ``qo_lens`` and
    ``kv_lens``: int64 [B] query rows and (logical) KV rows per entry (the masked wrapper: both
    are valid_lens, or Lq and Lk of a custom mask); ``rows``: Lq, the query rows of a layer;
    ``kv_rows``: Lk (ragged) or the fewest pages a layer's cache may have (paged, MLA: the largest
    page id + 1). The dense wrappers take their sizes from each layer's tensors (``rows`` and
    ``kv_rows`` are 0; a custom mask's plan: its Lq and Lk, which every layer must have).
    """

    arrays: Mapping
    device: Mapping
    scalars: Mapping
    qo_lens: np.ndarray
    kv_lens: np.ndarray
    rows: int
    kv_rows: int


class _Wrapper:
    """The kernel for ``spec``, opened on first use, and the current plan.

    ``backend``: a backend name or :class:`Target` (default ``"llvm-cpu"``, or the artifacts'
    backend); ``artifacts``: an :class:`ArtifactSet` to take the kernel from; ``cache``: the
    artifact cache a kernel is compiled into when it does not come from ``artifacts``;
    ``kernel``: a :class:`Kernel` of ``spec`` already opened (shared with other callers) instead.
    """

    spec_type: type

    def __init__(self, spec, backend=None, artifacts=None, cache=None, kernel: Kernel | None = None):
        if not isinstance(spec, self.spec_type):
            raise InputError(f"spec: {type(self).__name__} needs a {self.spec_type.__name__}, "
                             f"got {type(spec).__name__}")
        if kernel is not None and kernel.spec != spec:
            raise InputError(f"kernel: opened for {kernel.spec.name}, not {spec.name}")
        if artifacts is not None and backend is not None and \
                target_for(backend).backend != target_for(artifacts.backend).backend:
            raise ValueError(f"backend {backend!r} differs from the artifacts' {artifacts.backend!r}")
        self.spec = spec
        self._backend = backend or "llvm-cpu"
        self._artifacts = artifacts
        self._cache = cache
        self._kernel: Kernel | None = kernel
        self._lock = threading.Lock()
        self._plan: Plan | None = None

    @property
    def kernel(self) -> Kernel:
        """The loaded kernel (compiled or loaded from the artifacts on first use)."""
        with self._lock:
            if self._kernel is None:
                self._kernel = (self._artifacts.kernel(self.spec) if self._artifacts is not None
                                else open_kernel(self.spec, self._backend, cache=self._cache))
            return self._kernel

    @property
    def current_plan(self) -> Plan | None:
        return self._plan

    def _planned(self) -> Plan:
        plan = self._plan
        if plan is None:
            raise RuntimeError(f"{type(self).__name__}.run() called before plan(): call plan(...) "
                               "once per batch with its index arrays, then run(...) once per layer")
        return plan

    def _new_plan(self, arrays: dict, scalars: dict, qo_lens, kv_lens, rows: int, kv_rows: int) -> Plan:
        """Freezes copies of ``arrays``, uploads them to the kernel's device once, and makes the
        result the current plan (one assignment, so concurrent runs see the old or the new plan).
        On the CPU drivers the device's memory is the host's: the calls read private numpy copies
        in place (runtime/module.py: in_place, which takes writeable arrays only) instead of new
        device buffers, four allocations less a plan, which a decode step makes once."""
        frozen = {}
        for name, array in arrays.items():
            frozen[name] = np.array(array, copy=True)
            frozen[name].setflags(write=False)
        for lens in (qo_lens, kv_lens):
            lens.setflags(write=False)
        device = self.kernel.device
        if is_local(device):
            device = {name: np.array(array) for name, array in frozen.items()}
        else:
            device = dict(zip(frozen, as_device_arrays(device, list(frozen.values()))))
        self._plan = Plan(MappingProxyType(frozen), MappingProxyType(device), MappingProxyType(scalars), qo_lens,
                          kv_lens, rows, kv_rows)
        return self._plan

    def _plan_sinks(self, sinks) -> dict:
        """``plan``'s ``sinks`` by ABI name: {} when not given (``run`` must then give them)."""
        return {} if sinks is None else {"sinks": self._sinks(sinks)}

    def _sinks(self, sinks):
        """``sinks`` [h_q] float32 (finite), checked; only a ``head_sinks`` spec takes them."""
        if not self.spec.head_sinks:
            raise InputError(f"sinks: {self.spec.name} has no head_sinks; build the spec with head_sinks=True")
        return check_f32("sinks", sinks, shape=(self.spec.h_q,))

    def _launch(self, plan: Plan | None, to_host: bool, sinks=None, out=None, lse=None, **tensors) -> tuple:
        """Runs the kernel on this layer's checked ``tensors`` and the plan's index arrays and
        scalars (put in the table's order, mlir/abi.py); a call with no query rows returns zeros
        (output q's shape with d_v columns in the spec dtype, lse float32) without launching it.
        ``sinks`` (run's) wins over the plan's; a ``head_sinks`` spec needs one of them. ``out``
        / ``lse``: the caller's arrays for the results (runtime/outputs.py), returned as given."""
        outputs = caller_outputs(self.spec, tuple(tensors["q"].shape), out, lse)
        if outputs is not None and not to_host:
            raise InputError("out: results written into the caller's arrays are host results; drop to_host=False")
        if sinks is not None:
            tensors["sinks"] = self._sinks(sinks)
        elif self.spec.head_sinks and (plan is None or "sinks" not in plan.device):
            raise InputError(f"sinks: {self.spec.name} has head_sinks; pass sinks [h_q] float32 to run "
                             "(or once to plan)")
        named = dict(plan.device, **plan.scalars, **tensors) if plan is not None else tensors
        args = ordered(self.spec, named)
        out_shape = (*tensors["q"].shape[:-1], self.spec.d_v)
        if np.prod(out_shape[:-2]):
            # Not Kernel.__call__: its host checks would download the device arrays (the plan's
            # index arrays included); plan() and run() check the same conditions without that.
            return self.kernel.launch(*args, to_host=to_host, plan=plan, outputs=outputs)
        zeros = (np.zeros(out_shape, NUMPY_DTYPES[self.spec.dtype]), np.zeros(out_shape[:-1], np.float32))
        if outputs is not None:
            return outputs.store(*zeros)
        return zeros if to_host else tuple(as_device_arrays(self.kernel.device, zeros))


# ----------------------------------------------------------------------------- KV-cache wrappers


def _kv_scales(spec, k_scale, v_scale) -> dict:
    """``k_scale`` and ``v_scale`` checked ([h_kv] float32, positive; a number stands for every
    head) for a spec with an 8-bit KV cache (pages, or ragged k and v); nothing for one without
    (InputError if given)."""
    given = {name: value for name, value in (("k_scale", k_scale), ("v_scale", v_scale)) if value is not None}
    if not quantized_kv(spec):
        if given:
            raise InputError(f"{next(iter(given))}: {spec.name} reads its K/V in {spec.dtype}, without scales")
        return {}
    scales = {}
    for name in ("k_scale", "v_scale"):
        if name not in given:
            raise InputError(f"{name}: {spec.name} reads {spec.kv_dtype} K/V; pass k_scale and v_scale to run")
        scales[name] = check_scale(name, given[name], shape=(spec.h_kv,))   # a number: every head's
    check_one_scale(spec, scales["k_scale"], scales["v_scale"])
    return scales


class RaggedPrefillWrapper(_Wrapper):
    """``batch_prefill_ragged_kv`` (§1.2): q [Lq, h_q, d_qk], k [Lk, h_kv, d_qk], v [Lk, h_kv, d_v]
    -> output [Lq, h_q, d_v], lse [Lq, h_q] float32."""

    spec_type = RaggedPrefillSpec

    def plan(self, q_indptr, kv_indptr, *, causal=True, rope=None, q_rope_position=None,
             k_rope_pos_offset=None, sm_scale=None, custom_mask=None, mask_indptr=None, sinks=None) -> Plan:
        """q_indptr, kv_indptr int32 [B+1]; ``rope`` None (no RoPE) or ``dict(rope_scale=,
        rope_theta=)``; positions default as :func:`natural_positions`; ``sm_scale`` 1/sqrt(d_qk).

        With ``spec.custom_mask``: ``custom_mask`` bool or uint8 [sum of qo_len * kv_len] (each
        entry's block row-major, concatenated; ``causal`` is then ignored, §14) and optionally
        ``mask_indptr`` int32 [B+1] (default: the cumulative qo_len * kv_len). With
        ``spec.head_sinks``: ``sinks`` [h_q] float32 for every layer unless ``run`` gives its own."""
        q_indptr = _indptr("q_indptr", q_indptr)
        batch = q_indptr.shape[0] - 1
        kv_indptr = _indptr("kv_indptr", kv_indptr, batch)
        qo_lens, kv_lens = np.diff(q_indptr.astype(np.int64)), np.diff(kv_indptr.astype(np.int64))
        q_pos, k_off = natural_positions(q_indptr, kv_lens, q_rope_position, k_rope_pos_offset)
        scalars = _rope_scalars(causal, rope, sm_scale, self.spec.d_qk, "d_qk")
        if scalars["rotary_mode"] == 1:
            check_positions(q_pos, k_off, kv_lens)
        arrays = {"q_indptr": q_indptr, "kv_indptr": kv_indptr, "q_rope_position": q_pos,
                  "k_rope_pos_offset": k_off, **_mask_arrays(self.spec, custom_mask, mask_indptr, qo_lens, kv_lens),
                  **self._plan_sinks(sinks)}
        return self._new_plan(arrays, scalars, qo_lens, kv_lens, int(q_indptr[-1]), int(kv_indptr[-1]))

    @returns_like_inputs
    def run(self, q, k, v, *, k_scale=None, v_scale=None, sinks=None, to_host: bool | None = None, out=None,
            lse=None) -> tuple:
        """One layer: q [Lq, h_q, d_qk], k [Lk, h_kv, d_qk], v [Lk, h_kv, d_v] in spec.dtype, or k
        and v in its ``kv_dtype`` with ``k_scale`` and ``v_scale`` (as :meth:`PagedPrefillWrapper.run`);
        ``sinks`` [h_q] float32 this layer's (``head_sinks`` specs; default: the plan's)."""
        plan, spec, device = self._planned(), self.spec, self.kernel.device
        q = _rows("q", _tensor("q", q, spec.dtype, (None, spec.h_q, spec.d_qk), device), plan.rows, "q_indptr[-1]")
        rows, kv_dtype = spec.layout.row_axis, kv_dtype_of(spec)
        k = _rows("k", _tensor("k", k, kv_dtype, kv_shape(spec, spec.layout.key_dims), device), plan.kv_rows,
                  "kv_indptr[-1]", rows)
        v = _rows("v", _tensor("v", v, kv_dtype, kv_shape(spec, spec.layout.value_dims), device), plan.kv_rows,
                  "kv_indptr[-1]", rows)
        return self._launch(plan, to_host, sinks, out, lse, q=q, k=k, v=v, **_kv_scales(spec, k_scale, v_scale))


class PagedPrefillWrapper(_Wrapper):
    """``batch_prefill_paged_kv[_sliding_window]`` (§1.1): q [Lq, h_q, d], pages [P, 2, h_kv,
    page_size, d] (``kv_order="nhd"``: [P, 2, page_size, h_kv, d]) -> output [Lq, h_q, d], lse
    [Lq, h_q] float32."""

    spec_type = PagedPrefillSpec

    def plan(self, q_indptr, page_indptr, page_values, length_info, *, causal=False, rope=None,
             q_rope_position=None, k_rope_pos_offset=None, sm_scale=None, custom_mask=None, mask_indptr=None,
             sinks=None) -> Plan:
        """q_indptr, page_indptr int32 [B+1], page_values [nnz], length_info = last_page_len [B]
        (or [3, B] last_page_len, sw_off, sink with a sliding window); the rest as
        :meth:`RaggedPrefillWrapper.plan` (``sm_scale`` default 1/sqrt(d); a custom mask's columns
        are the logical KV rows, after a sliding window's remap, §2)."""
        arrays, kv_lens, pages_needed = _page_table(self.spec, q_indptr, page_indptr, page_values, length_info)
        q_pos, k_off = natural_positions(arrays["q_indptr"], kv_lens, q_rope_position, k_rope_pos_offset)
        scalars = _rope_scalars(causal, rope, sm_scale, self.spec.d, "d")
        if scalars["rotary_mode"] == 1:
            check_positions(q_pos, k_off, kv_lens)
        qo_lens = np.diff(arrays["q_indptr"].astype(np.int64))
        arrays.update(k_rope_pos_offset=k_off, q_rope_position=q_pos,
                      **_mask_arrays(self.spec, custom_mask, mask_indptr, qo_lens, kv_lens), **self._plan_sinks(sinks))
        return self._new_plan(arrays, scalars, qo_lens, kv_lens, int(arrays["q_indptr"][-1]), pages_needed)

    @returns_like_inputs
    def run(self, q, pages, *, k_scale=None, v_scale=None, sinks=None, to_host: bool | None = None, out=None,
            lse=None) -> tuple:
        """One layer: q [Lq, h_q, d], pages [P, 2, h_kv, page_size, d] (or the spec's
        ``kv_order``'s) in spec.dtype, or in its ``kv_dtype`` with ``k_scale`` and ``v_scale``
        (each [h_kv] float32, or one number for every head: semantics §15); ``sinks`` as
        :meth:`RaggedPrefillWrapper.run`."""
        plan, spec, device = self._planned(), self.spec, self.kernel.device
        q = _rows("q", _tensor("q", q, spec.dtype, (None, spec.h_q, spec.d), device), plan.rows, "q_indptr[-1]")
        pages = _page_count(_tensor("pages", pages, kv_dtype_of(spec), page_shape(spec), device),
                            plan.kv_rows)
        return self._launch(plan, to_host, sinks, out, lse, q=q, pages=pages, **_kv_scales(spec, k_scale, v_scale))


class MlaPagedPrefillWrapper(_Wrapper):
    """``batch_prefill_paged_kv_mla[_sliding_window]`` (§1.3): q [Lq, h_q, d_latent + d_rope],
    pages [P, page_size, d_latent + d_rope] -> output [Lq, h_q, d_latent], lse [Lq, h_q] float32."""

    spec_type = MlaPagedPrefillSpec

    def plan(self, q_indptr, page_indptr, page_values, length_info, *, causal=False, sm_scale, sinks=None) -> Plan:
        """As :meth:`PagedPrefillWrapper.plan` without RoPE or custom masks; ``sm_scale`` is
        required (DeepSeek: (qk_nope + qk_rope)^-0.5, not (d_latent + d_rope)^-0.5)."""
        arrays, kv_lens, pages_needed = _page_table(self.spec, q_indptr, page_indptr, page_values, length_info)
        scalars = {"causal": check_choice("causal", _int(causal), (0, 1)), "sm_scale": check_float("sm_scale", sm_scale)}
        arrays.update(self._plan_sinks(sinks))
        qo_lens = np.diff(arrays["q_indptr"].astype(np.int64))
        return self._new_plan(arrays, scalars, qo_lens, kv_lens, int(arrays["q_indptr"][-1]), pages_needed)

    @returns_like_inputs
    def run(self, q, pages, *, k_scale=None, v_scale=None, sinks=None, to_host: bool | None = None, out=None,
            lse=None) -> tuple:
        """One layer: q [Lq, h_q, d_latent + d_rope], pages [P, page_size, d_latent + d_rope] in
        spec.dtype, or in its ``kv_dtype`` with ``k_scale`` and ``v_scale`` (equal: [1] float32 or
        a number); ``sinks`` as :meth:`RaggedPrefillWrapper.run`."""
        plan, spec, device = self._planned(), self.spec, self.kernel.device
        q = _rows("q", _tensor("q", q, spec.dtype, (None, spec.h_q, spec.d_qk), device), plan.rows, "q_indptr[-1]")
        pages = _page_count(_tensor("pages", pages, kv_dtype_of(spec), (None, spec.page_size, spec.d_qk), device),
                            plan.kv_rows)
        return self._launch(plan, to_host, sinks, out, lse, q=q, pages=pages, **_kv_scales(spec, k_scale, v_scale))


# ----------------------------------------------------------------------------- dense wrappers


class SequencePrefillWrapper(_Wrapper):
    """``batch_sequence_prefill_kv`` (§1.4): q [B, Lq, h_q, d], k/v [B, Lk, h_kv, d] -> output
    [B, Lq, h_q, d], lse [B, Lq, h_q] float32. Causal and sm_scale are the spec's; no plan."""

    spec_type = SequencePrefillSpec

    @returns_like_inputs
    def run(self, q, k, v, *, k_scale=None, v_scale=None, sinks=None, to_host: bool | None = None, out=None,
            lse=None) -> tuple:
        """One layer: q [B, Lq, h_q, d], k/v [B, Lk, h_kv, d] (in the spec's ``kv_dtype`` with
        ``k_scale``/``v_scale``, as :meth:`PagedPrefillWrapper.run`); ``sinks`` [h_q] float32 with
        ``head_sinks``."""
        q, k, v = _dense(self.spec, q, k, v, self.kernel.device)
        return self._launch(None, to_host, sinks, out, lse, q=q, k=k, v=v, **_kv_scales(self.spec, k_scale, v_scale))


class MaskedSequencePrefillWrapper(_Wrapper):
    """``batch_sequence_prefill_kv_masked`` (§7): as :class:`SequencePrefillWrapper` plus
    valid_lens [B] int32 (or, with ``mask_mode="custom"``, custom_mask [B, Lq, Lk], §14.2), given
    once per batch to ``plan``."""

    spec_type = MaskedSequencePrefillSpec

    def plan(self, valid_lens=None, *, custom_mask=None, sinks=None) -> Plan:
        """valid_lens int32 [B], each in [0, min(Lq, Lk)] of every layer's q and k; with
        ``mask_mode="custom"`` instead custom_mask bool or uint8 [B, Lq, Lk] (1: query row may see
        key col); ``sinks`` as :meth:`RaggedPrefillWrapper.plan`."""
        arrays, qo_lens, kv_lens, rows, cols = host_mask(self.spec).plan_dense(
            self.spec, {"valid_lens": valid_lens, "custom_mask": custom_mask})  # runtime/masks.py
        return self._new_plan({**arrays, **self._plan_sinks(sinks)}, {}, qo_lens, kv_lens, rows, cols)

    @returns_like_inputs
    def run(self, q, k, v, *, k_scale=None, v_scale=None, sinks=None, to_host: bool | None = None, out=None,
            lse=None) -> tuple:
        """One layer: q [B, Lq, h_q, d], k/v [B, Lk, h_kv, d] with B and valid_lens as planned
        (a custom mask: B, Lq and Lk as its shape); the scales as :meth:`SequencePrefillWrapper.run`;
        ``sinks`` as :meth:`RaggedPrefillWrapper.run`."""
        plan = self._planned()
        q, k, v = _dense(self.spec, q, k, v, self.kernel.device)
        batch = plan.qo_lens.shape[0]
        if q.shape[0] != batch:
            raise InputError(f"q: expected batch {batch} (as planned), got {q.shape[0]}")
        host_mask(self.spec).check_layer(plan, q.shape[1], k.shape[1])  # runtime/masks.py
        return self._launch(plan, to_host, sinks, out, lse, q=q, k=k, v=v, **_kv_scales(self.spec, k_scale, v_scale))


# ----------------------------------------------------------------------------- plan helpers


def _indptr(name: str, value, batch: int | None = None) -> np.ndarray:
    """A CSR offset array int32 [B+1] (starts at 0, non-decreasing); its last value is the row count."""
    array = check_int32(name, value, shape=(None,))
    end = int(array[-1]) if array.size else 0
    return check_indptr(name, array, batch, end, "its last value")


def _mask_arrays(spec, custom_mask, mask_indptr, qo_lens: np.ndarray, kv_lens: np.ndarray) -> dict:
    """The mask rule's plan arguments by ABI name, checked against the planned lengths
    (runtime/masks.py: a custom mask's custom_mask as int8 and mask_indptr, §14.4; none, and any
    given refused by name, for a spec without one)."""
    return host_mask(spec).plan(spec, {"custom_mask": custom_mask, "mask_indptr": mask_indptr},
                                CallLengths(qo_lens, lambda: kv_lens))


def _page_table(spec, q_indptr, page_indptr, page_values, length_info) -> tuple[dict, np.ndarray, int]:
    """The checked page table (arrays by ABI name), KV lengths int64 [B] and the pages a layer needs."""
    q_indptr = _indptr("q_indptr", q_indptr)
    batch = q_indptr.shape[0] - 1
    page_values = check_int32("page_values", page_values, shape=(None,))
    check_range("page_values", page_values, 0, INT32_MAX - 1)
    page_indptr = check_indptr("page_indptr", page_indptr, batch, page_values.shape[0],
                               "nnz (length of page_values)")
    shape = (3, batch) if spec.sliding_window else (batch,)
    length_info = check_int32("length_info", length_info, shape=shape)
    check_length_info(length_info, page_indptr, spec.page_size, spec.sliding_window)
    kv_lens = paged_kv_lengths(page_indptr, length_info, spec.page_size, spec.sliding_window)
    arrays = {"q_indptr": q_indptr, "page_indptr": page_indptr, "page_values": page_values,
              "length_info": length_info}
    return arrays, kv_lens, int(page_values.max(initial=-1)) + 1


def _int(flag) -> int:
    """``causal`` given as a bool or an int."""
    return int(flag) if isinstance(flag, (bool, np.bool_)) else flag


def _rope_scalars(causal, rope, sm_scale, dim: int, dim_name: str) -> dict:
    """causal, rotary_mode, rope_scale, rope_theta and sm_scale by name, checked; ``rope`` None means
    rotary_mode 0, a dict ``rope_scale`` (default 1) and ``rope_theta`` (default 1e4) mode 1."""
    if rope is None:
        rotary_mode, rope_scale, rope_theta = 0, 1.0, DEFAULT_ROPE_THETA
    elif isinstance(rope, Mapping):
        unknown = sorted(set(rope) - {"rope_scale", "rope_theta"})
        if unknown:
            raise InputError(f"rope: unknown keys {unknown}; expected rope_scale and/or rope_theta")
        rotary_mode, rope_scale, rope_theta = 1, rope.get("rope_scale", 1.0), rope.get("rope_theta", DEFAULT_ROPE_THETA)
    else:
        raise InputError(f"rope: expected None or dict(rope_scale=, rope_theta=), got {type(rope).__name__}")
    sm_scale = dim ** -0.5 if sm_scale is None else sm_scale
    return check_rope_scalars(dict(causal=_int(causal), rotary_mode=rotary_mode, rope_scale=rope_scale,
                                   rope_theta=rope_theta, sm_scale=sm_scale), dim, dim_name)


# ----------------------------------------------------------------------------- run helpers


def _tensor(name: str, value, dtype: str, shape: tuple, device):
    """``value`` checked as ``dtype`` with ``shape`` (None: any size): a DeviceArray on ``device`` as
    is (no download), anything else as a C-contiguous numpy array (torch CPU tensors included)."""
    check_on_device(name, value, device)
    return check_tensor(name, value, dtype=dtype, shape=shape)


def _rows(name: str, array, want: int, source: str, axis: int = 0):
    """``array`` with ``want`` rows along ``axis`` (InputError otherwise)."""
    if array.shape[axis] != want:
        raise InputError(f"{name}: expected {want} rows ({source} of the plan), got {array.shape[axis]} "
                         f"(axis {axis})")
    return array


def _page_count(pages, needed: int):
    if pages.shape[0] < needed:
        raise InputError(f"pages: expected at least {needed} pages (the plan's page_values refer to page "
                         f"{needed - 1}), got {pages.shape[0]}")
    return pages


def _dense(spec, q, k, v, device) -> tuple:
    """The kernel's own check (dense_checks.check_sequence) of tensors that are numpy, torch CPU or
    DeviceArrays on ``device``."""
    for name, value in (("q", q), ("k", k), ("v", v)):
        check_on_device(name, value, device)
    checked = check_sequence(spec, {"q": q, "k": k, "v": v})
    return checked["q"], checked["k"], checked["v"]
