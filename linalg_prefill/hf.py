"""transformers models on the kernels: an attention function and a mask function.

    import linalg_prefill.hf
    name = linalg_prefill.hf.register()          # "linalg_prefill"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=name)
    model.set_attn_implementation(name)          # or on a loaded model

transformers calls :func:`attention` from every attention layer with the rotated ``query
[B, H_q, S_q, D]`` (a transposed view of ``[B, S_q, H_q, D]``), ``key`` and ``value
[B, H_kv, S_kv, D]`` (the cache's head-major tensors) and the mask :func:`attention_mask` built
for that layer type (a boolean ``[B, 1, S_q, S_kv]``, or None for a plain causal prefill or a
decode step without padding). It returns ``(output [B, S_q, H_q, D], None)``, contiguous.
gpt-oss's per-head sinks arrive as ``s_aux [H_q]`` and run as the kernels' ``sinks`` (semantics
§13), in float32 whatever the model's dtype.

Which kernel runs (RoPE off: the model rotated q and k already):

* a decode step (one query a row) of several sequences whose queries all see the same keys
  (no padding; a binding window's range is the same for every row): one ragged call with the
  batch folded into the heads, ``B x H_q`` query heads over ``B x H_kv`` KV heads, the cache's
  ``[B, H_kv, S_kv, D]`` tensors read as ``[B x H_kv, S_kv, D]`` (the same memory): query head
  ``b H_q + h`` sees KV head ``b H_kv + h / G``, row b's own (a kernel per batch size);
* a decode step of several sequences whose keys differ (padding): one ragged call per batch row
  over that row's own head-major cache tensors, its keys one range (no copy);
* no mask and no binding window: for one sequence's decode step or short chunk (at most 16
  queries), the ragged kernel over the cache's head-major K/V rows as DynamicCache holds them
  (``kv_order="hnd"``, no copy; the serving passes run it); else the dense kernel
  (``SequencePrefillSpec``, bottom-right causal when ``module.is_causal``), on ``q`` as it lies
  and K/V copied token-major (a prefill's copy is O(S) against its O(S^2) work);
* a mask (or a binding window) whose every query sees one contiguous range of keys: the paged
  kernel's sliding-window variant over one paged copy of K/V, with the query groups and key
  ranges of :mod:`linalg_prefill.runtime.key_ranges`: left and right padding, chunked prefill,
  per-layer sliding windows and packed sequences are all ranges of keys;
* a mask with holes (a query sees keys that are not one range: a speculative-decoding tree, a
  per-pair boolean mask): the ragged kernel with ``custom_mask`` (semantics §14), one entry per
  batch row whose mask block is that row's ``[S_q, S_kv]`` mask, over K/V copied token-major.

:class:`KvCache` (linalg_prefill/hf_cache.py), a DynamicCache whose decode steps write their
keys into buffers with room instead of copying the cache: the decode paths above read its views
where they lie (the rows past the tokens an entry without queries).

A decode call's later calls of the same shapes (the step's other layers, and the next steps')
run on the first one's plan and its serving pass's prepared arguments, without its planning and
checks again (:class:`_StepLane`).

An 8-bit cache (:class:`Fp8KvCache`, transformers' fp8 ``QuantizedCache`` whose layers hand over
their stored e4m3 states with the scale): the decode paths above read them in place (the ragged
kernel with ``kv_dtype``, semantics §15); the others widen them first, as transformers does.

K and V of different head dims (MLA as transformers runs DeepSeek V2/V3: d_qk 192, d_v 128): the
ragged kernels take both; the dense and paged ones one, V zero-padded and its padding's output
columns cut off. What some models add beyond these arguments (DeepSeek Sparse Attention's
``indices``: folded into the mask, a decode step's chosen keys gathered; DeepSeek V4's additive
mask; the arguments and models refused) is :mod:`linalg_prefill.hf_model_arguments`'s.

A query that sees no key gives 0 (never NaN).

Kernels are compiled once per distinct spec (head counts, head dim, dtype, soft cap, sinks, the
dense kernel's causality and scale, and which of the three runs) and cached in the process and on disk
(``LINALG_PREFILL_CACHE_DIR``). GQA runs without expanding K/V. Needs torch and transformers:
``pip install 'linalg-prefill[hf]'``.
"""

from __future__ import annotations

try:
    import torch
    from transformers import AttentionInterface, QuantizedCache
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
except ImportError as err:  # pragma: no cover - exercised by tests/test_hf_import.py in a subprocess
    raise ImportError("linalg_prefill.hf needs torch and transformers: pip install 'linalg-prefill[hf]' "
                      f"({err})") from err

import atexit
from dataclasses import dataclass, replace
import weakref

try:
    from transformers.cache_utils import Fp8QuantizedLayer
except ImportError:  # pragma: no cover - a transformers before its fp8 cache (5.24 has it): no Fp8KvCache
    Fp8QuantizedLayer = object

import numpy as np

from . import hf_batching, hf_model_arguments
from .hf_cache import KvCache, appended
from .mlir import PagedPrefillSpec, RaggedPrefillSpec, SequencePrefillSpec
from .mlir.specs import KV_DTYPES, SMALL_Q_TILE
from .runtime import InputError
from .runtime.checks import as_array, check_scale
from .runtime.interop import to_torch
from .runtime.key_ranges import Entries, key_ranges, paged_arguments, plan_entries, rule_ranges
from .torch_ops import DTYPES, kernel_for

__all__ = ["register", "attention", "attention_mask", "plan_call", "KernelCall", "kernel_for", "DEFAULT_NAME",
           "Fp8KvCache", "KvCache"]

DEFAULT_NAME = "linalg_prefill"
#: Page size of the paged copy of K/V the masked path reads (a compile-time field of its kernel).
PAGE_SIZE = 16


def register(name: str = DEFAULT_NAME) -> str:
    """Registers :func:`attention` with transformers' ``AttentionInterface`` and
    :func:`attention_mask` with its ``AttentionMaskInterface`` under ``name``, and lets
    continuous batching (``generate_batch``, ``init_continuous_batching``) run it on the
    engine's paged cache in place (:mod:`linalg_prefill.hf_batching`); returns ``name`` for
    ``attn_implementation=``."""
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, attention_mask)
    hf_batching.install(name)
    return name


#: Both functions run outside torch.compile's graphs (a graph break each): they plan on the host
#: with numpy and build and call IREE kernels, which dynamo cannot trace (``torch.compile(model)``
#: failed inside the MLIR bindings while building a kernel); the model's other layers compile.
@torch.compiler.disable
def attention_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                   mask_function=None, attention_mask=None, local_size: int | None = None,
                   allow_is_causal_skip: bool = True, **kwargs):
    """transformers' mask interface: the boolean mask of ``sdpa_mask``, or None where the mask is
    the plain bottom-right causal one (``q_length == kv_length`` or 1, no padding, no binding
    window). sdpa's other shortcut (a static cache's empty tail under a top-left causal mask) is
    not taken: :func:`attention` aligns causal masks bottom-right. A model whose code computes
    attention itself is refused (:func:`linalg_prefill.hf_model_arguments.check_model`); one
    whose attention code computes with its mask as eager's (``kwargs["config"]``: DeepSeek V4,
    :data:`linalg_prefill.hf_model_arguments.ADDITIVE_MASK_MODELS`) gets eager's additive float
    mask of ``kwargs["dtype"]``, never None."""
    allow = allow_is_causal_skip and (q_length == kv_length or q_length == 1)
    extra = {key: value for key, value in kwargs.items() if key in ("use_vmap", "device")}
    if mask_function is not None:
        extra["mask_function"] = mask_function
    hf_model_arguments.check_model(kwargs.get("config"))
    if hf_model_arguments.wants_additive_mask(kwargs.get("config")):
        return eager_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                          kv_offset=kv_offset, attention_mask=attention_mask, local_size=local_size,
                          dtype=kwargs.get("dtype") or torch.float32, **extra)
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, attention_mask=attention_mask, local_size=local_size,
                     allow_is_causal_skip=allow, **extra)


@dataclass(frozen=True)
class KernelCall:
    """The kernel calls of an attention layer: ``spec``, its seed-ABI ``args`` (torch tensors and
    int32 numpy index arrays) and the ``[B, S_q, H_q, D]`` shape its output takes; or, for a
    decode step of several sequences, ``rows``: the args of one call per batch row (each over
    that row's own cache tensors), whose outputs are the output's rows (``args`` then empty).
    ``value_dim``: where the kernel's head dim is wider than V's (V zero-padded for a kernel of one
    head dim), the output's, whose first columns :meth:`run` returns; 0 otherwise."""

    spec: object
    args: tuple
    output_shape: tuple
    rows: tuple = ()
    value_dim: int = 0

    def run(self):
        """``output [B, S_q, H_q, D]``, contiguous. A decode step of one sequence runs as a
        wrapper's plan and run (hf_batching.planned_decode): every layer of a step shares the
        plan, so the index arrays are checked and the serving schedule worked out once a step
        (and the calls after it of the same shapes take :meth:`step_lane`'s lane instead)."""
        if self.rows:
            kernel = kernel_for(self.spec)
            output = self.rows[0][0].new_empty(self.output_shape)
            for row, args in zip(output, self.rows):
                kernel(*args, out=row.view(*args[0].shape[:-1], row.shape[-1]))
            return output
        if isinstance(self.spec, RaggedPrefillSpec) and self.spec.kv_order == "hnd":
            return hf_batching.planned_decode(self.spec, self.args).view(self.output_shape)
        output, _lse = kernel_for(self.spec)(*self.args)
        return self.value_columns(output.view(self.output_shape))

    def value_columns(self, output):
        """``output`` (the kernel's, viewed as ``output_shape``) without V's padding columns: its
        first ``value_dim`` columns, contiguous, where V was zero-padded; else as it is."""
        return output[..., :self.value_dim].contiguous() if self.value_dim else output

    def step_lane(self, signature: tuple, window) -> "_StepLane | None":
        """The :class:`_StepLane` this call leaves for the later calls of ``signature`` (a
        planned decode call that ran on its kernel's PassLane; ``window`` its sliding window),
        else None."""
        if self.rows or not (isinstance(self.spec, RaggedPrefillSpec) and self.spec.kv_order == "hnd"):
            return None
        planned = hf_batching.planned_lane(self.spec)
        if planned is None:
            return None
        q, q_indptr, k, _v, kv_indptr, *_rest = self.args
        if int(q_indptr[1]) != q.shape[0]:   # not _decode_call's index arrays (a window's keys before the queries)
            return None
        wrapper, lane = planned
        return _StepLane(signature, wrapper, lane, int(kv_indptr[1]) - int(kv_indptr[0]), k.shape[1],
                         tuple(q.shape), self.output_shape, self.args[7], self.args[11],
                         int(window) if window else None)


@torch.compiler.disable
def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
              softcap: float | None = None, sliding_window: int | None = None, is_causal: bool | None = None,
              s_aux=None, **kwargs):
    """transformers' attention interface (module docstring): ``(output [B, S_q, H_q, D_v], None)``.
    A call with ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (continuous batching, packed sequences) is
    varlen attention (:func:`linalg_prefill.hf_batching.varlen_attention`). What some models add
    (DeepSeek Sparse Attention's ``indices``, sinks named ``sinks``) is read, and what the kernels
    cannot run refused, by :mod:`linalg_prefill.hf_model_arguments`."""
    hf_model_arguments.refused_arguments(kwargs)
    s_aux = hf_model_arguments.sinks_argument(s_aux, kwargs, getattr(query, "shape", (0, 0))[1])
    indices = kwargs.get("indices")
    if kwargs.get("cu_seq_lens_q") is not None and kwargs.get("cu_seq_lens_k") is not None:
        if indices is not None:
            raise InputError("indices: DeepSeek Sparse Attention over packed sequences is not supported")
        return _varlen(module, query, key, value, dropout, scaling, softcap, sliding_window, s_aux, kwargs), None
    signature = None if indices is not None else _lane_signature(
        module, query, key, value, attention_mask, dropout, scaling, softcap, sliding_window, is_causal, s_aux)
    lane = _step_lane[0]
    if signature is not None and lane is not None and lane.signature == signature:
        output = lane.run(query, key, value)
        if output is not None:
            return output, None
    call = plan_call(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, softcap=softcap,
                     sliding_window=sliding_window, is_causal=is_causal, s_aux=s_aux, indices=indices)
    output = call.run()
    if signature is not None:
        _step_lane[0] = call.step_lane(signature, sliding_window)
    return output, None


class _StepLane:
    """Decode calls after a step's first, on its plan's PassLane (runtime/pass_lane.py): a call
    whose :func:`_lane_signature` is ``signature`` (its shapes but the key length, dtypes,
    strides, device, scale, cap, window, causality) runs as a PassLane's ``run`` over its own K/V
    rows (:func:`_kv_rows`: read in place, within their storage). The lanes come from plans of
    ``wrapper`` whose index arrays are :func:`_decode_call`'s for a key length and the K/V's rows
    a head (one entry of that many keys, a buffer's room another), made with the wrapper's
    checks; a (length, rows) without a lane plans it and the AHEAD - 1 the next steps will have
    (each step ``q_len`` keys more, on the same rows: a KvCache's buffers; or on as many rows as
    keys: a DynamicCache's tensors, new each step) in one go: a plan and its serving schedule
    cost about 0.5 ms of host work at a step's first layer (the model's weights have just
    streamed through the caches) and a few times less each right after one another. The first
    call took every check; a call of the same signature has the same shapes but the key length,
    the same dtypes, strides and device, so they hold for it too (docs/performance.md, ninth
    session).

    ``q_shape``: the folded q ``[S_q, B H_q, D]``; ``output_shape`` ``[B, S_q, H_q, D]``;
    ``causal`` and ``scale`` the plans'; ``window`` the sliding window (a key length past it
    takes the full path). 8-bit K/V (an Fp8KvCache's) come with each layer's scales, checked."""

    #: Key lengths planned at once (the call's and the next steps').
    AHEAD = 8

    def __init__(self, signature: tuple, wrapper, lane, length: int, rows: int, q_shape: tuple,
                 output_shape: tuple, causal: int, scale: float, window: int | None):
        self.signature, self.wrapper, self.q_shape = signature, wrapper, q_shape
        self.output_shape, self.causal, self.scale, self.window = output_shape, causal, scale, window
        self.eight_bit = wrapper.spec.kv_dtype is not None   # K/V of an 8-bit cache, with their scales
        self._lanes = {(length, rows): lane}

    def run(self, query, key, value):
        """``output [B, S_q, H_q, D]``, or None where this lane cannot take the call (the caller
        then takes the full path)."""
        k, v, rows = _kv_rows(key, value)
        lane = self._lane(key.shape[2], rows)
        if lane is None:
            return None
        q = _token_major(query).view(self.q_shape)
        sources = (as_array("key", k), as_array("value", v))
        if self.eight_bit:   # each layer's own scales, checked as the wrapper checks them
            scales = _scales_arg(key, value, k.shape[0])
            sources += tuple(check_scale(name, scale, shape=(k.shape[0],))
                             for name, scale in zip(("k_scale", "v_scale"), scales))
        # the pass writes into the tensor returned (torch's CPU memory is 64-byte aligned): no
        # copy, no conversion (0.08 ms of host work less a call between a model's layers)
        output = query.new_empty(self.output_shape)
        written, _ = lane.run(as_array("query", q), sources, with_lse=False, out=as_array("output", output))
        return output if written.ctypes.data == output.data_ptr() else to_torch(written).view(self.output_shape)

    def _lane(self, length: int, rows: int):
        """The PassLane for ``length`` keys in K/V of ``rows`` rows a head (planning it and the
        next steps' where it has none), or None (a binding window, or calls that are not one
        pass)."""
        lane = self._lanes.get((length, rows))
        if lane is None:
            step, grows = self.q_shape[0], rows == length
            wanted = [(n, n if grows else rows) for n in range(length, length + self.AHEAD * step, step)]
            self._lanes = {(n, r): self._planned(n, r) for n, r in wanted
                           if n <= r and (self.window is None or n <= self.window)}
            lane = self._lanes.get((length, rows))
        return lane

    def _planned(self, length: int, rows: int):
        q_indptr, kv_indptr = _with_room([0, self.q_shape[0]], [0, length], rows)
        plan = self.wrapper.plan(np.array(q_indptr, np.int32), np.array(kv_indptr, np.int32),
                                 causal=bool(self.causal), sm_scale=self.scale)
        return self.wrapper.kernel.lane(plan)


#: The last decode call's :class:`_StepLane` (or None): one slot, replaced by every full call.
_step_lane: list = [None]


@atexit.register
def _release_lane() -> None:
    """Drops the lane (its IREE buffers and kernel) at exit, before runtime.kernels.release_shared
    (atexit runs the later registration first)."""
    _step_lane[0] = None


def _lane_signature(module, query, key, value, attention_mask, dropout, scaling, softcap, sliding_window,
                    is_causal, s_aux) -> tuple | None:
    """What decides an :func:`attention` call's checks, plan and kernel, or None for a call no
    :class:`_StepLane` takes (a mask, dropout, sinks, 8-bit K/V without their scales, anything
    but tensors)."""
    if (attention_mask is not None or dropout or s_aux is not None
            or not all(isinstance(t, torch.Tensor) for t in (query, key, value))):
        return None
    if key.dtype != query.dtype and not (key.dtype in _EIGHT_BIT and value.dtype == key.dtype
                                         and hasattr(key, SCALE_ATTRIBUTE) and hasattr(value, SCALE_ATTRIBUTE)):
        return None
    causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    return (query.shape, query.dtype, query.device, key.shape[:2], key.shape[3:], _strides(key), key.dtype,
            key.device, value.shape[:2], value.shape[3:], _strides(value), value.dtype, value.device,
            key.shape[2] == value.shape[2], scaling, softcap, sliding_window, causal)


def _strides(tensor) -> tuple | str:
    """A K/V tensor's layout in a lane's signature: "contiguous" (a DynamicCache's, whose strides
    change with its length), or its strides (a KvCache's views keep theirs while the buffer
    does)."""
    return "contiguous" if tensor.is_contiguous() else tensor.stride()


def _varlen(module, query, key, value, dropout, scaling, softcap, sliding_window, s_aux, kwargs):
    """The varlen call of :func:`attention`: one packed batch row, bottom-right causal."""
    _check_dropout(dropout)
    _check_tensors(query, key, value)
    if query.shape[0] != 1:
        raise InputError(f"query: packed sequences come as one batch row, got shape {tuple(query.shape)}")
    scale = float(query.shape[3] ** -0.5 if scaling is None else scaling)
    return hf_batching.varlen_attention(
        module, query, key, value, cu_seq_lens_q=kwargs["cu_seq_lens_q"], cu_seq_lens_k=kwargs["cu_seq_lens_k"],
        scaling=scale, softcap=softcap, sliding_window=int(sliding_window) if sliding_window else None,
        sinks=None if s_aux is None else _sinks(s_aux, query.shape[1]), pages=kwargs.get(hf_batching.PAGES_KWARG))


def plan_call(module, query, key, value, attention_mask, *, dropout: float = 0.0, scaling: float | None = None,
              softcap: float | None = None, sliding_window: int | None = None, is_causal: bool | None = None,
              s_aux=None, indices=None) -> KernelCall:
    """The checked :class:`KernelCall` of one :func:`attention` call (InputError naming the
    argument for what the kernels cannot run). ``indices``: DeepSeek Sparse Attention's chosen keys
    ``[B, S_q, top_k]``, folded into the mask
    (:func:`linalg_prefill.hf_model_arguments.with_selected_keys`)."""
    _check_dropout(dropout)
    _check_tensors(query, key, value)
    sinks = None if s_aux is None else _sinks(s_aux, query.shape[1])
    batch, h_q, q_len, d = query.shape
    kv_len = key.shape[2]
    causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    scale = float(d ** -0.5 if scaling is None else scaling)
    cap = float(softcap or 0.0)
    window = int(sliding_window) if sliding_window else None
    if indices is not None:
        attention_mask = hf_model_arguments.with_selected_keys(indices, attention_mask, batch, q_len, kv_len,
                                                               causal=causal, window=window)
        if q_len == 1:   # a decode step: the chosen keys gathered, the others never read
            chosen = hf_model_arguments.chosen_keys(attention_mask)
            if chosen is not None:
                order, counts = chosen
                key, value = (hf_model_arguments.gathered(_widened(states, query.dtype), order)
                              for states in (key, value))
                return _decode_rows_call(query, key, value, np.zeros_like(counts), counts, scale, cap, sinks)
    if attention_mask is None:
        if (window is None or kv_len <= window) and (q_len == 1 or (batch == 1 and q_len <= SMALL_Q_TILE)):
            return _decode_call(query, key, value, causal, scale, cap, sinks)
        if q_len == 1:  # one decode step of several sequences (or under a binding window)
            lo, hi = rule_ranges(batch, q_len, kv_len, causal=causal, window=window)
            return _decode_rows_call(query, key, value, lo[:, 0], hi[:, 0], scale, cap, sinks)
        key, value = _widened(key, query.dtype), _widened(value, query.dtype)  # the paths below copy K/V anyway
        if window is None or kv_len <= window:
            return _one_head_dim(_dense_call, query, key, value, causal, scale, cap, sinks)
        ranges = rule_ranges(batch, q_len, kv_len, causal=causal, window=window)
        return _one_head_dim(_paged_call, query, key, value, plan_entries(*ranges), scale, cap, sinks)
    allowed, ranges = _read_mask(attention_mask, batch, q_len, kv_len)
    if ranges is not None and q_len == 1:  # a decode step of a padded batch: each row's keys are one range
        return _decode_rows_call(query, key, value, ranges[0][:, 0], ranges[1][:, 0], scale, cap, sinks)
    key, value = _widened(key, query.dtype), _widened(value, query.dtype)
    if ranges is None:
        return _custom_mask_call(query, key, value, allowed, scale, cap, sinks)
    return _one_head_dim(_paged_call, query, key, value, plan_entries(*ranges), scale, cap, sinks)


def _one_head_dim(build, query, key, value, *rest) -> KernelCall:
    """``build(query, key, value, *rest)`` (the dense or paged kernel's call, which take one head
    dim for Q/K and V) where V's head dim differs from Q/K's (MLA as DeepSeek V2/V3 run it: d_qk
    192, d_v 128): the narrower side zero-padded, which changes no score and no output column
    (V's padding gives zero columns, cut off again: ``value_dim``; Q/K's adds nothing to a dot
    product)."""
    d_qk, d_v = query.shape[3], value.shape[3]
    if d_v == d_qk:
        return build(query, key, value, *rest)
    if d_v < d_qk:
        return replace(build(query, key, torch.nn.functional.pad(value, (0, d_qk - d_v)), *rest), value_dim=d_v)
    pad = (0, d_v - d_qk)
    return build(torch.nn.functional.pad(query, pad), torch.nn.functional.pad(key, pad), value, *rest)


def _check_dropout(dropout: float) -> None:
    if dropout:
        raise InputError(f"dropout: {dropout} is not supported (the kernels are for inference; call "
                         "model.eval() or use another attn_implementation for training)")


def _sinks(s_aux, h_q: int) -> np.ndarray:
    """``s_aux`` (a torch tensor of ``h_q`` logits, any float dtype) as the kernels' ``sinks``
    [h_q] float32 (their host check rejects non-finite values)."""
    if not isinstance(s_aux, torch.Tensor) or s_aux.numel() != h_q or not s_aux.dtype.is_floating_point:
        raise InputError(f"s_aux: expected a float tensor of {h_q} per-head sink logits, got "
                         f"{getattr(s_aux, 'shape', type(s_aux).__name__)}")
    return s_aux.detach().reshape(h_q).to(device="cpu", dtype=torch.float32).numpy()


def _check_tensors(query, key, value) -> None:
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
            raise InputError(f"{name}: expected a 4-D torch tensor [B, heads, S, D], got "
                             f"{getattr(tensor, 'shape', type(tensor).__name__)}")
        if tensor.device.type != "cpu":
            raise InputError(f"{name}: on {tensor.device}; this attention runs llvm-cpu kernels on CPU tensors")
        eight_bit = name != "query" and tensor.dtype in _EIGHT_BIT and tensor.dtype == key.dtype
        if not eight_bit and (tensor.dtype != query.dtype or tensor.dtype not in DTYPES):
            raise InputError(f"{name}: dtype {tensor.dtype}; expected query's, one of {sorted(map(str, DTYPES))}")
        if eight_bit and getattr(tensor, SCALE_ATTRIBUTE, None) is None:
            raise InputError(f"{name}: {tensor.dtype} states without their scale (an Fp8KvCache's layers "
                             f"hand them over with it)")
    if key.shape[:3] != value.shape[:3]:
        raise InputError(f"value: shape {tuple(value.shape)} differs from key's {tuple(key.shape)} in batch, heads "
                         "or length")
    if key.shape[0] != query.shape[0] or key.shape[3] != query.shape[3]:
        raise InputError(f"key: shape {tuple(key.shape)} does not match query {tuple(query.shape)} "
                         "(batch and head dim)")
    if query.shape[1] % key.shape[1]:
        raise InputError(f"key: {key.shape[1]} KV heads do not divide {query.shape[1]} query heads")


def _token_major(tensor):
    """``[B, H, S, D]`` -> ``[B, S, H, D]`` contiguous (a view when it already lies that way)."""
    return tensor.transpose(1, 2).contiguous()


def _dense_call(query, key, value, causal: bool, scale: float, cap: float, sinks) -> KernelCall:
    batch, h_q, q_len, d = query.shape
    spec = SequencePrefillSpec(h_q, key.shape[1], d, DTYPES[query.dtype], causal=causal, sm_scale=scale,
                               logits_soft_cap=cap, head_sinks=sinks is not None)
    args = (_token_major(query), _token_major(key), _token_major(value), *_sinks_arg(sinks))
    return KernelCall(spec, args, (batch, q_len, h_q, d))


def _decode_call(query, key, value, causal: bool, scale: float, cap: float, sinks) -> KernelCall:
    """A decode step (or a short chunk) of one sequence, or a decode step (one query a row) of B
    sequences seeing all of their keys: the ragged kernel over the cache's own head-major
    ``key`` / ``value [B, H_kv, S_kv, D]`` rows (``kv_order="hnd"``, read in place: no copy of the
    cache per layer per step), one entry, the batch folded into the heads (:func:`_folded`), which
    the serving passes run."""
    _, _, q_len, _ = query.shape
    spec, q, k, v, rows, tail = _folded(query, key, value, cap, sinks)
    args = _ragged_args(q, *_with_room([0, q_len], [0, key.shape[2]], rows), k, v, causal, scale, tail)
    return KernelCall(spec, args, (query.shape[0], q_len, query.shape[1], value.shape[3]))


def _hnd_spec(query, key, value, heads: int, kv_heads: int, cap: float, sinks) -> RaggedPrefillSpec:
    """The head-major ragged spec of a call over ``heads`` query heads and ``kv_heads`` KV heads
    of the model's ``query`` / ``key`` dtypes (an 8-bit key: its ``kv_dtype``) and head dims."""
    return RaggedPrefillSpec(heads, kv_heads, query.shape[3], value.shape[3], DTYPES[query.dtype],
                             logits_soft_cap=cap, head_sinks=sinks is not None, kv_order="hnd",
                             kv_dtype=_EIGHT_BIT.get(key.dtype))


def _ragged_args(q, q_indptr, kv_indptr, k, v, causal, scale: float, tail: tuple) -> tuple:
    """The ragged kernel's arguments in the seed's order with RoPE off (the model rotated q and
    k): query positions and key offsets 0, then ``tail`` (the 8-bit scales, the sinks)."""
    q_indptr, kv_indptr = np.array(q_indptr, np.int32), np.array(kv_indptr, np.int32)
    return (q, q_indptr, k, v, kv_indptr, np.zeros(int(q_indptr[-1]), np.int32), np.zeros(len(kv_indptr) - 1, np.int32),
            int(causal), 0, 1.0, 1.0e4, scale, *tail)


def _folded(query, key, value, cap: float, sinks) -> tuple:
    """``(spec, q [S_q, B H_q, D], k, v [B H_kv, C, D], C, tail)`` of a ragged HND call over the
    batch's rows with the batch folded into the heads: query head ``b H_q + h`` is row b's head
    h, and with G = H_q / H_kv it sees KV head ``(b H_q + h) / G = b H_kv + h / G``, row b's own;
    K/V as the cache lies (:func:`_head_rows`: C rows a head, C >= S_kv). B = 1 or S_q = 1, so
    that q token-major ``[B, S_q, H_q, D]`` reads as ``[S_q, B H_q, D]``; ``tail``: the 8-bit
    scales and the sinks, per folded head. One call for the batch, not one per row: a bf16 step
    of 4 sequences over 2048 cached keys spent 19 ms in attention, 4 calls a layer."""
    batch, h_q, q_len, d = query.shape
    heads, kv_heads = batch * h_q, batch * key.shape[1]
    q = _token_major(query).view(q_len, heads, d)
    k, v, rows = _kv_rows(key, value)
    tail = (*_scales_arg(key, value, kv_heads), *_sinks_arg(None if sinks is None else np.tile(sinks, batch)))
    return _hnd_spec(query, key, value, heads, kv_heads, cap, sinks), q, k, v, rows, tail


def _kv_rows(key, value) -> tuple:
    """``(k, v [B H_kv, C, D], C)``: :func:`_head_rows` of both, or copies of both's S_kv rows
    where their rows a head differ."""
    (k, rows), (v, value_rows) = _head_rows(key), _head_rows(value)
    if value_rows == rows:
        return k, v, rows
    batch, heads, tokens, _ = key.shape
    return key.reshape(batch * heads, tokens, -1), value.reshape(batch * heads, tokens, -1), tokens


def _head_rows(states) -> tuple:
    """``(rows [N, C, D], C)`` of head-major ``states [B, H, S, D]`` (N = B H) in their own
    memory: the states themselves where they are contiguous (C = S); the C rows a head of the
    buffer ``[B, H, C, D]`` whose first S rows a head they are (a :class:`KvCache` layer's view,
    or any such slice), read in place; else a copy (C = S)."""
    batch, heads, tokens, d = states.shape
    if states.is_contiguous():
        return states.view(batch * heads, tokens, d), tokens
    head_stride = states.stride()[1] if heads > 1 else states.stride()[0]
    rows = head_stride // d
    if (states.stride()[2:] == (d, 1) and head_stride == rows * d and rows >= tokens
            and (batch == 1 or heads == 1 or states.stride()[0] == heads * head_stride)
            and states.storage_offset() + batch * heads * head_stride
            <= states.untyped_storage().nbytes() // states.element_size()):
        return states.as_strided((batch * heads, rows, d), (head_stride, d, 1)), rows
    return states.reshape(batch * heads, tokens, d), tokens


def _with_room(q_indptr, kv_indptr, rows: int) -> tuple:
    """``(q_indptr, kv_indptr)`` of a call whose K/V hold ``rows`` rows a head, past the entries'
    ``kv_indptr[-1]``: the room (a :class:`KvCache` buffer's rows past its tokens) one more entry,
    without queries (which no kernel reads)."""
    if rows == kv_indptr[-1]:
        return q_indptr, kv_indptr
    return [*q_indptr, q_indptr[-1]], [*kv_indptr, rows]


def _decode_rows_call(query, key, value, lo, hi, scale: float, cap: float, sinks) -> KernelCall:
    """A decode step (one query a row) of ``B`` sequences, the query of row b seeing keys
    ``[lo[b], hi[b])`` (its padding or window left out): an entry of the keys before ``lo[b]``
    with no query, then the query's entry (empty when ``hi[b] <= lo[b]``: output 0). Every row
    seeing the same range: one call, the batch folded into the heads (:func:`_folded`); else one
    ragged call per batch row over that row's own head-major cache tensors ``key[b]`` /
    ``value[b] [H_kv, S_kv, D]`` (no copy)."""
    batch, h_q, _, _ = query.shape
    d = value.shape[3]
    if np.all(lo == lo[0]) and np.all(hi == hi[0]):
        spec, q, k, v, rows, tail = _folded(query, key, value, cap, sinks)
        args = _ragged_args(q, *_with_room([0, 0, 1], [0, lo[0], max(hi[0], lo[0])], rows), k, v, True, scale, tail)
        return KernelCall(spec, args, (batch, 1, h_q, d))
    h_kv = key.shape[1]
    q, tail = _token_major(query), (*_scales_arg(key, value, h_kv), *_sinks_arg(sinks))
    rows = []
    for b in range(batch):
        k, v, kv_rows = _kv_rows(key[b:b + 1], value[b:b + 1])
        rows.append(_ragged_args(q[b], *_with_room([0, 0, 1], [0, lo[b], max(hi[b], lo[b])], kv_rows), k, v, True,
                                 scale, tail))
    return KernelCall(_hnd_spec(query, key, value, h_q, h_kv, cap, sinks), (), (batch, 1, h_q, d), tuple(rows))


def _sinks_arg(sinks) -> tuple:
    """The call's trailing ``sinks`` argument (empty without sinks)."""
    return () if sinks is None else (sinks,)


# ----------------------------------------------------------------------------- 8-bit KV caches

#: The attribute an 8-bit key or value tensor of an :class:`Fp8KvCache` carries its scale in.
SCALE_ATTRIBUTE = "linalg_prefill_scale"
#: The kernels' KV-cache dtype of each torch 8-bit float dtype (semantics §15).
_EIGHT_BIT = {getattr(torch, name): name for name in KV_DTYPES}


def _scales_arg(key, value, heads: int) -> tuple:
    """``(k_scale, v_scale)`` [heads] float32 of 8-bit ``key`` / ``value`` (their per-tensor scale
    repeated over the call's KV heads); empty for K/V in the compute dtype."""
    if key.dtype not in _EIGHT_BIT:
        return ()
    return tuple(np.full(heads, float(getattr(x, SCALE_ATTRIBUTE)), np.float32) for x in (key, value))


def _widened(states, dtype):
    """8-bit ``states`` as ``dtype(float32(x) * scale)`` (what transformers' fp8 layer hands other
    attentions), for the paths that copy K/V anyway; states in the compute dtype as they are."""
    if states.dtype not in _EIGHT_BIT:
        return states
    return (states.float() * float(getattr(states, SCALE_ATTRIBUTE))).to(dtype)


class _InPlaceFp8Layer(Fp8QuantizedLayer):
    """transformers' fp8 layer (per-tensor e4m3 scales, frozen at the first update) whose decode
    updates hand the attention the stored 8-bit states, with their scale as ``SCALE_ATTRIBUTE``,
    instead of a dequantised copy of the whole cache each step, the step's rows written into
    buffers with room (:func:`linalg_prefill.hf_cache.appended`, as :class:`KvCache`'s); the
    first update (the prefill) returns the states as they came, as transformers' does."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            return super().update(key_states, value_states, *args, **kwargs)
        self.cumulative_length += key_states.shape[-2]
        stored = []
        for states, (quantized, scale) in ((key_states, self._quantized_keys), (value_states, self._quantized_values)):
            new, _ = self._quantize(states, scale=scale)
            quantized = appended(quantized, new)
            setattr(quantized, SCALE_ATTRIBUTE, scale)
            stored.append((quantized, scale))
        self._quantized_keys, self._quantized_values = stored
        return self._quantized_keys[0], self._quantized_values[0]


class Fp8KvCache(QuantizedCache):
    """transformers' ``QuantizedCache(backend="fp8", config)`` (float8_e4m3fn K/V, one scale per
    tensor per layer) for this attention: a decode step reads the 8-bit states in place (the
    ragged kernel with ``kv_dtype``, semantics §15) instead of a dequantised copy of the cache;
    the other paths (a prefill chunk, a mask with holes) widen them first, as transformers does.
    Its tokens are those of transformers' own fp8 cache under another attention.

        model.generate(ids, cache=linalg_prefill.hf.Fp8KvCache(model.config), ...)
    """

    def __init__(self, config):
        super().__init__("fp8", config)
        self.layers = [_InPlaceFp8Layer() for _ in self.layers]


def _paged_call(query, key, value, entries: Entries, scale: float, cap: float, sinks) -> KernelCall:
    batch, h_q, q_len, d = query.shape
    spec = PagedPrefillSpec(h_q, key.shape[1], d, DTYPES[query.dtype], page_size=PAGE_SIZE, sliding_window=True,
                            logits_soft_cap=cap, head_sinks=sinks is not None)
    pages, pages_per_row = _pages(key, value)
    page_indptr, page_values, length_info = paged_arguments(entries, pages_per_row, PAGE_SIZE)
    q = _token_major(query).view(batch * q_len, h_q, d)
    args = (q, entries.q_indptr, pages, page_indptr, page_values, length_info, np.zeros(len(entries), np.int32),
            np.zeros(batch * q_len, np.int32), 1, 0, 1.0, 1.0e4, scale, *_sinks_arg(sinks))
    return KernelCall(spec, args, (batch, q_len, h_q, d))


def _pages(key, value):
    """K/V ``[B, H_kv, S_kv, D]`` as pages ``[B * P, 2, H_kv, PAGE_SIZE, D]`` (batch row ``b``'s
    ``p``-th page is page ``b * P + p``; the last page's unused rows are zero); returns (pages, P)."""
    batch, h_kv, kv_len, d = key.shape
    per_row = max(-(-kv_len // PAGE_SIZE), 1)
    full, tail = divmod(kv_len, PAGE_SIZE)
    pages = key.new_empty((batch, per_row, 2, h_kv, PAGE_SIZE, d))
    for slot, source in enumerate((key, value)):
        if full:
            blocks = source[:, :, :full * PAGE_SIZE].reshape(batch, h_kv, full, PAGE_SIZE, d)
            pages[:, :full, slot].copy_(blocks.permute(0, 2, 1, 3, 4))
        if tail:
            pages[:, full, slot, :, :tail].copy_(source[:, :, full * PAGE_SIZE:])
            pages[:, full, slot, :, tail:].zero_()
    return pages.view(batch * per_row, 2, h_kv, PAGE_SIZE, d), per_row


def _custom_mask_call(query, key, value, allowed: np.ndarray, scale: float, cap: float, sinks) -> KernelCall:
    """The ragged kernel with ``custom_mask``: batch row ``b`` is entry ``b`` (its S_q queries and
    S_kv keys), whose mask block is ``allowed[b]`` (bool ``[B, S_q, S_kv]``, row-major as §14 wants)."""
    batch, h_q, q_len, d = query.shape
    h_kv, kv_len, d_v = key.shape[1], key.shape[2], value.shape[3]
    spec = RaggedPrefillSpec(h_q, h_kv, d, d_v, DTYPES[query.dtype], logits_soft_cap=cap, head_sinks=sinks is not None,
                             custom_mask=True)
    rows = np.arange(batch + 1, dtype=np.int64)
    q_indptr, kv_indptr, mask_indptr = ((rows * n).astype(np.int32) for n in (q_len, kv_len, q_len * kv_len))
    q = _token_major(query).view(batch * q_len, h_q, d)
    k, v = (_token_major(t).view(batch * kv_len, h_kv, t.shape[3]) for t in (key, value))
    args = (q, q_indptr, k, v, kv_indptr, np.zeros(batch * q_len, np.int32), np.zeros(batch, np.int32), 0, 0, 1.0,
            1.0e4, scale, allowed.reshape(-1), mask_indptr, *_sinks_arg(sinks))
    return KernelCall(spec, args, (batch, q_len, h_q, d_v))


_mask_cache: dict[int, tuple] = {}


def _read_mask(mask, batch: int, q_len: int, kv_len: int) -> tuple:
    """``(allowed, ranges)`` of a transformers mask, read once per mask tensor (every layer of a
    type shares it): ``allowed`` bool ``[B, S_q, S_kv]``, ``ranges`` its ``(lo, hi)`` int64
    ``[B, S_q]`` (:func:`key_ranges`), or None when a row has a hole."""
    key = id(mask)
    cached = _mask_cache.get(key)
    if cached is not None and cached[0]() is mask and cached[1] == (mask._version, q_len, kv_len):
        return cached[2]
    allowed = _boolean_mask(mask, batch, q_len, kv_len)
    read = (allowed, key_ranges(allowed))
    if len(_mask_cache) >= 4:  # a mask per layer type is live in a forward; keep the newest few
        _mask_cache.pop(next(iter(_mask_cache)))
    _mask_cache[key] = (weakref.ref(mask), (mask._version, q_len, kv_len), read)
    return read


def _boolean_mask(mask, batch: int, q_len: int, kv_len: int) -> np.ndarray:
    """bool ``[B, S_q, S_kv]`` from a boolean or additive (0 / very negative) ``[B or 1, 1 or H, S_q, >= S_kv]``."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        raise InputError(f"attention_mask: expected None or a 4-D tensor, got {getattr(mask, 'shape', type(mask))}")
    if mask.shape[2] != q_len or mask.shape[3] < kv_len or mask.shape[0] not in (1, batch):
        raise InputError(f"attention_mask: shape {tuple(mask.shape)} does not fit query length {q_len}, "
                         f"key length {kv_len} and batch {batch}")
    mask = hf_model_arguments.boolean(mask[..., :kv_len])
    if mask.shape[1] != 1 and not bool((mask == mask[:, :1]).all()):
        raise InputError("attention_mask: masks that differ per head are not supported")
    return np.ascontiguousarray(mask[:, 0].expand(batch, q_len, kv_len).cpu().numpy())
