"""Review 52b: ``ampguard bench`` (its rounds in resolve mode, a reader that left, ``--quick`` with
``--rounds``, ``--threads`` on a GPU) and ``benchmarks/train_vs_bare.py``'s precisions."""

from __future__ import annotations

import contextlib
import errno
import io
import math
import subprocess
import sys

import pytest
import torch

from ampguard.precision import Precision


def test_resolve_mode_rounds_up_the_least_rounds_to_whole_cycles_so_a_budget_stop_keeps_them(capsys):
    # review 52b #1: four contenders (a cycle of 4 orders), --rounds 7 and a budget spent at once: 7 rounds ran,
    # the cut back to whole cycles kept 4, below the 7 asked and the 6 an interval needs (no 95% interval)
    from ampguard.bench import Bare, BareAgain, _mlp, balanced_orders, measure

    class BareB(Bare):
        name = "bare loop (B)"

    class BareC(Bare):
        name = "bare loop (C)"

    cpu, fp32 = torch.device("cpu"), Precision("fp32", "cpu")
    assert len(balanced_orders(4)) == 4
    results = measure(_mlp(cpu), fp32, cpu, [Bare, BareAgain, BareB, BareC], steps=1, rounds=7, warmup=1,
                      fused=False, resolve=0.01, budget_s=0.0)
    assert [(len(r.rounds), r.stop, r.stop_detail) for r in results] == [(8, "budget", None)] * 4
    assert all(sorted(r.positions) == [0, 0, 1, 1, 2, 2, 3, 3] for r in results)  # every place alike
    assert all(not math.isnan(r.ratio_low) and r.ratio_low <= r.ratio_to_bare <= r.ratio_high for r in results[1:])
    assert ("tiny-mlp fp32: at least 8 rounds, not 7: the rounds run whole cycles of the 4 round orders"
            in capsys.readouterr().out)


def test_resolve_mode_rounds_down_where_up_would_pass_the_most_rounds(capsys):
    # review 52k: --rounds 1000 with three contenders (a cycle of 6 orders) ran 1002, past the 1000 a case may run
    from ampguard.bench import Bare, BareAgain, _mlp, measure

    class BareB(Bare):
        name = "bare loop (B)"

    cpu, fp32 = torch.device("cpu"), Precision("fp32", "cpu")
    results = measure(_mlp(cpu), fp32, cpu, [Bare, BareAgain, BareB], steps=1, rounds=10, warmup=1, fused=False,
                      resolve=0.01, budget_s=0.0, max_rounds=10)
    assert [len(r.rounds) for r in results] == [6] * 3  # (whole cycles within the most: 6, not 12)
    assert ("tiny-mlp fp32: 6 rounds, not 10: the rounds run whole cycles of the 6 round orders, within the 10 a case "
            "may run" in capsys.readouterr().out)


def test_quick_takes_rounds_past_the_most_a_resolve_may_take_and_the_refusal_names_the_verb(capsys):
    # review 52b #4: --quick turns --resolve off and sets its own rounds, yet `--quick --rounds 2000` was refused
    # for the --resolve it overrides, in a line without the "bench:" every other bench refusal has
    from ampguard.cli import main

    assert main(["bench", "--quick", "--rounds", "2000", "--models", "nano", "--precisions", "fp32", "--no-peers"]) == 0
    assert "| nano-mlp | fp32 | ampguard + csv |" in capsys.readouterr().out
    assert main(["bench", "--rounds", "1001", "--models", "nano", "--precisions", "fp32", "--no-peers"]) == 2
    assert capsys.readouterr().err.strip() == ("ampguard: error: bench: --rounds 1001 is more than the 1000 rounds a case "
                                               "run to --resolve may take; --resolve 0 runs a fixed number of rounds")


def test_threads_on_a_gpu_is_refused_rather_than_ignored():
    # review 52b #5: --threads pins a CPU's intra-op threads; on cuda it did nothing, and nothing said so
    # ("threads": null in the JSON, no word in the header). (_check_args takes the device as given: no GPU needed)
    from ampguard.bench import _check_args
    from ampguard.errors import InputError

    cuda = torch.device("cuda")
    _check_args(cuda, ["nano"], ["fp32"], peak_tflops=None, resolve_pct=1.0, budget_s=10.0, threads=None)
    with pytest.raises(InputError, match=r"^bench: --threads 2 pins a CPU's intra-op threads; on cuda the steps run "
                                         r"on the GPU and it is not used: leave it out$"):
        _check_args(cuda, ["nano"], ["fp32"], peak_tflops=None, resolve_pct=1.0, budget_s=10.0, threads=2)
    _check_args(torch.device("cpu"), ["nano"], ["fp32"], peak_tflops=None, resolve_pct=1.0, budget_s=10.0, threads=2)


class _ReaderLeaves(io.StringIO):
    """stdout into a pipe whose reader leaves (``| head``): the writes from the one that holds ``at`` on
    fail with EPIPE, as a pipe with no reader does."""

    def __init__(self, at: str) -> None:
        super().__init__()
        self.at, self.left = at, False

    def write(self, text: str) -> int:
        if self.left or self.at in text:
            self.left = True
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")
        return super().write(text)


@pytest.mark.parametrize("at", ["nano-mlp fp32:", "| workload |"])  # (in the rounds' lines; at the table)
def test_a_bench_whose_reader_left_finishes_with_its_own_code_and_says_no_interrupt(monkeypatch, capsys, at):
    # review 52b #2: `bench | head -1`: the reader leaving made the hold around the output start stopped (SIGPIPE),
    # and the bench that ran to its end said "ampguard: interrupted", exit 141, an interrupt nobody sent.
    # A verb outside a run finishes with its own code (docs/design.md, as validate, report and compare do)
    from ampguard.cli import main

    out = _ReaderLeaves(at)
    monkeypatch.setattr(sys, "stdout", out)
    assert main(["bench", "--quick", "--models", "nano", "--precisions", "fp32", "--no-peers"]) == 0
    assert out.left and out.getvalue().startswith("ampguard bench on cpu")
    assert "interrupted" not in capsys.readouterr().err


def test_a_bench_across_processes_whose_reader_left_finishes_with_its_own_code(tmp_path, capsys):
    # review 52b #2, --processes: the rows printed into a pipe with no reader raised Interrupted(141)
    from ampguard import bench_processes as bp
    from ampguard.signals import tolerant_console

    child = tmp_path / "child.py"
    row = {"workload": "nano-mlp", "precision": "fp32", "contender": "ampguard + csv", "ratio_to_bare": 1.1,
           "half_width": 0.01}
    child.write_text(f"import json; print(json.dumps({{'results': [{row!r}]}}))", encoding="utf-8")

    def launch(argv):
        return subprocess.Popen([sys.executable, str(child)], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                start_new_session=True)

    with contextlib.redirect_stdout(_ReaderLeaves("| workload |")), tolerant_console():
        assert bp.run_across(2, [], resolve=None, as_json=False, launch=launch) == 0
    assert "interrupted" not in capsys.readouterr().err


@pytest.mark.parametrize("precision", ["fp8", "fp16"])
def test_train_vs_bare_refuses_a_precision_its_bare_loop_does_not_run_as_ampguard_train_does(monkeypatch, capsys,
                                                                                            precision):
    # review 52b #3: the bare loop is autocast, backward and step: for fp8 bf16 autocast with no float8 layers, for
    # fp16 no GradScaler, while `ampguard train` converts to Float8Linear / scales the loss; the figure (and the
    # goal's verdict) compared other work. Refused before any run, in one line
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "train_vs_bare", Path(__file__).resolve().parents[2] / "benchmarks" / "train_vs_bare.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    ran = []
    monkeypatch.setattr(script, "bare", lambda args: ran.append(args))  # (none may run: refused first)
    monkeypatch.setattr(sys, "argv", ["train_vs_bare.py", "--quick", "--device", "cpu", "--precision", precision])
    with pytest.raises(SystemExit) as stop:
        script.main()
    assert stop.value.code == 2 and not ran
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"train_vs_bare.py: error: --precision {precision}: the bare loop here runs bf16 or fp32 "
                           "only")
