"""What a run tells people besides its records (``ampguard.events``): the event log, the
console words, the Ctrl-C handler."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from helpers import read_events

from ampguard import events
from ampguard.errors import InputError
from ampguard.events import EventLog, event_word

from ampguard.signals import stop_on_signals as stop_on_sigint

MONITOR = Path(events.__file__).with_name("monitor.py")


# ---------------------------------------------------------------------------- EventLog


def test_each_event_is_one_json_line_with_the_time(tmp_path):
    path = tmp_path / "events.jsonl"
    log = EventLog(path, lambda line: None)
    before = time.time()
    log.emit({"step": 0, "event": "run_start", "message": "linear; bf16 on cpu"})
    log.emit({"step": 3, "event": "rollback", "message": "loss spike", "checkpoint": "step-00000002.pt"}, "ROLLBACK")
    log.close()
    first, second = read_events(path, strict=False)
    assert first == {"time": first["time"], "step": 0, "event": "run_start", "message": "linear; bf16 on cpu"}
    assert list(second) == ["time", "step", "event", "message", "checkpoint"]
    assert before - 1 <= first["time"] <= second["time"] <= time.time() + 1
    assert path.read_text(encoding="utf-8").count("\n") == 2


def test_the_console_gets_word_step_message_only_when_given_a_word(tmp_path):
    said: list[str] = []
    log = EventLog(tmp_path / "events.jsonl", said.append)
    log.emit({"step": 0, "event": "run_start", "message": "quiet"})
    log.emit({"step": 5, "event": "checkpoint", "message": "saved step-00000005.pt"})
    log.emit({"step": 7, "event": "skip_rate_alert", "message": "rolling skip rate 0.2 > 0.05"}, "ALERT")
    log.close()
    assert said == ["ALERT 7 rolling skip rate 0.2 > 0.05"]
    assert len(read_events(tmp_path / "events.jsonl", strict=False)) == 3  # the file has every event, printed or not


def test_without_a_path_it_only_prints():
    said: list[str] = []
    log = EventLog(None, said.append)
    log.emit({"step": 2, "event": "fail", "message": "skip rate"}, "FAIL")
    log.close()
    assert said == ["FAIL 2 skip rate"]


def test_appending_on_resume_keeps_the_earlier_lines(tmp_path):
    path = tmp_path / "events.jsonl"
    log = EventLog(path, lambda line: None)
    log.emit({"step": 0, "event": "run_start", "message": "first"})
    log.emit({"step": 4, "event": "checkpoint", "message": "saved step-00000004.pt"})
    log.close()
    resumed = EventLog(path, lambda line: None, append=True)
    resumed.emit({"step": 4, "event": "resume", "message": "resumed from step-00000004.pt at step 4"}, "RESUME")
    resumed.close()
    assert [e["event"] for e in read_events(path, strict=False)] == ["run_start", "checkpoint", "resume"]


def test_an_existing_log_is_never_overwritten_without_append(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"step": 0, "event": "run_start", "message": "kept"}\n', encoding="utf-8")
    with pytest.raises(InputError, match="already exists"):
        EventLog(path, lambda line: None)
    assert read_events(path, strict=False) == [{"step": 0, "event": "run_start", "message": "kept"}]


# ---------------------------------------------------------------------------- event_word

WORDS = {"skip_rate_alert": "ALERT", "skip_rate_clear": "CLEAR", "scale_alert": "ALERT", "scale_clear": "CLEAR",
         "fail": "FAIL"}


@pytest.mark.parametrize(("kind", "word"), sorted(WORDS.items()))
def test_event_word_of_each_monitor_event_kind(kind, word):
    assert event_word(kind) == word


def test_the_words_cover_every_kind_the_monitor_emits():
    """A new event kind in monitor.py must get its word here (event_word calls anything else CLEAR)."""
    source = MONITOR.read_text(encoding="utf-8")
    kinds = set(re.findall(r"Event\(\s*step,\s*\"([a-z_]+)\"", source))
    assert kinds == set(WORDS), kinds ^ set(WORDS)


# ---------------------------------------------------------------------------- the SIGINT handler


def sigint() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.01)  # let the interpreter run the Python-level handler


def sentinel_handler(signum, frame) -> None:  # installed around each test, so restoring is visible
    raise AssertionError("the previous handler ran inside stop_on_sigint")


@pytest.fixture
def previous_handler():
    saved = signal.signal(signal.SIGINT, sentinel_handler)
    try:
        yield sentinel_handler
    finally:
        signal.signal(signal.SIGINT, saved)


def test_the_first_sigint_sets_the_flag_without_raising(previous_handler):
    with stop_on_sigint() as stop:
        assert not stop.requested
        sigint()
        assert stop.requested
        assert signal.getsignal(signal.SIGINT) is not previous_handler
    assert signal.getsignal(signal.SIGINT) is previous_handler


def test_the_second_sigint_raises_keyboard_interrupt(previous_handler):
    with pytest.raises(KeyboardInterrupt):
        with stop_on_sigint() as stop:
            sigint()
            assert stop.requested
            sigint()
            pytest.fail("the second SIGINT did not interrupt")
    assert signal.getsignal(signal.SIGINT) is previous_handler  # restored on the way out too


def test_each_use_starts_with_a_fresh_flag(previous_handler):
    with stop_on_sigint() as first:
        sigint()
    with stop_on_sigint() as second:
        assert first.requested and not second.requested
        sigint()  # a first SIGINT again: no KeyboardInterrupt
        assert second.requested
    assert signal.getsignal(signal.SIGINT) is previous_handler


def test_a_sigint_the_process_was_started_ignoring_stays_ignored_and_sigterm_still_stops():
    # review_seeds10: a script's background job (`ampguard train &`) starts with SIGINT ignored, so
    # that Ctrl-C in the terminal stops only the foreground command; the loop took it over and stopped
    saved = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with stop_on_sigint() as stop:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            sigint()
            assert not stop.requested
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)
            assert stop.requested and int(stop.exit_code) == 143
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, saved)


# ---------------------------------------------------------------------------- a full disk (issue 16)


def test_an_event_log_that_finds_the_disk_full_goes_quiet_and_remembers_it(tmp_path):
    import errno

    lines: list[str] = []
    log = EventLog(tmp_path / "events.jsonl", lines.append)
    log.emit({"step": 1, "event": "checkpoint", "message": "saved"})

    class Full:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            pass

        def close(self):
            pass

    log._sink._file = Full()
    log.emit({"step": 2, "event": "fail", "message": "skip rate"}, "FAIL")
    log.emit({"step": 3, "event": "rollback", "message": "rolled back"}, "ROLLBACK")  # nothing more is tried
    log.close()
    assert log.failed is not None and log.failed.path == tmp_path / "events.jsonl" and log.failed.through == 2
    assert lines == ["FAIL 2 skip rate", "ROLLBACK 3 rolled back"]  # the console words go on
    assert [e["step"] for e in read_events(tmp_path / "events.jsonl", strict=False)] == [1]
