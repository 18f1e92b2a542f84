"""The malformed-call catalogue, run in a child process by ``test_malformed_catalogue.py``.

Every case makes one bad call through the public API, at the seed-ABI level (``Kernel.__call__``)
or through a plan/run wrapper, on real compiled llvm-cpu kernels whose launch is replaced by a
tripwire (:class:`KernelLaunched`): a case passes when it raises one of the library's own
``ValueError`` subclasses naming the argument, which proves the check ran before any kernel. The
valid calls next to them (the ``control`` cases) must hit the tripwire, which proves it is armed.

    python tests/malformed_catalogue.py     # one JSON line per case, then {"done": N}

Choices the catalogue documents: non-contiguous arrays are accepted (copied), not rejected; a batch
with no entries (indptr ``[0]``, ``B = 0``) is a valid call with empty outputs, while an indptr
with no element at all is malformed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

import iree.runtime as rt  # noqa: E402
import numpy as np  # noqa: E402

import test_kv_checks as kv  # noqa: E402 (valid KV-cache calls and their 80 check-level cases)
from linalg_prefill.mlir import MaskedSequencePrefillSpec, SequencePrefillSpec  # noqa: E402
from linalg_prefill.runtime import (  # noqa: E402
    MaskedSequencePrefillWrapper, MlaPagedPrefillWrapper, PagedPrefillWrapper, RaggedPrefillWrapper,
    SequencePrefillWrapper, open_kernel,
)
from linalg_prefill.runtime.module import LoadedKernel  # noqa: E402

I32 = np.int32


class KernelLaunched(Exception):
    """Raised instead of running a kernel: a malformed call got past the checks."""


class Case(NamedTuple):
    id: str
    argument: str  # the name the error message must start with; "" for a control case
    call: Callable[[], object]


def _refuse_launch(self, *args, **kwargs):
    raise KernelLaunched(self.symbol)


# ----------------------------------------------------------------------------- kernels


_KERNELS: dict = {}


def kernel(spec):
    if spec not in _KERNELS:
        _KERNELS[spec] = open_kernel(spec)
    return _KERNELS[spec]


SEQ = SequencePrefillSpec(4, 2, 32, "float32", causal=True, sm_scale=32 ** -0.5)
MASKED = MaskedSequencePrefillSpec(4, 2, 32, "float32", mask_mode="padded", sm_scale=32 ** -0.5)


def dense_args(rng=None) -> dict:
    rng = rng or np.random.default_rng(0)
    q = rng.uniform(-1, 1, (2, 9, 4, 32)).astype(np.float32)
    k, v = (rng.uniform(-1, 1, (2, 7, 2, 32)).astype(np.float32) for _ in range(2))
    return dict(q=q, k=k, v=v)


def abi(spec, args: dict, **changes) -> Callable[[], object]:
    """A call of ``spec``'s kernel with ``args`` (ABI order) after ``changes``."""
    return lambda: kernel(spec)(*{**args, **changes}.values())


# ----------------------------------------------------------------------------- ABI-level cases


def abi_cases() -> list[Case]:
    cases = []
    # The KV-cache check catalogue of test_kv_checks, now through Kernel.__call__ on compiled kernels
    # (the odd-head-dim cases need specs of their own and stay at the check level).
    for param in kv.MALFORMED:
        variant, name, override, spec_fields = param.values
        if spec_fields:
            continue
        spec = kv.make_spec(variant)
        args = kv.build(variant, spec)
        args.update(override(args))
        cases.append(Case(f"abi-{param.id}", name, abi(spec, args)))
    d = dense_args()
    masked = dict(d, q=d["q"][:, :7], valid_lens=np.array([7, 0], I32))
    elsewhere = rt.get_device("local-sync")  # a second device: arrays on it do not belong to the kernel
    cases += [
        Case("abi-seq-q-float64", "q", abi(SEQ, d, q=d["q"].astype(np.float64))),
        Case("abi-seq-q-rank3", "q", abi(SEQ, d, q=d["q"][0])),
        Case("abi-seq-k-heads", "k", abi(SEQ, d, k=np.concatenate([d["k"], d["k"]], axis=2))),
        Case("abi-seq-v-d", "v", abi(SEQ, d, v=d["v"][..., :16])),
        Case("abi-seq-k-batch", "k.shape[0]", abi(SEQ, d, k=d["k"][:1])),
        Case("abi-seq-v-kv_len", "v.shape[1]", abi(SEQ, d, v=d["v"][:, :5])),
        Case("abi-seq-q-not-an-array", "q", abi(SEQ, d, q=object())),
        Case("abi-seq-q-ragged-list", "q", abi(SEQ, d, q=[[1.0], [1.0, 2.0]])),
        Case("abi-seq-v-other-device", "v", abi(SEQ, d, v=rt.asdevicearray(elsewhere, d["v"]))),
        Case("abi-seq-q-device-dtype", "q", abi(SEQ, d, q=rt.asdevicearray(kernel(SEQ).device, d["k"].astype(np.float16)))),
        Case("abi-masked-valid_lens-float", "valid_lens", abi(MASKED, masked, valid_lens=np.array([7.0, 0.0]))),
        Case("abi-masked-valid_lens-past-int32", "valid_lens", abi(MASKED, masked, valid_lens=np.array([7, 1 << 35]))),
        Case("abi-masked-valid_lens-negative", "valid_lens", abi(MASKED, masked, valid_lens=np.array([-1, 0], I32))),
        Case("abi-masked-valid_lens-beyond", "valid_lens", abi(MASKED, masked, valid_lens=np.array([8, 0], I32))),
        Case("abi-masked-valid_lens-length", "valid_lens", abi(MASKED, masked, valid_lens=np.array([7], I32))),
    ]
    return cases


def spec_cases() -> list[Case]:
    """Specs are checked when they are made, before anything compiles."""
    return [
        Case("spec-h_q-not-multiple-of-h_kv", "h_q", lambda: SequencePrefillSpec(6, 4, 32, "float32", True, 0.1)),
        Case("spec-dtype-float64", "dtype", lambda: SequencePrefillSpec(4, 4, 32, "float64", True, 0.1)),
        Case("spec-mask_mode", "mask_mode", lambda: MaskedSequencePrefillSpec(4, 4, 32, "float32", "causal", 0.1)),
        Case("spec-page_size-0", "page_size", lambda: kv.make_spec("paged", page_size=0)),
        Case("spec-rope-type", "rope_scaling", lambda: kv.make_spec("ragged", rope_scaling={"rope_type": "ntk"})),
        Case("spec-d-0", "d", lambda: SequencePrefillSpec(4, 4, 0, "float32", True, 0.1)),
        Case("spec-sm_scale-nan", "sm_scale", lambda: SequencePrefillSpec(4, 4, 32, "float32", True, float("nan"))),
        Case("spec-logits_soft_cap-negative", "logits_soft_cap",
             lambda: kv.make_spec("paged", logits_soft_cap=-30.0)),
        Case("spec-rotary_dim-odd", "rotary_dim", lambda: kv.make_spec("ragged", rotary_dim=7)),
        Case("spec-rotary_dim-too-wide", "rotary_dim", lambda: kv.make_spec("paged", rotary_dim=1024)),
    ]


# ----------------------------------------------------------------------------- wrapper-level cases


def _plan_args(variant: str, args: dict) -> tuple[tuple, dict]:
    """(positional, keyword) plan arguments from a valid ABI argument dict of ``variant``."""
    if variant == "ragged":
        return (args["q_indptr"], args["kv_indptr"]), dict(causal=1, rope=dict(rope_scale=1.0, rope_theta=1e4))
    table = (args["q_indptr"], args["page_indptr"], args["page_values"], args["length_info"])
    if variant.startswith("mla"):
        return table, dict(causal=1, sm_scale=0.2)
    return table, dict(causal=0, rope=dict(rope_scale=2.0, rope_theta=5e5))


WRAPPERS = {"ragged": RaggedPrefillWrapper, "paged": PagedPrefillWrapper, "paged_sw": PagedPrefillWrapper,
            "mla": MlaPagedPrefillWrapper}
_WRAPPED: dict = {}


def wrapper(variant: str):
    if variant not in _WRAPPED:
        _WRAPPED[variant] = WRAPPERS[variant](kv.make_spec(variant))
    return _WRAPPED[variant]


def plan_case(case_id: str, argument: str, variant: str, *, kw: dict | None = None, **changes) -> Case:
    """A plan() call of ``variant``'s wrapper with the valid table after ``changes``."""
    def call():
        args = {**kv.build(variant, kv.make_spec(variant)), **changes}
        positional, keywords = _plan_args(variant, args)
        return wrapper(variant).plan(*positional, **{**keywords, **(kw or {})})
    return Case(case_id, argument, call)


def run_case(case_id: str, argument: str, variant: str, **changes) -> Case:
    """A valid plan(), then run() with the layer tensors after ``changes``."""
    def call():
        args = kv.build(variant, kv.make_spec(variant))
        positional, keywords = _plan_args(variant, args)
        w = wrapper(variant)
        w.plan(*positional, **keywords)
        tensors = {**{k: args[k] for k in (("q", "k", "v") if variant == "ragged" else ("q", "pages"))}, **changes}
        return w.run(*tensors.values())
    return Case(case_id, argument, call)


def wrapper_cases() -> list[Case]:
    ragged = kv.build("ragged", kv.make_spec("ragged"))
    paged = kv.build("paged", kv.make_spec("paged"))
    d = dense_args()
    seq = SequencePrefillWrapper(SEQ)
    masked = MaskedSequencePrefillWrapper(MASKED)

    def masked_run(valid_lens, q_len=7):
        masked.plan(np.array(valid_lens, I32))
        return masked.run(d["q"][:, :q_len], d["k"], d["v"])

    return [
        plan_case("wrap-ragged-q_indptr-decreasing", "q_indptr", "ragged", q_indptr=np.array([0, 3, 2, 6], I32)),
        plan_case("wrap-ragged-q_indptr-start", "q_indptr", "ragged", q_indptr=np.array([1, 3, 4, 6], I32)),
        plan_case("wrap-ragged-no-batch-array", "q_indptr", "ragged", q_indptr=np.zeros(0, I32)),
        plan_case("wrap-ragged-kv_indptr-length", "kv_indptr", "ragged", kv_indptr=np.array([0, 6], I32)),
        plan_case("wrap-ragged-causal-2", "causal", "ragged", kw=dict(causal=2)),
        plan_case("wrap-ragged-rope_theta-nan", "rope_theta", "ragged",
                  kw=dict(rope=dict(rope_scale=1.0, rope_theta=float("nan")))),
        plan_case("wrap-ragged-sm_scale-inf", "sm_scale", "ragged", kw=dict(sm_scale=float("inf"))),
        run_case("wrap-ragged-q-rows", "q", "ragged", q=ragged["q"][:5]),
        run_case("wrap-ragged-k-dtype", "k", "ragged", k=ragged["k"].astype(np.float16)),
        run_case("wrap-ragged-v-d_v", "v", "ragged", v=ragged["v"][..., :4]),
        run_case("wrap-ragged-k-other-device", "k", "ragged",
                 k=rt.asdevicearray(rt.get_device("local-sync"), ragged["k"])),
        plan_case("wrap-paged-page_values-negative", "page_values", "paged", page_values=np.array([4, -1, 5, 0, 2], I32)),
        plan_case("wrap-paged-last_page_len-0", "length_info", "paged", length_info=np.array([0, 0, 4], I32)),
        plan_case("wrap-paged-last_page_len-big", "length_info", "paged",
                  length_info=np.array([3, 0, kv.PAGE_SIZE + 1], I32)),
        plan_case("wrap-paged-page_indptr-overrun", "page_indptr", "paged", page_indptr=np.array([0, 2, 2, 6], I32)),
        plan_case("wrap-paged-positions-overflow", "k_rope_pos_offset", "paged",
                  kw=dict(k_rope_pos_offset=np.array([0, 0, 2**31 - 5], I32))),
        plan_case("wrap-paged_sw-offset-beyond", "length_info", "paged_sw",
                  length_info=np.array([kv.LAST_PAGE_LEN, [8, 99, 6], kv.SINK], I32)),
        plan_case("wrap-paged-rotary-via-rope-scale", "rope_scale", "paged",
                  kw=dict(rope=dict(rope_scale=float("-inf"), rope_theta=1e4))),
        run_case("wrap-paged-too-few-pages", "pages", "paged", pages=paged["pages"][:3]),
        run_case("wrap-paged-pages-page_size", "pages", "paged", pages=paged["pages"][:, :, :, :2]),
        plan_case("wrap-mla-causal-2", "causal", "mla", kw=dict(causal=2)),
        plan_case("wrap-mla-sm_scale-nan", "sm_scale", "mla", kw=dict(sm_scale=float("nan"))),
        Case("wrap-seq-q-heads", "q", lambda: seq.run(d["q"][:, :, :2], d["k"], d["v"])),
        Case("wrap-seq-v-batch", "v", lambda: seq.run(d["q"], d["k"], d["v"][:1])),
        Case("wrap-masked-valid_lens-negative", "valid_lens", lambda: masked_run([-1, 0])),
        Case("wrap-masked-valid_lens-beyond-layer", "valid_lens", lambda: masked_run([7, 7], q_len=5)),
        Case("wrap-masked-q-batch", "q", lambda: masked_run([1, 2, 3])),
    ]


def control_cases() -> list[Case]:
    """Valid calls: each must reach the (disarmed) kernel launch."""
    controls = []
    for variant in ("ragged", "paged", "paged_sw", "mla", "mla_sw"):
        spec = kv.make_spec(variant)
        controls.append(Case(f"control-abi-{variant}", "", abi(spec, kv.build(variant, spec))))
    for variant in ("ragged", "paged", "mla"):
        controls.append(run_case(f"control-wrap-{variant}", "", variant))
    d = dense_args()
    controls.append(Case("control-abi-seq-non-contiguous", "", abi(SEQ, d, q=np.asfortranarray(d["q"]))))
    controls.append(Case("control-abi-masked", "", abi(MASKED, dict(d, q=d["q"][:, :7], valid_lens=np.array([7, 0], I32)))))
    return controls


def run_all() -> int:
    LoadedKernel._invoke = _refuse_launch  # every launch (a call, or LoadedKernel.consume) goes through it
    cases = spec_cases() + abi_cases() + wrapper_cases() + control_cases()
    for case in cases:
        try:
            case.call()
            outcome = dict(error=None, message="returned without an error")
        except KernelLaunched:
            outcome = dict(error="KernelLaunched", message="")
        except Exception as err:  # noqa: BLE001 - the test judges every outcome
            outcome = dict(error=type(err).__name__, module=type(err).__module__,
                           value_error=isinstance(err, ValueError), message=str(err))
        print(json.dumps(dict(id=case.id, argument=case.argument, **outcome)), flush=True)
    print(json.dumps(dict(done=len(cases))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_all())
