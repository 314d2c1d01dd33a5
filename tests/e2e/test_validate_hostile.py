"""``ampguard validate`` against a hostile review: a factory with no ``held_out`` (its report
must say it judged training data), two runs given one ``--out`` at once (the second is refused at
its start; the first's report is never overwritten), two default folders in one second, and a
recorded ``environment.config`` run again from another folder (its paths must not depend on the
folder the first run ran in). The verb's main behaviour is in ``tests/e2e/test_validate_cli.py``.
"""

from __future__ import annotations

import errno
import re
import json
import os
import time
from pathlib import Path

from helpers import one_line_error, train

from ampguard import validate
from ampguard.cli import main
from ampguard.files import DiskFull

# An identity Linear (logits = inputs: exact in bf16), trained on two batches, with no held_out: its
# evaluation set is its first training batches (tasks/factory.py's default).
NO_HELD_OUT = '''
import torch
from torch import nn
from torch.nn import functional as F


def build(config):
    lin = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(2))
    x = torch.tensor([[3.0, 0.0], [0.0, 3.0], [2.0, -1.0], [-1.0, 2.0], [4.0, 1.0], [1.0, 4.0]])
    y = x.argmax(1)
    return {"model": lin, "data": [(x[:3], y[:3]), (x[3:], y[3:])], "loss_fn": F.cross_entropy}
'''

LINEAR = ["--set", "task.name=linear", "--set", "validation.precisions=[bf16]", "--set", "validation.max_mse=100"]


def report(folder: Path) -> tuple[str, dict]:
    return ((folder / "validation.md").read_text(encoding="utf-8"),
            json.loads((folder / "validation.json").read_text(encoding="utf-8")))


# ---------------------------------------------------------------------------- defect 2: no held_out


def test_a_factory_with_no_held_out_is_reported_as_judged_on_training_data(cli, tmp_path, factory):
    (tmp_path / "tiny.py").write_text(NO_HELD_OUT, encoding="utf-8")
    code, out, err = cli("validate", "--set", "task.factory=tiny.py:build", "--set", "validation.precisions=[bf16]",
                         "--set", "validation.min_accuracy=0", "--out", "r")
    assert code == 0, (out, err)  # not refused: held_out is optional
    md, data = report(tmp_path / "r")
    said = "the first 2 training batches (6 examples), not held-out data: the task's factory returns no held_out"
    assert out.splitlines()[0].startswith(f"evaluation set: {said}")
    assert f"Evaluation set: {said}" in md
    assert data["evaluation_set"]["source"] == "training_batches"
    assert (data["evaluation_set"]["batches"], data["evaluation_set"]["examples"]) == (2, 6)
    # the probes drawn from those rows never claim to be held out
    assert data["probes"] == [f"train:{i}" for i in range(6)]
    assert not any("held_out" in probe["probe"] for probe in data["precisions"][0]["probes"])
    assert "held_out:" not in md

    # a factory that returns held_out: held-out, and said so
    code, out, err = cli("validate", "--set", f"task.factory={factory}", "--set", "validation.precisions=[bf16]",
                         "--set", "validation.min_accuracy=0", "--out", "h")
    assert code == 0, (out, err)
    md, data = report(tmp_path / "h")
    assert data["evaluation_set"] == {"source": "held_out", "examples": 6,
                                      "description": "task factory's held-out set (6 examples)"}
    assert out.splitlines()[0] == "evaluation set: task factory's held-out set (6 examples)"
    assert data["probes"][0] == "held_out:0"


# ---------------------------------------------------------------------------- defect 3: the output folder


def test_a_second_run_given_the_same_out_is_refused_at_its_start(cli, tmp_path, monkeypatch):
    # the second run starts while the first compares (after its up-front check): both passed the
    # check, and the second's report was overwritten by the first's, ACCEPTED printed over REJECTED
    real = validate.compare
    second: list[tuple[int, str]] = []

    def compare_while_another_starts(*args, **kwargs):
        if not second:
            second.append(("started", ""))
            code = main(["validate", *LINEAR, "--set", "validation.typical=2", "--out", "shared"])
            second[0] = (code, str(sorted(p.name for p in (tmp_path / "shared").iterdir())))
        return real(*args, **kwargs)

    monkeypatch.setattr(validate, "compare", compare_while_another_starts)
    code, out, err = cli("validate", *LINEAR, "--out", "shared")
    assert code == 0, (out, err)
    # the second: one line, exit 2, nothing of the first's touched (only its reservation was there)
    assert second == [(2, "['.ampguard-validate']")]
    [line, warning] = err.splitlines()
    assert line == (f"ampguard: error: --out shared is being written by another ampguard validate (pid {os.getpid()}): "
                    "choose another --out (or remove shared/.ampguard-validate if none runs)")
    assert warning.startswith("ampguard: warning: validate: no --checkpoint")  # (the first run's)
    # the report there is the first run's, whole, and the reservation is gone
    md, data = report(tmp_path / "shared")
    assert sorted(p.name for p in (tmp_path / "shared").iterdir()) == ["validation.json", "validation.md"]
    assert len([p for p in data["probes"] if p.startswith("held_out:")]) == 32  # not the second's typical=2
    assert out.splitlines()[-1] == "validate: ACCEPTED; report shared/validation.md, shared/validation.json"

    # the folder holds a report now: refused as before, and untouched
    before = (tmp_path / "shared" / "validation.md").read_bytes()
    line = one_line_error(*cli("validate", *LINEAR, "--out", "shared"))
    assert line == "ampguard: error: --out shared exists and is not empty; refusing to overwrite it"
    assert (tmp_path / "shared" / "validation.md").read_bytes() == before


def test_a_reservation_left_by_a_killed_run_does_not_hold_the_folder(cli, tmp_path):
    # a validate killed (SIGKILL, SIGTERM) never let go of its folder: every later run to that
    # --out was refused as "being written by another ampguard validate" while none ran
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for pid, refused in ((dead.pid, False), (os.getpid(), True)):  # (a live one: still refused)
        (tmp_path / "out").mkdir(exist_ok=True)
        (tmp_path / "out" / ".ampguard-validate").write_text(f"{pid}\n")
        code, out, err = cli("validate", *LINEAR, "--out", "out")
        assert (code == 2 and "being written by another ampguard validate" in err) if refused else code == 0, err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".ampguard-validate", "validation.json",
                                                                   "validation.md"]


def test_default_folders_started_in_the_same_second_do_not_collide(cli, tmp_path, monkeypatch):
    stamp, real = "validate-20250101-000000", time.strftime
    monkeypatch.setattr(time, "strftime", lambda fmt, *t: stamp if fmt.startswith("validate-") else real(fmt, *t))
    taken = tmp_path / "runs" / stamp
    taken.mkdir(parents=True)
    (taken / "validation.md").write_text("another run's report\n")
    code, out, err = cli("validate", *LINEAR)
    assert code == 0, (out, err)
    assert (taken / "validation.md").read_text() == "another run's report\n"
    assert sorted(p.name for p in (tmp_path / "runs" / f"{stamp}-2").iterdir()) == ["validation.json", "validation.md"]
    assert out.splitlines()[-1].endswith(f"report runs/{stamp}-2/validation.md, runs/{stamp}-2/validation.json")

    # a default folder that cannot be made names log.dir, not an --out nobody gave
    (tmp_path / "notes").write_text("keep me\n")
    line = one_line_error(*cli("validate", *LINEAR, "--set", "log.dir=notes"))
    assert line == f"ampguard: error: log.dir notes: {tmp_path / 'notes'} is a file, not a folder"


def test_a_run_stopped_after_its_reservation_takes_it_back(cli, tmp_path, monkeypatch):
    # the folder is made at the start now: a Ctrl-C or a failed write must not leave it behind
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    real_compare = validate.compare
    monkeypatch.setattr(validate, "compare", interrupted)
    (tmp_path / "empty").mkdir()
    for out in ("deep/report", "empty"):
        code, _, err = cli("validate", *LINEAR, "--out", out)
        assert code == 130, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]  # made: removed; found: kept, empty
    assert not list((tmp_path / "empty").iterdir())

    def disk_full(path, data):  # the report's first file written, then the disk is full
        if Path(path).name == "validation.json":
            raise DiskFull(path, OSError(errno.ENOSPC, "No space left on device"))
        Path(path).write_text(data)

    monkeypatch.setattr(validate, "compare", real_compare)
    monkeypatch.setattr(validate, "replace_atomically", disk_full)
    line = one_line_error(*cli("validate", *LINEAR, "--out", "deep/report"))
    assert line == "ampguard: error: --out deep/report: cannot write the report (No space left on device)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


# ---------------------------------------------------------------------------- defect 8: reproducible config


def test_the_recorded_config_reproduces_the_report_from_another_folder(cli, tmp_path, monkeypatch):
    (tmp_path / "tiny.py").write_text(NO_HELD_OUT, encoding="utf-8")
    factory = ["--set", "task.factory=tiny.py:build"]
    train(Path("runs"), "ck", *factory, "--set", "steps=2", "--set", "precision=fp32")
    checkpoint = Path("runs/ck/checkpoints/step-00000002.pt")
    assert checkpoint.is_file()
    code, out, err = cli("validate", *factory, "--set", "validation.precisions=[bf16]",
                         "--set", "validation.min_accuracy=0", "--checkpoint", checkpoint, "--out", "first")
    assert code == 0, (out, err)
    _, data = report(tmp_path / "first")
    env = data["environment"]
    assert env["config"]["validation"]["checkpoint"] == str((tmp_path / checkpoint).resolve())
    assert env["config"]["task"]["factory"] == f"{(tmp_path / 'tiny.py').resolve()}:build"
    assert env["config"]["validation"]["checkpoint"] == env["checkpoint"]["path"]

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    (elsewhere / "recorded.json").write_text(json.dumps(env["config"]), encoding="utf-8")
    code, out, err = cli("validate", "recorded.json", "--out", "again")
    assert code == 0, (out, err)
    _, again = report(elsewhere / "again")
    assert again["environment"] == env  # the same config, hash, checkpoint and probe set
    assert again["precisions"] == data["precisions"] and again["probes"] == data["probes"]


# ---------------------------------------------------------------------------- seed 001: updates actually made

# inputs x1000: fp16's weight gradients overflow above a loss scale of ~64 (the scaler searches
# down from 2**16), while the forward stays finite and right
BIG = '''
import torch
from torch.nn import functional as F
from torch import nn


def build(config):
    lin = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(2))
    x = torch.tensor([[3.0, 0.0], [0.0, 3.0], [2.0, -1.0], [-1.0, 2.0], [4.0, 1.0], [1.0, 4.0]]) * 1000
    y = x.argmax(1)
    y[0] = 1  # one wrong label: a real gradient
    return {"model": lin, "data": [(x, y)], "loss_fn": F.cross_entropy, "held_out": (x, x.argmax(1))}
'''


def test_training_that_applies_no_update_rejects_and_a_scalers_search_is_set_aside(cli, tmp_path):
    # the seed's check for a GradScaler, "the updates actually made": --train-steps reported
    # "train fp16: 0 updates applied" under ACCEPTED (informational only)
    (tmp_path / "big.py").write_text(BIG, encoding="utf-8")
    args = ["validate", "--set", "task.factory=big.py:build", "--set", "validation.precisions=[fp16]",
            "--set", "validation.min_accuracy=0.5", "--train-steps", "14"]
    code, out, err = cli(*args, "--set", "scaler.min_scale=1024", "--out", "floor")  # (the scale cannot get there)
    assert code == 1, (out, err)
    assert ("fp16: updates applied in training: 0 of 14 steps (14 skipped in the loss scaler's opening search) "
            "-> FAIL") in out
    assert out.splitlines()[-1].startswith("validate: REJECTED")
    code, out, err = cli(*args, "--out", "searched")
    assert code == 0, (out, err)
    [line] = [line for line in out.splitlines() if "updates applied in training" in line]
    assert re.fullmatch(r"fp16: updates applied in training: (\d+) of 14 steps \((\d+) skipped in the loss scaler's "
                        r"opening search\); \1/\d+ = 1\.00 \(>= 0\.9\) -> pass", line), line
    _, data = report(tmp_path / "searched")
    assert data["training"][1]["opening_skips"] > 0 and data["precisions"][0]["rules"][-1]["ok"] is True


# fp16's forward overflows on the first 8 batches (inputs x1e5: a non-finite loss, no search of a
# loss scale), then trains on normal ones
FORWARD_OVERFLOW = '''
import torch
from torch.nn import functional as F
from torch import nn


def build(config):
    lin = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(2))
    x = torch.tensor([[3.0, 0.0], [0.0, 3.0], [2.0, -1.0], [-1.0, 2.0]])
    y = x.argmax(1)
    data = [(x * 1e5, y)] * 8 + [(x, y)] * 2
    return {"model": lin, "data": data, "loss_fn": F.cross_entropy, "held_out": (x, y)}
'''


def test_skips_of_a_forward_that_overflowed_are_no_loss_scale_search(cli, tmp_path):
    # review: every skip before the first update was set aside as "the loss scaler's opening
    # search", a non-finite loss too: 2 updates of 10 read "2/2 = 1.00 -> pass", ACCEPTED
    (tmp_path / "ovf.py").write_text(FORWARD_OVERFLOW, encoding="utf-8")
    code, out, err = cli("validate", "--set", "task.factory=ovf.py:build", "--set", "validation.precisions=[fp16]",
                         "--set", "validation.min_accuracy=0.5", "--train-steps", "10", "--out", "r")
    assert code == 1, (out, err)
    assert "fp16: updates applied in training: 2 of 10 steps; 2/10 = 0.20 (>= 0.9) -> FAIL" in out, out


def test_a_marker_that_names_no_pid_holds_the_folder_in_one_line(cli, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / ".ampguard-validate").write_text("99999999999999999999\n")  # (os.kill: OverflowError)
    line = one_line_error(*cli("validate", *LINEAR, "--out", "out"))
    assert line == ("ampguard: error: --out out is being written by another ampguard validate: choose another --out "
                    "(or remove out/.ampguard-validate if none runs)")
