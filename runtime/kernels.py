"""``open_kernel``: a spec compiled (through the cache) and loaded on a device, with input checks.

    kernel = open_kernel(SequencePrefillSpec(h_q=32, h_kv=8, d=128, dtype="float32",
                                             causal=True, sm_scale=128 ** -0.5))
    output, lse = kernel(q, k, v)     # numpy in, numpy out; checked before the kernel runs
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..mlir.abi import argument_names
from ..mlir.decode import DecodeSpec
from ..mlir.specs import (
    MaskedSequencePrefillSpec, MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec,
    SequencePrefillSpec,
)
from ..pipeline import ArtifactCache, Target, compile_spec, target_for
from .checks import NUMPY_DTYPES, check_int32, check_on_device, check_range, check_same, check_tensor
from .decode import DECODE_PASSES, pass_queries, split_decode
from .errors import InputError
from .kv_checks import check_mla, check_paged, check_ragged
from .interop import like_inputs, results_to_host
from .module import LoadedKernel, as_device_arrays


def check_sequence(spec, q, k, v) -> tuple[np.ndarray, ...]:
    """q [B, Lq, h_q, d], k/v [B, Lk, h_kv, d], all in spec.dtype."""
    q = check_tensor("q", q, dtype=spec.dtype, shape=(None, None, spec.h_q, spec.d))
    k = check_tensor("k", k, dtype=spec.dtype, shape=(None, None, spec.h_kv, spec.d))
    v = check_tensor("v", v, dtype=spec.dtype, shape=(None, None, spec.h_kv, spec.d))
    check_same("k.shape[0]", k.shape[0], "q.shape[0] (batch)", q.shape[0])
    check_same("v.shape[0]", v.shape[0], "q.shape[0] (batch)", q.shape[0])
    check_same("v.shape[1]", v.shape[1], "k.shape[1] (kv_len)", k.shape[1])
    return q, k, v


def _check_masked(spec, q, k, v, valid_lens) -> tuple[np.ndarray, ...]:
    q, k, v = check_sequence(spec, q, k, v)
    valid_lens = check_int32("valid_lens", valid_lens, shape=(q.shape[0],))
    check_range("valid_lens", valid_lens, 0, min(q.shape[1], k.shape[1]))
    return q, k, v, valid_lens


_CHECKS: dict[type, Callable[..., tuple]] = {
    SequencePrefillSpec: check_sequence,
    MaskedSequencePrefillSpec: _check_masked,
    RaggedPrefillSpec: check_ragged,
    PagedPrefillSpec: check_paged,
    MlaPagedPrefillSpec: check_mla,
}


class Kernel:
    """A loaded kernel for one spec on one device. Calling it checks the inputs, then runs it.

    Returns ``(output, lse)`` like the inputs (runtime/interop.py): numpy arrays for numpy
    inputs, torch tensors for torch tensors, IREE DeviceArrays for DeviceArrays; ``to_host=True``
    or ``False`` overrides where they live. Index arguments may be any integer array, tensor or
    list whose values fit int32.
    Thread-safe: concurrent calls are serialised per kernel.
    """

    def __init__(self, spec, target: Target, loaded: LoadedKernel, *, cache: ArtifactCache | None = None,
                 decode_pass: bool = False):
        self.spec = spec
        self.target = target
        self._loaded = loaded
        self._check = _CHECKS[type(spec)]
        self._arg_names = argument_names(spec)  # the seed's ABI names (mlir/abi.py)
        # KV-cache kernels hand their short entries to the lowering's one-pass kernels
        # (runtime/decode.py), compiled through ``cache`` on the first call that has some.
        self._decode_pass = decode_pass and type(spec) in (RaggedPrefillSpec, PagedPrefillSpec, MlaPagedPrefillSpec)
        self._decode_passes = DECODE_PASSES[target.lowering]
        self._cache = cache
        self._decode_kernels: dict[int, LoadedKernel] = {}

    @property
    def device(self):
        return self._loaded.device

    def __call__(self, *args: Any, to_host: bool | None = None):
        for name, value in zip(self._arg_names, args):
            check_on_device(name, value, self.device)
        host = results_to_host(args, to_host)
        arrays = self._check(self.spec, *args)
        empty = _empty_result(self.spec, arrays[0])
        if empty is not None:
            results = empty if host else tuple(as_device_arrays(self.device, empty))
        else:
            results = self.launch(*arrays, to_host=host)
        return like_inputs(args, results) if host else results

    def launch(self, *checked_args: Any, to_host: bool = True):
        """Runs the kernel on arguments already checked (e.g. by a wrapper's plan): numpy arrays,
        IREE device arrays (used in place) and Python scalars, in the seed's order. No checks."""
        passes = pass_queries(self.spec, checked_args, self._decode_passes) if self._decode_pass else None
        if passes is not None and passes.any():
            return split_decode(self.spec, checked_args, passes, self._decode_passes, self._run_decode, self._run_rest,
                                lambda results: tuple(as_device_arrays(self.device, results)), to_host)
        return self._loaded(*checked_args, to_host=to_host)

    def _run_decode(self, queries: int, *args):
        """The one-pass kernel for entries of up to ``queries`` queries (runtime/decode.py)."""
        if queries not in self._decode_kernels:
            pass_spec = DecodeSpec(self.spec, queries)
            vmfb = compile_spec(pass_spec, self.target, cache=self._cache)
            self._decode_kernels[queries] = LoadedKernel(vmfb, pass_spec.symbol, self._loaded.driver)
        return self._decode_kernels[queries](*args, to_host=True)

    def _run_rest(self, *args):
        return self._loaded(*args, to_host=True)

    def __repr__(self) -> str:
        return f"Kernel({self.spec.name}, {self.target.tag})"


def _empty_result(spec, q: np.ndarray):
    """Outputs for a call with no query rows (the kernel is not launched for zero-size work).

    Dense variants have q [B, L, h_q, d]; the KV-cache variants q [L, h_q, d_qk] and an output
    with ``spec.d_v`` (ragged) or ``spec.d_latent`` (MLA) columns.
    """
    shape, dtype = tuple(q.shape), NUMPY_DTYPES[spec.dtype]  # q may be an IREE DeviceArray
    if len(shape) == 4:
        if shape[0] and shape[1]:
            return None
        return np.zeros(shape, dtype), np.zeros(shape[:3], np.float32)
    if shape[0]:
        return None
    d_out = getattr(spec, "d_v", None) or getattr(spec, "d_latent", None) or spec.d
    return np.zeros((0, spec.h_q, d_out), dtype), np.zeros((0, spec.h_q), np.float32)


def open_kernel(
    spec,
    backend: str | Target = "llvm-cpu",
    *,
    driver: str | None = None,
    cache: ArtifactCache | None = None,
) -> Kernel:
    """Compiles ``spec`` for ``backend`` (cached on disk) and loads it on ``driver``.

    ``driver`` defaults to the backend's (``local-task`` for llvm-cpu, ``cuda`` for cuda).
    """
    if type(spec) not in _CHECKS:
        raise InputError(f"spec: unsupported spec type {type(spec).__name__}")
    target = target_for(backend)
    vmfb = compile_spec(spec, target, cache=cache)
    return Kernel(spec, target, LoadedKernel(vmfb, spec.symbol, driver or target.driver), cache=cache, decode_pass=True)
