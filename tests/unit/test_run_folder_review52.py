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


def _hold_then_let_go(folder, ready) -> None:
    paths = RunPaths.existing(folder)
    paths.lock()
    ready.set()
    import time

    time.sleep(0.05)  # (inside the next one's patience)
    paths.unlock()


def test_a_lock_taken_while_its_holder_lets_go_is_the_one_the_folder_names(tmp_path):
    # review 52j: the waiting process locked the file its holder removed as it let go, and a third
    # made and locked a new one: two writers of one folder, and writer() said nobody wrote it
    context = multiprocessing.get_context("fork")
    ready = context.Event()
    holder = context.Process(target=_hold_then_let_go, args=(tmp_path, ready), daemon=True)
    holder.start()
    assert ready.wait(30)
    waiting = RunPaths.existing(tmp_path)
    waiting.lock()  # (waits the holder out)
    holder.join(30)
    try:
        assert (tmp_path / LOCK_FILE).is_file()
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


def test_a_holder_letting_go_as_the_patience_ends_leaves_one_writer(tmp_path, monkeypatch):
    # review 52n: the re-take ended with the patience; a holder letting go at its end left the waiting process
    # holding a removed file's lock, and a third locked the folder beside it
    import threading
    import time

    from ampguard import run_folder
    from ampguard.run_folder import LOCK_PATIENCE_S

    holder = RunPaths.existing(tmp_path)
    holder.lock()
    threading.Timer(LOCK_PATIENCE_S - 0.002, holder.unlock).start()
    named = run_folder._names

    def slow(path, fd):  # (the look at the name lands after the patience: a loaded machine, a slow stat)
        time.sleep(0.01)
        return named(path, fd)

    monkeypatch.setattr(run_folder, "_names", slow)
    waiting = RunPaths.existing(tmp_path)
    waiting.lock()
    monkeypatch.setattr(run_folder, "_names", named)
    try:
        assert named(tmp_path / LOCK_FILE, waiting._lock)
        with pytest.raises(InputError, match="is being written by another process"):
            RunPaths.existing(tmp_path).lock()
    finally:
        waiting.unlock()
