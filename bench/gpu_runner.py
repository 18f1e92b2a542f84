"""Runs a GPU bundle (made by ``bench/gpu_bundle.py``) on the machine with the GPU.

    python3 gpu_runner.py [--driver cuda] [--repeat 5] [--log FILE] [--max-seconds S] [--only TEXT]
        [--exclude TEXT]
                          [--runtime-flag=--cuda_async_allocations=false ...]

Needs only Python 3.12, numpy and the IREE runtime; when ``import iree.runtime`` fails it first
unpacks the wheels shipped in ``wheels/`` into ``deps/`` (a wheel is a zip file: no pip, no
registry). For every case in ``cases/`` it redraws or loads the arguments, runs the artifact on the
device, computes the float64 reference and the call's error bound on the CPU with the bundle's
``reference/`` copy (runtime/error_model.py) and checks output and lse elementwise against it, on
rows with a valid key; rows without one must be exactly 0 and -5e4. The ``bench-*`` cases are timed instead, next to torch's
``scaled_dot_product_attention`` on the same GPU when torch with CUDA is installed. Prints the
failures and a summary (``--log`` gets every case's line). Exit code 0 when every case passed.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import importlib
import importlib.util
import json
import os
import sys
import time
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
EMPTY_ROW_LSE = -5.0e4
#: The CPU workers' stack, as the library's runtime gives it (mlir/x86_attention.py:
#: WORKER_STACK_BYTES; IREE's default, 128 KiB, is less than some x86 kernels' buffers take).
WORKER_STACK_BYTES = 1 << 20


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a missing parent package
        return False


def _ensure_deps() -> None:
    """Unpacks the shipped wheels (the IREE runtime, ml_dtypes) into deps/ when one is missing;
    numpy must be the machine's own (the bundle ships none: bench/gpu_bundle.py)."""
    deps = os.path.join(HERE, "deps")
    sys.path.insert(0, HERE)  # reference/
    sys.path.insert(0, deps)
    if _importable("iree.runtime") and _importable("numpy") and _importable("ml_dtypes"):
        return
    for wheel in sorted(glob.glob(os.path.join(HERE, "wheels", "*.whl"))):
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(deps)
    sys.path_importer_cache.pop(deps, None)  # deps/ did not exist when first looked up
    importlib.invalidate_caches()
    if not _importable("numpy"):
        sys.exit("gpu_runner.py: numpy is not installed on this machine (the bundle ships the IREE runtime "
                 "and ml_dtypes only)")


def _bfloat16():
    """The bfloat16 dtype (ml_dtypes ships as a wheel; numpy has none)."""
    import ml_dtypes

    return ml_dtypes.bfloat16


def _redraw(draw: dict):
    """The array the tests' ``uniform`` drew from this PCG64 state (twin of gpu_bundle.redraw)."""
    import numpy as np

    rng = np.random.Generator(np.random.PCG64())
    rng.bit_generator.state = draw["state"]
    dtype = _bfloat16() if draw["dtype"] == "bfloat16" else draw["dtype"]
    array = rng.uniform(-1.0, 1.0, size=draw["shape"]).astype(dtype)
    if hashlib.sha1(array.tobytes()).hexdigest() != draw["sha1"]:
        raise RuntimeError("this numpy draws other numbers from the recorded PCG64 state")
    return array


def _load_case(path):
    """(meta, call arguments)."""
    import numpy as np

    rng = np.random.default_rng(0)
    with np.load(path, allow_pickle=False) as data:
        meta = json.loads(str(data["meta"]))
        args = []
        for kind, *value in meta["args"]:
            if kind == "uniform":
                args.append(_redraw(value[0]))
            elif kind == "random":
                shape, dtype = value
                drawn = rng.uniform(-1, 1, shape).astype(np.float32)
                args.append(drawn.astype(_bfloat16() if dtype == "bfloat16" else dtype))
            elif kind == "array":
                array = data[value[0]]
                args.append(array.view(_bfloat16()) if meta["dtype"] == "bfloat16" and array.dtype == np.uint16
                            else array)
            else:
                args.append(value[0])
        return meta, args


class Kernels:
    """One loaded module per artifact file (loading JIT-compiles its PTX: do it once)."""

    def __init__(self, rt, device):
        self.rt, self.device, self.functions = rt, device, {}

    def function(self, meta):
        key = (meta["file"], meta["symbol"])
        if key not in self.functions:
            if meta.get("amx"):
                _request_amx_state()
            context = self.rt.SystemContext(config=self.rt.Config(device=self.device))
            with open(os.path.join(HERE, meta["file"]), "rb") as f:
                module = self.rt.VmModule.copy_buffer(context.instance, f.read())
            context.add_vm_module(module)
            function = context.modules[module.name][meta["symbol"]]
            if "iree.abi.output" in function.vm_function.reflection.get("iree.abi.declaration", ""):
                function = _WithStorage(self.rt, self.device, context, function.vm_function, meta)
            self.functions[key] = (context, function)
        return self.functions[key][1]


class _WithStorage:
    """A function that takes storage for its results (the CPU artifacts: iree.abi.output, after
    its arguments; mlir/abi.py: with_output_storage), called as IREE's invoker is: buffers for
    (output, lse) allocated per call from the query's shape and passed after the arguments,
    which iree.runtime's invoker does not pack. Returns the results as device arrays."""

    ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}

    def __init__(self, rt, device, context, vm_function, meta):
        from iree.runtime._binding import ArgumentPacker, _invoke_statics

        self.rt, self.device, self.context, self.vm_function = rt, device, context, vm_function
        self.packer = ArgumentPacker(_invoke_statics, None)
        self.q_position, self.d_v, self.itemsize = meta["q_position"], meta["d_v"], self.ITEMSIZE[meta["dtype"]]

    def __call__(self, *args):
        from iree.runtime._binding import InvokeContext

        rt = self.rt
        rows = 1
        for extent in args[self.q_position].shape[:-1]:
            rows *= extent
        buffers = [self.device.allocator.allocate_buffer(
            memory_type=rt.MemoryType.DEVICE_LOCAL | rt.MemoryType.HOST_VISIBLE,
            allowed_usage=rt.BufferUsage.DEFAULT | rt.BufferUsage.MAPPING, allocation_size=max(size, 64))
            for size in (rows * self.d_v * self.itemsize, rows * 4)]
        arguments = self.packer.pack(InvokeContext(self.device), list(args), {})
        for buffer in buffers:
            arguments.push_ref(buffer)
        results = rt.VmVariantList(2)
        self.context.vm_context.invoke(self.vm_function, arguments, results)
        return tuple(rt.DeviceArray(self.device, results.get_as_object(i, rt.HalBufferView), implicit_host_transfer=True)
                     for i in range(2))


def _request_amx_state() -> None:
    """Asks Linux for the AMX tile state before an AMX kernel loads (a bundle built for llvm-cpu on
    a CPU with AMX; linalg_prefill/runtime/amx.py, which this standalone script cannot import)."""
    import ctypes

    if ctypes.CDLL(None, use_errno=True).syscall(158, 0x1023, 18) != 0:  # arch_prctl(REQ_XCOMP_PERM, XTILEDATA)
        raise SystemExit(f"this bundle's AMX kernels need the amx_tile state, which Linux refused "
                         f"(errno {ctypes.get_errno()})")


def _upload(rt, device, array):
    """A device array; int32 index arrays in host-local memory the device reads (the CUDA
    kernels' host program reads them in its loops: runtime/module.py host_readable)."""
    if array.dtype.name != "int32":
        return rt.asdevicearray(device, array)
    view = device.allocator.allocate_buffer_copy(
        memory_type=rt.MemoryType.HOST_LOCAL | rt.MemoryType.DEVICE_VISIBLE,
        allowed_usage=rt.BufferUsage.DEFAULT | rt.BufferUsage.MAPPING, device=device, buffer=array,
        element_type=rt.HalElementType.SINT_32)
    return rt.DeviceArray(device, view)


def _run(kernels, meta, args, repeat: int):
    """(output, lse) on the host, and the best of ``repeat`` timed calls (bench cases only)."""
    import numpy as np

    function = kernels.function(meta)
    device_args = [_upload(kernels.rt, kernels.device, a) if isinstance(a, np.ndarray) else a for a in args]
    out, lse = function(*device_args)
    out, lse = out.to_host(), lse.to_host()
    times = []
    for _ in range(repeat if meta["name"].startswith("bench-") else 0):
        start = time.perf_counter()
        function(*device_args)  # returns once the device is done (the module awaits its last fence)
        times.append(time.perf_counter() - start)
    return out, lse, (min(times) if times else None)


def _check(meta, args, out, lse) -> tuple[float, float, float, bool, bool]:
    """(max output error, max lse error, largest error / bound, empty rows exact, passed) against
    the reference and the call's error bound (runtime/error_model.py)."""
    import numpy as np
    from reference import error_model, reference

    name, kwargs = meta["reference"]
    names = meta["arguments"]
    evaluate = getattr(reference, name)

    def reference_of(named):
        if name == "decode_entries":  # a serving pass's reference takes its arguments in order
            return evaluate(*(named[n] for n in names), **kwargs)
        return evaluate(**{n: named[n] for n in names}, **kwargs)  # a variant's, by name

    named = dict(zip(names, args))
    want = want_out, want_lse = reference_of(named)
    bound = error_model.bound_of_call(named, error_model.CallFacts(**meta["facts"]), reference_of, want)
    valid = bound.valid
    err_out = float(np.max(np.abs(out.astype(np.float64) - want_out)[valid], initial=0.0))
    err_lse = float(np.max(np.abs(lse.astype(np.float64) - want_lse)[valid], initial=0.0))
    ratio = bound.worst((out, lse), want)
    empty_ok = bool(np.all(out.astype(np.float64)[~valid] == 0) and np.all(lse[~valid] == EMPTY_ROW_LSE))
    return err_out, err_lse, ratio, empty_ok, ratio <= 1.0 and empty_ok


def _torch_seconds(meta, args, repeat: int):
    """Best time of torch SDPA on the GPU for a bench case's attention, or None without torch/CUDA.

    Dense: one call on [B, H, L, D] (causal, GQA). Ragged and paged (pages in order, last page
    padding unused): one call per entry on its contiguous K/V (qo_len == kv_len, so torch's
    top-left causal mask is the bottom-right one; the paged kernel's page gather is not done for
    torch)."""
    if not _importable("torch"):
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    dtype = getattr(torch, meta["dtype"])
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if meta["symbol"].startswith("decode_entries"):  # a serving pass (decode_entries, decode_entries_q4, ...)
        return _torch_serving_seconds(torch, dtype, meta["group"], args, repeat)
    if meta["symbol"] == "batch_sequence_prefill_kv":
        q, k, v = (torch.tensor(a.astype("float32")).to("cuda", dtype).transpose(1, 2) for a in args[:3])
        calls = [(q, k, v)]
    else:
        q, indptr = args[0], args[1]
        kv_start = indptr
        if meta["symbol"].startswith("batch_prefill_paged_kv"):  # pages [P, 2, h_kv, 16, d] in order
            pages, page_indptr = args[2], args[3]
            k, v = (pages[:, i].transpose(0, 2, 1, 3).reshape(-1, pages.shape[2], pages.shape[4]) for i in (0, 1))
            kv_start = page_indptr * pages.shape[3]
        else:
            k, v = args[2], args[3]
        calls = []
        for b in range(len(indptr) - 1):
            n = int(indptr[b + 1] - indptr[b])
            q_rows, kv_rows = slice(int(indptr[b]), int(indptr[b]) + n), slice(int(kv_start[b]), int(kv_start[b]) + n)
            calls.append(tuple(torch.tensor(a[rows].astype("float32")).to("cuda", dtype).transpose(0, 1)[None]
                               for a, rows in ((q, q_rows), (k, kv_rows), (v, kv_rows))))
    times = []
    for _ in range(repeat + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for q, k, v in calls:
            sdpa(q, k, v, is_causal=True, enable_gqa=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times[1:])


def _torch_serving_seconds(torch, dtype, group: int, args, repeat: int, device: str = "cuda") -> float:
    """Best time of torch SDPA on a paged serving pass's attention: K/V gathered through the table
    and padded to the longest entry (not timed), one batched call with a boolean mask
    (bottom-right causal per entry)."""
    import numpy as np

    q, pages, table, geometry = args[0], args[1], args[2], args[3]
    n, h_kv, rows, d = q.shape
    queries = rows // group
    table = table.reshape(n, -1)  # [n, c, P] chunks of blocks
    width = table.shape[1] * pages.shape[3]
    kv = [pages[np.maximum(table, 0), i].transpose(0, 2, 1, 3, 4).reshape(n, h_kv, width, d) for i in (0, 1)]
    k, v = (torch.tensor(x.astype("float32")).to(device, dtype) for x in kv)
    q_heads = q.reshape(n, h_kv, queries, group, d).transpose(0, 1, 3, 2, 4).reshape(n, h_kv * group, queries, d)
    q_t = torch.tensor(q_heads.astype("float32")).to(device, dtype)
    kv_len, qo_len = geometry[:, 0, None, None], geometry[:, 3, None, None]
    cols, tokens = np.arange(width)[None, None], np.arange(queries)[None, :, None]
    mask = torch.tensor((cols < kv_len) & (cols <= kv_len - qo_len + tokens))[:, None].to(device)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    for _ in range(repeat + 1):
        synchronize()
        start = time.perf_counter()
        sdpa(q_t, k, v, attn_mask=mask, enable_gqa=True)
        synchronize()
        times.append(time.perf_counter() - start)
    return min(times[1:])


def sweep_summary(swept) -> list[str]:
    """A sweep's timed cases (bench/gpu_sweep.py) by case, candidates fastest first: ``swept`` is
    (case, candidate, seconds, torch seconds or None) rows; lines to print (none without rows)."""
    lines = []
    for case in sorted({row[0] for row in swept}):
        rows = sorted((row for row in swept if row[0] == case), key=lambda row: row[2])
        ranked = ", ".join(f"{candidate} {seconds * 1e3:.2f} ms" + (f" ({torch / seconds:.2f}x)" if torch else "")
                           for _, candidate, seconds, torch in rows)
        lines.append(f"sweep {case}: {ranked}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--driver", default="cuda")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--log", help="write every case's line here too")
    parser.add_argument("--only", help="run only the cases whose file name contains this text")
    parser.add_argument("--exclude", help="skip the cases whose file name contains this text")
    parser.add_argument("--runtime-flag", action="append", default=[],
                        help="an IREE runtime flag, e.g. --runtime-flag=--cuda_async_allocations=false")
    parser.add_argument("--max-seconds", type=float, default=float("inf"),
                        help="stop starting new cases after this long (the summary says how many ran)")
    args = parser.parse_args()
    _ensure_deps()
    import iree.runtime as rt

    if args.driver.startswith("local-"):   # the x86 kernels' workgroup buffers (runtime/devices.py)
        rt.flags.parse_flags(f"--task_worker_stack_size={WORKER_STACK_BYTES}")
    if args.runtime_flag:
        rt.flags.parse_flags(*args.runtime_flag)
    device = rt.get_device(args.driver)
    kernels = Kernels(rt, device)
    log = open(args.log, "w") if args.log else None
    started = time.perf_counter()

    def emit(line: str, always: bool = False) -> None:
        if log:
            print(line, file=log, flush=True)
        if always:
            print(line, flush=True)

    emit(f"device {args.driver}: {device} {' '.join(args.runtime_flag)}", always=True)
    emit(f"{'case':<70} {'err out':>9} {'err lse':>9} {'err/bnd':>7} {'empty':>5}", always=True)
    paths = sorted((path for path in glob.glob(os.path.join(HERE, "cases", "*.npz"))
                    if (args.only is None or args.only in os.path.basename(path))
                    and (args.exclude is None or args.exclude not in os.path.basename(path))),
                   key=lambda path: (os.path.basename(path).startswith("bench-"), path))  # checked ones first
    passed = failed = 0
    swept = []   # (sweep case, candidate, seconds, torch seconds or None) of a sweep's timed cases
    for path in paths:
        if time.perf_counter() - started > args.max_seconds:
            break
        try:
            meta, call_args = _load_case(path)
            out, lse, seconds = _run(kernels, meta, call_args, args.repeat)
        except Exception as error:  # noqa: BLE001 (a case that cannot run is a failure to report)
            failed += 1
            emit(f"{os.path.basename(path)[:70]:<70} ERROR {type(error).__name__}: {error}", always=True)
            # A failed call can leave the device unusable (every later allocation failed on CUDA):
            # the next case starts on a fresh device.
            device = rt.get_driver(args.driver).create_default_device()
            kernels = Kernels(rt, device)
            continue
        if seconds is not None:
            torch_seconds = _torch_seconds(meta, call_args, args.repeat)
            peer = (f"; torch SDPA {torch_seconds * 1e3:.2f} ms, {meta['flops'] / torch_seconds / 1e9:.1f} GFLOP/s, "
                    f"ratio (torch time / ours) {torch_seconds / seconds:.2f}") if torch_seconds else ""
            emit(f"{meta['name']}: {seconds * 1e3:.2f} ms, {meta['flops'] / seconds / 1e9:.1f} GFLOP/s{peer}",
                 always=True)
            if "sweep_case" in meta:
                swept.append((meta["sweep_case"], meta["candidate"], seconds, torch_seconds))
            continue
        err_out, err_lse, ratio, empty_ok, ok = _check(meta, call_args, out, lse)
        passed += ok
        failed += not ok
        emit(f"{meta['name'][:70]:<70} {err_out:>9.2e} {err_lse:>9.2e} {ratio:>7.3f} {str(empty_ok):>5}"
             f"{'' if ok else '  OUT OF BOUND'}", always=not ok)
    for line in sweep_summary(swept):
        emit(line, always=True)
    ran = passed + failed
    emit(f"{passed} of {ran} checked cases within their error bounds ({len(paths)} cases in the bundle, "
         f"{len(kernels.functions)} artifacts loaded last, {time.perf_counter() - started:.0f} s)", always=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
