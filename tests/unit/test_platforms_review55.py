"""Review 55a: ampguard on Windows and macOS, simulated on Linux (tests/platform_sim.py: what the
platform lacks is taken away before ampguard is imported). Under the Windows simulation every CLI
verb crashed at import (``signal.SIGPIPE``), ``replace_atomically`` needed ``dir_fd``, folders
opened and ``os.geteuid`` (a run folder, a CSV resume), ``rename_onto_nothing`` let
``ctypes.CDLL(None)``'s ``TypeError`` out, and run folders went unlocked without a word. The
scenarios run in one simulated interpreter, after a ``train`` run in a process forked from it before
ampguard's import; these are simulations, not runs on a real Windows. That interpreter is forked
warm (tests/warm.py: torch, numpy, matplotlib and ``torch._dynamo`` imported already, as
platform_sim.py imports the third-party modules before it takes anything away; a fresh one spent
~7 CPU-s importing them): ampguard's modules, which the forkserver imported too, on Linux, are
taken out of ``sys.modules`` first, so each is imported afresh under the simulation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import warm

from ampguard import files, validate
from ampguard.errors import InputError
from ampguard.files import left_by_an_ended_process

SIM = Path(__file__).resolve().parents[1] / "platform_sim.py"

SCENARIOS = r'''
import contextlib, io, json, os, sys, traceback, warnings
from pathlib import Path

out, results = Path(sys.argv[1]), {}
d = out.parent

# Forked warm, this interpreter holds the ampguard modules its forkserver imported, on Linux: out,
# so that each is imported afresh under the simulation (in a fresh interpreter, none is imported yet;
# ampguard changes nothing outside its own modules as it is imported)
for name in [name for name in sys.modules if name == "ampguard" or name.startswith("ampguard.")]:
    del sys.modules[name]

# First `python -m ampguard ARGS` in a child forked before ampguard is imported here: the process
# `platform_sim.py win -m ampguard ARGS` would be (the simulation made, torch imported, ampguard
# not), its exit code in results["train"], its output in the folder sys.argv[2], its working folder.
# (torch._dynamo, which the first optimizer step imports, imported once for both processes; os.fork
# is one of the names the simulation took away: posix's is the same function.)
import posix
import torch._dynamo

sys.stdout.flush(), sys.stderr.flush()
pid = posix.fork()
if pid == 0:
    import runpy
    os.chdir(sys.argv[2])
    for fd, name in ((1, "stdout"), (2, "stderr")):
        os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.argv = ["ampguard", *sys.argv[3:]]
    runpy.run_module("ampguard", run_name="__main__", alter_sys=True)  # (as platform_sim's -m)
    sys.exit(0)  # (the interpreter's ending, as the fresh process', for whatever ended it: SystemExit, an error)
results["train"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def scenario(fn):
    try:
        fn()
        results[fn.__name__] = "OK"
    except BaseException as err:
        results[fn.__name__] = "".join(traceback.format_exception_only(err)).strip()
    return fn


def cli(*argv):
    from ampguard.cli import main
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        try:
            code = main(list(argv))
        except SystemExit as end:
            code = end.code
    assert code in (0, None), (code, said.getvalue())
    return said.getvalue()


@scenario
def version():
    assert cli("--version").startswith("ampguard ")


@scenario
def help():
    assert "validate" in cli("--help")


@scenario
def reader_left_stops():
    from ampguard.signals import reader_left, stop_on_signals
    with stop_on_signals() as stop:
        reader_left()  # (no SIGPIPE here: its number stands for it)
        assert stop.requested and int(stop.exit_code) == 141 and stop.name == "stdout's reader left", stop.name


@scenario
def csv_resume_cut():
    import torch
    from ampguard import CsvSink, Guard
    model = torch.nn.Linear(4, 1)
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp32", max_norm=1.0)
    path = d / "run" / "steps.csv"
    path.parent.mkdir()
    log = CsvSink(path)
    for _ in range(4):
        with guard.autocast():
            loss = model(torch.ones(2, 4)).pow(2).mean()
        guard.backward(loss)
        log.write(guard.step())
    log.close()
    CsvSink(path, append=True, keep_through=2).close()  # (a resume from step 2's checkpoint)
    rows = path.read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == ["1", "2"], rows
    assert sorted(p.name for p in path.parent.iterdir()) == ["steps.csv"]


@scenario
def replace_atomically():
    import errno
    from ampguard.files import replace_atomically
    card = d / "card.md"
    card.write_text("old\n")
    replace_atomically(card, "new\n")
    assert card.read_bytes() == b"new\n"
    (d / "folder").mkdir()
    try:
        replace_atomically(d / "folder", "x\n")
    except OSError as err:  # (as on Linux: "Is a directory", not Windows' "Permission denied" of a rename onto it)
        assert err.errno == errno.EISDIR, err
    else:
        raise AssertionError("a folder was replaced")
    assert sorted(p.name for p in d.iterdir() if p.name.startswith(".")) == []  # (no temporary file left)


@scenario
def rename_onto_nothing():
    from ampguard.files import rename_onto_nothing
    (d / "a").mkdir()
    (d / "taken").mkdir()
    rename_onto_nothing(d / "a", d / "b")
    assert (d / "b").is_dir() and not (d / "a").exists()
    try:
        rename_onto_nothing(d / "b", d / "taken")
    except FileExistsError:
        pass
    else:
        raise AssertionError("an existing folder was replaced")


@scenario
def unlocked_said_once():
    from ampguard.errors import AmpguardWarning
    from ampguard.run_folder import RunPaths
    (d / "locked").mkdir()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        first, second = RunPaths.existing(d / "locked"), RunPaths.existing(d / "locked")
        first.lock()
        second.lock()  # (nothing refuses it here: the warning said so)
    lines = [str(w.message) for w in said if issubclass(w.category, AmpguardWarning)]
    assert len(lines) == 1 and "not locked on this platform" in lines[0] and "\n" not in lines[0], lines


@scenario
def new_folder_judged():
    # review 55o F2: os.pathconf (Unix only) judged each name to be made: a new out_dir (the HF callback's,
    # the Lightning csv='s parent, a tracker's dir) was an AttributeError traceback
    from ampguard.errors import folder_problem, unwritable
    assert folder_problem(d / "brand_new" / "guard") is None and unwritable(d / "brand_new" / "guard") is None
    assert not (d / "brand_new").exists()
    why = folder_problem(d / "brand_new" / ("x" * 256))
    assert why is not None and "File name too long" in why, why
    assert folder_problem(d / "brand_new" / ("é" * 255)) is None  # (255 UTF-16 units: NTFS takes it)


@scenario
def linux_lock_file_read():
    # review 55o F2: os.pread (Unix only) read a lock file's holder, one a Linux run left in the folder
    from ampguard import run_folder
    (d / "linux_run").mkdir()
    lock = d / "linux_run" / run_folder.LOCK_FILE
    lock.write_text("4242 gpu-node-7\nkernel 0f-boot\n")
    assert run_folder._holder_of(d / "linux_run") == ("4242", "gpu-node-7", "0f-boot")
    fd = os.open(lock, os.O_RDWR)
    try:
        os.lseek(fd, 7, os.SEEK_SET)
        assert run_folder._holder_in(fd) == ("4242", "gpu-node-7", "0f-boot")
        assert os.lseek(fd, 0, os.SEEK_CUR) == 7  # (its offset left where it was, as pread leaves it)
    finally:
        os.close(fd)


out.write_text(json.dumps(results))
'''


def _env() -> dict[str, str]:
    # (one intra-op thread: platform_sim.py sets torch's; the forkserver's OMP_NUM_THREADS is the suite's)
    src = Path(__file__).resolve().parents[2] / "src"
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")]),
            "PYTHONDONTWRITEBYTECODE": "1"}


def simulated(modes: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python tests/platform_sim.py MODES ARGS``, forked warm (tests/warm.py; the module's docstring)."""
    return warm.run([sys.executable, str(SIM), modes, *args], cwd=cwd, env=_env(), capture_output=True, text=True,
                    timeout=300)


TRAIN = ["train", "--set", "task.name=linear", "--set", "steps=3", "--set", "precision=fp32", "--set", "device=cpu",
         "--set", "log.plot=false"]
"""``ampguard TRAIN`` (its run folder added) runs under the Windows simulation first (:func:`on_windows`)."""


@pytest.fixture(scope="module")
def on_windows(tmp_path_factory) -> dict:
    """Each scenario's outcome under the Windows simulation: "OK", or the error it ended with; and
    "train": the exit code of ``ampguard train`` (TRAIN) run under it first, in a process of its own
    (forked, in the one simulated interpreter, before ampguard's import), its stderr in
    "train_stderr", and its folder (its working folder, its run's log.dir) in "train_dir"."""
    folder = tmp_path_factory.mktemp("win")
    train = folder / "train"
    train.mkdir()
    done = simulated("win", "-c", SCENARIOS, str(folder / "results.json"), str(train),
                     *TRAIN, "--set", f"log.dir={train}", "--set", "log.name=r", cwd=folder)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((folder / "results.json").read_text())
    return {**results, "train_dir": train, "train_stderr": (train / "stderr").read_text()}


@pytest.mark.parametrize("scenario", ["version", "help", "reader_left_stops", "csv_resume_cut", "replace_atomically",
                                      "rename_onto_nothing", "unlocked_said_once", "new_folder_judged",
                                      "linux_lock_file_read"])
def test_under_the_windows_simulation(on_windows, scenario):
    # SIGPIPE read at import (version, help); the descriptor walk (the CSV cut, a card written);
    # ctypes.CDLL(None)'s TypeError (rename_onto_nothing); no fcntl, and no word of it
    assert on_windows[scenario] == "OK"


def test_train_under_the_windows_simulation_writes_its_run_folder(on_windows):
    stderr = on_windows["train_stderr"]
    assert on_windows["train"] == 0, stderr[-3000:]
    assert "Traceback" not in stderr
    run = on_windows["train_dir"] / "r"
    rows = (run / "steps.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == ["1", "2", "3"]
    assert "finished" in (run / "RUN.md").read_text()
    assert (run / "config.yaml").is_file()
    unlocked = [line for line in stderr.splitlines() if "not locked on this platform" in line]
    assert len(unlocked) == 1 and unlocked[0].startswith("ampguard: warning: "), stderr


def test_where_processes_cannot_be_asked_after_none_is_signalled(tmp_path, monkeypatch):
    # review 55a F5: on Windows os.kill(pid, 0) sends CTRL_C_EVENT to the group pid (another number
    # ends the process outright): never called there; cannot be told is taken as running
    signalled = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: signalled.append((pid, sig)))
    monkeypatch.setattr(files, "CAN_PROBE_PROCESSES", False)
    monkeypatch.setattr(validate, "CAN_PROBE_PROCESSES", False)
    dead = 2**22 + 17  # (above Linux's pid_max default: no such process; it is not asked)
    assert left_by_an_ended_process(f".steps.csv.tmp-{dead}-00ff") is False  # (kept)
    assert files._running(str(dead)) is True
    assert validate._alive(dead) is True
    (tmp_path / validate.RESERVED).write_text(f"{dead}\n")  # (a validate killed, or one that runs: cannot be told)
    with pytest.raises(InputError, match="is being written by another ampguard validate") as refused:
        validate._take_over(tmp_path, f"--out {tmp_path}")
    assert str(tmp_path) in str(refused.value) and (tmp_path / validate.RESERVED).exists()
    assert signalled == []
