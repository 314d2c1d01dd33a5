"""Review 54g: the guards' decisions at their edges, where a mutation sweep found behaviour no test pinned.

Each test computes what the edge should give from the rule itself (the margin of a held-out
regression, a mean of the losses as the user computed them, a plain forward's BatchNorm
statistics, the rollback a guard decides at a step), never from a value the code printed. The
mutant each one kills is named in its comment (``/tmp/review_54/g/mutants.py``).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ampguard import Guard
from ampguard import guards as g
from ampguard.checkpoint import checkpoint_step, list_checkpoints
from ampguard.checkpointer import CONFIG, DATA, MODEL, OPTIMIZER, RNG, SCHEDULER, STATE, STEP, CheckpointManager
from ampguard.config import validate
from ampguard.guards import Guards, Rollback, Rollbacks, Stop, rollback_reach
from ampguard.events import EventLog
from ampguard.monitor import FAIL_SKIP_RATE, LossSpikeDetector, RunMonitor
from ampguard.records import SkipLog, StepLog

INF = float("inf")


def _clean(step: int, pre: float = 0.5) -> StepLog:
    return StepLog(step=step, lr=0.1, loss=1.0, grad_l2_pre_clip=pre, grad_l2_post_clip=min(pre, 1.0),
                   scaler_scale=1.0)


def _skip(step: int) -> SkipLog:
    return SkipLog(step=step, lr=0.1, loss=1.0, grad_l2_pre_clip=INF, grad_l2_post_clip=None, scaler_scale=1.0,
                   reason="non_finite_grad")


def _val_guards(threshold: float, metric: str, mode: str = "auto") -> tuple[Guards, RunMonitor]:
    config = validate({"rollback": {"triggers": ["val_regression"], "val_regression": threshold,
                                    "val_metric": metric, "val_mode": mode},
                       "checkpoint": {"every": 5}, "eval": {"every": 5}})
    monitor = RunMonitor(scaler_enabled=False)
    return Guards(config, monitor, metrics=(metric,)), monitor


# ---------------------------------------------------------------------------- val_regression's margin


def test_an_improving_negative_held_out_loss_never_regresses_and_its_margin_is_a_share_of_its_size():
    # G07 (margin = threshold x best, no abs): an NLL / ELBO-style val_loss below 0 that improves at
    # every evaluation (-2, -2.5, -3) rolled back at each one. The margin is threshold x |best|: with
    # best -2 and 0.5 the bound is -2 + 1 = -1, a regression only past it
    guards, monitor = _val_guards(0.5, "val_loss")
    for step, value in ((5, -2.0), (10, -2.5), (15, -3.0)):
        monitor.observe_eval({"val_loss": value})
        assert guards.val_regression(value) is None
        assert guards.check(_clean(step), None, {"val_loss": value}) == g.CONTINUE
    guards, monitor = _val_guards(0.5, "val_loss")
    monitor.observe_eval({"val_loss": -2.0})
    bound = -2.0 + 0.5 * abs(-2.0)  # -1.0, exact in binary
    assert guards.val_regression(bound) is None  # at the bound: not beyond it
    beyond = math.nextafter(bound, INF)
    assert guards.val_regression(beyond) == f"val_loss {beyond:.4g} > best -2 + 0.5 x 2"


def test_a_negative_higher_is_better_metric_regresses_downwards_by_a_share_of_its_size():
    # G07, the other direction: an ELBO-style metric (higher is better) at -2; the bound is -2 - 0.5 x 2 = -3
    guards, monitor = _val_guards(0.5, "val_elbo", mode="max")
    monitor.observe_eval({"val_elbo": -2.0})
    for better in (-1.5, -1.0):
        monitor.observe_eval({"val_elbo": better})
        assert guards.val_regression(better) is None
    guards, monitor = _val_guards(0.5, "val_elbo", mode="max")
    monitor.observe_eval({"val_elbo": -2.0})
    assert guards.val_regression(-2.5) is None and guards.val_regression(-3.0) is None
    assert guards.val_regression(-3.1) == "val_elbo -3.1 < best -2 - 0.5 x 2"


def test_a_higher_is_better_metric_exactly_at_its_bound_is_no_regression():
    # G05 (value <= best - margin): the twin of the lower-is-better boundary test in test_guards.py.
    # best 0.75, threshold 0.5: the bound is 0.75 - 0.375 = 0.375 (exact in binary); at it, no
    # rollback; the next float below it is one
    guards, monitor = _val_guards(0.5, "val_accuracy")
    monitor.observe_eval({"val_accuracy": 0.75})
    bound = 0.75 * (1 - 0.5)
    assert guards.val_regression(bound) is None
    monitor.observe_eval({"val_accuracy": bound})
    assert guards.check(_clean(10), None, {"val_accuracy": bound}) == g.CONTINUE
    below = math.nextafter(bound, -INF)
    assert guards.val_regression(below) == f"val_accuracy {below:.4g} < best 0.75 - 0.5 x 0.75"


@pytest.mark.parametrize("value", [float("nan"), INF, -INF], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("earlier", [(), (1.0,)], ids=["first-evaluation", "after-one"])
def test_a_non_finite_held_out_value_is_a_regression_whichever_infinity(value, earlier):
    # G13 (math.isnan for not math.isfinite): +inf at the first evaluation (a blown-up model) and
    # -inf after 1.0 (a log of 0; "better" than any best by <) went on as fine. Each is judged not
    # finite, and the guard rolls back to before the previous evaluation (before step 1 at the first)
    guards, monitor = _val_guards(0.2, "val_loss")
    step = 0
    for before in earlier:
        step += 5
        monitor.observe_eval({"val_loss": before})
        assert guards.check(_clean(step), None, {"val_loss": before}) == g.CONTINUE
    step += 5
    monitor.observe_eval({"val_loss": value})
    assert guards.val_regression(value) == f"val_loss {value:.4g} is not finite"
    decision = guards.check(_clean(step), None, {"val_loss": value})
    assert isinstance(decision, Rollback) and decision.kind == g.VAL_REGRESSION
    assert decision.first_bad_step == step - 5 + 1


# ---------------------------------------------------------------------------- the guarded step


def test_a_loss_divided_by_two_accumulation_steps_is_recorded_as_the_mean_of_the_undivided_losses():
    # S09 (x N for N > 2 only): divided=True (the Lightning and HF adapters) with the commonest
    # accumulation, 2: the record's loss (steps.csv, the run card, the spike detector) was half of it.
    # DESIGN.md: "loss is the mean of the group's micro-batch losses"
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp32", accumulation_steps=2)
    for group in range(2):
        losses = []
        for i in range(2):
            with guard.autocast():
                loss = model(torch.full((2, 4), float(2 * group + i + 1))).pow(2).mean()
            losses.append(loss.item())
            guard.backward(loss / 2, divided=True)
            record = guard.step()
        assert record is not None and not record.skipped
        assert losses[0] != losses[1]
        assert float(record.loss) == pytest.approx(sum(losses) / 2, rel=1e-6)


class _Gan(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
        self.d = nn.Linear(3, 1)


def _gan_step(model: _Gan, guard: Guard, x: torch.Tensor):
    with guard.autocast():
        loss = model.d(model.g(x)).mean()
    guard.backward(loss)
    return guard.step()


def test_a_step_only_one_optimizer_skips_keeps_the_applied_models_batchnorm_statistics():
    # S03 (end_step(skipped=bool(skipped))): the statistics are put back when the whole step skipped
    # (docs/design.md, "the running statistics are put back when the whole step skipped"); a GAN whose
    # discriminator alone overflows applies the generator's update, and its BatchNorm statistics must
    # move with it, as a plain training-mode forward of the same batch moves them, not lag its weights
    torch.manual_seed(0)
    model = _Gan()
    opts = {"g": torch.optim.SGD(model.g.parameters(), lr=0.1), "d": torch.optim.SGD(model.d.parameters(), lr=0.1)}
    guard = Guard(model, opts, precision="fp32")
    poison = {"on": False}
    model.d.weight.register_hook(lambda grad: torch.full_like(grad, INF) if poison["on"] else grad)
    _gan_step(model, guard, torch.randn(8, 3))  # step 1: both apply

    x = torch.randn(8, 3) + 2.0
    plain = nn.BatchNorm1d(3)  # what a training-mode forward of the batch writes (a layer no guard watches)
    plain.load_state_dict(model.g[1].state_dict())
    with torch.no_grad():
        plain(model.g[0](x))
    before_weight = model.g[0].weight.detach().clone()
    poison["on"] = True
    record = _gan_step(model, guard, x)  # step 2: d skips, g applies
    assert record.skipped and record.skipped_optimizers == ("d",) and guard.applied == {"g": 2, "d": 1}
    assert not torch.equal(model.g[0].weight, before_weight)  # g's update applied ...
    bn = model.g[1]
    assert torch.equal(bn.running_mean, plain.running_mean) and torch.equal(bn.running_var, plain.running_var)
    assert int(bn.num_batches_tracked) == 2  # ... and the statistics of its forward kept with it

    # the whole step skipped (a non-finite loss skips every optimizer): the statistics go back
    poison["on"] = False
    kept = {k: v.clone() for k, v in bn.state_dict().items()}
    record = _gan_step(model, guard, torch.full((8, 3), float("nan")))
    assert record.skipped and set(record.skipped_optimizers) == {"g", "d"}
    assert all(torch.equal(bn.state_dict()[k], v) for k, v in kept.items())


def test_a_pre_clip_norm_exactly_max_norm_is_not_counted_clipped_though_the_kernel_scales_by_its_epsilon():
    # M33 (pre >= max_norm): "clipped" is "applied with a pre-clip norm above max_norm" (README, the
    # report's legend, RunMonitor.clip_rate). At exactly max_norm the clip's factor
    # max_norm / (norm + 1e-6) is 1 - 1e-6 (PyTorch's guard against a zero norm, not a clip): the
    # post-clip norm is a hair below the pre-clip, and the step is not counted clipped
    model = nn.Linear(2, 1, bias=False)
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.0), precision="fp32", max_norm=5.0)
    monitor = RunMonitor(window=10, max_norm=5.0, scaler_enabled=False)
    records = []
    for x in ([3.0, 4.0], [3.0, 4.0], [0.3, 0.4], [6.0, 8.0]):  # gradient norms 5, 5, 0.5, 10
        with guard.autocast():
            loss = model(torch.tensor([x])).sum()  # d loss / d w = x
        guard.backward(loss)
        records.append(guard.step())
        monitor.observe(records[-1])
    pres = [float(r.grad_l2_pre_clip) for r in records]
    assert pres == [5.0, 5.0, 0.5, 10.0]
    assert float(records[0].grad_l2_post_clip) < 5.0  # the kernel's epsilon scale ...
    above = sum(pre > 5.0 for pre in pres)  # ... is no clip: the one norm above max_norm is
    assert above == 1 and monitor.clipped == above and monitor.clip_rate == above / len(pres)


# ---------------------------------------------------------------------------- RunMonitor at its edges


@pytest.mark.parametrize("fail_after", [0, -1])
def test_a_monitor_that_would_fail_a_clean_first_step_is_refused(fail_after):
    # M22 (fail_after < 0): fail_after 0 "fails after 0 steps above fail_rate", a clean step 1 too;
    # the config refuses it (a Count >= 1), and so does the class a direct user builds
    with pytest.raises(ValueError, match=rf"^fail_after must be >= 1, got {fail_after}$"):
        RunMonitor(window=10, fail_rate=0.5, fail_after=fail_after, scaler_enabled=False)
    monitor = RunMonitor(window=10, fail_rate=0.5, fail_after=1, scaler_enabled=False)
    assert monitor.observe(_clean(1)) == [] and monitor.failed is None  # 1, the least, fails no clean step


def _after_a_skip_guard_rollback(second_skipped: bool) -> RunMonitor:
    m = RunMonitor(window=10, fail_rate=0.5, fail_after=5, scaler_enabled=False)
    step = 0
    for skipped in [False] * 2 + [True] * 7:  # rates 1/3, 2/4 (not above), then 5 steps above 0.5
        step += 1
        m.observe(_skip(step) if skipped else _clean(step))
    assert m.failed is not None and m.failed.cause == FAIL_SKIP_RATE and m.failed.step == 9
    m.failed = None  # (the trainer's skip-guard rollback)
    m.rolled_back(m.updates, None, skip_guard=True)
    for skipped in (True, second_skipped):
        step += 1
        m.observe(_skip(step) if skipped else _clean(step))
    m.rolled_back(m.updates, None, skip_guard=False)  # a loss spike's rollback
    for _ in range(2):
        step += 1
        m.observe(_skip(step))
    m.at_end(step)
    return m


def test_a_step_at_exactly_fail_rate_clears_the_skip_guards_trouble():
    # M21 (rate >= fail_rate keeps the trouble): after the skip guard's rollback, one skip then one
    # applied step is a rate of 1/2, exactly fail_rate 0.5: "at or below fail_rate" clears the
    # trouble, so two skips after a later spike rollback are judged as any run's last steps (no
    # failure: fewer than fail_after); kept above it (two skips), the end fails the run
    m = _after_a_skip_guard_rollback(second_skipped=False)
    assert m.failed is None
    m = _after_a_skip_guard_rollback(second_skipped=True)
    assert m.failed is not None and m.failed.cause == FAIL_SKIP_RATE and "since the rollback" in m.failed.message


def test_the_rate_at_the_clearing_step_is_exactly_fail_rate():
    # (the M21 sequence's premise, read from the monitor: 1 skip in the 2 steps since the rollback)
    m = RunMonitor(window=10, fail_rate=0.5, fail_after=5, scaler_enabled=False, min_steps=0)
    for step in range(1, 4):
        m.observe(_skip(step))
    m.rolled_back(m.updates, None, skip_guard=True)
    m.observe(_skip(4))
    m.observe(_clean(5))
    assert m.skip_rate == 1 / 2 == m.fail_rate


# ---------------------------------------------------------------------------- rollback_reach


BOTH = {"rollback": {"triggers": ["skip_guard", "val_regression"], "val_regression": 0.2},
        "checkpoint": {"every": 5}, "eval": {"every": 20}, "monitor": {"window": 10, "fail_rate": 0.5, "fail_after": 30}}


@pytest.mark.parametrize("triggers", [["skip_guard"], ["val_regression"], ["skip_guard", "val_regression"]])
@pytest.mark.parametrize("step", [40, 45, 60, 61])
def test_the_reach_at_a_step_is_where_the_rollbacks_a_guard_decides_at_that_step_return_to(triggers, step):
    # G08 (step - fail_after + 1), G09 (max for min), G10 (an evaluation at the step itself): the
    # reach at a save at `step` is, as its docstring's example has it (45 -> 15 with fail_after 30),
    # where a rollback a guard decides at that very step returns to: the newest step before its first
    # bad step, read here from Guards.check itself, and of the two triggers the one that looks further
    # back. (The trainer judges a step before it saves there, so a rollback after the save is decided
    # a step later at least: the reach keeps one checkpoint to spare, and an unloadable newest one
    # falls back on it.)
    config = validate({**BOTH, "rollback": {**BOTH["rollback"], "triggers": triggers}})
    needed = []
    if "skip_guard" in triggers:  # every step from `first` on skipped (a window of 1: each its own rate)
        monitor = RunMonitor(window=1, fail_rate=0.5, fail_after=30, scaler_enabled=False, min_steps=0)
        guards = Guards(config, monitor, metrics=("val_loss",))
        first = step - 30 + 1
        for s in range(1, step + 1):
            record = _clean(s) if s < first else _skip(s)
            monitor.observe(record)
            decision = guards.check(record)
            if s < step:
                assert decision == g.CONTINUE, s
        assert isinstance(decision, Rollback) and decision.kind == g.SKIP_GUARD
        needed.append(decision.first_bad_step - 1)
    if "val_regression" in triggers:  # a regression judged at `step` (an evaluation there, or the last one)
        monitor = RunMonitor(scaler_enabled=False)
        guards = Guards(config, monitor, metrics=("val_loss",))
        monitor.observe_eval({"val_loss": 1.0})
        monitor.observe_eval({"val_loss": 5.0})
        decision = guards.check(_clean(step), None, {"val_loss": 5.0})
        assert isinstance(decision, Rollback) and decision.kind == g.VAL_REGRESSION
        needed.append(decision.first_bad_step - 1)
    assert rollback_reach(config, step) == min(needed)


class _Part:
    def __init__(self) -> None:
        self.value = 0

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state) -> None:
        self.value = state["value"]


class _State(_Part):
    """The step's state: a counter the checkpoint carries, and no scaler (nothing for the monitor)."""

    def __init__(self) -> None:
        super().__init__()
        self.steps, self.updates = 0, 0
        self.optimizer, self.scheduler = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), None
        self.scaler = torch.amp.GradScaler("cpu", enabled=False)

    def state_dict(self):
        return {"step": self.steps, "updates": self.updates, "scaler": None, "monitors": {}}

    def load_state_dict(self, state) -> None:
        self.updates = state["updates"]


class _Data:
    """The data stream's position (a DataStream's checkpointed part is an int)."""

    def __init__(self) -> None:
        self.position = 0

    def seek(self, position: int) -> None:
        self.position = position

    def state_dict(self) -> int:
        return self.position

    def load_state_dict(self, position: int) -> None:
        self.seek(position)


@pytest.mark.parametrize("triggers", [["skip_guard"], ["skip_guard", "val_regression"]])
def test_keep_one_still_holds_the_checkpoint_the_skip_guard_rolls_back_to(tmp_path, triggers):
    # G08/G09 through the pruning: checkpoint.every 5, keep 1, fail_after 30 (eval.every 20 with the
    # held-out trigger, which alone would keep less): the skip guard failing at step 46 returns before
    # its first bad step, 17, to the checkpoint at 15, which the saves up to 45 must have kept; with
    # keep 1 alone it would be gone and the run would stop, "cannot roll back"
    config = validate({**BOTH, "rollback": {**BOTH["rollback"], "triggers": triggers, "skip_batches": 0},
                       "checkpoint": {"every": 5, "keep": 1}})
    state, data = _State(), _Data()
    parts = {MODEL: _Part(), OPTIMIZER: _Part(), SCHEDULER: _Part(), RNG: _Part()}
    model = parts[MODEL]
    manager = CheckpointManager(tmp_path, {**parts, STATE: state, DATA: data}, keep=1,
                                meta=lambda: {STEP: state.steps, CONFIG: {}},
                                hold=lambda step: rollback_reach(config, step))
    for step in range(5, 50, 5):
        state.steps = state.updates = step
        for part in parts.values():
            part.value = step
        manager.save(step)
    kept = [checkpoint_step(p) for p in list_checkpoints(tmp_path)]
    assert 15 in kept and min(kept) == 15  # (the older ones went: only the reach holds any)

    monitor = RunMonitor(window=1, fail_rate=0.5, fail_after=30, scaler_enabled=False, min_steps=0)
    guards = Guards(config, monitor, metrics=("val_loss",))
    decision = None
    for s in range(1, 47):  # steps 17 to 46 all skipped (a window of 1): 30 above fail_rate
        record = _clean(s) if s < 17 else _skip(s)
        monitor.observe(record)
        decision = guards.check(record)
    assert isinstance(decision, Rollback) and decision.first_bad_step == 17
    state.steps = model.value = 46
    rollbacks = Rollbacks(config, manager, state, data, monitor, LossSpikeDetector(2, 3.0), EventLog(None, [].append))
    outcome = rollbacks.apply(decision)
    assert not isinstance(outcome, Stop), outcome
    assert outcome == g.CONTINUE and model.value == 15 and state.updates == 15
