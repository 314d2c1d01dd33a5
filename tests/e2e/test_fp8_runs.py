"""``precision: fp8`` in whole runs: torchao float8 training (on the CPU through PyTorch's
``torch._scaled_mm``) on the digits task learns as well as bf16 over the same steps, ``ampguard
train`` writes the same run folder and CSV, ``validate`` judges fp8 against the FP32 reference
with bf16's rules and report format, ``bench`` measures it, and bad fp8 input is one line, exit
2, nothing written."""

from __future__ import annotations

import csv
import importlib.metadata
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from helpers import one_line_error

from ampguard.config import load_config
from ampguard.run_folder import RunPaths
from ampguard.train import run

pytestmark = pytest.mark.usefixtures("_one_thread", "_no_bytecode")  # tests/conftest.py

FIXED = ["step", "lr", "grad_l2_pre_clip", "grad_l2_post_clip", "loss", "skipped", "skip_reason", "scaler_scale"]
DIGITS = ["device=cpu", "task.name=digits", "checkpoint.enabled=false", "eval.every=0", "log.plot=false"]  # (no plot read)


def rows_of(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    return list(reader.fieldnames or []), rows


def train_digits(tmp_path: Path, precision: str, steps: int) -> tuple[list[str], list[dict[str, str]]]:
    config = load_config(None, [*DIGITS, f"precision={precision}", f"steps={steps}"])
    path = tmp_path / f"{precision}.csv"
    result = run(config, outputs=lambda: RunPaths(csv=path), console_every=10**9, print_fn=lambda s: None)
    assert result.exit_code == 0, result.ended
    return rows_of(path)


def test_fp8_on_digits_reaches_bf16_accuracy_within_two_points(tmp_path):
    # the MLP is 64-128-128-10: its middle Linear trains in float8, the first and last stay bf16
    # (60 steps: emulated on the CPU a float8 step costs several bf16 ones; both are at 0.91 by then, 0.92 at 100)
    header_bf16, bf16 = train_digits(tmp_path, "bf16", 60)
    header_fp8, fp8 = train_digits(tmp_path, "fp8", 60)
    assert header_fp8 == header_bf16 == [*FIXED, "val_loss", "val_accuracy"]  # the CSV gains nothing
    assert [r["skipped"] for r in fp8] == ["0"] * 60 and {r["scaler_scale"] for r in fp8} == {"1.0"}
    acc_bf16, acc_fp8 = float(bf16[-1]["val_accuracy"]), float(fp8[-1]["val_accuracy"])
    assert acc_bf16 > 0.85  # it learned (chance is 0.1)
    assert abs(acc_fp8 - acc_bf16) <= 0.02, (acc_fp8, acc_bf16)
    assert fp8[-1]["loss"] != bf16[-1]["loss"]  # fp8 really ran (a different numeric path)


def test_train_fp8_end_to_end_writes_the_run_folder(cli, tmp_path):
    code, out, err = cli("train", "--set", "precision=fp8", "--set", "task.name=digits", "--set", "steps=6",
                         "--set", "device=cpu", "--set", "eval.every=3", "--set", "log.name=fp8",
                         "--set", "log.plot=false")  # (no test here reads the plot)
    assert code == 0, err
    folder = tmp_path / "runs" / "fp8"
    header, rows = rows_of(folder / "steps.csv")
    assert header == [*FIXED, "val_loss", "val_accuracy"] and len(rows) == 6
    assert all(r["skipped"] == "0" and r["skip_reason"] == "" for r in rows)
    card = (folder / "RUN.md").read_text(encoding="utf-8")
    assert re.search(r"\| precision \| fp8\b", card), card
    assert "| fp8 | recipe tensorwise; 1 Linear layer in float8: 2 |" in card  # the card says which
    assert (folder / "config.yaml").read_text(encoding="utf-8").count("recipe: tensorwise") == 1
    assert "Traceback" not in err and "Failed to load" not in err  # torchao's CPU import noise held back
    start = next(json.loads(line) for line in (folder / "events.jsonl").read_text(encoding="utf-8").splitlines()
                 if json.loads(line)["event"] == "run_start")
    assert "fp8 on cpu (1 Linear layer in float8: 2)" in start["message"]  # 64-128-128-10: the middle one


def test_fp8_with_headroom_measures_against_bf16_the_format_it_computes_in(cli, tmp_path):
    # monitor.headroom.format auto looked up a format "fp8" that does not exist: a KeyError traceback
    code, out, err = cli("train", "--set", "precision=fp8", "--set", "task.name=digits", "--set", "steps=2",
                         "--set", "device=cpu", "--set", "eval.every=0", "--set", "monitor.headroom.every=1",
                         "--set", "log.name=hr", "--set", "log.plot=false", "--set", "checkpoint.enabled=false")
    assert code == 0, err
    folder = tmp_path / "runs" / "hr"
    _, rows = rows_of(folder / "headroom.csv")
    assert {r["tensor"] for r in rows} == {"input", "output", "grad", "param_grad"} and {r["step"] for r in rows} == {"1", "2"}
    assert all(float(r["headroom_bits"]) > 100 for r in rows)  # bf16's range: nowhere near
    assert "every 1 step against bf16" in (folder / "RUN.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("argv,expected", [
    (["--set", "task.name=linear"], "precision: fp8: no Linear layer can train in fp8 (the model: a bare Linear, "
                                    "not a model that holds one); use bf16"),
    (["--set", "fp8.recipe=delayed"], "config: fp8.recipe: Input should be 'tensorwise' or 'rowwise' "
                                      "(got 'delayed')"),
    (["--set", "fp8.keep_first_last=maybe"], "config: fp8.keep_first_last: expected true or false, got the "
                                             "text 'maybe'"),
    # a typo would leave the layer it meant to keep in bf16 in float8
    (["--set", "task.name=digits", "--set", "fp8.exclude=[2, nosuch*]"],
     "precision: fp8: fp8.exclude 'nosuch*' matches no Linear layer of the model (it has '0', '2', '4')"),
])
def test_bad_fp8_input_is_one_line_exit_2_and_nothing_written(cli, tmp_path, unchanged, argv, expected):
    check = unchanged()
    code, out, err = cli("train", "--set", "precision=fp8", "--set", "device=cpu", "--set", "steps=2", *argv)
    assert one_line_error(code, out, err) == f"ampguard: error: {expected}"
    check()


def test_fp8_without_torchao_is_one_line_exit_2(cli, tmp_path, unchanged, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # the fp8 extra not installed
    check = unchanged()
    code, out, err = cli("train", "--set", "precision=fp8", "--set", "task.name=digits", "--set", "device=cpu",
                         "--set", "steps=2")
    assert one_line_error(code, out, err) == ("ampguard: error: precision: fp8 needs torchao, which is not "
                                              "installed: pip install 'ampguard[fp8]' (or pip install torchao)")
    check()


@pytest.mark.parametrize("source, said", [
    # made for a newer torch: its import fails on what this torch lacks, with whatever that raises
    ("raise AttributeError(\"module 'torch' has no attribute 'int1'\")",
     r"AttributeError: module 'torch' has no attribute 'int1'"),
    ("", r"ImportError: cannot import name 'float8' from 'torchao' \(.*\)"),  # older than torchao.float8
])
def test_fp8_with_a_torchao_that_fails_to_import_is_one_line_exit_2(cli, tmp_path, unchanged, monkeypatch, source,
                                                                     said):
    # it was a traceback (the AttributeError), or "torchao, which is not installed" (the ImportError)
    for name in [name for name in sys.modules if name.partition(".")[0] == "torchao"]:
        monkeypatch.delitem(sys.modules, name)  # (put back after the test)
    (tmp_path / "site" / "torchao").mkdir(parents=True)
    (tmp_path / "site" / "torchao" / "__init__.py").write_text(source + "\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    check = unchanged()
    code, out, err = cli("train", "--set", "precision=fp8", "--set", "task.name=digits", "--set", "device=cpu",
                         "--set", "steps=2")
    installed = importlib.metadata.version("torchao")  # (the installed one's metadata: the fake has none)
    assert re.fullmatch(rf"ampguard: error: precision: fp8 needs torchao, and torchao {re.escape(installed)} failed to "
                        rf"import with torch {re.escape(torch.__version__)} \({said}\): install the torchao release "
                        r"made for this torch \(torchao's README lists them\)", one_line_error(code, out, err))
    check()


ZERO_PROJECTION = """
import torch
from torch import nn
from torch.nn import functional as F


def build(config):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    with torch.no_grad():
        model[2].weight.zero_()  # a zero-initialised projection: its amax is 0
    g = torch.Generator().manual_seed(1)
    data = [(torch.rand(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(4)]
    return {"model": model, "data": data, "loss_fn": F.cross_entropy}
"""


def test_a_floorless_scale_in_a_run_is_skipped_then_stopped_and_named(tmp_path, monkeypatch):
    # torchao#3356's bug injected (float8_max / amax with no floor): the zero weight's scale is inf
    # and its cast 0 x inf = NaN on every step; the step skips it, strict mode stops the run (exit
    # 3) naming the Float8Linear layer and, from the diagnosis's own replay, the operand and the
    # scale that broke (the finding named the layer alone: find_bad_scales was yours to call)
    import torch
    from torchao.float8 import float8_scaling_utils
    from torchao.float8.float8_utils import tensor_to_amax

    def floorless(hp, float8_dtype, reduce_amax=False, mesh=None, granularity=None, axiswise_dim=None, rnd=False):
        amax = tensor_to_amax(hp, reduce_amax, mesh, granularity, axiswise_dim).to(torch.float64)
        return (torch.finfo(float8_dtype).max / amax).to(torch.float32)

    monkeypatch.setattr(float8_scaling_utils, "tensor_to_scale", floorless)
    factory = tmp_path / "zero_projection.py"
    factory.write_text(ZERO_PROJECTION, encoding="utf-8")
    config = load_config(None, ["device=cpu", "precision=fp8", f"task.factory={factory}:build", "steps=6",
                                "checkpoint.enabled=false", "diagnose.strict=true"])
    path = tmp_path / "steps.csv"
    result = run(config, outputs=lambda: RunPaths(csv=path), console_every=10**9, print_fn=lambda s: None)
    assert int(result.exit_code) == 3 and "forward output of 2 (Float8Linear" in result.ended, result.ended
    assert ("; a float8 scale broke first: 2 weight: amax 0 -> fp8 scale inf (the scale itself is broken: the tensor "
            "is finite). FP32 replay is finite: a precision-range problem; keeping 2 in FP32") in result.ended
    _, rows = rows_of(path)
    assert [(r["skipped"], r["skip_reason"]) for r in rows] == [("1", "non_finite_loss")]


def test_validate_judges_fp8_with_the_rules_and_report_of_bf16(cli, tmp_path):
    code, out, err = cli("validate", "--set", "task.name=digits", "--set", "device=cpu",
                         "--set", "validation.precisions=[bf16,fp8]", "--set", "validation.max_flips=100",
                         "--set", "validation.ties=accept", "--set", "validation.min_accuracy=0",
                         "--train-steps", "3", "--out", "report")
    assert code == 0, out + err
    md = (tmp_path / "report" / "validation.md").read_text(encoding="utf-8")
    data = json.loads((tmp_path / "report" / "validation.json").read_text(encoding="utf-8"))
    assert "## bf16 vs FP32" in md and "## fp8 vs FP32" in md
    by_name = {p["precision"]: p for p in data["precisions"]}
    assert list(by_name) == ["bf16", "fp8"]
    criteria = {name: [r["criterion"] for r in p["rules"]] for name, p in by_name.items()}
    assert criteria["fp8"] == criteria["bf16"] and len(criteria["fp8"]) == 6  # same probes, tolerances, flips,
    # quality, updates applied
    assert set(by_name["fp8"]) == set(by_name["bf16"])
    # float8 rounds harder than bf16: its scores stray further from the FP32 reference
    assert by_name["fp8"]["stats"]["max_abs_error"] > by_name["bf16"]["stats"]["max_abs_error"]
    assert re.search(r"^train fp8: 3 updates applied", out, flags=re.M), out
    # which layers ran in float8, and the recipe (the report said only "fp8 ... dtype torch.bfloat16")
    support = data["environment"]["dtype_support"]["fp8"]
    assert (support["recipe"], support["float8_layers"]) == ("tensorwise", ["2"])
    assert "| fp8 support | " in md and "recipe tensorwise, float8_layers 2 |" in md


def test_bench_measures_fp8_next_to_bf16(cli):
    code, out, err = cli("bench", "--quick", "--models", "mlp", "--precisions", "bf16,fp8", "--no-peers")
    assert code == 0, err
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| tiny-mlp | fp8")]
    assert {row[3].strip() for row in rows} == {"bare loop", "ampguard + csv"}
    assert re.search(r"^tiny-mlp, bare loop: fp8 is \d+\.\d\dx (faster|slower) than bf16 \(unpaired\)$", out, flags=re.M), out


def test_an_fp8_run_resumes_bit_for_bit(cli, tmp_path):
    common = ["--set", "precision=fp8", "--set", "task.name=digits", "--set", "device=cpu", "--set", "eval.every=0",
              "--set", "checkpoint.every=3", "--set", "schedule.decay=constant",  # the same lr whatever steps says
              "--set", "log.plot=false"]
    assert cli("train", *common, "--set", "steps=6", "--set", "log.name=straight")[0] == 0
    assert cli("train", *common, "--set", "steps=3", "--set", "log.name=cut")[0] == 0
    code, out, err = cli("train", "--resume", "runs/cut", "--set", "steps=6")
    assert code == 0, err
    _, straight = rows_of(tmp_path / "runs" / "straight" / "steps.csv")
    _, resumed = rows_of(tmp_path / "runs" / "cut" / "steps.csv")
    assert [r["step"] for r in resumed] == [str(i) for i in range(1, 7)]
    assert [(r["loss"], r["grad_l2_pre_clip"]) for r in resumed] == [(r["loss"], r["grad_l2_pre_clip"]) for r in straight]


def test_compare_says_which_layers_trained_in_float8(cli, tmp_path):
    # two fp8 runs whose float8 layers differ read "fp8" and "fp8" side by side (review_frontier13)
    common = ["--set", "precision=fp8", "--set", "task.name=digits", "--set", "device=cpu", "--set", "eval.every=0",
              "--set", "steps=2", "--set", "checkpoint.enabled=false", "--set", "log.plot=false"]
    assert cli("train", *common, "--set", "log.name=first_last_kept")[0] == 0
    assert cli("train", *common, "--set", "fp8.keep_first_last=false", "--set", "log.name=all")[0] == 0
    code, out, err = cli("compare", "runs/first_last_kept", "runs/all")
    assert code == 0, err
    row = next(line for line in out.splitlines() if line.startswith("| precision "))
    kept, every = [cell.strip() for cell in row.strip("|").split("|")[1:]]
    assert kept.startswith("fp8 (recipe tensorwise; 1 Linear layer in float8: ") and kept != every
    assert every.startswith("fp8 (recipe tensorwise; ") and "Linear layers in float8" in every
