"""Review 58f F3: a start-up or resume refused after some of its logs were open (a resume whose
``steps.jsonl`` is a link to nothing: ``steps.csv`` and ``events.jsonl`` opened first) left them
open: in-process (``ampguard.train``, a notebook, ``cli.main``) a descriptor held until the
collector ran, and a ``ResourceWarning`` then. The refusal closes every log it opened."""

from __future__ import annotations

import gc
import os
import sys
import warnings

import pytest

from ampguard.cli import main

SETS = ["task.name=linear", "precision=fp32", "device=cpu", "steps=3", "log.jsonl=true", "checkpoint.every=1",
        "log.name=r", "log.plot=false"]


def _open_under(folder):
    """The paths under ``folder`` this process holds a descriptor to."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(folder)):
            held.append(target)
    return held


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/fd")
def test_a_resume_refused_after_its_logs_opened_closes_them(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", *[a for s in SETS for a in ("--set", s)]]) == 0
    run = tmp_path / "runs" / "r"
    (run / "steps.jsonl").unlink()
    (run / "steps.jsonl").symlink_to(tmp_path / "nowhere.jsonl")
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        assert main(["train", "--resume", str(run), "--set", "steps=5"]) == 2
        assert "steps.jsonl is a symbolic link to nothing" in capsys.readouterr().err
        assert _open_under(run) == []  # (steps.csv and events.jsonl were)
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []
