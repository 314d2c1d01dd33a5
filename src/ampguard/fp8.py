"""FP8 training through torchao's ``Float8Linear``: which layers convert, the conversion, and
naming a broken scale.

``precision: fp8`` is bf16 autocast for the whole model plus torchao's float8 training for the
``nn.Linear`` layers that can take it: each of their three matmuls (output, grad input, grad
weight) casts its operands to float8 with a *dynamic* scale, ``float8_max / amax`` of the tensor
(``tensorwise``, the default recipe) or of each row (``rowwise``). The optimizer still updates
FP32 master weights, no loss scaler is used, and the guarded step is the same as for bf16.

Which layers convert (:func:`plan`): every ``nn.Linear`` whose ``in_features`` and
``out_features`` are multiples of 16 (what ``torch._scaled_mm`` takes), except the first and
the last one (``keep_first_last``: the input embedding-like layer and the output head are the
most sensitive to rounding, as torchtitan keeps its ``output`` layer) and the module names
matching an ``exclude`` pattern (``fnmatch``). The swap keeps only a layer's weight and bias,
so a Linear it would change stays out, named with why: a subclass with its own forward, one
whose forward is replaced on the instance (Accelerate's hooks, a patch) or compiled in place
(``module.compile()``), a parametrized (``weight_norm``, ``spectral_norm``) or uninitialised
lazy one, one holding other parameters, buffers (a bias kept as a buffer), modules, or hooks
(forward, backward, state-dict). A layer reused at several places is one layer: first and last
are judged at its first place, and it converts at all of its places or at none.
The conversion swaps modules in place and keeps the parameter objects, so an optimizer built
before it still holds the right tensors. Every float8 layer trains with ``pad_inner_dim`` on
(those torchao converted directly too): torchao pads the inner dimension of each of the layer's
three matmuls to a multiple of 16 (a CUDA ``_scaled_mm`` refuses it otherwise; the weight
gradient's has the micro-batch's token count there), so the micro-batch size is free. It does
so by copying both operands of all three matmuls, of every float8 layer, every step, aligned or
not (zero padding: the numbers are unchanged); what those copies cost on a GPU is not measured.

A bad scale: a scale is ``float8_max / clamp(amax, 1e-12)`` in torchao's float8 training, so
it is NaN when the tensor holds a NaN and 0 when it holds an inf, and either makes the matmul's
output non-finite; the guarded step then skips the step (``non_finite_loss`` for a forward cast,
``non_finite_grad`` for a backward one) with the parameters untouched. A scale function without
that floor (torchao#3356's path) turns an all-zero tensor into an inf scale and 0 x inf = NaN.
:func:`find_bad_scales` replays a micro-batch and names the layer, the operand and the amax
behind every non-finite or zero scale, telling a broken scale (finite tensor) from a non-finite
tensor. It is a diagnostic (hooks, host reads): never part of the step.

torchao is an optional extra (``pip install 'ampguard[fp8]'``), imported only here and only
when fp8 is asked for. On a CPU the float8 matmuls run in PyTorch's own CPU ``torch._scaled_mm``
(real float8 operands; torchao's ``emulate`` mode stays off): right for correctness checks, no
speed-up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import logging
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

from .errors import counted, raised
from .untouched import untouched

RECIPES: tuple[str, ...] = ("tensorwise", "rowwise")
"""The torchao float8 recipes ``fp8.recipe`` takes: per-tensor or per-row dynamic scaling."""
DIM_MULTIPLE = 16
"""Both dimensions of a Linear must be multiples of this for ``torch._scaled_mm``."""
CONVERT = "fp8"
""":func:`plan`'s word for a layer that converts."""


def require_torchao() -> ModuleType:
    """``torchao.float8``, or an ``ImportError`` with one line saying how to get it: torchao not
    installed, or installed but failing to import (a torchao older than ``torchao.float8``, or one
    made for another torch, which raises whatever its first missing piece raises: an
    ``AttributeError`` for a torch dtype it expects, an undefined symbol...), or one older than the
    extra's ``torchao>=0.10`` (no ``Float8LinearConfig.from_recipe_name``, which nothing else
    would check before the conversion fails on it).

    torchao's CUDA extensions cannot load on a machine without CUDA and it logs a warning for
    each; there (and only there) those lines are held back while importing.

    Example::

        >>> require_torchao().__name__
        'torchao.float8'
    """
    # torchao's warnings on import: its CUDA extensions (on a machine without CUDA), and torch's
    # note on an Enum torchao registers with pytree
    logs = [logging.getLogger("torch.utils._pytree")]
    if not torch.cuda.is_available():
        logs.append(logging.getLogger("torchao"))
    levels = [log.level for log in logs]
    try:
        for log in logs:
            log.setLevel(logging.ERROR)
        from torchao import float8
    except ModuleNotFoundError as err:
        if err.name != "torchao":
            raise ImportError(_torchao_broken(err)) from None
        raise ImportError("fp8 needs torchao, which is not installed: pip install 'ampguard[fp8]' "
                          "(or pip install torchao)") from None
    except Exception as err:  # (installed, but it does not import with this torch)
        raise ImportError(_torchao_broken(err)) from None
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)
    if not hasattr(getattr(float8, "Float8LinearConfig", None), "from_recipe_name"):  # (torchao < 0.10)
        raise ImportError(f"fp8 needs torchao 0.10 or newer (Float8LinearConfig.from_recipe_name) and {_installed()} "
                          "lacks it: install the torchao release made for this torch (torchao's README lists them)")
    return float8


def _installed() -> str:
    """``torchao`` and its version, as its package metadata has it."""
    from importlib import metadata

    try:
        return f"torchao {metadata.version('torchao')}"
    except metadata.PackageNotFoundError:
        return "torchao"


def _torchao_broken(err: Exception) -> str:
    """One line for a torchao that is installed but does not import."""
    return (f"fp8 needs torchao, and {_installed()} failed to import with torch {torch.__version__} "
            f"({raised(err)}): install the torchao release made for this torch (torchao's README lists them)")


def _float8_linear() -> type | None:
    """torchao's ``Float8Linear`` class when torchao is loaded (no model holds one otherwise)."""
    module = sys.modules.get("torchao.float8.float8_linear")
    return getattr(module, "Float8Linear", None) if module is not None else None


def float8_modules(model: nn.Module) -> list[nn.Module]:
    """The model's ``Float8Linear`` layers (itself included), unused ones too; none when torchao
    was never imported.

    Example::

        >>> model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 16))
        >>> float8_modules(model), convert_to_fp8(model), float8_modules(model) == [model[2]]
        ([], ['2'], True)
    """
    cls = _float8_linear()
    return [] if cls is None else [m for m in model.modules() if isinstance(m, cls)]


def fp8_layers(model: nn.Module) -> list[str]:
    """The names of the model's ``Float8Linear`` layers, a reused one at each place that holds it
    (none when torchao was never imported).

    Example::

        >>> model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 16))
        >>> fp8_layers(model), convert_to_fp8(model), fp8_layers(model)
        ([], ['2'], ['2'])
    """
    cls = _float8_linear()
    unused = _not_called(model)
    return [] if cls is None else [name for name, m in model.named_modules(remove_duplicate=False)
                                   if isinstance(m, cls) and id(m) not in unused]


def fp8_layers_named(model: nn.Module) -> list[str]:
    """The model's ``Float8Linear`` layers (those :func:`fp8_layers` names), one entry per layer:
    its first place's name, and ``(also ...)`` with the others of a layer held at several places.
    What the run card and ``run_start`` count (review 53a: they counted a reused layer once per
    place, "3 Linear layers in float8" of a model with 2).

    Example::

        >>> model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 16))
        >>> model[2] = model[1]
        >>> convert_to_fp8(model), fp8_layers(model), fp8_layers_named(model)
        (['1', '2'], ['1', '2'], ['1 (also 2)'])
    """
    places: dict[int, list[str]] = {}
    for name in fp8_layers(model):
        places.setdefault(id(model.get_submodule(name)), []).append(name)
    return [first + (f" (also {', '.join(others)})" if others else "") for first, *others in places.values()]


def in_float8(layers: Sequence[str]) -> str:
    """``N Linear layer(s) in float8: ...`` of :func:`fp8_layers_named`'s entries: the run card's
    and ``run_start``'s words for them.

    Example::

        >>> in_float8(["1 (also 2)", "3"]), in_float8([])
        ('2 Linear layers in float8: 1 (also 2), 3', '0 Linear layers in float8: none')
    """
    return f"{counted(len(layers), 'Linear layer')} in float8: {', '.join(layers) or 'none'}"


def _not_called(model: nn.Module) -> set[int]:
    """The Linear layers whose ``forward`` never runs: an ``nn.MultiheadAttention``'s
    ``out_proj`` (the attention passes its weight and bias to ``F.multi_head_attention_forward``),
    so a float8 swap of it would change nothing.

    Example::

        >>> attention = nn.MultiheadAttention(32, 4)
        >>> _not_called(attention) == {id(attention.out_proj)}
        True
    """
    return {id(child) for m in model.modules() if isinstance(m, nn.MultiheadAttention)
            for child in m.children() if isinstance(child, nn.Linear)}


def _torchs_own(hook: Any) -> bool:
    """Whether a module hook is one of ``torch.nn.utils``' own (weight_norm's compat hook,
    spectral_norm's load hook), through the wrapper the module keeps it in.

    Example::

        >>> layer = nn.Linear(2, 2)
        >>> _ = nn.utils.spectral_norm(layer); _ = nn.utils.remove_spectral_norm(layer)
        >>> [_torchs_own(h) for h in layer._load_state_dict_pre_hooks.values()], _torchs_own(print)
        ([True], False)
    """
    hook = getattr(hook, "hook", hook)  # (_WrappedHook)
    where = getattr(hook, "__module__", None) or type(hook).__module__
    return where.startswith("torch.nn.utils.") and where != "torch.nn.utils.parametrize"


def _cannot_swap(m: nn.Linear) -> str | None:
    """Why torchao's swap (a new ``Float8Linear`` given only ``weight`` and ``bias``:
    ``Float8Linear.from_float``) would not compute what this Linear computes, or fail; ``None``
    when it would. A subclass that keeps ``nn.Linear``'s forward (one that only adds an init, as
    GPT codes do) computes what a Linear does, so it converts; one with its own forward would
    silently lose it. Anything else the layer holds (a parametrization, other parameters or
    buffers, child modules, hooks) would be dropped with the old module, or make the swap raise.

    Example::

        >>> class Scaled(nn.Linear):
        ...     def forward(self, x):
        ...         return super().forward(x) * 2
        >>> _cannot_swap(Scaled(32, 32))
        "a Scaled with its own forward, which Float8Linear's would replace"
        >>> _cannot_swap(nn.LazyLinear(32))
        'not initialised (a lazy layer before its first forward): run one batch through the model first'
        >>> _cannot_swap(nn.utils.parametrizations.weight_norm(nn.Linear(32, 32)))
        'its weight is parametrized (weight_norm, spectral_norm...), which Float8Linear takes plain'
        >>> patched = nn.Linear(32, 32)
        >>> patched.forward = lambda x: nn.functional.linear(x, patched.weight) * 2
        >>> _cannot_swap(patched)
        "its forward is replaced on the instance (Accelerate's hooks, a patch), which the swap to a new Float8Linear would drop"
        >>> _cannot_swap(nn.Linear(32, 32)) is None
        True
    """
    from torch.nn.modules.lazy import LazyModuleMixin
    from torch.nn.utils import parametrize

    lazy = isinstance(m, LazyModuleMixin)
    if lazy and m.has_uninitialized_params():  # (in_features 0: "a multiple of 16")
        return "not initialised (a lazy layer before its first forward): run one batch through the model first"
    if parametrize.is_parametrized(m):
        names = " and ".join(m.parametrizations)
        return f"its {names} is parametrized (weight_norm, spectral_norm...), which Float8Linear takes plain"
    if type(m).forward is not nn.Linear.forward:
        return f"a {type(m).__name__} with its own forward, which Float8Linear's would replace"
    # (ampguard's own fp32_modules forward is no override: fp8 does not keep fp32_modules, and
    # validate's bf16 pass leaves it on the model its fp8 copy is made from)
    # an instance forward that is the class's own bound to the layer (what Accelerate's
    # remove_hook_from_module puts back) changes nothing; ampguard's fp32_modules one is read by
    # name (precision imports this module)
    forward = vars(m).get("forward")
    own = getattr(forward, "__func__", None)
    if "forward" in vars(m) and not (own is type(m).forward and getattr(forward, "__self__", None) is m) and (
            getattr(own, "__module__", None), getattr(own, "__qualname__", None)) != ("ampguard.precision",
                                                                                     "_fp32_method"):
        return "its forward is replaced on the instance (Accelerate's hooks, a patch), which the swap to a new " \
               "Float8Linear would drop"
    if getattr(m, "_compiled_call_impl", None) is not None:
        return "compiled in place (module.compile()), which the swap to a new Float8Linear would drop: " \
               "compile after convert_to_fp8"
    # old-style weight_norm / spectral_norm: weight_g and weight_v (or weight_orig) are the parameters
    # and a forward pre-hook writes a plain tensor to .weight
    extra = [n for n, _ in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]
             if n not in ("weight", "bias")]
    if extra:
        return f"holds {', '.join(extra)} besides weight and bias (old-style weight_norm, spectral_norm...), " \
               "which Float8Linear would drop"
    if not isinstance(m.weight, nn.Parameter):
        return "its weight is not an nn.Parameter, which Float8Linear needs"
    if m.bias is not None and not isinstance(m.bias, nn.Parameter):  # (the swap would raise a TypeError)
        return "its bias is not an nn.Parameter (a buffer: a fixed bias), which Float8Linear needs"
    if children := [n for n, _ in m.named_children()]:
        return f"holds modules ({', '.join(children)}), which Float8Linear would drop"
    # torch's own hooks of a lazy layer initialised by load_state_dict (a checkpoint), not by a
    # forward: they would only have set the parameters it has
    handles = (getattr(m, "_initialize_hook", None), getattr(m, "_load_hook", None)) if lazy else ()
    torchs = {h.id for h in handles if h is not None}

    def own(hooks: dict[int, Any]) -> bool:  # (torch's own leftovers aside: weight_norm's or spectral_norm's
        # load hook, left when they are removed, only renames their legacy keys, which a plain Linear has not)
        return any(key not in torchs and not _torchs_own(hook) for key, hook in hooks.items())

    if own(m._forward_pre_hooks) or own(m._forward_hooks) or m._backward_pre_hooks or m._backward_hooks:
        return "has hooks of its own, which the swap to a new Float8Linear would drop"
    if m._state_dict_hooks or m._state_dict_pre_hooks or own(m._load_state_dict_pre_hooks) \
            or m._load_state_dict_post_hooks:
        return "has state-dict hooks of its own, which the swap to a new Float8Linear would drop " \
               "(its checkpoint keys or loading would change)"
    return None


def plan(model: nn.Module, *, keep_first_last: bool = True, exclude: Sequence[str] = ()) -> dict[str, str]:
    """Every ``nn.Linear`` of the model (by name, in module order) and what happens to it:
    :data:`CONVERT` or why it stays in high precision. The first and last layer are the first and
    last the model registers (``named_modules()``' order: the order its forward calls them in
    most models; a model that registers its head first names that one "first"), an
    attention's ``out_proj`` aside (its module calls the weights, not the layer:
    :func:`_not_called`). Which layers the forward calls is not traced: a Linear registered
    after the head and never called (an auxiliary head) is the "last layer" and the head
    converts; name the real ones in ``exclude``. A layer the swap would change or drop something of stays out
    (:func:`_cannot_swap`). A layer held at several places (reused, or a second name for it such as
    ``self.last_block = self.blocks[-1]``) is named at each of them and is one layer, placed in
    that order by its first place (a second name registered after the head does not make it the
    last layer): it converts at all of them or at none.

    Example (digits' MLP: 64-64-64-10)::

        >>> mlp = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        >>> plan(mlp)
        {'0': 'first layer', '2': 'fp8', '4': 'last layer'}
        >>> plan(mlp, keep_first_last=False, exclude=["2"])
        {'0': 'fp8', '2': 'excluded (2)', '4': 'out_features 10 is not a multiple of 16'}
        >>> plan(nn.Sequential(nn.Linear(16, 32), nn.MultiheadAttention(32, 4), nn.Linear(32, 16)))["1.out_proj"]
        'inside nn.MultiheadAttention, which does not call its forward'
        >>> shared = nn.Linear(32, 32)
        >>> plan(nn.Sequential(nn.Linear(16, 32), shared, shared, nn.Linear(32, 16)))
        {'0': 'first layer', '1': 'fp8', '2': 'fp8', '3': 'last layer'}
        >>> plan(nn.Sequential(shared, nn.Linear(32, 32), shared, nn.Linear(32, 16)))["2"]
        "the same layer as '0', which stays out there (first layer)"
    """
    cls = _float8_linear()
    unused = _not_called(model)
    # every place a layer is held (named_modules() names a reused one once, and so does torchao's swap)
    linears = [(name, m) for name, m in model.named_modules(remove_duplicate=False) if isinstance(m, nn.Linear)]
    # first and last: over each layer's first place (a second name for it is no place in that order)
    called = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and id(m) not in unused]
    out: dict[str, str] = {}
    for name, m in linears:
        pattern = next((p for p in exclude if fnmatch.fnmatchcase(name, p)), None)
        if id(m) in unused:
            out[name] = "inside nn.MultiheadAttention, which does not call its forward"
        elif cls is not None and isinstance(m, cls):
            out[name] = f"{CONVERT} (already)"
        elif name == "":
            out[name] = "a bare Linear, not a model that holds one"
        elif (why := _cannot_swap(m)) is not None:
            out[name] = why
        elif keep_first_last and name == called[0]:
            out[name] = "first layer"
        elif keep_first_last and name == called[-1]:
            out[name] = "last layer"
        elif pattern is not None:
            out[name] = f"excluded ({pattern})"
        # (the weight's shape: a lazy layer loaded from a checkpoint still says in_features 0)
        elif (n := m.weight.shape[1]) % DIM_MULTIPLE:
            out[name] = f"in_features {n} is not a multiple of {DIM_MULTIPLE}"
        elif (n := m.weight.shape[0]) % DIM_MULTIPLE:
            out[name] = f"out_features {n} is not a multiple of {DIM_MULTIPLE}"
        else:
            out[name] = CONVERT
    places: dict[int, list[str]] = {}
    for name, m in linears:
        places.setdefault(id(m), []).append(name)
    for names in places.values():  # one layer: kept out at one place is kept out at all
        kept = next((n for n in names if out[n] != CONVERT), None)
        for name in names if kept is not None else ():
            if out[name] == CONVERT:
                out[name] = f"the same layer as {kept!r}, which stays out there ({out[kept]})"
    return out


def float8_config(recipe: str = "tensorwise") -> Any:
    """torchao's ``Float8LinearConfig`` for a recipe name in :data:`RECIPES`, with
    ``pad_inner_dim`` on: a CUDA ``torch._scaled_mm`` takes only operands whose inner dimension is
    a multiple of 16, and the weight gradient's matmul (``grad_output.t() @ input``) has the
    micro-batch's token count there, which nothing else bounds (a batch of 8 rows, the last short
    batch of an epoch). torchao then pads the inner dimension of all three of a layer's matmuls
    (output, grad input, grad weight) to a multiple of 16 with zeros: the numbers are unchanged,
    and it copies both operands of each of them every step, aligned or not (torchao's default is
    off for those copies). Correctness on CUDA first: what the copies cost on a GPU is not measured.

    Example::

        >>> float8_config("rowwise").round_scales_to_power_of_2, float8_config().pad_inner_dim
        (True, True)
        >>> float8_config("blockwise")
        Traceback (most recent call last):
        ...
        ValueError: fp8 recipe must be one of tensorwise, rowwise, got 'blockwise'
    """
    if recipe not in RECIPES:
        raise ValueError(f"fp8 recipe must be one of {', '.join(RECIPES)}, got {recipe!r}")
    return dataclasses.replace(require_torchao().Float8LinearConfig.from_recipe_name(recipe), pad_inner_dim=True)


def convert_to_fp8(model: nn.Module, *, recipe: str = "tensorwise", keep_first_last: bool = True,
                   exclude: Sequence[str] = ()) -> list[str]:
    """Swap the model's eligible ``nn.Linear`` layers (:func:`plan`) for torchao's ``Float8Linear``,
    in place; return their names. The parameters stay the same objects, so the optimizer may be
    built before or after. Layers already converted are left as they are (calling it twice
    converts nothing more), but for ``pad_inner_dim``: turned on in those torchao converted
    directly (its default is off), so that the micro-batch size is free there too
    (:func:`float8_config`). A layer held at several places becomes one ``Float8Linear`` at all of
    them (torchao's swap replaces it at the first only). A model left with no float8 layer at all
    is refused (``ValueError`` naming why each Linear stayed): it would train in plain bf16 under
    the name fp8.

    Then train it with ``precision="fp8"``::

        >>> from ampguard import Guard
        >>> model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        >>> convert_to_fp8(model)
        ['2']
        >>> guard = Guard(model, torch.optim.AdamW(model.parameters()), precision="fp8")
        >>> with guard.autocast():
        ...     loss = nn.functional.cross_entropy(model(torch.rand(32, 64)), torch.randint(0, 10, (32,)))
        >>> guard.backward(loss)
        >>> guard.step().skipped, type(model[2]).__name__
        (False, 'Float8Linear')
        >>> convert_to_fp8(nn.Sequential(nn.Linear(64, 16)))
        Traceback (most recent call last):
        ...
        ValueError: no Linear layer can train in fp8 (0: first layer); set fp8.keep_first_last false, or use bf16
        >>> convert_to_fp8(nn.Linear(64, 16))  # the hint names only what would convert a layer
        Traceback (most recent call last):
        ...
        ValueError: no Linear layer can train in fp8 (the model: a bare Linear, not a model that holds one); use bf16
    """
    config = float8_config(recipe)
    # (pad_inner_dim aside: layers converted by torchao directly, with its default, are the same recipe)
    other = next((m for m in float8_modules(model) if not isinstance(getattr(m, "config", None), type(config))
                  or dataclasses.replace(m.config, pad_inner_dim=True) != config), None)
    if other is not None:  # (a second recipe was dropped unsaid: the layers kept the first one's scaling)
        raise ValueError(f"the model's Float8Linear layers were converted with another recipe than {recipe!r}: "
                         "convert a fresh model to change it")
    layers = plan(model, keep_first_last=keep_first_last, exclude=exclude)
    idle = [p for p in exclude if not any(fnmatch.fnmatchcase(name, p) for name in layers)]
    if idle:  # a typo would leave the layer it meant in fp8
        has = ", ".join(repr(n) for n in layers if n) or ("none: it is a bare Linear, not a model that holds one"
                                                          if "" in layers else "none")
        raise ValueError(f"fp8.exclude {', '.join(map(repr, idle))} matches no Linear layer of the model (it has {has})")
    chosen = [name for name, what in layers.items() if what == CONVERT]
    if not chosen and not fp8_layers(model):
        why = "; ".join(f"{name or 'the model'}: {what}" for name, what in layers.items()) or "it has none"
        would = [hint for hint, kept, left in (("set fp8.keep_first_last false", False, exclude),
                                                ("exclude fewer layers (fp8.exclude)", keep_first_last, ()))
                 if CONVERT in plan(model, keep_first_last=kept, exclude=left).values()]
        raise ValueError(f"no Linear layer can train in fp8 ({why}); {', or '.join([*would, 'use bf16'])}")
    if chosen:
        modules = dict(model.named_modules(remove_duplicate=False))
        first = {id(modules[name]): name for name in reversed(chosen)}  # a reused layer's first place
        for name in first.values():  # (a lazy layer loaded from a checkpoint says in_features 0: torchao copies it)
            modules[name].in_features = modules[name].weight.shape[1]
        # the layer itself, not just its name: torchao offers every nn.Linear, subclasses included
        require_torchao().convert_to_float8_training(
            model, module_filter_fn=lambda m, fqn: first.get(id(m)) == fqn and modules.get(fqn) is m, config=config)
        for parent in model.modules():  # the places torchao's swap did not visit
            for attr, child in list(parent._modules.items()):
                if id(child) in first and modules[first[id(child)]] is child:
                    setattr(parent, attr, model.get_submodule(first[id(child)]))
    for m in float8_modules(model):  # torchao's own conversion: pad_inner_dim on, in its config and its matmuls'
        if not m.config.pad_inner_dim:
            m.config = config
            m.linear_mm_config = type(m.linear_mm_config)(*(mm._replace(pad_inner_dim=True)
                                                            for mm in m.linear_mm_config))
    return chosen


def check_model(model: nn.Module) -> None:
    """Refuse (``ValueError``, one line) a model fp8 cannot train: one without ``Float8Linear``
    layers (not converted). The device's half (a GPU of compute capability 8.9 or newer) is
    :meth:`ampguard.precision.Precision.support`'s.

    Example::

        >>> check_model(nn.Linear(16, 16))
        Traceback (most recent call last):
        ...
        ValueError: precision fp8 trains torchao Float8Linear layers and the model has none: convert it first with ampguard.fp8.convert_to_fp8(model)
    """
    require_torchao()
    if not fp8_layers(model):
        raise ValueError("precision fp8 trains torchao Float8Linear layers and the model has none: convert it first "
                         "with ampguard.fp8.convert_to_fp8(model)")


# ---------------------------------------------------------------------------- naming a bad scale


@dataclass(frozen=True)
class BadScale:
    """One float8 cast whose dynamic scale was non-finite or zero.

    ``role`` is the operand: ``input``, ``weight`` or ``grad_output``; ``amax`` the largest
    magnitude of the tensor (nan when it held a NaN); ``scale`` the worst scale (nan, 0 or inf).

    Example::

        >>> print(BadScale("blocks.0.fc", "weight", amax=0.0, scale=math.inf))
        blocks.0.fc weight: amax 0 -> fp8 scale inf (the scale itself is broken: the tensor is finite)
        >>> print(BadScale("fc", "input", amax=math.nan, scale=math.nan))
        fc input: amax nan -> fp8 scale nan (the tensor itself is not finite)
    """

    module: str
    role: str
    amax: float
    scale: float

    @property
    def broken_scale(self) -> bool:
        """The tensor was finite: the scale computation failed (a zero amax without a floor)."""
        return math.isfinite(self.amax)

    def __str__(self) -> str:
        why = ("the scale itself is broken: the tensor is finite" if self.broken_scale
               else "the tensor itself is not finite")
        return f"{self.module} {self.role}: amax {self.amax:g} -> fp8 scale {self.scale:g} ({why})"


@dataclass(frozen=True)
class CastStats:
    """One float8 cast: the largest magnitude, the worst scale, and the share of the tensor's
    nonzero values that the cast flushes to zero (below half float8's smallest subnormal after
    scaling): one outlier in a tensorwise-scaled tensor shrinks the scale until the rest vanish.

    Example::

        >>> print(CastStats("fc", "weight", amax=1e4, scale=0.0448, flushed=0.97))
        fc weight: amax 1e+04, fp8 scale 0.0448, 97.0% of its nonzero values flush to 0
    """

    module: str
    role: str
    amax: float
    scale: float
    flushed: float

    def __str__(self) -> str:
        return (f"{self.module} {self.role}: amax {self.amax:.3g}, fp8 scale {self.scale:.3g}, "
                f"{self.flushed:.1%} of its nonzero values flush to 0")


def _flush_below(dtype: torch.dtype) -> float:
    """Half the smallest subnormal of a float8 dtype: a scaled magnitude below it rounds to 0."""
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps / 2


class ScaleWatch:
    """While open, every float8 cast of the model's ``Float8Linear`` layers (input and weight in
    the forward, ``grad_output`` in the backward) is recomputed with torchao's own scale function
    (``tensor_to_scale``, with each layer's cast settings) and kept as device tensors;
    :meth:`bad` reads them (host syncs) and lists the non-finite or zero ones, forward casts
    first, in the order they ran; :meth:`stats` gives every cast with its flushed share. A layer
    held at several places is one module, and a call does not say through which name it came
    (``self.again is self.sh``): its casts are named at every place, ``"sh (the same layer as
    again)"``.

    A diagnostic: it repeats each amax reduction. Open it around one micro-batch (it keeps every
    cast it sees); :func:`find_bad_scales` does that for you.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.seen: list[tuple[str, str, torch.Tensor, torch.Tensor, torch.Tensor]] = []  # module, role, amax,
        # worst scale, flushed share
        self._handles: list[Any] = []

    def __enter__(self) -> ScaleWatch:
        cls = _float8_linear()
        places: dict[int, list[str]] = {}
        for name, module in self.model.named_modules(remove_duplicate=False):
            places.setdefault(id(module), []).append(name)
        for first, module in self.model.named_modules():
            if cls is not None and isinstance(module, cls):
                others = ", ".join(n for n in places[id(module)] if n != first)
                name = f"{first} (the same layer as {others})" if others else first
                self._handles.append(module.register_forward_pre_hook(self._forward_casts(name), with_kwargs=True))
                self._handles.append(module.register_forward_hook(self._backward_cast(name)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _record(self, name: str, role: str, tensor: torch.Tensor, cast: Any, dim: int, round_pow2: bool) -> None:
        from torchao.float8 import float8_scaling_utils as scaling

        granularity = cast.scaling_granularity
        axiswise = dim if granularity.name == "AXISWISE" else None
        with torch.no_grad():
            t = tensor.detach().reshape(-1, tensor.shape[-1])
            scale = scaling.tensor_to_scale(t, cast.target_dtype, False, None, granularity, axiswise, round_pow2)
            nan, zero, inf = scale.isnan().any(), (scale == 0).any(), scale.isinf().any()
            worst = torch.where(nan, math.nan, torch.where(zero, 0.0, torch.where(inf, math.inf, scale.min())))
            nonzero = t != 0
            flushed = (nonzero & ((t.float() * scale).abs() < _flush_below(cast.target_dtype))).sum()
            share = flushed / nonzero.sum().clamp(min=1)
            self.seen.append((name, role, t.abs().float().max(), worst.float(), share.float()))

    def _forward_casts(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            c = module.config
            # the input as the model passes it: layer(x) or layer(input=x) (a call Float8Linear.forward
            # itself would refuse is left to raise there, not here)
            x = args[0] if args else kwargs.get("input")
            if isinstance(x, torch.Tensor) and c.cast_config_input.scaling_type.name != "DISABLED":
                self._record(name, "input", x, c.cast_config_input, -1, c.round_scales_to_power_of_2)
            if c.cast_config_weight.scaling_type.name != "DISABLED":
                self._record(name, "weight", module.weight.t(), c.cast_config_weight, 0, c.round_scales_to_power_of_2)
        return hook

    def _backward_cast(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
            c = module.config
            if output.requires_grad and c.cast_config_grad_output.scaling_type.name != "DISABLED":
                output.register_hook(lambda grad: self._record(name, "grad_output", grad, c.cast_config_grad_output,
                                                               -1, c.round_scales_to_power_of_2))
        return hook

    def bad(self) -> list[BadScale]:
        """The casts whose scale was non-finite or zero, in the order they ran (host reads)."""
        out = []
        for name, role, amax, worst, _ in self.seen:
            scale = float(worst)
            if not math.isfinite(scale) or scale == 0.0:
                out.append(BadScale(name, role, float(amax), scale))
        return out

    def stats(self) -> list[CastStats]:
        """Every cast seen, in the order they ran, with its flushed share (host reads)."""
        return [CastStats(name, role, float(amax), float(worst), float(share))
                for name, role, amax, worst, share in self.seen]


def find_bad_scales(model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor], inputs: Any, targets: Any,
                    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
                    ) -> list[BadScale]:
    """Replay one micro-batch (forward, loss, backward) under ``autocast`` (the run's:
    ``Precision("fp8", ...).autocast``) and name every float8 cast whose scale was non-finite or
    zero (:class:`ScaleWatch`). Leaves no trace: gradients, buffers, mode and RNG are restored.
    The first entry is where it began; backward casts downstream of a NaN follow it.

    Example (a weight that holds a NaN: its scale is NaN, the step would skip)::

        >>> model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        >>> _ = convert_to_fp8(model)
        >>> with torch.no_grad():
        ...     model[2].weight[0, 0] = float("nan")
        >>> x, y = torch.rand(8, 16), torch.randint(0, 4, (8,))
        >>> print(find_bad_scales(model, nn.functional.cross_entropy, x, y)[0])
        2 weight: amax nan -> fp8 scale nan (the tensor itself is not finite)
        >>> model[2].weight.grad is None
        True
    """
    return _replay(model, loss_fn, inputs, targets, autocast).bad()


def cast_stats(model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor], inputs: Any, targets: Any,
               autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
               ) -> list[CastStats]:
    """Replay one micro-batch as :func:`find_bad_scales` does and return every float8 cast with
    its amax, scale and the share of its nonzero values flushed to zero: where an outlier
    silences the rest of a tensor (the ``rowwise`` recipe confines it to its row).

    Example (one outlier of 1e4 among weights of about 0.01)::

        >>> model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        >>> _ = convert_to_fp8(model)
        >>> with torch.no_grad():
        ...     _ = model[2].weight.normal_(0, 0.01)
        ...     model[2].weight[0, 0] = 1e4
        >>> x, y = torch.rand(8, 16), torch.randint(0, 4, (8,))
        >>> weight = [s for s in cast_stats(model, nn.functional.cross_entropy, x, y) if s.role == "weight"][0]
        >>> weight.flushed > 0.9
        True
    """
    return _replay(model, loss_fn, inputs, targets, autocast).stats()


def _replay(model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor], inputs: Any, targets: Any,
            autocast: Callable[[], contextlib.AbstractContextManager]) -> ScaleWatch:
    """Forward, loss and backward of one micro-batch under a :class:`ScaleWatch`, leaving no trace."""
    with untouched(model, passes=1), ScaleWatch(model) as watch:
        with autocast():
            loss = loss_fn(model(inputs), targets)
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss.float().backward()
    return watch

