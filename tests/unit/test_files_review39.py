"""Review 39g: a file replaced whole (``files.replace_atomically``) is made new at its temporary
name, never written, given away or opened up through what already lies there."""

from __future__ import annotations

import os

from ampguard.files import replace_atomically


def test_a_link_planted_at_the_temporary_name_is_not_written_through(tmp_path):
    # the name is predictable (.NAME.tmp-PID): a link put there made the write (and, as root,
    # the chown and chmod that keep a user's file theirs) land on the file it points at
    secret = tmp_path / "secret"
    secret.write_text("SECRET\n")
    os.chmod(secret, 0o600)
    csv = tmp_path / "steps.csv"
    csv.write_text("step\n1\n")
    os.chmod(csv, 0o640)
    (tmp_path / f".steps.csv.tmp-{os.getpid()}").symlink_to(secret)
    replace_atomically(csv, "step\n")
    assert secret.read_text() == "SECRET\n" and oct(secret.stat().st_mode & 0o777) == "0o600"
    assert not csv.is_symlink() and csv.read_text() == "step\n"
    assert oct(csv.stat().st_mode & 0o777) == "0o640"  # (the replaced file's mode kept)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["secret", "steps.csv"]  # (the planted link gone too)


def test_a_new_file_follows_the_umask_as_any_other(tmp_path):
    old = os.umask(0o027)
    try:
        replace_atomically(tmp_path / "card.md", "new\n")
    finally:
        os.umask(old)
    assert oct((tmp_path / "card.md").stat().st_mode & 0o777) == "0o640"
