"""What a compiled vmfb does on the host, read from its VM disassembly (no device needed).

    calls = host_blocking_calls_in_loops(vmfb_path)   # {"hal.device.queue.alloca": 0, ...}
    count = tensor_core_instructions(vmfb_bytes)       # mma.sync in the embedded PTX

IREE 3.13's CUDA HAL blocks the host inside ``queue.alloca`` and ``queue.dealloca`` and, of course,
in ``fence.await``; any of them inside a loop of the host program drains the GPU on every trip.
A loop is a branch back to the same or an earlier block of a function; its body is every block
from the branch target to the branch.
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


def _functions(text: str) -> list[list[tuple[int, list[str]]]]:
    """Per ``vm.func``: its blocks in order as (block number, lines)."""
    functions, blocks = [], None
    for line in text.splitlines():
        if line.lstrip().startswith("vm.func"):
            blocks = []
            functions.append(blocks)
            continue
        match = _BLOCK.match(line)
        if match and blocks is not None:
            blocks.append((int(match.group(1)), []))
        elif blocks:
            blocks[-1][1].append(line)
    return functions


def loop_body_lines(text: str) -> list[str]:
    """The lines of every block that lies inside a loop of a function of the disassembly."""
    found = []
    for blocks in _functions(text):
        position = {number: i for i, (number, _) in enumerate(blocks)}
        inside = set()
        for i, (_, lines) in enumerate(blocks):
            for line in lines:
                if _BRANCH.search(line):
                    for target in re.findall(r"\^bb(\d+)", line):
                        start = position.get(int(target))
                        if start is not None and start <= i:
                            inside.update(range(start, i + 1))
        found.extend(line for i in sorted(inside) for line in blocks[i][1])
    return found


def host_blocking_calls_in_loops(vmfb_path: str | Path) -> dict[str, int]:
    """How many calls of each HOST_BLOCKING import sit inside loops of the host program."""
    lines = loop_body_lines(disassembly(vmfb_path))
    return {name: sum(1 for line in lines if re.search(rf"@{re.escape(name)}\b", line)) for name in HOST_BLOCKING}


def tensor_core_instructions(vmfb: bytes) -> int:
    """``mma.sync`` instructions in the PTX a CUDA vmfb embeds as text (0: no tensor cores)."""
    return vmfb.count(b"mma.sync")
