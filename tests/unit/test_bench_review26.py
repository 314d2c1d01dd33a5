"""Review 26 of the benchmark side: ``train_vs_bare.py``'s paired blocks and their verdict,
fixed rounds in whole cycles, quick's overrides before the checks, the machine's load, and the
bench's JSON held whole through a SIGTERM (with ``gpu.sh`` keeping only whole JSON)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import warm
from helpers import gpu_sh_python

from ampguard.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _train_vs_bare():
    spec = importlib.util.spec_from_file_location("train_vs_bare", ROOT / "benchmarks" / "train_vs_bare.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


# ---------------------------------------------------------------- train_vs_bare.py (#1, #2)


def test_the_verdict_is_given_only_when_the_figure_resolves_the_goal():
    script = _train_vs_bare()
    steady = [670e3, 671e3, 669e3, 672e3, 670e3, 671e3]
    met = script.verdict([0.99, 0.995, 0.993, 0.996, 0.994, 0.992], steady)
    assert (met["resolved"], met["goal"], met["unresolved_why"]) == (True, "met", None)
    assert (met["low"], met["high"]) == (0.99, 0.996)  # the least and the most of 6 (order statistics)
    missed = script.verdict([0.95, 0.96, 0.955, 0.958, 0.952, 0.957], steady)
    assert (missed["resolved"], missed["goal"]) == (True, "missed")
    straddles = script.verdict([0.97, 0.99, 0.975, 0.985, 0.98, 0.99], steady)
    assert (straddles["resolved"], straddles["goal"]) == (False, None)
    assert "straddles 0.98" in straddles["unresolved_why"]
    few = script.verdict([0.99, 0.995], steady[:2])
    assert (few["resolved"], few["unresolved_why"]) == (False, "2 blocks give no 95% interval (6 needed)")
    # the bare loop's own runs 8% apart: the machine drifted; a ratio that looks fine is not a verdict
    drifted = script.verdict([0.99, 0.995, 0.993, 0.996, 0.994, 0.992], [670e3, 650e3, 640e3, 630e3, 625e3, 620e3])
    assert (drifted["resolved"], drifted["goal"]) == (False, None)
    assert round(drifted["spread"], 4) == round(670 / 620 - 1, 4) and round(drifted["drift"], 4) == round(620 / 670 - 1, 4)
    assert "more than the goal's 2%" in drifted["unresolved_why"]


def _stub_runs(script, monkeypatch, speeds):
    """``bare`` and ``ampguard`` stubbed (two runs a block): in block k the bare loop reads
    ``speeds[k]`` tokens/s and ampguard train 0.99 of it; the calls' order is kept."""
    calls: list[str] = []

    def bare(args):
        speed = speeds[len(calls) // 2]
        calls.append("bare")
        return {"tokens_per_s": [speed] * 3, "last_interval": None, "mfu": [], "summary": None, "path": ""}

    def ampguard(args, **extra):
        rate = 0.99 * speeds[len(calls) // 2]
        calls.append("ampguard")
        return {"tokens_per_s": [rate] * 2, "last_interval": 0.9 * rate, "mfu": ["40%"] * 2,
                "summary": "x tokens/s", "path": "fast path"}

    monkeypatch.setattr(script, "bare", bare)
    monkeypatch.setattr(script, "ampguard", ampguard)
    return calls


def test_train_vs_bare_alternates_in_paired_blocks_and_flags_a_drifting_bare_loop(monkeypatch, tmp_path, capsys):
    # review 26 #1: the contenders ran one after another, against the mean of two bare runs, with
    # no interval; a drift of -92% between the bare runs was printed and the ratio given anyway
    script = _train_vs_bare()
    calls = _stub_runs(script, monkeypatch, [100.0, 90.0, 80.0, 70.0, 60.0, 50.0])
    monkeypatch.setattr(sys, "argv", ["train_vs_bare.py", "--device", "cpu", "--blocks", "6", "--out", str(tmp_path)])
    assert script.main() == 0
    out = capsys.readouterr().out
    assert calls == ["bare", "ampguard", "ampguard", "bare"] * 3  # balanced: each first in half the blocks
    assert "x0.990 [0.990, 0.990] of the bare loop's tokens/s (median of 6 paired blocks, 95%)" in out
    assert "NOT RESOLVED: the figure cannot tell the goal (within 2%): the bare loop's own runs differ by 100.0%" in out
    data = json.loads((tmp_path / "train-vs-bare-gpt2-small.json").read_text())
    assert (data["resolved"], data["goal"], data["spread"]) == (False, None, 1.0)
    assert "differ by 100.0%" in data["unresolved_why"]
    ours = data["results"]["ampguard train"]
    assert ours["ratios"] == pytest.approx([0.99] * 6) and ours["low"] == pytest.approx(0.99)
    # the last STATS interval kept apart, not in the run's median
    first = data["blocks"][0]["ampguard train"]
    assert first["last_interval"] == pytest.approx(0.9 * 99.0) and first["median"] == pytest.approx(99.0)
    assert [b["bare loop"]["position"] for b in data["blocks"]] == [0, 1] * 3


def test_train_vs_bare_gives_the_goals_verdict_when_the_bare_loop_holds_steady(monkeypatch, tmp_path, capsys):
    script = _train_vs_bare()
    _stub_runs(script, monkeypatch, [100.0, 100.5, 99.8, 100.2, 100.1, 99.9])
    monkeypatch.setattr(sys, "argv", ["train_vs_bare.py", "--device", "cpu", "--blocks", "5", "--out", str(tmp_path)])
    assert script.main() == 0
    out = capsys.readouterr().out
    assert "6 blocks, not 5: whole cycles of the 2 orders" in out  # (rounded up, said so)
    assert "goal (within 2% of the bare loop's tokens/s): met" in out and "NOT RESOLVED" not in out
    data = json.loads((tmp_path / "train-vs-bare-gpt2-small.json").read_text())
    assert (data["resolved"], data["goal"], data["unresolved_why"]) == (True, "met", None)


def test_a_quick_run_is_named_as_one_and_leaves_a_measured_result_alone(monkeypatch, tmp_path, capsys):
    # review 26 #2: --quick (a 2 x 32 model) was headed gpt2-small and overwrote train-vs-bare-gpt2-small.json
    script = _train_vs_bare()
    _stub_runs(script, monkeypatch, [100.0] * 6)
    (tmp_path / "train-vs-bare-gpt2-small.json").write_text('{"measured": true}')
    monkeypatch.setattr(sys, "argv", ["train_vs_bare.py", "--quick", "--device", "cpu", "--out", str(tmp_path)])
    assert script.main() == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header.startswith("train vs bare, quick (2x32): cpu") and "gpt2" not in header
    assert json.loads((tmp_path / "train-vs-bare-gpt2-small.json").read_text()) == {"measured": True}
    assert json.loads((tmp_path / "train-vs-bare-quick.json").read_text())["label"] == "quick (2x32)"


# ---------------------------------------------------------------- ampguard bench (#4, #6, #7)


def test_fixed_rounds_are_whole_cycles_of_the_orders(capsys):
    # review 26 #4: --rounds 8 --resolve 0 with three contenders put the bare loop first 3 times,
    # second twice and third 3 times ([0,2,1,2,0,1,0,2]): a cycle is six orders
    assert main(["bench", "--models", "nano", "--precisions", "fp32", "--steps", "1", "--warmup", "1", "--rounds",
                 "8", "--resolve", "0", "--no-peers", "--json"]) == 0
    captured = capsys.readouterr()
    results = json.loads(captured.out)["results"]
    assert [len(r["rounds"]) for r in results] == [12] * 3
    for r in results:  # every contender in every place alike
        assert sorted(r["positions"]) == [0] * 4 + [1] * 4 + [2] * 4, r
    assert ("nano-mlp fp32: 12 rounds, not 8: fixed rounds run whole cycles of the 6 round orders" in captured.err)


def test_quick_ignores_the_budget_so_a_budget_of_0_is_not_refused(capsys, monkeypatch):
    # review 26 #6: --quick forces --resolve 0 and ignores the budget, yet --budget 0 was refused
    from ampguard import bench_processes

    assert main(["bench", "--quick", "--no-peers", "--budget", "0", "--models", "nano", "--precisions", "fp32"]) == 0
    assert "| nano-mlp | fp32 | ampguard + csv |" in capsys.readouterr().out
    ran = []
    monkeypatch.setattr(bench_processes, "run_across", lambda n, child, **kw: ran.append(child) or 0)
    assert main(["bench", "--quick", "--no-peers", "--budget", "0", "--processes", "2", "--models", "nano"]) == 0
    assert ran and "--quick" in ran[0]
    assert main(["bench", "--budget", "0", "--models", "nano"]) == 2  # (not quick: still refused)


@pytest.mark.parametrize("load, busy", [((99.0, 1.0, 0.5), True), ((0.0, 0.0, 0.0), False)])
def test_the_machines_load_is_recorded_and_a_busy_one_warned_of(monkeypatch, capsys, load, busy):
    # review 26 #7: a bench on a machine whose other work took the cores read as a measurement
    monkeypatch.setattr(os, "getloadavg", lambda: load)
    assert main(["bench", "--quick", "--no-peers", "--models", "nano", "--precisions", "fp32", "--json"]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert (data["load_avg"], data["load_above_cpus"]) == (list(load), busy)
    header = captured.err.splitlines()[0]
    assert ", load " + " ".join(f"{x:.2f}" for x in load) in header
    warned = "ampguard: warning: the 1-minute load before the bench (99.00) was above the" in captured.err
    assert warned == busy and ("timings are not to be trusted" in captured.err) == busy
    if busy:  # (after the figures, never before a refusal's one line)
        assert captured.err.rstrip().splitlines()[-1].startswith("ampguard: warning: the 1-minute load")


# ---------------------------------------------------------------- whole JSON through a SIGTERM (#5)


CUT_IN_THE_PRINT = """
import os, signal, sys
from ampguard import bench
real = bench.to_json
def to_json(*args, **kwargs):  # a time limit's SIGTERM as the JSON is written
    os.kill(os.getpid(), signal.SIGTERM)
    return real(*args, **kwargs)
bench.to_json = to_json
from ampguard.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_sigterm_while_the_json_is_printed_waits_until_it_is_whole():
    # review 26 #5: the default SIGTERM handler was back before the final print: killed mid-write
    done = warm.run([sys.executable, "-c", CUT_IN_THE_PRINT, "bench", "--quick", "--no-peers", "--models", "nano",
                     "--precisions", "fp32", "--json"], capture_output=True, text=True, timeout=300,
                    env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, stdin=subprocess.DEVNULL)
    assert done.returncode == 128 + signal.SIGTERM, (done.returncode, done.stderr)
    assert {r["contender"] for r in json.loads(done.stdout)["results"]} == {"bare loop", "ampguard + csv"}
    assert done.stderr.rstrip().endswith("ampguard: interrupted") and "Traceback" not in done.stderr


def test_gpu_sh_keeps_the_last_json_when_a_bench_writes_json_cut_short(tmp_path):
    # review 26 #5: bench_json checked only that the file was not empty before replacing the last good one
    python, env = gpu_sh_python(tmp_path)  # (the other commands: the real Python, those importing torch forked warm)
    fake = tmp_path / "python"
    fake.write_text(f"""#!/usr/bin/env bash
if [ "$1 $2 $3" = "-m ampguard bench" ]; then printf '{{"machine": "cut sh'; exit 143; fi
exec {python} "$@"
""")
    fake.chmod(0o755)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "bench-mlp.json").write_text('{"machine": "an earlier run", "run": {}, "results": []}')
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env, "PYTHON": str(fake), "OUT": str(out_dir), "STAGES": "3",
                               "DEVICE": "cpu"})
    out = done.stdout + done.stderr
    assert "stage 3 ended with exit 143" in out and "stage 3 wrote no JSON, or JSON cut short" in out, out
    assert json.loads((out_dir / "bench-mlp.json").read_text())["machine"] == "an earlier run"
    assert not (out_dir / "bench-mlp.json.tmp").exists()
