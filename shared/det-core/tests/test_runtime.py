"""det_core.runtime: the integer-argument check every package uses (as_index)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from det_core import runtime


@pytest.mark.parametrize("value", [7, np.int64(7), np.uint8(7), torch.tensor(7)])
def test_as_index_accepts_every_integer_type(value):
    assert runtime.as_index(value, "n", "op") == 7


@pytest.mark.parametrize(
    "value", [True, np.True_, torch.tensor(True), 7.0, 1.5, "7", None, torch.tensor(7.0)]
)
def test_as_index_rejects_bools_floats_and_strings_with_the_name_and_hint(value):
    with pytest.raises(TypeError, match=r"op: n must be an integer.*; pass 7"):
        runtime.as_index(value, "n", "op", "; pass 7")


def test_as_seed_checks_type_and_the_64_bit_range():
    from det_core import rng

    assert rng.as_seed(np.uint64(2**64 - 1), "op") == 2**64 - 1
    with pytest.raises(ValueError, match=r"op: seed must be in \[0, 2\*\*64\)"):
        rng.as_seed(-1, "op")
    with pytest.raises(TypeError, match="op: seed must be an integer"):
        rng.as_seed(True, "op")
