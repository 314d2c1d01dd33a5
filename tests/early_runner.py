"""Run one test module's ``early(work)`` and write what it returns, pickled, to
``WORK/early.pickle``: ``python early_runner.py MODULE_FILE WORK PARENT_PID``. conftest.py starts it
in a process of its own at nice 19 (xdist's controller at the session's start; one process at
collection: see there), forked warm (tests/warm.py: torch imported already; its parent the
suite's forkserver, PARENT_PID, which ends when the suite's process does); the module's tests
read the result.

Every process the job starts inherits the nice. torchrun starts each worker in a session of its
own, though, and on Linux a session is a scheduler autogroup that shares the cores with the
others whatever its processes' nice: each worker sets its autogroup's nice too (a
``sitecustomize`` on the job's ``PYTHONPATH``), or the job would take a core from the tests
running in the foreground. The same file has each worker die with its torchrun, and each
launch dies with this runner (``helpers.warm_own_group``'s tie; ``dies_with_its_parent`` for a
command not forked warm), which dies with the suite: no
launch trains on after the suite died, however each of them died. The launches' temporary files
(torchrun's ``torchelastic_*`` folders) go under the job's folder, and with it.

Adding an early job to a test module: define ``early(work) -> result`` in the module itself (an
imported function of that name starts nothing), which starts its launches (``helpers.Launch``,
``timeout_s=helpers.EARLY_TIMEOUT_S``) in ``work`` and ends them in a ``finally``
(``helpers.end_launches``), returning something picklable (``helpers.Ended``, builtins, paths).
It runs in this process, without pytest: no fixtures, ``tests/`` on the path (``helpers``), the
module imported a second time; an exception fails every test of the module. The tests read it
through the fixtures ``launches`` (the result) and ``work`` (the folder); those tests run last
(the module's others run in their place).
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import shutil
import signal
import sys
from pathlib import Path

RESULT = "early.pickle"
ENDING = "early.ending"
"""The file the suite leaves in the job's folder as it ends the job (conftest._end): the folder is then the
suite's to read and take away; a job given SIGTERM without it (its suite died) takes it away itself."""
NICE = 19
SITE = f"""import os
if os.getsid(0) == os.getpid():  # (a session of its own: a torchrun worker) -- tests/early_runner.py
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write("{NICE}")
    except OSError:  # (not Linux, or no autogroups)
        pass
    try:  # it dies with its torchrun (SIGKILL: one whose torchrun is gone has no one to report to)
        import ctypes
        ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass
"""


def _end_with_the_suite(parent_pid: int) -> None:
    """A SIGTERM ends the job through its ``finally`` blocks (each launch ended with its workers,
    which sit in process groups and sessions of their own) and :func:`main` takes its folder away; the job gets
    one when its parent (``parent_pid``: the suite's forkserver, which ends with the suite's process)
    dies, however it dies (Linux's parent-death signal), so a suite killed by a CI's time limit
    leaves no launch training on."""
    def ended(*_: object) -> None:
        # once: a second SIGTERM (a second Ctrl-C, a CI's SIGINT then SIGTERM) while the launches
        # are ended in the `finally` blocks would cut that short and leave the rest training
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.exit(128 + signal.SIGTERM)

    signal.signal(signal.SIGTERM, ended)
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # (not Linux: conftest's session end still ends the job)
        pass
    if os.getppid() != parent_pid:  # (the suite died before the signal was asked for)
        ended()


def main(module_file: str, work: str, parent_pid: str) -> None:
    try:
        _run(module_file, Path(work), int(parent_pid))
    except SystemExit:  # (a SIGTERM: the suite ended it, and reads its logs before it takes the folder; or died)
        if not (Path(work) / ENDING).exists():  # (conftest._end marks a job it ends: one without, its suite died)
            shutil.rmtree(work, ignore_errors=True)
        raise


def _run(module_file: str, work: Path, parent_pid: int) -> None:
    _end_with_the_suite(parent_pid)
    site = work / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITE)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    (tmp := work / "tmp").mkdir()
    os.environ["TMPDIR"] = str(tmp)  # (torchrun's torchelastic_* folders: gone with the job's folder)
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # `helpers`, as pytest puts tests/ on the path
    spec = importlib.util.spec_from_file_location(f"early_{Path(module_file).stem}", module_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.early(work)
    out = work / RESULT
    (partial := out.with_suffix(".partial")).write_bytes(pickle.dumps(result))
    partial.replace(out)  # whole or absent


if __name__ == "__main__":
    main(*sys.argv[1:])
