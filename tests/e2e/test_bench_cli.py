"""``ampguard bench`` in quick mode: its table, its JSON and its usage errors (the figures
themselves are not asserted)."""

from __future__ import annotations

from ampguard.cli import main


def test_bench_runs_end_to_end_in_quick_mode(capsys):
    code = main(["bench", "--quick", "--models", "mlp", "--precisions", "fp32,bf16", "--no-peers"])
    out = capsys.readouterr().out
    assert code == 0
    rows = [line for line in out.splitlines() if line.startswith("| tiny-mlp")]
    assert len(rows) == 4  # two contenders x two precisions
    assert {row.split("|")[3].strip() for row in rows} == {"bare loop", "ampguard + csv"}
    bare = [row for row in rows if "bare loop" in row]
    assert all(row.split("|")[6].strip() == "1.000 [1.000, 1.000]" for row in bare)  # the ratio is to the bare loop


def test_bench_json_and_bad_arguments(capsys):
    import json

    assert main(["bench", "--quick", "--models", "mlp", "--precisions", "fp32", "--no-peers", "--json"]) == 0
    out = capsys.readouterr().out
    data = json.loads(out)  # stdout is the JSON alone; the progress lines went to stderr
    assert {r["contender"] for r in data["results"]} == {"bare loop", "ampguard + csv"}
    assert all(r["median_ms"] > 0 and len(r["rounds"]) == 2 for r in data["results"])
    assert main(["bench", "--models", "resnet"]) == 2
    assert main(["bench", "--precisions", "fp4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "resnet" in err and "fp4" in err


def test_bench_refuses_a_negative_resolution_or_budget(capsys):
    assert main(["bench", "--resolve", "-1"]) == 2
    assert main(["bench", "--budget", "nan"]) == 2
    assert main(["bench", "--threads", "0"]) == 2
    err = capsys.readouterr().err
    assert "--resolve must be a finite number >= 0, got -1" in err


def test_a_bench_cut_by_a_time_limit_prints_what_it_measured(tmp_path):
    # `timeout` sends SIGTERM: the whole rounds so far come out as JSON, exit 143 (gpu.sh relies on it)
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    err_path = tmp_path / "err.txt"
    with open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "ampguard", "bench", "--models", "mlp", "--precisions", "fp32",
                                 "--no-peers", "--steps", "3", "--resolve", "0.0001", "--budget", "600", "--json"],
                                stdout=subprocess.PIPE, stderr=err, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 120
        while "tiny-mlp fp32:" not in err_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(5)  # the warm-up, then some rounds (a round of 3 steps takes milliseconds)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, err_path.read_text()
    if not out:  # (a loaded machine: still warming up after 5 s; the rounds' own test is in test_bench.py)
        assert "nothing measured" in err_path.read_text() and "ampguard: interrupted" in err_path.read_text()
        return
    results = json.loads(out)["results"]
    assert {r["stop"] for r in results} == {"interrupted"}
    assert len({len(r["rounds"]) for r in results}) == 1 and len(results[0]["rounds"]) >= 1
    assert "interrupted; the rounds measured so far follow" in err_path.read_text()
