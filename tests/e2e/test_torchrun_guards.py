"""Guard stops under torchrun (issue 16): CPU, gloo, 2 processes; every launch side by side, early (conftest.py).
The runs whose ranks end together run in two launches (``helpers.Batch``: the main batch, its
last S; the resumes P, Q, W's, and G last); T, H, W and B1 each end their launch their own way.

- ``S``: ``--strict --inject nan_loss@3@rank1``. The NaN is born on rank 1 only; every rank must
  stop at step 3 with exit 3 (none cut short by torchrun's SIGTERM when another exits first),
  rank 0 writes the run card, and the first-skip diagnosis names rank 1 (rank 0's own replay
  is clean).
- ``D``: the same run under ``ulimit -f`` (2,000 bytes a file): rank 0's CSV finds no room; every
  rank stops at the same step with ``ExitCode.DISK_FULL`` (74), none waits in a collective.
- ``E``: a factory whose ``evaluate`` scores each rank's share of the held-out set, the share of
  rank 1 getting worse at the second evaluation, with the ``val_regression`` trigger: the
  metrics are the mean over ranks, and every rank rolls back together (rank 1 alone rolled back
  and waited in a collective the others never joined: a hang). Its model has a trainable head
  its forward never uses: DDP is told (``find_unused_parameters``) and the run trains (it failed
  at step 2 with DDP's "Expected to have finished reduction" traceback).
- ``X``: a run folder that exists already (rank 0 alone looks): every rank refuses with exit 2.
- ``R``: a factory whose data a ``DistributedSampler`` already splits per rank (ampguard would
  slice each rank's share again and never train on half the data): every rank refuses, exit 2.
- ``V``: a factory whose fourth batch (15 examples in batches of 4) does not split over the two
  ranks: every rank stops there with exit 2, the three steps before it, their card and a
  checkpoint kept (it was exit 2 with no card, no checkpoint, no ``run_end``).
- ``K``: a loss spike in rank 1's share of step 5 (``spike@5@rank1``) rolls the run back: the
  evidence file holds the global batch, every rank's slice in rank order (it held rank 0's, which
  had no spike).
- ``Z``: a 6-step run whose every step skips for a NaN born on rank 1 alone, with ``fail_rate``:
  too short for the rolling rules, it is judged at its end, and every rank fails there together;
  each SKIP line names rank 1.
- ``T``: a long run; once it has written rows, SIGTERM to torchrun itself (a scheduler's stop):
  torchrun passes it to every rank, and each stops at the same step boundary with exit 143, a
  checkpoint of that step and the run card, every row written.
- ``C``: rank 1 given another ``optimizer.lr`` (a node's own config): every rank refuses with exit 2
  and one line naming the setting (the replicas drifted apart unsaid; another ``steps`` hung).
- ``P``: a copy of K's finished run whose last checkpoint holds an RNG state rank 1 cannot load,
  resumed: every rank refuses with that line, exit 2 (rank 0 went on to a collective and died of
  gloo's "Connection closed by peer" traceback, exit 1), and the run folder is left as it was.
- ``H``: rank 1's process stopped (SIGSTOP: hung) in its third step's forward, then SIGTERM to
  torchrun: rank 0, waiting in the step's collective, runs no Python; its stuck-watcher gives it
  10 s, then it writes the card and ``run_end`` alone and exits 143.
- ``W``: rank 1's process SIGKILLed in its third step's forward (an OOM killer, a lost node):
  torchrun ends rank 0 too, no rank waits in a collective, the CSV holds whole rows reaching a
  checkpoint, rank 0's card and ``run_end`` say it crashed (its collective failed: it closes alone),
  and ``--resume`` under torchrun trains the run to its end from there.

- ``O``: a SIGTERM to rank 1's process alone, in its third step: every rank stops at the same
  boundary and ends with 143, the card saying SIGTERM (rank 0 said 130, "Ctrl-C").
- ``G``: a SIGTERM to rank 0's process alone while it builds the run (start-up): rank 0 unwinds
  and ends with 143; rank 1's next start-up collective fails at once ("Connection closed by
  peer", a traceback and exit 1, before torchrun's SIGTERM reached it): it now reads the word
  rank 0 left in the store and ends with 143 too, one line each, no run folder left (rank 1
  waits 0 s for torchrun's SIGTERM here: waiting for it alone lost a race under load).
- ``L``: rank 0's SIGTERM before step 3's boundary and rank 1's own just after the boundary's
  agreement (a scheduler's signal reaching the nodes milliseconds apart): every rank stops there
  with 143 and the checkpoint (rank 1 took its own signal for a second one, skipped the save and
  left rank 0 waiting in it: a hang).
- ``B``: the data's fifth batch raises on every rank (the same global stream): every rank stops
  with exit 2 and one line, the checkpoint of step 4 kept (a traceback per rank, no checkpoint);
  ``B1``: it raises on rank 1 alone: rank 1's crash (its traceback), after waiting for the others;
  rank 0's card and ``run_end`` name rank 1's error (they said gloo's "Connection closed by peer").
- ``M``: rank 1's ``task.options`` gives a buffer another shape: refused on every rank, naming it,
  before anything is written (DDP's parameter-size traceback).
- ``Q``: K's run resumed from step 4 on rank 0 and step 6 on rank 1: refused on every rank, K's
  folder left as it was (rank 0 cut it back while rank 1 trained on, then the job hung).
- ``N``: rank 1's factory cannot read its node's file: every rank refuses with its line, exit 2
  (rank 0 said "interrupted", exit 143); ``NB``: rank 0's factory fails while rank 1 waits at the
  factory's barrier: the same, and no hang. Each a launch of its own (the refusing rank leaves
  the group: the store holds its line for the others).
- ``Y``: rank 1 given its own ``task.options`` (a node's data path), then ``Y-resume`` each node
  given its own again: it resumes (rank 1 was refused alone against rank 0's config). Its factory
  builds rank 1's model in eval mode: rank 1 warns of it, labelled, and the warning about the
  ranks' options is rank 0's alone.

A launch costs ~12 s of CPU, two thirds of it its three processes importing torch, so a claim
that can share a run does (the unused head rides on E, P's checkpoint is K's), and the runs whose
ranks all end at the same point (S, D, E, X, R, V, K, Z, C, M, Y, B; then P, Q, W's and Y's resumes) run one after
another in one launch each (``helpers.Batch``): this module's launches were a quarter of the
suite's CPU.

Each rank runs ``ampguard.cli.main`` through a small wrapper that writes the exit code ``main``
returned to ``rank<R>.rc`` before leaving: torchrun reports only the first failure it sees.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path

from helpers import (EARLY_TIMEOUT_S, RANK_EXIT, TORCHRUN, Batch, Ended, Launch, Run, end_launches, rank_codes,
                     read_rows, run_events, snapshot_of, torchrun_env)

from ampguard.errors import ExitCode

pytestmark = TORCHRUN

TIMEOUT_S = EARLY_TIMEOUT_S
# their ranks end together: one launch (helpers.Batch), in this order; S last, the launch's own end
# (O and L: a SIGTERM that every rank agrees on; each run begins with a fresh process's handlers)
BATCHED = ("D", "E", "X", "R", "V", "K", "Z", "C", "M", "Y", "B", "O", "L", "F", "S")
RUN = ["train", "--set", "task.name=linear", "--set", "precision=fp32", "--set", "device=cpu",
       "--set", "task.batch_size=8", "--set", "eval.enabled=false", "--set", "log.dir=runs"]
SHARDED_EVAL = '''
import os
import torch
from torch import nn


def build(config):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(8)]
    calls = []

    def evaluate(model, device):  # each rank's own share; the first call is the up-front check
        calls.append(1)
        worse = os.environ["RANK"] == "1" and len(calls) >= 3
        return {"val_loss": 10.0 if worse else 1.0 / len(calls)}

    return {"model": WithAux(), "data": data, "loss_fn": nn.functional.mse_loss, "evaluate": evaluate,
            "metrics": ("val_loss",)}


class WithAux(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.aux = nn.Linear(4, 1), nn.Linear(4, 1)  # aux: trained elsewhere, not here

    def forward(self, x):
        return self.body(x)
'''
SAMPLER = '''
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def build(config):
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
    loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=False))
    return nn.Linear(4, 1), loader, nn.functional.mse_loss
'''
UNEVEN = '''
import torch
from torch import nn


def build(config):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(19, 4, generator=g), torch.randn(19, 1, generator=g)  # (the fifth batch, of 3: past the
    return nn.Linear(4, 1), [(x[i:i + 4], y[i:i + 4]) for i in range(0, 19, 4)], nn.functional.mse_loss  # start-up's four)
'''
PATCHES = '''
"""The batches' prelude (helpers.Batch): each patch acts in the run whose environment names it."""
import os, signal
from ampguard import signals, trainer

agree, build_task = trainer.Trainer._agree, trainer._build_task


def late(self, stop, full):  # L (LATE_TERM): rank 0's SIGTERM before step 3's boundary, rank 1's own just after it
    late_term = os.environ.get("LATE_TERM")
    if late_term and os.environ["RANK"] == "0" and self.state.steps == 3:
        os.kill(os.getpid(), signal.SIGTERM)
    interrupted, full = agree(self, stop, full)
    if late_term and os.environ["RANK"] == "1" and interrupted:
        os.kill(os.getpid(), signal.SIGTERM)
    return interrupted, full


def building(*args, **kwargs):  # G (TERM_RANK_0_OPENING): a SIGTERM to rank 0 alone while it builds the run's task
    if os.environ.get("TERM_RANK_0_OPENING"):  # (a batch's last run: it leaves the process group)
        if os.environ["RANK"] == "0":
            os.kill(os.getpid(), signal.SIGTERM)
        else:  # rank 1 ends by rank 0's word in the store, not by torchrun's SIGTERM (whose timing on a
            signals.PEER_STOP_WAIT_S = 0.0  # loaded machine made this test flaky)
    return build_task(*args, **kwargs)


trainer.Trainer._agree, trainer._build_task = late, building
'''


KILLED = '''
import os
import signal
import torch
from torch import nn


class Dies(nn.Linear):
    calls = 0

    def forward(self, x):
        if self.training:  # (the start-up's check runs the first four batches as a step does: calls 1-4)
            Dies.calls += 1
            if os.environ.get("KILL_RANK_1") and os.environ["RANK"] == "1" and Dies.calls == 6:
                os.kill(os.getpid(), signal.SIGKILL)  # rank 1, in step 3's forward
            if os.environ.get("HANG_RANK_1") and os.environ["RANK"] == "1" and Dies.calls == 6:
                with open("rank1.pid", "w") as f:
                    f.write(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGSTOP)  # rank 1 hangs in step 3's forward
            if os.environ.get("TERM_RANK_1") and os.environ["RANK"] == "1" and Dies.calls == 6:
                os.kill(os.getpid(), signal.SIGTERM)  # a SIGTERM to rank 1's process alone, in step 3
        return super().forward(x)


class Batches:
    """The data; its fifth batch raises (a corrupt record) where DATA_RAISES says: on every rank
    (every rank reads the same stream), or on rank 1 alone (a file only its node reads)."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        for i, batch in enumerate(self.batches):
            if i == 4 and os.environ.get("DATA_RAISES") in ("every", os.environ["RANK"]):
                raise ValueError("corrupt record 33")
            yield batch


def build(config):
    if str(config.task.options.get("missing_on", "")) == os.environ["RANK"]:  # (a node's own file, missing)
        raise FileNotFoundError(f"node_data/rank{os.environ['RANK']}.pt")
    if config.task.options.get("barrier_fail"):  # rank 0 prepares the data, the others wait at a barrier
        if os.environ["RANK"] == "0":
            raise FileNotFoundError("data/train.bin: the download did not come")
        torch.distributed.barrier()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(8)]
    model = Dies(4, 1)
    model.register_buffer("table", torch.zeros(int(config.task.options.get("table", 3))))  # (sized by an option)
    if config.task.options.get("node") == "b":  # (Y: rank 1's node builds its model in eval mode, a warning of its own)
        model.eval()
    return model, Batches(data), nn.functional.mse_loss
'''
KILLED_RUN = ["train", "--set", "task.factory=../killed.py:build", "--set", "precision=fp32", "--set", "device=cpu",
              "--set", "steps=6", "--set", "checkpoint.every=1", "--set", "eval.enabled=false", "--set", "log.dir=runs",
              "--set", "log.name=W"]


def early(work: Path) -> dict[str, tuple]:
    """{name: (torchrun's exit code, stdout, stderr, working folder)} of every launch, run side
    by side in ``work``; and ``W-left``, what W's kill left before its resume (an early job: see
    conftest.py)."""
    wrapper = work / "rank_exit.py"
    wrapper.write_text(RANK_EXIT)
    (work / "sharded_eval.py").write_text(SHARDED_EVAL)
    (work / "X" / "runs" / "X").mkdir(parents=True)  # the folder of an earlier run
    (work / "sampler.py").write_text(SAMPLER)
    (work / "uneven.py").write_text(UNEVEN)
    (work / "killed.py").write_text(KILLED)
    specs = {
        "S": [*RUN, "--set", "steps=6", "--set", "log.name=S", "--strict", "--inject", "nan_loss@3@rank1"],
        "F": [*RUN, "--set", "steps=6", "--set", "log.name=F", "--set", "distributed.strategy=fsdp2", "--strict",
              "--inject", "nan_loss@3@rank1"],
        "D": [*RUN, "--set", "steps=300", "--set", "log.every=1000", "--set", "checkpoint.enabled=false",
              "--set", "log.name=D"],
        "E": ["train", "--set", f"task.factory={work / 'sharded_eval.py'}:build", "--set", "precision=fp32",
              "--set", "device=cpu", "--set", "steps=6", "--set", "eval.every=2", "--set", "checkpoint.every=2",
              "--set", "rollback.triggers=[val_regression]", "--set", "log.dir=runs", "--set", "log.name=E"],
        "X": [*RUN, "--set", "steps=2", "--set", "log.name=X"],
        "R": ["train", "--set", f"task.factory={work / 'sampler.py'}:build", "--set", "precision=fp32",
              "--set", "device=cpu", "--set", "steps=2", "--set", "log.dir=runs", "--set", "log.name=R"],
        "V": ["train", "--set", f"task.factory={work / 'uneven.py'}:build", "--set", "precision=fp32",
              "--set", "device=cpu", "--set", "steps=6", "--set", "checkpoint.every=2", "--set", "log.dir=runs",
              "--set", "log.name=V"],
        "K": [*RUN, "--set", "steps=8", "--set", "task.batch_size=4", "--set", "checkpoint.every=2",
              "--set", "rollback.triggers=[loss_spike]", "--set", "rollback.window=3", "--set", "rollback.skip_batches=1",
              "--set", "log.name=K", "--inject", "spike@5@rank1"],
        "Z": [*RUN, "--set", "steps=6", "--set", "log.name=Z", "--set", "monitor.fail_rate=0.5",
              "--inject", "nan_loss@every:1@rank1"],
        "W": KILLED_RUN,
        "H": [*KILLED_RUN[:-1], "log.name=H"],
        "C": [*RUN, "--set", "steps=4", "--set", "log.name=C"],
        "O": [*KILLED_RUN[:-1], "log.name=O"],
        "L": [*RUN, "--set", "steps=20", "--set", "log.name=L"],
        "B": [*KILLED_RUN[:-1], "log.name=B"],
        "B1": [*KILLED_RUN[:-1], "log.name=B1"],
        "M": [*KILLED_RUN[:-1], "log.name=M", "--set", "task.options.table=3"],
        "N": [*KILLED_RUN[:-1], "log.name=N", "--set", "task.options.missing_on=1"],
        "NB": [*KILLED_RUN[:-1], "log.name=NB", "--set", "task.options.barrier_fail=true"],
        "Y": [*KILLED_RUN[:-1], "log.name=Y", "--set", "steps=2", "--set", "task.options.node=a"],
        "G": [*RUN, "--set", "steps=4", "--set", "log.name=G"],
        "T": [*RUN, "--set", "steps=1000000", "--set", "log.every=100000", "--set", "checkpoint.every=100000",
              "--set", "log.name=T"],
    }
    env = torchrun_env(PYTHONDONTWRITEBYTECODE="1")
    # (no test here reads a plot: rank 0 drawing one costs seconds of CPU)
    specs = {name: [*args, "--set", "log.plot=false"] for name, args in specs.items()}
    sizes = {"D": 2000}  # (ulimit -f: rank 0's CSV finds no room)
    rank_1 = {"C": ["--set", "optimizer.lr=0.5"], "M": ["--set", "task.options.table=5"],  # rank 1's own --set
              "Y": ["--set", "task.options.node=b"]}
    own_env = {"W": {"KILL_RANK_1": "1"}, "H": {"HANG_RANK_1": "1"}, "O": {"TERM_RANK_1": "1"}, "L": {"LATE_TERM": "1"}, "G": {"TERM_RANK_0_OPENING": "1"},
               "B": {"DATA_RAISES": "every"}, "B1": {"DATA_RAISES": "1"}}
    started: dict[str, Launch] = {}
    try:
        # the runs whose ranks all end at one point, one after another in one launch
        batch = Batch("batch", {name: Run(specs[name], rank_1.get(name, []), own_env.get(name, {}), sizes.get(name))
                                for name in BATCHED}, work, timeout_s=TIMEOUT_S, env=env, prelude=PATCHES)
        started["batch"] = batch.launch
        for name in specs.keys() - {*BATCHED, "G"}:  # a kill, a hang, one rank's crash, torchrun's SIGTERM: each its own
            started[name] = Launch(name, [str(wrapper), str(work / name), *specs[name]], work / name, timeout_s=TIMEOUT_S,
                                   env={**env, **own_env.get(name, {})})
        # T: a scheduler's SIGTERM to torchrun once the run trains (its CSV has rows), not before; first,
        # as its run has no end of its own (every step until the signal is CPU the other launches wait for)
        rows, deadline = work / "T" / "runs" / "T" / "steps.csv", time.monotonic() + TIMEOUT_S / 2
        while time.monotonic() < deadline and started["T"].proc.poll() is None and not (
                rows.exists() and rows.read_text().count("\n") > 3):
            time.sleep(0.2)
        os.kill(started["T"].proc.pid, signal.SIGTERM)
        # what W's kill left (its CSV, its checkpoints), before its resume (with P and Q, below)
        killed = started["W"].wait()
        w_run = work / "W" / "runs" / "W"
        card = w_run / "RUN.md"
        left = ((w_run / "steps.csv").read_text(encoding="utf-8"), sorted(p.name for p in (w_run / "checkpoints").glob("*.pt")),
                card.read_text(encoding="utf-8") if card.exists() else None, (w_run / "events.jsonl").read_text(encoding="utf-8"))
        # H: once rank 1 hangs (stopped) in step 3, a scheduler's SIGTERM to torchrun; rank 0 waits in
        # the step's collective, where no Python runs; then rank 1 is killed (torchrun would, 30 s on)
        results: dict[str, tuple] = {"H-waited": _stop_a_hung_job(started["H"], work / "H")}
        results.update(_as_launches(batch.results()))
        # P: a copy of K's finished run, rank 1's RNG state in its last checkpoint spoilt (a hand
        # edit, a bad copy), resumed for more steps; Q: K's run resumed from step 4 on rank 0 and
        # from step 6 on rank 1
        k_run = work / "K" / "runs" / "K"
        assert rank_codes(work / "K") == {0: 0, 1: 0}, results["K"][2][-3000:]
        results["P-left"] = _spoilt_copy(k_run, work / "P" / "runs" / "P")
        results["Q-left"] = snapshot_of(k_run)
        resumes = Batch("resumes", {
            "P": Run(["train", "--resume", "runs/P", "--set", "steps=10"]),
            "Q": Run(["train", "--resume", str(k_run / "checkpoints" / "step-00000004.pt")],
                     ["--resume", str(k_run / "checkpoints" / "step-00000006.pt")]),
            "W-resume": Run(["train", "--resume", str(w_run)]),
            # Y resumed, each node given its own task.options again (rank 1 was refused alone: review 51g)
            "Y-resume": Run(["train", "--resume", str(work / "Y" / "runs" / "Y"), "--set", "steps=4", "--set",
                             "task.options.node=a"], ["--set", "task.options.node=b"]),
            # G last (rank 0, stopped in its start-up, leaves the process group, as a launch's own would)
            "G": Run(specs["G"], env=own_env["G"])}, work, timeout_s=TIMEOUT_S, env=env, prelude=PATCHES)
        started["resumes"] = resumes.launch
        results.update(_as_launches(resumes.results()))
        results["W-left"] = left
        for name, launch in started.items():
            launch.wait()
            if name not in ("batch", "resumes"):
                results[name] = (launch.rc, launch.stdout, launch.stderr, launch.cwd)
        assert killed.rc is not None
        return results
    finally:
        end_launches(started.values())  # (all at once: one grace for them all)


def _as_launches(runs: dict[str, Ended]) -> dict[str, tuple]:
    """A batch's runs as this module's launches: ``(code, stdout, stderr, folder)``."""
    return {name: (run.rc, run.stdout, run.stderr, run.cwd) for name, run in runs.items()}


def _stop_a_hung_job(launch: Launch, cwd: Path) -> tuple[float | None]:
    """SIGTERM to torchrun once rank 1 is stopped (its pid in ``rank1.pid``); then, once rank 0
    wrote ``run_end`` (or gave up), SIGKILL to rank 1. The seconds from the SIGTERM to
    ``run_end`` (None if it never came)."""
    pid_file, events = cwd / "rank1.pid", cwd / "runs" / "H" / "events.jsonl"

    def stopped() -> bool:
        try:
            return Path(f"/proc/{int(pid_file.read_text())}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
        except (OSError, ValueError, IndexError):
            return False

    def ended() -> bool:
        return events.exists() and '"event": "run_end"' in events.read_text(encoding="utf-8")

    deadline = time.monotonic() + TIMEOUT_S / 2
    while time.monotonic() < deadline and launch.proc.poll() is None and not stopped():
        time.sleep(0.2)
    os.kill(launch.proc.pid, signal.SIGTERM)
    sent = time.monotonic()
    while time.monotonic() < sent + TIMEOUT_S / 2 and not ended():
        time.sleep(0.2)
    waited = time.monotonic() - sent if ended() else None
    with contextlib.suppress(OSError, ValueError):
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
    return (waited,)


def _spoilt_copy(run: Path, copy: Path) -> dict[str, bytes]:
    """Copy ``run`` (a finished run's folder) to ``copy`` and make rank 1's RNG state in the
    copy's last checkpoint one no generator loads; every file of the copy's bytes, after."""
    import shutil

    import torch

    shutil.copytree(run, copy)
    path = copy / "checkpoints" / "step-00000008.pt"
    payload = torch.load(path, weights_only=False)
    payload["rng"][1]["torch"] = torch.zeros(7, dtype=torch.uint8)
    torch.save(payload, path)
    return {str(p.relative_to(copy)): p.read_bytes() for p in sorted(copy.rglob("*")) if p.is_file()}


def test_strict_mode_every_rank_stops_with_3_and_the_card_names_the_rank_of_the_nan(launches):
    code, out, err, cwd = launches["S"]
    assert rank_codes(cwd) == {0: ExitCode.GUARD, 1: ExitCode.GUARD}, f"torchrun exited {code}\n{err[-3000:]}"
    # (the batch's last run: torchrun's report) no rank cut short by the SIGTERM after the other's exit
    assert sorted(re.findall(r"exitcode\s+:\s*(-?\d+)", err)) == ["3", "3"], err[-3000:]
    run = cwd / "runs" / "S"
    card = (run / "RUN.md").read_text()
    finding = "step 3 (non_finite_loss) on rank 1: first nan under fp32: in the loss"
    assert finding in card
    assert f"ended: strict mode: non-finite loss at step 3: {finding}" in out
    assert "no non-finite value" not in out + card  # rank 0's clean replay is not the finding
    events = run_events(run)
    diagnosis = [e for e in events if e["event"] == "diagnosis"]
    assert len(diagnosis) == 1 and diagnosis[0]["rank"] == 1 and diagnosis[0]["amp"]["where"] == "loss"
    assert [e["message"] for e in events if e["event"] == "run_end"] == [f"strict mode: non-finite loss at step 3: "
                                                                          f"{diagnosis[0]['message']}"]
    rows = (run / "steps.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == ["1", "2", "3"]  # both ranks stopped at step 3
    assert out.count("summary:") == 1


def test_strict_mode_under_fsdp2_stops_every_rank_with_3_saying_the_step_is_not_replayed(launches):
    # (each rank replaying its own micro-batches through a sharded model ran collectives that did
    # not pair up: rank 1 a KeyError, rank 0 a broken connection, both exit 1 with tracebacks)
    code, out, err, cwd = launches["F"]
    assert rank_codes(cwd) == {0: ExitCode.GUARD, 1: ExitCode.GUARD}, f"torchrun exited {code}\n{err[-3000:]}"
    run = cwd / "runs" / "F"
    finding = "step 3 (non_finite_loss): not replayed: under FSDP2 every forward gathers the ranks' shards"
    assert finding in (run / "RUN.md").read_text()
    assert f"ended: strict mode: non-finite loss at step 3: {finding}" in out
    diagnosis = [e for e in run_events(run) if e["event"] == "diagnosis"]
    assert [(e["step"], e["verdict"]) for e in diagnosis] == [(3, "not replayed")]
    assert [r.split(",")[0] for r in (run / "steps.csv").read_text().splitlines()[1:]] == ["1", "2", "3"]


def test_a_full_disk_on_rank_0_stops_every_rank_at_the_same_step(launches):
    code, out, err, cwd = launches["D"]
    assert rank_codes(cwd) == {0: ExitCode.DISK_FULL, 1: ExitCode.DISK_FULL}, f"torchrun exited {code}\n{err[-3000:]}"
    lines = [line for line in err.splitlines() if line.startswith("ampguard: error: ")]
    assert len(lines) == 1, err[-3000:]  # rank 0 says it, once
    # no rank's traceback (torchrun prints its own ChildFailedError for any non-zero exit)
    assert not [line for line in err.splitlines() if line.strip().startswith("File ") and "ampguard" in line]
    assert lines[0].startswith("ampguard: error: disk full while writing runs/D/steps.csv; the run is intact up to step ")
    assert not (cwd / "runs" / "D" / "RUN.md").exists()


def test_held_out_metrics_are_the_mean_over_ranks_and_every_rank_rolls_back_together(launches):
    code, out, err, cwd = launches["E"]
    assert rank_codes(cwd) == {0: ExitCode.OK, 1: ExitCode.OK}, f"torchrun exited {code}\n{err[-3000:]}"
    assert code == 0
    rows = {int(r.split(",")[0]): r.split(",")[-1] for r in (cwd / "runs" / "E" / "steps.csv").read_text().splitlines()[1:]}
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]  # each step once: the rolled-back rows were replaced
    assert float(rows[2]) == 0.5  # both ranks 1/2
    rollbacks = [e for e in run_events(cwd / "runs" / "E") if e["event"] == "rollback"]
    assert [e["step"] for e in rollbacks] == [4, 6]  # both ranks rolled back, twice, and went on together
    assert "val_loss=5.167" in out  # (1/3 + 10) / 2: rank 1's share got worse
    assert "EVAL 6 val_loss=5.125" in out  # (1/4 + 10) / 2: the third evaluation on each rank
    assert "ended: finished: 6 steps" in out


def test_a_config_that_differs_on_one_rank_is_refused_on_every_rank_naming_the_setting(launches):
    code, out, err, cwd = launches["C"]
    assert rank_codes(cwd) == {0: ExitCode.BAD_INPUT, 1: ExitCode.BAD_INPUT}, f"torchrun exited {code}\n{err[-3000:]}"
    lines = {line for line in err.splitlines() if line.startswith("ampguard: error: ")}
    assert lines == {"ampguard: error: the ranks were given different configs: optimizer.lr is 0.003 on rank 0, 0.5 on "
                     "rank 1; give every rank the same config and --set values"}, err[-3000:]
    assert not (cwd / "runs").exists()  # refused before anything is written


def test_a_checkpoint_one_rank_cannot_restore_is_refused_on_every_rank_and_changes_nothing(launches):
    code, out, err, cwd = launches["P"]
    assert rank_codes(cwd) == {0: ExitCode.BAD_INPUT, 1: ExitCode.BAD_INPUT}, f"torchrun exited {code}\n{err[-3000:]}"
    lines = {line for line in err.splitlines() if line.startswith("ampguard: error: ")}
    assert len(lines) == 1 and lines.pop().startswith(
        "ampguard: error: runs/P/checkpoints/step-00000008.pt: does not fit this run (rng: "), err[-3000:]
    # no rank's traceback (torchrun prints its own ChildFailedError for any non-zero exit)
    assert not [line for line in err.splitlines() if line.strip().startswith("File ") and "ampguard" in line], err
    assert "Connection closed by peer" not in err
    run = cwd / "runs" / "P"
    assert {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()} == launches["P-left"]


def test_a_run_folder_that_exists_is_refused_on_every_rank_with_one_line(launches):
    code, out, err, cwd = launches["X"]
    assert rank_codes(cwd) == {0: ExitCode.BAD_INPUT, 1: ExitCode.BAD_INPUT}, f"torchrun exited {code}\n{err[-3000:]}"
    lines = [line for line in err.splitlines() if line.startswith("ampguard: error: ")]
    assert lines and set(lines) == {"ampguard: error: run folder runs/X already exists; choose another log.name"}
    # no rank's traceback (torchrun prints its own ChildFailedError for any non-zero exit)
    assert not [line for line in err.splitlines() if line.strip().startswith("File ") and "ampguard" in line]
    assert "Connection closed by peer" not in err


def test_data_a_sampler_already_split_per_rank_is_refused_on_every_rank(launches):
    code, out, err, cwd = launches["R"]
    assert rank_codes(cwd) == {0: ExitCode.BAD_INPUT, 1: ExitCode.BAD_INPUT}, f"torchrun exited {code}\n{err[-3000:]}"
    lines = {line for line in err.splitlines() if line.startswith("ampguard: error: ")}
    assert len(lines) == 1 and "the ranks read different data (the first batch of rank 1 differs" in lines.pop()
    assert not (cwd / "runs").exists()  # refused before anything is written


def test_a_parameter_the_forward_never_uses_trains_under_ddp(launches):
    code, out, err, cwd = launches["E"]  # (its model's head ``aux`` is never used)
    assert rank_codes(cwd) == {0: ExitCode.OK, 1: ExitCode.OK}, f"torchrun exited {code}\n{err[-3000:]}"
    assert len((cwd / "runs" / "E" / "steps.csv").read_text().splitlines()) == 7  # header and 6 steps
    start = next(e for e in run_events(cwd / "runs" / "E") if e["event"] == "run_start")
    assert "DDP find_unused_parameters (aux.weight, aux.bias unused at the first batch)" in start["message"]


def test_a_batch_that_does_not_split_over_the_ranks_stops_every_rank_and_keeps_the_steps_before(launches):
    code, out, err, cwd = launches["V"]
    assert rank_codes(cwd) == {0: ExitCode.BAD_INPUT, 1: ExitCode.BAD_INPUT}, f"torchrun exited {code}\n{err[-3000:]}"
    lines = [line for line in err.splitlines() if line.startswith("ampguard: error: ")]
    assert lines == ["ampguard: error: bad data at step 5: a batch of 3 examples does not split evenly over 2 ranks; "
                     "the run is intact up to step 4 (checkpoints/step-00000004.pt: --resume continues from there "
                     "once the data is fixed)"]
    run = cwd / "runs" / "V"
    assert (run / "RUN.md").is_file() and (run / "checkpoints" / "step-00000004.pt").is_file()
    assert [e["event"] for e in run_events(run)][-1] == "run_end"


def test_rollback_evidence_under_torchrun_is_the_global_batch(launches):
    import torch

    code, out, err, cwd = launches["K"]
    assert rank_codes(cwd) == {0: ExitCode.OK, 1: ExitCode.OK}, f"torchrun exited {code}\n{err[-3000:]}"
    evidence = torch.load(cwd / "runs" / "K" / "rollback" / "step-5.pt", weights_only=False)
    (batch,) = evidence["micro_batches"]
    assert batch["inputs"].shape[0] == 8  # 4 a rank, both ranks
    rows = batch["targets"].abs().flatten(1).amax(dim=1)
    assert rows[4:].min() > 1e6 and rows[:4].max() < 1e3  # rank 1's half is the spiked one (x 1e8)


def test_a_run_too_short_for_fail_after_fails_at_its_end_on_every_rank_together(launches):
    code, out, err, cwd = launches["Z"]
    assert rank_codes(cwd) == {0: ExitCode.GUARD, 1: ExitCode.GUARD}, f"torchrun exited {code}\n{err[-3000:]}"
    run = cwd / "runs" / "Z"
    assert ("ended: stopped by the guard at the end of the run (step 6): skip rate above fail_rate 0.5 at every one "
            "of the run's 6 steps") in out
    events = run_events(run)
    assert [(e["event"], e["step"]) for e in events if e["event"] in ("skip_rate_alert", "fail")] == [
        ("skip_rate_alert", 6), ("fail", 6)]  # rank 0 writes them, once
    rows = (run / "steps.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == ["1", "2", "3", "4", "5", "6"]
    assert all(r.split(",")[5] == "1" for r in rows[1:])  # every rank skipped every step (rank 1's NaN, agreed)
    # each SKIP line names the rank whose own loss was not finite (no diagnosis asked for)
    skips = [line for line in out.splitlines() if line.startswith("SKIP ")]
    assert len(skips) == 6 and all(line.endswith("reason=non_finite_loss (rank 1)") for line in skips), skips
    assert "| non-finite losses by rank | rank 1 (6) |" in (run / "RUN.md").read_text(encoding="utf-8")


def test_a_rank_killed_mid_run_ends_the_job_with_whole_rows_and_a_resume_finishes_it(launches):
    code, out, err, cwd = launches["W"]  # (launches waited at most TIMEOUT_S: no rank hung in a collective)
    assert code != 0 and 1 not in rank_codes(cwd), err[-3000:]  # rank 1 never returned
    text, saved, card, events = launches["W-left"]  # what the killed job left, before the resume
    assert text.endswith("\n")  # whole rows: no line cut short
    steps = [int(line.split(",")[0]) for line in text.splitlines()[1:]]
    assert steps == list(range(1, len(steps) + 1)) and 1 <= len(steps) <= 2, steps  # rank 1 died in step 3
    assert saved and saved[-1] <= f"step-{len(steps):08d}.pt"  # the rows reach the newest checkpoint
    # rank 0's collective failed when its peer's socket closed: it wrote the run card and run_end
    # alone (no collective) before torchrun's SIGTERM, which waited for them (it died of that
    # SIGTERM with nothing written: the card was left to the resume)
    assert card is not None and f"| ended | crashed after step {len(steps)}: RuntimeError: " in card, card
    assert '"event": "run_end", "message": "crashed after step' in events.splitlines()[-1]
    assert "Traceback" in err and rank_codes(cwd) == {}  # rank 0 raised (a crash): no code returned

    code, out, err, again = launches["W-resume"]  # torchrun again, --resume, without the kill
    assert rank_codes(again) == {0: ExitCode.OK, 1: ExitCode.OK}, err[-3000:]
    run = cwd / "runs" / "W"
    rows = (run / "steps.csv").read_text(encoding="utf-8").splitlines()[1:]
    assert [int(line.split(",")[0]) for line in rows] == [1, 2, 3, 4, 5, 6]
    assert "| ended | finished: 6 steps |" in (run / "RUN.md").read_text(encoding="utf-8")


def test_a_rank_stuck_in_a_collective_when_sigterm_comes_writes_the_card_alone_and_leaves(launches):
    # rank 1 hung (stopped) in step 3; the SIGTERM's Python handler never ran on rank 0, which waits
    # in the step's collective (as under NCCL, whose wait never returns): torchrun's SIGKILL came 30 s
    # on, with no card, no run_end. Now its stuck-watcher gives it its grace (10 s: its steps are
    # fast), then rank 0 closes alone and exits 143
    (waited,) = launches["H-waited"]
    code, out, err, cwd = launches["H"]
    run = cwd / "runs" / "H"
    assert waited is not None and 10 <= waited < TIMEOUT_S / 2, (waited, err[-3000:])
    assert code != 0 and rank_codes(cwd) == {}  # rank 0 left at once (os._exit), rank 1 was killed
    text = (run / "steps.csv").read_text(encoding="utf-8")
    steps = [int(line.split(",")[0]) for line in text.splitlines()[1:]]
    assert text.endswith("\n") and steps == list(range(1, len(steps) + 1)) and 1 <= len(steps) <= 2, steps
    (why,) = [e["message"] for e in run_events(run) if e["event"] == "run_end"]
    grace = re.fullmatch(rf"interrupted \(SIGTERM\) after step {len(steps)}: the process then waited over (\d+) s "
                         r"in a collective \(another process hung or died\?\)", why)
    assert grace and 10 <= int(grace[1]) <= waited + 1, why  # (10 s, or three of its slowest steps)
    assert f"| ended | {why} |" in (run / "RUN.md").read_text(encoding="utf-8")
    newest = sorted(p.name for p in (run / "checkpoints").glob("*.pt"))[-1]
    assert newest == f"step-{len(steps):08d}.pt"  # (checkpoint.every=1: the last step's, none of the stuck one)
    assert f"ampguard: {why}; the rows up to step {len(steps)} stand (--resume goes on from checkpoints/{newest})" in err


def test_a_sigterm_to_torchrun_stops_every_rank_at_one_boundary_with_card_and_checkpoint(launches):
    code, out, err, cwd = launches["T"]
    assert rank_codes(cwd) == {0: ExitCode.TERMINATED, 1: ExitCode.TERMINATED}, f"torchrun exited {code}\n{err[-3000:]}"
    run = cwd / "runs" / "T"
    text = (run / "steps.csv").read_text(encoding="utf-8")
    steps = [int(line.split(",")[0]) for line in text.splitlines()[1:]]
    assert text.endswith("\n") and steps == list(range(1, len(steps) + 1)) and len(steps) > 3
    assert f"| ended | interrupted (SIGTERM) after step {steps[-1]} |" in (run / "RUN.md").read_text(encoding="utf-8")
    assert (run / "checkpoints" / f"step-{steps[-1]:08d}.pt").exists()  # the stop's own checkpoint, of that step


def test_a_sigterm_to_one_rank_stops_every_rank_at_one_boundary_and_every_rank_says_sigterm(launches):
    # a per-process kill, a supervisor's: the ranks agreed to stop but not on why, and rank 0 (no
    # signal of its own) ended with 130 and a card saying "Ctrl-C"
    code, out, err, cwd = launches["O"]
    assert rank_codes(cwd) == {0: ExitCode.TERMINATED, 1: ExitCode.TERMINATED}, f"torchrun exited {code}\n{err[-3000:]}"
    run = cwd / "runs" / "O"
    steps = [int(line.split(",")[0]) for line in (run / "steps.csv").read_text(encoding="utf-8").splitlines()[1:]]
    assert steps == list(range(1, len(steps) + 1)) and 2 <= len(steps) < 6, steps  # (the signal came in its forward)
    assert f"| ended | interrupted (SIGTERM) after step {steps[-1]} |" in (run / "RUN.md").read_text(encoding="utf-8")
    assert (run / "checkpoints" / f"step-{steps[-1]:08d}.pt").exists() and "Ctrl-C" not in out + err


def test_data_raising_on_every_rank_stops_every_rank_with_one_line_and_keeps_the_steps_before(launches):
    # every rank reads the same stream: the same record raises on each. It was a traceback per
    # rank, exit 1, a "crashed" card and no checkpoint; one process gave this line and exit 2
    code, out, err, cwd = launches["B"]
    assert rank_codes(cwd) == {0: ExitCode.BAD_INPUT, 1: ExitCode.BAD_INPUT}, f"torchrun exited {code}\n{err[-3000:]}"
    lines = [line for line in err.splitlines() if "ampguard: error: " in line]
    assert lines == ["ampguard: error: bad data at step 5: ValueError: corrupt record 33; the run is intact up to "
                     "step 4 (checkpoints/step-00000004.pt: --resume continues from there once the data is fixed)"]
    assert "[rank" not in err  # (no rank's traceback)
    run = cwd / "runs" / "B"
    assert "| ended | bad data at step 5: ValueError: corrupt record 33 |" in (run / "RUN.md").read_text(encoding="utf-8")
    assert sorted(p.name for p in (run / "checkpoints").glob("*.pt"))[-1] == "step-00000004.pt"


def test_data_raising_on_one_rank_alone_is_that_ranks_crash_after_waiting_for_the_others(launches):
    # a file only rank 1's node reads: rank 0 never raises, and a stop on rank 1 alone would
    # leave rank 0 waiting in the step's collective; rank 1 waits its grace for the others, then
    # raises (its traceback ends the job)
    code, out, err, cwd = launches["B1"]
    assert code != 0 and rank_codes(cwd) == {}, err[-3000:]  # (neither rank returned a code)
    assert "[rank1]: ValueError: corrupt record 33" in err and "bad data at step" not in err
    run = cwd / "runs" / "B1"
    card = (run / "RUN.md").read_text(encoding="utf-8")
    # rank 0's collective failed ("Connection closed by peer"); review 53e: the card and run_end
    # said only that, rank 1's error was in its stderr alone (another node's log): now its line
    said = "crashed after step 4: rank 1 raised ValueError: corrupt record 33 (rank 0 saw: "
    assert f"| ended | {said}" in card, card
    assert f'"message": "{said}' in (run / "events.jsonl").read_text(encoding="utf-8").splitlines()[-1]
    # review 53e: rank 0's traceback ended with the guard's note for a user's own loop ("the next
    # guard.backward() begins a new step"): no next step here, nor a guard the user called
    assert "[rank0]:" in err and "guard.backward()" not in err, err[-3000:]
    assert "[rank0]: ampguard: rank 1 raised ValueError: corrupt record 33; its traceback is in its own output" in err


def test_ranks_whose_options_build_models_of_other_shapes_are_refused_before_anything_is_written(launches):
    # task.options may differ between ranks (a node's own data path): one that sizes a buffer or
    # a layer had DDP raise its parameter-size traceback on every rank (FSDP2: SIGABRT on rank 0,
    # a header-only CSV left behind)
    code, out, err, cwd = launches["M"]
    assert rank_codes(cwd) == {0: ExitCode.BAD_INPUT, 1: ExitCode.BAD_INPUT}, f"torchrun exited {code}\n{err[-3000:]}"
    line = ("ampguard: error: the ranks built different models: table is [3] on rank 0, [5] on rank 1 (a task.options "
            "value that differs between the ranks?); every rank must build the same model")
    assert [x for x in err.splitlines() if "ampguard: error: " in x] == [line, line]  # (once per process)
    assert not (cwd / "runs").exists() and "[rank" not in err  # (no rank's traceback)


def test_a_start_up_refusal_on_one_rank_alone_is_every_ranks_with_its_line(launches):
    # review_51g: rank 1's factory could not read its node's file: rank 1 exit 2, rank 0 "ampguard:
    # interrupted", exit 143, waiting for torchrun's SIGTERM in its next collective (a launch of its
    # own: rank 1 leaves the group, which ends rank 0's collective; the refusal's line is in the store)
    code, out, err, cwd = launches["N"]
    assert rank_codes(cwd) == {0: ExitCode.BAD_INPUT, 1: ExitCode.BAD_INPUT}, f"torchrun exited {code}\n{err[-3000:]}"
    lines = [x for x in err.splitlines() if x.startswith("ampguard: ")]
    assert len(lines) == 2 and len(set(lines)) == 1 and "FileNotFoundError: node_data/rank1.pt" in lines[0], lines
    assert not (cwd / "runs").exists()


def test_a_factory_refused_on_rank_0_while_rank_1_waits_at_its_barrier_is_every_ranks_line(launches):
    # review_51k: a gather of the start-up's refusals hung this job (rank 0 in the gather, rank 1 in
    # the factory's barrier); the refusal's line left in the store ends both, exit 2 (a launch of its
    # own: rank 0 leaves the group, which ends rank 1's barrier)
    code, out, err, cwd = launches["NB"]
    assert rank_codes(cwd) == {0: ExitCode.BAD_INPUT, 1: ExitCode.BAD_INPUT}, f"torchrun exited {code}\n{err[-3000:]}"
    lines = [x for x in err.splitlines() if x.startswith("ampguard: ")]
    assert len(lines) == 2 and len(set(lines)) == 1 and "the download did not come" in lines[0], lines


def test_a_run_whose_nodes_have_their_own_task_options_resumes_with_them(launches):
    # review_51g: the checkpoint's config is rank 0's; rank 1 given its own option again was refused
    # alone ("task.options.node was 'a' ..., now 'b'"), the run never resumable
    code, out, err, cwd = launches["Y-resume"]
    assert rank_codes(cwd) == {0: 0, 1: 0}, f"torchrun exited {code}\n{err[-3000:]}"
    assert [r["step"] for r in read_rows(cwd.parent / "Y" / "runs" / "Y" / "steps.csv")] == ["1", "2", "3", "4"]


def test_a_warning_about_the_run_is_said_once_and_one_about_a_rank_by_that_rank_labelled(launches):
    # rank 1's own warning (its factory's model in eval mode) went unsaid: the console showed rank
    # 0's warnings alone, whatever they were about
    code, out, err, cwd = launches["Y"]
    assert rank_codes(cwd) == {0: 0, 1: 0}, f"torchrun exited {code}\n{err[-3000:]}"
    said = [line for line in err.splitlines() if line.startswith("ampguard: warning: ")]
    assert [line for line in said if "is in eval mode" in line] == [
        "ampguard: warning: rank 1: task.factory ../killed.py:build: the model is in eval mode (dropout off, BatchNorm "
        "statistics frozen) and trains so: call model.train() in the factory to train it in train mode"]
    assert [line.partition(":")[2][:60] for line in said if "task.options.node" in line] == [
        " warning: task.options.node is 'a' on rank 0, 'b' on rank 1:"]  # (rank 0's, once)
    rank_1 = (cwd.parent / "Y.rank1.stderr").read_text()
    assert "rank 1: task.factory" in rank_1 and "task.options.node" not in rank_1


def test_ranks_given_different_resume_checkpoints_are_refused_before_anything_is_cut(launches):
    # rank 0 cut the CSV back to its step 4 and set the later checkpoints aside while rank 1
    # trained on from step 6; then the job hung
    code, out, err, cwd = launches["Q"]
    assert rank_codes(cwd) == {0: ExitCode.BAD_INPUT, 1: ExitCode.BAD_INPUT}, f"torchrun exited {code}\n{err[-3000:]}"
    lines = {line for line in err.splitlines() if "ampguard: error: " in line}
    assert len(lines) == 1 and re.fullmatch(
        r"ampguard: error: the ranks were given different --resume checkpoints: step 4 of run (\S+) on rank 0, "
        r"step 6 of run \1 on rank 1; give every rank the same --resume", lines.pop()), err[-3000:]
    assert snapshot_of(cwd.parent / "K" / "runs" / "K") == launches["Q-left"]  # K's run, as it was


def test_a_ranks_own_signal_just_after_the_agreed_stop_is_not_a_second_one(launches):
    code, out, err, cwd = launches["L"]
    assert rank_codes(cwd) == {0: ExitCode.TERMINATED, 1: ExitCode.TERMINATED}, f"torchrun exited {code}\n{err[-3000:]}"
    run = cwd / "runs" / "L"
    assert "| ended | interrupted (SIGTERM) after step 3 |" in (run / "RUN.md").read_text(encoding="utf-8")
    assert (run / "checkpoints" / "step-00000003.pt").exists()


def test_a_sigterm_to_rank_0_alone_in_its_start_up_ends_every_rank_with_143_and_one_line(launches):
    # review_27b #1: rank 1 died of its collective's "Connection closed by peer" traceback, exit 1;
    # and again under load, after waiting 60 s for torchrun's SIGTERM: now it reads rank 0's word
    code, out, err, cwd = launches["G"]
    assert rank_codes(cwd) == {0: ExitCode.TERMINATED, 1: ExitCode.TERMINATED}, f"torchrun exited {code}\n{err[-3000:]}"
    # (torchrun's own traceback, its ChildFailedError for rank 0's 143, is not a rank's)
    assert not re.search(r"\[rank\d\]: Traceback", err) and err.count("ampguard: interrupted") == 2, err[-3000:]
    assert not (cwd / "runs" / "G").exists()
