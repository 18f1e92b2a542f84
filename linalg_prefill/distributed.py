"""Context-parallel prefill over torch.distributed: one long sequence (or a ragged batch of them)
split across the ranks of a process group, each rank attending its queries to every rank's K/V.

    shards = ShardPlan.of([L], world=dist.get_world_size())            # zig-zag by default
    rows = shards.rows(dist.get_rank())                                   # global rows of this rank
    prefill = ContextParallelPrefill(RaggedPrefillSpec(32, 8, 128, 128, "bfloat16"), shards,
                                     dist.get_rank(), causal=True, rope=dict(rope_theta=5e5))
    out, lse = prefill.run(q[rows], k[rows], v[rows])   # this rank's rows of the whole attention

**Shards.** Each sequence is cut into chunks as even as possible (lengths differ by at most one;
a chunk is empty when the sequence is shorter than the chunk count). ``split="zigzag"`` (the
default): ``2 W`` chunks, rank ``r`` holding chunks ``r`` and ``2W - 1 - r``, so that every rank
gets the same causal work (one early, one late chunk); ``"contiguous"``: ``W`` chunks, rank ``r``
holding chunk ``r``. A rank holds the queries and the K/V of the same positions, its rows in
sequence order, then chunk order (:meth:`ShardPlan.rows`).

**The ring.** A rank first attends to its own K/V; then, ``W - 1`` times, it sends the K/V shard
it holds to rank ``r + 1`` and receives the next from rank ``r - 1`` (``torch.distributed``
``isend``/``irecv``: gloo on CPU, NCCL on GPU), the transfer overlapping the attention to the
shard it has. Each step's partial states (output, base-2 lse) are merged in float32 by
``runtime/merge.merge_state`` and rounded to the spec's dtype once at the end. A KV chunk is
attended to by a query chunk when it lies wholly before it (no mask) or, under a causal mask, is
the same chunk (the causal mask: the same length, so bottom-right is top-left); a later chunk is
skipped. The ragged kernel takes every pair of one step in a few calls (entries of one call need
disjoint query and KV rows; a call runs and merges only the query rows its pairs span); RoPE
positions are global (``q_rope_position``, and each entry's ``k_rope_pos_offset`` its chunk's
first position). The dense kernel (``SequencePrefillSpec``, a
batch of sequences of one length ``L``) runs each pair as a call, its causal spec on the
diagonal and the same spec with ``causal=False`` (compiled on first use) off it.

**Threads.** Ranks that share a host call :func:`pin_rank_threads` first (before any kernel
opens): IREE places every process's workers on the host's first CPUs otherwise.

The ring sends the caller's K/V from where they lie (contiguous arrays; others are copied once)
and receives each step's shard into a new buffer; the outputs are the rank's rows only. Not
supported: specs with head sinks or a custom mask (attention sinks enter a row's denominator
once: merge, then ``runtime.merge.apply_sinks``).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

import numpy as np

from .mlir.specs import RaggedPrefillSpec, SequencePrefillSpec
from .runtime.checks import NUMPY_DTYPES, as_array
from .runtime.devices import pin_cpu_threads
from .runtime.errors import InputError
from .runtime.kernels import open_kernel
from .runtime.merge import EMPTY_ROW_LSE, merge_state
from .runtime.wrappers import RaggedPrefillWrapper, SequencePrefillWrapper

__all__ = ["Chunk", "ContextParallelPrefill", "ShardPlan", "pin_rank_threads", "rank_cpus"]

SPLITS = ("zigzag", "contiguous")


@dataclass(frozen=True)
class Chunk:
    """Positions ``[start, stop)`` of sequence ``seq``."""

    seq: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class ShardPlan:
    """How sequences of ``lengths`` tokens are split over ``world`` ranks (see the module)."""

    lengths: tuple[int, ...]
    world: int
    split: str = "zigzag"

    @classmethod
    def of(cls, lengths, world: int, split: str = "zigzag") -> ShardPlan:
        """Checked: ``lengths`` non-negative ints (one per sequence), ``world`` >= 1."""
        lengths = tuple(int(n) for n in np.atleast_1d(np.asarray(lengths)))
        if not lengths or min(lengths) < 0:
            raise InputError(f"lengths: expected one non-negative length per sequence, got {lengths}")
        if int(world) < 1:
            raise InputError(f"world: expected at least one rank, got {world}")
        if split not in SPLITS:
            raise InputError(f"split: expected one of {SPLITS}, got {split!r}")
        return cls(lengths, int(world), split)

    def chunks(self, rank: int) -> tuple[Chunk, ...]:
        """Rank ``rank``'s chunks in its row order: by sequence, then position."""
        if not 0 <= rank < self.world:
            raise InputError(f"rank: expected 0 <= rank < {self.world}, got {rank}")
        count = 2 * self.world if self.split == "zigzag" else self.world
        picks = sorted({rank, count - 1 - rank}) if self.split == "zigzag" else [rank]
        return tuple(Chunk(seq, length * i // count, length * (i + 1) // count)
                     for seq, length in enumerate(self.lengths) for i in picks)

    def rows(self, rank: int) -> np.ndarray:
        """int64 [rank's rows]: the global rows (of the sequences concatenated) a rank holds, each
        row's position (:meth:`positions`) past its sequence's first row."""
        chunks = self.chunks(rank)
        first_rows = np.concatenate([[0], np.cumsum(self.lengths)])[[c.seq for c in chunks]]
        return self.positions(rank) + np.repeat(first_rows, [c.size for c in chunks]).astype(np.int64)

    def local_rows(self, rank: int) -> int:
        return sum(c.size for c in self.chunks(rank))

    def positions(self, rank: int) -> np.ndarray:
        """int32 [rank's rows]: each row's position in its sequence (its RoPE position)."""
        parts = [np.arange(c.start, c.stop) for c in self.chunks(rank)]
        return np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)


def rank_cpus(local_rank: int, local_world: int, cpus=None) -> list[int]:
    """The CPUs of rank ``local_rank`` of ``local_world`` ranks on this host: its contiguous share
    of ``cpus`` (default: the CPUs this process may run on), as even as possible (at least one:
    ranks share CPUs only when there are more ranks than CPUs)."""
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if not 0 <= local_rank < local_world:
        raise InputError(f"local_rank: expected 0 <= local_rank < {local_world}, got {local_rank}")
    if local_world >= len(cpus):
        return [cpus[local_rank % len(cpus)]]
    return cpus[len(cpus) * local_rank // local_world:len(cpus) * (local_rank + 1) // local_world]


def pin_rank_threads(local_rank: int | None = None, local_world: int | None = None) -> list[int]:
    """Runs this rank's kernel threads on its own CPUs (:func:`rank_cpus`; default: torchrun's
    ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``) and returns them. Without it every rank's IREE
    workers start on the host's first CPUs: two ranks on a 2-CPU host both ran on CPU 0, each at
    half speed (docs/distributed.md). Call before the first kernel opens."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0)) if local_rank is None else local_rank
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if local_world is None else local_world
    return pin_cpu_threads(rank_cpus(local_rank, local_world))


@dataclass(frozen=True)
class _Block:
    """Query rows ``[q_start, q_stop)`` of this rank against KV rows ``[kv_start, kv_stop)`` of
    the shard at hand, with or without the causal mask; ``k_position``: the KV chunk's first
    position in its sequence."""

    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int
    causal: bool
    k_position: int


def _blocks(plan: ShardPlan, rank: int, source: int, causal: bool) -> list[_Block]:
    """The pairs rank ``rank``'s queries attend to in rank ``source``'s K/V shard."""
    blocks, q_row = [], 0
    for q in plan.chunks(rank):
        kv_row = 0
        for kv in plan.chunks(source):
            diagonal = (kv.seq, kv.start, kv.stop) == (q.seq, q.start, q.stop)
            visible = kv.seq == q.seq and (not causal or kv.stop <= q.start or diagonal)
            if visible and q.size and kv.size:
                blocks.append(_Block(q_row, q_row + q.size, kv_row, kv_row + kv.size, causal and diagonal, kv.start))
            kv_row += kv.size
        q_row += q.size
    return blocks


@dataclass
class _RaggedCall:
    """One ragged-kernel call: entries with disjoint, increasing query and KV rows, over the
    query rows ``[q_indptr[0], q_indptr[-1])`` of this rank (the rows it attends, from its first
    block's to its last one's: the others are neither computed nor merged)."""

    causal: bool
    q_indptr: list
    kv_indptr: list
    k_offsets: list

    def take(self, block: _Block) -> bool:
        """Adds ``block`` as an entry (after gap entries: rows that attend to nothing, KV rows
        that nobody reads) if it fits after the last one; False if not."""
        if block.causal != self.causal or block.q_start < self.q_indptr[-1] or block.kv_start < self.kv_indptr[-1]:
            return False
        if block.q_start > self.q_indptr[-1]:
            self._entry(block.q_start, self.kv_indptr[-1], 0)
        if block.kv_start > self.kv_indptr[-1]:
            self._entry(self.q_indptr[-1], block.kv_start, 0)
        self._entry(block.q_stop, block.kv_stop, block.k_position)
        return True

    def _entry(self, q_stop: int, kv_stop: int, k_offset: int) -> None:
        self.q_indptr.append(q_stop)
        self.kv_indptr.append(kv_stop)
        self.k_offsets.append(k_offset)

    @property
    def rows(self) -> slice:
        return slice(self.q_indptr[0], self.q_indptr[-1])


def _ragged_calls(blocks: list[_Block]) -> list[_RaggedCall]:
    """``blocks`` packed first-fit into calls."""
    calls: list[_RaggedCall] = []
    for block in blocks:
        if not any(call.take(block) for call in calls):
            calls.append(_RaggedCall(block.causal, [block.q_start], [0], []))
            calls[-1].take(block)
    return calls


class ContextParallelPrefill:
    """This rank's part of a context-parallel prefill (see the module).

    ``spec``: a :class:`RaggedPrefillSpec` (q [rows, h_q, d_qk], k [rows, h_kv, d_qk], v [rows,
    h_kv, d_v]: this rank's rows of every sequence, :meth:`ShardPlan.rows`) or a
    :class:`SequencePrefillSpec` (q [B, rows, h_q, d], k/v [B, rows, h_kv, d]: this rank's rows
    of B sequences of one length; ``plan`` then has that one length). ``causal``, ``rope``
    (``dict(rope_scale=, rope_theta=)``, global positions) and ``sm_scale`` are the ragged
    wrapper's plan arguments; the dense kernel's come from its spec. ``group``: the process
    group (default: the world); ``plan.world`` must be its size and ``rank`` this process's rank
    in it. ``backend``/``cache``: where the kernels come from, as for the wrappers.
    """

    def __init__(self, spec, plan: ShardPlan, rank: int, *, causal: bool = True, rope=None, sm_scale=None,
                 group=None, backend=None, cache=None):
        if not isinstance(spec, (RaggedPrefillSpec, SequencePrefillSpec)):
            raise InputError(f"spec: context-parallel prefill takes a RaggedPrefillSpec or a SequencePrefillSpec, "
                             f"got {type(spec).__name__}")
        if spec.head_sinks or getattr(spec, "custom_mask", False):
            raise InputError(f"spec: {spec.name} has head sinks or a custom mask; split the KV of a spec "
                             "without them (then runtime.merge.apply_sinks)")
        if isinstance(spec, SequencePrefillSpec) and len(plan.lengths) != 1:
            raise InputError(f"plan: a dense spec takes sequences of one length, got lengths {plan.lengths}")
        if not 0 <= rank < plan.world:
            raise InputError(f"rank: expected 0 <= rank < {plan.world}, got {rank}")
        if plan.world > 1:
            _check_group(group, plan.world, rank)
        self.spec, self.plan, self.rank, self.group = spec, plan, rank, group
        self.dense = isinstance(spec, SequencePrefillSpec)
        causal = spec.causal if self.dense else bool(causal)
        self._steps = [_blocks(plan, rank, (rank - step) % plan.world, causal) for step in range(plan.world)]
        if self.dense:
            wrappers = {spec.causal: SequencePrefillWrapper(spec, backend=backend, cache=cache)}
            if any(not b.causal for blocks in self._steps for b in blocks) and spec.causal:
                wrappers[False] = SequencePrefillWrapper(dataclasses.replace(spec, causal=False), backend=backend,
                                                         cache=cache)
            self._dense = wrappers
        else:
            kernel = open_kernel(spec, backend or "llvm-cpu", cache=cache)
            positions = plan.positions(rank)
            self._calls = []
            for blocks in self._steps:
                step = []
                for call in _ragged_calls(blocks):
                    wrapper = RaggedPrefillWrapper(spec, kernel=kernel)
                    wrapper.plan(np.array(call.q_indptr, np.int32) - call.q_indptr[0],
                                 np.array(call.kv_indptr, np.int32), causal=call.causal, rope=rope,
                                 q_rope_position=positions[call.rows],
                                 k_rope_pos_offset=np.array(call.k_offsets, np.int32), sm_scale=sm_scale)
                    step.append((wrapper, call.rows, call.kv_indptr[-1]))
                self._calls.append(step)
        #: seconds of the last run: ``attention`` (kernel calls and merges), ``wait`` (blocked on
        #: the ring's transfers after this rank's attention of a step was done), ``total``.
        self.timings: dict[str, float] = {}

    def calls_per_step(self) -> list[int]:
        """Kernel calls each ring step makes (step 0: this rank's own shard)."""
        return [len(step) for step in self._calls] if not self.dense else [len(b) for b in self._steps]

    def run(self, q, k, v, *, partials: list | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(output, lse) of this rank's query rows against every rank's K/V: output like q with
        d_v columns in the spec's dtype, lse float32 [..., rows, h_q] (base 2). ``partials``: a
        list to which every partial state merged is appended (float32 output, lse; over all this
        rank's rows, the rows a call did not attend empty), for the error model's ``merge_bound``."""
        start = time.perf_counter()
        q, k, v = (as_array(name, x) for name, x in (("q", q), ("k", k), ("v", v)))
        axis = 1 if self.dense else 0
        rows = self.plan.local_rows(self.rank)
        for name, x in (("q", q), ("k", k), ("v", v)):
            if x.ndim != axis + 3 or x.shape[axis] != rows:
                raise InputError(f"{name}: expected {axis + 3} dims with {rows} rows (this rank's) on axis {axis}, "
                                 f"got shape {x.shape}")
        out = np.zeros((*q.shape[:-1], self.spec.d_v), np.float32)
        lse = np.full(q.shape[:-1], EMPTY_ROW_LSE, np.float32)
        attention = waited = 0.0
        shard = (k, v)
        for step in range(self.plan.world):
            ring = _Transfer(self, step, shard) if step + 1 < self.plan.world else None
            begun = time.perf_counter()
            for rows_slice, part_out, part_lse in self._attend(step, q, *shard):
                part_out = np.asarray(part_out, np.float32)
                index = (slice(None), rows_slice) if self.dense else (rows_slice,)
                if partials is not None:  # as states of all this rank's rows
                    whole = np.zeros_like(out), np.full_like(lse, EMPTY_ROW_LSE)
                    whole[0][index], whole[1][index] = part_out, part_lse
                    partials.append(whole)
                out[index], lse[index] = merge_state(out[index], lse[index], part_out, part_lse)
            attention += time.perf_counter() - begun
            if ring is not None:
                begun = time.perf_counter()
                shard = ring.received()
                waited += time.perf_counter() - begun
        self.timings = dict(attention=attention, wait=waited, total=time.perf_counter() - start)
        return out.astype(NUMPY_DTYPES[self.spec.dtype]), lse

    def _attend(self, step: int, q, k, v):
        """(query rows, output, lse) of each kernel call of ``step`` on the shard ``k``/``v``."""
        if self.dense:
            for b in self._steps[step]:
                wrapper = self._dense[b.causal]
                yield (slice(b.q_start, b.q_stop), *wrapper.run(q[:, b.q_start:b.q_stop], k[:, b.kv_start:b.kv_stop],
                                                                 v[:, b.kv_start:b.kv_stop], to_host=True))
            return
        for wrapper, rows, kv_rows in self._calls[step]:
            yield (rows, *wrapper.run(q[rows], k[:kv_rows], v[:kv_rows], to_host=True))


class _Transfer:
    """One ring step's send of the shard at hand to rank + 1 and receive from rank - 1, started
    at construction (non-blocking), finished by :meth:`received`. Shards travel as bytes; their
    sizes are known from the plan, so nothing is sent for an empty shard."""

    def __init__(self, prefill: ContextParallelPrefill, step: int, shard):
        import torch
        import torch.distributed as dist

        plan, rank, group = prefill.plan, prefill.rank, prefill.group
        to_rank, from_rank = (rank + 1) % plan.world, (rank - 1) % plan.world
        source = (rank - step - 1) % plan.world  # whose shard arrives
        axis = 1 if prefill.dense else 0
        self._works, self._shard, self._sent = [], [], []  # the sent arrays live until received()
        for tag, x in enumerate(shard):
            x = np.ascontiguousarray(x)
            self._sent.append(x)
            if x.size:
                self._works.append(dist.isend(torch.from_numpy(x.reshape(-1).view(np.uint8)),
                                              dst=_global(group, to_rank), group=group, tag=tag))
            shape = list(x.shape)
            shape[axis] = plan.local_rows(source)
            incoming = np.empty(shape, x.dtype)
            if incoming.size:
                self._works.append(dist.irecv(torch.from_numpy(incoming.reshape(-1).view(np.uint8)),
                                              src=_global(group, from_rank), group=group, tag=tag))
            self._shard.append(incoming)

    def received(self) -> tuple:
        for work in self._works:
            work.wait()
        return tuple(self._shard)


def _check_group(group, world: int, rank: int) -> None:
    """InputError naming ``group`` unless torch.distributed runs ``world`` ranks in ``group`` and
    this process is its rank ``rank``."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise InputError(f"group: a plan over {world} ranks needs torch.distributed "
                         "(dist.init_process_group first)")
    size, own = dist.get_world_size(group), dist.get_rank(group)
    if (size, own) != (world, rank):
        raise InputError(f"group: the plan is for {world} ranks and this is rank {rank}, but the group has "
                         f"{size} ranks and this process is its rank {own}")


def _global(group, rank: int) -> int:
    """``rank`` of ``group`` as a global rank (torch.distributed's send/recv take global ranks)."""
    import torch.distributed as dist

    return rank if group is None else dist.get_global_rank(group, rank)
