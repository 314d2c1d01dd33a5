"""Review 46a: the module-alone FP32 replays judged a scope by the whole pass at the step's own
loss scale, so at an fp16 run's first skip (scale 65536, the scaler's opening search) the scaled
backward overflowed in every scope and a forward overflow one Linear in FP32 fixes was blamed on
"only the whole model in FP32". A scope left with only a gradient overflow is now replayed at the
lowest scale the scaler reaches, and a fix there counts (said so)."""
import json

import torch
from torch import nn

from ampguard.locate import diagnose, find_fp32_scope
from ampguard.precision import Precision

FP16 = Precision("fp16", "cpu")


class Big(nn.Module):
    """Its Linear outputs ~1.2e5, past fp16's 65504; the `* 1e-3` after it brings it back in range."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        with torch.no_grad():
            self.lin.weight.fill_(1000.0)
            self.lin.bias.zero_()

    def forward(self, x):
        return self.lin(x) * 1e-3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block, self.other, self.head = Big(), nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x):
        return self.head(torch.relu(self.other(self.block(x))))


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.full((8, 4), 30.0) + torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)


def test_at_the_first_skips_scale_the_module_alone_is_named_with_the_scalers_back_off_said():
    x, y = _batch()
    d = diagnose(Net(), nn.functional.mse_loss, x, y, FP16, 65536.0, scale_floor=1.0)
    assert d.verdict == "precision-range" and d.amp.where == "forward" and d.amp.name == "block.lin"
    assert (d.fp32_scope, d.scope_scale, d.scopes_tried) == ("block.lin", 1.0, ["block.lin"])
    message = d.message()
    assert "keeping block.lin in FP32 (autocast off around it alone) fixes this batch" in message
    assert "finite at 1; scaled by 65536 its gradient still overflows fp16" in message, message
    assert "whole model" not in message
    assert json.loads(json.dumps(d.as_dict()))["scope_scale"] == 1.0
    # at scale 1 the same scope fixes it outright: nothing about the scaler is said
    d1 = diagnose(Net(), nn.functional.mse_loss, x, y, FP16, 1.0, scale_floor=1.0)
    assert (d1.fp32_scope, d1.scope_scale) == ("block.lin", 1.0)
    assert d1.message().endswith("keeping block.lin in FP32 (autocast off around it alone) fixes this batch")


def test_a_scaler_that_cannot_back_off_below_the_steps_scale_keeps_the_old_verdict():
    # the floor at the step's scale: the scaled gradient's overflow is no longer the scaler's to answer
    x, y = _batch()
    d = diagnose(Net(), nn.functional.mse_loss, x, y, FP16, 65536.0, scale_floor=65536.0)
    assert (d.fp32_scope, d.scope_scale) == ("", 65536.0)
    # (block.lin, then head beside it: the rest of the model's weights, every Linear: the model itself, review 49a)
    assert d.scopes_tried == ["block.lin", "block.lin + head", ""]
    assert ("keeping block.lin or block.lin + head in FP32 does not fix it; the whole model in FP32 (autocast off, "
            "the same loss scale) fixes this batch") in d.message()


def test_a_floor_between_keeps_its_own_scale_and_the_search_goes_up_where_the_floor_overflows_too():
    x, y = _batch()
    # a floor of 4: block.lin in FP32, scaled by 4, is finite: named at 4
    d = diagnose(Net(), nn.functional.mse_loss, x, y, FP16, 65536.0, scale_floor=4.0)
    assert (d.fp32_scope, d.scope_scale) == ("block.lin", 4.0) and "finite at 4;" in d.message()
    # the same scope search with no lower scale: every scope below the model leaves the gradient overflow
    scope, tried, at = find_fp32_scope(Net(), nn.functional.mse_loss, x, y, FP16, 65536.0, "block.lin")
    assert (scope, tried, at) == ([""], ["block.lin", "block.lin + head", ""], 65536.0)


def test_a_backward_overflow_halving_answers_is_not_given_a_scope_at_a_lower_scale():
    # no forward overflow: only the gradient scaled by 2**24 overflows fp16, finite with no scale;
    # what answers it is the scaler's halving, not a module in FP32 (the search keeps the step's scale)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    x, y = torch.full((8, 4), 3.0), torch.full((8, 1), 50.0)
    d = diagnose(model, nn.functional.mse_loss, x, y, FP16, 2.0**24, scale_floor=1.0)
    assert d.amp.where == "backward" and not d.overflows_unscaled, d.message()
    assert d.scope_scale in (None, 2.0**24)
    assert "routine while it settles" in d.message() and "backs off to" not in d.message()
