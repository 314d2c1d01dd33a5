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
import secrets
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from .errors import failed_because, shown

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
        super().__init__(f"disk full while writing {path} ({failed_because(error)})")
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


def _temporary_name(name: str) -> str:
    """The name of a temporary file for the file ``name``: ``.NAME.tmp-PID-RANDOM``, the random
    part (:mod:`secrets`) so that no one can guess it and put a link or a folder there first."""
    return f".{name}.tmp-{os.getpid()}-{secrets.token_hex(8)}"


@contextlib.contextmanager
def temporary_beside(path: str | os.PathLike) -> Iterator[Path]:
    """The path of a temporary file beside ``path`` (``.NAME.tmp-PID-RANDOM``, a name no one can
    guess: the same folder, so a rename over ``path`` is atomic), removed when the block ends
    however it ends, unless it was renamed: write it, then ``os.replace`` it over ``path`` (or
    link it, never to replace).

    Example::

        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> with temporary_beside(folder / "plot.png") as tmp:
        ...     _ = tmp.write_bytes(b"png")
        ...     tmp.name.startswith(f".plot.png.tmp-{os.getpid()}-"), is_temporary(tmp.name)
        (True, True)
        >>> sorted(folder.iterdir())  # not renamed: taken back
        []
    """
    path = Path(path)
    tmp = path.with_name(_temporary_name(path.name))
    try:
        yield tmp
    finally:
        with contextlib.suppress(OSError):  # (never raised over the block's own error: a leftover is only space)
            tmp.unlink(missing_ok=True)


def is_temporary(name: str) -> bool:
    """Whether the file ``name`` is one :func:`temporary_beside` names (``.NAME.tmp-PID-RANDOM``),
    or an older ampguard's (``.NAME.tmp-PID``, ``.NAME.tmp``): a write cut short, nothing of a run.

    Example::

        >>> is_temporary(".config.yaml.tmp-4242-0123456789abcdef"), is_temporary(".config.yaml.tmp-4242")
        (True, True)
        >>> is_temporary(".run-id.tmp"), is_temporary("steps.csv")
        (True, False)
    """
    return re.fullmatch(r"\..+\.tmp(-\d+(-[0-9a-f]+)?)?", name) is not None


CAN_PROBE_PROCESSES = os.name != "nt"
"""Whether ``os.kill(pid, 0)`` asks whether process ``pid`` runs, as on POSIX. Not on Windows: there
signal 0 is ``CTRL_C_EVENT``, sent to the process group ``pid`` (any other number ends the process
outright), so it is never called: whether a process runs cannot be told, and what a look at it would
decide is decided as for a process that runs (a temporary file kept, a folder not taken over)."""


def left_by_an_ended_process(name: str) -> bool:
    """Whether the temporary file ``name`` (:func:`is_temporary`) was left by a process that runs no
    more: the pid its name holds names none (a ``report`` or ``train`` killed in a write; review
    52c: nothing took such a file out of the run folder). A name with no pid, or the pid of a
    process that runs (another ``report`` drawing now; one of another user's), is not: kept; so is
    every one where processes cannot be asked after (:data:`CAN_PROBE_PROCESSES`).

    Example::

        >>> left_by_an_ended_process(f".report.png.tmp-{os.getpid()}-00ff"), left_by_an_ended_process(".run-id.tmp")
        (False, False)
    """
    found = re.fullmatch(r"\..+\.tmp-(\d+)(-[0-9a-f]+)?", name)
    if found is None or not CAN_PROBE_PROCESSES:  # (Windows: cannot be told, kept)
        return False
    try:
        os.kill(int(found[1]), 0)
    except ProcessLookupError:
        return True
    except (OSError, OverflowError, ValueError):  # (another user's process: EPERM; no such pid can be)
        return False
    return False


def remove_temporaries(folder: str | os.PathLike, keep_pid: int | None = None,
                       only: Callable[[str], object] = is_temporary) -> list[Path]:
    """Delete the temporary files (:func:`is_temporary`, or what ``only`` accepts of their names)
    that writes cut short by a kill left in ``folder``, except those of process ``keep_pid`` (a
    write of its own in progress); return what was deleted. A missing folder holds none.

    Example::

        >>> import shutil, tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> for name in (".a.pt.tmp-4242", f".b.pt.tmp-{os.getpid()}", f".e.tmp-{os.getpid()}-00ff", ".c.tmp", "d.pt"):
        ...     _ = (folder / name).write_bytes(b"")
        >>> [p.name for p in remove_temporaries(folder, keep_pid=os.getpid())]
        ['.a.pt.tmp-4242', '.c.tmp']
        >>> len(remove_temporaries(folder)), sorted(p.name for p in folder.iterdir())
        (2, ['d.pt'])
        >>> remove_temporaries(folder / "missing")
        []
        >>> shutil.rmtree(folder)
    """
    folder = Path(folder)
    if not folder.is_dir():
        return []
    removed = []
    for path in sorted(folder.iterdir()):
        pid = re.search(r"\.tmp-(\d+)(-[0-9a-f]+)?$", path.name)
        if is_temporary(path.name) and only(path.name) and not (pid and int(pid.group(1)) == keep_pid) and path.is_file():
            try:
                path.unlink(missing_ok=True)
            except OSError:  # not worth stopping a run for: it is only space
                continue
            removed.append(path)
    return removed


class NotReplaced(OSError):
    """:func:`replace_atomically` refused and wrote nothing: a folder on the way to the file became
    a symbolic link after the path was resolved (someone swapped it: what would be written is not
    what was looked at), or the file a link leads to (``through_link``) is not a regular file.
    An ``OSError``, so that whoever catches a failed write catches it; ``strerror`` says why,
    ``filename`` is the path given, and ``str`` is one line with both.

    Example::

        >>> str(NotReplaced(errno.ELOOP, "runs/d became a symbolic link", "runs/d/steps.csv"))
        'cannot replace runs/d/steps.csv: runs/d became a symbolic link'
    """

    def __str__(self) -> str:
        return f"cannot replace {shown(self.filename)}: {self.strerror}" if self.filename is not None else str(self.strerror)


_O_PATH = getattr(os, "O_PATH", getattr(os, "O_SEARCH", getattr(os, "O_EXEC", os.O_RDONLY)))
"""How a folder on the way is opened: to be gone through, no read permission needed (Linux's
``O_PATH``; ``O_SEARCH``/``O_EXEC`` elsewhere; where none is, a folder this user may search but
not read cannot be gone through, and the replace fails with ``EACCES``)."""
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_BINARY = getattr(os, "O_BINARY", 0)
"""Windows' flag for a file written byte for byte (no newline translation); nothing elsewhere."""
_CANNOT_SYNC = frozenset({errno.EINVAL, errno.EBADF, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)})
"""What ``fsync`` says of a descriptor that cannot be synced (a file system without it, a folder
opened only to be gone through): nothing to do. Any other error (ENOSPC, EIO) is a failed write."""

BY_DESCRIPTORS = ({os.open, os.stat, os.unlink, os.rename} <= os.supports_dir_fd and os.listdir in os.supports_fd
                  and hasattr(os, "O_DIRECTORY") and hasattr(os, "geteuid"))
"""Whether this OS lets a file be replaced relative to its folder's descriptor (``dir_fd``, a
folder opened, ``O_DIRECTORY``, user ids): Linux, macOS, the BSDs. Where it does not (Windows:
``os.supports_dir_fd`` is empty, a folder cannot be opened, there are no user ids),
:func:`replace_atomically` takes the plain path: a temporary file beside the file, synced and
renamed over it (``os.replace``), with no walk and no links of other users to judge (NTFS has no
such owners). Decided at import, as the OS is."""


def my_uid() -> int | None:
    """This process's effective user id, or None where the OS has none (Windows: every file's
    ``st_uid`` is 0 there, so no file can be told to be this user's)."""
    geteuid = getattr(os, "geteuid", None)
    return None if geteuid is None else geteuid()


STALE_AFTER_S = 600.0
"""How old (by its modification time) a temporary file of a dead process must be before
:func:`replace_atomically` removes it: a write in progress on another machine sharing the folder
(whose process this one cannot see) is never that slow."""


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


_MAX_LINKS = 40
"""The most links one path may lead through (Linux's own limit): more is a loop (``ELOOP``)."""


def _identity(seen: os.stat_result) -> tuple[int, ...]:
    """What must not change in a link between :func:`_link_in`'s first look at it and its look
    after its text was read (where the OS has no ``O_PATH``): the file (device, inode), its owner, its names, and its change
    time (a rename or a new name moves it: a link renamed away and back is the same inode)."""
    return seen.st_dev, seen.st_ino, seen.st_uid, seen.st_nlink, seen.st_ctime_ns


def _changed(link: str, path: str | os.PathLike) -> NotReplaced:
    """The refusal of ``link``, which changed between the walk's first look at it and the reading
    of its text (another link renamed over it: its text is not the judged link's)."""
    return NotReplaced(errno.EAGAIN, f"{shown(link)} changed while the path was walked; nothing was written",
                       os.fspath(path))


class _LedTo:
    """On :func:`_walked`'s stack, after a link's text: the walk has reached what the link leads
    to when it pops this; the link's ``owner`` must own that (see :func:`_walked`)."""

    __slots__ = ("link", "owner", "text")

    def __init__(self, link: str, owner: int, text: str) -> None:
        self.link, self.owner, self.text = link, owner, text


def _not_theirs(link: str, owner: int, leads: str, path: str | os.PathLike) -> NotReplaced:
    """The refusal of ``link``, a symbolic link of user ``owner``'s that leads to ``leads``, which
    that user does not own (for ``path``, the path given); ``owner`` -1: a link in a folder others
    may change, no one's (:func:`_link_in`)."""
    whose = f"of user {owner}'s" if owner >= 0 else "in a folder others may change"
    return NotReplaced(errno.EPERM, f"{shown(link)} is a symbolic link {whose} to {shown(leads)}, which is not "
                       "theirs; refusing to write through it", os.fspath(path))


def _hard_linked(link: str, path: str | os.PathLike) -> NotReplaced:
    """The refusal of ``link``, a symbolic link with more than one name where anyone may give it
    one (:func:`_hard_links_protected` False: a user hard-links root's link, or a teammate's own,
    into a run folder it may write in; reviews 40j, 40l)."""
    return NotReplaced(errno.EPERM, f"{shown(link)} is a symbolic link with another name (a hard link to it, which "
                       "anyone may make where fs.protected_hardlinks is off); refusing to write through it",
                       os.fspath(path))


def _hard_links_protected() -> bool:
    """Whether the kernel lets only a file's owner (or root) give it another name
    (``/proc/sys/fs/protected_hardlinks`` reads 1); False where it does not, or cannot be read."""
    try:
        return Path("/proc/sys/fs/protected_hardlinks").read_text().strip() == "1"
    except OSError:
        return False


def _link_in(fd: int, part: str, seen: os.stat_result, at: str, path: str | os.PathLike
             ) -> tuple[os.stat_result, str, int]:
    """The link ``part`` in the folder ``fd`` holds (``seen``: its ``lstat`` there; ``at``: its
    path, for errors): its status, its text, and whose it is taken to be, for :func:`_walked`.

    Where the OS has ``O_PATH`` the link is opened itself (``O_PATH | O_NOFOLLOW``) and its owner
    and text read from that one descriptor: both are one link's, whatever is renamed meanwhile.
    Elsewhere (macOS) a link cannot be opened, so it is looked at by name in the folder held,
    before and after its text is read, and a change between the two is :class:`NotReplaced`
    (a user's link renamed over a judged one: review 41a). That cannot see a link renamed away
    and back within a file system's clock tick (HFS+, ext3: a second; review 41d), so there a link
    lying in a folder another user owns is taken to be that user's unless its owner is them: a
    link of root's the user renamed into its own folder leads root only where the user could.
    A folder others may write and which is not sticky (anyone there may have renamed it) makes
    it no one's: not followed (:func:`_not_theirs` says so)."""
    if hasattr(os, "O_PATH"):
        lfd = os.open(part, os.O_PATH | _O_NOFOLLOW | _O_CLOEXEC, dir_fd=fd)
        try:
            link, text = os.fstat(lfd), os.readlink("", dir_fd=lfd)
        finally:
            os.close(lfd)
        return link, text, link.st_uid
    try:
        text, again = os.readlink(part, dir_fd=fd), os.stat(part, dir_fd=fd, follow_symlinks=False)
    except OSError as err:
        if err.errno not in (errno.ENOENT, errno.ENOTDIR, errno.EINVAL):  # (gone, or no link now)
            raise
        raise _changed(at, path) from None
    if _identity(again) != _identity(seen):
        raise _changed(at, path)
    folder, me = os.fstat(fd), os.geteuid()
    if folder.st_uid not in (me, 0, seen.st_uid):
        return seen, text, folder.st_uid
    if folder.st_mode & 0o022 and not folder.st_mode & stat.S_ISVTX:
        return seen, text, -1
    return seen, text, seen.st_uid


def _walked(given: Path, follow_last: bool, path: str | os.PathLike) -> tuple[int, Path]:
    """The folder ``given`` lies in, as a descriptor (opened to be read where this user may, to be
    synced and listed), and the path of the file in it: walked from ``/`` (or the working folder)
    one part at a time, each part looked at in the folder the walk holds (``dir_fd``), never by
    its name from ``/``: a folder the walk passed that someone swaps for a link afterwards is not
    gone through again (review 40j: the name-based walk went through it on its next look, to a
    link it trusted). The last part is followed when it is a link and ``follow_last``.

    Each link met is opened itself (``O_PATH | O_NOFOLLOW``), its owner and its text read from that
    one descriptor (read by name twice, a link swapped between the two was judged by one and
    followed by the other; where the OS has no ``O_PATH``, :func:`_link_in`), and followed only when this user or root made it, or when whoever
    made it owns what it leads to (the owner of the folder or file the walk reaches at its text's
    end). A link with another name (a hard link to it) is followed only where the kernel lets none
    but its owner make one (``fs.protected_hardlinks`` 1, :func:`_hard_links_protected`): else
    anyone may have linked someone's link into their own folder, root's or the user's own (review
    40l), and its owner says nothing of who put it there. Else :class:`NotReplaced`, nothing
    written: a user who may write in a run's folder pointed its CSV's link, or a folder on its
    way, at root's file, and a root resume rewrote that file. A part that cannot be gone through
    is an ``OSError`` naming the path up to it; a folder on the way swapped for a link while the
    walk looked at it, :class:`NotReplaced`."""
    me = os.geteuid()
    todo: list[Any] = list(reversed(given.parts))
    start = "/" if given.is_absolute() else "."
    try:  # (before any descriptor is open: a working folder removed meanwhile has no path)
        shown_at = Path(os.path.abspath(start))
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, "the working folder was removed", os.fspath(path)) from None
    fd = os.open(start, _O_PATH | os.O_DIRECTORY | _O_CLOEXEC)
    links = 0

    def judge(led: _LedTo, owner: int) -> None:
        if led.owner not in (me, 0) and led.owner != owner:
            raise _not_theirs(led.link, led.owner, led.text, path)

    try:
        while True:
            while todo and (isinstance(todo[-1], _LedTo) or todo[-1] in ("", ".", "/")):
                part = todo.pop()
                if isinstance(part, _LedTo):  # (a link's text walked: it led to the folder held)
                    judge(part, os.fstat(fd).st_uid)
            if not todo:
                raise NotReplaced(errno.EISDIR, "it names a folder, not a file; nothing was written", os.fspath(path))
            part = todo.pop()
            last = not any(isinstance(p, str) and p not in ("", ".", "/") for p in todo)
            if part == "..":
                inner = os.open("..", _O_PATH | os.O_DIRECTORY | _O_CLOEXEC, dir_fd=fd)
                fd, inner, shown_at = inner, fd, shown_at.parent  # (held before the old one closes: below)
                os.close(inner)
                continue
            try:
                seen = os.stat(part, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                if last:
                    break  # (a new file)
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), os.fspath(shown_at / part)) from None
            except OSError as err:
                err.filename = os.fspath(shown_at / part)  # (the path up to it, not the part alone)
                raise
            if stat.S_ISLNK(seen.st_mode) and (not last or follow_last):
                links += 1
                if links > _MAX_LINKS:
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), os.fspath(path))
                at = os.fspath(shown_at / part)
                link, text, maker = _link_in(fd, part, seen, at, path)
                if link.st_nlink > 1 and not _hard_links_protected():  # (a hard link to someone's link)
                    raise _hard_linked(at, path)
                todo += [_LedTo(at, maker, text), *reversed(Path(text).parts)]
                if os.path.isabs(text):
                    inner = os.open("/", _O_PATH | os.O_DIRECTORY | _O_CLOEXEC)
                    fd, inner, shown_at = inner, fd, Path("/")
                    os.close(inner)
                continue
            if last:
                break
            try:
                inner = os.open(part, _O_PATH | os.O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC, dir_fd=fd)
            except OSError as err:
                at = os.fspath(shown_at / part)
                if err.errno in (errno.ENOTDIR, errno.ELOOP) and _is_link(part, fd):  # (a folder when looked at)
                    raise NotReplaced(errno.ELOOP, f"{shown(at)} became a symbolic link while the path was walked "
                                      "(it changed while the file was being written); nothing was written",
                                      os.fspath(path)) from None
                err.filename = at
                raise
            fd, inner, shown_at = inner, fd, shown_at / part
            os.close(inner)
        try:  # (the file's own owner judges a link that led to it; one not there yet: its folder's)
            owner = os.stat(part, dir_fd=fd, follow_symlinks=False).st_uid
        except FileNotFoundError:
            owner = os.fstat(fd).st_uid
        for led in todo:
            if isinstance(led, _LedTo):
                judge(led, owner)
        try:  # (read where this user may: to be synced and listed)
            readable = os.open(".", os.O_RDONLY | os.O_DIRECTORY | _O_CLOEXEC, dir_fd=fd)
        except PermissionError:
            return fd, shown_at / part
        fd, readable = readable, fd
        os.close(readable)
        return fd, shown_at / part
    except BaseException:
        # (review 54l: each move of the walk closed the folder it held, then took the next one into fd; a
        # stop signal between the two had this close the same number again: "Bad file descriptor" replaced
        # the interrupt, exit 2 for 130, and with threads another thread's new file could be closed. fd now
        # holds the next descriptor before the old one is closed: a stop between leaves one open at worst)
        os.close(fd)
        raise


def _sync(fd: int) -> None:
    """``fsync`` the file or folder ``fd``: nothing for one that cannot be (:data:`_CANNOT_SYNC`)."""
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in _CANNOT_SYNC:
            raise


def _running(pid: str | None) -> bool:
    """Whether the process ``pid`` (digits, or None: none named) is running here (another user's
    too); a process of another machine or container is not seen (:data:`STALE_AFTER_S`). Where
    processes cannot be asked after (:data:`CAN_PROBE_PROCESSES`), a pid named is taken to run."""
    if pid is None:
        return False
    if not CAN_PROBE_PROCESSES:  # (Windows: cannot be told; taken to run)
        return True
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, OverflowError):
        return False
    except OSError:  # (EPERM: another user's)
        return True
    return True


def _at(folder: int | str, name: str) -> tuple[str, int | None]:
    """The file ``name`` of ``folder`` as the ``os`` calls take it, ``(path, dir_fd)``: relative to
    the descriptor the walk holds (:func:`_walked`), or, on the plain path (``folder`` a path, where
    the OS has no ``dir_fd``: :data:`BY_DESCRIPTORS`), joined to it."""
    return (name, folder) if isinstance(folder, int) else (os.path.join(folder, name), None)


def _remove_stale(dfd: int | str, name: str, old: os.stat_result | None) -> None:
    """Remove the temporary files of the file ``name`` (``.NAME.tmp-PID-RANDOM``, ``.NAME.tmp-PID``,
    ``.NAME.tmp``) that writes killed before their rename left in the folder ``dfd``: regular files
    only (never through a link: looked at and removed by name, relative to ``dfd``), of this user
    or the file's owner, older than :data:`STALE_AFTER_S`, of a process not running here. This
    process's own ``.NAME.tmp-PID``, the name it used to write at (it writes at none now), goes
    at any age when it is this user's or the file's owner's, whatever it is but a folder (a link
    planted there). A folder that cannot be listed is left as it is. ``dfd`` a path (the plain
    path, :data:`BY_DESCRIPTORS`): looked at by name, and, where the OS has no user ids, whoever's."""
    try:
        names = os.listdir(dfd)
    except OSError:  # (a folder opened only to be gone through, or not listed by this user)
        return
    pattern = re.compile(re.escape(f".{name}.tmp") + r"(?:-(\d+)(?:-[0-9a-f]+)?)?")
    legacy = f".{name}.tmp-{os.getpid()}"
    me = my_uid()
    owners = {me} | ({old.st_uid} if old is not None else set())
    for entry in names:
        found = pattern.fullmatch(entry)
        if found is None:
            continue
        at, at_fd = _at(dfd, entry)
        try:
            seen = os.stat(at, dir_fd=at_fd, follow_symlinks=False)
        except OSError:
            continue
        ours = me is None or seen.st_uid in owners  # (no user ids: no owner to tell by)
        if entry == legacy:  # (a third user's file at that name is another writer's: a PID of another container)
            stale = not stat.S_ISDIR(seen.st_mode) and ours
        else:
            stale = (stat.S_ISREG(seen.st_mode) and ours
                     and time.time() - seen.st_mtime > STALE_AFTER_S and not _running(found.group(1)))
        if stale:
            with contextlib.suppress(OSError):  # (gone meanwhile, or not ours to remove: only space)
                os.unlink(at, dir_fd=at_fd)


def _make_temporary(dfd: int | str, name: str, mode: int, folder: str) -> tuple[str, int]:
    """A new temporary file for ``name`` in the folder ``dfd`` (:func:`_temporary_name`), made with
    ``O_CREAT | O_EXCL | O_NOFOLLOW``: never opened through what lies at its name (a link, a
    folder: another name is tried). Its name and a descriptor open to write it."""
    for _ in range(16):
        tmp = _temporary_name(name)
        try:
            at, at_fd = _at(dfd, tmp)
            return tmp, os.open(at, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC | _O_BINARY, mode,
                                dir_fd=at_fd)
        except FileExistsError:
            continue
        except OSError as err:
            err.filename = os.path.join(folder, tmp)  # (where it could not be made)
            raise
    raise FileExistsError(errno.EEXIST, "no temporary file could be made beside it: every name tried was taken",
                          os.path.join(folder, f".{name}.tmp-*"))


def replace_atomically(path: str | os.PathLike, data: bytes | str | Callable[[IO[bytes]], None], *,
                       through_link: bool = False) -> None:
    """Make ``data`` (text is written as UTF-8, undecodable bytes kept; a callable writes it to the
    file it is handed, a cut's copy of a long file's head that is never held whole) the whole of ``path``: a
    temporary file beside it, synced (``fsync``) and renamed over it, the folder synced after
    (where this user may read it: a folder it may only write in cannot be synced), so a kill, a
    full disk or a crash leaves the old file or the new one, never half of one. A write
    that fails (:class:`DiskFull` when there is no room) takes the temporary file with it and
    leaves ``path`` as it was, but for one that fails after the rename (the folder's sync: ``EIO``,
    or :class:`DiskFull`), whose error has ``replaced = True``: ``path`` holds ``data`` already
    (a crash before the folder reaches the disk could bring back the old file).

    The path is walked once, from ``/``, by descriptors (:func:`_walked`: each part looked at in
    the folder the walk holds; each link met judged, one of another user's that leads to what is
    not theirs refused, as is a hard link to a link; where the OS has no ``O_PATH`` a link is
    looked at by name in the folder held, :func:`_link_in`), and all else is done relative to the
    folder it ends in: the old file looked at, the temporary file made (a random
    name, made new, never through what lies at it), given the old file's owner and mode through
    its descriptor, renamed. A folder on the way that became a link meanwhile (swapped by whoever
    owns the folder above it, so that a root run would write or give away a file elsewhere) is
    refused, nothing written: :class:`NotReplaced`, one line. The temporary files of this name
    that a killed write left there are removed (:func:`_remove_stale`).

    ``through_link``: a ``path`` that is a symbolic link to a regular file has that file rewritten
    (the temporary file beside it, in its folder, renamed over it), and stays the link: what a
    file appended to through its link wants when it is cut (a sink's resume; renamed over the
    link, the link became a file of its own and its target kept the rows cut). A link to
    something else (a folder, a named pipe, a device) is refused (:class:`NotReplaced`).
    Otherwise, and for a link to nothing, the link itself is replaced (a file written whole,
    whose link may point at a file of the user's: never written through).

    The new file takes the replaced one's permissions (``os.fchmod``; the set-user-ID and
    set-group-ID bits dropped: its content is new) and, when this process is root, its owner and
    group (``os.fchown``; a group of this user's otherwise), so a root run resuming a user's 0600
    CSV leaves it the user's, 0600, and its owner can append to it again (it became root's,
    0644). A file with other names (hard links) is split from them: the path names the new file,
    the other names keep the old one.

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
        >>> os.chmod(folder / "card.md", 0o4750)
        >>> replace_atomically(folder / "card.md", "newer\\n")
        >>> oct(os.stat(folder / "card.md").st_mode & 0o7777)
        '0o750'
        >>> (folder / "pipe").symlink_to(folder / "elsewhere")
        >>> try:
        ...     replace_atomically(folder / "pipe", "x\\n", through_link=True)
        ... except NotReplaced as err:
        ...     print(str(err).replace(str(folder.resolve()), "DIR").replace(str(folder), "DIR"))
        cannot replace DIR/pipe: it links to DIR/elsewhere, a folder, not a regular file; nothing was written
    """
    if isinstance(data, str):
        data = data.encode("utf-8", errors="surrogateescape")
    given = Path(path)
    followed = through_link and given.is_symlink() and given.exists()
    folder, target = _reached(given, followed, path)
    try:
        _replace_in(folder, target, data, path, followed)
    finally:
        _let_go(folder)


def _of_the_system(path: str | os.PathLike) -> bool:
    """Whether ``path`` names what the OS provides rather than a file of a run: under ``/dev`` or
    ``/proc`` (``/dev/stdout``, ``/dev/fd/3`` of a process substitution ``>(gzip > x)``, ``/dev/null``),
    whose links lead to ``pipe:[N]`` or a terminal, no path a walk can follow (review 55w: a sink
    given one was "No such file or directory"). Opened as given, never made; no run folder is there."""
    return Path(os.path.abspath(path)).parts[1:2] in (("dev",), ("proc",))


def _reached(given: Path, follow_last: bool, path: str | os.PathLike) -> tuple[int | str, Path]:
    """The folder the file ``given`` lies in and the file's path, as every write of a run's file
    reaches them (:func:`replace_atomically`, :func:`open_to_append`, a checkpoint's save): walked
    by descriptors (:func:`_walked`: the folder a descriptor, each link on the way judged), or,
    where the OS cannot (:data:`BY_DESCRIPTORS`: Windows), the plain path: the folder's path, the
    last part followed by name when ``follow_last`` and a link, a folder at it refused
    (:class:`NotReplaced`, ``EISDIR``). :func:`_let_go` after."""
    if BY_DESCRIPTORS:
        return _walked(given, follow_last, path)
    target = Path(os.path.realpath(given)) if follow_last and given.is_symlink() else given
    if not target.name or (os.path.isdir(target) and not os.path.islink(target)):
        raise NotReplaced(errno.EISDIR, "it names a folder, not a file; nothing was written", os.fspath(path))
    return os.fspath(target.parent), target


def _let_go(folder: int | str) -> None:
    """Close the folder :func:`_reached` held open (nothing on the plain path)."""
    if isinstance(folder, int):
        os.close(folder)


def _what(mode: int) -> str:
    """What a file of ``mode`` is, for :class:`NotReplaced`."""
    for test, what in ((stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a symbolic link (it changed after it was resolved)"),
                       (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device")):
        if test(mode):
            return what
    return "not a file"


def _replace_in(dfd: int | str, target: Path, data: bytes | Callable[[IO[bytes]], None], path: str | os.PathLike,
                followed: bool) -> None:
    """:func:`replace_atomically`'s work in the folder ``dfd`` (``target``'s, from :func:`_walked`),
    every step relative to it: ``target.name`` is replaced by ``data``. ``dfd`` a path (the plain
    path, :data:`BY_DESCRIPTORS`): every step by name in it, and the folder, which cannot be
    opened there, not synced."""
    name = target.name
    at, at_fd = _at(dfd, name)
    try:
        old: os.stat_result | None = os.stat(at, dir_fd=at_fd, follow_symlinks=False)
    except OSError:  # (none yet: the new file is made as any other)
        old = None
    if followed and (old is None or not stat.S_ISREG(old.st_mode)):  # (a link's target, rewritten: a file only)
        what = "gone (it changed after it was resolved)" if old is None else _what(old.st_mode)
        raise NotReplaced(errno.EISDIR if old is not None and stat.S_ISDIR(old.st_mode) else errno.EINVAL,
                          f"it links to {shown(target)}, {what}, not a regular file; nothing was written",
                          os.fspath(path))
    old = old if old is not None and stat.S_ISREG(old.st_mode) else None  # (a link replaced itself: its own)
    _remove_stale(dfd, name, old)
    with writing(path):
        # for this user alone until it takes the old file's mode: never more open than either
        tmp, fd = _make_temporary(dfd, name, 0o600 if old is not None else 0o666, os.fspath(target.parent))
    renamed = False
    try:
        with writing(path):
            with open(fd, "wb") as file:
                data(file) if callable(data) else file.write(data)
                file.flush()
                if old is not None:
                    _take_owner_and_mode(old, fd)
                _sync(fd)  # (the data on disk before the name points at it)
        try:
            os.replace(_at(dfd, tmp)[0], at, src_dir_fd=at_fd, dst_dir_fd=at_fd)
        except OSError as err:  # (a folder at the name: said with the paths, not the bare names)
            err.filename, err.filename2 = os.fspath(target.parent / tmp), os.fspath(target)
            raise
        renamed = True
    finally:
        if not renamed:
            with contextlib.suppress(OSError):
                os.unlink(_at(dfd, tmp)[0], dir_fd=at_fd)
    if not isinstance(dfd, int):  # (the plain path: a folder that cannot be opened cannot be synced)
        return
    try:
        with writing(path):
            _sync(dfd)  # (the rename on disk: else a crash could bring back the old file)
    except BaseException as err:  # (path holds data already: said to whoever takes back what went with the old file)
        err.replaced = True  # type: ignore[attr-defined]
        raise


def _take_owner_and_mode(old: os.stat_result, fd: int) -> None:
    """Give the open file ``fd`` the owner and group (when root: only root may give a file away; a
    group of this user's otherwise) and the permission bits of the file ``old`` describes, but the
    set-user-ID and set-group-ID bits (its content is new: ``cp`` and ``install`` drop them too),
    through the descriptor (never a path, which could be made to name another file). Best effort:
    a file system that keeps no owners or modes (FAT, some network ones) refuses, and the file is
    as this process made it; an OS without user ids (Windows) gives no owner."""
    mine, me = os.fstat(fd), my_uid()
    with contextlib.suppress(OSError):
        if me == 0 and (old.st_uid, old.st_gid) != (mine.st_uid, mine.st_gid):
            os.fchown(fd, old.st_uid, old.st_gid)
        elif me is not None and me != 0 and old.st_gid != mine.st_gid:
            os.fchown(fd, -1, old.st_gid)
    fchmod = getattr(os, "fchmod", None)  # (Windows' Python before 3.13 has none: its modes are only read-only)
    with contextlib.suppress(OSError):
        if fchmod is not None:
            fchmod(fd, stat.S_IMODE(old.st_mode) & ~(stat.S_ISUID | stat.S_ISGID))


_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


def rename_onto_nothing(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Rename ``src`` (a file or a folder) to ``dst``, which must not exist: :class:`FileExistsError`
    when something is there, a folder too, even an empty one (which ``rename(2)`` replaces). One
    atomic step where the C library and the file system have ``renameat2(RENAME_NOREPLACE)``
    (Linux); elsewhere a look, then ``os.rename``, which refuses a file or a folder that holds
    anything there (an empty folder made between the two is replaced: nothing in it is lost).
    What puts a new run folder in place whole (review 54c: :meth:`RunPaths.new_run_dir`).

    Example::

        >>> import shutil, tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> (root / "a").mkdir(); (root / "b").mkdir()
        >>> try:
        ...     rename_onto_nothing(root / "a", root / "b")  # (an empty folder: rename(2) replaces it)
        ... except FileExistsError:
        ...     print("refused")
        refused
        >>> rename_onto_nothing(root / "a", root / "c"); sorted(p.name for p in root.iterdir())
        ['b', 'c']
        >>> shutil.rmtree(root)
    """
    src_b, dst_b = os.fsencode(src), os.fsencode(dst)
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    # (no such C library call: the look, then rename; TypeError: Windows' ctypes cannot load "no library", review 55a)
    except (ImportError, OSError, AttributeError, TypeError):
        renameat2 = None
    if renameat2 is not None:
        renameat2.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
        renameat2.restype = ctypes.c_int
        if renameat2(_AT_FDCWD, src_b, _AT_FDCWD, dst_b, _RENAME_NOREPLACE) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.ENOSYS, errno.EINVAL):  # (EINVAL: a file system without the flag)
            raise OSError(code, os.strerror(code), os.fspath(src), None, os.fspath(dst))
    if os.path.lexists(dst_b):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fspath(src), None, os.fspath(dst))
    try:
        os.rename(src_b, dst_b)
    except OSError as err:
        if err.errno in (errno.ENOTEMPTY, errno.EEXIST) or (err.errno == errno.ENOTDIR and os.path.lexists(dst_b)):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fspath(src), None, os.fspath(dst)) from None
        raise


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


def open_to_append(path: str | os.PathLike, *, readable: bool = False, flags: int = 0) -> int:
    """A descriptor of ``path`` open to append (``O_APPEND | O_CREAT``, write-only, or read-write when
    ``readable``; ``flags`` added: ``O_NONBLOCK``), the file made when missing, reached as
    :func:`replace_atomically` reaches the file it writes: walked by descriptors (:func:`_walked`),
    each link met on the way, the file's own included, judged (one of another user's that leads to
    what is not theirs is :class:`NotReplaced`, one line, nothing opened), and the file itself opened
    with ``O_NOFOLLOW`` in the folder the walk ends in (a link put at its name after the walk is not
    gone through). What every log appended to uses (a sink's CSV and JSON lines, ``events.jsonl``,
    validate's history; review 55d: a teammate's ``events.jsonl`` linked to root's file had a root
    resume append to that file).

    Example::

        >>> import shutil, tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> fd = open_to_append(folder / "log.jsonl")
        >>> os.write(fd, b"{}\\n"), os.close(fd), (folder / "log.jsonl").read_bytes()
        (3, None, b'{}\\n')
        >>> shutil.rmtree(folder)
    """
    access = os.O_RDWR if readable else os.O_WRONLY
    if _of_the_system(path):  # (no run's file: a pipe, a terminal, /dev/null, as the OS names it)
        return os.open(path, access | os.O_APPEND | _O_CLOEXEC | flags)
    folder, target = _reached(Path(path), True, path)
    try:
        at, at_fd = _at(folder, target.name)
        return os.open(at, access | os.O_APPEND | os.O_CREAT | _O_NOFOLLOW | _O_CLOEXEC | _O_BINARY | flags, 0o666,
                       dir_fd=at_fd)
    except OSError as err:
        err.filename = os.fspath(path)
        raise
    finally:
        _let_go(folder)
