"""The run's data stream (``ampguard.data.DataStream``): position, seek, state, faults per step."""

from __future__ import annotations

import pytest
import torch

from helpers import deadline

from ampguard.config import validate
from ampguard.data import DataStream, _hashed, _leaf_text
from ampguard.distributed import DistInfo
from ampguard.faults import SPIKE_FACTOR, FaultInjector, parse_fault
from ampguard.tasks import build_task

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def task():
    return build_task(validate({"task": {"name": "linear", "batch_size": 4}}))


def stream(task, *faults: str, accumulation: int = 1, dist: DistInfo | None = None) -> DataStream:
    injector = FaultInjector([parse_fault(f) for f in faults], accumulation_steps=accumulation)
    return DataStream(task, injector, CPU, dist)


@pytest.fixture(scope="module")
def uninterrupted(task):
    data = stream(task)
    return [data.next(first_step=1) for _ in range(16)]


def same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_position_counts_the_micro_batches_taken(task):
    data = stream(task)
    assert data.position == 0 and data.state_dict() == 0
    for n in range(1, 6):
        data.next(first_step=1)
        assert data.position == n and data.state_dict() == n


def test_the_stream_is_the_tasks_stream_in_order(task, uninterrupted):
    source = task.batches()
    for got in uninterrupted:
        assert same(got, next(source))
    assert not same(uninterrupted[0], uninterrupted[1])  # the batches differ: comparing them means something


@pytest.mark.parametrize("n", [0, 1, 7, 15])
def test_seek_then_next_gives_the_batch_the_uninterrupted_stream_gave_there(task, uninterrupted, n):
    data = stream(task)
    data.seek(n)
    assert data.position == n
    for i in range(n, 16):
        assert same(data.next(first_step=1), uninterrupted[i]), i
        assert data.position == i + 1


def test_seek_backwards_and_forwards_on_a_stream_in_use(task, uninterrupted):
    data = stream(task)
    for _ in range(9):
        data.next(first_step=1)
    data.seek(3)  # back (a rollback)
    assert same(data.next(first_step=1), uninterrupted[3]) and data.position == 4
    data.seek(12)  # forward (skipping bad batches)
    assert same(data.next(first_step=1), uninterrupted[12]) and data.position == 13
    data.seek(12)  # to where it already is: the batch is read again
    assert same(data.next(first_step=1), uninterrupted[12])


def test_state_dict_round_trip_continues_the_same_stream(task, uninterrupted):
    a = stream(task)
    for _ in range(7):
        a.next(first_step=1)
    b = stream(task)
    b.load_state_dict(a.state_dict())
    assert b.position == 7
    for i in range(7, 12):
        x, y = a.next(first_step=1), b.next(first_step=1)
        assert same(x, y) and same(x, uninterrupted[i])
    assert a.state_dict() == b.state_dict() == 12


def test_load_state_dict_takes_an_integer_like_position(task, uninterrupted):
    data = stream(task)
    data.load_state_dict(torch.tensor(5))
    assert data.position == 5 and isinstance(data.position, int)
    assert same(data.next(first_step=1), uninterrupted[5])


def spiked(batches, clean) -> list[bool]:
    """Which batches had their targets multiplied by the spike factor (inputs untouched)."""
    out = []
    for (x, y), (cx, cy) in zip(batches, clean):
        assert torch.equal(x, cx)
        if torch.equal(y, cy):
            out.append(False)
        else:
            assert torch.equal(y, cy * SPIKE_FACTOR)
            out.append(True)
    return out


def test_a_fault_hits_the_micro_batches_of_its_step_only(task, uninterrupted):
    data = stream(task, "spike@2", accumulation=2)
    got = [data.next(first_step=1) for _ in range(8)]
    assert spiked(got, uninterrupted) == [False, False, True, True, False, False, False, False]  # batches 3 and 4


def test_a_fault_after_a_seek_follows_first_step(task, uninterrupted):
    data = stream(task, "spike@2", accumulation=2)
    data.seek(2)  # a resume at step 1: the next batch belongs to step 2
    got = [data.next(first_step=2) for _ in range(4)]
    assert spiked(got, uninterrupted[2:6]) == [True, True, False, False]
    data.seek(4)  # past it: step 3 on, nothing to corrupt
    got = [data.next(first_step=3) for _ in range(4)]
    assert spiked(got, uninterrupted[4:8]) == [False] * 4


def test_first_step_only_counts_when_the_stream_is_opened(task, uninterrupted):
    data = stream(task, "spike@2", accumulation=1)
    data.next(first_step=1)
    assert spiked([data.next(first_step=99)], [uninterrupted[1]]) == [True]  # still step 2: already open


def test_nan_input_corrupts_inputs_of_its_step(task, uninterrupted):
    data = stream(task, "nan_input@3", accumulation=1)
    got = [data.next(first_step=1) for _ in range(4)]
    assert [bool(x.isnan().any()) for x, _ in got] == [False, False, True, False]
    assert torch.equal(got[2][1], uninterrupted[2][1])


def test_under_torchrun_each_rank_takes_its_slice_of_each_global_batch(task, uninterrupted):
    for rank in (0, 1):
        data = stream(task, dist=DistInfo(rank=rank, world_size=2, local_rank=rank))
        for i in range(3):
            x, y = data.next(first_step=1)
            gx, gy = uninterrupted[i]
            assert torch.equal(x, gx[2 * rank: 2 * rank + 2]) and torch.equal(y, gy[2 * rank: 2 * rank + 2])
        assert data.position == 3  # global batches


# ---------------------------------------------------------------------------- seeking without reading (issue 16)


def test_seek_far_is_instant_for_a_built_in_task(task, monkeypatch):
    import ampguard.tasks.linear
    from ampguard.tasks.linear import linear_batches

    # A spy on the linear task's batch source (the real one does the work): the position each
    # stream was opened at and the batches drawn from it.
    opened: list[int] = []
    drawn: list[int] = []

    def spy(seed, batch_size, sample_seed=None, start=0):
        opened.append(start)
        for i, batch in enumerate(linear_batches(seed, batch_size, sample_seed, start=start)):
            drawn.append(start + i)
            yield batch

    monkeypatch.setattr(ampguard.tasks.linear, "linear_batches", spy)
    data = stream(task)
    with deadline(30):  # reading 10**12 batches would take days: a hang fails here
        data.seek(10**12)
        x, y = data.next(first_step=1)
    assert opened == [10**12]  # opened at the position itself, once, never from 0
    assert drawn == [10**12]  # and only the batch given was drawn
    cx, cy = next(linear_batches(1, 4, start=10**12))  # the linear task of seed 0: its stream is seed + 1
    assert torch.equal(x, cx) and torch.equal(y, cy) and data.position == 10**12 + 1


def test_a_task_without_batches_from_is_read_up_to_the_position(uninterrupted):
    from ampguard.tasks import Task

    reads = []

    def batches():
        for i, batch in enumerate(uninterrupted):
            reads.append(i)
            yield batch

    data = stream(Task("toy", torch.nn.Linear(16, 4), torch.nn.functional.mse_loss, batches=batches))
    data.seek(5)
    assert same(data.next(first_step=1), uninterrupted[5]) and reads == [0, 1, 2, 3, 4, 5]


def test_peek_gives_the_next_batch_without_faults_and_without_moving(task, uninterrupted):
    data = stream(task, "nan_input@1", "spike@1", dist=DistInfo(rank=1, world_size=2, local_rank=1))
    data.seek(3)
    x, y = data.peek()
    assert data.position == 3
    assert torch.equal(x, uninterrupted[3][0][2:]) and torch.equal(y, uninterrupted[3][1][2:])  # rank 1's half, clean
    assert same(data.peek(), (x, y))


class Tags:
    """A batch field of the user's with ``object``'s ``repr`` (its address)."""


def test_the_digest_ranks_compare_is_the_same_for_the_same_batch_in_any_process():
    """Review 58e: fresh torchrun ranks reading identical batches were refused as reading different
    data when a batch held a set (its order follows the process's hash secret, and its own
    history) or an object whose ``repr`` names its address."""
    grown = set()
    grown.add(9), grown.add(1)  # (1 and 9 share a slot of a small set: its order is its history's)
    assert repr(grown) != repr({1, 9})
    x = torch.arange(4.0)
    assert _hashed((x, {"tags": grown})) == _hashed((x, {"tags": {1, 9}}))
    assert _hashed((x, frozenset({("a", 1), ("b", 2)}))) == _hashed((x, frozenset({("b", 2), ("a", 1)})))
    one, another = Tags(), Tags()  # (both alive: two addresses)
    assert _hashed((x, {"meta": one})) == _hashed((x, {"meta": another}))
    # what differs still differs: the members, the type, the tensors
    assert _hashed((x, {"tags": {1, 9}})) != _hashed((x, {"tags": {1, 8}}))
    assert _hashed((x, {"tags": {1, 9}})) != _hashed((x, {"tags": frozenset({1, 9})}))
    assert _hashed((x, {"meta": Tags()})) != _hashed((x, {"meta": object()}))
    assert _hashed((x, {"tags": {1, 9}})) != _hashed((x + 1, {"tags": {1, 9}}))


def test_a_plain_leafs_text_is_its_repr_as_a_checkpoints_fingerprint_kept_it():
    """The digest of a batch of tensors and plain values is what an earlier ampguard kept in a
    checkpoint (``data_next``): a string that looks like an address is a value, kept whole."""
    for leaf in ("x at 0x1234", b"\x00", 3, 2.5, True, None):
        assert _leaf_text(leaf) == repr(leaf)
