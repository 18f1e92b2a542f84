"""IREE compilation, targets and the on-disk artifact cache."""

from .cache import ArtifactCache, default_cache
from .compiler import COMPILER_VERSION, CompileError, compile_ir, compile_spec, compile_specs
from .targets import BACKENDS, Target, target_for

__all__ = ["ArtifactCache", "default_cache", "COMPILER_VERSION", "CompileError", "compile_spec",
           "compile_specs",
           "compile_ir", "BACKENDS", "Target", "target_for"]
