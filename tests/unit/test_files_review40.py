"""Review 40b: a file replaced whole (``files.replace_atomically``) is replaced where its path was
resolved, never where a folder swapped for a link meanwhile leads (a root resume rewrote, or gave
away, a root-only file); synced before and after its rename; its set-ID bits dropped; made at a
name no one can guess, and the leftovers of a killed write of it removed. A link followed must
lead to a regular file. A resume whose cut cannot be made says so in one line; ``mkdir -p`` paths
with a NUL or a too-long part, and a folder where no byte can be written, are refused up front."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

import pytest

from helpers import file_size_limit, in_fork

from ampguard import files
from ampguard.errors import InputError, folder_problem, unwritable
from ampguard.files import DiskFull, replace_atomically
from ampguard.sinks import CsvSink, JsonlSink

ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (to give up root in a child)")
NOBODY = 65534


def nobody() -> None:
    """Give up root in a forked child (``in_fork``'s ``preexec``): uid and gid 65534."""
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


@contextlib.contextmanager
def shared_folder():
    """A folder outside pytest's (which only its owner may enter), owned by uid 65534."""
    folder = Path(tempfile.mkdtemp()).resolve()
    try:
        folder.chmod(0o755)
        os.chown(folder, NOBODY, NOBODY)
        yield folder
    finally:
        shutil.rmtree(folder)


def state(path: Path) -> tuple[bytes, int, int, int]:
    st = os.lstat(path)
    return path.read_bytes(), st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)


@pytest.fixture
def hostile(tmp_path):
    """A root-only folder holding a 0600 "shadow", and a user's folder ``user`` (the user owns
    it: may rename what is in it) holding ``d/shadow`` and the link ``steps.csv`` to it."""
    secret = tmp_path / "rootonly"
    secret.mkdir(mode=0o700)
    (secret / "shadow").write_text("root:$6$secret:19000::::::\n")
    os.chmod(secret / "shadow", 0o600)
    user = tmp_path / "user"
    (user / "d").mkdir(parents=True)
    (user / "d" / "shadow").write_text("step,lr\n1,0.1\n2,0.1\n")
    (user / "steps.csv").symlink_to(user / "d" / "shadow")
    (user / "run").mkdir()
    (user / "run" / "config.yaml").write_text("a: 1\n")
    if os.geteuid() == 0:
        for path in (user, user / "d", user / "d" / "shadow", user / "run", user / "run" / "config.yaml"):
            os.chown(path, NOBODY, NOBODY)
        os.chown(user / "steps.csv", NOBODY, NOBODY, follow_symlinks=False)
    return secret, user


@pytest.fixture(params=["by descriptors", "by names"])
def walk(request, monkeypatch):
    """Each link-rule test both ways ``replace_atomically``'s walk (:func:`files._walked`, by
    descriptors) reads a link: opened itself (Linux's ``O_PATH``) and by name in the folder held
    (where the OS has no ``O_PATH``: :func:`files._link_in`), so that the second, which this
    machine never takes on its own, holds to the same rule."""
    if request.param == "by names":
        monkeypatch.delattr(os, "O_PATH")
    return request.param


def swap(folder: Path, to: Path) -> None:
    """What the user does: ``folder`` becomes a link to ``to`` (the real one kept beside it)."""
    os.rename(folder, folder.with_name(folder.name + ".real"))
    os.symlink(to, folder)


def test_a_folder_swapped_for_a_link_after_the_path_was_resolved_is_refused(hostile, monkeypatch):
    # review 40b #1 (r1 a): swapped just after realpath, the root-only file was rewritten with the user's rows.
    # Walked by descriptors, the swap after the walk changes nothing: the file cut is in the folder the walk
    # judged and holds
    secret, user = hostile
    before = state(secret / "shadow")
    real = files._walked

    def walked_then_swap(*args, **kwargs):
        walked = real(*args, **kwargs)
        monkeypatch.setattr(files, "_walked", real)
        swap(user / "d", secret)
        return walked

    monkeypatch.setattr(files, "_walked", walked_then_swap)
    replace_atomically(user / "steps.csv", b"step,lr\n1,0.1\n", through_link=True)
    assert (user / "d.real" / "shadow").read_text() == "step,lr\n1,0.1\n"  # (the file judged, cut)
    assert state(secret / "shadow") == before
    assert sorted(p.name for p in secret.iterdir()) == ["shadow"]


@pytest.mark.parametrize("through_link", [True, False], ids=["the linked CSV", "a run folder's config.yaml"])
def test_a_folder_swapped_while_the_temporary_file_is_made_leaves_the_root_only_folder_alone(
        hostile, monkeypatch, through_link):
    # review 40b #1 (r1 b, c): swapped after the old file was looked at, the root-only file became
    # the user's (uid 65534, 0644, the user's rows), or a user's config.yaml appeared in that folder
    secret, user = hostile
    before = state(secret / "shadow")
    folder, path, name = (user / "d", user / "steps.csv", "shadow") if through_link else \
        (user / "run", user / "run" / "config.yaml", "config.yaml")
    real_open = os.open

    def open_then_swap(file, flags, *args, **kwargs):  # (the temporary file's open: after the old one's lstat)
        if os.path.basename(os.fspath(file)).startswith(f".{name}.tmp") and not folder.is_symlink():
            swap(folder, secret)
        return real_open(file, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_then_swap)
    replace_atomically(path, b"new\n", through_link=through_link)
    monkeypatch.setattr(os, "open", real_open)
    assert folder.is_symlink()  # (the swap was made)
    assert state(secret / "shadow") == before
    assert sorted(p.name for p in secret.iterdir()) == ["shadow"]
    real = folder.with_name(folder.name + ".real")
    assert (real / name).read_bytes() == b"new\n"  # (the file looked at is the file written)
    assert sorted(p.name for p in real.iterdir()) == [name]  # (no temporary file left)
    if os.geteuid() == 0:
        assert os.stat(real / name).st_uid == NOBODY  # (still the user's)


def test_a_link_followed_must_lead_to_a_regular_file(tmp_path, walk):
    # review 40b #6: a named pipe a link led to became a regular 0644 file
    os.mkfifo(tmp_path / "fifo", 0o600)
    (tmp_path / "steps.csv").symlink_to(tmp_path / "fifo")
    with pytest.raises(OSError) as err:
        replace_atomically(tmp_path / "steps.csv", "step\n", through_link=True)
    assert str(err.value) == (f"cannot replace {tmp_path / 'steps.csv'}: it links to {tmp_path / 'fifo'}, a named pipe, "
                              "not a regular file; nothing was written")
    assert stat.S_ISFIFO(os.lstat(tmp_path / "fifo").st_mode) and (tmp_path / "steps.csv").is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "steps.csv"]


def test_the_set_id_bits_are_dropped_from_a_file_given_new_content(tmp_path):
    # review 40b #3: a 06755 file rewritten stayed 06755 (with the user's bytes, after a swap: a root setuid file)
    path = tmp_path / "tool"
    path.write_bytes(b"old")
    os.chmod(path, 0o6755)
    replace_atomically(path, b"#new\n")
    assert oct(stat.S_IMODE(os.stat(path).st_mode)) == "0o755" and path.read_bytes() == b"#new\n"


def test_the_new_file_is_synced_before_its_rename_and_the_folder_after(tmp_path, monkeypatch):
    # review 40b #2: no fsync at all: after a crash, an empty file, or the old uncut one back
    path = tmp_path / "steps.csv"
    path.write_text("step\n1\n2\n")
    calls = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        st = os.fstat(fd)
        calls.append(("fsync", "folder" if stat.S_ISDIR(st.st_mode) else "file", st.st_ino))
        return real_fsync(fd)

    def replace(*args, **kwargs):
        calls.append(("replace",))
        return real_replace(*args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    replace_atomically(path, "step\n1\n", through_link=True)
    assert calls == [("fsync", "file", os.stat(path).st_ino), ("replace",),
                     ("fsync", "folder", os.stat(tmp_path).st_ino)], calls
    assert path.read_text() == "step\n1\n"


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EIO])
def test_a_failed_sync_is_a_failed_write(tmp_path, monkeypatch, error):
    # review 40b #2: ENOSPC or EIO from fsync: DiskFull (or the error), the old file whole, no temporary left
    path = tmp_path / "steps.csv"
    path.write_text("step\n1\n2\n")
    real_fsync = os.fsync

    def fsync(fd):
        if stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(error, os.strerror(error))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(DiskFull if error == errno.ENOSPC else OSError) as err:
        replace_atomically(path, "step\n1\n")
    assert (err.value.error if error == errno.ENOSPC else err.value).errno == error
    assert path.read_text() == "step\n1\n2\n" and sorted(p.name for p in tmp_path.iterdir()) == ["steps.csv"]


def test_a_folder_at_a_temporary_name_is_no_error(tmp_path, monkeypatch):
    # review 40b #4: a folder at .NAME.tmp-PID (the old, predictable name) was a raw IsADirectoryError
    planted = tmp_path / f".card.md.tmp-{os.getpid()}"
    planted.mkdir()
    replace_atomically(tmp_path / "card.md", "x\n")
    assert (tmp_path / "card.md").read_text() == "x\n" and planted.is_dir()
    # and one planted at the very name drawn (as if guessed) is passed over for another
    names = iter(["0123456789abcdef", "fedcba9876543210"])
    monkeypatch.setattr(files.secrets, "token_hex", lambda n: next(names))
    (tmp_path / f".card.md.tmp-{os.getpid()}-0123456789abcdef").mkdir()
    replace_atomically(tmp_path / "card.md", "y\n")
    assert (tmp_path / "card.md").read_text() == "y\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".card.md.tmp-{os.getpid()}",
                                                          f".card.md.tmp-{os.getpid()}-0123456789abcdef", "card.md"]


def test_a_killed_writes_leftovers_of_the_same_file_are_removed_and_nothing_else(tmp_path):
    # review 40b #4: a kill between the write and the rename left .NAME.tmp-PID beside the file for ever
    dead = 2**22 + 1  # (above any pid_max: no such process)
    path = tmp_path / "steps.csv"
    path.write_text("step\n1\n2\n")
    old = time.time() - 86400  # (a day: older than files.STALE_AFTER_S)
    fresh = f".steps.csv.tmp-{dead}-1111111111111111"
    for name in (f".steps.csv.tmp-{dead}", f".steps.csv.tmp-{dead}-00ff00ff00ff00ff", ".steps.csv.tmp",  # stale: go
                 f".steps.csv.tmp-{os.getpid()}-abcdefabcdefabcd",  # (this process's own, running: stays)
                 f".steps.csv.tmp-{dead}-1111111111111111",  # (fresh: another machine's write in progress? stays)
                 f".events.jsonl.tmp-{dead}"):  # (another file's: stays)
        (tmp_path / name).write_text("half")
        if name != fresh:
            os.utime(tmp_path / name, (old, old))
    (tmp_path / "secret").write_text("SECRET\n")
    (tmp_path / f".steps.csv.tmp-{dead}-2222222222222222").symlink_to(tmp_path / "secret")  # (a link: stays)
    (tmp_path / f".steps.csv.tmp-{dead}-3333333333333333").mkdir()  # (a folder: stays)
    os.utime(tmp_path / f".steps.csv.tmp-{dead}-2222222222222222", (old, old), follow_symlinks=False)
    replace_atomically(path, "step\n1\n")
    assert path.read_text() == "step\n1\n" and (tmp_path / "secret").read_text() == "SECRET\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([
        f".events.jsonl.tmp-{dead}", f".steps.csv.tmp-{dead}-1111111111111111",
        f".steps.csv.tmp-{dead}-2222222222222222", f".steps.csv.tmp-{dead}-3333333333333333",
        f".steps.csv.tmp-{os.getpid()}-abcdefabcdefabcd", "secret", "steps.csv"])


@pytest.mark.parametrize("part", ["a\0b", "a\0b/c", "new/" + "x" * 300])
def test_a_path_mkdir_p_cannot_make_is_refused_in_one_line(tmp_path, part):
    # review 40b #5: a NUL (pathlib said "not there") or a too-long part still to be made passed
    # both checks, and mkdir -p then raised ValueError or ENAMETOOLONG
    folder = Path(str(tmp_path) + "/" + part)
    for check in (folder_problem, unwritable):
        said = check(folder)
        assert said is not None and "\n" not in said, (check, said)
        assert ("holds a NUL byte" if "\0" in part else "cannot be looked at: File name too long") in said, said
    assert sorted(tmp_path.iterdir()) == []


def test_a_folder_where_no_byte_can_be_written_is_unwritable(tmp_path):
    # review 40b #8: the probe was an empty file: a full disk or quota (here ulimit -f 0) passed
    code, said = in_fork(lambda: unwritable(tmp_path), preexec=file_size_limit(0))
    assert code == 0 and said == f"no file can be made in {tmp_path} (File too large)", said
    assert sorted(tmp_path.iterdir()) == []


@ROOT
@pytest.mark.parametrize("when", ["resume", "begin_again"])
@pytest.mark.parametrize("sink", ["jsonl", "csv"])
def test_a_resume_whose_cut_cannot_be_made_is_one_line(sink, when):
    # review 40b #7: a log linked to a file this user may write, in a folder it may not: a resume's
    # cut (made beside the file, renamed over it) was a raw PermissionError; review 41: a Hugging Face
    # retry's cut (begin_again) was too, and left the rows it set aside in the log and in the attempt's copy
    with shared_folder() as mine:
        shared = mine / "shared"
        shared.mkdir(mode=0o755)  # (root's: the user may not make a file in it)
        if sink == "jsonl":
            content, make = b'{"step": 1}\n{"step": 2}\n', lambda path, keep: JsonlSink(path, append=True, keep_through=keep)
        else:
            columns = "step,lr,grad_l2_pre_clip,grad_l2_post_clip,loss,skipped,skip_reason,scaler_scale\n"
            content = (columns + "1,0.1,1,1,1,0,,\n2,0.1,1,1,1,0,,\n").encode()
            make = lambda path, keep: CsvSink(path, append=True, keep_through=keep)  # noqa: E731
        (shared / "log").write_bytes(content)
        os.chown(shared / "log", NOBODY, NOBODY)
        link = mine / "steps.log"
        link.symlink_to(shared / "log")

        def resume():
            try:
                if when == "resume":
                    make(link, 1).close()
                else:  # (opened to go on after its rows: none cut; then the loop begins again from step 0)
                    make(link, None).begin_again(0)
            except InputError as err:
                return f"InputError: {err}"
            return "resumed"

        code, said = in_fork(resume, preexec=nobody)
        assert code == 0, said
        purpose = "to resume" if when == "resume" else "for the loop's new attempt"
        assert said == (f"InputError: cannot cut {link} back to step {int(when == 'resume')} {purpose}: no file can be "
                        f"made beside it in {shared} (Permission denied): the file is rewritten whole beside itself, "
                        "then renamed over the old one"), said
        assert (shared / "log").read_bytes() == content and sorted(p.name for p in shared.iterdir()) == ["log"]
        assert sorted(p.name for p in mine.iterdir()) == ["shared", "steps.log"]  # (no attempt's copy left)


# ---------------------------------------------------------------------------- review 40f: links of another user's


def user_link(link: Path, to: Path) -> None:
    """What the user does, as root sees it: a link of the user's (uid 65534) at ``link``."""
    if link.is_symlink():
        link.unlink()
    link.symlink_to(to)
    os.lchown(link, NOBODY, NOBODY)


@ROOT
def test_a_users_link_repointed_at_a_root_file_after_the_read_is_not_followed(hostile, walk):
    # review 40f #1 (r21): after the sink read its log, the user re-pointed the link (its own) at a file
    # of root's: the cut replaced that file with the user's rows, root's owner and mode kept
    secret, user = hostile
    before = state(secret / "shadow")
    user_link(user / "steps.csv", secret / "shadow")
    with pytest.raises(files.NotReplaced) as err:
        replace_atomically(user / "steps.csv", b"step,lr\n1,0.1\n", through_link=True)
    assert str(err.value) == (f"cannot replace {user / 'steps.csv'}: {user / 'steps.csv'} is a symbolic link of user "
                              f"{NOBODY}'s to {secret / 'shadow'}, which is not theirs; refusing to write through it")
    assert state(secret / "shadow") == before and sorted(p.name for p in secret.iterdir()) == ["shadow"]


@ROOT
@pytest.mark.parametrize("through_link", [True, False], ids=["the linked CSV", "a run folder's config.yaml"])
def test_a_folder_swapped_for_a_users_link_before_the_path_is_resolved_is_not_followed(hostile, walk, through_link):
    # review 40f #1 (r20): swapped between the sink's read and the cut, before any resolution: the
    # root-only file was rewritten (a), or a config.yaml of the user's rows made in the root-only folder (b)
    secret, user = hostile
    before = state(secret / "shadow")
    os.rename(user / "d", user / "d.real")
    user_link(user / "d", secret)
    path = user / "steps.csv" if through_link else user / "d" / "config.yaml"
    with pytest.raises(files.NotReplaced, match=r"is a symbolic link of user 65534's to .*, which is not theirs"):
        replace_atomically(path, b"step,lr\n1,0.1\n", through_link=through_link)
    assert state(secret / "shadow") == before and sorted(p.name for p in secret.iterdir()) == ["shadow"]


@ROOT
def test_links_root_made_or_a_user_made_to_its_own_files_are_followed(hostile, walk, tmp_path):
    # the rule is Linux's protected_symlinks: a link is followed when this user or root made it, or
    # whoever made it owns what it leads to (the user's own CSV link, a system link such as /var/run)
    secret, user = hostile
    user_link(user / "steps.csv", user / "d" / "shadow")  # (the user's link to the user's file)
    replace_atomically(user / "steps.csv", b"step,lr\n1,0.1\n", through_link=True)
    assert (user / "d" / "shadow").read_bytes() == b"step,lr\n1,0.1\n" and (user / "steps.csv").is_symlink()
    (tmp_path / "by-root").symlink_to(user / "d")  # (root's link to the user's folder)
    replace_atomically(tmp_path / "by-root" / "card.md", b"x\n")
    assert (user / "d" / "card.md").read_bytes() == b"x\n"


@ROOT
def test_a_third_users_file_at_the_old_temporary_name_is_left_alone(tmp_path):
    # review 40f #3: .NAME.tmp-<this PID> was removed whoever's it was: another container's writer
    # with the same PID lost its temporary file
    theirs = tmp_path / f".card.md.tmp-{os.getpid()}"
    theirs.write_text("half\n")
    os.chown(theirs, 4242, 4242)
    replace_atomically(tmp_path / "card.md", "x\n")
    assert theirs.read_text() == "half\n" and (tmp_path / "card.md").read_text() == "x\n"


# ---------------------------------------------------------------------------- review 40j: a walk by descriptors


@ROOT
def test_a_folder_swapped_after_the_walk_passed_it_is_not_gone_through_again(tmp_path, monkeypatch, walk):
    # review 40j #1 (r30): the walk looked each part up by its whole name: a folder it had passed, swapped
    # for a link, was gone through on its next look, to a link of root's (think /etc/alternatives/editor)
    secret, user, system = tmp_path / "rootonly", tmp_path / "user", tmp_path / "sys"
    secret.mkdir(mode=0o700)
    (secret / "secret").write_text("root:SECRET\n")
    os.chmod(secret / "secret", 0o600)
    system.mkdir()
    (system / "editor").symlink_to(secret / "secret")  # (root's own link, its text absolute)
    (user / "a").mkdir(parents=True)
    (user / "a" / "editor").write_text('{"step": 1}\n{"step": 2}\n')
    for path in (user, user / "a", user / "a" / "editor"):
        os.chown(path, NOBODY, NOBODY)
    user_link(user / "steps.jsonl", user / "a" / "editor")
    before = state(secret / "secret")
    real_stat, real_lstat = os.stat, os.lstat

    def swap_once() -> None:  # (the window: the walk is inside user/a, about to look at editor)
        if not (user / "a").is_symlink():
            os.rename(user / "a", user / "a.real")
            user_link(user / "a", system)

    def stat_then_swap(name, *args, dir_fd=None, **kwargs):  # (a walk by descriptors looks in the folder held)
        if dir_fd is not None and name == "editor":
            swap_once()
        return real_stat(name, *args, dir_fd=dir_fd, **kwargs)

    def lstat_then_swap(name, *args, **kwargs):  # (a walk by names looked at the whole name)
        if os.fspath(name) == os.fspath(user / "a" / "editor"):
            swap_once()
        return real_lstat(name, *args, **kwargs)

    monkeypatch.setattr(files.os, "stat", stat_then_swap)
    monkeypatch.setattr(files.os, "lstat", lstat_then_swap)
    replace_atomically(user / "steps.jsonl", b'{"step": 1}\n', through_link=True)
    monkeypatch.setattr(files.os, "stat", real_stat)
    monkeypatch.setattr(files.os, "lstat", real_lstat)
    assert (user / "a").is_symlink() and (user / "a.real" / "editor").read_text() == '{"step": 1}\n'  # (the judged one)
    assert state(secret / "secret") == before


@ROOT
@pytest.mark.parametrize("owner", [0, NOBODY], ids=["root's link", "the user's own link"])
def test_a_hard_link_to_a_link_is_not_followed_where_anyone_may_make_one(tmp_path, walk, monkeypatch, owner):
    # review 40j #3 (r33): where fs.protected_hardlinks is off, a user hard-links root's link (its owner 0,
    # trusted) into its own folder as its CSV: root's file was rewritten; review 40l #1: a teammate
    # hard-links the victim's own link into their shared run folder the same way
    monkeypatch.setattr(files, "_hard_links_protected", lambda: False)  # (a host with it off)
    secret, user = tmp_path / "rootonly", tmp_path / "user"
    secret.mkdir(mode=0o700)
    (secret / "secret").write_text("root:SECRET\n")
    (secret / "editor").symlink_to(secret / "secret")
    os.lchown(secret / "editor", owner, owner)
    user.mkdir()
    os.link(secret / "editor", user / "steps.csv", follow_symlinks=False)  # (what the user did)
    if owner:
        os.chown(secret / "secret", owner, owner)  # (the victim's own file, its own link)
    before = state(secret / "secret")
    with pytest.raises(files.NotReplaced, match="is a symbolic link with another name"):
        replace_atomically(user / "steps.csv", b"step\n1\n", through_link=True)
    assert state(secret / "secret") == before



@ROOT
def test_a_hard_link_to_a_link_is_followed_where_only_its_owner_may_make_one(tmp_path, walk, monkeypatch):
    # review 40l #3: a cp -al snapshot of a run folder hard-links its CSV link; where fs.protected_hardlinks
    # is on, only the link's owner (or root) made that name: judged as any link
    monkeypatch.setattr(files, "_hard_links_protected", lambda: True)
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "steps.csv").write_text("step\n1\n2\n")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "steps.csv").symlink_to(tmp_path / "real" / "steps.csv")
    (tmp_path / "copy").mkdir()
    os.link(tmp_path / "run" / "steps.csv", tmp_path / "copy" / "steps.csv", follow_symlinks=False)
    replace_atomically(tmp_path / "copy" / "steps.csv", "step\n1\n", through_link=True)
    assert (tmp_path / "real" / "steps.csv").read_text() == "step\n1\n"


def test_a_walk_that_cannot_go_on_names_the_path_up_to_where_it_stopped(tmp_path, monkeypatch, walk):
    # review 40l #5: the walk's errors named the part alone ("nope"), where the names the folders were
    # looked up by named the path; #4: a working folder removed meanwhile leaked a descriptor, unnamed
    (tmp_path / "f").write_text("a file\n")
    for given, error in ((tmp_path / "nope" / "x.csv", FileNotFoundError), (tmp_path / "f" / "x.csv", NotADirectoryError)):
        with pytest.raises(error) as err:
            replace_atomically(given, "x\n")
        assert err.value.filename == os.fspath(given.parent), err.value
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    before = len(os.listdir("/proc/self/fd")) if Path("/proc/self/fd").is_dir() else None
    for _ in range(5):
        with pytest.raises(FileNotFoundError, match="the working folder was removed"):
            replace_atomically("steps.csv", "x\n")
    if before is not None:
        assert len(os.listdir("/proc/self/fd")) == before
