"""Runs a GPU bundle (made by ``bench/gpu_bundle.py``) on the machine with the GPU.

    python3 gpu_runner.py [--driver cuda] [--repeat 5]

Needs only Python 3.12, numpy and the IREE runtime; when ``import iree.runtime`` fails it first
unpacks the wheels shipped in ``wheels/`` into ``deps/`` (a wheel is a zip file: no pip, no
registry). For every case in ``cases/`` it runs the artifact on the device, compares output and
lse with the float64 reference computed when the bundle was made (rows with a valid key; rows
without one must be exactly 0 and -5e4) and prints a table; the ``bench-*`` cases are also timed.
Exit code 0 when every case is within tolerance.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import sys
import time
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
TOLERANCE = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 3e-2}
EMPTY_ROW_LSE = -5.0e4


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a missing parent package
        return False


def _ensure_deps() -> None:
    deps = os.path.join(HERE, "deps")
    sys.path.insert(0, deps)
    if _importable("iree.runtime") and _importable("numpy") and _importable("ml_dtypes"):
        return
    for wheel in sorted(glob.glob(os.path.join(HERE, "wheels", "*.whl"))):
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(deps)
    sys.path_importer_cache.pop(deps, None)  # deps/ did not exist when first looked up
    importlib.invalidate_caches()


def _load_case(path):
    """(meta, call arguments, reference output or None, reference lse or None)."""
    import numpy as np

    rng = np.random.default_rng(0)
    with np.load(path, allow_pickle=False) as data:
        meta = json.loads(str(data["meta"]))
        args = []
        for kind, *value in meta["args"]:
            if kind == "random":
                shape, dtype = value
                drawn = rng.uniform(-1, 1, shape).astype(np.float32)
                args.append(drawn.astype(_bfloat16() if dtype == "bfloat16" else dtype))
            elif kind == "array":
                array = data[value[0]]
                args.append(array.view(_bfloat16()) if meta["dtype"] == "bfloat16" and array.dtype == np.uint16
                            else array)
            else:
                args.append(value[0])
        want = (data["want_out"], data["want_lse"]) if "want_out" in data else (None, None)
        return meta, args, *want


def _bfloat16():
    """The bfloat16 dtype (ml_dtypes ships as a wheel; numpy has none)."""
    import ml_dtypes

    return ml_dtypes.bfloat16


def _run_case(rt, device, meta, args, repeat: int):
    import numpy as np

    config = rt.Config(device=device)
    context = rt.SystemContext(config=config)
    with open(os.path.join(HERE, meta["file"]), "rb") as f:
        module = rt.VmModule.copy_buffer(context.instance, f.read())
    context.add_vm_module(module)
    function = context.modules[module.name][meta["symbol"]]
    device_args = [rt.asdevicearray(device, a) if isinstance(a, np.ndarray) else a for a in args]
    out, lse = function(*device_args)
    out, lse = out.to_host(), lse.to_host()
    times = []
    for _ in range(repeat if meta["name"].startswith("bench-") else 0):
        start = time.perf_counter()
        result = function(*device_args)
        result[0].to_host()
        times.append(time.perf_counter() - start)
    return out, lse, (min(times) if times else None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--driver", default="cuda")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    _ensure_deps()
    import iree.runtime as rt
    import numpy as np

    device = rt.get_device(args.driver)
    print(f"device {args.driver}: {device}")
    failures = 0
    print(f"{'case':<58} {'max err out':>12} {'max err lse':>12} {'empty ok':>8} {'ms':>9} {'GFLOP/s':>8}")
    for path in sorted(glob.glob(os.path.join(HERE, "cases", "*.npz"))):
        meta, call_args, want_out, want_lse = _load_case(path)
        out, lse, seconds = _run_case(rt, device, meta, call_args, args.repeat)
        timing = f"{seconds * 1e3:>9.2f} {meta['flops'] / seconds / 1e9:>8.1f}" if seconds else f"{'-':>9} {'-':>8}"
        if want_out is None:  # a bench case: timed only
            print(f"{meta['name'][:58]:<58} {'-':>12} {'-':>12} {'-':>8} {timing}")
            continue
        valid = want_lse != EMPTY_ROW_LSE
        err_out = float(np.max(np.abs(out.astype(np.float64) - want_out)[valid], initial=0.0))
        err_lse = float(np.max(np.abs(lse.astype(np.float64) - want_lse)[valid], initial=0.0))
        empty_ok = bool(np.all(out.astype(np.float64)[~valid] == 0) and np.all(lse[~valid] == EMPTY_ROW_LSE))
        tol = TOLERANCE[meta["dtype"]]
        ok = err_out <= tol and err_lse <= tol and empty_ok
        failures += not ok
        print(f"{meta['name'][:58]:<58} {err_out:>12.2e} {err_lse:>12.2e} {str(empty_ok):>8} {timing}"
              f"{'' if ok else '  OUT OF TOLERANCE'}")
    print(f"{'all cases within tolerance' if not failures else f'{failures} case(s) out of tolerance'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
