"""Shared fixtures: run the CLI in-process, snapshot a folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from ampguard.cli import main


@pytest.fixture
def cli(tmp_path, monkeypatch, capsys):
    """``cli(*argv) -> (exit_code, stdout, stderr)``: ``ampguard.cli.main`` run inside ``tmp_path``."""
    monkeypatch.chdir(tmp_path)

    def run(*argv: object) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture
def snapshot():
    """``snapshot(folder) -> {relative path: bytes or '<dir>'}`` of everything under ``folder``."""

    def take(folder: Path) -> dict[str, object]:
        folder = Path(folder)
        return {
            str(p.relative_to(folder)): ("<dir>" if p.is_dir() else p.read_bytes())
            for p in sorted(folder.rglob("*"))
        }

    return take
