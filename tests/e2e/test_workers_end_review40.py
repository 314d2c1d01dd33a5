"""A run ends the DataLoader workers its reads started when its loop is over (``Task.release``,
``DataStream.release``): they lived on, held in a reference cycle of the run's stream, until a
garbage collection ended them, which then waited 5 s a worker (their queues' feeder threads
were finalised first, so no worker heard it should stop): 10 s of a notebook's or a test
suite's next collection after each ``ampguard train`` of a factory with two workers."""

from __future__ import annotations

import multiprocessing

import pytest

from helpers import NOISY_DATA, write

pytestmark = pytest.mark.usefixtures("_one_thread", "_no_bytecode")  # tests/conftest.py

RUN = ["--set", "device=cpu", "--set", "precision=fp32", "--set", "log.plot=false", "--set", "eval.enabled=false",
       "--set", "steps=3"]

FACTORIES = NOISY_DATA + """

def persistent(config):
    return nn.Linear(8, 2), persistent_loader(), F.mse_loss


def workers(config):
    x, y = xy()
    data = DataLoader(Noisy(x, y), batch_size=16, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(0))
    return nn.Linear(8, 2), data, F.mse_loss
"""


@pytest.mark.parametrize("fn", ["persistent", "workers"])
def test_a_runs_dataloader_workers_end_with_its_loop_not_at_a_later_collection(cli, tmp_path, fn):
    write(tmp_path / "fw.py", FACTORIES)
    before = set(multiprocessing.active_children())
    code, out, err = cli("train", *RUN, "--set", f"task.factory=fw.py:{fn}", "--set", f"log.name={fn}")
    assert code == 0, err
    left = [p for p in multiprocessing.active_children() if p not in before]
    assert left == [], f"{fn}: {len(left)} worker processes still running after the run"
