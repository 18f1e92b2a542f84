"""A reference interpreter for the PTX of the hand-written CUDA dispatches, so their numerics are
checked on the CPU (CI has no GPU): the instructions LLVM's NVPTX back end emits for
mlir/cuda_attention.py, with the warp-level ones (``ldmatrix``, ``mma.sync``, ``shfl.sync``)
per the PTX ISA's fragment layouts. It is slow (numpy over a workgroup's threads, one
instruction at a time) and meant for calls of a few hundred tokens.

Execution: one workgroup at a time, its threads in lockstep by the lowest program counter
(threads at other counters wait: divergent branches run one side, then the other, and meet
again where the code does). A warp-level instruction must find all 32 lanes of each warp that
runs it there. Memory is one flat address space: the buffers given (:meth:`Memory.add`) and the
workgroup's shared memory at :data:`SHARED_BASE`. ``cp.async`` copies land at the thread's
``cp.async.wait_group`` (not before: a missing wait reads stale data), and shared memory is
checked for races: a thread reading or overwriting bytes another thread wrote or read since the
last ``bar.sync`` raises :class:`PtxRace` (a missing barrier); a copy counts as writing from
its issue on. An instruction outside the
subset raises :class:`PtxUnsupported` naming it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from ..mlir.cuda_attention import MMA_TILING, MmaTiling

#: Where shared memory starts in the flat address space, and where buffers do.
SHARED_BASE = 1 << 40
GLOBAL_BASE = 1 << 32


class PtxUnsupported(Exception):
    """An instruction or operand outside the interpreted subset."""


class PtxRace(Exception):
    """Shared memory used by two threads with no barrier between (or a misaligned access)."""


@dataclass
class Instruction:
    opcode: str
    operands: list
    guard: str | None = None        # "%p3" or "!%p3"
    text: str = ""


@dataclass
class Kernel:
    name: str
    params: list[str]
    instructions: list[Instruction]
    labels: dict[str, int]
    threads: int


_ENTRY = re.compile(r"\.entry\s+(\w+)\s*\((.*?)\)\s*(.*?)\{(.*)\}", re.S)


def parse_kernel(ptx: str, name: str | None = None) -> Kernel:
    """The entry ``name`` (the first where None) of a PTX module."""
    ptx = re.sub(r"//[^\n]*", "", ptx)
    for match in _ENTRY.finditer(ptx):
        if name is None or match.group(1) == name:
            break
    else:
        raise PtxUnsupported(f"no entry {name!r} in the PTX")
    params = re.findall(r"\.param\s+\.\S+(?:\s+\.ptr\s+\.align\s+\d+)?\s+(\w+)", match.group(2))
    ntid = re.search(r"\.maxntid\s+(\d+)", match.group(3))
    threads = int(ntid.group(1)) if ntid else 32
    body = match.group(4)
    instructions, labels = [], {}
    for statement in body.split(";"):
        statement = statement.strip()
        while True:
            label = re.match(r"(\$?[\w$]+):\s*", statement)
            if not label:
                break
            labels[label.group(1)] = len(instructions)
            statement = statement[label.end():]
        if not statement or statement.startswith("."):
            continue
        guard = None
        if statement.startswith("@"):
            guard, statement = statement[1:].split(None, 1)
        parts = statement.split(None, 1)
        operands = _split_operands(parts[1]) if len(parts) > 1 else []
        instructions.append(Instruction(parts[0], operands, guard, statement))
    return Kernel(match.group(1), params, instructions, labels, threads)


def _split_operands(text: str) -> list:
    out, depth, current = [], 0, ""
    for char in text:
        if char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
        if char == "," and depth == 0:
            out.append(current.strip())
            current = ""
        else:
            current += char
    if current.strip():
        out.append(current.strip())
    return [[item.strip() for item in op[1:-1].split(",")] if op.startswith("{") else op for op in out]


class Memory:
    """Buffers at addresses from GLOBAL_BASE, 64 KiB aligned."""

    def __init__(self):
        self.buffers: list[tuple[int, np.ndarray]] = []
        self.next = GLOBAL_BASE

    def add(self, array: np.ndarray) -> int:
        """Places a copy of ``array``'s bytes; returns its address (read back with :meth:`read`)."""
        data = np.frombuffer(np.ascontiguousarray(array).tobytes(), np.uint8).copy()
        address = self.next
        self.buffers.append((address, data))
        self.next += (len(data) + 65535) // 65536 * 65536 + 65536   # 64 KiB apart, as aligned as IREE assumes
        return address

    def read(self, address: int, dtype, shape) -> np.ndarray:
        for base, data in self.buffers:
            if base == address:
                return data.view(dtype).reshape(shape).copy()
        raise KeyError(address)

    def _spans(self, addresses: np.ndarray, size: int):
        """(buffer, offsets, positions) for each buffer the ``addresses`` fall in; PtxRace where
        one falls outside every buffer."""
        addresses = np.asarray(addresses, np.uint64).astype(np.int64)
        placed = np.zeros(len(addresses), bool)
        for base, data in self.buffers:
            inside = (addresses >= base) & (addresses + size <= base + len(data))
            if inside.any():
                placed |= inside
                positions = np.flatnonzero(inside)
                yield data, addresses[positions] - base, positions
        if not placed.all():
            raise PtxRace(f"global access of {size} bytes at {int(addresses[~placed][0]):#x} outside every buffer")

    def read_bytes(self, addresses: np.ndarray, size: int) -> np.ndarray:
        """[len(addresses), size] bytes."""
        out = np.zeros((len(addresses), size), np.uint8)
        for data, offsets, positions in self._spans(addresses, size):
            out[positions] = data[offsets[:, None] + np.arange(size)]
        return out

    def load(self, addresses: np.ndarray, size: int) -> np.ndarray:
        raw = self.read_bytes(addresses, size)
        return (raw.astype(np.uint64) << (8 * np.arange(size, dtype=np.uint64))).sum(axis=1, dtype=np.uint64)

    def store(self, addresses: np.ndarray, values: np.ndarray, size: int) -> None:
        values = np.asarray(values, np.uint64)
        raw = ((values[:, None] >> (8 * np.arange(size, dtype=np.uint64))) & np.uint64(0xFF)).astype(np.uint8)
        for data, offsets, positions in self._spans(addresses, size):
            data[offsets[:, None] + np.arange(size)] = raw[positions]


@dataclass
class _Shared:
    """A workgroup's shared memory with the race bookkeeping (module docstring)."""

    size: int
    data: np.ndarray = field(init=False)
    writer: np.ndarray = field(init=False)
    reader: np.ndarray = field(init=False)

    def __post_init__(self):
        self.data = np.zeros(self.size, np.uint8)
        self.writer = np.full(self.size, -1, np.int64)     # thread that wrote since the barrier
        self.reader = np.full(self.size, -1, np.int64)     # thread that read since it (-2: several)

    def barrier(self) -> None:
        self.writer[:] = -1
        self.reader[:] = -1

    def _spans(self, addresses: np.ndarray, size: int) -> np.ndarray:
        """[n, size] byte offsets of accesses at ``addresses`` (PtxRace outside or misaligned)."""
        offsets = np.asarray(addresses, np.int64) - SHARED_BASE
        if np.any(offsets < 0) or np.any(offsets + size > self.size) or np.any(offsets % min(size, 16)):
            raise PtxRace(f"shared access of {size} bytes at offsets {offsets.min()}..{offsets.max()} "
                          f"(size {self.size}, alignment {min(size, 16)})")
        return offsets[:, None] + np.arange(size)

    def read(self, threads: np.ndarray, addresses: np.ndarray, size: int) -> np.ndarray:
        """[len(threads), size] bytes, thread i reading at addresses[i]."""
        span = self._spans(addresses, size)
        threads = np.asarray(threads, np.int64)[:, None]
        writers = self.writer[span]
        clash = (writers >= 0) & (writers != threads)
        if clash.any():
            i, j = np.argwhere(clash)[0]
            raise PtxRace(f"thread {threads[i, 0]} reads shared byte {span[i, j]} written by thread "
                          f"{writers[i, j]} with no barrier between")
        readers = self.reader[span]
        self.reader[span] = np.where((readers == -1) | (readers == threads), threads, -2)
        return self.data[span]

    def claim(self, threads: np.ndarray, addresses: np.ndarray, size: int) -> np.ndarray:
        """Thread i starts writing ``size`` bytes at addresses[i] (a cp.async issued: its bytes may
        land at any time until the thread's wait): a race where another thread used them since the
        barrier, or two of these threads write the same byte. Returns the byte offsets."""
        span = self._spans(addresses, size)
        threads = np.asarray(threads, np.int64)[:, None]
        readers, writers = self.reader[span], self.writer[span]
        used = ((readers >= 0) & (readers != threads)) | (readers == -2) | ((writers >= 0) & (writers != threads))
        flat, owners = span.reshape(-1), np.broadcast_to(threads, span.shape).reshape(-1)
        order = np.argsort(flat, kind="stable")
        shared_byte = (flat[order][1:] == flat[order][:-1]) & (owners[order][1:] != owners[order][:-1])
        if used.any() or shared_byte.any():
            raise PtxRace("a thread overwrites shared bytes another thread used with no barrier between")
        self.writer[span] = threads
        return span

    def write(self, threads: np.ndarray, addresses: np.ndarray, payloads: np.ndarray) -> None:
        """Thread i writes payloads[i] (bytes) at addresses[i]."""
        span = self.claim(threads, addresses, payloads.shape[1])
        self.data[span] = payloads


def _f32(bits: np.ndarray) -> np.ndarray:
    return (bits & 0xFFFFFFFF).astype(np.uint32).view(np.float32)


def _bits32(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, np.float32).view(np.uint32).astype(np.uint64)


def _half_bits(values: np.ndarray, kind: str) -> np.ndarray:
    """f32 values rounded to nearest even as f16 or bf16 bits."""
    values = np.asarray(values, np.float32)
    if kind == "f16":
        return values.astype(np.float16).view(np.uint16).astype(np.uint64)
    bits = values.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return np.where(np.isnan(values), 0x7FC0, rounded & 0xFFFF).astype(np.uint64)


def _from_half(bits: np.ndarray, kind: str) -> np.ndarray:
    bits = np.asarray(bits, np.uint64) & 0xFFFF
    if kind == "f16":
        return bits.astype(np.uint16).view(np.float16).astype(np.float64)
    return (bits << 16).astype(np.uint32).view(np.float32).astype(np.float64)


_WIDTH = {"8": 8, "16": 16, "32": 32, "64": 64, "pred": 1}


def _type_of(opcode: str) -> tuple[str, int]:
    """("s"/"u"/"b"/"f", bits) of an opcode's last type suffix."""
    for part in reversed(opcode.split(".")):
        match = re.fullmatch(r"([subf])(8|16|32|64)", part)
        if match:
            return match.group(1), int(match.group(2))
        if part == "pred":
            return "pred", 1
    raise PtxUnsupported(f"no type in {opcode}")


def _signed(values: np.ndarray, bits: int) -> np.ndarray:
    values = values.astype(np.uint64) & np.uint64((1 << bits) - 1 if bits < 64 else 0xFFFFFFFFFFFFFFFF)
    return values.astype(np.int64) - ((values >> np.uint64(bits - 1)) & 1).astype(np.int64) * (1 << bits) \
        if bits < 64 else values.view(np.int64)


def _wrap(values, bits: int) -> np.ndarray:
    values = np.asarray(values)
    if values.dtype.kind == "i":
        values = values.astype(np.int64).view(np.uint64)
    values = values.astype(np.uint64)
    return values & np.uint64((1 << bits) - 1) if bits < 64 else values


class _Workgroup:
    """One workgroup of ``kernel`` running (module docstring)."""

    def __init__(self, kernel: Kernel, memory: Memory, params: dict, block: tuple, grid: tuple, shared_bytes: int):
        self.k, self.memory, self.params = kernel, memory, params
        self.n = kernel.threads
        self.block, self.grid = block, grid
        self.regs: dict[str, np.ndarray] = {}
        self.shared = _Shared(shared_bytes)
        # cp.async copies not landed: batches (threads, shared addresses, payloads, group of each),
        # a thread's group being the count of its commits at the copy's issue
        self.pending: list[tuple] = []
        self.committed = np.zeros(self.n, np.int64)
        self.tid = np.arange(self.n, dtype=np.uint64)

    # ---- operands
    def read(self, operand: str, kind: str = "b") -> np.ndarray:
        if operand in self.regs:
            return self.regs[operand]
        if operand.startswith("%"):
            special = {"%tid.x": self.tid, "%tid.y": 0, "%tid.z": 0, "%ntid.x": self.n,
                       "%ctaid.x": self.block[0], "%ctaid.y": self.block[1], "%ctaid.z": self.block[2],
                       "%nctaid.x": self.grid[0], "%nctaid.y": self.grid[1], "%nctaid.z": self.grid[2]}
            if operand in special:
                return np.broadcast_to(np.uint64(special[operand]), (self.n,)).astype(np.uint64)
            raise PtxUnsupported(f"register {operand} read before written")
        if operand == "__dynamic_shared_memory__":
            return np.full(self.n, SHARED_BASE, np.uint64)
        if re.fullmatch(r"0[fF][0-9a-fA-F]{8}", operand):
            return np.full(self.n, int(operand[2:], 16), np.uint64)
        if re.fullmatch(r"-?(0[xX][0-9a-fA-F]+|\d+)", operand):
            value = int(operand, 0)
            return np.full(self.n, value & 0xFFFFFFFFFFFFFFFF, np.uint64)
        raise PtxUnsupported(f"operand {operand}")

    def write(self, operand: str, values, mask: np.ndarray) -> None:
        if operand == "_":
            return
        old = self.regs.get(operand, np.zeros(self.n, np.uint64))
        self.regs[operand] = np.where(mask, np.asarray(values).astype(np.uint64), old)

    def address(self, operand: str) -> np.ndarray:
        match = re.fullmatch(r"\[([^\]+]+)(?:\+(-?\d+))?\]", operand)
        if not match:
            raise PtxUnsupported(f"address {operand}")
        base = self.read(match.group(1).strip())
        return base + np.uint64(int(match.group(2) or 0) & 0xFFFFFFFFFFFFFFFF)

    # ---- running
    def run(self) -> None:
        k = self.k
        pc = np.zeros(self.n, np.int64)
        done = np.zeros(self.n, bool)
        steps = 0
        while not done.all():
            current = pc[~done].min()
            at = (pc == current) & ~done
            instruction = k.instructions[current]
            mask = at.copy()
            if instruction.guard:
                negate = instruction.guard.startswith("!")
                predicate = self.regs[instruction.guard.lstrip("!")] != 0
                mask &= ~predicate if negate else predicate
            pc[at] += 1
            target = self.execute(instruction, mask, at)
            if target == "ret":
                done |= mask
            elif target is not None:
                pc[mask] = k.labels[target]
            steps += 1
            if steps > 50_000_000:
                raise PtxUnsupported("over 50M steps: a loop that does not end?")

    def _warps_whole(self, mask: np.ndarray, what: str) -> None:
        lanes = mask.reshape(-1, 32)
        if not np.all(lanes.all(axis=1) | ~lanes.any(axis=1)):
            raise PtxRace(f"{what} with part of a warp")

    def execute(self, ins: Instruction, mask: np.ndarray, at: np.ndarray):
        op, args = ins.opcode, ins.operands
        head = op.split(".")[0]
        handler = getattr(self, f"_op_{head}", None)
        if handler is None:
            raise PtxUnsupported(f"instruction {ins.text!r}")
        return handler(op, args, mask, at)

    # ---- control
    def _op_bra(self, op, args, mask, at):
        return args[0]

    def _op_ret(self, op, args, mask, at):
        return "ret"

    def _op_bar(self, op, args, mask, at):
        if not np.array_equal(at, mask):
            raise PtxRace("bar.sync under a predicate")
        self.shared.barrier()

    # ---- moves and parameters
    def _op_ld(self, op, args, mask, at):
        if ".param." in op:
            index = self.k.params.index(args[1].strip("[]"))
            _, bits = _type_of(op)
            self.write(args[0], np.full(self.n, self.params[index] & ((1 << bits) - 1)), mask)
            return
        if ".global" not in op:
            raise PtxUnsupported(op)
        kind, bits = _type_of(op)
        size = bits // 8
        targets = args[0] if isinstance(args[0], list) else [args[0]]
        base = self.address(args[1])
        active = np.flatnonzero(mask)
        for i, target in enumerate(targets):
            values = np.zeros(self.n, np.uint64)
            values[active] = self.memory.load(base[active] + np.uint64(i * size), size)
            if kind == "s" and bits < 32:
                values = _wrap(_signed(values, bits), 32)
            self.write(target, values, mask)

    def _op_st(self, op, args, mask, at):
        if ".global" not in op:
            raise PtxUnsupported(op)
        _, bits = _type_of(op)
        size = bits // 8
        sources = args[1] if isinstance(args[1], list) else [args[1]]
        base = self.address(args[0])
        active = np.flatnonzero(mask)
        for i, source in enumerate(sources):
            self.memory.store(base[active] + np.uint64(i * size), self.read(source)[active], size)

    def _op_mov(self, op, args, mask, at):
        if isinstance(args[0], list):            # unpack: {lo, hi} of a 32-bit register
            value = self.read(args[1])
            half = 16 if len(args[0]) == 2 and op.endswith("32") else 32
            for i, target in enumerate(args[0]):
                self.write(target, (value >> np.uint64(i * half)) & np.uint64((1 << half) - 1), mask)
            return
        if isinstance(args[1], list):            # pack
            half = 16 if op.endswith("32") else 32
            value = np.zeros(self.n, np.uint64)
            for i, source in enumerate(args[1]):
                value |= (self.read(source) & np.uint64((1 << half) - 1)) << np.uint64(i * half)
            self.write(args[0], value, mask)
            return
        self.write(args[0], self.read(args[1]), mask)

    def _op_cvta(self, op, args, mask, at):
        self.write(args[0], self.read(args[1]), mask)

    def _op_cvt(self, op, args, mask, at):
        parts = op.split(".")
        if parts[-2] in ("f16x2", "bf16x2"):
            kind = parts[-2][:-2]
            high, low = _f32(self.read(args[1])), _f32(self.read(args[2]))
            self.write(args[0], (_half_bits(high, kind) << np.uint64(16)) | _half_bits(low, kind), mask)
            return
        (dkind, dbits), (skind, sbits) = [(m.group(1), int(m.group(2))) for m in
                                          (re.fullmatch(r"([su])(\d+)", p) for p in parts[-2:])]
        value = self.read(args[1])
        value = _signed(value, sbits) if skind == "s" else _wrap(value, sbits)
        self.write(args[0], _wrap(value, dbits), mask)

    # ---- integer arithmetic
    def _int_args(self, op, args):
        kind, bits = _type_of(op)
        values = [self.read(a) for a in args[1:]]
        if kind == "s":
            return kind, bits, [_signed(v, bits) for v in values]
        return kind, bits, [_wrap(v, bits) for v in values]

    def _arith(self, op, args, mask, fn):
        kind, bits = _type_of(op)
        if kind == "f":
            x = [_f32(self.read(a)) for a in args[1:]]
            with np.errstate(all="ignore"):
                self.write(args[0], _bits32(fn(*x)), mask)
            return
        _, bits, x = self._int_args(op, args)
        with np.errstate(all="ignore"):
            self.write(args[0], _wrap(fn(*x), bits), mask)

    def _op_add(self, op, args, mask, at):
        self._arith(op, args, mask, lambda a, b: a + b)

    def _op_sub(self, op, args, mask, at):
        self._arith(op, args, mask, lambda a, b: a - b)

    def _op_mul(self, op, args, mask, at):
        if ".wide." in op:
            kind, bits = _type_of(op)
            x = [_signed(self.read(a), bits) if kind == "s" else _wrap(self.read(a), bits) for a in args[1:]]
            self.write(args[0], _wrap(x[0] * x[1], 2 * bits), mask)
            return
        self._arith(op, args, mask, lambda a, b: a * b)

    def _op_mad(self, op, args, mask, at):
        if ".lo." not in op:
            raise PtxUnsupported(op)
        self._arith(op, args, mask, lambda a, b, c: a * b + c)

    def _op_neg(self, op, args, mask, at):
        self._arith(op, args, mask, lambda a: -a)

    def _op_min(self, op, args, mask, at):
        self._arith(op, args, mask, np.minimum)

    def _op_max(self, op, args, mask, at):
        self._arith(op, args, mask, np.maximum if ".NaN." in op or _type_of(op)[0] != "f" else np.fmax)

    def _bitwise(self, op, args, mask, fn):
        kind, bits = _type_of(op)
        values = [self.read(a) for a in args[1:]]
        self.write(args[0], _wrap(fn(*values), bits if kind != "pred" else 1), mask)

    def _op_and(self, op, args, mask, at):
        self._bitwise(op, args, mask, lambda a, b: a & b)

    def _op_or(self, op, args, mask, at):
        self._bitwise(op, args, mask, lambda a, b: a | b)

    def _op_xor(self, op, args, mask, at):
        self._bitwise(op, args, mask, lambda a, b: a ^ b)

    def _op_not(self, op, args, mask, at):
        self._bitwise(op, args, mask, lambda a: ~a)

    def _op_shl(self, op, args, mask, at):
        _, bits = _type_of(op)
        value, shift = self.read(args[1]), np.minimum(self.read(args[2]) & np.uint64(0xFFFFFFFF), bits)
        self.write(args[0], _wrap(np.where(shift >= bits, 0, value << np.minimum(shift, 63)), bits), mask)

    def _op_shr(self, op, args, mask, at):
        kind, bits = _type_of(op)
        shift = np.minimum(self.read(args[2]) & np.uint64(0xFFFFFFFF), np.uint64(bits))
        if kind == "s":
            value = _signed(self.read(args[1]), bits)
            self.write(args[0], _wrap(value >> np.minimum(shift, bits - 1).astype(np.int64), bits), mask)
        else:
            value = _wrap(self.read(args[1]), bits)
            self.write(args[0], np.where(shift >= bits, 0, value >> np.minimum(shift, 63)), mask)

    def _op_setp(self, op, args, mask, at):
        parts = op.split(".")
        compare = parts[1]
        kind, bits = _type_of(op)
        if kind == "f":
            a, b = _f32(self.read(args[1])), _f32(self.read(args[2]))
            with np.errstate(invalid="ignore"):
                result = {"eq": a == b, "ne": a != b, "lt": a < b, "le": a <= b, "gt": a > b, "ge": a >= b,
                          "nan": np.isnan(a) | np.isnan(b), "num": ~(np.isnan(a) | np.isnan(b)),
                          "equ": (a == b) | np.isnan(a) | np.isnan(b), "neu": (a != b),
                          "ltu": ~(a >= b), "leu": ~(a > b), "gtu": ~(a <= b), "geu": ~(a < b)}[compare]
        else:
            convert = (lambda v: _signed(v, bits)) if kind == "s" else (lambda v: _wrap(v, bits))
            a, b = convert(self.read(args[1])), convert(self.read(args[2]))
            result = {"eq": a == b, "ne": a != b, "lt": a < b, "le": a <= b, "gt": a > b, "ge": a >= b,
                      "lo": a < b, "ls": a <= b, "hi": a > b, "hs": a >= b}[compare]
        self.write(args[0], np.asarray(result, bool).astype(np.uint64), mask)

    def _op_selp(self, op, args, mask, at):
        predicate = self.read(args[3]) != 0
        self.write(args[0], np.where(predicate, self.read(args[1]), self.read(args[2])), mask)

    # ---- float
    def _op_rcp(self, op, args, mask, at):
        self._arith(op, args, mask, lambda a: np.float32(1.0) / a)

    def _op_ex2(self, op, args, mask, at):
        self._arith(op, args, mask, lambda a: np.exp2(a))

    def _op_lg2(self, op, args, mask, at):
        self._arith(op, args, mask, lambda a: np.log2(a))

    def _op_fma(self, op, args, mask, at):
        self._arith(op, args, mask, lambda a, b, c: (a.astype(np.float64) * b + c).astype(np.float32))

    def _op_div(self, op, args, mask, at):
        self._arith(op, args, mask, lambda a, b: a / b)

    # ---- warp-level and shared memory
    def _op_shfl(self, op, args, mask, at):
        if ".bfly." not in op:
            raise PtxUnsupported(op)
        self._warps_whole(mask, "shfl.sync")
        value, offset = self.read(args[1]), self.read(args[2])
        source = (self.tid & ~np.uint64(31)) | ((self.tid & np.uint64(31)) ^ (offset & np.uint64(31)))
        target = args[0].split("|")[0]
        self.write(target, value[source.astype(np.int64)], mask)

    def _op_ldmatrix(self, op, args, mask, at):
        self._warps_whole(mask, "ldmatrix")
        count = int(re.search(r"\.x(\d)", op).group(1))
        warps = np.unique(np.flatnonzero(mask) // 32)
        lanes = warps[:, None] * 32 + np.arange(32)                   # [W, 32]
        addresses = self.address(args[1])
        results = [np.zeros(self.n, np.uint64) for _ in range(count)]
        g, t = np.arange(32) // 4, np.arange(32) % 4
        for j in range(count):
            readers = lanes[:, 8 * j:8 * j + 8].reshape(-1)            # lane 8j + r gives row r
            rows = self.shared.read(readers, addresses[readers], 16).view(np.uint16)
            matrix = rows.reshape(len(warps), 8, 8).astype(np.uint64)  # [W, row, col]
            if ".trans" in op:
                matrix = matrix.transpose(0, 2, 1)
            values = matrix[:, g, 2 * t] | (matrix[:, g, 2 * t + 1] << np.uint64(16))
            results[j][lanes.reshape(-1)] = values.reshape(-1)
        for target, values in zip(args[0], results):
            self.write(target, values, mask)

    def _op_mma(self, op, args, mask, at):
        self._warps_whole(mask, "mma.sync")
        match = re.fullmatch(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.(f16|bf16)\.\1\.f32", op)
        if not match:
            raise PtxUnsupported(op)
        kind = match.group(1)
        d, a, b, c = args
        warps = np.unique(np.flatnonzero(mask) // 32)
        lanes = (warps[:, None] * 32 + np.arange(32)).reshape(-1)
        w = np.repeat(np.arange(len(warps)), 32)
        g, t = np.tile(np.arange(32) // 4, len(warps)), np.tile(np.arange(32) % 4, len(warps))
        A = np.zeros((len(warps), 16, 16))
        B = np.zeros((len(warps), 16, 8))
        C = np.zeros((len(warps), 16, 8))
        for reg, (row, col) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
            bits = self.read(a[reg])[lanes]
            A[w, row, col], A[w, row, col + 1] = _from_half(bits, kind), _from_half(bits >> np.uint64(16), kind)
        for reg, k0 in enumerate((2 * t, 2 * t + 8)):
            bits = self.read(b[reg])[lanes]
            B[w, k0, g], B[w, k0 + 1, g] = _from_half(bits, kind), _from_half(bits >> np.uint64(16), kind)
        places = ((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1))
        for reg, (row, col) in enumerate(places):
            C[w, row, col] = _f32(self.read(c[reg])[lanes])
        D = (A @ B + C).astype(np.float32)
        for reg, (row, col) in enumerate(places):
            values = np.zeros(self.n, np.uint64)
            values[lanes] = _bits32(D[w, row, col])
            self.write(d[reg], values, mask)

    def _op_cp(self, op, args, mask, at):
        if op.startswith("cp.async.commit_group"):
            self.committed[mask] += 1
            return
        if op.startswith("cp.async.wait_group"):
            # a thread's copies land once at most ``keep`` of its committed groups are newer
            limit = np.where(mask, self.committed - int(args[0]), -1)
            kept = []
            for threads, addresses, payloads, groups in self.pending:
                lands = groups < limit[threads]
                if lands.any():
                    self.shared.write(threads[lands], addresses[lands], payloads[lands])
                if not lands.all():
                    kept.append((threads[~lands], addresses[~lands], payloads[~lands], groups[~lands]))
            self.pending = kept
            return
        if not op.startswith("cp.async.") or ".shared.global" not in op:
            raise PtxUnsupported(op)
        size = int(args[2])
        destination, source = self.address(args[0]), self.address(args[1])
        threads = np.flatnonzero(mask)
        self.shared.claim(threads, destination[threads], size)
        self.pending.append((threads, destination[threads], self.memory.read_bytes(source[threads], size),
                             self.committed[threads].copy()))


def run_kernel(kernel: Kernel, memory: Memory, params: list[int], grid: tuple[int, int, int],
               shared_bytes: int) -> None:
    """Runs every workgroup of ``grid`` of ``kernel`` with the parameter values ``params`` (in
    the entry's order: buffer addresses from ``memory``, then the 32-bit constants)."""
    if len(params) != len(kernel.params):
        raise ValueError(f"{kernel.name} takes {len(kernel.params)} parameters, got {len(params)}")
    for z in range(grid[2]):
        for y in range(grid[1]):
            for x in range(grid[0]):
                _Workgroup(kernel, memory, params, (x, y, z), grid, shared_bytes).run()


def run_dispatch(ptx: str, inputs: list[np.ndarray], outputs: list[tuple], scalars: list[tuple[str, object]],
                 grid: tuple[int, int, int], shared_bytes: int) -> list[np.ndarray]:
    """The results of a hand-written dispatch's PTX: ``inputs`` (arrays, each its own buffer),
    ``outputs`` ((dtype, shape) each, zero-filled), ``scalars`` (("index" | "i32" | "f32", value))
    in the dispatch's operand order, over ``grid`` with ``shared_bytes`` of shared memory.

    The launch IREE 3.13 makes of a dispatch whose inputs are distinct buffers and whose results
    it allocates together (read from its HAL IR): a pointer a binding (the inputs, then the
    results), then 32-bit constants: the byte offset of each result after the first in their
    common buffer (an index, here 0: each result is its own buffer), then the scalars, an index
    as (low, high), an f32 as its bits."""
    kernel = parse_kernel(ptx)
    memory = Memory()
    pointers = [memory.add(array) for array in inputs]
    results = [memory.add(np.zeros(shape, dtype)) for dtype, shape in outputs]
    constants = []
    for kind, value in [("index", 0)] * (len(outputs) - 1) + list(scalars):
        if kind == "index":
            constants += [int(value) & 0xFFFFFFFF, (int(value) >> 32) & 0xFFFFFFFF]
        elif kind == "i32":
            constants.append(int(value) & 0xFFFFFFFF)
        else:
            constants.append(int(np.float32(value).view(np.uint32)))
    run_kernel(kernel, memory, pointers + results + constants, grid, shared_bytes)
    return [memory.read(address, dtype, shape) for address, (dtype, shape) in zip(results, outputs)]


def emulate_sequence_prefill(ptx: str, q: np.ndarray, k: np.ndarray, v: np.ndarray, *rest: np.ndarray,
                             tiling: MmaTiling | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(output [B, Lq, h_q, d] in q's dtype, lse [B, Lq, h_q] float32) of the mma lowering's
    dense dispatch (mlir/cuda_attention.py, built with ``tiling``, default its MMA_TILING) run
    from its PTX on q [B, Lq, h_q, d], k/v [B, Lk, h_kv, d] (float16 or bfloat16) and the rest
    of the call in its order (valid_lens [B] int32 for the padded masks, sinks [h_q] float32):
    the dense kernel's function is that one dispatch (:func:`run_dispatch`)."""
    tiling = tiling or MMA_TILING
    batch, q_len, h_q, d = q.shape
    out, lse = run_dispatch(ptx, [q, k, v, *(np.asarray(x) for x in rest)],
                            [(q.dtype, q.shape), (np.float32, (batch, q_len, h_q))],
                            [("index", batch), ("index", q_len), ("index", k.shape[1])],
                            (-(-q_len // tiling.rows), h_q, batch), tiling.shared_bytes(d))
    return out, lse
