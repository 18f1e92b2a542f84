"""What a call returns, given what it was called with.

    numpy arrays (or lists) in  -> numpy arrays out
    torch CPU tensors in        -> torch tensors out, same dtype (bfloat16 as torch.bfloat16),
                                   sharing the result's memory (torch.from_numpy, no copy)
    IREE DeviceArrays in        -> DeviceArrays out (the results stay on the device)

An explicit ``to_host=True`` / ``False`` overrides the device rule. Inputs are read the other way
round by ``checks.as_array`` (torch CPU tensors through ``.numpy()``, no copy).
"""

from __future__ import annotations

import functools
from typing import Any, Iterable

import iree.runtime as rt
import ml_dtypes
import numpy as np


def is_torch(value: Any) -> bool:
    """A torch tensor, recognised without importing torch."""
    return type(value).__module__.split(".")[0] == "torch" and hasattr(value, "detach")


def results_to_host(inputs: Iterable[Any], to_host: bool | None) -> bool:
    """``to_host`` when given, else True unless an input is an IREE DeviceArray."""
    if to_host is not None:
        return to_host
    return not any(isinstance(value, rt.DeviceArray) for value in inputs)


def like_inputs(inputs: Iterable[Any], results: tuple) -> tuple:
    """Host ``results`` as torch tensors when an input was a torch tensor, else unchanged."""
    if not any(is_torch(value) for value in inputs):
        return results
    return tuple(to_torch(np.asarray(result)) for result in results)


def to_torch(array: np.ndarray):
    """A torch tensor sharing ``array``'s memory (bfloat16 through an int16 view)."""
    import torch

    array = np.ascontiguousarray(array)
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def returns_like_inputs(run):
    """For a wrapper's ``run(self, *tensors, to_host=None, **options)``: results placed as
    :func:`results_to_host` decides from the positional tensors and typed as :func:`like_inputs`
    makes them; keyword ``options`` (``sinks``) pass through. Results written into the caller's
    ``out`` / ``lse`` come back as the caller's objects (runtime/outputs.py)."""

    @functools.wraps(run)
    def wrapped(self, *tensors, to_host: bool | None = None, **options):
        given = options.get("out") is not None or options.get("lse") is not None
        host = True if given and to_host is None else results_to_host(tensors, to_host)
        results = run(self, *tensors, to_host=host, **options)
        return like_inputs(tensors, results) if host and not given else results

    return wrapped
