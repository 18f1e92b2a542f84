"""linalg-prefill: prefill attention kernels written as MLIR linalg and compiled by IREE.

Layers, each importing only the ones above it (tests/test_layering.py):
    linalg_prefill.mlir      IR builders (one online-softmax emitter, one spec per variant)
    linalg_prefill.pipeline  IREE compilation, AOT artifacts and the on-disk artifact cache
    linalg_prefill.runtime   loading modules, devices, input checks, plan/run, the float64 reference
    linalg_prefill.cli, .demo, .bench   the ``linalg-prefill`` command and its demo and bench

Environment:
    LINALG_PREFILL_LOG    log level of the ``linalg_prefill`` logger printed to stderr (debug, info,
                          warning, error); unset: nothing is configured (the application decides);
                          another value is ignored with a warning
"""

import logging as _logging
import os as _os
from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("linalg-prefill")
except _metadata.PackageNotFoundError:  # a source tree used without installing it
    __version__ = "0+unknown"


def _configure_logging() -> None:
    level = _os.environ.get("LINALG_PREFILL_LOG", "").strip().upper()
    if not level:
        return
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        import warnings

        warnings.warn(f"LINALG_PREFILL_LOG: expected debug, info, warning or error, got {level.lower()!r}; "
                      "ignored", stacklevel=2)
        return
    logger = _logging.getLogger("linalg_prefill")
    handler = _logging.StreamHandler()
    handler.setFormatter(_logging.Formatter("linalg_prefill %(levelname)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False  # printed once, here, even when the application configured the root logger


_configure_logging()
