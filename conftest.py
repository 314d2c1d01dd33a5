"""The docstring examples in src/ampguard make their folders with ``tempfile.mkdtemp()``, the way a
reader would; under pytest those land in the test's own ``tmp_path`` (pytest keeps the last three
sessions' and removes the rest), not in the system's temporary folder, where every run of the
suite left a dozen behind."""

from __future__ import annotations

import tempfile

import pytest
from _pytest.doctest import DoctestItem


@pytest.fixture(autouse=True)
def _doctest_folders_in_tmp_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if isinstance(request.node, DoctestItem):
        monkeypatch.setattr(tempfile, "tempdir", str(request.getfixturevalue("tmp_path")))
