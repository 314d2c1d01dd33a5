"""Helpers shared by several test files (imported as ``helpers``: pytest puts tests/ on the path)."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import gc
import importlib.util
import io
import json
import os
import re
import resource
import signal
import struct
import sys
import textwrap
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from torch.overrides import TorchFunctionMode

from ampguard.checkpoint import REQUIRED
from ampguard.cli import main
from ampguard.sinks import BackgroundSink, CsvSink

ROOT = Path(__file__).resolve().parents[1]
"""The repository."""


class GatedCsv(CsvSink):
    """A CSV whose writes wait for ``gate`` (a hung disk until it is set: rows stay queued in a
    :class:`~ampguard.sinks.BackgroundSink` in front of it)."""

    def __init__(self, path: Path, gate: threading.Event) -> None:
        super().__init__(path)
        self.gate = gate

    def write(self, record: Any, extra: Any = None) -> None:
        assert self.gate.wait(timeout=60)
        super().write(record, extra)


def dropped_unclosed(inner: Any, steps: Iterable[int]) -> threading.Thread:
    """A :class:`~ampguard.sinks.BackgroundSink` in front of ``inner``, handed :func:`step_log` of
    each of ``steps``, then dropped unclosed and collected (a notebook cell run again, a loop that
    crashed): its writer thread, which writes what was queued, closes ``inner`` and ends."""
    bg = BackgroundSink(inner)
    for step in steps:
        bg.write(step_log(step))
    thread = bg._thread
    del bg
    gc.collect()
    return thread


class HostReads(TorchFunctionMode):
    """Counts the Tensor methods that copy a value to the host."""

    READS = frozenset(
        {
            torch.Tensor.item,
            torch.Tensor.tolist,
            torch.Tensor.__bool__,
            torch.Tensor.__float__,
            torch.Tensor.__int__,
            torch.Tensor.__index__,
            torch.Tensor.cpu,
            torch.Tensor.numpy,
        }
    )

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            self.count += 1
            self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def reference_rates(skipped: list[bool], window: int) -> list[float]:
    """Rolling skip rate after each step, by brute force: skips among the steps the window holds
    (the last ``window`` steps, or every step so far while there are fewer)."""
    return [sum(held) / len(held) for held in (skipped[max(0, i + 1 - window): i + 1] for i in range(len(skipped)))]


def reference_episodes(
    rates: list[float], threshold: float, labels: tuple[str, str] = ("ALERT", "CLEAR"), min_steps: int = 0,
    clear: float | None = None,
) -> list[tuple[int, str]]:
    """(step, label) each time the rate rises above ``threshold`` (alerting) or, alerting, falls to
    ``clear`` (default 0.8 x ``threshold``) or below; an alert starts only from step ``min_steps`` on."""
    clear = 0.8 * threshold if clear is None else clear
    out, alerting = [], False
    for step, rate in enumerate(rates, start=1):
        if rate > threshold and not alerting and step >= min_steps:
            out.append((step, labels[0]))
            alerting = True
        elif rate <= clear and alerting:
            out.append((step, labels[1]))
            alerting = False
    return out


def reference_episodes_events(rates: list[float], threshold: float, min_steps: int = 0) -> list[tuple[int, str]]:
    """The same, labelled as the event log names them."""
    return reference_episodes(rates, threshold, ("skip_rate_alert", "skip_rate_clear"), min_steps)


def reference_fail_step(rates: list[float], fail_rate: float, fail_after: int, after: int = 0) -> int | None:
    """The first step past ``after`` ending ``fail_after`` consecutive rates above ``fail_rate``
    (the run counted from step 1)."""
    run = 0
    for step, rate in enumerate(rates, start=1):
        run = run + 1 if rate > fail_rate else 0
        if run >= fail_after and step > after:
            return step
    return None


def _no_plot(*args: object, **kwargs: object) -> None:
    return None


def ag(*argv: object) -> tuple[int, str, str]:
    """``ampguard ARGV`` in-process: (exit code, stdout, stderr); the plot is skipped."""
    out, err = io.StringIO(), io.StringIO()
    with mock.patch("ampguard.report.plot_run", _no_plot), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def train(log_dir: Path, name: str, *args: object) -> tuple[int, str, str]:
    """``ampguard train`` in-process (``ag``), its run folder ``log_dir/name``."""
    return ag("train", "--set", f"log.dir={log_dir}", "--set", f"log.name={name}", *args)


def ok(result: tuple[int, str, str]) -> str:
    """The stdout of a run that exited 0."""
    code, out, err = result
    assert code == 0, f"exit {code}\nstdout:\n{out}\nstderr:\n{err}"
    return out


def resumed_leaving_as_is(run: Path, log: str, *off: str) -> None:
    """``ampguard train --resume RUN`` from step 4 with ``off`` (``--set`` values turning a log
    off) goes on, and leaves the log file ``log`` byte for byte as it was, a warning naming it."""
    before = (run / log).read_bytes()
    code, out, err = ag("train", "--resume", run, *(a for value in off for a in ("--set", value)))
    assert code == 0 and "RESUME 4" in out, err
    assert f"ampguard: warning: {run / log} is left as it is (" in err, err
    assert "): any steps after 4 in it are the abandoned run's" in err, err
    assert (run / log).read_bytes() == before


# ---------------------------------------------------------------------------- refusals (one line on stderr)


def only_line(err: str) -> str:
    """The single line of ``err``, which holds no traceback."""
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def one_line_error(code: int, out: str, err: str) -> str:
    """The single error line of a refusal: exit 2, no traceback."""
    assert code == 2, (code, out, err)
    return only_line(err)


def one_error_line(result: tuple[int, str, str], code: int = 2) -> str:
    """The single ``ampguard: error: ...`` line of a ``(exit code, stdout, stderr)`` that exited ``code``."""
    got, out, err = result
    assert got == code, f"exit {got}\nstdout:\n{out}\nstderr:\n{err}"
    line = only_line(err)
    assert line.startswith("ampguard: error: "), line
    return line


class FullStdout:
    """A stdout on a full disk (``> out.json`` with no room left): every write raises ENOSPC."""

    encoding = "utf-8"

    def write(self, text: str) -> int:
        raise OSError(28, "No space left on device")

    def flush(self) -> None:
        pass


class Hang(Exception):
    pass


@contextlib.contextmanager
def deadline(seconds: float):
    """Raise :class:`Hang` in this (main) thread after ``seconds``: a block that never ends fails
    the test instead of hanging the suite."""

    def alarm(signum, frame):
        raise Hang(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def selected(request: pytest.FixtureRequest, name: str) -> bool:
    """Whether the test ``name`` of the requesting module is to run this session: a module fixture
    that starts a test's slow launch early (its imports overlapping the tests before it) starts
    nothing for a test ``-k`` or a test id left out."""
    return any(item.name == name and getattr(item, "module", None) is request.module for item in request.session.items)


def snapshot_of(folder: Path) -> dict[str, object]:
    """``{relative path: bytes or '<dir>'}`` of everything under ``folder``."""
    folder = Path(folder)
    return {str(p.relative_to(folder)): ("<dir>" if p.is_dir() else p.read_bytes()) for p in sorted(folder.rglob("*"))}


# ---------------------------------------------------------------------------- what a run writes


def png_size(path: str | Path) -> tuple[int, int]:
    """A PNG's width and height, read from its header (signature and IHDR checked first)."""
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR", f"{path}: no IHDR chunk first"
    return struct.unpack(">II", data[16:24])


def card_table(card: str) -> dict[str, str]:
    """The ``| key | value |`` rows of a run card (RUN.md's text) as a mapping."""
    rows = {}
    for line in card.splitlines():
        m = re.fullmatch(r"\| (.+?) \| (.*) \|", line)
        if m and m.group(1) not in ("", "---|---"):
            rows[m.group(1)] = m.group(2)
    return rows

def read_rows(path: Path) -> list[dict[str, str]]:
    """The rows of a CSV file (steps.csv) as dicts."""
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def strict_json(line: str) -> dict:
    def refuse(token: str):
        raise AssertionError(f"non-strict JSON constant {token} in {line!r}")

    return json.loads(line, parse_constant=refuse)


def read_events(path: Path, *, strict: bool = True) -> list[dict]:
    """One dict per line of a JSON-lines file (events.jsonl); ``strict``: NaN and Infinity refused."""
    parse = strict_json if strict else json.loads
    return [parse(line) for line in Path(path).read_text(encoding="utf-8").splitlines()]


def run_events(run: Path) -> list[dict]:
    """The events of the run folder ``run`` (its events.jsonl, read as plain JSON)."""
    return read_events(run / "events.jsonl", strict=False)


# ---------------------------------------------------------------------------- child processes


def file_size_limit(limit: int):
    """A ``preexec_fn`` that sets ``ulimit -f`` to ``limit`` bytes in the child (inherited by its
    children): a write past it fails with EFBIG instead of a SIGXFSZ that would kill the process."""

    def set_up() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return set_up


def in_fork(fn: Any, *, preexec: Any = None) -> tuple[int, str]:
    """``fn()`` in a forked child of this process, after ``preexec()`` (a :func:`file_size_limit`,
    giving up root): (the child's exit code, ``str(fn())`` or the traceback it raised). The child
    has this process's imports already (no interpreter or torch to start: a subprocess costs ~2 s
    of torch import); keep ``fn`` to host work, files and the command line's refusals (torch's
    thread pool is not meant to be used across a fork)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code, said = 1, ""
        try:
            os.close(read)
            if preexec is not None:
                preexec()
            said, code = str(fn()), 0
        except BaseException:  # noqa: BLE001 - the parent shows it
            import traceback

            said = traceback.format_exc()
        finally:
            with contextlib.suppress(OSError), os.fdopen(write, "wb") as out:
                out.write(said.encode(errors="replace"))
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        said = f.read().decode()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), said


WARM_TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
"""torchrun of two local workers, forked warm itself (``python -m torch.distributed.run``, its
script's main: its own ``torchrun`` command is a fresh interpreter importing torch first); its
workers :func:`warm_workers`' stand-ins, their options after these."""


def torchrun() -> list[str]:
    """The command that starts torchrun from this virtualenv."""
    exe = Path(sys.executable).with_name("torchrun")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]


def warm_workers(env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """(torchrun's options before the script, ``env`` with what they need) for workers forked warm:
    each worker's process is a stand-in (tests/warm_worker.py) for ``python -u SCRIPT ARGS`` forked
    from this process's forkserver (tests/warm.py), which imported torch once, where a fresh
    worker imports it again (~4.5 s of CPU each)."""
    import warm

    stand_in = Path(__file__).with_name("warm_worker.py")
    return ["--no-python", sys.executable, str(stand_in)], {**env, "AMPGUARD_WARM_SERVER": warm.server_handle()}


WARM_PYTHON = """#!/usr/bin/env bash
# gpu.sh's $PYTHON here: its commands that import torch (a script on stdin, -m ampguard) forked warm
# (tests/warm_worker.py's stand-in), not fresh interpreters importing torch first (~3 s of CPU each);
# a script on stdin, `python - ARGS`, as `-c SCRIPT ARGS`; its other commands as they are
case "$1 $2" in
    "- "*) shift; code=$(cat); exec {python} {stand_in} -c "$code" "$@" ;;
    "-m ampguard") exec {python} {stand_in} "$@" ;;
esac
exec {python} "$@"
"""


def gpu_sh_python(folder: Path) -> tuple[Path, dict[str, str]]:
    """(a ``PYTHON`` for benchmarks/gpu.sh, written in ``folder``: :data:`WARM_PYTHON`; the environment
    it needs): what the gpu.sh tests (test_bench_cli, test_gpu_sh_review54, test_bench_review26) run it with."""
    (_, python, stand_in), env = warm_workers({})
    path = folder / "warm-python"
    path.write_text(WARM_PYTHON.format(python=python, stand_in=stand_in))
    path.chmod(0o755)
    return path, env


GLOO = torch.distributed.is_available() and torch.distributed.is_gloo_available()
TORCHRUN = [pytest.mark.slow, pytest.mark.skipif(not GLOO, reason="torch.distributed with the gloo backend is not available")]
"""The marks of a module of torchrun launches (``pytestmark = TORCHRUN``): slow, and skipped without gloo."""


def end_all(procs: Any) -> None:
    """Kill whichever of the ``subprocess.Popen`` objects ``procs`` still runs, and reap them all
    (the teardown of a fixture that started them together)."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def own_process_group(preexec_fn: Any = None) -> dict[str, Any]:
    """``subprocess.Popen`` arguments that start the child in a process group of its own (which
    :func:`kill_tree` ends), after ``preexec_fn``. Not a session of its own: on Linux each session
    is a scheduler autogroup, which shares the cores with the others whatever its processes' nice,
    so an early job (conftest.py) at nice 19 would take a core from the tests in the foreground."""
    if sys.version_info >= (3, 11):
        return {"process_group": 0, "preexec_fn": preexec_fn}

    def set_up() -> None:  # pragma: no cover - Python 3.10
        os.setpgrp()
        if preexec_fn is not None:
            preexec_fn()

    return {"preexec_fn": set_up}


def dies_with_its_parent(sig: int = signal.SIGTERM, then: Any = None) -> Any:
    """A ``preexec_fn``: the child gets ``sig`` when the process that started it dies, however it
    dies (Linux's parent-death signal, kept across ``exec``; elsewhere nothing), then runs
    ``then``. A torchrun given SIGTERM passes it on to its workers, which sit in sessions of
    their own (early_runner.py gives those theirs)."""
    def set_up() -> None:
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
        if then is not None:
            then()

    return set_up


def kill_tree(pid: int) -> None:
    """SIGKILL the process ``pid`` (a torchrun started in :func:`own_process_group`), its process
    group and every descendant: torchrun's workers may sit in sessions of their own, out of
    reach of ``killpg``, and a worker hung in a collective would outlive the test holding its
    pipes open (psutil, where installed, finds them)."""
    try:
        import psutil

        children = psutil.Process(pid).children(recursive=True)
    except Exception:  # noqa: BLE001 - no psutil, or the process is gone: the group is what is left
        children = []
    for child in children:
        with contextlib.suppress(Exception):
            child.kill()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def warm_own_group(cmd: list[str], cwd: Path, env: dict[str, str] | None, **streams: Any):
    """``cmd`` (a Python command) forked warm (tests/warm.py) in ``cwd``, in a process group of its
    own that a SIGTERM reaches when the suite's forkserver dies, and that dies (SIGKILL) with this
    process however it dies (``warm.Popen``'s ``tied``; an early job's runner shares the suite's
    forkserver, which outlives it): how :class:`Launch` and :func:`run_to_end` start theirs."""
    import warm
    import weakref

    tie, held = os.pipe()  # (the writing end this process alone holds, as long as the object lives)
    try:
        proc = warm.Popen(cmd, cwd=cwd, env=env, process_group=0, death_signal=signal.SIGTERM, tied=tie, **streams)
    except BaseException:
        os.close(held)
        raise
    finally:
        os.close(tie)
    weakref.finalize(proc, os.close, held)
    return proc


class Launch:
    """One ``torchrun --standalone --nproc_per_node 2 ARGS`` in ``cwd`` (ARGS a Python script and its
    arguments), forked warm, its workers too (tests/warm.py, :func:`warm_workers`), in a process
    group of its own that dies with the suite (its forkserver's parent-death signal), its output in
    ``NAME.stdout`` / ``NAME.stderr`` beside ``cwd`` (files, not pipes: a hung worker cannot block
    the test on a pipe); killed with its workers (:func:`kill_tree`; a warm worker dies with its
    stand-in) when it runs past ``timeout_s`` (counted from its start) or at :meth:`close`."""

    def __init__(self, name: str, args: list[str], cwd: Path, *, timeout_s: float,
                 env: dict[str, str] | None = None) -> None:
        import subprocess
        import time

        self.name, self.cwd, self.timeout_s = name, cwd, timeout_s
        cwd.mkdir(parents=True, exist_ok=True)
        workers, env = warm_workers(env or torchrun_env())
        self.cmd = [*WARM_TORCHRUN, *workers, *args]
        self._out = (cwd.parent / f"{name}.stdout").open("w+")
        self._err = (cwd.parent / f"{name}.stderr").open("w+")
        self.started = time.monotonic()
        self.proc = warm_own_group(self.cmd, cwd, env, stdout=self._out, stderr=self._err, stdin=subprocess.DEVNULL)
        self.rc: int | None = None
        self.stdout = self.stderr = ""

    def kill(self) -> None:
        """End it, its workers too: a SIGTERM first, which torchrun passes on to each worker (in a
        session of its own, out of reach of the process group), then SIGKILL to what is left."""
        end_launches([self], close=False)

    def wait(self) -> Launch:
        """Its exit code and output, once it ended (a test failure if it ran past ``timeout_s``)."""
        import subprocess
        import time

        if self.rc is None:
            left = max(1.0, self.timeout_s - (time.monotonic() - self.started))
            try:
                self.rc = self.proc.wait(timeout=left)
            except subprocess.TimeoutExpired:
                self.kill()
                self.rc = -9
                self._read()
                pytest.fail(f"torchrun {self.name} did not finish within {self.timeout_s:g} s (a rank hangs?)\n"
                            f"stderr tail:\n{self.stderr[-3000:]}")
            self._read()
        return self

    def _read(self) -> None:
        for f in (self._out, self._err):
            f.flush()
            f.seek(0)
        self.stdout, self.stderr = self._out.read(), self._err.read()

    def ok(self) -> Launch:
        self.wait()
        _ended_ok(self)
        return self

    def ended(self) -> Ended:
        """What it left once it ended (:meth:`wait`), as a picklable :class:`Ended`."""
        self.wait()
        return Ended(self.name, self.rc, self.stdout, self.stderr, self.cwd)

    def close(self) -> None:
        end_launches([self])


BATCH_RANK = '''
"""One torchrun worker of a helpers.Batch: its runs, one after another (tests/helpers.py)."""
import json, os, resource, runpy, shutil, signal, sys, traceback
from pathlib import Path

from ampguard import distributed
from ampguard.cli import main

rank = os.environ["RANK"]
if len(sys.argv) > 2:  # the batch's prelude (patches each run's environment turns on)
    exec(compile(Path(sys.argv[2]).read_text(), sys.argv[2], "exec"), {"__name__": "prelude"})
shutdown, distributed.shutdown = distributed.shutdown, lambda: None  # one process group for every run


def script(path, args):
    """A script run as ``python PATH ARGS`` would: its code, 0 when it returns."""
    argv, sys.argv = sys.argv, [path, *args]
    try:
        runpy.run_path(path, run_name="__main__")
        return 0
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    finally:
        sys.argv = argv


console = os.dup(1), os.dup(2)
runs = json.loads(Path(sys.argv[1]).read_text())
for run in runs:
    if run is runs[-1]:  # the last ends as a launch of its own would: leaves the group, exits with its code
        distributed.shutdown = shutdown
    cwd = Path(run["cwd"])
    cwd.mkdir(parents=True, exist_ok=True)
    os.chdir(cwd)
    for module in list(sys.modules.values()):  # (a warning an earlier run showed is shown again)
        registry = getattr(module, "__warningregistry__", None)
        if isinstance(registry, dict):
            registry.clear()
    # a fresh process's handlers (a run that ended left SIGTERM ignored: distributed.ending)
    signal.signal(signal.SIGTERM, signal.SIG_DFL), signal.signal(signal.SIGINT, signal.default_int_handler)
    before = {name: os.environ.get(name) for name in run["env"]}
    os.environ.update(run["env"])
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if run["file_size"] is not None:  # (`ulimit -f` for this run: a write past it fails, EFBIG; main ignores SIGXFSZ)
        resource.setrlimit(resource.RLIMIT_FSIZE, (run["file_size"], hard))
    with open(cwd.parent / f"{run['name']}.rank{rank}.stdout", "w") as out, \\
            open(cwd.parent / f"{run['name']}.rank{rank}.stderr", "w") as err:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
        try:
            args, own = run["args"], run["rank1"] if rank == "1" else []
            if own[:1] and own[0] in args and own[0] not in ("--set", "--inject"):  # (--resume: the CLI takes it once)
                at = args.index(own[0])
                args, own = args[:at] + own[:2] + args[at + 2:], own[2:]
            if run["copy"]:  # (rank 0 copies; every rank reads the copy)
                if rank == "0":
                    source, target = run["copy"]
                    if source.endswith("/*"):  # (the one folder in it, its name chosen by a run before)
                        [source] = Path(source[:-2]).iterdir()
                    shutil.copytree(source, target)
                distributed.barrier()
            code = int(main(args + own)) if run["script"] is None else script(run["script"], args + own)
        except BaseException:  # a bug: the runs after it would wait in collectives this rank never joins
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        sys.stdout.flush(), sys.stderr.flush()
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    Path(run["rc"] + f".rank{rank}.rc").write_text(str(code))  # (beside its folder, which holds what the run wrote)
    for name, value in before.items():
        if value is None:
            del os.environ[name]
        else:
            os.environ[name] = value
os.dup2(console[0], 1), os.dup2(console[1], 2)
sys.exit(code)  # (torchrun's report names each rank's: none cut short by the SIGTERM after another's exit)
'''


@dataclass
class Run:
    """One run of a :class:`Batch`: ``ampguard ARGS`` (rank 1 adds ``rank1``: its own ``--set``; an
    option there that takes one value, ``--resume``, replaces the one in ARGS),
    with ``env`` set around it, under ``ulimit -f`` ``file_size`` bytes if given."""

    args: list[str]
    rank1: list[str] = dataclasses.field(default_factory=list)
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    file_size: int | None = None
    cwd: str | None = None
    """Its working folder's name in the batch's folder (the run's name if None)."""
    script: str | None = None
    """A Python file run as ``python SCRIPT ARGS`` in place of ``ampguard ARGS`` (it joins the
    process group only if no run before it did, and leaves it only if it joined it)."""
    copy: tuple[str, str] | None = None
    """``(source, target)``: a folder rank 0 copies before the run (``DIR/*``: the one folder in
    DIR), every rank waiting for it (a run before this one formed the process group)."""


class Batch:
    """Several ``ampguard`` runs, one after another, in one torchrun launch of 2 workers (a
    launch costs ~12 s of CPU, two thirds of it its three processes importing torch; a run in a
    batch, ~2 s): for runs whose every rank ends at the same point (a refusal, a guard's stop, a
    stop signal the ranks agree on, the end), so that the next run's collectives meet (a run whose
    ranks part would fail the runs after it, not itself). Not for a kill or a crash on one rank,
    but as the last run, which ends as a launch of its own: the process group left, each worker
    exiting with its code (torchrun's report, the launch's stderr, follows that run's). Each run
    begins with a fresh process's SIGTERM and SIGINT handlers. ``runs``: ``{name: Run}``; each
    runs in ``work/NAME``, with its ranks' output and the codes their ``main`` returned in files
    beside it (``NAME.rank<R>.rc``: :func:`rank_codes`; :meth:`results`). ``prelude``: Python
    source each worker runs once before the runs (patches that each run's ``env`` turns on)."""

    def __init__(self, name: str, runs: dict[str, Run], work: Path, *, timeout_s: float, env: dict[str, str],
                 prelude: str | None = None) -> None:
        self.names, self.work = list(runs), work
        self.folders = {n: work / (run.cwd or n) for n, run in runs.items()}
        spec = [{**dataclasses.asdict(run), "name": n, "cwd": str(self.folders[n]), "rc": str(work / n)}
                for n, run in runs.items()]
        (work / f"{name}.json").write_text(json.dumps(spec))
        (work / "batch_rank.py").write_text(BATCH_RANK)
        args = [str(work / "batch_rank.py"), str(work / f"{name}.json")]
        if prelude is not None:
            (work / f"{name}.prelude.py").write_text(prelude)
            args.append(str(work / f"{name}.prelude.py"))
        self.launch = Launch(name, args, work / name, timeout_s=timeout_s, env=env)

    def results(self) -> dict[str, Ended]:
        """Each run once the launch ended, as an :class:`Ended` whose ``rc`` is the highest code
        its ranks' ``main`` returned (-1 when a rank returned none; the launch's stderr then
        follows the run's, as it does the last run's)."""
        launch = self.launch.wait()

        def read(run: str, stream: str) -> str:
            files = (self.work / f"{run}.rank{r}.{stream}" for r in (0, 1))
            return "".join(f.read_text(encoding="utf-8", errors="replace") for f in files if f.exists())

        ended = {}
        for run in self.names:
            out, err = read(run, "stdout"), read(run, "stderr")
            codes = rank_codes(self.work / run)
            rc = max(codes.values()) if len(codes) == 2 else -1
            tail = launch.stderr if rc == -1 or run == self.names[-1] else ""
            ended[run] = Ended(run, rc, out, err + tail, self.folders[run])
        return ended


RANK_EXIT = '''
import os, sys
from pathlib import Path
from ampguard.cli import main

code = int(main(sys.argv[2:]))
Path(f"{sys.argv[1]}.rank{os.environ['RANK']}.rc").write_text(str(code))  # (helpers.rank_codes)
sys.exit(code)
'''
"""A torchrun worker script (``rank_exit.py RUN verb args...``): ``ampguard``'s ``main``, then the
code it returned written to ``RUN.rank<R>.rc`` (:func:`rank_codes`), which ``os._exit`` and a
torchrun summary would not tell."""


def rank_codes(run: Path) -> dict[int, int]:
    """``{rank: the code its main returned}`` of the ranks that wrote ``RUN.rank<R>.rc`` (a
    :class:`Batch` run, or a wrapper that does the same): a rank that died or raised wrote none."""
    return {r: int(f.read_text()) for r in (0, 1) if (f := run.parent / f"{run.name}.rank{r}.rc").exists()}


def end_launches(launches: Iterable[Launch], grace_s: float = 10.0, close: bool = True) -> None:
    """End every launch still running, its workers too, all at once: a SIGTERM to each (torchrun
    passes it on to its workers), one ``grace_s`` for them all, then SIGKILL to what is left
    (:func:`kill_tree`); with ``close``, their output files closed. (One at a time, 10 s each, a
    dozen launches at nice 19 kept a Ctrl-C'd suite silent for a minute.)"""
    launches = list(launches)
    end_processes([launch.proc for launch in launches], grace_s)
    for launch in launches if close else ():
        launch._out.close()
        launch._err.close()


def end_processes(procs: Iterable[Any], grace_s: float, *, group: bool = True) -> None:
    """End every process still running, all at once: SIGTERM to each one's process group (to the
    process alone with ``group=False``: an early job, which ends its launches itself), one
    ``grace_s`` for them all, then SIGKILL to each one's tree (:func:`kill_tree`) that is left."""
    import subprocess
    import time

    running = [proc for proc in procs if proc.poll() is None]
    for proc in running:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM) if group else proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in running:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            proc.wait()


EARLY_TIMEOUT_S = 900
"""The most a launch of an early job (conftest.py) may take, from its start: at nice 19 it waits for
the cores while the tests in the foreground run, so it is long; a rank hung in a collective still
ends the launch."""


@dataclass(frozen=True)
class Ended:
    """A :class:`Launch` that ended: its exit code and output, with the same ``wait`` and ``ok``
    (an early job, run in a process of its own, hands these back: see conftest.py)."""

    name: str
    rc: int
    stdout: str
    stderr: str
    cwd: Path

    def wait(self) -> Ended:
        return self

    def ok(self) -> Ended:
        _ended_ok(self)
        return self


def run_to_end(name: str, cmd: list[str], cwd: Path, *, timeout_s: float, env: dict[str, str] | None = None,
               ) -> Ended:
    """``cmd`` run in ``cwd`` (made if missing) to its end, its output captured: an :class:`Ended`.
    In a process group of its own that dies with this process (a SIGTERM that ends this process
    ends it; a Python command is forked warm, tests/warm.py, and also dies with the suite's
    forkserver); past ``timeout_s`` it is ended with everything it started (a torchrun's workers
    too: killing torchrun alone left them running) and the test fails with its output's tail."""
    import subprocess

    cwd.mkdir(parents=True, exist_ok=True)
    streams = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "stdin": subprocess.DEVNULL, "text": True}
    if cmd[0] == sys.executable:
        proc = warm_own_group(cmd, cwd, env, **streams)
    else:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, **streams, **own_process_group(dies_with_its_parent()))
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        end_processes([proc], 10.0)
        out, err = proc.communicate()
        pytest.fail(f"{name} did not finish within {timeout_s:g} s\nstderr tail:\n{err[-3000:]}")
    except BaseException:  # (this process ended by a SIGTERM: its command ends with it)
        end_processes([proc], 10.0)
        raise
    return Ended(name, proc.returncode, out, err, cwd)


def _ended_ok(launch: Launch | Ended) -> None:
    assert launch.rc == 0, (f"torchrun {launch.name} exited {launch.rc}\nstdout tail:\n{launch.stdout[-2000:]}\n"
                            f"stderr tail:\n{launch.stderr[-4000:]}")

def torchrun_env(**extra: str) -> dict[str, str]:
    """This process's environment without the variables of an enclosing torchrun, unbuffered output;
    and ``extra``. One thread a process and no progress bars unless this process's environment says
    otherwise (conftest.py sets them for the suite), not set over it: the warm processes (torchrun,
    its workers) have their forkserver's, which started with this process's (warm.READ_AT_START)."""
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    env.update((k, v) for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                            "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID"))
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


# ---------------------------------------------------------------------------- monitor (unit and whole runs)

HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


# ---------------------------------------------------------------------------- config (unit and --print-config)

# One non-default config, written below as YAML, JSON and TOML.
SAMPLE = {
    "precision": "fp16",
    "max_norm": 0.5,
    "accumulation_steps": 2,
    "steps": 7,
    "seed": 3,
    "device": "cpu",
    "optimizer": {"name": "sgd", "lr": 0.01, "betas": [0.8, 0.99], "fused": False, "momentum": 0.5},
    "schedule": {"warmup": 2, "decay": "linear"},
    "scaler": {"init_scale": 1024.0, "growth_interval": 10, "backoff_factor": 0.25},
    "monitor": {"window": 50, "fail_rate": 0.5, "fail_after": 5},
    "log": {"dir": "elsewhere", "every": 2},
    "checkpoint": {"every": 3, "keep": 1},
    "task": {"name": "linear", "batch_size": 8},
    "inject": ["inf_grad@5", "nan_loss@every:3"],
}

SAMPLE_TOML = """\
precision = "fp16"
max_norm = 0.5
accumulation_steps = 2
steps = 7
seed = 3
device = "cpu"
inject = ["inf_grad@5", "nan_loss@every:3"]

[optimizer]
name = "sgd"
lr = 0.01
betas = [0.8, 0.99]
fused = false
momentum = 0.5

[schedule]
warmup = 2
decay = "linear"

[scaler]
init_scale = 1024.0
growth_interval = 10
backoff_factor = 0.25

[monitor]
window = 50
fail_rate = 0.5
fail_after = 5

[log]
dir = "elsewhere"
every = 2

[checkpoint]
every = 3
keep = 1

[task]
name = "linear"
batch_size = 8
"""


# ---------------------------------------------------------------------------- checkpoints (unit and --resume)


def minimal_payload(step: int, **extra: object) -> dict:
    """The smallest payload ``load_checkpoint`` accepts (every REQUIRED key but the marker)."""
    payload = {key: {} for key in REQUIRED if key not in ("magic", "format")}
    payload.update(step=step, data_position=step, model={"w": torch.full((3,), float(step))})
    payload.update(extra)
    return payload


def _truncated(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


# ---------------------------------------------------------------------------- tasks (unit and whole runs)

EXAMPLE = ROOT / "examples" / "my_model.py"

TINY_LM = ["task.name=charlm", "task.n_layer=1", "task.n_embd=32", "task.n_head=2", "task.block_size=32",
           "task.batch_size=16", "eval.batches=4"]


def write(path: Path, source: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source), encoding="utf-8")
    return path


def caught_warnings(block) -> list[str]:
    """The messages of the ampguard warnings ``block()`` gave, every one (none filtered as a repeat)."""
    import warnings

    from ampguard.errors import AmpguardWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        block()
    return [str(w.message) for w in caught if issubclass(w.category, AmpguardWarning)]



# A noiseless linear regression y = x @ w, learnable to ~0 from any start: a user factory's data.
REGRESSION = """\
import torch
from torch import nn

def make():
    g = torch.Generator().manual_seed(7)
    w = torch.randn(8, 1, generator=g)
    x = torch.randn(512, 8, generator=g)
    y = x @ w
    train = [(x[i:i + 32], y[i:i + 32]) for i in range(0, 448, 32)]
    return train, x[448:], y[448:]
"""

FILE_FACTORY = REGRESSION + """
def build(config):
    train, x_test, y_test = make()
    torch.manual_seed(config.seed)
    model = nn.Linear(8, 1)

    def evaluate(model, device):
        out = model(x_test.to(device)).float()
        return {"val_mse": float(nn.functional.mse_loss(out, y_test.to(device)))}

    return {"model": model, "data": train, "loss_fn": nn.functional.mse_loss,
            "evaluate": evaluate, "metrics": ("val_mse",)}
"""


# A user factory's data for the start-up's checks: a seeded regression set, and a Dataset that
# draws a random augmentation in its workers (whose RNG the start-up's reads must not move).
NOISY_DATA = """\
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset


def xy(n=64):
    g = torch.Generator().manual_seed(7)
    return torch.randn(n, 8, generator=g), torch.randn(n, 2, generator=g)


class Noisy(Dataset):  # a random augmentation, drawn in the workers
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.randn(8), self.y[i]


def persistent_loader():
    x, y = xy()
    return DataLoader(Noisy(x, y), batch_size=16, shuffle=True, num_workers=2, persistent_workers=True,
                      generator=torch.Generator().manual_seed(0))
"""


def hand_loop(path: Path, fn: str, steps: int) -> dict[str, torch.Tensor]:
    """The canonical PyTorch loop over the factory ``fn`` of the file ``path`` (model, data, loss
    function), what a run of it must equal bit for bit: seeded as a run is, AdamW (the config's
    defaults), clipping at 1.0, ``steps`` steps within the first epoch. The model's state after."""
    import random

    import numpy as np

    spec = importlib.util.spec_from_file_location(f"hand_loop_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    model, data, loss_fn = getattr(module, fn)(None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    batches = iter(data)
    for _ in range(steps):
        x, y = next(batches)
        loss_fn(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    del batches, data
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def trains_as_the_hand_loop(cli: Any, path: Path, fn: str, *run: str, steps: int = 3) -> None:
    """``ampguard train`` of the factory ``fn`` in ``path`` (run by the ``cli`` fixture, in
    ``path``'s folder) warns of nothing and ends with the weights :func:`hand_loop` ends with, bit
    for bit."""
    code, out, err = cli("train", *run, "--set", f"task.factory={path.name}:{fn}", "--set", f"steps={steps}",
                         "--set", f"log.name={fn}")
    assert code == 0, err
    assert "warning" not in err, err
    saved = torch.load(path.parent / "runs" / fn / "checkpoints" / f"step-{steps:08d}.pt", weights_only=True)["model"]
    expected = hand_loop(path, fn, steps)
    assert saved.keys() == expected.keys()
    assert all(torch.equal(saved[k], expected[k]) for k in expected), fn


# ---------------------------------------------------------------------------- plots: ampguard's mark, a user's PNG


def marked(path: Path) -> bool:
    """Whether the PNG at ``path`` carries ampguard's mark: a tEXt chunk ``Software: ampguard <version>``."""
    return b"tEXtSoftware\0ampguard " in path.read_bytes()


def someones_png(path: Path) -> bytes:
    """A user's own figure at ``path``: a real PNG, drawn by matplotlib (its Software text is
    matplotlib's); returns its bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1, 1))
    ax.plot([1, 2])
    fig.savefig(path, format="png")
    plt.close(fig)
    return path.read_bytes()


# a task.factory of a BatchNorm model (test_fsdp2_wrap, test_running_stats): options rank_init (an
# init that differs by rank) and evals_to (a folder where each rank appends its own held-out loss)
BN_FACTORY = '''
import os

import torch
from torch import nn


def build(config):
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)) for _ in range(8)]
    held = [(torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)) for _ in range(2)]
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    if config.task.options.get("rank_init"):  # an init seeded by rank (a node's own weights file, say)
        with torch.no_grad():
            model[0].weight.fill_(float(os.environ["RANK"]))
    loss_fn = nn.MSELoss()

    def evaluate(m, device):
        m.eval()
        with torch.no_grad():
            value = sum(loss_fn(m(x), y).item() for x, y in held) / len(held)
        m.train()
        if config.task.options.get("evals_to"):  # each rank's own value, before the mean over ranks
            with open(os.path.join(config.task.options["evals_to"], "rank" + os.environ["RANK"]), "a") as f:
                f.write(repr(value) + "\\n")
        return {"val_loss": value}

    return {"model": model, "data": data, "loss_fn": loss_fn, "evaluate": evaluate, "metrics": ["val_loss"]}
'''


def hf_retrying_trainer(out_dir: Path) -> Any:
    """A stock Hugging Face ``GuardedTrainer`` (a one-layer GPT-2, ``auto_find_batch_size``, four
    steps of batch 4 with an ``AmpGuardCallback``) whose third forward of a batch of more than two
    raises an out-of-memory stand-in: HF begins the loop again at step 0 with half the batch, and
    the callback sets the first attempt's rows aside. Its files go under ``out_dir / "ampguard"``."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from ampguard.integrations.transformers import AmpGuardCallback, GuardedTrainer

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8))
    ids = [{"input_ids": t, "labels": t} for t in torch.randint(0, 32, (64, 8))]
    args = TrainingArguments(str(out_dir), per_device_train_batch_size=4, max_steps=4, use_cpu=True, report_to=[],
                             save_strategy="no", disable_tqdm=True, auto_find_batch_size=True)
    trainer = GuardedTrainer(model=model, args=args, train_dataset=ids,
                             callbacks=[AmpGuardCallback(print_fn=lambda line: None)])
    forwards = [0]

    def out_of_memory(module: Any, args: Any, kwargs: dict[str, Any]) -> None:  # (the third forward, at step 3)
        forwards[0] += 1
        if kwargs["input_ids"].shape[0] > 2 and forwards[0] > 2:
            raise RuntimeError("CUDA out of memory. Tried to allocate 1 GiB (a stand-in)")

    model.register_forward_pre_hook(out_of_memory, with_kwargs=True)
    return trainer


# ---------------------------------------------------------------------------- a sink's cut and its retry (review 41)

def step_log(step: int):
    """A step's record with every CSV column filled."""
    from ampguard.records import StepLog

    return StepLog(step, lr=0.1, loss=0.5, grad_l2_pre_clip=1.0, grad_l2_post_clip=1.0, scaler_scale=1.0)


def logged_steps(path: Path) -> list[int] | None:
    """The steps of a CSV's rows or of JSON lines' records; None for no file."""
    if not path.exists():
        return None
    if path.suffix == ".jsonl":
        return [json.loads(line)["step"] for line in path.read_text().splitlines()]
    return [int(line.split(",")[0]) for line in path.read_text().splitlines()[1:]]


def names_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def sink_of_four_steps(tmp_path: Path, kind: str = "csv"):
    """A ``CsvSink`` (``kind`` "csv") or ``JsonlSink`` in ``tmp_path`` that logged steps 1-4."""
    from ampguard.sinks import CsvSink, JsonlSink

    sink = CsvSink(tmp_path / "steps.csv") if kind == "csv" else JsonlSink(tmp_path / "steps.jsonl")
    for step in range(1, 5):
        sink.write(step_log(step))
    return sink


def armed_after_set_aside(monkeypatch) -> list[bool]:
    """A list that holds True once ``sinks.set_aside`` has made its copy (what comes after is the cut)."""
    from ampguard import sinks

    real, armed = sinks.set_aside, []

    def set_aside_then_arm(*args, **kwargs):
        out = real(*args, **kwargs)
        armed.append(True)
        return out

    monkeypatch.setattr(sinks, "set_aside", set_aside_then_arm)
    return armed


def folder_sync_raises(monkeypatch, make, armed=lambda: True) -> None:
    """The folder's fsync after a rename (``files._sync`` on a folder) raises ``make()`` while ``armed()``."""
    import stat

    from ampguard import files

    real_sync = files._sync

    def sync(fd):
        if armed() and stat.S_ISDIR(os.fstat(fd).st_mode):
            raise make()
        return real_sync(fd)

    monkeypatch.setattr(files, "_sync", sync)


def check_reader(batch):
    """A ``read_batch`` for the start-up's check (``build.check_forward``): ``batch``, or ``count``
    of it (several passes)."""
    def read(count=None):
        return iter([batch] * count) if count else batch
    return read


CHECK_BATCH = (torch.linspace(-3, 5, 32).reshape(8, 4), torch.zeros(8, 2))
"""The batch :func:`start_up_warnings` checks a :func:`toy_model` with."""


def toy_model() -> torch.nn.Sequential:
    """A small model, the same at each call: Linear(4, 8), Tanh, Linear(8, 2)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def start_up_warnings(model: torch.nn.Module, loss_fn=torch.nn.functional.mse_loss) -> list[str]:
    """The warnings of the start-up's check (``build.check_forward``, four passes of
    :data:`CHECK_BATCH`, fp32) of ``model`` and ``loss_fn``."""
    from ampguard.build import check_forward
    from ampguard.precision import Precision

    return caught_warnings(lambda: check_forward(model, loss_fn, check_reader(CHECK_BATCH), Precision("fp32", "cpu"),
                                                 "task toy"))
