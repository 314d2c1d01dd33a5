"""Review 58d, finding 3: a DataLoader worker that dies while a checkpoint is written.

Torch's DataLoader sets a SIGCHLD handler that raises ``DataLoader worker (pid N) ... exited
unexpectedly`` wherever the main thread is when a worker dies: in a checkpoint's write it cut the
save short (the checkpoint lost; the run ended "crashed", a traceback, exit 1), at a data read it
was bad data (exit 2, the checkpoint kept), by timing. The write now holds SIGCHLD's handler back
(``checkpoint.child_exits_held``): the save completes, and the loader says the worker died at its
next read.

The death is a real one, at a known point: the payload holds an object whose pickling, inside
``torch.save``, kills the loader's worker (SIGKILL, as an OOM kill) and waits until it has exited
(not reaping it: torch's handler looks at it).
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from ampguard.checkpoint import save_checkpoint


class Pids(Dataset):
    """Item ``i``: ``(i, the pid of the process that made it)``: the worker's, under a DataLoader."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor(float(i)), torch.tensor(os.getpid())


class KillsWorker:
    """Pickled (by ``torch.save``), kills the process ``pid`` and waits until it has exited."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def __reduce__(self):
        os.kill(self.pid, signal.SIGKILL)
        os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)  # (left to be reaped: torch's handler reads it)
        for _ in range(1000):  # (a handler the signal tripped runs at the next check of the main thread)
            pass
        return int, (0,)


@pytest.mark.skipif(not hasattr(signal, "SIGCHLD"), reason="no SIGCHLD (Windows)")
def test_a_worker_that_dies_during_a_save_leaves_the_checkpoint_and_is_said_at_the_next_read(tmp_path):
    loader = DataLoader(Pids(), batch_size=2, num_workers=1, timeout=1.0, multiprocessing_context="fork")
    reader = iter(loader)  # (torch's SIGCHLD handler is set as its workers start)
    _, pids = next(reader)
    torch_handler = signal.getsignal(signal.SIGCHLD)
    path = save_checkpoint(tmp_path / "step-00000004.pt", {"step": 4, "dies": KillsWorker(int(pids[0]))})
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000004.pt"]  # whole, at its name; no temporary left
    assert torch.load(path, weights_only=False)["step"] == 4
    assert signal.getsignal(signal.SIGCHLD) is torch_handler
    with pytest.raises(RuntimeError, match=r"^DataLoader worker \(pid"):  # (after the batches it had sent)
        for _ in range(len(loader)):
            next(reader)


@pytest.mark.skipif(not hasattr(signal, "SIGCHLD"), reason="no SIGCHLD (Windows)")
def test_another_handlers_error_is_raised_after_the_block_and_the_handler_put_back():
    from ampguard.checkpoint import child_exits_held

    def raises(signum, frame):
        raise ValueError("a handler of the user's")

    before = signal.signal(signal.SIGCHLD, raises)
    try:
        went_on = False
        with pytest.raises(ValueError, match="a handler of the user's"):
            with child_exits_held():
                signal.raise_signal(signal.SIGCHLD)
                went_on = True
        assert went_on and signal.getsignal(signal.SIGCHLD) is raises
    finally:
        signal.signal(signal.SIGCHLD, before)
