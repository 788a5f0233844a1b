"""Exact sums of float64 terms (`ExactSum`, `add_columns`) against `fractions.Fraction`."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from clipcli.core.exact import ExactSum, add_columns


def value(total: ExactSum) -> Fraction:
    return Fraction(total.acc) * Fraction(2) ** total.low


def reference(column: np.ndarray, k: int = 0) -> Fraction:
    return sum((Fraction(s) for s in column.tolist()), Fraction(0)) * Fraction(2) ** k


TERMS = st.floats(min_value=0.0, max_value=1e300, allow_nan=False, allow_infinity=False, allow_subnormal=True)


MATRICES = hnp.arrays(np.float64, hnp.array_shapes(min_dims=2, max_dims=2, max_side=40), elements=TERMS)


@settings(max_examples=200, deadline=None)
@given(MATRICES, st.integers(-60, 60))
def test_add_columns_is_exact(sums, k):
    totals = [ExactSum() for _ in range(sums.shape[1])]
    add_columns(totals, sums, k)
    assert [value(t) for t in totals] == [reference(c, k) for c in sums.T]


@pytest.mark.parametrize("rows", [1, 8, 9, 300])
def test_add_columns_mixes_narrow_wide_and_zero_columns(rows):
    # one column within 2**10 (summed in NumPy's two halves), one spread over 2**40 (term by term), one of zeros
    rng = np.random.default_rng(rows)
    narrow = rng.uniform(1.0, 1000.0, rows) * 2.0**60  # large 53-bit integers: the halves' carries matter
    wide = rng.uniform(0.5, 1.0, rows) * 2.0 ** rng.integers(-20, 20, rows)
    sums = np.column_stack([narrow, wide, np.zeros(rows)])
    totals = [ExactSum(), ExactSum(), ExactSum()]
    for _ in range(2):  # adding twice: into a total that holds something already
        add_columns(totals, sums)
    assert [value(t) for t in totals] == [2 * reference(c) for c in sums.T]


def test_add_many_is_one_column():
    sums = np.array([0.1, 0.0, 3e-300, 2.5e10] * 5)
    total = ExactSum()
    total.add_many(sums, 3)
    assert value(total) == reference(sums, 3)
