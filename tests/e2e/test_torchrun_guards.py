"""Guard stops under torchrun (issue 16): CPU, gloo, 2 processes, two launches side by side.

- ``S``: ``--strict --inject nan_loss@3@rank1``. The NaN is born on rank 1 only; every rank must
  stop at step 3 with exit 3 (none cut short by torchrun's SIGTERM when another exits first),
  rank 0 writes the run card, and the first-skip diagnosis names rank 1 (rank 0's own replay
  is clean).
- ``D``: the same run under ``ulimit -f`` (2,000 bytes a file): rank 0's CSV finds no room; every
  rank stops at the same step with ``ExitCode.DISK_FULL`` (74), none waits in a collective.

Each rank runs ``ampguard.cli.main`` through a small wrapper that writes the exit code ``main``
returned to ``rank<R>.rc`` before leaving: torchrun reports only the first failure it sees.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from helpers import file_size_limit, run_events, torchrun, torchrun_env

from ampguard.errors import ExitCode

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                       reason="torch.distributed with the gloo backend is not available"),
]

TIMEOUT_S = 180
RUN = ["train", "--set", "task.name=linear", "--set", "precision=fp32", "--set", "device=cpu",
       "--set", "task.batch_size=8", "--set", "eval.enabled=false", "--set", "log.dir=runs"]
WRAPPER = '''
import os, sys
from pathlib import Path
from ampguard.cli import main

code = int(main(sys.argv[2:]))
Path(sys.argv[1], f"rank{os.environ['RANK']}.rc").write_text(str(code))
sys.exit(code)
'''


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """{name: (torchrun's exit code, stdout, stderr, working folder)} for S and D, run side by side."""
    work = tmp_path_factory.mktemp("torchrun_guards")
    wrapper = work / "rank_exit.py"
    wrapper.write_text(WRAPPER)
    specs = {
        "S": ([*RUN, "--set", "steps=6", "--set", "log.name=S", "--strict", "--inject", "nan_loss@3@rank1"], None),
        "D": ([*RUN, "--set", "steps=300", "--set", "log.every=1000", "--set", "checkpoint.enabled=false",
               "--set", "log.name=D"], file_size_limit(2000)),
    }
    env = torchrun_env(PYTHONDONTWRITEBYTECODE="1")
    started = {}
    try:
        for name, (args, limit) in specs.items():
            cwd = work / name
            cwd.mkdir()
            cmd = [*torchrun(), "--standalone", "--nproc_per_node", "2", str(wrapper), str(cwd), *args]
            started[name] = (subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                              stdin=subprocess.DEVNULL, text=True, start_new_session=True,
                                              preexec_fn=limit), cwd)
        results, t0 = {}, time.monotonic()
        for name, (proc, cwd) in started.items():
            try:
                out, err = proc.communicate(timeout=max(1.0, TIMEOUT_S - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
                pytest.fail(f"torchrun {name} did not finish within {TIMEOUT_S} s (a rank hangs?)\n{err[-3000:]}")
            results[name] = (proc.returncode, out, err, cwd)
        yield results
    finally:
        for proc, _ in started.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _rank_codes(cwd: Path) -> dict[int, int]:
    return {r: int((cwd / f"rank{r}.rc").read_text()) for r in (0, 1) if (cwd / f"rank{r}.rc").exists()}


def test_strict_mode_every_rank_stops_with_3_and_the_card_names_the_rank_of_the_nan(launches):
    code, out, err, cwd = launches["S"]
    assert _rank_codes(cwd) == {0: ExitCode.GUARD, 1: ExitCode.GUARD}, f"torchrun exited {code}\n{err[-3000:]}"
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


def test_a_full_disk_on_rank_0_stops_every_rank_at_the_same_step(launches):
    code, out, err, cwd = launches["D"]
    assert _rank_codes(cwd) == {0: ExitCode.DISK_FULL, 1: ExitCode.DISK_FULL}, f"torchrun exited {code}\n{err[-3000:]}"
    lines = [line for line in err.splitlines() if line.startswith("ampguard: error: ")]
    assert len(lines) == 1, err[-3000:]  # rank 0 says it, once
    # no rank's traceback (torchrun prints its own ChildFailedError for any non-zero exit)
    assert not [line for line in err.splitlines() if line.strip().startswith("File ") and "ampguard" in line]
    assert lines[0].startswith("ampguard: error: disk full while writing runs/D/steps.csv; the run is intact up to step ")
    assert not (cwd / "runs" / "D" / "RUN.md").exists()
