"""Review 60a: a refusal one rank found is shared with the others through one collective
(``distributed.refused_on_every_rank``, ``distributed.first_error``). When that collective fails
(a peer that crashed or never came: gloo's "Connection closed by peer", a timeout), the rank that
found it raised the transport's error instead, and its one line ("steps.csv already exists",
exit 2) was lost to a gloo traceback. Here the group is real (gloo, two ranks, its store in this
process) and rank 1 never comes: gloo connects lazily, so rank 0 starts alone and its first
collective fails after the group's timeout (a fraction of a second)."""

from __future__ import annotations

import datetime

import pytest

from helpers import GLOO

from ampguard import distributed
from ampguard.errors import InputError


@pytest.fixture
def peer_never_comes(monkeypatch):
    """Rank 0 of a gloo group of two whose rank 1 never joins: each collective fails."""
    if not GLOO:
        pytest.skip("needs gloo")
    import torch.distributed as dist

    monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", "1")  # (no connection made at the start, which would wait for rank 1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=2,
                            timeout=datetime.timedelta(seconds=0.2))
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("raised", [InputError("steps.csv already exists; refusing to overwrite it"),
                                    OSError(28, "No space left on device")], ids=["bad-input", "disk-full"])
def test_a_rank_raises_its_own_refusal_when_the_collective_that_shares_it_fails(peer_never_comes, raised):
    with pytest.raises(type(raised)) as caught:
        with distributed.refused_on_every_rank():
            raise raised
    assert caught.value is raised  # (not gloo's error: the line the CLI prints, exit 2 for bad input)
    assert [note.startswith("ampguard: the other ranks could not be told of it: ")
            for note in getattr(raised, "__notes__", [])] == [True], raised.__notes__
    # first_error: this rank's own line; a rank with none to say still meets the failure
    assert distributed.first_error("task.factory: evaluate() returned ['x']") == "task.factory: evaluate() returned ['x']"
    with pytest.raises(RuntimeError):
        distributed.first_error(None)
    with pytest.raises(RuntimeError):  # (and so does refused_on_every_rank's: it has no refusal of its own)
        with distributed.refused_on_every_rank():
            pass
