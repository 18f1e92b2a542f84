"""Compilation targets: one :class:`Backend` record per backend, and a :class:`Target` of one.

    Target("llvm-cpu")                      # the host CPU, the backend's own lowering (linalg)
    Target("cuda", "sm_86")                 # an arch from BACKENDS["cuda"].archs
    Target("llvm-cpu", lowering="fused")    # the fused lowering compiled for the CPU

Everything that differs between backends lives in its record in ``BACKENDS``: the IREE flags, the
HAL driver, the archs, the lowering, the row chunk and tiling hooks the IR gets
(pipeline/tuning.py) and the structure checks its artifacts must pass (pipeline/vm_structure.py).
A new backend is one record; the records are checked when this module is imported. ``llvm-cpu``
defaults to the host CPU (``--iree-llvmcpu-target-cpu=host`` resolves to a named CPU with all its
features); pass ``"x86-64-v3"`` or another LLVM CPU name for an artifact that runs on other
machines. ``cuda`` defaults to ``sm_80``: IREE 3.13 has no sm_90/sm_100 target ("missing GPU
target"), and Hopper runs sm_80 PTX through the driver's JIT. ``rocm`` defaults to ``gfx942``
(MI300) and takes ``gfx950`` and ``gfx90a``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..mlir import mma_unsupported
from ..mlir.decode import DECODE_PASSES, DecodePasses, DecodeSpec
from ..mlir.mask_rules import mask_rule
from . import cpu_tiles, tuning, vm_structure

#: The lowerings every spec builds in.
LOWERINGS = ("linalg", "fused")
#: Lowerings that build some specs on one backend: a backend's ``spec_lowering`` picks one where it
#: can (llvm-cpu: the hand-written x86 dispatches, mlir/x86_attention.py); a Target may ask for it
#: (cuda: "mma", the hand-written mma.sync dispatches of mlir/cuda_attention.py, the fused
#: lowering for the specs they do not build). The backend each runs on: :data:`LOWERING_BACKENDS`.
PARTIAL_LOWERINGS = ("x86", "mma")
LOWERING_BACKENDS = {"x86": "llvm-cpu", "mma": "cuda"}


@dataclass(frozen=True, kw_only=True)
class Backend:
    """What a backend needs, every field required (checked at import: :func:`check_backend`).

    ``archs``: the arch names it compiles for, or None for any name its compiler takes (LLVM CPU
    names); ``arch_note``: added to the error for an arch not in ``archs`` ("" for none).
    ``driver``: the IREE runtime driver of its artifacts. ``flags(arch)``: the iree-compile
    flags. ``lowering``: the kernels' default lowering (``Target(..., lowering=)`` overrides it).
    ``spec_lowering(arch, spec, lowering)``: the lowering a spec gets where the target asks for
    ``lowering`` (the CPU's features may pick a faster one: llvm-cpu's AMX kernels).
    ``row_chunk``: the widest row the linalg lowering's online softmax reduces in one op
    (``build_module(row_chunk=)``; None: whole rows). ``score_tiles(arch, dtype)``: the layout
    of its KV-step tiles in the linalg lowering (mlir/score_tiles.py, pipeline/cpu_tiles.py),
    ``pass_vectors(arch)`` its serving passes' vectors there (mlir/decode.py).
    ``tune_contraction(op)`` and ``tune_attention(op, loops)``: the attributes a marked
    contraction or online_attention op gets (pipeline/tuning.py), ``tune_generic(role, sizes, unit_loops)``
    those of a generic marked with a role (mlir.ir.mark_tiling: the serving passes' and the query
    packing's), None for the compiler's own choice; ``tune_dispatch(threads)`` those of a
    hand-written GPU dispatch's function (mlir.ir.dispatch_mark), None where the backend takes none. ``output_storage``: the kernels' functions
    take storage for their results (mlir/abi.py: with_output_storage), which the runtime passes
    (the CPU drivers, whose results are host memory the runtime allocates itself; a device with
    memory of its own keeps IREE's result buffers). ``structure_checks``: ``check(spec, vmfb_path) -> problem or None`` each artifact
    must pass (pipeline/vm_structure.py)."""

    name: str
    driver: str
    default_arch: str
    archs: tuple[str, ...] | None
    arch_note: str
    flags: Callable[[str], list[str]]
    lowering: str
    spec_lowering: Callable[[str, object, str], str]
    row_chunk: int | None
    score_tiles: Callable[[str, str], object]
    pass_vectors: Callable[[str], object]
    tune_contraction: Callable
    tune_attention: Callable
    tune_generic: Callable
    tune_dispatch: Callable
    output_storage: bool
    structure_checks: tuple[Callable, ...]

    @property
    def on_host(self) -> bool:
        """Runs on the host CPU (a ``local-*`` driver): a device always exists."""
        return self.driver.startswith("local-")


def check_backend(key: str, record: Backend) -> None:
    """Raises TypeError naming the first field of ``record`` that is missing or inconsistent."""
    def bad(field_name: str, why: str):
        return TypeError(f"BACKENDS[{key!r}].{field_name}: {why}")

    for name in ("name", "driver", "default_arch"):
        if not isinstance(getattr(record, name), str) or not getattr(record, name):
            raise bad(name, "must be a non-empty string")
    if record.name != key:
        raise bad("name", f"{record.name!r} differs from its key")
    if record.archs is not None and record.default_arch not in record.archs:
        raise bad("default_arch", f"{record.default_arch!r} is not in archs {record.archs}")
    if not isinstance(record.arch_note, str):
        raise bad("arch_note", "must be a string")
    if record.lowering not in LOWERINGS:
        raise bad("lowering", f"must be one of {LOWERINGS}, got {record.lowering!r}")
    if record.row_chunk is not None and (not isinstance(record.row_chunk, int) or record.row_chunk < 1):
        raise bad("row_chunk", "must be None or a positive int")
    for name in ("flags", "spec_lowering", "score_tiles", "tune_contraction", "tune_attention", "tune_generic",
                 "tune_dispatch"):
        if not callable(getattr(record, name)):
            raise bad(name, "must be callable")
    if not isinstance(record.output_storage, bool) or (record.output_storage and not record.on_host):
        raise bad("output_storage", "must be a bool, and True only on a host driver (its storage is host memory)")
    if not isinstance(record.structure_checks, tuple) or not all(map(callable, record.structure_checks)):
        raise bad("structure_checks", "must be a tuple of callables")
    if not all(isinstance(flag, str) for flag in record.flags(record.default_arch)):
        raise bad("flags", "must return a list of strings")


#: The flag that sets the address alignment an artifact's executables assume of their buffers.
ALIGNMENT_FLAG = "--iree-stream-resource-min-offset-alignment="
#: What IREE assumes without the flag: its executables load inputs with aligned vector moves.
DEFAULT_ALIGNMENT = 64
#: The CPU artifacts' input alignment: numpy's own (16 bytes), so that the runtime can hand a
#: caller's arrays to the kernels in place (runtime/module.py: in_place). With IREE's default of
#: 64 the executables use aligned loads (vmovaps), which fault on a numpy array's address.
CPU_INPUT_ALIGNMENT = 16


def input_alignment(flags) -> int:
    """The byte alignment an artifact compiled with ``flags`` needs of its input buffers."""
    values = [int(flag[len(ALIGNMENT_FLAG):]) for flag in flags if flag.startswith(ALIGNMENT_FLAG)]
    return values[-1] if values else DEFAULT_ALIGNMENT


def _cpu_flags(arch: str) -> list[str]:
    # O3 turns named contractions into generics; the packed tiles' batch_mmt4d must stay one to
    # get IREE's mmt4d code (14x slower as a generic: docs/performance.md, packed tiles). LLVM's
    # loop vectorizer (off in IREE by default) takes the scalar loops of the hand-written x86
    # dispatches, such as a serving pass's row pointers (docs/performance.md, twenty-fourth session)
    return ["--iree-hal-target-device=local", "--iree-hal-local-target-device-backends=llvm-cpu",
            f"--iree-llvmcpu-target-cpu={arch}", "--iree-opt-level=O3", "--iree-opt-generalize-matmul=false",
            "--iree-llvmcpu-loop-vectorization", f"{ALIGNMENT_FLAG}{CPU_INPUT_ALIGNMENT}"]


def _cuda_flags(arch: str) -> list[str]:
    return ["--iree-hal-target-device=cuda", f"--iree-cuda-target={arch}", "--iree-opt-level=O3"]


def _rocm_flags(arch: str) -> list[str]:
    return ["--iree-hal-target-device=hip", f"--iree-rocm-target={arch}", "--iree-opt-level=O3"]


def _keep_default(*_) -> None:
    """A tuning hook that keeps the compiler's own configuration."""
    return None


def _as_asked(_arch: str, _spec, lowering: str) -> str:
    """The lowering the target asks for, whatever the spec (the GPU backends)."""
    return lowering


def _cuda_spec_lowering(_arch: str, spec, lowering: str) -> str:
    """The lowering asked for; where "mma" is asked, the fused one for the specs the mma
    lowering does not build (mlir.mma_unsupported: it builds the dense prefills in f16 and bf16).
    The record's default stays "fused" until the GPU sweep measures "mma" (docs/cuda.md)."""
    if lowering == "mma" and mma_unsupported(spec) is not None:
        return "fused"
    return lowering


BACKENDS: dict[str, Backend] = {
    # The explicit linalg online softmax (IREE's fused attention op measured ~30x slower there,
    # bench/report.py); whole-row reductions: 3 dispatches a KV step instead of 6
    # (docs/performance.md, row reductions); the measured contraction tiling.
    "llvm-cpu": Backend(
        name="llvm-cpu", driver="local-task", default_arch="host", archs=None, arch_note="",
        flags=_cpu_flags, lowering="linalg", spec_lowering=cpu_tiles.cpu_spec_lowering, row_chunk=None,
        score_tiles=cpu_tiles.cpu_score_tiles,
        pass_vectors=cpu_tiles.cpu_pass_vectors,
        tune_contraction=tuning.cpu_contraction_config, tune_attention=_keep_default,
        tune_generic=cpu_tiles.cpu_generic_tiling, tune_dispatch=_keep_default, output_storage=True,
        structure_checks=()),
    # The KV loop inside one online_attention dispatch per query band, f16/bf16 operands on the
    # tensor cores (mlir/fused_kernels.py, docs/cuda.md). IREE 3.13 fails to distribute a
    # 256-column row reduction (the linalg lowering's row_chunk); sm_90, sm_90a and sm_100 fail
    # with "missing GPU target".
    "cuda": Backend(
        name="cuda", driver="cuda", default_arch="sm_80", archs=("sm_80", "sm_86", "sm_89", "sm_120"),
        arch_note=("IREE 3.13 has no sm_90 or sm_100 target; Hopper (H100, H200) and newer run sm_80 PTX "
                   "through the driver JIT, so use sm_80"),
        flags=_cuda_flags, lowering="fused", spec_lowering=_cuda_spec_lowering, row_chunk=128,
        score_tiles=cpu_tiles.row_tiles,
        pass_vectors=cpu_tiles.narrow_pass_vectors,
        tune_contraction=_keep_default, tune_attention=tuning.cuda_attention_config, tune_generic=_keep_default,
        tune_dispatch=tuning.cuda_dispatch_config, output_storage=False,
        structure_checks=(vm_structure.missing_tensor_cores, vm_structure.host_stalls_in_loops)),
    # The fused lowering on AMD Instinct (gfx942: MI300; docs/rocm.md), f16/bf16 on MFMA; waves
    # of 64, so CUDA's configuration does not apply (rocm_attention_config).
    "rocm": Backend(
        name="rocm", driver="hip", default_arch="gfx942", archs=("gfx942", "gfx950", "gfx90a"),
        arch_note="", flags=_rocm_flags, lowering="fused", spec_lowering=_as_asked, row_chunk=128,
        score_tiles=cpu_tiles.row_tiles,
        pass_vectors=cpu_tiles.narrow_pass_vectors,
        tune_contraction=_keep_default, tune_attention=tuning.rocm_attention_config, tune_generic=_keep_default,
        tune_dispatch=_keep_default, output_storage=False,
        structure_checks=(vm_structure.missing_mfma, vm_structure.host_stalls_in_loops)),
}
for _key, _record in BACKENDS.items():
    check_backend(_key, _record)


def backend_record(name: str) -> Backend:
    """The record of backend ``name``; ValueError naming it and the known ones if there is none."""
    record = BACKENDS.get(name)
    if record is None:
        raise ValueError(f"unknown backend {name!r}: known backends are {', '.join(BACKENDS)}")
    return record


@dataclass(frozen=True)
class Target:
    """A backend plus its architecture: ``Target("llvm-cpu", "host")``, ``Target("cuda", "sm_80")``."""

    backend: str
    arch: str = ""
    extra_flags: tuple[str, ...] = field(default=())
    lowering: str = ""

    def __post_init__(self):
        record = backend_record(self.backend)
        if not self.arch:
            object.__setattr__(self, "arch", record.default_arch)
        if record.archs is not None and self.arch not in record.archs:
            note = f"; {record.arch_note}" if record.arch_note else ""
            raise ValueError(f"{self.backend} arch {self.arch!r}: known archs are {', '.join(record.archs)}{note}")
        if not self.lowering:
            object.__setattr__(self, "lowering", record.lowering)
        if self.lowering not in LOWERINGS + PARTIAL_LOWERINGS:
            raise ValueError(f"lowering must be one of {LOWERINGS + PARTIAL_LOWERINGS}, got {self.lowering!r}")
        runs_on = LOWERING_BACKENDS.get(self.lowering, self.backend)
        if runs_on != self.backend:
            raise ValueError(f"lowering {self.lowering!r} runs on {runs_on}, not on {self.backend}")

    @property
    def record(self) -> Backend:
        """The backend's record in ``BACKENDS``."""
        return backend_record(self.backend)

    @property
    def driver(self) -> str:
        """The IREE runtime driver that runs this target's artifacts."""
        return self.record.driver

    @property
    def tag(self) -> str:
        """Filename-safe id, e.g. ``llvm-cpu-host``, ``cuda-sm_80`` or, for a lowering other than
        the backend's own, ``llvm-cpu-host-fused``."""
        suffix = "" if self.lowering == self.record.lowering else f"-{self.lowering}"
        return f"{self.backend}-{self.arch}{suffix}"

    def flags(self) -> list[str]:
        return [*self.record.flags(self.arch), *self.extra_flags]

    def lowering_of(self, spec) -> str:
        """The lowering ``spec`` is built in here: the asked one, or where the backend's
        ``spec_lowering`` picks another for the arch (llvm-cpu: "x86" for the specs the hand-written
        kernels build, on a CPU with AMX)."""
        return self.record.spec_lowering(self.arch, spec, self.lowering)

    def decode_passes(self, spec) -> DecodePasses:
        """The serving passes of the KV-cache spec ``spec`` here (mlir/decode.py: DECODE_PASSES):
        those of the lowering its passes are built in (llvm-cpu on a CPU with AMX: "x86" for the
        passes it builds), else of this target's lowering."""
        return DECODE_PASSES[self.lowering_of(DecodeSpec(spec, 1))]

    def serving_passes(self, spec) -> list[DecodeSpec]:
        """The serving passes a KV-cache kernel of ``spec`` hands its short entries to here: the
        lowering's usable ones (runtime/decode.py); none for a dense variant, a pass, or a mask
        rule that does not run in one pass (a custom mask). The one answer to "which passes":
        what an AOT build writes (pipeline/artifacts.py), what ``open_kernel`` loads
        (runtime/kernels.py) and what the tests declare (tests/conftest.py)."""
        if isinstance(spec, DecodeSpec) or spec.kv_layout == "dense" or not mask_rule(spec).one_pass:
            return []
        return [DecodeSpec(spec, queries) for queries in self.decode_passes(spec).usable(spec)]


def target_for(backend: str | Target) -> Target:
    """A Target from a backend name (defaults for its arch) or an existing Target."""
    return backend if isinstance(backend, Target) else Target(backend)


def structure_problems(spec, target: Target, vmfb_path) -> list[str]:
    """What is wrong with the structure of ``spec``'s artifact for ``target`` (the vmfb at
    ``vmfb_path``), by its backend's structure checks; empty when it passes them all."""
    return [problem for check in target.record.structure_checks if (problem := check(spec, vmfb_path))]
