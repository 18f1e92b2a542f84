"""The inline RoPE emitter (:mod:`linalg_prefill.mlir.rope`) against the float64 reference."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from conftest import NUMPY_DTYPE, uniform
from linalg_prefill.mlir.ir import DYN, element_type, f32, func_d, i32, ir, module_context, tensor_type
from linalg_prefill.mlir.rope import apply_rope
from linalg_prefill.pipeline import Target, compile_ir
from linalg_prefill.runtime.error_model import rotation_bound
from linalg_prefill.runtime.module import LoadedKernel
from linalg_prefill.runtime.rope import apply_rope as reference_rope, rope_pair_angles
from support import LLAMA3, LLAMA4, LONGROPE, YARN

LLAMA3_STEP = {**LLAMA3, "high_freq_factor": 1.0}
YARN_ILTS = {**YARN, "inv_theta_log_scale": 0.05}
YARN_FLAT = {**YARN, "beta_fast": 8, "beta_slow": 8}  # low == high: the ramp is a 0.001-wide step
# transformers' yarn: bounds (10.47, 22.51) at theta 1e4 become (10, 23), (9.74, 20.94) at 2e4 (9, 21)
YARN_TRUNCATED = {**YARN, "truncate": True, "attention_factor": 1.25}
# Phi-3.5's kind of long_factor: per-pair divisors from 1 to about 40, not monotonic
LONGROPE_FACTORS = {**LONGROPE, "ext_factors": [round(float(f), 4) for f in
                                                 np.geomspace(1.0, 40.0, 32) * (1 + 0.1 * np.sin(np.arange(32)))]}

# (rope_scaling, head_dim, theta): each compiled kernel runs at (theta, 0.5) and (2 theta, 2.0).
F32_CASES = {
    "absent": ({}, 64, 10000.0),
    "default": ({"rope_type": "default"}, 128, 10000.0),
    "gptj": ({"rope_type": "gptj"}, 64, 10000.0),
    "llama3": (LLAMA3, 128, 500000.0),
    "llama3-step": (LLAMA3_STEP, 64, 500000.0),
    "llama4": (LLAMA4, 128, 500000.0),
    "longrope": (LONGROPE, 64, 10000.0),
    "longrope-factors": (LONGROPE_FACTORS, 64, 10000.0),
    "yarn": (YARN, 128, 10000.0),
    "yarn-ilts": (YARN_ILTS, 64, 1000000.0),
    "yarn-flat": (YARN_FLAT, 64, 10000.0),
    "yarn-truncated": (YARN_TRUNCATED, 64, 10000.0),
}
HEADS = 3
ROWS = 37


def _module(dtype: str, head_dim: int, rope_scaling: dict, *, first_scalar: bool = False,
            rows: int = DYN) -> ir.Module:
    """``@rope(x [rows, HEADS, D], positions [rows] i32 | first i32, theta f32, scale f32)``."""
    return _functions_module({"rope": (dtype, head_dim, rope_scaling, first_scalar, rows)})


def _functions_module(functions: dict) -> ir.Module:
    """One module of ``@name(x, positions | first, theta, scale)`` per (dtype, head_dim,
    rope_scaling, first_scalar, rows) of ``functions``."""
    with module_context() as module:
        for name, (dtype, head_dim, rope_scaling, first_scalar, rows) in functions.items():
            x_type = tensor_type([rows, HEADS, head_dim], element_type(dtype))
            pos_type = i32() if first_scalar else tensor_type([rows], i32())
            with ir.InsertionPoint(module.body):
                fn = func_d.FuncOp(name, ([x_type, pos_type, f32(), f32()], [x_type]))
                with ir.InsertionPoint(fn.add_entry_block()):
                    x, positions, theta, scale = fn.arguments
                    func_d.ReturnOp([apply_rope(x, positions, theta=theta, scale=scale, rope_scaling=rope_scaling)])
        module.operation.verify()
        return module


#: The numerics tests' functions, compiled as one module once a process (14 compiles took 9 s of
#: the suite, AMD EPYC): per name (dtype, head_dim, rope_scaling, first_scalar, rows).
FUNCTIONS = {
    **{f"rope_f32_{case.replace('-', '_')}": ("float32", head_dim, rope_scaling, False, DYN)
       for case, (rope_scaling, head_dim, _) in F32_CASES.items()},
    "rope_float16": ("float16", 128, LLAMA3, False, DYN),
    "rope_bfloat16": ("bfloat16", 128, {"rope_type": "gptj"}, False, DYN),
    "rope_first_static_rows": ("float32", 64, YARN, True, 16),
}


@functools.cache
def _vmfb() -> bytes:
    return compile_ir(str(_functions_module(FUNCTIONS)), Target("llvm-cpu"))


def _kernel(name: str) -> LoadedKernel:
    """FUNCTIONS[name], loaded. Call it with Python float / int scalars: numpy scalars fail ("not a
    value type")."""
    return LoadedKernel(_vmfb(), name, "local-task")


def _positions(rng: np.random.Generator, rows: int) -> np.ndarray:
    """i32 [rows] in [0, 4096), including both ends."""
    pos = rng.integers(0, 4096, size=rows).astype(np.int32)
    pos[:2] = (0, 4095)
    return pos


def _assert_within_rotation_bound(name, got, x, pos, dtype, **rope):
    """The kernel's rotation against the float64 one, element by element within
    runtime/error_model.rotation_bound (the f32 angle of each pair, the rotation, the rounding)."""
    want = reference_rope(x, pos, **rope)
    bound = rotation_bound(x, pos, dtype=dtype, exact=want, **rope)
    error = np.abs(np.asarray(got, np.float64) - want)
    assert np.all(error <= bound), f"{name}: error {np.max(error / bound):.3g} x its bound"


@pytest.mark.parametrize("case", list(F32_CASES))
def test_float32_matches_reference(case):
    rope_scaling, head_dim, theta = F32_CASES[case]
    kernel = _kernel(f"rope_f32_{case.replace('-', '_')}")
    rng = np.random.default_rng(sum(map(ord, case)))
    x = uniform(rng, (ROWS, HEADS, head_dim), "float32")
    pos = _positions(rng, ROWS)
    for run_theta, scale in ((theta, 0.5), (2.0 * theta, 2.0)):
        (got,) = kernel(x, pos, run_theta, scale)
        assert got.dtype == np.float32 and got.shape == x.shape
        # pair 0 (frequency 1, s * 1 exact) is held to the cos/sin of large angles alone: 8 u32
        _assert_within_rotation_bound(f"{case} theta={run_theta} scale={scale}", got, x, pos, "float32",
                                      rope_theta=run_theta, rope_scale=scale, rope_scaling=rope_scaling)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_matches_reference(dtype):
    kernel = _kernel(f"rope_{dtype}")
    rope_scaling = FUNCTIONS[f"rope_{dtype}"][2]
    rng = np.random.default_rng(7)
    x = uniform(rng, (ROWS, HEADS, 128), dtype)
    pos = _positions(rng, ROWS)
    (got,) = kernel(x, pos, 500000.0, 0.5)
    assert got.dtype == NUMPY_DTYPE[dtype]
    _assert_within_rotation_bound("rope", got, x, pos, dtype, rope_theta=500000.0, rope_scale=0.5,
                                  rope_scaling=rope_scaling)


def test_first_position_scalar_with_static_rows():
    """positions = first + row, on a module whose row count is static."""
    _, head_dim, _, _, rows = FUNCTIONS["rope_first_static_rows"]
    first = 3000
    kernel = _kernel("rope_first_static_rows")
    rng = np.random.default_rng(3)
    x = uniform(rng, (rows, HEADS, head_dim), "float32")
    pos = first + np.arange(rows, dtype=np.int32)
    for theta, scale in ((10000.0, 0.5), (20000.0, 2.0)):
        (got,) = kernel(x, first, theta, scale)
        _assert_within_rotation_bound("first", got, x, pos, "float32", rope_theta=theta, rope_scale=scale,
                                      rope_scaling=YARN)


def test_truncated_yarn_reference_differs_from_the_seed_form():
    """The truncated case really moves the ramp and the multiplier (so the IR test above sees it)."""
    for theta in (10000.0, 20000.0):
        seed, seed_mult = rope_pair_angles(np.ones(1), head_dim=64, rope_theta=theta, rope_scale=1.0,
                                           rope_scaling=YARN)
        hf, hf_mult = rope_pair_angles(np.ones(1), head_dim=64, rope_theta=theta, rope_scale=1.0,
                                       rope_scaling=YARN_TRUNCATED)
        assert np.max(np.abs(hf / seed - 1.0)) > 0.01 and hf_mult == 1.25 != seed_mult


def _generics(module: ir.Module) -> list[tuple[ir.Operation, list[str]]]:
    """Each linalg.generic of ``@rope`` with the op names of its body."""
    body = module.body.operations[0].regions[0].blocks[0]
    return [
        (op, [inner.operation.name for inner in op.regions[0].blocks[0].operations])
        for op in body.operations
        if op.operation.name == "linalg.generic"
    ]


def _result_types(op: ir.Operation) -> list[str]:
    return [str(r.type) for r in op.results]


def test_cos_sin_computed_once_per_row_and_pair_not_per_head():
    module = _module("float16", 128, LLAMA3)
    text = str(module)
    assert text.count("math.cos") == 1 and text.count("math.sin") == 1
    (table,) = [op for op, names in _generics(module) if "math.cos" in names and "math.sin" in names]
    assert _result_types(table) == ["tensor<?x64xf32>"] * 2  # [N, D/2]: no head axis
    (freqs,) = [op for op, names in _generics(module) if "math.exp2" in names]
    assert _result_types(freqs) == ["tensor<64xf32>"]


@pytest.mark.parametrize("rope_scaling, split", [({}, "2x64"), ({"rope_type": "gptj"}, "64x2")])
def test_rotation_is_one_generic_over_the_expanded_pairs_without_math(rope_scaling, split):
    module = _module("bfloat16", 128, rope_scaling)
    assert "tensor.expand_shape %arg0 [[0], [1], [2, 3]]" in str(module)
    rotations = [(op, names) for op, names in _generics(module)
                 if _result_types(op) == [f"tensor<?x{HEADS}x{split}xbf16>"]]
    assert len(rotations) == 1
    names = rotations[0][1]
    assert "linalg.index" in names and "arith.truncf" in names
    assert not [n for n in names if n.startswith("math.")]


@pytest.mark.parametrize("bad", [{"rope_type": "dynamic"}, {"rope_type": ""}])
def test_unknown_rope_type_is_rejected(bad):
    with pytest.raises(ValueError, match="rope_type"):
        _module("float32", 64, bad)


def test_odd_head_dim_is_rejected():
    with pytest.raises(ValueError, match="even"):
        _module("float32", 63, {})
