"""Review 54n: a checkpoint's ``magic`` and ``format`` are compared only as the exact str and int
they must be (a tensor's ``==`` is a tensor: its truth raised, or, with one element, passed), and
``step``/the weights/the config are checked by the one check a resume runs."""

from __future__ import annotations

import pytest
import torch

from ampguard import checkpoint as ckpt
from ampguard import checkpointer as ck
from ampguard.errors import InputError


def saved(tmp_path, **fields):
    """A complete checkpoint written with torch.save (no ampguard marker), ``fields`` over it."""
    payload = {**ck._example_payload(4, {}), "magic": ckpt.MAGIC, "format": ckpt.FORMAT, **fields}
    path = tmp_path / "step-00000004.pt"
    torch.save(payload, path)
    return path


@pytest.mark.parametrize("value, said", [
    (torch.tensor([1, 2]), "a Tensor"),  # (it raised "Boolean value of Tensor with more than one value is ambiguous")
    (torch.tensor(1), "a Tensor"),  # (tensor(1) != 1 is tensor(False): it passed)
    (True, "True"),  # (True == 1: it passed)
    (1.0, "1.0"),
])
def test_a_format_that_is_not_the_int_1_is_refused_on_one_line(tmp_path, value, said):
    path = saved(tmp_path, format=value)
    with pytest.raises(InputError) as err:
        ckpt.load_checkpoint(path)
    assert str(err.value) == f"{path}: checkpoint format {said}, this ampguard reads 1"


@pytest.mark.parametrize("value", [torch.tensor([1, 2]), torch.tensor(1), ["ampguard-checkpoint"]])
def test_a_magic_that_is_not_the_text_is_not_an_ampguard_checkpoint(tmp_path, value):
    path = saved(tmp_path, magic=value)
    with pytest.raises(InputError, match=r"not an ampguard checkpoint \(a plain PyTorch state_dict\? load it into the "
                                         r"model in your task\.factory's build\)$"):
        ckpt.load_checkpoint(path)


def test_validate_and_locate_check_the_step_with_the_check_resume_runs(tmp_path):
    """load_trained_weights (validate, locate) took a step of 'abc' and reported it."""
    from ampguard.config import validate

    model = torch.nn.Linear(2, 1)
    path = saved(tmp_path, model=model.state_dict(), step="abc")
    with pytest.raises(InputError) as err:
        ck.load_trained_weights(model, path, validate({"task": {"name": "linear"}}), "cpu")
    assert str(err.value) == f"{path}: bad checkpoint: step is 'abc', expected an int >= 0"
    with pytest.raises(InputError) as again:
        ck.check_payload(ck.Loaded(path, torch.load(path, weights_only=True)))
    assert str(again.value) == str(err.value)  # (the same check, the same line)


@pytest.mark.parametrize("value", [[[0.5, 0.5]], "w", None])
def test_a_weight_that_is_not_a_tensor_is_named_by_load_weights_and_by_a_resume(tmp_path, value):
    model = torch.nn.Linear(2, 1)
    path = saved(tmp_path, model={**model.state_dict(), "weight": value})
    with pytest.raises(InputError) as err:
        ckpt.load_weights(model, path)
    assert str(err.value).startswith(f"{path}: bad checkpoint: model.weight is ")
    assert str(err.value).endswith(", expected a tensor")
    with pytest.raises(InputError) as again:
        ck.check_payload(ck.Loaded(path, torch.load(path, weights_only=True)))
    assert str(again.value) == str(err.value)


def test_a_module_extra_state_may_be_anything(tmp_path):
    assert ckpt.not_weights({"w": torch.zeros(1), "norm._extra_state": {"a": [1]}}) == ""


@pytest.mark.parametrize("config, said", [
    ({"scheduler_on_skip": -5}, "config: scheduler_on_skip: Input should be 'hold' or 'step' (got -5)"),
    ({"optimizer": {"lr": 1e40}}, "config: optimizer.lr: must be <= 3.40282e+38, the largest float32 (got 1e+40)"),
    ({"log": {"dir": {"a": 1}}}, "config: log.dir: "),
    ({"monitor": {"bogus": 1}}, "config: monitor.bogus: unknown key"),
])
def test_a_config_the_schema_refuses_is_a_bad_checkpoint(tmp_path, config, said):
    path = saved(tmp_path, config=config)
    with pytest.raises(InputError) as err:
        ck.check_payload(ck.Loaded(path, torch.load(path, weights_only=True)))
    assert str(err.value).startswith(f"{path}: bad checkpoint: {said}")


def test_a_config_of_an_older_ampguard_is_read_as_it_ran(tmp_path):
    """A key added since (monitor.clear_rate) is missing, and a key it lists twice (fp8.exclude) read once."""
    path = saved(tmp_path, config={"monitor": {"alert_rate": 0.1}, "fp8": {"exclude": ["a", "a"]}})
    ck.check_payload(ck.Loaded(path, torch.load(path, weights_only=True)))


@pytest.mark.parametrize("task", [
    {"name": "charlm", "n_head": torch.zeros(2)},  # (a RuntimeError: Boolean value of Tensor ... ambiguous)
    {"name": torch.zeros(10, 10)},  # (its repr, many lines, went into the error line)
])
def test_validate_and_locate_check_the_config_they_compare_the_task_of(tmp_path, task):
    from ampguard.config import validate

    model = torch.nn.Linear(2, 1)
    path = saved(tmp_path, model=model.state_dict(), config={"task": task})
    with pytest.raises(InputError) as err:
        ck.load_trained_weights(model, path, validate({"task": {"name": "charlm"}}), "cpu")
    assert str(err.value) == f"{path}: bad checkpoint: config is a dict, expected a mapping of plain data"


def test_an_older_runs_names_listed_twice_are_read_once_not_refused():
    """Review 54q: a checkpoint's config is checked against the schema on resume; an older run's
    ``fp32_modules`` or ``rollback.triggers`` listed a name twice before that was refused, and its
    checkpoints were refused as damaged; they read as the run ran, once."""
    from ampguard.checkpointer import check_config
    from ampguard.config import plain_data, validate

    saved = plain_data(validate({"precision": "fp16", "monitor": {"fail_rate": 0.5}, "checkpoint": {"every": 5}}))
    saved["fp32_modules"] = ["head", "head"]
    saved["rollback"] = {**saved["rollback"], "triggers": ["skip_guard", "skip_guard"]}
    check_config("step-00000004.pt", saved)  # (no InputError)
