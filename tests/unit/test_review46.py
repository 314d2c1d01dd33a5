"""Reviews 44c, 44d and 44e of review 44a's fixes to the start-up check's put-back (``untouched``):
modules outside the model that cannot be kept as the model's are (lazy, TorchScript, never
initialised), in eval mode, in a hook's containers, their parameters; the loss's own state (said
where it changed, not put back; its logs given back and its first call's setups left, unsaid; its
generators kept; what it draws from); a registry of names; a helper's memo default."""

from __future__ import annotations

import math
import types
import warnings

import torch
from torch import nn

from helpers import CHECK_BATCH as BATCH
from helpers import start_up_warnings as checked
from helpers import toy_model as toy
from ampguard import untouched

STATE = "changed the state a hook of the model keeps"
LOSS = "changed the state the loss"


def first_loss(model: nn.Module, loss_fn) -> float:
    return loss_fn(model(BATCH[0]), BATCH[1]).item()


def as_plain(make) -> tuple[float, float, list[str]]:
    """The run's first loss from a plain loop's state and from what the check left, and its warnings."""
    model, loss = make()
    plain = first_loss(model, loss)
    model, loss = make()
    said = checked(model, loss)
    return plain, first_loss(model, loss), said


# --- outside modules that cannot be kept as the model's ----------------------------------------------

class HeadLoss(nn.Module):
    """A loss module with a lazy projection head."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.LazyLinear(2)

    def forward(self, out, y):
        return ((self.proj(out) - y) ** 2).mean() + ((out - y) ** 2).mean()


def test_a_lazy_module_outside_the_model_is_left_to_its_first_forward():
    # review 44c H1: kept as the model's, its materialised class had its lazy pre-hook and in_features=0 put
    # back: AttributeError at the run's first step
    plain, after, _ = as_plain(lambda: (toy(), HeadLoss()))
    assert plain == after


class NeverInitialised(nn.Module):
    def __init__(self, k: float) -> None:  # (no Module.__init__: no _parameters, no _buffers)
        self.k = k

    def scale(self, x):
        return x * self.k


def test_modules_that_cannot_be_kept_do_not_stop_the_check():
    # review 44c H2: a TorchScript teacher's buffers are no dict (TypeError at start-up); a module that
    # never called Module.__init__ has no _parameters (AttributeError at start-up)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # (torch.jit.script: deprecated, still met)
        teacher = torch.jit.script(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)).eval())
    odd = NeverInitialised(2.0)

    def loss(out, y):
        with torch.no_grad():
            t = teacher(y)
        return ((odd.scale(out) - y) ** 2).mean() + ((out - t) ** 2).mean()
    checked(toy(), loss)


# --- the loss's own state ---------------------------------------------------------------------------

class Normalised:
    """A loss normalised by a running statistic kept in place, and a count of its calls."""

    def __init__(self) -> None:
        self.running, self.count = torch.ones(()), 0

    def __call__(self, out, y):
        self.count += 1
        self.running.mul_(0.9).add_(0.1 * (out - y).pow(2).mean().detach())
        return (out - y).pow(2).mean() / self.running


def test_a_loss_whose_tensor_moved_in_place_keeps_its_count_with_it_and_is_said():
    # review 44c H3: the count was rewound beside the statistic changed in place, which cannot be: silently
    loss = Normalised()
    said = checked(toy(), loss)
    assert any(LOSS in w and "a Normalised" in w for w in said), said
    assert loss.count == 1 and float(loss.running) != 1.0  # (both as the check left them: consistent)


def test_a_running_tensor_in_a_loss_closure_changed_in_place_is_said():
    running = torch.zeros(())

    def loss(out, y):
        running.add_(out.detach().mean())
        return nn.functional.mse_loss(out, y)
    assert any(LOSS in w for w in checked(toy(), loss))


def test_the_losss_and_a_hooks_own_generators_are_given_back_their_state():
    # review 44c H4: the generators rng_kept does not keep were those of the modules only
    def make():
        model, gen = toy(), torch.Generator().manual_seed(3)
        hook_gen = torch.Generator().manual_seed(4)

        def noisy(out, y):
            return nn.functional.mse_loss(out + 0.1 * torch.randn(out.shape, generator=gen), y)

        def jitter(m, args, out, g=hook_gen):  # (a generator as the hook's default)
            return out + 0.1 * torch.randn(out.shape, generator=g)
        model[1].register_forward_hook(jitter)
        return model, noisy
    plain, after, said = as_plain(make)
    assert plain == after and not any(STATE in w for w in said)


class Tracker(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(()))

    def forward(self, x):
        self.mean.mul_(0.5).add_(x.detach().mean())
        return x


def test_modules_in_a_hooks_containers_are_kept_as_the_models_are():
    # review 44c H5: only a module held directly was found
    def make():
        model, trackers = toy(), {"0": Tracker()}
        model[1].register_forward_hook(lambda m, args, out: out + trackers["0"](out).mean() - trackers["0"].mean)
        return model, nn.functional.mse_loss
    plain, after, _ = as_plain(make)
    assert plain == after


def test_an_outside_modules_parameters_changed_in_place_are_said():
    # review 44c H6: an EMA teacher a pre-hook moves: its parameters were never summed
    model, teacher = toy(), nn.Linear(4, 8)

    def ema(m, args):
        with torch.no_grad():
            for t, s in zip(teacher.parameters(), m.parameters()):
                t.mul_(0.9).add_(0.1 * s)
    model[0].register_forward_pre_hook(ema)
    said = checked(model)
    assert any("changed 2 parameters in place (Linear.weight, Linear.bias)" in w for w in said), said


class CountingLoss:
    """A loss object one of whose methods is a hook on the model: the count is the loss's."""

    def __init__(self) -> None:
        self.calls, self.seen = 0, []

    def hook(self, module, args, out) -> None:
        self.seen.append(out)

    def __call__(self, out, y):
        self.calls += 1
        return nn.functional.mse_loss(out, y) * (1 + self.calls)


def test_a_loss_count_on_an_object_a_hook_is_bound_to_is_said():
    # review 44c H7: the hook holds the count loosely and lets it be; the loss left it to the hook: spent,
    # unsaid. The loss's state is said (not put back: review 44d), the hook's captures given back
    model, loss = toy(), CountingLoss()
    model[1].register_forward_hook(loss.hook)
    said = checked(model, loss)
    assert any(LOSS in w for w in said) and not any(STATE in w for w in said)
    assert loss.calls == 1 and loss.seen == []


# --- names, memos ----------------------------------------------------------------------------------

def test_names_each_appended_once_are_a_registry_left_and_said():
    # review 44c M1: an LSUV-like initialisation's ``done.append(name)``, read as a log and rewound: the
    # initialisation ran again at the run's first forward, on weights the check had scaled
    def make():
        model, done = toy(), []

        def init_once(m, args, out):
            key = type(m).__name__ + str(out.shape[-1])
            if key not in done:
                with torch.no_grad():
                    m.weight.mul_(0.5)
                done.append(key)
        model[0].register_forward_hook(init_once)
        model[2].register_forward_hook(init_once)
        return model, nn.functional.mse_loss
    plain_model, _ = make()
    plain_model(BATCH[0])
    model, loss = make()
    said = checked(model, loss)
    model(BATCH[0])
    assert any(STATE in w for w in said)
    assert torch.equal(model[0].weight, plain_model[0].weight)  # (scaled once, as a plain loop's first forward)


def groups_for(c: int, _memo={}) -> int:  # noqa: B006 - the memo idiom
    if c not in _memo:
        _memo[c] = math.gcd(c, 32)
    return _memo[c]


def test_a_helpers_memo_default_is_no_state_of_the_hook():
    # review 44c M2: every visited function's defaults were read: the memo's new slot, a number, read as
    # state: a warning at every start-up, and the hook's captures left with it
    model, feats = toy(), []

    def hook(m, args, out):
        feats.append(out.reshape(out.shape[0], groups_for(out.shape[-1]), -1))
    model[1].register_forward_hook(hook)
    groups_for.__defaults__[0].clear()
    assert not any(STATE in w for w in checked(model))
    assert feats == []


def test_a_frozen_outside_modules_buffers_are_not_copied():
    # review 44c M3: a teacher in eval mode (its weights buffers where it is quantised) was copied whole
    model, teacher = toy(), nn.BatchNorm1d(8).eval()
    model[1].register_forward_hook(lambda m, args, out: teacher(out))
    snapshot = untouched.BufferSnapshot(model)
    assert teacher in snapshot.outside and id(teacher.running_mean) not in snapshot.copies
    teacher.train()
    snapshot = untouched.BufferSnapshot(model)
    assert id(teacher.running_mean) in snapshot.copies


class Raising:
    """A loss object whose ``__getattr__`` raises for any name it does not have."""

    def __getattr__(self, name):
        raise RuntimeError(f"no {name}")

    def __call__(self, out, y):
        return nn.functional.mse_loss(out, y)


def test_a_loss_whose_getattr_raises_does_not_stop_the_check():
    # its generators were looked for in its ``__func__``'s defaults: RuntimeError at start-up
    checked(toy(), Raising())


def test_a_loss_that_drains_a_queue_keeps_its_count_with_it_and_is_said():
    import queue

    class Draining:
        def __init__(self) -> None:
            self.calls, self.outs = 0, queue.Queue()

        def __call__(self, out, y):
            self.calls += 1
            while not self.outs.empty():
                self.outs.get()
            return nn.functional.mse_loss(out, y)

    model, loss = toy(), Draining()
    loss.outs.put(torch.ones(1))
    said = checked(model, loss)
    assert any(LOSS in w for w in said)
    assert loss.calls == 1  # (left with the queue it drained: not rewound beside it)


# --- review 44d -----------------------------------------------------------------------------------------

READY = False


class CacheLoss:
    """A loss that builds a weight at its first call, behind a module global flag."""

    def __call__(self, out, y):
        global READY
        if not READY:
            self.w = torch.ones(out.shape[-1])
            READY = True
        return ((out - y) ** 2 * self.w).mean()


def test_a_loss_whose_cache_stands_behind_a_flag_no_put_back_sees_is_left_as_the_check_left_it():
    # review 44d H1: the loss's state was given back, the cache with it, the flag in a global not: the
    # run's first step raised AttributeError. A setup the first call made is left, unsaid (44e: a
    # warning at every start-up for a cache the run's first call would build the same)
    global READY
    READY = False
    model, loss = toy(), CacheLoss()
    assert not any(LOSS in w for w in checked(model, loss))
    assert hasattr(loss, "w")
    first_loss(model, loss)  # (no AttributeError)
    READY = False


class Observer(nn.Module):
    """Like torch.ao's observers: moves its buffers in eval mode too."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("high", torch.zeros(()))

    def forward(self, x):
        self.high.copy_(torch.maximum(self.high, x.detach().abs().max()))
        return x


def test_a_buffer_an_outside_module_in_eval_mode_changes_in_place_is_said():
    # review 44d H3: an eval-mode outside module's buffers were neither copied nor looked at
    model, observer = toy(), Observer().eval()
    model[1].register_forward_hook(lambda m, args, out: observer(out))
    said = checked(model)
    assert any("changed the buffer Observer.high of a module outside the model in place" in w for w in said), said


def test_a_tensor_bound_to_the_loss_or_a_hook_changed_in_place_is_said():
    # review 44d H4: a partial's tensor argument and a default tensor were no state of anyone's
    import functools

    def adaptive(out, y, w):
        w.mul_(0.9)
        return nn.functional.mse_loss(out, y) * w
    assert any(LOSS in w for w in checked(toy(), functools.partial(adaptive, w=torch.ones(()))))

    model = toy()

    def hook(m, args, out, seen=torch.zeros(())):
        seen.add_(1)
    model[1].register_forward_hook(hook)
    assert any(STATE in w for w in checked(model))


def test_what_the_loss_draws_from_or_steps_is_said():
    # review 44d H6: an iterator of a schedule, a generator, an optimizer's lr the loss changes
    schedule = iter([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])

    def scheduled(out, y):
        return nn.functional.mse_loss(out, y) * next(schedule)
    assert any(LOSS in w for w in checked(toy(), scheduled))

    def weights():
        while True:
            yield 1.0
    drawn = weights()

    def generated(out, y):
        return nn.functional.mse_loss(out, y) * next(drawn)
    assert any(LOSS in w for w in checked(toy(), generated))

    model = toy()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)

    def halving(out, y):
        optimizer.param_groups[0]["lr"] *= 0.5
        return nn.functional.mse_loss(out, y)
    assert any(LOSS in w for w in checked(model, halving))


HOOK_HELPERS = types.ModuleType("hook_helpers")  # (a module of the user's: its functions are the user's code)
exec("def needs(h):\n    return not h.built\n"
     "def build_cache(h, out):\n    h.cache = out.detach().abs().mean(0) + 1.0\n    h.built = True\n",
     HOOK_HELPERS.__dict__)


class ScaleByModule:
    """A hook whose cache its helpers, kept in a module of the user's, build and flag."""

    def __init__(self) -> None:
        self.built, self.cache = False, None

    def hook(self, module, args, out):
        if HOOK_HELPERS.needs(self):
            HOOK_HELPERS.build_cache(self, out)
        return out * self.cache


def test_a_helper_in_a_module_of_the_users_is_followed():
    # review 44d H7: ``helpers.build_cache(self, out)``: the helper was followed by its global name only;
    # the flag it set was loose, the cache rewound to None: TypeError at the run's first forward
    model, scale = toy(), ScaleByModule()
    model[1].register_forward_hook(scale.hook)
    said = checked(model)
    assert any(STATE in w for w in said)
    model(BATCH[0])


class Centred(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.register_buffer("center", torch.zeros(2))

    def forward(self, x):
        out = self.lin(x)
        self.center.mul_(0.9).add_(0.1 * out.detach().mean(0))
        return out


def test_a_loss_reading_a_model_buffer_is_not_said_for_it():
    # review 44d M2: the model's buffer, which the put-back copies back, was the loss's tensor moved
    model = Centred()
    center = model.center

    def centring(out, y):
        return nn.functional.mse_loss(out - center, y)
    assert not any("the loss" in w for w in checked(model, centring))


class RaisingCounting(Raising):
    """A loss object whose ``__getattr__`` raises, and which counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, out, y):
        self.calls += 1
        return nn.functional.mse_loss(out, y)


def test_the_losss_warning_does_not_ask_the_loss_its_name():
    # review 44d: the warning asked the loss for __qualname__, which its __getattr__ refused: RuntimeError
    assert any(LOSS in w and "a RaisingCounting" in w for w in checked(toy(), RaisingCounting()))


# --- review 44e: the loss's logs and setups, what it draws from --------------------------------------------

LOSSES: list[float] = []


class LoggingTrainer:
    """A trainer whose loss logs: a history, the last value, a metrics dict, the last logits."""

    def __init__(self) -> None:
        self.history: list[float] = []
        self.last = None
        self.metrics: dict[str, float] = {}
        self.weight = torch.ones(2)

    def loss(self, out, y):
        loss = nn.functional.mse_loss(out * self.weight, y)
        if not getattr(self, "_moved", False):  # (the weights moved to the logits' device once, a flag beside)
            self.weight, self._moved = self.weight.to(out.device, copy=True), True
        self.history.append(loss.item())
        self.last = loss.detach()
        self.metrics["loss"] = loss.item()
        LOSSES.append(loss.item())
        return loss


def test_a_losss_logs_are_given_back_and_its_first_call_setups_left_unsaid():
    # review 44e M1: a warning at every start-up for a loss that logs (44d's rule said every change), and the
    # user's global log kept the check's entries
    LOSSES.clear()
    model, trainer = toy(), LoggingTrainer()
    assert not any("the loss" in w for w in checked(model, trainer.loss))
    assert trainer.history == [] and LOSSES == []  # (appended to: logs, given back)
    assert trainer._moved and trainer.metrics  # (a setup, a value where there was none, a dict's new slot: left
    # as the check made them; the run's first call would make the same, or write them again)


def test_what_a_loss_draws_from_is_said_however_it_iterates():
    # review 44e H1: a primed generator's place does not move in a ``while True`` loop; itertools, map,
    # numpy's and dict's iterators were not fingerprinted
    import itertools

    import numpy as np

    def ramp():
        x = 0.0
        while True:
            x += 1.0
            yield x
    primed = ramp()
    next(primed)
    for source in (primed, itertools.cycle([1.0, 2.0]), iter(np.linspace(1, 4, 8)), map(float, range(8)),
                   iter({1.0: 0, 2.0: 0, 3.0: 0, 4.0: 0, 5.0: 0})):
        def drawing(out, y, source=source):
            return nn.functional.mse_loss(out, y) * next(source)
        assert any(LOSS in w for w in checked(toy(), drawing)), source


def test_a_count_on_the_loss_function_and_a_tensor_it_reaches_by_a_made_name_are_said():
    # review 44e H2: a function's own attributes were not read; a loose attribute's tensor was not watched
    def counted(out, y):
        counted.calls += 1
        return nn.functional.mse_loss(out, y) * counted.calls
    counted.calls = 0
    assert any(LOSS in w for w in checked(toy(), counted))

    class ByName:
        def __init__(self) -> None:
            self.name, self.scale = "scale", torch.ones(())

        def __call__(self, out, y):
            getattr(self, self.name).mul_(2)
            return nn.functional.mse_loss(out, y) * self.scale
    assert any(LOSS in w for w in checked(toy(), ByName()))
