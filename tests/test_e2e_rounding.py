"""End to end: with bf16 weights and no fp32 master copy, AdamW with stochastic rounding trains
further than AdamW rounding each update to nearest (at a learning rate where most updates are
smaller than half a bf16 ULP of the weight, round-to-nearest drops them; SR keeps them on average).

The curves for the docs come from ``examples/plot_rounding.py`` (docs/img/rounding.png)."""

from __future__ import annotations

import dataclasses

import pytest

from examples import train_gpt as tg

# lr 1e-4: an Adam update (~lr) is below half a ULP for weights of magnitude above ~0.025, so
# round-to-nearest loses most of them; the norm weights (1.0, ULP 2**-7) never move at all.
SMALL_LR = dict(lr=1e-4, warmup_steps=1, min_lr_ratio=1.0, weight_decay=0.0)


def test_stochastic_rounding_reaches_lower_loss_than_nearest():
    cfg = tg.make_config("tiny", steps=12, **SMALL_LR)
    sr = tg.train(cfg, evaluate_end=True)
    nearest = tg.train(dataclasses.replace(cfg, rounding="nearest"), evaluate_end=True)
    assert sr["val_loss"] < nearest["val_loss"] - 0.01, (sr["val_loss"], nearest["val_loss"])
    assert sum(sr["losses"][-4:]) < sum(nearest["losses"][-4:])
    # nearest leaves the RMSNorm weights exactly at their initial 1.0; SR moves them
    assert (nearest["state_dict"]["final_norm.weight"] == 1).all()
    assert not (sr["state_dict"]["final_norm.weight"] == 1).all()


def test_rounding_option_is_checked():
    with pytest.raises(ValueError, match="rounding"):
        tg.build_model(tg.make_config("tiny", rounding="up"), "cpu")
