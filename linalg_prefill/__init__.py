"""linalg-prefill: prefill attention kernels written as MLIR linalg and compiled by IREE.

Subpackages:
    linalg_prefill.mlir      IR builders (one online-softmax emitter, one spec per variant)
    linalg_prefill.pipeline  IREE compilation and the on-disk artifact cache
    linalg_prefill.runtime   loading modules, devices, input checks, the float64 reference
"""
