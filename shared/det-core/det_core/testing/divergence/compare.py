"""Comparing two recorded runs bit for bit: one recorded tensor of run a against run b
(``_compare``), the first differing element (``_first_element``), and whether a differing module's
inputs already differed (``_with_inputs``)."""

from __future__ import annotations

import torch

from .. import bits
from .._nested import hex_bits
from .capture import _Run, _Stream
from .report import Difference, _where


def _compare(
    kind: str,
    key: tuple[str, int | None, str],
    a: _Stream | None,
    b: _Stream | None,
    batch_dim: int | None,
    strict: bool,
) -> Difference | str | None:
    """None when equal, a Difference, or a string saying why the two cannot be compared."""
    name, call, path = key
    if a is None or b is None:
        return Difference(
            kind,
            name,
            call,
            path,
            "missing",
            digest_a=a and a.hasher.hexdigest(),
            digest_b=b and b.hasher.hexdigest(),
        )
    shape_a, shape_b = a.global_shape(batch_dim), b.global_shape(batch_dim)
    one_tensor = a.joins and b.joins
    if not strict and not one_tensor:
        what = (
            f"no dim {batch_dim} to join the micro-batches along (a per-micro-batch value)"
            if a.stacks and b.stacks
            else f"its pieces do not join along dim {batch_dim}"
        )
        return (
            f"{_where(kind, name, call, path)}: {what}, shapes {shape_a} vs {shape_b}; compared only "
            "run-to-run or for equal splits"
        )
    dtype_a, dtype_b = a.dtypes[0], b.dtypes[0]
    if set(a.dtypes) != set(b.dtypes) or (strict and a.dtypes != b.dtypes):
        return Difference(kind, name, call, path, "dtype", dtype_a=dtype_a, dtype_b=dtype_b)
    if shape_a != shape_b:
        if not strict:
            return (
                f"{_where(kind, name, call, path)}: global shapes {shape_a} vs {shape_b} after joining the "
                f"micro-batches along dim {batch_dim}: dim {batch_dim} is not the batch dim here"
            )
        return Difference(
            kind,
            name,
            call,
            path,
            "shape",
            dtype_a=dtype_a,
            dtype_b=dtype_b,
            shape_a=shape_a,
            shape_b=shape_b,
        )
    digest_a, digest_b = a.hasher.hexdigest(), b.hasher.hexdigest()
    if digest_a == digest_b:
        return None
    fields = dict(dtype_a=dtype_a, dtype_b=dtype_b, shape_a=shape_a, shape_b=shape_b)
    fields.update(digest_a=digest_a, digest_b=digest_b)
    ta, tb = a.global_tensor(batch_dim), b.global_tensor(batch_dim)
    if ta is not None and tb is not None:
        fields.update(_first_element(ta, tb))
    return Difference(kind, name, call, path, "bits", **fields)


def _first_element(a: torch.Tensor, b: torch.Tensor) -> dict:
    ba, bb = bits(a).flatten(), bits(b).flatten()
    diff = ba != bb
    flat = int(diff.nonzero()[0])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape)) if a.dim() else ()
    nbytes = a.element_size()
    return dict(
        count=int(diff.sum()),
        numel=a.numel(),
        index=index,
        value_a=a.flatten()[flat].item(),
        value_b=b.flatten()[flat].item(),
        bits_a=hex_bits(int(ba[flat]), nbytes),
        bits_b=hex_bits(int(bb[flat]), nbytes),
    )


def _with_inputs(
    found: Difference, key, run_a: _Run, run_b: _Run, batch_dim: int, strict: bool
) -> Difference:
    name, call, _ = key
    verdicts = []
    for in_key in dict.fromkeys(k for k in (*run_a.inputs, *run_b.inputs) if k[:2] == (name, call)):
        verdict = _compare(
            "input", in_key, run_a.inputs.get(in_key), run_b.inputs.get(in_key), batch_dim, strict
        )
        if isinstance(verdict, str):
            continue
        verdicts.append(verdict is None)
    if not verdicts:
        return found
    return Difference(**{**found.__dict__, "inputs_agree": all(verdicts)})
