"""``ampguard bench`` in quick mode: its table, its JSON and its usage errors (the figures
themselves are not asserted)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import warm

from helpers import FullStdout, end_all, gpu_sh_python

from ampguard.cli import main


def test_bench_runs_end_to_end_in_quick_mode(capsys):
    code = main(["bench", "--quick", "--models", "mlp", "--precisions", "fp32,bf16", "--no-peers"])
    out = capsys.readouterr().out
    assert code == 0
    assert "--quick: a smoke test that every contender runs, not a measurement" in out  # (8.5x read as a figure)
    rows = [line for line in out.splitlines() if line.startswith("| tiny-mlp")]
    assert len(rows) == 4  # two contenders x two precisions
    assert {row.split("|")[3].strip() for row in rows} == {"bare loop", "ampguard + csv"}
    bare = [row for row in rows if "bare loop" in row]
    assert all(row.split("|")[6].strip() == "1 (baseline)" for row in bare)  # the ratio is to the bare loop
    guarded = [row.split("|")[6].strip() for row in rows if "ampguard" in row]
    assert all("[" not in ratio and float(ratio) > 0 for ratio in guarded)  # two rounds: no 95% interval
    assert all(row.split("|")[9].strip() == "n/a" for row in rows)  # (review 36b: an n/a the output explains)
    assert "peak MiB: measured on CUDA only (PyTorch keeps no peak of CPU memory, per contender or at all)" in out


def test_bench_json_and_bad_arguments(capsys):
    import json

    assert main(["bench", "--quick", "--models", "mlp", "--precisions", "fp32", "--no-peers", "--json"]) == 0
    out = capsys.readouterr().out
    data = json.loads(out)  # stdout is the JSON alone; the progress lines went to stderr
    assert {r["contender"] for r in data["results"]} == {"bare loop", "ampguard + csv"}
    assert all(r["median_ms"] > 0 and len(r["rounds"]) == 2 for r in data["results"])
    # each round's order (the balanced design: two contenders swap places) and the case's seconds
    assert sorted(r["positions"] for r in data["results"]) == [[0, 1], [1, 0]]
    assert len({r["case_s"] for r in data["results"]}) == 1 and data["results"][0]["case_s"] > 0
    assert main(["bench", "--models", "resnet"]) == 2
    assert main(["bench", "--precisions", "fp4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "resnet" in err and "fp4" in err


def test_bench_json_lists_the_cases_it_did_not_run_and_why(capsys):
    # review (bench): the "not run" lines went to stderr alone; the JSON did not say what was left out
    import json

    assert main(["bench", "--quick", "--models", "mlp,transformer", "--precisions", "fp16", "--no-peers",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {r["workload"] for r in data["results"]} == {"tiny-mlp"}
    assert data["not_run"] == [{"workload": "small-transformer", "precision": "fp16", "contender": None,
                                "why": "on a CPU fp16 runs only the mlp and nano models"}]


def test_bench_refuses_a_negative_resolution_or_budget(capsys):
    assert main(["bench", "--resolve", "-1"]) == 2
    assert main(["bench", "--budget", "nan"]) == 2
    assert main(["bench", "--threads", "0"]) == 2
    err = capsys.readouterr().err
    assert "--resolve must be a finite number >= 0, got -1" in err
    # a resolution that means nothing, or one with no time to reach it (it ran --rounds, then said
    # "not resolved: the time budget ran out" of a case that had every interval within it)
    assert main(["bench", "--resolve", "200"]) == 2
    assert main(["bench", "--budget", "0"]) == 2  # (the default --resolve 1)
    assert main(["bench", "--budget", "0", "--resolve", "0", "--quick", "--models", "mlp", "--precisions", "fp32",
                 "--no-peers", "--no-aa"]) == 0  # exactly --rounds: fine
    err = capsys.readouterr().err.splitlines()
    assert [line for line in err if line.startswith("ampguard: error:")] == [
        "ampguard: error: bench: --resolve is a percentage below 100 (1 is ±1%), got 200",
        "ampguard: error: bench: --budget 0 leaves no time to add rounds until resolved: give --resolve 0 to run "
        "exactly --rounds"]


PAUSE_IN_BENCH = Path(__file__).with_name("pause_in_bench.py")
BENCH_ARGS = ["bench", "--models", "mlp", "--precisions", "fp32", "--no-peers", "--no-aa", "--steps", "3",
              "--warmup", "1", "--rounds", "7", "--resolve", "0", "--json"]


PAUSES = ("round:2", "round:0", "warmup")


@pytest.fixture(scope="module")
def paused_benches(tmp_path_factory):
    """{where: (process, its marker, its stderr file)}: ``ampguard bench BENCH_ARGS`` held by
    ``pause_in_bench.py`` at each ``where``, all started at once so that their torch imports
    overlap; each test signals its own."""
    started = {}
    try:
        for where in PAUSES:
            folder = tmp_path_factory.mktemp(where.replace(":", "-"))
            with open(folder / "err.txt", "w") as err:
                started[where] = (warm.Popen([sys.executable, str(PAUSE_IN_BENCH), str(folder / "paused"), where,
                                              *BENCH_ARGS], stdout=subprocess.PIPE, stderr=err,
                                             stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"}),
                                  folder / "paused", folder / "err.txt")
        yield started
    finally:
        end_all(proc for proc, _, _ in started.values())


def _bench_sigterm_at(paused_benches, where):
    """The bench held at ``where``, sent SIGTERM (what ``timeout`` sends): (exit code, stdout, stderr)."""
    proc, marker, err_path = paused_benches[where]
    deadline = time.monotonic() + 120  # only a hang runs into it
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    if not marker.exists():
        proc.kill()
        pytest.fail(f"bench never paused at {where} (exit {proc.poll()}):\n{err_path.read_text()}")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    return proc.returncode, out.decode(), err_path.read_text()


def test_a_bench_cut_by_a_time_limit_after_two_rounds_prints_them_as_json(paused_benches):
    # `timeout` sends SIGTERM: the whole rounds so far come out as JSON, exit 143 (gpu.sh relies on it)
    import json

    code, out, err = _bench_sigterm_at(paused_benches, "round:2")  # 2 of 7 rounds measured, the third started
    assert code == 143, err
    assert "Traceback" not in err
    results = json.loads(out)["results"]
    assert [r["contender"] for r in results] == ["bare loop", "ampguard + csv"]
    assert {r["stop"] for r in results} == {"interrupted"}
    assert [len(r["rounds"]) for r in results] == [2, 2]  # the cut third round left out
    assert all(r["median_ms"] > 0 and all(t > 0 for t in r["rounds"]) for r in results)
    said = [line for line in err.splitlines() if not line.startswith("ampguard: warning: the 1-minute load")]  # (a busy CI)
    assert said[-1] == "bench: interrupted; the rounds measured so far follow", err


def test_a_bench_cut_by_a_time_limit_inside_its_first_round_says_nothing_was_measured(paused_benches):
    code, out, err = _bench_sigterm_at(paused_benches, "round:0")
    assert code == 143, err
    assert out == "" and "Traceback" not in err
    assert err.splitlines()[-2:] == ["  tiny-mlp fp32: interrupted before a whole round, nothing measured",
                                     "ampguard: interrupted"], err


def test_a_bench_cut_by_a_time_limit_in_its_warm_up_exits_143_with_no_json(paused_benches):
    code, out, err = _bench_sigterm_at(paused_benches, "warmup")
    assert code == 143, err
    assert out == "" and "Traceback" not in err
    assert err.splitlines()[-2:] == ["tiny-mlp fp32: bare loop, ampguard + csv", "ampguard: interrupted"], err


def test_bench_json_carries_the_runs_settings(capsys):
    import json

    assert main(["bench", "--models", "nano", "--precisions", "fp32", "--no-peers", "--no-aa", "--steps", "1",
                 "--rounds", "2", "--warmup", "1", "--resolve", "50", "--budget", "5", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    run = data["run"]
    # (--peak-tflops: carried too, test_bench_review38; with the nano model alone it is refused: no FLOPs counted)
    assert {k: run[k] for k in ("device", "steps", "warmup", "min_rounds", "budget_s", "peak_tflops")} == {
        "device": "cpu", "steps": 1, "warmup": 1, "min_rounds": 2, "budget_s": 5.0, "peak_tflops": None}
    assert (run["confidence"], run["decide_confidence"], run["min_rounds_to_resolve"], run["max_rounds"]) == (
        0.95, 0.99, 8, 1000)
    assert run["interval"].startswith("order statistics") and data["versus"] == []  # (no peers ran)
    assert data["resolve"] == 0.5 and isinstance(data["threads"], int)
    import torch

    from ampguard import __version__  # (review 34b: no version but torch's, the peers' none)
    assert {k: data["versions"][k] for k in ("ampguard", "torch")} == {"ampguard": __version__,
                                                                        "torch": torch.__version__}
    assert {"python", "accelerate", "lightning", "torchao", "ampguard_commit"} <= set(data["versions"])
    guarded = [r for r in data["results"] if r["contender"] == "ampguard + csv"][0]
    ratio, low, high = guarded["ratio_to_bare"], guarded["ratio_low"], guarded["ratio_high"]
    # which of the two ways it ended is the machine's (a loaded one may run out of its 5 s first);
    # each is checked, and one of them ran (review_tests14 #7: both were ifs, a slow box checked none)
    assert guarded["stop"] in ("resolved", "budget"), guarded["stop"]
    rounds = len(guarded["rounds"])
    assert (low is None) == (rounds < 6)  # (no interval below 6 rounds)
    if low is not None:  # (its farther side, relative)
        assert guarded["half_width"] == max(high - ratio, ratio - low) / ratio
    if guarded["stop"] == "resolved":  # (within ±50%, decided on 8 rounds at least)
        assert guarded["half_width"] <= 0.5 and rounds >= 8


@pytest.fixture(scope="module")
def warm_python(tmp_path_factory):
    """gpu.sh's ``PYTHON`` and what it needs (:func:`helpers.gpu_sh_python`)."""
    python, env = gpu_sh_python(tmp_path_factory.mktemp("python"))
    return {**env, "PYTHON": str(python)}


def _gpu_sh(env, tmp_path, python=None):
    root = Path(__file__).resolve().parents[2]
    return subprocess.run(["bash", str(root / "benchmarks" / "gpu.sh")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": sys.executable, **(python or {}), "OUT": str(tmp_path), **env})


def test_gpu_sh_stage_limits_fit_one_device_command(tmp_path):
    # every stage's limit plus its kill grace (and the setup): under a device command's 600 s,
    # for the defaults and for the call the header suggests
    import re

    for env in ({}, {"STAGES": "1 3 4", "MLP_MODELS": "mlp", "MLP_BUDGET": "60", "GPT2_BUDGET": "180"}):
        done = _gpu_sh({"PLAN_ONLY": "1", "DEVICE": "cuda", **env}, tmp_path)
        assert done.returncode == 0, done.stderr
        worst = int(re.search(r"worst case (\d+) s", done.stdout).group(1))
        assert worst <= 580, done.stdout
        assert re.findall(r" (\w+): \d+\+(\d+)", done.stdout) and all(
            int(grace) >= 10 for _, grace in re.findall(r" (\w+): \d+\+(\d+)", done.stdout))


def test_gpu_sh_summary_takes_a_case_with_no_bare_loop(tmp_path, warm_python):
    # no stage runs; the summary reads a bench JSON whose contenders had no bare loop (ratio null)
    import json

    rows = [{"workload": "tiny-mlp", "precision": "bf16", "contender": "lightning fabric", "median_ms": 0.5,
             "ratio_to_bare": None, "ratio_low": None, "ratio_high": None, "mfu": None, "ops": 40,
             "rounds": [0.5, 0.5], "stop": "fixed"}]
    (tmp_path / "bench-mlp.json").write_text(json.dumps({"machine": "test", "run": {"steps": 3}, "results": rows}))
    done = _gpu_sh({"STAGES": "none", "DEVICE": "cpu"}, tmp_path, warm_python)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "lightning fabric" in done.stdout and "2 rounds (fixed)" in done.stdout, done.stdout
    assert "Traceback" not in done.stdout + done.stderr


def test_gpu_sh_says_how_each_stage_ended_keeps_the_last_json_and_exits_1_on_a_failure(tmp_path, warm_python):
    # a bench that is refused (a model no bench knows: refused on any machine) was summed up as
    # "ran out of time", its empty output had replaced the last good JSON, and the script exited 0
    (tmp_path / "bench-mlp.json").write_text('{"machine": "an earlier run", "run": {}, "results": []}')
    done = _gpu_sh({"STAGES": "3", "DEVICE": "cpu", "MLP_MODELS": "nosuch"}, tmp_path, warm_python)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "stage 3 ended with exit 2 (refused (bad input))" in out and "stages: 3=2" in out, out
    assert "stage 3 wrote no JSON" in out and "bench-mlp.json an earlier run" in out, out
    assert not (tmp_path / "bench-mlp.json.tmp").exists()


def test_train_vs_bare_stops_when_a_run_is_cut_short(tmp_path, monkeypatch, capsys):
    # a time limit's SIGTERM inside `ampguard train` (in-process) is a graceful stop: the script
    # must not report the cut-short run as that contender's figure, but stop with its exit code
    import importlib.util
    from pathlib import Path

    import ampguard.train

    spec = importlib.util.spec_from_file_location(
        "train_vs_bare", Path(__file__).resolve().parents[2] / "benchmarks" / "train_vs_bare.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    real_run = ampguard.train.run

    def cut_short(config, **kw):  # the run gets SIGTERM, as `timeout` sends it, at its first STATS line
        print_fn = kw["print_fn"]

        def on_line(line):
            print_fn(line)
            if line.startswith("STATS ") and signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
                signal.raise_signal(signal.SIGTERM)  # (only once the run has its own handler)
        assert config.log.plot is False  # (the script's runs draw no report.png: it would go with their folder)
        return real_run(config, **{**kw, "print_fn": on_line})

    monkeypatch.setattr(ampguard.train, "run", cut_short)
    monkeypatch.setattr(sys, "argv", ["train_vs_bare.py", "--quick", "--device", "cpu", "--eager",
                                      "--out", str(tmp_path)])
    assert script.main() == 143
    captured = capsys.readouterr()
    assert "ampguard train: the run did not finish (interrupted" in captured.err
    assert "  ampguard train " not in captured.out  # not reported
    assert not list(tmp_path.glob("*.json"))


def test_bench_help_says_what_rounds_does(capsys):

    with pytest.raises(SystemExit) as done:
        main(["bench", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    # (review 26 #3: both said the 95% interval decides; the rule decides on the 99% one, from 8
    # rounds, at the end of a whole cycle of the orders; and fixed rounds run whole cycles)
    assert ("--rounds ROUNDS the least number of paired rounds a case runs (default 7); more are added until every "
            "ratio is resolved as --resolve says or --budget runs out (--resolve 0: this many); rounded up to whole "
            "cycles of the round orders (with --resolve, down where that would pass 1000)") in text
    assert ("--resolve PCT add rounds until every ratio's 99% interval (which holds the 95% one reported) is within "
            "±PCT%, judged at the end of each whole cycle of the round orders from 8 rounds on (0: just --rounds, in "
            "whole cycles)") in text
    assert "95% interval is within" not in text and "95% interval is as narrow" not in text


def test_lightnings_precision_banner_stays_out_of_the_bench_output(capfd, caplog):
    # "Using bfloat16 Automatic Mixed Precision (AMP)" came between the header and the table
    import importlib.util
    import logging


    if importlib.util.find_spec("lightning") is None:
        pytest.skip("lightning is not installed")
    caplog.set_level(logging.INFO)
    assert main(["bench", "--quick", "--models", "mlp", "--precisions", "bf16", "--no-aa"]) == 0
    out, err = capfd.readouterr()
    assert "| tiny-mlp | bf16 | lightning fabric |" in out  # the Fabric contender was built and ran
    assert "Automatic Mixed Precision" not in out + err + caplog.text
    fabric = logging.getLogger("lightning.fabric")
    assert fabric.isEnabledFor(logging.INFO)  # held back only while bench built the contender


def test_bench_refuses_a_resolution_finer_than_any_timing(capsys):
    # review 34b: --resolve 1e-323 divided by 100 was 0.0: the header said "fixed rounds", the JSON
    # "resolve": 0.0, and the rounds stopped on the budget, "not resolved to ±0%"
    assert main(["bench", "--resolve", "1e-323"]) == 2
    assert capsys.readouterr().err.strip() == ("ampguard: error: bench: --resolve 1e-323 is finer than any timing "
                                               "resolves (at least 0.001, or 0 for fixed rounds)")


_Full = FullStdout  # (a stdout on a full disk)


@pytest.mark.parametrize("stdout", [_Full, None], ids=["full-disk", "closed"])
def test_bench_json_that_stdout_could_not_take_is_no_success(capsys, monkeypatch, stdout):
    # review 34b: `bench --json > out.json` on a full disk exited 0 with an empty file; a closed
    # stdout (`>&-`) was a traceback (every verb: `TolerantStream` wrapped None)
    quick = ["--quick", "--models", "nano", "--precisions", "fp32", "--no-peers", "--no-aa"]
    monkeypatch.setattr(sys, "stdout", stdout() if stdout else None)
    assert main(["bench", *quick, "--json"]) == 74
    assert capsys.readouterr().err.splitlines()[-1] == (
        "ampguard: error: bench: the --json result could not be written to stdout ("
        + ("No space left on device)" if stdout else "stdout is closed)"))
    # (review 38b #5: the table is the bench's product too: it exited 0 having printed nothing)
    assert main(["bench", *quick]) == 74
    assert capsys.readouterr().err.splitlines()[-1] == (
        "ampguard: error: bench: the table could not be written to stdout ("
        + ("No space left on device)" if stdout else "stdout is closed)"))
    assert main(["demo", "--steps", "2"]) == 0


def test_a_batch_too_large_for_memory_is_a_case_not_run_not_a_traceback(capsys):
    # review 34b: --batch 1000000000 on the transformer ended in the allocator's traceback, exit 1
    assert main(["bench", "--quick", "--models", "transformer", "--precisions", "fp32", "--no-peers",
                 "--batch", "1000000000"]) == 2
    out, err = capsys.readouterr()
    assert "transformer: not run (its data could not be made: RuntimeError: " in out + err
    assert err.splitlines()[-1] == ("ampguard: error: bench: no contender could run transformer in fp32 on cpu (why: "
                                    "the lines above)") and "Traceback" not in err
