"""Fixtures shared by the core tests."""

import numpy as np
import pytest

from packbench.core.trace import Trace, TraceCall, TraceModel


def ids(*e):
    return np.array(e, dtype=np.int64)


@pytest.fixture
def trace():
    """2 MoE layers of 4 experts of 1000 B, top 2: one prefill, two decode calls of one token
    (the simulate tests' hand-computed box)."""
    model = TraceModel(family="mixtral", unit="expert", layers=2, units=4, unit_bytes=1000, k=2, shape="box-moe")
    calls = [TraceCall(0, "prefill", 3), TraceCall(0, "decode", 1), TraceCall(0, "decode", 1)]
    sets = [[ids(0, 1, 2), ids(1, 2, 3)], [ids(0, 1), ids(2, 3)], [ids(0, 2), ids(1, 3)]]
    forecasts = [[ids(), ids(1, 2)], [ids(), ids(2, 3)], [ids(), ids(0, 3)]]
    return Trace(model=model, calls=calls, sets=sets, forecasts=forecasts)
