"""One row of a variant's argument table (mlir/abi.py): a name, a kind and dims. Its own module
so that the parts that add rows (a mask rule: mlir/mask_rules.py) need not import the table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

Dims = tuple[Union[int, str], ...]


@dataclass(frozen=True)
class Arg:
    """One argument: its name, kind and dims (a callable of the spec where they depend on it)."""

    name: str
    kind: str
    dims: Union[Dims, Callable[[object], Dims]] = ()

    def dims_of(self, spec) -> Dims:
        return self.dims(spec) if callable(self.dims) else self.dims
