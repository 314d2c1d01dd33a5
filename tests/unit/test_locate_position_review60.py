"""Session 60d: ``locate --step N`` on a task that cannot seek (a factory without ``batches_from``)
reads the stream up to the data position it replays from; a hand-edited ``data_position`` of
10**15, in the checkpoint or in a rollback event of ``events.jsonl``, read for ever (``resume``
bounds a checkpoint's, ``locate`` did not). Both are now bounded as a resume bounds it
(``checkpointer.check_reachable_position``): one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from helpers import deadline, one_error_line

FACTORY = """
import torch
from torch import nn

def build(config):  # (no batches_from: a replay reads the stream up to its position)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)) for _ in range(3)]
    return {"model": nn.Linear(3, 1), "data": data, "loss_fn": nn.functional.mse_loss}
"""

BOUND = "= step x accumulation_steps + rollbacks x the largest rollback.skip_batches the run used)"


def test_locate_refuses_a_data_position_past_what_the_run_could_have_taken(cli, tmp_path):
    (tmp_path / "seekless.py").write_text(FACTORY)
    code, _, err = cli("train", "--set", "task.factory=seekless.py:build", "--set", "steps=3", "--set", "precision=fp32",
                       "--set", "device=cpu", "--set", "checkpoint.every=1", "--set", "eval.enabled=false",
                       "--set", "log.plot=false", "--set", "log.name=r")
    assert code == 0, err
    run = tmp_path / "runs" / "r"
    saved = run / "checkpoints" / "step-00000001.pt"
    payload = torch.load(saved, weights_only=False)
    torch.save({**payload, "data_position": 10**15}, saved)
    with deadline(30):  # (it read for ever)
        refused = cli("locate", run / "config.yaml", "--step", 2, "--checkpoint", saved)
    assert one_error_line(refused) == (f"ampguard: error: {saved}: data position 1000000000000000 is beyond what "
                                       f"1 step could have taken (1 {BOUND}")
    # a rollback event's, with no checkpoint: replayed from it (the run's folder is log.dir/log.name's)
    with (run / "events.jsonl").open("a") as events:
        events.write(json.dumps({"step": 1, "event": "rollback", "message": "a hand edit", "data_position": 10**15}) + "\n")
    with deadline(30):
        refused = cli("locate", run / "config.yaml", "--step", 3)
    assert one_error_line(refused) == (f"ampguard: error: {Path('runs/r/events.jsonl')} (the rollback at step 1): data position "
                                       f"1000000000000000 is beyond what 1 step could have taken (21 {BOUND}")
