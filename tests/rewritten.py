"""Write pytest's assertion-rewritten bytecode of test modules ahead of the suite's workers:
``python rewritten.py FILE...`` (conftest.py's :func:`pytest_configure` starts two, in xdist's
controller, before its workers start).

Each xdist worker imports every test module to collect it, and pytest rewrites each one's asserts
(parse, rewrite, compile: ~24 s of CPU a worker for the suite's 270 modules, more than the imports
themselves); it caches the result beside the module (``__pycache__/*-pytest-*.pyc``) only where
bytecode may be written, and ``PYTHONDONTWRITEBYTECODE`` is set on the project's machines, so
every worker of every run rewrote every module. Its loader reads a valid cached file whatever that
setting, though: written here once, in two processes while the controller starts its early jobs,
both workers read it (a file whose source changed since is rewritten by pytest as before: the file
records its source's hash).

It uses pytest's own rewriting (``_pytest.assertion.rewrite``: the functions its loader calls), so
what a worker reads is what it would have made; a pytest without them, or any failure, writes
nothing and the workers rewrite as before. The suite's ``enable_assertion_pass_hook`` is off (the
one setting the rewriting reads).
"""

from __future__ import annotations

import sys
from pathlib import Path


def _trace(message: str) -> None:
    pass


class _State:
    """What ``_write_pyc`` asks of pytest's assertion state: a ``trace`` (its failures are not ours)."""

    trace = staticmethod(_trace)


def write(files: list[str]) -> int:
    """Rewrite and cache each of ``files`` not cached already; return how many were written."""
    try:
        from _pytest.assertion.rewrite import PYC_TAIL, _read_pyc, _rewrite_test, _write_pyc, get_cache_dir, try_makedirs
    except ImportError:
        return 0
    written = 0
    for name in files:
        try:
            fn = Path(name).resolve()
            cache = get_cache_dir(fn)
            pyc = cache / (fn.name[:-3] + PYC_TAIL)
            if _read_pyc(fn, pyc, _trace) is not None or not try_makedirs(cache):
                continue
            source_hash, code = _rewrite_test(fn, None)  # type: ignore[arg-type] - None: no assertion-pass hook
            written += bool(_write_pyc(_State, code, source_hash, pyc))  # type: ignore[arg-type]
        except Exception:  # noqa: BLE001 - a module that cannot be rewritten here: its worker says why
            continue
    return written


if __name__ == "__main__":
    write(sys.argv[1:])
