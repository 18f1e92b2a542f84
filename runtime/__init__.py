"""Loading compiled kernels, devices, input checks, plan/run wrappers, backend comparison, and the
float64 reference."""

from .artifact_set import ArtifactSet, open_artifacts
from .compare import ComparisonReport, compare_backends
from .examples import example_inputs
from .devices import cuda_available, device_available, get_device
from .errors import InputError
from .kernels import Kernel, open_kernel
from .wrappers import (
    MaskedSequencePrefillWrapper, MlaPagedPrefillWrapper, PagedPrefillWrapper, RaggedPrefillWrapper,
    SequencePrefillWrapper,
)

__all__ = ["ArtifactSet", "open_artifacts", "ComparisonReport", "compare_backends", "example_inputs",
           "cuda_available", "device_available", "get_device", "InputError", "Kernel", "open_kernel",
           "MaskedSequencePrefillWrapper", "MlaPagedPrefillWrapper", "PagedPrefillWrapper",
           "RaggedPrefillWrapper", "SequencePrefillWrapper"]
