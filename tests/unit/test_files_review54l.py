"""Review 54l: a stop signal inside ``files._walked`` (the walk of a path by descriptors that every
atomic write makes) that landed between the close of the folder the walk held and the walk's move
to the next one had the walk's handler close the same descriptor again: "Bad file descriptor"
came out of the write (``cannot create run folder ...``, exit 2) instead of the interrupt (130),
and in a process with threads it could close another thread's newly opened file."""

from __future__ import annotations

import sys

from ampguard import files
from ampguard.files import replace_atomically


def _stopped_at_line(k: int, call) -> bool:
    """Run ``call`` with a KeyboardInterrupt raised at the ``k``-th line ``_walked`` runs (the moment
    a Ctrl-C's handler runs); whether it was raised (``_walked`` ran fewer lines: False)."""
    count = [0]

    def local(frame, event, arg):
        if event == "line":
            count[0] += 1
            if count[0] == k:
                raise KeyboardInterrupt
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code is files._walked.__code__ else None

    sys.settrace(tracer)
    try:
        call()
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(None)
    return False


def test_a_stop_anywhere_in_the_walk_comes_out_as_the_stop(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "up").symlink_to(tmp_path / "a" / "b")  # (an absolute link: the walk starts again at /)
    target = tmp_path / "up" / ".." / "b" / "file.txt"  # (and a "..": the walk goes up)
    for k in range(1, 100_000):
        if not _stopped_at_line(k, lambda: replace_atomically(target, "x\n")):
            break
    assert k > 50 and (tmp_path / "a" / "b" / "file.txt").read_text() == "x\n"
