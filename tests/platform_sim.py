"""Run Python as if on another platform, on Linux: what that platform lacks is taken away before
ampguard is imported (review 55a's harness, cut down). The third-party modules ampguard uses
(torch, numpy, yaml, pydantic, matplotlib) are imported first, whole, so that only ampguard's own
assumptions are tried. A simulation, not the platform: it removes exactly the names below, nothing
a real Windows or macOS would also change (path separators, file sharing, process creation).

Usage: ``python tests/platform_sim.py MODE[,MODE...] (-m MODULE | -c CODE | SCRIPT) [ARGS...]``

MODE:

- ``nofcntl``: :mod:`fcntl` cannot be imported (and ``resource``, ``pwd``, ``grp``, ``termios``).
- ``winsig``: :mod:`signal` without :data:`SIGNAL_NAMES`.
- ``winos``: :mod:`os` without :data:`OS_NAMES`.
- ``windirfd``: no ``dir_fd``: ``os.supports_dir_fd`` and ``os.supports_fd`` empty, a ``dir_fd=``
  (``src_dir_fd=``, ``dst_dir_fd=``) raises ``NotImplementedError``, ``os.listdir`` of a descriptor
  ``TypeError``, and ``os.open`` of a folder ``PermissionError``, as on Windows.
- ``winctypes``: ``ctypes.CDLL(None)`` raises ``TypeError``, as CPython's ``ctypes`` does on Windows.
- ``win``: all of the above.
- ``mac``: :mod:`os` without :data:`MAC_OS_NAMES`, and a C library without ``renameat2``
  (``ctypes.CDLL(None).renameat2`` raises ``AttributeError``). (``/proc`` stays: ampguard reads it
  only where it is there.)
"""

from __future__ import annotations

import ctypes
import importlib
import os
import runpy
import signal
import sys

SIGNAL_NAMES = ("SIGPIPE", "SIGKILL", "SIGXFSZ", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGCHLD",
                "pthread_sigmask", "pthread_kill", "sigtimedwait", "sigwait", "setitimer", "alarm", "siginterrupt",
                "SIG_BLOCK", "SIG_UNBLOCK", "SIG_SETMASK", "ITIMER_REAL")
"""What Windows' :mod:`signal` lacks of Linux's, of the names ampguard could use."""
OS_NAMES = ("geteuid", "getuid", "getgid", "getegid", "O_DIRECTORY", "O_NOFOLLOW", "O_PATH", "O_CLOEXEC",
            "O_NONBLOCK", "O_NOATIME", "sched_getaffinity", "fchown", "sync", "getpgid", "killpg", "setsid", "fork",
            "uname", "pathconf", "pread")
"""What Windows' :mod:`os` lacks of Linux's, of the names ampguard could use."""
MAC_OS_NAMES = ("O_PATH", "sched_getaffinity")
"""What macOS' :mod:`os` lacks of Linux's, of the names ampguard uses."""
MODULES = ("fcntl", "resource", "pwd", "grp", "termios")
"""The POSIX-only modules ``nofcntl`` makes unimportable."""
THIRD_PARTY = ("torch", "numpy", "yaml", "pydantic", "matplotlib.figure", "matplotlib.backends.backend_agg")
"""Imported before anything is taken away."""
_DIR_FD_FUNCTIONS = ("stat", "lstat", "open", "unlink", "replace", "rename", "readlink", "mkdir", "rmdir", "chmod")


def _without_dir_fd(fn):
    def wrapped(*args, **kwargs):
        if any(kwargs.get(k) is not None for k in ("dir_fd", "src_dir_fd", "dst_dir_fd")):
            raise NotImplementedError(f"{fn.__name__}: dir_fd unavailable on this platform")
        if fn.__name__ == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)) and os.path.isdir(args[0]):
            raise PermissionError(13, "Permission denied", os.fspath(args[0]))
        return fn(*args, **kwargs)
    wrapped.__name__ = fn.__name__
    return wrapped


def simulate(modes: set[str]) -> None:
    """Take away what the platforms in ``modes`` lack (see the module's docstring)."""
    if "win" in modes:
        modes |= {"nofcntl", "winsig", "winos", "windirfd", "winctypes"}
    if "nofcntl" in modes:
        for name in MODULES:
            sys.modules[name] = None  # (import raises ImportError)
    if "winsig" in modes:
        for name in SIGNAL_NAMES:
            if hasattr(signal, name):
                delattr(signal, name)
    if "winos" in modes:
        for name in OS_NAMES:
            if hasattr(os, name):
                delattr(os, name)
    if "windirfd" in modes:
        for name in _DIR_FD_FUNCTIONS:
            setattr(os, name, _without_dir_fd(getattr(os, name)))
        listdir = os.listdir

        def listdir_by_name(path="."):
            if isinstance(path, int):
                raise TypeError("listdir: path should be string, bytes, os.PathLike or None, not int")
            return listdir(path)
        os.listdir = listdir_by_name
        os.supports_dir_fd, os.supports_fd = set(), set()
        import shutil
        shutil._use_fd_functions = False  # (shutil's own choice on a platform without them)
    if "mac" in modes:
        for name in MAC_OS_NAMES:
            if hasattr(os, name):
                delattr(os, name)
        libc_of = ctypes.CDLL

        class WithoutRenameat2:
            def __init__(self, libc):
                self._libc = libc

            def __getattr__(self, name):
                if name == "renameat2":
                    raise AttributeError(name)
                return getattr(self._libc, name)

        ctypes.CDLL = lambda name, *a, **k: WithoutRenameat2(libc_of(name, *a, **k)) if name is None \
            else libc_of(name, *a, **k)
    if "winctypes" in modes:
        cdll = ctypes.CDLL

        def windows_cdll(name, *args, **kwargs):
            if name is None:
                raise TypeError("argument of type 'NoneType' is not iterable")
            return cdll(name, *args, **kwargs)
        ctypes.CDLL = windows_cdll


def main(argv: list[str]) -> None:
    os.environ.setdefault("MPLBACKEND", "Agg")
    for module in THIRD_PARTY:  # (first, whole: their own platform code is not what is tried)
        importlib.import_module(module)
    sys.modules["torch"].set_num_threads(1)
    simulate(set(argv[0].split(",")))
    what, rest = argv[1], argv[2:]
    if what == "-m":
        sys.argv = [rest[0], *rest[1:]]
        runpy.run_module(rest[0], run_name="__main__", alter_sys=True)
    elif what == "-c":
        sys.argv = ["-c", *rest[1:]]
        exec(compile(rest[0], "<platform_sim -c>", "exec"), {"__name__": "__main__"})
    else:
        sys.argv = [what, *rest]
        runpy.run_path(what, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
