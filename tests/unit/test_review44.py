"""The forty-third session's reviews of the start-up check's put-back (``checkpoint.untouched``): the
state of a hook that is an object (``SaveOutput()``, the tutorials' feature extractor) or an object's
method (timm's ``FeatureHooks``) is judged and put back as a closure's is; torch's own hook objects
(``weight_norm``'s, FSDP2's state) are left to torch."""

from __future__ import annotations

import collections

import torch
from torch import nn

from helpers import caught_warnings
from helpers import check_reader as reader
from ampguard import checkpoint
from ampguard.build import check_forward
from ampguard.precision import Precision

FP32 = Precision("fp32", "cpu")
BATCH = (torch.linspace(-3, 5, 32).reshape(8, 4), torch.zeros(8, 2))


def checked(model: nn.Module) -> list[str]:
    """The warnings of the start-up's check (four passes) of ``model``."""
    return caught_warnings(lambda: check_forward(model, nn.functional.mse_loss, reader(BATCH), FP32, "task toy"))


def toy() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


class SaveOutput:
    """The tutorials' feature extractor: one object registered on several layers, each output
    appended to its list, which the caller reads (an activation penalty) and clears."""

    def __init__(self) -> None:
        self.outputs: list[torch.Tensor] = []

    def __call__(self, module, args, out) -> None:
        self.outputs.append(out)

    def penalty(self) -> torch.Tensor:
        value = sum(o.pow(2).mean() for o in self.outputs)
        self.outputs.clear()
        return value


def first_loss(model: nn.Module, saved: SaveOutput) -> float:
    out = model(BATCH[0])
    return (nn.functional.mse_loss(out, BATCH[1]) + 0.1 * saved.penalty()).item()


def test_outputs_a_hook_object_appends_to_its_list_are_put_back():
    # the check's four passes left eight outputs in the object's list, silently: the run's first loss added
    # their penalty to its own
    plain, model = toy(), toy()
    for m in (plain, model):
        m.saved = SaveOutput()
        m[0].register_forward_hook(m.saved)
        m[2].register_forward_hook(m.saved)
    assert checked(model) == []
    assert model.saved.outputs == []
    assert first_loss(model, model.saved) == first_loss(plain, plain.saved)


def test_a_countdown_on_the_object_whose_method_is_the_hook_is_said_and_left():
    # a warm-up kept on the object whose bound method is the hook: spent by the passes, unsaid
    class WarmUp:
        def __init__(self) -> None:
            self.left = 5

        def halve(self, module, args, out):
            if self.left:
                self.left -= 1
                return out * 0.5

    model, warm = toy(), WarmUp()
    model[0].register_forward_hook(warm.halve)
    said = checked(model)
    assert len(said) == 1 and "keeps in its closure or object (a forward hook on Linear)" in said[0], said
    assert warm.left == 1  # (left as the passes left it, and said: a count cannot be told from a log)


def test_a_flag_beside_a_capture_on_a_hook_object_leaves_both():
    # as 43c for a closure: the scale rewound to None beside its flag left set broke the run's first forward
    class ActNorm:
        def __init__(self) -> None:
            self.scale, self.ready = None, False

        def __call__(self, module, args, out):
            if not self.ready:
                self.scale, self.ready = 1 / (out.detach().std() + 1e-6), True
            return out * self.scale

    model, norm = toy(), ActNorm()
    model[0].register_forward_hook(norm)
    said = checked(model)
    assert len(said) == 1 and "keeps in its closure or object" in said[0], said
    assert norm.ready and norm.scale is not None
    model(BATCH[0])  # (the run's first forward works)


def test_a_generator_a_hook_object_draws_noise_from_is_given_its_state_back():
    class Noise:
        def __init__(self) -> None:
            self.generator = torch.Generator().manual_seed(1)

        def __call__(self, module, args, out):
            return out + 0.01 * torch.randn(out.shape, generator=self.generator)

    model, noise = toy(), Noise()
    before = noise.generator.get_state()
    model[0].register_forward_hook(noise)
    assert checked(model) == []
    assert torch.equal(noise.generator.get_state(), before)


def test_per_device_outputs_kept_by_the_object_whose_method_is_the_hook_are_put_back():
    # timm's FeatureHooks: ``self._feature_outputs[device][name] = output``, a dict of dicts the passes filled
    class FeatureHooks:
        def __init__(self, named) -> None:
            self._feature_outputs = collections.defaultdict(collections.OrderedDict)
            for name, module in named:
                module.register_forward_hook(lambda m, a, o, name=name: self.collect(name, o))
                module.register_forward_hook(self._collect)

        def _collect(self, module, args, out):
            self._feature_outputs[out.device][f"{id(module)}"] = out

        def collect(self, name, out):
            self._feature_outputs[out.device][name] = out

    model = toy()
    hooks = FeatureHooks([("0", model[0]), ("2", model[2])])
    hooks._feature_outputs[torch.device("cpu")]["kept"] = torch.ones(1)  # (one before the check stays)
    assert checked(model) == []
    assert list(hooks._feature_outputs[torch.device("cpu")]) == ["kept"]


def test_torchs_own_hook_objects_are_left_to_torch():
    # weight_norm's and spectral_norm's pre-hooks are objects of torch's: their attributes are torch's to keep
    model = toy()
    nn.utils.spectral_norm(model[2])
    (hook,) = model[2]._forward_pre_hooks.values()
    assert type(hook).__module__.startswith("torch.") and checkpoint._hook_state(hook, {}) == []
    saved = SaveOutput()
    assert checkpoint._hook_state(saved, {}) != []  # (a user's object is looked at)
    assert checked(model) == []


def test_one_object_on_many_layers_is_judged_and_given_back_once():
    model = nn.Sequential(*[nn.Identity() for _ in range(2000)], nn.Linear(4, 2))
    saved = SaveOutput()
    for layer in model:
        layer.register_forward_hook(saved)
    assert checked(model) == []
    assert saved.outputs == []
    memo: dict = {}
    first, second = checkpoint._hook_state(saved, memo), checkpoint._hook_state(saved, memo)
    assert first[0][1] is second[0][1]  # (one cell for the attribute: judged by one key)
