"""Review 53g: what the guard's Python API took silently, where a seed's rule or the CLI speaks.

``guard.unscale_()`` after every micro-batch (a ported loop's unscale_ outside its ``if
boundary:``) turned each group of N into N updates of gradients divided by N, unsaid; the
``scaler=`` settings of a precision that runs no loss scaler were dropped unsaid (the CLI says
"precision bf16 uses no loss scaler: scaler.init_scale ignored"); a float16 weight under bf16
was told to undo a cast it never had (".to(torch.bfloat16)").
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from ampguard import AmpguardWarning, Guard
from ampguard.precision import Precision, SlowPrecisionWarning, check_scaler_settings
from ampguard.step import ShortGroupWarning

from helpers import train


def _loss(model: nn.Module) -> torch.Tensor:
    return model(torch.ones(2, 3)).pow(2).mean()


def _guard(precision: str = "fp32", n: int = 4) -> tuple[nn.Module, Guard]:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    return model, Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision=precision,
                        accumulation_steps=n, max_norm=None)


def _short_group_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, ShortGroupWarning)]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_unscale_after_every_micro_batch_is_said_once_with_the_groups_numbers(precision):
    # review 53g: unscale_() per micro-batch (seed 001: once, after the group's backwards) made every
    # micro-batch a step of gradients divided by 4, with no word; the groups still end short (the
    # auto-close is kept), now said once per guard
    model, guard = _guard(precision)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = []
        for _ in range(8):
            guard.backward(_loss(model))
            guard.unscale_()
            records.append(guard.step())
    assert [r.step for r in records] == list(range(1, 9)) and guard.updates == 8  # the behaviour kept
    said = _short_group_warnings(caught)
    assert len(said) == 1, said
    assert said[0].startswith("Guard.unscale_() after micro-batch 1 of 4: the group ends short"), said[0]
    assert "guard.step(close=True)" in said[0]
    assert issubclass(ShortGroupWarning, AmpguardWarning)


def test_the_warning_names_the_micro_batch_the_group_was_cut_at():
    model, guard = _guard()
    for _ in range(4):  # a whole group first
        guard.backward(_loss(model))
        guard.step()
    guard.backward(_loss(model))
    guard.step()
    guard.backward(_loss(model))
    with pytest.warns(ShortGroupWarning, match=r"^Guard\.unscale_\(\) after micro-batch 2 of 4: the group ends short"):
        guard.unscale_()
        assert guard.step().step == 2


def test_close_true_after_unscale_and_a_full_group_say_nothing():
    # the legitimate short group (a loop whose data ended inside a group, a framework's last short
    # group) says close=True; a full group unscaled after its last backward is the recipe
    model, guard = _guard()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShortGroupWarning)
        guard.backward(_loss(model))
        guard.step()
        guard.backward(_loss(model))
        guard.unscale_()
        assert guard.step(close=True).step == 1  # a group of 2 of 4, said so
        for _ in range(4):
            guard.backward(_loss(model))
            if guard.micro_batches == 4:
                guard.unscale_()
            record = guard.step()
        assert record.step == 2


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_scaler_settings_a_precision_without_a_scaler_ignores_are_said_naming_the_keys(precision):
    # review 53g: the CLI said "precision bf16 uses no loss scaler: scaler.init_scale ignored"; the
    # API took scaler=dict(init_scale=...) and dropped it, unsaid
    model = nn.Linear(3, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision=precision,
                      scaler=dict(init_scale=1024.0, growth_interval=10, enabled=False))
    # (not the CPU's emulated-bf16 warning, said once a process: whether this test says it depends on the order)
    said = [str(w.message) for w in caught
            if issubclass(w.category, AmpguardWarning) and not issubclass(w.category, SlowPrecisionWarning)]
    assert said == [f"precision {precision} uses no loss scaler: scaler settings init_scale, growth_interval "
                    "ignored"], said
    assert not guard.scaler.is_enabled()


def test_scaler_settings_of_a_scaler_turned_off_are_said_too(tmp_path):
    # review 53j: fp16 with enabled=False dropped init_scale unsaid in the API (the CLI said it); a
    # CLI run with the scaler off says it once, by the config's check, not again by the guard's
    model = nn.Linear(3, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16",
              scaler=dict(enabled=False, init_scale=8.0))
    said = [str(w.message) for w in caught if issubclass(w.category, AmpguardWarning)]
    assert "the loss scaler is off (enabled: False): scaler settings init_scale ignored" in said, said
    base = ("--set", "task.name=linear", "--set", "precision=fp16", "--set", "steps=1", "--set", "scaler.enabled=false")
    code, _, err = train(tmp_path, "off", *base, "--set", "scaler.init_scale=1024")
    assert code == 0 and err.count("ignored") == 1 and "scaler.init_scale ignored" in err, err


def test_scaler_settings_that_apply_say_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error", AmpguardWarning)
        check_scaler_settings("bf16", {"enabled": False})
        check_scaler_settings("bf16", {})
        check_scaler_settings("fp16", {"init_scale": 1024.0, "growth_interval": 10})


def test_a_bf16_train_run_says_its_ignored_scaler_settings_once_and_none_by_default(tmp_path):
    # the trainer handed the guard the config's whole scaler section (every default): the guard
    # must not say again, or at all, what the config's check says once
    base = ("--set", "task.name=linear", "--set", "precision=bf16", "--set", "steps=2")
    code, _, err = train(tmp_path, "plain", *base)
    assert code == 0 and "loss scaler" not in err, err
    code, _, err = train(tmp_path, "given", *base, "--set", "scaler.init_scale=1024")
    assert code == 0, err
    assert err.count("uses no loss scaler") == 1, err
    assert "ampguard: warning: precision bf16 uses no loss scaler: scaler.init_scale ignored" in err


@pytest.mark.parametrize("dtype, cast", [(torch.float16, r"\(no \.half\(\) / \.to\(torch\.float16\)\)$"),
                                         (torch.bfloat16, r"\(no \.to\(torch\.bfloat16\)\)$")])
def test_a_half_weights_refusal_names_the_cast_of_the_dtype_found(dtype, cast):
    # review 53g: a float16 weight under bf16 was told "(no .half() / .to(torch.bfloat16))"
    with pytest.raises(ValueError, match=rf"^parameter 'weight' is {str(dtype)[6:]}, .*{cast}"):
        Precision("bf16", "cpu").check(nn.Linear(2, 2).to(dtype), torch.device("cpu"))


@pytest.mark.parametrize("enabled", ["false", 0, 1])
def test_a_scaler_enabled_that_is_no_bool_is_refused(enabled):
    # review 53n: "false" (a text from a YAML or JSON of one's own) left fp16's scaler running at 65536,
    # unsaid; 0 turned it off, and GuardedTrainer told its callback a scaler ran
    model = nn.Linear(3, 1)
    with pytest.raises(ValueError, match=r"^scaler enabled must be True, False or None, got "):
        Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16", scaler={"enabled": enabled})
    with pytest.raises(ValueError, match=r"^scaler enabled must be True, False or None, got "):
        check_scaler_settings("fp16", {"enabled": enabled})


def test_a_loss_scale_a_guard_with_its_scaler_off_cannot_take_is_said():
    # review 53n: an fp16 state loaded into a guard whose scaler is off dropped its scale (32768), unsaid
    def make(**scaler):
        model = nn.Linear(3, 1)
        return Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16", scaler=scaler or None)
    saved = make().state_dict()
    off = make(enabled=False)
    with pytest.warns(AmpguardWarning, match=r"the state's loss scale 65536\.0 is not taken: this guard's loss "
                                             r"scaler is off"):
        off.load_state_dict(saved)
    assert not off.scaler.is_enabled()
