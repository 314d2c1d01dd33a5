"""tests/rewritten.py: the rewritten test modules xdist's controller writes ahead of its workers
are the ones pytest's loader reads, and a module edited since is not read from them."""

from __future__ import annotations

import sys
from pathlib import Path

from _pytest.assertion.rewrite import PYC_TAIL, _read_pyc, get_cache_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import rewritten  # noqa: E402


def test_the_written_module_is_read_by_pytests_loader_until_its_source_changes(tmp_path):
    test = tmp_path / "test_x.py"
    test.write_text("def test_x():\n    x = [1, 2]\n    assert x == [1, 3]\n")
    broken = tmp_path / "test_broken.py"
    broken.write_text("def test_(:\n")
    assert rewritten.write([str(test), str(broken), str(tmp_path / "test_gone.py")]) == 1
    assert rewritten.write([str(test)]) == 0  # (cached already)
    pyc = get_cache_dir(test) / ("test_x" + PYC_TAIL)
    code = _read_pyc(test, pyc)
    namespace: dict = {}
    exec(code, namespace)  # noqa: S102
    try:
        namespace["test_x"]()
    except AssertionError as error:  # (rewritten: the assert explains itself)
        assert "[1, 2] == [1, 3]" in str(error)
    else:
        raise AssertionError("the rewritten test passed")
    test.write_text(test.read_text().replace("[1, 3]", "[1, 2]"))
    assert _read_pyc(test, pyc) is None
