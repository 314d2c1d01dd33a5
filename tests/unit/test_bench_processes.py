"""``ampguard bench --processes N`` (ampguard.bench_processes): the rows across processes from
their ``--json`` outputs, the processes run one after another, a failing or interrupted one, and
the arguments each process gets (parsed by the real command line). The processes here are
small Python scripts that print a bench's JSON (no torch import): what is tested is the
running and the pooling, not a measurement."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading

import pytest

from ampguard import bench_processes as bp
from ampguard.bench import Bare, BareAgain, median_interval
from ampguard.cli import build_parser


def _child(ratios: dict[str, float | None], workload: str = "tiny-mlp", half_width: float | None = 0.005) -> dict:
    results = [{"workload": workload, "precision": "bf16", "contender": Bare.name, "ratio_to_bare": 1.0,
                "half_width": None}]
    results += [{"workload": workload, "precision": "bf16", "contender": name, "ratio_to_bare": r,
                 "half_width": half_width} for name, r in ratios.items()]
    return {"results": results}


def test_each_contender_is_the_median_of_the_processes_with_their_order_statistics_interval():
    guard = [1.10, 1.09, 1.11, 1.10, 1.095, 1.105, 1.12]
    aa = [1.0, 0.99, 1.01, 1.0, 1.005, 0.995, 1.0]
    rows = bp.across([_child({BareAgain.name: a, "ampguard + csv": g}) for a, g in zip(aa, guard)])
    assert [r.contender for r in rows] == [BareAgain.name, "ampguard + csv"]  # the bare loop: 1 by definition
    assert rows[1].ratios == guard and (rows[1].ratio, rows[1].low, rows[1].high) == median_interval(guard)
    assert rows[1].low == min(guard) and rows[1].high == max(guard)  # 7 processes: the least and the most
    assert rows[0].ratio == 1.0 and rows[1].within == 0.005


def test_a_contender_one_process_left_out_has_fewer_values_and_no_ratio_is_skipped():
    children = [_child({"ampguard + csv": 1.1, "accelerate": 1.2}) for _ in range(5)]
    children.append(_child({"ampguard + csv": 1.1}))  # (accelerate not run in the last one)
    children.append(_child({"ampguard + csv": None}))  # (no ratio: no bare loop there)
    rows = {r.contender: r for r in bp.across(children)}
    assert len(rows["ampguard + csv"].ratios) == 6 and not math.isnan(rows["ampguard + csv"].low)
    assert len(rows["accelerate"].ratios) == 5 and math.isnan(rows["accelerate"].low)  # below 6: no interval
    assert bp.resolution(list(rows.values()), 0.01) == [
        "across processes: no interval below 6 processes (5 ran): --processes 6 or more for one"]


def test_a_bare_loop_run_alone_is_kept_and_the_cases_stay_apart():
    alone = {"results": [{"workload": "nano", "precision": "fp32", "contender": Bare.name, "ratio_to_bare": 0.98,
                          "half_width": 0.01}]}
    rows = bp.across([alone, _child({"ampguard + csv": 1.1})])
    assert [(r.workload, r.contender, r.ratios) for r in rows] == [
        ("nano", Bare.name, [0.98]), ("tiny-mlp", "ampguard + csv", [1.1])]


def _script(tmp_path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(body, encoding="utf-8")
    return str(path)


def _launcher(scripts: list[str], seen: list[list[str]]):
    """Each launch runs the next script (a stand-in for `ampguard bench --json`), as run_across would."""
    def launch(argv):
        seen.append(argv)
        return subprocess.Popen([sys.executable, scripts[len(seen) - 1]], stdout=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    return launch


def test_the_processes_run_one_after_another_and_the_table_pools_them(tmp_path, capsys):
    scripts = [_script(tmp_path, f"p{i}.py", f"import json; print(json.dumps({_child({'ampguard + csv': r})!r}))")
               for i, r in enumerate([1.10, 1.08, 1.12, 1.09, 1.11, 1.10])]
    seen: list[list[str]] = []
    code = bp.run_across(6, ["--models", "mlp"], resolve=0.01, as_json=False, launch=_launcher(scripts, seen))
    out, err = capsys.readouterr()
    assert code == 0 and len(seen) == 6
    assert seen[0][-4:] == ["bench", "--models", "mlp", "--json"] and seen[0][1:3] == ["-m", "ampguard"]
    assert err.count("process ") == 6 and "process 6 of 6:" in err
    row = out.splitlines()[2]
    assert row.startswith("| tiny-mlp | bf16 | ampguard + csv | 1.100 | [1.080, 1.120] (±1.82%) | 1.1 1.08 1.12 1.09 "), out
    assert out.splitlines()[-1].endswith("not within ±1% asked (up to 8 processes the interval is their least and "
                                         "most; from 9 on, more processes narrow it)")


def test_a_failing_process_ends_the_run_with_its_code_after_the_ones_before_it(tmp_path, capsys):
    ok = _script(tmp_path, "ok.py", f"import json; print(json.dumps({_child({'ampguard + csv': 1.1})!r}))")
    bad = _script(tmp_path, "bad.py", "import sys; print('ampguard: error: no room', file=sys.stderr); sys.exit(2)")
    seen: list[list[str]] = []
    code = bp.run_across(4, [], resolve=None, as_json=True, launch=_launcher([ok, bad, ok, ok], seen))
    out, err = capsys.readouterr()
    assert code == 2 and len(seen) == 2  # (the third was never started)
    data = json.loads(out)
    assert (data["processes"], data["ran"], data["stopped"]) == (4, 1, "process 2 exited 2")
    assert data["across"][0]["ratios"] == [1.1] and len(data["children"]) == 1
    assert "bench: process 2 of 4 exited 2 (its lines above); the 1 process before it follow" in err


@pytest.mark.parametrize("signals, code", [([signal.SIGTERM], 143), ([signal.SIGINT], 130),
                                           ([signal.SIGTERM, signal.SIGINT], 143)])
def test_a_signal_ends_the_running_process_and_reports_those_that_finished(tmp_path, capsys, signals, code):
    """SIGTERM (``timeout``) or Ctrl-C: the running process is ended, the rows of those before it
    printed; a second signal while it ends is ignored (it had lost every row)."""
    ok = _script(tmp_path, "ok.py", f"import json; print(json.dumps({_child({'ampguard + csv': 1.1})!r}))")
    marker = tmp_path / "started"
    slow = _script(tmp_path, "slow.py", "import pathlib, signal, time\n"  # (slow to end: 0.5 s after SIGTERM)
                   "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(0.5), exit(143)))\n"
                   f"pathlib.Path({str(marker)!r}).touch(); time.sleep(60)")
    seen: list[list[str]] = []
    launch = _launcher([ok, slow, ok], seen)
    procs = []

    def launch_and_keep(argv):
        procs.append(launch(argv))
        return procs[-1]

    def term_once_started():
        for _ in range(500):
            if marker.exists():
                break
            threading.Event().wait(0.01)
        for sig in signals:  # (as `timeout` sends it, or `kill -INT`: to this process alone)
            os.kill(os.getpid(), sig)
            threading.Event().wait(0.1)

    killer = threading.Thread(target=term_once_started)
    killer.start()
    try:
        returned = bp.run_across(3, [], resolve=None, as_json=False, launch=launch_and_keep)
    finally:
        killer.join()
    out, err = capsys.readouterr()
    assert (returned, len(seen)) == (code, 2)
    assert procs[1].returncode == 143  # ended, not left running its minute
    assert "bench: interrupted in process 2 of 3; the 1 process before it follow" in err
    assert "| tiny-mlp | bf16 | ampguard + csv | 1.100 | n/a (1 process; 6 needed) |" in out


def test_each_process_gets_the_settings_the_command_line_reads_back_with_its_share_of_the_budget():
    settings = dict(device="cpu", models="mlp,nano", precisions="bf16,fp16", steps=12, rounds=9, warmup=3,
                    fused=True, peers=False, peak_tflops=312.5, quick=False, resolve_pct=0.5, budget_s=100 / 3,
                    threads=2, aa=False, batch=48)
    args = build_parser().parse_args(["bench", *bp.child_args(**settings)])
    assert (args.device, args.models, args.precisions, args.steps, args.rounds, args.warmup) == (
        "cpu", "mlp,nano", "bf16,fp16", 12, 9, 3)
    assert (args.fused, args.no_peers, args.peak_tflops, args.quick, args.resolve, args.threads, args.no_aa) == (
        True, True, 312.5, False, 0.5, 2, True)
    assert args.budget == 100 / 3 and args.processes == 1  # (the share, in full; each runs one process)
    assert args.batch == 48
    assert build_parser().parse_args(["bench", *bp.child_args(**{**settings, "batch": None})]).batch is None


def test_bad_arguments_are_one_line_exit_2_before_any_process_starts(cli):
    code, out, err = cli("bench", "--processes", "3", "--models", "mlp", "--resolve", "150")
    assert code == 2 and out == "" and "process 1" not in err
    assert err.strip() == "ampguard: error: bench: --resolve is a percentage below 100 (1 is ±1%), got 150"


@pytest.mark.parametrize("body, code, said", [
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", 137, "was killed by SIGKILL"),
    ("print('half a JSON {')", 1, "printed no JSON")])
def test_a_process_killed_or_printing_no_json_ends_the_run_with_the_rows_before_it(tmp_path, capsys, body, code, said):
    ok = _script(tmp_path, "ok.py", f"import json; print(json.dumps({_child({'ampguard + csv': 1.1})!r}))")
    bad = _script(tmp_path, "bad.py", body)
    assert bp.run_across(3, [], resolve=None, as_json=False, launch=_launcher([ok, bad, ok], [])) == code
    out, err = capsys.readouterr()
    assert f"bench: process 2 of 3 {said} (its lines above); the 1 process before it follow" in err
    assert "| tiny-mlp | bf16 | ampguard + csv | 1.100 |" in out


def test_quick_says_it_is_a_smoke_test_and_gives_no_interval(tmp_path, capsys):
    scripts = [_script(tmp_path, f"p{i}.py", f"import json; print(json.dumps({_child({'ampguard + csv': r})!r}))")
               for i, r in enumerate([1.10, 1.08, 1.12, 1.09, 1.11, 1.10])]
    assert bp.run_across(6, [], resolve=None, as_json=False, quick=True, launch=_launcher(scripts, [])) == 0
    out, err = capsys.readouterr()
    assert "--quick: a smoke test that the processes run, not a measurement (no interval)" in err
    assert "| 1.100 | n/a (--quick: a smoke test) |" in out and "the widest interval" not in out


def test_each_process_gets_its_share_of_the_budget_and_the_quick_flag(monkeypatch):
    ran = {}

    def fake_run_across(n, child, **kwargs):
        ran.update(n=n, child=build_parser().parse_args(["bench", *child]), **kwargs)
        return 0

    monkeypatch.setattr(bp, "run_across", fake_run_across)
    assert bp.run(processes=4, device="cpu", models="mlp", precisions="bf16", steps=30, rounds=7, warmup=5,
                  fused=False, peers=False, peak_tflops=None, quick=True, as_json=True, resolve_pct=1.0,
                  budget_s=100.0, threads=None, aa=True) == 0
    assert (ran["n"], ran["child"].budget, ran["child"].quick, ran["quick"], ran["resolve"], ran["as_json"]) == (
        4, 25.0, True, True, None, True)
    from ampguard.errors import InputError

    with pytest.raises(InputError, match="shared by 4 processes leaves none a second"):
        bp.run(processes=4, device="cpu", models="mlp", precisions="bf16", steps=30, rounds=7, warmup=5,
               fused=False, peers=False, peak_tflops=None, quick=False, as_json=False, resolve_pct=1.0,
               budget_s=1e-323, threads=None, aa=True)
