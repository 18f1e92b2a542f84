"""``open_kernel``: a spec compiled (through the cache) and loaded on a device, with input checks.

    kernel = open_kernel(SequencePrefillSpec(h_q=32, h_kv=8, d=128, dtype="float32",
                                             causal=True, sm_scale=128 ** -0.5))
    output, lse = kernel(q, k, v)     # numpy in, numpy out; checked before the kernel runs
    output, lse = kernel(q=q, k=k, v=v)   # the same call, by the argument names of mlir/abi.py
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import threading
from typing import Any, Callable, Iterable

import numpy as np

from ..mlir.abi import argument_names
from ..mlir.bundle import function_name
from ..mlir import x86_uses_amx
from ..mlir.decode import DecodeSpec
from ..pipeline import ArtifactCache, Target, compile_specs, target_for
from .amx import request_amx_state
from ..pipeline.cpu_tiles import x86_cpu
from ..pipeline.targets import input_alignment
from .checks import NUMPY_DTYPES, check_on_device
from .decode import decode_schedule, schedule_key, split_decode
from .devices import cpu_workers, get_device
from .errors import InputError
from .interop import like_inputs, results_to_host
from .module import LoadedKernel, as_device_arrays, device_resident, host_visible_array, is_local
from .outputs import Outputs, caller_outputs, result_shapes
from .pass_lane import PassLane
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

    def __init__(self, spec, target: Target, loaded: LoadedKernel, passes: dict[int, LoadedKernel] | None = None):
        self.spec = spec
        self.target = target
        self._loaded = loaded
        self._arg_names = argument_names(spec)  # the seed's ABI names (mlir/abi.py)
        # ``passes``: the serving passes loaded at open, by query count (Target.serving_passes):
        # a call hands its short entries to them (runtime/decode.py) and compiles nothing; without
        # them every entry runs in the main kernel.
        self._decode_kernels = dict(passes or {})
        decode_passes = target.decode_passes(spec)
        if is_local(loaded.device):  # chunks sized for the CPU's workers (DecodePasses.for_workers)
            decode_passes = decode_passes.for_workers(spec, cpu_workers())
        self._decode_passes = dataclasses.replace(decode_passes, loaded=tuple(sorted(self._decode_kernels)))
        self._schedule: tuple = (None, None)  # (plan, its DecodeSchedule) of the last planned call
        self._call_schedule: tuple = (None, None)  # (schedule_key, its DecodeSchedule) of the last other call
        self._lane: tuple = (None, None)  # (plan, its PassLane) of the last planned in-order call

    @property
    def serving_passes(self) -> tuple[int, ...]:
        """The query counts of the serving passes this kernel loaded at open (none: every entry
        runs in the main kernel)."""
        return self._decode_passes.loaded

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
        instead of on every call, and a plan that is one pass call over its rows in order runs
        host results on its :class:`PassLane` (:meth:`lane`). ``outputs``: the caller's arrays
        for the results (host results only), which the call then returns (Outputs.given)."""
        schedule = self._decode_schedule(checked_args, plan) if self._decode_kernels else None
        if schedule is not None and schedule.in_order and plan is not None and outputs is None and to_host:
            return self._lane_of(plan, schedule, checked_args).run_args(checked_args)
        if schedule is not None:
            return split_decode(self.spec, checked_args, schedule, self._run_decode, self._run_rest,
                                lambda shape, dtype: host_visible_array(self.device, shape, dtype),
                                lambda results: device_resident(self.device, results), to_host, outputs)
        if outputs is not None:
            return self._loaded.consume(outputs.store, *checked_args, into=outputs.arrays)
        return self._loaded(*checked_args, to_host=to_host)

    def _decode_schedule(self, checked_args: tuple, plan: Any):
        """The call's DecodeSchedule (runtime/decode.py), or None: kept for ``plan`` when given,
        else for the call's index arrays and scalars and the kernel's passes (a call with the same
        ones, e.g. the next layer's, reuses it: one 16-query entry over 256 keys, the call's host work
        0.34 -> 0.13 ms, docs/performance.md)."""
        if plan is not None:
            planned, schedule = self._schedule
            if planned is not plan:
                # the plan's host copies of its arrays (a wrapper's Plan.arrays) rather than its
                # device arrays read back
                host = getattr(plan, "arrays", None) or {}
                args = tuple(host.get(name, value) for name, value in zip(self._arg_names, checked_args))
                schedule = decode_schedule(self.spec, args, self._decode_passes)
                self._schedule = (plan, schedule)
            return schedule
        key = (self._decode_passes, schedule_key(self.spec, checked_args))
        kept, schedule = self._call_schedule
        if kept != key:
            schedule = decode_schedule(self.spec, checked_args, self._decode_passes)
            self._call_schedule = (key, schedule)
        return schedule

    def lane(self, plan: Any) -> PassLane | None:
        """The :class:`PassLane` of ``plan`` (a wrapper's Plan: its host ``arrays``, ``scalars``
        and ``rows``), or None where its calls are not one pass call over their rows in order:
        the plan's calls (a decode step's layers) may run on it with their checked q and KV
        sources. Kept for the last plan asked about."""
        planned, lane = self._lane
        if planned is plan:
            return lane
        if not self._decode_kernels:
            return None
        args = tuple(plan.arrays.get(name, plan.scalars.get(name)) for name in self._arg_names)
        schedule = self._decode_schedule(args, plan)
        return self._lane_of(plan, schedule, args) if schedule is not None and schedule.in_order else None

    def _lane_of(self, plan: Any, schedule, args: tuple) -> PassLane:
        """``plan``'s lane given its (in-order) ``schedule``; ``args`` a call's, in the seed's order."""
        planned, lane = self._lane
        if planned is not plan:
            scheduled = schedule.calls[0]
            named = dict(zip(self._arg_names, args))
            lane = PassLane.of(self.spec, self._decode_kernels[scheduled.rows.shape[1]], scheduled,
                               len(schedule.rest_rows), named)
            self._lane = (plan, lane)
        return lane

    def _run_decode(self, queries: int, *args, use: Callable | None = None):
        """The one-pass kernel for entries of up to ``queries`` queries (runtime/decode.py):
        numpy results, or what ``use`` returns given them (LoadedKernel.consume)."""
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
    serving_passes: bool | Iterable[int] = True,
) -> Kernel:
    """Compiles ``spec`` and its serving passes for ``backend`` (cached on disk; the missing ones
    concurrently) and loads them on ``driver``: no call compiles.

    ``driver`` defaults to the backend's (``local-task`` for llvm-cpu, ``cuda`` for cuda).
    ``serving_passes``: the one-pass kernels a KV-cache call hands its short entries to
    (runtime/decode.py): True, every pass the target has for ``spec`` (``Target.serving_passes``:
    1, 4 and 16 queries on llvm-cpu, those within its scratch bound); an iterable of query counts,
    those of them; False, none (every entry runs in the variant's own kernel).
    """
    if variant(spec).check is None:
        raise InputError(f"spec: {type(spec).__name__} is a pass of a variant's kernel, not a variant")
    target = target_for(backend)
    passes = passes_at_open(spec, target, serving_passes)
    kernel, *loaded = compiled_kernels([spec, *passes], target, driver or target.driver, cache)
    return Kernel(spec, target, kernel, {pass_spec.queries: pass_kernel for pass_spec, pass_kernel in zip(passes, loaded)})


def compiled_kernels(specs, target: Target, driver: str, cache: ArtifactCache | None) -> list[LoadedKernel]:
    """``specs`` (a kernel, serving passes) compiled for ``target`` through ``cache`` (the missing
    ones concurrently: pipeline.compile_specs) and loaded on ``driver``, in order."""
    alignment = input_alignment(target.flags())
    vmfbs = compile_specs(specs, target, cache=cache)
    for spec in specs:
        ready_to_load(spec, target)
    return [LoadedKernel(vmfb, function_name(spec, vmfb), driver, alignment=alignment, results=result_shapes(spec))
            for spec, vmfb in zip(specs, vmfbs)]


def ready_to_load(spec, target: Target) -> None:
    """What the process needs before it loads ``spec``'s artifact for ``target``: the AMX tile
    state for a kernel on AMX tiles (runtime/amx.py; AmxUnavailable where Linux refuses)."""
    if target.lowering_of(spec) == "x86" and x86_uses_amx(spec, x86_cpu(target.arch)):
        request_amx_state()


def passes_at_open(spec, target: Target, serving_passes: bool | Iterable[int] = True) -> list[DecodeSpec]:
    """The serving passes ``open_kernel(spec, target, serving_passes=...)`` loads; ValueError
    naming ``serving_passes`` for a query count the target has no pass of for ``spec``."""
    every = target.serving_passes(spec)
    if serving_passes is True:
        return every
    if serving_passes is False or serving_passes is None:
        return []
    wanted = sorted(set(serving_passes))
    usable = {pass_spec.queries: pass_spec for pass_spec in every}
    unknown = [queries for queries in wanted if queries not in usable]
    if unknown:
        raise ValueError(f"serving_passes: {target.tag} has no pass of {unknown} queries for {spec.name} (its "
                         f"passes: {sorted(usable) or 'none'})")
    return [usable[queries] for queries in wanted]


_shared: dict = {}
_shared_lock = threading.Lock()


def release_shared() -> None:
    """Drops the process's shared kernels and IREE devices (the memo below, devices.get_device),
    then collects the cycles: run at exit (``atexit``), before the interpreter tears IREE's module
    down, so that nanobind finds none of its objects alive (it printed a page of "leaked"
    reports after scripts that imported the transformers integration). A kernel a caller still
    holds stays usable until it goes."""
    with _shared_lock:
        _shared.clear()
    get_device.cache_clear()
    gc.collect()


atexit.register(release_shared)


def shared_kernel(spec, backend: str | Target = "llvm-cpu", *, cache: ArtifactCache | None = None,
                  serving_passes: bool | Iterable[int] = True) -> Kernel:
    """:func:`open_kernel`'s kernel of ``spec``, opened once per process for these arguments and
    shared (a Kernel serialises its calls): the library's one kernel memo, which the torch ops and
    the transformers adapter open their kernels through."""
    target = target_for(backend)
    passes = tuple(pass_spec.queries for pass_spec in passes_at_open(spec, target, serving_passes))
    key = (spec, target, cache.root if cache is not None else None, passes)
    with _shared_lock:
        if key not in _shared:
            _shared[key] = open_kernel(spec, target, cache=cache, serving_passes=passes)
        return _shared[key]
