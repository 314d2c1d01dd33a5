"""A corpus of hostile and careless inputs across every verb: each is refused with ONE line on
stderr (``ampguard: error: ...``) and exit 2, no traceback, no hang, and nothing written or
changed in the folder it ran in (fixture files included). The line must name the case's own
problem (each case carries a regex for it): a case refused for another reason, e.g. a second bad
input in its command line, is no check of the refusal it is named for (review 54d: ``locate
--batch ... --step`` passed with its refusal removed, because its batch did not fit the model).

Each case runs ``ampguard.cli.main`` in-process (fast) under a wall-clock alarm: a case that
hangs fails as a hang instead of blocking the suite. The last test prints the counts
(tried / clean / tracebacks / hangs / wrote files) with ``pytest -s``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import re
import shutil
import signal
import tempfile
import traceback
from collections import Counter
from pathlib import Path

import pytest
import torch

from helpers import snapshot_of

from ampguard.cli import main

HANG_S = 30
LINEAR = ["--set", "task.name=linear", "--set", "precision=fp32"]
TALLY: Counter[str] = Counter()


class _Hang(Exception):
    pass


class _RunsCode:
    """A pickle that would create a file if it were ever unpickled with code allowed."""

    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def _files(folder: Path) -> None:
    """The fixture files every case may name, written into the case's own folder."""
    (folder / "existing.csv").write_text("keep me\n", encoding="utf-8")
    (folder / "bomb.yaml").write_text(
        'a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
        + "".join(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]\n" for i in range(1, 9)), encoding="utf-8")
    (folder / "recursive.yaml").write_text("a: &a [*a]\n", encoding="utf-8")
    (folder / "date.yaml").write_text("steps: 2020-01-01\n", encoding="utf-8")
    (folder / "binary.yaml").write_text("task:\n  name: !!binary aGVsbG8=\n", encoding="utf-8")
    (folder / "deep.json").write_text("[" * 200_000 + "]" * 200_000, encoding="utf-8")
    (folder / "date.toml").write_text("steps = 1979-05-27\n", encoding="utf-8")
    (folder / "list.yaml").write_text("- 1\n- 2\n", encoding="utf-8")
    (folder / "syntax.yaml").write_text("steps: [1, 2\n", encoding="utf-8")
    (folder / "syntax.json").write_text('{"steps": }', encoding="utf-8")
    (folder / "latin1.yaml").write_bytes(b"steps: 3 # caf\xe9\n")
    (folder / "config.txt").write_text("steps: 3\n", encoding="utf-8")
    (folder / "huge.yaml").write_text("# " + "x" * (1 << 20) + "\n", encoding="utf-8")
    (folder / "unknown_key.yaml").write_text("stepz: 3\n", encoding="utf-8")
    (folder / "twice.yaml").write_text("optimizer:\n  lr: 0.1\nsteps: 3\noptimizer:\n  weight_decay: 0.0\n",
                                       encoding="utf-8")
    (folder / "twice.json").write_text('{"steps": 3, "steps": 4}', encoding="utf-8")
    (folder / "inject_int.yaml").write_text("steps: 3\ntask: {name: linear}\ninject: 5\n", encoding="utf-8")
    (folder / "inject_str.yaml").write_text("steps: 3\ntask: {name: linear}\ninject: nan_loss@2\n", encoding="utf-8")
    (folder / "monitor_null.yaml").write_text("steps: 3\ntask: {name: linear}\nmonitor:\n", encoding="utf-8")
    (folder / "monitor_int.yaml").write_text("steps: 3\ntask: {name: linear}\nmonitor: 5\n", encoding="utf-8")
    (folder / "junk.pt").write_bytes(b"not a checkpoint at all")
    (folder / "empty.pt").write_bytes(b"")
    with (folder / "code.pt").open("wb") as f:
        pickle.dump({"magic": _RunsCode()}, f)
    torch.save({"inputs": torch.randn(4, 3), "targets": torch.randn(4, 2)}, folder / "wrong_shape.pt")
    torch.save({"inputs": torch.randn(4, 16), "targets": torch.randn(4, 4)}, folder / "fits.pt")  # (task linear's)
    torch.save({"x": torch.randn(4, 16)}, folder / "not_a_batch.pt")
    torch.save({"model": {}}, folder / "foreign.pt")
    (folder / "bad_header.csv").write_text("a,b,c\n1,2,3\n", encoding="utf-8")
    (folder / "empty.csv").write_text("", encoding="utf-8")
    header = "step,lr,grad_l2_pre_clip,grad_l2_post_clip,loss,skipped,skip_reason,scaler_scale\n"
    (folder / "good.csv").write_text(header + "1,0.1,1.0,1.0,0.5,0,,1.0\n2,0.1,1.0,1.0,0.4,0,,1.0\n", encoding="utf-8")
    (folder / "bad_rows.csv").write_text(header + "1,0.1,1.0,1.0,0.5,maybe,,1.0\n", encoding="utf-8")
    (folder / "no_run").mkdir()
    (folder / "no_run" / "steps.csv").write_text(header, encoding="utf-8")


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> tuple[Path, dict[str, object]]:
    """A folder with every fixture file and one finished 4-step linear run (no plot: no case reads
    one), given to each case as hard links (:func:`_linked`), and its snapshot."""
    root = tmp_path_factory.mktemp("corpus-template")
    _files(root)
    cwd = Path.cwd()
    os.chdir(root)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            code = main(["train", *LINEAR, "--set", "steps=4", "--set", "checkpoint.every=2", "--set", "log.dir=.", "--set", "log.name=run",
                         "--set", "eval.enabled=false", "--set", "log.plot=false"])
    finally:
        os.chdir(cwd)
    assert code == 0
    truncated = root / "run" / "checkpoints" / "step-00000002.pt"
    shutil.copy(truncated, root / "truncated.pt")
    data = (root / "truncated.pt").read_bytes()
    (root / "truncated.pt").write_bytes(data[: len(data) // 2])
    return root, snapshot_of(root)


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> Path:
    """The folder the cases' folders are made in (pytest's ``tmp_path`` for each case scanned the
    whole base folder, every test's folder so far, for its number: ~4 ms a case late in a suite)."""
    return tmp_path_factory.mktemp("corpus-cases")


def _linked(src: str, dst: str) -> None:
    """``copytree``'s copy of one file: a hard link to the template's (~1 ms a case instead of
    ~18 ms of copying its 1.5 MB). A case that writes a new file, replaces, renames or removes one
    changes only its own folder; one that rewrote a file in place would change the template's
    too: its own snapshot shows the change (the case fails), and each later case checks that its
    folder starts as the template was made."""
    try:
        os.link(src, dst)
    except OSError:  # (another file system: a copy)
        shutil.copy2(src, dst)


def _refuses_overcommit() -> bool:
    """Whether Linux refuses an allocation past its memory (``vm.overcommit_memory`` 0 or 2; with
    1 it lends any, and a model's initialisation then touches it all)."""
    try:
        return Path("/proc/sys/vm/overcommit_memory").read_text().strip() != "1"
    except OSError:
        return False


# (name, argv, a regex the one line must match: the problem the case is named for)
CASES: list[tuple[str, list[str], str]] = [
    # ---- usage, every verb
    ("no verb", [], r"arguments are required: VERB"),
    ("unknown verb", ["nope"], r"invalid choice: 'nope'"),
    ("demo steps 0", ["demo", "--steps", "0"], r"--steps: must be in \[1, .*got 0$"),
    ("demo steps negative", ["demo", "--steps", "-3"], r"--steps: must be in \[1, .*got -3$"),
    ("demo steps text", ["demo", "--steps", "abc"], r"--steps: expected a whole number, got 'abc'"),
    ("demo precision fp8", ["demo", "--precision", "fp8"], r"--precision: invalid choice: 'fp8'"),
    ("demo bf16 vs fp16", ["demo", "--bf16", "--precision", "fp16"], r"--bf16 contradicts --precision fp16"),
    ("demo fault kind", ["demo", "--inject", "bogus@5"], r"unknown fault kind 'bogus'"),
    ("demo fault when empty", ["demo", "--inject", "nan_loss@"], r"fault 'nan_loss@' needs @WHEN"),
    ("demo fault rate > 1", ["demo", "--inject", "nan_loss@rate:2"], r"bad WHEN in fault 'nan_loss@rate:2'"),
    ("demo max-norm text", ["demo", "--max-norm", "abc"], r"--max-norm: expected a number, got 'abc'"),
    ("demo csv exists", ["demo", "--csv", "existing.csv"], r"--csv existing\.csv already exists"),
    ("demo fail rate > 1", ["demo", "--fail-skip-rate", "1.5"],
     r"--fail-skip-rate: must be a rate in \[0, 1\], got 1\.5"),
    ("demo fail-after 0", ["demo", "--fail-after", "0"], r"--fail-after: must be in \[1, .*got 0$"),
    ("demo fail-after without a rate", ["demo", "--fail-after", "3"], r"--fail-after needs a fail rate"),
    ("bench model", ["bench", "--models", "nope"], r"bench: unknown model 'nope'"),
    ("bench precision", ["bench", "--precisions", "fp4"], r"bench: unknown precision 'fp4'"),
    ("bench steps 0", ["bench", "--steps", "0"], r"--steps: must be in \[1, .*got 0$"),
    ("bench rounds past the most a resolve takes", ["bench", "--rounds", "3000", "--budget", "1"],
     r"--rounds 3000 is more than the 1000 rounds"),  # (review 49e)
    # ---- config values through --set
    ("steps 0", ["train", "--set", "steps=0"], r"config: steps: must be >= 1 \(got 0\)"),
    ("steps text", ["train", "--set", "steps=abc"], r"config: steps: expected a number, got the text 'abc'"),
    ("precision fp4", ["train", "--set", "precision=fp4"], r"config: precision: .*\(got 'fp4'\)"),
    ("unknown key", ["train", "--set", "nope=1"], r"config: nope: unknown key"),
    ("lr negative", ["train", "--set", "optimizer.lr=-1"], r"optimizer\.lr: must be a finite number >= 0 \(got -1"),
    ("lr nan", ["train", "--set", "optimizer.lr=.nan"], r"optimizer\.lr: must be a finite number .*\(got nan\)"),
    ("max_norm nan", ["train", "--set", "max_norm=.nan"], r"max_norm: must be a finite number \(got nan\)"),
    ("scaler with bf16", ["train", "--set", "precision=bf16", "--set", "scaler.enabled=true"],
     r"scaler\.enabled: bf16 does not use a loss scaler"),
    ("backoff > 1", ["train", "--set", "scaler.backoff_factor=1.5"],
     r"scaler\.backoff_factor: must be in \(0, 1\) \(got 1\.5\)"),
    ("growth 1", ["train", "--set", "scaler.growth_factor=1"], r"scaler\.growth_factor: must be a finite number > 1 \(got 1"),
    ("init_scale past float32", ["train", "--set", "precision=fp16", "--set", "scaler.init_scale=1e39"],
     r"scaler\.init_scale: must be <= .*the largest float32"),
    ("window 0", ["train", "--set", "monitor.window=0"], r"monitor\.window: must be >= 1 \(got 0\)"),
    ("alert rate 2", ["train", "--set", "monitor.alert_rate=2"], r"monitor\.alert_rate: must be in \[0, 1\] \(got 2"),
    ("task unknown", ["train", "--set", "task.name=mnist"], r"task\.name: .*\(got 'mnist'\)"),
    ("factory file missing", ["train", "--set", "task.factory=nonexistent.py:build"],
     r"task\.factory: no such file nonexistent\.py"),
    ("run name with a slash", ["train", "--set", "log.name=a/b"],
     r"log\.name: must be a plain folder name \(got 'a/b'\)"),
    ("run name 256 chars", ["train", "--set", "log.name=" + "x" * 256], r"log\.name: at most 100 bytes .*\(got 256\)"),
    ("seed negative", ["train", "--set", "seed=-1"], r"seed: must be >= 0 \(got -1\)"),
    ("seed 2**64", ["train", "--set", f"seed={2**64}"], r"seed: must be <= 4294967295 \(got 18446744073709551616\)"),
    ("rollback without checkpoints", ["train", "--set", "rollback.triggers=[loss_spike]"],
     r"rollback\.triggers: rolling back needs checkpoints"),
    ("skip guard without a fail rate", ["train", "--set", "rollback.triggers=[skip_guard]", "--set", "checkpoint.every=5"],
     r"rollback\.triggers: skip_guard needs the guard itself"),
    ("--set without =", ["train", "--set", "steps"], r"--set 'steps': expected key\.sub=value"),
    ("--set empty key part", ["train", "--set", ".a=1"], r"--set '\.a=1': expected key\.sub=value"),
    ("--set a date", ["train", "--set", "steps=2020-01-01"], r"steps: a date is not a config value"),
    ("--set an alias", ["train", "--set", "steps=*a"], r"--set steps: cannot parse value '\*a' \(aliases"),
    ("fault rank beyond the world", ["train", *LINEAR, "--inject", "nan_loss@3@rank3"],
     r"'nan_loss@3@rank3' targets rank 3, but this run has 1 process"),
    ("train fail-after without a rate", ["train", *LINEAR, "--fail-after", "3"], r"--fail-after needs a fail rate"),
    ("nan_input on integer tokens", ["train", "--inject", "nan_input@1"],
     r"nan_input needs a floating-point input tensor; the inputs of task charlm"),
    ("digits batch larger than the data", ["train", "--set", "task.name=digits", "--set", "task.batch_size=2000"],
     r"a batch of 2000 images is larger than the digits training set"),
    # ---- config files
    ("config missing", ["train", "missing.yaml"], r"config file not found: missing\.yaml"),
    ("config unknown format", ["train", "config.txt"], r"config\.txt: unknown format '\.txt'"),
    ("alias bomb", ["train", "bomb.yaml"], r"bomb\.yaml: cannot parse: aliases \(\*name\) are not allowed"),
    ("recursive alias", ["train", "recursive.yaml"],
     r"recursive\.yaml: cannot parse: aliases \(\*name\) are not allowed"),
    ("yaml date", ["train", "date.yaml"], r"steps: a date is not a config value"),
    ("yaml binary", ["train", "binary.yaml"], r"task\.name: a bytes is not a config value"),
    ("200k-deep json", ["train", "deep.json"], r"deep\.json: nested more than 32 levels deep"),
    ("toml date", ["train", "date.toml"], r"steps: a date is not a config value"),
    ("yaml list at the top", ["train", "list.yaml"], r"list\.yaml: the top level must be a mapping, got list"),
    ("yaml syntax", ["train", "syntax.yaml"], r"syntax\.yaml: cannot parse: expected ',' or '\]'"),
    ("json syntax", ["train", "syntax.json"], r"syntax\.json: cannot parse: Expecting value"),
    ("not utf-8", ["train", "latin1.yaml"], r"latin1\.yaml: cannot parse: 'utf-8' codec can't decode"),
    ("over 1 MiB", ["train", "huge.yaml"], r"huge\.yaml: larger than 1024 KiB"),
    ("unknown key in a file", ["train", "unknown_key.yaml"], r"stepz: unknown key \(did you mean steps\?\)"),
    ("print-config of a bad file", ["train", "date.yaml", "--print-config"], r"steps: a date is not a config value"),
    # ---- checkpoints and resume
    ("resume nothing there", ["train", "--resume", "nowhere"],
     r"--resume: no such run folder or checkpoint file: nowhere"),
    ("resume junk", ["train", "--resume", "junk.pt"], r"junk\.pt: unreadable checkpoint"),
    ("resume empty file", ["train", "--resume", "empty.pt"], r"empty\.pt: unreadable checkpoint"),
    ("resume pickled code", ["train", "--resume", "code.pt"], r"code\.pt: refused by the weights-only loader"),
    ("resume foreign .pt", ["train", "--resume", "foreign.pt"], r"foreign\.pt: not an ampguard checkpoint"),
    ("resume truncated", ["train", "--resume", "truncated.pt"], r"truncated\.pt: unreadable checkpoint"),
    ("resume a folder without checkpoints", ["train", "--resume", "no_run"], r"--resume: no_run is not a run folder"),
    ("resume with another precision", ["train", "--resume", "run", "--set", "precision=fp16"],
     r"precision was 'fp32' in .*, now 'fp16'"),
    ("resume with another seed", ["train", "--resume", "run", "--set", "seed=3"], r"seed was 0 in .*, now 3"),
    ("resume below the saved step", ["train", "--resume", "run", "--set", "steps=2"],
     r"is at step 4, the run asks for 2 steps"),
    # ---- validate
    ("validate no precisions", ["validate", *LINEAR, "--set", "validation.precisions=[]"],
     r"validation\.precisions: name at least one AMP precision"),
    ("validate out is a file", ["validate", *LINEAR, "--out", "existing.csv"],
     r"--out existing\.csv is a file, not a folder"),
    ("validate checkpoint junk", ["validate", *LINEAR, "--checkpoint", "junk.pt"], r"junk\.pt: unreadable checkpoint"),
    ("validate checkpoint of another model", ["validate", "--set", "task.name=digits", "--checkpoint",
                                              "run/checkpoints/step-00000004.pt"],
     r"does not fit this model .*checkpoint of task linear, this config's is digits"),
    ("validate accuracy floor on a regression", ["validate", *LINEAR, "--set", "validation.min_accuracy=0.9"],
     r"validation\.min_accuracy applies to classifiers"),
    # ---- locate
    ("locate step beyond steps", ["locate", *LINEAR, "--step", "100000000"],
     r"--step 100000000 is beyond the run's 1000 steps"),
    ("locate scale negative", ["locate", *LINEAR, "--scale", "-1"], r"--scale must be a finite number > 0, got -1"),
    ("locate scale nan", ["locate", *LINEAR, "--scale", "nan"], r"--scale must be a finite number > 0, got nan"),
    ("locate scale on bf16", ["locate", "--set", "task.name=linear", "--set", "precision=bf16", "--scale", "1024"],
     r"--scale: bf16 uses no loss scaler"),
    ("locate batch junk", ["locate", *LINEAR, "--batch", "junk.pt"], r"junk\.pt: unreadable batch"),
    ("locate batch not a batch", ["locate", *LINEAR, "--batch", "not_a_batch.pt"],
     r"not_a_batch\.pt: a batch file holds \{'inputs'"),
    ("locate batch of the wrong shape", ["locate", *LINEAR, "--batch", "wrong_shape.pt"],
     r"batch wrong_shape\.pt does not fit the model of task linear"),
    ("locate nan_input on integer tokens", ["locate", "--inject", "nan_input@1"],
     r"nan_input needs a floating-point input tensor; the inputs of task charlm"),
    ("locate fault beyond the steps", ["locate", *LINEAR, "--set", "steps=4", "--inject", "nan_input@9"],
     r"fault 'nan_input@9' never fires: the run has 4 steps"),  # (49a)
    ("locate checkpoint missing", ["locate", *LINEAR, "--checkpoint", "missing.pt"],
     r"no checkpoint file at missing\.pt"),
    # ---- report
    ("report nothing there", ["report", "nowhere"], r"no per-step CSV at nowhere"),
    ("report bad header", ["report", "bad_header.csv"], r"bad_header\.csv: the header is not ampguard's"),
    ("report empty csv", ["report", "empty.csv"], r"empty\.csv is empty"),
    ("report bad rows", ["report", "bad_rows.csv"], r"bad_rows\.csv line 2: skipped must be 0 or 1, got 'maybe'"),
    ("report out in a missing folder", ["report", "good.csv", "--out", "missing/x.png"],
     r"--out missing/x\.png: folder missing does not exist"),
    ("report out not a png", ["report", "good.csv", "--out", "x.xyz"], r"--out x\.xyz: the plot is a PNG"),
    ("report window 0", ["report", "good.csv", "--window", "0"], r"--window: must be in \[1, .*got 0$"),
    ("report a run folder without rows", ["report", "no_run"], r"no_run/steps\.csv: no steps recorded"),
    # ---- found by fuzzing: an empty path read as "not given", sizes past memory, unchecked flags
    ("train resume an empty path", ["train", "--resume", ""], r"--resume: expected a path, got an empty string"),
    ("train an empty config path", ["train", ""], r"CONFIG: expected a path, got an empty string"),
    ("demo csv an empty path", ["demo", "--csv", ""], r"--csv: expected a path, got an empty string"),
    ("validate checkpoint an empty path", ["validate", *LINEAR, "--checkpoint", ""],
     r"--checkpoint: expected a path, got an empty string"),
    ("validate out an empty path", ["validate", *LINEAR, "--out", ""], r"--out: expected a path, got an empty string"),
    ("locate batch an empty path", ["locate", *LINEAR, "--batch", ""],
     r"--batch: expected a path, got an empty string"),
    ("locate checkpoint an empty path", ["locate", *LINEAR, "--checkpoint", ""],
     r"--checkpoint: expected a path, got an empty string"),
    ("report out an empty path", ["report", "good.csv", "--out", ""], r"--out: expected a path, got an empty string"),
    ("compare an empty path", ["compare", "run", ""], r"RUN_DIR: expected a path, got an empty string"),
    ("log.dir an empty string", ["train", "--set", "log.dir=''"], r"log\.dir: must be a folder, not an empty string"),
    ("task.factory an empty string", ["train", "--set", "task.factory=''"],
     r"task\.factory: must be module:function .*not an empty string"),
    ("monitor window 2**62", ["train", "--set", f"monitor.window={2**62}"],
     r"monitor\.window: must be <= 10000000 \(got 4611686018427387904\)"),
    ("rollback window 10**30", ["train", "--set", f"rollback.window={10**30}"],
     r"rollback\.window: must be <= 10000000 \(got 10{30}\)"),
    ("accumulation_steps 10**30", ["train", "--set", f"accumulation_steps={10**30}"],
     r"accumulation_steps: must be <= 1000000000 \(got 10{30}\)"),
    ("steps 10**30", ["train", "--set", f"steps={10**30}"], r"config: steps: must be <= 1000000000 \(got 10{30}\)"),
    ("run name 400 bytes", ["train", "--set", "log.name=" + "\U0001F600" * 100],
     r"log\.name: at most 100 bytes in UTF-8 \(got 400\)"),
    ("validate train-steps 10**30", ["validate", *LINEAR, "--train-steps", str(10**30)],
     r"--train-steps: must be in \[1, .*got 10{30}$"),
    ("bench threads 2**31", ["bench", "--quick", "--threads", str(2**31)],
     r"--threads: must be in \[1, 4096\], got 2147483648"),
    ("report window 2**62", ["report", "good.csv", "--window", str(2**62)],
     r"--window: must be in \[1, .*got 4611686018427387904"),
    ("report min-steps negative", ["report", "good.csv", "--min-steps", "-5"],
     r"--min-steps: must be in \[0, .*got -5"),
    ("report max-norm nan", ["report", "good.csv", "--max-norm", "nan"],
     r"--max-norm: must be a finite number .*got nan"),
    ("report max-norm inf", ["report", "good.csv", "--max-norm", "inf"],
     r"--max-norm: must be a finite number .*got inf"),
    ("demo csv name over 255 bytes", ["demo", "--csv", "y" * 256 + ".csv"], r"file name too long: y+\.\.\.y+\.csv$"),
    ("report a name over 255 bytes", ["report", "y" * 256], r"file name too long: y+\.\.\.y+$"),
    ("train log.dir name over 255 bytes", ["train", *LINEAR, "--set", "log.dir=" + "y" * 256],
     r"cannot create run folder y{256}/.*File name too long"),
    ("wandb dir a file", ["train", *LINEAR, "--set", "log.wandb.mode=offline", "--set", "log.wandb.dir=existing.csv"],
     r"log\.wandb\.dir: existing\.csv is a file, not a folder"),
    # review 38f: a traceback (exit 1) after the run folder was made; a model the config's sizes allow
    # that cannot be allocated (a traceback from torch's allocator, in train and locate)
    ("wandb dir that cannot be made", ["train", *LINEAR, "--set", "log.wandb.mode=offline",
                                       "--set", "log.wandb.dir=/proc/nope"],
     r"log\.wandb\.dir: /proc/nope cannot be made"),
    # a section the file holds as a scalar, with a flag that fills it (a TypeError in the merge)
    # a key given twice: last-wins dropped the first silently (a second optimizer: reset lr)
    ("yaml section twice", ["train", "twice.yaml", "--print-config"],
     r"twice\.yaml: cannot parse: key 'optimizer' appears twice"),
    ("json key twice", ["train", "twice.json", "--print-config"],
     r"twice\.json: cannot parse: key 'steps' appears twice"),
    ("--set flow mapping with a key twice", ["train", "--set", "optimizer={lr: 1, lr: 2}", "--print-config"],
     r"--set optimizer: cannot parse value .* \(key 'lr' appears twice"),
    ("log.name with a newline", ["train", *LINEAR, "--set", 'log.name="a\\nb"'],
     r"log\.name: must be a plain folder name \(got 'a\\nb'\)"),
    ("a --set key path past 32 levels", ["train", *LINEAR, "--set", "task.options." + ".".join(["k"] * 40) + "=1"],
     r"task\.options(\.k)+: nested more than 32 levels deep"),
    ("a folder as CONFIG", ["train", "no_run"], r"config file no_run is a folder"),
    ("a folder as --checkpoint", ["validate", *LINEAR, "--checkpoint", "no_run"],
     r"no_run is a folder, not a checkpoint file"),
    ("--inject none beside a fault", ["train", *LINEAR, "--inject", "none", "--inject", "nan_loss@2"],
     r"--inject none injects nothing, but --inject nan_loss@2 asks for a fault"),
    ("a rate that never fires", ["train", *LINEAR, "--inject", "nan_loss@rate:0"],
     r"bad WHEN in fault 'nan_loss@rate:0'"),
    # review 54d: a batch that fits the model, so only the --step/--inject refusal can refuse them
    ("locate --batch with --inject", ["locate", *LINEAR, "--batch", "fits.pt", "--inject", "nan_input@1"],
     r"--batch replays the saved batch as it is; --inject does not apply to it"),
    ("locate --batch with --step", ["locate", *LINEAR, "--batch", "fits.pt", "--step", "2"],
     r"--batch replays the saved batch as it is; --step does not apply to it"),
    ("inject a number, --inject", ["train", "inject_int.yaml", "--inject", "nan_loss@2"],
     r"config: inject: .*list \(got '5'\)"),
    ("inject a string, --inject", ["train", "inject_str.yaml", "--inject", "spike@3"],
     r"config: inject: .*list \(got 'nan_loss@2'\)"),
    ("monitor a number, --fail-skip-rate", ["train", "monitor_int.yaml", "--fail-skip-rate", "0.5"],
     r"config: monitor: .*\(got 5\)"),
    ("monitor null, --fail-skip-rate", ["train", "monitor_null.yaml", "--fail-skip-rate", "0.5"],
     r"config: monitor: .*\(got null\)"),
    ("diagnose false, --strict", ["train", *LINEAR, "--set", "diagnose=false", "--strict"],
     r"config: diagnose: .*\(got false\)"),
    ("locate: inject a number, --inject", ["locate", *LINEAR, "--set", "inject=5", "--inject", "nan_loss@1"],
     r"config: inject: .*list \(got '5'\)"),
    # ---- numbers in other scripts' digits or with _ (Python's int() and float() read them)
    ("demo steps in Arabic-Indic digits", ["demo", "--steps", "\u0663"],
     r"--steps: expected a whole number, got '\u0663'"),
    ("demo fault step in fullwidth digits", ["demo", "--inject", "nan_loss@\uff11"],
     r"bad WHEN in fault 'nan_loss@\uff11'"),
    ("demo fault step 1_0", ["demo", "--inject", "nan_loss@1_0"], r"bad WHEN in fault 'nan_loss@1_0'"),
    ("demo max-norm 1_0", ["demo", "--max-norm", "1_0"], r"--max-norm: expected a number, got '1_0'"),
    ("demo seed in Arabic-Indic digits", ["demo", "--seed", "\u0663"],
     r"--seed: expected a whole number, got '\u0663'"),
    # review 38f: a right-to-left override shows the folder's name reversed
    ("log.name with a right-to-left override", ["train", *LINEAR, "--set", "log.name=a\u202eb"],
     r"log\.name: must be a plain folder name \(got 'a\\u202eb'\)"),
    # review 39a: every format character that shows as nothing, not a listed few
    ("log.name with a word joiner", ["train", *LINEAR, "--set", "log.name=a\u2060b"],
     r"log\.name: must be a plain folder name \(got 'a\\u2060b'\)"),
    ("log.name with a tag character", ["train", *LINEAR, "--set", "log.name=a\U000e0041b"],
     r"log\.name: must be a plain folder name \(got 'a\\U000e0041b'\)"),
    ("fast true with optimizer.fused false", ["train", *LINEAR, "--set", "fast=true", "--set", "optimizer.fused=false"],
     r"fast: true runs the fused optimizer.*optimizer\.fused is false"),
    # review 38f: a # that YAML drops (the run trained into runs/exp, or a timestamp folder); a name
    # listed twice (fp32_modules refused it, fp8.exclude and log.wandb.tags took it); a merge key;
    # a tracker switched off, then given a setting
    ("--set value with a YAML comment", ["train", *LINEAR, "--set", "log.name=exp #3"],
     r"--set log\.name: '#3' is a YAML comment there.*log\.name=.exp #3.\)"),
    ("--set value that is all a YAML comment", ["train", *LINEAR, "--set", "log.name=#3"],
     r"--set log\.name: '#3' is a YAML comment there.*log\.name=.#3.\)"),
    ("fp8.exclude with a name twice", ["train", *LINEAR, "--set", "fp8.exclude=[a, a]"],
     r"fp8\.exclude: a listed more than once"),
    ("log.wandb.tags with a tag twice", ["train", *LINEAR, "--set", "log.wandb.tags=[a, a]", "--print-config"],
     r"log\.wandb\.tags: a listed more than once"),
    ("a YAML merge key in --set", ["train", *LINEAR, "--set", "optimizer={<<: {lr: 1}}"],
     r"YAML merge keys \(<<\) are not supported"),
    ("a tracker switched off, then its setting", ["train", *LINEAR, "--set", "log.mlflow=false",
                                                  "--set", "log.mlflow.experiment=e"],
     r"log\.mlflow is false \(off\) in the config: turn it on"),
]
if not torch.cuda.is_available() and _refuses_overcommit():  # (else the 256 GB is lent, then touched: killed)
    CASES += [("train a model too big for memory", ["train", "--set", "task.name=digits", "--set", "precision=fp32",
                                                    "--set", "task.n_embd=1000000000"],
               r"task digits: its model does not fit in memory"),
              ("locate a model too big for memory", ["locate", "--set", "task.name=digits", "--set", "precision=fp32",
                                                     "--set", "task.n_embd=1000000000"],
               r"task digits: its model does not fit in memory")]
if not torch.cuda.is_available():
    CASES += [("train on cuda without one", ["train", "--set", "device=cuda"],
               r"device: cuda was asked for but no CUDA device is available"),
              ("demo on cuda without one", ["demo", "--device", "cuda"],
               r"device: cuda was asked for but no CUDA device is available")]


@pytest.mark.parametrize(("argv", "expected"), [(argv, expected) for _, argv, expected in CASES],
                         ids=[name for name, _, _ in CASES])
def test_refused_with_one_line_exit_2_nothing_written(template, cases, monkeypatch, argv, expected):
    root, made = template
    folder = Path(tempfile.mkdtemp(dir=cases)) / "case"
    shutil.copytree(root, folder, copy_function=_linked)
    monkeypatch.chdir(folder)
    before = snapshot_of(folder)
    assert before == made, "an earlier case changed a fixture file in place (the cases share them: _linked)"

    def alarm(signum, frame):
        raise _Hang

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(HANG_S)
    out, err = io.StringIO(), io.StringIO()
    outcome = "clean"
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    except _Hang:
        outcome, code = "hang", None
    except BaseException:  # noqa: BLE001 - a traceback is what this test counts
        outcome, code = "traceback", None
        err.write(traceback.format_exc())
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    lines = err.getvalue().splitlines()
    if outcome == "clean" and "Traceback" in out.getvalue() + err.getvalue():
        outcome = "traceback"
    if outcome == "clean" and snapshot_of(folder) != before:
        outcome = "wrote files"
    if outcome == "clean" and (code != 2 or len(lines) != 1 or not lines[0].startswith("ampguard: error: ")):
        outcome = "not one line, exit 2"
    if outcome == "clean" and not re.search(expected, lines[0]):
        outcome = "refused for another reason"
    TALLY["tried"] += 1
    TALLY[outcome] += 1
    assert not (folder / "PWNED").exists(), "a checkpoint ran code"
    assert outcome == "clean", f"{outcome}: exit {code} (expected /{expected}/)\nstdout:\n{out.getvalue()[-1500:]}\nstderr:\n{err.getvalue()[-3000:]}"


def test_the_corpus_is_large_and_its_cases_are_distinct():
    assert len(CASES) >= 60
    assert len({name for name, _, _ in CASES}) == len(CASES)  # every case named once
    # every case names the line it expects, and no expected text would match any refusal at all
    vague = [name for name, _, expected in CASES if re.search(expected, "ampguard: error: x")]
    assert not vague, f"cases whose expected text matches any one-line error: {vague}"
    argvs = [tuple(argv) for _, argv, _ in CASES]
    twice = sorted({argv for argv in argvs if argvs.count(argv) > 1})
    assert not twice, f"the same command line under two names: {twice}"  # no case counted twice
    if TALLY["tried"]:  # after the cases ran in this session (each case asserts its own outcome)
        print("\ncorpus tally:", json.dumps(dict(TALLY)))
