"""Key construction and the count validator; error codes are distinct and stable."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from scheduler import errors as E
from scheduler.keys import chunk_key, count


def test_chunk_key_normalises_numpy_ints():
    k = chunk_key("ctx", np.int64(3))
    assert k == ("ctx", 3) and type(k[1]) is int


@pytest.mark.parametrize("ctx,idx", [("", 0), (3, 0), ("c", -1), ("c", 1.0), ("c", True), ("c", "1")])
def test_chunk_key_refuses_bad(ctx, idx):
    with pytest.raises(ValueError):
        chunk_key(ctx, idx)


def test_count():
    assert count("n", np.int32(5), 1) == 5
    for bad in (0, -1, 2.5, None, False):
        with pytest.raises(ValueError, match="n must be"):
            count("n", bad, 1)


def test_error_codes_are_distinct_and_capacity_errors_carry_numbers():
    classes = [c for _, c in inspect.getmembers(E, inspect.isclass)
               if issubclass(c, E.SchedulerError)]
    codes = [c.code for c in classes]
    assert len(classes) >= 10 and len(set(codes)) == len(codes)
    err = E.NotEnoughEvictableError("x", needed=5, available=2)
    assert isinstance(err, E.CapacityError) and (err.needed, err.available) == (5, 2)
    assert str(E.UnknownChunkKeyError("no such chunk")) == "no such chunk"
