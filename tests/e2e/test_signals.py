"""Stop signals: SIGTERM (what SLURM and Kubernetes send) is handled as Ctrl-C is, and signals that
arrive while a run writes its last checkpoint and run card wait for them."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import warm

from helpers import ag, card_table, end_all, ok, read_rows, selected, snapshot_of

HERE = Path(__file__).resolve().parent
# (log.plot false: a plot costs each run a second of matplotlib; the one test about the closing draws it)
LINEAR = ["--set", "task.name=linear", "--set", "precision=fp32", "--set", "eval.enabled=false", "--set", "log.plot=false"]


def _spawn(cwd: Path, *argv: str, fresh: bool = False, buffered: bool = False) -> subprocess.Popen | warm.Popen:
    """``python ARGV`` in ``cwd``, its output piped: forked warm (tests/warm.py), or a fresh interpreter
    (``fresh``: a signal during its start-up's import of torch). Unbuffered, unless ``buffered``: Python's
    streams as a shell, ``nohup`` or CI gives them, stdout into a pipe block-buffered (review 56b: the
    tests' ``PYTHONUNBUFFERED=1`` hid that ``train | true`` trained on until 8 KiB of lines were due)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"} if buffered else \
        {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = subprocess.Popen if fresh else warm.Popen
    return start([sys.executable, *argv], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _rows(path: Path) -> list[dict[str, str]]:
    return read_rows(path) if path.exists() else []


def _wait_for(predicate, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the run ended (exit {proc.returncode}) before the test could signal it:\n{out}\n{err}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("timed out waiting for the run")
        time.sleep(0.02)


def _card(run: Path) -> dict[str, str]:
    return card_table((run / "RUN.md").read_text(encoding="utf-8"))


def test_sigterm_stops_at_a_step_boundary_with_checkpoint_card_and_exit_143(tmp_path):
    run = tmp_path / "runs" / "t"
    proc = _spawn(tmp_path, "-m", "ampguard", "train", *LINEAR, "--set", "steps=100000", "--set", "log.name=t",
                  "--set", "checkpoint.every=0")
    _wait_for(lambda: len(_rows(run / "steps.csv")) >= 3, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 143, out + err
    _stopped_whole_and_resumed(run, err, "SIGTERM")


def _stopped_whole_and_resumed(run: Path, err: str, why: str) -> None:
    """A run stopped at a step boundary (``why`` in the card): no traceback, the card, the
    checkpoint of its last step, the closing line; then ``--resume`` appends two more steps."""
    assert "Traceback" not in err
    n = len(_rows(run / "steps.csv"))
    assert n >= 1 and _card(run)["ended"] == f"interrupted ({why}) after step {n}"
    assert (run / "checkpoints" / f"step-{n:08d}.pt").is_file()
    assert f"interrupted after step {n}" in err

    ok(ag("train", "--resume", run, "--set", f"steps={n + 2}"))  # (in this process: no torch import to wait for)
    assert [int(r["step"]) for r in _rows(run / "steps.csv")] == list(range(1, n + 3))


CARD_SIGNALS = {"int": [signal.SIGINT], "int-int": [signal.SIGINT, signal.SIGINT],
                "term-int": [signal.SIGTERM, signal.SIGINT]}
PAUSE_IN_STARTUP = HERE / "pause_in_startup.py"
PHASES = ["torch_import", "building", "run_folder", "before_step_1"]
TERM_PHASES = ["loading_resume", "building", "run_folder", "run_folder_in_c"]


class _StartedWhenAsked(dict):
    """{case: what its start made}, each case started when a test first asks for it (``starts``:
    {case: a function that starts it})."""

    def __init__(self, starts: dict) -> None:
        super().__init__()
        self.starts = starts

    def __missing__(self, case: str):
        self[case] = started = self.starts[case]()
        return started


@pytest.fixture(scope="module")
def paused(tmp_path_factory):
    """{case: (process, its folder, its marker)}: the runs that hold themselves at a point for a
    test to signal them there; each test drives its own. Each is started when its test asks for it:
    forked warm, a run reaches its point in a fraction of a second (the fresh ``torch_import`` one
    before its import of torch, which comes after the test's go); started all at once with the
    module, the ones held for the later tests polled for their go meanwhile (pause_in_*.py: 100
    times a second, ~0.02 CPU-s a second each, about a CPU-second of this module's)."""

    def card(case: str):
        cwd = tmp_path_factory.mktemp(f"card-{case}")
        return (_spawn(cwd, str(HERE / "pause_in_report.py"), str(cwd / "closing"), "train", *LINEAR,
                       "--set", "steps=5", "--set", "log.name=c", "--set", "log.plot=true"), cwd, cwd / "closing")

    def startup(phase: str):
        cwd = tmp_path_factory.mktemp(f"startup-{phase}")
        return (_spawn(cwd, str(PAUSE_IN_STARTUP), str(cwd / "paused"), phase, "train", *LINEAR,
                       "--set", "steps=100000", "--set", "log.name=s", fresh=phase == "torch_import"),
                cwd, cwd / "paused")

    def term(phase: str):
        cwd = tmp_path_factory.mktemp(f"startup-term-{phase}")
        if phase == "loading_resume":  # (a finished run of 2 steps, resumed for more)
            ok(ag("train", *LINEAR, "--set", "steps=2", "--set", f"log.dir={cwd / 'runs'}", "--set", "log.name=s"))
            argv = ["train", "--resume", "runs/s", "--set", "steps=100000"]
        else:
            argv = ["train", *LINEAR, "--set", "steps=100000", "--set", "log.name=s"]
        return _spawn(cwd, str(PAUSE_IN_STARTUP), str(cwd / "paused"), phase, *argv), cwd, cwd / "paused"

    def factory():  # (held in its factory's sleep, its marker the file "building")
        cwd = tmp_path_factory.mktemp("factory")
        (cwd / "factory.py").write_text(SWALLOWING_FACTORY, encoding="utf-8")
        return (_spawn(cwd, "-m", "ampguard", "train", *LINEAR[2:], "--set", "task.factory=factory.py:build",
                       "--set", "steps=3", "--set", "log.name=f"), cwd, cwd / "building")

    started = _StartedWhenAsked({
        **{case: functools.partial(card, case) for case in CARD_SIGNALS},
        **{phase: functools.partial(startup, phase) for phase in PHASES},
        **{f"SIGTERM-{phase}": functools.partial(term, phase) for phase in TERM_PHASES},
        "factory": factory,
    })
    try:
        yield started
    finally:
        end_all(proc for proc, _, _ in started.values())


SIGNAL_AT_LAST_STEP = '''
import os
import signal

import torch
from torch import nn

calls = [0]


def loss_fn(output, target):  # the last step's loss (after the first batch's check at start-up)
    calls[0] += 1
    if calls[0] == {steps} + 1:
        os.kill(os.getpid(), signal.{name})
    return nn.functional.mse_loss(output, target)


def build(config):
    torch.manual_seed(0)
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(20)]
    return {{"model": nn.Linear(3, 1), "data": data, "loss_fn": loss_fn}}
'''


READER_LEAVES = "test_a_reader_that_leaves_stops_the_run_as_sigterm_does_with_exit_141"


@pytest.fixture(scope="module")
def fired(request, tmp_path_factory):
    """{case: (process, its folder)}: the runs a test only waits on and checks, started at once (they run
    side by side, none of them held waiting for its test): a reader gone before the first line, a verb
    whose reader left, a stop signal during the last step (sent by the run's own loss). With them,
    when its test is to run, the run whose reader that test makes leave (the first test here to
    ask for this fixture: it drives its run as soon as it is started, as it would its own)."""
    started = {}
    try:
        if selected(request, READER_LEAVES):
            cwd = tmp_path_factory.mktemp("reader-leaves")
            started["reader-leaves"] = (_spawn(cwd, "-m", "ampguard", "train", *LINEAR, "--set", "steps=100000",
                                               "--set", "log.name=t", "--set", "log.every=1",
                                               "--set", "checkpoint.every=0", buffered=True), cwd)
        cwd = tmp_path_factory.mktemp("reader-gone")
        proc = _spawn(cwd, "-m", "ampguard", "train", *LINEAR, "--set", "steps=100000", "--set", "log.name=t",
                      "--set", "checkpoint.every=0", buffered=True)
        proc.stdout.close()
        started["reader-gone"] = (proc, cwd)
        cwd = tmp_path_factory.mktemp("verb-reader-left")
        proc = _spawn(cwd, "-m", "ampguard", "locate", "--set", "task.name=linear", "--inject", "nan_input@1")
        proc.stdout.close()  # gone before the first line
        started["verb-reader-left"] = (proc, cwd)
        for name in ("SIGTERM", "SIGINT"):
            cwd = tmp_path_factory.mktemp(f"last-{name}")
            factory = cwd / "last.py"
            factory.write_text(SIGNAL_AT_LAST_STEP.format(steps=6, name=name), encoding="utf-8")
            started[f"last-{name}"] = (_spawn(cwd, "-m", "ampguard", "train", *LINEAR[2:], "--set",
                                              f"task.factory={factory}:build", "--set", "steps=6", "--set",
                                              "log.name=t", "--set", "log.dir=runs"), cwd)
        if Path("/dev/full").exists():  # a console that cannot encode the run's name, and one with no room
            cwd = tmp_path_factory.mktemp("console")
            run = [sys.executable, "-m", "ampguard", "train", *LINEAR, "--set", "steps=2"]
            started["console-ascii"] = (warm.Popen(
                [*run, "--set", "log.name=ünï"], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                env={**os.environ, "PYTHONIOENCODING": "ascii"}), cwd)
            with open("/dev/full", "w") as full:
                started["console-full"] = (warm.Popen([*run, "--set", "log.name=full"], cwd=cwd, stdout=full,
                                                      stderr=subprocess.PIPE, text=True), cwd)
        yield started
    finally:
        end_all(proc for proc, _ in started.values())


@pytest.mark.parametrize("case", CARD_SIGNALS)
def test_signals_while_the_run_card_is_written_wait_for_it(paused, case):
    proc, cwd, marker = paused[case]
    run = cwd / "runs" / "c"
    _wait_for(marker.exists, proc)
    for sig in CARD_SIGNALS[case]:
        proc.send_signal(sig)
        time.sleep(0.05)
    marker.with_name("closing.go").write_text("go", encoding="utf-8")
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, out + err  # the run had finished: a signal while closing changes nothing
    assert "Traceback" not in err
    assert _card(run)["ended"] == "finished: 5 steps"
    assert (run / "report.png").is_file()


@pytest.mark.parametrize("phase", PHASES)
def test_ctrl_c_during_start_up_exits_130_without_a_traceback(paused, phase):
    # each Ctrl-C lands in its phase every time: pause_in_startup.py holds the run there until the
    # test has sent it (see its docstring for where each phase is)
    proc, cwd, marker = paused[phase]
    runs = cwd / "runs"
    _wait_for(marker.exists, proc)
    assert marker.read_text(encoding="utf-8") == f"{phase} {proc.pid}"
    proc.send_signal(signal.SIGINT)
    marker.with_name("paused.go").write_text("go", encoding="utf-8")
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 130, out + err
    assert "Traceback" not in err
    if phase in ("torch_import", "building"):  # held through the import, or before the run folder: nothing written
        assert err == "ampguard: interrupted\n" and out == ""
        assert not runs.exists()
    elif phase == "run_folder":  # before the run's own handlers: it stops at once, no step, no logs
        assert err == "ampguard: interrupted\n"
        # the new folder held the config alone, nothing of a run: it is taken back (it was left behind,
        # and a rerun with the same log.name was refused as "already exists")
        assert out.splitlines()[-1] == "run folder: runs/s removed (nothing was run)", out
        assert not runs.exists()
    else:  # before_step_1: the run's handler holds it to the end of step 1, then closes it as a stop does
        run = runs / "s"
        assert err.splitlines()[-1] == ("ampguard: interrupted after step 1; 1 complete row in runs/s/steps.csv; "
                                        "--resume goes on from checkpoints/step-00000001.pt"), err
        assert [r["step"] for r in _rows(run / "steps.csv")] == ["1"]
        assert _card(run)["ended"] == "interrupted (Ctrl-C) after step 1"
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000001.pt"]


@pytest.mark.parametrize("phase", TERM_PHASES)
def test_sigterm_during_start_up_exits_143_and_takes_the_new_run_folder_back(paused, phase):
    # review_session25: SIGTERM's default ended a start-up at once (-15, no line) and left the new run
    # folder holding config.yaml and run-id, which no resume could use and no rerun could take the name
    # of; now it unwinds as Ctrl-C does, and a start-up waiting in C (a collective whose peer died) is
    # ended by its watcher after the grace (1 s here), the folder taken back too
    proc, cwd, marker = paused[f"SIGTERM-{phase}"]
    _wait_for(marker.exists, proc)
    before = snapshot_of(cwd / "runs") if phase == "loading_resume" else None
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    if phase != "run_folder_in_c":  # (that one is never let go)
        marker.with_name("paused.go").write_text("go", encoding="utf-8")
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 143, out + err
    assert err == "ampguard: interrupted\n", err
    if phase == "loading_resume":  # review_27b #2: before any run handler, SIGTERM's default: -15, no line
        assert out == "" and snapshot_of(cwd / "runs") == before
        return
    if phase == "building":
        assert out == ""
    else:
        assert out.splitlines()[-1] == "run folder: runs/s removed (nothing was run)", out
        if phase == "run_folder_in_c":
            assert 1.0 <= time.monotonic() - sent < 60
    assert not (cwd / "runs").exists()


SWALLOWING_FACTORY = '''
import pathlib
import time

import torch
from torch import nn


def build(config):
    pathlib.Path("building").write_text("x")
    try:  # (a factory's fallback: "if the download fails, use the cached copy"; long: it waits
        time.sleep(600)  # here for its test's SIGTERM, which comes long before)
    except Exception:
        pass
    return nn.Linear(3, 1), [(torch.randn(4, 3), torch.randn(4, 1))] * 4, nn.functional.mse_loss
'''


def test_a_sigterm_in_the_users_factory_is_neither_bad_input_nor_swallowed(paused):
    # review_session26: the start-up's SIGTERM was an Exception: the factory's wrapper called it bad input
    # (exit 2, "task.factory ... raised Interrupted"), and a factory's `except Exception` swallowed it and
    # the run trained to its end (exit 0). (The run is one of :func:`paused`'s.)
    proc, tmp_path, building = paused["factory"]
    _wait_for(building.exists, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=180)
    assert (proc.returncode, err, out) == (143, "ampguard: interrupted\n", ""), (out, err)
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------------- the console itself failing


def test_a_reader_that_leaves_stops_the_run_as_sigterm_does_with_exit_141(fired):
    """`ampguard train | head -2`: stdout's reader leaves. To a Unix tool that is SIGPIPE; the run
    ended with exit 0 and a half-written folder (no run card, no checkpoint: --resume found
    nothing). Now it is a stop signal: the step boundary, the checkpoint, the card, exit 141.
    (Its run is started with :func:`fired`'s, their runs overlapping; its stdout
    block-buffered, as a shell's pipe is: the first line is read as it is printed.)"""
    proc, cwd = fired["reader-leaves"]
    run = cwd / "runs" / "t"
    assert proc.stdout.readline().startswith("run folder: ")
    proc.stdout.close()  # the reader leaves: the next console line is a broken pipe
    err = proc.stderr.read()
    assert proc.wait(timeout=180) == 141, err
    _stopped_whole_and_resumed(run, err, "stdout's reader left")


def test_a_reader_gone_before_the_run_began_stops_it_at_its_first_step(fired):
    """`ampguard train | true`: the reader is gone before the run's first line (its folder), so
    before the loop armed its stop flag: the run trained to its end and exited 0. It stops
    after its first step, whole, with exit 141. Its stdout is block-buffered, as a shell's pipe
    is (review 56b: with no ``PYTHONUNBUFFERED`` the first line waited in the buffer, and the run
    trained on until 8 KiB of lines were due: it is line-buffered while a verb runs)."""
    proc, cwd = fired["reader-gone"]
    run = cwd / "runs" / "t"
    err = proc.stderr.read()
    assert proc.wait(timeout=180) == 141, err
    assert _card(run)["ended"] == "interrupted (stdout's reader left) after step 1"
    assert (run / "checkpoints" / "step-00000001.pt").is_file()


def test_a_verb_whose_reader_left_keeps_its_own_exit_code(fired):
    """`ampguard locate ... | head -1` (or `validate`): the reader leaving mapped every verb to
    exit 0, so a CI step piped into head passed a NaN found (or a model rejected). The verb
    finishes, its output dropped, with its own code: 1 here, a non-finite value found."""
    proc, _ = fired["verb-reader-left"]
    err = proc.stderr.read()
    assert proc.wait(timeout=180) == 1, err
    assert "Traceback" not in err and "BrokenPipe" not in err


def test_a_console_that_cannot_take_the_lines_leaves_the_run_whole(fired):
    """stdout that cannot encode the run's name (an ASCII terminal) or has no room (/dev/full)
    ended the run with a traceback after its folder was made: a folder holding config.yaml alone
    (a rerun refused as existing), and a false "disk full while writing the run folder". The
    name is printed escaped; a full console is said once on stderr and the run goes on."""
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    # the two runs side by side, started with :func:`fired`'s
    (ascii_run, tmp_path), (full_run, _) = fired["console-ascii"], fired["console-full"]
    (out, ascii_err), (_, err) = ascii_run.communicate(timeout=120), full_run.communicate(timeout=120)
    assert ascii_run.returncode == 0, ascii_err
    assert b"run folder: runs/\\xfcn\\xef (RUN.md" in out
    assert (tmp_path / "runs" / "ünï" / "RUN.md").is_file()
    assert full_run.returncode == 0, err
    assert err.splitlines() == [
        "ampguard: warning: stdout: No space left on device; its lines are dropped, the run goes on"]
    card = _card(tmp_path / "runs" / "full")
    assert card["ended"] == "finished: 2 steps"




@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_a_stop_signal_during_the_last_step_leaves_a_finished_run(fired, name):
    # review_walk14 B3: honoured at the boundary after the last step, it made a run that had trained
    # every step "interrupted" (exit 143/130/141), and skipped the end-of-run judgement
    proc, cwd = fired[f"last-{name}"]
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, out + err
    assert _card(cwd / "runs" / "t")["ended"] == "finished: 6 steps"
