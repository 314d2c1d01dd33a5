"""What a :class:`~ampguard.step.Guard` watches outside its own calls: the process's module and
parameter registrations (a model changed under it), an ``optimizer.step()`` of the loop's own
beside the guard's (refused), and whether the first training forward ran under autocast.

Module-level state, hooks and the small helpers around them, kept out of ``step.py`` so the step
reads as the recipe. The hooks are module-level functions (a model or optimizer that holds one
still pickles); ``ampguard.step`` re-exports :func:`_note_autocast`, which older pickles name
there. Each hook costs a counter read on the guard's own steps.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from . import distributed
from .errors import counted
from .untouched import outlives_passes

UNFROZEN_EVERY = 64
"""Every this many groups a guard looks for a parameter no optimizer holds that requires grad
again (unfrozen without ``add_param_group``); a frozen backbone's tensors are not looked at
every step."""

class _Watched:
    """What the hooks below count and note, process-wide (one object: ``step.py`` reads its
    attributes as they are now, which an imported global would not be)."""

    __slots__ = ("registered", "buffers")

    def __init__(self) -> None:
        self.registered = 0
        """A count of parameter and module registrations anywhere (torch's global registration
        hooks, installed with the first :class:`Guard`): one that changed since a guard read its
        parameters means a module may have been added to its model."""
        self.buffers = 0
        """A count of buffer registrations anywhere: with :attr:`registered`, one that changed
        since a :class:`RunningStats` read its layers means a BatchNorm may have been made
        (``nn.BatchNorm1d(4, affine=False)`` registers buffers only, and ``Sequential.insert``
        nothing)."""


WATCHED = _Watched()


class _Stepping(threading.local):
    """Each thread's guards' own ``optimizer.step()`` calls: per thread, as the calls are (a
    count the whole process shared let a loop's stray ``optimizer.step()`` in one thread through
    while another thread's guard stepped: about half of them, each applying its gradients
    unchecked, then again by its guard; review 51c)."""

    def __init__(self) -> None:
        self.stepping: dict[int, int] = {}
        """The optimizers (by id) a guard is inside the ``step()`` of now in this thread, each with
        how many times over (:func:`_refuse_stray_step`: a guard's own; another optimizer stepped
        from a hook inside it is not, review 51l)."""
        self.finished: Any = None
        """The optimizer whose ``step()`` last finished its update in this thread
        (:func:`_mark_finished`, its first step post-hook): an error from the ``step()`` call
        after it is a later post-hook's, the update stands."""


STEPPING = _Stepping()


def _count_registration(*args: Any) -> None:
    """A module or parameter registered. Not counted while dynamo traces (a count read inside a
    compiled graph guards it, and ``fullgraph=True`` and a strict ``torch.export`` refuse the
    side effect or a disabled call): a layer a compiled forward makes is found by the guard's
    look every :data:`UNFROZEN_EVERY` steps instead."""
    if not torch.compiler.is_compiling():
        WATCHED.registered += 1


def _count_buffer(module: nn.Module, name: str, buffer: Any) -> None:
    """A buffer registered: counted when its name is new to the module (or a normalization
    layer's that held None: ``track_running_stats`` turned on), not a forward's assignment to one
    it has (``self.n = self.n + 1``, a cache set to None and back each step: a compiled forward
    that did it recompiled at each call on the count, until dynamo's limit left it uncompiled).
    Not while dynamo traces (:func:`_count_registration`)."""
    if torch.compiler.is_compiling():
        return
    if name not in module._buffers or (module._buffers[name] is None
                                       and isinstance(module, nn.modules.batchnorm._NormBase)):
        WATCHED.buffers += 1


@functools.cache
def _watch_registrations() -> None:
    """Install the global hooks that count registrations (once per process)."""
    torch.nn.modules.module.register_module_parameter_registration_hook(_count_registration)
    torch.nn.modules.module.register_module_module_registration_hook(_count_registration)
    torch.nn.modules.module.register_module_buffer_registration_hook(_count_buffer)


_GUARDED: weakref.WeakKeyDictionary[torch.optim.Optimizer, weakref.WeakSet[Any]] = weakref.WeakKeyDictionary()
"""Each optimizer a Guard holds -> the last Guard built over it and that guard's copies (its step
pre-hook is installed once; a new guard takes the optimizer over from one abandoned with a step
open: a retried fit)."""


def _refuse_stray_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """An optimizer step pre-hook: ``optimizer.step()`` while a Guard holding the optimizer has a
    step open (after ``guard.backward()``, before ``guard.step()``), from outside the guard, is a
    loop's own ``optimizer.step()`` (or ``scaler.step(optimizer)``) kept beside it. It applied the
    group's gradients unchecked and unclipped (still scaled, under fp16; a NaN too, while the guard
    then recorded a skip), and the guard applied them again. Refused before it changes anything,
    and only with gradients there to apply. Between the guard's steps the optimizer is the
    caller's (no gradient is left to apply there: the guard drops them). On the guard's own steps
    one read of a counter."""
    if id(optimizer) in STEPPING.stepping:
        return
    guards = _GUARDED.get(optimizer, ())
    if any(guard.micro_batches or guard.pending for guard in guards) and holds_gradients(optimizer):
        raise RuntimeError(f"{type(optimizer).__name__}.step() called outside the guard after guard.backward(): "
                           "it would apply gradients the guard has not checked or clipped, and guard.step() "
                           "steps the optimizer itself; remove your own optimizer.step() / "
                           "scaler.step(optimizer) from the loop (under Lightning's manual optimization, "
                           "step self.optimizers(), not the raw torch optimizer)")


def _mark_finished(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if id(optimizer) in STEPPING.stepping:  # (the guard's own steps only; it lets go of the optimizer after each)
        STEPPING.finished = optimizer


def _code_of(hook: Any) -> Any:
    """The code a hook runs as (its frame's in a traceback): a function's or method's, through
    ``functools.wraps`` layers, a ``functools.partial`` (nested too) and a callable object's
    ``__call__`` (review 56a: those two had none, and a pre-hook of theirs that refused was said to
    leave an update "maybe partly applied"); None for one that runs no Python code of its own.

    Example::

        >>> class Refuser:
        ...     def __call__(self, optimizer, args, kwargs): ...
        >>> _code_of(functools.partial(Refuser())) is Refuser.__call__.__code__
        True
    """
    for _ in range(8):  # (a few layers deep: a partial of a bound method of a wrapped function)
        try:
            hook = inspect.unwrap(hook)
        except ValueError:  # (a __wrapped__ cycle)
            return None
        if isinstance(hook, functools.partial):
            hook = hook.func
        elif hasattr(hook, "__func__"):  # (a bound method)
            hook = hook.__func__
        elif (code := getattr(hook, "__code__", None)) is not None:
            return code
        else:
            hook = getattr(type(hook), "__call__", None)
            if hook is None:
                return None
    return None


def began_update(optimizer: torch.optim.Optimizer, err: BaseException) -> bool:
    """Whether ``optimizer.step()``, which raised ``err`` before it finished, may have begun its
    update: False only where that is certain, ``err`` raised by one of its step pre-hooks (torch's
    global ones or its own), which run before the update, from outside the step's own body (a
    frame of a pre-hook's code in the traceback, none of the body's). An error anywhere else
    inside ``step()`` (an out-of-memory as it makes its state, a Ctrl-C between two parameters of
    a per-tensor loop) may have left some parameters and their state moved (review 55r). Read on
    the error path only: the traceback's frames against the hooks' code."""
    from torch.optim import optimizer as torch_optimizer

    hooks = [*getattr(torch_optimizer, "_global_optimizer_pre_hooks", {}).values(),
             *getattr(optimizer, "_optimizer_step_pre_hooks", {}).values()]
    codes = {code for hook in hooks if (code := _code_of(hook)) is not None}
    body = getattr(inspect.unwrap(getattr(type(optimizer), "step", None)), "__code__", None)
    in_hook = False
    tb = err.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code is body:  # (the update's own code ran: whatever a hook inside it raised)
            return True
        in_hook = in_hook or code in codes
        tb = tb.tb_next
    return not in_hook


class _GuardStepping:
    """``with _GuardStepping(optimizers):`` around a guard's own ``optimizer.step()`` calls:
    :func:`_refuse_stray_step` lets those optimizers' through in this thread, and ``STEPPING.finished`` (which
    one finished its update) is put back as it was after (another guard's, when this step runs
    inside its optimizer's post-hook). A class, not a generator: a quarter of the cost on the hot
    path."""

    __slots__ = ("finished", "ids")

    def __init__(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        self.ids = [id(optimizer) for optimizer in optimizers]

    def __enter__(self) -> None:
        stepping = STEPPING
        for i in self.ids:
            stepping.stepping[i] = stepping.stepping.get(i, 0) + 1
        self.finished = stepping.finished

    def __exit__(self, *exc: object) -> None:
        stepping = STEPPING
        for i in self.ids:
            if stepping.stepping[i] == 1:
                del stepping.stepping[i]
            else:
                stepping.stepping[i] -= 1
        stepping.finished = self.finished


def holds_gradients(optimizer: Any) -> bool:
    """Whether any parameter ``optimizer`` holds has a gradient: for the refusals outside the step
    (the guard drops its own after each step, so none should be left there). O(parameters)."""
    return any(p.grad is not None for group in optimizer.param_groups for p in group["params"])


def _hook_stray_steps(guard: Any, optimizers: Mapping[str, torch.optim.Optimizer], taken: bool = True) -> None:
    """Have :func:`_refuse_stray_step` watch ``optimizers`` for ``guard`` while it lives (an
    optimizer without torch's step hooks, one that only has ``param_groups``, is not watched);
    ``taken=False`` (a copy): beside the guards that watch it already (a shallow copy shares the
    original's optimizers: each of the two, while it lives, refuses for its own open step)."""
    for optimizer in optimizers.values():
        if not hasattr(optimizer, "register_step_pre_hook"):
            continue
        if _refuse_stray_step not in getattr(optimizer, "_optimizer_step_pre_hooks", {}).values():
            optimizer.register_step_pre_hook(_refuse_stray_step)  # (a copied optimizer holds the hook already)
        posts = getattr(optimizer, "_optimizer_step_post_hooks", None)
        if isinstance(posts, dict) and _mark_finished not in posts.values():  # (first: before any that may raise)
            handle = optimizer.register_step_post_hook(_mark_finished)
            others = [(k, h) for k, h in posts.items() if k != handle.id]
            posts.clear()
            posts[handle.id] = _mark_finished
            posts.update(others)
        if taken or optimizer not in _GUARDED:
            _GUARDED[optimizer] = weakref.WeakSet([guard])
        else:
            _GUARDED[optimizer].add(guard)


_PROBING: weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet[Any]] = weakref.WeakKeyDictionary()
"""Each module a guard probes for autocast (:func:`_probe_autocast`) -> the guards probing it."""


def _note_autocast(module: nn.Module, args: Any) -> None:
    """A forward pre-hook: each probing guard notes, at each training forward (one that records
    gradients: an evaluation under ``torch.no_grad()`` before training is not it) until its
    first backward, the autocast dtype it ran under for its device (``False`` without
    autocast): the last one before the backward is the one trained (an evaluation with
    gradients on, under autocast, before training, was taken for it: review 51l). A module-level
    function (a model with the hook still pickles). Nothing while ``torch.compile`` traces it: a
    graph that read the registry would be guarded on its entries' positions (a collected model
    made a later compile fail with an ``IndexError``). On a module no guard probes (a copy of the
    model, which took the hook with it) it removes itself (:func:`_shed`)."""
    if torch.compiler.is_compiling():
        return
    probing = _PROBING.get(module)
    if not probing:  # (a copy's: an EMA's deepcopy, swa_utils' AveragedModel, made before the first backward)
        _shed(module, _note_autocast, _PROBING)
        return
    if not torch.is_grad_enabled():
        return
    for guard in probing:
        if guard._autocast_probes:  # (its probe still open)
            device_type = guard.precision.device_type
            guard._forward_autocast = torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type)


def note_autocast_inside(module: nn.Module) -> None:
    """:func:`_note_autocast` again from inside a forward that enters its autocast itself (the
    wrapper ``GuardedTrainer`` puts on the model's forward, as Accelerate does the stock Trainer's):
    the probe's pre-hook ran before the wrapper, outside its autocast. Nothing once the probe ended."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return
    probing = _PROBING.get(module)
    if not probing:  # (none: nothing to note, and nothing to shed, which the hook itself does)
        return
    for guard in probing:
        if guard._autocast_probes:  # (still open: what the pre-hook noted outside the wrapper is taken back)
            guard._forward_autocast = None
    _note_autocast(module, ())


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` runs through ``torch.compile``: its wrapper (``OptimizedModule``), or
    compiled in place (``module.compile()``). A hook added to one, then removed, makes dynamo
    compile it again."""
    return type(module).__name__ == "OptimizedModule" or getattr(module, "_compiled_call_impl", None) is not None


def compiled_inside(model: nn.Module) -> bool:
    """Whether ``model`` or a module inside it is compiled (``torch.compile(m)`` kept as a child,
    or ``m.compile()``: :func:`is_compiled`).

    Example::

        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> compiled_inside(model)
        False
        >>> model[0].compile(); compiled_inside(model)
        True
    """
    return any(map(is_compiled, model.modules()))


class _Notes:
    """Where the leaves' hooks note their dtypes (:func:`_note_dtype`) while ``open``; hooks left
    on a model after its first forward (traced into a compiled graph) find it closed.
    ``autocast``: whether autocast was on for a layer they noted (a loop that asked for fp16 on
    a CPU, where Hugging Face's Trainer makes no autocast, computed every layer in float32)."""

    __slots__ = ("dtypes", "open", "autocast")

    def __init__(self, dtypes: dict[str, str]) -> None:
        self.dtypes, self.open, self.autocast = dtypes, True, False


def _note_dtype(notes: _Notes, name: str, module: nn.Module, args: Any, output: Any) -> None:
    """A forward hook (:func:`note_dtypes`): the dtype of the module's output's first
    floating-point tensor, at its first call. Nothing while ``torch.compile`` traces it (the
    test short-circuits there: a graph never reads ``notes``, nor is guarded on it), nor once
    ``notes`` is closed. A module-level function: a model with the hook on it still pickles."""
    if torch.compiler.is_compiling() or not notes.open:
        return
    if name not in notes.dtypes:
        floats = [t for t in torch.utils._pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if floats:
            notes.dtypes[name] = str(floats[0].dtype).removeprefix("torch.")
            notes.autocast = notes.autocast or torch.is_autocast_enabled(floats[0].device.type)


def note_dtypes(model: nn.Module, notes: _Notes) -> dict[str, Any]:
    """Hook each leaf module of ``model`` (one with no children) to note in ``notes`` (name ->
    ``"bfloat16"``...) its output's dtype at its first call (:func:`_note_dtype`); the handles by name."""
    return {name: module.register_forward_hook(functools.partial(_note_dtype, notes, name))
            for name, module in ((name or type(module).__name__, module)  # (a model of one layer: its class)
                                 for name, module in model.named_modules() if next(module.children(), None) is None)}


def compiled_graphs() -> int:
    """The graphs dynamo compiled in this process so far (0 when it was never imported)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return int(utils.counters["stats"]["unique_graphs"]) if utils is not None else 0


@contextlib.contextmanager
def first_forward_dtypes(model: nn.Module, owner: Any) -> Iterator[None]:
    """Around a loop's first forward under autocast: each leaf of ``model`` notes its output's
    dtype, and ``owner.autocast_dtypes`` is what they noted (the float32 map; ``{}`` while the
    block runs). No hooks for a model with something compiled inside or one FSDP2 shards
    (hooks added and removed on those): ``{}``. At the exit a leaf that noted its dtype ran
    eagerly, and its hook goes; one that noted nothing keeps its hook, closed (it notes nothing
    more), until ``owner`` goes, when dynamo compiled a graph during the block: it may have been
    traced into it (a part of the model compiled on its own, or a ``torch.compile`` wrapper
    beside it), and removed, it would make dynamo compile that again. A block that raises
    leaves no hooks and sets ``owner.autocast_dtypes`` back to ``None``: the next forward notes
    them (a retried out-of-memory). A forward that ran without autocast leaves ``{}``: no layer
    was computed under it, and "every layer float32" would read as autocast's choice."""
    owner.autocast_dtypes = {}
    notes, handles = _Notes({}), {}
    if not (compiled_inside(model) or any(map(distributed.is_sharded, model.modules()))):
        handles = note_dtypes(model, notes)
    graphs = compiled_graphs()
    try:
        yield
    except BaseException:
        owner.autocast_dtypes = None
        for handle in handles.values():
            handle.remove()
        raise
    finally:
        notes.open = False
    traced = compiled_graphs() != graphs
    for name, handle in handles.items():
        if traced and name not in notes.dtypes:
            weakref.finalize(owner, handle.remove)
        else:
            handle.remove()
    owner.autocast_dtypes = notes.dtypes if notes.autocast else {}


@contextlib.contextmanager
def recording_dtypes(model: nn.Module, dtypes: dict[str, str]) -> Iterator[None]:
    """While open, each leaf module of ``model`` that runs notes its output's dtype in ``dtypes``
    (:func:`note_dtypes`): under autocast, the layers it computed in float32 (the seed's
    "regions that may stay in FP32", for the run card and the checkpoint). Hooks gone at the exit.

    Example (bf16 autocast on the CPU: an embedding is a lookup autocast leaves in float32; on
    CUDA LayerNorm and softmax are float32 too; a ``loss_fn`` outside the model is not seen)::

        >>> model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 1))
        >>> seen = {}
        >>> with torch.autocast("cpu", dtype=torch.bfloat16), recording_dtypes(model, seen):
        ...     _ = model(torch.tensor([1, 2]))
        >>> seen, model[0]._forward_hooks
        ({'0': 'float32', '1': 'bfloat16'}, OrderedDict())
    """
    handles = note_dtypes(model, _Notes(dtypes))
    try:
        yield
    finally:
        for handle in handles.values():
            handle.remove()


FLOAT32_LAYERS_SHOWN = 6
"""How many of the layers autocast left in float32 the run card names (the rest counted)."""


def float32_layers_text(dtypes: dict[str, str]) -> str:
    """The run card's "float32 under autocast": the leaf modules whose output autocast left in
    float32 (:func:`recording_dtypes`), of how many.

    Example::

        >>> float32_layers_text({"wte": "float32", "h.0.attn": "bfloat16", "ln_f": "float32", "head": "bfloat16"})
        'wte, ln_f (2 of 4 layers; the others bfloat16)'
        >>> float32_layers_text({"fc": "float16"})
        'none (1 layer, in float16)'
        >>> float32_layers_text({})  # (a compiled model: no layer noted)
        'none noted'
    """
    if not dtypes:
        return "none noted"
    kept = [name for name, dtype in dtypes.items() if dtype == "float32"]
    others = sorted({dtype for dtype in dtypes.values() if dtype != "float32"})
    if not kept:
        return f"none ({counted(len(dtypes), 'layer')}, in {', '.join(others)})"
    named = ", ".join(kept[:FLOAT32_LAYERS_SHOWN]) + (", ..." if len(kept) > FLOAT32_LAYERS_SHOWN else "")
    rest = f"; the others {', '.join(others)}" if others else ""
    return f"{named} ({len(kept)} of {counted(len(dtypes), 'layer')}{rest})"


def _probe_autocast(guard: Any, modules: Sequence[nn.Module]) -> list[Any]:
    """:func:`_note_autocast` on ``modules`` for ``guard``: the hooks' handles, which the guard
    removes at its first backward when that saw a forward through the module's ``__call__``;
    otherwise (``model.forward(x)`` called directly, a model compiled after ``Guard()``, a guard
    never used) they stay until the guard is collected (the model does not keep it alive), a
    Python call on each forward. A compiled module is not probed: a hook removed after its first call
    would make ``torch.compile`` compile it again. Nor is a model under DDP or FSDP2."""
    handles = []
    for module in modules:
        # (not DDP's nor FSDP2's: with their own hooks, a torchrun job's rank 0 sometimes aborted at exit
        # when one was added and removed)
        if is_compiled(module) or distributed.defers_sync(module):
            continue
        with _HOOKS_LOCK:  # (not between a copy's hook finding no guard and its removing itself: _shed)
            _PROBING.setdefault(module, weakref.WeakSet()).add(guard)
            handle = module.register_forward_pre_hook(_note_autocast)
        weakref.finalize(guard, handle.remove)
        handles.append(handle)
    return handles


def _parameter_count(optimizers: dict[str, torch.optim.Optimizer]) -> int:
    """How many parameters the optimizers hold: a change means ``add_param_group`` (or a group
    taken out) since the guard read them."""
    return sum(len(group["params"]) for opt in optimizers.values() for group in opt.param_groups)


def _parameter_slots(root: nn.Module) -> int:
    """How many parameters the modules under ``root`` hold (a tied one once a module holding it;
    a slot set to None not): another number than a guard read means a parameter was added,
    registered or not (one a compiled forward made: no count while dynamo traces), or taken out.
    ~0.8 us a module.

    Example::

        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1, bias=False))
        >>> _parameter_slots(model)
        3
    """
    return sum(p is not None for module in root.modules() for p in module._parameters.values())


_KEEPING: weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet[Any]] = weakref.WeakKeyDictionary()
"""Each watched layer's :class:`RunningStats` keepers (a layer forgets them with its guard)."""
_HOOKED: weakref.WeakKeyDictionary[nn.Module, list[Any]] = weakref.WeakKeyDictionary()
"""Each layer's hook handle and how many keepers watch it (the hook goes with the last)."""
_HOOKS_LOCK = threading.RLock()  # (a finalizer may run in any thread, and inside the lock: re-entrant)


@outlives_passes  # (a pass's forward may register it on a layer added since the last look: it stays)
def _keep_running_stats(module: nn.Module, args: Any) -> None:
    """A forward pre-hook on each layer that tracks running statistics (or observes: a QAT
    model's observers and fake-quantizers, :func:`_tracking_layers`): before the layer runs in
    training mode (it then writes them, under ``torch.no_grad()`` too), each keeper watching it
    copies the statistics, once a step. A module-level function (a model with it pickles, and
    loads where ampguard is installed). Nothing while ``torch.compile`` traces it, checked before
    the registry is read (a graph guarded on the registry would compile again with every guard
    made or collected). On a layer no keeper watches it removes itself (:func:`_shed`), at any
    forward, in eval mode too: a copy's (an EMA's deepcopy, swa_utils' ``AveragedModel``, a
    teacher), which took the hook with it, or an unpickled model's whose guard is gone."""
    if torch.compiler.is_compiling():
        return
    keepers = _KEEPING.get(module)
    if not keepers:
        _shed(module, _keep_running_stats, _KEEPING)
        return
    if not (module.training or _observes_in_eval(module)):
        return
    with _HOOKS_LOCK:  # (the set as it is now: another thread may be adding a keeper to it)
        keepers = list(keepers)
    for keeper in keepers:
        keeper.keep()


def _shed(module: nn.Module, hook: Any, registry: weakref.WeakKeyDictionary[nn.Module, Any]) -> None:
    """Take ``hook`` off ``module``, which no guard watches (``registry`` holds none for it): its
    own hook, a handle's, is the guard's to remove (:func:`_release`, the probe's end). Review
    54a: a copy of a guarded model (``copy.deepcopy``, ``AveragedModel``) took ampguard's hooks
    with it, kept for good (nothing held their handles), so a ``torch.save(copy)`` named
    ``ampguard.watch`` and did not load where ampguard is not installed; now the copy's first
    forward sheds them (a copy saved before any forward of its own still names them). Under the
    lock, checked again: a guard may be taking the module on in another thread. The tables are
    edited in place (the handles of a user's own hooks on the module point at them: review 54l,
    new tables left ``handle.remove()`` doing nothing), but where they are a watched module's too
    (a shallow copy: ``copy.copy``, the replicas ``nn.DataParallel`` makes, share them with the
    original, whose guard still needs its hook) the module gets new tables without it (review
    54i: a copy's first forward took the original's hooks off)."""
    with _HOOKS_LOCK:
        if registry.get(module) or (hook is _keep_running_stats and module in _HOOKED):  # (_release's to remove)
            return
        hooks, with_kwargs = module._forward_pre_hooks, module._forward_pre_hooks_with_kwargs
        shed = [key for key, value in hooks.items() if value is hook]
        if not shed:
            return
        watched = [*_PROBING.keys(), *_KEEPING.keys(), *_HOOKED.keys()]
        if any(other is not module and other._forward_pre_hooks is hooks for other in watched):
            module._forward_pre_hooks = OrderedDict((k, v) for k, v in hooks.items() if k not in shed)
            module._forward_pre_hooks_with_kwargs = OrderedDict((k, v) for k, v in with_kwargs.items() if k not in shed)
            return
        for key in shed:
            del hooks[key]
            with_kwargs.pop(key, None)


def _ours(layer: nn.Module) -> bool:
    """Whether ``layer`` already has the hook (a copy's or an unpickled model's: not stacked again)."""
    return any(hook is _keep_running_stats for hook in layer._forward_pre_hooks.values())


def _release(layers: list[weakref.ReferenceType[nn.Module]]) -> None:
    """A keeper was collected (or stopped watching these layers): a layer no keeper watches any
    more loses the hook it was given."""
    with _HOOKS_LOCK:
        for ref in layers:
            layer = ref()
            entry = _HOOKED.get(layer) if layer is not None else None
            if entry is None:
                continue
            entry[1] -= 1
            if not entry[1]:
                entry[0].remove()
                del _HOOKED[layer]


def _quantizer_types() -> tuple[type, ...]:
    """torch.ao's observers and fake-quantizers (quantization-aware training: ``prepare_qat``), the
    classes of those of its modules loaded (looked up in ``sys.modules``, never imported: a model
    with one has them loaded); none where neither is."""
    found = (getattr(sys.modules.get("torch.ao.quantization.observer"), "ObserverBase", None),
             getattr(sys.modules.get("torch.ao.quantization.fake_quantize"), "FakeQuantizeBase", None))
    return tuple(t for t in found if t is not None)


def _tracking_layers(modules: Sequence[nn.Module]) -> list[nn.Module]:
    """The layers of ``modules`` that write statistics in a training forward, once each: the
    normalization layers that track running statistics, and torch.ao's observers and
    fake-quantizers that have buffers (:func:`_written`)."""
    quantizers = _quantizer_types()
    return list(dict.fromkeys(m for root in modules for m in root.modules()
                              if (isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats)
                              or (isinstance(m, quantizers) and m._buffers)))


def _observes_in_eval(layer: nn.Module) -> bool:
    """Whether ``layer`` writes its buffers in a forward in eval mode: torch.ao's observers and
    fake-quantizers record in ``eval()`` too (a QAT model fine-tuned with its BatchNorm frozen by
    ``model.eval()``: review 55w, one NaN batch left it dead), a normalization layer does not. Asked
    with gradients on (a training step's forward; an evaluation under ``no_grad`` is no step)."""
    return not isinstance(layer, nn.modules.batchnorm._NormBase) and torch.is_grad_enabled()


def _written(layer: nn.Module) -> Iterable[torch.Tensor | None]:
    """The buffers of a watched layer that its forward writes: a normalization layer's running
    statistics and count; an observer's or fake-quantizer's own buffers, all of them (``min_val``,
    ``max_val``, a histogram, ``scale``, ``zero_point``, a handful of numbers a layer, or a
    channel's; the fused ``FusedMovingAvgObsFakeQuantize`` writes its observer's and its own
    without calling the observer, so both are watched)."""
    if isinstance(layer, nn.modules.batchnorm._NormBase):
        return (layer.running_mean, layer.running_var, layer.num_batches_tracked)
    return layer._buffers.values()


class RunningStats:
    """The running statistics a forward writes (BatchNorm's, an InstanceNorm's that tracks them) in
    ``modules``: copied before the first of those layers writes them in a step (any forward of a
    layer in training mode, by a pre-hook on those layers; and by :meth:`keep_before_training`,
    which ``Guard.autocast()`` calls, so a compiled model's are copied too), put back when the
    step is skipped (:meth:`end_step`). A skip leaves the parameters and the
    optimizer's state as they were; without this, the forward of a NaN batch it skipped had left a
    BatchNorm's statistics NaN for good (every evaluation after it NaN). The same for a
    quantization-aware model's observers and fake-quantizers (torch.ao's ``prepare_qat``), whose
    buffers a training forward writes too: a NaN batch left their ``min_val`` / ``max_val`` and
    ``scale`` NaN, and as their training forward reads them, every step after it skipped (review
    55m); a buffer the forward resized in place (an empty per-channel ``min_val``'s first
    observation) is resized back. Those layer types only, not every buffer of the model: a
    buffer of another module is a cache or a constant (a rotary table, a causal mask: copied at
    every step for nothing, some large) or state its module means to keep (a queue, an EMA, a
    counter), which the put-back cannot tell from statistics. A model without such layers gets
    no hook and pays nothing; other modules never run one.

    Example (a NaN batch through a BatchNorm, its step skipped: the statistics as they were)::

        >>> bn = nn.BatchNorm1d(2)
        >>> stats = RunningStats([bn])
        >>> _ = bn(torch.ones(4, 2))  # step 1, applied
        >>> stats.end_step(skipped=False)
        >>> before = bn.running_mean.clone()
        >>> _ = bn(torch.full((4, 2), float("nan")))  # step 2: its statistics NaN
        >>> stats.end_step(skipped=True)
        >>> torch.equal(bn.running_mean, before), int(bn.num_batches_tracked)
        (True, 1)
    """

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self._modules = list(modules)
        self.layers: list[nn.Module] = []
        self._quantizers = False  # whether a layer is an observer or fake-quantizer (whose buffers may be resized)
        self._saved: list[torch.Tensor] = []  # the copy
        self._kept: list[torch.Tensor] = []  # the buffers copied this step (empty: none yet)
        self._fresh: list[nn.Module] = []  # lazy layers with no statistics yet when copied: a skip starts them again
        self._copies = 0  # steps copied: every UNFROZEN_EVERY-th looks for the layers again (one removed)
        self._refs: list[weakref.ReferenceType[nn.Module]] = []  # the layers' hooks to release (in place)
        self._registered = (WATCHED.registered, WATCHED.buffers)  # (before the look: one made during it, seen next)
        self._watch(_tracking_layers(self._modules))
        weakref.finalize(self, _release, self._refs)

    def _watch(self, layers: list[nn.Module]) -> None:
        """Watch ``layers`` (each hooked once, however many keepers watch it), and no longer those
        watched before that are not among them."""
        new = set(layers)
        gone = [layer for layer in self.layers if layer not in new]
        with _HOOKS_LOCK:
            for layer in layers:
                keepers = _KEEPING.setdefault(layer, weakref.WeakSet())
                if self in keepers:
                    continue
                keepers.add(self)
                if layer in _HOOKED:
                    _HOOKED[layer][1] += 1
                elif not _ours(layer):
                    _HOOKED[layer] = [layer.register_forward_pre_hook(_keep_running_stats), 1]
            for layer in gone:
                _KEEPING[layer].discard(self)
            _release([weakref.ref(layer) for layer in gone])
        self.layers = layers
        self._quantizers = any(not isinstance(layer, nn.modules.batchnorm._NormBase) for layer in layers)
        self._refs[:] = [weakref.ref(layer) for layer in layers]

    @property
    def stale(self) -> bool:
        """Whether a module, a parameter or a buffer was registered anywhere since the layers were read."""
        return self._registered != (WATCHED.registered, WATCHED.buffers)

    def watch_again(self, always: bool = False) -> None:
        """Look for the layers again if a module, parameter or a buffer of a new name was
        registered anywhere since they were read (:attr:`stale`), or ``always``: a BatchNorm made
        and added to the model after the guard was is watched from its first forward after this
        (one replaced no longer is, nor kept alive). :meth:`keep` calls it, ``always`` every
        :data:`UNFROZEN_EVERY` copies (a layer taken out, ``del model[1]``, registers nothing:
        let go then); the guard's ``autocast()`` too, for a model that had no such layer. An O(1)
        look when nothing was registered."""
        if self.stale or always:
            seen = (WATCHED.registered, WATCHED.buffers)  # (before the look: one made during it, seen next)
            layers = _tracking_layers(self._modules)
            if layers != self.layers:
                self._watch(layers)
            self._registered = seen

    def keep_before_training(self, look: bool = False) -> None:
        """:meth:`keep`, when a forward that writes the statistics may follow: gradients on and one
        of the layers in training mode (a frozen BatchNorm in eval mode writes nothing; the root's
        own mode says nothing: a guard of several models has a root of its own, always training).
        ``Guard.autocast()`` calls it, where a compiled model's hooks would run nothing; ``look``:
        look for the layers again whatever was registered (every ``UNFROZEN_EVERY`` steps)."""
        if self._kept:  # (once a step: the micro-batches after the first look at nothing)
            return
        self.watch_again(always=look)
        if self.layers and torch.is_grad_enabled() and any(m.training or _observes_in_eval(m) for m in self.layers):
            self.keep()

    def keep(self) -> None:
        """Copy the statistics, unless this step's copy is taken. A lazy layer (``LazyBatchNorm``)
        whose first forward has not made them yet has nothing to copy: a skip of that forward's
        step starts them again (mean 0, variance 1) instead."""
        if self._kept:
            return
        self._copies += 1
        self.watch_again(always=not self._copies % UNFROZEN_EVERY)
        if not self.layers:
            return
        self._fresh = [layer for layer in self.layers
                       if isinstance(layer, nn.modules.batchnorm._NormBase) and is_lazy(layer.running_mean)]
        buffers = [b for layer in self.layers for b in _written(layer) if b is not None and not is_lazy(b)]
        with torch.no_grad():
            if len(self._saved) == len(buffers) and all(
                    s.shape == b.shape and s.dtype == b.dtype and s.device == b.device
                    for s, b in zip(self._saved, buffers)):
                torch._foreach_copy_(self._saved, buffers)
            else:  # (the first copy, or a model moved or changed since)
                self._saved = [b.detach().clone() for b in buffers]
        self._kept = buffers

    def end_step(self, skipped: bool | torch.Tensor) -> None:
        """The step's decision: put the statistics back if it was skipped (``skipped`` on the
        device, the sync-free step's flag: a select there, no host read), and take a new copy
        at the next step's first training forward."""
        kept, fresh = self._kept, self._fresh
        if not kept:  # (no copy this step: no such layers, or none ran in training)
            return
        self._kept, self._fresh = [], []
        if skipped is False:
            return
        # (a quantizer's forward may resize its buffers in place; a normalization layer's does not)
        resized = [(b, s.shape) for s, b in zip(self._saved, kept) if b.shape != s.shape] if self._quantizers else []
        if resized and isinstance(skipped, torch.Tensor):  # (no select between shapes: read, once a resize)
            skipped = bool(skipped)
            if not skipped:
                return
        with torch.no_grad():
            for b, shape in resized:  # (an observer's first observation: ``min_val`` from ``tensor([])``)
                b.resize_(shape)
            if isinstance(skipped, torch.Tensor):
                flag = skipped.bool()
                torch._foreach_copy_(kept, [torch.where(flag, s, b) for s, b in zip(self._saved, kept)])
            else:
                torch._foreach_copy_(kept, self._saved)
            for layer in fresh:  # (made by the skipped step's forward: as a new layer's)
                mean, var = layer.running_mean, layer.running_var
                if is_lazy(mean):  # (its forward did not run)
                    continue
                if isinstance(skipped, torch.Tensor):
                    mean.copy_(torch.where(flag, 0.0, mean))
                    var.copy_(torch.where(flag, 1.0, var))
                else:
                    mean.zero_()
                    var.fill_(1.0)

    def forget(self) -> None:
        """The model's state was loaded (a resume, a rollback): the copy is no longer of it."""
        self._kept, self._fresh = [], []
