"""``AdamWSR``'s checkpoint side: the format checks a state_dict passes before anything loads, the
copies that keep every loaded moment in its group's ``state_dtype``, and the group options an older
state lacks (a ``torch.optim.AdamW`` state_dict, or one saved before an option existed).

The optimizer calls these from ``load_state_dict`` and ``__setstate__``; none of them touches its
caches (the optimizer clears those itself).
"""

from __future__ import annotations

import torch

from . import _states
from .functional import MAX_STEP
from .indices import check_disjoint_indices, is_dtensor, local_tensor

__all__ = ["STATE_KEYS", "check_loadable", "check_loaded_states", "copy_loaded_states", "fill_group_defaults"]

# the moment entries of a param's state, in ``StepLaunch``'s order (8-bit scales: ``_states.SCALE_KEYS``)
STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def check_loadable(param_groups: list[dict], state_dict: dict) -> None:
    """``AdamWSR.load_state_dict``'s format checks of ``state_dict`` against the optimizer's
    ``param_groups``, before anything changes (see there). Group or param counts that differ are
    left to torch's own load, which names the mismatch.

    Raises:
        ValueError: a checkpoint group's ``state_dtype`` differs from the optimizer's group's, a saved
            state does not hold its format's tensors (moment dtype, 8-bit scales), or the checkpoint's
            ``base_index`` does not list one entry per param or gives two params overlapping ranges.
    """
    saved_groups = state_dict.get("param_groups", [])
    if len(saved_groups) != len(param_groups):
        return  # torch's own load names this mismatch
    for i, (mine, theirs) in enumerate(zip(param_groups, saved_groups, strict=True)):
        raw = theirs.get("state_dtype", _states.FLOAT32)
        try:
            saved_dtype = _states.canonical_state_dtype(raw, "AdamWSR.load_state_dict")
        except ValueError as e:
            raise ValueError(f"param group {i} of the checkpoint: {e}") from None
        if saved_dtype != mine["state_dtype"]:
            raise ValueError(
                f"AdamWSR.load_state_dict: param group {i} of the checkpoint has state_dtype="
                f"{saved_dtype!r}, this optimizer's group has state_dtype={mine['state_dtype']!r}; "
                "moments are not converted between formats: build the optimizer with "
                f"state_dtype={saved_dtype!r} to resume this checkpoint"
            )
        want = _states.moment_dtype(saved_dtype)
        for pid in theirs.get("params", []):
            state = state_dict["state"].get(pid) or {}
            keys = (*STATE_KEYS, *(_states.SCALE_KEYS if saved_dtype == _states.EIGHT_BIT else ()))
            for key in keys:
                value = state.get(key)
                if value is None:
                    if key in _states.SCALE_KEYS and state.get("exp_avg") is not None:
                        raise ValueError(
                            f"AdamWSR.load_state_dict: the 8-bit state of param {pid} (group {i}) "
                            f"lacks '{key}'"
                        )
                    continue
                ok = value.is_floating_point() if want == torch.float32 and key in STATE_KEYS else (
                    value.dtype == (torch.uint8 if key in _states.SCALE_KEYS else want)
                )  # fmt: skip
                if not ok:
                    raise ValueError(
                        f"AdamWSR.load_state_dict: state '{key}' of param {pid} (group {i}, "
                        f"state_dtype={saved_dtype!r}) has dtype {value.dtype}; that format stores "
                        f"{torch.uint8 if key in _states.SCALE_KEYS else want}"
                    )
    # the checkpoint's base_index replaces each group's: its ranges must be disjoint too
    loaded = [
        dict(g, base_index=t.get("base_index")) for g, t in zip(param_groups, saved_groups, strict=True)
    ]
    for i, group in enumerate(loaded):
        if len(saved_groups[i].get("params", [])) != len(group["params"]):
            return  # torch's own load names this mismatch
        if group["base_index"] is not None and len(group["base_index"]) != len(group["params"]):
            raise ValueError(
                f"AdamWSR.load_state_dict: param group {i} of the checkpoint has base_index "
                f"{group['base_index']!r} for {len(group['params'])} params; it must list one per param"
            )
    check_disjoint_indices(loaded, "AdamWSR.load_state_dict (the checkpoint's base_index)")


def check_loaded_states(param_groups: list[dict], state: dict) -> None:
    """After torch's load and ``copy_loaded_states``: every loaded state holds its format's tensors at
    its param's shape and a ``step`` (``_states.check_state``), every ``step`` is an integer in
    ``[0, MAX_STEP)`` (what the next step can increment) and no second
    moment (``exp_avg_sq``, ``max_exp_avg_sq`` of float formats) is negative, where ``sqrt`` would turn
    the param into NaN. The values are read in one device sync.

    Raises:
        ValueError: naming the group, the param's shape and what is wrong.

    **Determinism:** reads shapes, dtypes and values; changes nothing.
    """
    where = "AdamWSR.load_state_dict"
    flags, names = [], []
    for i, group in enumerate(param_groups):
        float_moments = group["state_dtype"] != _states.EIGHT_BIT
        for p in group["params"]:
            st = state.get(p)
            if not st:
                continue
            try:
                _states.check_state(p, st, group["state_dtype"], group["amsgrad"])
            except RuntimeError as e:
                raise ValueError(f"{where}: param group {i} of the checkpoint: {e}") from None
            shape = tuple(p.shape)
            step = local_tensor(st["step"]).double()
            # the count the next step increments: an integer below MAX_STEP (fp32 counts exactly)
            flags.append(~((step >= 0) & (step < MAX_STEP) & (step == step.trunc())).all())
            names.append(
                f"the step count of a param of shape {shape} (group {i}) is not an integer in "
                f"[0, 2**24 - 2] (negative, fractional, NaN or too large)"
            )
            for key in ("exp_avg_sq", "max_exp_avg_sq") if float_moments else ():
                if st.get(key) is not None:
                    flags.append((local_tensor(st[key]) < 0).any())
                    names.append(f"'{key}' of a param of shape {shape} (group {i}) has negative values")
    by_device: dict = {}  # one read per device (steps may live on the CPU, moments on the GPU)
    for name, flag in zip(names, flags, strict=True):
        by_device.setdefault(flag.device, []).append((name, flag))
    bad = [
        name
        for entries in by_device.values()
        for (name, _), hit in zip(entries, torch.stack([f for _, f in entries]).tolist(), strict=True)
        if hit
    ]
    if bad:
        more = f" ({len(bad) - 1} more such entries)" if len(bad) > 1 else ""
        raise ValueError(f"{where}: {bad[0]}: the checkpoint is corrupt or not an AdamW state{more}")


def copy_loaded_states(state: dict, param_groups: list[dict], saved: dict, saved_groups: list[dict]) -> None:
    """After torch's load: replace each loaded state tensor in ``state`` (the optimizer's, keyed by
    param) by a copy of the checkpoint's, in its group's ``state_dtype``.

    Why: torch casts floating state to the param dtype (fp32 moments would be rounded to bf16, 8-bit
    codes turned into numbers) and keeps a reference to the caller's ``step`` tensors, which the
    in-place steps would then write into. Float moments load into ``torch.float32`` states.
    ``saved``: the checkpoint's ``"state"``; ``saved_groups``: its ``"param_groups"``.
    """
    order = [(p, g) for g in param_groups for p in g["params"]]
    saved_ids = [i for g in saved_groups for i in g["params"]]
    for pid, (p, group) in zip(saved_ids, order, strict=True):
        if pid in saved:
            fp32 = group["state_dtype"] == _states.FLOAT32
            for key in (*STATE_KEYS, *_states.SCALE_KEYS):
                value = saved[pid].get(key)
                if value is None:
                    continue
                dtype = torch.float32 if fp32 else value.dtype
                # a copy, so in-place steps never write into the caller's state_dict
                if is_dtensor(value):
                    state[p][key] = value.to(dtype=dtype, copy=True)
                else:
                    state[p][key] = value.to(device=local_tensor(p).device, dtype=dtype, copy=True)
            step = state[p].get("step")
            if isinstance(step, torch.Tensor) and step is saved[pid].get("step"):
                state[p]["step"] = step.clone()  # torch would alias the caller's step tensor


def fill_group_defaults(param_groups: list[dict], seed: int) -> None:
    """Fill the options a loaded param group lacks (e.g. from a ``torch.optim.AdamW`` state_dict) with
    ``AdamWSR``'s defaults, in place, as torch's optimizers do in ``__setstate__``; ``seed``: the
    optimizer's default seed."""
    for group in param_groups:
        group.setdefault("amsgrad", False)
        group.setdefault("maximize", False)
        group.setdefault("foreach", None)
        group.setdefault("capturable", False)
        group.setdefault("differentiable", False)
        group.setdefault("fused", None)
        group.setdefault("seed", seed)
        group.setdefault("stochastic_rounding", None)
        group.setdefault("base_index", None)
        group.setdefault("state_dtype", _states.FLOAT32)  # a checkpoint without it has float moments
        group.setdefault("state_rounding", "stochastic")
