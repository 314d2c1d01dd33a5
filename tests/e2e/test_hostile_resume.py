"""Hostile and careless resumes (issue 16): a run folder must not make ``--resume`` run code or
take another run's state, a checkpoint's fields are checked before use, leftovers are cleaned up,
a read-only run folder is one line. ``docs/resume.md`` says what a resume executes.

Every refusal is one line ``ampguard: error: ...``, exit 2, and leaves the run folder exactly as it
was (the ``snapshot`` fixture). Runs go through ``ampguard.cli.main`` in-process; what could hang
runs under a wall-clock alarm.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import math
import os
import pickle
import re
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import yaml

from helpers import ag, deadline, in_fork, ok, one_error_line, run_events, snapshot_of, train

from ampguard import checkpoint as ckpt
from ampguard import checkpointer as ck
from ampguard.compare import load_run
from ampguard.errors import ExitCode, InputError

LINEAR = ["--set", "task.name=linear", "--set", "precision=fp32", "--set", "log.plot=false"]  # (no plot read here)
SHORT = ["--set", "steps=8", "--set", "checkpoint.every=4", "--set", "checkpoint.keep=10", "--set", "log.every=1000"]
CKPT4, CKPT8 = "step-00000004.pt", "step-00000008.pt"


def refused(snapshot, run: Path, *argv: object) -> str:
    """``ampguard train ARGV``: one error line, and not a byte of ``run`` changed."""
    before = snapshot(run)
    with deadline(120):
        line = one_error_line(ag("train", *argv))
    assert snapshot(run) == before
    return line


_LOADED: dict[bytes, dict] = {}


def payload_of(path: Path) -> dict:
    """``torch.load(path, weights_only=True)``; the tests spoil copies of the same few checkpoints,
    so bytes read before are loaded once and deep-copied after (~4 ms, not ~12 ms of unpickling)."""
    data = path.read_bytes()
    key = hashlib.sha256(data).digest()
    if key not in _LOADED:
        _LOADED[key] = torch.load(io.BytesIO(data), weights_only=True)
    return copy.deepcopy(_LOADED[key])


def rewrite(path: Path, payload: dict) -> None:
    """Write ``payload`` at ``path`` as ampguard would (atomically, with the marker)."""
    ckpt.save_checkpoint(path, {k: v for k, v in payload.items() if k not in ("magic", "format")})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two linear runs with the same config (so: two run ids), an fp16 one (its loss scaler on,
    a loss-spike detector), and a digits run."""
    root = tmp_path_factory.mktemp("hostile")
    ok(train(root, "lin", *LINEAR, *SHORT))
    ok(train(root, "twin", *LINEAR, *SHORT))
    ok(train(root, "fp16", "--set", "task.name=linear", "--set", "precision=fp16", *SHORT,
             "--set", "rollback.triggers=[loss_spike]", "--set", "rollback.window=4"))
    ok(train(root, "digits", "--set", "task.name=digits", "--set", "precision=fp32", "--set", "steps=5",
             "--set", "checkpoint.every=5", "--set", "eval.enabled=false", "--set", "log.every=1000"))
    return root


@pytest.fixture
def lin(runs, tmp_path) -> Path:
    """A copy of the linear run to spoil."""
    run = tmp_path / "lin"
    shutil.copytree(runs / "lin", run)
    return run


# ---------------------------------------------------------------------------- A. whose checkpoint


def test_a_charlm_checkpoint_from_another_pythons_corpus_is_refused_naming_both(tmp_path, snapshot):
    # review_session26: charlm reads the running Python's standard library; a resume under another
    # Python trained on other text, unsaid (the same seed, the same config, other data)
    tiny = [a for kv in ("task.name=charlm", "task.n_layer=1", "task.n_embd=16", "task.n_head=2",
                         "task.block_size=16", "task.batch_size=4", "eval.batches=1") for a in ("--set", kv)]
    ok(train(tmp_path, "lm", *tiny, "--set", "precision=fp32", "--set", "steps=4", "--set", "checkpoint.every=2",
             "--set", "eval.enabled=false", "--set", "log.plot=false"))
    run = tmp_path / "lm"
    (run / "checkpoints" / "step-00000004.pt").unlink()
    path = run / "checkpoints" / "step-00000002.pt"
    payload = payload_of(path)
    assert payload[ck.DATA_ID].startswith("Python 3.") and " standard library, " in payload[ck.DATA_ID]
    rewrite(path, {**payload, ck.DATA_ID: "Python 3.9 standard library, 351234 bytes, sha256 0123456789ab"})
    line = refused(snapshot, run, "--resume", run)
    assert line == (f"ampguard: error: step-00000002.pt: it was trained on other data: Python 3.9 standard library, "
                    f"351234 bytes, sha256 0123456789ab; this process's is {payload[ck.DATA_ID]}"), line
    # locate replays a step of that data, validate judges on it: both refuse the same way
    line = one_error_line(ag("locate", run / "config.yaml", "--step", "2", "--checkpoint", path))
    assert line.startswith(f"ampguard: error: {path}: it was trained on other data: Python 3.9"), line


def test_every_checkpoint_carries_its_run_folders_id(runs):
    run_id = (runs / "lin" / "run-id").read_text(encoding="ascii").strip()
    assert len(run_id) == 32 and int(run_id, 16) >= 0
    assert run_id != (runs / "twin" / "run-id").read_text(encoding="ascii").strip()
    for path in ckpt.list_checkpoints(runs / "lin" / "checkpoints"):
        assert ckpt.load_checkpoint(path)[ck.RUN_ID] == run_id


def test_a_digits_checkpoint_named_step_99_in_a_linear_run_is_refused_and_nothing_changes(runs, lin, snapshot):
    """It used to replace the linear run's CSV rows and set its real checkpoints aside."""
    dropped = lin / "checkpoints" / "step-00000099.pt"
    shutil.copy(runs / "digits" / "checkpoints" / "step-00000005.pt", dropped)
    for target in (lin, dropped):  # the folder's newest checkpoint, or named
        line = refused(snapshot, lin, "--resume", target, "--set", "steps=200")
        assert str(dropped) in line and "named for step 99 but holds step 5" in line


@pytest.mark.parametrize("form", ["folder", "file"])
def test_another_runs_checkpoint_under_the_right_name_is_refused_naming_it(runs, lin, snapshot, form):
    """The newest checkpoint of the folder belongs to another run: refused, not passed over for step 4."""
    shutil.copy(runs / "twin" / "checkpoints" / CKPT8, lin / "checkpoints" / CKPT8)
    line = refused(snapshot, lin, "--resume", lin if form == "folder" else lin / "checkpoints" / CKPT8,
                   "--set", "steps=12")
    assert str(lin / "checkpoints" / CKPT8) in line and "saved by another run" in line


def test_a_digits_checkpoint_with_the_runs_id_is_refused_by_its_config_before_the_task_is_built(runs, lin, snapshot):
    foreign = payload_of(runs / "digits" / "checkpoints" / "step-00000005.pt")
    foreign[ck.RUN_ID] = (lin / "run-id").read_text(encoding="ascii").strip()  # the id copied too
    rewrite(lin / "checkpoints" / "step-00000005.pt", foreign)
    line = refused(snapshot, lin, "--resume", lin / "checkpoints" / "step-00000005.pt")
    assert "--resume: task.name was 'digits' in the checkpoint, now 'linear'" in line


FACTORY = '''
from pathlib import Path
Path({marker!r}).write_text("imported")  # runs when the factory file is imported


def build(config):
    raise SystemExit("the factory was built")
'''


@pytest.mark.parametrize("run_id", ["none", "same", "other"])
def test_a_checkpoint_naming_a_factory_file_never_gets_it_imported(lin, snapshot, tmp_path, run_id):
    """The task comes from the run folder's config.yaml: a checkpoint whose embedded config names a
    ``task.factory`` file is refused (another run's id, or a config that differs), and the file is
    never imported. ``none``: a checkpoint from before run ids, judged by its config."""
    marker = tmp_path / "IMPORTED"
    factory = tmp_path / "evil.py"
    factory.write_text(FACTORY.format(marker=str(marker)), encoding="utf-8")
    payload = payload_of(lin / "checkpoints" / CKPT8)
    payload[ck.CONFIG]["task"]["factory"] = f"{factory}:build"
    if run_id == "none":
        del payload[ck.RUN_ID]
    elif run_id == "other":
        payload[ck.RUN_ID] = "f" * 32
    rewrite(lin / "checkpoints" / CKPT8, payload)
    for target in (lin, lin / "checkpoints" / CKPT8):
        line = refused(snapshot, lin, "--resume", target, "--set", "steps=12")
        if run_id == "other":
            assert "saved by another run" in line
        else:
            # (a value over 80 characters, as a long temporary folder makes it, keeps its head and its end)
            assert f"--resume: task.factory was '{str(factory)[:20]}" in line, line
            assert "evil.py:build' in " in line and "now null" in line, line
    assert not marker.exists()


def test_a_model_of_another_shape_is_refused_after_the_model_is_built_and_before_anything_is_written(lin, snapshot):
    payload = payload_of(lin / "checkpoints" / CKPT8)
    del payload[ck.RUN_ID]  # a checkpoint from before run ids, with the right config
    payload[ck.MODEL] = {"weight": torch.zeros(1, 9), "bias": torch.zeros(1)}
    rewrite(lin / "checkpoints" / CKPT8, payload)
    line = refused(snapshot, lin, "--resume", lin, "--set", "steps=12")
    assert str(lin / "checkpoints" / CKPT8) in line
    assert "its model does not match the one this run builds: weight is [1, 9] in the checkpoint" in line
    payload[ck.MODEL] = {"weight": torch.zeros(1, 8), "bias": torch.zeros(1), "extra": torch.zeros(2)}
    rewrite(lin / "checkpoints" / CKPT8, payload)
    assert "unexpected 'extra'" in refused(snapshot, lin, "--resume", lin, "--set", "steps=12")


def test_a_checkpoint_from_before_run_ids_resumes_when_its_config_matches(runs, tmp_path):
    """A run folder made before run ids (no run-id file, checkpoints without an id) resumes bit for
    bit; from then on it has an id and its new checkpoints carry it."""
    old = tmp_path / "old"
    shutil.copytree(runs / "lin", old)
    (old / "run-id").unlink()
    (old / "checkpoints" / CKPT8).unlink()
    payload = payload_of(old / "checkpoints" / CKPT4)
    del payload[ck.RUN_ID]
    rewrite(old / "checkpoints" / CKPT4, payload)
    out = ok(ag("train", "--resume", old))
    assert "resuming from step-00000004.pt" in out
    assert (old / "steps.csv").read_bytes() == (runs / "lin" / "steps.csv").read_bytes()
    new_id = (old / "run-id").read_text(encoding="ascii").strip()
    assert len(new_id) == 32 and ckpt.load_checkpoint(old / "checkpoints" / CKPT8)[ck.RUN_ID] == new_id


def test_a_run_of_an_older_ampguard_goes_on_clearing_its_alert_as_it_ran(lin):
    """A run written before monitor.clear_rate existed cleared its ALERT at alert_rate. Resumed,
    it took the new default (0.8 x alert_rate) from then on, and the resume recorded a policy change
    "clear_rate None -> ..." that no one made. It goes on as it ran, and nothing is recorded."""
    config = yaml.safe_load((lin / "config.yaml").read_text(encoding="utf-8"))
    del config["monitor"]["clear_rate"]
    (lin / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    (lin / "checkpoints" / CKPT8).unlink()
    payload = payload_of(lin / "checkpoints" / CKPT4)
    del payload[ck.CONFIG]["monitor"]["clear_rate"]
    rewrite(lin / "checkpoints" / CKPT4, payload)
    ok(ag("train", "--resume", lin))
    resumed = yaml.safe_load((lin / "config.yaml").read_text(encoding="utf-8"))["monitor"]
    assert resumed["clear_rate"] == resumed["alert_rate"] == config["monitor"]["alert_rate"]
    changes = [e["key"] for e in run_events(lin) if e["event"] == "policy_change"]
    assert "monitor.clear_rate" not in changes, changes


def test_the_resumed_config_is_the_run_folders_config_yaml_plus_set(lin):
    """Not the checkpoint's: an edit of config.yaml outside the fixed keys is what the run uses."""
    config = yaml.safe_load((lin / "config.yaml").read_text(encoding="utf-8"))
    assert ckpt.load_checkpoint(lin / "checkpoints" / CKPT8)[ck.CONFIG]["eval"]["every"] == config["eval"]["every"]
    config["eval"]["every"] = 3
    (lin / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    printed = yaml.safe_load(ok(ag("train", "--resume", lin, "--set", "steps=12", "--print-config")))
    assert printed["eval"]["every"] == 3 and printed["steps"] == 12


def test_a_run_folder_without_config_yaml_and_a_config_file_with_resume_are_refused(lin, snapshot):
    (lin / "config.yaml").unlink()
    line = refused(snapshot, lin, "--resume", lin)
    assert "config.yaml" in line and str(lin) in line
    (lin / "other.yaml").write_text("steps: 20\n", encoding="utf-8")
    line = refused(snapshot, lin, lin / "other.yaml", "--resume", lin)
    assert "--resume" in line and "--set" in line


@pytest.mark.parametrize("text", ["", "# only a comment\n", "{}\n", "null\n"])
def test_an_empty_config_yaml_is_refused_not_resumed_as_the_defaults(lin, snapshot, text):
    # read as the defaults, the linear fp32 run was refused as "precision was 'fp32' ..., now
    # 'bf16'"; a run whose settings were the defaults would have resumed on them, unsaid
    (lin / "config.yaml").write_text(text, encoding="utf-8")
    line = refused(snapshot, lin, "--resume", lin)
    assert line.endswith(f"--resume: config file {lin / 'config.yaml'}: empty; a run's config.yaml holds every "
                         "setting"), line


def test_a_steps_csv_cell_past_the_csv_modules_limit_is_one_line(lin, snapshot):
    # csv's field limit (128 KiB) raised _csv.Error out of the resume: a traceback
    rows = (lin / "steps.csv").read_bytes().splitlines(keepends=True)
    rows[2] = rows[2].replace(b",", b',"' + b"x" * 200_000 + b'",', 1)
    (lin / "steps.csv").write_bytes(b"".join(rows))
    line = refused(snapshot, lin, "--resume", lin)
    assert line.endswith(f"{lin / 'steps.csv'} line 3: not a row of this CSV (field larger than field limit "
                         "(131072)); cannot resume from it"), line



@pytest.mark.parametrize("column, cell, said", [
    ("lr", "0.0\x0003", "column lr holds '0.0\\x0003', not a number"),
    ("loss", "1e", "column loss holds '1e', not a number"),
    ("val_loss", "n/a", "column val_loss holds 'n/a', not a number"),
    ("skipped", "2", "skipped must be 0 or 1, got '2'"),
])
def test_a_kept_row_report_cannot_read_is_refused_not_appended_to(lin, snapshot, column, cell, said):
    # resume checked only each kept row's step cell: it appended to the row edited by hand, and
    # the run could no longer be read back (report and compare refused it, at the same cell; a
    # metric's cell compare now reads as text, noted, while the resume still refuses it)
    rows = (lin / "steps.csv").read_text(encoding="utf-8").splitlines(keepends=True)
    header = rows[0].rstrip("\n").split(",")
    cells = rows[3].rstrip("\n").split(",")
    cells[header.index(column)] = cell
    rows[3] = ",".join(cells) + "\n"
    (lin / "steps.csv").write_text("".join(rows), encoding="utf-8")
    if column == "val_loss":  # compare reads a metric column with a cell of text as text, and says so (review 46e)
        assert any("column val_loss holds numbers and text (its first text 'n/a'" in note for note in load_run(lin).notes)
    else:
        with pytest.raises(InputError, match=re.escape(said)):
            load_run(lin)  # as compare reads a run (report: its fixed eight columns)
    assert refused(snapshot, lin, "--resume", lin).endswith(f"{lin / 'steps.csv'} line 4: {said}; cannot resume from it")

def test_a_resume_whose_csv_columns_would_change_is_refused_before_config_yaml_is_rewritten(lin, snapshot):
    line = refused(snapshot, lin, "--resume", lin, "--set", "steps=12", "--set", "eval.enabled=false")
    assert f"{lin / 'steps.csv'}: its header does not match this run's columns (no metrics), cannot append" in line


# ---------------------------------------------------------------------------- B. the payload's fields


BAD_FIELDS = {
    "step": ("abc", "step is 'abc', expected an int >= 0"),
    "scheduler": ("x", "scheduler is 'x', expected a mapping"),
    "world_size": ("two", "world_size is 'two', expected an int >= 1"),
    "data_position": (-3, "data_position is -3, expected an int >= 0"),
    "rollbacks": ([7], "rollbacks is a list, expected a list of str"),
    "config": ([1], "config is a list, expected a mapping of plain data"),
    "model": ({"weight": "w"}, "model.weight is 'w', expected a tensor"),  # (review 54n: it named the mapping)
    "optimizer": ({"state": {}}, "optimizer is a dict, expected an optimizer state"),
    "state": ({"step": 8}, "state is a dict, expected a mapping with scaler, step, updates"),
    "rng": (3, "rng is 3, expected a mapping"),
    "updates": (True, "updates is True, expected an int >= 0"),
}


@pytest.mark.parametrize("field", list(BAD_FIELDS))
@pytest.mark.parametrize("form", ["folder", "file"])
def test_a_checkpoint_with_a_field_of_the_wrong_type_is_one_line_naming_it(lin, snapshot, field, form):
    value, expected = BAD_FIELDS[field]
    payload = payload_of(lin / "checkpoints" / CKPT8)
    payload[field] = value
    rewrite(lin / "checkpoints" / CKPT8, payload)
    line = refused(snapshot, lin, "--resume", lin if form == "folder" else lin / "checkpoints" / CKPT8,
                   "--set", "steps=12")
    assert f"{lin / 'checkpoints' / CKPT8}: bad checkpoint: {expected}" in line


def test_a_data_position_beyond_what_the_run_could_have_taken_is_refused_at_once(lin, snapshot):
    """10**12: the data stream is skipped to it by reading, so the resume would spin for ever."""
    payload = payload_of(lin / "checkpoints" / CKPT8)
    payload[ck.DATA] = 10**12
    rewrite(lin / "checkpoints" / CKPT8, payload)
    line = refused(snapshot, lin, "--resume", lin, "--set", "steps=12")  # within 120 s, or it fails as a hang
    assert "data position 1000000000000 is beyond what 8 steps could have taken (8 = " in line
    payload[ck.DATA], payload[ck.ROLLBACKS] = 9, ["step 6: a rollback"]  # 8 + 1 rollback x skip_batches 20
    payload.pop(ck.DATA_NEXT)  # (the position moved: its next batch's hash, which a resume compares, goes too)
    rewrite(lin / "checkpoints" / CKPT8, payload)
    with deadline(120):
        ok(ag("train", "--resume", lin, "--set", "steps=9"))


def test_the_data_bound_holds_for_a_real_run_with_a_rollback(tmp_path):
    """A rollback seeks skip_batches past an older position: a run resumed after it is accepted,
    also with ``rollback.skip_batches`` lowered (a recorded change: the rollback skipped 3)."""
    args = [*LINEAR, "--set", "steps=8", "--set", "checkpoint.every=1", "--set", "checkpoint.keep=20",
            "--set", "accumulation_steps=2", "--inject", "spike@5", "--set", "rollback.triggers=[loss_spike]",
            "--set", "rollback.window=3", "--set", "rollback.skip_batches=3", "--set", "log.every=1000",
            "--set", "rollback.z=20"]  # (a window of 3 after the rollback, the checkpoint's, is tight: one spike)
    out = ok(train(tmp_path, "r", *args))
    assert "ROLLBACK 5" in out
    run = tmp_path / "r"
    last = ckpt.load_checkpoint(run / "checkpoints" / "step-00000006.pt")
    assert last[ck.ROLLBACKS] and last[ck.DATA] == 6 * 2 - 2 + 3  # one step of data re-read, 3 skipped
    for path in ckpt.list_checkpoints(run / "checkpoints"):
        if ckpt.checkpoint_step(path) > 6:
            path.unlink()
    lowered = tmp_path / "lowered"
    shutil.copytree(run, lowered)
    ok(ag("train", "--resume", run))
    out = ok(ag("train", "--resume", lowered, "--set", "rollback.skip_batches=0"))
    assert "POLICY 6 rollback.skip_batches 3 -> 0" in out
    # and again from a checkpoint the lowered run wrote: its policy log still knows the 3
    for path in ckpt.list_checkpoints(lowered / "checkpoints"):
        if ckpt.checkpoint_step(path) > 7:
            path.unlink()
    written = ckpt.load_checkpoint(lowered / "checkpoints" / "step-00000007.pt")
    assert written[ck.CONFIG]["rollback"]["skip_batches"] == 0 and written[ck.ROLLBACKS]
    ok(ag("train", "--resume", lowered))


DELETE = object()  # (a NESTED case's value: the field taken out)

# A field inside the guarded step's state, the optimizer's parameter groups or the RNG state: each
# used to pass every check, then fail with a traceback (exit 1) in the training loop, after
# config.yaml, events.jsonl and steps.csv had been changed (or, for the RNG, in the restore).
NESTED = {
    "scaler growth_factor": (["state", "scaler", "growth_factor"], "x",
                             "bad checkpoint: state.scaler.growth_factor is 'x', expected a finite number > 1"),
    # review 54b: each of these was taken, exit 0: a backoff of 2.0 grew the scale on every overflow, to inf
    # (every later step skipped); a growth factor of 0.5 shrank it on its growth steps; a floor of 3e38 (above
    # the config's init_scale, which the config refuses) skipped every step; one the config does not say trained
    # on with the checkpoint's value, though the run card said the config's
    "scaler backoff 2": (["state", "scaler", "backoff_factor"], 2.0,
                         "bad checkpoint: state.scaler.backoff_factor is 2.0, expected in (0, 1)"),
    "scaler growth 0.5": (["state", "scaler", "growth_factor"], 0.5,
                          "bad checkpoint: state.scaler.growth_factor is 0.5, expected a finite number > 1"),
    "scaler floor not the config's": (["state", "scaler", "min_scale"], 3e38,
                                      "bad checkpoint: state.scaler.min_scale is 3e+38, not its config's "
                                      "scaler.min_scale 1.0"),
    "scaler backoff not the config's": (["state", "scaler", "backoff_factor"], 0.25,
                                        "bad checkpoint: state.scaler.backoff_factor is 0.25, not its config's "
                                        "scaler.backoff_factor 0.5"),
    "scaler interval not the config's": (["state", "scaler", "growth_interval"], 3000,
                                         "bad checkpoint: state.scaler.growth_interval is 3000, not its config's "
                                         "scaler.growth_interval 2000"),
    "scaler tracker": (["state", "scaler", "_growth_tracker"], "x",
                       "bad checkpoint: state.scaler._growth_tracker is 'x', expected an int in [0, growth_interval"),
    "monitor counter": (["state", "monitors", "run", "updates"], "x",
                        "bad checkpoint: state.monitors.run.updates is 'x', expected an int >= 0"),
    "short ring": (["state", "monitors", "run", "skip_window", "ring"], [0.0],
                   "bad checkpoint: state.monitors.run.skip_window.ring is a list of 1, expected a list of 1000"),
    "ring position": (["state", "monitors", "run", "skip_window", "pos"], 1000,
                      "bad checkpoint: state.monitors.run.skip_window.pos is 1000, expected an int in [0, 1000)"),
    "loss-spike window": (["state", "monitors", "loss_spike", "sum", "pos"], -1,
                          "bad checkpoint: state.monitors.loss_spike.sum.pos is -1, expected an int in [0, 4)"),
    "betas": (["optimizer", "param_groups", 0, "betas"], [0.9],
              "its optimizer state does not match this run's parameters: param_groups[0].betas has 1 entries, "
              "this optimizer's 2"),
    "rng": (["rng", "numpy", "pos"], 10**30,
            "does not fit this run (rng: Python int too large to convert to C long)"),
    # each of these loaded (load_state_dict casts a dtype) and the run went on from what it made of them
    "model dtype": (["model", "weight"], lambda w: w.long(),  # truncated to whole numbers
                    "its model does not match the one this run builds: weight is int64 in the checkpoint, float32 here"),
    "model nan": (["model", "weight"], lambda w: torch.full_like(w, math.nan),  # every later step skipped
                  "bad checkpoint: its model's weight holds nan: a run resumed from it would skip every step"),
    "moment dtype": (["optimizer", "state", 0, "exp_avg"], lambda m: m.half(),
                     "its optimizer state does not match this run's parameters: exp_avg of parameter 0 is float16, "
                     "the parameter float32"),
    "step nan": (["optimizer", "state", 0, "step"], lambda s: torch.full_like(s, math.nan),  # NaN bias corrections
                 "its optimizer state does not match this run's parameters: step of parameter 0 is nan"),
    "no scaler state": (["state", "scaler"], {},  # resumed at init_scale: the scale the run found, lost
                        "bad checkpoint: state.scaler is empty: a loss scaler that is on needs its saved scale"),
    # review 36c: each of these passed the checks; the first three then failed with a traceback in
    # the first optimizer.step(), after the run folder was cut back (steps.csv, RUN.md, the later
    # checkpoints set aside); a NaN moment made every weight NaN, the run "finished" with exit 0
    "no moment": (["optimizer", "state", 0, "exp_avg"], DELETE,
                  "its optimizer state does not match this run's parameters: the state of parameter 0 has no 'exp_avg'"),
    "moment none": (["optimizer", "state", 1, "exp_avg_sq"], None,
                    "its optimizer state does not match this run's parameters: exp_avg_sq of parameter 1 is None, "
                    "not a tensor"),
    "moment nan": (["optimizer", "state", 1, "exp_avg_sq"], lambda m: torch.full_like(m, math.nan),
                   "its optimizer state does not match this run's parameters: exp_avg_sq of parameter 1 holds a "
                   "non-finite value"),
    "negative eps": (["optimizer", "param_groups", 0, "eps"], -1.0,  # (trained with it, unsaid)
                     "its optimizer state does not match this run's parameters: param_groups[0]: Invalid epsilon "
                     "value: -1.0"),
}


@pytest.mark.parametrize("case", list(NESTED))
def test_a_bad_field_inside_the_checkpoint_is_one_line_before_the_run_folder_is_touched(runs, tmp_path, snapshot,
                                                                                        case):
    path, value, expected = NESTED[case]
    run = tmp_path / "fp16"
    shutil.copytree(runs / "fp16", run)
    payload = payload_of(run / "checkpoints" / CKPT8)
    node = payload
    for key in path[:-1]:
        node = node[key]
    if value is DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value(node[path[-1]]) if callable(value) else value
    rewrite(run / "checkpoints" / CKPT8, payload)
    line = refused(snapshot, run, "--resume", run, "--set", "steps=12")
    assert f"{run / 'checkpoints' / CKPT8}: {expected}" in line


def test_a_checkpoint_whose_bytes_changed_after_it_was_written_is_refused(lin, snapshot):
    # review 36c: torch.load does not check the zip's CRC-32s: a flipped bit in a weight loaded as
    # another weight, and the run trained on from it (exit 0)
    path = lin / "checkpoints" / CKPT8
    weight = payload_of(path)["model"]["weight"]
    data = bytearray(path.read_bytes())
    at = data.index(weight.numpy().tobytes())
    data[at + 1] ^= 0x10
    path.write_bytes(bytes(data))
    line = refused(snapshot, lin, "--resume", path, "--set", "steps=12")
    assert line.startswith(f"ampguard: error: {path}: damaged checkpoint: its ") and line.endswith(
        " fails its checksum (the bytes changed after it was written: a disk or copy error)"), line


def test_a_folder_named_like_a_checkpoint_is_left_alone_when_the_run_prunes(lin):
    # review 36c: pruning took it for the oldest checkpoint and unlink() failed on it mid-run
    # (IsADirectoryError, exit 1, after the step-12 save)
    folder = lin / "checkpoints" / "step-00000001.pt"
    folder.mkdir()
    ok(ag("train", "--resume", lin / "checkpoints" / CKPT8, "--set", "steps=16", "--set", "checkpoint.keep=2"))
    assert folder.is_dir()
    assert sorted(p.name for p in (lin / "checkpoints").glob("step-*.pt") if p.is_file()) == [
        "step-00000012.pt", "step-00000016.pt"]


# ---------------------------------------------------------------------------- C. leftovers


def test_partial_saves_are_removed_when_a_resume_starts(lin):
    folder = lin / "checkpoints"
    stale = [folder / ".step-00000009.pt.tmp-4242", folder / f".step-00000010.pt.tmp-{os.getpid()}"]
    for path in stale:
        path.write_bytes(b"half a checkpoint")
    ok(ag("train", "--resume", lin, "--set", "steps=9"))
    assert not any(path.exists() for path in stale)
    assert sorted(p.name for p in (lin / "checkpoints").iterdir()) == [CKPT4, CKPT8, "step-00000009.pt"]


@pytest.mark.parametrize("where", ["under a file", "a name too long"])
def test_a_run_folder_that_cannot_be_made_leaves_no_empty_folder_behind(cli, tmp_path, where):
    (tmp_path / "a-file").write_text("", encoding="utf-8")
    log_dir = tmp_path / "a-file" / "runs" if where == "under a file" else tmp_path / "runs" / ("x" * 300)
    before = sorted(p.name for p in tmp_path.iterdir())
    code, out, err = cli("train", *LINEAR, "--set", "steps=2", "--set", f"log.dir={log_dir}", "--set", "log.name=a")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "cannot create run folder" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no runs/ left behind


@pytest.mark.parametrize("error, expected_code, line", [
    ((13, "Permission denied"), ExitCode.BAD_INPUT, "cannot create run folder runs/deeper/a: Permission denied"),
    # a full disk is not bad input: it has its own exit code
    ((28, "No space left on device"), ExitCode.DISK_FULL, "disk full while writing the run folder"),
], ids=["EACCES", "ENOSPC"])
@pytest.mark.parametrize("what", ["write_config", "ensure_run_id", "the write itself"])
def test_a_run_folder_whose_config_cannot_be_written_is_taken_back(cli, tmp_path, monkeypatch, error,
                                                                   expected_code, line, what):
    # the run id (written just after config.yaml) on a disk that filled up in between was a
    # traceback, exit 1, and a folder left holding config.yaml and .run-id.tmp
    from ampguard import run_folder

    def cannot_write(self, *config):
        raise OSError(*error)

    if what == "the write itself":  # through files.replace_atomically, which names a full disk DiskFull
        real_open = os.open

        def open_fails(path, flags, *args, **kwargs):  # config.yaml's temporary file (no inode left, no access)
            if os.path.basename(os.fspath(path)).startswith(".config.yaml.tmp"):
                raise OSError(*error)
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", open_fails)
    else:
        monkeypatch.setattr(run_folder.RunPaths, what, cannot_write)
    code, out, err = cli("train", *LINEAR, "--set", "steps=2", "--set", "log.dir=runs/deeper", "--set", "log.name=a")
    assert code == expected_code, (code, out, err)
    assert len(err.strip().splitlines()) == 1 and err.startswith("ampguard: error: "), err
    assert line in err and error[1] in err, err
    assert list(tmp_path.iterdir()) == []  # runs/ and runs/deeper were made by the run: taken back


# ---------------------------------------------------------------------------- D. read-only run folders


def _as_another_user(argv: list[str]) -> tuple[int, str]:
    """``ampguard ARGV`` in a forked child that gave up root (as root every folder is writable):
    (exit code, stderr). Everything the refusal needs is imported before the fork."""
    import ampguard.train  # noqa: F401 - the child cannot read root's Python install to import it
    from ampguard.cli import main

    def give_up_root() -> None:
        os.setgid(65534)
        os.setuid(65534)

    def refused() -> str:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(argv)
        return f"{int(code)} {err.getvalue()}"

    forked, said = in_fork(refused, preexec=give_up_root)
    assert forked == 0, said
    code, err = said.split(" ", 1)
    return int(code), err


@pytest.mark.parametrize("what", ["run folder", "checkpoints"])
def test_resume_of_a_read_only_run_folder_is_one_line_naming_it(runs, snapshot, what):
    root = Path(tempfile.mkdtemp())  # not under pytest's folder, which only root may enter
    try:
        root.chmod(0o755)
        run = root / "lin"
        shutil.copytree(runs / "lin", run)
        if os.geteuid() == 0:  # the folder is the other user's own, but for what is made read-only
            for path in [run, *run.rglob("*")]:
                os.chown(path, 65534, 65534)
        readonly = [run, *run.iterdir()] if what == "run folder" else [run / "checkpoints"]
        for path in readonly:
            path.chmod(0o555 if path.is_dir() else 0o444)
        before = snapshot(run)
        argv = ["train", "--resume", str(run), "--set", "steps=12"]
        if os.geteuid() == 0:
            code, err = _as_another_user(argv)
        else:
            code, _, err = ag(*argv)
        assert code == 2, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert f"run folder {run} is read-only" in err
        assert ("(it cannot be written)" if what == "run folder" else "(checkpoints in it cannot be written)") in err
        assert snapshot(run) == before
    finally:
        for path in [root, *root.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        shutil.rmtree(root)


# ---------------------------------------------------------------------------- the pickled-code message


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_junk_bytes_are_unreadable_and_pickled_code_is_refused_as_such(tmp_path):
    class RunsCode:
        def __reduce__(self):
            return os.system, ("touch PWNED",)

    junk, code = tmp_path / "step-00000001.pt", tmp_path / "step-00000002.pt"
    junk.write_bytes(b"not a checkpoint")
    code.write_bytes(pickle.dumps({"model": RunsCode()}))
    with pytest.raises(ckpt.InputError, match=r"unreadable checkpoint \(truncated, or not a PyTorch file\)"):
        ckpt.load_checkpoint(junk)
    with pytest.raises(ckpt.InputError, match="refused by the weights-only loader: it holds pickled objects"):
        ckpt.load_checkpoint(code)


def test_a_steps_csv_that_does_not_reach_the_checkpoint_or_goes_back_is_refused(tmp_path):
    """The resume appended after the checkpoint's step whatever the CSV held before it: a CSV cut
    short (rows 1-2 of 6, or the header alone) became 1, 2, 7, 8 (report then disagreed with the
    run card), and a row going back (..., 6, 2) stayed in a CSV report refuses. Each is one
    line, exit 2, the CSV as it was."""
    code, out, err = train(tmp_path, "base", "--set", "task.name=linear", "--set", "steps=6",
                           "--set", "checkpoint.every=2")
    assert code == 0, err
    base = tmp_path / "base"
    rows = (base / "steps.csv").read_text(encoding="utf-8").splitlines(keepends=True)
    cases = {"short": (rows[:3], "its rows end at step 2, the checkpoint is at step 6 (rows missing); cannot resume "
                                 "into it; --resume {run}/checkpoints/step-00000002.pt goes on from there"),
             "header": (rows[:1], "its rows end at step 0, the checkpoint is at step 6 (rows missing)"),
             "gap": (rows[:3] + rows[4:], "line 4: step 4 where step 3 should be (a row is missing)"),
             "back": (rows + [rows[2]], "line 8: step 2 where step 7 should be (a step goes back)")}
    for name, (lines, said) in cases.items():
        run = tmp_path / name
        shutil.copytree(base, run)
        (run / "steps.csv").write_text("".join(lines), encoding="utf-8")
        before = snapshot_of(run)
        said = said.format(run=run)
        ending = "" if "goes on from there" in said else "; cannot resume into it"
        assert one_error_line(ag("train", "--resume", run, "--set", "steps=8")) == (
            f"ampguard: error: {run / 'steps.csv'}{': ' if said.startswith('its') else ' '}{said}{ending}"), name
        assert snapshot_of(run) == before, name


def test_the_logs_are_made_durable_before_each_checkpoint(tmp_path, monkeypatch):
    """Checkpoints are fsync'ed, rows were not: after a machine crash the CSV could stop short of
    a checkpoint that survived, and the resume refuses such a CSV. Before each checkpoint is
    written, steps.csv and events.jsonl are fsync'ed (seen here in the order of the real calls)."""
    synced = []
    real = os.fsync

    def fsync(fd):
        with contextlib.suppress(OSError):
            synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")).name)
        return real(fd)

    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc to name the synced files")
    monkeypatch.setattr(os, "fsync", fsync)
    ok(train(tmp_path, "R", *LINEAR, "--set", "steps=4", "--set", "checkpoint.every=2"))
    first = next(i for i, name in enumerate(synced) if name.startswith(".step-00000002.pt"))
    assert {"steps.csv", "events.jsonl"} <= set(synced[:first]), synced
