"""Workloads (issue 4, part 1), built directly: the built-in tasks read real data with a held-out
split that stays held out, and training streams (built-in and user factories) are reproducible.
Whole runs (each workload learns, the evaluation columns, user factories through ``ampguard
train``, bad factories as bad input) are in ``tests/e2e/test_task_runs.py``."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

from helpers import EXAMPLE, FILE_FACTORY, REGRESSION, TINY_LM, write

from ampguard.config import load_config
from ampguard.errors import InputError
from ampguard.tasks import build_task, charlm, digits

pytestmark = pytest.mark.usefixtures("_one_thread", "_no_bytecode")  # tests/conftest.py

# ---------------------------------------------------------------------------- helpers


def same_batches(a, b) -> bool:
    return all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b, strict=True))


def take(task, n: int):
    return list(itertools.islice(task.batches(), n))


# ---------------------------------------------------------------------------- held out is held out


def test_charlm_corpus_is_real_python_source():
    corpus = charlm.read_corpus()
    assert corpus.dtype == torch.uint8
    text = bytes(corpus.tolist())
    assert len(text) > 100_000  # twelve standard-library modules
    assert b"def " in text and b"import " in text and b"class " in text
    assert torch.equal(corpus, charlm.read_corpus())  # read the same way every time


def test_charlm_split_is_two_disjoint_slices():
    corpus = charlm.read_corpus()
    train, held_out = charlm.split(corpus)
    assert len(train) > 0 and len(held_out) > 0
    # a prefix and the suffix after it: every byte position is in exactly one of the two
    assert len(train) + len(held_out) == len(corpus)
    assert torch.equal(torch.cat([train, held_out]), corpus)
    assert abs(len(held_out) / len(corpus) - charlm.VAL_FRACTION) < 1e-3


def test_charlm_training_windows_come_from_the_training_slice():
    config = load_config(None, [*TINY_LM, "seed=3"])
    train, _ = charlm.split(charlm.read_corpus())
    train_bytes = bytes(train.tolist())
    task = build_task(config)
    for inputs, targets in take(task, 4):
        assert inputs.shape == targets.shape == (16, 32)
        assert torch.equal(inputs[:, 1:], targets[:, :-1])  # next-byte targets
        for x, y in zip(inputs, targets):
            assert bytes(x.tolist()) + bytes([int(y[-1])]) in train_bytes


def test_charlm_evaluates_on_the_held_out_slice(monkeypatch):
    seen = []

    def spy(model, loss_fn, batches, device):
        seen.extend(batches)
        return 1.0

    monkeypatch.setattr(charlm, "mean_loss", spy)
    train, held_out = charlm.split(charlm.read_corpus())
    train_bytes, held_bytes = bytes(train.tolist()), bytes(held_out.tolist())
    config = load_config(None, [*TINY_LM, "eval.batches=3"])
    task = build_task(config)
    assert task.evaluate(task.model, torch.device("cpu")) == {"val_loss": 1.0}
    assert len(seen) == 3
    windows = [bytes(x.tolist()) + bytes([int(y[-1])]) for inputs, targets in seen for x, y in zip(inputs, targets)]
    assert all(w in held_bytes for w in windows)
    # if these were training text, every window would also occur in the training slice
    assert sum(w not in train_bytes for w in windows) > len(windows) / 2


def test_charlm_held_out_batches_do_not_move_with_the_run_seed(monkeypatch):
    seen: list[list] = []

    def spy(model, loss_fn, batches, device):
        seen.append(batches)
        return 0.0

    monkeypatch.setattr(charlm, "mean_loss", spy)
    for seed in (0, 11):
        task = build_task(load_config(None, [*TINY_LM, f"seed={seed}"]))
        task.evaluate(task.model, torch.device("cpu"))
    assert len(seen) == 2 and same_batches(seen[0], seen[1])


def test_charlm_makes_its_held_out_batches_at_the_first_evaluation_only(monkeypatch):
    # review_51f: eval.batches were made with the task, evaluation on or off (20,000 held 1.2 GB)
    made: list[int] = []
    real = charlm.held_out_batches
    monkeypatch.setattr(charlm, "held_out_batches", lambda *a: made.append(a[2]) or real(*a))
    task = build_task(load_config(None, [*TINY_LM, "eval.batches=2"]))
    assert made == []
    first = task.evaluate(task.model, torch.device("cpu"))
    assert task.evaluate(task.model, torch.device("cpu")) == first and made == [2]  # (made once)


def test_digits_split_is_fixed_and_disjoint():
    from sklearn.datasets import load_digits

    torch.manual_seed(1)
    a = digits.load_split()
    torch.manual_seed(2)
    b = digits.load_split()
    assert all(torch.equal(p, q) for p, q in zip(a, b))  # the global RNG does not move it
    x_train, y_train, x_test, y_test = a
    assert len(x_train) + len(x_test) == 1797 and len(x_test) == digits.TEST_SIZE
    assert len(y_train) == len(x_train) and len(y_test) == len(x_test)
    assert set(y_test.tolist()) == set(range(10))
    assert float(x_train.min()) >= 0.0 and float(x_train.max()) <= 1.0

    # train + test is exactly the dataset (as a multiset of labelled images): a partition, no overlap
    raw = load_digits()
    everything = sorted(tuple(row) + (label,) for row, label in zip((raw.data / 16.0).round(6).tolist(), raw.target.tolist()))
    split = sorted(
        tuple(row) + (label,)
        for x, y in ((x_train, y_train), (x_test, y_test))
        for row, label in zip(x.double().round(decimals=6).tolist(), y.tolist())
    )
    assert split == everything


class Recorder(nn.Module):
    """Answers class 0 for everything and remembers what it was shown."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.Tensor] = []

    def forward(self, x):
        self.seen.append(x.clone())
        return torch.zeros(len(x), 10)


@pytest.mark.parametrize("seed", [0, 5])
def test_digits_evaluates_on_the_fixed_test_split_whatever_the_seed(seed):
    _, _, x_test, y_test = digits.load_split()
    task = build_task(load_config(None, ["task.name=digits", f"seed={seed}"]))
    recorder = Recorder()
    metrics = task.evaluate(recorder, torch.device("cpu"))
    assert len(recorder.seen) == 1 and torch.equal(recorder.seen[0], x_test)
    # uniform logits: loss ln 10, argmax is class 0
    assert metrics["val_loss"] == pytest.approx(math.log(10), rel=1e-6)
    assert metrics["val_accuracy"] == pytest.approx(float((y_test == 0).float().mean()))


def test_digits_training_batches_never_contain_test_images():
    x_train, _, x_test, _ = digits.load_split()
    train_rows = {tuple(r) for r in x_train.tolist()}
    test_only = {tuple(r) for r in x_test.tolist()} - train_rows  # (an image may occur twice in the dataset)
    assert len(test_only) > len(x_test) / 2
    task = build_task(load_config(None, ["task.name=digits", "task.batch_size=64"]))
    for inputs, _ in take(task, 30):  # more than one epoch of 1,497 images
        for r in map(tuple, inputs.tolist()):
            assert r in train_rows and r not in test_only


# ---------------------------------------------------------------------------- reproducible streams


@pytest.mark.parametrize(
    "overrides,n",
    [(TINY_LM, 5), (["task.name=digits"], 100), (["task.name=linear"], 20)],
    ids=["charlm", "digits", "linear"],
)
def test_batches_called_twice_yield_the_same_stream(overrides, n):
    task = build_task(load_config(None, [*overrides, "seed=4"]))
    first = take(task, n)
    torch.manual_seed(12345)  # the global RNG must not matter
    assert same_batches(first, take(task, n))
    # and a fresh build with the same seed (what a resumed run does) gives it again
    assert same_batches(first, take(build_task(load_config(None, [*overrides, "seed=4"])), n))
    # the seed does choose the stream
    other = take(build_task(load_config(None, [*overrides, "seed=5"])), n)
    assert not same_batches(first, other)


def test_digits_stream_covers_the_training_split_each_epoch():
    x_train, _, _, _ = digits.load_split()
    batch_size = 32
    per_epoch = len(x_train) // batch_size
    task = build_task(load_config(None, ["task.name=digits", f"task.batch_size={batch_size}"]))
    batches = take(task, 2 * per_epoch)
    for epoch in range(2):
        seen = torch.cat([x for x, _ in batches[epoch * per_epoch:(epoch + 1) * per_epoch]])
        assert len({tuple(r) for r in seen.tolist()}) >= len({tuple(r) for r in x_train.tolist()}) - batch_size
    assert not torch.equal(batches[0][0], batches[per_epoch][0])  # reshuffled each epoch


def test_factory_list_and_function_streams_are_reproducible(tmp_path):
    write(tmp_path / "lst.py", FILE_FACTORY)
    write(tmp_path / "gen.py", REGRESSION + """
def build(config):
    train, _, _ = make()
    def data():
        for x, y in train:
            yield x, y
    return nn.Linear(8, 1), data, nn.functional.mse_loss
""")
    for spec in (f"{tmp_path}/lst.py:build", f"{tmp_path}/gen.py:build"):
        task = build_task(load_config(None, [f"task.factory={spec}"]))
        first = take(task, 30)  # 14 batches an epoch: crosses two epoch boundaries
        assert same_batches(first, take(task, 30))
        assert same_batches(first[:14], first[14:28])  # epoch after epoch, the same data


def test_example_dataloader_stream_is_reproducible():
    task = build_task(load_config(None, [f"task.factory={EXAMPLE}:build"]))
    assert same_batches(take(task, 3), take(task, 3))


def test_a_shuffling_dataloader_reshuffles_every_epoch_as_a_plain_loop_does_and_each_stream_is_the_same(tmp_path):
    # review_session26: every epoch reset the loader's generator, so each epoch had the first one's
    # order (silently worse SGD); and the check that the data is re-iterable drew from the generator
    # before its state was kept, so not even the first epoch was the loader's own
    write(tmp_path / "dl.py", """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def build(config):
    data = DataLoader(TensorDataset(torch.arange(8.0)[:, None], torch.zeros(8, 1)), batch_size=2, shuffle=True,
                      generator=torch.Generator().manual_seed(1))
    return nn.Linear(1, 1), data, nn.functional.mse_loss
""")
    import importlib.util

    spec = importlib.util.spec_from_file_location("dl_plain", tmp_path / "dl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    loader = module.build(None)[1]
    plain = [int(v) for _ in range(3) for x, _ in loader for v in x.flatten()]  # three epochs of a plain loop
    task = build_task(load_config(None, [f"task.factory={tmp_path / 'dl.py'}:build"]))
    order = lambda: [int(v) for x, _ in itertools.islice(task.batches(), 12) for v in x.flatten()]  # noqa: E731
    assert order() == plain and order() == plain  # the loader's own epochs, again from the start
    assert plain[:8] != plain[8:16]


# ---------------------------------------------------------------------------- a stream from any position (issue 16)


@pytest.mark.parametrize(
    "overrides,starts",
    [(TINY_LM, [0, 1, 7]), (["task.name=digits", "task.batch_size=500"], [0, 1, 2, 3, 5, 8]),
     (["task.name=linear"], [0, 1, 13])],
    ids=["charlm", "digits", "linear"],
)
def test_a_built_in_stream_from_a_position_is_the_stream_read_up_to_it(overrides, starts):
    task = build_task(load_config(None, overrides))
    assert task.batches_from is not None
    reference = take(task, max(starts) + 3)
    for start in starts:  # digits: 2 batches of 500 an epoch, so these cross epoch boundaries
        assert same_batches(list(itertools.islice(task.stream(start), 3)), reference[start:start + 3]), start


def test_digits_refuses_a_batch_larger_than_its_training_set():
    with pytest.raises(InputError, match=r"^task.batch_size: a batch of 1498 images is larger than the digits "
                                         r"training set \(1,497 images\); use at most 1497$"):
        build_task(load_config(None, ["task.name=digits", "task.batch_size=1498"]))
    assert len(next(build_task(load_config(None, ["task.name=digits", "task.batch_size=1497"])).batches())[0]) == 1497


def test_a_digit_stream_with_no_whole_batch_raises_instead_of_looping_forever():
    x, y = torch.zeros(5, 2), torch.zeros(5)
    with pytest.raises(ValueError, match="a batch of 6 examples is larger than the 5 there are"):
        next(digits.digit_batches(x, y, seed=0, batch_size=6))


def test_charlm_refuses_a_context_longer_than_its_held_out_text():
    with pytest.raises(InputError, match=r"^task.block_size: a context of 10000000 is longer than the held-out text"):
        build_task(load_config(None, [*TINY_LM, "task.block_size=10000000"]))
    with pytest.raises(ValueError, match="a context of 8 needs at least 9 bytes of text, not 8"):
        next(charlm.char_batches(torch.zeros(8, dtype=torch.uint8), seed=0, batch_size=1, block_size=8))
    next(charlm.char_batches(torch.zeros(9, dtype=torch.uint8), seed=0, batch_size=1, block_size=8))  # (one window)


def test_under_torchrun_a_batch_size_refusal_says_its_numbers_are_the_global_batchs():
    # "use at most 1497" read as a per-process limit: under 2 processes it is 748
    from ampguard.config import validate
    from ampguard.trainer import _build_task

    config = validate({"task": {"name": "digits", "batch_size": 1000}})
    with pytest.raises(InputError, match=r"use at most 1497 \(under torchrun task.batch_size is per process: the global "
                                         r"batch is 1000 x 2 processes; divide by 2\)"):
        _build_task(config, 2)


def test_a_setting_the_task_does_not_read_is_said_and_a_charlm_rule_binds_charlm_only():
    # review_session26: `n_head must divide n_embd` refused a digits run of width 10 (digits has no
    # heads), while task.options and charlm's shape given to digits or linear were ignored unsaid
    from ampguard.errors import AmpguardWarning

    config = load_config(None, ["task.name=digits", "task.n_embd=10", "task.n_layer=3", "task.options={w: 1}"])
    with pytest.warns(AmpguardWarning, match=r"^task digits does not read task\.options, task\.n_layer: ignored "
                                             r"\(task\.options are a task\.factory's\)$"):
        task = build_task(config)
    assert task.name == "digits"
    with pytest.raises(Exception, match=r"n_head \(4\) must divide n_embd \(10\)"):
        load_config(None, ["task.name=charlm", "task.n_embd=10"])
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_task(load_config(None, ["task.name=linear"]))  # (defaults: nothing said)


def test_a_dataloader_shuffling_with_the_global_rng_is_said(tmp_path):
    # review_session26: the README says resume is exact only with a seeded generator; nothing said so
    from ampguard.errors import AmpguardWarning

    source = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def build(config):
    data = DataLoader(TensorDataset(torch.ones(8, 1), torch.zeros(8, 1)), batch_size=2, shuffle=True{gen})
    return nn.Linear(1, 1), data, nn.functional.mse_loss
"""
    write(tmp_path / "a.py", source.format(gen=""))
    write(tmp_path / "b.py", source.format(gen=", generator=torch.Generator().manual_seed(0)"))
    ds = "TensorDataset(torch.ones(8, 1), torch.zeros(8, 1))"
    write(tmp_path / "c.py", source.replace("shuffle=True{gen}", "").replace(  # (a sampler of the user's: the
        "batch_size=2, )", f"sampler=torch.utils.data.RandomSampler({ds}), generator=torch.Generator(), batch_size=2)"))
    write(tmp_path / "d.py", source.replace(  # loader's generator never reaches it), or inside a batch sampler
        f"DataLoader({ds}, batch_size=2, shuffle=True{{gen}})",
        f"DataLoader({ds}, batch_sampler=torch.utils.data.BatchSampler(torch.utils.data.RandomSampler({ds}), 2, False))"))
    for name in ("a", "c", "d"):
        with pytest.warns(AmpguardWarning, match=r"the DataLoader's sampler draws from the global RNG: a resume"):
            build_task(load_config(None, [f"task.factory={tmp_path / name}.py:build"]))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", AmpguardWarning)
        build_task(load_config(None, [f"task.factory={tmp_path / 'b.py'}:build"]))


def test_a_samplers_own_generator_starts_every_stream_where_the_factory_left_it(tmp_path):
    # re-read of the session: only the loader's generator was set back at a stream's start, so a
    # sampler with a generator of its own (what the sampler warning suggests) read another order on a
    # resume's stream than on the run's
    write(tmp_path / "s.py", """
import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset


def build(config):
    ds = TensorDataset(torch.arange(8.0)[:, None], torch.zeros(8, 1))
    data = DataLoader(ds, batch_size=2, sampler=RandomSampler(ds, generator=torch.Generator().manual_seed(3)))
    return nn.Linear(1, 1), data, nn.functional.mse_loss
""")
    task = build_task(load_config(None, [f"task.factory={tmp_path / 's.py'}:build"]))
    order = lambda: [int(v) for x, _ in itertools.islice(task.batches(), 8) for v in x.flatten()]  # noqa: E731
    first = order()
    assert order() == first and first[:8] != first[8:]  # (the same stream again; each epoch its own order)


# ---------------------------------------------------------------------------- a factory's batches_from

SEEKABLE = """
import torch
from torch import nn

MADE = []  # the index of every batch made, in order


def batch(i):
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)


def stream(start):  # the whole stream from micro-batch `start` on: batch i drawn from its index
    i = start
    while True:
        MADE.append(i)
        yield batch(i)
        i += 1


def build(config):
    torch.manual_seed(0)
    seek = {"right": stream, "off": lambda start: stream(start + 1), "ends": lambda start: iter([batch(start)] * 4),
            "none": "stream"}[config.task.options.get("seek", "right")]
    return {"model": nn.Linear(3, 1), "data": lambda: stream(0), "loss_fn": nn.functional.mse_loss,
            "batches_from": seek}
"""


def seekable(tmp_path, seek: str = "right"):
    write(tmp_path / "seekable.py", SEEKABLE)
    return build_task(load_config(None, [f"task.factory={tmp_path / 'seekable.py'}:build", f"task.options.seek={seek}"]))


def test_a_factorys_batches_from_starts_a_stream_without_making_the_batches_before_it(tmp_path):
    # a resume, a rollback and locate read a factory's stream from its start up to their position
    # (a large dataset's hour of batches decoded to be dropped); batches_from starts there
    task = seekable(tmp_path)
    made = task.batches_from.args[0].__globals__["MADE"]  # (the factory module's own list)
    assert made == [0, 1, 2, 3, 0, 0, 3]  # build read data's first four and its first again, checked batches_from(0), (3)
    made.clear()
    assert same_batches(list(itertools.islice(task.stream(50), 3)), take(task, 53)[50:])
    assert made[:3] == [50, 51, 52] and made[3:] == list(range(53))  # the seek made no batch before 50


@pytest.mark.parametrize("seek, said", [
    ("off", r"batches_from\(0\) does not start with data's batch 0 \(counted from 0\): a resume would train on other "
            r"batches than the run; make batches_from\(start\) give data's stream from micro-batch start on$"),
    ("none", r"batches_from must be a function: batches_from\(start\) -> the batches of data from micro-batch start "
             r"on, got a str$"),
])
def test_a_factorys_batches_from_that_does_not_give_datas_stream_is_refused_in_one_line(tmp_path, seek, said):
    with pytest.raises(InputError, match=r"^task\.factory .*seekable\.py:build: " + said):
        seekable(tmp_path, seek)


def test_a_factorys_batches_from_that_ends_says_so_when_the_stream_runs_out(tmp_path):
    task = seekable(tmp_path, "ends")  # (right on the batches checked; then four batches and no more)
    stream = task.stream(7)
    assert len(list(itertools.islice(stream, 4))) == 4
    with pytest.raises(ValueError, match=r"batches_from\(7\) ended after 4 batches: it must give data's stream on, "
                                         r"epoch after epoch"):
        next(stream)
