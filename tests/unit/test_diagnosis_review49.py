"""Review 49a: what `locate` names and advises. In backward it named the first parameter whose
gradient went non-finite, the module before the one whose backward overflowed; its FP32 scope
search climbed only to parents, so a value one module's FP32 output left to the next read "only
the whole model in FP32 fixes this batch"; a value the caller's code made and passed as a second
argument was blamed on the module it was passed to; an accumulated step's finding did not say
which micro-batch held it. Review 49b: AmpTrainState's signature hid Guard's keywords."""
from __future__ import annotations

import inspect
from collections import OrderedDict

import torch
from torch import nn
from torch.nn import functional as F

from ampguard import AmpTrainState
from ampguard.locate import diagnose, diagnose_group, fp32_around, trace_first_non_finite
from ampguard.precision import Precision, keep_in_fp32

FP16 = Precision("fp16", "cpu")


def _filled(layer: nn.Linear, weight: float) -> nn.Linear:
    with torch.no_grad():
        layer.weight.fill_(weight)
        if layer.bias is not None:
            layer.bias.zero_()
    return layer


def _finite_with(model: nn.Module, kept: list[str], x: torch.Tensor, y: torch.Tensor) -> bool:
    """The batch's loss and every gradient finite under fp16 autocast with ``kept`` in FP32."""
    model.zero_grad(set_to_none=True)
    with fp32_around(model, kept):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x), y)
        loss.float().backward()
    finite = bool(torch.isfinite(loss)) and all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()
                                                if p.grad is not None)
    model.zero_grad(set_to_none=True)
    return finite


def backward_born() -> nn.Sequential:
    """1's forward is fine (1e-4 in, 3 out), its input gradient (3e4 x the output's) is past fp16's max;
    its own weight's gradient (the small input x the output's) is not."""
    return nn.Sequential(_filled(nn.Linear(4, 4), 1e-4), _filled(nn.Linear(4, 4), 3e4), _filled(nn.Linear(4, 1), 1.0))


def test_a_backward_overflow_is_named_where_the_backward_made_it_not_at_the_next_parameter():
    model, x, y = backward_born(), torch.ones(8, 4), torch.zeros(8, 1)
    found = trace_first_non_finite(model, F.mse_loss, x, y, FP16)
    assert (found.where, found.grad, found.name, found.op, found.before) == ("backward", "input", "1", "Linear", "0")
    assert found.place_text().startswith("in backward, the input gradient of 1 (Linear), made by its backward from a "
                                         "finite gradient of its output")
    assert model[1].weight.grad is None  # (the pass put .grad back)
    d = diagnose(model, F.mse_loss, x, y, FP16)
    assert d.verdict == "precision-range" and d.amp.name == "1"
    # 1 alone in FP32 still hands 0 its gradient in fp16 (0's output is fp16): 0 is kept beside it
    assert (d.fp32_scope, d.fp32_also, d.scopes_tried) == ("1", ["0"], ["1", "1 + 0"])
    assert "keeping 1 and 0 in FP32 together (autocast off around each; fp32_modules=[1,0]) fixes this batch" \
        in d.message()
    assert d.as_dict()["fp32_also"] == ["0"]
    # the advice is an experiment: so kept (as fp32_modules keeps them in a run) the batch is finite; 1 alone is not
    assert _finite_with(model, ["1", "0"], x, y) and not _finite_with(model, ["1"], x, y)
    keep_in_fp32(model, ["1", "0"])
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model(x), y)
    loss.float().backward()
    assert all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())


class Chain(nn.Module):
    """a's output 1e5 is past fp16's max; b (x 1e-3) brings it back, but autocast casts b's input to fp16
    first: a and b in FP32 together fix it, c and d stay in fp16 (the model is not all they are)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = _filled(nn.Linear(2, 2), 1e3), _filled(nn.Linear(2, 2), 1e-3)
        self.c, self.d = _filled(nn.Linear(2, 2), 1.0), _filled(nn.Linear(2, 1), 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(torch.relu(self.c(self.b(self.a(x)))))


def test_two_modules_in_fp32_together_are_advised_where_neither_alone_nor_a_parent_short_of_the_model_fixes_it():
    model, x, y = Chain(), torch.full((1, 2), 50.0), torch.zeros(1, 1)
    d = diagnose(model, F.mse_loss, x, y, FP16)
    assert d.verdict == "precision-range" and (d.amp.where, d.amp.name) == ("forward", "a")
    assert (d.fp32_scope, d.fp32_also) == ("a", ["b"])  # (it read "only the whole model" before)
    assert d.scopes_tried == ["a", "a + b"]
    assert "keeping a and b in FP32 together" in d.message() and "whole model" not in d.message()
    assert _finite_with(model, ["a", "b"], x, y) and not _finite_with(model, ["a"], x, y)
    assert all("forward" not in vars(m) for m in model.modules())  # (the replays' wrappers are gone)


def test_a_set_that_holds_every_weighted_module_of_its_parent_is_said_as_that_parent():
    body = nn.Sequential(OrderedDict(a=_filled(nn.Linear(2, 2), 1e3), b=_filled(nn.Linear(2, 2), 1e-3)))
    model = nn.Sequential(OrderedDict(body=body, head=_filled(nn.Linear(2, 1), 0.1)))
    d = diagnose(model, F.mse_loss, torch.full((1, 2), 50.0), torch.zeros(1, 1), FP16)
    assert (d.fp32_scope, d.fp32_also) == ("body", [])
    assert d.scopes_tried == ["body.a", "body"]
    assert "keeping body in FP32 (autocast off around it alone) fixes this batch" in d.message()


class Mix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = _filled(nn.Linear(4, 4), 0.1)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.proj(a) + b


class Memory(nn.Module):
    """The model's own torch.exp (exp(20) = 4.9e8, inf in fp16) passed to mix as its second argument."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.mix, self.head = _filled(nn.Linear(4, 4), 5.0), Mix(), _filled(nn.Linear(4, 1), 1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mix(x, torch.exp(self.enc(x))))


def test_a_value_the_callers_code_made_and_passed_as_a_later_argument_is_the_callers():
    found = trace_first_non_finite(Memory(), F.mse_loss, torch.ones(8, 4), torch.zeros(8, 1), FP16)
    assert (found.where, found.name, found.op, found.before) == ("forward", "", "Memory", "mix")
    assert found.place_text().startswith("in the forward code of <model> itself (Memory;")


class Masked(nn.Module):
    """scores x 1e5 (past fp16's max), then a -inf mask added: the mask in the second argument is no finding."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = _filled(nn.Linear(2, 2), 1e5)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + mask


class WithMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.att = Masked()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.tensor([0.0, -torch.inf])
        return self.att(x, mask)[:, :1]


def test_a_minus_inf_mask_in_a_later_argument_still_leaves_the_module_its_own_overflow():
    found = trace_first_non_finite(WithMask(), F.mse_loss, torch.ones(1, 2), torch.zeros(1, 1), FP16)
    assert (found.where, found.name) == ("forward", "att.lin")


def test_an_accumulated_steps_finding_names_its_micro_batch_whose_loss_it_quotes():
    model = nn.Sequential(_filled(nn.Linear(2, 2), 1.0), nn.ReLU(), _filled(nn.Linear(2, 1), 1.0))
    clean, big = (torch.ones(4, 2), torch.zeros(4, 1)), (torch.full((4, 2), 1e4), torch.zeros(4, 1))
    d = diagnose_group(model, F.mse_loss, [clean, big], FP16)
    assert (d.amp.micro_batch, d.amp.micro_batches) == (2, 2)
    assert d.message().startswith("first inf under fp16 in micro-batch 2 of 2: ")
    assert diagnose_group(model, F.mse_loss, [big], FP16).amp.micro_batch == 0  # (one micro-batch: nothing to say)


def test_the_losss_own_backward_is_named_and_the_module_whose_output_it_is_kept():
    lin = _filled(nn.Linear(4, 1, bias=False), 1.0)
    x, y = torch.ones(2, 4), torch.full((2, 1), 1e8)  # dL/dout ~ -1e8: inf in fp16, the output's dtype
    found = trace_first_non_finite(lin, F.mse_loss, x, y, FP16)
    assert (found.where, found.grad, found.op) == ("backward", "loss", "mse_loss")
    assert found.place_text().startswith("in backward, the gradient of the model's output, made by the loss's "
                                         "backward (mse_loss)")
    assert diagnose(lin, F.mse_loss, x, y, FP16).fp32_scope == ""  # (lin is the model: its output float32)


def test_amp_train_states_signature_shows_guards_keywords():
    params = inspect.signature(AmpTrainState).parameters
    assert list(params)[:3] == ["model", "optimizer", "loss_fn"]
    assert params["precision"].default == "fp16" and params["max_norm"].default == 1.0
    assert params["accumulation_steps"].default == 1 and params["precision"].kind is inspect.Parameter.KEYWORD_ONLY


# ---- review 49d: the new attribution on real shapes


def _finite_kept(model: nn.Module, kept: list[str], x: torch.Tensor, loss_fn=None) -> bool:
    """``kept`` in FP32 as ``fp32_modules`` keeps them in a run (a copy of the model): the fp16 pass finite."""
    import copy

    copied = copy.deepcopy(model)
    keep_in_fp32(copied, kept)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = (loss_fn or _summed)(copied(x), None)
    loss.float().backward()
    return bool(torch.isfinite(loss)) and all(bool(torch.isfinite(p.grad).all()) for p in copied.parameters()
                                              if p.grad is not None)


def _summed(out: torch.Tensor, _targets: object) -> torch.Tensor:
    return out.float().sum()


class Residual(nn.Module):
    """h = inp(x) in fp16, read by fc and by the residual add: each gradient 40000, finite; their fp16 sum is not."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.fc = _filled(nn.Linear(4, 4), 1e-3), _filled(nn.Linear(4, 4, bias=False), 0.25)
        self.out = _filled(nn.Linear(4, 1), 4e4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.out(h + self.fc(h))


def test_a_residuals_summed_gradient_is_the_sums_not_the_readers_and_its_maker_is_advised():
    model, x = Residual(), torch.ones(1, 4)
    d = diagnose(model, _summed, x, None, FP16)
    assert (d.amp.where, d.amp.grad, d.amp.before, d.amp.also) == ("backward", "code", "inp", ["fc"])
    assert d.amp.place_text().startswith("in backward, the gradient of the output of inp, summed from what reads it "
                                         "(fc, each one's own input gradient finite, and any code of <model> (Residual)")
    assert (d.fp32_scope, d.fp32_also, d.scopes_tried) == ("inp", [], ["inp"])  # (it advised fc and inp)
    assert _finite_kept(model, ["inp"], x) and not _finite_kept(model, ["fc"], x)


class ThreeReaders(nn.Module):
    """h = proj(x) read by q, k and v: each input gradient 2.8e4, their sum 8.4e4, past fp16's max."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.out = _filled(nn.Linear(4, 4), 1e-3), _filled(nn.Linear(4, 1), 1e4)
        self.q, self.k, self.v = (_filled(nn.Linear(4, 4, bias=False), 0.7) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return self.out(self.q(h) + self.k(h) + self.v(h))


def test_a_sum_of_several_readers_gradients_advises_the_module_whose_output_it_is_alone():
    model, x = ThreeReaders(), torch.ones(1, 4)
    d = diagnose(model, _summed, x, None, FP16)
    assert (d.amp.grad, d.amp.before, d.amp.also) == ("code", "proj", ["q", "k", "v"])
    assert (d.fp32_scope, d.fp32_also) == ("proj", [])  # (it advised q, k, v and proj)
    assert _finite_kept(model, ["proj"], x) and not _finite_kept(model, ["q", "k", "v"], x)


def test_the_module_before_a_parameter_free_activation_is_the_one_named_to_keep_beside():
    # 2's input gradient overflows; the ReLU between cannot hold it in FP32: 0, whose output it is, can
    model = nn.Sequential(_filled(nn.Linear(4, 4), 1e-4), nn.ReLU(), _filled(nn.Linear(4, 4), 3e4),
                          _filled(nn.Linear(4, 1), 1.0))
    x, y = torch.ones(8, 4), torch.zeros(8, 1)
    d = diagnose(model, F.mse_loss, x, y, FP16)
    assert (d.amp.grad, d.amp.name, d.amp.before) == ("input", "2", "0")
    assert (d.fp32_scope, d.fp32_also, d.scopes_tried) == ("2", ["0"], ["2", "2 + 0"])  # (no replay keeping the ReLU)
    assert _finite_kept(model, ["2", "0"], x, lambda out, _: F.mse_loss(out.float(), y))


class Scores(nn.Module):
    """q k^T x 3e3 in the module's own code (autocast runs the matmul in fp16): its backward overflows."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.q, self.k, self.v, self.sm = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d), nn.Softmax(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sm(self.q(x) @ self.k(x).transpose(-1, -2) * 3e3) @ self.v(x)


class WithScores(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.enc, self.attn, self.head = nn.Linear(d, d), Scores(d), nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(self.enc(x)))


def test_a_gradient_a_modules_own_code_makes_from_a_kept_ones_output_keeps_that_module():
    torch.manual_seed(0)
    model = WithScores()
    with torch.no_grad():
        model.attn.q.weight.mul_(0.003)
        model.attn.k.weight.mul_(0.003)
        model.head.weight.fill_(0.1)
    x, scale = torch.randn(1, 6, 8), 2.0 ** 14
    d = diagnose(model, _summed, x, None, FP16, scale, scale_floor=scale)
    # k kept in FP32, the scores' matmul (autocast: fp16) still hands its output an fp16 gradient: attn's code is
    # kept instead, taking k's place
    assert d.scopes_tried[-1] == "head + attn" and (d.fp32_scope, d.fp32_also) == ("head", ["attn"])
    assert "attn.k" in " ".join(d.scopes_tried[:-1])


def test_the_places_hold_no_tensor_so_autograd_frees_activations_as_it_would():
    import gc
    import weakref

    from ampguard.locate import _Flows

    lin, flows = nn.Linear(2, 2), _Flows(nn.Linear(1, 1), {}, [], "fp16")
    x = lin(torch.ones(1, 2))  # (a non-leaf: a module output, read by the next module)
    args, _ = flows.read(lin, (x,), {}, None)
    assert args[0] is not x and torch.equal(args[0], x)  # (its own alias: the values unchanged)
    assert not any(isinstance(v, torch.Tensor) for place in flows.places.values() for v in place.values())
    dead = weakref.ref(x)
    del x, args
    gc.collect()
    assert dead() is None  # (it held them before review 49d: +139% peak memory under activation checkpointing)
    flows.close()


# ---- review 49i: the aliases against what models do with their arguments


class Collect(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, feats: list, state: dict) -> torch.Tensor:
        y = self.lin(x)
        feats.append(y)  # (a feature pyramid's list, an incremental decoder's state: written into)
        state["prev"] = y
        return y


class Collecting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = Collect(), Collect()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feats: list = []
        state: dict = {}
        self.c2(self.c1(x, feats, state), feats, state)
        return (torch.stack(feats).sum(0) + state["prev"]) * 1e5


class SameTwice(nn.Module):
    """kv is x: the self-attention path (nn.MultiheadAttention takes its packed projection so)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * 1e5 if kv is x else self.lin(x) * 0


class CallsSameTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.i = nn.Linear(4, 4), SameTwice()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.i(h, h)


def test_a_module_writing_into_a_list_or_dict_argument_is_diagnosed_as_it_runs():
    # the replay handed each module new copies of its lists and dicts: its writes were lost, diagnose() raised
    torch.manual_seed(0)
    model, x, y = Collecting(), torch.ones(2, 4), torch.zeros(2, 4)
    d = diagnose(model, F.mse_loss, x, y, FP16)
    assert d.verdict == "precision-range" and d.amp.where == "forward"


def test_one_tensor_passed_twice_is_one_alias_so_identity_holds_inside_the_module():
    torch.manual_seed(0)
    d = diagnose(CallsSameTwice(), F.mse_loss, torch.ones(2, 4), torch.zeros(2, 4), FP16)
    assert (d.amp.where, d.amp.name) == ("forward", "i")  # (two aliases took the `* 0` path: "no non-finite value")


class PassesOut(nn.Module):
    """blk (a Sequential) passes its last child's output out; the model's own code (x 1e5) overflows its gradient."""

    def __init__(self, reentrant: bool | None = None) -> None:
        super().__init__()
        self.a, self.blk, self.reentrant = nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.reentrant is None:
            return self.blk(h) * 1e5
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.blk, h, use_reentrant=self.reentrant) * 1e5


def test_a_code_finding_names_the_code_that_reads_the_value_not_the_container_that_passed_it_on():
    for reentrant in (None, False, True):  # (a reentrant recompute calls blk alone: not the model's output)
        torch.manual_seed(0)
        found = trace_first_non_finite(PassesOut(reentrant), F.mse_loss, torch.ones(2, 4), torch.zeros(2, 4), FP16)
        assert (found.grad, found.name, found.op, found.before) == ("code", "", "PassesOut", "blk.1"), reentrant


def test_modules_that_are_a_whole_block_count_as_the_block_against_the_cap():
    from ampguard.locate import _merged

    model = nn.Sequential(*(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)) for _ in range(3)))
    assert _merged(model, ["2.0", "1.1", "1.0", "0.1"]) == ["2.0", "0.1", "1"]
    assert sorted(_merged(model, ["0.0", "0.1", "1.0", "1.1", "2.0", "2.1"])) == ["0", "1", "2"]  # (not the model)


def test_a_first_skip_diagnosis_whose_replay_raises_ends_no_run():
    from ampguard.guards import FirstSkipDiagnosis
    from ampguard.step import AmpTrainState

    class Breaks(nn.Linear):
        calls = 0

        def forward(self, x):
            Breaks.calls += 1
            if Breaks.calls > 2:  # (the step's two passes ran; the replay's raise)
                raise RuntimeError("a model the replay cannot run")
            return super().forward(x)

    model = Breaks(2, 1)
    state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, precision="bf16")
    diagnosis = FirstSkipDiagnosis(state, model)
    for x in (torch.ones(4, 2), torch.full((4, 2), float("nan"))):
        diagnosis.capture((x, torch.zeros(4, 1)))
        found = diagnosis.after(state.step(x, torch.zeros(4, 1)))
    assert found.startswith("step 2 (non_finite_loss): not replayed: its replay failed (RuntimeError: a model the "
                            "replay cannot run); `ampguard locate --step 2"), found


# ---- review 49j: the first-skip diagnosis under torchrun


def test_a_collective_in_a_replay_is_refused_before_it_is_issued_and_put_back_after(monkeypatch):
    # ranks replay different numbers of passes: a loss that all-reduces its sample count waited in a collective
    # the other rank never joined (the job hung at its first skip)
    import torch.distributed as dist

    from ampguard import distributed

    real = dist.all_reduce
    monkeypatch.setattr(distributed, "current", lambda: type("Info", (), {"active": True})())
    with distributed.no_collectives():
        try:
            dist.all_reduce(torch.ones(1))
        except distributed.CollectiveInReplay as err:
            assert "torch.distributed.all_reduce, a collective" in str(err)
        else:
            raise AssertionError("the collective went through")
        try:
            dist.distributed_c10d.all_gather_into_tensor(torch.ones(2), torch.ones(1))
        except distributed.CollectiveInReplay:
            pass
        else:
            raise AssertionError("the collective went through")
    assert dist.all_reduce is real and dist.distributed_c10d.all_reduce is real


def test_every_ranks_replay_failure_is_said_when_no_rank_found_a_value(monkeypatch):
    # rank 0 said "no non-finite value on any of the 2 ranks" while the faulted rank's replay had failed
    from ampguard import guards
    from ampguard.guards import FirstSkipDiagnosis
    from ampguard.step import AmpTrainState

    model = nn.Linear(2, 1)
    state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, precision="bf16")
    emitted = []
    diagnosis = FirstSkipDiagnosis(state, model, events=type("Events", (), {"emit": lambda _, e, *a: emitted.append(e)})())
    gathered = [(None, "RuntimeError: boom"), (None, "RuntimeError: boom"), (None, None)]
    monkeypatch.setattr(guards.distributed, "all_gather", lambda mine: gathered)
    x = torch.full((4, 2), float("nan"))
    diagnosis.capture((x, torch.zeros(4, 1)))
    found = diagnosis.after(state.step(x, torch.zeros(4, 1)))
    assert "not replayed: its replay failed (ranks 0, 1: RuntimeError: boom)" in found, found
    # the event names them too, as a finding's names its rank (review 50: it carried no rank)
    assert [(e["verdict"], e["ranks"], e["message"]) for e in emitted] == [("not replayed", [0, 1], found)]
