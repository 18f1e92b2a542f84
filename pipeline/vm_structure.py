"""What a compiled vmfb does on the host, read from its VM disassembly (no device needed).

    calls = host_blocking_calls_in_loops(vmfb_path)   # {"hal.device.queue.alloca": 0, ...}
    count = tensor_core_instructions(vmfb_bytes)       # mma.sync in the embedded PTX
    missing_tensor_cores(spec, vmfb_path)             # a structure check: a problem, or None

IREE 3.13's CUDA HAL blocks the host inside ``queue.alloca`` and ``queue.dealloca`` and, of course,
in ``fence.await``; any of them inside a loop of the host program drains the GPU on every trip.
Loops are the natural loops of each function's control-flow graph (a branch to a block that
dominates it closes one), so the error paths IREE places between a loop's blocks do not count.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

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


def host_blocking_calls_in_loops(vmfb_path: str | Path, *, innermost: bool = False) -> dict[str, int]:
    """How many calls of each HOST_BLOCKING import sit inside loops of the host program
    (``innermost``: inside loops that contain no other loop, e.g. a kernel's query-band loops)."""
    lines = {line for body in loop_bodies(disassembly(vmfb_path), innermost=innermost) for line in body}
    return {name: sum(1 for line in lines if re.search(rf"@{re.escape(name)}\b", line)) for name in HOST_BLOCKING}


def tensor_core_instructions(vmfb: bytes) -> int:
    """``mma.sync`` instructions in the PTX a CUDA vmfb embeds as text (0: no tensor cores)."""
    return vmfb.count(b"mma.sync")


# Structure checks: ``check(spec, vmfb_path) -> problem or None``; a backend record lists the ones
# its artifacts must pass (pipeline/targets.py: Backend.structure_checks).


def missing_tensor_cores(spec, vmfb_path: str | Path) -> str | None:
    """f16/bf16 operands must run on tensor cores (f32 has none on IREE 3.13's CUDA target)."""
    if spec.dtype == "float32" or tensor_core_instructions(Path(vmfb_path).read_bytes()):
        return None
    return f"{spec.name}: no mma.sync in the PTX, so its {spec.dtype} operands miss the tensor cores"


def host_stalls_in_loops(spec, vmfb_path: str | Path) -> str | None:
    """No host-blocking call inside a loop of the host program (each would drain the GPU)."""
    stalls = {name: count for name, count in host_blocking_calls_in_loops(vmfb_path).items() if count}
    return None if not stalls else f"{spec.name}: host-blocking calls inside host-program loops: {stalls}"
