"""Shared fixtures: run the CLI in-process, snapshot a folder (and check it is unchanged); the tiny
classifier factory of the validate tests; one intra-op thread and no bytecode for the task tests
(unit and whole runs); early jobs (a module's slow launches, started at collection)."""

from __future__ import annotations

import collections
import contextlib
import gc
import importlib
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

# One thread for numpy's BLAS in this process and every process a test starts, set before the first
# numpy import (torch's, below): OpenBLAS starts a worker a core at import, and after each call it
# spins waiting for more work: 22 s of the suite's CPU (matplotlib's transforms call it), a core
# taken from the tests' own processes and the early jobs.
for _name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, "1")
# No tqdm bar but one asked for (``disable=``; ampguard's own is off off a terminal either way).
# tqdm reads TQDM_* once, as it is imported (torch's import brings it): here, and in the
# forkserver the processes the tests start are forked from (tests/warm.py), whose children cannot
# be given other ones (``warm.READ_AT_START``); the torchrun launches ask for it (helpers.torchrun_env).
os.environ.setdefault("TQDM_DISABLE", "1")
# No requirements file in a W&B run the tests start: each run's start otherwise reads the metadata
# of every installed package for it (~0.2 of the ~0.25 CPU-s a ``wandb.init`` takes once W&B is
# imported; review 59c), and no test reads it. W&B reads the setting as it is set up (after a
# ``wandb.teardown()``, or in a process of its own), from the environment every process inherits.
os.environ.setdefault("WANDB__SAVE_REQUIREMENTS", "false")
# The tests that compute with more than one thread (the bench pins the usable CPUs, two here; the
# benchmark scripts' --threads) have OpenMP's threads sleep, not spin, between ops: spinning, each
# one's second thread burned a core the other worker and the early jobs needed, and under load
# every op waited for a thread descheduled mid-spin (tests/unit/test_bench.py in one process:
# 27-39 s -> 14-16 s of CPU, 54-72 s -> 13-15 s of wall). Read by libgomp as torch loads it,
# below; what a test checks is the thread count, which this leaves as it was.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402 - after the thread counts
import torch  # noqa: E402
import warm  # noqa: E402

from early_runner import ENDING, NICE, RESULT
from helpers import EARLY_TIMEOUT_S, GLOO, end_processes, snapshot_of

from ampguard.cli import main


_INDUCTOR_CACHE: list[str] = []
"""The Inductor cache folder this process made for the run (:func:`pytest_configure`)."""


def pytest_unconfigure(config: pytest.Config) -> None:
    for folder in _INDUCTOR_CACHE:  # (this process made it: the last of the run to end)
        shutil.rmtree(folder, ignore_errors=True)


def pytest_configure(config: pytest.Config) -> None:
    # One Inductor cache for the whole run: every process a compile happens in (both workers, the early
    # jobs, the processes they start) reads what another compiled already. Left to itself Inductor took
    # the folder from the temporary folder of the moment it first compiled: a doctest's tmp_path in one
    # worker, an early job's own TMPDIR, so each compiled the same graphs cold (and its precompiled
    # header, ~10 s of CPU with g++). A folder of this run's, made here by the process that starts the
    # suite, before its workers and forkserver (which inherit it), removed as it ends (pytest_unconfigure,
    # which follows a configure only: one made at import leaked where pytest stopped before, a bad
    # option); a user's own setting is kept. (Inductor's precompiled headers go where its default cache
    # is, whatever this says: read at its codecache's import, which tests/warm.py's forkservers and the
    # processes that run tests make before any TMPDIR changes; not xdist's controller, which compiles
    # nothing: ~2.7 s of CPU.)
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        _INDUCTOR_CACHE.append(tempfile.mkdtemp(prefix="ampguard-inductor-"))
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR_CACHE[0]
    if not _controller(config):
        importlib.import_module("torch._inductor.codecache")  # (its precompiled headers' folder fixed now)
    if _worker(config):  # (the early jobs xdist's controller runs: pytest_sessionstart)
        _FROM_CONTROLLER.update({m: Path(w) for m, w in config.workerinput.get("ampguard_early", [])})
    elif _controller(config):
        _rewrite_ahead(config)
    # A suite started as a background job of a script (`bash .ci/run &`) inherits SIGINT ignored,
    # and so would every process it starts; ampguard leaves an ignored signal ignored, so the tests
    # that stop a run with Ctrl-C would find it running on. They are about Ctrl-C, not about that.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _rewrite_ahead(config: pytest.Config, timeout_s: float = 120) -> None:
    """Have pytest's assertion rewriting of the test modules under the suite's paths
    (:func:`_test_files`) written to their ``__pycache__`` before xdist's workers start
    (tests/rewritten.py: each worker rewrote every module it collected, ~24 s of CPU each, where
    bytecode is not written), in two processes (the cores the workers will use), waited for: a
    module they did not reach is rewritten by the workers as before."""
    if config.getoption("assertmode", "rewrite") != "rewrite":
        return
    files = [str(f) for f in _test_files(config)]
    if len(files) < 8:
        return
    script = str(Path(__file__).with_name("rewritten.py"))
    procs = [subprocess.Popen([sys.executable, script, *files[i::2]], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(2)]
    for proc in procs:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------------- the test extras in CI
# review 54d: the adapters are tested against the real frameworks, which CI installs as required
# test extras (pyproject's ``test``), but each integration module importorskips its framework: a
# broken install, or one that fails at import, turned whole modules into skips and the suite still
# finished green. With CI set, a skip for a test extra that cannot be imported is a failure.

REQUIRED_IN_CI = ("lightning", "transformers", "accelerate", "torchao", "wandb", "mlflow", "tensorboard", "optuna")
"""The test extras (pyproject's ``test``) that CI must have: a skip for one missing fails there."""
_NOT_IMPORTED = re.compile(r"could not import '(?P<module>[\w.]+)'|^(?P<named>[\w.]+) is not installed")
"""A skip's reason that says a module is missing: ``pytest.importorskip``'s, or a skipif's."""


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _fail_a_missing_extra(report: pytest.CollectReport | pytest.TestReport) -> None:
    """In CI, ``report`` (a module's collection, or a test's phase) made a failure where it is a
    skip because a :data:`REQUIRED_IN_CI` module cannot be imported (a submodule such as
    ``transformers.distributed.tensor_parallel``, which a version may lack, stays a skip)."""
    if not (report.skipped and isinstance(report.longrepr, tuple) and _in_ci()):
        return
    reason = str(report.longrepr[2]).removeprefix("Skipped: ")
    found = _NOT_IMPORTED.search(reason)
    if found and (found["module"] or found["named"]) in REQUIRED_IN_CI:
        report.outcome = "failed"
        report.longrepr = (f"CI is set, and a test extra its tests need cannot be imported: {reason} "
                           "(scripts/setup.sh installs the test extras; a skip would hide their tests)")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    _fail_a_missing_extra((yield).get_result())  # (a module-level importorskip: the whole module)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    _fail_a_missing_extra((yield).get_result())  # (an importorskip or a skipif in a test)


# ---------------------------------------------------------------------------- early jobs
# A module whose launches are slow (torchrun: three processes a launch, each importing torch)
# defines ``early(work) -> result`` (picklable: builtins, paths, helpers.Ended). Its job starts in a
# process of its own at nice 19 (tests/early_runner.py: how to add one): under xdist (the suite's
# way, scripts/test.sh) xdist's controller starts them all at the session's start and the workers
# run their modules last (pytest_sessionstart); in one process at collection, and the module's
# tests that read the fixture ``launches`` (what it returned) or ``work`` (its folder) run last. The
# launches run on what the in-process tests leave idle, instead of minutes of the suite's own. A
# job that fails keeps its folder (the failure names it, with its launches' logs).

EARLY_JOB_TIMEOUT_S = 2 * EARLY_TIMEOUT_S  # (its launches may come in two waves: a resume after its run)
_EARLY: dict[str, tuple[subprocess.Popen, Path]] = {}
_KEPT: set[Path] = set()  # the folders of jobs that failed: left for a person to read
_STARTED_IN: dict[str, Path] = {}  # (the controller's: each job's folder, made before it starts)


def _has_early(module: object) -> bool:
    """Whether a test module defines an early job: a function ``early`` of its own (one imported
    under that name starts nothing)."""
    early = getattr(module, "early", None)
    return callable(early) and getattr(early, "__module__", None) == getattr(module, "__name__", None)


def _start_early(module_file: str) -> None:
    """Start ``module_file``'s job, forked warm (tests/warm.py: torch imported already) at nice 19 in
    a process group of its own; its scripts fork from the same forkserver, whose end (this
    process's) ends the job: the runner is told the forkserver's pid as its parent's."""
    work = _STARTED_IN.get(module_file) or _work_of(module_file)
    with (work / "early.stdout").open("w") as out, (work / "early.stderr").open("w") as err:
        _EARLY[module_file] = (warm.Popen(
            [sys.executable, str(Path(__file__).with_name("early_runner.py")), module_file, str(work),
             str(warm.server_pid())], cwd=work, stdout=out, stderr=err, stdin=subprocess.DEVNULL, process_group=0,
            nice=NICE, share_server=True), work)


def _controller(config: pytest.Config) -> bool:
    """Whether this process is pytest-xdist's controller (``-n``: it collects nothing, its workers do)."""
    return not _worker(config) and config.pluginmanager.has_plugin("dsession")


EARLY_FIRST = ("test_torchrun_guards.py", "test_lightning.py", "test_transformers.py")
"""The early jobs the controller starts first: the longest (their launches wait on timeouts and one
another: minutes of wall time, much of it not on a core)."""
EARLY_PRELOAD = ["lightning", "transformers.trainer"]
"""What the controller's forkserver, whose forks the early jobs' processes are, imports besides
``warm.PRELOAD``: the frameworks their ranks and scripts import (~8 s and ~6 s of CPU each time:
once here instead of in each of ~8 processes; 150.9 against 192.4 CPU-s for test_lightning,
test_ranks_review48 and test_transformers together, with the shared forkserver). They bring
``torchao.float8``, accelerate, torchmetrics and ``matplotlib.pyplot`` with them, which no early
job's check reads; not MLflow or W&B, which ampguard's tracker sinks look for in ``sys.modules``."""
EARLY_AT_ONCE = 2
"""How many early jobs the controller runs at once (each at nice 19, beside the two workers: as
many as the workers would start, one each, before; more starved the launches' timed steps)."""
RC = "early.rc"
"""The file, in a job's folder, where the controller writes its exit code once it ended."""
KEEP = "early.keep"
"""The file a worker leaves in the folder of a job that failed: the controller keeps the folder."""


def _test_files(config: pytest.Config) -> list[Path]:
    """The test modules (``test_*.py``) under the paths the suite was given, sorted. The folders
    pytest does not look in are not looked in (``norecursedirs``, ``--ignore``, ``--ignore-glob``,
    dot folders: a ``.venv`` under the root held 2,000 test files, one not UTF-8; review 43d)."""
    import fnmatch

    skipped = [*config.getini("norecursedirs"), *(config.getoption("ignore_glob", None) or [])]
    ignored = {str(Path(p).resolve()) for p in (config.getoption("ignore", None) or [])}

    def left_out(path: str, name: str) -> bool:
        return path in ignored or name.startswith(".") or any(fnmatch.fnmatch(name, g) or fnmatch.fnmatch(path, g)
                                                               for g in skipped)

    found = set()
    for arg in config.args or [str(config.rootpath)]:
        top = Path(arg.split("::")[0]).resolve()
        files = [top] if top.is_file() else []
        for folder, dirs, names in os.walk(top) if top.is_dir() else ():
            dirs[:] = [d for d in dirs if not left_out(os.path.join(folder, d), d)]
            files += [Path(folder, n) for n in names if fnmatch.fnmatch(n, "test_*.py")
                      and not left_out(os.path.join(folder, n), n)]
        found.update(files)
    return sorted(found)


def _early_modules(config: pytest.Config) -> list[str]:
    """The test modules that define an early job (a top-level ``def early(``) among
    :func:`_test_files`, longest first (:data:`EARLY_FIRST`): the controller cannot import them."""
    found = set()
    for f in _test_files(config):
        with contextlib.suppress(OSError):
            if re.search(rb"^def early\(", f.read_bytes(), re.M):
                found.add(str(f))
    return sorted(found, key=lambda f: (Path(f).name not in EARLY_FIRST, EARLY_FIRST.index(Path(f).name)
                                        if Path(f).name in EARLY_FIRST else 0, f))


def _run_early_jobs(modules: list[str]) -> None:
    """Start the early jobs of ``modules`` (the controller's), :data:`EARLY_AT_ONCE` at a time, each
    one's exit code written to its folder's :data:`RC` when it ends (the workers wait for that
    file: the job is not their child); one that runs past :data:`EARLY_JOB_TIMEOUT_S` is ended,
    one that cannot start is noted as ended (-1). Run in a thread that lives until the last job
    ended (each job dies with the thread that started it: Linux's parent-death signal)."""
    import time

    pending, running = list(modules), []
    while pending or running:
        for module_file in list(running):
            if _EARLY[module_file][0].poll() is None and time.monotonic() - _EARLY_STARTED[module_file] > EARLY_JOB_TIMEOUT_S:
                _end([_EARLY[module_file]])
            if _EARLY[module_file][0].poll() is not None:
                running.remove(module_file)
                _note_end(module_file)
        with _STARTING:  # (none starts once the session's end took the jobs to end: pytest_sessionfinish)
            if _STOPPING.is_set():
                pending.clear()
            while pending and len(running) < EARLY_AT_ONCE:
                module_file = pending.pop(0)
                try:
                    _start_early(module_file)
                except Exception as err:  # (its module's tests fail, naming it: early.stderr)
                    with contextlib.suppress(OSError):
                        (_STARTED_IN[module_file] / "early.stderr").write_text(f"the job could not start: {err!r}\n")
                    _note_end(module_file, -1)
                    continue
                _EARLY_STARTED[module_file] = time.monotonic()
                running.append(module_file)
        time.sleep(0.2)


def _note_end(module_file: str, code: int | None = None) -> None:
    """Write the exit code of ``module_file``'s job (``code``, else its process's) where the workers
    read it (:data:`RC`); not once the session ends (its folder is being removed: review 43d)."""
    work = _STARTED_IN[module_file]
    with contextlib.suppress(OSError, KeyError), _STARTING:
        if not _STOPPING.is_set():
            (work / f"{RC}.partial").write_text(str(_EARLY[module_file][0].returncode if code is None else code))
            (work / f"{RC}.partial").replace(work / RC)


_STOPPING = threading.Event()  # (set at the session's end: no job starts after it)
_STARTING = threading.RLock()  # (held while the controller's thread starts jobs or notes an end)
_EARLY_STARTED: dict[str, float] = {}  # (the controller's: when each job started, time.monotonic)
_FROM_CONTROLLER: dict[str, Path] = {}  # (a worker's: the jobs the controller runs, by module file)


def pytest_sessionstart(session: pytest.Session) -> None:
    # Under xdist the controller starts every early job at the session's start, before the workers
    # have collected (their first minute): a job started with its module's first test, late in a
    # worker's share, was waited for at once, its launches' timeouts and waits on one another (two
    # of the torchrun guards' four minutes) spent with a core idle
    config = session.config
    if _controller(config) and GLOO and not config.option.collectonly and _nothing_deselected(config):
        modules = _early_modules(config)
        config.option.loadscopereorder = False  # (the workers order the modules: pytest_collection_modifyitems)
        _STARTED_IN.update({m: _work_of(m) for m in modules})  # (told to the workers: pytest_configure_node)
        warm.preload_also(EARLY_PRELOAD)
        # (the forkserver started here, on the main thread, before xdist starts its workers: its start sets
        # PYTHONPATH in the environment a moment, and a setenv while another thread exec'd a worker failed
        # that exec, "OSError: [Errno 14] Bad address", the session's INTERNALERROR; warm._ensure_running)
        warm.server_pid()
        threading.Thread(target=_run_early_jobs, args=(modules,), name="early jobs", daemon=True).start()


@pytest.hookimpl(optionalhook=True)  # (xdist's hook: unknown without it, -p no:xdist)
def pytest_configure_node(node) -> None:  # (in xdist's controller: what each worker is told)
    node.workerinput["ampguard_early"] = [(m, str(w)) for m, w in _STARTED_IN.items()]  # (in their order)


def _job_of(module: object) -> str | None:
    """``module``'s file where xdist's controller runs its early job (None: this process starts it)."""
    return job if _has_early(module) and (job := str(Path(module.__file__).resolve())) in _FROM_CONTROLLER else None


def _from_controller(module: object) -> Path | None:
    """The folder of ``module``'s early job where xdist's controller runs it (None: this process starts it)."""
    return _FROM_CONTROLLER[job] if (job := _job_of(module)) else None


def _work_of(module_file: str) -> Path:
    """The folder of ``module_file``'s job (made now: the workers are told it before the job starts)."""
    return Path(tempfile.mkdtemp(prefix=f"early-{Path(module_file).stem}-"))


def _worker(config: pytest.Config) -> bool:
    """Whether this process is one of pytest-xdist's workers (``-n``, as ``scripts/test.sh`` runs
    the suite): each worker collects every module, so none starts a job at collection (every job
    would start once a worker); a module's job starts with its first test, in the worker that runs
    the module (``--dist loadfile``: one), while its other tests run (:func:`pytest_runtest_setup`)."""
    return hasattr(config, "workerinput")


def _nothing_deselected(config: pytest.Config) -> bool:
    """Whether every test collected will run: no ``-k``, ``-m``, ``--deselect``, ``--lf`` or
    test id (``file::name``) that could leave a module's tests out."""
    return not (config.option.keyword or config.option.markexpr or config.getoption("deselect", None)
                or config.getoption("lf", False) or any("::" in str(arg) for arg in config.args))


def pytest_itemcollected(item: pytest.Item) -> None:
    # A module's job starts as soon as the module is collected, when nothing can deselect its tests:
    # collection (~17 s: the adapters import their frameworks) runs on one core and leaves the
    # other idle, and a job started then has less of the foreground's time to share later
    module = getattr(item, "module", None)
    config = item.config
    if (_has_early(module) and module.__file__ not in _EARLY and GLOO and not config.option.collectonly
            and _nothing_deselected(config) and not _worker(config)):
        _start_early(module.__file__)


@pytest.hookimpl(trylast=True)  # (after -k and -m have deselected: no job for a module none of whose tests run)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    early = {m.__file__ for m in (getattr(item, "module", None) for item in items) if _has_early(m)}
    if _FROM_CONTROLLER:
        # Under xdist, whose controller started every job at the session's start, the modules with jobs
        # go last, in the order their jobs started, and the others before them, the biggest first (as
        # xdist's own order, turned off in the controller: pytest_sessionstart); each worker is handed
        # the modules in this order, so it reaches a job's module once the job had the longest to run
        # (by the size alone a module whose job started last came first, and its worker waited 5 min)
        sizes = collections.Counter(item.nodeid.split("::")[0] for item in items)
        started = list(_FROM_CONTROLLER)
        items.sort(key=lambda item: (started.index(job) if (job := _job_of(getattr(item, "module", None))) else -1,
                                     -sizes[item.nodeid.split("::")[0]], item.nodeid.split("::")[0],
                                     "early_result" in getattr(item, "fixturenames", ())))
    elif early:
        # (stable) only the tests that read a job's results wait for it: its module's others keep
        # their place, beside the jobs, rather than after every job has ended
        items.sort(key=lambda item: "early_result" in getattr(item, "fixturenames", ()))
        if GLOO and not config.option.collectonly and not _worker(config):
            for module_file in sorted(early - _EARLY.keys()):  # (those not started at their collection)
                _start_early(module_file)


def pytest_runtest_setup(item: pytest.Item) -> None:
    # an xdist worker starts a module's early job with the module's first test (see _worker)
    module = getattr(item, "module", None)
    if _has_early(module) and module.__file__ not in _EARLY and GLOO and _from_controller(module) is None:
        _start_early(module.__file__)
    # every test computes with one intra-op thread, as every process it starts does (the environment,
    # above): the models are tiny, and a second thread on two shared cores only spins against the
    # suite's other processes. Set again before each test: torch may have been imported before this
    # file (a plugin), and a test may set more and not give them back: the bench once left the
    # usable CPUs (two here) pinned, and the rest of the suite computed with two threads, OpenMP's
    # second spinning after every op (34 s of this process's CPU, measured per thread)
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def pytest_collection_finish(session: pytest.Session) -> None:
    # Collected, this process holds ~660k objects (torch, transformers, Lightning, every test
    # module), none of them garbage, and every full collection walked them all: 49 s of the suite's
    # CPU (accelerate alone collects 9 times an auto_find_batch_size train()). Frozen, the collector
    # walks only what the tests make: measured 37-42 s -> 28-30 s on four of the in-process modules.
    gc.freeze()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    # At the end of each module (its fixtures torn down: the last hook to run) what it imported
    # lazily (transformers' models, Lightning's loops) is frozen too: HF's train() collects at
    # each call (accelerate's free_memory), and walked them all again each time
    if nextitem is not None and getattr(nextitem, "module", None) is not getattr(item, "module", None):
        gc.collect()
        gc.freeze()


def _end(jobs: list[tuple[subprocess.Popen, Path]], grace_s: float = 30.0) -> None:
    """End the early jobs (process, folder) that still run, all at once: SIGTERM first (each ends
    its launches, whose workers sit in sessions of their own), one ``grace_s`` for them all, then
    SIGKILL to each one's process tree. Each folder is marked (:data:`ENDING`) first: a job ended
    by the suite keeps it for the suite to read; one given SIGTERM otherwise (its suite killed)
    takes it away (review 43d: the parent's pid, which the job judged by, is still the suite's
    while a killed suite's threads die)."""
    for _, work in jobs:
        with contextlib.suppress(OSError):
            (work / ENDING).touch()
    running = [proc for proc, _ in jobs if proc.poll() is None]
    if running:
        print(f"\nending {len(running)} early job(s) (their torchrun launches)...", file=sys.stderr, flush=True)
    end_processes(running, grace_s, group=False)


def pytest_sessionfinish(session: pytest.Session) -> None:
    with _STARTING:
        _STOPPING.set()
        jobs = list(_EARLY.values())
    try:
        _end(jobs)
    finally:  # (a second Ctrl-C while the jobs end: their processes die with the suite, their folders go here)
        for work in {*(work for _, work in jobs), *_STARTED_IN.values()}:
            if work not in _KEPT and not (work / KEEP).exists():  # (a worker's failed job is kept: KEEP)
                shutil.rmtree(work, ignore_errors=True)


def _logs(work: Path, limit: int = 1500) -> str:
    """The tail of each log in an early job's folder: the runner's own, then its launches' (the
    newest first), for a failure message."""
    logs = sorted(work.glob("*.stderr"), key=lambda p: (p.name != "early.stderr", -p.stat().st_mtime))
    return "\n".join(f"--- {p.name} (tail) ---\n{p.read_text(errors='replace')[-limit:]}" for p in logs[:8])


@pytest.fixture(scope="module")
def early_result(request: pytest.FixtureRequest) -> tuple[Path, object]:
    """(the early job's working folder, what the module's ``early(work)`` returned), once it ended."""
    module_file = request.module.__file__
    work = _from_controller(request.module)
    if work is not None:  # (xdist's controller runs it: its code in the folder once it ended)
        code, how = _ended_in(work)
    else:
        if module_file not in _EARLY:  # (not started at collection: started now)
            _start_early(module_file)
        proc, work = _EARLY[module_file]
        try:
            how = f"exited {proc.wait(timeout=EARLY_JOB_TIMEOUT_S)}"
        except subprocess.TimeoutExpired:
            _end([(proc, work)])
            how = f"did not end within {EARLY_JOB_TIMEOUT_S} s"
        code = proc.returncode
    if code != 0 or not (work / RESULT).is_file():
        _KEPT.add(work)
        with contextlib.suppress(OSError):
            (work / KEEP).touch()
        pytest.fail(f"early() of {Path(module_file).name} {how}; its folder is kept: {work}\n{_logs(work)}")
    return work, pickle.loads((work / RESULT).read_bytes())


def _ended_in(work: Path) -> tuple[int | None, str]:
    """(exit code, how it ended) of the early job in ``work`` that xdist's controller runs, once its
    code is there (:data:`RC`), or None after :data:`EARLY_JOB_TIMEOUT_S` plus the time a job may
    wait to start (the controller then ends it at the session's end)."""
    import time

    deadline = time.monotonic() + 2 * EARLY_JOB_TIMEOUT_S
    while not (work / RC).exists():
        if time.monotonic() > deadline:
            return None, f"did not end within {2 * EARLY_JOB_TIMEOUT_S} s"
        time.sleep(0.2)
    code = int((work / RC).read_text())
    return code, f"exited {code}"


@pytest.fixture(scope="module")
def work(early_result: tuple[Path, object]) -> Path:
    """The module's early job's working folder."""
    return early_result[0]


@pytest.fixture(scope="module")
def launches(early_result: tuple[Path, object]) -> object:
    """What the module's ``early(work)`` returned: its launches, ended."""
    return early_result[1]


_MODULE_TMP: dict[str, Path] = {}
"""Each test module's folder under pytest's base temporary folder (:func:`tmp_path`)."""


@pytest.fixture
def tmp_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """pytest's ``tmp_path`` (a new empty folder named after the test), made in a folder of the
    test's module rather than straight in the worker's base folder: pytest numbers each one by
    listing every folder already there, and ~2,000 tests a worker made that quadratic (~1.3 ms a
    test at 300 folders, ~4 ms at 3,000; review 59e). Its name ends in ``tempfile``'s random
    letters, not pytest's number; the base folder and its keeping are pytest's."""
    module = request.node.nodeid.split("::")[0]
    if module not in _MODULE_TMP:
        _MODULE_TMP[module] = tmp_path_factory.mktemp(re.sub(r"\W", "_", Path(module).stem)[:30])
    return Path(tempfile.mkdtemp(prefix=re.sub(r"\W", "_", request.node.name)[:30], dir=_MODULE_TMP[module]))


@pytest.fixture
def cli(tmp_path, monkeypatch, capsys):
    """``cli(*argv) -> (exit_code, stdout, stderr)``: ``ampguard.cli.main`` run inside ``tmp_path``."""
    monkeypatch.chdir(tmp_path)

    def run(*argv: object) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture
def cpu_kind(monkeypatch):
    """``cpu_kind(bf16=..., fp16=...)``: this CPU taken for one that has (or lacks) oneDNN's
    bf16 / fp16 kernels, for the notes that depend on it (an AVX2-only CPU emulates both)."""

    def pretend(*, bf16: bool, fp16: bool = False) -> None:
        monkeypatch.setattr("ampguard.precision.cpu_runs_natively", {"bf16": bf16, "fp16": fp16}.__getitem__)

    return pretend


@pytest.fixture
def snapshot():
    """``snapshot(folder) -> {relative path: bytes or '<dir>'}`` of everything under ``folder``."""
    return snapshot_of


@pytest.fixture
def unchanged(tmp_path, snapshot):
    """``check = unchanged()`` snapshots the working folder; ``check()`` asserts it is the same."""

    def take():
        before = snapshot(tmp_path)

        def check() -> None:
            assert snapshot(tmp_path) == before

        return check

    return take


# ---------------------------------------------------------------------------- validate (unit and CLI)

# The user factory of the validate tests: an identity ``Linear`` (logits = inputs), with options
# that plant a near-tie, a margin of exactly 0.5, an exp overflow, a wrong label or swapped classes.
FACTORY = '''
import torch
from torch import nn
from torch.nn import functional as F


class Exp(nn.Module):
    def forward(self, x):
        return torch.exp(x)


def build(config):
    opts = config.task.options
    lin = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(2))  # logits = inputs
    model = nn.Sequential(lin, Exp()) if opts.get("exp") else lin
    # six well-separated examples (top-2 margin 3), the label is the larger logit
    x = torch.tensor([[3.0, 0.0], [0.0, 3.0], [2.0, -1.0], [-1.0, 2.0], [4.0, 1.0], [1.0, 4.0]])
    if opts.get("tie"):  # index 6: a near-tie that fp16 and bf16 cannot resolve
        x = torch.cat([x, torch.tensor([[1.0, 1.0003]])])
    if opts.get("narrow"):  # index 6: margin exactly 0.5 in every precision
        x = torch.cat([x, torch.tensor([[1.5, 1.0]])])
    if opts.get("exp"):  # index 6: exp(100) is inf even in fp32
        x = torch.cat([x, torch.tensor([[100.0, 0.0]])])
    y = x.argmax(1)
    if opts.get("mislabel"):
        y[0] = 1 - y[0]
    made = {"model": model, "data": [(x, y)], "loss_fn": F.cross_entropy, "held_out": (x, y),
            "edge_cases": (["big"], torch.tensor([[10.0, -10.0]]))}
    if opts.get("swap"):
        made["predict"] = lambda m, inputs: m(inputs)[:, [1, 0]]
    return made
'''


@pytest.fixture(scope="module")
def factory(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("factory") / "tiny_classifier.py"
    path.write_text(FACTORY, encoding="utf-8")
    return f"{path}:build"


# ---------------------------------------------------------------------------- tasks (unit and whole runs)
# Not autouse: test_tasks.py and test_task_runs.py ask for them with ``pytest.mark.usefixtures``.


@pytest.fixture(scope="module")
def _one_thread():
    # these models are tiny: one intra-op thread is as fast, and it does not collapse (tens of times
    # slower) when the two cores are shared with other processes
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def _no_bytecode(monkeypatch):
    # loading a factory file must not leave __pycache__ next to it (or in examples/)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
