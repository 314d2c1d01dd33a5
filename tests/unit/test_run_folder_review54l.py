"""Review 54l: the edges of a new run folder's making (``RunPaths.new_run_dir``) and of the takeover
of a folder a killed start-up left at the name (``_take_killed_start``): a stop signal just after the
rename let go of the lock before the folder was removed (a same-name start-up took the folder over,
then lost it to this process's removal); one just after the staging folder was made left it; the
takeover trusted ``flock`` to show a holder on another machine, refused a rerun while ``report``
polled the lock, and judged names, not kinds nor owners."""

from __future__ import annotations

import fcntl
import os
import pathlib
import socket
import subprocess

import pytest

from ampguard import run_folder
from ampguard.config import validate
from ampguard.errors import AmpguardWarning, InputError
from ampguard.run_folder import LOCK_FILE, RunPaths


def _config(runs, name):
    return validate({"log": {"dir": str(runs), "name": name}})


def _ended_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _killed(runs, name) -> RunPaths:
    """What a start-up killed just after its rename left at ``runs/name``: its folder, with the lock
    file its process wrote (its pid, one that runs no more now, and this host), held by nobody."""
    killed = RunPaths.new_run_dir(_config(runs, name), lock=True)
    os.close(killed._lock)  # (the kernel lets go as the process ends)
    lock = killed.dir / LOCK_FILE
    lock.write_text(lock.read_text().replace(str(os.getpid()), str(_ended_pid()), 1))
    return killed


def _names(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_a_stop_just_after_the_rename_removes_the_folder_before_it_lets_go(tmp_path, monkeypatch):
    # the folder at its name, unlocked, was "a killed start-up's": a same-name start-up took it over and
    # put its own folder there, and this process's removal (its run id read a moment before) deleted it
    runs = tmp_path / "runs"
    real, seen = run_folder._remove_created, []

    def removing(created, run_dir):
        if run_dir in created:  # (the folder at its name is about to be removed)
            seen.append(RunPaths.existing(run_dir).writer())
            try:  # (another start-up of the name, in this moment)
                RunPaths.new_run_dir(_config(runs, "a"), lock=True)
                seen.append("taken")
            except InputError as err:
                seen.append(str(err))
        real(created, run_dir)

    def stopped(paths):  # (a Ctrl-C as train's on_made is told)
        raise KeyboardInterrupt

    monkeypatch.setattr(run_folder, "_remove_created", removing)
    with pytest.raises(KeyboardInterrupt):
        RunPaths.new_run_dir(_config(runs, "a"), on_made=stopped, lock=True)
    assert seen == [str(os.getpid()), f"run folder {runs / 'a'} already exists; choose another log.name"]
    assert not runs.exists()


def test_a_stop_just_after_the_staging_folder_is_made_leaves_nothing(tmp_path, monkeypatch):
    real = pathlib.Path.mkdir

    def mkdir(self, *args, **kwargs):
        real(self, *args, **kwargs)
        if self.name.startswith(".new-run.tmp-"):
            raise KeyboardInterrupt  # (a Ctrl-C landing as mkdir returns)

    monkeypatch.setattr(pathlib.Path, "mkdir", mkdir)
    with pytest.raises(KeyboardInterrupt):
        RunPaths.new_run_dir(_config(tmp_path / "runs", "a"), lock=True)
    assert _names(tmp_path) == []  # (.new-run.tmp-PID-RANDOM was left in runs/, and runs/ with it)


@pytest.mark.parametrize("holder", ["live here", "another host", "no host", "not ascii digits", "this pid, another kernel",
                                    "a long odd host"])
def test_a_lock_nobody_here_holds_is_not_taken_unless_it_names_an_ended_process_of_this_host(tmp_path, holder):
    # where flock is each machine's own (Lustre localflock, NFS local_lock) a start-up on another machine
    # shows no holder: its live folder was moved aside and removed, and it went on writing into the rerun's
    runs = tmp_path / "runs"
    live = RunPaths.new_run_dir(_config(runs, "a"), lock=True)
    os.close(live._lock)  # (its holder not seen from here)
    lock = live.dir / LOCK_FILE
    if holder == "live here":  # (another kernel's lock, review 54r: on this one flock tells, and nobody holds it)
        lock.write_text(f"{os.getppid()} {socket.gethostname()}\nkernel another-boot\n")
    elif holder == "another host":
        lock.write_text(f"{_ended_pid()} elsewhere.invalid\n")
    elif holder == "no host":  # (an older ampguard's lock: the pid alone)
        lock.write_text(f"{_ended_pid()}\n")
    elif holder == "not ascii digits":  # (review 54r: "²" passed isdigit(), and int() of it was a traceback)
        lock.write_text(f"\u00b2 {socket.gethostname()}\n")
    elif holder == "this pid, another kernel":  # (review 54t: pid 1 in a container of another machine, same name)
        lock.write_text(f"{os.getpid()} {socket.gethostname()}\nkernel another-boot\n")
    elif holder == "a long odd host":
        lock.write_text(f"{_ended_pid()} {'h' * 2000}\x1b\n")
    before = _names(live.dir)
    with pytest.raises(InputError, match="already exists; choose another log.name .it holds nothing of a run.*"
                                         "its lock names (pid|a process).*remove the folder if that start-up runs no more"):
        RunPaths.new_run_dir(_config(runs, "a"), lock=True)
    assert _names(live.dir) == before and _names(runs) == ["a"]
    with pytest.raises(InputError) as refused:
        RunPaths.new_run_dir(_config(runs, "a"), lock=True)
    message = str(refused.value)  # (the host cut short: the line without the folder's path, which is the test's)
    assert len(message.replace(str(live.dir), "<dir>")) < 450 and "\x1b" not in message


@pytest.mark.parametrize("holder", ["a new container", "a restarted container"])
def test_a_lock_this_kernel_wrote_is_taken_whatever_its_host_and_pid_say(tmp_path, holder):
    """Review 54r: inside containers the host name changes with each container and a restarted
    one's ampguard is pid 1 again (the rerun's own pid, "running"): a killed start-up's folder was
    refused for good. Its lock names this kernel's boot id, whose flock tells that nobody holds it."""
    if run_folder._kernel_boot() is None:
        pytest.skip("no kernel boot id here (not Linux)")
    runs = tmp_path / "runs"
    killed = _killed(runs, "a")
    boot = run_folder._kernel_boot()
    pid, host = (_ended_pid(), "another-container") if holder == "a new container" else (os.getpid(), socket.gethostname())
    (killed.dir / LOCK_FILE).write_text(f"{pid} {host}\nkernel {boot}\n")
    with pytest.warns(AmpguardWarning, match="held nothing of a run"):
        paths = RunPaths.new_run_dir(_config(runs, "a"), lock=True)
    paths.unlock()
    assert (paths.dir / "config.yaml").is_file()


def test_the_lock_file_names_its_process_and_host(tmp_path):
    paths = RunPaths.new_run_dir(_config(tmp_path, "a"), lock=True)
    try:
        boot = run_folder._kernel_boot()
        assert (paths.dir / LOCK_FILE).read_text() == (f"{os.getpid()} {socket.gethostname()}\n"
                                                       + (f"kernel {boot}\n" if boot else ""))
        assert RunPaths.existing(paths.dir).writer() == str(os.getpid())
    finally:
        paths.unlock()


def test_a_reader_looking_at_the_lock_does_not_refuse_the_takeover(tmp_path, monkeypatch):
    # report/compare hold the lock shared for microseconds (RunPaths.writer): the takeover tried its
    # exclusive lock once, and the rerun was refused "already exists"
    runs = tmp_path / "runs"
    killed = _killed(runs, "a")
    killed_id = killed.run_id()
    reader = os.open(killed.dir / LOCK_FILE, os.O_RDONLY)
    fcntl.flock(reader, fcntl.LOCK_SH)
    real_flock, its = fcntl.flock, os.fstat(reader).st_ino

    def flock(fd, how):  # (the reader lets go just after the takeover's first try of its lock)
        try:
            return real_flock(fd, how)
        finally:
            if fd != reader and how == fcntl.LOCK_EX | fcntl.LOCK_NB and os.fstat(fd).st_ino == its:
                real_flock(reader, fcntl.LOCK_UN)

    monkeypatch.setattr(run_folder.fcntl, "flock", flock)
    try:
        with pytest.warns(AmpguardWarning, match="held nothing of a run"):
            paths = RunPaths.new_run_dir(_config(runs, "a"), lock=True)
    finally:
        os.close(reader)
    monkeypatch.undo()
    assert paths.run_id() != killed_id
    paths.unlock()


def _a_file_of_another_kind(folder, name):
    (folder / name).unlink()
    (folder / name).mkdir()
    (folder / name / "precious.txt").write_text("precious\n")


@pytest.mark.parametrize("case", ["config.yaml a folder", "run-id a folder", "wandb a file", "wandb a link",
                                  "a temporary file a folder", "another user's"])
def test_a_folder_holding_names_of_other_kinds_or_of_another_user_is_not_taken(tmp_path, case):
    runs = tmp_path / "runs"
    killed = _killed(runs, "a")
    folder = killed.dir
    if case.endswith("a folder") and not case.startswith("a temporary"):
        _a_file_of_another_kind(folder, case.split()[0])
    elif case == "wandb a file":
        (folder / "wandb").write_text("precious\n")
    elif case == "wandb a link":
        (tmp_path / "elsewhere").mkdir()
        (tmp_path / "elsewhere" / "precious.txt").write_text("precious\n")
        (folder / "wandb").symlink_to(tmp_path / "elsewhere")
    elif case == "a temporary file a folder":
        left = folder / f".config.yaml.tmp-{_ended_pid()}-00ff"
        left.mkdir()
        (left / "precious.txt").write_text("precious\n")
    else:
        if os.geteuid() != 0:
            pytest.skip("only root can give a folder to another user")
        os.chown(folder, 4242, 4242)
    before = sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))
    with pytest.raises(InputError, match="already exists; choose another log.name"):
        RunPaths.new_run_dir(_config(runs, "a"), lock=True)
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) == before


def test_a_killed_start_ups_folder_of_this_host_is_still_taken(tmp_path):
    runs = tmp_path / "runs"
    killed = _killed(runs, "a")
    killed_id = killed.run_id()
    (killed.dir / "wandb" / "offline-run-1").mkdir(parents=True)  # (W&B opened before the kill)
    with pytest.warns(AmpguardWarning, match=f"run folder {killed.dir} held nothing of a run"):
        paths = RunPaths.new_run_dir(_config(runs, "a"), lock=True)
    assert _names(paths.dir) == [LOCK_FILE, "config.yaml", "run-id"] and paths.run_id() != killed_id
    paths.unlock()
