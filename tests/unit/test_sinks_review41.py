"""Review 41 (sinks): a Hugging Face retry's cut (``begin_again``, the callback's own CSV) judged
from the file, not from its error: a stop signal or any error after the cut's rename keeps the
copy of the abandoned rows, and the error says where they are; ``set_aside``'s own copy that fails
after its rename is removed, one line naming it; a sink whose cut was made goes on after the last
row kept; a full disk at the cut's folder sync says the file was cut; a retry's refusal says it is
for the loop's new attempt; ``aside_taken_back`` is public."""

from __future__ import annotations

import errno
import os

import pytest

from helpers import armed_after_set_aside as _armed_after_set_aside
from helpers import folder_sync_raises as _folder_sync_raises
from helpers import hf_retrying_trainer, logged_steps as _steps, names_in as _names
from helpers import sink_of_four_steps as _sink, step_log as _log

from ampguard import files, sinks
from ampguard.errors import ExitCode, InputError
from ampguard.files import DiskFull
from ampguard.signals import Interrupted
from ampguard.sinks import CsvSink, set_aside

HEADER = "step,lr,grad_l2_pre_clip,grad_l2_post_clip,loss,skipped,skip_reason,scaler_scale\n"


# ---------------------------------------------------------------------------- F4: judged from the file


def _the_cut_raises(monkeypatch, before=None, after=None) -> None:
    """The cut's ``replace_atomically`` (through its link; set_aside's copy is made without) raises
    ``before()`` before its rename or ``after()`` after it."""
    real = sinks.replace_atomically

    def replace(path, data, through_link=False):
        if through_link and before is not None:
            raise before()
        real(path, data, through_link=through_link)
        if through_link and after is not None:
            raise after()

    monkeypatch.setattr(sinks, "replace_atomically", replace)



@pytest.mark.parametrize("kind", ["csv", "jsonl"])
def test_a_stop_signal_after_the_cuts_rename_keeps_the_copy_and_the_sink_goes_on(tmp_path, monkeypatch, kind):
    # review 41 F4: Interrupted (a KeyboardInterrupt, no `replaced` on it) in the cut's folder sync, after the
    # rename: _aside_taken_back deleted the only copy of steps 3-4 (the log already cut to 1-2)
    sink = _sink(tmp_path, kind)
    armed = _armed_after_set_aside(monkeypatch)
    _folder_sync_raises(monkeypatch, lambda: Interrupted(ExitCode.TERMINATED), lambda: bool(armed))
    with pytest.raises(Interrupted):
        sink.begin_again(2)
    copy = sink.path.with_name(f"steps.attempt-1.{kind}")
    assert _steps(sink.path) == [1, 2] and _steps(copy) == [3, 4]  # (each row once, none lost)
    monkeypatch.undo()
    sink.write(_log(3))  # (open again, after the last row kept)
    sink.close()
    assert _steps(sink.path) == [1, 2, 3]


def test_an_error_after_the_cuts_rename_without_replaced_keeps_the_copy_and_says_so(tmp_path, monkeypatch):
    # review 41 F4: any error raised after the rename but without `replaced` (here: replace_atomically made the
    # cut, then raised) deleted the copy: the abandoned rows in neither file, and the error said nothing of it
    sink = _sink(tmp_path)
    _the_cut_raises(monkeypatch, after=lambda: RuntimeError("the folder's sync was cut short"))
    with pytest.raises(InputError) as err:
        sink.begin_again(2)
    assert _steps(sink.path) == [1, 2] and _steps(tmp_path / "steps.attempt-1.csv") == [3, 4]
    assert str(err.value) == (f"{sink.path} was cut back to step 2 for the loop's new attempt (its 2 rows after it "
                              "moved to steps.attempt-1.csv), but then: the folder's sync was cut short")
    monkeypatch.undo()
    sink.write(_log(3))
    sink.close()
    assert _steps(sink.path) == [1, 2, 3]


def test_a_stop_signal_before_the_cuts_rename_still_takes_the_copy_back(tmp_path, monkeypatch):
    # (a guard, passes before and after: the file as it was, the copy taken back, the sink open as it was)
    sink = _sink(tmp_path)
    _the_cut_raises(monkeypatch, before=lambda: Interrupted(ExitCode.TERMINATED))
    with pytest.raises(Interrupted):
        sink.begin_again(2)
    assert _names(tmp_path) == ["steps.csv"] and _steps(sink.path) == [1, 2, 3, 4]
    sink.write(_log(5))
    sink.close()
    assert _steps(sink.path) == [1, 2, 3, 4, 5]


# ---------------------------------------------------------------------------- F5: the open after the cut


def _open_fails_once_after(monkeypatch, armed) -> None:
    real, failed = sinks._open_for_append, []

    def emfile(path):
        if armed() and not failed:
            failed.append(True)
            raise InputError(f"cannot write {path}: Too many open files")
        return real(path)

    monkeypatch.setattr(sinks, "_open_for_append", emfile)


def test_begin_again_whose_open_after_the_cut_fails_says_the_log_was_cut_and_goes_on(tmp_path, monkeypatch):
    # review 41 F5: the open after the cut sat outside the try: its error ("cannot write ...") said nothing of
    # the cut, and the sink stayed closed with its last step 4 (the next row, step 3, refused)
    sink = _sink(tmp_path)
    armed = _armed_after_set_aside(monkeypatch)
    _open_fails_once_after(monkeypatch, lambda: bool(armed))
    with pytest.raises(InputError) as err:
        sink.begin_again(2)
    assert _steps(sink.path) == [1, 2] and _steps(tmp_path / "steps.attempt-1.csv") == [3, 4]
    assert str(err.value) == (f"{sink.path} was cut back to step 2 for the loop's new attempt (its 2 rows after it "
                              f"moved to steps.attempt-1.csv), but then: cannot write {sink.path}: Too many open files")
    sink.write(_log(3))
    sink.close()
    assert _steps(sink.path) == [1, 2, 3]


def test_the_callbacks_csv_whose_open_after_the_cut_fails_keeps_the_copy_and_says_so(tmp_path, monkeypatch):
    # review 41 F5: the callback's retry (transformers.py: set_aside, then CsvSink(again=True) inside
    # _aside_taken_back): CsvSink's open failing after its cut deleted the copy of the cut log's rows
    path = tmp_path / "steps.csv"
    sink = _sink(tmp_path)
    sink.close()
    kept = set_aside(path, 0, header=True)
    _open_fails_once_after(monkeypatch, lambda: True)
    taken_back = getattr(sinks, "aside_taken_back", None)
    with pytest.raises(InputError) as err:
        if taken_back is not None:
            with taken_back(kept, path, 0):
                CsvSink(path, append=True, again=True, keep_through=0)
        else:  # (the old name and signature)
            with sinks._aside_taken_back(kept):
                CsvSink(path, append=True, again=True, keep_through=0)
    assert _steps(path) == [] and _steps(tmp_path / "steps.attempt-1.csv") == [1, 2, 3, 4]
    assert str(err.value) == (f"{path} was cut back to step 0 for the loop's new attempt (its 4 rows after it moved "
                              f"to steps.attempt-1.csv), but then: cannot write {path}: Too many open files")


def test_the_callbacks_retry_whose_open_after_the_cut_fails_keeps_the_copy(tmp_path, monkeypatch):
    # review 41 F5, end to end: a Hugging Face auto_find_batch_size retry whose CSV's open after the cut fails
    trainer = hf_retrying_trainer(tmp_path / "out")
    folder = tmp_path / "out" / "ampguard"
    _open_fails_once_after(monkeypatch, lambda: (folder / "steps.attempt-1.csv").exists())
    with pytest.raises(InputError) as err:
        trainer.train()
    assert _steps(folder / "steps.attempt-1.csv") == [1, 2] and _steps(folder / "steps.csv") == []
    assert str(err.value) == (f"{folder / 'steps.csv'} was cut back to step 0 for the loop's new attempt (its 2 rows "
                              f"after it moved to steps.attempt-1.csv), but then: cannot write {folder / 'steps.csv'}: "
                              "Too many open files")


# ---------------------------------------------------------------------------- F6: set_aside's own copy


@pytest.mark.parametrize("error", [errno.EIO, errno.ENOSPC])
def test_set_aside_whose_copy_was_renamed_but_not_synced_removes_it_and_says_so(tmp_path, monkeypatch, error):
    # review 41 F6: the copy's folder sync failed after its rename (replaced): a raw OSError naming no file, and
    # the copy left beside a log that kept every row (the rows in two files, silently, if the caller went on)
    path = _sink(tmp_path).path
    _folder_sync_raises(monkeypatch, lambda: OSError(error, os.strerror(error)))
    with pytest.raises(DiskFull if error == errno.ENOSPC else InputError) as err:
        set_aside(path, 2, header=True)
    assert _names(tmp_path) == ["steps.csv"] and _steps(path) == [1, 2, 3, 4]
    why = "disk full: No space left on device" if error == errno.ENOSPC else "Input/output error"
    assert str(err.value) == (f"cannot set {path}'s rows after step 2 aside in steps.attempt-1.csv: its folder could "
                              f"not be synced after it was written ({why}); nothing was moved")


def test_begin_again_whose_every_folder_sync_fails_moves_nothing_and_goes_on(tmp_path, monkeypatch):
    # review 41 F6 (case C): set_aside's copy hit the failing folder first; begin_again raised a raw OSError
    # with the copy left and the log whole
    sink = _sink(tmp_path)
    _folder_sync_raises(monkeypatch, lambda: OSError(errno.EIO, os.strerror(errno.EIO)))
    with pytest.raises(InputError, match="aside in steps.attempt-1.csv: .*; nothing was moved$"):
        sink.begin_again(2)
    assert _names(tmp_path) == ["steps.csv"] and _steps(sink.path) == [1, 2, 3, 4]
    monkeypatch.undo()
    sink.write(_log(5))
    sink.close()
    assert _steps(sink.path) == [1, 2, 3, 4, 5]


def test_set_aside_interrupted_after_its_copys_rename_leaves_no_copy(tmp_path, monkeypatch):
    # review 41 F6: a stop signal in the copy's folder sync left the copy (every row still in the log too)
    path = _sink(tmp_path).path
    _folder_sync_raises(monkeypatch, lambda: Interrupted(ExitCode.TERMINATED))
    with pytest.raises(Interrupted):
        set_aside(path, 2, header=True)
    assert _names(tmp_path) == ["steps.csv"] and _steps(path) == [1, 2, 3, 4]


# ---------------------------------------------------------------------------- F7: the sink goes on after a cut


@pytest.mark.parametrize("error", [errno.EIO, errno.ENOSPC])
def test_a_sink_whose_cut_was_made_but_not_synced_goes_on_after_the_last_row_kept(tmp_path, monkeypatch, error):
    # review 41 F7: left closed, its last step 4: the next row was refused as "step 3 after step 4"
    sink = _sink(tmp_path)
    armed = _armed_after_set_aside(monkeypatch)
    _folder_sync_raises(monkeypatch, lambda: OSError(error, os.strerror(error)), lambda: bool(armed))
    with pytest.raises(DiskFull if error == errno.ENOSPC else InputError) as err:
        sink.begin_again(2)
    assert err.value.replaced is True
    assert _steps(sink.path) == [1, 2] and _steps(tmp_path / "steps.attempt-1.csv") == [3, 4]
    monkeypatch.undo()
    sink.write(_log(3))
    sink.close()
    assert _steps(sink.path) == [1, 2, 3]


# ---------------------------------------------------------------------------- F8: wording, the public name


def test_a_full_disk_at_the_cuts_folder_sync_says_the_file_was_cut_and_where_its_rows_are(tmp_path, monkeypatch):
    # review 41 F8: it said only "disk full while writing .../steps.csv (No space left on device)"
    sink = _sink(tmp_path)
    armed = _armed_after_set_aside(monkeypatch)
    _folder_sync_raises(monkeypatch, lambda: OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), lambda: bool(armed))
    with pytest.raises(DiskFull) as err:
        sink.begin_again(2)
    assert err.value.error.errno == errno.ENOSPC and os.fspath(err.value.path) == os.fspath(sink.path)
    assert str(err.value) == (f"{sink.path} was cut back to step 2 for the loop's new attempt, but its folder could "
                              "not be synced after (disk full: No space left on device): a crash could bring back the "
                              "rows after it; its 2 rows after it moved to steps.attempt-1.csv")


def test_a_retrys_csv_with_a_short_row_is_refused_for_the_loops_new_attempt(tmp_path):
    # review 41 F8: CsvSink(again=True) said "cannot resume from it" (a retry resumes nothing)
    path = tmp_path / "steps.csv"
    path.write_text(HEADER + "1,0.1,1,1,0.5,0,,1\n2,0.1,1\n")
    with pytest.raises(InputError) as err:
        CsvSink(path, append=True, again=True, keep_through=2)
    assert str(err.value) == (f"{path} line 3: 3 cells, the header has 8; cannot cut it back for the loop's new "
                              "attempt")
    with pytest.raises(InputError, match="; cannot resume from it$"):  # (a resume's, as it was)
        CsvSink(path, append=True, keep_through=2)
    assert path.read_text() == HEADER + "1,0.1,1,1,0.5,0,,1\n2,0.1,1\n"


def test_aside_taken_back_is_public_and_the_callback_uses_it():
    # review 41 F8: transformers.py imported the private _aside_taken_back
    assert callable(getattr(sinks, "aside_taken_back", None))
    pytest.importorskip("transformers")
    from ampguard.integrations import transformers as integration

    assert integration.aside_taken_back is sinks.aside_taken_back
    assert not hasattr(integration, "_aside_taken_back")


def test_a_dangling_link_at_an_attempts_name_is_no_free_name(tmp_path, monkeypatch):
    # review 41e L3: the free name was looked for through links: a dangling link of the user's at
    # steps.attempt-1.csv was taken for free, and a failed copy's clean-up removed it
    log = tmp_path / "steps.csv"
    log.write_text("step,lr\n1,0.1\n2,0.1\n")
    os.symlink("/nonexistent/archive/attempt-1.csv", tmp_path / "steps.attempt-1.csv")
    copy, rows = set_aside(log, 1, header=True)
    assert copy.name == "steps.attempt-2.csv" and rows == 1
    copy.unlink()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files, "_make_temporary", full)
    with pytest.raises(Exception):
        set_aside(log, 1, header=True)
    assert os.path.islink(tmp_path / "steps.attempt-1.csv")  # (the user's link, left alone)


def test_a_dangling_link_at_a_trials_folder_name_is_no_free_name(tmp_path):
    # review 41f L5: the trial's run-N folder was looked for through links: a dangling link at run-0 was taken
    # for free, and making the folder failed with FileExistsError
    from ampguard.integrations.transformers import _trial_folder

    os.symlink("/nonexistent/elsewhere", tmp_path / "run-0")
    assert _trial_folder(tmp_path, None).name == "run-1"


def test_a_dangling_link_at_a_rollback_evidence_name_is_no_free_name(tmp_path):
    # review 41f L5 (untested until review 41g): the evidence's free name was looked for through links: a
    # dangling link at rollback/step-7.pt was taken for free and the evidence written where it points
    from ampguard.config import Config
    from ampguard.guards import Rollback, Rollbacks

    class Kept:  # (the batches the Trainer keeps as evidence)
        def payload(self, step, kind, why):
            return {"step": step, "kind": kind, "why": why, "micro_batches": []}

    rollbacks = Rollbacks(Config(), None, None, None, None, None)
    rollbacks.evidence, rollbacks.folder = Kept(), tmp_path
    (tmp_path / "rollback").mkdir()
    elsewhere = tmp_path / "elsewhere" / "step-7.pt"
    os.symlink(elsewhere, tmp_path / "rollback" / "step-7.pt")
    saved = rollbacks._save_evidence(7, Rollback(7, "loss spike", "loss_spike"))
    assert saved == tmp_path / "rollback" / "step-7-2.pt" and saved.is_file()
    assert os.path.islink(tmp_path / "rollback" / "step-7.pt") and not os.path.lexists(elsewhere)
