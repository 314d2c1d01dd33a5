"""Review 44a of the start-up check's put-back (``untouched``): what a helper function given the
object reaches, values bound as a hook's defaults, modules outside the model that hooks or the
loss keep state on, a lazy model's checked copy, and the audit hooks (dtypes, shapes, the modules'
order) whose records are captures."""

from __future__ import annotations

import argparse
import types

import pytest
import torch
from torch import nn

from helpers import CHECK_BATCH as BATCH
from helpers import start_up_warnings as checked
from helpers import toy_model as toy
from ampguard import untouched

STATE = "changed the state a hook of the model keeps"


def said_state(said: list[str]) -> bool:
    return any(STATE in w for w in said)


# --- a module-level helper given the object ---------------------------------------------------------

def needs(h) -> bool:
    return not h.built


def build_cache(h, out: torch.Tensor) -> None:
    h.cache = out.detach().abs().mean(0) + 1.0
    h.built = True


class Scale:
    """A hook whose cache is built once, by a helper given the object that also sets its flag."""

    def __init__(self) -> None:
        self.built, self.cache = False, None

    def hook(self, module, args, out):
        if needs(self):
            build_cache(self, out)
        return out * self.cache

    def attach(self, module: nn.Module) -> None:  # (the same as a closure over self)
        def hook(m, args, out):
            if needs(self):
                build_cache(self, out)
            return out * self.cache
        module.register_forward_hook(hook)


@pytest.mark.parametrize("how", ["bound method", "closure over self"])
def test_a_flag_a_helper_sets_beside_the_cache_the_hook_names_is_its_state(how):
    # review 44a H1: ``built`` was among the loose attributes (the hook's code does not name it), left
    # unsaid, while the cache it names was rewound to None: the run's first forward multiplied by None
    model, scale = toy(), Scale()
    if how == "bound method":
        model[1].register_forward_hook(scale.hook)
    else:
        scale.attach(model[1])
    said = checked(model)
    assert said_state(said)  # (a setup the check did: said, and the hook left whole)
    assert scale.built and scale.cache is not None
    model(BATCH[0])  # (the run's first forward: no TypeError)


def test_the_names_a_hook_reaches_include_those_its_helpers_use():
    assert {"built", "cache"} <= untouched._reached(Scale.hook)
    assert "cache" in untouched._reached(needs) | untouched._reached(build_cache)
    assert untouched._reached(len) == frozenset()  # (no code: nothing)


# --- values bound as defaults -----------------------------------------------------------------------

def test_a_list_bound_as_a_hooks_default_is_given_back_its_outputs():
    # review 44a H3: the loop-binding idiom, ``lambda m, i, o, store=store: ...``: the defaults were
    # never read, and the check's four outputs stayed in the list, silently
    model = toy()
    store: list[torch.Tensor] = []
    model[1].register_forward_hook(lambda m, args, out, store=store: store.append(out))
    assert not said_state(checked(model))
    assert store == []


@pytest.mark.parametrize("keyword", [False, True])
def test_a_count_kept_in_a_default_is_said(keyword):
    model, seen = toy(), {}
    if keyword:
        def hook(m, args, out, *, seen=seen):
            seen["n"] = seen.get("n", 0) + 1
    else:
        def hook(m, args, out, seen=seen):
            seen["n"] = seen.get("n", 0) + 1
    model[1].register_forward_hook(hook)
    assert said_state(checked(model))


# --- modules outside the model ----------------------------------------------------------------------

class FeatureLoss(nn.Module):
    """A feature-matching loss written as a module: its hook on the model keeps outputs on it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.feats: list[torch.Tensor] = []
        self.register_buffer("ema", torch.zeros(8))
        self.calls = 0
        model[1].register_forward_hook(self.hook)

    def hook(self, module, args, out) -> None:
        self.feats.append(out)
        self.ema.mul_(0.5).add_(out.detach().mean(0))

    def forward(self, out, y):
        self.calls += 1
        return nn.functional.mse_loss(out, y)


def test_a_loss_module_whose_hook_keeps_outputs_on_it_is_put_back_as_the_models_modules_are():
    # review 44a H2: any nn.Module was taken for the model's, which the snapshot keeps; one outside it
    # was kept by nothing: its list kept the check's outputs, its buffer the check's average, silently
    model = toy()
    loss = FeatureLoss(model)
    said = checked(model, loss)
    assert not said_state(said)
    assert loss.feats == [] and torch.equal(loss.ema, torch.zeros(8)) and loss.calls == 0


def test_a_module_a_hook_closes_over_outside_the_model_is_put_back():
    model, tracker = toy(), nn.Module()
    tracker.register_buffer("total", torch.zeros(()))
    tracker.seen = 0

    def hook(m, args, out):
        tracker.total += out.detach().sum()
        tracker.seen += 1
    model[1].register_forward_hook(hook)
    checked(model)
    assert float(tracker.total) == 0.0 and tracker.seen == 0


# --- a lazy model's checked copy --------------------------------------------------------------------

def test_a_lazy_models_hooks_shared_with_its_checked_copy_are_given_back_their_outputs():
    # review 44a H6: the copy's hooks share their closures with the model's; the copy was checked under
    # rng_kept alone and the list kept the check's outputs
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(8), nn.Tanh(), nn.Linear(8, 2))
    feats: list[torch.Tensor] = []
    model[1].register_forward_hook(lambda m, args, out: feats.append(out))
    checked(model)
    assert feats == []
    assert model[0].weight.shape == (8, 4)  # (the model's own lazy weights made, as before)


# --- audit hooks: their records are captures ---------------------------------------------------------

def audit(kind: str):
    record: dict | list = [] if kind == "order" or kind == "records" else {}

    def hook(m, args, out):
        if kind == "dtypes":
            record[type(m).__name__] = out.dtype
        elif kind == "devices":
            record[type(m).__name__] = out.device
        elif kind == "shapes":
            record[type(m).__name__] = tuple(out.shape)
        elif kind == "order":
            record.append(type(m).__name__)
        else:
            record.append({"name": type(m).__name__, "dtype": out.dtype, "max": out.abs().max().item()})
    return record, hook


@pytest.mark.parametrize("kind", ["dtypes", "devices", "shapes", "order", "records"])
def test_an_audit_hooks_records_are_given_back_unsaid(kind):
    # review 44a M1: a dtype, a shape as a tuple, names appended were read as state: a warning at every
    # start-up and the check's entries left
    model = toy()
    record, hook = audit(kind)
    for layer in model:
        layer.register_forward_hook(hook)
    assert not said_state(checked(model))
    assert len(record) == 0


# --- stdlib records ------------------------------------------------------------------------------------

def test_a_simple_namespace_counter_is_said_and_an_argparse_namespaces_list_given_back():
    # review 44a H4: both were taken for a library's objects, whose state is their own
    model, state = toy(), types.SimpleNamespace(left=2)

    def warm(m, args, out):
        state.left -= 1
    model[1].register_forward_hook(warm)
    assert said_state(checked(model))

    model, args_ = toy(), argparse.Namespace(acts=[])
    model[1].register_forward_hook(lambda m, a, out: args_.acts.append(out))
    assert not said_state(checked(model))
    assert args_.acts == []


def test_lists_in_a_tuple_a_hook_closes_over_are_given_back():
    model = toy()
    store = ([], [])
    acts, outs = store

    def hook(m, args, out):
        store[0].append(out)
        store[1].append(out.sum())
    model[1].register_forward_hook(hook)
    assert not said_state(checked(model))
    assert acts == [] and outs == []


# --- a library's object carried in a capture -----------------------------------------------------------

def test_a_library_object_beside_the_tensors_of_a_capture_is_part_of_it():
    # review 44a M2: a transformers ModelOutput captured with use_cache=True holds a DynamicCache:
    # read as state, a warning at every start-up and four outputs left with their graphs
    transformers = pytest.importorskip("transformers")
    model, outs = toy(), []
    model[1].register_forward_hook(lambda m, args, out: outs.append({"out": out, "cache": transformers.DynamicCache()}))
    assert not said_state(checked(model))
    assert outs == []
    assert untouched._carried(transformers.DynamicCache())
    assert not untouched._carried(Scale()) and not untouched._carried(torch.ones(1))


# --- the loss's own state ------------------------------------------------------------------------------

class Curriculum:
    """A loss that weighs a term by how many times it was called (a KL annealing's step)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, out, y):
        self.calls += 1
        return nn.functional.mse_loss(out, y) * min(1.0, self.calls / 10)


def test_a_loss_objects_own_count_moved_by_the_check_is_said():
    # review 44a H7: the check called the loss; the run's first step weighed its term as the second,
    # silently. Said, not put back (review 44d: what a put-back sees of a loss is not all of it)
    model, loss = toy(), Curriculum()
    said = checked(model, loss)
    assert any("changed the state the loss (a Curriculum) keeps of its own" in w for w in said), said
    assert loss.calls == 1


class FeatLoss:
    """One object that is the hook (its __call__ appends) and the loss (a method counting calls)."""

    def __init__(self) -> None:
        self.acts: list[torch.Tensor] = []
        self.calls = 0

    def __call__(self, module, args, out) -> None:
        self.acts.append(out)

    def loss(self, out, y):
        self.calls += 1
        return nn.functional.mse_loss(out, y)


def test_the_loss_gives_back_nothing_a_hooks_state_holds():
    # the hook's count moved, so its state is left whole and said; the loss's put-back must not rewind
    # the captures beside it (left together with the count, as the hook's judgement says)
    model, both = toy(), FeatLoss()
    model[1].register_forward_hook(both)
    said = checked(model, both.loss)
    assert said_state(said)
    assert len(both.acts) == 4 and both.calls == 1


# --- a global a pass makes --------------------------------------------------------------------------------

def test_a_global_the_hooks_first_call_makes_is_taken_out_again():
    # review 44a H5: a global not there yet was skipped; the check's passes made it, and the run's first
    # forward blended its output into the check's running mean, silently
    model = toy()
    model[1].register_forward_hook(_running_mean)
    assert not said_state(checked(model))
    assert "EMA_OF_TANH" not in globals()
    model(BATCH[0])
    assert "EMA_OF_TANH" in globals()  # (the run's first forward makes it, as a plain loop's does)
    del globals()["EMA_OF_TANH"]


def _running_mean(module, args, out):
    global EMA_OF_TANH
    try:
        EMA_OF_TANH = 0.9 * EMA_OF_TANH + 0.1 * out.detach().mean()  # noqa: F821 - made at the first call
    except NameError:
        EMA_OF_TANH = out.detach().mean()


def test_the_check_keeps_no_hook_alive_after_it():
    # what the names a hook reaches were found by is not kept by function: a hook's closure may hold a
    # model's worth of tensors, which a cache of the hooks' functions kept alive for good
    import gc
    import weakref

    class Held:
        pass

    model, held = toy(), Held()
    gone = weakref.ref(held)

    def hook(m, args, out, held=held):  # (a default: what the hook's code reaches is asked of the function)
        return out if held is not None else None
    handle = model[1].register_forward_hook(hook)
    checked(model)
    handle.remove()
    del hook, held
    gc.collect()
    assert gone() is None


# --- objects no put-back looks into: said when changed ---------------------------------------------------

def _opaque(kind: str):
    import itertools
    import queue
    import weakref

    import numpy as np
    if kind == "numpy":
        count = np.zeros(1)

        def hook(m, args, out):
            count[0] += 1
        return hook
    if kind == "count":
        ticks = itertools.count()

        def hook(m, args, out):
            next(ticks)
        return hook
    if kind == "queue":
        outs = queue.Queue()

        def hook(m, args, out):
            outs.put(out)
        return hook
    sums = weakref.WeakKeyDictionary()

    def hook(m, args, out):
        sums[m] = sums.get(m, 0) + out.detach().sum()
    return hook


@pytest.mark.parametrize("kind", ["numpy", "count", "queue", "weak"])
def test_an_object_no_put_back_looks_into_is_said_when_the_check_changed_it(kind):
    # review 44a H4: a NumPy counter changed in place, an itertools.count, a queue.Queue, a
    # WeakKeyDictionary: neither judged nor said, each a warm-up or a store the check moved, silently
    model = toy()
    model[1].register_forward_hook(_opaque(kind))
    assert said_state(checked(model))


def test_an_unchanged_numpy_array_a_hook_reads_is_no_change():
    import numpy as np
    model, table = toy(), np.arange(4.0)
    model[1].register_forward_hook(lambda m, args, out: out * float(table[0] + 1))
    assert not said_state(checked(model))
