"""The run folder: where a run writes what (paths), and what a finished run hands back (result).

``runs/<name>/`` holds ``RUN.md``, ``steps.csv``, ``events.jsonl``, ``report.png``,
``config.yaml``, ``run-id``, ``checkpoints/`` (and ``steps.jsonl``, ``tensorboard/`` when asked
for). ``run-id`` is the folder's identity (32 hex digits, written when the run opens its outputs):
every checkpoint carries it, and ``--resume`` refuses a checkpoint of another run. While a
process trains in it, it holds ``.ampguard.lock`` (:meth:`RunPaths.lock`). A demo writes
at most a CSV: its :class:`RunPaths` has no folder. :mod:`ampguard.report` reads these names from
here; nothing here imports the training loop.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import os
import re
import shutil
import socket
import stat
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import Config, dump_config
from .errors import AmpguardWarning, ExitCode, InputError, failed_because, name_too_long, shortened, shown, warn
from .files import (STALE_AFTER_S, DiskFull, _running, _temporary_name, is_temporary, left_by_an_ended_process,
                    make_parents, my_uid, rename_onto_nothing, replace_atomically)

if TYPE_CHECKING:  # (none imported at run time: `train --print-config` refuses a taken folder without torch)
    import torch

    from .monitor import RunMonitor

try:
    import fcntl
except ImportError:  # not a POSIX system (Windows): run folders go unlocked, said once (RunPaths.lock)
    fcntl = None  # type: ignore[assignment]
_SAID_UNLOCKED = [False]
"""Whether :meth:`RunPaths.lock` has said that run folders go unlocked here (no ``fcntl``): once a process."""

LOCK_FILE = ".ampguard.lock"
"""Held (``flock``) by the process that trains in a run folder, with its pid, its host's name and
its kernel's boot id in it (:func:`_holder_line`); the kernel lets go of it when that process
ends, however it ends."""

Holder = tuple[str | None, str | None, str | None]
"""What a lock file names (:func:`_holder_in`): its holder's pid, host name and kernel boot id."""

LOCK_PATIENCE_S = 0.15
"""How long :meth:`RunPaths.lock` tries again before it refuses: a reader's look at the lock
(:meth:`RunPaths.writer`) holds it shared for microseconds, a run that trains for its whole run."""
MAX_RETAKES = 100
"""How many times :meth:`RunPaths.lock` takes the lock again on the file the folder names once the
one it locked was let go and removed meanwhile (a race resolves in one or two; a file system whose
stat and fstat never agree would loop)."""


def taken(run_dir: Path, why: str = "") -> InputError:
    """The refusal of a new run in a folder that exists (a run's folder is its own)."""
    return InputError(f"run folder {run_dir} already exists; choose another log.name{why}")


@dataclass
class RunPaths:
    """What a run writes. A demo has only (maybe) a CSV; a train run has a folder with all of it.

    Example::

        >>> p = RunPaths.existing(Path("runs/a"))
        >>> p.csv.as_posix(), p.card.as_posix(), RunPaths().card is None
        ('runs/a/steps.csv', 'runs/a/RUN.md', True)
    """

    csv: Path | None = None
    dir: Path | None = None
    created: list[Path] = field(default_factory=list, repr=False, compare=False)
    """The folders :meth:`new_run_dir` made (parents first), for :meth:`remove_unused`."""
    _lock: int | None = field(default=None, repr=False, compare=False)
    """The descriptor of the held :data:`LOCK_FILE` (:meth:`lock`), or None."""

    def _in_dir(self, name: str) -> Path | None:
        return self.dir / name if self.dir is not None else None

    @property
    def events(self) -> Path | None:
        return self._in_dir("events.jsonl")

    @property
    def steps_jsonl(self) -> Path | None:
        return self._in_dir("steps.jsonl")

    @property
    def plot(self) -> Path | None:
        return self._in_dir("report.png")

    @property
    def card(self) -> Path | None:
        return self._in_dir("RUN.md")

    @property
    def config(self) -> Path | None:
        return self._in_dir("config.yaml")

    @property
    def tensorboard(self) -> Path | None:
        return self._in_dir("tensorboard")

    @property
    def checkpoints(self) -> Path | None:
        return self._in_dir("checkpoints")

    @property
    def id_file(self) -> Path | None:
        return self._in_dir(RUN_ID_FILE)

    @classmethod
    def existing(cls, run_dir: Path) -> RunPaths:
        """The paths of the run folder ``run_dir`` (nothing is created)."""
        return cls(csv=run_dir / "steps.csv", dir=run_dir)

    @classmethod
    def new_run_dir(cls, config: Config, on_made: Callable[[RunPaths], None] | None = None, *,
                    lock: bool = False) -> RunPaths:
        """Create the run folder ``log.dir/log.name`` (a timestamp by default), never reusing one,
        with the effective config and the run id in it. When that fails it is one :class:`InputError`
        line, and the folders it created are removed again (the run folder; ``log.dir`` and its
        parents while empty: a run started beside this one may have put its folder there).
        ``on_made`` is told the paths as soon as the folder is at its name (a caller that takes an
        unused folder back after a Ctrl-C knows it even if the signal lands before this returns).

        The folder is made under a temporary name beside it (``.new-run.tmp-PID-RANDOM``), its
        ``config.yaml`` and ``run-id`` written there, and renamed into place only then, onto a name
        that must not exist (:func:`~ampguard.files.rename_onto_nothing`): a process killed in
        between (SIGKILL runs no taking back) leaves no folder at the name. (Review 54c: it made
        ``runs/NAME`` first, and a kill before its ``config.yaml`` left it empty, or holding the
        dead process's ``.config.yaml.tmp-*``: a rerun was refused the name, ``report`` found no
        CSV.) Such a leftover, hidden, is removed by a later start-up in ``log.dir``
        (:func:`_remove_abandoned`). A stop signal while it is made takes back what it made.
        ``lock``: the folder is locked (:meth:`lock`) before it is renamed into place, so it is
        held at its name for as long as its process lives; a folder at the name that holds
        nothing of a run (:func:`_killed_start`: a start-up killed after the rename, before its
        logs opened), whose lock nobody holds, taken under this kernel or naming a process of this
        host that runs no more (:func:`_ended_here`), is taken, with a warning line.

        Example (``log.dir`` under a file: nothing is left behind)::

            >>> import shutil, tempfile
            >>> from ampguard.config import validate
            >>> root = Path(tempfile.mkdtemp())
            >>> _ = (root / "a-file").write_text("")
            >>> for log_dir in (root / "a-file" / "runs", root / "runs" / ("x" * 300)):
            ...     try:
            ...         RunPaths.new_run_dir(validate({"log": {"dir": str(log_dir), "name": "a"}}))
            ...     except InputError as err:
            ...         print(str(err).replace(str(root), "ROOT")[:60])
            cannot create run folder ROOT/a-file/runs/a: Not a directory
            cannot create run folder ROOT/runs/xxxxxxxxxxxxxxxxxxxxxxxxx
            >>> sorted(p.name for p in root.iterdir())  # no empty runs/ left behind
            ['a-file']
            >>> paths = RunPaths.new_run_dir(validate({"log": {"dir": str(root / "runs"), "name": "a"}}))
            >>> sorted(p.name for p in paths.dir.iterdir()), sorted(p.name for p in (root / "runs").iterdir())
            (['config.yaml', 'run-id'], ['a'])
            >>> shutil.rmtree(root)
        """
        if config.log.name:
            names = iter([config.log.name])
        else:  # a timestamp, made unique when another run started in the same second
            stamp = _stamp()
            names = itertools.chain([stamp], (f"{stamp}-{n}" for n in itertools.count(2)))
        run_dir = Path(config.log.dir) / next(names)
        if config.log.name:
            _refuse_taken(run_dir)
        created: list[Path] = []
        staged: RunPaths | None = None
        run_id: str | None = None
        handed = False
        try:
            make_parents(run_dir, created)
            _remove_abandoned(run_dir.parent)
            staging = run_dir.with_name(_temporary_name(STAGING))
            # (known before it is made: review 54l, a stop signal as mkdir returned left it, and runs/ with it;
            # its name is this process's alone, PID-RANDOM, so whatever is there is its own)
            staged = cls(csv=staging / "steps.csv", dir=staging)
            try:
                staging.mkdir()
            except FileNotFoundError:  # a parent another run made, then took back unused, meanwhile
                make_parents(run_dir, created)
                staging.mkdir()
            if lock:  # (held at its name from its first moment there: never taken for a killed start's)
                staged.lock()
            staged.write_config(config)
            run_id = staged.ensure_run_id()  # (here: a disk full by then was a traceback from the run's open)
            while True:  # into place: never onto a folder another run made, even a moment ago
                try:
                    rename_onto_nothing(staging, run_dir)
                    break
                except FileExistsError:
                    if config.log.name:
                        if _take_killed_start(run_dir):
                            continue
                        raise taken(run_dir) from None
                    run_dir = run_dir.parent / next(names)
            created.append(run_dir)
            paths = cls(csv=run_dir / "steps.csv", dir=run_dir, created=created, _lock=staged._lock)
            if on_made is not None:
                on_made(paths)
            handed = True
        except BaseException as err:  # (a stop signal too: what is not handed over yet is taken back here)
            if not handed:  # (removed while still held, then let go: review 54l, let go first, the folder at
                # its name was a killed start-up's to a same-name start-up, which took it over, and the removal
                # here, its run id read a moment before, deleted that run's live folder)
                _remove_staged(staged, run_dir, run_id, created)
                if staged is not None:
                    staged.unlock()
            if isinstance(err, InputError) or not isinstance(err, (OSError, ValueError, DiskFull)):
                raise
            err = err.error if isinstance(err, DiskFull) else err  # (replace_atomically names a full disk DiskFull)
            why = failed_because(err)
            raise InputError(f"cannot create run folder {run_dir}: {why}") from None
        return paths

    @staticmethod
    def check_new(config: Config) -> None:
        """What :meth:`new_run_dir` would refuse, found without making anything, so that ``train``
        refuses it before it builds the task and the model (a second of work, and torch's import,
        for a refusal): the folder ``log.name`` names exists (a run's: a killed start-up's is taken
        over, as :meth:`new_run_dir` does), or ``log.dir`` cannot hold a new folder (a file on its
        way, a link on it that leads nowhere or round in a loop, a name or path longer than the
        file system takes, a folder that cannot be written or searched: the lines
        :meth:`new_run_dir` says, the folder named as it names it, a timestamp without
        ``log.name``). What it finds only as it makes the folder (a full disk, a run that takes the
        name meanwhile) it still refuses then.

        Example::

            >>> import shutil, tempfile
            >>> from ampguard.config import validate
            >>> root = Path(tempfile.mkdtemp())
            >>> _ = (root / "a-file").write_text("")
            >>> (root / "runs" / "a").mkdir(parents=True)
            >>> for log_dir, name in ((root / "a-file" / "runs", "a"), (root / "runs", "a"), (root / "runs", "b")):
            ...     try:
            ...         RunPaths.check_new(validate({"log": {"dir": str(log_dir), "name": name}}))
            ...     except InputError as err:
            ...         print(str(err).replace(str(root), "ROOT"))
            cannot create run folder ROOT/a-file/runs/a: Not a directory
            run folder ROOT/runs/a already exists; choose another log.name
            >>> shutil.rmtree(root)
        """
        run_dir = Path(config.log.dir) / (config.log.name or _stamp())  # (named as the making names it)
        if config.log.name:
            _refuse_taken(run_dir)
        # the deepest folder on the way that is there: a link there that leads nowhere (or round in a
        # loop) is what the making meets as it makes the folder below it, a missing one or a loop
        there = next(folder for folder in run_dir.parents if os.path.lexists(folder) or folder == Path(folder.anchor))
        try:
            problem = errno.ENOTDIR if not stat.S_ISDIR(os.stat(there).st_mode) else None
        except OSError as err:
            problem = err.errno
        if problem is None and any(name_too_long(there, part) for part in run_dir.relative_to(there).parts):
            problem = errno.ENAMETOOLONG  # (as errors.as_made finds it: NAME_MAX, or on Windows NTFS's 255)
        if problem is None and not os.access(there, os.W_OK | os.X_OK):  # (as check_writable, a resume's)
            problem = errno.EACCES
        if problem is not None:
            raise InputError(f"cannot create run folder {run_dir}: {os.strerror(problem)}")

    def lock(self) -> None:
        """Hold the run folder for this process: one :class:`InputError` line when another process
        holds it (a run still training, whose ``--resume`` would cut its CSV and set its newer
        checkpoints aside while it goes on writing them: rows lost, silently). The lock is the
        kernel's (``flock`` on :data:`LOCK_FILE`), so a process that dies, even by SIGKILL,
        leaves none behind; a file system that has no locks (some network mounts) goes unlocked.
        So does every folder where Python has no ``fcntl`` (Windows): one warning line says so, the
        first time a process would lock one.
        A reader's look at the lock (:meth:`writer`) is waited out (:data:`LOCK_PATIENCE_S`).
        :meth:`unlock` lets go. Nothing for a run with no folder (a demo).

        Example::

            >>> import tempfile
            >>> paths = RunPaths.existing(Path(tempfile.mkdtemp()))
            >>> paths.lock()
            >>> try:  # another holder (a lock is the open file's: a second open is another holder)
            ...     RunPaths.existing(paths.dir).lock()
            ... except InputError as err:
            ...     print(str(err).replace(str(paths.dir), "RUN"))  # doctest: +ELLIPSIS
            run folder RUN is being written by another process (pid ...): wait for it to end, or stop it, ...
            >>> paths.unlock(); sorted(p.name for p in paths.dir.iterdir())  # taken back, the file too
            []
            >>> paths.dir.rmdir()
        """
        if self.dir is None or self._lock is not None:
            return
        if fcntl is None:
            if not _SAID_UNLOCKED[0]:
                _SAID_UNLOCKED[0] = True
                warn("run folders are not locked on this platform (Python has no fcntl): a second "
                     "process could write the same run folder; resume or train in one folder one "
                     "process at a time", AmpguardWarning, stacklevel=2)
            return
        path = self.dir / LOCK_FILE
        # a reader's look (writer(): report, compare) holds a shared lock for microseconds: tried again for a
        # moment before the refusal (review 52c: a resume beside a polling report was refused, naming a dead pid)
        patience, retakes = time.monotonic() + LOCK_PATIENCE_S, 0
        while True:
            fd = _open_lock(path)
            if fd is None:
                return  # a folder that cannot be written: what the run writes says so, in its words
            held = _flock_exclusive(fd, patience)
            if held is None:  # no locks on this file system: unlocked, as before
                os.close(fd)
                return
            if not held:
                holder = _holder_in(fd)
                os.close(fd)
                raise self._busy(holder)
            if _names(path, fd) or retakes >= MAX_RETAKES:  # (a file system whose stat and fstat never agree: held
                break  # as before, not a loop for ever, review 52l; counted, not timed: a holder letting go at the
            retakes += 1  # patience's end left a second writer, review 52n)
            # the holder let go and took its file away (unlock) while this one waited on it: the lock held
            # is of a file no longer there, beside which a third process makes and holds a new one (review
            # 52j: two writers of one folder); the lock is taken again on the file the folder names
            os.close(fd)
            time.sleep(0.001)
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.write(fd, _holder_line().encode("utf-8", "surrogateescape"))
        self._lock = fd

    def _busy(self, holder: Holder) -> InputError:
        named = _holder_named(holder)
        held = f" ({named})" if named else ""
        return InputError(f"run folder {self.dir} is being written by another process{held}: wait for it to end, "
                          "or stop it, before you resume it")

    def check_not_written(self) -> None:
        """One :class:`InputError` line while another process trains in this folder (:meth:`writer`),
        the one :meth:`lock` gives: a resume says so before it looks for a checkpoint (a run
        still in its first steps has none yet, and "no checkpoint" sent the user looking for one)."""
        holder = self._live_holder()
        if holder is not None:
            raise self._busy(holder)

    def writer(self) -> str | None:
        """The pid of the process that trains in this folder now (it holds :meth:`lock`), ``"?"``
        where its lock file names none, or None: nobody does, or it cannot be told (no lock file,
        a file system without locks). Takes no lock itself. What ``report`` and ``compare`` ask
        before they read a run as if it had ended (:meth:`writer_named`: in their words).

        Example::

            >>> import tempfile
            >>> paths = RunPaths.existing(Path(tempfile.mkdtemp()))
            >>> paths.writer() is None
            True
            >>> paths.lock(); RunPaths.existing(paths.dir).writer() == str(os.getpid())  # (a second open: held)
            True
            >>> paths.unlock(); paths.dir.rmdir()
        """
        holder = self._live_holder()
        return None if holder is None else holder[0] or "?"

    def writer_named(self) -> str | None:
        """:meth:`writer` in a message's words: ``pid N``, ``on HOST`` after it where its lock names
        a host other than this one (:func:`_holder_named`, as the takeover's refusal names it),
        ``pid ?`` where it names no pid; None when nobody writes the folder (or it cannot be told).

        Example::

            >>> import tempfile
            >>> paths = RunPaths.existing(Path(tempfile.mkdtemp()))
            >>> paths.lock(); RunPaths.existing(paths.dir).writer_named() == f"pid {os.getpid()}"  # (this host's)
            True
            >>> paths.unlock(); paths.dir.rmdir()
        """
        holder = self._live_holder()
        return None if holder is None else _holder_named(holder) or "pid ?"

    def _live_holder(self) -> Holder | None:
        """What the lock file of the process that trains in this folder now names (:func:`_holder_in`),
        or None when nobody does or it cannot be told (:meth:`writer`)."""
        if self.dir is None or fcntl is None:
            return None
        fd = _open_to_read(self.dir / LOCK_FILE)
        if fd is None:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return _holder_in(fd)
            except OSError:
                return None
            return None  # (got it: nobody holds it; closing lets go)
        finally:
            os.close(fd)

    def unlock(self) -> None:
        """Let go of :meth:`lock`: the file is removed while still held (a process that opened it
        before then finds it held; one after, a new file), then closed. Nothing if not held."""
        fd, self._lock = self._lock, None
        if fd is None or self.dir is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.dir / LOCK_FILE)
        os.close(fd)

    def remove_unused(self) -> bool:
        """Take back a new run folder that a refusal stopped before it held anything of a run
        (a tracker that refused at its open, a Ctrl-C in the start-up): the folders
        :meth:`new_run_dir` made, when the run folder holds nothing but ``config.yaml``,
        ``run-id`` and W&B's own ``wandb/`` (its run opened before the stop; no step was
        logged: kept, it left a folder no resume could use and no new run could take). True
        when it did.

        Example::

            >>> import shutil, tempfile
            >>> from ampguard.config import validate
            >>> root = Path(tempfile.mkdtemp())
            >>> paths = RunPaths.new_run_dir(validate({"log": {"dir": str(root / "runs"), "name": "a"}}))
            >>> _ = paths.ensure_run_id()
            >>> paths.remove_unused(), sorted(p.name for p in root.iterdir())  # runs/ was made for it too
            (True, [])
            >>> paths = RunPaths.new_run_dir(validate({"log": {"dir": str(root / "runs"), "name": "w"}}))
            >>> (paths.dir / "wandb" / "offline-run-1").mkdir(parents=True)  # (W&B opened, then the stop)
            >>> paths.remove_unused(), (root / "runs").exists()
            (True, False)
            >>> paths = RunPaths.new_run_dir(validate({"log": {"dir": str(root / "runs"), "name": "b"}}))
            >>> _ = paths.csv.write_text("step\\n")
            >>> paths.remove_unused(), sorted(p.name for p in paths.dir.iterdir())  # it has records: kept
            (False, ['config.yaml', 'run-id', 'steps.csv'])
            >>> shutil.rmtree(root)
        """
        if not self.created or self.dir is None:
            return False
        try:
            names = {p.name for p in self.dir.iterdir()}
            if {n for n in names if not is_temporary(n)} - UNUSED:
                return False  # (a write cut short leaves its .NAME.tmp-PID: nothing of a run either)
        except OSError:
            return False
        _remove_created(self.created, self.dir)
        self.created = []
        return True

    def write_config(self, config: Config) -> None:
        """``config.yaml``, replaced atomically (a resumed run may have changed ``steps``)."""
        if self.config is not None:
            replace_atomically(self.config, dump_config(config))

    def run_id(self) -> str | None:
        """The run folder's id (its ``run-id`` file), None when it has none (a folder made before
        run ids, or no folder); one :class:`InputError` line when the file is not an id.

        Example::

            >>> import shutil, tempfile
            >>> paths = RunPaths.existing(Path(tempfile.mkdtemp()))
            >>> paths.run_id() is None, RunPaths().run_id() is None
            (True, True)
            >>> made = paths.ensure_run_id()
            >>> len(made), paths.run_id() == made == paths.ensure_run_id()  # made once, then read
            (32, True)
            >>> _ = paths.id_file.write_text("../../etc/passwd")
            >>> try:
            ...     paths.run_id()
            ... except InputError as err:
            ...     print(str(err).replace(str(paths.dir), "RUN"))
            RUN/run-id: not a run id (expected 32 hex digits)
            >>> shutil.rmtree(paths.dir)
        """
        path = self.id_file
        if path is None or not (path.exists() or path.is_symlink()):
            return None
        try:
            with path.open("rb") as f:
                text = f.read(100).decode("ascii").strip()
        except (OSError, UnicodeDecodeError):
            text = ""
        if not RUN_ID_PATTERN.fullmatch(text):
            raise InputError(f"{path}: not a run id (expected 32 hex digits)")
        return text

    def ensure_run_id(self) -> str | None:
        """The run folder's id, made (a random uuid4, written atomically) if it has none yet;
        None without a folder. Called when a run opens its outputs, new or resumed."""
        if self.dir is None or self.id_file is None:
            return None
        found = self.run_id()
        if found is not None:
            return found
        made = uuid.uuid4().hex
        replace_atomically(self.id_file, made + "\n")
        return made

    def check_writable(self) -> None:
        """One :class:`InputError` line naming the run folder when it, or anything in it a run
        writes, cannot be written (a read-only folder or file system): what ``--resume`` checks
        before it reads or changes anything.

        Example::

            >>> import shutil, tempfile
            >>> paths = RunPaths.existing(Path(tempfile.mkdtemp()))
            >>> paths.check_writable()
            >>> paths.card.mkdir()
            >>> try:
            ...     paths.check_writable()
            ... except InputError as err:
            ...     print(str(err).split(": ", 1)[1])
            RUN.md is not a file; a resumed run writes it, so it must be one or not exist
            >>> shutil.rmtree(paths.dir)
        """
        if self.dir is None:
            return
        folders = (self.dir, self.checkpoints, self.tensorboard)
        for path in (*folders, self.csv, self.events, self.steps_jsonl, self.card, self.plot, self.config, self.id_file):
            if path is None or not path.exists():
                continue
            if path.is_dir() != (path in folders) or not (path.is_dir() or path.is_file()):
                # (what the run writes must be what it writes: a folder named RUN.md fails at the end)
                should = "a folder" if path in folders else "a file"
                raise InputError(f"run folder {self.dir}: {path.name} is not {should}; "
                                 "a resumed run writes it, so it must be one or not exist")
            mode = os.W_OK | os.X_OK if path.is_dir() else os.W_OK
            if not os.access(path, mode):
                what = "it" if path == self.dir else f"{path.name} in it"
                raise InputError(f"run folder {self.dir} is read-only ({what} cannot be written); "
                                 "a resumed run writes its CSV, events and checkpoints there")


RUN_ID_FILE = "run-id"
"""The file in a run folder that holds its id."""
RUN_ID_PATTERN = re.compile(r"[0-9a-f]{32}")
"""A run id as ``run-id`` holds it and checkpoints carry it: a uuid4's 32 hex digits."""


def _stamp() -> str:
    """A new run folder's name when ``log.name`` gives none: the time it starts."""
    return time.strftime("%Y%m%d-%H%M%S")


def _refuse_taken(run_dir: Path) -> None:
    """Refuse a new run at ``run_dir`` that exists (:func:`taken`; a killed start-up's is taken
    over), or whose look fails: a path longer than the OS takes, a folder on the way that cannot
    be searched; one line, as the making says it (it was a raw ``OSError``: a traceback from the
    library, under torchrun rank 0's alone)."""
    try:
        there = run_dir.exists()
    except OSError as err:
        raise InputError(f"cannot create run folder {run_dir}: {failed_because(err)}") from None
    if there and not _killed_start(run_dir):
        raise taken(run_dir, _kept_because(run_dir))


def _open_lock(path: Path) -> int | None:
    """The run folder's lock file opened (made if missing) for :meth:`RunPaths.lock`, never through
    a link; None where the folder cannot be written. One :class:`InputError` line for a link or
    anything but a regular file there."""
    try:  # (never through a link: the pid would be written into whatever it names)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise InputError(f"{path} is a symbolic link; remove it (ampguard keeps its lock there)") from None
        if err.errno == errno.EISDIR:  # (review 52a: read as a folder that cannot be written, the run went on
            # unlocked, and a second resume cut the first one's CSV while it wrote)
            raise InputError(f"{path} is not a regular file; remove it (ampguard keeps its lock there)") from None
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise InputError(f"{path} is not a regular file; remove it (ampguard keeps its lock there)")
    return fd


def _open_to_read(path: Path) -> int | None:
    """A lock file opened to look at its lock or read its holder (never through a link, never
    waiting on a pipe), or None where there is none to open."""
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None


def _flock_exclusive(fd: int, deadline: float) -> bool | None:
    """Hold the lock of the file open at ``fd``, tried again until ``deadline`` (``time.monotonic``)
    while another holds it: a reader's look (:meth:`RunPaths.writer`: ``report``, ``compare``)
    holds it shared for microseconds. True: held; False: still another's at the deadline; None: a
    file system without locks."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        except OSError:
            return None


def _names(path: Path, fd: int) -> bool:
    """Whether ``path`` still names the file open at ``fd`` (not removed, nor replaced by another)."""
    try:
        now = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    held = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def _holder_line() -> str:
    """What a lock's holder writes in its file: ``PID HOST``, and on Linux a second line,
    ``kernel BOOT_ID``, the running kernel's boot id (:func:`_kernel_boot`)."""
    boot = _kernel_boot()
    return f"{os.getpid()} {socket.gethostname()}\n" + (f"kernel {boot}\n" if boot else "")


@functools.cache
def _kernel_boot() -> str | None:
    """This kernel's boot id (Linux's ``/proc/sys/kernel/random/boot_id``; None elsewhere): the
    same in every container on the machine, another after a reboot and on another machine."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as file:
            return file.read().strip() or None
    except (OSError, ValueError):
        return None


def _holder_of(run_dir: Path) -> Holder | None:
    """:func:`_holder_in` of ``run_dir``'s lock file, or None where it has none to read."""
    fd = _open_to_read(run_dir / LOCK_FILE)
    if fd is None:
        return None
    try:
        return _holder_in(fd)
    finally:
        os.close(fd)


def _holder_in(fd: int) -> Holder:
    """The pid, the host's name and the kernel's boot id a lock file's holder wrote in it
    (:meth:`RunPaths.lock`: :func:`_holder_line`; an older ampguard's, the pid alone), each None
    where it holds none. A pid is ASCII digits (review 54r: ``²`` passed ``isdigit()`` and its
    ``int()`` was a traceback)."""
    first, _, rest = _read_start(fd, 1024).decode("utf-8", "surrogateescape").partition("\n")
    words = first.split(maxsplit=1)
    pid = words[0] if words and words[0].isascii() and words[0].isdigit() else None
    host = words[1] if pid is not None and len(words) > 1 else None
    kernel = rest.partition("\n")[0].removeprefix("kernel ").strip() if rest.startswith("kernel ") else None
    return pid, host, kernel or None


def _read_start(fd: int, size: int) -> bytes:
    """Up to ``size`` bytes from the start of the file ``fd`` is open on, its offset left where it
    was: ``os.pread``, or where there is none (Windows: reached for a lock file a Linux run left in
    a folder, review 55o) a seek to the start, a read, and a seek back."""
    pread = getattr(os, "pread", None)
    if pread is not None:
        return pread(fd, size, 0)
    at = os.lseek(fd, 0, os.SEEK_CUR)
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        return os.read(fd, size)
    finally:
        os.lseek(fd, at, os.SEEK_SET)


def _holder_named(holder: Holder) -> str | None:
    r"""The process a lock file names (:func:`_holder_in`) in a message's words: ``pid N``, with
    ``on HOST`` where the host it names is not this one (another machine's, another container's:
    its pid means nothing here), escaped and shortened (a lock file's text is any bytes); None
    where it names no pid. Every message that names a folder's holder names it so.

    Example::

        >>> _holder_named(("12", "gpu-node-7", None)), _holder_named(("12", socket.gethostname(), None))
        ('pid 12 on gpu-node-7', 'pid 12')
        >>> print(_holder_named(("12", "a\x1bb", None)), _holder_named((None, None, None)))
        pid 12 on 'a\x1bb' None
    """
    pid, host, _ = holder
    if pid is None:
        return None
    elsewhere = host is not None and host != socket.gethostname()
    return f"pid {pid}" + (f" on {shortened(shown(host), 80)}" if elsewhere else "")


def _ended_here(holder: Holder) -> bool:
    """Whether the ``holder`` a lock file names (:func:`_holder_in`), a lock nobody holds now (the
    caller's look), has ended, as far as this machine can tell. Written under this very kernel (its boot id,
    :func:`_kernel_boot`): yes, ``flock`` is that kernel's own and tells (containers share it,
    whatever their host names and pid namespaces: review 54r, a new container's rerun, or a
    restarted one's whose ampguard is pid 1 again, was refused the name for good). Else (another
    machine's, or a lock from before a reboot or without a boot id): only a process of this host
    that runs no more (review 54t: not this one's own pid taken for ended: a container on
    another machine sharing the folder, of the same host name, runs ampguard as pid 1 too; review 54l: some shared file systems keep each
    machine's locks to itself, Lustre ``localflock``, NFS ``local_lock``; a start-up on another
    machine shows no holder here, and its live folder was taken)."""
    pid, host, kernel = holder
    if kernel is not None and kernel == _kernel_boot():
        return True
    return pid is not None and host == socket.gethostname() and not _running(pid)


def _kept_because(run_dir: Path) -> str:
    """Why a folder at a new run's name that holds nothing of a run is not taken over (review 54r:
    the refusal said only "already exists"): a clause for :func:`taken`, "" for any other folder."""
    holder = _holder_of(run_dir)
    if holder is None or not _mine_holding_nothing(run_dir) or RunPaths.existing(run_dir).writer() is not None:
        return ""
    return (f" (it holds nothing of a run, only what a start-up leaves before its logs open, and its lock names "
            f"{_holder_named(holder) or 'a process'}, of another machine or from before this one's last start, or an older ampguard's, which "
            f"cannot be told here to have ended: remove the folder if that start-up runs no more)")


def _remove_staged(staged: RunPaths | None, run_dir: Path, run_id: str | None, created: list[Path]) -> None:
    """Undo a :meth:`RunPaths.new_run_dir` that failed or was stopped before it handed its folder
    over: the folder it staged, or, renamed already (a signal just after the rename), the run
    folder that holds its ``run_id``; then the parents it made, while empty."""
    if staged is not None and staged.dir is not None and staged.dir.is_dir():
        shutil.rmtree(staged.dir, ignore_errors=True)
    elif run_id is not None and run_dir not in created:
        with contextlib.suppress(InputError, OSError):
            if RunPaths.existing(run_dir).run_id() == run_id:  # (this process's: a run id is never another's)
                created.append(run_dir)
    _remove_created(created, run_dir)


UNUSED = frozenset({"config.yaml", "run-id", "wandb", LOCK_FILE})
"""What a new run folder holds before its logs open: nothing of a run (:meth:`RunPaths.remove_unused`,
:func:`_killed_start`). (Its lock: a run taking its own folder back holds it until the folder is gone.)"""


def _killed_start(run_dir: Path) -> bool:
    """Whether ``run_dir`` is what a ``train`` start-up killed (SIGKILL: no taking back) before its
    logs opened left: a real folder of this user's (review 54l: another user's was taken where
    its lock file could be opened, by root or a shared group, as :func:`_remove_abandoned` never
    does) that holds nothing of a run (:func:`_holds_nothing`), whose lock nobody holds (a live
    start-up holds it from before its folder took the name: ``new_run_dir(lock=True)``) and that
    was taken under this kernel or names a process of this host that runs no more
    (:func:`_ended_here`: ``flock`` alone is not trusted across machines). Review 54c: such a
    folder took the name for good."""
    if not _mine_holding_nothing(run_dir):
        return False
    holder = _holder_of(run_dir)
    return holder is not None and _ended_here(holder) and RunPaths.existing(run_dir).writer() is None


def _mine_holding_nothing(run_dir: Path) -> bool:
    """Whether ``run_dir`` is a real folder (not a link) of this user's that holds nothing of a run
    (:func:`_holds_nothing`)."""
    try:
        seen = os.lstat(run_dir)
    except OSError:
        return False
    return stat.S_ISDIR(seen.st_mode) and seen.st_uid == my_uid() and _holds_nothing(run_dir)


def _holds_nothing(run_dir: Path) -> bool:
    """Whether the folder ``run_dir`` holds only :data:`UNUSED` names and temporary files of ended
    processes, each of the kind a start-up makes (``wandb`` a folder, all else regular files:
    review 54l, a folder named ``config.yaml`` was removed with what it held), with a sign that
    an ampguard process that ended made it: its lock file (a live ``train`` holds it; one that
    ended normally removed it) or such a temporary file (an older ampguard's, killed as it wrote
    ``config.yaml``). A folder without either (an empty one; one a
    :class:`~ampguard.trainer.Trainer` of the API, which takes no lock, is opening) is not."""
    try:
        names = os.listdir(run_dir)
        kinds = {n: stat.S_IFMT(os.lstat(run_dir / n).st_mode) for n in names}
    except OSError:
        return False
    left = {n for n in names if is_temporary(n) and left_by_an_ended_process(n)}
    if set(names) - left - UNUSED or not (LOCK_FILE in names or left):
        return False
    return all(kind == (stat.S_IFDIR if name == "wandb" else stat.S_IFREG) for name, kind in kinds.items())


def _take_killed_start(run_dir: Path) -> bool:
    """Remove ``run_dir`` when it is a killed start-up's (:func:`_killed_start`), judged again under
    its lock (held while it is moved aside, as ``.new-run.tmp-PID-RANDOM`` of this process, and removed),
    with a warning line naming it; True when the name is free now. Nothing where locks are not kept.
    A reader's look at the lock (``report``, ``compare``) is waited out as :meth:`RunPaths.lock` does."""
    if fcntl is None or not _killed_start(run_dir):
        return False
    try:
        fd = _open_lock(run_dir / LOCK_FILE)
    except InputError:  # (a link or a folder at the lock's name: not a folder ampguard left)
        return False
    if fd is None:
        return False
    try:
        # (a reader's look waited out, review 54l: tried once, a rerun beside a polling report was refused)
        if not _flock_exclusive(fd, time.monotonic() + LOCK_PATIENCE_S):  # (held still: its start-up lives; or no locks)
            return False
        holder = _holder_in(fd)
        # (judged again, held: its lock's file still the folder's)
        if not _names(run_dir / LOCK_FILE, fd) or not _mine_holding_nothing(run_dir) or not _ended_here(holder):
            return False
        aside = run_dir.with_name(_temporary_name(STAGING))
        try:
            os.rename(run_dir, aside)
        except FileNotFoundError:
            return True
        except OSError:
            return False
        shutil.rmtree(aside, ignore_errors=True)
    finally:
        os.close(fd)
    named = _holder_named(holder)
    by = f" ({named})" if named else ""
    warn(f"run folder {run_dir} held nothing of a run: a start-up killed before its logs opened{by} "
         "left it; it is taken for this run", AmpguardWarning, stacklevel=3)
    return True


STAGING = "new-run"
"""A run folder being made is ``.new-run.tmp-PID-RANDOM`` (:meth:`RunPaths.new_run_dir`), beside it."""
ABANDONED = re.compile(r"\.new-run\.tmp-\d+-[0-9a-f]+")
"""The name of a run folder being made, or being removed (:func:`_take_killed_start`)."""


def _remove_abandoned(log_dir: Path) -> None:
    """Remove from ``log_dir`` the run folders being made (:data:`ABANDONED`) that a process killed
    while making them left (review 54c): real folders (not links) of this user, of a process that
    runs no more (:func:`~ampguard.files.left_by_an_ended_process`), untouched for
    :data:`~ampguard.files.STALE_AFTER_S` (one being made on another machine sharing the folder,
    whose process this one cannot see, is renamed into place within moments). Best effort."""
    try:
        names = os.listdir(log_dir)
    except OSError:
        return
    for name in names:
        if not ABANDONED.fullmatch(name) or not left_by_an_ended_process(name):
            continue
        folder = log_dir / name
        try:
            seen = folder.lstat()
        except OSError:
            continue
        if stat.S_ISDIR(seen.st_mode) and seen.st_uid == my_uid() and time.time() - seen.st_mtime > STALE_AFTER_S:
            shutil.rmtree(folder, ignore_errors=True)


def _remove_created(created: list[Path], run_dir: Path) -> None:
    """Undo a failed :meth:`RunPaths.new_run_dir`: the run folder ``run_dir`` if it made it (with
    what it wrote in it) and the parents it made, newest first, while they are empty (a run started
    beside this one may have put its folder in one)."""
    for folder in reversed(created):
        try:
            if folder == run_dir:
                shutil.rmtree(folder)
            else:
                folder.rmdir()
        except OSError:
            return


@dataclass
class RunResult:
    """What a finished (or stopped) run hands back; the run card is written from it.

    Example (a demo-like run: no folder, only a CSV)::

        >>> import shutil, tempfile
        >>> from ampguard.config import validate
        >>> from ampguard.train import run
        >>> folder = Path(tempfile.mkdtemp())
        >>> config = validate({"task": {"name": "linear"}, "steps": 2, "precision": "bf16", "device": "cpu",
        ...                    "inject": ["nan_loss@2"]})
        >>> result = run(config, outputs=lambda: RunPaths(csv=folder / "steps.csv"), console_every=1,
        ...              print_fn=lambda line: None)
        >>> result.exit_code, result.ended, result.monitor.skips_text(), result.device
        (<ExitCode.OK: 0>, 'finished: 2 steps', 'non_finite_loss=1', device(type='cpu'))
        >>> result.paths.dir, result.paths.csv.name, result.checkpoints, result.rollbacks, result.resumed_from
        (None, 'steps.csv', [], [], None)
        >>> shutil.rmtree(folder)
    """

    exit_code: ExitCode
    monitor: RunMonitor
    paths: RunPaths
    ended: str
    """Why the run ended, in words: finished, stopped by a guard, interrupted."""
    device: torch.device
    checkpoints: list[Path] = field(default_factory=list)
    rollbacks: list[str] = field(default_factory=list)
    resumed_from: Path | None = None
    task: str = ""
    diagnosis: str | None = None
    policy_changes: list[str] = field(default_factory=list)
    """Settings changed on resume (``key old -> new from step N``), in order (docs/resume.md)."""
    policy: list[dict[str, Any]] = field(default_factory=list)
    """The same changes as data (``{"key", "old", "new", "step"}``): what each step ran under."""
    throughput: str | None = None
    """Tokens (or examples) per second after the first step, and the MFU where known."""
    path: str = ""
    """The step's path and why (``build.fast_path``)."""
    fp8_layers: list[str] = field(default_factory=list)
    """Under fp8: the Linear layers that trained in float8."""
    world_size: int = 1
    """How many processes trained the run (torchrun's world size)."""
    autocast_dtypes: dict[str, str] = field(default_factory=dict)
    """Under autocast, each leaf module's output dtype at start-up (``watch.recording_dtypes``)."""


def disk_full_line(full: DiskFull, saved: list[Path], step: int, recorded: int, run_dir: Path | None) -> str:
    """The one line a run that found the disk full ends with: the file, and the step up to which
    the run is intact (its newest checkpoint up to ``step``; without one, the last step whose
    records are complete, ``full.through`` or ``recorded``).

    Example::

        >>> import errno
        >>> full = DiskFull("runs/a/steps.csv", OSError(errno.ENOSPC, "No space left on device"))
        >>> disk_full_line(full, [Path("runs/a/checkpoints/step-00000004.pt")], 6, 6, Path("runs/a"))
        'disk full while writing runs/a/steps.csv; the run is intact up to step 4 (checkpoints/step-00000004.pt: --resume runs/a continues from there; No space left on device)'
        >>> disk_full_line(DiskFull("demo.csv", OSError(errno.ENOSPC, "No space left on device")), [], 3, 3, None)
        'disk full while writing demo.csv; the run is intact up to step 3 (its records; No space left on device)'
    """
    from .checkpoint import checkpoint_name, checkpoint_step

    steps = [n for n in map(checkpoint_step, saved) if 0 <= n <= step]
    if steps:
        intact = max(steps)
        how = f"checkpoints/{checkpoint_name(intact)}: --resume {run_dir} continues from there"
    else:
        intact = recorded if full.through is None else full.through
        how = "its records" + ("; no checkpoint to resume from" if run_dir is not None else "")  # (a demo has none)
    return (f"disk full while writing {full.path}; the run is intact up to step {intact} "
            f"({how}; {failed_because(full.error)})")
