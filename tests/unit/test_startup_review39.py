"""Review 39e: the start-up's checks of a factory's task, built directly (whole runs against a
hand-written loop: ``tests/e2e/test_startup_runs_review39.py``).

The start-up's reads of the data leave the global RNGs as ``build()`` left them (a DataLoader's
``iter()`` draws its seed there); the batches after the first go through the model as the step
runs them (a BatchNorm batch of one is refused at start-up, and an EMA model whose ``eval()``
swaps its weights keeps its trained ones); ``untouched`` judges a parameter changed by its
values, not its version counter, and says so in words of its caller; an ``__iter__`` that is a
generator over one stored iterator is warned as a likely one-shot; a DataLoader's persistent
workers start afresh at each read from the data's start."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from helpers import NOISY_DATA, write

from ampguard.build import check_forward
from ampguard.untouched import untouched
from ampguard.config import load_config
from ampguard.data import DataStream
from ampguard.errors import AmpguardWarning, InputError
from ampguard.faults import FaultInjector
from ampguard.precision import Precision
from ampguard.tasks import Task, build_task, cycle

pytestmark = pytest.mark.usefixtures("_one_thread", "_no_bytecode")  # tests/conftest.py

CPU = torch.device("cpu")
FP32 = Precision("fp32", "cpu")

FACTORIES = NOISY_DATA + """
LEFT = {}  # the RNG state build() left


def plain(config):  # no generator: each iter() draws its workers' base seed from torch's RNG
    x, y = xy()
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.Linear(16, 2))
    data = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=config.task.options.get("shuffle", False))
    LEFT["torch"] = torch.get_rng_state()
    return model, data, F.mse_loss


class GenOverStored:  # __iter__ a generator over ONE stored iterator: a second read goes on
    def __init__(self, batches):
        self.it = iter(batches)

    def __iter__(self):
        yield from self.it


class LoopOverStored(IterableDataset):  # the same, by a for loop, read through a DataLoader
    def __init__(self, batches):
        self.it = iter(batches)

    def __iter__(self):
        for batch in self.it:
            yield batch


class FreshNoise(IterableDataset):  # a generator reading its source anew, each pass its own noise
    def __init__(self, batches):
        self.batches, self.g = batches, torch.Generator().manual_seed(3)

    def __iter__(self):
        for x, y in self.batches:
            yield x + torch.randn(x.shape, generator=self.g), y


def batches():
    x, y = xy(16 * 20)
    return [(x[i:i + 16], y[i:i + 16]) for i in range(0, len(x), 16)]


def gen_over_stored(config):
    return nn.Linear(8, 2), GenOverStored(batches()), F.mse_loss


def loop_over_stored(config):
    return nn.Linear(8, 2), DataLoader(LoopOverStored(batches()), batch_size=None), F.mse_loss


def fresh_noise(config):
    return nn.Linear(8, 2), DataLoader(FreshNoise(batches()), batch_size=None), F.mse_loss


def persistent(config):
    data = persistent_loader()
    return nn.Linear(8, 2), data, F.mse_loss


class Wrapped:  # re-iterable: each read starts the loader over (whose persistent workers give one iterator)
    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        for batch in self.loader:
            yield batch


def wrapped_persistent(config):
    x, y = xy()
    data = DataLoader(Noisy(x, y), batch_size=16, num_workers=1, persistent_workers=True)  # (read again: another)
    return nn.Linear(8, 2), Wrapped(data), F.mse_loss
"""


def factory_task(tmp_path, fn: str, *extra: str) -> Task:
    path = write(tmp_path / "f39.py", FACTORIES)
    return build_task(load_config(None, [f"task.factory={path}:{fn}", *extra]))


def factory_module():
    import sys
    return next(m for name, m in sys.modules.items() if name.startswith("_ampguard_factory_") and hasattr(m, "LEFT")
                and m.__file__ and m.__file__.endswith("f39.py"))


def one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    return text


def stream_of(model, batches) -> DataStream:
    return DataStream(Task("factory", model, F.mse_loss, batches=lambda: cycle(lambda: batches)), FaultInjector([]), CPU)


# ---------------------------------------------------------------------------- D1. the RNG the start-up's reads draw


@pytest.mark.parametrize("shuffle", [False, True])
def test_the_start_ups_reads_of_a_plain_dataloader_leave_torchs_rng_where_build_left_it(tmp_path, shuffle):
    # each iter(DataLoader) draws a base seed from torch's RNG (and a shuffle without a generator its
    # order): the start-up's `iter(data) is not data` test and its first read moved it twice, so the
    # run's dropout masks were other than a plain loop's (bit for bit: D1)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AmpguardWarning)  # (shuffle: the sampler draws from the global RNG)
        factory_task(tmp_path, "plain", f"task.options.shuffle={str(shuffle).lower()}")
    assert torch.equal(torch.get_rng_state(), factory_module().LEFT["torch"])


# ---------------------------------------------------------------------------- D2. the modes, and untouched's judgment


class EMASwap(nn.Module):
    """``eval()`` swaps the EMA weights in, ``train()`` the trained ones back (a common EMA helper)."""

    def __init__(self, assert_training: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1)
        self.ema = [p.detach().clone() + 0.5 for p in self.lin.parameters()]
        self.backup: list[torch.Tensor] | None = None
        self.assert_training = assert_training

    def train(self, mode: bool = True):
        if self.training and not mode:
            self.backup = [p.detach().clone() for p in self.lin.parameters()]
            with torch.no_grad():
                for p, e in zip(self.lin.parameters(), self.ema):
                    p.copy_(e)
        elif not self.training and mode and self.backup is not None:
            with torch.no_grad():
                for p, b in zip(self.lin.parameters(), self.backup):
                    p.copy_(b)
        return super().train(mode)

    def forward(self, x):
        if self.assert_training:
            assert self.training, "for training only"
        return self.lin(x)


def numbered(n: int, rows: int = 4):
    return [(torch.randn(rows, 3, generator=torch.Generator().manual_seed(i)), torch.zeros(rows, 1))
            for i in range(n)]


@pytest.mark.parametrize("assert_training", [False, True])
def test_an_ema_model_that_swaps_its_weights_in_eval_keeps_its_trained_ones_and_is_not_warned(assert_training):
    # batches 2-4 went in eval mode (the EMA weights swapped in); a forward that failed there was tried
    # again with module.training set by hand (no train(): not swapped back), then eval() again took
    # the EMA weights as the "trained" ones: every parameter off by 0.5; and a false warning
    model = EMASwap(assert_training)
    trained = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_forward(model, F.mse_loss, stream_of(model, numbered(6)).peek, FP32, "task.factory f.py:build") == []
    assert model.training and all(torch.equal(p, q) for p, q in zip(model.parameters(), trained))


def test_untouched_judges_a_parameter_by_its_values_not_its_version():
    # an eval() that swaps weights out and a train() that swaps them back move the version counters;
    # the values are back: no "changed in place ... not put back" (it was a UserWarning, falsely)
    model = EMASwap()
    trained = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with untouched(model):
            model.eval()
            model(torch.ones(2, 3))
    assert model.training and all(torch.equal(p, q) for p, q in zip(model.parameters(), trained))


class Momentum(nn.Module):
    """A momentum encoder: its target follows the online weights in forward, through ``.data``
    (MoCo's own code: no version counter moves) or in place."""

    def __init__(self, through_data: bool) -> None:
        super().__init__()
        self.online, self.target = nn.Linear(3, 1), nn.Linear(3, 1)
        self.target.requires_grad_(False)
        self.through_data = through_data

    def forward(self, x):
        for t, o in zip(self.target.parameters(), self.online.parameters()):
            if self.through_data:
                t.data = t.data * 0.9 + o.data * 0.1
            else:
                with torch.no_grad():
                    t.mul_(0.9).add_(o, alpha=0.1)
        return self.online(x) + self.target(x)


@pytest.mark.parametrize("through_data", [False, True])
def test_parameters_the_start_ups_check_changes_are_named_in_its_own_words(through_data):
    model = Momentum(through_data)
    with pytest.warns(AmpguardWarning) as caught:
        check_forward(model, F.mse_loss, stream_of(model, numbered(6)).peek, FP32, "task.factory f.py:build")
    said = [str(w.message) for w in caught if issubclass(w.category, AmpguardWarning)]
    assert said == ["task.factory f.py:build: the start-up's check of the first batches changed 2 parameters in place "
                    "(target.weight, target.bias) (in a Linear): the model's forward updates them, and they are not "
                    "put back: the run starts from weights the check's passes moved, not bit for bit a plain loop's; "
                    "make the change in the training step, not the forward, or keep it in a buffer (buffers are put "
                    "back)"]


# ---------------------------------------------------------------------------- D4. batches 2-4 as the step runs them


class Recording(nn.Module):
    """A BatchNorm and a dropout, noting the mode and the grad mode of each forward in ``modes``
    (a list of the caller's: one the model held as its attribute, the check puts back)."""

    def __init__(self, modes: list[tuple[bool, bool]] | None = None) -> None:
        super().__init__()
        self.lin, self.norm, self.drop = nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Dropout(0.5)
        self.note = (modes if modes is not None else []).append

    def forward(self, x):
        self.note((self.training, torch.is_grad_enabled()))
        return self.drop(self.norm(self.lin(x))).sum(dim=1, keepdim=True)


def test_a_batchnorm_batch_of_one_among_the_first_four_is_refused_naming_it():
    # 33 examples in batches of 16: the third holds one; it went through in eval mode (BatchNorm takes
    # one there) and the run crashed at step 3 with a traceback
    x, y = torch.randn(33, 3, generator=torch.Generator().manual_seed(0)), torch.zeros(33, 1)
    model = Recording()
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    data = DataStream(Task("factory", model, F.mse_loss, batches=lambda: cycle(lambda: loader)), FaultInjector([]), CPU)
    with pytest.raises(InputError) as err:
        check_forward(model, F.mse_loss, data.peek, FP32, "task.factory f.py:build")
    assert one_line(err) == ("task.factory f.py:build: the model's forward pass on the third batch failed: ValueError: "
                             "Expected more than 1 value per channel when training, got input size torch.Size([1, 4])")


def test_the_batches_after_the_first_go_as_the_step_runs_them_and_leave_no_trace():
    modes: list[tuple[bool, bool]] = []
    model = Recording(modes)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(5)
    rng = torch.get_rng_state()
    assert check_forward(model, F.mse_loss, stream_of(model, numbered(6)).peek, FP32, "task.factory f.py:build") == []
    assert modes == [(True, True)] * 4  # (it was eval mode under no_grad for the second to the fourth)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())  # BatchNorm's statistics, its count
    assert torch.equal(torch.get_rng_state(), rng)  # (dropout drew: put back)
    assert all(p.grad is None for p in model.parameters()) and model.training


# ---------------------------------------------------------------------------- D3. a generator over a stored iterator


def test_a_generator_over_one_stored_iterator_is_warned_as_a_likely_one_shot(tmp_path):
    # 20 batches: the start-up read 9, the run trained 11 and ended "the data yielded no batches"; it
    # was warned only as data that changes from pass to pass (give the shuffle a seeded generator)
    for fn in ("gen_over_stored", "loop_over_stored"):
        with pytest.warns(AmpguardWarning, match=r"data read again from its start gave another first batch, and every "
                                                 r"read shares one iterator \(a one-shot iterable\?\)"):
            factory_task(tmp_path, fn)
    with pytest.warns(AmpguardWarning) as caught:  # (a generator that reads its source anew: not a one-shot)
        factory_task(tmp_path, "fresh_noise")
    assert [str(w.message).split(": ", 1)[1] for w in caught] == [
        "data read again from its start gave another first batch: a resume, a rollback or locate's replay reads "
        "other batches than the run did, and the run, after the start-up's reads, other batches than a plain loop: "
        "something it draws from goes on from read to read (a generator of its own, a NumPy one, a dataset's; the "
        "torch generators of its DataLoaders and their samplers are set back); re-seed it at the start of each read "
        "(in __iter__, or in the function data is), or draw from a generator the DataLoader holds (generator=)"]


def test_a_wrapper_that_starts_a_persistent_workers_loader_over_is_no_one_shot(tmp_path):
    # review 39h: a persistent-workers DataLoader's iter() is one object at every read, held by both
    # reads' generators: a wrapper that starts the loader over was warned as a one-shot
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        factory_task(tmp_path, "wrapped_persistent")
    assert not [w for w in caught if "one-shot" in str(w.message)]


def test_untouched_names_a_parameter_given_another_shape_or_dtype_of_the_same_bytes():
    # review 39h: the checksum reads bytes alone: zeros(2, 8) for a 4 x 4 of zeros was no change
    model = nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    for made in (lambda: torch.zeros(2, 8), lambda: torch.zeros(8, dtype=torch.float64)):
        with pytest.warns(AmpguardWarning, match=r"changed 1 parameter in place \(weight\)"):
            with untouched(model):
                model.weight.data = made()
        model.weight.data = torch.zeros(4, 4)


# ---------------------------------------------------------------------------- D5. persistent workers


def test_a_dataloaders_persistent_workers_start_afresh_at_each_read_from_the_start(tmp_path):
    # the workers kept their RNGs from one iter() to the next: the start-up's reads advanced the
    # augmentation's draws (and the first iter(), before the generator was set back, took the
    # sampler's draw too), so the run read other batches than a plain loop's first epoch
    task = factory_task(tmp_path, "persistent")
    mine = [x for x, _ in itertools_take(task.batches(), 3)]
    again = [x for x, _ in itertools_take(task.batches(), 3)]  # (a resume's, a rollback's read: the same)
    torch.manual_seed(0)
    _, plain, _ = factory_module().persistent(None)
    expected = [x for x, _ in itertools_take(iter(plain), 3)]  # a plain loop's first epoch
    del plain
    assert all(torch.equal(a, b) for a, b in zip(mine, expected)) and len(mine) == 3
    assert all(torch.equal(a, b) for a, b in zip(again, expected))


def itertools_take(iterator, n: int) -> list:
    return [next(iterator) for _ in range(n)]
