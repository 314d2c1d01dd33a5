"""Review 41: the walk where the OS has no ``O_PATH`` follows only the link it judged
(one renamed over it between its look and the reading of its text is refused), and judges a link
to nothing by the folder it would be made in; a cut whose rename was made, its folder's sync
failed after, says so and keeps the rows it set aside (``replaced``); a Hugging Face retry's
cut that fails, in ``begin_again`` (the file closed, read or cut) or in the callback's own CSV,
takes its copy back, the sink open again, and says it is for the loop's new attempt."""

from __future__ import annotations

import errno
import os
import stat
import time
from pathlib import Path

import pytest

from helpers import armed_after_set_aside, folder_sync_raises, hf_retrying_trainer, names_in as _names
from helpers import sink_of_four_steps, step_log as _log

from ampguard import files, sinks
from ampguard.errors import InputError
from ampguard.files import DiskFull, replace_atomically
from ampguard.sinks import CsvSink

ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (to make a link of another user's)")
NOBODY = 65534
HEADER = "step,lr,grad_l2_pre_clip,grad_l2_post_clip,loss,skipped,skip_reason,scaler_scale\n"


def _rows(path: Path) -> list[int]:
    return [int(line.split(",")[0]) for line in path.read_text().splitlines()[1:]]


def _user_link(link: Path, to: Path) -> None:
    link.symlink_to(to)
    os.lchown(link, NOBODY, NOBODY)


# ---------------------------------------------------------------------------- 1: the walk by names


@ROOT
@pytest.mark.parametrize("back", [False, True], ids=["swapped", "swapped and put back after its text was read"])
def test_a_link_renamed_over_the_judged_one_before_its_text_is_read_is_not_followed(tmp_path, monkeypatch, back):
    # review 41 r4: the fallback judged root's link user/run by lstat, then read user/run's text by name:
    # the user's own link to root's folder, renamed over it between the two, was followed and root's file
    # rewritten. Put back after the read (the same link, renamed away and back), its change time tells
    secret, user = tmp_path / "rootonly", tmp_path / "user"
    secret.mkdir(mode=0o700)
    (secret / "steps.csv").write_text("root's own file\n")
    os.chmod(secret / "steps.csv", 0o600)
    (user / "realrun").mkdir(parents=True)
    for path in (user, user / "realrun"):
        os.chown(path, NOBODY, NOBODY)
    (user / "run").symlink_to(user / "realrun")  # (root's: the run made it)
    _user_link(user / "evil", secret)
    time.sleep(0.05)  # (a rename's change time is not the link's made time: file times tick by the jiffy)
    real_readlink, swapped = os.readlink, []

    def readlink_after_swap(path, *args, **kwargs):  # (what uid 65534 may do in its own folder, at the worst time)
        if swapped or os.fspath(path) not in (os.fspath(user / "run"), "run"):  # (by name, or in the folder held)
            return real_readlink(path, *args, **kwargs)
        swapped.append(True)
        os.rename(user / "run", user / "run.away")
        os.rename(user / "evil", user / "run")
        text = real_readlink(path, *args, **kwargs)
        if back:
            os.rename(user / "run.away", user / "run")
        return text

    monkeypatch.delattr(os, "O_PATH")  # (the walk by names, as where the OS has no O_PATH)
    monkeypatch.setattr(files.os, "readlink", readlink_after_swap)
    with pytest.raises(files.NotReplaced) as err:
        replace_atomically(user / "run" / "steps.csv", "step,lr\n1,0.1\n")
    assert swapped and str(err.value) == (f"cannot replace {user / 'run' / 'steps.csv'}: {user / 'run'} changed while "
                                          "the path was walked; nothing was written")
    assert (secret / "steps.csv").read_text() == "root's own file\n" and _names(secret) == ["steps.csv"]


@ROOT
def test_a_roots_link_in_a_users_folder_is_judged_as_the_users_where_a_rename_cannot_be_seen(tmp_path, monkeypatch):
    # review 41d F2: where change times tick by the second (HFS+, ext3), a link renamed away and back
    # between the walk's two looks looks the same: the user's link to root's folder, renamed over root's
    # link user/run for the read of its text, was followed and root's file rewritten. A link in a folder
    # another user owns is taken to be that user's: it leads root only where the user could
    secret, user = tmp_path / "rootonly", tmp_path / "user"
    secret.mkdir(mode=0o700)
    (secret / "steps.csv").write_text("root's own file\n")
    (user / "realrun").mkdir(parents=True)
    for path in (user, user / "realrun"):
        os.chown(path, NOBODY, NOBODY)
    (user / "run").symlink_to(user / "realrun")  # (root's)
    _user_link(user / "evil", secret)
    real_readlink, swapped = os.readlink, []

    def readlink_swapped_and_back(path, *args, **kwargs):
        if swapped or os.fspath(path) not in (os.fspath(user / "run"), "run"):
            return real_readlink(path, *args, **kwargs)
        swapped.append(True)
        os.rename(user / "run", user / "run.away")
        os.rename(user / "evil", user / "run")
        text = real_readlink(path, *args, **kwargs)
        os.rename(user / "run", user / "evil")
        os.rename(user / "run.away", user / "run")
        return text

    monkeypatch.delattr(os, "O_PATH")
    monkeypatch.setattr(files, "_identity", lambda seen: (seen.st_dev, seen.st_ino, seen.st_uid, seen.st_nlink))
    monkeypatch.setattr(files.os, "readlink", readlink_swapped_and_back)  # (a clock too coarse to see it)
    with pytest.raises(files.NotReplaced, match=r"run is a symbolic link of user 65534's to .*rootonly, which is not"):
        replace_atomically(user / "run" / "steps.csv", "step,lr\n1,0.1\n")
    assert swapped and (secret / "steps.csv").read_text() == "root's own file\n" and _names(secret) == ["steps.csv"]
    monkeypatch.setattr(files.os, "readlink", real_readlink)
    replace_atomically(user / "run" / "steps.csv", "step,lr\n1,0.1\n")  # (root's link to the user's own folder)
    assert (user / "realrun" / "steps.csv").read_text() == "step,lr\n1,0.1\n"


@ROOT
@pytest.mark.parametrize("walk", ["by descriptors", "by names"])
def test_a_users_link_to_nothing_in_roots_folder_is_judged_by_that_folder(tmp_path, monkeypatch, walk):
    # review 41: the walk by names judged a link that led to nothing by the link's own owner (followed);
    # the walk by descriptors judges it by the owner of the folder the new file would be made in (review 41d:
    # there is one walk now, by descriptors, its links looked at by name where the OS has no O_PATH)
    if walk == "by names":
        monkeypatch.delattr(os, "O_PATH")
    secret, user = tmp_path / "rootonly", tmp_path / "user"
    secret.mkdir(mode=0o700)
    user.mkdir()
    os.chown(user, NOBODY, NOBODY)
    _user_link(user / "steps.csv", secret / "new.csv")
    with pytest.raises(files.NotReplaced, match=r"is a symbolic link of user 65534's to .*new\.csv, which is not theirs"):
        os.close(files._walked(user / "steps.csv", True, user / "steps.csv")[0])
    # the user's own folder: followed, to the file it would make
    (user / "d").mkdir()
    os.chown(user / "d", NOBODY, NOBODY)
    _user_link(user / "mine.csv", user / "d" / "new.csv")
    fd, target = files._walked(user / "mine.csv", True, "mine.csv")
    os.close(fd)
    assert target == user / "d" / "new.csv"
    assert _names(secret) == []


# ---------------------------------------------------------------------------- 2: replaced, its folder not synced


def _failing_folder_sync(monkeypatch, error: int, armed=lambda: True) -> None:
    folder_sync_raises(monkeypatch, lambda: OSError(error, os.strerror(error)), armed)


@pytest.mark.parametrize("error", [errno.EIO, errno.ENOSPC])
def test_an_error_after_the_rename_says_the_file_was_replaced(tmp_path, monkeypatch, error):
    # review 41 r5: the folder's sync failing after the rename was as any failed write: "as it was"
    path = tmp_path / "steps.csv"
    path.write_text("old\n")
    _failing_folder_sync(monkeypatch, error)
    with pytest.raises(DiskFull if error == errno.ENOSPC else OSError) as err:
        replace_atomically(path, "new\n")
    assert err.value.replaced is True and path.read_text() == "new\n" and _names(tmp_path) == ["steps.csv"]
    # an error before it: the file as it was, and no such mark
    monkeypatch.setattr(files, "_sync", lambda fd: (_ for _ in ()).throw(OSError(errno.EIO, "Input/output error")))
    with pytest.raises(OSError) as err:
        replace_atomically(path, "newer\n")
    assert not hasattr(err.value, "replaced") and path.read_text() == "new\n"


@pytest.mark.parametrize("kind", ["csv", "jsonl"])
def test_begin_again_whose_cut_was_made_but_not_synced_keeps_the_rows_it_set_aside(tmp_path, monkeypatch, kind):
    # review 41 r5: the cut's rename made, its folder's sync failed: begin_again deleted the attempt's copy
    # (its rows in neither file) and said "cannot cut" (the file as it was)
    sink = sink_of_four_steps(tmp_path, kind)
    armed = armed_after_set_aside(monkeypatch)
    _failing_folder_sync(monkeypatch, errno.EIO, lambda: bool(armed))
    with pytest.raises(InputError) as err:
        sink.begin_again(2)
    copy = sink.path.with_name(f"steps.attempt-1.{kind}")
    count = lambda path: path.read_text().count('"step"') if kind == "jsonl" else len(_rows(path))  # noqa: E731
    assert copy.exists() and count(sink.path) == 2 and count(copy) == 2  # (each row once)
    assert str(err.value) == (f"{sink.path} was cut back to step 2 for the loop's new attempt, but its folder could "
                              "not be synced after (Input/output error): a crash could bring back the rows after it")


# ---------------------------------------------------------------------------- 2: begin_again's other failures


class _ClosingFails:
    """A sink's file whose close fails (a quota, an NFS error said only at close)."""

    def __init__(self, file):
        self.file = file

    def __getattr__(self, name):
        return getattr(self.file, name)

    def close(self):
        self.file.close()
        raise OSError(errno.EDQUOT, "Disk quota exceeded")


@pytest.mark.parametrize("how", ["close fails", "cut refused"])
def test_begin_again_that_fails_takes_its_copy_back_and_goes_on_appending(tmp_path, monkeypatch, how):
    # review 41 r13: a close that failed (DiskFull) sat outside the try: the rows in both files. And a sink
    # whose cut failed was left closed: its next row raised "I/O operation on closed file"
    sink = CsvSink(tmp_path / "steps.csv")
    for step in range(1, 5):
        sink.write(_log(step))
    if how == "close fails":
        sink._file = _ClosingFails(sink._file)
        expected = DiskFull
    else:
        real = sinks.replace_atomically

        def refused(path, data, through_link=False):
            if through_link:  # (the cut; set_aside's copy is made without it)
                raise PermissionError(errno.EACCES, "Permission denied", str(Path(path).parent / ".steps.csv.tmp-x"))
            return real(path, data, through_link=through_link)

        monkeypatch.setattr(sinks, "replace_atomically", refused)
        expected = InputError
    with pytest.raises(expected):
        sink.begin_again(2)
    assert _names(tmp_path) == ["steps.csv"] and _rows(sink.path) == [1, 2, 3, 4]
    sink.write(_log(5))  # (open again, as it was)
    sink.close()
    assert _rows(sink.path) == [1, 2, 3, 4, 5]


# ---------------------------------------------------------------------------- 3: the callback's own CSV


@pytest.mark.parametrize("how", ["cut refused", "cut made, its folder not synced"])
def test_the_callbacks_retry_whose_cut_fails_takes_its_copy_back(tmp_path, monkeypatch, how):
    # review 41 r6: on an auto_find_batch_size retry the callback set the CSV's rows aside, then a cut that
    # failed left them in both files, and said "to resume"
    trainer = hf_retrying_trainer(tmp_path / "out")
    real, armed = sinks.replace_atomically, []

    def cut(path, data, through_link=False):
        if through_link and Path(path).name == "steps.csv":
            if how == "cut refused":
                raise PermissionError(errno.EACCES, "Permission denied", str(Path(path).parent / ".steps.csv.tmp-x"))
            armed.append(True)
        return real(path, data, through_link=through_link)

    monkeypatch.setattr(sinks, "replace_atomically", cut)
    _failing_folder_sync(monkeypatch, errno.EIO, lambda: bool(armed))
    folder = tmp_path / "out" / "ampguard"
    with pytest.raises(InputError) as err:
        trainer.train()
    if how == "cut refused":
        assert not (folder / "steps.attempt-1.csv").exists() and _rows(folder / "steps.csv") == [1, 2]
        assert str(err.value) == (f"cannot cut {folder / 'steps.csv'} back to step 0 for the loop's new attempt: "
                                  f"Permission denied ({folder / '.steps.csv.tmp-x'})")
    else:
        assert _rows(folder / "steps.attempt-1.csv") == [1, 2] and _rows(folder / "steps.csv") == []
        assert str(err.value).startswith(f"{folder / 'steps.csv'} was cut back to step 0 for the loop's new attempt, "
                                         "but its folder could not be synced after (Input/output error)")


def test_a_stop_signal_after_the_rename_says_the_file_was_replaced_too(tmp_path, monkeypatch):
    # review 41d F4: an interrupt (Ctrl-C, a stop signal's Interrupted) in the folder's sync was not marked:
    # a retry's cut then took back the only copy of the rows it had set aside
    from ampguard.signals import Interrupted

    path = tmp_path / "steps.csv"
    path.write_text("old\n")
    real_sync = files._sync

    def sync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise Interrupted("interrupted (Ctrl-C)")
        return real_sync(fd)

    monkeypatch.setattr(files, "_sync", sync)
    with pytest.raises(Interrupted) as err:
        replace_atomically(path, "new\n")
    assert err.value.replaced is True and path.read_text() == "new\n"
