"""Review 55d: the writes that skipped the link checks the rest of the package applies. A log
appended to (``events.jsonl``, the sinks' CSV and JSON lines, validate's history) is reached as a
file replaced whole is (``files.open_to_append``: another user's link to what is not theirs
refused); a checkpoint's temporary file has a name no one can guess and is made new, never
through a link put at it; ``report`` and ``validate`` print what a run folder or a shared history
holds with its control characters escaped; an over-long line of ``events.jsonl`` is an unreadable
line, never read whole."""

from __future__ import annotations

import os
import re
import resource
import types
from pathlib import Path

import pytest

from helpers import in_fork, minimal_payload

from ampguard import checkpoint as ckpt
from ampguard import files
from ampguard.errors import InputError
from ampguard.report import LoggedEvents
from ampguard.sinks import CsvSink, JsonlSink
from ampguard.validate import note_verdict, rejections_text

ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (to make a link another user's)")
NOBODY = 65534
REFUSED = r"is a symbolic link of user 65534's to .*, which is not theirs; refusing to write through it"


@pytest.fixture
def planted(tmp_path):
    """A root-only file ``victim`` (what a root run must never write), and the folder ``team`` of
    uid 65534 (a teammate's run folder, a shared runs folder): ``plant(name)`` puts a link of that
    user's there, at ``name``, to the victim."""
    secret = tmp_path / "rootonly"
    secret.mkdir(mode=0o700)
    victim = secret / "victim"
    victim.write_bytes(b"PRECIOUS\n")
    team = tmp_path / "team"
    team.mkdir()
    os.chown(team, NOBODY, NOBODY)

    def plant(name: str, content: bytes = b"PRECIOUS\n") -> Path:
        victim.write_bytes(content)
        link = team / name
        link.symlink_to(victim)
        os.lchown(link, NOBODY, NOBODY)
        return link

    return victim, plant


# ---------------------------------------------------------------------------- F1: logs appended to


@ROOT
def test_a_log_appended_to_is_not_written_through_another_users_link(planted):
    # review 55d F1: events.jsonl (JsonlSink(append=True), no keep_through: no cut, so no check) was opened
    # with a plain open("ab"): a root resume of a teammate's run appended its events to root's file
    victim, plant = planted
    line = b'{"step": 1, "event": "run_start", "message": "m"}\n'
    link = plant("events.jsonl", line)
    with pytest.raises(InputError, match=f"^cannot write {re.escape(str(link))}: {re.escape(str(link))} {REFUSED}$"):
        JsonlSink(link, append=True)
    assert victim.read_bytes() == line


@ROOT
def test_a_torn_last_line_is_not_cut_through_another_users_link(planted):
    # the torn-tail cut before an append (os.truncate by name) went through the link too: root's file lost its tail
    victim, plant = planted
    content = b'{"step": 1, "event": "run_start"}\n{"step": 2, "ev'
    link = plant("events.jsonl", content)
    with pytest.raises(InputError, match=REFUSED):
        JsonlSink(link, append=True)
    assert victim.read_bytes() == content


@ROOT
def test_a_csv_appended_to_is_not_written_through_another_users_link(planted):
    # (every appender opens the same way: the CSV, its cut done, was opened again by name, after the check)
    victim, plant = planted
    link = plant("steps.csv", b"")
    with pytest.raises(InputError, match=REFUSED):
        CsvSink(link, append=True)
    assert victim.read_bytes() == b""


def test_a_log_reached_through_ones_own_links_is_appended_to(tmp_path):
    # (the rule is the one replace_atomically follows: a link of this user's, or of whoever owns its target, goes)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "events.jsonl").write_bytes(b'{"step": 1, "event": "a"}\n')
    (tmp_path / "events.jsonl").symlink_to(tmp_path / "elsewhere" / "events.jsonl")
    sink = JsonlSink(tmp_path / "events.jsonl", append=True)
    sink.write_event({"step": 2, "event": "b"})
    sink.close()
    assert (tmp_path / "elsewhere" / "events.jsonl").read_bytes().splitlines()[1] == b'{"step": 2, "event": "b"}'
    assert (tmp_path / "events.jsonl").is_symlink()


# ---------------------------------------------------------------------------- F2: a checkpoint's temporary file


def test_a_checkpoint_is_never_written_through_a_link_at_its_old_temporary_name(tmp_path):
    # review 55d F2: the temporary file was .step-N.pt.tmp-PID (the PID in the world-readable lock file),
    # opened with open("wb"): links planted for the coming steps had a root resume overwrite their target
    victim = tmp_path / "victim"
    victim.write_bytes(b"PRECIOUS\n")
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    trap = folder / f".step-00000003.pt.tmp-{os.getpid()}"
    trap.symlink_to(victim)
    path = ckpt.save_checkpoint(folder / "step-00000003.pt", minimal_payload(3))
    assert victim.read_bytes() == b"PRECIOUS\n"
    assert not path.is_symlink() and ckpt.load_checkpoint(path)["step"] == 3
    assert trap.is_symlink()  # (not ours to use: left for the start-up sweep)


def test_a_checkpoints_temporary_file_has_a_random_name_and_its_leftovers_are_swept(tmp_path, monkeypatch):
    names = []
    real_replace = os.replace

    def replace(src, dst, **dir_fds):
        names.append(os.fspath(src))
        real_replace(src, dst, **dir_fds)

    monkeypatch.setattr(os, "replace", replace)
    ckpt.save_checkpoint(tmp_path / "step-00000005.pt", minimal_payload(5))
    monkeypatch.undo()
    assert len(names) == 1 and re.fullmatch(rf"\.step-00000005\.pt\.tmp-{os.getpid()}-[0-9a-f]{{16}}", names[0])
    # a save a kill cut short leaves such a name: the sweep knows it (and an older ampguard's .tmp-PID)
    left = [tmp_path / ".step-00000006.pt.tmp-4242-0123456789abcdef", tmp_path / ".step-00000007.pt.tmp-4242"]
    for path in left:
        path.write_bytes(b"half a checkpoint")
    assert sorted(ckpt.remove_partial(tmp_path)) == sorted(left)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000005.pt"]


@ROOT
def test_a_checkpoint_folder_reached_through_another_users_link_is_refused(planted, tmp_path):
    # (the folder is walked as a file replaced whole: a teammate's checkpoints/ made a link to root's folder)
    victim, plant = planted
    link = plant("checkpoints")
    victim.unlink()
    victim.mkdir()  # (a folder of root's)
    with pytest.raises(files.NotReplaced, match=REFUSED):
        ckpt.save_checkpoint(link / "step-00000001.pt", minimal_payload(1))
    assert list(victim.iterdir()) == []


# ---------------------------------------------------------------------------- F3, F5: validate's history


@ROOT
def test_validate_notes_no_verdict_through_another_users_link_in_a_shared_folder(planted, tmp_path):
    # review 55d F3: log.dir/validate-history.jsonl, a link another user put in a shared runs folder, had
    # root's validate append its verdict to the file it led to
    victim, plant = planted
    link = plant("validate-history.jsonl")
    said = note_verdict(link, {"weights": "w", "rules": {}}, types.SimpleNamespace(ok=True, verdict="ACCEPTED"),
                        tmp_path / "report")
    assert said is not None and re.search(REFUSED, said), said
    assert victim.read_bytes() == b"PRECIOUS\n"


def test_validate_notes_a_verdict_on_a_line_of_its_own_after_a_torn_one(tmp_path):
    history = tmp_path / "validate-history.jsonl"
    history.write_bytes(b'{"torn')
    v = types.SimpleNamespace(ok=False, verdict="REJECTED")
    assert note_verdict(history, {"weights": "w", "rules": {}}, v, tmp_path / "r") is None
    assert note_verdict(history, {"weights": "w", "rules": {}}, v, tmp_path / "r") is None
    lines = history.read_bytes().split(b"\n")
    assert lines[0] == b'{"torn' and lines[1].startswith(b'{"time"') and lines[2].startswith(b'{"time"') and lines[3] == b""


def test_earlier_verdicts_from_a_history_are_said_with_their_control_characters_escaped():
    # review 55d F5: another user's history line set the terminal's title and wrote a line of its own
    said = rejections_text([{"time": "t\x1b[5m", "report": "/x\x1b]0;pwned\x07\rFAKE LINE",
                             "verdict": "REJECTED\x1b[2J", "changed": ["validation.max_flips: 7 -> 0\n"]}])
    assert not any(c in said for c in "\x1b\x07\r\n"), said
    assert "REJECTED\\x1b[2J at t\\x1b[5m (/x\\x1b]0;pwned\\x07\\rFAKE LINE)" in said


# ---------------------------------------------------------------------------- F6: an over-long line of events.jsonl


def test_an_over_long_event_line_is_unreadable_and_the_lines_after_it_are_read(tmp_path, monkeypatch):
    monkeypatch.setattr("ampguard.report.MAX_EVENT_LINE", 64, raising=False)
    long = '{"step": 2, "event": "x", "message": "' + "a" * 200 + '"}'
    (tmp_path / "events.jsonl").write_text('{"step": 1, "event": "a"}\n' + long + '\n{"step": 3, "event": "b"}\n'
                                           + long)  # (the last one torn: no newline)
    log = LoggedEvents(tmp_path)
    assert [e["step"] for e in log.events()] == [1, 3]
    assert log.unreadable() == [2]


def test_a_huge_event_line_is_not_read_whole(tmp_path):
    # review 55d F6: events.jsonl read whole (read_text) with a 1 GiB line: report and compare ended in a
    # MemoryError traceback under a memory limit. Here a 192 MiB line (12 times MAX_EVENT_LINE), 128 MiB to spare (a
    # whole read of it fails there; the reads of MAX_EVENT_LINE fit); a sparse file: no disk used
    path = tmp_path / "events.jsonl"
    with path.open("wb") as f:
        f.write(b'{"step": 1, "event": "a"}\n')
        f.seek(192 << 20, os.SEEK_CUR)
        f.write(b'\n{"step": 2, "event": "b"}\n')

    def limited() -> None:  # (what this process holds now, and 128 MiB more)
        size = int(re.search(r"VmSize:\s+(\d+) kB", Path("/proc/self/status").read_text())[1]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (size + (128 << 20), resource.RLIM_INFINITY))

    def read() -> str:
        log = LoggedEvents(tmp_path)
        return f"{[e['step'] for e in log.events()]} {log.unreadable()}"

    code, said = in_fork(read, preexec=limited)
    assert (code, said) == (0, "[1, 2] [2]"), said

