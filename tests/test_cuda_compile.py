"""Every variant must compile for CUDA, even on a machine without a GPU (compile only)."""

import pytest

from linalg_prefill.mlir import (
    MaskedSequencePrefillSpec, MlaPagedPrefillSpec, PagedPrefillSpec, RaggedPrefillSpec, SequencePrefillSpec,
)
from linalg_prefill.pipeline import Target, compile

CUDA_SPECS = [
    SequencePrefillSpec(32, 8, 128, "float16", causal=True, sm_scale=128 ** -0.5),
    SequencePrefillSpec(6, 1, 64, "float32", causal=False, sm_scale=0.125),
    SequencePrefillSpec(4, 4, 128, "bfloat16", causal=True, sm_scale=0.1),
    MaskedSequencePrefillSpec(8, 2, 64, "float16", mask_mode="padded", sm_scale=0.125),
    MaskedSequencePrefillSpec(8, 2, 128, "bfloat16", mask_mode="causal_padded_left", sm_scale=0.1),
    RaggedPrefillSpec(32, 8, 128, 128, "float16", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    RaggedPrefillSpec(16, 16, 192, 128, "bfloat16"),
    PagedPrefillSpec(32, 8, 128, "float16", page_size=16),
    PagedPrefillSpec(32, 8, 128, "float16", page_size=16, sliding_window=True),
    PagedPrefillSpec(8, 1, 64, "float32", page_size=1, rope_scaling={"rope_type": "gptj"}),
    MlaPagedPrefillSpec(16, 512, 64, "float16", page_size=16),
    MlaPagedPrefillSpec(16, 512, 64, "bfloat16", page_size=64, sliding_window=True),
]


@pytest.mark.parametrize("spec", CUDA_SPECS, ids=lambda s: s.name)
def test_compiles_for_cuda_sm80(spec, cache):
    vmfb = compile(spec, Target("cuda", "sm_80"), cache=cache)
    assert vmfb[:2] == b"PK"  # a vmfb is a zip-framed flatbuffer
    assert spec.symbol.encode() in vmfb and b"cuda" in vmfb
