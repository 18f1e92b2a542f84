"""IR builders: typed MLIR bindings, one online-softmax emitter, one spec per variant."""

from .specs import MaskedSequencePrefillSpec, SequencePrefillSpec
from .sequence import build_sequence_prefill

_BUILDERS = {
    SequencePrefillSpec: build_sequence_prefill,
    MaskedSequencePrefillSpec: build_sequence_prefill,
}


def build_module(spec):
    """The verified MLIR module for any variant spec."""
    try:
        builder = _BUILDERS[type(spec)]
    except KeyError:
        raise TypeError(f"no IR builder for {type(spec).__name__}") from None
    return builder(spec)


__all__ = ["SequencePrefillSpec", "MaskedSequencePrefillSpec", "build_module", "build_sequence_prefill"]
