"""The least host work for a planned call that is one serving pass call over its rows in order
(runtime/decode.py: ``DecodeSchedule.in_order``; a decode step, one query an entry): what the plan
fixes (the pass, its table and geometry in the device's memory, the scalars, where each argument
sits) is prepared once per plan, and a layer's call is its q reshaped, its K/V sources, the IREE
call and one copy of each result.

A decode step through transformers runs one such call per layer under the same plan. Against
the general path (the call's arguments by name, the schedule looked up, the pass's arguments
gathered, its table and geometry imported again) a wrapper's call saves about 0.02 ms of host
work between the model's layers; linalg_prefill/hf.py's step lane, which calls :meth:`PassLane.run`
straight with a layer's tensors, skips the wrapper's path as well: 0.41 -> 0.24 ms a layer
(docs/performance.md, ninth session).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..mlir.abi import argument_names, kv_sources
from .checks import on_host
from .decode import PassCall
from .module import LoadedKernel, aligned_empty, as_device_arrays


@dataclass(frozen=True)
class PassLane:
    """One plan's in-order pass call, ready to run a layer: ``loaded`` the pass, ``q_shape`` its q
    ``[n, h_kv, R, d_qk]`` (the call's q ``[tokens, h_q, d_qk]`` reshaped), ``fixed`` its
    arguments after the KV sources (table and geometry as device arrays, causal, sm_scale),
    ``head_sinks`` whether sinks follow them; ``out_shape`` ``[tokens, h_q, d_v]`` and ``lse_shape``
    ``[tokens, h_q]``; ``positions``: where q, the KV sources and the sinks sit in the seed's
    argument order (:meth:`run_args`); ``lse_scratch``: the pass's lse ``[n, h_kv, R]`` for calls
    that do not keep it (``with_lse=False``), written and never read, where the pass writes its
    results in place (LoadedKernel.writes_in_place; else None)."""

    loaded: LoadedKernel
    q_shape: tuple
    fixed: tuple
    head_sinks: bool
    out_shape: tuple
    lse_shape: tuple
    positions: tuple
    lse_scratch: np.ndarray | None = None

    @classmethod
    def of(cls, spec, loaded: LoadedKernel, scheduled: PassCall, tokens: int, scalars: dict) -> "PassLane":
        """The lane of ``scheduled`` (an in-order PassCall of a plan) for calls of ``spec`` with
        ``tokens`` query rows under the plan's ``scalars`` (by ABI name: causal, sm_scale)."""
        names = argument_names(spec)
        table, geometry = as_device_arrays(loaded.device, [scheduled.table, scheduled.geometry])
        sources = tuple(names.index(arg.name) for arg in kv_sources(spec))
        sinks = (names.index("sinks"),) if spec.head_sinks else ()
        q_shape = scheduled.q_shape(spec.d_qk)
        scratch = aligned_empty(q_shape[:-1], np.float32) if loaded.writes_in_place else None
        return cls(loaded, q_shape, PassCall.fixed_arguments(scalars, table, geometry),
                   spec.head_sinks, (tokens, spec.h_q, spec.d_v), (tokens, spec.h_q),
                   (names.index("q"), sources, sinks), scratch)

    def run(self, q: np.ndarray, sources: tuple, sinks=None, with_lse: bool = True,
            out: np.ndarray | None = None) -> tuple:
        """``(output [tokens, h_q, d_v], lse [tokens, h_q] float32)``, numpy arrays of their own
        (lse None unless ``with_lse``), for ``q [tokens, h_q, d_qk]`` and the KV sources in the
        variant's order (its KV tensors, then an 8-bit cache's scales) and, for a ``head_sinks``
        spec, ``sinks``: every one checked by the caller, as Kernel.launch takes them (no checks
        here). ``out``: an array ``[tokens, h_q, d_v]`` of the output's dtype the pass writes the
        output into where it can (LoadedKernel._call_into: C-contiguous, 64-byte aligned), which
        is then the output returned (else a new array is)."""
        args = (q.reshape(self.q_shape), *sources, *self.fixed, *((sinks,) if self.head_sinks else ()))
        into = () if out is None else (out.reshape(*self.q_shape[:-1], -1),)
        if with_lse:
            return self.loaded.consume(self._copied, *args, into=into)
        if self.lse_scratch is not None:
            into = (into[0] if into else None, self.lse_scratch)
        return self.loaded.consume(self._output, *args, results=1, into=into), None

    def run_args(self, args: tuple) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`run` for a call's checked arguments in the seed's order."""
        q_at, sources, sinks = self.positions
        return self.run(np.asarray(on_host(args[q_at])), tuple(args[i] for i in sources),
                        args[sinks[0]] if sinks else None)

    def _copied(self, output: np.ndarray, lse: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self._own(output.reshape(self.out_shape)), self._own(lse.reshape(self.lse_shape))

    def _output(self, output: np.ndarray) -> np.ndarray:
        return self._own(output.reshape(self.out_shape))

    def _own(self, result: np.ndarray) -> np.ndarray:
        """``result`` as an array the caller may keep: itself where the call wrote it into an
        array of its own (LoadedKernel.writes_in_place), else a copy of IREE's buffer."""
        return result if self.loaded.writes_in_place else np.array(result)
