"""Review 52c: a reader's look at the run folder's lock (``RunPaths.writer``, what ``report`` and
``compare`` ask) holds a shared lock for a moment; a resume's ``RunPaths.lock`` that landed in that
moment was refused as "being written by another process", naming the pid of a run killed long
before. A real reader process polls while the folder is locked and let go again and again."""

from __future__ import annotations

import multiprocessing

import pytest

from ampguard.errors import InputError
from ampguard.run_folder import LOCK_FILE, RunPaths


def _poll(folder, ready, stop) -> None:
    paths = RunPaths.existing(folder)
    ready.set()
    while not stop.is_set():
        paths.writer()


def test_a_reader_polling_the_lock_never_refuses_a_resume(tmp_path):
    (tmp_path / LOCK_FILE).write_text("12345\n")  # (left by a run killed earlier)
    context = multiprocessing.get_context("fork")
    ready, stop = context.Event(), context.Event()
    reader = context.Process(target=_poll, args=(tmp_path, ready, stop), daemon=True)
    reader.start()
    try:
        assert ready.wait(30)
        refused = []
        for _ in range(1500):
            paths = RunPaths.existing(tmp_path)
            try:
                paths.lock()
            except InputError as err:
                refused.append(str(err))
                continue
            paths.unlock()
            (tmp_path / LOCK_FILE).write_text("12345\n")
    finally:
        stop.set()
        reader.join(30)
    assert refused == []


def test_a_process_that_holds_the_lock_is_still_refused(tmp_path):
    holder = RunPaths.existing(tmp_path)
    holder.lock()
    try:
        with pytest.raises(InputError, match="is being written by another process"):
            RunPaths.existing(tmp_path).lock()
    finally:
        holder.unlock()


def test_a_lock_file_that_is_a_folder_is_refused_not_skipped(tmp_path):
    # review 52a: os.open's EISDIR read as "a folder that cannot be written": the run went on unlocked,
    # and two resumes wrote one folder at once (the second cut the first's CSV as it wrote)
    (tmp_path / LOCK_FILE).mkdir()
    with pytest.raises(InputError, match=rf"^{tmp_path / LOCK_FILE} is not a regular file; remove it \(ampguard keeps "
                                         r"its lock there\)$"):
        RunPaths.existing(tmp_path).lock()


def _letting_go_at_the_first_try(monkeypatch, holder, *, late: float = 0.0) -> None:
    """``fcntl.flock`` as ``run_folder`` calls it: at the next process's first try of the lock, the
    holder lets go (its file taken away), and the clock then reads ``late`` seconds on (past the
    patience: the moment made, not waited for on a loaded machine)."""
    import fcntl
    import time

    from ampguard import run_folder

    shift, real_flock, real_clock = [0.0], fcntl.flock, time.monotonic

    def flock(fd, how):
        if holder._lock is not None and how == fcntl.LOCK_EX | fcntl.LOCK_NB:
            holder.unlock()
            shift[0] = late
        return real_flock(fd, how)

    monkeypatch.setattr(run_folder.fcntl, "flock", flock)
    monkeypatch.setattr(run_folder.time, "monotonic", lambda: real_clock() + shift[0])


@pytest.mark.parametrize("late", [0.0, 10.0])
def test_a_lock_taken_while_its_holder_lets_go_is_the_one_the_folder_names(tmp_path, monkeypatch, late):
    # review 52j: the waiting process locked the file its holder removed as it let go, and a third
    # made and locked a new one: two writers of one folder, and writer() said nobody wrote it; review 52n:
    # so again where the holder let go as the patience ended (late: the re-take was bounded by it)
    from ampguard import run_folder

    holder = RunPaths.existing(tmp_path)
    holder.lock()
    _letting_go_at_the_first_try(monkeypatch, holder, late=late)
    waiting = RunPaths.existing(tmp_path)
    waiting.lock()
    monkeypatch.undo()
    try:
        assert run_folder._names(tmp_path / LOCK_FILE, waiting._lock)
        assert RunPaths.existing(tmp_path).writer() is not None
        with pytest.raises(InputError, match="is being written by another process"):
            RunPaths.existing(tmp_path).lock()
    finally:
        waiting.unlock()


def test_a_lock_whose_file_never_reads_as_the_folders_ends_held_not_in_a_loop(tmp_path, monkeypatch):
    # review 52l: where stat and fstat never agree (a file system's quirk), the re-take looped for ever
    import time

    monkeypatch.setattr("ampguard.run_folder._names", lambda path, fd: False)
    paths = RunPaths.existing(tmp_path)
    began = time.monotonic()
    paths.lock()
    try:
        assert time.monotonic() - began < 5 and paths._lock is not None
    finally:
        paths.unlock()
