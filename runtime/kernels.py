"""``open_kernel``: a spec compiled (through the cache) and loaded on a device, with input checks.

    kernel = open_kernel(SequencePrefillSpec(h_q=32, h_kv=8, d=128, dtype="float32",
                                             causal=True, sm_scale=128 ** -0.5))
    output, lse = kernel(q, k, v)     # numpy in, numpy out; checked before the kernel runs
    output, lse = kernel(q=q, k=k, v=v)   # the same call, by the argument names of mlir/abi.py
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np

from ..mlir.abi import argument_names
from ..mlir.decode import DecodeSpec
from ..mlir.mask_rules import mask_rule
from ..pipeline import ArtifactCache, Target, compile_spec, target_for
from ..pipeline.targets import input_alignment
from .checks import NUMPY_DTYPES, check_on_device
from .decode import DECODE_PASSES, decode_schedule, schedule_key, split_decode
from .errors import InputError
from .interop import like_inputs, results_to_host
from .module import LoadedKernel, as_device_arrays, device_resident, host_visible_array
from .outputs import Outputs, caller_outputs
from .variants import call_arguments, checked, variant


class Kernel:
    """A loaded kernel for one spec on one device. Calling it checks the inputs, then runs it.

    Returns ``(output, lse)`` like the inputs (runtime/interop.py): numpy arrays for numpy
    inputs, torch tensors for torch tensors, IREE DeviceArrays for DeviceArrays; ``to_host=True``
    or ``False`` overrides where they live; ``out=`` / ``lse=`` take them in the caller's arrays
    (runtime/outputs.py). Index arguments may be any integer array, tensor or list whose values
    fit int32. On the CPU drivers numpy arrays and CPU torch tensors are read in place
    (runtime/module.py: a call costs what it reads, not the size of the caller's arrays).
    Thread-safe: concurrent calls are serialised per kernel.
    """

    def __init__(self, spec, target: Target, loaded: LoadedKernel, *, cache: ArtifactCache | None = None,
                 decode_pass: bool = False, pass_loader=None):
        self.spec = spec
        self.target = target
        self._loaded = loaded
        self._arg_names = argument_names(spec)  # the seed's ABI names (mlir/abi.py)
        # Kernels whose mask rule allows it (the KV-cache causal mask) hand their short entries to
        # the lowering's one-pass kernels (runtime/decode.py), compiled through ``cache`` on the
        # first call that has some; other rules run every entry in the main kernel.
        self._decode_pass = decode_pass and mask_rule(spec).one_pass
        self._decode_passes = DECODE_PASSES[target.lowering]
        self._cache = cache
        self._decode_kernels: dict[int, LoadedKernel] = {}
        # ``pass_loader(pass_spec, target)``: a pass's LoadedKernel from elsewhere (an artifact
        # folder), or None to compile it through ``cache``.
        self._pass_loader = pass_loader
        self._schedule: tuple = (None, None)  # (plan, its DecodeSchedule) of the last planned call
        self._call_schedule: tuple = (None, None)  # (schedule_key, its DecodeSchedule) of the last other call

    @property
    def device(self):
        return self._loaded.device

    @property
    def bytes_copied(self) -> int:
        """Bytes of the callers' numpy arrays and tensors this kernel and its serving passes had to
        copy into new buffers (LoadedKernel.bytes_copied): 0 while every array was used in place."""
        return self._loaded.bytes_copied + sum(loaded.bytes_copied for loaded in self._decode_kernels.values())

    def __call__(self, *args: Any, to_host: bool | None = None, out=None, lse=None, **named: Any):
        """``kernel(*args)`` in the seed's order, or by name (``kernel(q=q, k=k, v=v)``), or both;
        ``out`` / ``lse``: the caller's arrays for the results (runtime/outputs.py)."""
        args = call_arguments(self.spec, args, named)
        for name, value in zip(self._arg_names, args):
            check_on_device(name, value, self.device)
        arrays = checked(self.spec, args)
        outputs = caller_outputs(self.spec, tuple(arrays[0].shape), out, lse)
        host = True if outputs is not None and to_host is None else results_to_host(args, to_host)
        if outputs is not None and not host:
            raise InputError("out: results written into the caller's arrays are host results; drop to_host=False")
        empty = _empty_result(self.spec, arrays[0])
        if empty is not None:
            if outputs is not None:
                return outputs.store(*empty)
            results = empty if host else tuple(as_device_arrays(self.device, empty))
        else:
            results = self.launch(*arrays, to_host=host, outputs=outputs)
            if outputs is not None:
                return results
        return like_inputs(args, results) if host else results

    def launch(self, *checked_args: Any, to_host: bool = True, plan: Any = None, outputs: Outputs | None = None):
        """Runs the kernel on arguments already checked (e.g. by a wrapper's plan): numpy arrays,
        IREE device arrays (used in place) and Python scalars, in the seed's order. No checks.
        ``plan``: an immutable object that stands for the call's index arrays and scalars (a
        wrapper's Plan): the host schedule of its serving passes is then worked out once per plan
        instead of on every call. ``outputs``: the caller's arrays for the results (host results
        only), which the call then returns (Outputs.given)."""
        schedule = self._decode_schedule(checked_args, plan) if self._decode_pass else None
        if schedule is not None:
            return split_decode(self.spec, checked_args, schedule, self._run_decode, self._run_rest,
                                lambda shape, dtype: host_visible_array(self.device, shape, dtype),
                                lambda results: device_resident(self.device, results), to_host, outputs)
        if outputs is not None:
            return self._loaded.consume(outputs.store, *checked_args)
        return self._loaded(*checked_args, to_host=to_host)

    def _decode_schedule(self, checked_args: tuple, plan: Any):
        """The call's DecodeSchedule (runtime/decode.py), or None: kept for ``plan`` when given,
        else for the call's index arrays and scalars and the kernel's passes (a call with the same
        ones, e.g. the next layer's, reuses it: one 16-query entry over 256 keys, the call's host work
        0.34 -> 0.13 ms, docs/performance.md)."""
        if plan is not None:
            planned, schedule = self._schedule
            if planned is not plan:
                schedule = decode_schedule(self.spec, checked_args, self._decode_passes)
                self._schedule = (plan, schedule)
            return schedule
        key = (self._decode_passes, schedule_key(self.spec, checked_args))
        kept, schedule = self._call_schedule
        if kept != key:
            schedule = decode_schedule(self.spec, checked_args, self._decode_passes)
            self._call_schedule = (key, schedule)
        return schedule

    def _run_decode(self, queries: int, *args, use: Callable | None = None):
        """The one-pass kernel for entries of up to ``queries`` queries (runtime/decode.py):
        numpy results, or what ``use`` returns given them (LoadedKernel.consume)."""
        if queries not in self._decode_kernels:
            pass_spec = DecodeSpec(self.spec, queries)
            loaded = self._pass_loader(pass_spec, self.target) if self._pass_loader is not None else None
            if loaded is None:
                vmfb = compile_spec(pass_spec, self.target, cache=self._cache)
                loaded = LoadedKernel(vmfb, pass_spec.symbol, self._loaded.driver,
                                      alignment=input_alignment(self.target.flags()))
            self._decode_kernels[queries] = loaded
        loaded = self._decode_kernels[queries]
        return loaded(*args, to_host=True) if use is None else loaded.consume(use, *args)

    def _run_rest(self, *args, use: Callable):
        """The variant's kernel for the entries no pass takes, its results handed to ``use``."""
        return self._loaded.consume(use, *args)

    def __repr__(self) -> str:
        return f"Kernel({self.spec.name}, {self.target.tag})"


def _empty_result(spec, q: np.ndarray):
    """Outputs for a call with no query rows (the kernel is not launched for zero-size work):
    output q's shape with ``spec.d_v`` columns, lse f32 q's shape without its last dim."""
    shape = tuple(q.shape)  # q may be an IREE DeviceArray
    if all(shape[:-2]):
        return None
    return np.zeros((*shape[:-1], spec.d_v), NUMPY_DTYPES[spec.dtype]), np.zeros(shape[:-1], np.float32)


def open_kernel(
    spec,
    backend: str | Target = "llvm-cpu",
    *,
    driver: str | None = None,
    cache: ArtifactCache | None = None,
    serving_passes: bool = True,
) -> Kernel:
    """Compiles ``spec`` for ``backend`` (cached on disk) and loads it on ``driver``.

    ``driver`` defaults to the backend's (``local-task`` for llvm-cpu, ``cuda`` for cuda).
    ``serving_passes=False`` runs every entry in the variant's own kernel instead of handing the
    short ones of a KV-cache call to the one-pass kernels (runtime/decode.py): no pass is compiled.
    """
    if variant(spec).check is None:
        raise InputError(f"spec: {type(spec).__name__} is a pass of a variant's kernel, not a variant")
    target = target_for(backend)
    vmfb = compile_spec(spec, target, cache=cache)
    loaded = LoadedKernel(vmfb, spec.symbol, driver or target.driver, alignment=input_alignment(target.flags()))
    return Kernel(spec, target, loaded, cache=cache, decode_pass=serving_passes)


_shared: dict = {}
_shared_lock = threading.Lock()


def shared_kernel(spec, backend: str | Target = "llvm-cpu", *, cache: ArtifactCache | None = None,
                  serving_passes: bool = True) -> Kernel:
    """:func:`open_kernel`'s kernel of ``spec``, opened once per process for these arguments and
    shared (a Kernel serialises its calls): the library's one kernel memo, which the torch ops and
    the transformers adapter open their kernels through."""
    key = (spec, target_for(backend), cache.root if cache is not None else None, serving_passes)
    with _shared_lock:
        if key not in _shared:
            _shared[key] = open_kernel(spec, backend, cache=cache, serving_passes=serving_passes)
        return _shared[key]
