"""Data-parallel training under torchrun (issue 6): CPU, gloo, 2 processes.

Each torchrun launch costs seconds (torch is imported by three processes), so there is one, in
an early job (conftest.py: started at collection), shared by the tests of this module; its runs
one after another (``helpers.Batch``: their ranks end together):

- ``A``, ``ampguard train`` with DDP, fp32, accumulation 2, per-rank batch 8, 8 steps, a
  checkpoint at step 4, and faults on rank 1 only (``nan_input@2@rank1``, ``nan_loss@3@rank1``,
  ``inf_grad@6@rank1``); ``F``, the same with FSDP2 (6 steps, ``nan_loss@2@rank1``);
- ``S``, ``dist_scripts/lib_api.py``, the library API (``AmpTrainState``) on a DDP-wrapped and
  an FSDP2-sharded model, each rank writing its own state to a file (and the warnings a ``Guard``
  gave it: one about the run, rank 0's alone);
- ``B``, a copy of run A resumed from its step-4 checkpoint; ``W``, a run of one process
  (trained by the job itself before the launch) resumed under torchrun (refused: world size).

The single-process references (batch 16) run in this process.
"""

from __future__ import annotations

import math
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from helpers import (EARLY_TIMEOUT_S, TORCHRUN, Batch, Ended, Run, card_table, end_launches, rank_codes, read_rows,
                     run_events, snapshot_of, torchrun_env)

from ampguard.checkpoint import load_checkpoint
from ampguard.cli import main as ampguard_main


pytestmark = TORCHRUN

TIMEOUT_S = EARLY_TIMEOUT_S
SCRIPTS = Path(__file__).parent.parent / "dist_scripts"
CKPT4, CKPT8 = "step-00000004.pt", "step-00000008.pt"

# per-rank batch B = 8 on 2 ranks; the single-process reference reads batches of 2B = 16
COMMON = ["--set", "task.name=linear", "--set", "precision=fp32", "--set", "device=cpu",
          "--set", "accumulation_steps=2", "--set", "task.batch_size=8"]
RUN_A = [*COMMON, "--set", "steps=8", "--set", "checkpoint.every=4"]
FAULTS_A = ["--inject", "nan_input@2@rank1", "--inject", "nan_loss@3@rank1", "--inject", "inf_grad@6@rank1"]
FAULTS_A_SINGLE = ["--inject", "nan_input@2", "--inject", "nan_loss@3", "--inject", "inf_grad@6"]
RUN_F = [*COMMON, "--set", "steps=6", "--set", "distributed.strategy=fsdp2"]
FAULTS_F = ["--inject", "nan_loss@2@rank1"]
FAULTS_F_SINGLE = ["--inject", "nan_loss@2"]


# ---------------------------------------------------------------------------- launching


def early(work: Path) -> dict[str, Ended]:
    """One launch (``helpers.Batch``: a launch is ~12 s of CPU, a run in it ~2 s), in ``work``:
    A, F, S (the library API script), B (a copy of run A resumed from its step-4 checkpoint) and
    W (a run of one process, trained here first, resumed under torchrun: refused); each once it
    ended, and ``W-left``, W's folder before (an early job: see conftest.py)."""
    w = work / "W_runs" / "W"  # (a world of one: this process has no torchrun variables)
    assert ampguard_main(["train", *RUN_A, "--set", "task.batch_size=16", "--set", f"log.dir={w.parent}",
                          "--set", "log.name=W", "--set", "log.plot=false"]) == 0
    w_left = snapshot_of(w)
    (work / "S_out").mkdir()
    b = work / "B_runs" / "B"
    # (F, B: no test reads their plots; rank 0 drawing one costs ~0.7 s of CPU, the rest of such a run
    # ~0.1 s. B's resume is told so: the plot is not what its bit-for-bit comparison reads)
    batch = Batch("AF", {
        "A": Run(["train", *RUN_A, *FAULTS_A, "--set", f"log.dir={work / 'A_runs'}"], cwd="A_cwd"),
        "F": Run(["train", *RUN_F, *FAULTS_F, "--set", "log.plot=false", "--set", f"log.dir={work / 'F_runs'}",
                  "--set", "log.name=F"], cwd="F_cwd"),
        "S": Run([str(work / "S_out" / "state")], cwd="S_cwd", script=str(SCRIPTS / "lib_api.py")),
        "B": Run(["train", "--resume", str(b / "checkpoints" / CKPT4), "--set", "log.plot=false"], cwd="B_cwd",
                 copy=(f"{work / 'A_runs'}/*", str(b))),
        "W": Run(["train", "--resume", str(w / "checkpoints" / CKPT4)], cwd="W_cwd")},
        work, timeout_s=TIMEOUT_S, env=torchrun_env())
    try:
        return {**batch.results(), "W-left": w_left}
    finally:
        end_launches([batch.launch])


def _single_run_dir(runs: Path) -> Path:
    folders = [p for p in runs.iterdir()]
    assert len(folders) == 1, f"expected one run folder in {runs}, found {sorted(p.name for p in folders)}"
    return folders[0]


@pytest.fixture(scope="module")
def run_a(launches, work) -> Path:
    """Run A's folder (the launch finished with exit 0)."""
    launches["A"].ok()
    return _single_run_dir(work / "A_runs")


@pytest.fixture(scope="module")
def resume_launches(launches, work):
    """The early job's ``B`` and ``W``, each with its run's folder (and W's files before)."""
    return {"B": (launches["B"], work / "B_runs" / "B"), "W": (launches["W"], work / "W_runs" / "W", launches["W-left"])}


def _single_process(work: Path, name: str, args: list[str]) -> Path:
    """``ampguard train`` in this process (world size 1) with batches of 2B; its run folder (no
    plot: no test reads a reference's, and drawing one is most of such a run's CPU, ~0.7 s)."""
    env_keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    assert not any(k in os.environ for k in env_keys), "run the tests outside torchrun"
    code = ampguard_main(["train", *args, "--set", "task.batch_size=16", "--set", "log.plot=false",
                          "--set", f"log.dir={work / 'single'}", "--set", f"log.name={name}"])
    assert code == 0
    return work / "single" / name


@pytest.fixture(scope="module")
def single_a(launches, work) -> Path:
    return _single_process(work, "A", [*RUN_A, *FAULTS_A_SINGLE])


@pytest.fixture(scope="module")
def single_f(launches, work) -> Path:
    return _single_process(work, "F", [*RUN_F, *FAULTS_F_SINGLE])


@pytest.fixture(scope="module")
def lib_states(launches, work) -> tuple[dict, dict]:
    launches["S"].ok()
    return tuple(torch.load(work / "S_out" / f"state.rank{r}.pt", weights_only=False) for r in (0, 1))


# ---------------------------------------------------------------------------- helpers


def _num(text: str) -> float | None:
    return None if text == "" else float(text)


def _close(a: float | None, b: float | None, rel: float = 1e-5) -> bool:
    if a is None or b is None:
        return a is b
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-7)


def _final_model(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_checkpoint(run_dir / "checkpoints" / f"step-{step:08d}.pt")["model"]


def _assert_params_close(dist_model: dict, single_model: dict, atol: float = 1e-6) -> None:
    assert dist_model.keys() == single_model.keys()
    for key in single_model:
        a, b = dist_model[key].float(), single_model[key].float()
        assert a.shape == b.shape, key
        diff = (a - b).abs().max().item()
        assert diff <= atol, f"{key}: max |distributed - single| = {diff:.3g} > {atol}"


def _assert_rows_match(dist_rows: list[dict], single_rows: list[dict]) -> None:
    """Same decisions and schedule exactly; the same norms and losses up to float rounding (the
    norm is the global one: a per-rank or per-shard norm would differ by a factor ~sqrt(2))."""
    assert [r["step"] for r in dist_rows] == [r["step"] for r in single_rows]
    for d, s in zip(dist_rows, single_rows, strict=True):
        for key in ("skipped", "skip_reason", "lr", "scaler_scale"):
            assert d[key] == s[key], f"step {d['step']}: {key} {d[key]!r} != {s[key]!r}"
        for key in ("grad_l2_pre_clip", "grad_l2_post_clip", "loss", "val_loss"):
            assert _close(_num(d[key]), _num(s[key])), f"step {d['step']}: {key} {d[key]!r} != {s[key]!r}"


def _same(a, b) -> bool:
    """Deep equality with tensors compared by torch.equal and NaN equal to NaN."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and (
            torch.equal(a, b) or (a.shape == b.shape and bool(torch.equal(a.isnan(), b.isnan()))
                                  and torch.equal(a.nan_to_num(), b.nan_to_num())))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


# ---------------------------------------------------------------------------- CLI: DDP


def test_ddp_with_batch_b_per_rank_matches_one_process_with_batch_2b(run_a, single_a):
    _assert_params_close(_final_model(run_a, 8), _final_model(single_a, 8))
    _assert_params_close(_final_model(run_a, 4), _final_model(single_a, 4))
    _assert_rows_match(read_rows(run_a / "steps.csv"), read_rows(single_a / "steps.csv"))
    payload = load_checkpoint(run_a / "checkpoints" / CKPT8)
    assert payload["world_size"] == 2
    assert payload["updates"] == 5 and payload["step"] == 8
    # every rank took its slice of the same global batches: 16 micro-batches of 2B were read
    assert payload["data_position"] == 16
    assert isinstance(payload["rng"], list) and len(payload["rng"]) == 2


def test_a_fault_on_rank_1_makes_both_ranks_skip_that_step(launches, run_a):
    rows = read_rows(run_a / "steps.csv")
    skips = {int(r["step"]): r["skip_reason"] for r in rows if r["skipped"] == "1"}
    assert skips == {2: "non_finite_loss", 3: "non_finite_loss", 6: "non_finite_grad"}
    assert all(r["skip_reason"] == "" for r in rows if r["skipped"] == "0")
    by_step = {int(r["step"]): r for r in rows}
    # rank 0's own loss was finite at step 3: the logged loss is the global mean, so NaN
    assert math.isnan(float(by_step[3]["loss"]))
    assert by_step[3]["grad_l2_pre_clip"] == "" and by_step[3]["grad_l2_post_clip"] == ""
    # rank 0's gradient was finite at step 6: the Inf came through the all-reduce / agreement
    assert by_step[6]["grad_l2_pre_clip"] == "inf" and by_step[6]["grad_l2_post_clip"] == ""
    assert math.isfinite(float(by_step[6]["loss"]))
    # the scheduler held on the skips: a skipped step runs at the lr of the step after it
    assert by_step[3]["lr"] == by_step[4]["lr"] and by_step[6]["lr"] == by_step[7]["lr"]
    out = launches["A"].stdout
    assert "SKIP 3" in out and "SKIP 6" in out
    assert "skips=3" in out


def test_only_rank_0_writes_the_run_folder_and_prints(launches, run_a, work):
    launch = launches["A"]
    runs = work / "A_runs"
    assert [p.name for p in runs.iterdir()] == [run_a.name]  # no second (timestamped) folder from rank 1
    assert list((work / "A_cwd").iterdir()) == []  # nothing relative to the working directory
    files = sorted(str(p.relative_to(run_a)) for p in run_a.rglob("*"))
    assert files == sorted(["RUN.md", "config.yaml", "events.jsonl", "report.png", "run-id", "steps.csv", "checkpoints",
                            f"checkpoints/{CKPT4}", f"checkpoints/{CKPT8}"])
    lines = (run_a / "steps.csv").read_text(encoding="utf-8").splitlines()
    assert sum(line.startswith("step,") for line in lines) == 1 and lines[0].startswith("step,")
    assert [int(line.split(",")[0]) for line in lines[1:]] == list(range(1, 9))
    events = run_events(run_a)
    kinds = [e["event"] for e in events]
    assert kinds.count("run_start") == 1 and kinds.count("run_end") == 1
    assert [e["message"] for e in events if e["event"] == "checkpoint"] == [f"saved {CKPT4}", f"saved {CKPT8}"]
    card = card_table((run_a / "RUN.md").read_text(encoding="utf-8"))
    # the card and the run's start say how many processes trained it (task.batch_size is per process)
    assert card["processes"] == "2 (torchrun, ddp; a step's batch is 2 x a process's)"
    assert " x 2 processes (ddp)" in next(e["message"] for e in events if e["event"] == "run_start")
    assert (run_a / "report.png").stat().st_size > 0
    # rank 0 speaks for the run, once
    assert launch.stdout.count("summary:") == 1
    assert launch.stdout.count("ended: finished: 8 steps") == 1
    assert launch.stdout.count("EVAL 8") == 1


def test_resuming_a_ddp_checkpoint_in_one_process_is_refused(run_a, work, cli, snapshot):
    copy = work / "C_runs" / "C"
    shutil.copytree(run_a, copy)
    before = snapshot(copy)
    code, out, err = cli("train", "--resume", copy / "checkpoints" / CKPT4)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "world size" in lines[0] and "2" in lines[0] and "1" in lines[0]
    assert "Traceback" not in err
    assert snapshot(copy) == before  # nothing written or overwritten


# ---------------------------------------------------------------------------- CLI: FSDP2


def test_fsdp2_matches_one_process_with_batch_2b(launches, single_f, work):
    launch = launches["F"].ok()
    run_f = work / "F_runs" / "F"
    _assert_params_close(_final_model(run_f, 6), _final_model(single_f, 6))
    rows = read_rows(run_f / "steps.csv")
    _assert_rows_match(rows, read_rows(single_f / "steps.csv"))
    assert {int(r["step"]): r["skip_reason"] for r in rows if r["skipped"] == "1"} == {2: "non_finite_loss"}
    assert load_checkpoint(run_f / "checkpoints" / "step-00000006.pt")["world_size"] == 2
    assert [p.name for p in (work / "F_runs").iterdir()] == ["F"]
    assert list((work / "F_cwd").iterdir()) == []
    assert launch.stdout.count("summary:") == 1


# ---------------------------------------------------------------------------- library API


def test_library_api_under_ddp_every_rank_skips_the_same_steps_and_ends_identical(lib_states):
    r0, r1 = lib_states
    assert (r0["rank"], r1["rank"], r0["world_size"]) == (0, 1, 2)
    c = r0["constants"]
    d0, d1 = r0["ddp"], r1["ddp"]
    for name, p0 in d0["params"].items():
        assert torch.equal(p0, d1["params"][name]), name
    assert _same(d0["optimizer"], d1["optimizer"])
    assert _same(d0["scaler"], d1["scaler"])
    assert _same(d0["logs"], d1["logs"])  # same decisions, scale history, global loss and norms
    for logs in (d0["logs"], d1["logs"]):
        assert [log["step"] for log in logs] == list(range(1, c["STEPS"] + 1))
        assert {log["step"]: log["reason"] for log in logs if log["skipped"]} == {
            c["NAN_STEP"]: "non_finite_loss", c["INF_STEP"]: "non_finite_grad"}
        # fp16, init_scale 1024: the scale backs off at each skip and only there
        expected, scale = [], 1024.0
        for step in range(1, c["STEPS"] + 1):
            scale = scale / 2 if step in (c["NAN_STEP"], c["INF_STEP"]) else scale
            expected.append(scale)
        assert [log["scale"] for log in logs] == expected
        assert math.isnan(logs[c["NAN_STEP"] - 1]["loss"])  # rank 0's data was clean: the global mean
        assert logs[c["INF_STEP"] - 1]["pre"] == math.inf
    assert d0["updates"] == d1["updates"] == c["STEPS"] - 2
    assert d0["steps"] == d1["steps"] == c["STEPS"]


def test_library_api_under_torchrun_says_a_warning_about_the_run_once_from_rank_0(lib_states):
    # a Guard's warning about its settings (the same on every rank) was said by each rank: rank 1's
    # copy doubled the console (an fp32 guard given scaler settings: ignored)
    said = [state["warnings"] for state in lib_states]
    assert said == [["precision fp32 uses no loss scaler: scaler settings init_scale ignored"], []]


def test_library_api_under_ddp_accumulation_all_reduces_only_when_a_group_closes(lib_states):
    for state in lib_states:
        c, per_micro = state["constants"], state["ddp"]["allreduces_per_micro"]
        assert len(per_micro) == c["STEPS"] * c["ACCUM"]
        mid = [n for i, n in enumerate(per_micro) if (i + 1) % c["ACCUM"]]
        closing = [n for i, n in enumerate(per_micro) if (i + 1) % c["ACCUM"] == 0]
        assert mid == [0] * len(mid)  # no_sync on the micro-batches inside a group
        assert all(n >= 1 for n in closing) and len(set(closing)) == 1


def test_library_api_under_fsdp2_ranks_agree_and_accumulate_without_reduce_scatter(lib_states):
    f0, f1 = (s["fsdp2"] for s in lib_states)
    c = lib_states[0]["constants"]
    assert _same(f0["logs"], f1["logs"])  # the same global norm, loss and decisions on every rank
    assert [log["step"] for log in f0["logs"]] == list(range(1, c["FSDP_STEPS"] + 1))
    assert all(math.isfinite(log["pre"]) or log["skipped"] for log in f0["logs"])
    # set_requires_gradient_sync(False) mid-group: the sharded gradients are not written yet
    assert f0["grads_empty_mid_group"] == f1["grads_empty_mid_group"] == [True] * c["FSDP_STEPS"]


def test_inf_grad_on_rank_1_under_fsdp2_makes_every_rank_skip(lib_states):
    for state in lib_states:
        c, logs = state["constants"], state["fsdp2"]["logs"]
        assert {log["step"]: log["reason"] for log in logs if log["skipped"]} == {
            c["FSDP_INF_STEP"]: "non_finite_grad"}


# ---------------------------------------------------------------------------- resume


def test_resume_under_ddp_is_bit_for_bit_the_uninterrupted_run(run_a, resume_launches):
    launch, b = resume_launches["B"]
    launch.ok()
    assert "resuming from step-00000004.pt" in launch.stdout
    assert launch.stdout.count("summary:") == 1
    assert (b / "steps.csv").read_bytes() == (run_a / "steps.csv").read_bytes()
    resumed, whole = load_checkpoint(b / "checkpoints" / CKPT8), load_checkpoint(run_a / "checkpoints" / CKPT8)
    for key, value in whole["model"].items():
        assert torch.equal(resumed["model"][key], value), key
    assert _same(resumed["optimizer"], whole["optimizer"])
    assert _same(resumed["state"], whole["state"])
    assert _same(resumed["scheduler"], whole["scheduler"])
    for key in ("step", "updates", "data_position", "world_size"):
        assert resumed[key] == whole[key], key
    events = run_events(b)
    assert [e["event"] for e in events].count("resume") == 1
    assert [p.name for p in b.parent.iterdir()] == ["B"]  # no second run folder
    assert list((b.parent.parent / "B_cwd").iterdir()) == []


def test_resuming_a_single_process_checkpoint_under_torchrun_is_refused(resume_launches, work):
    launch, w, before = resume_launches["W"]
    assert rank_codes(work / "W") == {0: 2, 1: 2}, launch.stderr[-3000:]  # bad input, on every rank
    # (the batch's last run: torchrun's report) the workers exited 2; torchrun may stop the second with
    # SIGTERM (-15) once the first has failed, depending on which gets there first: no other code
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", launch.stderr)
    assert "2" in codes and set(codes) <= {"2", "-15"}, launch.stderr[-3000:]
    # ... with one line each naming the world sizes, and no traceback of ampguard's
    errors = [line for line in launch.stderr.splitlines() if line.startswith("ampguard: error:")]
    assert len(errors) == 2 and len(set(errors)) == 1, launch.stderr[-3000:]
    assert "saved by 1 process" in errors[0] and "2" in errors[0] and "world size" in errors[0]
    assert not [line for line in launch.stderr.splitlines() if line.strip().startswith("File ") and "ampguard" in line]
    assert snapshot_of(w) == before  # nothing written or overwritten
    assert list((work / "W_cwd").iterdir()) == []


def test_nan_input_on_rank_1_makes_every_rank_skip_that_step(launches, run_a):
    # (run A's step 2: rank 1's inputs are NaN, rank 0's are finite)
    by_step = {int(r["step"]): r for r in read_rows(run_a / "steps.csv")}
    assert (by_step[2]["skipped"], by_step[2]["skip_reason"]) == ("1", "non_finite_loss")
    assert math.isnan(float(by_step[2]["loss"]))  # the global mean: rank 0's own loss was finite
    assert by_step[2]["grad_l2_pre_clip"] == ""  # stopped before the backward on every rank
    assert (by_step[1]["skipped"], by_step[4]["skipped"]) == ("0", "0")
    assert "SKIP 2" in launches["A"].stdout
