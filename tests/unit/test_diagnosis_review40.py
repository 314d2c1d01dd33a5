"""Review 40d: locate's and validate's passes each start from the same state, not only the same
RNG state: the buffers a forward updates (a counter, a running normaliser, a cache) are put back
before every pass (items 1 and 2); locate names the call of a module called more than once
(item 3); a backward overflow that overflows with no loss scale too is no routine back-off of the
scaler, and an injected fault is named under a precision-range verdict too (item 4). The command
line's side is ``tests/e2e/test_diagnosis_runs_review40.py``."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ampguard.config import validate as make_config
from ampguard.locate import Diagnosis, Finding, diagnose, diagnose_group, find_fp32_scope
from ampguard.precision import Precision
from ampguard.tasks import build_task
from ampguard.validate import compare

CPU = torch.device("cpu")
FP16, BF16 = Precision("fp16", "cpu"), Precision("bf16", "cpu")


class Counting(nn.Module):
    """A Linear whose input is scaled by ``scales[calls - 1]`` (``later`` past the list), ``calls`` a
    buffer its forward counts up: the state a forward updates (an observation normaliser, a cache)."""

    def __init__(self, scales: list[float], weight: float, later: float = 1.0) -> None:
        super().__init__()
        self.l = nn.Linear(4, 1)
        self.scales, self.later = scales, later
        self.register_buffer("calls", torch.zeros(()))
        with torch.no_grad():
            self.l.weight.fill_(weight)
            self.l.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        i = int(self.calls) - 1
        return self.l(x * (self.scales[i] if i < len(self.scales) else self.later))


# ---------------------------------------------------------------------------- item 1: locate


def test_locate_replays_in_fp32_from_the_buffers_the_amp_pass_saw():
    # the first pass at the step's state overflows in FP32 too (2e39): a data/model problem; the FP32
    # replay ran with the counter the bf16 pass left (scale 1e-3: finite) and read precision-range
    model = Counting([1.0], 1e37, later=1e-3)
    x, y = torch.full((2, 4), 50.0), torch.zeros(2, 1)
    with torch.no_grad():
        assert not torch.isfinite(model.l(x)).any()
    d = diagnose(model, F.l1_loss, x, y, BF16)
    assert d.verdict == "data/model", d.message()
    assert d.fp32 is not None and d.fp32.where == "forward" and d.fp32.name == "l"
    assert float(model.calls) == 0.0  # put back after the whole diagnosis too


def test_each_scope_replay_starts_from_the_same_buffers():
    # inf on the first call only, in every precision: no scope fixes the batch; the second scope's replay
    # ran with the counter the first left (no inf) and read "only the whole model in FP32 fixes this batch"
    model = Counting([math.inf], 1.0)
    x, y = torch.ones(2, 4), torch.zeros(2, 1)
    scope, tried, at = find_fp32_scope(model, F.mse_loss, x, y, FP16, 1.0, "l")
    assert (scope, tried, at) == (None, ["l", ""], None)
    assert float(model.calls) == 0.0  # (the buffers as they were: put back after the scopes too)


def test_a_group_s_next_micro_batch_starts_from_the_buffers_the_one_before_left():
    # as in the step, micro-batch 2 runs with the counter micro-batch 1 left (2): its input x 1e3 makes the
    # Linear's output 4e5, past fp16's range, finite in FP32. Each micro-batch's replay began from the
    # counter as given (0), and micro-batch 2's overflow was never seen
    model = Counting([1.0, 1e3], 100.0)
    batch = (torch.ones(2, 4), torch.zeros(2, 1))
    d = diagnose_group(model, F.mse_loss, [batch, batch], FP16, 1.0)
    assert d.verdict == "precision-range", d.message()
    assert (d.amp.where, d.amp.name, d.fp32.where) == ("forward", "l", "none")
    assert d.fp32_scope == "l"
    assert float(model.calls) == 0.0


# ---------------------------------------------------------------------------- item 2: validate

STATEFUL = '''
import torch
from torch import nn


class Stateful(nn.Module):
    """Its output adds 1.0 once the buffer calls, counted up by the forward, is past 2."""

    def __init__(self, fp8):
        super().__init__()
        if fp8:  # (three Linear layers: the middle one converts, the first and last are kept)
            self.l = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))
        else:
            self.l = nn.Linear(16, 3)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return self.l(x) + (self.calls > 2).float()


def build(config):
    torch.manual_seed(0)
    model = Stateful(config.task.options.get("fp8", False))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 16, generator=g)
    y = torch.randint(0, 3, (32,), generator=g)
    return {"model": model, "data": [(x, y)], "loss_fn": nn.functional.cross_entropy, "held_out": (x, y),
            "mode": "classifier"}
'''


def _stateful_config(tmp_path, precisions, **options):
    (tmp_path / "stateful.py").write_text(STATEFUL, encoding="utf-8")
    return make_config({"task": {"factory": f"{tmp_path / 'stateful.py'}:build", "options": options},
                        "device": "cpu", "validation": {"precisions": precisions, "min_accuracy": 0.0,
                                                        "abs_tol": 0.05, "rel_tol": 0.05}})


def test_validate_does_not_blame_the_precision_for_a_buffer_the_forward_updates(tmp_path):
    # the FP32 passes ran with calls 1, 2 (3 with the boundary pass), bf16's with 3, 4: bf16 was REJECTED for
    # a difference of 1.0 the model's own counter made; the caller's model came back with calls 4, in eval mode
    config = _stateful_config(tmp_path, ["bf16"])
    task = build_task(config)
    model = task.model
    assert model.training
    v = compare(task, model, config, CPU)
    [bf16] = v.results
    assert bf16.ok, [(r.criterion, r.amp, r.decision) for r in bf16.rules]
    assert bf16.stats["max_abs_error"] < 0.05
    assert float(model.calls) == 0.0 and model.training and model.l.training


def test_validate_s_fp8_copy_starts_from_the_buffers_as_given(tmp_path):
    # the fp8 copy was made after the FP32 passes, with the counter they left (and counted on from there)
    pytest.importorskip("torchao")
    config = _stateful_config(tmp_path, ["fp8"], fp8=True)
    task = build_task(config)
    v = compare(task, task.model, config, CPU)
    [fp8] = v.results
    assert fp8.stats["max_abs_error"] < 0.5, [(r.criterion, r.amp, r.decision) for r in fp8.rules]
    assert float(task.model.calls) == 0.0


# ---------------------------------------------------------------------------- item 3: the call


class Twice(nn.Module):
    """``l`` called twice; only its second call overflows fp16 (300 x 300 = 9e4)."""

    def __init__(self) -> None:
        super().__init__()
        self.l, self.n, self.out = nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 1)
        with torch.no_grad():
            self.l.weight.copy_(torch.eye(4) * 300)
            self.l.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.n(self.l(self.l(x))))


def test_locate_names_the_call_of_a_module_called_more_than_once():
    d = diagnose(Twice(), F.mse_loss, torch.ones(3, 4), torch.zeros(3, 1), FP16)
    assert (d.verdict, d.amp.where, d.amp.name, d.amp.call) == ("precision-range", "forward", "l", 2)
    assert "in the forward output of l (its call 2) (Linear;" in d.message()
    assert d.as_dict()["amp"]["call"] == 2
    # a module called once says nothing of calls
    once = Finding("forward", "l", "Linear", "inf", ["float16"], ["float16"], "fp16")
    assert once.call == 1 and "call" not in once.place_text()


# ---------------------------------------------------------------------------- item 4: the scale


def test_a_backward_overflow_that_overflows_with_no_loss_scale_too_is_not_routine():
    # targets of 1e8: the gradient (~1e8) overflows fp16 at any scale, 1 included: halving does not answer it
    lin = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    x, y = torch.ones(2, 4), torch.full((2, 1), 1e8)
    d = diagnose(lin, F.mse_loss, x, y, FP16, loss_scale=65536.0)
    assert d.verdict == "precision-range" and d.amp.where == "backward" and d.overflows_unscaled
    message = d.message()
    assert "routine" not in message and "halving the scale and skipping" not in message
    assert "the gradient scaled by 65536 overflows fp16" in message
    assert "overflows fp16 with no loss scale too" in message
    assert "fixes this batch" in message  # (a range problem: where to look, as with no loss scale)
    assert d.as_dict()["overflows_unscaled"] is True
    # one that is finite with no loss scale is still the scaler's routine back-off
    small = diagnose(lin, F.mse_loss, x, torch.full((2, 1), 100.0), FP16, loss_scale=2.0**20)
    assert not small.overflows_unscaled and "routine while it settles" in small.message()


def test_an_injected_fault_is_named_under_a_precision_range_verdict_too():
    amp = Finding("backward", "weight", "Linear", "inf", precision="fp16", loss=1.2e16)
    d = Diagnosis(amp, Finding("none", precision="fp32"), "precision-range", 1.0, injected=["spike@3"])
    assert "precision-range problem (the gradient overflows fp16 with no loss scale); this step carries the " \
           "injected spike@3" in d.message()
