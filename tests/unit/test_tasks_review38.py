"""Review 38: the workloads' data path, built directly (whole runs: ``tests/e2e/test_task_review38.py``).

An evaluation keeps every global RNG (a plain ``DataLoader`` in ``evaluate`` moved the training's
dropout masks); a metric that is no number, data on the meta device, a batch of no examples, a
one-shot iterable longer than the start-up's read and a bad batch among the first four are one
line at start-up; a Task's stream that ends is one line mid-run; charlm draws its last window and
scores ``val_loss`` on windows that do not move with the batch size."""

from __future__ import annotations

import random
import types
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from helpers import TINY_LM, write

from ampguard.build import check_forward
from ampguard.config import load_config, validate
from ampguard.data import DataStream
from ampguard.errors import AmpguardWarning, InputError
from ampguard.evaluation import Evaluator
from ampguard.faults import FaultInjector
from ampguard.precision import Precision
from ampguard.tasks import Task, build_task, charlm, cycle
from ampguard.tasks.factory import _same_batch

pytestmark = pytest.mark.usefixtures("_one_thread", "_no_bytecode")  # tests/conftest.py

CPU = torch.device("cpu")
FP32 = Precision("fp32", "cpu")


def factory_task(tmp_path, source: str, fn: str = "build", *extra: str) -> Task:
    path = write(tmp_path / "f38.py", source)
    return build_task(load_config(None, [f"task.factory={path}:{fn}", *extra]))


def one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    return text


# ---------------------------------------------------------------------------- 1. an evaluation keeps the RNGs


def draws() -> tuple:
    return torch.rand(3).tolist(), random.random(), float(np.random.rand())


def test_an_evaluation_during_the_run_leaves_every_global_rng_where_it_was():
    # evaluate() draws from torch (a plain DataLoader's worker seed), random and NumPy: the run's
    # next draws (dropout) must be those it would have made without the evaluation
    def evaluate(model, device):
        torch.rand(5), random.random(), np.random.rand(4)
        return {"val_loss": 0.5}

    task = Task("factory", nn.Linear(2, 1), F.mse_loss, batches=lambda: iter(()), evaluate=evaluate,
                metrics=("val_loss",))
    ev = Evaluator(task, FP32, CPU, validate({"steps": 10, "eval": {"every": 1}}))
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    expected = draws()
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    assert ev() == {"val_loss": 0.5}  # (the mid-run call, not the start-up's check)
    assert draws() == expected


# ---------------------------------------------------------------------------- 3. a metric that is no number


@pytest.mark.parametrize("value,said", [
    ("abc", "a str for metric 'val_loss' ('abc'), not a number"),
    ("0.5", "a str for metric 'val_loss' ('0.5'), not a number"),
    (None, "a NoneType for metric 'val_loss', not a number"),
    (torch.ones(3), "a Tensor of shape (3,) for metric 'val_loss', not a number (one value: .item() or .mean())"),
])
def test_a_metric_that_is_no_number_mid_run_is_one_line_naming_it_and_its_type(value, said):
    calls = []

    def evaluate(model, device):
        calls.append(1)
        return {"val_loss": 1.0 if len(calls) < 3 else value}

    task = Task("factory", nn.Linear(2, 1), F.mse_loss, batches=lambda: iter(()), evaluate=evaluate,
                metrics=("val_loss",))
    ev = Evaluator(task, FP32, CPU, validate({"steps": 10, "eval": {"every": 1}}))
    ev.check()
    assert ev() == {"val_loss": 1.0}
    with pytest.raises(InputError) as err:  # (it was float()'s ValueError: a traceback, exit 1)
        ev()
    assert one_line(err) == f"task.factory: evaluate() returned {said}"


def test_numbers_of_every_kind_are_metrics():
    values = {"a": 1, "b": 0.25, "c": torch.tensor(0.5), "d": np.float32(2.0), "e": float("nan"), "f": torch.ones(1, 1)}
    task = Task("factory", nn.Linear(2, 1), F.mse_loss, batches=lambda: iter(()), evaluate=lambda m, d: values,
                metrics=tuple(values))
    got = Evaluator(task, FP32, CPU, validate({})).__call__()
    assert got["a"] == 1.0 and got["b"] == 0.25 and got["c"] == 0.5 and got["d"] == 2.0 and got["f"] == 1.0
    assert got["e"] != got["e"] and all(type(v) is float for k, v in got.items() if k != "a")
    assert type(got["a"]) is int  # (an integer stays one: the CSV writes its digits, exact)


# ---------------------------------------------------------------------------- 2. a one-shot iterable, longer


ONE_SHOT = """
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, IterableDataset


class Stored(IterableDataset):  # __iter__ returns a stored iterator: a second read goes on
    def __init__(self, n):
        g = torch.Generator().manual_seed(0)
        self.it = iter([(torch.randn(3, generator=g), torch.randn(1, generator=g)) for _ in range(n)])

    def __iter__(self):
        return self.it


class Itself(IterableDataset):  # its own iterator: the same
    def __init__(self, n):
        self.n, self.i = n, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.i >= self.n:
            raise StopIteration
        self.i += 1
        return torch.full((3,), float(self.i)), torch.zeros(1)


class Fresh(IterableDataset):  # a generator each pass, drawing from a private RNG never set back
    def __init__(self):
        self.g = torch.Generator().manual_seed(0)

    def __iter__(self):
        for _ in range(64):
            yield torch.randn(3, generator=self.g), torch.zeros(1)


def stored(config):
    return nn.Linear(3, 1), DataLoader(Stored(64), batch_size=4), F.mse_loss


def itself(config):
    return nn.Linear(3, 1), DataLoader(Itself(64), batch_size=4), F.mse_loss


def plain_stored(config):  # not a DataLoader: an object whose __iter__ returns its stored iterator
    class Data:
        it = iter([(torch.full((4, 3), float(i)), torch.zeros(4, 1)) for i in range(16)])

        def __iter__(self):
            return self.it
    return nn.Linear(3, 1), Data(), F.mse_loss


def function_of_stored(config):  # a function handing back one stored iterator
    it = iter([(torch.full((4, 3), float(i)), torch.zeros(4, 1)) for i in range(16)])
    return nn.Linear(3, 1), (lambda: it), F.mse_loss


def fresh(config):
    return nn.Linear(3, 1), DataLoader(Fresh(), batch_size=4), F.mse_loss


def fresh_each_call(config):  # a new one-shot dataset at every call: every pass starts over
    return nn.Linear(3, 1), (lambda: DataLoader(Stored(64), batch_size=4)), F.mse_loss
"""


@pytest.mark.parametrize("fn", ["stored", "itself", "plain_stored", "function_of_stored"])
def test_a_one_shot_iterable_longer_than_the_start_ups_read_is_warned_as_one(tmp_path, fn):
    # it was warned only as "another first batch", and the run stopped at the end of its first pass; it is
    # warned as a likely one-shot (not refused: review 38i, an iterable that starts over and returns itself
    # shares one iterator too, and trains)
    from ampguard.errors import AmpguardWarning

    with pytest.warns(AmpguardWarning, match=r"every read shares one iterator \(a one-shot iterable\?\)"):
        factory_task(tmp_path, ONE_SHOT, fn)


SELF_RESET = """
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, IterableDataset


class Reshuffled(IterableDataset):  # starts over at every read, reshuffled by its own generator, and is its iterator
    def __init__(self):
        self.g = torch.Generator().manual_seed(0)
        self.x = torch.randn(32, 3, generator=self.g)

    def __iter__(self):
        self.order, self.i = torch.randperm(32, generator=self.g), 0
        return self

    def __next__(self):
        if self.i == 32:
            raise StopIteration
        k = self.order[self.i]
        self.i += 1
        return self.x[k], self.x[k, :1]


def build(config):
    return nn.Linear(3, 1), DataLoader(Reshuffled(), batch_size=4), F.mse_loss


class TrainingOnly(nn.Linear):
    def forward(self, x):
        assert self.training, "use .predict() for inference"
        return super().forward(x)


class Physics(nn.Module):  # a physics-informed network: its forward takes the gradient of its output
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(3, 1)

    def forward(self, x):
        x = x.detach().requires_grad_(True)
        u = self.net(x)
        du = torch.autograd.grad(u.sum(), x, create_graph=True)[0]
        return u + du[:, :1]


def data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)) for _ in range(4)]


def training_only(config):
    return TrainingOnly(3, 1), data(), F.mse_loss


def physics(config):
    return Physics(), data(), F.mse_loss
"""


def test_an_iterable_that_starts_over_and_returns_itself_trains_past_its_first_pass(tmp_path):
    # review 38i D5: refused as a one-shot (one iterator shared by every read), though each read starts over
    from ampguard.errors import AmpguardWarning

    with pytest.warns(AmpguardWarning):
        task = factory_task(tmp_path, SELF_RESET, "build")
    stream = task.batches()
    assert len([next(stream) for _ in range(20)]) == 20  # (8 batches a pass: it goes on past the first)


@pytest.mark.parametrize("fn", ["training_only", "physics"])
def test_a_forward_that_needs_training_mode_or_gradients_is_not_refused(tmp_path, fn):
    # review 38i D1, D2: batches 2-4 went through the model in eval mode under no_grad only: a forward
    # that asserts self.training, or takes the gradient of its output, was refused though every step takes it
    from ampguard.build import check_forward
    from ampguard.precision import Precision

    task = factory_task(tmp_path, SELF_RESET, fn)
    batches = [next(task.batches()) for _ in range(1)] * 4

    def read(count=None):  # (DataStream.peek's signature: the first `count` batches from one read)
        return iter(batches[:count]) if count else batches[0]

    before = [p.detach().clone() for p in task.model.parameters()]
    assert check_forward(task.model, task.loss_fn, read, Precision("fp32", "cpu"), "f38") == []
    assert task.model.training and all(torch.equal(p, q) for p, q in zip(task.model.parameters(), before))


@pytest.mark.parametrize("fn", ["fresh", "fresh_each_call"])
def test_data_that_starts_over_each_pass_is_not_a_one_shot(tmp_path, fn):
    from ampguard.errors import AmpguardWarning

    if fn == "fresh":  # (other batches each pass: warned, as before)
        with pytest.warns(AmpguardWarning, match="data read again from its start gave another first batch"):
            task = factory_task(tmp_path, ONE_SHOT, fn)
    else:
        task = factory_task(tmp_path, ONE_SHOT, fn)
    stream = task.batches()
    assert len([next(stream) for _ in range(40)]) == 40  # (16 batches a pass: it goes on past the first)


# ---------------------------------------------------------------------------- 4, 5. meta tensors, no examples


META_AND_EMPTY = """
import torch
from torch import nn
from torch.nn import functional as F


def meta(config):
    return nn.Linear(3, 1), [(torch.randn(4, 3, device="meta"), torch.randn(4, 1, device="meta"))], F.mse_loss


def meta_targets_later(config):
    good = (torch.randn(4, 3), torch.randn(4, 1))
    return nn.Linear(3, 1), [good, (torch.randn(4, 3), torch.randn(4, 1, device="meta"))], F.mse_loss


def empty(config):
    return nn.Linear(3, 1), [(torch.empty(0, 3), torch.empty(0, 1))], F.mse_loss


def empty_third(config):
    good = (torch.randn(4, 3), torch.randn(4, 1))
    return nn.Linear(3, 1), [good, good, (torch.empty(0, 3), torch.empty(0, 1))], F.mse_loss


def empty_dict(config):
    return nn.Linear(3, 1), [({"x": torch.empty(0, 3), "m": torch.empty(0)}, torch.empty(0, 1))], F.mse_loss
"""


@pytest.mark.parametrize("fn,batch", [("meta", 0), ("meta_targets_later", 1)])
def test_data_on_the_meta_device_is_one_line(tmp_path, fn, batch):
    # (it was torch.equal's NotImplementedError, a traceback, in _same_batch)
    with pytest.raises(InputError) as err:
        factory_task(tmp_path, META_AND_EMPTY, fn)
    assert one_line(err).endswith(f":{fn}: data's batch {batch} (counted from 0) holds a tensor on the meta device "
                                  "(a shape without values): make the data's tensors on the CPU, with their values")


def test_comparing_batches_that_cannot_be_compared_is_no_crash():
    meta = torch.ones(2, device="meta")
    assert _same_batch((meta, meta), (meta, meta)) is False


@pytest.mark.parametrize("fn,batch", [("empty", 0), ("empty_third", 2), ("empty_dict", 0)])
def test_a_batch_of_no_examples_is_refused(tmp_path, fn, batch):
    # (it was taken: every step a non_finite_loss skip, exit 0)
    with pytest.raises(InputError) as err:
        factory_task(tmp_path, META_AND_EMPTY, fn)
    assert one_line(err).endswith(f":{fn}: data's batch {batch} (counted from 0) holds no examples: its inputs' first "
                                  "dimension is 0 (every step on it would be skipped as a non-finite loss)")


# ---------------------------------------------------------------------------- 6. the first batches through the model


class Counting(nn.Module):
    """A BatchNorm and a dropout (training mode): buffers and draws the check must leave as they were."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm, self.drop = nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Dropout(0.5)
        # (in a namespace: a list held as the model's own attribute, the check gives its contents back)
        self.noted = types.SimpleNamespace(seen=[], modes=[])

    def forward(self, x):
        self.noted.seen.append(int(x[0, 0]))
        self.noted.modes.append((self.training, torch.is_grad_enabled()))
        return self.drop(self.norm(self.lin(x))).sum(dim=1, keepdim=True)


def numbered(n: int):
    """``n`` batches of four examples, batch ``i``'s first feature ``i`` (the model notes it)."""
    batches = []
    for i in range(n):
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(i))
        x[:, 0] = i
        batches.append((x, torch.zeros(4, 1)))
    return batches


def stream_of(model, batches, **task):
    return DataStream(Task("factory", model, F.mse_loss, batches=lambda: cycle(lambda: batches), **task),
                      FaultInjector([]), CPU)


def test_the_start_ups_check_puts_every_batch_it_reads_through_the_model_and_leaves_no_trace():
    model = Counting()
    data = stream_of(model, numbered(6))
    norm_before = {k: v.clone() for k, v in model.norm.state_dict().items()}
    torch.manual_seed(5)
    rng = torch.get_rng_state()
    assert check_forward(model, F.mse_loss, data.peek, FP32, "task.factory f.py:build") == []
    assert model.noted.seen == [0, 1, 2, 3]  # the four it reads (it was the first alone)
    assert model.noted.modes == [(True, True)] * 4  # each as the step runs it (review 39e: batches 2-4 went in eval mode
    # under no_grad, and a BatchNorm batch of one passed, to crash the run at its step); forward only
    assert torch.equal(torch.get_rng_state(), rng)  # dropout drew, put back
    assert all(torch.equal(norm_before[k], v) for k, v in model.norm.state_dict().items())  # statistics untouched
    assert all(p.grad is None for p in model.parameters()) and model.training
    assert data.position == 0


@pytest.mark.parametrize("bad,nth", [(1, "second"), (3, "fourth")])
def test_a_batch_the_model_cannot_take_among_the_first_four_is_one_line_naming_it(bad, nth):
    batches = numbered(6)
    batches[bad] = (torch.ones(4, 5), torch.zeros(4, 1))
    model = nn.Linear(3, 1)
    with pytest.raises(InputError) as err:  # (it crashed the run at that step, a traceback)
        check_forward(model, F.mse_loss, stream_of(model, batches).peek, FP32, "task.factory f.py:build")
    assert one_line(err) == (f"task.factory f.py:build: the model's forward pass on the {nth} batch failed: "
                             "RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x5 and 3x1)")


class TwoHeads(nn.Module):
    """An auxiliary head in training mode (Inception's): ``(main, aux)``; the main output alone in eval mode."""

    def __init__(self) -> None:
        super().__init__()
        self.main, self.aux = nn.Linear(3, 1), nn.Linear(3, 1)

    def forward(self, x):
        return (self.main(x), self.aux(x)) if self.training else self.main(x)


def test_the_batches_after_the_first_go_through_the_model_alone_not_the_loss():
    # the loss takes the step's output: in eval mode the model's may differ, which is no bad batch
    calls = {"n": 0}  # (a count: the loss's state, left as the check left it and said; a log would be given back)

    def loss(out, y):
        calls["n"] += 1
        main, aux = out  # (a tensor here would not unpack)
        return F.mse_loss(main, y) + 0.3 * F.mse_loss(aux, y)

    model = TwoHeads()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AmpguardWarning)  # (the loss's count, said)
        assert check_forward(model, loss, stream_of(model, numbered(6)).peek, FP32, "who") == []
    assert calls["n"] == 1 and model.training


def test_a_task_stream_that_ends_within_the_start_ups_read_is_refused_and_mid_run_is_one_line():
    batches = numbered(3)
    task = Task("factory", nn.Linear(3, 1), F.mse_loss, batches=lambda: iter(batches))
    data = DataStream(task, FaultInjector([]), CPU)
    with pytest.raises(InputError) as err:
        check_forward(task.model, F.mse_loss, data.peek, FP32, "task.factory f.py:build")
    assert one_line(err).startswith("task.factory f.py:build: the data ended after 3 batches: a run reads it epoch "
                                    "after epoch")
    for _ in range(3):
        data.next(first_step=1)
    with pytest.raises(ValueError, match=r"^the data ended after 3 micro-batches: a Task's batches\(\) must be "
                                         r"endless"):  # (a bare StopIteration: the run's traceback)
        data.next(first_step=1)


def test_a_reader_of_one_batch_puts_that_one_through_as_before():
    model = Counting()
    check_forward(model, F.mse_loss, lambda: numbered(1)[0], FP32, "validate")
    assert model.noted.seen == [0]


# ---------------------------------------------------------------------------- 7, 8. charlm's windows


def test_charlm_draws_every_window_the_last_byte_a_target_too():
    text = torch.arange(12, dtype=torch.uint8)
    starts, last_targets = set(), set()
    for _, (x, y) in zip(range(200), charlm.char_batches(text, seed=0, batch_size=4, block_size=8)):
        starts.update(x[:, 0].tolist())
        last_targets.update(y[:, -1].tolist())
    assert starts == {0, 1, 2, 3} and 11 in last_targets  # (the window at 3 never came: its target 11 neither)
    x, y = next(charlm.char_batches(torch.arange(9, dtype=torch.uint8), seed=0, batch_size=2, block_size=8))
    assert y[0].tolist() == list(range(1, 9))  # a context of 8 needs 9 bytes (it asked for 10)
    _, targets = charlm._next_char_set(text, block_size=8, n=4)
    assert int(targets.max()) == 11  # validate's held-out windows reach the last byte too


def held_out_seen(monkeypatch, overrides: list[str], world: int = 1) -> list:
    from ampguard.trainer import _build_task

    seen: list = []
    monkeypatch.setattr(charlm, "mean_loss", lambda model, loss_fn, batches, device: seen.extend(batches) or 0.0)
    task = _build_task(load_config(None, [*TINY_LM, "eval.batches=2", *overrides]), world)
    task.evaluate(task.model, CPU)
    return seen


def test_charlm_scores_val_loss_on_the_same_windows_whatever_the_batch_size_and_process_count(monkeypatch):
    base = held_out_seen(monkeypatch, ["task.batch_size=16"])
    assert len(base) == 2 and sum(len(x) for x, _ in base) == 2 * charlm.EVAL_WINDOWS
    for overrides, world in ((["task.batch_size=4"], 1), (["task.batch_size=64"], 1), (["task.batch_size=16"], 2)):
        other = held_out_seen(monkeypatch, overrides, world)  # (it was eval.batches x the (global) batch size)
        assert len(other) == len(base), overrides
        assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(base, other)), (overrides, world)
