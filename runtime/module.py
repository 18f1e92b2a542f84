"""Loading a vmfb on a device and calling its entry point with numpy (or device) arrays."""

from __future__ import annotations

import functools
import math
import threading
import time
from typing import Any, Callable, Sequence, TypeVar

import iree.runtime as rt
import numpy as np
from iree.runtime.array_interop import map_dtype_to_element_type

from ..mlir.abi import OUTPUT_STORAGE_ATTRIBUTE
from ..pipeline.quiet_logging import root_logger_left_alone
from .devices import get_device
from .worker_placement import BATCH_WAIT_FROM_S, PLACEMENT, waiting_as_batch

T = TypeVar("T")


class LoadedKernel:
    """One entry point of a vmfb loaded into its own context on a device.

    ``kernel(*args)`` takes numpy arrays, IREE ``DeviceArray``s (used in place) and Python
    scalars, and returns the results as numpy arrays, or as ``DeviceArray``s with
    ``to_host=False``. Calls are serialised by a lock, so one object may be shared by threads.
    On the CPU drivers a numpy array is used in place too (:func:`in_place`: no copy, so a call
    costs what it reads, not the size of its arrays) when it is C-contiguous, writeable and at an
    address that is a multiple of ``alignment``, the input alignment the artifact was compiled
    for (pipeline.targets.input_alignment: 64 unless its flags lower it); any other array is
    copied into a new buffer, and :attr:`bytes_copied` counts those bytes.
    A function that takes storage for its results (mlir/abi.py: with_output_storage; the CPU
    artifacts) writes them into arrays this object allocates, or into the caller's (``into``):
    ``results`` (:class:`ResultShapes`) gives their shapes from a call's arguments, and the
    results a call returns are those arrays, no copy (:attr:`writes_in_place`). Otherwise, on
    the CPU drivers, the results are copies: no buffer of IREE's outlives a call (see
    __init__); :meth:`consume` hands them to a function in place instead, with no copy.
    """

    def __init__(self, vmfb: bytes, symbol: str, driver: str, *, alignment: int = 64,
                 results: "ResultShapes | None" = None):
        self.driver = driver
        self.symbol = symbol
        self.device = get_device(driver)
        self._config = rt.Config(device=self.device)
        self._context = rt.SystemContext(config=self._config)
        self._vm_module = rt.VmModule.copy_buffer(self._context.instance, vmfb)
        self._context.add_vm_module(self._vm_module)
        with root_logger_left_alone():
            self._function = self._context.modules[self._vm_module.name][symbol]
        self._storage = None
        if takes_output_storage(self._function.vm_function):   # its results go into storage the call passes
            if results is None:
                raise ValueError(f"{symbol}: takes storage for its results; open it with their shapes (results=)")
            if not is_local(self.device):
                raise ValueError(f"{symbol}: takes storage for its results, which only the CPU drivers pass")
            self._storage = results
            self._function = _StorageCall(self._context.vm_context, self.device, self._function.vm_function)
        self._lock = threading.Lock()
        # A device with memory of its own: int32 index arrays go host-local (see host_readable).
        self._index_arrays_host_local = not is_local(self.device)
        # On the CPU drivers no result buffer of a call outlives it: IREE 3.13's local-task device
        # leaks memory when one call's result buffers are alive during the next call and freed
        # after it (a 128 x 64 vs 128 serving step grew by 64 MiB a step, heap in use, for good),
        # so results are copied out (to numpy, or into arrays uploaded anew with to_host=False).
        self._results_detached = is_local(self.device)
        # On the CPU drivers numpy arrays at addresses the executables accept are used in place.
        self._alignment = alignment if is_local(self.device) else None
        # On the CPU drivers the first IREE worker is kept off the calling thread's CPU, and after
        # a call of BATCH_WAIT_FROM_S or longer the caller waits for the workers as SCHED_BATCH
        # (runtime/worker_placement.py: inside a torch model a call took twice as long either way).
        self._placement = PLACEMENT if is_local(self.device) else None
        self._last_call_s = 0.0
        #: Bytes of numpy arguments that had to be copied into new buffers, over every call.
        self.bytes_copied = 0

    @property
    def writes_in_place(self) -> bool:
        """Whether a call's results are arrays of their own (written where the call put them,
        valid after :meth:`consume`'s ``use`` too), not mapped buffers of IREE's."""
        return self._storage is not None

    def __call__(self, *args: Any, to_host: bool = True) -> tuple:
        if self._storage is not None:
            arrays = self._call_into(args)
            return arrays if to_host else tuple(as_device_arrays(self.device, arrays))
        results = self._invoke(args)
        if to_host:
            return tuple(_to_numpy(r, copy=self._results_detached) for r in results)
        if self._results_detached:  # uploaded straight from the mapped results: one copy
            return tuple(as_device_arrays(self.device, [_to_numpy(r) for r in results]))
        return tuple(results)

    def consume(self, use: Callable[..., T], *args: Any, results: int | None = None, into: tuple = ()) -> T:
        """``use(*results)`` with the call's results as numpy arrays that are valid only inside
        ``use`` (on the CPU drivers the result buffers mapped in place, no copy): ``use`` copies
        what it keeps, and the buffers go when it returns. Returns what ``use`` returns. With
        ``results=n`` only the first n are mapped and handed to ``use`` (a mapping costs 0.03 ms
        between a model's layers). ``into``: arrays for the results of a function that takes
        storage for them, used where they can be (:meth:`_call_into`)."""
        if self._storage is not None:
            return use(*self._call_into(args, into)[:results])
        returned = self._invoke(args)
        return use(*(_to_numpy(r) for r in returned[:results]))

    def _invoke(self, args: tuple) -> tuple:
        if self._index_arrays_host_local:
            args = tuple(host_readable(self.device, a) if _is_index_array(a) else a for a in args)
        elif self._alignment is not None:
            args = tuple(self._in_place(a) if isinstance(a, np.ndarray) else a for a in args)
        with self._lock:
            if self._placement is None:
                results = self._function(*args)
            else:
                self._placement.before_call()
                start = time.perf_counter()
                if self._last_call_s >= BATCH_WAIT_FROM_S:
                    results = waiting_as_batch(lambda: self._function(*args))
                else:
                    results = self._function(*args)
                self._last_call_s = time.perf_counter() - start
        return tuple(results) if isinstance(results, (tuple, list)) else (results,)


    def _call_into(self, args: tuple, into: tuple = ()) -> tuple:
        """The results of a call of a function that takes their storage, written into ``into``'s
        arrays where each is the result's C-contiguous writeable array of its shape and dtype at
        a 64-byte boundary, else into new arrays (also 64-byte aligned); returns the arrays."""
        arrays = []
        for i, (shape, dtype) in enumerate(self._storage.shapes(args)):
            given = into[i] if i < len(into) else None
            arrays.append(given if _takes(given, shape, dtype) else aligned_empty(shape, dtype))
        buffers = tuple(_imported(self.device, _at_least_a_line(a)) for a in arrays)
        self._invoke((*args, *buffers))
        return tuple(arrays)

    def _in_place(self, array: np.ndarray):
        """``array`` as a buffer view over its own memory, or as it is (IREE then copies it into
        a new buffer, counted in :attr:`bytes_copied`)."""
        view = in_place(self.device, array, self._alignment)
        if view is None:
            self.bytes_copied += array.nbytes
            return array
        return view


def in_place(device: rt.HalDevice, array: np.ndarray, alignment: int) -> rt.HalBufferView | None:
    """A buffer view of ``array``'s own memory for a call on a CPU driver's ``device`` (the
    buffer keeps ``array`` alive), or None where the kernel cannot read it in place: an empty,
    non-contiguous or read-only array, one whose dtype IREE has no element type for, or one at an
    address that is not a multiple of ``alignment`` (the executables load their inputs with
    instructions that fault on a less aligned address: pipeline.targets.input_alignment)."""
    if (array.size == 0 or not array.flags.c_contiguous or not array.flags.writeable
            or array.ctypes.data % alignment):
        return None
    element = _element_type(array.dtype)
    if element is None:
        return None
    return rt.HalBufferView(_imported(device, array), array.shape, element)


def _imported(device: rt.HalDevice, array: np.ndarray) -> rt.HalBuffer:
    """A buffer over ``array``'s own memory (it keeps ``array`` alive), for a CPU driver's call."""
    return device.allocator.import_host_allocation(array, _IMPORTED_MEMORY, _MAPPED_USAGE)


_IMPORTED_MEMORY = rt.MemoryType.HOST_LOCAL | rt.MemoryType.DEVICE_VISIBLE
#: The byte boundary of the arrays results are written into.
RESULT_ALIGNMENT = 64


class ResultShapes:
    """The shapes and dtypes of a kernel's (output, lse) from a call's arguments: the output is
    the query's shape (argument ``q_position``) with ``d_v`` columns in ``dtype``, lse the
    query's shape without its last axis, float32 (mlir/abi.py: result_dims)."""

    def __init__(self, q_position: int, d_v: int, dtype):
        self.q_position, self.d_v, self.dtype = q_position, d_v, np.dtype(dtype)

    def shapes(self, args: tuple) -> tuple:
        rows = tuple(args[self.q_position].shape[:-1])
        return ((*rows, self.d_v), self.dtype), (rows, np.dtype(np.float32))


def takes_output_storage(vm_function) -> bool:
    """Whether a loaded function takes storage for its results (mlir/abi.py: with_output_storage),
    read from the signature IREE records in its reflection."""
    return OUTPUT_STORAGE_ATTRIBUTE in vm_function.reflection.get("iree.abi.declaration", "")


def aligned_empty(shape: tuple, dtype) -> np.ndarray:
    """An uninitialised C-contiguous array at a RESULT_ALIGNMENT boundary."""
    dtype = np.dtype(dtype)
    size = math.prod(shape) * dtype.itemsize
    raw = np.empty(size + RESULT_ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % RESULT_ALIGNMENT
    return raw[start:start + size].view(dtype).reshape(shape)


def _takes(array, shape: tuple, dtype) -> bool:
    """Whether ``array`` can be written in place as a result of ``shape`` and ``dtype``."""
    return (isinstance(array, np.ndarray) and array.shape == tuple(shape) and array.dtype == dtype
            and array.flags.c_contiguous and array.flags.writeable and array.size > 0
            and array.ctypes.data % RESULT_ALIGNMENT == 0)


def _at_least_a_line(array: np.ndarray) -> np.ndarray:
    """``array`` as flat bytes to import, or a line of its own for an empty result (IREE imports
    no empty allocation; the result's view then has no element)."""
    flat = array.reshape(-1).view(np.uint8)
    return flat if flat.size else aligned_empty((RESULT_ALIGNMENT,), np.uint8)


class _StorageCall:
    """Calls a VM function whose trailing arguments are its results' storage (``!hal.buffer``,
    which iree.runtime's FunctionInvoker does not pack): the other arguments packed as the
    invoker packs them (numpy arrays, buffer views, DeviceArrays, Python scalars), the buffers
    pushed after them. The results (views of the storage) are dropped."""

    def __init__(self, vm_context, device: rt.HalDevice, vm_function):
        # iree's binding objects held by instances only, never by this module's globals: a
        # global one outlives nanobind's check at exit, which then reports leaks (the kernels'
        # instances go at exit: runtime/kernels.py, release_shared)
        from iree.runtime import _binding

        self._vm_context, self._device, self._vm_function = vm_context, device, vm_function
        self._packer = _binding.ArgumentPacker(_binding._invoke_statics, None)
        self._context_type = _binding.InvokeContext

    def __call__(self, *args) -> tuple:
        values = [a for a in args if not isinstance(a, rt.HalBuffer)]
        arguments = self._packer.pack(self._context_type(self._device), values, {})
        for buffer in args[len(values):]:
            arguments.push_ref(buffer)
        self._vm_context.invoke(self._vm_function, arguments, rt.VmVariantList(2))
        return ()


def host_visible_array(device: rt.HalDevice, shape: tuple, dtype) -> tuple[Any, np.ndarray]:
    """(argument, view): an array the host fills through ``view`` and a call then takes as
    ``argument`` with no copy. On the CPU drivers a device buffer mapped into host memory (passing
    a numpy array instead copies it into a fresh buffer on every call); elsewhere a numpy array
    (argument and view the same), which the call uploads."""
    dtype = np.dtype(dtype)
    if not is_local(device):
        return host_array(shape, dtype)
    buffer = device.allocator.allocate_buffer(memory_type=_MAPPED_MEMORY, allowed_usage=_MAPPED_USAGE,
                                              allocation_size=max(math.prod(shape) * dtype.itemsize, 1))
    array = rt.DeviceArray(device, rt.HalBufferView(buffer, shape, _element_type(dtype)), implicit_host_transfer=True,
                           override_dtype=dtype)
    return array, array.to_host()


def host_array(shape: tuple, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(array, array): :func:`host_visible_array`'s form for a numpy array, argument and view the
    same."""
    array = np.empty(shape, dtype)
    return array, array


_MAPPED_MEMORY = rt.MemoryType.DEVICE_LOCAL | rt.MemoryType.HOST_VISIBLE
_MAPPED_USAGE = rt.BufferUsage.DEFAULT | rt.BufferUsage.MAPPING


@functools.cache
def _element_type(dtype: np.dtype) -> rt.HalElementType:
    return map_dtype_to_element_type(dtype)


def _to_numpy(value, copy: bool = False) -> np.ndarray:
    """A result as a numpy array; with ``copy``, one of its own, so that the call's result buffer
    can go (``to_host`` maps a local device's buffer in place)."""
    if isinstance(value, rt.DeviceArray):
        host = value.to_host()
        return np.array(host) if copy else host
    return np.asarray(value)


def as_device_arrays(device: rt.HalDevice, arrays: Sequence[np.ndarray]) -> list:
    """Uploads arrays once so repeated calls reuse them without a host-to-device copy; int32 index
    arrays go host-local on a device with memory of its own (see :func:`host_readable`)."""
    local = is_local(device)
    return [host_readable(device, a) if _is_index_array(a) and not local
            else rt.asdevicearray(device, a, implicit_host_transfer=True) for a in arrays]


def device_resident(device: rt.HalDevice, arrays: Sequence) -> tuple:
    """``arrays`` as device arrays: DeviceArrays as they are, numpy arrays uploaded."""
    return tuple(a if isinstance(a, rt.DeviceArray) else as_device_arrays(device, [a])[0] for a in arrays)


def host_readable(device: rt.HalDevice, array: np.ndarray) -> rt.DeviceArray:
    """An int32 index array in host-local memory the device can read (pinned memory on CUDA).

    The CUDA kernels' host program reads their index arrays in its loops (mlir/ir.py:
    HostReadable); from this memory that is a plain load, from device memory it could not be.
    """
    view = device.allocator.allocate_buffer_copy(
        memory_type=rt.MemoryType.HOST_LOCAL | rt.MemoryType.DEVICE_VISIBLE,
        allowed_usage=rt.BufferUsage.DEFAULT | rt.BufferUsage.MAPPING, device=device,
        buffer=np.ascontiguousarray(array), element_type=rt.HalElementType.SINT_32)
    return rt.DeviceArray(device, view, implicit_host_transfer=True)


def _is_index_array(value) -> bool:
    return isinstance(value, np.ndarray) and value.dtype == np.int32


def is_local(device: rt.HalDevice) -> bool:
    """The CPU drivers' devices (local-task, local-sync) share the host's memory."""
    return "local" in str(device).lower()
