"""What a checkpoint must be before a resume uses it (issue 16): the payload's schema
(``checkpointer.check_payload``), whose checkpoint it is (``check_belongs``), whether it fits the
model, optimizer, scheduler, loss scaler and monitors this run built
(``CheckpointManager.check_fits``), what ``restore`` refuses (an RNG state past C's integers),
the data position's bound (``check_resume``), and ``checkpoint.safe_load`` telling junk bytes
from pickled code. Real parts (a tiny ``nn.Linear``), no training run.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ampguard import checkpoint as ckpt
from ampguard import checkpointer as ck
from ampguard.checkpointer import (
    CONFIG, DATA, MODEL, OPTIMIZER, PRECISION, RNG, ROLLBACKS, RUN_ID, SCHEDULER, STATE, STATE_KEYS, STEP,
    TORCH_VERSION, UPDATES, WORLD_SIZE, CheckpointManager, Loaded, ModelState, OptimizerState, Resume, RngState,
)
from ampguard.config import ScalerConfig, validate
from ampguard.distributed import DistInfo
from ampguard.errors import InputError
from ampguard.monitor import LossSpikeDetector, RunMonitor
from ampguard.step import AmpTrainState

PATH = Path("run/checkpoints/step-00000004.pt")
RUN = "0123456789abcdef0123456789abcdef"


def parts(in_features: int = 3, groups: int = 1) -> dict[str, Any]:
    model = nn.Linear(in_features, 2)
    params = list(model.parameters())
    chunks = [{"params": params}] if groups == 1 else [{"params": [p]} for p in params]
    optimizer = torch.optim.AdamW(chunks, lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: 1.0)
    state = AmpTrainState(model, optimizer, nn.functional.mse_loss, precision="fp32", scheduler=scheduler)
    return {MODEL: ModelState(model), OPTIMIZER: OptimizerState(model, optimizer), SCHEDULER: scheduler,
            STATE: state, RNG: RngState(DistInfo())}


def payload(step: int = 4, **changes: Any) -> dict[str, Any]:
    """A payload as a run saves it after ``step`` steps (the counters set by hand)."""
    made = parts()
    made[STATE].steps = made[STATE].updates = step
    out = {UPDATES: step, CONFIG: validate({"task": {"name": "linear"}}).model_dump(mode="json"), PRECISION: "fp32",
           WORLD_SIZE: 1, TORCH_VERSION: str(torch.__version__), RUN_ID: RUN, STEP: step, DATA: step, ROLLBACKS: [],
           **{key: part.state_dict() for key, part in made.items()}}
    out.update(changes)
    return out


def refusal(loaded: Loaded, check=ck.check_payload) -> str:
    with pytest.raises(InputError) as err:
        check(loaded)
    text = str(err.value)
    assert "\n" not in text and err.value.__cause__ is None
    return text


# ---------------------------------------------------------------------------- check_payload


def test_the_state_keys_are_those_the_guarded_step_writes():
    assert tuple(parts()[STATE].state_dict()) == STATE_KEYS


def test_a_payload_as_a_run_saves_it_passes():
    ck.check_payload(Loaded(PATH, payload()))
    ck.check_payload(Loaded(PATH, payload(rng=[ckpt.rng_state(), ckpt.rng_state()])))  # a list by rank (torchrun)
    old = payload()
    for key in (UPDATES, WORLD_SIZE, ROLLBACKS, RUN_ID, PRECISION, TORCH_VERSION):  # older checkpoints lack them
        del old[key]
    ck.check_payload(Loaded(PATH, old))


BAD = [
    (STEP, "abc", "step is 'abc', expected an int >= 0"),
    (STEP, -1, "step is -1, expected an int >= 0"),
    (STEP, 4.0, "step is 4.0, expected an int >= 0"),
    (STEP, torch.tensor(4), "step is a tensor of shape [], expected an int >= 0"),
    (UPDATES, "x", "updates is 'x', expected an int >= 0"),
    (DATA, True, "data_position is True, expected an int >= 0"),
    (DATA, None, "data_position is None, expected an int >= 0"),
    (WORLD_SIZE, "two", "world_size is 'two', expected an int >= 1"),
    (WORLD_SIZE, 0, "world_size is 0, expected an int >= 1"),
    (CONFIG, "x", "config is 'x', expected a mapping of plain data"),
    (CONFIG, {"task": torch.zeros(1)}, "config is a dict, expected a mapping of plain data"),
    (CONFIG, {1: "not a str key"}, "config is a dict, expected a mapping of plain data"),
    (PRECISION, 16, "precision is 16, expected a str"),
    (RUN_ID, "../../etc", "run_id is '../../etc', expected 32 hex digits"),
    (RUN_ID, RUN.upper(), "expected 32 hex digits"),
    (MODEL, "w", "model is 'w', expected a mapping of parameter names to tensors"),
    (MODEL, {"weight": [1.0]}, "model.weight is a list of 1, expected a tensor"),  # (review 54n: it named the mapping)
    (OPTIMIZER, [], "optimizer is a list, expected an optimizer state"),
    (OPTIMIZER, {"state": {}, "param_groups": [{"lr": 1}]}, "optimizer is a dict, expected an optimizer state"),
    (SCHEDULER, "x", "scheduler is 'x', expected a mapping"),
    (SCHEDULER, {1: 2}, "scheduler is a dict, expected a mapping"),
    (STATE, "x", "state is 'x', expected a mapping with scaler, step, updates, precision, accumulation_steps, monitors"),
    (STATE, {"step": 4}, "state is a dict, expected a mapping with scaler"),
    (RNG, 3, "rng is 3, expected a mapping (a list of them under torchrun)"),
    (RNG, [1, 2], "rng is a list, expected a mapping"),
    (ROLLBACKS, "step 3", "rollbacks is 'step 3', expected a list of str"),
    (ROLLBACKS, [b"x"], "rollbacks is a list, expected a list of str"),
]


@pytest.mark.parametrize(("key", "value", "said"), BAD, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(BAD)])
def test_a_field_of_the_wrong_type_is_one_line_naming_the_file_and_the_field(key, value, said):
    line = refusal(Loaded(PATH, payload(**{key: value})))
    assert line.startswith(f"{PATH}: bad checkpoint: ") and said in line


@pytest.mark.parametrize("key", [STEP, DATA, CONFIG, MODEL, OPTIMIZER, SCHEDULER, STATE, RNG])
def test_a_missing_field_is_named(key):
    broken = payload()
    del broken[key]
    assert refusal(Loaded(PATH, broken)) == f"{PATH}: bad checkpoint: {key} is missing"


@pytest.mark.parametrize(("key", "value", "said"), [
    ("step", "4", "state.step is '4', expected an int >= 0"),
    ("updates", -1, "state.updates is -1, expected an int >= 0"),
    ("accumulation_steps", 0, "state.accumulation_steps is 0, expected an int >= 1"),
    ("precision", None, "state.precision is None, expected a str"),
    ("scaler", [], "state.scaler is a list, expected a mapping"),
    ("monitors", "x", "state.monitors is 'x', expected a mapping"),
    ("step", 3, "state.step is 3, expected 4 (the checkpoint's step)"),
    ("updates", 5, "state.updates is 5, expected at most 4 (the checkpoint's step)"),
])
def test_the_guarded_steps_state_is_checked_field_by_field(key, value, said):
    good = payload()
    line = refusal(Loaded(PATH, {**good, STATE: {**good[STATE], key: value}}))
    assert line == f"{PATH}: bad checkpoint: {said}"


def test_the_counters_must_agree_with_the_step():
    assert "updates is 5, expected at most 4" in refusal(Loaded(PATH, payload(updates=5)))
    assert "rollbacks is a list, expected at most 4 entries" in refusal(Loaded(PATH, payload(rollbacks=["r"] * 5)))
    ck.check_payload(Loaded(PATH, payload(rollbacks=["r"] * 4)))


def test_a_deep_config_and_a_long_value_stay_one_short_line():
    deep: dict = {}
    node = deep
    for _ in range(40):
        node["a"] = {}
        node = node["a"]
    assert "config is a dict" in refusal(Loaded(PATH, payload(config=deep)))
    line = refusal(Loaded(PATH, payload(step="x" * 10_000)))
    assert len(line) < 200 and line.endswith("xxx', expected an int >= 0") and "x...x" in line  # (head ... tail)


# ---------------------------------------------------------------------------- check_belongs


def test_a_checkpoint_belongs_when_its_name_is_its_step_and_its_id_is_the_run_folders():
    ck.check_belongs(Loaded(PATH, payload()), RUN)
    old = payload()
    del old[RUN_ID]
    ck.check_belongs(Loaded(PATH, old), RUN)  # from before run ids: its config decides (check_resume)
    ck.check_belongs(Loaded(PATH, old), None)


@pytest.mark.parametrize(("path", "run_id", "said"), [
    (Path("step-00000099.pt"), RUN, "named for step 99 but holds step 4"),
    (Path("step-00000003.pt"), RUN, "named for step 3 but holds step 4"),
    (Path("best.pt"), RUN, "not named step-<8 digits>.pt"),
    (Path("step-4.pt"), RUN, "not named step-<8 digits>.pt"),
    (PATH, "f" * 32, f"saved by another run (run id {RUN}; runs/a is {'f' * 32})"),
    (PATH, None, f"saved by run {RUN}, but runs/a has no run-id file"),
])
def test_a_checkpoint_that_is_not_this_runs_is_refused_naming_it(path, run_id, said):
    line = refusal(Loaded(path, payload()), lambda loaded: ck.check_belongs(loaded, run_id, Path("runs/a")))
    assert line.startswith(f"{path}: ") and said in line


# ---------------------------------------------------------------------------- check_fits


def manager(**kwargs: Any) -> CheckpointManager:
    return CheckpointManager(None, parts(**kwargs), keep=1)


def test_a_checkpoint_of_the_same_shapes_fits():
    manager().check_fits(Loaded(PATH, payload()))
    trained = parts()
    model, opt = trained[MODEL].model, trained[OPTIMIZER].optimizer
    model(torch.ones(1, 3)).sum().backward()
    opt.step()  # Adam's moments now exist, shaped like the parameters
    manager().check_fits(Loaded(PATH, payload(optimizer=opt.state_dict())))


@pytest.mark.parametrize(("model", "said"), [
    ({"weight": torch.zeros(2, 5), "bias": torch.zeros(2)}, "weight is [2, 5] in the checkpoint, [2, 3] here"),
    ({"weight": torch.zeros(2, 3)}, "missing 'bias'"),
    ({"weight": torch.zeros(2, 3), "bias": torch.zeros(2), "head.weight": torch.zeros(1)}, "unexpected 'head.weight'"),
    ({"weight": torch.zeros(2, 3), "bias_extra_state": 1}, "missing 'bias'; unexpected 'bias_extra_state'"),
])
def test_a_model_of_another_shape_does_not_fit(model, said):
    line = refusal(Loaded(PATH, payload(model=model)), manager().check_fits)
    assert line.startswith(f"{PATH}: its model does not match the one this run builds: ") and said in line


def test_an_optimizer_state_of_other_parameters_does_not_fit():
    other = parts(in_features=5)
    model, opt = other[MODEL].model, other[OPTIMIZER].optimizer
    model(torch.ones(1, 5)).sum().backward()
    opt.step()
    line = refusal(Loaded(PATH, payload(optimizer=opt.state_dict())), manager().check_fits)
    assert line.startswith(f"{PATH}: its optimizer state does not match this run's parameters: ")
    assert "of parameter 0 is [2, 5], the parameter [2, 3]" in line
    line = refusal(Loaded(PATH, payload(optimizer=parts(groups=2)[OPTIMIZER].state_dict())), manager().check_fits)
    assert "parameter groups of [1, 1] in the checkpoint, [2] here" in line
    bad = {"state": {0: "x"}, "param_groups": payload()[OPTIMIZER]["param_groups"]}
    assert "the state of parameter 0 is 'x'" in refusal(Loaded(PATH, payload(optimizer=bad)), manager().check_fits)


@pytest.mark.parametrize(("edit", "said"), [
    (lambda state: state["param_groups"][0].update(params=[0, 5]), "the state of parameter 1 belongs to no parameter "
                                                                   "group (its groups name 0, 5)"),
    (lambda state: state["state"].__setitem__("x", state["state"].pop(0)), "the state of parameter 'x' belongs to no "
                                                                          "parameter group (its groups name 0, 1)"),
    (lambda state: state["param_groups"][0].update(params=[0, 0]), "parameter 0 is named twice in its parameter groups"),
    (lambda state: state["param_groups"][0].update(params=[0, None]), "a parameter id is None"),
])
def test_an_optimizer_state_whose_entries_are_not_its_groups_parameters_does_not_fit(edit, said):
    # review 52a: Optimizer.load_state_dict maps the saved ids by position and drops a state entry no id
    # names; a hand-edited group or state key left a parameter's AdamW moments behind, unsaid (exit 0)
    trained = parts()
    model, opt = trained[MODEL].model, trained[OPTIMIZER].optimizer
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state = opt.state_dict()
    edit(state)
    line = refusal(Loaded(PATH, payload(optimizer=state)), manager().check_fits)
    assert line == f"{PATH}: its optimizer state does not match this run's parameters: {said}", line


@pytest.mark.parametrize(("changes", "said"), [
    ({"optimizer": {}}, "'optimizer' is not scheduler state"),
    ({"__class__": 1}, "'__class__' is not scheduler state"),
    ({"last_epoch": "x"}, "last_epoch is 'x', this scheduler's is 0"),
    ({"base_lrs": [0.1, 0.1]}, "base_lrs has 2 entries, this scheduler's 1"),
    ({"base_lrs": ["x"]}, "base_lrs[0] is 'x', this scheduler's is 0.1"),  # not "a list ... a list"
    ({"base_lrs": [float("nan")]}, "base_lrs[0] is nan, this scheduler's is 0.1"),
    ({"lr_lambdas": [{"x": 1}]}, "lr_lambdas[0] is a dict, this scheduler's is None"),
])
def test_a_scheduler_state_that_would_replace_its_attributes_or_types_does_not_fit(changes, said):
    scheduler = {**payload()[SCHEDULER], **changes}
    line = refusal(Loaded(PATH, payload(scheduler=scheduler)), manager().check_fits)
    assert line.startswith(f"{PATH}: its scheduler state does not fit this run's scheduler: ") and said in line


@pytest.mark.parametrize(("changes", "said"), [
    ({"last_epoch": -5}, "last_epoch is -5, and a scheduler of 4 step(s) counts 0 to 4"),
    ({"last_epoch": 10**9}, "last_epoch is 1000000000, and a scheduler of 4 step(s) counts 0 to 4"),
    ({"_step_count": 0}, "_step_count is 0, and a scheduler of 4 step(s) counts 1 to 5"),
])
def test_a_scheduler_that_counted_steps_no_run_of_the_checkpoints_length_takes_does_not_fit(changes, said):
    # review 50e: last_epoch -5 passed, then the first step after the resume divided by zero (the logs
    # already cut); 1e9 put the LR at the schedule's floor from the resumed step on, unsaid
    line = refusal(Loaded(PATH, payload(scheduler={**payload()[SCHEDULER], **changes})), manager().check_fits)
    assert line.startswith(f"{PATH}: its scheduler state does not fit this run's scheduler: ") and said in line
    for fits in (0, 4):  # the counts a run of 4 steps can leave (a scheduler held on every skip: 0)
        manager().check_fits(Loaded(PATH, payload(scheduler={**payload()[SCHEDULER], "last_epoch": fits,
                                                              "_step_count": fits + 1})))


@pytest.mark.parametrize(("entry", "value", "said"), [
    ("step", torch.tensor(-4.0), "step of parameter 0 is below 0"),
    ("exp_avg_sq", -1.0, "exp_avg_sq of parameter 0 is below 0"),
])
def test_an_optimizer_count_or_mean_of_squares_below_zero_does_not_fit(entry, value, said):
    # review 50e: an AdamW step of -4 crashed the first step after the resume had cut the logs; an
    # exp_avg_sq below 0 made every update NaN (the final weights NaN), exit 0
    trained = parts()
    model, opt = trained[MODEL].model, trained[OPTIMIZER].optimizer
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state = opt.state_dict()
    moment = state["state"][0]
    moment[entry] = value if entry == "step" else torch.full_like(moment[entry], value)
    line = refusal(Loaded(PATH, payload(optimizer=state)), manager().check_fits)
    assert line.startswith(f"{PATH}: its optimizer state does not match this run's parameters: ") and said in line


# ---------------------------------------------------------------------------- check_fits: parameter groups
# Optimizer.load_state_dict puts the saved groups' settings in place as they are, and the step
# reads them: betas [0.9] used to fail in AdamW's step ("not enough values to unpack"), mid-run.


def saved_group(**changes: Any) -> dict[str, Any]:
    """The optimizer state of ``parts()`` with its one parameter group changed (``...``: removed)."""
    state = payload()[OPTIMIZER]
    group = {**state["param_groups"][0], **changes}
    return {**state, "param_groups": [{k: v for k, v in group.items() if v is not ...}]}


BAD_GROUP = [
    ({"betas": [0.9]}, "param_groups[0].betas has 1 entries, this optimizer's 2"),
    ({"betas": (0.9, "x")}, "param_groups[0].betas[1] is 'x', this optimizer's is 0.999"),
    ({"lr": "x"}, "param_groups[0].lr is 'x', this optimizer's is 0.1"),
    ({"lr": float("nan")}, "param_groups[0].lr is nan, this optimizer's is 0.1"),
    ({"lr": torch.tensor([0.1, 0.2])}, "param_groups[0].lr is a tensor of shape [2], this optimizer's is 0.1"),
    ({"eps": 10**400}, "param_groups[0].eps is 1000000000"),  # float() of it: OverflowError
    ({"weight_decay": None}, "param_groups[0].weight_decay is None, this optimizer's is 0.01"),
    ({"amsgrad": "x"}, "param_groups[0].amsgrad is 'x', this optimizer's is False"),
    ({"eps": ...}, "param_groups[0] has no 'eps'"),  # KeyError in the step
]


@pytest.mark.parametrize(("changes", "said"), BAD_GROUP,
                         ids=[f"{next(iter(c))}-{i}" for i, (c, _) in enumerate(BAD_GROUP)])
def test_a_parameter_group_setting_of_another_kind_does_not_fit(changes, said):
    line = refusal(Loaded(PATH, payload(optimizer=saved_group(**changes))), manager().check_fits)
    assert line.startswith(f"{PATH}: its optimizer state does not match this run's parameters: {said}")


def test_a_group_from_the_other_path_or_an_older_pytorch_fits_and_loads_but_not_a_str_lr():
    """The fast path's LR is a tensor and its AdamW fused; either path reads the other's
    checkpoints. A flag an older PyTorch did not save is set by the optimizer."""
    saved = saved_group(lr=torch.tensor(0.5), fused=True, decoupled_weight_decay=...)
    manager().check_fits(Loaded(PATH, payload(optimizer=saved)))
    made = parts()
    made[OPTIMIZER].load_state_dict(saved)
    group = made[OPTIMIZER].optimizer.param_groups[0]
    assert float(group["lr"]) == 0.5 and group["decoupled_weight_decay"] is True
    str_lr = {**saved, "param_groups": [{**saved["param_groups"][0], "lr": "0.5"}]}
    line = refusal(Loaded(PATH, payload(optimizer=str_lr)), manager().check_fits)
    assert line.endswith("param_groups[0].lr is '0.5', this optimizer's is 0.1")


# ---------------------------------------------------------------------------- check_fits: the loss scaler and monitors


def step_parts() -> dict[str, Any]:
    """``parts()`` under fp16 (the loss scaler on), with the monitors a run registers."""
    made = parts()
    model, optimizer, scheduler = made[MODEL].model, made[OPTIMIZER].optimizer, made[SCHEDULER]
    # (the floor the payload's config says, as a run's scaler has it: a resume holds the two equal, review 54b)
    state = AmpTrainState(model, optimizer, nn.functional.mse_loss, precision="fp16", scheduler=scheduler,
                          scaler={"min_scale": ScalerConfig().min_scale})
    state.monitors["run"] = RunMonitor(window=8)
    state.monitors["loss_spike"] = LossSpikeDetector(window=3, z=3.0)
    return {**made, STATE: state}


def step_payload(path: str, value: Any) -> dict[str, Any]:
    """A payload of ``step_parts()`` after 4 steps, with ``state.<path>`` set (``...``: removed)."""
    made = step_parts()
    state = made[STATE]
    for _ in range(4):
        state.step(torch.ones(2, 3), torch.zeros(2, 2))
    saved = state.state_dict()
    for name, monitor in state.monitors.items():
        saved["monitors"][name] = monitor.state_dict()
    *parents, last = path.split(".")
    node = saved
    for key in parents:
        node = node[key]
    if value is ...:
        del node[last]
    elif last:
        node[last] = value
    return payload(state=saved)


BAD_STEP_STATE = [  # each loaded as it was, then failed in the training loop (traceback, exit 1)
    ("scaler.growth_factor", "x", "state.scaler.growth_factor is 'x', expected a finite number > 1"),
    ("scaler._growth_tracker", "x",
     "state.scaler._growth_tracker is 'x', expected an int in [0, growth_interval 2000)"),
    ("scaler.scale", float("nan"), "state.scaler.scale is nan, expected a number in [0, 3.40282e+38] (a float32)"),
    ("monitors.run", "x", "state.monitors.run is 'x', expected a mapping"),
    ("monitors.run.updates", "x", "state.monitors.run.updates is 'x', expected an int >= 0"),
    ("monitors.run.skip_window.ring", [0.0], "state.monitors.run.skip_window.ring is a list of 1, expected a list of 8 "
                                             "finite numbers"),
    ("monitors.run.skip_window.pos", 8, "state.monitors.run.skip_window.pos is 8, expected an int in [0, 8)"),
    ("monitors.run.health.opening", -1, "state.monitors.run.health.opening is -1, expected an int >= 0"),
    ("monitors.loss_spike.sq", ..., "state.monitors.loss_spike.sq is missing"),
]


@pytest.mark.parametrize(("path", "value", "said"), BAD_STEP_STATE,
                         ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(BAD_STEP_STATE)])
def test_the_loss_scaler_and_monitor_states_are_checked_naming_the_whole_field(path, value, said):
    manager = CheckpointManager(None, step_parts(), keep=1)
    manager.check_fits(Loaded(PATH, step_payload("", None)))  # as the run saved it
    manager.check_fits(Loaded(PATH, step_payload("monitors.headroom", "x")))  # a monitor the step does not have
    bad = Loaded(PATH, step_payload(path, value))
    ck.check_payload(bad)  # the payload's schema holds: these are inside state.scaler / state.monitors
    assert refusal(bad, manager.check_fits) == f"{PATH}: bad checkpoint: {said}"
    line = refusal(bad, manager.restore)  # and restore refuses it too (a rollback's checkpoint)
    assert line.startswith(f"{PATH}: does not fit this run (state: ")


# ---------------------------------------------------------------------------- restore: the RNG state


@pytest.mark.parametrize("spoil", ["numpy", "random"])
def test_an_rng_state_past_cs_integers_is_one_line_naming_the_rng(spoil):
    """``np.random.set_state`` / ``random.setstate`` raise OverflowError, which restore let through."""
    state = ckpt.rng_state()
    if spoil == "numpy":
        state["numpy"] = {**state["numpy"], "pos": 10**30}
    else:
        version, internal, gauss = state["random"]
        state["random"] = (version, (2**70, *internal[1:]), gauss)
    line = refusal(Loaded(PATH, payload(rng=state)), CheckpointManager(None, parts(), keep=1).restore)
    assert line == f"{PATH}: does not fit this run (rng: Python int too large to convert to C " + (
        "long)" if spoil == "numpy" else "unsigned long)")


@pytest.mark.parametrize("states", [1, 3])
def test_an_rng_list_of_another_length_than_the_world_is_refused_naming_the_rng(states):
    """A list by rank with more states than processes was taken as it came (its first entry),
    one with fewer was 'list index out of range' on the ranks past its end."""
    parts_two = {**parts(), RNG: RngState(DistInfo(rank=1, world_size=2, local_rank=1))}
    line = refusal(Loaded(PATH, payload(**{WORLD_SIZE: 2, RNG: [ckpt.rng_state()] * states})),
                   CheckpointManager(None, parts_two, keep=1).restore)
    said = "1 state" if states == 1 else "3 states"
    assert line == f"{PATH}: does not fit this run (rng: a list of {said} for 2 processes)"


def test_parts_that_are_not_model_optimizer_or_scheduler_are_not_looked_at():
    CheckpointManager(None, {MODEL: object(), SCHEDULER: object()}, keep=1).check_fits(Loaded(PATH, {}))


# ---------------------------------------------------------------------------- check_resume: the data position


def resume(position: int, rollbacks: int = 0, picked: bool = False, **config: Any) -> Resume:
    saved = validate({"task": {"name": "linear"}, **config}).model_dump(mode="json")
    made = payload(8, config=saved, data_position=position, rollbacks=["r"] * rollbacks)
    return Resume(Loaded(Path("run/checkpoints/step-00000008.pt"), made), Path("run"), picked=picked)


@pytest.mark.parametrize(("acc", "skip", "rollbacks"), [(1, 20, 0), (3, 20, 0), (2, 5, 2), (1, 0, 3)])
def test_a_data_position_up_to_steps_x_accumulation_plus_rollbacks_x_skip_is_accepted(acc, skip, rollbacks):
    bound = 8 * acc + rollbacks * skip
    config = {"accumulation_steps": acc, "rollback": {"skip_batches": skip}}
    ck.check_resume(resume(bound, rollbacks, **config), validate({"task": {"name": "linear"}, **config}))
    with pytest.raises(InputError) as err:
        ck.check_resume(resume(bound + 1, rollbacks, **config), validate({"task": {"name": "linear"}, **config}))
    assert str(err.value) == (
        f"run/checkpoints/step-00000008.pt: data position {bound + 1} is beyond what 8 steps could have taken "
        f"({bound} = step x accumulation_steps + rollbacks x the largest rollback.skip_batches the run used)")


def check_bound(made: Resume, skip_now: int, bound: int) -> None:
    """``bound`` is the largest data position ``check_resume`` accepts of ``made`` with
    ``rollback.skip_batches`` now ``skip_now``."""
    now = validate({"task": {"name": "linear"}, "rollback": {"skip_batches": skip_now}})
    made.loaded.payload[DATA] = bound
    ck.check_resume(made, now)
    made.loaded.payload[DATA] = bound + 1
    with pytest.raises(InputError, match=f"data position {bound + 1} is beyond what 8 steps could have taken"):
        ck.check_resume(made, now)


def test_skip_batches_lowered_on_resume_still_bounds_the_rollbacks_taken_with_the_old_value():
    """``rollback.skip_batches`` is a recorded change (docs/resume.md): the run's own checkpoint,
    whose two rollbacks skipped 5 batches each, is accepted with skip_batches 0 now."""
    check_bound(resume(8, 2, rollback={"skip_batches": 5}), 0, 8 + 2 * 5)
    check_bound(resume(8, 2, rollback={"skip_batches": 5}), 7, 8 + 2 * 7)  # raised: the new one


def test_skip_batches_changed_at_an_earlier_resume_counts_from_the_policy_log():
    made = resume(8, 2, rollback={"skip_batches": 5})  # lowered from 30 to 5 at a resume from step 6
    made.loaded.payload[ck.POLICY] = [{"key": "rollback.skip_batches", "old": 30, "new": 5, "step": 6},
                                      {"key": "steps", "old": 8, "new": 100, "step": 6}]
    check_bound(made, 0, 8 + 2 * 30)
    # a checkpoint config's value that is no count is passed over (a plain-data config need not be valid)
    made.loaded.payload[CONFIG]["rollback"]["skip_batches"] = "x"
    check_bound(made, 0, 8 + 2 * 30)
    del made.loaded.payload[CONFIG]["rollback"]["skip_batches"]  # (one from before the key)
    made.loaded.payload[ck.POLICY] = []
    check_bound(made, 4, 8 + 2 * 4)


def test_a_fixed_key_of_a_picked_checkpoint_names_the_file():
    with pytest.raises(InputError) as err:
        ck.check_resume(resume(8, picked=True), validate({"task": {"name": "linear"}, "seed": 5}))
    assert str(err.value) == ("--resume: seed was 0 in run/checkpoints/step-00000008.pt, now 5; "
                              "a resumed run must keep it")


def test_a_huge_fixed_value_is_cut_short_in_the_line():
    made = resume(8)
    made.loaded.payload[CONFIG]["precision"] = "x" * 5000
    with pytest.raises(InputError) as err:
        ck.check_resume(made, validate({"task": {"name": "linear"}}))
    assert len(str(err.value)) < 250 and "precision was 'xxx" in str(err.value)


# ---------------------------------------------------------------------------- safe_load: junk vs pickled code


class RunsCode:
    def __reduce__(self):
        return os.system, ("touch PWNED",)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("junk", [b"not a checkpoint", b"Not a checkpoint", b"\x80\x02junk", b"}" * 10,
                                  pickle.dumps({"a": 1})[:-1]])
def test_junk_bytes_are_unreadable_not_pickled_objects(tmp_path, junk):
    path = tmp_path / "step-00000001.pt"
    path.write_bytes(junk)
    with pytest.raises(InputError) as err:
        ckpt.safe_load(path)
    assert str(err.value) == f"{path}: unreadable checkpoint (truncated, or not a PyTorch file)"


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("protocol", [0, 2, 4, 5, "torch.save"])
def test_a_pickle_of_code_is_refused_as_pickled_objects_and_never_runs(tmp_path, monkeypatch, protocol):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "step-00000001.pt"
    if protocol == "torch.save":
        torch.save({"model": RunsCode()}, path)
    else:
        path.write_bytes(pickle.dumps({"model": RunsCode()}, protocol=protocol))
    with pytest.raises(InputError) as err:
        ckpt.safe_load(path)
    assert str(err.value).startswith(f"{path}: refused by the weights-only loader: it holds pickled objects")
    assert not (tmp_path / "PWNED").exists()
