"""Probe for issue 17's design: a whole batch of short entries as the online-softmax emitter's batch.

    .venv/bin/python bench/serving_probe.py [--batch 32] [--new 1] [--cached 1024] [--kv-tile 64]

Not a kernel of the library: a stand-alone module (f32, h_q=32, h_kv=8, d=128, page size 16,
equal lengths, no causal mask) whose KV loop walks ``kv-tile`` columns of every entry at once:
per step one generic per K and V fetches the tile's pages through the page table
(``tensor.extract`` with the page id read inside the body), then ``online_softmax`` runs with
B = batch. The dispatch count per call depends on the KV length only, not on the batch size.
Prints its time and KV bandwidth next to torch SDPA on the gathered KV in the same run, and the
per-entry paged kernel of the library for the same step (``serving_batches.py`` rows).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

import iree.runtime as rt  # noqa: E402
from iree.compiler import tools  # noqa: E402

from linalg_prefill.mlir.ir import (  # noqa: E402
    DYN, affine_map, arith_d, collapse, const_f32, const_index, dim, empty, expand, extract_slice, f32, func_d,
    generic, i32, index, ir, linalg_d, lt, module_context, tensor_d, tensor_type,
)
from linalg_prefill.mlir.online_softmax import KvTile, ScoreMask, online_softmax  # noqa: E402
from linalg_prefill.pipeline.bench import best_times  # noqa: E402
from linalg_prefill.pipeline.targets import Target  # noqa: E402
from linalg_prefill.pipeline.tuning import apply_tuning  # noqa: E402
from serving_batches import H_KV, H_Q, PAGE_SIZE, D, serving_step, torch_call  # noqa: E402

GROUP = H_Q // H_KV


def build(rows: int, kv_tile: int) -> str:
    """``probe(q [B, h_kv, rows, d], pages, page_table [B, P], kv_len [B]) -> (out, lse)``, P a
    multiple of kv_tile / page size."""
    pages_per_tile = kv_tile // PAGE_SIZE
    with module_context() as module:
        arg_types = [tensor_type([DYN, H_KV, rows, D], f32()), tensor_type([DYN, 2, H_KV, PAGE_SIZE, D], f32()),
                     tensor_type([DYN, DYN], i32()), tensor_type([DYN], i32())]
        results = [tensor_type([DYN, H_KV, rows, D], f32()), tensor_type([DYN, H_KV, rows], f32())]
        with ir.InsertionPoint(module.body):
            fn = func_d.FuncOp("probe", (arg_types, results))
            with ir.InsertionPoint(fn.add_entry_block()):
                q, pages, table, kv_len = fn.arguments
                batch = dim(q, 0)
                flat = collapse(pages, [[0], [1], [2], [3, 4]])  # [P, 2, h_kv, page_size * d]

                def page_rows(ids, which):
                    """[B, h_kv, pages_per_tile, page_size * d]: K (0) or V (1) of the tile's pages."""
                    def body(_out):
                        b, h, p, j = (linalg_d.IndexOp(i).result for i in range(4))
                        page = arith_d.index_cast(index(), tensor_d.extract(ids, [b, p]))
                        return [tensor_d.extract(flat, [page, const_index(which), h, j])]
                    out = empty([batch, H_KV, pages_per_tile, PAGE_SIZE * D], f32())
                    return generic([], [out], [affine_map(4, range(4))], "pppp", body)[0]

                def load(tile):
                    ids = extract_slice(table, [0, arith_d.muli(tile, const_index(pages_per_tile))],
                                        [batch, pages_per_tile])
                    keys = collapse(expand(page_rows(ids, 0), [[0], [1], [2], [3, 4]],
                                           [batch, H_KV, pages_per_tile, PAGE_SIZE, D]), [[0], [1], [2, 3], [4]])
                    values = collapse(expand(page_rows(ids, 1), [[0], [1], [2], [3, 4]],
                                             [batch, H_KV, pages_per_tile, PAGE_SIZE, D]), [[0], [1], [2, 3], [4]])
                    keys_t = generic([keys], [empty([batch, H_KV, D, kv_tile], f32())],
                                     [affine_map(4, (0, 1, 3, 2)), affine_map(4, range(4))], "pppp", lambda x, _o: [x])[0]
                    return KvTile(keys=keys_t, values=values)

                def valid(idx, _extras):
                    length = arith_d.index_cast(index(), tensor_d.extract(kv_len, [idx.b]))
                    return lt(arith_d.addi(idx.kv_start, idx.n), length)

                tiles = arith_d.divui(dim(table, 1), const_index(pages_per_tile))
                result = online_softmax(q, num_kv_tiles=tiles, kv_tile=kv_tile, d_v=D, load_kv_tile=load,
                                        mask=ScoreMask(valid), sm_scale=D ** -0.5, row_chunk=None)
                func_d.ReturnOp([result.output, result.lse])
        module.operation.verify()
        return str(apply_tuning(module, Target("llvm-cpu")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new", type=int, default=1)
    parser.add_argument("--cached", type=int, default=1024)
    parser.add_argument("--kv-tile", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(2)
    target = Target("llvm-cpu")
    vmfb = tools.compile_str(build(GROUP * args.new, args.kv_tile), input_type="auto", extra_args=target.flags())
    config = rt.Config(target.driver)
    context = rt.SystemContext(config=config)
    context.add_vm_module(rt.VmModule.copy_buffer(context.instance, vmfb))
    probe = context.modules.module["probe"]

    rng = np.random.default_rng(0)
    kv_len = args.cached + args.new
    padded = -(-kv_len // args.kv_tile) * args.kv_tile
    step = serving_step(args.batch, args.new, np.full(args.batch, args.cached), "float32", rng)
    per_entry = -(-kv_len // PAGE_SIZE)
    table = np.zeros((args.batch, padded // PAGE_SIZE), np.int32)
    table[:, :per_entry] = step["page_values"].reshape(args.batch, per_entry)
    q = step["q"].reshape(args.batch, args.new, H_KV, GROUP, D).transpose(0, 2, 1, 3, 4)
    q = np.ascontiguousarray(q.reshape(args.batch, H_KV, args.new * GROUP, D))
    pages = rt.asdevicearray(config.device, step["pages"])
    lengths = np.full(args.batch, kv_len, np.int32)
    ours = lambda: probe(q, pages, table, lengths)[0].to_host()  # noqa: E731
    step["kv_lens"] = np.full(args.batch, kv_len)
    peer = torch_call(step, args.new, "float32")
    ours_s, peer_s = best_times([ours, peer], args.repeat)
    if args.new == 1:  # the causal mask of torch's call hides nothing then: the same attention
        out = ours().reshape(args.batch, H_Q, 1, D)
        print(f"max |probe - torch| = {np.abs(out - peer().numpy()).max():.1e}")
    kv_bytes = args.batch * kv_len * 2 * H_KV * D * 4
    print(f"probe {args.batch} x {args.new} new vs {args.cached} cached, kv tile {args.kv_tile}: "
          f"{ours_s * 1e3:.1f} ms ({kv_bytes / ours_s / 1e9:.2f} GB/s); torch SDPA {peer_s * 1e3:.1f} ms "
          f"({kv_bytes / peer_s / 1e9:.2f} GB/s); ratio {peer_s / ours_s:.2f}")


if __name__ == "__main__":
    main()
