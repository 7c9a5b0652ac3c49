"""Bad input of det_train's embedding and cross_entropy over random small sizes (hypothesis): each
raises a TypeError / ValueError whose message names the problem. Split from test_properties.py
(the ops' values, bits and row invariance), with the same derandomized settings.
"""

from __future__ import annotations

import det_train
import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

# as test_properties.py's: the same examples every run, no deadline, no database, no shrinking
SETTINGS = settings(
    max_examples=3, deadline=None, derandomize=True, database=None, phases=(Phase.explicit, Phase.generate)
)


def _bad_embedding(kind: str, v: int):
    ids, w = torch.zeros(4, dtype=torch.int64), torch.ones(v, 3)
    if kind == "id_too_large":
        return (torch.full((4,), v), w), {}, ValueError, rf"ids must lie in \[0, {v}\), got min {v}, max {v}"
    if kind == "id_negative":
        return (torch.full((2,), -1), w), {}, ValueError, rf"ids must lie in \[0, {v}\), got min -1"
    if kind == "float_ids":
        return (ids.float(), w), {}, TypeError, "ids must be int32 or int64"
    if kind == "int_weight":
        return (ids, w.long()), {}, TypeError, "weight must be floating point"
    if kind == "weight_1d":
        return (ids, torch.ones(v)), {}, ValueError, "weight must be"
    if kind == "padding_range":
        return (ids, w), {"padding_idx": v}, ValueError, "padding_idx"
    if kind == "padding_float":
        return (ids, w), {"padding_idx": 1.0}, TypeError, "padding_idx must be an integer"
    # found by these tests: a list or numpy array gave an AttributeError ('list' object has no
    # attribute 'dtype') or a TypeError naming numpy's dtype ("must be int32 or int64, got int64")
    if kind == "list_ids":
        return ([0, 1], w), {}, TypeError, "ids must be a torch.Tensor, got builtins.list"
    if kind == "numpy_ids":
        return (ids.numpy(), w), {}, TypeError, r"ids must be a torch.Tensor, got numpy.ndarray .*from_numpy"
    if kind == "list_weight":
        return (ids, [[1.0] * 3] * v), {}, TypeError, "weight must be a torch.Tensor, got builtins.list"
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind",
    [
        "id_too_large",
        "id_negative",
        "float_ids",
        "int_weight",
        "weight_1d",
        "padding_range",
        "padding_float",
        "list_ids",
        "numpy_ids",
        "list_weight",
    ],
)
@SETTINGS
@given(
    v=st.sampled_from([1, 2, 17]),
)
def test_embedding_bad_input_raises_a_clear_error(kind, v):
    args, kw, error, match = _bad_embedding(kind, v)
    with pytest.raises(error, match=match):
        det_train.embedding(*args, **kw)


def _bad_cross_entropy(kind: str, v: int):
    logits, targets = torch.zeros(4, v), torch.zeros(4, dtype=torch.int64)
    if kind == "target_too_large":
        return (logits, torch.full((4,), v)), {}, ValueError, f"target {v} is outside"
    if kind == "target_negative":
        return (logits, torch.full((4,), -2)), {}, ValueError, "target -2 is outside"
    if kind == "targets_shape":
        return (logits, torch.zeros(5, dtype=torch.int64)), {}, ValueError, "targets shape"
    if kind == "empty_classes":
        return (torch.zeros(4, 0), targets), {}, ValueError, "class dimension is empty"
    if kind == "float_targets":
        return (logits, targets.float()), {}, TypeError, "int64 or int32"
    if kind == "float64":
        return (logits.double(), targets), {}, TypeError, "not supported"
    if kind == "reduction":
        return (logits, targets), {"reduction": "avg"}, ValueError, "reduction must be"
    if kind == "zero_dim":
        return (torch.tensor(1.0), torch.tensor(0)), {}, ValueError, "at least 1 dim, the class dim"
    # found by these tests: ignore_index=0.5 returned a wrong mean (the kernels ignored class
    # int(0.5) = 0, the count did not), None or "0" an AttributeError, 2**70 an OverflowError
    if kind == "ignore_float":
        return (logits, targets), {"ignore_index": 0.5}, TypeError, "ignore_index must be an integer"
    if kind == "ignore_none":
        return (logits, targets), {"ignore_index": None}, TypeError, "ignore_index must be an integer"
    if kind == "ignore_str":
        return (logits, targets), {"ignore_index": "0"}, TypeError, "ignore_index must be an integer"
    if kind == "ignore_huge":
        return (logits, targets), {"ignore_index": 2**70}, ValueError, "ignore_index must fit in int64"
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind",
    [
        "target_too_large",
        "target_negative",
        "targets_shape",
        "empty_classes",
        "float_targets",
        "float64",
        "reduction",
        "zero_dim",
        "ignore_float",
        "ignore_none",
        "ignore_str",
        "ignore_huge",
    ],
)
@SETTINGS
@given(
    v=st.sampled_from([1, 2, 17]),
)
def test_cross_entropy_bad_input_raises_a_clear_error(kind, v):
    args, kw, error, match = _bad_cross_entropy(kind, v)
    with pytest.raises(error, match=match):
        det_train.cross_entropy(*args, **kw)
