"""Review 50j: the command line keeps its contracts at the edges. ``train --print-config`` printed,
exit 0, a config the same command line refuses, exit 2; a verb whose stdout is its result (report,
compare, locate, --print-config) exited 0 with that result lost to a full disk; ``locate --inject``
of a fault that does not fire at the replayed step came out clean, unsaid; a newline in a path the user
gave split the one error line; ``train --spike`` (DESIGN §4) was unknown; ``scripts/train.sh``
ran the job in the repository, so a relative config named another file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import warm

from helpers import ROOT, ag, ok, one_error_line, train

LINEAR = ["--set", "task.name=linear", "--set", "log.plot=false"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("cli50")
    ok(train(folder, "base", *LINEAR, "--set", "steps=4", "--set", "checkpoint.every=2"))
    return folder / "base"


@pytest.mark.parametrize("argv", [
    ["--resume", "{run}", "--set", "precision=fp16"],
    ["--resume", "{run}", "--set", "steps=2"],
    ["--resume", "{run}", "--set", "max_norm=2"],  # (the run trained all its steps: it applies to no step)
    ["--inject", "nan_loss@9", "--set", "steps=4", *LINEAR, "--set", "log.dir={dir}", "--set", "log.name=fresh"],
    [*LINEAR, "--set", "log.dir={dir}", "--set", "log.name=base"],  # (the folder exists)
], ids=["precision", "steps-below", "idle-setting", "idle-fault", "folder-exists"])
def test_print_config_refuses_what_train_refuses_with_the_same_line(finished_run, argv):
    argv = [a.format(run=finished_run, dir=finished_run.parent) for a in argv]
    refused = one_error_line(ag("train", *argv))
    assert one_error_line(ag("train", *argv, "--print-config")) == refused


def _to_full_disk(*argv: object) -> subprocess.CompletedProcess:
    """``python -m ampguard ARGV > /dev/full``, forked warm (tests/warm.py: its stdout made and
    flushed at the end as a fresh interpreter's, without the ~3 s of CPU of its imports)."""
    with open("/dev/full", "w") as full:
        return warm.run([sys.executable, "-m", "ampguard", *map(str, argv)], stdout=full, stderr=subprocess.PIPE,
                        text=True, cwd=ROOT, timeout=300)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_a_result_lost_to_a_full_disk_is_exit_74_in_one_line(finished_run):
    for argv, verb in (([*LINEAR, "--print-config"], "train"), ([finished_run, "--no-plot"], "report")):
        done = _to_full_disk(verb, *argv)
        assert done.returncode == 74, done.stderr
        assert done.stderr.splitlines() == [f"ampguard: error: {verb}: its output could not be written to stdout "
                                            "(No space left on device)"], done.stderr


def test_locate_names_an_injected_fault_that_does_not_fire_at_the_step_it_replays():
    code, out, _ = ag("locate", *LINEAR, "--inject", "nan_input@3")
    assert code == 0 and out.startswith("locate: step 1 of task linear (seed 0) (nan_input@3 not: it fires at other "
                                        "steps; --step N replays step N), "), out
    code, out, _ = ag("locate", *LINEAR, "--inject", "nan_input@3", "--step", "3")
    assert code == 1 and "with nan_input@3 injected" in out


def test_a_newline_in_a_path_the_user_gave_stays_inside_the_one_error_line(tmp_path):
    line = one_error_line(ag("train", tmp_path / "a\nb.yaml"))
    assert "a\\nb.yaml" in line
    line = one_error_line(ag("train", "x" * 100_000 + ".yaml"))
    assert len(line) < 2100


def test_train_spike_is_inject_spike_at_5():
    out = ok(ag("train", *LINEAR, "--spike", "--print-config"))
    assert "- spike@5" in out.split("inject:")[1].splitlines()[1]
    assert "--spike injects spike@5, --inject none nothing" in one_error_line(
        ag("train", *LINEAR, "--spike", "--inject", "none"))
    assert one_error_line(ag("train", *LINEAR, "--spike", "--set", "steps=3")) == (
        "ampguard: error: train: --spike is a loss spike at step 5, past the run's 3 steps: drop --spike, or raise "
        "steps to 5 or more")
    ok(ag("train", *LINEAR, "--spike", "--inject", "spike@5", "--print-config"))  # (the same fault, given twice)


def test_the_main_job_script_runs_in_the_folder_it_is_called_from(tmp_path):
    (tmp_path / "mine.yaml").write_text("steps: 7\nprecision: fp32\n", encoding="utf-8")
    done = subprocess.run(["bash", str(ROOT / "scripts" / "train.sh"), "mine.yaml", "--print-config"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "steps: 7" in done.stdout.splitlines()
