"""Review 39c: the paths the integrations write to. One probe of writability for all three
(``ampguard.errors.unwritable``: a real file made where ``mkdir -p`` would make something, never
``os.access``, which root passes on ``/proc``); a Lightning ``csv=`` that is a named pipe (which
hung the fit for ever) or a device refused, and a sink given a pipe no process reads refused
rather than waited on; a file a resume cuts keeping its owner and mode; ``~`` expanded in
``out_dir`` and ``csv=``; ``csv="logs/"`` refused; refusals that name a path with a newline, or
a path thousands of characters long, kept to one short line."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import in_fork, read_rows

L = pytest.importorskip("lightning")
pytest.importorskip("transformers")

from test_lightning import Digits, fit, loader, rows, same  # noqa: E402
from test_transformers_review import arguments, tiny_gpt2, token_ids  # noqa: E402

from ampguard import errors  # noqa: E402 - (looked up when a test runs: the shared rule)
from ampguard.errors import InputError  # noqa: E402
from ampguard.files import replace_atomically  # noqa: E402
from ampguard.integrations.lightning import AmpGuardPlugin, _check_writable  # noqa: E402
from ampguard.integrations.trackers import _not_a_folder  # noqa: E402
from ampguard.integrations.transformers import AmpGuardCallback, GuardedTrainer, _check_out_dir  # noqa: E402
from ampguard.sinks import CsvSink  # noqa: E402

PROC = pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc (a folder no file can be made in)")
ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (to give a file away, and to give up root)")


def nobody() -> None:
    """Give up root in a forked child (``in_fork``'s ``preexec``): uid and gid 65534."""
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)


@contextlib.contextmanager
def shared_folder():
    """A folder outside pytest's (which only its owner may enter), owned by uid 65534."""
    folder = Path(tempfile.mkdtemp()).resolve()
    try:
        folder.chmod(0o755)
        os.chown(folder, 65534, 65534)
        yield folder
    finally:
        for path in folder.rglob("*"):  # (a read-only folder of the test's: its files can go)
            if path.is_dir() and not path.is_symlink():
                path.chmod(0o755)
        shutil.rmtree(folder)


class Hung(Exception):
    """A call that waited past its time (not an OSError: a refusal must not be taken for one)."""


@contextlib.contextmanager
def no_hang(seconds: int = 60):
    """Fail, rather than wait for ever, a call that blocks (an ``open`` of a named pipe)."""
    def hung(*_: object) -> None:
        raise Hung(f"still waiting after {seconds} s")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def check_csv(plugin: AmpGuardPlugin, ckpt_path: str | None = None) -> None:
    """The plugin's up-front refusals of its ``csv=``, on rank 0, without a fit."""
    plugin._check_csv(SimpleNamespace(is_global_zero=True, ckpt_path=ckpt_path), 1)


# 1. one probe of writability, the same for the three integrations


@PROC
@pytest.mark.parametrize("folder", ["/proc/ampguard", "/proc"])
def test_a_folder_no_file_can_be_made_in_is_refused_by_every_integration(folder):
    # review 39c #1: as root, os.access (trackers) and folder_problem alone (the Hugging Face callback) let
    # /proc/ampguard through; the Lightning plugin's temporary file refused it: three answers for one folder
    said = errors.unwritable(Path(folder))
    assert said is not None and "\n" not in said
    assert said in (f"{folder} cannot be made: no file can be made in /proc (No such file or directory)",
                    f"{folder} cannot be made: /proc is not a folder this user may write in",
                    "no file can be made in /proc (No such file or directory)",
                    "/proc is not a folder this user may write in")
    assert _not_a_folder(folder) == said
    with pytest.raises(InputError) as refused:
        check_csv(AmpGuardPlugin("32-true", csv=f"{folder}/ampguard-steps.csv"))
    assert str(refused.value) == (f"AmpGuardPlugin csv='{folder}/ampguard-steps.csv': {said}; give a csv path in a "
                                  f"folder you can write")


@PROC
def test_an_out_dir_no_file_can_be_made_in_is_refused_when_train_begins_before_any_step(tmp_path):
    # review 39c #1: out_dir=/proc/ampguard passed, then train() died in folder.mkdir with a raw FileNotFoundError
    model = tiny_gpt2()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = GuardedTrainer(model=model, args=arguments(tmp_path, "fp32", max_steps=2), train_dataset=token_ids(16),
                             ampguard=AmpGuardCallback("/proc/ampguard", print_fn=lambda line: None))
    with pytest.raises(InputError) as refused:
        trainer.train()
    assert str(refused.value) == f"AmpGuardCallback(out_dir=...): {errors.unwritable(Path('/proc/ampguard'))}"
    assert str(refused.value).startswith("AmpGuardCallback(out_dir=...): /proc/ampguard cannot be made: ")
    assert trainer.state.global_step == 0 and same(list(model.parameters()), before)
    assert not os.path.exists("/proc/ampguard")


@ROOT
def test_a_folder_under_a_read_only_one_is_refused_for_uid_65534_by_every_integration():
    # review 39c #1: as uid 65534, out_dir under a chmod 555 folder passed the callback's check, then train()
    # raised mkdir's raw PermissionError
    with shared_folder() as shared:
        (shared / "ro").mkdir()
        os.chown(shared / "ro", 65534, 65534)
        (shared / "ro").chmod(0o555)
        out = shared / "ro" / "guard"

        def begin_train() -> str:
            callback = AmpGuardCallback(out, print_fn=lambda line: None)
            state = SimpleNamespace(is_world_process_zero=True, trial_params=None, trial_name=None, global_step=0,
                                    train_batch_size=4)
            args = SimpleNamespace(output_dir=str(shared / "hf"), auto_find_batch_size=False, max_grad_norm=1.0)
            try:
                callback.on_train_begin(args, state, SimpleNamespace())
            except InputError as err:
                return str(err)
            return "began"

        said = f"{out} cannot be made: {shared / 'ro'} is not a folder this user may write in"
        assert in_fork(begin_train, preexec=nobody) == (0, f"AmpGuardCallback(out_dir=...): {said}")
        assert in_fork(lambda: _not_a_folder(out), preexec=nobody) == (0, said)
        assert in_fork(lambda: errors.unwritable(shared / "ro"), preexec=nobody) == (
            0, f"{shared / 'ro'} is not a folder this user may write in")
        assert not out.exists() and sorted(p.name for p in shared.iterdir()) == ["ro"]


def test_the_probe_passes_every_folder_that_can_be_written_and_leaves_nothing(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "a\nb").mkdir()
    for folder in ("new/deeper", "real", "link/../real/x", "nodir/../real", "a\nb/x", "sp ace/ünï", "."):
        assert errors.unwritable(tmp_path / folder) is None, folder
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a\nb", "link", "real"]  # (nothing made, nothing left)


# 2. a named pipe, a device


@pytest.mark.parametrize("kind", ["fifo", "link to a fifo"])
def test_a_csv_that_is_not_a_regular_file_is_refused_before_the_fit_trains_never_waited_on(tmp_path, kind):
    # review 39c #2: csv= a named pipe (size 0: taken for a fresh CSV) hung the fit for ever in open(path, "ab")
    pipe = tmp_path / "steps.csv"
    os.mkfifo(pipe)
    csv_path = pipe if kind == "fifo" else tmp_path / "view.csv"
    if kind.startswith("link"):
        csv_path.symlink_to(pipe)
    module = Digits(hidden=8)
    before = module._params()
    with no_hang(), pytest.raises(InputError) as refused:
        fit(module, AmpGuardPlugin("32-true", csv=csv_path), steps=1, data=loader(n=32))
    what = {"fifo": "a named pipe", "link to a fifo": f"a symbolic link to {pipe}, a named pipe"}[kind]
    assert str(refused.value) == (f"AmpGuardPlugin csv={str(csv_path)!r}: that is {what}, not a regular file; give "
                                  f"the path of a CSV file")
    assert module.trainer.global_step == 0 and same(module._params(), before)
    assert stat.S_ISFIFO(os.stat(pipe).st_mode)


@pytest.mark.skipif(not Path("/dev/null").is_char_device(), reason="needs /dev/null")
@pytest.mark.parametrize("through_link", [False, True])
def test_csv_dev_null_trains_a_fresh_fit_and_its_resume_keeping_nothing_and_cutting_nothing(tmp_path, through_link):
    # the thirty-eighth session's left item: /dev/null was refused as "a device" (it reads empty: a
    # resume appends to it as to an empty CSV and never replaces it with a file)
    csv_path = Path("/dev/null")
    if through_link:
        csv_path = tmp_path / "view.csv"
        csv_path.symlink_to("/dev/null")
    first = AmpGuardPlugin("32-true", csv=csv_path)
    trainer = fit(Digits(hidden=8), first, steps=2, data=loader(n=64))
    assert trainer.global_step == 2 and len(first.records) == 2
    trainer.save_checkpoint(tmp_path / "at2.ckpt")
    resumed = AmpGuardPlugin("32-true", csv=csv_path)
    trainer = fit(Digits(hidden=8), resumed, steps=4, data=loader(n=64), ckpt_path=tmp_path / "at2.ckpt")
    assert trainer.global_step == 4 and resumed.guard.steps == 4
    assert Path("/dev/null").is_char_device() and os.path.realpath(csv_path) == "/dev/null"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["at2.ckpt", *(["view.csv"] if through_link else [])]


def test_a_csv_sink_given_a_pipe_no_process_reads_refuses_it_and_writes_one_that_is_read(tmp_path):
    # review 39c #2: the sink's own open waited for a reader for ever
    pipe = tmp_path / "steps.csv"
    os.mkfifo(pipe)
    with no_hang(), pytest.raises(InputError) as refused:
        CsvSink(pipe)
    assert str(refused.value) == f"cannot write {pipe}: it is a named pipe that no process reads; refusing to wait for one"
    reader = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)  # (a reader: a pipe is a valid place for the rows)
    try:
        with no_hang():
            sink = CsvSink(pipe)
        assert os.get_blocking(sink._file.fileno())  # (it waits for a slow reader, as a plain open's file)
        sink.close()
        assert os.read(reader, 1 << 16).startswith(b"step,lr,")
    finally:
        os.close(reader)


# 3. a file a resume cuts keeps its owner and mode


def test_a_file_replaced_whole_keeps_its_mode_through_a_link_too(tmp_path):
    # review 39c #3: the new file renamed over the old was made with the umask's mode (a 0600 CSV became 0644)
    (tmp_path / "real").mkdir()
    target, link = tmp_path / "real" / "steps.csv", tmp_path / "steps.csv"
    target.write_text("step\n1\n2\n")
    target.chmod(0o600)
    link.symlink_to(target)
    replace_atomically(link, "step\n1\n", through_link=True)
    assert link.is_symlink() and target.read_text() == "step\n1\n"
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600
    target.chmod(0o640)
    replace_atomically(target, "step\n")
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["real", "steps.csv", "steps.csv"]


@ROOT
def test_a_users_csv_a_root_resume_cuts_stays_the_users_and_they_can_append_to_it():
    # review 39c #3: a root run resuming uid 65534's 0600 CSV (through a link) left it root's, 0644: its owner
    # could no longer append to it
    with shared_folder() as shared:
        (shared / "real").mkdir()
        target = shared / "real" / "steps.csv"
        header = "step,lr,grad_l2_pre_clip,grad_l2_post_clip,loss,skipped,skip_reason,scaler_scale\n"
        target.write_text(header + "1,0.1,1,1,0.5,0,,1\n2,0.1,1,1,0.5,0,,1\n")
        os.chown(target, 65534, 65534)
        target.chmod(0o600)
        (shared / "steps.csv").symlink_to(target)
        CsvSink(shared / "steps.csv", append=True, keep_through=1).close()
        st = os.stat(target)
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (65534, 65534, 0o600)
        assert [r["step"] for r in read_rows(target)] == ["1"]

        def append() -> str:
            with open(shared / "steps.csv", "ab") as f:
                f.write(b"2,0.1,1,1,0.5,0,,1\n")
            return "appended"

        assert in_fork(append, preexec=nobody) == (0, "appended")


@ROOT
def test_a_read_only_csv_a_resume_would_append_to_is_refused_before_the_fit_trains():
    # review 39c #3: the cut keeps the mode, so a 0444 CSV stays read-only: refused up front (the append
    # after the cut would fail at the first record, after an update)
    with shared_folder() as shared:
        frozen = shared / "steps.csv"
        frozen.write_text("step\n")
        os.chown(frozen, 65534, 65534)
        frozen.chmod(0o444)

        def check() -> str:
            try:
                _check_writable(frozen, "csv", rewritten=True)
            except InputError as err:
                return str(err)
            return "passed"

        assert in_fork(check, preexec=nobody) == (0, f"csv: cannot write {frozen}: Permission denied (a resume appends "
                                                     f"to it); give a csv path you can write")


# 4. a leading ~


def test_a_leading_tilde_is_the_home_folder_in_csv_and_out_dir(tmp_path, monkeypatch):
    # review 39c #4: out_dir="~/guard" and csv="~/steps.csv" wrote ./~/guard and ./~/steps.csv in the working folder
    home = tmp_path / "home"
    home.mkdir()
    (tmp_path / "work").mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path / "work")
    assert AmpGuardCallback("~/guard", print_fn=lambda line: None).out_dir == home / "guard"
    plugin = AmpGuardPlugin("32-true", csv="~/steps.csv")
    assert plugin.csv == home / "steps.csv"
    fit(Digits(hidden=8), plugin, steps=2, data=loader(n=32))
    assert [r["step"] for r in rows(home / "steps.csv")] == ["1", "2"]
    assert list((tmp_path / "work").iterdir()) == []


# 5. csv="logs/"


@pytest.mark.parametrize("csv", ["logs/", "logs/.", "runs/logs//", "~/"])
def test_a_csv_path_that_names_a_folder_is_refused_when_the_plugin_is_made(tmp_path, monkeypatch, csv):
    # review 39c #5: Path drops the trailing slash: csv="logs/" was written as a FILE named logs
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as refused:
        AmpGuardPlugin("32-true", csv=csv)
    assert str(refused.value) == (f"AmpGuardPlugin(csv={csv!r}): that names a folder; give the path of the CSV file, "
                                  f"e.g. {os.path.join(csv, 'steps.csv')!r}")
    assert list(tmp_path.iterdir()) == []
    assert AmpGuardPlugin("32-true", csv="logs/steps.csv").csv == Path("logs/steps.csv")  # (a file in it: fine)


# 6. one short line, whatever the path


def test_a_refusal_naming_a_path_with_a_newline_is_one_line(tmp_path):
    # review 39c #6: a path holding a newline was printed as two lines
    ab = tmp_path / "a\nb"
    ab.write_text("mine")
    inner = ab / "guard"
    said = f"{str(inner)!r} lies under {str(ab)!r}, a file, not a folder"
    assert errors.folder_problem(inner) == said
    assert _not_a_folder(inner) == said
    with pytest.raises(ValueError) as refused:
        _check_out_dir(ab)
    assert str(refused.value) == f"AmpGuardCallback(out_dir=...): {str(ab)!r} is a file, not a folder"
    with pytest.raises(InputError) as refused:
        check_csv(AmpGuardPlugin("32-true", csv=inner / "steps.csv"))
    assert str(refused.value) == f"AmpGuardPlugin csv={str(inner / 'steps.csv')!r}: {said}"
    assert all(len(str(s).splitlines()) == 1 for s in (said, refused.value))


@pytest.mark.parametrize("long", ["x" * 300, "y" * 200 + "/" + ("z" * 200 + "/") * 24 + "q"])
def test_a_refusal_naming_a_path_too_long_for_the_os_is_one_short_line(tmp_path, long):
    # review 39c #6: an ENAMETOOLONG path was written twice in full (~10 KB on one line)
    folder = tmp_path / long
    for said in (errors.folder_problem(folder), _not_a_folder(folder)):
        assert said.endswith(" cannot be looked at: File name too long") and len(said) <= 300, len(said)
        assert "\n" not in said and "..." in said
    with pytest.raises(ValueError) as refused:
        _check_out_dir(folder)
    assert len(str(refused.value)) <= 350
    with pytest.raises(InputError) as refused:
        check_csv(AmpGuardPlugin("32-true", csv=folder / "steps.csv"))
    assert str(refused.value).endswith(" cannot be looked at: File name too long") and len(str(refused.value)) <= 600
    with pytest.raises(InputError) as refused:
        CsvSink(folder / "steps.csv")
    assert str(refused.value).endswith(": File name too long") and len(str(refused.value)) <= 300
