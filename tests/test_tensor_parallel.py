"""transformers' tensor parallelism on the CPU (issue 45, its TP half): a tiny Llama (peaked
attention, tests/hf_models.py) loaded with ``tp_plan="auto"`` on 2 ranks (``torchrun
--standalone``: gloo, loopback) and ``attn_implementation`` the adapter's gives the logits and the
greedy tokens of one process; each rank runs its half of the heads (2 query heads on 1 KV head)
through the kernels. transformers needs ``accelerate`` for ``tp_plan`` (the test extra has it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")  # CI installs the hf and test extras: these never skip there
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import linalg_prefill.hf as hf  # noqa: E402
from linalg_prefill.mlir import RaggedPrefillSpec, SequencePrefillSpec  # noqa: E402
from linalg_prefill.mlir.decode import DecodeSpec  # noqa: E402

from hf_models import tiny_model  # noqa: E402

#: A rank's kernels: its 2 of the 4 query heads on its 1 of the 2 KV heads (d 16), the prefill's
#: dense kernel and the decode steps' head-major ragged one with its 1-query pass.
RANK_DECODE = RaggedPrefillSpec(2, 1, 16, 16, "float32", kv_order="hnd")
pytestmark = pytest.mark.compiles(SequencePrefillSpec(2, 1, 16, "float32", causal=True, sm_scale=0.25), RANK_DECODE,
                                  DecodeSpec(RANK_DECODE))

RANK_PROGRAM = """
import json, sys
import torch, torch.distributed as dist, transformers
import linalg_prefill.hf as hf

model_dir, out_path = sys.argv[1], sys.argv[2]
heads = set()  # the query heads each attention call of this rank gets


def attention(module, query, *args, **kwargs):
    heads.add(query.shape[1])
    return hf.attention(module, query, *args, **kwargs)


hf.register()
transformers.AttentionInterface.register("rank_attention", attention)
transformers.masking_utils.AttentionMaskInterface.register("rank_attention", hf.attention_mask)
model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", attn_implementation="rank_attention")
ids = torch.tensor([[5, 17, 3, 9, 41, 2, 7, 7, 13, 1, 8, 33, 60, 4, 11, 90, 2, 14, 77]])
with torch.no_grad():
    logits = model(ids).logits.float()
tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, pad_token_id=0,
                        eos_token_id=96)
if dist.get_rank() == 0:
    with open(out_path, "w") as out:
        json.dump(dict(logits=logits.tolist(), tokens=tokens.tolist(), world=dist.get_world_size(),
                       heads=sorted(heads)), out)
dist.barrier()
dist.destroy_process_group()  # a rank that left gloo's group to the interpreter's exit once aborted
"""


def test_a_tensor_parallel_model_gives_the_single_process_logits_and_tokens(tmp_path):
    model = tiny_model("llama3")
    model.save_pretrained(tmp_path / "model")
    program = tmp_path / "rank.py"
    program.write_text(RANK_PROGRAM)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          str(program), str(tmp_path / "model"), str(tmp_path / "out.json")],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert run.returncode == 0, run.stderr[-4000:]
    ranks = json.loads((tmp_path / "out.json").read_text())
    assert ranks["world"] == 2 and ranks["heads"] == [2]  # each rank attends with half of the 4 query heads
    ids = torch.tensor([[5, 17, 3, 9, 41, 2, 7, 7, 13, 1, 8, 33, 60, 4, 11, 90, 2, 14, 77]])
    model.set_attn_implementation(hf.register())
    with torch.no_grad():
        want = model(ids).logits.float()
    want_tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                 pad_token_id=0, eos_token_id=96)
    got = torch.tensor(ranks["logits"])
    assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())  # f32: the all-reduce's order only
    assert ranks["tokens"] == want_tokens.tolist()
