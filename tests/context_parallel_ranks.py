"""The rank program of tests/test_context_parallel.py (``torchrun --nproc_per_node W this.py
OUT``): every rank pins its kernel threads to its CPUs, draws the same whole inputs of each case
in :data:`CASES`, runs its shard through ``linalg_prefill.distributed.ContextParallelPrefill``
over gloo and saves its rows' output, lse and partial states to ``OUT/<case>-rank<r>.npz`` (its
IREE workers' CPUs to ``threads-rank<r>.npz``); the test assembles and checks them."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from linalg_prefill.mlir import RaggedPrefillSpec, SequencePrefillSpec
from linalg_prefill.runtime.checks import NUMPY_DTYPES
from linalg_prefill.runtime.worker_placement import iree_workers

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class Case:
    """One context-parallel prefill: ``lengths`` (a dense spec: ``batch`` sequences of
    ``lengths[0]``), the split, and the ragged plan's ``causal`` and ``rope``."""

    name: str
    spec: object
    lengths: tuple
    split: str = "zigzag"
    causal: bool = True
    rope: dict | None = None
    batch: int = 1
    peak: float = 4.0  # q drawn in [-peak, peak): peaked rows

    def inputs(self):
        """(q, k, v) of the whole batch: ragged [sum(lengths), h, d], dense [batch, L, h, d]."""
        rng = np.random.default_rng(len(self.name))
        spec, dtype = self.spec, NUMPY_DTYPES[self.spec.dtype]
        lead = (self.batch, self.lengths[0]) if isinstance(spec, SequencePrefillSpec) else (sum(self.lengths),)
        d_qk, d_v = (spec.d, spec.d) if isinstance(spec, SequencePrefillSpec) else (spec.d_qk, spec.d_v)
        q = (rng.uniform(-self.peak, self.peak, (*lead, spec.h_q, d_qk))).astype(dtype)
        k = rng.uniform(-1, 1, (*lead, spec.h_kv, d_qk)).astype(dtype)
        v = rng.uniform(-1, 1, (*lead, spec.h_kv, d_v)).astype(dtype)
        return q, k, v


#: Kernels other tests compile (test_wrappers' f32 ragged, test_head_sinks' bf16 ragged,
#: test_sequence_prefill's f32 dense pair), plus the dense bf16 GQA kernel's non-causal twin.
RAGGED_F32 = RaggedPrefillSpec(4, 2, 64, 64, "float32", LLAMA3)
RAGGED_BF16 = RaggedPrefillSpec(4, 2, 16, 16, "bfloat16")
DENSE_F32 = SequencePrefillSpec(4, 4, 64, "float32", causal=True, sm_scale=0.125)
DENSE_BF16 = SequencePrefillSpec(8, 2, 64, "bfloat16", causal=True, sm_scale=0.125)

CASES = (
    # one odd-length sequence, RoPE at global positions, GQA 2
    Case("ragged-f32-rope", RAGGED_F32, (53,), rope=dict(rope_theta=1e4)),
    # a ragged batch: a sequence shorter than the 4 zig-zag chunks (an empty chunk) and uneven ones
    Case("ragged-bf16-batch", RAGGED_BF16, (3, 41, 18)),
    # contiguous shards: one rank's queries see the other's K/V whole, the other's none of it
    Case("ragged-f32-contiguous", RAGGED_F32, (29, 6), split="contiguous", rope=dict(rope_theta=1e4)),
    Case("ragged-bf16-noncausal", RAGGED_BF16, (1, 37), causal=False),
    # rank 0 holds no token at all: it sends nothing, receives rank 1's shard, returns no rows
    Case("ragged-f32-empty-shard", RAGGED_F32, (1, 1), split="contiguous", rope=dict(rope_theta=1e4)),
    Case("dense-f32", DENSE_F32, (45,), batch=2),
    Case("dense-bf16-gqa", DENSE_BF16, (38,)),
)


def main(out_dir: str) -> None:
    import torch.distributed as dist

    from linalg_prefill.distributed import ContextParallelPrefill, ShardPlan, pin_rank_threads
    from linalg_prefill.runtime import InputError

    cpus = pin_rank_threads()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for case in CASES:
        plan = ShardPlan.of(case.lengths, world, case.split)
        rows = plan.rows(rank)
        dense = isinstance(case.spec, SequencePrefillSpec)
        q, k, v = (x[:, rows] if dense else x[rows] for x in case.inputs())
        prefill = ContextParallelPrefill(case.spec, plan, rank, causal=case.causal, rope=case.rope)
        partials = []
        out, lse = prefill.run(q, k, v, partials=partials)
        np.savez(Path(out_dir) / f"{case.name}-rank{rank}.npz", out=out.astype(np.float32), lse=lse,
                 partial_out=np.stack([p[0] for p in partials]) if partials else np.zeros((0, *out.shape)),
                 partial_lse=np.stack([p[1] for p in partials]) if partials else np.zeros((0, *lse.shape)),
                 calls=np.array(prefill.calls_per_step()))
    try:  # a plan for another number of ranks than the group's is refused by name
        ContextParallelPrefill(RAGGED_F32, ShardPlan.of([8], world + 1), rank)
        refusal = ""
    except InputError as err:
        refusal = str(err)
    workers = {tid: _allowed_cpus(Path("/proc/self/task") / str(tid)) for tid, _ in iree_workers()}
    np.savez(Path(out_dir) / f"threads-rank{rank}.npz", pinned=np.array(cpus),
             workers=np.array(sorted(workers.values())), refusal=np.array(refusal))
    dist.barrier()
    dist.destroy_process_group()


def _allowed_cpus(task: Path) -> list[int]:
    """The CPUs a thread may run on (its Cpus_allowed_list, e.g. "0-1,3")."""
    line = next(x for x in (task / "status").read_text().splitlines() if x.startswith("Cpus_allowed_list"))
    cpus = []
    for part in line.split(":")[1].strip().split(","):
        low, _, high = part.partition("-")
        cpus += range(int(low), int(high or low) + 1)
    return cpus


if __name__ == "__main__":
    main(sys.argv[1])
