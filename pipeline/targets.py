"""Compilation targets: which IREE flags build a vmfb for a backend.

Each backend has its lowering (``DEFAULT_LOWERING``). ``llvm-cpu`` defaults to the host CPU (``--iree-llvmcpu-target-cpu=host`` resolves to a named CPU
with all its features); pass ``cpu="x86-64-v3"`` or another LLVM CPU name for an artifact that
runs on other machines. ``cuda`` defaults to ``sm_80``: IREE 3.13 has no sm_90/sm_100 target
("missing GPU target"), and Hopper runs sm_80 PTX through the driver's JIT.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BACKENDS = ("llvm-cpu", "cuda")
RUNTIME_DRIVER = {"llvm-cpu": "local-task", "cuda": "cuda"}
LOWERINGS = ("linalg", "fused")
#: The one place the lowering is chosen per target. llvm-cpu: the explicit linalg online softmax
#: (IREE's fused attention op measured ~30x slower there, bench/report.py). CUDA: the KV loop
#: inside one online_attention dispatch per query band, f16/bf16 operands on the tensor cores
#: (mlir/fused_kernels.py). ``Target(backend, lowering=...)`` overrides it, e.g. to check the
#: fused lowering's numerics on llvm-cpu.
DEFAULT_LOWERING = {"llvm-cpu": "linalg", "cuda": "fused"}
#: CUDA architectures IREE 3.13 compiles for (sm_90, sm_90a and sm_100 fail with "missing GPU
#: target"); Hopper runs sm_80 PTX through the driver's JIT.
CUDA_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_120")


@dataclass(frozen=True)
class Target:
    """A backend plus its architecture: ``Target("llvm-cpu", "host")``, ``Target("cuda", "sm_80")``."""

    backend: str
    arch: str = ""
    extra_flags: tuple[str, ...] = field(default=())
    lowering: str = ""

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if not self.arch:
            object.__setattr__(self, "arch", "host" if self.backend == "llvm-cpu" else "sm_80")
        if self.backend == "cuda" and self.arch not in CUDA_ARCHS:
            raise ValueError(f"cuda arch {self.arch!r}: IREE 3.13 compiles CUDA for {', '.join(CUDA_ARCHS)} only; "
                             "Hopper (H100, H200) and newer run sm_80 PTX through the driver JIT, so use sm_80")
        if not self.lowering:
            object.__setattr__(self, "lowering", DEFAULT_LOWERING[self.backend])
        if self.lowering not in LOWERINGS:
            raise ValueError(f"lowering must be one of {LOWERINGS}, got {self.lowering!r}")

    @property
    def driver(self) -> str:
        """The IREE runtime driver that runs this target's artifacts."""
        return RUNTIME_DRIVER[self.backend]

    @property
    def tag(self) -> str:
        """Filename-safe id, e.g. ``llvm-cpu-host``, ``cuda-sm_80`` or, for a lowering other than
        the backend's own, ``llvm-cpu-host-fused``."""
        suffix = "" if self.lowering == DEFAULT_LOWERING[self.backend] else f"-{self.lowering}"
        return f"{self.backend}-{self.arch}{suffix}"

    def flags(self) -> list[str]:
        if self.backend == "llvm-cpu":
            base = [
                "--iree-hal-target-device=local",
                "--iree-hal-local-target-device-backends=llvm-cpu",
                f"--iree-llvmcpu-target-cpu={self.arch}",
            ]
        else:
            base = ["--iree-hal-target-device=cuda", f"--iree-cuda-target={self.arch}"]
        return [*base, "--iree-opt-level=O3", *self.extra_flags]


def target_for(backend: str | Target) -> Target:
    """A Target from a backend name (defaults for its arch) or an existing Target."""
    return backend if isinstance(backend, Target) else Target(backend)
