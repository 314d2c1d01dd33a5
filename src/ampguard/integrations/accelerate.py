"""ampguard in an Accelerate script, both ways round.

Needs the ``accelerate`` extra (``pip install 'ampguard[accelerate]'``) only for
:func:`make_guard`; :func:`found_inf` reads a plain ``torch.amp.GradScaler``.

- **ampguard does the AMP** (Accelerate with ``mixed_precision="no"``): :func:`make_guard` builds a
  :class:`Guard` over what ``accelerator.prepare`` returned. Under ``accelerate launch`` the
  process group is up, so the guard's one all-reduce per step (``distributed.agree``) makes every
  process skip the same steps; ``accelerator.is_main_process`` writes the CSV.
- **Accelerate owns the scaler** (``mixed_precision="fp16"`` on a GPU): ampguard can read the
  truth of a step, :func:`found_inf`, from the scaler before ``optimizer.step()``, instead of
  ``accelerator.optimizer_step_was_skipped``, which says "not skipped" for fused optimizers
  (accelerate#4242: ``GradScaler.step`` hands a fused optimizer the flag and always calls it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Unpack

import torch
from torch.amp.grad_scaler import OptState

from ..errors import called_by_user
from ..step import Guard, GuardSettings

__all__ = ["GuardState", "found_inf", "make_guard"]


def _inner(optimizer: Any) -> Any:
    """The torch optimizer inside Accelerate's ``AcceleratedOptimizer`` wrapper(s); of each, for a
    dict or a list of them (a GAN's: the wrappers reached the guard, an ``AttributeError``)."""
    if isinstance(optimizer, dict):
        return {name: _inner(o) for name, o in optimizer.items()}
    if isinstance(optimizer, (list, tuple)):
        return type(optimizer)(_inner(o) for o in optimizer)
    while hasattr(optimizer, "optimizer") and hasattr(optimizer, "step_was_skipped"):
        optimizer = optimizer.optimizer
    return optimizer


def found_inf(scaler: torch.amp.GradScaler | None, optimizer: Any) -> torch.Tensor:
    """1.0 if ``scaler.step(optimizer)`` is about to skip this step (an inf/nan gradient), else 0.0.

    A device tensor: no host read (``bool(...)`` of it is one). Call it after the backward and
    before ``optimizer.step()`` (on each micro-batch of an accumulation group too: each reads the
    gradients summed so far); the scaler forgets the flag in ``update()``. When the gradients
    are already unscaled (``accelerator.clip_grad_norm_`` unscales them) it is the flag the scaler
    itself found; otherwise the gradients are checked without unscaling them (the scaler's own
    ``_check_inf_per_device``), so a later ``clip_grad_norm_`` still works. ``optimizer`` may be
    Accelerate's wrapper. A disabled scaler, or none (``accelerator.scaler`` is ``None`` for bf16
    and for fp16 on a CPU), never skips: 0.0.

    Example::

        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.AdamW(model.parameters(), fused=True)
        >>> scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        >>> scaler.scale(model(torch.ones(1, 2)).sum() * float("inf")).backward()
        >>> found_inf(scaler, opt).item()
        1.0
        >>> scaler.step(opt); scaler.update(); scaler.get_scale()  # fused: the kernel skipped it
        2.0
    """
    if scaler is None or not scaler.is_enabled():  # (Accelerate makes none for bf16, nor for fp16 on a CPU)
        return torch.zeros(())
    device = scaler._scale.device if getattr(scaler, "_scale", None) is not None else torch.device("cpu")
    optimizer = _inner(optimizer)
    state = scaler._per_optimizer_states[id(optimizer)]
    if state["stage"] is OptState.UNSCALED:  # what unscale_ found: what step() skips on
        per_device = state["found_inf_per_device"]
    else:  # checked without unscaling, and not left in the scaler's record: read back by the next
        # micro-batch of an accumulation group, an earlier micro-batch's check hid an inf in the last
        # one (review 52e); step() checks again as it unscales
        kept = state["found_inf_per_device"]
        per_device = scaler._check_inf_per_device(optimizer)
        state["found_inf_per_device"] = kept
    return torch.stack([v.to(device) for v in per_device.values()]).sum().clamp(max=1.0)


@called_by_user  # (a warning of Guard(...)'s names the line that called make_guard, review 58f)
def make_guard(accelerator: Any, model: Any, optimizer: Any, *, register_state: bool = True,
               **settings: Unpack[GuardSettings]) -> Guard:
    """A :class:`Guard` over a model and optimizer that ``accelerator.prepare`` returned.

    Accelerate must not do the AMP too (``Accelerator(mixed_precision="no")``, the default):
    autocast twice and two loss scalers would be refused anyway, so it is refused here with the
    fix. The guard takes the torch optimizer inside Accelerate's wrapper and the accelerator's
    device; ``settings`` are :class:`Guard`'s (``precision``, ``max_norm``, ``scheduler``, ...;
    typed for checkers as :class:`~ampguard.step.GuardSettings`).
    Use the guard's verbs instead of ``accelerator.backward``, ``clip_grad_norm_`` and
    ``optimizer.step``; don't wrap them in ``accelerator.accumulate``: the guard accumulates.

    Its ``accumulation_steps`` is the accelerator's ``gradient_accumulation_steps``
    (``Accelerator(gradient_accumulation_steps=4)``, or ``ACCELERATE_GRADIENT_ACCUMULATION_STEPS=4``
    in the environment; ``accelerate launch --gradient_accumulation_steps`` passes it on only to
    DeepSpeed) unless given. Given, it must be the same, or the accelerator's must be 1 (its
    default: nothing asked of it); another number is refused rather than one of the two silently
    winning. The guard's groups run on across epochs (a loop over a loader whose length is no
    multiple of N); ``guard.step(close=True)`` ends a short one in a single process.

    The accelerator's ``clip_grad_norm_`` and ``clip_grad_value_`` are refused from then on (a
    ``ValueError`` naming the fix): the guard clips at ``guard.step()``, and the accelerator,
    with no scaler of its own, would clip the guard's still-scaled fp16 gradients (the updates
    shrink by the scale, silently) or clip twice, hiding the pre-clip norm.

    The guard's state (loss scale, counters) is registered for ``accelerator.save_state()`` /
    ``load_state()`` (make the guard before ``load_state()``): inside an accumulation group the
    last closed step's, which is what the model and optimizer files hold then (the open group's
    micro-batches are not kept: a resume begins a new group). Registering the guard itself as
    well is refused: its ``state_dict()`` refuses inside a group, and Accelerate asks for it
    only after it has deleted old checkpoints (``total_limit``) and written the model's files.
    ``register_state=False`` leaves the guard out of the checkpoints: to load a folder saved
    without its state (an older ampguard's, where the guard was not registered), which Accelerate
    refuses with one custom state registered more than the folder holds.

    Example::

        >>> from types import SimpleNamespace
        >>> accelerator = SimpleNamespace(mixed_precision="no", device=torch.device("cpu"),  # Accelerator(cpu=True)
        ...                               gradient_accumulation_steps=1)
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)  # model, opt = accelerator.prepare(model, opt)
        >>> guard = make_guard(accelerator, model, opt, precision="bf16")
        >>> with guard.autocast():
        ...     loss = model(torch.randn(8, 4)).square().mean()
        >>> guard.backward(loss)
        >>> guard.step().skipped
        False
        >>> make_guard(SimpleNamespace(mixed_precision="fp16"), model, opt)
        Traceback (most recent call last):
        ...
        ValueError: the accelerator does mixed precision 'fp16' already; ...
    """
    if accelerator.mixed_precision != "no":
        raise ValueError(f"the accelerator does mixed precision {accelerator.mixed_precision!r} already; with "
                         "ampguard doing the AMP, make it Accelerator(mixed_precision='no') (or launch with "
                         "--mixed_precision no) and pass precision= to the guard")
    if getattr(accelerator, "num_processes", 1) > 1 and getattr(accelerator, "even_batches", True) is False:
        raise ValueError("Accelerator(even_batches=False) over several processes: the guard's one all-reduce a "
                         "step pairs the processes' steps, and one with fewer batches would pair its next epoch's "
                         "with another's last (a hang, then a peer's error): leave even_batches on")
    _check_world(accelerator)
    _check_prepared(accelerator, model)
    accumulation = accelerator.gradient_accumulation_steps
    given = settings.setdefault("accumulation_steps", accumulation)
    if accumulation != 1 and given != accumulation:
        raise ValueError(f"accumulation_steps={given} but the accelerator has gradient_accumulation_steps="
                         f"{accumulation}: give the guard the same number (or leave accumulation_steps out to "
                         "take the accelerator's)")
    settings.setdefault("device", accelerator.device)
    guard = Guard(model, _inner(optimizer), **settings)
    for name in ("clip_grad_norm_", "clip_grad_value_", "accumulate"):
        if hasattr(accelerator, name):
            setattr(accelerator, name, _refused(name))  # (this accelerator's own attribute, not the class's)
    # Accelerate's prepared scheduler steps only while its gradient state says "sync" (what its
    # accumulate() sets per micro-batch): one left False by an accumulate() block that ended
    # mid-group made every scheduler step the guard took go nowhere, unsaid; the guard accumulates
    state = getattr(accelerator, "gradient_state", None)
    if state is not None and not state.sync_gradients and hasattr(state, "_set_sync_gradients"):
        state._set_sync_gradients(True)
    if register_state and hasattr(accelerator, "register_for_checkpointing"):
        _register(accelerator, GuardState(guard))
    return guard


def _check_world(accelerator: Any) -> None:
    """Refuse an accelerator that counts other processes than the process group holds: the
    guard agrees its skips over the group's. ``accelerate launch --multi_gpu`` on a machine
    without a GPU starts the group, and an ``Accelerator()`` not told ``cpu=True`` then runs each
    process as a world of one (every one the main process, the model not wrapped in DDP, the
    data not split): unsynchronised replicas whose skips the guard would tie together.

    Example (no process group: a world of one, as the accelerator's)::

        >>> from types import SimpleNamespace
        >>> _check_world(SimpleNamespace(num_processes=1))
        >>> _check_world(SimpleNamespace(num_processes=2))
        Traceback (most recent call last):
        ...
        ValueError: the accelerator counts 2 processes but torch.distributed has 1: ...
    """
    from .. import distributed

    world, counted_ = distributed.current().world_size, getattr(accelerator, "num_processes", None)
    if counted_ is None or counted_ == world:
        return
    hint = (" (accelerate launch on a machine without a GPU: make it Accelerator(cpu=True), as "
            "examples/accelerate_guard.py does when CUDA is not available)" if counted_ == 1 else "")
    raise ValueError(f"the accelerator counts {counted_} process{'es' if counted_ != 1 else ''} but torch.distributed "
                     f"has {world}{hint}: the guard agrees every skip over torch.distributed's processes, and "
                     "the accelerator would train them as separate runs")


def _check_prepared(accelerator: Any, model: Any) -> None:
    """Refuse a model from before ``accelerator.prepare`` where prepare wrapped it (DDP over
    several processes), or the module inside the wrapper: the guard's model is the one the loop's
    forward runs and whose all-reduce it defers mid-group, and the one inside is never
    all-reduced by itself (each process would train its own replica while the guard tied their
    skips into one record, review 48b). Accelerate keeps the model it was given among its models
    and marks the one it returns as prepared; a model prepare returned as it was (one process,
    FSDP2's in-place shards) carries the mark itself. Each of a list or dict of models (a GAN's),
    and the modules inside one (an ``nn.ModuleList`` of them), outside a prepared one, is looked at.

    Example (nothing prepared: nothing to compare)::

        >>> from types import SimpleNamespace
        >>> _check_prepared(SimpleNamespace(_models=[], num_processes=2), torch.nn.Linear(2, 1))
    """
    if getattr(accelerator, "num_processes", 1) <= 1:
        return
    given = {id(m) for m in getattr(accelerator, "_models", None) or []}
    if not given:
        return
    named = (model.items() if isinstance(model, (Mapping, torch.nn.ModuleDict)) else enumerate(model)
             if isinstance(model, (list, tuple, torch.nn.ModuleList)) else [(None, model)])
    for key, each in named:
        found = _inside_unprepared(each, given)
        if found is not None:
            which = f" (model {key!r})" if key is not None else ""
            raise ValueError(f"make_guard got the {type(found).__name__}{which} from before accelerator.prepare (or "
                             "from inside what it returned), which prepare wrapped for several processes: give the "
                             "guard, and the loop's forward, the model prepare returned (model, opt, data = "
                             "accelerator.prepare(model, opt, data)): the one inside is never all-reduced by itself, "
                             "and the guard defers the wrapper's all-reduce mid-group")


def _inside_unprepared(module: Any, given: set[int]) -> Any:
    """The first module under ``module`` (itself included) that Accelerate was given to prepare
    but that is not what prepare returned (``given``: the ids of the models it was given), not
    looking inside a prepared one; None when there is none."""
    if getattr(module, "_is_accelerate_prepared", False):
        return None
    if id(module) in given:
        return module
    for child in module.children() if isinstance(module, torch.nn.Module) else ():
        found = _inside_unprepared(child, given)
        if found is not None:
            return found
    return None


class GuardState:
    """What ``accelerator.save_state()`` keeps of a guard (:func:`make_guard` registers it): its
    ``state_dict(mid_group=True)``, the last closed step's, so a save between micro-batches keeps
    the state the model and optimizer files are in, and its ``autocast_dtypes`` once noted (the
    layers autocast left in float32: a record kept with the checkpoint, not compared on a load);
    ``load_state()`` restores it (and drops an open group).

    Example::

        >>> model = torch.nn.Linear(2, 1)
        >>> guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp32",
        ...               accumulation_steps=2)
        >>> guard.backward(model(torch.ones(1, 2)).sum()); guard.step()  # one micro-batch of two
        >>> saved = GuardState(guard).state_dict()
        >>> saved["step"], guard.mid_group
        (0, True)
    """

    def __init__(self, guard: Guard) -> None:
        self.guard = guard

    def state_dict(self) -> dict[str, Any]:
        dtypes = self.guard.autocast_dtypes
        return {**self.guard.state_dict(mid_group=True), **({"autocast_dtypes": dict(dtypes)} if dtypes else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.guard.load_state_dict(state)


def _register(accelerator: Any, state: GuardState) -> None:
    """Register ``state`` for the accelerator's checkpoints, in the place of one an earlier
    :func:`make_guard` on this accelerator registered (the same index: a rerun cell in a notebook
    must not add a custom checkpoint the saved folder lacks); and refuse the guard itself there."""
    objects = getattr(accelerator, "_custom_objects", None)
    earlier = [i for i, o in enumerate(objects or ()) if isinstance(o, GuardState)]
    if earlier:
        objects[earlier[0]] = state
    else:
        accelerator.register_for_checkpointing(state)
    if getattr(accelerator.register_for_checkpointing, "_ampguard", False):
        return
    register = accelerator.register_for_checkpointing

    def refusing(*objects: Any) -> Any:
        if any(isinstance(o, Guard) for o in objects):
            raise ValueError("accelerator.register_for_checkpointing(guard): make_guard registered the guard's "
                             "state already (inside an accumulation group the guard itself refuses to be saved, "
                             "after Accelerate has deleted old checkpoints); remove the call")
        return register(*objects)

    refusing._ampguard = True  # type: ignore[attr-defined]
    accelerator.register_for_checkpointing = refusing  # (this accelerator's own attribute, not the class's)


def _refused(name: str) -> Any:
    why = ("the guard accumulates over gradient_accumulation_steps itself, and inside it Accelerate's prepared "
           "scheduler does not step (its updates ran at a frozen LR); remove the with block (a second model "
           "trained the stock way on this accelerator would do the same to the guard's scheduler, through the "
           "gradient state they share: give it a guard of its own, or an Accelerator of its own)"
           if name == "accumulate" else
           "the guard clips at guard.step() (max_norm=), after it has unscaled fp16's gradients and measured the "
           "pre-clip norm it records; clipping here as well would clip twice (under fp16, gradients still scaled); "
           "remove the call")

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise ValueError(f"accelerator.{name}() with the guard doing the AMP: {why}")
    return refuse
