"""tests/warm.py's ``share_server``: a child started with it (an early job's runner) forks its own
children (its scripts, torchrun and its workers' stand-ins) from the same forkserver, not from one
of its own (which imported torch again: ~6 s of CPU an early job), and they run at its niceness,
as children of its own would, though the forkserver runs at the suite's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import warm

TESTS = str(Path(__file__).resolve().parents[1])

CHILD = f"""
import json, os, subprocess, sys
sys.path.insert(0, {TESTS!r})
import warm
said = {{"server": warm.server_pid(), "address": warm.server_address(), "nice": os.getpriority(os.PRIO_PROCESS, 0)}}
out = warm.run([sys.executable, "-c", "import json, os; print(json.dumps([os.getppid(), os.getpriority(os.PRIO_PROCESS, 0)]))"],
               capture_output=True, text=True, timeout=120)
said["grandchild"] = json.loads(out.stdout)
print(json.dumps(said))
"""


def test_a_child_sharing_the_forkserver_forks_from_it_at_its_own_niceness():
    server, address = warm.server_pid(), warm.server_address()
    child = warm.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       share_server=True, nice=3)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err[-2000:]
    said = json.loads(out.strip().splitlines()[-1])
    assert (said["server"], said["address"]) == (server, address)  # (not a forkserver of its own)
    parent, nice = said["grandchild"]
    assert parent == server
    assert said["nice"] == nice == min(19, 3 + os.getpriority(os.PRIO_PROCESS, 0))


LAUNCHER = f"""
import os, signal, sys
from pathlib import Path
sys.path.insert(0, {TESTS!r})
import helpers
proc = helpers.warm_own_group([sys.executable, "-c", "import time; time.sleep(120)"], Path.cwd(), None)
print(proc.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # (no finally, no atexit: as a runner killed past its grace)
"""


def test_a_launch_dies_with_the_process_that_started_it_though_its_forkserver_lives_on(tmp_path):
    """An early job's runner shares the suite's forkserver, which outlives it: its launches
    (helpers.warm_own_group) are tied to it, or one it could not end (SIGKILL) would train on."""
    import time

    runner = warm.Popen([sys.executable, "-c", LAUNCHER], cwd=tmp_path, stdout=subprocess.PIPE, text=True,
                        share_server=True)
    out, _ = runner.communicate(timeout=120)
    assert runner.returncode == -9
    launch = int(out.split()[0])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(launch, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(launch, 9)
        raise AssertionError("the launch outlived the process that started it")


def test_the_forkserver_imported_warm_and_matplotlib_before_the_fork():
    """Not each child after it (Python 3.11's forkserver ignores the path it is handed: warm, in
    tests/, failed to import there silently, and each child imported it and matplotlib, ~0.8 s)."""
    code = ("import os, sys; w = sys.modules['warm']; "
            "print(w._IMPORTED_IN != os.getpid(), 'matplotlib.backends.backend_agg' in sys.modules)")
    out = warm.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True"]


SERVER_SEED = os.environ.get("PYTHONHASHSEED")
"""The hash seed this process, and so the forkserver, started with (a CI may export one: tox does)."""
OTHER_SEED = "12345" if SERVER_SEED != "12345" else "54321"

REFUSES = f"""
import os, sys
sys.path.insert(0, {TESTS!r})
import warm
if len(sys.argv) > 1:  # (not the forkserver's child: as torchrun's stand-in, tests/warm_worker.py)
    warm.connect(sys.argv[1])
print(warm.run([sys.executable, "-c", "print('ran')"], capture_output=True, text=True, timeout=120).stdout.strip())
try:
    warm.Popen([sys.executable, "-c", "pass"], env={{**os.environ, "PYTHONHASHSEED": {OTHER_SEED!r}}})
except ValueError as refused:
    print(refused)
"""


def test_a_process_sharing_the_forkserver_or_connected_to_it_knows_what_it_started_with():
    """What the forkserver read as it started (warm.READ_AT_START) is known to a process that forks
    from it without having started it, a child sharing it or one handed it (``server_handle``): the
    same environment runs, another hash seed is refused."""
    for args, shared in (([], True), ([warm.server_handle()], False)):
        done = warm.run([sys.executable, "-c", REFUSES, *args], capture_output=True, text=True, timeout=120,
                        share_server=shared)
        assert done.returncode == 0, done.stderr[-2000:]
        ran, refused = done.stdout.splitlines()
        server = "unset" if SERVER_SEED is None else repr(SERVER_SEED)
        assert ran == "ran" and refused.startswith(f"warm.Popen cannot give a child PYTHONHASHSEED {OTHER_SEED!r} "
                                                   f"(the forkserver's: {server})"), done.stdout


UNWRITABLE_CONFIG = f"""
import os, subprocess, sys
sys.path.insert(0, {TESTS!r})
import warm
warm.PRELOAD[:] = ["warm", "matplotlib"]  # (a forkserver of this process's own, as the suite's imports it)
probe = "import matplotlib, os; print(os.path.isdir(matplotlib.get_configdir()))"
for _ in range(2):
    done = warm.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    print(done.returncode, done.stdout.strip(), "Traceback" in done.stderr)
"""


def test_a_child_leaves_the_folders_the_forkserver_made_to_the_forkserver(tmp_path):
    """matplotlib makes a temporary config folder where its own is not writable (a CI's read-only
    HOME) and registers its removal at exit: every warm child ran that at its end, so the first one
    removed the folder the forkserver and the later children share (review 58m)."""
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    done = subprocess.run([sys.executable, "-c", UNWRITABLE_CONFIG], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MPLCONFIGDIR": str(not_a_folder / "mpl")}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["0 True False", "0 True False"], (done.stdout, done.stderr[-2000:])
