"""The run folder (``ampguard.run_folder.RunPaths``): a new folder is never a reused one, the
effective config is written into it and replaced atomically, the paths of an existing one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ampguard import files, run_folder
from ampguard.config import read_file, validate
from ampguard.errors import InputError
from ampguard.run_folder import RunPaths


def config_in(folder: Path, name: str | None = None, steps: int = 10):
    return validate({"task": {"name": "linear"}, "steps": steps, "log": {"dir": str(folder), "name": name}})


# ---------------------------------------------------------------------------- new_run_dir


def test_a_named_run_folder_is_created_with_its_config(tmp_path):
    config = config_in(tmp_path / "runs", "first")
    paths = RunPaths.new_run_dir(config)
    assert paths.dir == tmp_path / "runs" / "first" and paths.csv == paths.dir / "steps.csv"
    assert sorted(p.name for p in paths.dir.iterdir()) == ["config.yaml", "run-id"]  # nothing else until the run writes
    assert validate(read_file(paths.config)) == config


def test_a_named_run_folder_that_exists_is_refused_and_left_alone(tmp_path):
    config = config_in(tmp_path, "taken")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "steps.csv").write_text("the earlier run's rows\n")
    with pytest.raises(InputError) as err:
        RunPaths.new_run_dir(config)
    assert str(err.value) == f"run folder {tmp_path / 'taken'} already exists; choose another log.name"
    assert sorted(p.name for p in (tmp_path / "taken").iterdir()) == ["steps.csv"]
    assert (tmp_path / "taken" / "steps.csv").read_text() == "the earlier run's rows\n"


def test_timestamp_names_are_made_unique(tmp_path, monkeypatch):
    monkeypatch.setattr(run_folder.time, "strftime", lambda fmt: "20240102-030405")
    config = config_in(tmp_path)  # no log.name: a timestamp
    names = [RunPaths.new_run_dir(config).dir.name for _ in range(3)]
    assert names == ["20240102-030405", "20240102-030405-2", "20240102-030405-3"]
    assert all((tmp_path / name / "config.yaml").is_file() for name in names)


def test_a_timestamp_name_is_the_current_time(tmp_path):
    name = RunPaths.new_run_dir(config_in(tmp_path)).dir.name
    assert len(name) == 15 and name[8] == "-" and name.replace("-", "").isdigit()


def test_the_log_dir_is_created_with_its_parents(tmp_path):
    paths = RunPaths.new_run_dir(config_in(tmp_path / "a" / "b", "run"))
    assert paths.dir.is_dir() and paths.dir.parent == tmp_path / "a" / "b"


def _another_run_makes(monkeypatch, folder: Path, *, then_fill: bool = False) -> None:
    """Another run, started beside this one, makes ``folder`` between this run's look and its
    ``mkdir`` (the race of two jobs launched at once into one ``log.dir``)."""
    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if self == folder and not folder.exists():
            real_mkdir(folder)
            if then_fill:
                (folder / "its-run").mkdir()
        return real_mkdir(self, *args, **kwargs)
    monkeypatch.setattr(Path, "mkdir", mkdir)


def _another_run_takes(monkeypatch, folder: Path, *, then_fill: bool = False) -> None:
    """Another run, started beside this one, puts its run folder at ``folder`` between this run's
    look and its rename of the folder it made under a temporary name into place there (review 54c:
    the moment that decides; the run folder is no longer made at its name)."""
    real_rename = run_folder.rename_onto_nothing

    def rename(src, dst):
        if Path(dst) == folder and not folder.exists():
            folder.mkdir()
            if then_fill:
                (folder / "its-run").mkdir()
        return real_rename(src, dst)
    monkeypatch.setattr(run_folder, "rename_onto_nothing", rename)


def test_a_log_dir_another_run_makes_at_the_same_moment_is_shared_not_refused(tmp_path, monkeypatch):
    """Two runs started together into a ``log.dir`` not yet there: each looked, found none, and
    made it; the second's ``mkdir`` failed and its run was refused, "cannot create run folder
    runs/b: File exists" (seen in the suite: two runs started side by side)."""
    _another_run_makes(monkeypatch, tmp_path / "runs", then_fill=True)
    paths = RunPaths.new_run_dir(config_in(tmp_path / "runs", "b"))
    assert paths.dir == tmp_path / "runs" / "b" and (paths.dir / "config.yaml").is_file()
    assert paths.created == [paths.dir]  # runs/ is the other run's: never this one's to take back
    assert paths.remove_unused()
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["its-run"]


def test_a_timestamp_another_run_takes_at_the_same_moment_is_passed_over(tmp_path, monkeypatch):
    """Two unnamed runs started in the same second: both found the timestamp free; the second's
    ``mkdir`` failed with "already exists; choose another log.name", a name it was never given."""
    monkeypatch.setattr(run_folder.time, "strftime", lambda fmt: "20240102-030405")
    _another_run_takes(monkeypatch, tmp_path / "20240102-030405")  # (an empty folder: taken too)
    paths = RunPaths.new_run_dir(config_in(tmp_path))
    assert paths.dir.name == "20240102-030405-2" and paths.created == [paths.dir]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["20240102-030405", "20240102-030405-2"]


def test_a_name_another_run_takes_at_the_same_moment_is_refused_and_its_folder_left_alone(tmp_path, monkeypatch):
    _another_run_takes(monkeypatch, tmp_path / "runs" / "b", then_fill=True)
    with pytest.raises(InputError) as err:
        RunPaths.new_run_dir(config_in(tmp_path / "runs", "b"))
    assert str(err.value) == f"run folder {tmp_path / 'runs' / 'b'} already exists; choose another log.name"
    assert sorted(p.name for p in (tmp_path / "runs" / "b").iterdir()) == ["its-run"]  # not removed as ours
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["b"]  # (nor the folder it made left)


def test_a_log_dir_another_run_takes_back_at_the_same_moment_is_made_again(tmp_path, monkeypatch):
    """A run refused after making ``runs/`` takes it back while empty (``remove_unused``): between
    this run's look and its ``mkdir`` of ``runs/b`` (since review 54c: of ``runs/.new-run.tmp-*``, renamed
    to ``runs/b`` once written) it was gone ("No such file or directory")."""
    (tmp_path / "runs").mkdir()  # the other run's, empty
    real_mkdir, taken = Path.mkdir, []

    def mkdir(self, *args, **kwargs):
        if self.parent == tmp_path / "runs" and self.name.startswith(".new-run.tmp-") and not taken:
            taken.append((tmp_path / "runs").rmdir())  # the other run takes its folder back
        return real_mkdir(self, *args, **kwargs)
    monkeypatch.setattr(Path, "mkdir", mkdir)
    paths = RunPaths.new_run_dir(config_in(tmp_path / "runs", "b"))
    assert taken and (paths.dir / "config.yaml").is_file()
    assert paths.created == [tmp_path / "runs", paths.dir]  # made again by this run: its own to take back


def test_a_run_folder_that_cannot_be_created_is_one_input_error_line(tmp_path):
    (tmp_path / "not-a-folder").write_text("")
    with pytest.raises(InputError) as err:
        RunPaths.new_run_dir(config_in(tmp_path / "not-a-folder", "run"))
    assert str(err.value).startswith(f"cannot create run folder {tmp_path / 'not-a-folder' / 'run'}: ")
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------- write_config


def test_write_config_replaces_the_file_atomically(tmp_path, monkeypatch):
    paths = RunPaths.new_run_dir(config_in(tmp_path, "run", steps=10))
    replaced = []
    real_replace = os.replace

    def spy(src, dst, **kwargs):
        replaced.append((Path(src).name, Path(dst).name))
        return real_replace(src, dst, **kwargs)

    monkeypatch.setattr(files.os, "replace", spy)
    resumed = config_in(tmp_path, "run", steps=25)  # a resumed run may raise steps
    paths.write_config(resumed)
    assert [(src.startswith(".config.yaml.tmp"), dst) for src, dst in replaced] == [(True, paths.config.name)]  # written beside it, then renamed over it
    assert validate(read_file(paths.config)).steps == 25
    assert sorted(p.name for p in paths.dir.iterdir()) == ["config.yaml", "run-id"]  # no temporary file left


def test_write_config_without_a_folder_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    RunPaths(csv=tmp_path / "steps.csv").write_config(config_in(tmp_path, "run"))
    RunPaths().write_config(config_in(tmp_path, "run"))
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------- existing


def test_existing_names_every_path_and_creates_nothing(tmp_path):
    run_dir = tmp_path / "runs" / "a"
    paths = RunPaths.existing(run_dir)
    assert paths.dir == run_dir
    assert {name: getattr(paths, name) for name in (
        "csv", "events", "steps_jsonl", "plot", "card", "config", "tensorboard", "checkpoints")} == {
        "csv": run_dir / "steps.csv", "events": run_dir / "events.jsonl", "steps_jsonl": run_dir / "steps.jsonl",
        "plot": run_dir / "report.png", "card": run_dir / "RUN.md", "config": run_dir / "config.yaml",
        "tensorboard": run_dir / "tensorboard", "checkpoints": run_dir / "checkpoints"}
    assert not (tmp_path / "runs").exists()


def test_a_demo_has_only_a_csv():
    paths = RunPaths(csv=Path("steps.csv"))
    assert paths.csv == Path("steps.csv")
    assert [paths.events, paths.steps_jsonl, paths.plot, paths.card, paths.config, paths.tensorboard,
            paths.checkpoints] == [None] * 7


def test_the_lock_is_never_taken_through_a_link(tmp_path):
    # the pid went into whatever a link at .ampguard.lock named (a copied or shared run folder)
    from ampguard.errors import InputError
    from ampguard.run_folder import LOCK_FILE, RunPaths

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_FILE).symlink_to(victim)
    with pytest.raises(InputError, match=r"\.ampguard\.lock is a symbolic link; remove it"):
        RunPaths.existing(run).lock()
    assert victim.read_text() == "precious\n"
    (run / LOCK_FILE).unlink()
    paths = RunPaths.existing(run)
    paths.lock()
    assert (run / LOCK_FILE).read_text().split()[0] == str(os.getpid())  # (and its host's name: review 54l)
    paths.unlock()
    assert not (run / LOCK_FILE).exists()


@pytest.mark.parametrize("with_checkpoint", [False, True])
def test_a_resume_of_a_folder_another_process_trains_in_says_so_before_looking_for_a_checkpoint(tmp_path, with_checkpoint):
    # a run in its first steps has no checkpoint yet: --resume said "no checkpoint in .../checkpoints"
    # and sent the user looking for one; the run was alive (with a checkpoint it named the writer)
    from ampguard import checkpoint as ckpt
    from ampguard.checkpointer import _example_payload, find_resume

    run = tmp_path / "live"
    (run / "checkpoints").mkdir(parents=True)
    (run / "steps.csv").write_text("")
    config = validate({"task": {"name": "linear"}, "steps": 10})
    (run / "config.yaml").write_text("steps: 10\n")
    if with_checkpoint:
        ckpt.save_checkpoint(run / "checkpoints" / "step-00000004.pt", _example_payload(4, config.model_dump(mode="json")))
    live = RunPaths.existing(run)
    live.lock()  # (as a training process holds it: a second open of the lock file is another holder)
    try:
        with pytest.raises(InputError) as err:
            find_resume(run)
        assert str(err.value) == (f"run folder {run} is being written by another process (pid {os.getpid()}): wait "
                                  "for it to end, or stop it, before you resume it")
    finally:
        live.unlock()
    if with_checkpoint:  # once the writer is gone, the resume goes on
        assert find_resume(run).loaded.step == 4
