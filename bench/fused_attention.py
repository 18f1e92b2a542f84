"""IREE's own fused ``iree_linalg_ext.attention`` op, built with the typed bindings, for comparison.

Only a measured alternative (DEVELOPERS.md): non-causal, f32, [B*H, L, d] layout.
"""

from __future__ import annotations

from linalg_prefill.mlir.ir import affine_map, const_f32, empty, f32, func_d, ir, module_context, tensor_type


def build_fused_attention(batch_heads: int, length: int, d: int) -> str:
    """MLIR text of ``attention(q, k, v) -> out``, all [batch_heads, length, d] f32, scale d^-0.5."""
    with module_context() as module:
        t = tensor_type([batch_heads, length, d], f32())
        with ir.InsertionPoint(module.body):
            fn = func_d.FuncOp("attention", ([t, t, t], [t]))
            with ir.InsertionPoint(fn.add_entry_block()):
                q, k, v = fn.arguments
                out = empty([batch_heads, length, d], f32())
                # loops (b, m, k1, k2, n): q (b,m,k1), k (b,k2,k1), v (b,k2,n), scale (), out (b,m,n)
                maps = [affine_map(5, (0, 1, 2)), affine_map(5, (0, 3, 2)), affine_map(5, (0, 3, 4)),
                        ir.AffineMap.get(5, 0, []), affine_map(5, (0, 1, 4))]
                op = ir.Operation.create(
                    "iree_linalg_ext.attention",
                    results=[t],
                    operands=[q, k, v, const_f32(d ** -0.5), out],
                    attributes={
                        "indexing_maps": ir.ArrayAttr.get([ir.AffineMapAttr.get(m) for m in maps]),
                        "operandSegmentSizes": ir.DenseI32ArrayAttr.get([1, 1, 1, 1, 0, 1]),
                    },
                    regions=1,
                )
                block = op.regions[0].blocks.append(f32())
                with ir.InsertionPoint(block):
                    ir.Operation.create("iree_linalg_ext.yield", operands=[block.arguments[0]])
                func_d.ReturnOp([op.result])
        module.operation.verify()
        return str(module)
