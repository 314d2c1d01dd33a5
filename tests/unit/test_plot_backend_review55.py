"""Review 55r F1: a run, ``report`` or ``compare`` called in a notebook's process (``cli.main``,
``train.train``) drew its PNG through pyplot after ``matplotlib.use("Agg")``: the kernel's backend
was Agg from then on, and inline plots and ``plt.show()`` showed nothing. The plots are drawn on a
``Figure`` of their own now; the caller's backend and pyplot's figures stay as they were. Run in a
process of its own (forked warm), which picks another backend first: the suite's stays Agg."""

from __future__ import annotations

import json
import sys

import warm

CHILD = r'''
import json, sys
from pathlib import Path

import matplotlib

matplotlib.use("svg")  # (a backend of the user's, not Agg)
import matplotlib.pyplot as plt

import torch

from ampguard import cli, train
from ampguard.config import validate

torch.set_num_threads(1)
runs, seen = Path(sys.argv[1]), []
plt.figure()  # the user's own figure, open


def look(what, code):
    seen.append([what, code, matplotlib.get_backend(), plt.get_fignums()])


base = ["--set", "task.name=linear", "--set", "steps=3", "--set", "precision=fp32", "--set", "device=cpu",
        "--set", f"log.dir={runs}"]
look("train (cli.main)", cli.main(["train", *base, "--set", "log.name=a"]))
config = validate({"task": {"name": "linear"}, "steps": 3, "precision": "fp32", "device": "cpu",
                   "log": {"dir": str(runs), "name": "b"}})
look("train.train", int(train.train(config)))
look("report", cli.main(["report", str(runs / "a")]))
look("compare", cli.main(["compare", str(runs / "a"), str(runs / "b"), "--out", str(runs / "both.png")]))
print(json.dumps(seen))
'''


def test_a_run_report_and_compare_leave_the_callers_backend_and_figures(tmp_path):
    done = warm.run([sys.executable, "-c", CHILD, str(tmp_path / "runs")], cwd=tmp_path, capture_output=True,
                    text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert [what for what, *_ in seen] == ["train (cli.main)", "train.train", "report", "compare"]
    for what, code, backend, figures in seen:
        assert (code, backend, figures) == (0, "svg", [1]), what
    for png in ("a/report.png", "b/report.png", "both.png"):  # (drawn all the same)
        assert (tmp_path / "runs" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
