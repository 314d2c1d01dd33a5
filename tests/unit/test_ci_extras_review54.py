"""Review 54d: with CI set, a test skipped because a test extra (the frameworks the adapters are
tested against, pyproject's ``test``) cannot be imported is a failure, not a skip: CI installs
them, so a broken install turned whole integration modules into skips and the suite stayed green.
Without CI a missing extra still skips (a developer without, say, torchao). Each case runs a few
tiny test files in a pytest session of its own, both sessions in one process forked warm
(tests/warm.py: torch, which the conftest imports, imported already; the extras are not), with
tests/conftest.py as a plugin (its hooks do it) and the extras hidden as if not installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import warm

TESTS = Path(__file__).resolve().parents[1]

HIDE = """
import sys
sys.modules["mlflow"] = None  # (as if not installed: an import raises ImportError)
sys.modules["torchao"] = None
"""
MODULE_LEVEL = """
import pytest
pytest.importorskip("mlflow")

def test_uses_mlflow():
    pass
"""
IN_TESTS = """
import pytest

def test_importorskip_in_a_test():
    pytest.importorskip("torchao")

@pytest.mark.skipif(True, reason="tensorboard is not installed")
def test_skipif_not_installed():
    pass

def test_a_submodule_a_version_may_lack():
    pytest.importorskip("transformers.no_such_submodule")

def test_skipped_for_another_reason():
    pytest.skip("needs a CUDA device")

def test_runs():
    pass
"""


MARK = "=== the session's exit code: "
"""(Ends each session's output; its exit code follows on that line.)"""
SESSIONS = f"""
import os, sys

import pytest

for ci in ("true", None):  # (CI set, then not: one pytest session each, in this one process)
    if ci is None:
        del os.environ["CI"]
    else:
        os.environ["CI"] = ci
    code = pytest.main(sys.argv[1:])
    print("\\n" + {MARK!r} + str(int(code)), flush=True)
"""


def _pytest(folder: Path) -> dict[str | None, subprocess.CompletedProcess]:
    """The tiny test files in ``folder`` run by pytest with CI set ("true") and without it (None): a
    session each, both in one process forked warm (the hooks read CI at each report): {CI: what the
    session returned, and printed}."""
    (folder / "hide_extras.py").write_text(HIDE, encoding="utf-8")
    (folder / "test_module_level.py").write_text(MODULE_LEVEL, encoding="utf-8")
    (folder / "test_in_tests.py").write_text(IN_TESTS, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS") and not k.startswith("PYTEST_XDIST")}
    env["PYTHONPATH"] = os.pathsep.join([str(folder), str(TESTS), str(TESTS.parent / "src"), env.get("PYTHONPATH", "")])
    done = warm.run([sys.executable, "-c", SESSIONS, "-p", "no:cacheprovider", "-p", "no:xdist", "-o", "addopts=",
                     "-p", "conftest", "-p", "hide_extras", "--continue-on-collection-errors", "-rA", "-q",
                     "--rootdir", str(folder), str(folder)],
                    cwd=folder, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.count(MARK) == 2, done.stdout + done.stderr
    runs, rest = {}, done.stdout
    for ci in ("true", None):
        said, _, rest = rest.partition(MARK)
        code, _, rest = rest.partition("\n")
        runs[ci] = subprocess.CompletedProcess(done.args, int(code), said, done.stderr)
    return runs


@pytest.fixture(scope="module")
def sessions(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    return _pytest(tmp_path_factory.mktemp("ci_extras"))


def _outcomes(done: subprocess.CompletedProcess) -> dict[str, str]:
    """The test files and tests that failed or erred, from ``-rA``'s summary (``FAILED path::name - why``,
    ``ERROR path - why``): {the file's or the test's name: FAILED or ERROR}."""
    found = {}
    for line in done.stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("FAILED", "ERROR"):
            found[rest.split(" - ")[0].split("::")[-1]] = word
    return found


def test_with_ci_set_a_missing_test_extra_fails_where_it_skipped(sessions):
    done = sessions["true"]
    outcomes = _outcomes(done)
    assert done.returncode == 1, done.stdout + done.stderr
    # a module that importorskips an extra at its top (collected as an error), one in a test, a skipif's
    assert outcomes["test_module_level.py"] == "ERROR", done.stdout
    assert outcomes["test_importorskip_in_a_test"] == "FAILED", done.stdout
    assert outcomes["test_skipif_not_installed"] == "ERROR", done.stdout
    assert "CI is set, and a test extra its tests need cannot be imported: could not import 'mlflow'" in done.stdout
    # a submodule (not an extra itself) and a skip for another reason stay skips; a test that runs passes
    assert "1 passed, 2 skipped" in done.stdout, done.stdout
    assert "no_such_submodule" in done.stdout and "needs a CUDA device" in done.stdout


def test_without_ci_a_missing_test_extra_still_skips(sessions):
    done = sessions[None]
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed, 5 skipped" in done.stdout, done.stdout
    assert "CI is set" not in done.stdout
