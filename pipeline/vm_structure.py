"""What a compiled vmfb does on the host, read from its VM disassembly (no device needed).

    calls = host_blocking_calls_in_loops(vmfb_path)   # {"hal.device.queue.alloca": 0, ...}
    count = tensor_core_instructions(vmfb_bytes)       # mma.sync in the embedded PTX
    missing_tensor_cores(spec, vmfb_path)             # a structure check: a problem, or None
    kernels = amdgpu_kernels(amdgpu_isa(vmfb_path))    # ROCm: per kernel v_mfma, VGPRs, spills
    kernels = ptxas_kernels(ptx_modules(vmfb_bytes))   # CUDA: per kernel registers and spills (ptxas)

A ROCm vmfb embeds machine code, not assembly: its ISA is the ``*.rocmasm`` that iree-compile
writes with ``--iree-hal-dump-executable-intermediates-to=DIR``; the ROCm checks read it from
:func:`isa_folder` beside the vmfb (``isa_dump_flag`` gives the flag that writes it there).

IREE 3.13's CUDA HAL blocks the host inside ``queue.alloca`` and ``queue.dealloca`` and, of course,
in ``fence.await``; any of them inside a loop of the host program drains the GPU on every trip.
Loops are the natural loops of each function's control-flow graph (a branch to a block that
dominates it closes one), so the error paths IREE places between a loop's blocks do not count.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..mlir.dtypes import ir_dtype

HOST_BLOCKING = ("hal.device.queue.alloca", "hal.device.queue.dealloca", "hal.fence.await")
_BLOCK = re.compile(r"^\s*\^bb(\d+)(\(.*\))?:\s*$")
_BRANCH = re.compile(r"\bvm\.(br|cond_br)\b")


def disassembly(vmfb_path: str | Path) -> str:
    """``iree-dump-module --output=disassembly`` of the file (the tool ships with the runtime)."""
    tool = Path(sys.executable).with_name("iree-dump-module")
    command = [str(tool) if tool.exists() else "iree-dump-module", "--output=disassembly", str(vmfb_path)]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


def _functions(text: str) -> list[tuple[str, list[tuple[int, list[str]]]]]:
    """Per ``vm.func``: its name and its blocks in order as (block number, lines)."""
    functions, blocks = [], None
    for line in text.splitlines():
        if line.lstrip().startswith("vm.func"):
            blocks = []
            functions.append((re.search(r"@([\w$.]+)", line).group(1), blocks))
            continue
        match = _BLOCK.match(line)
        if match and blocks is not None:
            blocks.append((int(match.group(1)), []))
        elif blocks:
            blocks[-1][1].append(line)
    return functions


def _successors(lines: list[str]) -> list[int]:
    """Blocks a block branches to: vm.br / vm.cond_br targets and a yieldable call's continuation."""
    found = []
    for line in lines:
        if _BRANCH.search(line) or "-> ^bb" in line:
            found.extend(int(t) for t in re.findall(r"\^bb(\d+)", line))
    return found


def _natural_loops(blocks: list[tuple[int, list[str]]]) -> list[tuple[int, set[int]]]:
    """(header, body) of every natural loop of one function: for each back edge u -> h (h
    dominates u), h and every block that reaches u without passing through h."""
    names = [number for number, _ in blocks]
    succ = {number: [t for t in _successors(lines) if t in names] for number, lines in blocks}
    pred = {number: [] for number in names}
    for number, targets in succ.items():
        for t in targets:
            pred[t].append(number)
    entry = names[0]
    dom = {number: set(names) for number in names}
    dom[entry] = {entry}
    changed = True
    while changed:
        changed = False
        for number in names[1:]:
            preds = [dom[p] for p in pred[number]]
            new = ({number} | set.intersection(*preds)) if preds else {number}
            if new != dom[number]:
                dom[number], changed = new, True
    loops = {}
    for u in names:
        for h in succ[u]:
            if h in dom[u]:
                body, stack = {h, u}, [u]
                while stack:
                    for p in pred[stack.pop()]:
                        if p not in body:
                            body.add(p)
                            stack.append(p)
                loops.setdefault(h, set()).update(body)
    return list(loops.items())


def loop_bodies(text: str, *, innermost: bool = False, function: str | None = None) -> list[list[str]]:
    """The lines of each natural loop of the disassembly's functions (``innermost``: only loops
    that contain no other loop; ``function``: only that function's, e.g. a kernel's entry point
    without the module initializer's device-enumeration loop)."""
    found = []
    for name, blocks in _functions(text):
        if function is not None and name != function:
            continue
        lines = dict(blocks)
        loops = _natural_loops(blocks)
        for header, body in loops:
            if innermost and any(other != header and other in body for other, _ in loops):
                continue
            found.append([line for number in sorted(body) for line in lines[number]])
    return found


def dispatch_sites(text: str, function: str) -> tuple[int, int]:
    """(dispatches, those inside a loop) of ``function`` in a disassembly: its
    ``hal.command_buffer.dispatch`` calls. (1, 0): one dispatch a call, whatever the shapes (the
    mma lowering's dense kernels); a band loop's dispatches count once each."""
    call = re.compile(r"@hal\.command_buffer\.dispatch\b")
    in_loops = {line for body in loop_bodies(text, function=function) for line in body if call.search(line)}
    total = sum(1 for name, blocks in _functions(text) if name == function
                for _, lines in blocks for line in lines if call.search(line))
    return total, len(in_loops)


def host_blocking_calls_in_loops(vmfb_path: str | Path, *, innermost: bool = False) -> dict[str, int]:
    """How many calls of each HOST_BLOCKING import sit inside loops of the host program
    (``innermost``: inside loops that contain no other loop, e.g. a kernel's query-band loops)."""
    lines = {line for body in loop_bodies(disassembly(vmfb_path), innermost=innermost) for line in body}
    return {name: sum(1 for line in lines if re.search(rf"@{re.escape(name)}\b", line)) for name in HOST_BLOCKING}


def tensor_core_instructions(vmfb: bytes) -> int:
    """``mma.sync`` instructions in the PTX a CUDA vmfb embeds as text (0: no tensor cores)."""
    return vmfb.count(b"mma.sync")


_PTX_START = b"//\n// Generated by LLVM NVPTX Back-End"
#: The GPU whose registers the checks count: an H200's (the vmfb's sm_80 PTX is compiled for it
#: by the driver when it loads).
PTXAS_ARCH = "sm_90"


def ptx_modules(vmfb: bytes) -> list[str]:
    """The PTX modules a CUDA vmfb embeds (each a NUL-terminated text, one per executable)."""
    starts = [match.start() for match in re.finditer(re.escape(_PTX_START), vmfb)]
    return [vmfb[start:vmfb.index(b"\0", start)].decode() for start in starts]


@dataclass(frozen=True)
class PtxasKernel:
    """One kernel as ``ptxas -v`` compiles it: its name, registers a thread, and the bytes a
    thread spills (stores and loads of local memory)."""

    name: str
    registers: int
    spill_bytes: int


def ptxas_tool() -> str | None:
    """The CUDA toolkit's ptxas: on the PATH, or in /usr/local/cuda/bin; None without one."""
    return shutil.which("ptxas") or next((str(p) for p in Path("/usr/local").glob("cuda*/bin/ptxas")), None)


def ptxas_kernels(modules: list[str], arch: str = PTXAS_ARCH) -> list[PtxasKernel]:
    """Every kernel of the PTX ``modules`` compiled by ``ptxas -v`` for ``arch`` (FileNotFoundError
    without ptxas)."""
    tool = ptxas_tool()
    if tool is None:
        raise FileNotFoundError("no ptxas (the CUDA toolkit's) on the PATH or in /usr/local/cuda*/bin")
    kernels = []
    with tempfile.TemporaryDirectory() as folder:
        for i, text in enumerate(modules):
            source = Path(folder) / f"module{i}.ptx"
            source.write_text(text)
            report = subprocess.run([tool, f"-arch={arch}", "-v", str(source), "-o", str(source.with_suffix(".cubin"))],
                                    capture_output=True, text=True, check=True).stderr
            for block in report.split("Compiling entry function")[1:]:
                spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", block)
                kernels.append(PtxasKernel(block.split("'")[1], int(re.search(r"Used (\d+) registers", block).group(1)),
                                           int(spills.group(1)) + int(spills.group(2))))
    return kernels


def isa_folder(vmfb_path: str | Path) -> Path:
    """Where the ROCm checks read the ISA of the vmfb at ``vmfb_path``: ``kernel.vmfb`` ->
    ``kernel.isa/``."""
    return Path(vmfb_path).with_suffix(".isa")


def isa_dump_flag(vmfb_path: str | Path) -> str:
    """The iree-compile flag that writes the ISA of the vmfb to be written at ``vmfb_path`` into
    :func:`isa_folder`."""
    return f"--iree-hal-dump-executable-intermediates-to={isa_folder(vmfb_path)}"


def amdgpu_isa(vmfb_path: str | Path) -> str:
    """The AMDGPU assembly of every executable of the vmfb (its ``*.rocmasm`` files, joined);
    FileNotFoundError naming the flag when there are none."""
    files = sorted(isa_folder(vmfb_path).glob("*.rocmasm"))
    if not files:
        raise FileNotFoundError(f"no *.rocmasm in {isa_folder(vmfb_path)}: compile with {isa_dump_flag(vmfb_path)}")
    return "\n".join(path.read_text() for path in files)


@dataclass(frozen=True)
class AmdgpuKernel:
    """One kernel of an AMDGPU ISA: its name, ``v_mfma`` instructions, VGPRs and AGPRs used,
    and the registers it spills to scratch (VGPR and SGPR)."""

    name: str
    mfma: int
    vgprs: int
    agprs: int
    vgpr_spills: int
    sgpr_spills: int


_MFMA = re.compile(r"^\s*v_mfma\w*", re.M)


def amdgpu_kernels(isa: str) -> list[AmdgpuKernel]:
    """Every kernel of the assembly :func:`amdgpu_isa` gives, from each function's body
    (``v_mfma`` lines, between ``name:`` and ``.Lfunc_end``) and the ``amdhsa.kernels``
    metadata (registers, spills)."""
    bodies = {match.group(1): len(_MFMA.findall(match.group(2)))
              for match in re.finditer(r"^(\w+):\s*\n(.*?)^\.Lfunc_end\d+:", isa, re.M | re.S)}
    kernels = []
    for block in re.split(r"^\s*- \.agpr_count:", isa, flags=re.M)[1:]:
        def field(name: str) -> int:
            return int(re.search(rf"^\s*\.{name}:\s*(\d+)", block, re.M).group(1))

        name = re.search(r"^\s*\.name:\s*(\S+)", block, re.M).group(1)
        kernels.append(AmdgpuKernel(name, bodies.get(name, 0), field("vgpr_count"),
                                    int(block.split("\n", 1)[0]), field("vgpr_spill_count"),
                                    field("sgpr_spill_count")))
    return kernels


# Structure checks: ``check(spec, vmfb_path) -> problem or None``; a backend record lists the ones
# its artifacts must pass (pipeline/targets.py: Backend.structure_checks).


def missing_tensor_cores(spec, vmfb_path: str | Path) -> str | None:
    """f16/bf16 operands must run on tensor cores (f32 has none on IREE 3.13's CUDA target: its
    dtype record says so, mlir/dtypes.py)."""
    if not ir_dtype(spec.dtype).matrix_units or tensor_core_instructions(Path(vmfb_path).read_bytes()):
        return None
    return f"{spec.name}: no mma.sync in the PTX, so its {spec.dtype} operands miss the tensor cores"


def missing_mfma(spec, vmfb_path: str | Path) -> str | None:
    """f16/bf16 operands must run on the matrix cores (``v_mfma`` in the ISA :func:`amdgpu_isa`
    reads); f32 operands are free not to."""
    if not ir_dtype(spec.dtype).matrix_units:
        return None
    try:
        count = sum(kernel.mfma for kernel in amdgpu_kernels(amdgpu_isa(vmfb_path)))
    except FileNotFoundError as err:
        return f"{spec.name}: {err}"
    return None if count else f"{spec.name}: no v_mfma in the ISA, so its {spec.dtype} operands miss the matrix cores"


def spill_limit(spec) -> int:
    """The spill bytes a thread of any kernel of ``spec``'s CUDA artifact may have (ptxas for
    :data:`PTXAS_ARCH`): 64 up to head dims of 128, 512 above (the tilings of pipeline/tuning.py,
    measured: d 64 and 128 0-12, d 72-96 0-48, 160-256 and MLA's 576/512 48-512; a tiling that
    does not fit, as MLA's 64 rows unstaged, spilled 16.9 KB)."""
    return 64 if max(spec.d_qk, spec.d_v) <= 128 else 512


def spilling_kernels(spec, vmfb_path: str | Path) -> str | None:
    """No kernel of the artifact spills more than :func:`spill_limit` bytes a thread once ptxas
    compiles its PTX for :data:`PTXAS_ARCH`."""
    kernels = ptxas_kernels(ptx_modules(Path(vmfb_path).read_bytes()))
    limit = spill_limit(spec)
    over = {k.name: (k.registers, k.spill_bytes) for k in kernels if k.spill_bytes > limit}
    return None if not over else f"{spec.name}: kernels spilling more than {limit} bytes (registers, bytes): {over}"


def host_stalls_in_loops(spec, vmfb_path: str | Path) -> str | None:
    """No host-blocking call inside a loop of the host program (each would drain the GPU)."""
    stalls = {name: count for name, count in host_blocking_calls_in_loops(vmfb_path).items() if count}
    return None if not stalls else f"{spec.name}: host-blocking calls inside host-program loops: {stalls}"
