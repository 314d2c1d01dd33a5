"""The command line: the demo, train end to end, bad input, Ctrl-C.

Most tests call ``ampguard.cli.main`` in-process (the ``cli`` fixture); a real process is used
only where one is needed: SIGINT, ``python -m ampguard`` and the console script.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import warm
import torch
import yaml

from helpers import read_rows

from ampguard.cli import main
from ampguard.config import load_config, validate
from ampguard.precision import Precision, SlowPrecisionWarning

HEADER = "step,lr,grad_l2_pre_clip,grad_l2_post_clip,loss,skipped,skip_reason,scaler_scale"
LINE = re.compile(r"^(STEP|SKIP) (\d+) ")
VENV_BIN = Path(sys.executable).parent
# A charlm small enough that a few steps take well under a second on a CPU.
TINY_CHARLM = ["task.n_layer=1", "task.n_embd=16", "task.n_head=2", "task.block_size=16", "task.batch_size=4"]


def step_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(("STEP ", "SKIP "))]


def field(line: str, name: str) -> str:
    match = re.search(rf"\b{name}=(\S+)", line)
    assert match, f"no {name}= in {line!r}"
    return match.group(1)


def summary(out: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith("summary:")]
    assert len(lines) == 1, out
    return lines[0]


def read_csv(path: Path) -> tuple[str, list[dict[str, str]]]:
    return Path(path).read_text(encoding="utf-8").splitlines()[0], read_rows(path)


def number(cell: str) -> float:
    return float(cell)  # float() reads "inf", "-inf" and "nan" as well


# ---------------------------------------------------------------------------- demo


def test_demo_default_structure(cli):
    code, out, err = cli("demo")
    assert code == 0, err
    lines = step_lines(out)
    assert len(lines) == 20
    assert [int(LINE.match(line).group(2)) for line in lines] == list(range(1, 21))
    skipped = [line for line in lines if line.startswith("SKIP ")]
    assert skipped == [lines[4]]
    assert lines[4].startswith("SKIP 5 ")
    assert field(lines[4], "reason") == "non_finite_grad"
    scales = [float(field(line, "scale")) for line in lines]
    assert scales[4] == scales[3] / 2
    assert set(scales[:4]) == {scales[0]}
    assert set(scales[4:]) == {scales[4]}
    text = summary(out)
    assert re.search(r"\bsteps=20\b", text) and re.search(r"\bupdates=19\b", text)


def test_demo_csv_file(cli, tmp_path):
    code, out, err = cli("demo", "--csv", "demo.csv")
    assert code == 0, err
    header, rows = read_csv(tmp_path / "demo.csv")
    assert header == HEADER
    assert [int(r["step"]) for r in rows] == list(range(1, 21))
    assert all(len(r) == 8 and None not in r.values() for r in rows)
    for r in rows:
        assert r["skipped"] in ("0", "1")
        assert math.isfinite(number(r["lr"])) and number(r["lr"]) > 0
    bad = rows[4]
    assert (bad["skipped"], bad["skip_reason"]) == ("1", "non_finite_grad")
    assert bad["grad_l2_pre_clip"] == "inf"  # written out, not blank
    assert bad["grad_l2_post_clip"] == ""  # no clip happened
    for r in rows[:4] + rows[5:]:
        assert (r["skipped"], r["skip_reason"]) == ("0", "")
        pre, post = number(r["grad_l2_pre_clip"]), number(r["grad_l2_post_clip"])
        assert math.isfinite(pre) and 0 <= post <= 1.0 and post <= pre
        assert math.isfinite(number(r["loss"]))
    scales = [number(r["scaler_scale"]) for r in rows]
    assert scales[4] == scales[3] / 2 and len(set(scales[:4])) == 1 and len(set(scales[4:])) == 1
    # The console shows the same steps, the same skip and the same scale.
    lines = step_lines(out)
    assert [line.startswith("SKIP") for line in lines] == [r["skipped"] == "1" for r in rows]
    assert [float(field(line, "scale")) for line in lines] == scales
    assert "demo.csv" in out


def test_demo_spike_fp16_is_skipped(cli, tmp_path):
    code, out, err = cli("demo", "--spike", "--csv", "s.csv")
    assert code == 0, err
    lines = step_lines(out)
    assert len(lines) == 20
    assert [line.split()[1] for line in lines if line.startswith("SKIP")] == ["5"]
    assert field(lines[4], "reason") == "non_finite_grad"
    _, rows = read_csv(tmp_path / "s.csv")
    assert [r["skipped"] for r in rows].count("1") == 1 and rows[4]["skipped"] == "1"
    assert rows[4]["grad_l2_pre_clip"] in ("inf", "nan")
    assert number(rows[4]["loss"]) > 1e3  # the spike is there, in the loss


def test_demo_spike_bf16_is_clipped_not_skipped(cli, tmp_path):
    code, out, err = cli("demo", "--spike", "--bf16", "--max-norm", "0.5", "--csv", "b.csv")
    assert code == 0, err
    lines = step_lines(out)
    assert len(lines) == 20 and not any(line.startswith("SKIP") for line in lines)
    assert re.search(r"\bupdates=20\b", summary(out))
    _, rows = read_csv(tmp_path / "b.csv")
    assert [r["skipped"] for r in rows] == ["0"] * 20
    spike = rows[4]
    assert number(spike["grad_l2_pre_clip"]) > 1e3
    assert number(spike["grad_l2_post_clip"]) <= 0.5
    assert all(number(r["grad_l2_post_clip"]) <= 0.5 for r in rows)
    assert {number(r["scaler_scale"]) for r in rows} == {1.0}  # bf16: no scaler


def test_demo_bf16_alone_is_the_same_demo_whose_skip_rate_drops_to_zero_as_the_seed_says(cli, tmp_path):
    # seed 000, exercise 2: "add --bf16 ...; on the same demo, verify the skip rate drops to zero" (review 40e:
    # plain --bf16 kept the injected Inf, an Inf in every precision, and skipped step 5)
    code, out, err = cli("demo", "--bf16", "--csv", "b.csv")
    assert code == 0, err
    assert out.splitlines()[0].endswith("bf16 with no loss scaler, max_norm=1.0, inject: spike@5"), out
    assert re.search(r"\bskips=0\b", summary(out)) and not any(line.startswith("SKIP") for line in step_lines(out))
    _, rows = read_csv(tmp_path / "b.csv")
    assert [r["skipped"] for r in rows] == ["0"] * 20 and number(rows[4]["grad_l2_pre_clip"]) > 1e3  # the spike, taken
    code, out, err = cli("demo", "--bf16", "--inject", "inf_grad@5")  # the Inf, asked for: skipped in bf16 too
    assert code == 0, err
    assert [line.split()[1] for line in step_lines(out) if line.startswith("SKIP")] == ["5"]


@pytest.mark.parametrize("given", ["-1", "0"])
def test_a_max_norm_of_zero_or_below_is_clipping_off_as_the_contract_says(cli, tmp_path, given):
    # review_session26: DESIGN says "max_norm <= 0 or null disables clipping (post = pre)"; the config and
    # the command line refused a negative one (exit 2) while Guard took it
    code, out, err = cli("demo", "--spike", "--bf16", "--max-norm", given, "--csv", "off.csv")
    assert code == 0, err
    assert out.splitlines()[0].endswith("no loss scaler, clipping off, inject: spike@5"), out
    _, rows = read_csv(tmp_path / "off.csv")
    assert number(rows[4]["grad_l2_pre_clip"]) > 1e3  # the spike, not clipped
    assert all(r["grad_l2_post_clip"] == r["grad_l2_pre_clip"] for r in rows)


def test_demo_inject_none(cli):
    code, out, err = cli("demo", "--inject", "none")
    assert code == 0, err
    lines = step_lines(out)
    assert len(lines) == 20 and all(line.startswith("STEP ") for line in lines)
    assert len({field(line, "scale") for line in lines}) == 1
    assert re.search(r"\bupdates=20\b", summary(out))


def test_demo_steps(cli):
    code, out, err = cli("demo", "--steps", "7")
    assert code == 0, err
    lines = step_lines(out)
    assert [int(line.split()[1]) for line in lines] == list(range(1, 8))
    assert lines[4].startswith("SKIP 5 ")
    text = summary(out)
    assert re.search(r"\bsteps=7\b", text) and re.search(r"\bupdates=6\b", text)
    # review_session26: the demo's own warm-up of 10 updates past a 7-step demo was a raw Python warning
    assert err == "", err


@pytest.mark.parametrize(
    ("argv", "step", "reason", "pre"),
    [
        (("--inject", "nan_loss@3"), 3, "non_finite_loss", ""),  # skipped before backward: no norm
        (("--inject", "nan_grad@3"), 3, "non_finite_grad", "nan"),
        (("--precision", "fp32"), 5, "non_finite_grad", "inf"),  # same checks without a scaler
    ],
)
def test_demo_other_faults(cli, tmp_path, argv, step, reason, pre):
    code, out, err = cli("demo", "--steps", "6", *argv, "--csv", "f.csv")
    assert code == 0, err
    lines = step_lines(out)
    assert [line.split()[1] for line in lines if line.startswith("SKIP")] == [str(step)]
    assert field(lines[step - 1], "reason") == reason
    _, rows = read_csv(tmp_path / "f.csv")
    row = rows[step - 1]
    assert (row["skipped"], row["skip_reason"], row["grad_l2_pre_clip"], row["grad_l2_post_clip"]) == (
        "1", reason, pre, "",
    )
    if "fp32" in argv:
        assert {number(r["scaler_scale"]) for r in rows} == {1.0}


def test_slow_precision_is_one_line_for_train_and_silent_for_the_demo(cli, tmp_path, cpu_kind):
    """fp16 on a CPU is emulated: ``train`` says so in one stderr line; the demo (fp16 on purpose) does not."""
    # (log.plot false on the trains: the plot is not what is tested, and costs each a second)
    cpu_kind(bf16=True)  # (a CPU with bf16 kernels: the note compares fp16 with bf16 there)
    shown = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always", SlowPrecisionWarning)  # the suite's config ignores it
        code, out, err = cli("train", *sum((["--set", s] for s in [
            "steps=1", "precision=fp16", *TINY_CHARLM, f"log.dir={tmp_path / 'runs'}", "log.plot=false"]), []))
        assert code == 0 and "\nended: finished: 1 step\n" in out, err  # (one step, not "1 steps")
        warned = [line for line in err.splitlines() if "emulated" in line]
        assert warned == [line for line in err.splitlines() if "Warning" in line or "warning" in line]
        assert warned == ["ampguard: warning: fp16 autocast on a CPU is emulated, about 10x slower than bf16 "
                          "there; prefer bf16 on CPUs"]
        code, _, err = cli("locate", "--set", "task.name=linear", "--set", "precision=fp16", "--step", "1")
        assert code == 0 and [line for line in err.splitlines() if "emulated" in line] == warned, err  # it too
        code, _, err = cli("demo", "--steps", "2")  # fp16 by default
        assert code == 0 and "emulated" not in err, err
        cpu_kind(bf16=False)  # an AVX2-only CPU: the main job's bf16 is emulated too, and said so once
        code, out, err = cli("train", *sum((["--set", s] for s in [
            "steps=1", *TINY_CHARLM, f"log.dir={tmp_path / 'runs-avx2'}", "log.plot=false"]), []))
        assert code == 0 and [line for line in err.splitlines() if "warning" in line] == [
            "ampguard: warning: bf16 autocast on this CPU is emulated (oneDNN has no bf16 kernels without AVX-512 "
            "or AMX): its matmuls run about 100x slower than fp32's; fp32 trains faster here"], err
        assert warnings.showwarning is shown  # main() put Python's own back
        with pytest.warns(SlowPrecisionWarning):  # and left the caller's filters as they were
            Precision("fp16", "cpu").check(torch.nn.Linear(2, 2), torch.device("cpu"))


@pytest.mark.parametrize("rank, world, launched, shown", [
    ("1", "2", True, False), ("0", "2", True, True), ("1", "1", True, True), ("", "", True, True),
    ("1", "2", False, True),  # (a RANK and WORLD_SIZE left in the environment alone: no launch, review 51k)
])
def test_under_torchrun_only_rank_0_says_ampguards_warnings(monkeypatch, rank, world, launched, shown):
    # every rank runs the same config on the same global stream: each warning came once per rank;
    # one about a rank's own state is that rank's, labelled (errors.warn decides, the one place)
    import contextlib
    import io

    from ampguard.cli import _slow_precision_in_one_line
    from ampguard.errors import RankWarning, warn

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", world)
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):  # (torchrun sets them beside)
        if launched:
            monkeypatch.setenv(name, value)
        else:
            monkeypatch.delenv(name, raising=False)
    err, passed = io.StringIO(), []
    kept = warnings.showwarning
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(err):
            warnings.simplefilter("always")
            warnings.showwarning = lambda message, category, *args, **kwargs: passed.append(category)
            _slow_precision_in_one_line(quiet=False).release()
            warn("the schedule's warmup is longer than the run")
            warn("its data read again gave another first batch", RankWarning)
            warnings.warn("a plain warning", UserWarning)  # (not ampguard's: Python's, on every rank)
    finally:
        warnings.showwarning = kept
    lines = err.getvalue().splitlines()
    assert ("ampguard: warning: the schedule's warmup is longer than the run" in lines) is shown
    label = f"rank {rank}: " if world == "2" and launched else ""
    assert f"ampguard: warning: {label}its data read again gave another first batch" in lines
    assert passed == [UserWarning]  # (handed on to Python's own, whatever the rank)


# ---------------------------------------------------------------------------- train


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One tiny charlm ``train`` (3 steps), shared by the tests that read what it wrote."""
    root = tmp_path_factory.mktemp("tiny")
    # (log.plot false: no test here reads report.png, and the plot costs the run a second of matplotlib)
    sets = ["steps=3", *TINY_CHARLM, f"log.dir={root / 'runs'}", "log.name=t", "log.plot=false"]
    argv = ["train"]
    for item in sets:
        argv += ["--set", item]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue(), root / "runs" / "t", load_config(None, sets)


def test_train_tiny_charlm_end_to_end(tiny_run):
    code, out, err, run_dir, expected = tiny_run
    assert code == 0, err
    header, rows = read_csv(run_dir / "steps.csv")
    assert header == HEADER + ",val_loss"  # the fixed eight, then the task's held-out metric
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    assert [r["val_loss"] != "" for r in rows] == [False, False, True]  # evaluated at the last step
    assert all(r["skipped"] == "0" and math.isfinite(number(r["loss"])) for r in rows)
    saved = validate(yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8")))
    assert saved == expected
    assert saved.steps == 3 and saved.task.n_embd == 16 and saved.task.name == "charlm"
    assert number(rows[0]["lr"]) == pytest.approx(expected.optimizer.lr)  # lr is the one the step used
    assert re.search(r"\bsteps=3\b", summary(out))


def test_train_lr_reaches_documented_floor_at_last_step(tiny_run):
    code, _, err, run_dir, config = tiny_run
    assert code == 0, err
    assert config.schedule.decay != "constant" and config.schedule.warmup == 0
    _, rows = read_csv(run_dir / "steps.csv")
    assert number(rows[-1]["lr"]) == pytest.approx(config.optimizer.lr * config.schedule.min_lr_ratio)


# ---------------------------------------------------------------------------- bad input: exit 2

# (name, config file to write or None, argv, text the one stderr line must contain)
BAD_INPUTS = [
    ("unknown key", ("c.yaml", "optimizer:\n  lrr: 0.1\n"), ["train", "c.yaml"], "optimizer.lrr"),
    ("unknown top key", ("c.yaml", "stepz: 3\n"), ["train", "c.yaml"], "stepz"),
    ("wrong type", ("c.yaml", "steps: many\n"), ["train", "c.yaml"], "steps"),
    ("section not a mapping", ("c.yaml", "optimizer: 3\n"), ["train", "c.yaml"], "optimizer"),
    ("max_norm inf", ("c.yaml", "max_norm: .inf\n"), ["train", "c.yaml"], "max_norm"),
    ("accumulation 0", ("c.yaml", "accumulation_steps: 0\n"), ["train", "c.yaml"], "accumulation_steps"),
    ("lr nan", ("c.yaml", "optimizer:\n  lr: .nan\n"), ["train", "c.yaml"], "optimizer.lr"),
    ("lr negative", ("c.yaml", "optimizer:\n  lr: -0.001\n"), ["train", "c.yaml"], "optimizer.lr"),
    ("backoff 1", ("c.yaml", "scaler:\n  backoff_factor: 1.0\n"), ["train", "c.yaml"], "scaler.backoff_factor"),
    ("backoff > 1", ("c.yaml", "scaler:\n  backoff_factor: 2\n"), ["train", "c.yaml"], "scaler.backoff_factor"),
    ("growth 1", ("c.yaml", "scaler:\n  growth_factor: 1.0\n"), ["train", "c.yaml"], "scaler.growth_factor"),
    ("growth < 1", ("c.yaml", "scaler:\n  growth_factor: 0.5\n"), ["train", "c.yaml"], "scaler.growth_factor"),
    ("unknown precision", ("c.yaml", "precision: fp4\n"), ["train", "c.yaml"], "precision"),
    ("bf16 with scaler", ("c.yaml", "precision: bf16\nscaler:\n  enabled: true\n"), ["train", "c.yaml"],
     "scaler.enabled"),
    ("alert_rate > 1", ("c.yaml", "monitor:\n  alert_rate: 2\n"), ["train", "c.yaml"], "monitor.alert_rate"),
    ("heads do not divide", ("c.yaml", "task:\n  n_head: 3\n"), ["train", "c.yaml"], "n_head"),
    ("unparseable yaml", ("c.yaml", "steps: [1, 2\n"), ["train", "c.yaml"], "c.yaml"),
    ("json bad value", ("c.json", '{"optimizer": {"lr": -1}}'), ["train", "c.json"], "optimizer.lr"),
    ("unparseable json", ("c.json", '{"steps": }'), ["train", "c.json"], "c.json"),
    ("toml bad value", ("c.toml", "[scaler]\ngrowth_interval = 0\n"), ["train", "c.toml"], "scaler.growth_interval"),
    ("unparseable toml", ("c.toml", "steps = \n"), ["train", "c.toml"], "c.toml"),
    ("top-level list", ("c.yaml", "- 1\n- 2\n"), ["train", "c.yaml"], "c.yaml"),
    ("unknown extension", ("c.ini", "steps = 3\n"), ["train", "c.ini"], ".ini"),
    ("bad inject in file", ("c.yaml", "inject: ['melt@5']\n"), ["train", "c.yaml"], "melt"),
    ("missing config file", None, ["train", "nope.yaml"], "nope.yaml"),
    ("--set without =", None, ["train", "--set", "steps"], "steps"),
    ("--set on a non-section", None, ["train", "--set", "steps.x=1"], "steps"),
    ("--set under a scalar", None, ["train", "--set", "steps=5", "--set", "steps.x=1"], "steps"),
    ("--set bad value", None, ["train", "--set", "optimizer.lr=-1"], "optimizer.lr"),
    ("unknown verb", None, ["frobnicate"], "frobnicate"),
    ("no verb", None, [], "VERB"),
    ("bad --inject kind", None, ["demo", "--inject", "melt@5"], "melt"),
    ("bad --inject WHEN", None, ["train", "--inject", "inf_grad@0"], "inf_grad@0"),
    ("bad --inject rate", None, ["demo", "--inject", "nan_grad@rate:1.5"], "rate:1.5"),
    ("--inject without WHEN", None, ["demo", "--inject", "spike"], "spike"),
    ("demo --steps 0", None, ["demo", "--steps", "0"], "--steps"),
    ("demo --max-norm nan", None, ["demo", "--max-norm", "nan"], "--max-norm"),
    ("demo --bf16 vs --precision", None, ["demo", "--bf16", "--precision", "fp32"], "--bf16"),
    ("demo --csv in a missing folder", None, ["demo", "--csv", "nowhere/d.csv"],
     "--csv nowhere/d.csv: folder nowhere does not exist"),
    ("a fault after the last step", None,
     ["train", "--set", "task.name=linear", "--set", "steps=5", "--inject", "inf_grad@6"], "'inf_grad@6' never fires"),
    ("demo: every:N past its steps", None, ["demo", "--inject", "nan_grad@every:21"], "never fires: the run has 20 steps"),
    ("nan_input on charlm", None,
     ["train", "--inject", "nan_input@2", "--set", "steps=2", "--set", "task.n_layer=1"], "nan_input"),
]


@pytest.mark.parametrize(("config", "argv", "names"), [case[1:] for case in BAD_INPUTS],
                         ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_exits_2_with_one_line(cli, tmp_path, snapshot, config, argv, names):
    if config is not None:
        (tmp_path / config[0]).write_text(config[1], encoding="utf-8")
    before = snapshot(tmp_path)
    code, out, err = cli(*argv)
    assert code == 2
    assert "Traceback" not in err and "Traceback" not in out
    assert len(err.splitlines()) == 1 and err.endswith("\n"), err
    assert names in err
    assert snapshot(tmp_path) == before  # nothing written


def _single_value_options() -> list[tuple[str, str, str]]:
    """(verb, option, a value its type takes) for every option of every verb that takes one value."""
    from ampguard.cli import build_parser

    found = []
    verbs = next(a for a in build_parser()._actions if a.dest == "verb")
    for verb, parser in verbs.choices.items():
        for action in parser._actions:
            if not action.option_strings or action.nargs == 0 or type(action).__name__ in ("_AppendAction", "_HelpAction"):
                continue
            value = next(v for v in [*(action.choices or []), "1", "0.5", "a.csv"] if _takes(action, v))
            found.append((verb, action.option_strings[-1], value))
    return found


def _takes(action, value: str) -> bool:
    try:
        (action.type or str)(value)
    except Exception:  # noqa: BLE001 - any refusal: not a value for it
        return False
    return True


@pytest.mark.parametrize(("verb", "option", "value"), _single_value_options())
def test_an_option_given_twice_is_refused_naming_it(verb, option, value):
    # argparse keeps the last, unsaid: `demo --csv a.csv --csv b.csv` wrote b.csv alone, two
    # --resume resumed one of them. Every verb's every one-value option (--set and --inject repeat)
    from ampguard.cli import build_parser
    from ampguard.errors import InputError

    positional = {"report": ["r"], "compare": ["a", "b"]}.get(verb, [])
    build_parser().parse_args([verb, *positional, option, value])  # once: taken
    with pytest.raises(InputError, match=rf"^{verb}: argument .*{option}: given twice \(.*, then .*\): give it once$"):
        build_parser().parse_args([verb, *positional, option, value, option, value])


def test_set_and_inject_repeat():
    from ampguard.cli import build_parser

    args = build_parser().parse_args(["train", "--set", "steps=2", "--set", "seed=1", "--inject", "nan_loss@1",
                                      "--inject", "inf_grad@2"])
    assert args.set == ["steps=2", "seed=1"] and args.inject == ["nan_loss@1", "inf_grad@2"]


def test_demo_csv_refuses_existing_file(cli, tmp_path, snapshot):
    (tmp_path / "kept.csv").write_text("precious,data\n1,2\n", encoding="utf-8")
    before = snapshot(tmp_path)
    code, out, err = cli("demo", "--csv", "kept.csv")
    assert code == 2
    assert len(err.splitlines()) == 1 and "kept.csv" in err and "Traceback" not in err
    assert not step_lines(out)  # it did not train
    assert snapshot(tmp_path) == before
    assert (tmp_path / "kept.csv").read_text(encoding="utf-8") == "precious,data\n1,2\n"


def test_demo_csv_refuses_a_link_to_nothing_before_it_trains(cli, tmp_path):
    # it wrote through the link and created the target wherever it pointed
    (tmp_path / "link.csv").symlink_to(tmp_path / "elsewhere" / "made.csv")
    code, out, err = cli("demo", "--steps", "2", "--csv", "link.csv")
    assert (code, out) == (2, "")
    assert err == "ampguard: error: --csv link.csv is a symbolic link to nothing; refusing to write through it\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.csv"]


def test_demo_csv_dash_is_refused_not_written_as_a_file_named_dash(cli, tmp_path):
    # "-" reads as stdout by convention; stdout carries the demo's own lines, so it is refused
    code, out, err = cli("demo", "--steps", "2", "--csv", "-")
    assert (code, out) == (2, "")
    assert err == "ampguard: error: --csv -: the demo prints its lines to stdout; give a file path for the CSV\n"
    assert list(tmp_path.iterdir()) == []


def test_an_fp16_demo_that_never_applies_a_step_fails_fast_at_its_end(cli):
    # six overflows from init_scale 2^10: the scaler's opening search, set aside by the rolling
    # rules, never found a scale; it ended "finished", exit 0, no alert, with fail-fast set
    code, out, _ = cli("demo", "--steps", "6", "--inject", "nan_grad@every:1", "--fail-skip-rate", "0.5",
                       "--fail-after", "2")
    assert code == 3
    assert "ALERT 6 no step applied in the run's 6 steps" in out
    assert "ended: stopped by the guard at the end of the run (step 6): no step applied" in out


@pytest.mark.parametrize("size, line", [
    ("2", "WORLD_SIZE=2 but RANK is not set: launch with torchrun (it sets RANK, MASTER_ADDR, MASTER_PORT), or unset "
          "WORLD_SIZE to train in one process"),
    ("abc", "WORLD_SIZE=abc is not a whole number (torchrun sets it; unset it to train in one process)"),
    ("0", "WORLD_SIZE=0 is below 1 (torchrun sets it to the number of processes; unset it to train in one process)"),
    ("-3", "WORLD_SIZE=-3 is below 1 (torchrun sets it to the number of processes; unset it to train in one process)"),
])
@pytest.mark.parametrize("verb", [["train", "--set", "task.name=linear", "--set", "steps=2"], ["demo", "--steps", "2"]])
def test_a_world_size_left_in_the_environment_is_one_line(cli, tmp_path, monkeypatch, size, line, verb):
    # a leftover export, or a plain `ampguard train` inside a scheduler's allocation: tracebacks;
    # 0 and -3 trained as one process unsaid; the demo printed its set-up line before the refusal
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", size)
    code, out, err = cli(*verb)
    assert (code, out, err) == (2, "", f"ampguard: error: {line}\n")
    assert list(tmp_path.iterdir()) == []


def test_the_demo_judges_a_fault_against_torchruns_processes_before_any_group(cli, tmp_path, monkeypatch):
    # review 34a: under torchrun with 2 processes the demo refused `nan_loss@3@rank1` as aimed past
    # a world of one (it judged the faults before joining the group, as one process); train judges
    # them after joining, against the group's size
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")  # (no group is joined: the refusal comes first)
    code, out, err = cli("demo", "--steps", "6", "--inject", "nan_loss@3@rank2")
    assert (code, out) == (2, ""), err
    assert err.startswith("ampguard: error: inject: fault 'nan_loss@3@rank2' targets rank 2, but this run has 2 "
                          "processes"), err
    assert list(tmp_path.iterdir()) == []


def test_train_refuses_existing_run_folder(cli, tmp_path, snapshot):
    run_dir = tmp_path / "runs" / "X"
    run_dir.mkdir(parents=True)
    (run_dir / "steps.csv").write_text(HEADER + "\n1,0.1,1,1,1,0,,1\n", encoding="utf-8")
    before = snapshot(tmp_path)
    code, out, err = cli("train", "--set", "task.name=linear", "--set", "steps=2", "--set", "log.name=X")
    assert code == 2
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert os.path.join("runs", "X") in err
    assert snapshot(tmp_path) == before  # not clobbered, nothing added


def test_demo_csv_under_a_file_is_bad_input(cli, tmp_path, snapshot):
    (tmp_path / "afile").write_text("x\n", encoding="utf-8")
    before = snapshot(tmp_path)
    try:
        code, out, err = cli("demo", "--steps", "2", "--csv", "afile/steps.csv")
    except Exception as exc:  # noqa: BLE001 - escaping main() is the failure being shown
        pytest.fail(f"main() raised {type(exc).__name__}: {exc}")
    assert code == 2
    assert len(err.splitlines()) == 1 and "afile" in err
    assert snapshot(tmp_path) == before


def test_train_tensorboard_missing_leaves_nothing(cli, tmp_path, snapshot, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # the package hidden (it is installed here)
    before = snapshot(tmp_path)
    code, out, err = cli("train", "--set", "task.name=linear", "--set", "steps=2", "--set", "log.tensorboard=true",
                         "--set", "log.name=tb")
    assert code == 2
    assert err.splitlines() == ["ampguard: error: log.tensorboard is on but the tensorboard package is not "
                                "installed: pip install 'ampguard[tensorboard]'"], err
    assert snapshot(tmp_path) == before


# ---------------------------------------------------------------------------- real processes

TRAIN_FOREVER = ["train", "--set", "task.name=linear", "--set", "steps=100000", "--set", "log.every=1000000",
                 "--set", "log.dir=runs", "--set", "log.name=int", "--set", "log.plot=false"]  # (no plot read)
DEMO_FOREVER = ["demo", "--steps", "100000", "--csv", "long.csv"]


def _count_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """A long ``train`` and a long ``demo``, started together (two real processes), each sent
    SIGINT once its CSV has a few rows. -> {name: (exit code, stdout, stderr, csv path)}"""
    if os.name != "posix":
        pytest.skip("needs POSIX signals")
    runs = {}
    for name, argv, csv_name in (("train", TRAIN_FOREVER, "runs/int/steps.csv"), ("demo", DEMO_FOREVER, "long.csv")):
        cwd = tmp_path_factory.mktemp(name)
        out, err = open(cwd / "stdout.txt", "wb"), open(cwd / "stderr.txt", "wb")
        proc = warm.Popen([sys.executable, "-m", "ampguard", *argv], cwd=cwd, stdout=out, stderr=err)
        runs[name] = (proc, cwd, cwd / csv_name, out, err)
    results = {}
    try:
        deadline = time.monotonic() + 60
        pending = dict(runs)
        while pending and time.monotonic() < deadline:
            for name, (proc, cwd, csv_path, _, _) in list(pending.items()):
                if proc.poll() is not None or _count_lines(csv_path) > 5:  # header + 5 rows
                    if proc.poll() is None:
                        proc.send_signal(signal.SIGINT)
                    del pending[name]
            time.sleep(0.05)
        for name, (proc, cwd, csv_path, _, _) in runs.items():
            results[name] = (proc.wait(timeout=max(1.0, deadline + 30 - time.monotonic())), cwd, csv_path)
    finally:
        for proc, _, _, out, err in runs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
            out.close()
            err.close()
    return {
        name: (code, (cwd / "stdout.txt").read_text(encoding="utf-8"), (cwd / "stderr.txt").read_text(encoding="utf-8"),
               csv_path)
        for name, (code, cwd, csv_path) in results.items()
    }


def _assert_complete_rows(csv_path: Path, err: str, at_least: int) -> list[dict[str, str]]:
    text = csv_path.read_text(encoding="utf-8")
    assert text.endswith("\n")  # the last row is complete
    header, rows = read_csv(csv_path)
    assert header.startswith(HEADER)  # the fixed eight first; a task may add metric columns
    steps = [int(r["step"]) for r in rows]
    assert len(steps) >= at_least
    assert steps == list(range(1, len(steps) + 1))
    for r in rows:
        assert None not in r and None not in r.values()
        assert r["skipped"] in ("0", "1")
        for name in ("lr", "grad_l2_pre_clip", "grad_l2_post_clip", "loss", "scaler_scale"):
            if r["skipped"] == "1" and name.startswith("grad_l2"):
                continue  # may be empty on a skipped row
            number(r[name])
    counted = re.search(r"(\d+) complete rows?", err)
    assert counted, err  # the interrupted run says how many rows it kept
    assert int(counted.group(1)) == len(rows)
    kept = f"{len(rows)} complete row" + ("s" if len(rows) != 1 else "")
    assert f"ampguard: interrupted after step {len(rows)}; {kept} in " in err
    return rows


def test_train_ctrl_c_exits_130_and_keeps_complete_rows(interrupted):
    code, out, err, csv_path = interrupted["train"]
    assert code == 130, err
    assert "Traceback" not in err
    assert os.path.join("runs", "int", "steps.csv") in err  # where the CSV is
    _assert_complete_rows(csv_path, err, at_least=5)


def test_demo_ctrl_c_exits_130_and_keeps_complete_rows(interrupted):
    code, out, err, csv_path = interrupted["demo"]
    assert code == 130, err
    assert "Traceback" not in err
    assert "long.csv" in err
    rows = _assert_complete_rows(csv_path, err, at_least=5)
    # The console printed one line per row written (every step in the demo).
    assert [int(line.split()[1]) for line in step_lines(out)] == [int(r["step"]) for r in rows]


@pytest.fixture(scope="module")
def help_runs():
    """``python -m ampguard --help`` and the ``ampguard`` console script's ``--help``, run together."""
    script = VENV_BIN / "ampguard"
    commands = {"module": [sys.executable, "-m", "ampguard", "--help"]}
    if script.exists():
        commands["script"] = [str(script), "--help"]
    procs = {k: subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k, c in commands.items()}
    results = {}
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=60)
            results[name] = (proc.returncode, out, err)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    return results


@pytest.mark.parametrize("how", ["module", "script"])
def test_help_exits_0(help_runs, how):
    if how not in help_runs:
        pytest.skip(f"no console script next to {sys.executable}")
    code, out, err = help_runs[how]
    assert code == 0, err
    assert "demo" in out and "train" in out
    assert "Traceback" not in err


@pytest.mark.parametrize("verb", ["demo", "train", "report", "bench"])
def test_an_unknown_flag_is_one_line_naming_the_verb(cli, tmp_path, verb):
    # argparse's own "unrecognized arguments" line named no verb, where every other usage error does
    code, out, err = cli(verb, *(["x.csv"] if verb == "report" else []), "--bogus=1")
    assert (code, out) == (2, "")
    assert err == f"ampguard: error: {verb}: unrecognized arguments: --bogus=1\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("more", [[], ["--inject", "none"]])
def test_a_spike_past_a_short_demo_says_to_drop_the_spike(cli, more):
    code, out, err = cli("demo", "--steps", "3", "--spike", *more)
    assert (code, out) == (2, "")
    assert err == ("ampguard: error: demo: --spike is a loss spike at step 5, past the demo's 3 steps: drop --spike, "
                   "or give --steps 5 or more\n")


@pytest.mark.parametrize("every, warned", [(50, True), (10, False)])
def test_a_val_regression_trigger_that_can_never_fire_is_said_at_the_start(cli, tmp_path, every, warned):
    # review_27e: eval.every past the run's steps leaves one evaluation, nothing to compare it with:
    # the trigger was taken and never fired, unsaid (headroom says so of its own unmeasured runs)
    code, out, err = cli("train", "--set", "task.name=linear", "--set", "steps=20", "--set", "log.plot=false",
                         "--set", "rollback.triggers=[val_regression]", "--set", "checkpoint.every=5",
                         "--set", f"eval.every={every}", "--set", f"log.dir={tmp_path / 'runs'}")
    assert code == 0, err
    line = ("ampguard: warning: rollback.triggers: val_regression compares each evaluation with the best before it, "
            "and this run evaluates once (eval.every 50, steps 20): it rolls back only on a non-finite metric")
    assert (line in err.splitlines()) is warned, err


def test_a_scaler_held_at_its_floor_is_still_a_scaler_in_report_and_a_clean_floor_run_is_not_collapsing(cli, tmp_path):
    # review_27f: report inferred "no loss scaler" from a CSV whose scale never left 1 (the config says
    # fp16), and a clean run started at the floor read "collapsing" on its card
    common = ["train", "--set", "task.name=linear", "--set", "steps=8", "--set", "precision=fp16", "--set",
              "scaler.init_scale=1", "--set", "log.plot=false", "--set", f"log.dir={tmp_path / 'runs'}"]
    code, out, err = cli(*common, "--set", "log.name=clean")
    assert code == 0 and "ALERT" not in out, out
    assert "| scale health | stable (final scale 1) |" in (tmp_path / "runs" / "clean" / "RUN.md").read_text()
    code, out, err = cli(*common, "--set", "log.name=skip", "--inject", "inf_grad@5")
    assert code == 0 and "ALERT 5 loss scale 1 is at its floor" in out, out
    code, out, err = cli("report", tmp_path / "runs" / "skip", "--no-plot")  # (the summary is what is read)
    assert code == 0 and "scale collapsing" in out and "no loss scaler" not in out, out
