"""Review 43a of the start-up check's put-back (``untouched``): what a pass captures into
a hook's closure (a statistic kept as a tensor, outputs appended to a list) is put back, a random
generator the model holds of its own is given its state back, a false alarm on captured outputs
beside None or as NumPy arrays, and a piece of state many hooks share is judged once."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from helpers import caught_warnings
from helpers import check_reader as reader
from ampguard import untouched
from ampguard.build import check_forward
from ampguard.precision import Precision

FP32 = Precision("fp32", "cpu")
BATCH = (torch.linspace(-3, 5, 32).reshape(8, 4), torch.zeros(8, 2))


def checked(model: nn.Module) -> list[str]:
    """The warnings of the start-up's check (four passes) of ``model``."""
    return caught_warnings(lambda: check_forward(model, nn.functional.mse_loss, reader(BATCH), FP32, "task toy"))


def twins(make) -> tuple[nn.Module, nn.Module]:
    """Two models ``make()`` builds from the same seed."""
    torch.manual_seed(0)
    a = make()
    torch.manual_seed(0)
    return a, make()


def running_amax() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A hook that clamps a layer's output to a running amax it keeps as a tensor in a dict of its
    closure (a hand-rolled delayed scaling), replaced each forward; and the dict."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    amax = {"act": torch.tensor(1.0)}

    def clip_to_history(module, args, out):
        bound = amax["act"]
        amax["act"] = torch.maximum(0.9 * amax["act"], out.detach().abs().max())
        return out.clamp(-bound, bound)

    model[0].register_forward_hook(clip_to_history)
    return model, amax


def test_a_statistic_a_hook_keeps_as_a_tensor_in_its_closure_is_put_back():
    # 43a #1: read as a captured cache (42f), the running amax the check's four passes moved was neither put back
    # nor said: the run's first forward clamped to another bound than a plain loop's
    (plain, _), (model, amax) = twins(running_amax)
    assert checked(model) == []
    assert amax["act"].item() == 1.0
    assert torch.equal(model(BATCH[0]), plain(BATCH[0]))


def test_outputs_a_hook_appends_to_a_list_in_its_closure_are_taken_out():
    # 43a #2: activation regularisation, a list the loss sums and clears: the check's forward-only passes left
    # three batches' outputs (and their graphs) in it, and the run's first loss counted them, silently
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    acts: list[torch.Tensor] = []
    model[1].register_forward_hook(lambda module, args, out: acts.append(out))
    assert checked(model) == []
    assert acts == []


class OwnGenerator(nn.Module):
    """Random masking drawn from a generator of the module's own (MAE's), of each kind."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.net, self.kind = nn.Linear(4, 2), kind
        self.gen = {"torch": torch.Generator().manual_seed(1234), "numpy": np.random.default_rng(1234),
                    "numpy-legacy": np.random.RandomState(1234), "random": random.Random(1234)}[kind]

    def forward(self, x):
        if self.kind == "torch":
            keep = torch.rand(x.shape, generator=self.gen)
        elif self.kind == "random":
            keep = torch.tensor([[self.gen.random() for _ in range(x.shape[1])] for _ in range(x.shape[0])])
        else:
            keep = torch.from_numpy(self.gen.random(x.shape)).float()
        return self.net(x * (keep > 0.25))


def noisy_hook() -> nn.Module:
    """NEFTune-like noise drawn from a generator in a hook's closure."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    gen = torch.Generator().manual_seed(1234)
    model[0].register_forward_hook(lambda module, args, out: out + 0.1 * torch.randn(out.shape, generator=gen))
    return model


@pytest.mark.parametrize("make", [*(lambda kind=kind: OwnGenerator(kind)
                                    for kind in ("torch", "numpy", "numpy-legacy", "random")), noisy_hook],
                         ids=["torch", "numpy", "numpy-legacy", "random", "in-a-hook"])
def test_a_generator_the_model_holds_of_its_own_is_given_its_state_back(make):
    # 43a #5: rng_kept keeps the global generators only; the check's passes drew from the model's own, so the
    # run's first masks differed from a plain loop's, silently
    plain, model = twins(make)
    assert checked(model) == []
    assert torch.equal(model(BATCH[0]), plain(BATCH[0]))


def test_a_generator_whose_state_cannot_be_read_is_left():
    model = OwnGenerator("random")
    model.gen = random.SystemRandom()  # (getstate raises)
    assert checked(model) == []


class Capture(nn.Module):
    """A model whose hooks capture what each layer returns, as feature extraction does: a tuple
    with None (an attention layer's ``(output, None)``), a NumPy copy, a shape, or the last
    output alone (``nonlocal last``)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)
        feats: dict = {}
        last = None

        def hook(module, args, out):
            nonlocal last
            if how == "tuple-with-none":
                feats[type(module).__name__] = (out.detach(), None)
            elif how == "numpy":
                feats[id(module)] = out.detach().numpy()
            elif how == "shape":
                feats[id(module)] = out.shape
            else:
                last = out.detach()

        for m in (self.a, self.b):
            m.register_forward_hook(hook)

    def forward(self, x):
        return self.b(self.a(x))


@pytest.mark.parametrize("how", ["tuple-with-none", "numpy", "shape", "cell"])
def test_outputs_captured_beside_none_as_arrays_or_in_a_cell_are_not_said(how):
    # 43a #4: transformers' attention layers return (output, None): _captured refused the None, and the check
    # warned on a plain feature extractor; so did a NumPy copy and `nonlocal last = out`
    assert checked(Capture(how)) == []


def test_a_registration_record_of_parameters_is_not_taken_for_captured_outputs():
    # (the rule's edge: transformers' tensor parallelism records the parameters it hooked in a dict of its
    # hook's closure; rewound as captured tensors, each parameter was hooked again: review 41b's defect)
    model = nn.Linear(4, 2)
    hooked: dict[str, nn.Parameter] = {}

    def once(module, args):
        if torch.is_grad_enabled():
            for name, p in module.named_parameters(recurse=False):
                if hooked.get(name) is not p:
                    p.register_hook(lambda g: g)
                    hooked[name] = p

    model.register_forward_pre_hook(once)
    said = checked(model)
    assert len(said) == 1 and "registered a gradient hook once on 2 parameters" in said[0], said
    assert hooked == {"weight": model.weight, "bias": model.bias}
    model(BATCH[0])  # (the run's first forward registers nothing more)
    assert len(model.weight._backward_hooks) == len(model.bias._backward_hooks) == 1


def shared_counter() -> nn.Module:
    """Hooks on four layers sharing one dict of counts (not what a pass captures)."""
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(3)), nn.Linear(4, 2))
    seen = {"calls": 0}

    def count(module, args):
        seen["calls"] += 1

    for m in model:
        m.register_forward_pre_hook(count)
    return model


def test_state_many_hooks_share_is_judged_once_and_said_of_the_first(monkeypatch):
    # 43a #3 and #4: judged once a hook, a dict of every parameter in 4,000 hooks' closures took 13 s (the
    # layer-wise optimizer's pattern), and every hook sharing a changed dict was named
    calls = []
    verdict = untouched._state_verdict
    monkeypatch.setattr(untouched, "_state_verdict", lambda *a: (calls.append(a), verdict(*a))[1])
    said = checked(shared_counter())
    assert len(said) == 1 and "(a forward pre-hook on Linear)" in said[0], said
    assert len(calls) <= 2 * 2  # (the cell and the dict, once for the warning and once for the put-back)


# ---------------------------------------------------------------------------- review 43b (of the fixes above)


def test_a_record_kept_as_a_tensor_beside_the_gradient_hook_it_registered_is_left():
    # 43b #1: the captures were put back before the put-back knew a gradient hook stays: the record (a scale
    # computed in the pass) went, the hook stayed, and the run's first forward registered it again
    def make():
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        scales: dict[str, torch.Tensor] = {}

        def once(module, args, out):
            if "l0" not in scales:
                scales["l0"] = 0.5 / out.detach().std()
                module.weight.register_hook(lambda g: g * scales["l0"])

        model[0].register_forward_hook(once)
        return model

    plain, model = twins(make)
    said = checked(model)
    # (the record is left with its hook, and said as left: 43c #3, a tensor recorded cannot be told from outputs)
    assert len(said) == 2 and "registered a gradient hook once on 1 parameter (0.weight)" in said[1], said
    assert "keeps in its closure or object (a forward hook on Linear): it is not put back" in said[0], said
    grads = []
    for m in (plain, model):
        nn.functional.mse_loss(m(BATCH[0]), BATCH[1]).backward()
        grads.append(m[0].weight.grad)
    assert len(model[0].weight._backward_hooks) == 1
    assert torch.equal(*grads)


@pytest.mark.parametrize("slot", ["dict", "list"])
def test_a_slot_made_with_none_and_filled_by_a_pass_is_a_capture(slot):
    # 43b #4: `feats = {"relu": None}` or `[None]`, filled by the hook: the None lost read as state, warned
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    feats = {"relu": None} if slot == "dict" else [None]
    key = "relu" if slot == "dict" else 0

    def keep(module, args, out):
        feats[key] = out.detach()

    model[1].register_forward_hook(keep)
    assert checked(model) == []
    assert feats[key] is None


def test_an_input_made_to_require_grad_is_a_capture_not_a_trained_tensor():
    # 43b #3: any leaf that requires grad was taken for a trained tensor: an embedding's output made so by
    # enable_input_require_grads (a frozen base under gradient checkpointing), stored by a feature hook, was
    # warned as state and left
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    model[0].register_forward_hook(lambda module, args, out: out.requires_grad_(True))
    feats: dict[str, torch.Tensor] = {}
    model[1].register_forward_hook(lambda module, args, out: feats.__setitem__("in", args[0]))
    batch = (torch.arange(8).reshape(4, 2) % 10, torch.zeros(4, 2, 2))
    said = caught_warnings(lambda: check_forward(model, nn.functional.mse_loss, reader(batch), FP32, "task toy"))
    assert said == [] and feats == {}


class OwnGenerators(nn.Module):
    """Masks drawn from generators the module holds in a list, as a NumPy bit generator, or given to
    a hook as a ``functools.partial``'s argument."""

    def __init__(self, where: str) -> None:
        import functools

        super().__init__()
        self.net, self.where = nn.Linear(4, 2), where
        if where == "list":
            self.gens = [torch.Generator().manual_seed(7)]
        elif where == "bit-generator":
            self.bits = np.random.PCG64(7)
        else:
            def noise(gen, module, args):
                return (args[0] + torch.rand(args[0].shape, generator=gen),)

            self.net.register_forward_pre_hook(functools.partial(noise, torch.Generator().manual_seed(7)))

    def forward(self, x):
        if self.where == "list":
            x = x * (torch.rand(x.shape, generator=self.gens[0]) > 0.25)
        elif self.where == "bit-generator":
            x = x * torch.from_numpy(np.random.Generator(self.bits).random(x.shape) > 0.25)
        return self.net(x)


@pytest.mark.parametrize("where", ["list", "bit-generator", "partial"])
def test_generators_in_a_list_as_a_bit_generator_or_in_a_partial_are_given_their_state_back(where):
    # 43b #6: only attributes and closure cells were looked at
    plain, model = twins(lambda: OwnGenerators(where))
    assert checked(model) == []
    assert torch.equal(model(BATCH[0]), plain(BATCH[0]))


def test_a_dict_each_hook_holds_in_a_cell_of_its_own_is_judged_once(monkeypatch):
    # 43b #5: keyed by the cell, a dict every hook of a factory holds in its own cell was judged once a hook
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(5)), nn.Linear(4, 2))
    shared = {"calls": 0}

    def make(seen, name):
        def count(module, args):
            seen["calls"] += 1
        return count

    for name, m in model.named_children():
        m.register_forward_pre_hook(make(shared, name))
    calls = []
    verdict = untouched._state_verdict
    monkeypatch.setattr(untouched, "_state_verdict", lambda *a: (calls.append(a), verdict(*a))[1])
    said = checked(model)
    assert len(said) == 1 and "(a forward pre-hook on Linear)" in said[0], said
    assert len([a for a in calls if a[0][0] == "cell" and a[0][2] is shared]) <= 2, len(calls)


# ---------------------------------------------------------------------------- review 43c (of the fixes above)


def test_a_numpy_seed_sequence_on_a_module_is_no_generator_to_put_back():
    # 43c #1: a SeedSequence has a read-only `state`: taken for a bit generator, its put-back raised a raw
    # AttributeError at start-up, before the modules' attributes were put back
    model = nn.Sequential(nn.Linear(4, 2))
    model.seeds, model.calls = np.random.SeedSequence(5), 0

    def count(module, args):
        module.calls += 1

    model.register_forward_pre_hook(count)
    assert checked(model) == []
    assert model.calls == 0


def ready_flag() -> nn.Module:
    """An ActNorm-like hook whose closure holds a scale (a tensor) set at the first forward behind
    a ``ready`` flag (a bool)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    scale, ready = None, False

    def hook(module, args, out):
        nonlocal scale, ready
        if not ready:
            scale, ready = out.detach().abs().amax(), True
        return out / scale

    model[0].register_forward_hook(hook)
    return model


def test_a_capture_beside_state_of_the_same_hook_is_left_with_it():
    # 43c #2: each cell was judged alone: the scale rewound to None beside its flag left True, and the run's first
    # forward divided by None (TypeError); now the hook's state is left whole, and said
    model = ready_flag()
    said = checked(model)
    assert len(said) == 1 and "changed the state a hook of the model keeps in its closure or object" in said[0], said
    assert torch.isfinite(model(BATCH[0])).all()


def test_captures_left_where_a_gradient_hook_stays_are_said():
    # 43c #3: where a pass registered a gradient hook the model is left as the passes left it, outputs appended
    # to a list included: the warning named the gradient hook only
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    acts: list[torch.Tensor] = []
    model[1].register_forward_hook(lambda module, args, out: acts.append(out))

    def once(module, args):
        if not module.weight._backward_hooks:
            module.weight.register_hook(lambda g: g)

    model[2].register_forward_pre_hook(once)
    said = checked(model)
    assert any("keeps in its closure or object (a forward hook on Tanh)" in s for s in said), said
    assert any("registered a gradient hook once on 1 parameter (2.weight)" in s for s in said), said


@pytest.mark.parametrize("empty", [list, dict, tuple])
def test_a_capture_that_starts_empty_and_is_given_a_new_container_is_put_back(empty):
    # 43c #4: `acts = [out]` each pass from `acts = []`: the empty start read as state, warned and left
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    acts = empty()

    def keep(module, args, out):
        nonlocal acts
        acts = {"out": out} if empty is dict else empty([out])

    model[0].register_forward_hook(keep)
    assert checked(model) == []
    assert len(acts) == 0


# ---------------------------------------------------------------------------- review 43e (of the fixes above)


def per_layer_lists() -> tuple[nn.Module, dict[str, list], object]:
    """Hooks appending each layer's output to its list in a dict of their closure, and a loss that
    reads them and gives each key a fresh list; the model, the dict, the loss."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    feats: dict[str, list] = {"0": [], "2": []}

    def keep(name):
        return lambda module, args, out: feats[name].append(out)

    model[0].register_forward_hook(keep("0"))
    model[2].register_forward_hook(keep("2"))

    def loss(out, y):
        aux = sum(torch.stack(v).pow(2).mean() for v in feats.values())
        for k in feats:
            feats[k] = []
        return nn.functional.mse_loss(out, y) + 0.01 * aux

    return model, feats, loss


def test_lists_a_dict_of_the_closure_holds_are_given_their_contents_back():
    # 43e F1: the dict was put back to its first lists, which the check's first pass had appended to: the run's
    # first loss counted a stale output, silently
    (plain, _, plain_loss), (model, feats, loss) = twins(per_layer_lists)
    assert caught_warnings(lambda: check_forward(model, loss, reader(BATCH), FP32, "task toy")) == []
    assert {k: len(v) for k, v in feats.items()} == {"0": 0, "2": 0}
    assert torch.equal(loss(model(BATCH[0]), BATCH[1]), plain_loss(plain(BATCH[0]), BATCH[1]))


def test_counts_one_level_down_in_a_closures_dict_are_said():
    # 43a's nested state, left unsaid then: a per-layer dict of warm-up counts
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    state = {"0": {"seen": 0}}

    def warm(module, args):
        state["0"]["seen"] += 1

    model[0].register_forward_pre_hook(warm)
    said = checked(model)
    assert len(said) == 1 and "(a forward pre-hook on Linear)" in said[0], said


@pytest.mark.parametrize("setup", ["module attribute", "global hook"])
def test_a_setup_behind_a_none_state_made_an_empty_dict_is_done_once(setup):
    # 43e F2: None -> {} was judged no change: the flag stayed set, the module attribute it set was put back, and
    # the run never set it again, silently (now put back: the run's first forward sets up, as a plain loop's);
    # 43f #4: put back, a setup outside the model (a global module hook) was done twice (left and said where the
    # passes registered a global hook)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].temperature = 1.0
    state, handles = None, []

    def prepare(module, args):
        nonlocal state
        if state is None:
            state = {}
            if setup == "global hook":
                handles.append(nn.modules.module.register_module_forward_hook(lambda m, a, o: None))
            else:
                module.temperature = float(args[0].std()) * 3

    model[0].register_forward_pre_hook(prepare)
    try:
        said = checked(model)
        if setup == "global hook":
            assert len(said) == 1 and "(a forward pre-hook on Linear)" in said[0], said
            assert state == {} and len(handles) == 1
        else:
            assert said == [] and state is None and model[0].temperature == 1.0
        model(BATCH[0])  # (the run's first forward: the global hook not registered again; the setup done)
        assert len(handles) == 1 if setup == "global hook" else model[0].temperature != 1.0
    finally:
        for handle in handles:
            handle.remove()


def test_a_hook_appending_none_beside_outputs_is_put_back_whole():
    # 43g #1: an attention layer's (out, None): the list that only gained None read as state, and the whole hook
    # was left, its other list keeping the check's outputs (the run's first loss 1.081 vs 0.965)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    hidden: list[torch.Tensor] = []
    weights: list[None] = []

    def keep(module, args, out):
        hidden.append(out)
        weights.append(None)

    model[0].register_forward_hook(keep)
    assert checked(model) == []
    assert hidden == [] and weights == []


def test_a_long_list_a_closures_dict_holds_is_cut_back_to_its_length():
    # 43g #3: past 4,096 items a list one level down was not looked at: the check's outputs stayed, unsaid
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    logs = {"acts": [torch.zeros(1)] * 5000}
    model[0].register_forward_hook(lambda module, args, out: logs["acts"].append(out.detach()))
    assert checked(model) == []
    assert len(logs["acts"]) == 5000


def test_a_piece_no_pass_changed_joins_no_hooks():
    # 43f #1: hooks of one factory reading one config dict were all left with a warm-up counter among them, a
    # capture's outputs too (the check's four in the run's first loss), unsaid
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    config, left, acts = {"scale": 1.0}, [2], []

    def warm_up(module, args):
        if left[0] and config["scale"]:
            left[0] -= 1

    def capture(module, args, out):
        if config["scale"]:
            acts.append(out.detach())

    model[0].register_forward_pre_hook(warm_up)
    model[1].register_forward_hook(capture)
    said = checked(model)
    assert len(said) == 1 and "(a forward pre-hook on Linear)" in said[0], said
    assert acts == []


def test_a_module_attribute_left_with_a_hook_is_named():
    # 43f #3: a module's own list (an MoE's aux losses) that a left hook reads was left with the hook, unsaid
    class MoE(nn.Linear):
        def forward(self, x):
            self.aux.append(x.pow(2).mean())
            return super().forward(x)

    model = MoE(4, 2)
    model.aux, calls = [], [0]
    aux = model.aux

    def log(module, args):
        calls[0] += len(aux) >= 0

    model.register_forward_pre_hook(log)
    said = checked(model)
    assert len(said) == 1 and "(with the module attributes it shares: MoE.aux)" in said[0], said  # (the root: its type)


def test_a_dict_a_left_hook_shares_with_its_module_is_left_too():
    # 43e F3: the hook's state was left (its `ready` flag) but the module's put-back emptied the dict it shares
    # as an attribute: the run's first forward raised KeyError
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].init_stats = stats = {}
    ready = False

    def hook(module, args, out):
        nonlocal ready
        if not ready:
            stats["scale"], ready = out.detach().abs().amax(), True
        return out / stats["scale"]

    model[0].register_forward_hook(hook)
    said = checked(model)
    assert len(said) == 1 and "keeps in its closure or object" in said[0], said
    assert list(model[0].init_stats) == ["scale"] and torch.isfinite(model(BATCH[0])).all()


def test_a_hook_sharing_state_with_a_hook_left_is_left_whole():
    # 43e F4: only one sharing step was followed: B's own capture was put back beside the shared dict left
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    ref: dict[str, torch.Tensor] = {}
    ready, mine = False, None

    def a(module, args, out):
        nonlocal ready
        if not ready:
            ref["first"], ready = out.detach().mean(0), True

    def b(module, args, out):
        nonlocal mine
        if mine is None:
            mine = out.detach().mean(0) * float(ref["first"].sum())  # (a pair with A's first capture)

    model[0].register_forward_hook(a)
    model[1].register_forward_hook(b)
    said = checked(model)
    assert len(said) == 1 and "keeps in its closure or object" in said[0], said
    assert "first" in ref and mine is not None
