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
