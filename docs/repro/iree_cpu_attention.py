"""IREE 3.13's llvm-cpu code for ``iree_linalg_ext.attention`` is wrong when the query/key head dim
is above 128 (docs/iree-cpu-attention-bug.md). One op, float32, 64 queries x 64 keys, no mask:

    .venv/bin/python docs/repro/iree_cpu_attention.py            # d_qk, d_v = 128/128, 160/160, ...
    .venv/bin/python docs/repro/iree_cpu_attention.py 160 160    # one pair; keeps attention.mlir

Writes ``attention.mlir``, compiles it with ``iree-compile`` for llvm-cpu (host), runs it with
``iree-run-module`` on ``local-task`` and prints the largest difference from a float64 numpy
attention of the same inputs (the op's result at d_qk <= 128 matches it to 1e-7).
"""

import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

TOOLS = Path(sys.executable).parent  # the venv's iree-compile and iree-run-module
ROWS, SCALE = 64, 0.125
MLIR = """func.func @attention(%q: tensor<1x{n}x{dqk}xf32>, %k: tensor<1x{n}x{dqk}xf32>, %v: tensor<1x{n}x{dv}xf32>)
    -> tensor<1x{n}x{dv}xf32> {{
  %scale = arith.constant {scale} : f32
  %empty = tensor.empty() : tensor<1x{n}x{dv}xf32>
  %out = iree_linalg_ext.attention <indexing_maps = [affine_map<(d0, d1, d2, d3, d4) -> (d0, d1, d2)>,
                                                     affine_map<(d0, d1, d2, d3, d4) -> (d0, d3, d2)>,
                                                     affine_map<(d0, d1, d2, d3, d4) -> (d0, d3, d4)>,
                                                     affine_map<(d0, d1, d2, d3, d4) -> ()>,
                                                     affine_map<(d0, d1, d2, d3, d4) -> (d0, d1, d4)>]>
      ins(%q, %k, %v, %scale : tensor<1x{n}x{dqk}xf32>, tensor<1x{n}x{dqk}xf32>, tensor<1x{n}x{dv}xf32>, f32)
      outs(%empty : tensor<1x{n}x{dv}xf32>) {{
    ^bb0(%score: f32):
      iree_linalg_ext.yield %score : f32
  }} -> tensor<1x{n}x{dv}xf32>
  return %out : tensor<1x{n}x{dv}xf32>
}}
"""


def run(d_qk: int, d_v: int, folder: Path) -> float:
    """Max |IREE - float64 reference| of one attention op with these head dims."""
    (folder / "attention.mlir").write_text(MLIR.format(n=ROWS, dqk=d_qk, dv=d_v, scale=SCALE))
    subprocess.run([str(TOOLS / "iree-compile"), "attention.mlir", "--iree-hal-target-device=local",
                    "--iree-hal-local-target-device-backends=llvm-cpu", "--iree-llvmcpu-target-cpu=host",
                    "-o", "attention.vmfb"], cwd=folder, check=True)
    rng = np.random.default_rng(0)
    q, k = (rng.uniform(-1, 1, (1, ROWS, d_qk)).astype(np.float32) for _ in range(2))
    v = rng.uniform(-1, 1, (1, ROWS, d_v)).astype(np.float32)
    for name, array in zip("qkv", (q, k, v)):
        np.save(folder / f"{name}.npy", array)
    subprocess.run([str(TOOLS / "iree-run-module"), "--module=attention.vmfb", "--device=local-task",
                    "--function=attention", "--input=@q.npy", "--input=@k.npy", "--input=@v.npy",
                    "--output=@out.npy"], cwd=folder, check=True, capture_output=True)
    got = np.load(folder / "out.npy")[0].astype(np.float64)
    scores = SCALE * q[0].astype(np.float64) @ k[0].T.astype(np.float64)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ v[0].astype(np.float64)
    return float(np.abs(got - want).max())


def main(argv) -> None:
    pairs = [tuple(map(int, argv))] if argv else [(128, 128), (160, 160), (160, 128), (128, 160), (136, 64),
                                                  (256, 256)]
    for d_qk, d_v in pairs:
        folder = Path.cwd() if argv else Path(tempfile.mkdtemp())
        error = run(d_qk, d_v, folder)
        print(f"d_qk {d_qk:>3} d_v {d_v:>3}: max |IREE - reference| = {error:.2e}"
              f"{'  WRONG' if error > 1e-5 else ''}")


if __name__ == "__main__":
    main(sys.argv[1:])
