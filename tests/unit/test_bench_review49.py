"""Review 49e: "resolved to ±1%" was printed beside an A/A row (the bare loop against an identical
copy, true ratio 1) whose interval excluded 1 (0.993-0.997 in 5 of 6 clean runs: the order the
loops were built in); a case is resolved only when that noise floor lies within ±resolve of 1 too."""
from __future__ import annotations

import time

from ampguard import bench
from ampguard.bench import Bare, BareAgain, Guarded, Result


def _times(aa: float, guarded: float, n: int = 48) -> dict[str, list[float]]:
    wobble = [1.0 + 0.001 * ((i * 7) % 5 - 2) for i in range(n)]  # (a little spread, the same each round)
    return {Bare.name: [1.0] * n, BareAgain.name: [aa * w for w in wobble], Guarded.name: [guarded * w for w in wobble]}


def test_a_case_whose_aa_row_reads_apart_from_1_by_more_than_resolve_is_not_resolved():
    rule = dict(rounds=6, cycle=6, budget_s=None, max_rounds=1000, started=time.perf_counter())
    assert bench._stop_reason(_times(0.998, 1.05), 48, resolve=0.01, **rule) == "resolved"
    # the same narrow intervals, the A/A copy 1.3% off: what a ratio may owe to where it sits is past ±1%
    assert bench._stop_reason(_times(0.987, 1.05), 48, resolve=0.01, **rule) is None
    assert bench._stop_reason(_times(0.987, 1.05), 48, resolve=0.01, **{**rule, "budget_s": 0.0}) == "budget"
    assert bench._stop_reason(_times(0.987, 1.05), 48, resolve=0.02, **rule) == "resolved"  # (within ±2%)
    del_aa = {k: v for k, v in _times(0.987, 1.05).items() if k != BareAgain.name}
    assert bench._stop_reason(del_aa, 48, resolve=0.01, **rule) == "resolved"  # (no A/A row: nothing to judge)


def test_the_resolution_line_says_the_noise_floor_kept_the_case_from_resolving():
    rows = [Result("nano-mlp", "fp32", Bare.name, 1, 1, 1.0, ratio_low=1.0, ratio_high=1.0, stop="budget", rounds=[1] * 48),
            Result("nano-mlp", "fp32", BareAgain.name, 1, 1, 0.993, ratio_low=0.986, ratio_high=0.998, stop="budget",
                   rounds=[1] * 48),
            Result("nano-mlp", "fp32", Guarded.name, 1, 1, 1.05, ratio_low=1.046, ratio_high=1.054, stop="budget",
                   rounds=[1] * 48)]
    line = bench.resolution(rows, 0.01)[0]
    assert line.startswith("nano-mlp fp32: not resolved to ±1% (the time budget ran out after 48 rounds; widest ±0.7%")
    assert "the noise floor reaches 1.4% from 1: identical loops read further apart than ±1% in this process" in line


def test_the_header_carries_the_settings_that_change_the_figures(capsys):
    import torch

    before = torch.get_num_threads()
    try:
        # (--fused adds the sync-free contender whose tail torch.compile compiles: run eagerly here, what is
        # checked is the header; Inductor's C++ of that tail, ~6-14 CPU-s with g++, is test_sync_free's)
        with torch.compiler.set_stance("force_eager"):
            assert bench.run(models="mlp", precisions="fp32", steps=1, rounds=2, warmup=1, peers=False, aa=False,
                             threads=1, resolve_pct=0.0, batch=8, fused=True) == 0
    finally:
        torch.set_num_threads(before)
    header = capsys.readouterr().out.splitlines()[0]
    assert header.endswith("; 1 warm-up step a contender, batch 8, fused AdamW, no peers"), header


def test_the_processes_lines_say_why_each_process_stopped():
    from ampguard.bench_processes import stops

    child = lambda stop, n: {"results": [  # noqa: E731
        {"workload": "nano-mlp", "precision": "fp32", "contender": Bare.name, "stop": stop, "rounds": [1.0] * n},
        {"workload": "nano-mlp", "precision": "fp32", "contender": Guarded.name, "stop": stop, "rounds": [1.0] * n}]}
    assert stops([child("resolved", 96), child("budget", 40)]) == [
        "nano-mlp fp32: each process stopped: resolved after 96 rounds, the time budget after 40 rounds"]
