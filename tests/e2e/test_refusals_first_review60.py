"""Refusals before the work (review 60b): bad input is one line, exit 2, and it costs no start-up.

- ``train --print-config`` of a config imports neither torch nor matplotlib (it was 4.7 CPU-s of
  torch's import for a printed YAML);
- a resume of a finished run that changes a setting is refused before the task is built (its
  factory called, its model compiled);
- a run folder that exists, or a ``log.dir`` that cannot hold one, is refused before the task is
  built: by the command line, before torch is imported, and by the trainer itself.

The task of these runs is a user factory that notes each call in a file: "built" is that file;
its ``evaluate()``, which the start-up tries once, runs the model (compiled, under ``compile``).
"""

from __future__ import annotations

import subprocess
import sys

import torch._dynamo

from ampguard.checkpointer import find_resume
from ampguard.config import validate
from ampguard.errors import InputError
from ampguard.train import train

FACTORY = '''
import pathlib
import torch
from torch import nn


def build(config):
    with open(pathlib.Path(__file__).with_name("built.txt"), "a") as f:
        f.write("built\\n")
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, 2, generator=g), torch.randn(4, 1, generator=g)) for _ in range(2)]

    def evaluate(model, device):  # (tried once at start-up: a compiled model compiles there)
        return {"val_mse": float(nn.functional.mse_loss(model(data[0][0].to(device)), data[0][1].to(device)))}

    return {"model": nn.Linear(2, 1), "data": data, "loss_fn": nn.functional.mse_loss, "evaluate": evaluate,
            "metrics": ("val_mse",)}
'''

RUN = ["--set", "task.factory=fac.py:build", "--set", "steps=2", "--set", "precision=fp32", "--set", "device=cpu",
       "--set", "log.plot=false"]


def _built(tmp_path) -> int:
    path = tmp_path / "built.txt"
    return len(path.read_text(encoding="utf-8").splitlines()) if path.exists() else 0


def test_print_config_of_a_config_imports_neither_torch_nor_matplotlib(tmp_path):
    (tmp_path / "runs" / "a").mkdir(parents=True)
    # (and the config module, whose import builds pydantic's schemas, is imported with the stop signals
    # held: a Ctrl-C there came out wrapped in a SchemaError, a traceback and exit 1; review 60f)
    child = ("import contextlib, importlib.abc, io, signal, sys\n"
             "held = []\n"
             "class Seen(importlib.abc.MetaPathFinder):\n"
             "    def find_spec(self, name, path, target=None):\n"
             "        if name == 'ampguard.config':\n"
             "            held.append(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))\n"
             "sys.meta_path.insert(0, Seen())\n"
             "from ampguard.cli import main\n"
             "with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()) as err:\n"
             "    printed = main(['train', '--print-config', '--set', 'steps=7'])\n"
             "    taken = main(['train', '--print-config', '--set', 'log.dir=runs', '--set', 'log.name=a'])\n"
             "print(int(printed), 'steps: 7' in out.getvalue(), int(taken), err.getvalue().strip())\n"
             "print(sorted(m for m in ('torch', 'matplotlib', 'numpy') if m in sys.modules), held)\n")
    done = subprocess.run([sys.executable, "-c", child], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    said, imported = done.stdout.splitlines()[-2:]
    assert said == "0 True 2 ampguard: error: run folder runs/a already exists; choose another log.name"
    assert imported == "[] [True]"


def test_a_taken_run_folder_is_refused_before_the_task_is_built(cli, tmp_path):
    (tmp_path / "fac.py").write_text(FACTORY, encoding="utf-8")
    (tmp_path / "runs" / "a").mkdir(parents=True)
    (tmp_path / "a-file").write_text("", encoding="utf-8")
    for where, line in ((["--set", "log.name=a"], "run folder runs/a already exists; choose another log.name"),
                        (["--set", "log.dir=a-file/runs", "--set", "log.name=b"],
                         "cannot create run folder a-file/runs/b: Not a directory")):
        code, out, err = cli("train", *RUN, *where)
        assert (code, out, err) == (2, "", f"ampguard: error: {line}\n")
    assert _built(tmp_path) == 0
    # the trainer, called as a library (no command line before it), refuses it as early
    try:
        train(validate({"task": {"factory": "fac.py:build"}, "steps": 2, "precision": "fp32", "device": "cpu",
                        "log": {"dir": "runs", "name": "a"}}))
    except InputError as err:
        assert str(err) == "run folder runs/a already exists; choose another log.name"
    else:
        raise AssertionError("not refused")
    assert _built(tmp_path) == 0 and sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["a"]


def test_a_finished_run_resumed_with_a_new_setting_is_refused_before_anything_is_built_or_compiled(cli, tmp_path):
    (tmp_path / "fac.py").write_text(FACTORY, encoding="utf-8")
    code, _, err = cli("train", *RUN, "--set", "log.name=r")
    assert code == 0, err
    assert _built(tmp_path) == 1
    line = ("train --resume: the run has trained all its steps (2 of steps=2): optimizer.lr, compile would apply to "
            "no step; raise steps to train on under the new settings, or leave them out to rewrite the run card")
    torch._dynamo.utils.counters.clear()
    code, out, err = cli("train", "--resume", "runs/r", "--set", "compile=true", "--set", "optimizer.lr=0.5")
    assert (code, out, err) == (2, "", f"ampguard: error: {line}\n")
    # the trainer, called as a library, refuses it before it builds the task (and compiles its model)
    resume = find_resume("runs/r")
    config = validate({**resume.run_config(), "compile": True, "optimizer": {"lr": 0.5}})
    try:
        train(config, resume)
    except InputError as err:
        assert str(err) == line
    else:
        raise AssertionError("not refused")
    assert _built(tmp_path) == 1 and not torch._dynamo.utils.counters["frames"]
