"""Review 40c: the start-up's checks of a factory's task, built directly (whole runs against the
hand-written loop: ``tests/e2e/test_startup_runs_review40.py``).

``untouched`` takes a model with lazy modules (no traceback), puts back a module's plain
attributes and an ``nn.Embedding(max_norm=...)``'s renormalised rows, names the module type of a
parameter changed in place and says what to do, and its checksum sees a negated weight and a
``+d``/``-d`` rectangle; ``check_forward`` checks a lazy model on a copy, leaving the user's
weights to be drawn at its first forward; the start-up sets back the generators of a DataLoader
behind a wrapper or a function (and a custom batch sampler's), restarts its persistent workers,
and does not call a wrapper over a persistent-workers loader a one-shot."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.parameter import UninitializedParameter

from helpers import NOISY_DATA, caught_warnings, write

from ampguard.build import check_forward
from ampguard.untouched import _checksum, untouched
from ampguard.config import load_config
from ampguard.errors import AmpguardWarning
from ampguard.precision import Precision
from ampguard.tasks import build_task

pytestmark = pytest.mark.usefixtures("_one_thread", "_no_bytecode")  # tests/conftest.py

FP32 = Precision("fp32", "cpu")


# ---------------------------------------------------------------------------- 1. lazy modules


@pytest.mark.parametrize("make", [lambda: nn.Sequential(nn.LazyLinear(4)),
                                  lambda: nn.Sequential(nn.Linear(3, 3), nn.LazyBatchNorm1d())])
def test_untouched_takes_a_model_with_lazy_modules_and_says_it_made_them(make):
    # 8caa52d: ValueError "Attempted to use an uninitialized parameter" from _checksum (LazyLinear)
    # or from the buffers' copies (LazyBatchNorm1d), a traceback out of locate and fp8 too
    model = make()

    def block():
        with untouched(model):
            model(torch.randn(2, 3))

    said = caught_warnings(block)
    assert len(said) == 1 and "made the weights of the model's lazy modules (Lazy" in said[0], said
    assert _checksum(nn.LazyLinear(2).weight) is None


def test_the_start_ups_check_of_a_lazy_model_makes_its_weights_there_and_says_so():
    # the copy is checked (its draws kept from torch's RNG); the user's model is then made, drawing from
    # torch's RNG as its first forward would, in the order the forward met its lazy modules, and warned of
    batch = (torch.randn(4, 3), torch.zeros(4, 2))
    model = nn.Sequential(nn.LazyLinear(2), nn.Dropout(0.5))
    torch.manual_seed(1)
    with pytest.warns(AmpguardWarning, match=r"lazy modules 0 \(LazyLinear\) made their weights at start-up"):
        assert check_forward(model, F.mse_loss, lambda: batch, FP32, "f.py:build") == []
    assert type(model[0]) is nn.Linear and model[0].weight.shape == (2, 3) and not model[0]._forward_pre_hooks
    torch.manual_seed(1)
    assert torch.equal(model[0].weight, nn.Linear(3, 2).weight)  # (drawn as a Linear(3, 2) of that RNG)


# ---------------------------------------------------------------------------- 4. plain attributes


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(2, 2)
        self.calls = 0
        self.last = torch.zeros(2)
        self.total = torch.zeros(2)

    def forward(self, x):
        if self.training:
            self.calls += 1
            self.seen = True  # (an attribute the forward adds)
            self.last = x.detach()[0]  # (a tensor attribute replaced)
        return self.l(x)


def test_untouched_puts_back_a_modules_plain_attributes_and_a_replaced_tensor_attribute():
    # self.calls += 1 in the forward: the start-up's passes moved the run's warm-up ramp, unsaid
    model = Counter()
    last = model.last

    def block():
        with untouched(model):
            model(torch.ones(3, 2))
            model(torch.ones(3, 2))

    assert caught_warnings(block) == []
    assert model.calls == 0 and model.last is last and not hasattr(model, "seen")


def test_untouched_names_a_tensor_attribute_changed_in_place():
    model = Counter()

    def block():
        with untouched(model, by="the check"):
            model.total.add_(1)

    assert caught_warnings(block) == [
        "the check changed the tensor attribute Counter.total in place: it is no buffer, so it is not put back, and "
        "the run goes on from its value, not a plain loop's; keep such state in a buffer (register_buffer), which "
        "is put back"]


class Swapping(nn.Module):  # eval() keeps the trained weights in an attribute, train() puts them back
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(2, 2)
        self.backup = None

    def train(self, mode=True):
        if self.training and not mode:
            self.backup = self.l.weight.detach().clone()
            with torch.no_grad():
                self.l.weight.zero_()
        elif not self.training and mode and self.backup is not None:
            with torch.no_grad():
                self.l.weight.copy_(self.backup)
            self.backup = None
        return super().train(mode)


def test_an_attribute_a_modules_train_reads_is_put_back_after_its_mode():
    # (the attributes put back first, backup None: train() would have left the zeros in place)
    model = Swapping()
    before = model.l.weight.detach().clone()

    def block():
        with untouched(model):
            model.eval()

    assert caught_warnings(block) == []
    assert model.training and model.backup is None and torch.equal(model.l.weight, before)


# ---------------------------------------------------------------------------- 5. in place: Embedding(max_norm)


def test_an_embeddings_max_norm_rows_are_put_back_and_another_change_names_its_module_and_what_to_do():
    model = nn.Sequential(nn.Embedding(10, 4, max_norm=0.5), nn.Flatten(), nn.Linear(8, 2))
    with torch.no_grad():
        model[0].weight.mul_(10)
    before = model[0].weight.detach().clone()

    def renorm():
        with untouched(model):
            model(torch.tensor([[1, 2], [3, 4]]))

    assert caught_warnings(renorm) == [] and torch.equal(model[0].weight, before)

    def moved():
        with untouched(model, by="the check", so="and they are not put back"):
            with torch.no_grad():
                model[2].weight.neg_()

    assert caught_warnings(moved) == [
        "the check changed 1 parameter in place (2.weight) (in a Linear): the model's forward updates them, and they "
        "are not put back; make the change in the training step, not the forward, or keep it in a buffer (buffers "
        "are put back)"]


# ---------------------------------------------------------------------------- 6. the checksum's blind spots


def test_the_checksum_sees_a_negated_weight_and_a_rectangle_of_opposite_changes():
    torch.manual_seed(0)
    w = torch.randn(2, 1024)  # (2048 words: each plain row and column sum of a 1024-wide table moves by 2**32)
    assert not torch.equal(_checksum(w), _checksum(-w))
    for width in (1024, 1023):  # +d, -d at two rows and two columns of a table of that width
        a = torch.randn(4096)
        b = a.clone()
        words = b.view(torch.int32)
        for row, column, sign in [(0, 5, 1), (1, 9, 1), (0, 9, -1), (1, 5, -1)]:
            words[row * width + column] += sign * 7
        assert not torch.equal(_checksum(a), _checksum(b)), width


# ---------------------------------------------------------------------------- 2, 3. data behind a wrapper

FACTORIES = NOISY_DATA + """
import numpy as np


class Wrapper:  # a wrapper class over a seeded shuffling loader
    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        for x, y in self.loader:
            yield x.float(), y


def seeded():
    x, y = xy()
    return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0))


def wrapper(config):
    return nn.Linear(8, 2), Wrapper(seeded()), F.mse_loss


def function(config):
    loader = seeded()
    return nn.Linear(8, 2), (lambda: (b for b in loader)), F.mse_loss


class Buckets(torch.utils.data.Sampler):  # a batch sampler with its own seeded generator
    def __init__(self, n, size):
        self.n, self.size, self.g = n, size, torch.Generator().manual_seed(0)

    def __iter__(self):
        order = torch.randperm(self.n, generator=self.g).tolist()
        for i in range(0, self.n, self.size):
            yield order[i:i + self.size]

    def __len__(self):
        return self.n // self.size


def buckets(config):
    x, y = xy()
    return nn.Linear(8, 2), DataLoader(TensorDataset(x, y), batch_sampler=Buckets(64, 16)), F.mse_loss


class NumpyNoise(Dataset):  # a dataset's own NumPy generator: not set back
    def __init__(self, x, y):
        self.x, self.y, self.rng = x, y, np.random.default_rng(0)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + float(self.rng.normal()), self.y[i]


def numpy_noise(config):
    x, y = xy()
    return nn.Linear(8, 2), DataLoader(NumpyNoise(x, y), batch_size=16), F.mse_loss


class Wrap:  # __iter__ returns the loader's iterator: one object at every read with persistent workers
    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        return iter(self.loader)


def wrapped_persistent(config):
    x, y = xy()
    loader = DataLoader(Noisy(x, y), batch_size=16, num_workers=1, persistent_workers=True)
    return nn.Linear(8, 2), Wrap(loader), F.mse_loss
"""


def factory_task(tmp_path, fn: str):
    path = write(tmp_path / "f40.py", FACTORIES)
    return build_task(load_config(None, [f"task.factory={path}:{fn}"]))


def first_pass(tmp_path, fn: str) -> list[torch.Tensor]:
    """A plain loop's first batches over the factory's data, read before anything else."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("plain_40c", tmp_path / "f40.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _, data, _ = getattr(module, fn)(None)
    return [x for x, _ in list(data() if callable(data) and not hasattr(data, "__iter__") else data)[:4]]


@pytest.mark.parametrize("fn", ["wrapper", "function", "buckets"])
def test_the_generators_behind_a_wrapper_a_function_or_a_batch_sampler_are_set_back(tmp_path, fn):
    # the start-up's reads advanced them: the run trained on the loader's fourth shuffle, not its first
    made = []
    assert caught_warnings(lambda: made.append(factory_task(tmp_path, fn))) == []
    task = made[0]
    stream = task.batches()
    got = [next(stream)[0] for _ in range(4)]
    assert all(torch.equal(a, b) for a, b in zip(got, first_pass(tmp_path, fn)))


def test_a_generator_that_is_not_set_back_is_said_to_move_the_runs_own_batches(tmp_path):
    said = caught_warnings(lambda: factory_task(tmp_path, "numpy_noise"))
    assert len(said) == 1 and said[0].endswith(
        "data read again from its start gave another first batch: a resume, a rollback or locate's replay reads "
        "other batches than the run did, and the run, after the start-up's reads, other batches than a plain loop: "
        "something it draws from goes on from read to read (a generator of its own, a NumPy one, a dataset's; the "
        "torch generators of its DataLoaders and their samplers are set back); re-seed it at the start of each read "
        "(in __iter__, or in the function data is), or draw from a generator the DataLoader holds (generator=)"), said


def test_a_wrapper_returning_a_persistent_loaders_iterator_is_no_one_shot_and_its_workers_start_afresh(tmp_path):
    # review 40c #3: iter(a) is iter(b) for a persistent-workers loader: warned as a one-shot, and
    # its workers' RNGs went on from the start-up's reads
    said = caught_warnings(lambda: factory_task(tmp_path, "wrapped_persistent"))
    # (its workers' seeds are drawn from the global RNG as each pass begins, with no generator of the loader's
    # own: a resume inside a pass draws other augmentations, said since review 52h)
    assert len(said) == 1 and "data draws from the global RNG as a pass begins" in said[0], said


# ---------------------------------------------------------------------------- review 40g: the redraw's edges


def lazy_model():
    return nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.Linear(4, 1))


def checked(model):
    with pytest.warns(AmpguardWarning, match="made their weights at start-up"):
        check_forward(model, F.mse_loss, lambda: (torch.ones(2, 3), torch.zeros(2, 1)), FP32, "f.py:build")
    return model


def test_weights_made_at_start_up_are_the_ones_every_later_pass_sees():
    # reviews 40g/40k: drawn again at the first training forward, the weights a resume restored, an evaluation
    # before step 1, a deepcopy, a step-0 checkpoint or an activation checkpoint's recomputation met were
    # not the ones trained; made at start-up, they are the same everywhere
    model = checked(lazy_model())
    made = model[0].weight.detach().clone()
    twin = copy.deepcopy(model)
    model.eval()
    with torch.no_grad():
        model(torch.ones(2, 3))
    model.train()
    model(torch.ones(2, 3))
    twin(torch.ones(2, 3))
    assert torch.equal(model[0].weight, made) and torch.equal(twin[0].weight, made)
    assert not any(m._forward_pre_hooks for m in [*model.modules(), *twin.modules()])


class LazyScale(LazyModuleMixin, nn.Module):  # a user's lazy module: its lazy init draws, its reset does not
    def __init__(self):
        super().__init__()
        self.w = UninitializedParameter()

    def reset_parameters(self):
        if not self.has_uninitialized_params():
            nn.init.ones_(self.w)

    def initialize_parameters(self, x):
        self.w.materialize(x.shape[-1:])
        nn.init.normal_(self.w, 1.0, 0.1)

    def forward(self, x):
        return x * self.w


def test_a_lazy_module_of_the_users_own_class_is_made_by_its_own_lazy_init():
    # review 40g #5: its weights were reset_parameters()' ones, not the draws of its own lazy init
    x = torch.randn(4, 3)
    torch.manual_seed(0)
    plain = nn.Sequential(LazyScale(), nn.Linear(3, 1))
    plain(x)
    torch.manual_seed(0)
    ours = nn.Sequential(LazyScale(), nn.Linear(3, 1))
    with pytest.warns(AmpguardWarning, match="made their weights at start-up"):
        check_forward(ours, lambda o, t: o.sum(), lambda: (x, None), FP32, "f.py:build")
    assert torch.equal(ours[0].w, plain[0].w)  # (its own init's draws: nothing drew between, here)


def test_data_whose_getattr_reads_a_dict_is_read_not_a_traceback(tmp_path):
    # review 40g #7: getattr(data, "sampler", None) let the wrapper's KeyError through: a traceback at start-up
    path = write(tmp_path / "cfgwrap.py", """
import torch
from torch import nn
from torch.nn import functional as F


class CfgWrap:
    def __init__(self, batches):
        self.__dict__["cfg"] = {"batches": batches}

    def __getattr__(self, key):
        return self.cfg[key]

    def __iter__(self):
        return iter(self.cfg["batches"])


def build(config):
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)) for _ in range(4)]
    return nn.Linear(3, 1), CfgWrap(batches), F.mse_loss
""")
    task = build_task(load_config(None, [f"task.factory={path}:build"]))
    assert task.name == "factory" and len(next(iter(task.stream()))) == 2


class PrivateCounter(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(2, 2)
        self._step = 0

    def forward(self, x):
        if self.training:
            self._step += 1  # (a warm-up ramp's count, spelled as most write it)
        return self.l(x) * min(1.0, self._step / 10)


def test_a_private_counter_the_forward_moves_is_put_back():
    # review 40g #6: only public attributes were kept; self._step moved by the check's four passes, unsaid
    model = PrivateCounter()
    check_forward(model, F.mse_loss, lambda: (torch.ones(2, 2), torch.zeros(2, 2)), FP32, "f.py:build")
    assert model._step == 0


# ---------------------------------------------------------------------------- review_51c


class Curriculum:  # a helper of the user's, held by the model, changed in place by its forward
    def __init__(self):
        self.seen = 0
        self.g = torch.Generator().manual_seed(0)

    def tick(self, x):
        self.seen += 1
        return x * (torch.rand(x.shape, generator=self.g) > 0.1)


class WithHelpers(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 1)
        self.curriculum = Curriculum()
        self.hist = np.zeros(2)

    def forward(self, x):
        self.hist[0] += 1
        return self.fc(self.curriculum.tick(x))


def test_the_start_up_check_and_the_diagnosis_put_back_a_helper_object_and_an_array_the_forward_changed():
    # the check left curriculum.seen at 1, hist at [1, 0] and the helper's generator advanced, unsaid;
    # diagnose's FP32 replay began from the AMP pass's state
    from ampguard.locate import diagnose

    def batch():
        return torch.ones(4, 3), torch.zeros(4, 1)

    for replay in (lambda m: check_forward(m, nn.functional.mse_loss, batch, Precision("fp32", "cpu"), "toy"),
                   lambda m: diagnose(m, nn.functional.mse_loss, torch.full((4, 3), float("nan")), torch.zeros(4, 1),
                                      Precision("bf16", "cpu"))):
        model = WithHelpers()
        state = model.curriculum.g.get_state().clone()
        replay(model)
        assert model.curriculum.seen == 0 and model.hist.tolist() == [0.0, 0.0]
        assert torch.equal(model.curriculum.g.get_state(), state)
