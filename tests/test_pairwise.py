"""support.pairwise, the covering arrays the numerics grids are built from: every pair of values
of two factors in some row, far fewer rows than the full product."""

from __future__ import annotations

import itertools

import pytest

from support import pairwise

FACTOR_SETS = {
    "dense grid": dict(heads=[(4, 4), (8, 2), (6, 1)], d=[64, 128], causal=[False, True],
                       dtype=["float32", "float16", "bfloat16"], lowering=["linalg", "fused"]),
    "3x3x2x2": dict(a=[1, 2, 3], b=["x", "y", "z"], c=[0, 1], d=[{"k": 1}, {"k": 2}]),
    "one factor": dict(a=[1, 2, 3]),
    "two factors": dict(a=[1, 2, 3], b=[1, 2]),
}


@pytest.mark.parametrize("name", list(FACTOR_SETS))
def test_every_pair_of_values_is_in_some_row(name):
    factors = FACTOR_SETS[name]
    rows = pairwise(**factors)
    assert all(list(row) == list(factors) for row in rows)
    assert all(row[f] in factors[f] for row in rows for f in factors)
    for f, g in itertools.combinations(factors, 2):
        for u, v in itertools.product(factors[f], factors[g]):
            assert any(row[f] == u and row[g] == v for row in rows), (f, u, g, v)
    if len(factors) == 1:
        assert [row["a"] for row in rows] == factors["a"]


def test_rows_are_far_fewer_than_the_product():
    assert len(pairwise(**FACTOR_SETS["3x3x2x2"])) == 9  # 36 in the product; 9 is the least
    assert len(pairwise(**FACTOR_SETS["dense grid"])) == 9  # 72 in the product
    assert len(pairwise(**FACTOR_SETS["two factors"])) == 6  # two factors: the product itself
