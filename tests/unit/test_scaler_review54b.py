"""Review 54b: the loss scaler's ranges (growth_factor > 1, backoff_factor in (0, 1), growth_interval
a whole number >= 1) held on two of the ways in, not on the others. A ``GuardedGradScaler`` made
directly (the README's "scaler a guard makes", the class to subclass) took a backoff of 0 (the
scale pinned at the float32 floor after one skip, every later step "applied" with zero gradients)
or an interval of 0 (the scale never grew), and its guard's own state was then refused at resume.
``Guard.load_state_dict`` took a saved backoff of 2.0 (the scale grew on every overflow, to inf,
every later step skipped) or a growth factor of 0.5."""

from __future__ import annotations

import math

import pytest
import torch

from ampguard import Guard
from ampguard.precision import GuardedGradScaler, Precision

# what the config, make_scaler and Guard(scaler={...}) refuse (torch's own GradScaler takes the first ones)
OUT_OF_RANGE = [
    {"backoff_factor": 0.0}, {"backoff_factor": -0.5}, {"backoff_factor": 1.0}, {"backoff_factor": 2.0},
    {"growth_factor": 1.0}, {"growth_factor": 0.5}, {"growth_factor": math.inf}, {"backoff_factor": math.nan},
    {"growth_interval": 0}, {"growth_interval": -3}, {"growth_interval": 1.5},
]


def refusal(make) -> str:
    with pytest.raises(ValueError) as info:  # (a ValueError: torch's own asserts were AssertionErrors)
        make()
    return str(info.value)


@pytest.mark.parametrize("settings", OUT_OF_RANGE, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_a_guarded_gradscaler_made_directly_refuses_what_make_scaler_refuses_in_its_words(settings):
    said = refusal(lambda: Precision("fp16", "cpu").make_scaler(**settings))
    assert said.startswith(f"scaler {next(iter(settings))} must be ")
    assert refusal(lambda: GuardedGradScaler("cpu", **settings)) == said
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert refusal(lambda: Guard(model, opt, precision="fp16", scaler=settings)) == said


@pytest.mark.parametrize("settings", [{"backoff_factor": 0.0}, {"backoff_factor": -0.5}, {"growth_interval": 0},
                                      {"growth_factor": math.inf}])
def test_a_plain_gradscaler_torch_takes_is_refused_by_the_same_rule(settings):
    plain = torch.amp.GradScaler("cpu", **settings)  # (torch asserts only growth > 1 and backoff < 1)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    said = refusal(lambda: Guard(model, opt, precision="fp16", scaler=plain))
    assert said == refusal(lambda: Precision("fp16", "cpu").make_scaler(**settings))


def test_a_disabled_guarded_gradscaler_keeps_no_settings_and_is_not_refused_for_them():
    # (as torch's: a disabled scaler's settings do nothing; from_scaler makes one for a disabled GradScaler)
    assert not GuardedGradScaler("cpu", enabled=False, backoff_factor=0.0).is_enabled()


SAVED_OUT_OF_RANGE = [("backoff_factor", 2.0, "expected in (0, 1)"), ("backoff_factor", 1.0, "expected in (0, 1)"),
                      ("growth_factor", 0.5, "expected a finite number > 1"),
                      ("growth_factor", 1.0, "expected a finite number > 1")]


@pytest.mark.parametrize(("key", "value", "want"), SAVED_OUT_OF_RANGE)
def test_guard_load_state_dict_refuses_saved_factors_the_config_refuses_and_changes_nothing(key, value, want):
    model = torch.nn.Linear(2, 1)
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16")
    state = guard.state_dict()
    state["scaler"] = {**state["scaler"], "scale": 2.0**126, key: value}
    before = guard.scaler.state_dict()
    with pytest.raises(ValueError, match=rf"^{key} is {value!r}, {want.replace('(', '[(]').replace(')', '[)]')}$"):
        guard.load_state_dict(state)
    assert guard.scaler.state_dict() == before


@pytest.mark.parametrize(("key", "value", "want"), SAVED_OUT_OF_RANGE)
def test_check_state_names_the_field_with_the_prefix(key, value, want):
    scaler = GuardedGradScaler("cpu")
    with pytest.raises(ValueError) as info:
        scaler.check_state({**scaler.state_dict(), key: value}, "state.scaler.")
    assert str(info.value) == f"state.scaler.{key} is {value!r}, {want}"
