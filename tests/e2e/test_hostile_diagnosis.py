"""Hostile and careless input to the diagnosis verbs (issue 16): ``locate``, ``validate``,
``report`` and ``bench``. Every refusal is one line ``ampguard: error: ...`` on stderr, exit 2,
nothing on stdout that claims a result, and the working folder exactly as it was (``snapshot``).

Read-only folders: root writes through permission bits, so when the tests run as root the
``read_only`` fixture shows this process what any other user sees (``os.access`` honours the
owner-write bit); the writes that follow the check are tested separately by failing them.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch
import yaml

from helpers import Hang, deadline
from helpers import one_error_line as refused  # the single error line of a refusal (exit 2, no traceback)

LINEAR = ["--set", "task.name=linear"]
LINEAR_FP16 = [*LINEAR, "--set", "precision=fp16"]
TINY_CHARLM = ["--set", "task.name=charlm", "--set", "task.n_layer=1", "--set", "task.n_embd=16",
               "--set", "task.n_head=2", "--set", "task.block_size=16", "--set", "task.batch_size=4"]
CSV_TEXT = ("step,lr,grad_l2_pre_clip,grad_l2_post_clip,loss,skipped,skip_reason,scaler_scale\n"
            "1,0.1,2.0,1.0,0.5,0,,65536.0\n2,0.1,inf,,0.4,1,non_finite_grad,32768.0\n3,0.1,0.5,0.5,0.3,0,,32768.0\n")


@pytest.fixture
def read_only(monkeypatch):
    """``read_only(folder)``: make ``folder`` (created if missing) read-only, as a non-root user sees it."""
    made: list[Path] = []
    if os.geteuid() == 0:
        real = os.access

        def access(path, mode, *args, **kwargs):
            if mode & os.W_OK and os.path.exists(path) and not os.stat(path).st_mode & stat.S_IWUSR:
                return False
            return real(path, mode, *args, **kwargs)

        monkeypatch.setattr(os, "access", access)

    def make(folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o555)
        made.append(folder)
        return folder

    yield make
    for folder in made:
        folder.chmod(0o755)


# ---------------------------------------------------------------------------- locate


def test_locate_a_step_beyond_the_run_is_refused_at_once(cli, tmp_path, snapshot):
    # it used to read the data stream up to step 100000000: hours, with nothing said. In this process
    # (inside tmp_path), under a deadline that fails a hang: a subprocess cost ~4 s of torch import
    before = snapshot(tmp_path)
    try:
        with deadline(120):
            result = cli("locate", *LINEAR, "--step", "100000000")
    except Hang:
        pytest.fail("locate --step 100000000 did not return within 120 s")
    line = refused(result)
    assert line == "ampguard: error: locate: --step 100000000 is beyond the run's 1000 steps (config steps)"
    assert snapshot(tmp_path) == before


def test_locate_step_is_bounded_by_the_configs_steps(cli, unchanged):
    check = unchanged()
    line = refused(cli("locate", *LINEAR, "--set", "steps=5", "--step", "6"))
    assert line == "ampguard: error: locate: --step 6 is beyond the run's 5 steps (config steps)"
    check()
    code, out, err = cli("locate", *LINEAR, "--set", "steps=5", "--step", "5")  # the last step is fine
    assert code == 0, err


@pytest.mark.parametrize("value, shown", [("-1", "-1"), ("0", "0"), ("nan", "nan"), ("inf", "inf"), ("-inf", "-inf")])
def test_locate_scale_must_be_a_finite_positive_number(cli, unchanged, value, shown):
    check = unchanged()
    line = refused(cli("locate", *LINEAR_FP16, f"--scale={value}"))
    assert line == f"ampguard: error: locate: --scale must be a finite number > 0, got {shown}"
    check()


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_locate_scale_on_a_run_without_a_loss_scaler_is_refused(cli, unchanged, precision):
    # it used to invent an fp16-style overflow finding for a run that never scales its loss
    check = unchanged()
    line = refused(cli("locate", *LINEAR, "--set", f"precision={precision}", "--scale", str(2.0**24)))
    assert line == f"ampguard: error: locate: --scale: {precision} uses no loss scaler"
    line = refused(cli("locate", *LINEAR_FP16, "--set", "scaler.enabled=false", "--scale", "8"))
    assert line == "ampguard: error: locate: --scale: fp16 with scaler.enabled=false uses no loss scaler"
    check()


def test_locate_a_batch_the_model_cannot_take_is_one_line(cli, tmp_path, unchanged):
    torch.save({"inputs": torch.ones(8, 7), "targets": torch.zeros(8, 4)}, tmp_path / "narrow.pt")  # model takes 16
    torch.save({"inputs": torch.ones(8, 16), "targets": torch.zeros(8, 3)}, tmp_path / "targets.pt")  # it gives 4
    torch.save({"inputs": 5, "targets": [1, 2]}, tmp_path / "numbers.pt")
    check = unchanged()
    line = refused(cli("locate", *LINEAR_FP16, "--batch", "narrow.pt"))
    assert line.startswith("ampguard: error: locate: batch narrow.pt does not fit the model of task linear: "
                           "RuntimeError: mat1 and mat2 shapes cannot be multiplied"), line
    line = refused(cli("locate", *LINEAR_FP16, "--batch", "targets.pt"))
    assert "batch targets.pt does not fit the model of task linear: RuntimeError: " in line
    line = refused(cli("locate", *LINEAR_FP16, "--batch", "numbers.pt"))
    assert "batch numbers.pt does not fit the model of task linear: TypeError: " in line
    check()


def test_locate_a_model_that_exits_is_one_line_not_a_silent_exit(cli, tmp_path, unchanged):
    # (locate caught Exception only: the model's sys.exit(0) passed through as locate's own exit 0,
    # which says "every value finite", and printed nothing)
    (tmp_path / "fac.py").write_text(
        "import sys, torch\n"
        "class Exits(torch.nn.Linear):\n"
        "    def forward(self, x):\n"
        "        sys.exit(0)\n"
        "def build(config):\n"
        "    def batches():\n"
        "        while True:\n"
        "            yield torch.randn(4, 2), torch.randn(4, 1)\n"
        "    return Exits(2, 1), batches, torch.nn.functional.mse_loss\n", encoding="utf-8")
    check = unchanged()
    line = refused(cli("locate", "--set", "task.factory=fac.py:build", "--set", "precision=fp32", "--step", "1"))
    assert line == ("ampguard: error: locate: task factory: the model or the loss failed on step 1's batch: "
                    "SystemExit: 0")
    check()


def test_locate_a_batch_that_fits_still_shows_the_losss_warning(cli, tmp_path):
    # a target that broadcasts is not an error: the replay runs and the loss's warning is shown
    torch.save({"inputs": torch.ones(8, 16), "targets": torch.zeros(8, 1)}, tmp_path / "broadcast.pt")
    with pytest.warns(UserWarning, match="target size"):
        code, out, err = cli("locate", *LINEAR_FP16, "--batch", "broadcast.pt")
    assert code == 0, err
    assert "no non-finite value" in out


def test_locate_nan_input_on_integer_tokens_is_refused_as_train_does(cli, unchanged):
    check = unchanged()
    line = refused(cli("locate", *TINY_CHARLM, "--inject", "nan_input@1"))
    assert line == ("ampguard: error: inject: nan_input needs a floating-point input tensor; the inputs of task charlm "
                    "hold none")
    check()
    # train says the same
    assert refused(cli("train", *TINY_CHARLM, "--set", "steps=1", "--inject", "nan_input@1")) == line
    check()


# ---------------------------------------------------------------------------- validate


def test_validate_out_naming_an_existing_file_is_refused_untouched(cli, tmp_path, unchanged):
    (tmp_path / "notes.txt").write_text("keep me\n")
    check = unchanged()
    line = refused(cli("validate", *LINEAR, "--set", "validation.max_mse=10", "--out", "notes.txt"))
    assert line == "ampguard: error: --out notes.txt is a file, not a folder"
    line = refused(cli("validate", *LINEAR, "--set", "validation.max_mse=10", "--out", "notes.txt/report"))
    assert line == f"ampguard: error: --out notes.txt/report: {tmp_path / 'notes.txt'} is a file, not a folder"
    check()


def test_validate_out_in_a_read_only_folder_is_refused(cli, tmp_path, read_only, unchanged):
    locked = read_only(tmp_path / "locked")
    check = unchanged()
    line = refused(cli("validate", *LINEAR, "--set", "validation.max_mse=10", "--out", "locked/report"))
    assert line == f"ampguard: error: --out locked/report: {locked} is not writable"
    # the default folder (log.dir/validate-<time>) is checked the same way
    line = refused(cli("validate", *LINEAR, "--set", "validation.max_mse=10", "--set", "log.dir=locked"))
    assert line.endswith(f"{locked} is not writable"), line
    check()


def test_validate_a_write_that_fails_leaves_nothing(cli, tmp_path, monkeypatch, unchanged):
    from ampguard import validate

    real = validate.write_outputs

    def disk_full(v, config, folder):
        real(v, config, folder)  # the first files are written, then the disk fills up
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(validate, "write_outputs", disk_full)
    check = unchanged()
    line = refused(cli("validate", *LINEAR, "--set", "validation.max_mse=10", "--out", "deep/report"))
    assert line == "ampguard: error: --out deep/report: cannot write the report (No space left on device)"
    check()  # no report, no half-made folders


def test_validate_an_empty_probe_set_is_refused_naming_the_keys(cli, tmp_path, factory, unchanged):
    check = unchanged()
    line = refused(cli("validate", *LINEAR, "--set", "validation.typical=0", "--set", "validation.edge_cases=false",
                       "--out", "r"))
    assert line == ("ampguard: error: validate: the probe set is empty (validation.typical is 0, validation.boundary "
                    "applies to classifiers only, validation.edge_cases is false): set validation.typical > 0")
    line = refused(cli("validate", "--set", f"task.factory={factory}", "--set", "validation.typical=0",
                       "--set", "validation.boundary=0", "--set", "validation.edge_cases=false", "--out", "r"))
    assert line == ("ampguard: error: validate: the probe set is empty (validation.typical is 0, validation.boundary "
                    "is 0, validation.edge_cases is false): set validation.typical > 0")
    check()


def test_validate_no_precisions_is_refused(cli, tmp_path, unchanged):
    # it used to say ACCEPTED with nothing compared
    check = unchanged()
    line = refused(cli("validate", *LINEAR, "--set", "validation.precisions=[]", "--out", "r"))
    assert line == ("ampguard: error: config: validation.precisions: name at least one AMP precision to compare "
                    "(fp16, bf16, fp8)")
    line = refused(cli("validate", *LINEAR, "--set", "validation.precisions=[bf16,bf16]", "--out", "r"))
    assert line == "ampguard: error: config: validation.precisions: bf16 listed more than once"
    check()


def test_validate_a_quality_threshold_of_the_other_mode_is_refused(cli, tmp_path, factory, unchanged):
    # both used to be silently ignored: the report said "no quality threshold"
    check = unchanged()
    line = refused(cli("validate", *LINEAR, "--set", "validation.min_accuracy=0.9", "--out", "r"))
    assert line == ("ampguard: error: validate: validation.min_accuracy applies to classifiers; task linear is a "
                    "regression task (declare validation.max_mse)")
    config = tmp_path / "classifier.yaml"
    config.write_text(yaml.safe_dump({"task": {"factory": factory}, "validation": {"max_mse": 0.1}}))
    check = unchanged()
    line = refused(cli("validate", config, "--out", "r"))
    assert line == ("ampguard: error: validate: validation.max_mse applies to regression tasks; task factory is a "
                    "classifier (declare validation.min_accuracy)")
    check()


# ---------------------------------------------------------------------------- report


@pytest.fixture
def steps_csv(tmp_path) -> Path:
    path = tmp_path / "steps.csv"
    path.write_text(CSV_TEXT, encoding="utf-8")
    return path


def test_report_out_in_a_missing_folder_is_refused(cli, steps_csv, unchanged, tmp_path):
    check = unchanged()
    missing = tmp_path / "missing"  # (not /nonexistent: a root process, matplotlib's HOME=/nonexistent, may make it)
    line = refused(cli("report", steps_csv.name, "--out", missing / "x.png"))
    assert line == f"ampguard: error: report: --out {missing / 'x.png'}: folder {missing} does not exist"
    check()


@pytest.mark.parametrize("name", ["x.xyz", "x.pdf", "x", "x.png.txt"])
def test_report_out_must_be_a_png(cli, steps_csv, unchanged, name):
    check = unchanged()
    line = refused(cli("report", steps_csv.name, "--out", name))
    assert line == f"ampguard: error: report: --out {name}: the plot is a PNG; name a .png file"
    check()


def test_report_never_overwrites_what_is_not_a_plot(cli, tmp_path, steps_csv, unchanged):
    (tmp_path / "notes.png").write_text("not a picture\n")
    (tmp_path / "folder.png").mkdir()
    data_png = tmp_path / "data.png"  # a CSV whose default plot path is itself
    data_png.write_text(CSV_TEXT, encoding="utf-8")
    check = unchanged()
    line = refused(cli("report", steps_csv.name, "--out", "notes.png"))
    assert line == "ampguard: error: report: --out notes.png exists and is not a PNG; refusing to overwrite it"
    line = refused(cli("report", steps_csv.name, "--out", "folder.png"))
    assert line == "ampguard: error: report: --out folder.png is a folder"
    line = refused(cli("report", "data.png"))
    assert line == ("ampguard: error: report: data.png is named as a plot (.png) but holds no PNG: the plot beside it "
                    "would be the CSV itself; give --out another .png, or --no-plot")
    check()


def test_report_in_a_read_only_folder_is_refused(cli, tmp_path, read_only, unchanged):
    run = tmp_path / "run"
    run.mkdir()
    (run / "steps.csv").write_text(CSV_TEXT, encoding="utf-8")
    read_only(run)
    check = unchanged()
    line = refused(cli("report", "run"))  # the default plot, run/report.png
    assert line == "ampguard: error: report: the plot run/report.png: folder run is not writable"
    line = refused(cli("report", "run", "--out", "run/again.png"))
    assert line == "ampguard: error: report: --out run/again.png: folder run is not writable"
    check()


def test_report_a_plot_that_cannot_be_saved_leaves_nothing(cli, steps_csv, monkeypatch, unchanged):
    from matplotlib.figure import Figure

    def disk_full(self, fname, **kwargs):
        Path(fname).write_bytes(b"\x89PNG half")  # a part of the file is out, then the disk fills up
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", disk_full)
    check = unchanged()
    line = refused(cli("report", steps_csv.name, "--out", "plot.png"))
    assert line == "ampguard: error: plot.png: cannot write the plot (No space left on device)"
    check()


# ---------------------------------------------------------------------------- bench


def test_bench_with_no_contender_left_is_one_line(cli, monkeypatch):
    # it used to end in ZeroDivisionError (r % len(built)) when every contender failed its warm-up
    from ampguard import bench

    def broken(self):
        raise RuntimeError("no kernel for this")

    monkeypatch.setattr(bench.Bare, "step", broken)
    monkeypatch.setattr(bench.Guarded, "step", broken)
    monkeypatch.setattr(bench.os, "getloadavg", lambda: (99.0, 1.0, 0.5))  # (a busy machine: still one line)
    code, out, err = cli("bench", "--quick", "--models", "mlp", "--precisions", "fp32", "--no-peers")
    line = refused((code, "", err))
    assert line == "ampguard: error: bench: no contender could run mlp in fp32 on cpu (why: the lines above)"
    assert "bare loop: not run (RuntimeError: no kernel for this)" in out
    assert "tiny-mlp fp32: no contender could run, nothing measured" in out
    assert "| tiny-mlp" not in out  # no table of nothing


def test_bench_nothing_to_measure_is_refused_up_front(cli):
    line = refused(cli("bench", "--models", "transformer,gpt2", "--precisions", "fp16", "--device", "cpu"))
    assert line == "ampguard: error: bench: on a CPU fp16 runs only the mlp and nano models; nothing to measure for transformer,gpt2"
    for value in ("-1", "0", "nan"):
        line = refused(cli("bench", "--quick", "--models", "mlp", f"--peak-tflops={value}"))
        assert line == f"ampguard: error: bench: --peak-tflops must be a finite number > 0, got {value}"
