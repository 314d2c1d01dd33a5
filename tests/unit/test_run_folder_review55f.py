"""Review 55f: a run folder another process trains in is named by the pid its lock file records
(``PID HOST``, then ``kernel BOOT_ID``): a pid of another machine's (a folder on a shared file
system) or another container's means nothing here, and the "being written by another process"
lines named the pid alone. They name the host too where it is not this one, as the takeover's
refusal names a lock's holder (one formatter, ``run_folder._holder_named``)."""

from __future__ import annotations

import fcntl
import os
import socket

import pytest

from ampguard import compare, report
from ampguard.errors import InputError
from ampguard.run_folder import LOCK_FILE, RunPaths
from ampguard.sinks import CSV_COLUMNS


def _held_by(folder, line):
    """``folder``'s lock file holding ``line``, held (another open file: another holder)."""
    (folder / "steps.csv").write_text(",".join(CSV_COLUMNS) + "\n1,0.1,2.0,1.0,0.5,0,,1.0\n")
    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, line.encode("utf-8", "surrogateescape"))
    return fd


def _refusals(folder, capsys):
    """What the resume's lock, the resume's first look, compare and report say of ``folder``."""
    said = []
    for refused in (RunPaths.existing(folder).lock, RunPaths.existing(folder).check_not_written,
                    lambda: compare.load_run(folder)):
        with pytest.raises(InputError) as err:
            refused()
        said.append(str(err.value))
    report.run(folder, plot=False)
    said.append(next(line for line in capsys.readouterr().out.splitlines() if "being written" in line))
    return said


@pytest.mark.parametrize("host, named", [
    ("gpu-node-7.cluster", "pid 4242 on gpu-node-7.cluster"),
    ("odd\x1bhost" + "h" * 500, "pid 4242 on 'odd\\x1bhosthhh"),  # (escaped, shortened: a lock's text is any bytes)
    (socket.gethostname(), "pid 4242)"),  # (this host's: the pid alone, as before)
])
def test_a_writer_is_named_with_its_host_where_it_is_another_host_s(tmp_path, capsys, host, named):
    fd = _held_by(tmp_path, f"4242 {host}\nkernel another-boot\n")
    try:
        said = _refusals(tmp_path, capsys)
    finally:
        os.close(fd)
    for line in said:
        assert f"being written by another process ({named}" in line, line
        assert "\x1b" not in line and len(line) < 400 + len(str(tmp_path)), line
