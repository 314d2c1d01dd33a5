"""tests/warm.py: a command forked warm is the process a fresh interpreter makes of it (its exit code,
its output, its ``sys.argv``/``sys.path``/working folder, its interpreter's ending), for the commands
the suite starts that way. Each case runs the same small program both ways and compares."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import warm

EXE = sys.executable


def both(argv: list[str], **kwargs) -> tuple[tuple, tuple]:
    """(returncode, stdout, stderr) of ``argv`` in a fresh interpreter, then forked warm."""
    results = []
    for start in (subprocess.Popen, warm.Popen):
        proc = start([EXE, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                     stdin=subprocess.DEVNULL, **kwargs)
        out, err = proc.communicate(timeout=120)
        results.append((proc.returncode, out, re.sub(r" at 0x[0-9a-f]+", " at 0x...", err)))  # (a function's address)
    return results[0], results[1]


STATE = "\n".join([  # (one process: what it holds as it starts, each read once, its globals first)
    "print(sorted(globals()), __loader__, __spec__)",
    "import sys; print(sys.argv, repr(sys.path[0]), sys.stdin.read())",
    "import multiprocessing as mp; print(mp.current_process().name, mp.parent_process(), mp.get_start_method())",
    "import sys; print(sys.stdout.encoding, sys.stdout.errors, sys.stderr.errors, repr(sys.stdout), repr(sys.stderr))",
    "import signal; print([signal.getsignal(s) for s in (signal.SIGINT, signal.SIGPIPE, signal.SIGXFSZ)])",
])
"""A fresh interpreter's state a command reads: its globals, ``__loader__`` and ``__spec__``, ``sys.argv``,
``sys.path[0]`` and stdin, ``multiprocessing``'s view of it, its streams' encodings, its signal handlers."""


@pytest.mark.parametrize("code", [
    "print('a'); import sys; sys.exit(3)",
    "raise SystemExit('bye')",
    "raise SystemExit",
    "def f():\n    raise ValueError('x')\nf()",
    "import atexit; atexit.register(lambda: print('at exit')); print('body')",
    "import threading, time\nthreading.Thread(target=lambda: (time.sleep(0.2), print('late', flush=True))).start()",
    pytest.param(STATE, id="its-state"),
    "import sys; sys.exit(256)",
    "import sys; sys.exit(-1)",
    "import sys; sys.exit(2 ** 40)",
    "import sys; sys.stdout = None",
    "import sys; del sys.stdout",
    "import atexit; atexit.register(lambda: 1 / 0); print('body')",
    "import sys\ndef hook(*_):\n    raise RuntimeError('hook')\nsys.excepthook = hook\nraise ValueError('x')",
])
def test_a_command_ends_as_in_a_fresh_interpreter(code, tmp_path):
    fresh, forked = both(["-c", code, "one", "two"], cwd=tmp_path)
    assert forked == fresh


def test_a_module_and_a_script_run_as_main_with_their_argv_and_path(tmp_path):
    (tmp_path / "pkg_mod.py").write_text("import os, sys\nprint(__name__, sys.argv, sys.path[0], os.getcwd())\n")
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "s.py").write_text("import os, sys\nprint(__name__, __file__, sys.argv, sys.path[0], os.getcwd())\n")
    fresh, forked = both(["-m", "pkg_mod", "a"], cwd=tmp_path)
    assert forked == fresh
    fresh, forked = both(["scripts/s.py", "b"], cwd=tmp_path)
    assert forked == fresh and fresh[1].startswith(f"__main__ {tmp_path / 'scripts/s.py'} ['scripts/s.py', 'b']")


def without(*names: str, **values: str) -> dict[str, str]:
    """This process's environment without ``names``, with ``values``: what a case compares does not
    depend on what the machine sets (``PYTHONUNBUFFERED=1`` here hid a warm stderr always
    unbuffered, review 58e)."""
    return {**{k: v for k, v in os.environ.items() if k not in names}, **values}


@pytest.mark.parametrize("unbuffered", ["", "1"])  # (a shell's, CI's; PYTHONUNBUFFERED=1)
@pytest.mark.parametrize("io_encoding", ["", "ascii", ":replace", "latin-1:ignore"])  # (none, a name, errors, both)
def test_its_standard_streams_encode_and_buffer_as_a_fresh_interpreters(io_encoding, unbuffered):
    env = without("PYTHONUNBUFFERED", PYTHONIOENCODING=io_encoding, **({"PYTHONUNBUFFERED": "1"} if unbuffered else {}))
    code = ("import sys; print([(s.encoding, s.errors, s.line_buffering, s.write_through, s.mode, repr(s.buffer))"
            " for s in (sys.stdin, sys.stdout, sys.stderr)])")
    fresh, forked = both(["-c", code], env=env)
    assert forked == fresh


@pytest.mark.parametrize("option, variable", [("", ""), ("-B", ""), ("", "1")])  # (-B, PYTHONDONTWRITEBYTECODE)
def test_its_temporary_folder_time_zone_and_bytecode_writing_are_its_environments(option, variable, tmp_path):
    """What an interpreter reads of its environment as it starts and a warm child reads again
    (review 58e: torchrun forked warm put its torchelastic_* folders in /tmp, not in the TMPDIR
    tests/early_runner.py gives its launches; a warm child wrote bytecode as its forkserver did)."""
    env = without("PYTHONDONTWRITEBYTECODE", TMPDIR=str(tmp_path), TZ="AMP-3",
                  **({"PYTHONDONTWRITEBYTECODE": variable} if variable else {}))
    code = "import sys, tempfile, time; print(tempfile.gettempdir(), time.tzname, time.timezone, sys.dont_write_bytecode)"
    fresh, forked = both([*filter(None, [option]), "-c", code], env=env)
    assert forked == fresh and fresh[1].startswith(f"{tmp_path} ('AMP', 'AMP') -10800 "), fresh


@pytest.mark.parametrize("name, value", [("PYTHONHASHSEED", "12345"), ("PYTHONWARNINGS", "error"),
                                         ("PYTHONFAULTHANDLER", "1"), ("OMP_NUM_THREADS", "3"), ("OMP_NUM_THREADS", None),
                                         ("MPLBACKEND", "svg"), ("TQDM_MININTERVAL", "5"), ("LC_ALL", "warm.probe")])
def test_a_variable_read_once_at_start_up_that_is_not_the_forkservers_is_refused(name, value):
    """A child forked warm has what the forkserver read as it started (its hash secret, its warning
    options, torch's threads, matplotlib's backend, tqdm's defaults, the locale): a command asking
    for another is refused, not run under the forkserver's (review 58e)."""
    if value is not None and os.environ.get(name) == value:  # (a CI that exports it: PYTHONFAULTHANDLER=1)
        value += "1"
    env = without(name, **({} if value is None else {name: value}))
    shown = "unset" if value is None else repr(value)
    with pytest.raises(ValueError, match=rf"cannot give a child {name} {re.escape(shown)} \(the forkserver's: .*"
                                         r"start this command in a fresh interpreter"):
        warm.Popen([EXE, "-c", "pass"], env=env)


@pytest.mark.parametrize("option", ["-I", "-E", "-s"])
def test_an_option_that_changes_what_the_interpreter_reads_as_it_starts_is_refused(option):
    """``-I``, ``-E``, ``-s``: a warm child has read its path and ``PYTHON*`` already, as the
    forkserver did (review 58e: ``-I`` ran with ``PYTHONPATH`` on the path, not isolated)."""
    with pytest.raises(ValueError, match=f"does not take the interpreter option '{option}'"):
        warm.Popen([EXE, "-u", option, "-c", "pass"])


def test_its_environment_console_encoding_and_unbuffered_output(tmp_path):
    # (and variables no interpreter reads as it starts, though named like some: gpu.sh's PYTHON, a terminal's LC_*)
    env = {**os.environ, "PYTHONIOENCODING": "ascii", "AMPGUARD_WARM_PROBE": "x", "PYTHON": EXE, "LC_TERMINAL": "x"}
    code = ("import ctypes, os\nprint(os.environ['AMPGUARD_WARM_PROBE'], ctypes.CDLL(None).getenv(b'AMPGUARD_WARM_PROBE') != 0)"
            "\nprint('\u00fcn\u00ef')")
    fresh, forked = both(["-c", code], env=env, cwd=tmp_path)
    assert forked[0] == fresh[0] == 1 and forked[1] == fresh[1] == "x True\n"
    assert forked[2].splitlines()[-1] == fresh[2].splitlines()[-1]  # (the UnicodeEncodeError)
    unbuffered = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for start in (subprocess.Popen, warm.Popen):  # a line is there before the process ends
        proc = start([EXE, "-c", "import sys, time; sys.stdout.write('now'); time.sleep(60)"], stdout=subprocess.PIPE,
                     env=unbuffered)
        try:
            assert proc.stdout.read(3) == b"now"
        finally:
            proc.kill()
            proc.communicate()


def test_ctrl_c_uncaught_ends_it_by_sigint_and_a_full_console_exits_120(tmp_path):
    results = []
    for start in (subprocess.Popen, warm.Popen):
        proc = start([EXE, "-c", "import time; print('ready', flush=True); time.sleep(60)"], stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True)
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        results.append((proc.returncode, err.splitlines()[-1]))
    assert results[0] == results[1] == (-signal.SIGINT, "KeyboardInterrupt")
    if not Path("/dev/full").exists():
        return
    for unbuffered, code in (("", 120), ("1", 1)):  # (a flush at the end fails, or the print itself)
        ended = []
        env = {**{k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}, "PYTHONUNBUFFERED": unbuffered}
        for start in (subprocess.Popen, warm.Popen):
            with open("/dev/full", "w") as full:
                proc = start([EXE, "-c", "print('x')"], stdout=full, stderr=subprocess.PIPE, text=True, env=env)
                _, err = proc.communicate(timeout=60)
            ended.append((proc.returncode, err.splitlines()[0], err.splitlines()[-1]))
        assert ended[0] == ended[1] and ended[0][0] == code, ended


def test_a_session_a_file_size_limit_and_fresh_random_numbers(tmp_path):
    draw = "import numpy, torch; print(numpy.random.rand(), torch.rand(1).item())"  # (each child its own)
    code = "import os; print(os.getsid(0) == os.getpid())\n" + draw
    proc = warm.Popen([EXE, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    session = proc.communicate(timeout=60)[0].splitlines()
    assert session[0] == "True"
    done = warm.run([EXE, "-c", draw + "\nwith open('big', 'wb') as f:\n    f.write(b'x' * 100)"], cwd=tmp_path,
                    capture_output=True, text=True, timeout=60, file_size=10)
    assert done.returncode == 1 and "File too large" in done.stderr and (tmp_path / "big").stat().st_size == 10
    for generator, first, second in zip(("numpy", "torch"), session[1].split(), done.stdout.split(), strict=True):
        assert first != second, generator


def test_a_torchrun_worker_forked_warm_dies_with_its_stand_in_and_torchrun_reports_how(tmp_path):
    """tests/warm_worker.py: a worker forked warm (its parent the forkserver, not torchrun's
    stand-in) is killed by the kernel the moment its stand-in is (torchrun's SIGKILL after its
    grace, a test's kill of the launch), not left running; torchrun reports the rank killed, as it
    would a fresh worker. (The exit codes a stand-in hands on: the torchrun guards' tests.) Torchrun
    itself forked warm too (``python -m torch.distributed.run``, as the early jobs start it): its
    agent is not what is tried, and a fresh one imported torch first, ~4 s of CPU."""
    import time

    from helpers import WARM_TORCHRUN, torchrun_env, warm_workers

    psutil = pytest.importorskip("psutil")
    code = ("import os, time\nopen(f'rank{os.environ[\"RANK\"]}.pid', 'w').write(f'{os.getpid()} {os.getppid()}')"
            "\ntime.sleep(120)")
    workers, env = warm_workers(torchrun_env())
    launch = warm.Popen([*WARM_TORCHRUN, *workers, "-c", code], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"rank{r}.pid").exists() for r in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.05)
        pid, parent = map(int, (tmp_path / "rank0.pid").read_text().split())
        assert parent == warm.server_pid()  # (forked from this process's forkserver, not started afresh)
        [stand_in] = [p for p in psutil.Process(launch.pid).children() if p.environ().get("LOCAL_RANK") == "0"]
        assert "warm_worker.py" in " ".join(stand_in.cmdline())
        stand_in.kill()
        deadline = time.monotonic() + 10
        while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        _, err = launch.communicate(timeout=60)
    finally:
        if launch.poll() is None:
            os.killpg(launch.pid, signal.SIGKILL)
            launch.communicate()
    assert launch.returncode != 0 and "exitcode  : -9" in err, err[-2000:]


def test_torchruns_rendezvous_records_are_named_in_a_warm_child_as_torch_names_them():
    # review 59f: the forkserver gives torchrun's agent warm.method_name for torch's get_method_name
    # (inspect.stack(): ~1.7 s of CPU an agent in a child holding ~4,000 modules); the same names
    dynamic_rendezvous = pytest.importorskip("torch.distributed.elastic.rendezvous.dynamic_rendezvous")

    torch_own = dynamic_rendezvous.get_method_name  # (this process's own: the tests' process is no forkserver child)
    assert torch_own is not warm.method_name

    def inner(name, *depth):
        return name(*depth)

    def caller(name, *depth):
        return inner(name, *depth)

    for depth in ((), (1,), (3,), (10_000,)):
        assert caller(warm.method_name, *depth) == caller(torch_own, *depth), depth
    assert caller(warm.method_name) == "caller" and warm.method_name(10_000) == "no_method_name"
    done = warm.run([sys.executable, "-c", "import warm\nfrom torch.distributed.elastic.rendezvous import "
                     "dynamic_rendezvous as d\nprint(d.get_method_name is warm.method_name)"],
                    capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "True\n", done.stderr
