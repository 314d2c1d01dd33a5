"""``warm.Popen([sys.executable, *ARGS], ...)``: ``subprocess.Popen`` of the same command, the new
process forked from a warm one instead of started afresh.

A fresh interpreter spends ~4.5 s of CPU importing torch and ``torch._dynamo`` (which the first
optimizer imports) before ampguard runs a line; the tests that start ``ampguard`` as a process of
its own (to signal it, to kill it mid-write, to read its exit code and its console) started ~40,
a fifth of the suite's CPU on two cores. Here each is forked from Python's forkserver
(``multiprocessing``'s, one for each test process, started at the first use), which imported torch,
``torch._dynamo``, ampguard's modules and matplotlib once; the child then becomes the process the
command line describes before it runs a line of it:

- its working folder, environment (``os.environ`` and the C environment), ``sys.argv`` and
  ``sys.path`` (the one a fresh ``python`` would have there, asked of one once), a session or a
  process group of its own if asked (``start_new_session``, ``process_group=0``); what a fresh
  interpreter reads of its environment as it starts and a child can read again: its temporary
  folder (``TMPDIR``), time zone (``TZ``) and ``-B``/``PYTHONDONTWRITEBYTECODE``;
- its standard streams on the files or pipes given (``subprocess.PIPE``, ``DEVNULL``, a file, an
  fd, ``STDOUT``), stdin on ``/dev/null`` unless given; Python's text layers made as a fresh
  interpreter makes them (``create_stdio``: stderr a line at a time, all of them unbuffered under
  ``-u``/``PYTHONUNBUFFERED``; ``PYTHONIOENCODING``);
- ``-m MODULE``, ``-c CODE`` or a script run as ``__main__`` (``runpy``, as ``python`` does); then
  the interpreter's own ending: ``SystemExit``'s code (a message printed, code 1), a traceback and
  code 1 for an exception, non-daemon threads joined, ``atexit``'s functions run, the streams
  flushed (a flush that fails: code 120), and an uncaught ``KeyboardInterrupt`` ending the
  process by SIGINT, as CPython does;
- the signal handlers of a fresh interpreter (SIGINT raising ``KeyboardInterrupt``, SIGPIPE and
  SIGXFSZ ignored), the global random generators seeded afresh (Python's by the fork, NumPy's and
  torch's default generator here: torchrun's ranks forked warm each drew the same numbers).

What it is not: an interpreter's start (a test of a signal during torch's import, or of a console
encoding read at start-up beyond ``PYTHONIOENCODING``, starts ``subprocess.Popen``); the modules
imported before it are imported already (what a fresh process would import again, with its own
environment, is shared); a parent-death signal names the forkserver, which ends with the process
that started it, not the test (``death_signal``). Nothing of the test process's state reaches the
child: the forkserver is a fresh interpreter. But every child, and every torchrun rank forked
warm, has the forkserver's hash secret and heap: ``hash()`` of a string, the order of a set of
strings and an object's ``repr`` with its address are the same in all of them, where fresh
processes differ; so no warm launch can catch ranks that disagree because of them (a check that
the ranks agree on such a thing needs a launch whose workers are fresh). What Python or a module
the forkserver imported read once as it started (Python's variables such as the hash seed and
``PYTHONWARNINGS``, the locale, the thread pools' sizes, matplotlib's backend and folder, tqdm's
defaults: :data:`READ_AT_START`) is the forkserver's: a command whose environment differs on one
is refused (a ``ValueError``: start it fresh), as are ``-I``, ``-E``, ``-s`` and any option but
``-u`` and ``-B``; a ``sitecustomize`` on the command's ``PYTHONPATH`` is not run (the early
jobs' is for torchrun's stand-ins, which are fresh). The warning filters the forkserver's imports
installed are the child's: torch's, which a fresh process importing torch installs too, and, in
the forkserver of xdist's controller, whose children are the early jobs' processes, Lightning's
(``conftest.EARLY_PRELOAD``: ``torch.optim.lr_scheduler``'s UserWarnings and an FSDP
FutureWarning ignored, in a plain ``ampguard train`` rank too), left as they are: taken back, a
rank that imports Lightning would lack them; a test of such a warning in an early job's process
starts it fresh.

The early jobs' runners (conftest.py) and the Python scripts they run fork from the suite's
forkserver too, and so do torchrun's workers, through a stand-in torchrun starts
(tests/warm_worker.py: :func:`connect`, ``tied``).

The object has what the tests use of ``subprocess.Popen``: ``args``, ``pid``, ``returncode``,
``stdin`` (None), ``stdout``/``stderr`` (the pipes' reading ends), ``poll``, ``wait``,
``communicate``, ``send_signal``, ``terminate``, ``kill``, and ``with``.
"""

from __future__ import annotations

import atexit
import builtins
import codecs
import contextlib
import fcntl
import gc
import importlib.machinery
import io
import json
import multiprocessing.process
import os
import resource
import runpy
import select
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from typing import Any

PRELOAD = ["warm", "torch", "torch._dynamo", "torch._inductor.codecache", "ampguard.cli", "ampguard.train",
           "ampguard.trainer", "ampguard.report", "ampguard.bench", "ampguard.locate", "ampguard.tasks.linear"]
"""What the forkserver imports before its first fork (``warm`` itself: the child's code; and
matplotlib's Figure and Agg canvas, as ampguard's plots import them: see :func:`_warm_up`).
Inductor's codecache reads its precompiled headers' folder from the temporary folder as it is
imported: here, before a child's ``TMPDIR`` (an early job's own) could move it to a cold one."""

_MAIN_PROCESS = type(multiprocessing.process.current_process())
"""(The class of a fresh interpreter's ``multiprocessing.current_process()``: read at this module's
import, in the forkserver before its first fork.)"""
_FRESH_STDIO = (sys.__stdout__.encoding, sys.__stdout__.errors) if sys.__stdout__ else ("utf-8", "strict")
"""(The encoding and error handler a fresh interpreter gives its stdout in this environment, C
locale or UTF-8 mode included: read, as :data:`_MAIN_PROCESS`, in the forkserver.)"""
_IMPORTED_IN = os.getpid()
"""(The process that imported this module: in a child, the forkserver's, where PRELOAD imported it.)"""
_CONTEXT: Any = None
_BASE_PATH: dict[tuple[str, str | None], list[str]] = {}

READ_AT_START = (
    # CPython's own (3.11), but those a child sets again as a fresh interpreter has them
    # (PYTHONPATH, PYTHONIOENCODING, PYTHONUNBUFFERED, PYTHONDONTWRITEBYTECODE) and PYTHONBREAKPOINT,
    # read at each breakpoint(); the locale's, as Python sets LC_CTYPE from them
    "PYTHONHASHSEED", "PYTHONWARNINGS", "PYTHONFAULTHANDLER", "PYTHONHOME", "PYTHONSAFEPATH", "PYTHONPLATLIBDIR",
    "PYTHONSTARTUP", "PYTHONOPTIMIZE", "PYTHONDEBUG", "PYTHONINSPECT", "PYTHONVERBOSE", "PYTHONCASEOK",
    "PYTHONPYCACHEPREFIX", "PYTHONINTMAXSTRDIGITS", "PYTHONNOUSERSITE", "PYTHONUSERBASE", "PYTHONEXECUTABLE",
    "PYTHONTRACEMALLOC", "PYTHONPROFILEIMPORTTIME", "PYTHONASYNCIODEBUG", "PYTHONMALLOC", "PYTHONMALLOCSTATS",
    "PYTHONCOERCECLOCALE", "PYTHONDEVMODE", "PYTHONUTF8", "PYTHONWARNDEFAULTENCODING", "PYTHONNODEBUGRANGES",
    "LANG", "LC_ALL", "LC_CTYPE",
    # those of the modules the forkserver imported: the thread pools' (torch's, OpenMP's, MKL's, OpenBLAS's),
    # matplotlib's backend and folder, and tqdm's defaults (TQDM_*: at its import, which torch's brings)
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MPLBACKEND", "MPLCONFIGDIR", "TQDM_*")
"""The variables read once, as an interpreter starts, by Python or by a module the forkserver
imported: a child forked from it has what the forkserver read, whatever its command's environment
says, so :class:`Popen` refuses a command whose environment differs from the forkserver's on one of
them (:func:`_read_at_start`). (Those a child reads again: its path, streams and ``-B``, above, and
``TMPDIR`` and ``TZ``: :func:`_child`.)"""
_STARTED_WITH: dict[str, str] | None = None
"""The variables of :data:`READ_AT_START` the forkserver this process forks from started with:
recorded as this process starts it (:func:`_ensure_running`), inherited from it (a child sharing
it: :func:`_unforked`), or handed over (:func:`connect`)."""


def _read_at_start(env: Any) -> dict[str, str]:
    """The variables of ``env`` read once at start-up (:data:`READ_AT_START`, a ``*`` ending a prefix)."""
    return {name: value for name, value in env.items()
            if any(name == read or read.endswith("*") and name.startswith(read[:-1]) for read in READ_AT_START)}


def _refuse_what_it_cannot_read(env: dict[str, str]) -> None:
    """A ``ValueError`` naming the first variable read at start-up (:data:`READ_AT_START`) on which
    ``env`` differs from the forkserver's environment: the child would run with the forkserver's."""
    asked, had = _read_at_start(env), _STARTED_WITH or {}
    for name in sorted(set(asked) | set(had)):
        if asked.get(name) != had.get(name):
            def shown(value: str | None) -> str:
                return "unset" if value is None else repr(value)

            raise ValueError(f"warm.Popen cannot give a child {name} {shown(asked.get(name))} (the forkserver's: "
                             f"{shown(had.get(name))}): Python or a module the forkserver imported reads it once, as "
                             "the interpreter starts; start this command in a fresh interpreter (subprocess.Popen)")


def preload_also(modules: list[str]) -> None:
    """Have this process's forkserver, not started yet, import ``modules`` too, those installed (a
    module that cannot be imported is passed over there, as ``multiprocessing`` does): for a process
    whose children import them, each its own ~6-8 s of CPU (lightning, transformers' Trainer)."""
    if _CONTEXT is not None:
        raise RuntimeError("the forkserver's preload is read as it starts: ask before the first fork")
    PRELOAD.extend(m for m in modules if m not in PRELOAD)


def _context() -> Any:
    global _CONTEXT
    if _CONTEXT is None:
        import multiprocessing

        multiprocessing.set_forkserver_preload(PRELOAD)
        _CONTEXT = multiprocessing.get_context("forkserver")
    return _CONTEXT


def method_name(depth: int = 2) -> str:
    """torch's ``dynamic_rendezvous.get_method_name`` (the name of the function ``depth`` frames
    up, ``inspect.stack()[depth].function``), read from the frame: ``inspect.stack()`` looks up
    each frame's module and source, and in a forkserver's child, holding ~4,000 modules, torchrun's
    agent spent ~1.7 s of CPU an agent on it (two calls a rendezvous record, for the records'
    names; ~14 agents in the suite, review 59f). The same name (tests/unit/test_warm.py)."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # (fewer frames: torch's own answer)
        return "no_method_name"


def _warm_up() -> None:
    """What ampguard's plots import (run in the forkserver, when it imports this module): a
    ``Figure`` and its Agg canvas (``report.import_matplotlib``; no pyplot, no backend chosen);
    and torchrun's rendezvous with :func:`method_name` for its ``get_method_name``."""
    for module in ("matplotlib.figure", "matplotlib.backends.backend_agg"):
        importlib.import_module(module)
    try:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    except ImportError:  # (a torch without torch.distributed)
        return
    dynamic_rendezvous.get_method_name = method_name


if getattr(sys.modules.get("__main__"), "main", None) is getattr(sys.modules.get("multiprocessing.forkserver"), "main",
                                                                  False):  # (the forkserver's preload)
    _warm_up()


def _server() -> Any:
    """This process's forkserver (``multiprocessing``'s), started if it has none and shares none."""
    from multiprocessing import forkserver

    _context()
    _ensure_running()
    return forkserver._forkserver


def _ensure_running() -> None:
    """Start this process's forkserver if it has none and shares none, with this file's folder on
    its path. (Python 3.11's ``forkserver.main`` is handed ``sys_path`` and does not use it: the
    server imported :data:`PRELOAD` with a fresh ``python -c``'s path, which lacks tests/, so
    ``warm`` failed silently there and each child imported it, and matplotlib with it
    (:func:`_warm_up`): ~0.8 s of CPU a child, review 57a.) The instance's ``ensure_running``, not
    the module's, which is the method bound at import: a child that shares its parent's forkserver
    (:func:`connect`, ``share_server``) has the instance's do nothing, and the module's started a
    second one there (each early job's own, ~6 s of CPU importing torch again)."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if server._forkserver_pid is not None or "ensure_running" in vars(server):  # (running, or shared)
        server.ensure_running()
        return
    global _STARTED_WITH
    _STARTED_WITH = _read_at_start(os.environ)
    # (set only for the server's launch, so no later child sees it; a setenv while another thread execs is
    # undefined, the exec's environment freed under it, EFAULT: start the server before other threads spawn,
    # as tests/conftest.py's pytest_sessionstart does)
    kept = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.abspath(__file__)), *filter(None, [kept])])
    try:
        server.ensure_running()
    finally:
        if kept is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = kept


def server_pid() -> int:
    """The forkserver's pid (started if it was not): the parent of every child :class:`Popen` starts."""
    return _server()._forkserver_pid


def server_address() -> str:
    """The address of this process's forkserver (started if it has none, or the one it shares)."""
    return _server()._forkserver_address


def server_handle() -> str:
    """What a process that is not the forkserver's child needs to ask it for a fork (:func:`connect`):
    its address and the variables it started with (:data:`READ_AT_START`), one string."""
    address = server_address()
    return json.dumps([address, _STARTED_WITH])


def connect(handle: str) -> None:
    """Have this process's :class:`Popen` fork from the forkserver ``handle`` names (another
    process's: :func:`server_handle`), not start one of its own."""
    from multiprocessing import forkserver, resource_tracker

    global _STARTED_WITH
    address, _STARTED_WITH = json.loads(handle)
    _context()
    server = forkserver._forkserver
    server._forkserver_address = address
    server._forkserver_alive_fd = os.open(os.devnull, os.O_WRONLY)  # (the hold is the suite's: handed to the child)
    server.ensure_running = lambda: None
    resource_tracker._resource_tracker._fd = os.open(os.devnull, os.O_WRONLY)  # (none to start: nothing to track)


def _fresh_path(executable: str, pythonpath: str | None) -> list[str]:
    """``sys.path[1:]`` of a fresh ``executable`` under ``PYTHONPATH=pythonpath`` (its first entry is
    the script's folder or the working folder, set per command)."""
    key = (executable, pythonpath)
    if key not in _BASE_PATH:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        if pythonpath is not None:
            env["PYTHONPATH"] = pythonpath
        out = subprocess.run([executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
                             env=env, capture_output=True, text=True, check=True).stdout
        _BASE_PATH[key] = json.loads(out)
    return list(_BASE_PATH[key])


@contextlib.contextmanager
def _main_left_out() -> Any:
    """Start a process without ``multiprocessing``'s re-import of this one's ``__main__`` in it (a
    script's: the child would run it again before its command)."""
    from multiprocessing import spawn

    prepared = spawn.get_preparation_data

    def without_main(name: str) -> dict[str, Any]:
        data = prepared(name)
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        return data

    spawn.get_preparation_data = without_main
    try:
        yield
    finally:
        spawn.get_preparation_data = prepared


class _Fd:
    """A file descriptor of this process that reaches the child as its own (forkserver's fd passing)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple:
        from multiprocessing import reduction

        return _inherited, (reduction.DupFd(self.fd),)


def _inherited(dup: Any) -> int:
    return dup.detach()


def _stream(fd: int, mode: str, *, unbuffered: bool, encoding: str, errors: str) -> io.TextIOWrapper:
    """The standard stream ``fd`` as CPython's start-up makes it (``create_stdio``): stdin buffered
    whatever ``-u``; stdout and stderr buffered unless ``unbuffered`` (``-u``, ``PYTHONUNBUFFERED``),
    then a line at a time on a terminal, and stderr a line at a time wherever it goes."""
    buffer = io.open(fd, mode + "b", 0 if unbuffered and mode == "w" else -1, closefd=False)
    raw = buffer if isinstance(buffer, io.FileIO) else buffer.raw
    raw.name = ("<stdin>", "<stdout>", "<stderr>")[fd]
    text = io.TextIOWrapper(buffer, encoding=encoding, errors=errors, newline="\n", write_through=unbuffered,
                            line_buffering=not unbuffered and (raw.isatty() or fd == 2))
    text.mode = mode
    return text


def _unforked(shared: int | None) -> None:  # pragma: no cover - in the child
    """Take back what ``multiprocessing`` made of this process (a child of the forkserver) from what a
    fresh interpreter is: its main process, with no parent and no children, ``fork`` its default
    way to start one (a ``DataLoader``'s workers), no hold on the forkserver; or, ``shared`` (the
    forkserver's pid, which its children are not told), the forkserver kept for this process's own
    :class:`Popen` and :func:`server_address` (an early job's scripts and torchrun workers)."""
    from multiprocessing import context, forkserver, process

    global _STARTED_WITH
    # (the environment, not the command's yet, is the forkserver's: what it started with)
    _STARTED_WITH = _read_at_start(os.environ) if shared is not None else None
    process._current_process = _MAIN_PROCESS()
    process._parent_process = None
    process._children = set()
    context._default_context._actual_context = None
    server = forkserver._forkserver
    server._inherited_fds = None
    if shared is not None:  # (its address and hold are this process's already: nothing to start)
        server.ensure_running = lambda: None
        server._forkserver_pid = shared
        return
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
    server._forkserver_alive_fd = server._forkserver_address = server._forkserver_pid = None


def _child(spec: dict[str, Any], fds: dict[str, int]) -> None:  # pragma: no cover - in the child
    """Become the process ``spec`` describes, run its command, end as the interpreter does."""
    # (the forkserver's ~340k objects, torch's and the preloads', out of the collector's sight: a
    # full collection in the child walked them all, ~0.37 s of CPU each and their pages copied;
    # what the child makes is collected as in a fresh interpreter)
    gc.freeze()
    # (the forkserver's at-exit removals of what it made, matplotlib's temporary config folder where
    # its own is not writable: the first child to end removed the folder the forkserver and every
    # later child share, and they printed a traceback at their own ends; review 58m)
    atexit.unregister(shutil.rmtree)
    _unforked(spec["shared"])
    os.chdir(spec["cwd"])
    os.environ.clear()
    os.environ.update(spec["env"])
    # (what the interpreter or a module read of the environment at start-up that can be read again:
    # the temporary folder, TMPDIR at the next gettempdir, torchrun's torchelastic_* folders in it;
    # the time zone; -B/PYTHONDONTWRITEBYTECODE. The others Popen refuses to differ: _read_at_start)
    tempfile.tempdir = None
    time.tzset()
    sys.dont_write_bytecode = spec["dont_write_bytecode"]
    if spec["session"]:
        os.setsid()
    elif spec["group"]:
        os.setpgid(0, 0)
    if spec["niceness"] > os.getpriority(os.PRIO_PROCESS, 0):  # (the forkserver's is its starter's: 0 in the suite)
        os.setpriority(os.PRIO_PROCESS, 0, min(spec["niceness"], 19))
    if "tied" in fds:  # (SIGKILL when the pipe's other end closes: its holder ended, however)
        tied = fds["tied"]
        fcntl.fcntl(tied, fcntl.F_SETOWN, os.getpid())
        fcntl.fcntl(tied, fcntl.F_SETSIG, signal.SIGKILL)
        fcntl.fcntl(tied, fcntl.F_SETFL, fcntl.fcntl(tied, fcntl.F_GETFL) | os.O_ASYNC)
        if select.select([tied], [], [], 0)[0]:  # (closed before the line above: no signal comes for that)
            os.kill(os.getpid(), signal.SIGKILL)
    if spec["death_signal"]:  # (its parent is the forkserver, which ends with the suite's process)
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, spec["death_signal"])  # PR_SET_PDEATHSIG
    if spec["file_size"] is not None:  # (``ulimit -f``: a write past it fails, EFBIG, where SIGXFSZ is ignored)
        resource.setrlimit(resource.RLIMIT_FSIZE, (spec["file_size"], spec["file_size"]))
    for target, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        os.dup2(fds[name], target)
    for name, fd in fds.items():
        if fd > 2 and name != "tied" and fd != fds.get("tied"):
            os.close(fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for name in ("SIGPIPE", "SIGXFSZ"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    io_encoding = spec["env"].get("PYTHONIOENCODING") or ""
    encoding, _, errors = io_encoding.partition(":")
    # (CPython: an encoding named there makes the error handler strict unless it names one too)
    encoding, errors = (codecs.lookup(encoding).name if encoding else _FRESH_STDIO[0],
                        errors or ("strict" if encoding else _FRESH_STDIO[1]))
    unbuffered = spec["unbuffered"]
    sys.stdin = sys.__stdin__ = _stream(0, "r", unbuffered=unbuffered, encoding=encoding, errors=errors)
    sys.stdout = sys.__stdout__ = _stream(1, "w", unbuffered=unbuffered, encoding=encoding, errors=errors)
    sys.stderr = sys.__stderr__ = _stream(2, "w", unbuffered=unbuffered, encoding=encoding, errors="backslashreplace")
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:  # (its default generator: each child its own, as each fresh process)
        sys.modules["torch"].seed()
    sys.path[:] = spec["path"]
    sys.argv[:] = spec["argv"]
    code = 0
    interrupted = False
    main = sys.modules["__main__"] = types.ModuleType("__main__")  # (not the forkserver's, which holds its code)
    main.__builtins__, main.__annotations__ = builtins, {}
    try:
        if spec["kind"] == "module":
            runpy._run_module_as_main(spec["what"], alter_argv=True)  # (what ``python -m`` calls)
        elif spec["kind"] == "code":
            main.__loader__ = importlib.machinery.BuiltinImporter
            exec(compile(spec["what"], "<string>", "exec"), main.__dict__)  # noqa: S102 - ``python -c``
        else:  # (``python SCRIPT``: its absolute path is its ``__file__`` and its code's file name)
            path = os.path.abspath(spec["what"])
            main.__file__, main.__cached__ = path, None
            main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
            with io.open_code(path) as source:
                exec(compile(source.read(), path, "exec"), main.__dict__)  # noqa: S102
    except SystemExit as stop:
        if stop.code is None:
            code = 0
        elif isinstance(stop.code, int):
            code = int(stop.code)
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException as error:  # noqa: BLE001 - the interpreter prints it (not this frame) and exits 1
        error.__traceback__ = error.__traceback__.tb_next
        # (as CPython's PyErr_Print: what an atexit handler reads of how the program ended, e.g. a
        # tracker sink ending its run FAILED)
        sys.last_type, sys.last_value, sys.last_traceback = type(error), error, error.__traceback__
        if sys.version_info >= (3, 12):
            sys.last_exc = error
        try:
            sys.excepthook(type(error), error, error.__traceback__)
        except BaseException as failed:  # noqa: BLE001 - a hook that raises: CPython says so, then the error
            with contextlib.suppress(BaseException):
                print("Error in sys.excepthook:", file=sys.stderr)
                traceback.print_exception(type(failed), failed, failed.__traceback__.tb_next, file=sys.stderr,
                                          chain=False)
                print("\nOriginal exception was:", file=sys.stderr)
                traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
        code, interrupted = 1, isinstance(error, KeyboardInterrupt)
    # (Py_FinalizeEx: the non-daemon threads waited for, then atexit; what raises in either is
    # "Exception ignored" and the ending goes on, a Ctrl-C there too)
    for step, where in ((threading._shutdown, "<module 'threading'>"), (atexit._run_exitfuncs, "atexit")):
        try:
            step()
        except BaseException as error:  # noqa: BLE001
            _ignored(where, error)
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name, None)
        if stream is None:  # (deleted or set to None: nothing to flush, as CPython finds)
            continue
        try:
            stream.flush()
        except Exception as error:  # noqa: BLE001 - CPython: "Exception ignored", exit 120
            _ignored(repr(stream), error)
            code = 120
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)  # (an exit status is a byte: sys.exit(256) and sys.exit(2**40) are 0, -1 is 255)


def _ignored(where: str, error: BaseException) -> None:
    """CPython's "Exception ignored in: WHERE" and the error, on stderr if it takes them."""
    with contextlib.suppress(BaseException):
        print(f"Exception ignored in: {where}", file=sys.stderr)
        traceback.print_exception(type(error), error, None, file=sys.stderr)


def _command(argv: list[str]) -> tuple[str, str, list[str], set[str]]:
    """(kind, module/code/script, ``sys.argv``, the options of ``-u`` and ``-B`` given) of
    ``[python, *options, ...]``. Any other option is refused: ``-I``, ``-E`` and ``-s`` change
    what the interpreter read as it started (its path, ``PYTHON*``, the user's site), which a
    child of the forkserver has read already."""
    args, options = list(argv[1:]), set()
    while args and args[0] in ("-u", "-B"):
        options.add(args.pop(0))
    if not args:
        raise ValueError(f"warm.Popen runs a module, code or a script, not {argv!r}")
    if args[0] == "-m":
        return "module", args[1], [args[1], *args[2:]], options
    if args[0] == "-c":
        return "code", args[1], ["-c", *args[2:]], options
    if args[0].startswith("-"):
        raise ValueError(f"warm.Popen does not take the interpreter option {args[0]!r}")
    return "script", args[0], args, options


class Popen:
    """``subprocess.Popen(argv, ...)`` for ``argv = [sys.executable, ...]``, forked warm (the module's
    docstring). ``stdout``/``stderr``/``stdin``: None (this process's), ``subprocess.PIPE`` (not for
    stdin), ``DEVNULL``, ``STDOUT`` (stderr), a file object or an fd. ``file_size``: ``ulimit -f`` in
    the child, in bytes (what ``helpers.file_size_limit`` does as a ``preexec_fn``, which cannot
    travel to a forked child); ``nice``: added to this process's niceness, which the child has, as a
    child of this process would, whatever the forkserver's (an early job's at 19 shares one at 0); ``death_signal``: the signal it gets
    when its parent, the forkserver, ends (which it does when the process that started it ends:
    Linux's parent-death signal); ``share_server``: the child's own :class:`Popen` forks from the
    same forkserver (an early job's launcher, whose scripts import torch too), not a new one;
    ``tied``: the reading end of a pipe whose writing end this process alone holds: the child is
    killed (SIGKILL, by the kernel: ``F_SETSIG``) when that end closes, when this process ends
    however it ends (a torchrun worker's stand-in: tests/warm_worker.py)."""

    def __init__(self, argv: list[str], *, cwd: Any = None, env: dict[str, str] | None = None, stdin: Any = None,
                 stdout: Any = None, stderr: Any = None, text: bool = False, universal_newlines: bool | None = None,
                 encoding: str | None = None, errors: str | None = None, start_new_session: bool = False,
                 process_group: int | None = None, file_size: int | None = None, nice: int = 0,
                 death_signal: int = 0, share_server: bool = False, tied: int | None = None) -> None:
        kind, what, child_argv, options = _command([str(a) for a in argv])
        server = _server()  # (started here if it was not, with tests/ on its path: _ensure_running)
        env = dict(os.environ if env is None else env)
        _refuse_what_it_cannot_read(env)
        cwd = os.path.abspath(os.fspath(cwd) if cwd is not None else os.getcwd())
        first = os.path.dirname(os.path.abspath(os.path.join(cwd, what))) if kind == "script" else (
            cwd if kind == "module" else "")
        spec = {"cwd": cwd, "env": env, "session": start_new_session, "group": process_group == 0,
                "file_size": file_size, "niceness": os.getpriority(os.PRIO_PROCESS, 0) + nice,
                "death_signal": death_signal, "shared": server._forkserver_pid if share_server else None,
                "kind": kind, "what": what, "argv": child_argv,
                "path": [first, *_fresh_path(str(argv[0]), env.get("PYTHONPATH"))],
                "unbuffered": "-u" in options or bool(env.get("PYTHONUNBUFFERED")),
                "dont_write_bytecode": "-B" in options or bool(env.get("PYTHONDONTWRITEBYTECODE"))}
        self.args, self.returncode = argv, None
        self.stdin = None
        text = bool(text or universal_newlines or encoding or errors)
        opened: list[int] = []  # (ours to close once the child has its copies)

        def fd_of(target: Any, name: str) -> int:
            if target is None:
                return {"stdin": 0, "stdout": 1, "stderr": 2}[name]
            if target == subprocess.DEVNULL:
                opened.append(os.open(os.devnull, os.O_RDWR))
                return opened[-1]
            if target == subprocess.PIPE:
                if name == "stdin":
                    raise ValueError("warm.Popen gives no pipe to stdin")
                read, write = os.pipe()
                opened.append(write)
                reader = open(read, "rb")  # noqa: SIM115 - the caller's, as Popen's pipes are
                setattr(self, name, io.TextIOWrapper(reader, encoding=encoding, errors=errors) if text else reader)
                return write
            return target if isinstance(target, int) else target.fileno()

        self.stdout = self.stderr = None
        fds = {"stdin": fd_of(stdin if stdin is not None else subprocess.DEVNULL, "stdin"),
               "stdout": fd_of(stdout, "stdout")}
        fds["stderr"] = fds["stdout"] if stderr == subprocess.STDOUT else fd_of(stderr, "stderr")
        if tied is not None:
            fds["tied"] = tied
        try:
            self._process = _context().Process(target=_child, args=(spec, {n: _Fd(fd) for n, fd in fds.items()}),
                                               daemon=False)
            with _main_left_out():
                self._process.start()
            # (as a subprocess.Popen's: this process's end neither waits for it nor ends it)
            multiprocessing.process._children.discard(self._process)
        finally:
            for fd in opened:
                os.close(fd)
        self.pid = self._process.pid
        self._out: dict[str, list] = {"stdout": [], "stderr": []}

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:  # noqa: A002
        """Read the pipes to their ends, then wait: (stdout, stderr), None for one not a pipe."""
        if input:
            raise ValueError("warm.Popen gives no pipe to stdin")
        deadline = None if timeout is None else time.monotonic() + timeout
        pipes = {name: f for name in ("stdout", "stderr") if (f := getattr(self, name)) is not None and not f.closed}
        with selectors.DefaultSelector() as selector:
            for name, f in pipes.items():
                os.set_blocking(f.fileno(), False)
                selector.register(f.fileno(), selectors.EVENT_READ, name)
            while selector.get_map():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                for key, _ in selector.select(left):
                    chunk = os.read(key.fd, 65536)
                    if chunk:
                        self._out[key.data].append(chunk)
                    else:
                        selector.unregister(key.fd)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        said = []
        for name in ("stdout", "stderr"):
            f = getattr(self, name)
            if f is None or name not in pipes:
                said.append(None)
                continue
            data = b"".join(self._out[name])
            self._out[name] = []
            said.append(data.decode(f.encoding, f.errors).replace("\r\n", "\n") if isinstance(f, io.TextIOWrapper)
                        else data)
            f.close()
        return said[0], said[1]

    def __enter__(self) -> Popen:
        return self

    def __exit__(self, *exc: object) -> None:
        for f in (self.stdout, self.stderr):
            if f is not None:
                f.close()
        self.wait()


def run(argv: list[str], *, timeout: float | None = None, capture_output: bool = False, **kwargs: Any,
        ) -> subprocess.CompletedProcess:
    """``subprocess.run`` of :class:`Popen` (``check`` and ``input`` aside): killed past ``timeout``."""
    if capture_output:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with Popen(argv, **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)
