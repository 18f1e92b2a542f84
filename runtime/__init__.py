"""Loading compiled kernels, devices, input checks, plan/run wrappers, backend comparison, the
float64 reference and the error bound a result must meet against it."""

from .artifact_set import ArtifactSet, open_artifacts
from .compare import ComparisonReport, compare_backends, error_bound
from .examples import example_inputs
from .devices import cuda_available, device_available, get_device
from .errors import InputError
from .kernels import Kernel, open_kernel, shared_kernel
from .wrappers import (
    MaskedSequencePrefillWrapper, MlaPagedPrefillWrapper, PagedPrefillWrapper, RaggedPrefillWrapper,
    SequencePrefillWrapper,
)

__all__ = ["ArtifactSet", "open_artifacts", "ComparisonReport", "compare_backends", "error_bound", "example_inputs",
           "cuda_available", "device_available", "get_device", "InputError", "Kernel", "open_kernel", "shared_kernel",
           "MaskedSequencePrefillWrapper", "MlaPagedPrefillWrapper", "PagedPrefillWrapper",
           "RaggedPrefillWrapper", "SequencePrefillWrapper"]
