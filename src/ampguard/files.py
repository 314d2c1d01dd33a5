"""File safety for a run's files: a full disk named as such (:class:`DiskFull`, raised by
:class:`writing` around a write), and a file replaced whole or not at all
(:func:`replace_atomically`, or :func:`temporary_beside` for a writer of its own: a plot).
Checkpoints have their own, fsync'ed, save (:func:`ampguard.checkpoint.save_checkpoint`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})
"""No space left on the device, a file over the size limit (``ulimit -f``), the quota reached."""


def disk_full_error(err: BaseException | None) -> OSError | None:
    """The ``OSError`` behind ``err`` that says the disk is full (:data:`DISK_FULL_ERRNOS`):
    ``err`` itself, or its cause or context (``torch.save`` reports a failed write as a
    ``RuntimeError`` whose context is the ``OSError``); None for any other error.

    Example::

        >>> disk_full_error(OSError(errno.EFBIG, "File too large")).strerror
        'File too large'
        >>> try:
        ...     try:
        ...         raise OSError(errno.ENOSPC, "No space left on device")
        ...     except OSError:
        ...         raise RuntimeError("unexpected pos 64 vs 0")
        ... except RuntimeError as err:
        ...     found = disk_full_error(err)
        >>> found.errno == errno.ENOSPC, disk_full_error(OSError(errno.EACCES, "Permission denied"))
        (True, None)
    """
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in DISK_FULL_ERRNOS:
            return err
        err = err.__cause__ or err.__context__
    return None


class DiskFull(Exception):
    """A run's file could not be written for want of space (:func:`disk_full_error`); ``path``
    names it (or what was being written). ``through`` is set by whoever catches it: the last
    step whose records are complete.

    Example::

        >>> str(DiskFull("runs/a/steps.csv", OSError(errno.EFBIG, "File too large")))
        'disk full while writing runs/a/steps.csv (File too large)'
    """

    def __init__(self, path: str | os.PathLike, error: OSError) -> None:
        super().__init__(f"disk full while writing {path} ({error.strerror or error})")
        self.path = path
        self.error = error
        self.through: int | None = None


class writing:  # noqa: N801 - used as `with writing(path):`, like a function
    """Around a write to ``path``: a disk-full ``OSError`` becomes :class:`DiskFull`; any other
    error passes unchanged. (A class, not a generator context manager: it wraps every CSV row.)

    Example::

        >>> try:
        ...     with writing("steps.csv"):
        ...         raise OSError(errno.ENOSPC, "No space left on device")
        ... except DiskFull as full:
        ...     print(full.path, full.error.errno == errno.ENOSPC)
        steps.csv True
    """

    __slots__ = ("path",)

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = path

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, err: BaseException | None, tb: Any) -> None:
        full = disk_full_error(err) if isinstance(err, Exception) else None
        if full is not None:
            raise DiskFull(self.path, full) from None


@contextlib.contextmanager
def temporary_beside(path: str | os.PathLike) -> Iterator[Path]:
    """The path of a temporary file beside ``path`` (``.NAME.tmp-PID``: the same folder, so a
    rename over ``path`` is atomic), removed when the block ends however it ends, unless it was
    renamed: write it, then ``os.replace`` it over ``path`` (or link it, never to replace).

    Example::

        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> with temporary_beside(folder / "plot.png") as tmp:
        ...     _ = tmp.write_bytes(b"png")
        ...     tmp.name.startswith(".plot.png.tmp-")
        True
        >>> sorted(folder.iterdir())  # not renamed: taken back
        []
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
    finally:
        tmp.unlink(missing_ok=True)


def is_temporary(name: str) -> bool:
    """Whether the file ``name`` is one :func:`temporary_beside` names (``.NAME.tmp-PID``), or an
    older ampguard's (``.NAME.tmp``): a write cut short, nothing of a run.

    Example::

        >>> is_temporary(".config.yaml.tmp-4242"), is_temporary(".run-id.tmp"), is_temporary("steps.csv")
        (True, True, False)
    """
    return re.fullmatch(r"\..+\.tmp(-\d+)?", name) is not None


def remove_temporaries(folder: str | os.PathLike, keep_pid: int | None = None,
                       only: Callable[[str], object] = is_temporary) -> list[Path]:
    """Delete the temporary files (:func:`is_temporary`, or what ``only`` accepts of their names)
    that writes cut short by a kill left in ``folder``, except those of process ``keep_pid`` (a
    write of its own in progress); return what was deleted. A missing folder holds none.

    Example::

        >>> import shutil, tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> for name in (".a.pt.tmp-4242", f".b.pt.tmp-{os.getpid()}", ".c.tmp", "d.pt"):
        ...     _ = (folder / name).write_bytes(b"")
        >>> [p.name for p in remove_temporaries(folder, keep_pid=os.getpid())]
        ['.a.pt.tmp-4242', '.c.tmp']
        >>> len(remove_temporaries(folder)), sorted(p.name for p in folder.iterdir())
        (1, ['d.pt'])
        >>> remove_temporaries(folder / "missing")
        []
        >>> shutil.rmtree(folder)
    """
    folder = Path(folder)
    if not folder.is_dir():
        return []
    removed = []
    for path in sorted(folder.iterdir()):
        pid = re.search(r"\.tmp-(\d+)$", path.name)
        if is_temporary(path.name) and only(path.name) and not (pid and int(pid.group(1)) == keep_pid) and path.is_file():
            try:
                path.unlink(missing_ok=True)
            except OSError:  # not worth stopping a run for: it is only space
                continue
            removed.append(path)
    return removed


def replace_atomically(path: str | os.PathLike, data: bytes | str, *, through_link: bool = False) -> None:
    """Make ``data`` (text is written as UTF-8, undecodable bytes kept) the whole of ``path``: a
    temporary file beside it, renamed over it, so a kill or a full disk leaves the old file or
    the new one, never half of one. A write that fails (:class:`DiskFull` when there is no room)
    takes the temporary file with it and leaves ``path`` as it was.

    ``through_link``: a ``path`` that is a symbolic link to a file has that file rewritten (the
    temporary file beside it, in its folder, renamed over it), and stays the link: what a file
    appended to through its link wants when it is cut (a sink's resume; renamed over the link,
    the link became a file of its own and its target kept the rows cut). Otherwise, and for a
    link to nothing, the link itself is replaced (a file written whole, whose link may point at
    a file of the user's: never written through).

    The new file takes the replaced one's permissions (``os.chmod``) and, when this process is
    root, its owner and group (``os.chown``; a group of this user's otherwise), so a root run
    resuming a user's 0600 CSV leaves it the user's, 0600, and its owner can append to it again
    (it became root's, 0644). A file with other names (hard links) is split from them: the
    path names the new file, the other names keep the old one.

    Example::

        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> replace_atomically(folder / "card.md", "new\\n")
        >>> (folder / "card.md").read_text(), sorted(p.name for p in folder.iterdir())
        ('new\\n', ['card.md'])
        >>> (folder / "elsewhere").mkdir(); _ = (folder / "elsewhere" / "steps.csv").write_text("old\\n")
        >>> (folder / "steps.csv").symlink_to(folder / "elsewhere" / "steps.csv")
        >>> replace_atomically(folder / "steps.csv", "cut\\n", through_link=True)
        >>> (folder / "steps.csv").is_symlink(), (folder / "elsewhere" / "steps.csv").read_text()
        (True, 'cut\\n')
        >>> os.chmod(folder / "card.md", 0o600)
        >>> replace_atomically(folder / "card.md", "newer\\n")
        >>> oct(os.stat(folder / "card.md").st_mode & 0o777)
        '0o600'
    """
    if isinstance(data, str):
        data = data.encode("utf-8", errors="surrogateescape")
    target = Path(path)
    if through_link and target.is_symlink() and target.exists():
        target = Path(os.path.realpath(target))  # (the file the link points at, through every link)
    try:
        old = os.lstat(target)
    except OSError:  # (none yet: the new file is made as any other)
        old = None
    old = old if old is not None and stat.S_ISREG(old.st_mode) else None  # (a link replaced itself: its own)
    with temporary_beside(target) as tmp:
        with writing(path):
            # made new, never through what lies at its name (a stale one, or a link someone put
            # there: root would write, chown and chmod the file it points at), and for this user
            # alone until it takes the old file's mode: never more open than either
            tmp.unlink(missing_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0),
                         0o600 if old is not None else 0o666)
            with open(fd, "wb") as file:
                file.write(data)
                if old is not None:
                    _take_owner_and_mode(old, fd)
        os.replace(tmp, target)


def _take_owner_and_mode(old: os.stat_result, fd: int) -> None:
    """Give the open file ``fd`` the owner and group (when root: only root may give a file away; a
    group of this user's otherwise) and the permission bits of the file ``old`` describes, through
    the descriptor (never a path, which could be made to name another file). Best effort: a file
    system that keeps no owners or modes (FAT, some network ones) refuses, and the file is as this
    process made it."""
    mine = os.fstat(fd)
    with contextlib.suppress(OSError):  # (owner first: chown clears the set-user-ID bits)
        if os.geteuid() == 0 and (old.st_uid, old.st_gid) != (mine.st_uid, mine.st_gid):
            os.fchown(fd, old.st_uid, old.st_gid)
        elif os.geteuid() != 0 and old.st_gid != mine.st_gid:
            os.fchown(fd, -1, old.st_gid)
    with contextlib.suppress(OSError):
        os.fchmod(fd, stat.S_IMODE(old.st_mode))


def make_parents(path: str | os.PathLike, made: list[Path]) -> None:
    """Make the missing folders above ``path``, outermost first, appending to ``made`` each one
    this process made (so a caller that fails part-way knows what to take back). A folder a
    process started beside this one makes first is not added (its ``mkdir`` loses the race: that
    folder is the other's); a file on the way is left for the caller's own ``mkdir`` to say so.

    Example::

        >>> import shutil, tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> made = []
        >>> make_parents(root / "a" / "b" / "run", made)
        >>> [p.relative_to(root).as_posix() for p in made]
        ['a', 'a/b']
        >>> shutil.rmtree(root)
    """
    for folder in reversed(Path(path).parents):
        if not folder.exists():
            with contextlib.suppress(FileExistsError):
                folder.mkdir()
                made.append(folder)
