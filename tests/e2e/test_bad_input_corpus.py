"""A corpus of hostile and careless inputs across every verb: each is refused with ONE line on
stderr (``ampguard: error: ...``) and exit 2, no traceback, no hang, and nothing written or
changed in the folder it ran in (fixture files included).

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
import shutil
import signal
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
def template(tmp_path_factory) -> Path:
    """A folder with every fixture file and one finished 4-step linear run, copied for each case."""
    root = tmp_path_factory.mktemp("corpus-template")
    _files(root)
    cwd = Path.cwd()
    os.chdir(root)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            code = main(["train", *LINEAR, "--set", "steps=4", "--set", "checkpoint.every=2", "--set", "log.dir=.", "--set", "log.name=run",
                         "--set", "eval.enabled=false"])
    finally:
        os.chdir(cwd)
    assert code == 0
    truncated = root / "run" / "checkpoints" / "step-00000002.pt"
    shutil.copy(truncated, root / "truncated.pt")
    data = (root / "truncated.pt").read_bytes()
    (root / "truncated.pt").write_bytes(data[: len(data) // 2])
    return root


def _refuses_overcommit() -> bool:
    """Whether Linux refuses an allocation past its memory (``vm.overcommit_memory`` 0 or 2; with
    1 it lends any, and a model's initialisation then touches it all)."""
    try:
        return Path("/proc/sys/vm/overcommit_memory").read_text().strip() != "1"
    except OSError:
        return False


CASES: list[tuple[str, list[str]]] = [
    # ---- usage, every verb
    ("no verb", []),
    ("unknown verb", ["nope"]),
    ("demo steps 0", ["demo", "--steps", "0"]),
    ("demo steps negative", ["demo", "--steps", "-3"]),
    ("demo steps text", ["demo", "--steps", "abc"]),
    ("demo precision fp8", ["demo", "--precision", "fp8"]),
    ("demo bf16 vs fp16", ["demo", "--bf16", "--precision", "fp16"]),
    ("demo fault kind", ["demo", "--inject", "bogus@5"]),
    ("demo fault when empty", ["demo", "--inject", "nan_loss@"]),
    ("demo fault rate > 1", ["demo", "--inject", "nan_loss@rate:2"]),
    ("demo max-norm text", ["demo", "--max-norm", "abc"]),
    ("demo csv exists", ["demo", "--csv", "existing.csv"]),
    ("demo fail rate > 1", ["demo", "--fail-skip-rate", "1.5"]),
    ("demo fail-after 0", ["demo", "--fail-after", "0"]),
    ("demo fail-after without a rate", ["demo", "--fail-after", "3"]),
    ("bench model", ["bench", "--models", "nope"]),
    ("bench precision", ["bench", "--precisions", "fp4"]),
    ("bench steps 0", ["bench", "--steps", "0"]),
    ("bench rounds past the most a resolve takes", ["bench", "--rounds", "3000", "--budget", "1"]),  # (review 49e)
    # ---- config values through --set
    ("steps 0", ["train", "--set", "steps=0"]),
    ("steps text", ["train", "--set", "steps=abc"]),
    ("precision fp4", ["train", "--set", "precision=fp4"]),
    ("unknown key", ["train", "--set", "nope=1"]),
    ("lr negative", ["train", "--set", "optimizer.lr=-1"]),
    ("lr nan", ["train", "--set", "optimizer.lr=.nan"]),
    ("max_norm nan", ["train", "--set", "max_norm=.nan"]),
    ("scaler with bf16", ["train", "--set", "precision=bf16", "--set", "scaler.enabled=true"]),
    ("backoff > 1", ["train", "--set", "scaler.backoff_factor=1.5"]),
    ("growth 1", ["train", "--set", "scaler.growth_factor=1"]),
    ("init_scale past float32", ["train", "--set", "precision=fp16", "--set", "scaler.init_scale=1e39"]),
    ("window 0", ["train", "--set", "monitor.window=0"]),
    ("alert rate 2", ["train", "--set", "monitor.alert_rate=2"]),
    ("task unknown", ["train", "--set", "task.name=mnist"]),
    ("factory file missing", ["train", "--set", "task.factory=nonexistent.py:build"]),
    ("run name with a slash", ["train", "--set", "log.name=a/b"]),
    ("run name 256 chars", ["train", "--set", "log.name=" + "x" * 256]),
    ("seed negative", ["train", "--set", "seed=-1"]),
    ("seed 2**64", ["train", "--set", f"seed={2**64}"]),
    ("rollback without checkpoints", ["train", "--set", "rollback.triggers=[loss_spike]"]),
    ("skip guard without a fail rate", ["train", "--set", "rollback.triggers=[skip_guard]", "--set", "checkpoint.every=5"]),
    ("--set without =", ["train", "--set", "steps"]),
    ("--set empty key part", ["train", "--set", ".a=1"]),
    ("--set a date", ["train", "--set", "steps=2020-01-01"]),
    ("--set an alias", ["train", "--set", "steps=*a"]),
    ("fault rank beyond the world", ["train", *LINEAR, "--inject", "nan_loss@3@rank3"]),
    ("train fail-after without a rate", ["train", *LINEAR, "--fail-after", "3"]),
    ("nan_input on integer tokens", ["train", "--inject", "nan_input@1"]),
    ("digits batch larger than the data", ["train", "--set", "task.name=digits", "--set", "task.batch_size=2000"]),
    # ---- config files
    ("config missing", ["train", "missing.yaml"]),
    ("config unknown format", ["train", "config.txt"]),
    ("alias bomb", ["train", "bomb.yaml"]),
    ("recursive alias", ["train", "recursive.yaml"]),
    ("yaml date", ["train", "date.yaml"]),
    ("yaml binary", ["train", "binary.yaml"]),
    ("200k-deep json", ["train", "deep.json"]),
    ("toml date", ["train", "date.toml"]),
    ("yaml list at the top", ["train", "list.yaml"]),
    ("yaml syntax", ["train", "syntax.yaml"]),
    ("json syntax", ["train", "syntax.json"]),
    ("not utf-8", ["train", "latin1.yaml"]),
    ("over 1 MiB", ["train", "huge.yaml"]),
    ("unknown key in a file", ["train", "unknown_key.yaml"]),
    ("print-config of a bad file", ["train", "date.yaml", "--print-config"]),
    # ---- checkpoints and resume
    ("resume nothing there", ["train", "--resume", "nowhere"]),
    ("resume junk", ["train", "--resume", "junk.pt"]),
    ("resume empty file", ["train", "--resume", "empty.pt"]),
    ("resume pickled code", ["train", "--resume", "code.pt"]),
    ("resume foreign .pt", ["train", "--resume", "foreign.pt"]),
    ("resume truncated", ["train", "--resume", "truncated.pt"]),
    ("resume a folder without checkpoints", ["train", "--resume", "no_run"]),
    ("resume with another precision", ["train", "--resume", "run", "--set", "precision=fp16"]),
    ("resume with another seed", ["train", "--resume", "run", "--set", "seed=3"]),
    ("resume below the saved step", ["train", "--resume", "run", "--set", "steps=2"]),
    # ---- validate
    ("validate no precisions", ["validate", *LINEAR, "--set", "validation.precisions=[]"]),
    ("validate out is a file", ["validate", *LINEAR, "--out", "existing.csv"]),
    ("validate checkpoint junk", ["validate", *LINEAR, "--checkpoint", "junk.pt"]),
    ("validate checkpoint of another model", ["validate", "--set", "task.name=digits", "--checkpoint",
                                              "run/checkpoints/step-00000004.pt"]),
    ("validate accuracy floor on a regression", ["validate", *LINEAR, "--set", "validation.min_accuracy=0.9"]),
    # ---- locate
    ("locate step beyond steps", ["locate", *LINEAR, "--step", "100000000"]),
    ("locate scale negative", ["locate", *LINEAR, "--scale", "-1"]),
    ("locate scale nan", ["locate", *LINEAR, "--scale", "nan"]),
    ("locate scale on bf16", ["locate", "--set", "task.name=linear", "--set", "precision=bf16", "--scale", "1024"]),
    ("locate batch junk", ["locate", *LINEAR, "--batch", "junk.pt"]),
    ("locate batch not a batch", ["locate", *LINEAR, "--batch", "not_a_batch.pt"]),
    ("locate batch of the wrong shape", ["locate", *LINEAR, "--batch", "wrong_shape.pt"]),
    ("locate nan_input on integer tokens", ["locate", "--inject", "nan_input@1"]),
    ("locate fault beyond the steps", ["locate", *LINEAR, "--set", "steps=4", "--inject", "nan_input@9"]),  # (49a)
    ("locate checkpoint missing", ["locate", *LINEAR, "--checkpoint", "missing.pt"]),
    # ---- report
    ("report nothing there", ["report", "nowhere"]),
    ("report bad header", ["report", "bad_header.csv"]),
    ("report empty csv", ["report", "empty.csv"]),
    ("report bad rows", ["report", "bad_rows.csv"]),
    ("report out in a missing folder", ["report", "good.csv", "--out", "missing/x.png"]),
    ("report out not a png", ["report", "good.csv", "--out", "x.xyz"]),
    ("report window 0", ["report", "good.csv", "--window", "0"]),
    ("report a run folder without rows", ["report", "no_run"]),
    # ---- found by fuzzing: an empty path read as "not given", sizes past memory, unchecked flags
    ("train resume an empty path", ["train", "--resume", ""]),
    ("train an empty config path", ["train", ""]),
    ("demo csv an empty path", ["demo", "--csv", ""]),
    ("validate checkpoint an empty path", ["validate", *LINEAR, "--checkpoint", ""]),
    ("validate out an empty path", ["validate", *LINEAR, "--out", ""]),
    ("locate batch an empty path", ["locate", *LINEAR, "--batch", ""]),
    ("locate checkpoint an empty path", ["locate", *LINEAR, "--checkpoint", ""]),
    ("report out an empty path", ["report", "good.csv", "--out", ""]),
    ("compare an empty path", ["compare", "run", ""]),
    ("log.dir an empty string", ["train", "--set", "log.dir=''"]),
    ("task.factory an empty string", ["train", "--set", "task.factory=''"]),
    ("monitor window 2**62", ["train", "--set", f"monitor.window={2**62}"]),
    ("rollback window 10**30", ["train", "--set", f"rollback.window={10**30}"]),
    ("accumulation_steps 10**30", ["train", "--set", f"accumulation_steps={10**30}"]),
    ("steps 10**30", ["train", "--set", f"steps={10**30}"]),
    ("run name 400 bytes", ["train", "--set", "log.name=" + "\U0001F600" * 100]),
    ("validate train-steps 10**30", ["validate", *LINEAR, "--train-steps", str(10**30)]),
    ("bench threads 2**31", ["bench", "--quick", "--threads", str(2**31)]),
    ("report window 2**62", ["report", "good.csv", "--window", str(2**62)]),
    ("report min-steps negative", ["report", "good.csv", "--min-steps", "-5"]),
    ("report max-norm nan", ["report", "good.csv", "--max-norm", "nan"]),
    ("report max-norm inf", ["report", "good.csv", "--max-norm", "inf"]),
    ("demo csv name over 255 bytes", ["demo", "--csv", "y" * 256 + ".csv"]),
    ("report a name over 255 bytes", ["report", "y" * 256]),
    ("train log.dir name over 255 bytes", ["train", "--set", "log.dir=" + "y" * 256]),
    ("wandb dir a file", ["train", *LINEAR, "--set", "log.wandb.mode=offline", "--set", "log.wandb.dir=existing.csv"]),
    # review 38f: a traceback (exit 1) after the run folder was made; a model the config's sizes allow
    # that cannot be allocated (a traceback from torch's allocator, in train and locate)
    ("wandb dir that cannot be made", ["train", *LINEAR, "--set", "log.wandb.mode=offline",
                                       "--set", "log.wandb.dir=/proc/nope"]),
    # a section the file holds as a scalar, with a flag that fills it (a TypeError in the merge)
    # a key given twice: last-wins dropped the first silently (a second optimizer: reset lr)
    ("yaml section twice", ["train", "twice.yaml", "--print-config"]),
    ("json key twice", ["train", "twice.json", "--print-config"]),
    ("--set flow mapping with a key twice", ["train", "--set", "optimizer={lr: 1, lr: 2}", "--print-config"]),
    ("log.name with a newline", ["train", *LINEAR, "--set", 'log.name="a\\nb"']),
    ("a --set key path past 32 levels", ["train", *LINEAR, "--set", "task.options." + ".".join(["k"] * 40) + "=1"]),
    ("a folder as CONFIG", ["train", "no_run"]),
    ("a folder as --checkpoint", ["validate", *LINEAR, "--checkpoint", "no_run"]),
    ("--inject none beside a fault", ["train", *LINEAR, "--inject", "none", "--inject", "nan_loss@2"]),
    ("a rate that never fires", ["train", *LINEAR, "--inject", "nan_loss@rate:0"]),
    ("locate --batch with --inject", ["locate", *LINEAR, "--batch", "wrong_shape.pt", "--inject", "nan_input@1"]),
    ("locate --batch with --step", ["locate", *LINEAR, "--batch", "wrong_shape.pt", "--step", "2"]),
    ("inject a number, --inject", ["train", "inject_int.yaml", "--inject", "nan_loss@2"]),
    ("inject a string, --inject", ["train", "inject_str.yaml", "--inject", "spike@3"]),
    ("monitor a number, --fail-skip-rate", ["train", "monitor_int.yaml", "--fail-skip-rate", "0.5"]),
    ("monitor null, --fail-skip-rate", ["train", "monitor_null.yaml", "--fail-skip-rate", "0.5"]),
    ("diagnose false, --strict", ["train", *LINEAR, "--set", "diagnose=false", "--strict"]),
    ("locate: inject a number, --inject", ["locate", *LINEAR, "--set", "inject=5", "--inject", "nan_loss@1"]),
    # ---- numbers in other scripts' digits or with _ (Python's int() and float() read them)
    ("demo steps in Arabic-Indic digits", ["demo", "--steps", "\u0663"]),
    ("demo fault step in fullwidth digits", ["demo", "--inject", "nan_loss@\uff11"]),
    ("demo fault step 1_0", ["demo", "--inject", "nan_loss@1_0"]),
    ("demo max-norm 1_0", ["demo", "--max-norm", "1_0"]),
    ("demo seed in Arabic-Indic digits", ["demo", "--seed", "\u0663"]),
    # review 38f: a right-to-left override shows the folder's name reversed
    ("log.name with a right-to-left override", ["train", *LINEAR, "--set", "log.name=a\u202eb"]),
    # review 39a: every format character that shows as nothing, not a listed few
    ("log.name with a word joiner", ["train", *LINEAR, "--set", "log.name=a\u2060b"]),
    ("log.name with a tag character", ["train", *LINEAR, "--set", "log.name=a\U000e0041b"]),
    ("fast true with optimizer.fused false", ["train", *LINEAR, "--set", "fast=true", "--set", "optimizer.fused=false"]),
    # review 38f: a # that YAML drops (the run trained into runs/exp, or a timestamp folder); a name
    # listed twice (fp32_modules refused it, fp8.exclude and log.wandb.tags took it); a merge key;
    # a tracker switched off, then given a setting
    ("--set value with a YAML comment", ["train", *LINEAR, "--set", "log.name=exp #3"]),
    ("--set value that is all a YAML comment", ["train", *LINEAR, "--set", "log.name=#3"]),
    ("fp8.exclude with a name twice", ["train", *LINEAR, "--set", "fp8.exclude=[a, a]"]),
    ("log.wandb.tags with a tag twice", ["train", *LINEAR, "--set", "log.wandb.tags=[a, a]", "--print-config"]),
    ("a YAML merge key in --set", ["train", *LINEAR, "--set", "optimizer={<<: {lr: 1}}"]),
    ("a tracker switched off, then its setting", ["train", *LINEAR, "--set", "log.mlflow=false",
                                                  "--set", "log.mlflow.experiment=e"]),
]
if not torch.cuda.is_available() and _refuses_overcommit():  # (else the 256 GB is lent, then touched: killed)
    CASES += [("train a model too big for memory", ["train", "--set", "task.name=digits", "--set", "precision=fp32",
                                                    "--set", "task.n_embd=1000000000"]),
              ("locate a model too big for memory", ["locate", "--set", "task.name=digits", "--set", "precision=fp32",
                                                     "--set", "task.n_embd=1000000000"])]
if not torch.cuda.is_available():
    CASES += [("train on cuda without one", ["train", "--set", "device=cuda"]),
              ("demo on cuda without one", ["demo", "--device", "cuda"])]


@pytest.mark.parametrize("argv", [argv for _, argv in CASES], ids=[name for name, _ in CASES])
def test_refused_with_one_line_exit_2_nothing_written(template, tmp_path, monkeypatch, argv):
    folder = tmp_path / "case"
    shutil.copytree(template, folder)
    monkeypatch.chdir(folder)
    before = snapshot_of(folder)

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
    TALLY["tried"] += 1
    TALLY[outcome] += 1
    assert not (folder / "PWNED").exists(), "a checkpoint ran code"
    assert outcome == "clean", f"{outcome}: exit {code}\nstdout:\n{out.getvalue()[-1500:]}\nstderr:\n{err.getvalue()[-3000:]}"


def test_the_corpus_is_large_and_its_cases_are_distinct():
    assert len(CASES) >= 60
    assert len({name for name, _ in CASES}) == len(CASES)  # every case named once
    argvs = [tuple(argv) for _, argv in CASES]
    twice = sorted({argv for argv in argvs if argvs.count(argv) > 1})
    assert not twice, f"the same command line under two names: {twice}"  # no case counted twice
    if TALLY["tried"]:  # after the cases ran in this session (each case asserts its own outcome)
        print("\ncorpus tally:", json.dumps(dict(TALLY)))
