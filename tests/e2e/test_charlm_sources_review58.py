"""Review 58d, finding 2: charlm's standard-library sources, read at run time, are its data.

A source that cannot be read (a disk error; a file left unreadable to this user by an install
under ``umask 077``, whose imports the ``.pyc`` files still serve) was a traceback, exit 1; now
one line naming the file and why, exit 2, and no run folder. Sources that are all empty were
refused as a ``task.block_size`` too long for the held-out text; now the empty corpus is named.

The standard library is a copy in the test's folder (``sysconfig``'s ``stdlib`` pointed at it);
the read error is a real one: a source that is a link to ``/proc/self/mem``, a regular file
whose read at offset 0 fails with EIO (the address is not mapped), for root too.
"""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import pytest

from ampguard.tasks.charlm import SOURCES
from helpers import one_error_line

TINY = ["--set", "task.name=charlm", "--set", "task.n_layer=1", "--set", "task.n_embd=16", "--set", "task.n_head=2",
        "--set", "task.block_size=16", "--set", "task.batch_size=4", "--set", "steps=1", "--set", "log.plot=false"]


@pytest.fixture
def stdlib(tmp_path, monkeypatch):
    """A copy of charlm's sources, which the task reads in place of the standard library's."""
    real = Path(sysconfig.get_paths()["stdlib"])
    folder = tmp_path / "stdlib"
    folder.mkdir()
    for name in SOURCES:
        shutil.copy(real / name, folder / name)
    get_paths = sysconfig.get_paths
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {**get_paths(*a, **k), "stdlib": str(folder)})
    return folder


def test_a_source_that_cannot_be_read_is_one_line_naming_it(cli, tmp_path, stdlib):
    (stdlib / "csv.py").unlink()
    (stdlib / "csv.py").symlink_to("/proc/self/mem")
    assert one_error_line(cli("train", *TINY)) == (
        f"ampguard: error: charlm: cannot read the standard-library source {stdlib / 'csv.py'}: Input/output error")
    assert not (tmp_path / "runs").exists()


def test_sources_that_are_all_empty_are_named_not_the_block_size(cli, tmp_path, stdlib):
    for name in SOURCES:
        (stdlib / name).write_bytes(b"")
    assert one_error_line(cli("train", *TINY)) == (
        f"ampguard: error: charlm: the standard-library sources under {stdlib} are empty (12 files, 0 bytes): no text "
        "to train on")
    assert not (tmp_path / "runs").exists()
