"""A second Ctrl-C mid-step under torchrun (review 49c H1): CPU, gloo, 2 processes, an early job
(conftest.py).

Rank 1 takes two SIGINTs 0.3 s apart in its second step's forward (a supervisor's per-process
signal; a terminal's double Ctrl-C reaches a rank the same way): the second interrupts the step
in flight, while rank 0 waits in the step's all-reduce for it. Rank 1 closed with a collective
(``_close``'s broadcast, then the leaving barrier) that rank 0, still in the all-reduce, never
joined: both ranks waited until gloo's 30 minutes, and the card then blamed a SIGTERM and "waited
over 10 s in a collective". Now rank 1 ends alone and leaves word in the store; rank 0's
all-reduce fails as it leaves, and rank 0 reads the word: every rank ends with 130 within
seconds, no traceback, and rank 0's card says "interrupted (Ctrl-C) after step 1".

A hang is bounded: once rank 1 has sent its second signal the launch is given ``HANG_S``, then
killed, and the test fails saying so.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from helpers import EARLY_TIMEOUT_S, RANK_EXIT, TORCHRUN, Launch, end_launches, rank_codes, torchrun_env

from ampguard.errors import ExitCode

pytestmark = TORCHRUN

HANG_S = 60.0
"""How long the job may take to end once rank 1's second signal was sent (it takes a few seconds;
a hang waited 30 minutes)."""

TWICE = '''
import os
import signal
import time
import torch
from torch import nn


class Twice(nn.Linear):
    calls = 0

    def forward(self, x):
        if self.training:  # (the start-up's check runs the first four batches as a step does: calls 1-4)
            Twice.calls += 1
            if os.environ["RANK"] == "1" and Twice.calls == 6:  # rank 1, in step 2's forward
                os.kill(os.getpid(), signal.SIGINT)  # the first: a stop at the next boundary
                time.sleep(0.3)
                with open("signalled", "w") as f:
                    f.write(str(time.monotonic()))
                os.kill(os.getpid(), signal.SIGINT)  # the second: the step in flight is interrupted
                time.sleep(5)  # (the handler raises in here)
        return super().forward(x)


def build(config):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(8)]
    return Twice(4, 1), data, nn.functional.mse_loss
'''
RUN = ["train", "--set", "task.factory=../twice.py:build", "--set", "precision=fp32", "--set", "device=cpu",
       "--set", "steps=8", "--set", "checkpoint.every=1", "--set", "eval.enabled=false", "--set", "log.dir=runs",
       "--set", "log.name=I", "--set", "log.plot=false"]


def early(work: Path) -> dict[str, object]:
    """{"I": (torchrun's code, stdout, stderr, folder), "hung": whether it ran past ``HANG_S`` after
    the second signal and was killed} (an early job: see conftest.py)."""
    (work / "rank_exit.py").write_text(RANK_EXIT)
    (work / "twice.py").write_text(TWICE)
    launch = Launch("I", [str(work / "rank_exit.py"), str(work / "I"), *RUN], work / "I", timeout_s=EARLY_TIMEOUT_S,
                    env=torchrun_env(PYTHONDONTWRITEBYTECODE="1"))
    try:
        signalled = work / "I" / "signalled"
        while launch.proc.poll() is None and not signalled.exists():
            if time.monotonic() - launch.started > EARLY_TIMEOUT_S:
                break
            time.sleep(0.2)
        sent = time.monotonic()
        while launch.proc.poll() is None and time.monotonic() - sent < HANG_S:
            time.sleep(0.2)
        hung = launch.proc.poll() is None
        if hung:
            launch.kill()
        launch.wait()
        return {"I": (launch.rc, launch.stdout, launch.stderr, launch.cwd), "hung": hung,
                "signalled": signalled.exists()}
    finally:
        end_launches([launch])


def test_a_second_sigint_mid_step_on_one_rank_ends_every_rank_with_130_and_no_hang(launches):
    code, out, err, cwd = launches["I"]
    assert launches["signalled"], f"rank 1 never reached step 2 (torchrun exited {code})\n{err[-3000:]}"
    assert not launches["hung"], f"the job still ran {HANG_S:g} s after rank 1's second SIGINT (a hang)\n{err[-3000:]}"
    assert rank_codes(cwd) == {0: ExitCode.INTERRUPTED, 1: ExitCode.INTERRUPTED}, \
        f"torchrun exited {code}\n{err[-3000:]}"
    # (torchrun's own traceback, which reports the ranks' codes, only: no rank's crash)
    assert err.count("Traceback (most recent call last)") == err.count("raise ChildFailedError("), err[-3000:]
    run = cwd / "runs" / "I"
    card = (run / "RUN.md").read_text(encoding="utf-8")
    ended = re.search(r"interrupted \(Ctrl-C\) after step (\d+)", card)
    assert ended, card
    assert "SIGTERM" not in card and "collective" not in card and "crashed" not in card
    rows = (run / "steps.csv").read_text(encoding="utf-8")  # whole rows, up to the last step rank 0 recorded
    steps = [line.split(",")[0] for line in rows.splitlines()[1:]]
    assert rows.endswith("\n") and steps == [str(s) for s in range(1, int(ended[1]) + 1)], rows


TEARDOWN = '''
import gc, os, signal, sys, time
from ampguard.signals import settled


class Slow:  # collected in the interpreter's C-level teardown (its last collection), where no Python handler runs
    def __del__(self, sleep=time.sleep, path=sys.argv[1], make=open):
        make(path, "w").close()
        sleep(3)


gc.disable()
cycle = Slow()
cycle.me = cycle
del cycle
settled(3)
sys.exit(3)
'''


def test_a_ctrl_c_in_the_interpreters_teardown_leaves_the_decided_code(tmp_path):
    # (review 49c M1: a torchrun rank garbage-collecting after main returned was killed by the
    # second Ctrl-C, torchrun reporting -2 for its decided 130)
    import os
    import signal
    import subprocess
    import sys

    script, there = tmp_path / "teardown.py", tmp_path / "in-teardown"
    script.write_text(TEARDOWN, encoding="utf-8")
    proc = subprocess.Popen([sys.executable, str(script), str(there)], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not there.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert there.exists(), proc.stderr.read() if proc.poll() is not None else "the teardown never came"
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 3, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
