"""A replay leaves no trace: the start-up's check, validate's and locate's passes run the
user's model and put back what they touched.

:func:`untouched` wraps such passes. On leaving it, the modules' buffers and own attributes are
as they were (:class:`BufferSnapshot`), the hooks the passes registered are taken out and the
ones they took out put back, every random generator (the process's, :func:`rng_kept`, and the
modules' own) has its state back, the train/eval flags are as they were (:func:`modes_kept`),
gradients are given back, and what a pass captured into the state a user's hook keeps (outputs
appended to a list, a slot of a dict filled) is put back; what cannot be put back without
tearing the hook's state apart (a countdown beside its captures, a cache beside its flag) is
left whole and said in one warning. docs/design.md, "A replay leaves no trace", says what
counts as a hook's state and why.
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import copy
import dis
import functools
import inspect
import itertools
import operator
import os
import queue
import random
import site
import sys
import sysconfig
import types
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.parameter import is_lazy

from .checkpoint import rng_state, set_rng_state
from .errors import AmpguardWarning, InputError, counted, first_line, listed, warn


@contextlib.contextmanager
def rng_kept() -> Iterator[None]:
    """Every RNG (:func:`rng_state`) as it was once the block is left, also on an error: a check
    or a replay that draws numbers leaves the run's stream where it was.

    Example::

        >>> with rng_kept():
        ...     first = torch.rand(2)
        >>> torch.equal(torch.rand(2), first)
        True
    """
    saved = rng_state()
    try:
        yield
    finally:
        set_rng_state(saved)


@contextlib.contextmanager
def modes_kept(model: torch.nn.Module) -> Iterator[None]:
    """On leaving, each module's train/eval flag as it was: ``model.train(flag)`` alone would set
    every submodule's, and a layer the user froze in eval mode (a BatchNorm whose statistics stay
    put) would train again. Each module whose flag differs is given it back through its own
    ``train(flag)``, top down (the model first, when it changed), so that an override undoes what
    its ``eval()`` did (an EMA model swaps its trained weights back) and a frozen layer's own
    ``eval()`` runs again after its parent's ``train()`` reached it; a module whose flag is as it
    was is left alone.

    Example::

        >>> model = torch.nn.Sequential(torch.nn.BatchNorm1d(2).eval(), torch.nn.Dropout())
        >>> with modes_kept(model):
        ...     _ = model.eval()
        >>> [m.training for m in model]
        [False, True]
    """
    modes = [(m, m.training) for m in model.modules()]
    try:
        yield
    finally:
        for m, training in modes:  # (parents before children: a parent's train() reaches them first)
            if m.training != training:
                m.train(training)


class BufferSnapshot:
    """Each module's buffers as they are now (None ones too), and a copy of each tensor's values:
    :meth:`put_back` makes them so again, as often as asked: a buffer the forward replaced (a
    cache grown to a new shape) is put back itself, one it filled from None, or registered anew,
    is taken out, and each one's values are copied back in place (:func:`_set_back`). A buffer
    with internal overlap (an expanded view, stride 0, which nothing can write in place) is
    referenced, not copied. The random generators the modules hold of their own are given their
    state back (:func:`_generators_in`). Each module's own attributes (:func:`_kept_attributes`: a
    ``self.calls += 1`` counter's int, a tensor attribute by identity) are put back too, and the
    hooks registered on its modules since taken out, unless a gradient hook was registered on a
    parameter: then the modules stay as the pass left them (:func:`_put_attributes_back`).
    Between passes that must each start from
    the same state (locate's FP32 and scope replays, validate's reference and each precision's
    passes: a call counter, a running normaliser, a cache the forward updates), and at the end
    of :func:`untouched`. ``skip``: buffers (by id) not copied (a lazy module's, not made yet);
    ``modules_skipped``: modules (by id) whose attributes are not kept (lazy ones).

    Example::

        >>> model = torch.nn.BatchNorm1d(2)
        >>> snapshot = BufferSnapshot(model)
        >>> _ = model(torch.randn(4, 2) + 5)
        >>> _ = snapshot.put_back()
        >>> model.running_mean.tolist(), int(model.num_batches_tracked)
        ([0.0, 0.0], 0)
        >>> model.calls = 0
        >>> model.register_buffer("ones", torch.ones(1).expand(3))  # (stride 0: referenced, not copied)
        >>> snapshot = BufferSnapshot(model)
        >>> model.calls += 1
        >>> _ = snapshot.put_back()
        >>> model.calls, model.ones.tolist()
        (0, [1.0, 1.0, 1.0])
    """

    def __init__(self, model: torch.nn.Module, skip: frozenset[int] | set[int] = frozenset(),
                 modules_skipped: frozenset[int] | set[int] = frozenset(), also: tuple[Any, ...] = ()) -> None:
        # each module's plain attributes (:func:`_kept_attributes`: a counter's int, a tensor attribute by
        # identity), and its hooks' state, which may hold modules outside the model: kept as the model's are
        memo: dict[Any, tuple[Any, Any]] = {}  # (a container many hooks share: copied once)
        self.attributes = [_kept_module(m, memo) for m in model.modules()
                           if id(m) not in modules_skipped and not _reducer_owned(m)]
        # (the loss: a module, kept as the model's are, or a function or object whose state is read as a
        # hook's is and judged after the put-back, :meth:`also_back`; its generators are given back)
        self.also_named = [x for x in also if not isinstance(x, torch.nn.Module)]
        for x in also:
            if isinstance(x, torch.nn.Module):
                _hold_module(memo, x)
        self.also = [held for x in self.also_named for held in _hook_state(x, memo)]
        self.also_said = False  # (:meth:`put_back`'s judgement of it: a change :func:`untouched` says)
        self.outside = _outside(model, memo, self.attributes)
        modules = list(model.modules()) + self.outside
        self.held = [(m, dict(m._buffers)) for m in modules]
        # (an outside module's buffers are copied while they are in training mode and _OUTSIDE_COPIED bytes
        # last, a tracker's running mean; the others, a frozen teacher's, its weights where it is quantised
        # (review 44c: +417 MiB), referenced, a replaced one put back, one changed in place said: an observer
        # that moves in eval mode, review 44d)
        self.watched: list[tuple[str, torch.Tensor, int | None]] = []
        budget = _OUTSIDE_COPIED
        for m in self.outside:
            for name, b in m._buffers.items():
                if b is None or is_lazy(b):
                    continue
                size = b.numel() * b.element_size()
                if m.training and size <= budget:
                    budget -= size
                else:
                    self.watched.append((f"{type(m).__name__}.{name}", b, _version(b)))
        skip = frozenset(skip) | {id(b) for _, b, _ in self.watched}
        self.module_names = {id(m): name for name, m in model.named_modules()}  # (what an error calls a buffer)
        # (a tensor with internal overlap, an expanded view, stride 0: nothing writes it in place, so
        # it is referenced, not copied; a replacement is undone by putting the object back)
        self.copies = {id(b): b.detach().clone() for _, held in self.held for b in held.values()
                       if b is not None and id(b) not in skip and not _overlaps(b)}
        # (where each copied one's values lie: a forward that resized it, or gave it another storage with
        # `.data = x`, is set back there before its values are copied in, never into whatever it views now)
        self.places = {i: _place(b) for _, held in self.held for b in held.values() if (i := id(b)) in self.copies}
        # (each parameter's names as they are now, tied ones together, and each trainable tensor attribute's:
        # what a warning calls a hooked one)
        self.names: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            self.names.setdefault(id(p), []).append(name)
        for prefix, m in model.named_modules():
            for name, t in _trainable_attributes(m):
                self.names.setdefault(id(t), []).append(f"{prefix}.{name}" if prefix else name)
        self.generators = _generators_in(self.attributes, self.also, tuple(self.also_named))
        # the objects of the user's own classes among the modules' attributes (a curriculum's counter,
        # ``self.curriculum.tick()``) by their attributes, and small NumPy arrays by a copy (``self.hist[0]
        # += 1``): the forward changed them in place, unput back and unsaid (review 51c)
        self.objects, self.arrays = _attribute_objects(self.attributes)
        self.global_hooks = _global_hooks()  # (a setup a pass did outside the model: registered_outside)
        self.trained = frozenset(self.names)  # (what a hook's record of parameters holds: no capture)
        self.own = _memories(model.modules())  # (the model's parameters and buffers, by memory: no hook's tensors)
        own = self.own | _memories(self.outside)  # (a model buffer the loss reads is put back: review 44d)
        self.also_tensors = [(t, _version(t)) for t in _piece_tensors(self.also, set())
                             if _memory(t) is None or _memory(t) not in own]
        self.also_marks = [(v, mark) for v in _piece_values(self.also, set()) if (mark := _fingerprint(v)) is not None]

    def also_back(self) -> bool:
        """Judge what the block changed of the loss's own state (``also``'s: :func:`_hook_state`'s
        pieces, after the hooks' put-back, which gives back what both share), give back what is
        safe to, and return whether a change stays that :func:`untouched` must say. What a put-back
        sees of a loss is not all of it (review 44d: a cache the loss builds at its first call,
        rewound beside its flag in a global it never showed, broke the run's first step), so:

        - a setup its first call made (a value where there was None or nothing, a dict's new slots:
          a cache, ``self.w``, ``cache["mask"]``, and the flag beside it, ``self._on = True``; a
          last-value log filled, ``metrics["loss"]``) is left, unsaid: the run's first call would
          make it from the same first batch, or write it again;
        - what it captured into what it held (a list appended to, a log of ``loss.item()``s, review
          44e; a value replaced by a tensor or float computed in the pass, ``self.last =
          loss.detach()``, an EMA) is given back, unsaid;
        - anything else (a count, ``self.calls += 1``: a curriculum's, review 44a; a flag; a tensor
          changed in place; an object no put-back looks into, :func:`_fingerprint`, moved) leaves
          all of it as the block left it, and is said."""
        if any(_version(t) != version for t, version in self.also_tensors) or any(
                _fingerprint(v) != mark for v, mark in self.also_marks):
            return True
        back = []
        for held in _flat(self.also):
            verdict = _judged(held, self.trained)
            if verdict is None or _set_up(held) and (verdict in ("captured", "start") or _flag(held)):
                continue
            if verdict != "captured":
                return True
            back.append(held)
        left = _left_keys(_hooks_judged(self.attributes, self.trained))  # (a hook's said state: left with it)
        _state_back([held for held in back if _piece_key(held) not in left], set())
        return False

    def registered_outside(self) -> bool:
        """Whether a hook was registered on every module (``register_module_forward_hook`` and the
        like) since the snapshot: something the put-back does not undo."""
        return _global_hooks() != self.global_hooks

    def put_back(self, passes: int | None = None) -> tuple[list[tuple[str, int]], list[str]] | None:
        """The buffers and plain attributes as they were when the snapshot was taken. Returned: None,
        or where a pass registered a gradient hook on a parameter (the modules then left as it left
        them, :func:`_put_attributes_back`) the parameters hooked (their names, tied ones joined by
        ``=``, each with the most hooks of one function it gained: :func:`_most_of_one`) and what
        the pass changed in the modules. A
        buffer that cannot be put back leaves the others put back, its error raised after them.
        Every copied
        buffer's values are copied back, not only those whose version counter moved: BatchNorm's
        kernel updates its running statistics in place without bumping it. One the forward resized
        in place (``resize_``), gave another storage (``self.last.data = x``) or another layout is
        first set back to its own storage, offset, size and strides (copied into as it was, it
        raised, or wrote into the user's batch; given a clone, its aliases parted from it: reviews
        41, 41b, 41c); the attributes are put back whatever happened to the buffers. Buffers that
        cannot be put back (a tensor class without an in-place ``copy_``) are one
        :class:`~ampguard.errors.InputError` line naming each, raised after the rest are put back."""
        failed: list[tuple[str, torch.Tensor, Exception]] = []
        try:
            with torch.no_grad():
                for m, held in self.held:
                    for name in [n for n in m._buffers if n not in held]:  # (registered by the forward: taken out)
                        del m._buffers[name]
                        m._non_persistent_buffers_set.discard(name)
                    for name, b in held.items():
                        m._buffers[name] = b  # (the same tensor, or None: one the forward re-registered is put back)
                        if b is not None and id(b) in self.copies:
                            try:  # (each one: a buffer that cannot be put back leaves the others put back)
                                _set_back(b, self.places[id(b)], self.copies[id(b)])
                            except Exception as err:
                                prefix = self.module_names.get(id(m), "")
                                failed.append((f"{prefix}.{name}" if prefix else name, b, err))
        finally:
            _generators_back(self.generators)
            left = _put_attributes_back(self.attributes, passes, self.trained, self.registered_outside())
            if left is None:  # (where the modules stay as the pass left them, these do too)
                _objects_back(self.objects, self.arrays)
        if failed:
            said = listed([f"{name} (a {type(b).__name__}: {first_line(err)})" for name, b, err in failed], 2,
                          more=f" and {len(failed) - 2} more")
            raise InputError(f"the model's {'buffer' if len(failed) == 1 else 'buffers'} {said} cannot be put back "
                             "in place as they were before the passes (the values copied in with copy_): keep such "
                             "state in a plain tensor buffer, or out of the model's buffers") from failed[0][2]
        self.also_said = left is None and bool(self.also) and self.also_back()  # (after the hooks': review 44d)
        if left is None:
            return None
        hooked, modules = left
        return [(" = ".join(self.names.get(id(p), ["a parameter the pass replaced"])), n)
                for p, n in hooked.items()], modules


@contextlib.contextmanager
def untouched(model: torch.nn.Module, by: str = "the replay",
              so: str = "each replayed pass once more, and they are not put back",
              passes: int | None = None, also: tuple[Any, ...] = ()) -> Iterator[BufferSnapshot]:
    """Run a replay or a check that leaves no trace: on leaving, the model's mode, its buffers
    (BatchNorm statistics; a buffer the forward replaced, a cache grown to a new shape, is put
    back itself; one it filled from None, or registered anew, is taken out), its parameters'
    gradients (taken away for the block, so that a backward in it starts from none and adds
    nothing into the run's tensors, and given back), every RNG (torch, CUDA, NumPy, ``random``,
    and the generators the modules hold of their own: :func:`_generators_in`)
    and each module's own attributes (:func:`_kept_attributes`: a call counter's int, a tensor
    attribute replaced; the hooks a pass registered taken out, but ampguard's own:
    :func:`_put_attributes_back`) are as they were, so a run goes on bit for bit as without it.
    But where a pass registered a gradient hook on a parameter, that hook stays and so do the
    modules' attributes and hooks as the pass left them (whatever records the hook must agree
    with it), named in an :class:`~ampguard.errors.AmpguardWarning` with the parameters hooked:
    as registered once (kept, as the run's first forward would register it) where each gained at
    most one hook of a function over ``passes`` grad-enabled forward passes (two or more: one
    pass, or an unknown number, cannot tell a hook registered once from one registered at every
    forward, and the warning says so), as piled up where one was registered at each.

    Parameters are not copied (a model's worth of memory): each one's :func:`_checksum` is taken
    on entering and again on leaving (two reads of the weights; about a thousandth of their size
    kept), and one whose values changed (a momentum encoder's moving average, made in the
    forward) is named with its module's type in an :class:`~ampguard.errors.AmpguardWarning`,
    ``"{by} changed N parameters in place (names) (in a Type): the model's forward updates them,
    {so}; make the change in the training step, not the forward, or keep it in a buffer (buffers
    are put back)"`` (``by``, ``so``: the words for who calls it: locate's replay, the start-up's
    check), and not put back. The weights of an ``nn.Embedding`` or ``nn.EmbeddingBag`` with a
    ``max_norm``, which its forward renormalises in place, are copied and put back. One changed
    in place and put back (an EMA model's ``eval()`` swaps its weights out, its ``train()`` back:
    review 39e) is no change: values are compared, not version counters. A parameter whose
    checksum cannot be taken (a tensor without storage) is judged by its version counter and
    its storage instead (a sharded DTensor by this rank's shard). A lazy module's parameter or
    buffer not made yet (``nn.LazyLinear``'s, before its first forward) is neither summed nor
    copied: one the block makes is said in a warning (its initial weights were drawn in the
    block, under the RNGs it puts back; :func:`~ampguard.build.check_forward` checks a copy of
    such a model instead). ``also``: what else the block runs (the loss): a module is kept as the
    model's are, a function's or object's own state judged (:meth:`BufferSnapshot.also_back`), what
    it logged given back, a change other than a setup or a log said.

    Example::

        >>> model = torch.nn.BatchNorm1d(2)
        >>> before, draw = model.running_mean.clone(), torch.get_rng_state()
        >>> with untouched(model):
        ...     _ = model(torch.randn(4, 2) + 5)
        >>> torch.equal(model.running_mean, before), torch.equal(torch.get_rng_state(), draw)
        (True, True)
    """
    # every module's buffers as they are (None ones too), and a copy of each tensor's values
    buffers = [(m, dict(m._buffers)) for m in model.modules()]
    lazy = {id(t) for _, held in buffers for t in held.values() if t is not None and is_lazy(t)}
    lazy |= {id(p) for p in model.parameters() if is_lazy(p)}
    lazy_kinds = [(m, type(m).__name__) for m in model.modules() if any(
        id(t) in lazy for t in itertools.chain(m.parameters(recurse=False), m.buffers(recurse=False)))]
    snapshot = BufferSnapshot(model, skip=lazy, modules_skipped={id(m) for m, _ in lazy_kinds}, also=also)
    grads = [(p, p.grad) for p in itertools.chain(  # (these objects: FSDP2 swaps the module's during a pass)
        model.parameters(), (t for m in model.modules() for _, t in _trainable_attributes(m)))]
    renormed = {id(p): p.detach().clone() for m in model.modules() if _renormalises(m)
                for p in m.parameters(recurse=False) if id(p) not in lazy}
    named = [(name, p) for name, p in model.named_parameters() if id(p) not in lazy]
    taken = {id(p) for _, p in named}
    counts: collections.Counter[str] = collections.Counter(name for name, _ in named)
    for m in snapshot.outside:  # (and the parameters of the modules outside it that hooks or the loss hold: an
        for name, p in m.named_parameters(recurse=False):  # EMA teacher a hook moves, review 44c)
            if id(p) not in taken and not is_lazy(p):
                key = f"{type(m).__name__}.{name}"
                counts[key] += 1  # (two outside modules of one type: each its own name, in one look, 44d)
                taken.add(id(p))
                named.append((key if counts[key] == 1 else f"{key} ({counts[key]})", p))
    sums = {name: _checksum(p) for name, p in named}
    versions = {name: (_version(p), _storage(p), p.shape, p.dtype) for name, p in named}
    try:
        for p, _ in grads:  # (a backward in the block starts from none: it accumulated into the run's in place)
            p.grad = None
        # (attributes put back after the modes: an EMA model's train() swaps its weights back by what its
        # eval() kept in an attribute)
        with rng_kept(), _attributes_warned(snapshot, by, model), modes_kept(model):
            yield snapshot
    finally:
        left: tuple[list[tuple[str, int]], list[str]] | None = None
        try:
            try:
                left = snapshot.put_back(passes)
            except InputError as err:  # (a buffer that cannot be put back: said as who met it)
                raise InputError(f"{by}: {err}") from err.__cause__
            with torch.no_grad():
                for p in model.parameters():
                    if id(p) in renormed and p.shape == renormed[id(p)].shape:  # (Embedding(max_norm=...)'s rows)
                        p.copy_(renormed[id(p)])
        finally:  # (the gradients whatever the put-back met; a parameter the block made has none)
            entered = {id(p) for p, _ in grads}
            for p in model.parameters():
                if id(p) not in entered:
                    p.grad = None
            for p, grad in grads:
                p.grad = grad
        owners = {id(p): type(m).__name__ for m in itertools.chain(model.modules(), snapshot.outside)
                  for p in m.parameters(recurse=False)}
        changed = [(name, owners.get(id(p), "")) for name, p in named
                   if _changed(p, sums.get(name), versions.get(name))]
        if changed:
            kinds = list(dict.fromkeys(kind for _, kind in changed))
            warn(f"{by} changed {counted(len(changed), 'parameter')} in place ("
                 f"{listed([name for name, _ in changed])}) (in "
                 f"{listed([_a(kind) for kind in kinds], 2, ' and ', ' and others')}): "
                 f"the model's forward updates them, {so}; make the change in the training step, not the "
                 "forward, or keep it in a buffer (buffers are put back)", AmpguardWarning, stacklevel=3)
        if left is not None:  # (review 41e: said whether or not an attribute changed: the hooks alone may differ)
            _warn_hooks_left(*left, by, passes)
        if snapshot.also_said:
            names = listed([x.__qualname__.split("<locals>.")[-1]  # (the loss not asked: 44d's __getattr__)
                            if isinstance(x, (types.FunctionType, types.MethodType)) else f"a {type(x).__name__}"
                            for x in snapshot.also_named])
            warn(f"{by} changed the state the loss ({names}) keeps of its own (in its closure, on its object, "
                 "in a global): it is not put back, so the run goes on from it, not from a plain loop's (a "
                 "curriculum's count is ahead by the check's calls); keep such state in a module, whose "
                 "attributes are put back", AmpguardWarning, stacklevel=3)
        made = sorted({kind for m, kind in lazy_kinds if not not_made(m)})
        if made:
            warn(f"{by} made the weights of the model's lazy modules ({', '.join(made)}) at its first "
                 "forward: they were drawn there, under RNGs it puts back, not where a plain loop draws them; "
                 "run a batch through the model before handing it over to make them", AmpguardWarning,
                 stacklevel=3)


def _set_up(held: tuple[Any, ...]) -> bool:
    """Whether a piece of the loss's state a pass changed was set up by it
    (:meth:`BufferSnapshot.also_back`): a cell (or attribute, or global) that held None or nothing,
    a dict that only gained slots (a cache, or a last-value log the run writes again). Not a list
    appended to, empty or not: a log."""
    kind, target, *rest = held
    if kind in ("cell", "loose"):
        before = rest[0]
        look = rest[1]  # (a cell's contents; a loose one's look, ("contents", copy) for a container)
        contents = look if kind == "cell" else look[1] if look is not None and look[0] == "contents" else None
        if before is None or before is _GONE:
            return True
        return isinstance(contents, dict) and target.cell_contents is before and _only_gained(before, contents)
    return kind == "contents" and isinstance(target, dict) and _only_gained(target, rest[0])


def _flag(held: tuple[Any, ...]) -> bool:
    """Whether a cell of the loss's state now holds a flag (a bool: ``self._on = True`` beside the setup
    it records; review 44e), not a count (``self.calls = 1``)."""
    return held[0] in ("cell", "loose") and type(held[1].cell_contents) is bool


def _only_gained(now: dict[Any, Any], then: dict[Any, Any]) -> bool:
    """Whether dict ``now`` holds every slot of its copy ``then`` as it was: it only gained."""
    return all(now.get(k, _GONE) is v for k, v in then.items())


def _flat(pieces: list[tuple[Any, ...]]) -> Iterator[tuple[Any, ...]]:
    """:func:`_hook_state`'s ``pieces``, those below a container and an object's loose ones in
    their place."""
    for held in pieces:
        if held[0] == "inner":
            yield from _flat(held[2])
        else:
            yield held


def _outside(model: torch.nn.Module, memo: dict[Any, tuple[Any, Any]], kept: list[_Kept]) -> list[torch.nn.Module]:
    """The modules outside ``model`` that its hooks' state holds (:func:`_hook_state` lists them in
    ``memo``: a distillation or feature-matching loss written as a module, whose hooks on the model
    append to ``self.feats``, a tracker module's buffers; review 44a: kept by nothing, they kept
    the check's outputs and statistics, silently), with their submodules, and those their own
    hooks' state holds: each one's attributes appended to ``kept`` (:func:`_kept_module`), to be
    kept and put back as the model's are. Not one that cannot be kept so (review 44c: a lazy one
    not made yet, which its first forward turns into another class, a TorchScript module, whose
    buffers are no dict, a module that never called ``Module.__init__``): each is left as it is."""
    seen = {id(m) for m in model.modules()}
    found: list[torch.nn.Module] = []
    while new := [m for m in _held_modules(memo) if id(m) not in seen]:
        for top in new:
            seen.add(id(top))
            try:
                below = list(top.modules())
            except Exception:  # (a module that never called Module.__init__)
                continue
            for m in below:
                if id(m) in seen and m is not top:
                    continue
                seen.add(id(m))
                if not _keepable(m):
                    continue
                try:
                    snapshot = _kept_module(m, memo)
                except Exception:  # (one whose attributes or hooks cannot be read: left as it is)
                    continue
                found.append(m)
                if not _reducer_owned(m):
                    kept.append(snapshot)
    return found


def _keepable(m: torch.nn.Module) -> bool:
    """Whether a module outside the model can be kept and put back as the model's are
    (:func:`_outside`)."""
    return (type(getattr(m, "_buffers", None)) is dict and type(getattr(m, "_parameters", None)) is dict
            and not isinstance(m, (torch.jit.ScriptModule, LazyModuleMixin)) and not not_made(m))


def _warn_hooks_left(hooked: list[tuple[str, int]], modules: list[str], by: str, passes: int | None) -> None:
    """:func:`untouched`'s warning of the gradient hooks its block left (``hooked``: each
    parameter's names and the most hooks of one function it gained; ``modules``: what else the
    block changed in them, :func:`_put_attributes_back`), over ``passes`` grad-enabled forwards:
    registered once (one each over two passes or more), at every forward (piled up: one function
    registered as often as there were passes, or twice where their number is not known), more
    than once but not at each pass (a backward in one took its hook out: review 42b), or, with
    one pass or an unknown number, one each that cannot be told apart (review 42a: one pass was
    said to have registered it once)."""
    most = max(n for _, n in hooked)
    piled = most >= (passes if passes and passes > 1 else 2)
    shown = listed([f"{name} ({n})" if n > 1 else name for name, n in hooked], more=f" and {len(hooked) - 3} more")
    also = (f"; what its passes changed in the modules stays too ({listed(modules, 2, ' and ', ' and others')})"
            if modules else "")
    params = counted(len(hooked), "parameter")
    once = ("register such a hook once, behind a flag or in the factory, not at every forward (one its backward takes "
            "out stays after passes that ran no backward)")
    if piled:  # (at every forward: they piled up)
        said = (f"registered gradient hooks on {params} at its passes ({shown}, hooks of one function each): they stay, "
                f"so the run starts with hooks a plain loop's would not have{also}; {once}")
    elif passes and passes > 1 and most > 1:  # (more than once, not at each: a backward took some out, review 42b)
        said = (f"registered gradient hooks on {params} more than once over its {passes} passes, though not at each "
                f"({shown}, hooks of one function each): they stay, so the run may start with hooks a plain loop's "
                f"would not have{also}; {once}")
    elif passes and passes > 1:  # (once each over several passes: as the run's first forward does)
        said = (f"registered a gradient hook once on {params} ({shown}): kept, as the run's first forward would "
                f"register it, with the modules as its passes left them (whatever records the hooks agrees with "
                f"them){also}")
    else:  # (one pass, or how many is not known: once and at every forward read alike)
        which = "its pass" if passes == 1 else "its passes"
        said = (f"registered a gradient hook on {params} ({shown}): kept, with the modules as {which} left them "
                f"(whatever records the hooks agrees with them){also}; right if the model registers it once, as the "
                "run's first forward would; one registered at every forward would be there twice at the run's first "
                f"step, and {'one pass' if passes == 1 else 'the passes'} cannot tell them apart")
    warn(f"{by} {said}", AmpguardWarning, stacklevel=4)


def _a(noun: str) -> str:
    """``noun`` with its article: "a Linear", "an Embedding"."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}" if noun else "the model"


def _renormalises(module: torch.nn.Module) -> bool:
    """Whether ``module``'s forward renormalises its weight's rows in place: an ``nn.Embedding``
    or ``nn.EmbeddingBag`` given a ``max_norm`` (:func:`untouched` copies and puts it back)."""
    return isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.max_norm is not None


@contextlib.contextmanager
def _attributes_warned(snapshot: BufferSnapshot, by: str, model: torch.nn.Module) -> Iterator[None]:
    """Warn, on leaving, of the tensor attributes in ``snapshot.attributes`` (each module's own
    ones, :func:`_kept_attributes`), or tensors one level inside
    a list, tuple or dict among them, that the block changed in place (``self.state.add_(x)``:
    its version counter moved); not one that is a parameter or buffer of ``model`` (kept apart:
    a buffer is put back). The snapshot puts every attribute
    back (:func:`_put_attributes_back`: a replaced one, ``self.calls += 1`` or ``self.state =
    self.state + x``, is put back by reference; one added is taken out), but a tensor changed in
    place cannot be: it is named in an :class:`~ampguard.errors.AmpguardWarning` (keep it in a
    buffer). A snapshot of references: no tensor copied.

    Example::

        >>> class Counting(torch.nn.Linear):
        ...     calls = 0
        ...     def forward(self, x):
        ...         self.calls += 1
        ...         self.seen.add_(1)
        ...         return super().forward(x)
        >>> model = Counting(2, 1)
        >>> model.calls, model.seen = 5, torch.zeros(1)
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as said:
        ...     warnings.simplefilter("always")
        ...     with untouched(model):
        ...         _ = model(torch.ones(1, 2))
        >>> model.calls, model.seen.item(), "the tensor attribute Counting.seen" in str(said[0].message)
        (5, 1.0, True)
    """
    kept = snapshot.attributes
    own = snapshot.own
    tensors = [(f"{type(m).__name__}.{k}", t) for m, held, _, _ in kept for k, v in held.items()
               for t in _tensors_in(v) if _memory(t) is None or _memory(t) not in own]  # (nor a view of one)
    versions = [_version(t) for _, t in tensors]
    held = _hook_tensors(kept, own)
    held_versions = [_version(t) for _, t in held]
    opaque = [(hook, v, mark) for hook, v in _hook_values(kept) if (mark := _fingerprint(v)) is not None]
    yield
    watched = list(dict.fromkeys(name for name, b, version in snapshot.watched if _version(b) != version))
    if watched:
        warn(f"{by} changed the buffer {listed(watched)} of a module outside the model in place: it is "
             "not put back (a module in eval mode, or past 64 MiB of such buffers, is not copied), so the run "
             "goes on from it, not from a plain loop's; keep the module in training mode, or its state out of "
             "the forward", AmpguardWarning, stacklevel=4)
    moved = list(dict.fromkeys(name for (name, t), version in zip(tensors, versions) if _version(t) != version))
    if moved:
        more = f" (and {len(moved) - 1} more)" if len(moved) > 1 else ""
        warn(f"{by} changed the tensor attribute {moved[0]}{more} in place: it is no buffer, so it is "
             "not put back, and the run goes on from its value, not a plain loop's; keep such state in a "
             "buffer (register_buffer), which is put back", AmpguardWarning, stacklevel=4)
    spent, beside = _hooks_state_moved(kept, snapshot.trained, snapshot.registered_outside(), snapshot.module_names)
    spent = list(dict.fromkeys([*spent, *(hook for (hook, t), version in zip(held, held_versions)
                                          if _version(t) != version),  # (review 43h: ``amax_history.copy_(...)``)
                                *(hook for hook, v, mark in opaque if _fingerprint(v) != mark)]))  # (44a)
    if spent:
        also = f" (with the module attributes it shares: {listed(beside)})" if beside else ""
        warn(f"{by} changed the state a hook of the model keeps in its closure or object "
             f"({listed(spent, 2, ' and ', ' and others')}): it is not put back{also} (it may record what "
             "the hook did, or be the caller's own log), so the run goes on from it, not from a plain loop's "
             "(a warm-up's countdown is spent by the passes); keep such state in the module, whose attributes "
             "are put back", AmpguardWarning, stacklevel=4)


def _hook_tensors(kept: list[_Kept], own: set[Any]) -> list[tuple[str, torch.Tensor]]:
    """The tensors in the state of the hooks in ``kept`` (:func:`_hook_state`: a cell's, one in a
    container there, or in one below it), each once with the hook that holds it first (``"a
    forward hook on Linear"``), not the model's parameters and buffers (``own``, by memory):
    :func:`_attributes_warned` says those the block changed in place, which cannot be put back
    (review 43h: a delayed-scaling hook's ``amax_history.copy_(...)``, ``stats["sq"] += x``)."""
    return [(hook, t) for hook, t in _hook_values(kept) if isinstance(t, torch.Tensor)
            and (_memory(t) is None or _memory(t) not in own)]


def _hook_values(kept: list[_Kept]) -> list[tuple[str, Any]]:
    """The values in the state of the hooks in ``kept`` (:func:`_piece_values`), each once with the
    hook that holds it first (``"a forward hook on Linear"``)."""
    found: dict[int, tuple[str, Any]] = {}
    looked: set[int] = set()  # (a container many hooks hold, and those below it: looked into once)
    for m, _, hooks, _ in kept:
        for owner, name, _, states in hooks:
            kind = _hook_kind(m, owner, name) or "hook"
            for pieces in states.values():
                for v in _piece_values(pieces, looked):
                    if id(v) not in found:
                        found[id(v)] = (f"{_a(kind)} on {type(m).__name__}", v)
    return list(found.values())


def _piece_tensors(pieces: list[tuple[Any, ...]], looked: set[int]) -> Iterator[torch.Tensor]:
    """The tensors in :func:`_hook_state`'s ``pieces`` (:func:`_piece_values`'s)."""
    return (v for v in _piece_values(pieces, looked) if isinstance(v, torch.Tensor))


def _piece_values(pieces: list[tuple[Any, ...]], looked: set[int]) -> Iterator[Any]:
    """The values in :func:`_hook_state`'s ``pieces``: a cell's value, one in a container there
    (a list, tuple, deque or dict's), or in one below it; each container once (``looked``, by
    identity)."""
    for kind, target, *rest in pieces:
        if kind not in ("inner", "cell", "contents", "loose") or id(rest[0]) in looked:
            continue
        if kind == "inner":  # (the containers below)
            looked.add(id(rest[0]))
            yield from _piece_values(rest[0], looked)
            continue
        if kind == "loose":  # (an object's other attributes: one reached by a name made as it runs, 44e)
            yield rest[0]
            continue
        value = rest[0]  # (a cell's value; a container's contents as they were)
        try:
            if isinstance(value, (list, tuple, collections.deque, dict)):
                looked.add(id(value))  # (its first _INNER_MOST, names and numbers aside: review 44e, a schedule
                items = itertools.islice(value.values() if isinstance(value, dict) else value, _INNER_MOST)
                yield from [x for x in items if x is not None and type(x) not in _TAGS]  # of 1M floats, 3.6 s)
            else:
                yield value
        except Exception:  # (one that cannot be looked at: a dead weak proxy, review 42d)
            continue


def _fingerprint(v: Any) -> Any:
    """What tells whether an object a hook's state holds, that no put-back looks into, was changed
    in place, or None for one not told so: a small NumPy array (``count[0] += 1``), an
    ``itertools.count``, a ``queue.Queue``, a weak dictionary (review 44a: each such warm-up's
    count was spent by the check, silently); said as a tensor changed in place is
    (:func:`_attributes_warned`), not put back."""
    if _is_numpy_array(v):  # (hashed, not kept: 20k arrays would hold 320 MiB, review 44e)
        return (v.shape, str(v.dtype), hash(v.tobytes())) if v.size <= _INNER_MOST and v.dtype != object else None
    if isinstance(v, itertools.count):
        return repr(v)
    if isinstance(v, queue.Queue):
        return tuple(map(id, list(v.queue)[:_INNER_MOST])), v.qsize()
    if isinstance(v, (weakref.WeakKeyDictionary, weakref.WeakValueDictionary)) and len(v) <= _INNER_MOST:
        return tuple((id(k), id(x)) for k, x in list(v.items()))
    if isinstance(v, torch.utils.data.dataloader._BaseDataLoaderIter):
        return v._num_yielded
    if isinstance(v, Iterator) and not _user_made(v):  # (one the loss draws from: 44d, 44e)
        return _iterator_mark(v, 0)
    if isinstance(v, torch.optim.Optimizer):  # (its groups' numbers: a loss that halves the lr, 44d)
        return tuple(tuple((k, x) for k, x in g.items() if type(x) in (int, float, bool)) for g in v.param_groups)
    return None


def _iterator_mark(v: Any, depth: int) -> Any:
    """Where iterator ``v`` stands: a generator by its frame's place and its locals (a ``while
    True`` loop's place alone does not move), any other by its length hint and what it reduces to
    (a list iterator's index, a ``map``'s or ``zip``'s iterators in turn, a ``cycle``'s saved items),
    three levels down; a container in it by identity and length, never copied nor printed."""
    if isinstance(v, types.GeneratorType):
        frame = v.gi_frame
        return -1 if frame is None else (frame.f_lasti, tuple(_mark(x, 3) for x in frame.f_locals.values()))
    try:
        hint = operator.length_hint(v, -1)
        reduced = v.__reduce__()
    except Exception:  # (one that cannot say: a file, a user's iterator whose reduce raises)
        return type(v)
    args = reduced[1] if len(reduced) > 1 and type(reduced[1]) is tuple else ()
    return type(v), hint, tuple(_mark(x, depth + 1) for x in (*args, *reduced[2:]))


def _mark(x: Any, depth: int) -> Any:
    """:func:`_iterator_mark`'s mark of one part of what an iterator reduces to."""
    if x is None or type(x) in _TAGS:
        return x
    if isinstance(x, Iterator) and depth < 3:
        return _iterator_mark(x, depth)
    if type(x) is tuple and depth < 3:
        return tuple(_mark(y, depth + 1) for y in x[:16])
    try:
        return id(x), len(x)
    except Exception:
        return id(x)


def _captured(v: Any, trained: frozenset[int] = frozenset()) -> bool:
    """Whether ``v`` is what a hook captures from a pass: a tensor computed in it (not one the model
    trains: :func:`_trained`), a NumPy array (one copied to the host), a shape, or a tuple, list or
    dict of them beside None (a transformers attention layer's ``(output, None)``: review 43a) and
    names or numbers (:data:`_TAGS`).
    ``trained``: the ids of the model's parameters and trainable tensor attributes."""
    if isinstance(v, torch.Tensor):
        return not _trained(v, trained)
    if isinstance(v, (torch.Size, torch.dtype, torch.device)) or _is_numpy_array(v) or type(v) is float:
        return True  # (an autocast audit's ``dtypes[name] = o.dtype``: review 44a, read as state and left; a float is
        # a value computed, ``self.last = loss.item()``, 44e: a count or a flag is an int or a bool)
    if type(v) is tuple and v and all(type(x) is int for x in v):
        return True  # (a shape: ``shapes[name] = tuple(o.shape)``, 44a)
    items = list(v) if isinstance(v, (tuple, list)) else list(v.values()) if isinstance(v, dict) else []
    items = [x for x in items if x is not None and type(x) not in _TAGS]
    taken = [_captured(x, trained) for x in items]
    return any(taken) and all(t or _carried(x) for x, t in zip(items, taken))


def _carried(v: Any) -> bool:
    """Whether ``v``, beside a capture in a tuple, list or dict, is carried with it: an object of a
    library's class that is no container (a transformers ``DynamicCache`` in a ``ModelOutput``
    captured with ``use_cache=True``, GPT-2's default: review 44a, read as state, a warning at every
    start-up and four outputs left with their graphs). Not a user's object: its state is judged."""
    return not (isinstance(v, (torch.Tensor, tuple, list, dict, set, collections.deque, type, types.ModuleType))
                or callable(v) or _is_numpy_array(v) or _user_made(v) or type(v).__module__ in ("builtins", None))


_TAGS = (str, int, float, bool)
"""What a capture may carry beside its tensors, in a tuple, list or dict: a layer's name, a step
(``feats.append((name, out))``, ``{"layer": name, "out": out}``: review 43h, read as state, the
hook was left whole with the check's outputs, and a warning said so at every start-up)."""


def _trained(v: Any, trained: frozenset[int]) -> bool:
    """Whether ``v`` is a tensor the model trains: a parameter (one FSDP2 unshards for a pass too),
    or one of ``trained`` (the model's trainable tensor attributes; review 43b: any leaf that
    requires grad was taken for one, and an embedding's output made so by
    ``enable_input_require_grads`` was not a capture)."""
    return isinstance(v, torch.nn.Parameter) or isinstance(v, torch.Tensor) and id(v) in trained


def _grad_hooked(v: Any) -> bool:
    """Whether tensor ``v`` carries a gradient hook (its own, or a post-accumulate one)."""
    return bool(getattr(v, "_backward_hooks", None) or getattr(v, "_post_accumulate_grad_hooks", None))


def _is_numpy_array(v: Any) -> bool:
    return type(v).__name__ == "ndarray" and type(v).__module__ == "numpy"


def _state_verdict(held: tuple[Any, ...], trained: frozenset[int] = frozenset()) -> str | None:
    """How the block changed one piece of a hook's state (:func:`_hook_state`'s ``held``): None
    (not at all), ``"captured"`` (every value it gained or lost, None aside, is :func:`_captured`:
    an activation cache a forward writes again, a slot filled in a dict or list made with None,
    a list of outputs it appends to, a statistic kept as a tensor and replaced each forward;
    reviews 42f, 43a, 43b), ``"record"`` (beside those, the model's trained tensors, each with a
    gradient hook: a record of the parameters a hook registered gradient hooks on, transformers'
    tensor parallelism's, review 41b, agreeing with the hooks), ``"parameters"`` (such a record
    of parameters without one), ``"start"`` (a cell given None or an empty container, or given
    one for None: a flag a setup was done behind, ``if state is None: state = {}``), or
    ``"state"`` (anything else: a count, a flag); of an object's attribute the hook's code does not
    name (``"loose"``), ``"captured"`` or ``"loose"`` (anything else: left unsaid, with the object's
    other such attributes, :func:`_hooks_judged`). ``trained``: :func:`_trained`'s."""
    kind, target, *rest = held
    if kind == "loose":  # (an attribute a hook's code does not name: a capture, or "loose" to leave unsaid)
        value, look = rest
        now = target.cell_contents
        if now is not value:
            verdict = _verdict_of([value, now], trained, cell=True)
        elif look is None:
            return None
        else:
            verdict = _state_verdict((look[0], now, *look[1:]), trained)
        return verdict if verdict in (None, "captured") else "loose"
    if kind == "length":  # (a long list one level down: only what was appended is looked at)
        length, ends = rest
        if len(target) < length or length and (target[0] is not ends[0] or target[length - 1] is not ends[1]):
            return "state"  # (cut, or a full window moved on: review 43h, a deque of 5,000 amaxes, unsaid)
        return None if len(target) == length else _verdict_of(_logged(itertools.islice(target, length, None)), trained)
    value, contents = (target.cell_contents, rest[1]) if kind == "cell" else (target, rest[0])
    if kind == "cell" and value is not rest[0]:
        return _verdict_of([rest[0], value], trained, cell=True)
    if contents is None:
        return None
    if isinstance(contents, dict):
        changed = [x for k in value.keys() | contents.keys()
                   if (a := value.get(k, _GONE)) is not (b := contents.get(k, _GONE)) for x in (a, b)]
    elif isinstance(contents, set):
        changed = [*(value - contents), *(contents - value)]
    elif len(value) > len(contents) and all(a is b for a, b in zip(value, contents)):
        changed = _logged(itertools.islice(value, len(contents), None))  # (appended to: a log)
    else:
        changed = [x for a, b in itertools.zip_longest(value, contents, fillvalue=_GONE) if a is not b for x in (a, b)]
    return _verdict_of(changed, trained) if changed else None


def _logged(appended: Iterator[Any]) -> list[Any]:
    """What was appended to a list, numbers read as None: a log of ``out.abs().mean().item()`` is a
    capture as a log of the tensor is (review 43i: read as state, a warning at every start-up and
    the check's values left), and so is a log of names (``order.append(name)``, the modules' order:
    review 44a) where a name comes again (each pass logged it); names each appended once are a
    registry of what was done (an LSUV-like initialisation's ``done.append(name)``: rewound, it ran
    twice, review 44c); a number in a dict's new slot is not a capture (``done[name] = 1``)."""
    appended = list(appended)
    names = [x for x in appended if type(x) is str]
    log = len(set(names)) < len(names)  # (a name again: a log of the passes, not a registry of what was done)
    return [None if type(x) in (int, float) or type(x) is str and log else x for x in appended]


def _verdict_of(changed: list[Any], trained: frozenset[int], cell: bool = False) -> str | None:
    """:func:`_state_verdict` of the values a piece of state gained or lost (None, an empty list,
    tuple, dict or other container, where a capture starts, and :data:`_GONE` aside: review 43c; 43i, timm's
    ``get_output`` gives the device's slot a new ``OrderedDict()``). None or empty ones
    alone are a capture in a container (an attention layer's ``(out, None)``'s None appended:
    review 43g) and a ``"start"`` in a ``cell`` (a flag a setup was done behind, ``if state is
    None: state = {}``: put back where the setup is the model's, which is put back too, review
    43e; left and said where the block registered a global hook, review 43f:
    :func:`_put_attributes_back`)."""
    changed = [x for x in changed if x is not _GONE]
    if not changed:
        return None
    changed = [x for x in changed if x is not None and not ((type(x) in _CONTAINERS or type(x) is tuple) and not x)]
    if not changed:
        return "start" if cell else "captured"
    if all(_captured(x, trained) for x in changed):
        return "captured"
    if not all(_captured(x, trained) or _trained(x, trained) for x in changed):
        return "state"
    return "record" if all(_grad_hooked(x) for x in changed if _trained(x, trained)) else "parameters"


def _piece_key(held: tuple[Any, ...]) -> int:
    """What one piece of a hook's state is judged and given back by, once: the container a cell
    holds (many hooks of one factory each hold the same dict in a cell of their own: review 43b,
    judged once a cell, 4,000 hooks took 12 s), else the cell or the container itself."""
    kind, target, *rest = held
    if kind in ("cell", "loose") and rest[1] is not None and target.cell_contents is rest[0]:
        return id(rest[0])  # (a loose one as a cell: review 43k, a dict another hook's state left was emptied)
    return id(rest[0]) if kind == "inner" else id(target)


_HOOK_KINDS = {"_forward_hooks": "forward hook", "_forward_pre_hooks": "forward pre-hook",
               "_backward_hooks": "backward hook", "_backward_pre_hooks": "backward pre-hook",
               "_post_accumulate_grad_hooks": "post-accumulate-grad hook"}
"""What a warning calls the hooks of each hook dict (a parameter's ``_backward_hooks``: a gradient hook)."""


def _hook_kind(m: torch.nn.Module, owner: Any, name: str) -> str | None:
    """What a warning calls a hook in ``owner``'s dict ``name`` of module ``m``'s snapshot: a
    parameter's ``_backward_hooks`` hold gradient hooks (:data:`_HOOK_KINDS`)."""
    return "gradient hook" if owner is not m and name == "_backward_hooks" else _HOOK_KINDS.get(name)


def _hooks_state_moved(kept: list[_Kept], trained: frozenset[int] = frozenset(), outside: bool = False,
                       names: dict[int, str] | None = None) -> tuple[list[str], list[str]]:
    """The hooks in ``kept`` (:func:`_kept_hooks`' snapshots) still registered whose state
    (:func:`_hook_state`) the block changed other than by what a pass captures
    (:func:`_state_verdict`: a closure cell given another value, a container's contents changed;
    ``"a forward pre-hook on Sequential"``; review 42e: guessed from their types, a count rewound
    beside its flag left, a counter that recorded a registration rewound); a record of parameters
    not where the block registered gradient hooks (where it did, the model is left as the passes
    left it, the record agreeing with the hooks, and :func:`_warn_hooks_left` says so), but then
    what a pass captured, left too (review 43c: outputs appended to a list stayed, unsaid). A
    piece of state many hooks share is said of the first (:func:`_hooks_judged`; review 43a:
    every hook sharing a dict was named). ``trained``: :func:`_trained`'s. Returned: those hooks
    (``"a forward pre-hook on Sequential"``), and the module attributes (``"MoE.aux"``) left with
    them, a container they share (:func:`_left_keys`; review 43f: a module's list of aux losses a
    left hook reads kept the check's terms, unsaid), by their full names (``names``: the
    modules' by id). ``outside``: whether the block registered a hook on every module (a
    ``"start"`` is then left and said: :func:`_verdict_of`)."""
    hooked = any(_gained_gradient_hooks(m, hooks) for m, _, hooks, _ in kept)
    said = {"state", "captured", "told"} if hooked else _left_verdicts(outside)
    told: set[int] = set()
    found = []
    judged = _hooks_judged(kept, trained)
    for m, owner, name, pieces in judged:
        moved = {key for key, _, verdict in pieces if _said(verdict, said)} - told
        kind = _hook_kind(m, owner, name)
        if moved and kind:
            told |= moved
            found.append(f"{_a(kind)} on {type(m).__name__}")
    left = set() if hooked else _left_keys(judged, outside)  # (hooked: the modules are left whole, said apart)
    beside = [f"{(names or {}).get(id(m)) or type(m).__name__}.{k}" for m, held, _, contents in kept
              for k in _changed_attributes(vars(m), held, contents) if k in contents and id(held[k]) in left]
    return list(dict.fromkeys(found)), list(dict.fromkeys(beside))


def _hooks_judged(kept: list[_Kept], trained: frozenset[int]
                  ) -> list[tuple[torch.nn.Module, Any, str, list[tuple[int, tuple[Any, ...], str | None]]]]:
    """(module, the hook dict's owner, its name, [(key, piece, verdict)]) for each hook in ``kept``
    still registered with state (:func:`_hook_state`): each piece with what it is judged by,
    once (:func:`_piece_key`: many hooks of one factory hold the same dict, each in a cell of its
    own; review 43a/43b: judged once a hook, 4,000 hooks took 12-13 s) and its
    :func:`_state_verdict` (None where it cannot be looked at). The containers below a container
    (:func:`_hook_state`'s ``("inner", container, pieces)``) are judged once too, each hook holding
    them given ``("inner", container, [(key, piece, verdict)])`` and the set of their verdicts
    (review 43h: each hook listed them all, 4,096 hooks sharing a dict of per-module lists took
    93 s and 2.5 GiB)."""
    verdicts: dict[int, Any] = {}
    inner: dict[int, tuple[Any, ...]] = {}
    judged = []
    for m, _, hooks, _ in kept:
        for owner, name, before, states in hooks:
            now = getattr(owner, name, None) or {}
            for k in before:
                if k not in now or not states[k]:
                    continue
                pieces = []
                for held in states[k]:
                    key = _piece_key(held)
                    if held[0] == "inner":
                        if key not in inner:
                            below = [(_piece_key(piece), piece, _judged(piece, trained)) for piece in held[2]]
                            told = set()
                            if any(verdict == "loose" for _, _, verdict in below):  # (an object's other attributes:
                                below = [(k, piece, None) for k, piece, _ in below]  # a flag moved, its cache stays)
                                told = {"told"} if held[3:] == ("own",) else set()  # (the hook's own: said)
                            inner[key] = ("inner", held[1], below)
                            verdicts[key] = frozenset({v for _, _, v in below if v is not None} | told) or None
                        held = inner[key]
                    elif key not in verdicts:
                        verdicts[key] = _judged(held, trained)
                    pieces.append((key, held, verdicts[key]))
                judged.append((m, owner, name, pieces))
    return judged


def _judged(held: tuple[Any, ...], trained: frozenset[int]) -> str | None:
    """:func:`_state_verdict`, None where the piece cannot be looked at (a value that refuses it, a
    cell emptied)."""
    try:
        return _state_verdict(held, trained)
    except Exception:
        return None


def _said(verdict: Any, which: set[str]) -> bool:
    """Whether ``verdict`` (:func:`_hooks_judged`'s: one, or the set of those of the containers
    below a container) is, or holds, one of ``which``."""
    return verdict in which if isinstance(verdict, str) or verdict is None else bool(verdict & which)


def _captures_back(kept: list[_Kept], done: set[int], trained: frozenset[int], outside: bool = False) -> set[int]:
    """What the block's passes captured into the state of the hooks in ``kept`` still registered
    (:func:`_state_verdict`'s ``"captured"``: activations appended to a list, a statistic kept
    as a tensor), put back (review 43a: a running amax in a closure dict moved by the check's
    passes, and outputs appended to a list the loss reads and clears were three stale batches
    in the run's first loss, silently). What a forward writes again anyway is no harm put back;
    a record of a registration holds no tensor computed in a pass (a record of the parameters
    hooked is no capture: :func:`_trained`). Not a hook's captures beside state of it that is left
    (a count, a flag: :func:`_hooks_state_moved` says it), nor those it shares with such a hook:
    review 43c, an ActNorm-like ``scale`` rewound to None beside its ``ready`` flag left True
    broke the run's first forward; a hook sharing a piece with such a hook, and so on, is left whole
    too: review 43e). Each piece once (``done``, the containers given back already). Returned:
    the keys (:func:`_piece_key`) of the pieces left, which :func:`_put_modules_back` leaves too
    where a module holds them as an attribute (43e: the put-back of the module's dict emptied
    what the hook's flag said was there)."""
    judged = _hooks_judged(kept, trained)
    left = _left_keys(judged, outside)
    expanded: set[int] = set()
    for _, _, _, pieces in judged:
        for key, held, verdict in pieces:
            if held[0] == "inner":  # (the containers below: each once, not once a hook holding them)
                if key in left or key in expanded:
                    continue
                expanded.add(key)
            for key, held, verdict in held[2] if held[0] == "inner" else [(key, held, verdict)]:
                if verdict in ("captured", "start") and key not in left and key not in done:
                    _state_back([held], done)
                    done.add(key)
    return left


def _left_verdicts(outside: bool) -> set[str]:
    """The verdicts (:func:`_state_verdict`) of the state a hook's passes changed that is left in
    place and said where no gradient hook stays: a count or flag, a record of parameters, and a
    setup's flag where the passes registered a hook on every module (``outside``), and a hook
    object's own attribute moved by code its names miss (``"told"``: its named captures left too, a
    cache beside a flag its helper set was rewound, the run's first forward read None)."""
    return {"state", "parameters", "told", *(["start"] if outside else [])}


def _left_keys(judged: list[tuple[torch.nn.Module, Any, str, list[tuple[int, tuple[Any, ...], str | None]]]],
               outside: bool = False) -> set[int]:
    """The keys of the changed pieces left in place (:func:`_hooks_judged`'s): those of each hook
    with state left (``"state"``, ``"parameters"``), and of each hook sharing a changed piece
    with it, and so on (reviews 43c, 43e). Only changed pieces join hooks (review 43f: a config
    dict every hook of a factory reads, unchanged, joined a warm-up counter to a capture, whose
    outputs stayed), and each key is followed once (quadratic otherwise: 8,000 hooks sharing a
    dict, 8.9 s). The containers below a container (``"inner"``) join the hooks holding it by its
    key, and are left with it."""
    changed = [{key for key, _, verdict in pieces if verdict is not None} for _, _, _, pieces in judged]
    sharing: dict[int, list[int]] = {}
    for i, keys in enumerate(changed):
        for key in keys:
            sharing.setdefault(key, []).append(i)
    spent = _left_verdicts(outside)
    todo = [i for i, (_, _, _, pieces) in enumerate(judged) if any(_said(v, spent) for _, _, v in pieces)]
    reached, followed = set(todo), set()
    while todo:
        for key in changed[todo.pop()] - followed:
            followed.add(key)
            for j in sharing[key]:
                if j not in reached:
                    reached.add(j)
                    todo.append(j)
    left = {key for i in reached for key in changed[i]}
    below = {key: held[2] for _, _, _, pieces in judged for key, held, _ in pieces if held[0] == "inner" and key in left}
    # (an object's loose ones too: a left hook may read another's capture there through a helper, review 43m,
    # whose rewind broke the run's first forward; that capture is left, said with the hook, 43l's F3)
    return left | {key for pieces in below.values() for key, _, verdict in pieces if verdict is not None}


def _global_hooks() -> tuple[frozenset[Any], ...]:
    """The handles of the hooks registered on every module (``torch.nn.modules.module``'s
    ``_global_*`` dicts: ``register_module_forward_hook`` and the like)."""
    from torch.nn.modules import module as torch_module

    return tuple(frozenset(v) for k, v in sorted(vars(torch_module).items())
                 if k.startswith("_global_") and isinstance(v, dict))


def _generator_kept(g: Any) -> Callable[[], None] | None:
    """A function that gives ``g`` its present state back, if it is a random generator of its own
    (a ``torch.Generator``, NumPy's ``Generator``, ``RandomState`` or a bit generator, a
    ``random.Random``), else None: the state read and written by one dispatch on its type."""
    if isinstance(g, torch.Generator):
        state = g.get_state()
        return lambda: g.set_state(state)
    if isinstance(g, random.Random):
        state = g.getstate()
        return lambda: g.setstate(state)
    if type(g).__module__.startswith("numpy.random"):  # (NumPy imported already: it made g)
        import numpy as np

        if isinstance(g, np.random.RandomState):
            state = g.get_state()
            return lambda: g.set_state(state)
        bits = g.bit_generator if isinstance(g, np.random.Generator) else g
        if isinstance(bits, np.random.BitGenerator):  # (not a SeedSequence, whose state is read-only: review 43c)
            state = copy.deepcopy(bits.state)
            return lambda: setattr(bits, "state", copy.deepcopy(state))
    return None


def _generators_in(kept: list[_Kept], also: list[tuple[Any, ...]] = (), callables: tuple[Any, ...] = ()
                   ) -> list[Callable[[], None]]:
    """For each random generator the modules in ``kept`` hold of their own, a function that gives
    it back its present state (:func:`_generator_kept`): an attribute, a value in a hook's state
    (a cell of :func:`_hook_state`'s: its closure, its object), a ``functools.partial``'s
    arguments or a hook's defaults, or one in a list, tuple or dict of a few there (64 at most:
    not a vocabulary's list, review 43c; per-layer generators, review 43h) (MAE's masking draws
    from ``self.gen``; noise drawn from a generator of its own): :func:`rng_kept` keeps the global
    ones only, and the block's draws advanced these, silently (reviews 43a, 43b). And those in
    ``also`` (the loss's state, :func:`_hook_state`'s pieces) and the defaults of ``callables``
    (the loss; review 44c: a loss drawing noise from a generator of its own). Each once."""
    def few(v: Any) -> Iterator[Any]:
        yield v
        if (type(v) in (list, tuple) or type(v) in _CONTAINERS and isinstance(v, dict)) and len(v) <= 64:
            yield from v.values() if isinstance(v, dict) else v  # (a few: not a vocabulary, review 43c)

    def in_pieces(pieces: Iterable[tuple[Any, ...]]) -> Iterator[Any]:
        for piece in pieces:
            if piece[0] == "inner" and id(piece[2]) not in tested:  # (an object's other attributes)
                tested.add(id(piece[2]))
                yield from (v for p in piece[2] if p[0] == "loose" for v in few(p[2]))
            elif piece[0] == "cell":
                yield from few(piece[2])

    def bound(f: Any) -> Iterator[Any]:  # (a partial's arguments, a function's defaults)
        while isinstance(f, functools.partial):
            for v in (*f.args, *f.keywords.values()):
                yield from few(v)
            f = f.func
        if isinstance(f, types.MethodType):
            f = f.__func__
        if isinstance(f, types.FunctionType):  # (not any callable's: one whose __getattr__ answers anything)
            yield from (x for v in (*(f.__defaults__ or ()), *(f.__kwdefaults__ or {}).values()) for x in few(v))

    def candidates() -> Iterator[Any]:
        for _, held, hooks, _ in kept:
            for v in held.values():
                yield from few(v)
                if _user_made(v) and isinstance(getattr(v, "__dict__", None), dict):  # (a helper's own: 51c)
                    for x in list(vars(v).values()):
                        yield from few(x)
            for _, _, before, states in hooks:  # (per-layer generators in a closure's list: review 43h)
                for pieces in states.values():
                    yield from in_pieces(pieces)
                for hook in before.values():
                    yield from bound(hook)
        yield from in_pieces(also)
        for f in callables:
            yield from bound(f)

    found: dict[int, Callable[[], None]] = {}
    tested: set[int] = set()  # (each value once, however many hooks hold it: review 43i, 4,096 hooks 10 s)
    for v in candidates():
        if id(v) not in tested:
            tested.add(id(v))
            try:
                back = _generator_kept(v)
            except Exception:  # (one whose state cannot be read: SystemRandom's)
                back = None
            if back is not None:
                found[id(v)] = back
    return list(found.values())


def _attribute_objects(kept: list[_Kept]) -> tuple[list[tuple[Any, dict[str, Any]]], list[tuple[Any, Any]]]:
    """What :meth:`BufferSnapshot.put_back` gives back of the modules' attributes beyond the
    attributes themselves: each object of a class the user wrote (:func:`_user_made`) with its
    own attributes by reference, and each small writable NumPy array (at most
    :data:`_INNER_MOST` elements, not of objects) with a copy of it; each once.

    Example::

        >>> import numpy as np
        >>> m = torch.nn.Linear(1, 1)
        >>> m.tick, m.hist = types.SimpleNamespace(seen=0), np.zeros(2)  # (a record of the user's)
        >>> memo = {}
        >>> objects, arrays = _attribute_objects([_kept_module(m, memo)])
        >>> m.tick.seen += 1; m.hist[0] += 1
        >>> _objects_back(objects, arrays); m.tick.seen, m.hist.tolist()
        (0, [0.0, 0.0])
    """
    objects: dict[int, tuple[Any, dict[str, Any]]] = {}
    arrays: dict[int, tuple[Any, Any]] = {}
    for _, held, _, _ in kept:
        for v in held.values():
            if id(v) in objects or id(v) in arrays:
                continue
            if _is_numpy_array(v):
                if v.size <= _INNER_MOST and v.dtype != object and v.flags.writeable:
                    arrays[id(v)] = (v, v.copy())
            elif _user_made(v) and isinstance(getattr(v, "__dict__", None), dict):
                objects[id(v)] = (v, dict(vars(v)))
    return list(objects.values()), list(arrays.values())


def _objects_back(objects: list[tuple[Any, dict[str, Any]]], arrays: list[tuple[Any, Any]]) -> None:
    """:func:`_attribute_objects`' objects given their attributes back (one added taken out) and
    its arrays their values (one that refuses is left: the put-back goes on)."""
    for obj, attributes in objects:
        with contextlib.suppress(Exception):
            now = vars(obj)
            if now != attributes or any(now[k] is not v for k, v in attributes.items()):
                now.clear()
                now.update(attributes)
    for array, saved in arrays:
        with contextlib.suppress(Exception):
            if array.shape == saved.shape:
                array[...] = saved


def _generators_back(generators: list[Callable[[], None]]) -> None:
    """Each generator :func:`_generators_in` found given its state back (one that refuses it is
    left: the put-back goes on)."""
    for back in generators:
        with contextlib.suppress(Exception):
            back()


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """``value`` if a tensor, else the tensors one level inside it (a list, tuple, deque or dict's
    values)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple, collections.deque)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    if isinstance(value, dict):
        return [v for v in value.values() if isinstance(v, torch.Tensor)]
    return []


_GONE = object()


class _AttrCell:
    """An attribute of a hook's object read and written as a closure's cell is (``cell_contents``):
    :func:`_hook_state` keeps it as one, so that what a pass captured into ``self.outputs`` is
    judged and put back as what it captured into a closure's list (:func:`_state_verdict`). One
    not there reads :data:`_GONE`, and is taken out again when put back so (``if not hasattr(self,
    "outs"): self.outs = []``: review 43i). In the object's ``__dict__``, as read (no
    ``__setattr__`` of its class runs), or its slot (``@dataclass(slots=True)``)."""

    __slots__ = ("obj", "name", "slot")

    def __init__(self, obj: Any, name: str) -> None:
        self.obj, self.name = obj, name
        self.slot = not hasattr(obj, "__dict__") or any(
            name in ((names,) if isinstance(names, str) else names)
            for names in (vars(c).get("__slots__", ()) for c in type(obj).__mro__))

    @property
    def cell_contents(self) -> Any:
        if self.slot:
            return getattr(self.obj, self.name, _GONE)
        return vars(self.obj).get(self.name, _GONE)

    @cell_contents.setter
    def cell_contents(self, value: Any) -> None:
        if self.slot:
            if value is _GONE:
                with contextlib.suppress(AttributeError):
                    object.__delattr__(self.obj, self.name)
            else:
                object.__setattr__(self.obj, self.name, value)
        elif value is _GONE:
            vars(self.obj).pop(self.name, None)
        else:
            vars(self.obj)[self.name] = value


class _Bound:
    """A value bound to a function (a partial's argument, a default) held as a closure's cell is
    (``cell_contents``), which nothing rebinds: a tensor or an object :func:`_fingerprint` tells
    changed in place is said (:func:`_attributes_warned`)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    @property
    def cell_contents(self) -> Any:
        return self.value

    @cell_contents.setter
    def cell_contents(self, value: Any) -> None:
        pass  # (the same object: a partial's arguments and a function's defaults are not rebound)


class _GlobalCell:
    """A global of a hook's module (``acts`` in ``acts.append(out)``) read and written as a closure's
    cell is (``cell_contents``), as :class:`_AttrCell` an attribute; one not there (yet, or the
    block deleted it) reads :data:`_GONE`, and is taken out again when put back so."""

    __slots__ = ("scope", "name")

    def __init__(self, scope: dict[str, Any], name: str) -> None:
        self.scope, self.name = scope, name

    @property
    def cell_contents(self) -> Any:
        return self.scope.get(self.name, _GONE)

    @cell_contents.setter
    def cell_contents(self, value: Any) -> None:
        if value is _GONE:  # (one a pass made: ``global ema`` set at the hook's first call, review 44a)
            self.scope.pop(self.name, None)
        else:
            self.scope[self.name] = value


@functools.lru_cache(maxsize=4096)
def _names_used(code: types.CodeType) -> tuple[frozenset[str], frozenset[str]]:
    """The global names and the attribute names ``code`` and the code objects in it (a
    comprehension's, a nested function's) load, store or delete: what of a module's globals, and of
    an object's attributes, a hook's code can reach (review 43i: by ``co_names``, ``o.data`` read a
    global ``data`` of 300k items, and every attribute of ``self`` was its state, a trainer's
    dataset and the loss's step counter among them). A name in a string (``getattr(self, "outs")``)
    is one too, and code that makes names as it runs (``getattr``, ``setattr``, ``vars``,
    ``__dict__``) is given ``"*"``: every attribute."""
    found: tuple[set[str], set[str]] = (set(), set())
    for instruction in dis.get_instructions(code):
        if instruction.opname.endswith("_GLOBAL"):
            found[0].add(instruction.argval)
        elif instruction.opname.endswith(("_ATTR", "_METHOD")):
            found[1].add(instruction.argval)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            more = _names_used(const)
            found[0].update(more[0])
            found[1].update(more[1])
        elif isinstance(const, str) and const.isidentifier():  # (``getattr(self, "outs")``, ``hasattr``)
            found[1].add(const)
    if found[0] & {"getattr", "setattr", "delattr", "vars"} or "__dict__" in found[1]:
        found[1].add("*")  # (a name made as it runs: every attribute the object has)
    return frozenset(found[0]), frozenset(found[1])


def _method_functions(attribute: Any) -> list[types.FunctionType]:
    """The functions of a class's ``attribute`` if it is a method (a function, a static or class
    method, a property's getter and setter, a ``cached_property``'s or ``partialmethod``'s
    function), through its decorators (``@torch.no_grad()``: review 43j, the wrapper's code named
    none of the method's attributes), else none: code, not state (:func:`_hook_state`). By type,
    not by asking the attribute (a config object whose ``__getattr__`` raises: 43j)."""
    if isinstance(attribute, property):
        functions = [attribute.fget, attribute.fset, attribute.fdel]
    elif isinstance(attribute, (staticmethod, classmethod)):
        functions = [attribute.__func__]
    elif isinstance(attribute, (functools.cached_property, functools.partialmethod)):
        functions = [attribute.func]
    else:
        functions = [attribute]
    found = []
    for function in functions:
        with contextlib.suppress(Exception):
            function = inspect.unwrap(function)
        if isinstance(function, types.FunctionType):
            found.append(function)
    return found


def _reached(function: Any, depth: int = 0) -> frozenset[str]:
    """The attribute names ``function``'s code uses (:func:`_names_used`) and those of the user's
    functions it calls by a global name, two levels down: a module-level helper given the object
    (``build_cache(self, out)``, which sets ``self.cache`` and ``self.built``) reaches its
    attributes as the hook's own code does (review 44a: the flag the helper set was loose, left
    unsaid, beside the cache it named, rewound to None: the run's first forward multiplied by None).
    Not cached by function: a hook's closure may hold a model's worth of tensors (the code's names
    are, :func:`_names_used`)."""
    code = getattr(function, "__code__", None)
    if not isinstance(code, types.CodeType):
        return frozenset()
    global_names, found = _names_used(code)
    if depth < 2 and isinstance(function, types.FunctionType) and _user_code(function):
        for name in global_names:
            helper = function.__globals__.get(name)
            # (or one of a module of the user's it names: ``helpers.build_cache(self, out)``, review 44d)
            helpers = [vars(helper).get(attribute) for attribute in found] if isinstance(
                helper, types.ModuleType) else [helper]
            for helper in helpers:
                if isinstance(helper, types.FunctionType) and helper is not function and _user_code(helper):
                    found = found | _reached(helper, depth + 1)
    return found


def _attributes_used(cls: type, names: frozenset[str]) -> frozenset[str]:
    """``names`` and the attribute names the methods of ``cls`` they name use (each definition
    along its MRO: ``super().__call__``, review 43j), and so on: what of an object of ``cls`` a
    hook's code reaches (``self._store(out)``, which appends to ``self.buf``)."""
    try:
        return _attributes_used_cached(cls, names)
    except TypeError:  # (a class that cannot be hashed: its metaclass defines __eq__)
        return _attributes_used_cached.__wrapped__(cls, names)


@functools.lru_cache(maxsize=1024)
def _attributes_used_cached(cls: type, names: frozenset[str]) -> frozenset[str]:
    found, todo = set(names), list(names)
    while todo:
        name = todo.pop()
        for c in cls.__mro__:
            for function in _method_functions(vars(c).get(name)):
                for more in _reached(function) - found:
                    found.add(more)
                    todo.append(more)
    return frozenset(found)


def _state_names(cls: type, names: frozenset[str]) -> frozenset[str]:
    """The attributes of an object of ``cls`` that ``names`` reach (:func:`_attributes_used`) and
    that are no method: its state's names, each a cell of a hook's state (:func:`_hook_state`).
    Not ``"*"`` (names made as it runs: those are among the loose ones, review 43l), nor dunders.
    Cached by class and names (review 44c: 2,000 hooks each calling a helper that names ~40
    attributes, looked up on the class once a hook and a name, 4.0 s at start-up)."""
    try:
        return _state_names_cached(cls, names)
    except TypeError:  # (a class that cannot be hashed)
        return _state_names_cached.__wrapped__(cls, names)


@functools.lru_cache(maxsize=1024)
def _state_names_cached(cls: type, names: frozenset[str]) -> frozenset[str]:
    return frozenset(name for name in _attributes_used(cls, names) if name != "*"
                     and not (name.startswith("__") and name.endswith("__"))
                     and not _method_functions(inspect.getattr_static(cls, name, None)))


def _user_code(f: types.FunctionType) -> bool:
    """Whether function ``f`` is the user's (a script's, a notebook's, a module outside the standard
    library and the installed packages, nor torch's or ampguard's): :func:`_hook_state` reads the
    globals one loads (a library's module state is its own)."""
    if _frameworks(getattr(f, "__module__", "")):
        return False
    file = f.__code__.co_filename
    return file.startswith("<") or _users_file(file)


def _called(obj: Any) -> frozenset[str]:
    """``{"__call__"}`` for a callable object a hook's code holds (``saver(out)``: what its
    ``__call__`` uses is the hook's), else none (review 43k: a trainer's step, ``__call__``, was read
    for a hook that only holds its method)."""
    return frozenset({"__call__"}) if callable(obj) else frozenset()


def _user_made(obj: Any) -> bool:
    """Whether ``obj`` is an object of a class the user wrote (in a script, a notebook, or a module
    outside the standard library and the installed packages): :func:`_hook_state` reads the
    attributes of one in a hook's closure (a library's object there, a logger, keeps its own state)."""
    cls = type(obj)
    if isinstance(obj, (torch.nn.Module, type, types.ModuleType)) or cls.__module__ in ("builtins", None) \
            or _framework_own(obj):
        return False
    if cls.__module__ == "__main__" or cls is types.SimpleNamespace or (cls.__module__, cls.__qualname__) == (
            "argparse", "Namespace"):  # (a plain record of the user's: ``state = SimpleNamespace(step=0)``, 44a)
        return True
    file = getattr(sys.modules.get(cls.__module__), "__file__", None)
    return bool(file) and _users_file(file)


@functools.lru_cache(maxsize=1024)
def _users_file(file: str) -> bool:
    """Whether ``file`` is outside the standard library and the installed packages."""
    return not os.path.realpath(file).startswith(_library_roots())


def _frameworks(module: Any) -> bool:
    """Whether ``module`` (a module's name) is torch's or ampguard's."""
    return str(module).split(".")[0] in ("torch", "ampguard")


@functools.cache
def _library_roots() -> tuple[str, ...]:
    """Where the standard library and the installed packages are (:func:`_user_made`)."""
    return tuple(os.path.join(os.path.realpath(p), "") for p in {sysconfig.get_path(k) for k in (
        "stdlib", "platstdlib", "purelib", "platlib")} | set(site.getsitepackages()) if p)


def _framework_own(obj: Any) -> bool:
    """Whether ``obj`` is an object of torch's or ampguard's own making (FSDP2's state,
    ``weight_norm``'s hook, fp8's casts): its attributes are theirs to keep (:func:`_hook_state`)."""
    return _frameworks(type(obj).__module__)


def not_made(m: torch.nn.Module) -> bool:
    """Whether module ``m`` holds a parameter or buffer of its own that a lazy module has not made
    yet (``nn.LazyLinear`` before its first forward).

    Example::

        >>> lazy = torch.nn.Sequential(torch.nn.LazyLinear(2))
        >>> not_made(lazy[0]), not_made(torch.nn.Linear(2, 1)), not_made(lazy)  # (its own only)
        (True, False, False)
    """
    return any(is_lazy(t) for t in itertools.chain(m.parameters(recurse=False), m.buffers(recurse=False)))


_Hooks = list[tuple[Any, str, dict[int, Any], dict[int, list[tuple[Any, Any, Any]]]]]
"""A module's hook dicts and its own parameters' as they were (:func:`_kept_hooks`): (owner,
the dict's name, a copy of its entries, handle id -> hook or flag, and by the same id each
hook's state: :func:`_hook_state`)."""

_Kept = tuple[torch.nn.Module, dict[str, Any], _Hooks, dict[str, Any]]
"""A module's snapshot (:func:`_kept_module`): the module, its attributes by reference, its hook
dicts and its own parameters' (:func:`_kept_hooks`), and a copy of the contents of each
attribute that is a list, dict, set or deque."""

_INNER_MOST = 4096
"""The most items a list below a hook's container may have to be copied and put back whole; a
longer one is judged by its length and ends (:func:`_hook_state`)."""

_INNER_PIECES = 16384
"""The most containers judged below one hook's container (a dict of per-module lists: one per
module; a list of 300k records is not walked past them: review 43i; :func:`_hook_state`)."""

_INNER_BUDGET = 1 << 20
"""The most items the containers below one hook's container may hold together to be copied (about
8 MiB of references; :func:`_hook_state`)."""

_CONTAINERS = (list, dict, set, collections.OrderedDict, collections.defaultdict, collections.Counter,
               collections.deque)
"""The attribute types whose contents a snapshot copies (one level: shallow) and puts back in
place: a forward's ``self.seen.append(...)``, ``self.cache[key] = ...``. These exact types only:
a subclass may refuse to be changed (transformers' ``ModelOutput`` refuses ``update``)."""


def _reducer_owned(m: torch.nn.Module) -> bool:
    """Whether module ``m`` is a ``DistributedDataParallel`` wrapper, whose own attributes pair with
    its C++ reducer's state (``_static_graph_delay_allreduce_enqueued``): put back alone, they
    disagreed with it, and the next backward failed an internal assert (review 41). Its wrapped
    module's are kept as any other's."""
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(m, DistributedDataParallel)


def _kept_module(m: torch.nn.Module, memo: dict[Any, tuple[Any, Any]]) -> _Kept:
    """Module ``m``'s snapshot for :func:`_put_attributes_back`: :func:`_kept_attributes`,
    :func:`_kept_hooks`, and a shallow copy of each list, dict or set among the attributes
    (review 41: a list a forward appends to in place, a dict it fills, kept each pass's entries:
    a live diagnosis's replays moved the run's later steps, 40m #4)."""
    held = _kept_attributes(m)
    return m, held, _kept_hooks(m, memo), {k: copy.copy(v) for k, v in held.items() if type(v) in _CONTAINERS}


def _kept_attributes(m: torch.nn.Module) -> dict[str, Any]:
    """The attributes of module ``m`` that :class:`BufferSnapshot` puts back, by reference: its
    own, every ``__dict__`` entry but :data:`_MODULES_OWN` (review 40g: a private counter,
    ``_step``, is kept too; 40m: of any type, so that one a pass replaced by another type,
    ``self.prev = ()`` then a tensor, is put back, not taken out as added).
    Parameters and buffers are not among them: they are kept apart."""
    return {k: v for k, v in vars(m).items() if k not in _MODULES_OWN}


def _kept_hooks(m: torch.nn.Module, memo: dict[Any, tuple[Any, Any]]) -> _Hooks:
    """(owner, dict's name, a copy of its entries) for module ``m``'s own hook dicts
    (:data:`_HOOK_DICTS`) and its own parameters' and trainable tensor attributes'
    (:data:`_TENSOR_HOOK_DICTS`; one that is None yet kept as empty: :func:`_trainable_attributes`).
    The hooks themselves, not only their ids: one a pass takes out (a
    data-dependent initialisation that removes itself after its first call) is put back (review
    42a: the check used it up, and the run never initialised the layer)."""
    return [(owner, name, before, {k: _hook_state(hook, memo) for k, hook in before.items()})
            for owner, names in [(m, _HOOK_DICTS), *((p, _TENSOR_HOOK_DICTS) for p in m.parameters(recurse=False)),
                                 *((t, _TENSOR_HOOK_DICTS) for _, t in _trainable_attributes(m))]
            for name in names if isinstance(getattr(owner, name, None), dict) or owner is not m
            for before in [dict(getattr(owner, name) or {})]]


def _trainable_attributes(m: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Module ``m``'s tensor attributes that are trained but not parameters (a leaf that requires
    grad, handed to the optimizer by hand: SAC's ``self.log_alpha``): their gradient hooks are
    kept as a parameter's (41g: one registered behind a flag the put-back cleared was registered
    twice, unsaid)."""
    return [(k, v) for k, v in vars(m).items() if k not in _MODULES_OWN and isinstance(v, torch.Tensor)
            and not isinstance(v, torch.nn.Parameter) and v.requires_grad and v.is_leaf]


_OUTSIDE_COPIED = 64 << 20
"""The bytes of buffers of modules outside the model (:func:`_outside`) a snapshot copies at most:
past it, and for one in eval mode, a buffer is referenced and a change in place said."""

_MODULES_HELD = ("modules held",)
"""The key of :func:`_hook_state`'s ``memo`` under which it lists the modules hooks' state holds."""


def _hold_module(memo: dict[Any, tuple[Any, Any]], m: torch.nn.Module) -> None:
    """List module ``m`` in ``memo`` as one a hook's state (or the loss) holds: the model's own, or
    one outside it (a loss module whose hooks on the model keep features in ``self.feats``, a
    tracker's buffer: :func:`_outside` keeps those as the model's are, review 44a)."""
    memo.setdefault(_MODULES_HELD, (None, {}))[1][id(m)] = m


def _held_modules(memo: dict[Any, tuple[Any, Any]]) -> list[torch.nn.Module]:
    """The modules :func:`_hold_module` listed in ``memo``."""
    return list(memo.get(_MODULES_HELD, (None, {}))[1].values())


def _memories(modules: Iterable[torch.nn.Module]) -> set[Any]:
    """Where the parameters and buffers of ``modules`` (their own, made) lie (:func:`_memory`)."""
    return {_memory(t) for m in modules
            for t in itertools.chain(m.parameters(recurse=False), m.buffers(recurse=False)) if not is_lazy(t)} - {None}


def _hook_state(hook: Any, memo: dict[Any, tuple[Any, Any]]) -> list[tuple[Any, ...]]:
    """The state a hook keeps outside its module, by reference, with a shallow copy of each list,
    dict, set or deque's contents: :func:`_state_back` puts it back for a hook a pass took out
    (review 42b: a warm-up hook that counts down and removes itself at 0, put back with its count
    spent, went on for good); for one left in place, what a pass captured is put back
    (:func:`_captures_back`) and another change said (:func:`_hooks_state_moved`; 42c: the passes
    had spent the run's warm-up steps, silently). Its pieces:

    - its closure's cells (``("cell", cell, value, contents)``), through the functions they hold
      and the ones it wraps (``__wrapped__``: a ``torch.no_grad()``-decorated hook), and a
      ``functools.partial``'s arguments' contents (``("contents", value, contents)``);
    - the globals a hook of the user's code loads (:class:`_GlobalCell`, :func:`_user_code`: the
      tutorials' ``activation = {}``; review 43h), not a library's;
    - of an object -- the hook itself (``SaveOutput()``), the object whose method it is (timm's
      ``FeatureHooks``), one of the user's classes in its closure or globals (``self`` of the method
      that made it) -- the attributes its code uses, each a cell (:class:`_AttrCell`,
      :func:`_names_used`, :func:`_attributes_used`; reviews 43i, 43j), and its other attributes
      held loosely (``("loose", cell, value, look)``, looked at in O(1)); not torch's or ampguard's
      own objects (FSDP2's hooks are its state object's methods: put back, its lazy initialisation
      ran again and refused the model);
    - the containers below a container, two levels (``("inner", container, pieces)``, one piece a
      hook however many hooks hold it: review 43h).

    Not a tensor changed in place (said: :func:`_hook_tensors`). A container many hooks share is
    copied once (``memo``, by identity: review 42d, a dict of every parameter in every hook's
    closure made the snapshot quadratic); a hook whose state cannot be read (a dead weak proxy in
    its closure) keeps what was read of it."""
    kept: list[tuple[Any, ...]] = []
    seen: set[int] = set()
    objects: set[tuple[int, str | None]] = set()  # (an object's attributes looked at: once a hook)

    def held(cell: Any, value: Any) -> None:
        kept.append(("cell", cell, value, copied(value) if type(value) in _CONTAINERS else None))
        if (type(value) in _CONTAINERS or type(value) is tuple) and (pieces := inner(value)):
            kept.append(("inner", value, pieces))  # (a tuple's too: ``acts, grads = store``'s, 44a)

    def copied(v: Any) -> Any:
        if id(v) not in memo:
            memo[id(v)] = (v, copy.copy(v))  # (v held: its id is not reused while the snapshot lives)
        return memo[id(v)][1]

    def inner(v: Any) -> list[tuple[Any, ...]]:
        # (the lists, dicts, sets or deques container v holds, two levels below, each with its contents:
        # a dict of per-layer lists a hook appends to, or of per-layer counts, reviews 43a, 43e; a dict of
        # per-layer records, ``{"acts": [...]}``, 43h. Once a container: a dict of every parameter is walked
        # once, not once a hook, and each hook holding it is given one ("inner", v, pieces). A list of over
        # 4,096 items by its length, what is appended to it looked at, not copied: a log of every step's
        # numbers, review 43g; the others copied while _INNER_BUDGET items last: a dict of 5,000 per-module
        # lists is judged whole, review 43h)
        key = ("inner", id(v))
        if key not in memo:
            pieces: list[tuple[Any, ...]] = []
            budget = _INNER_BUDGET

            def below(c: Any, depth: int) -> None:
                nonlocal budget
                for x in list(c.values() if isinstance(c, dict) else c):
                    if len(pieces) >= _INNER_PIECES:
                        return
                    if type(x) not in _CONTAINERS:
                        if isinstance(x, torch.nn.Module):  # (``{"0": RunningMean()}``: review 44c)
                            _hold_module(memo, x)
                        continue
                    if len(x) > _INNER_MOST and isinstance(x, (list, collections.deque)):
                        pieces.append(("length", x, len(x), (x[0], x[-1]) if x else ()))
                    elif len(x) <= budget:
                        budget -= len(x)
                        pieces.append(("contents", x, copied(x)))
                        if depth < 2:
                            below(x, depth + 1)

            if len(v) <= _INNER_BUDGET:
                below(v, 1)
            memo[key] = (v, pieces)
        return memo[key][1]

    def cell_of(obj: Any, name: str) -> _AttrCell:
        key = ("attribute", id(obj), name)
        if key not in memo:
            memo[key] = (obj, _AttrCell(obj, name))
        return memo[key][1]

    def attributes(obj: Any, names: frozenset[str], depth: int = 0, own: bool = False) -> None:
        # (a hook object's, or the object whose method the hook is, or one of the user's classes its code
        # reaches: the attributes its code uses (``names``, its __call__'s if it is called, and those their
        # methods use: _attributes_used), each a cell of its own, one for every hook that holds the object, so
        # that it is judged and given back once; one not there yet too, which a pass may add; an object of the
        # user's classes in one, once. The others, which code the names miss may reach (a helper given self,
        # ``vars(self)``, a callable stored on it: review 43j), held by reference and looked at in O(1),
        # ("loose", ...): what a pass appended or bound there put back where it is a capture, nothing said)
        if isinstance(obj, torch.nn.Module):
            _hold_module(memo, obj)
        if depth > 1 or isinstance(obj, (torch.nn.Module, type, weakref.ProxyTypes)) or _framework_own(obj):
            return
        cls = type(obj)
        if (id(obj), None) in objects:
            return
        objects.add((id(obj), None))
        try:
            used = _state_names(cls, names)
        except Exception:  # (a class that cannot be looked into: every attribute, loosely)
            used = frozenset()
        for name in sorted(used):
            value = cell_of(obj, name).cell_contents
            held(cell_of(obj, name), value)
            if _user_made(value):
                attributes(value, frozenset(used) | _called(value), depth + 1)
            elif callable(value):  # (a callback stored on it: ``Hook(fn)``, review 43l)
                visit(value, depth + 1, False)
        key = ("loose", id(obj), frozenset(used))  # (one list for every hook holding the object: judged once)
        if key not in memo:
            loose = [("loose", cell_of(obj, name), value,
                      ("length", len(value), (value[0], value[-1]) if value else ())
                      if type(value) in (list, collections.deque) else ("contents", copied(value))
                      if type(value) in _CONTAINERS and len(value) <= _INNER_MOST else None)
                     for name, value in list(getattr(obj, "__dict__", {}).items()) if name not in used]
            memo[key] = (obj, (loose, [v for _, _, v, _ in loose if isinstance(v, types.FunctionType)]))
        loose, functions = memo[key][1]
        for function in functions:  # (a callable stored on it: ``self.record = ...``)
            visit(function, 1, False)
        if loose:  # (own: the hook itself, whose other attributes' moves are said, 43k's ``tick(self)``)
            kept.append(("inner", obj, loose, "own") if own else ("inner", obj, loose))

    def argument(v: Any, names: frozenset[str], depth: int) -> None:
        # (a value bound to a function: a partial's argument, ``partial(save, store)`` (review 43k), or a
        # default, the loop-binding ``lambda m, i, o, name=name, store=store: ...`` (review 44a: its list
        # kept the check's outputs, silently); ``names``: the attributes the function's code uses)
        if type(v) in _CONTAINERS:
            kept.append(("contents", v, copied(v)))
            if pieces := inner(v):
                kept.append(("inner", v, pieces))
        elif isinstance(v, torch.Tensor) or _fingerprint(v) is not None:  # (one changed in place is said: 44d,
            kept.append(("cell", _Bound(v), v, None))  # ``partial(loss, w=torch.ones(1))`` scaling ``w``)
        elif callable(v):
            visit(v, depth + 1, False)
        if _user_made(v):
            attributes(v, names | _called(v))

    def visit(f: Any, depth: int, hook: bool = True) -> None:
        # (hook: f is the hook, or what it calls as it (a partial's function, a decorator's wrapped
        # one), whose object's attributes are its state; not a callable its closure merely holds)
        if isinstance(f, torch.nn.Module):
            _hold_module(memo, f)
        if isinstance(f, weakref.ProxyTypes) or id(f) in seen or depth > 4 or isinstance(f, (torch.nn.Module, type)):
            return
        seen.add(id(f))
        if isinstance(f, functools.partial):
            names = frozenset().union(*(_reached(function) for function in _method_functions(f.func)))
            for v in (*f.args, *f.keywords.values()):
                argument(v, names, depth)
            visit(f.func, depth + 1, hook)
        elif isinstance(f, types.MethodType):
            if hook or _user_made(f.__self__):  # (or one its closure holds and calls: ``rec = store.rec``, 43k)
                attributes(f.__self__, frozenset([getattr(f.__func__, "__name__", "")]).union(
                    *(_reached(function) for function in _method_functions(f.__func__))))
            visit(f.__func__, depth + 1, hook)
        elif isinstance(f, types.FunctionType):
            for cell in f.__closure__ or ():
                try:
                    value = cell.cell_contents
                except ValueError:  # (a cell not filled yet)
                    continue
                held(cell, value)
                if callable(value):
                    visit(value, depth + 1, False)
                if _user_made(value):  # (``self`` of the method that made the hook: ``self.features[name] = out``)
                    attributes(value, _reached(f) | _called(value))
            if _user_code(f):  # (not a library's: its module state is its own)
                if hook:  # (the hook's own defaults; a helper's mutable default is its memo, review 44c)
                    for value in (*(f.__defaults__ or ()), *(f.__kwdefaults__ or {}).values()):
                        argument(value, _reached(f), depth)
                    for name in [n for n in vars(f) if not n.startswith("__")]:  # (its own attributes, ``loss.calls
                        held(cell_of(f, name), vars(f)[name])  # += 1``: review 44e)
                for name in sorted(_names_used(f.__code__)[0]):  # (the tutorials' ``activation = {}``: 43h)
                    value = f.__globals__.get(name, _GONE)
                    if isinstance(value, torch.nn.Module):
                        _hold_module(memo, value)
                    if value is _GONE and name in vars(builtins) or isinstance(
                            value, (types.ModuleType, type, torch.nn.Module)):
                        continue  # (one not there yet is held too: a pass may make it)
                    if isinstance(value, (types.FunctionType, types.MethodType)):  # (a helper it calls: ``record(out)``)
                        visit(value, depth + 1, False)
                    elif not callable(value) or _user_made(value):
                        key = ("global", id(f.__globals__), name)
                        if key not in memo:
                            memo[key] = (f.__globals__, _GlobalCell(f.__globals__, name))
                        held(memo[key][1], value)
                        if _user_made(value):
                            attributes(value, _reached(f) | _called(value))
            if (wrapped := getattr(f, "__wrapped__", None)) is not None:
                visit(wrapped, depth + 1, hook)
        elif hook and not isinstance(f, types.BuiltinFunctionType):
            attributes(f, frozenset({"__call__"}), own=True)  # (a hook object: what its __call__ uses, and more)

    try:
        visit(hook, 0)
    except Exception:  # (a value that cannot be looked at: what was read is kept)
        pass
    return kept


def _state_back(kept: list[tuple[Any, ...]], done: set[int]) -> None:
    """What :func:`_hook_state` kept, put back: each cell's value, and each container's contents,
    in place, once (``done``: the containers given back already, by identity; review 42d: one
    dict every hook shares was refilled once a hook)."""
    for kind, target, *rest in kept:
        if kind == "inner":  # (the containers below a container: :func:`_hook_state`)
            _state_back(rest[0], done)
            continue
        if kind == "loose":
            value, look = rest
            if target.cell_contents is not value:
                target.cell_contents = value
            elif look is not None:
                _state_back([(look[0], value, *look[1:])], done)
            continue
        if kind == "length":
            if id(target) not in done and len(target) > rest[0]:
                done.add(id(target))
                for _ in range(len(target) - rest[0]):
                    target.pop()
            continue
        if kind == "cell":
            value, contents = rest
            if target.cell_contents is not value:
                target.cell_contents = value
        else:
            value, contents = target, rest[0]
        if contents is not None and id(value) not in done:
            done.add(id(value))
            _contents_back(value, contents)


def _contents_back(v: Any, contents: Any) -> None:
    """A list, dict, set or deque ``v`` given back ``contents`` (its shallow copy) in place: whoever
    else holds it sees them put back too."""
    if isinstance(v, list):
        v[:] = contents
    elif isinstance(v, collections.deque):
        v.clear()
        v.extend(contents)
    else:
        v.clear()
        v.update(contents)


def _put_attributes_back(kept: list[_Kept], passes: int | None = None, trained: frozenset[int] = frozenset(),
                         outside: bool = False) -> tuple[dict[Any, int], list[str]] | None:
    """Each module's attributes in ``kept`` (:func:`_kept_module`'s snapshots) as they were: one
    replaced put back (the same object, whatever its type: a counter, an LSTM's hidden tuple, a
    dict; review 40o), one added since taken out, a list, dict or set changed in place given its
    contents back (one level: a tensor in it changed in place stays changed), and the hooks the
    block registered on the module removed. A helper a first forward makes (a hook
    registered, its handle kept in ``self.handle``, ``self.handles`` or behind a ``self._hooked``
    flag: reviews 40n, 40o) is so undone whole, its hook with it, and the run's first forward
    makes it once, as a plain loop's does (put back without its hook taken out, it registered the
    hook twice). A hook ampguard registers for the run (:func:`outlives_passes`: the guard's
    running-statistics keeper, which a pass's forward may register on a BatchNorm added since
    it last looked) is left: taken out, the guard went on believing the layer hooked, and a
    skipped step left its statistics NaN. A name a pass moved into ``_modules``, ``_parameters`` or
    ``_buffers`` (``self.head = nn.Linear(...)``) is left: put back in ``__dict__``, the old value
    would hide it.

    A gradient hook a pass registered on a parameter (``p.register_hook``) stays, and then so does
    everything the pass changed in the model's modules, their attributes and hooks (only buffers,
    gradients, modes and RNGs are put back): whatever records that the hook is there (a set of
    the parameters hooked on the module, on its parent, a flag beside another hook) then agrees
    with it, wherever it is kept. Taken out, a library that records it outside the module lost
    it for good (transformers' tensor-parallel ``ReplicatedWithGradAllReduce``, a dict in its
    hook's closure: the layer's gradients were never all-reduced again, review 41b); kept while
    a record was put back, it was registered again, each gradient halved twice (41a, and 41c
    with the record on the parent). Returned: None when everything was put back, else the
    parameters hooked, each with the most hooks of one function it gained (:func:`_most_of_one`),
    and each module the pass so left changed (``"Type (name, ..., N hooks registered, N taken
    out)"``: its attributes, the hooks its passes registered on it or took out of it)."""
    hooked: dict[Any, int] = {}
    for m, _, hooks, _ in kept:
        hooked.update(_gained_gradient_hooks(m, hooks, passes))
    if hooked:  # (the whole model as the pass left it; its hooks said first: listed cuts the names short)
        seen: set[Any] = set()
        return hooked, [f"{type(m).__name__} ({listed(changed)})" for m, held, hooks, contents in kept
                        if (changed := _changed_hooks(m, hooks, seen) + _changed_attributes(vars(m), held, contents))]
    done: set[int] = set()  # (the hooks' state given back: each piece once)
    left = _captures_back(kept, done, trained, outside)  # (not where a gradient hook stays: a tensor may record it)
    _put_modules_back(kept, done, left)
    return None


def _put_modules_back(kept: list[_Kept], done: set[int], left: set[int] = frozenset()) -> None:
    """:func:`_put_attributes_back`'s work when the block registered no gradient hook: each module's
    hooks taken out, its attributes and their contents put back (``done``: the hooks' state
    given back already, each piece once), but the contents of a container a hook's state left in
    place holds (``left``: :func:`_captures_back`'s)."""
    for m, held, hooks, contents in kept:
        _hooks_put_back(m, hooks, done)
        now = vars(m)
        for k in [k for k in now if k not in held and k not in _MODULES_OWN]:  # (added since: taken out)
            del now[k]
        for k, v in held.items():
            if k in m._modules or k in m._parameters or k in m._buffers:
                continue
            if now.get(k, _GONE) is not v:
                now[k] = v
            if k in contents and id(v) not in left:  # (in place: whoever else holds it sees them put back too)
                _contents_back(v, contents[k])


def _gained_gradient_hooks(m: torch.nn.Module, hooks: _Hooks, passes: int | None = None) -> dict[Any, int]:
    """Module ``m``'s own parameters on which the block registered gradient hooks, each with the
    most hooks of one function it gained (``hooks``: :func:`_kept_hooks`' snapshot;
    :func:`_most_of_one`)."""
    gained: dict[Any, list[Any]] = {}
    for owner, name, before, _ in hooks:
        if owner is not m:
            gained.setdefault(owner, []).extend(h for k, h in (getattr(owner, name, None) or {}).items()
                                                if k not in before)
    return {p: _most_of_one(new, passes) for p, new in gained.items() if new}


def _most_of_one(hooks: list[Any], passes: int | None = None) -> int:
    """The most of ``hooks`` that are one hook registered again: one function (its code, through
    a ``functools.partial`` and the functions a decorator wraps) with the same state (its closure's,
    a partial's arguments, its object's attributes; :func:`_hook_key`). 1 where each is another (a
    gradient hook and a post-accumulate one registered once: review 42a; ``scaled(0.5)`` and
    ``scaled(2)``, two objects' methods: 42b, 42c), more where one was registered again (a lambda or
    ``Clip(1.0).apply`` at every forward: a new object each time, the same code and state). Over
    ``passes`` grad-enabled passes (two or more), hooks of one code as many as the passes, or a
    multiple, are one registered at each whatever their state (review 42d: a lambda capturing
    the batch's own bound read as four hooks registered once).

    Example::

        >>> import functools
        >>> def clamp(g, bound=1.0):
        ...     return g.clamp(-bound, bound)
        >>> def scaled(k):
        ...     return lambda g: g * k
        >>> _most_of_one([lambda g: g, print]), _most_of_one([functools.partial(clamp, bound=b) for b in (1, 2)])
        (1, 1)
        >>> _most_of_one([scaled(0.5), scaled(2)]), _most_of_one([scaled(2) for _ in range(3)])
        (1, 3)
    """
    keys = []
    for hook in hooks:
        try:
            key = _hook_key(hook, 0)
            hash(key)
        except Exception:  # (a value that cannot be hashed or read: the hook by itself)
            key = ("hook", id(hook))
        keys.append(key)
    if passes and passes > 1:  # (one code at each pass: piled up, whatever each captured)
        codes = collections.Counter(_code_of(key) for key in keys)
        if piled := [n for n in codes.values() if n >= passes and n % passes == 0]:
            return max(piled)
    return max(collections.Counter(keys).values(), default=0)


def _code_of(key: Any) -> Any:
    """The innermost code of a :func:`_hook_key` (through a partial's function and a method's):
    what one hook registered at each pass shares whatever each captured (review 42e: a partial
    registered at each pass read as registered once)."""
    while isinstance(key, tuple) and key and key[0] in ("partial", "method"):
        key = key[1]
    if isinstance(key, tuple) and key and key[0] in ("function", "object"):
        return key[:2]
    return key


def _hook_key(hook: Any, depth: int) -> Any:
    """What tells ``hook`` from another (:func:`_most_of_one`): its code and its state, each value
    by what a hook registered again would share with the first: a model's module or parameter by
    identity, a number, string or tuple of them by value, a function by its own key, anything else
    (a list, a handle, a batch's tensor: made anew at each registration) by its type."""
    def plain(v: Any) -> Any:
        if isinstance(v, (torch.nn.Module, torch.nn.Parameter)):
            return "object", id(v)
        if v is None or isinstance(v, (bool, int, float, complex, str, bytes)):
            return v
        if isinstance(v, tuple):
            return tuple(plain(x) for x in v)
        if callable(v) and not isinstance(v, type) and depth < 4:
            return _hook_key(v, depth + 1)
        return type(v)

    def attributes(obj: Any) -> Any:
        if isinstance(obj, torch.nn.Module) or not isinstance(getattr(obj, "__dict__", None), dict):
            return "object", id(obj)
        return tuple(sorted((k, plain(v)) for k, v in vars(obj).items()))

    if isinstance(hook, functools.partial):
        return ("partial", _hook_key(hook.func, depth + 1), tuple(plain(a) for a in hook.args),
                tuple(sorted((k, plain(v)) for k, v in hook.keywords.items())))
    if isinstance(hook, types.MethodType):
        return "method", _hook_key(hook.__func__, depth + 1), attributes(hook.__self__)
    if isinstance(hook, types.FunctionType):
        cells = []
        for cell in hook.__closure__ or ():
            try:
                cells.append(plain(cell.cell_contents))
            except ValueError:  # (a cell not filled yet)
                cells.append(None)
        return "function", hook.__code__, tuple(cells)
    if isinstance(hook, types.BuiltinFunctionType) or not isinstance(getattr(hook, "__dict__", None), dict):
        return hook  # (a builtin, a method descriptor: itself)
    return "object", type(hook), attributes(hook)


def _changed_hooks(m: torch.nn.Module, hooks: _Hooks, seen: set[Any]) -> list[str]:
    """How the block changed module ``m``'s own hook dicts and its parameters' (``hooks``:
    :func:`_kept_hooks`' snapshot): ``["N hooks registered", "N taken out", "N gradient hooks
    taken out"]``, each when there are any (the flag dicts, with-kwargs and always-called, not
    counted: they pair with an entry of another; gradient hooks registered are said apart, by
    parameter: :func:`_gained_gradient_hooks`). ``seen``: the parameters counted already, under
    another module (a tied one is counted once: review 42c)."""
    registered = taken = gradients = 0
    for owner, name, before, _ in hooks:
        now = getattr(owner, name, None) or {}
        if owner is not m:
            if (id(owner), name) not in seen:
                seen.add((id(owner), name))
                gradients += sum(k not in now for k in before)
        elif not name.endswith(("_with_kwargs", "_always_called")):
            registered += sum(k not in before and not _outlives(h) for k, h in now.items())
            taken += sum(k not in now for k in before)
    return ([f"{counted(registered, 'hook')} registered"] if registered else []) + \
        ([f"{counted(taken, 'hook')} taken out"] if taken else []) + \
        ([f"{counted(gradients, 'gradient hook')} taken out"] if gradients else [])


def _hooks_put_back(m: torch.nn.Module, hooks: _Hooks, done: set[int]) -> None:
    """Module ``m``'s own hook dicts and its parameters' as they were (``hooks``:
    :func:`_kept_hooks`' snapshot), in place and in their order: the hooks the block registered
    taken out, but those marked :func:`outlives_passes` (their flags stay with them: the
    with-kwargs and always-called dicts hold True under the handle's id), and those it took out
    put back (a hook that removes itself after its first call: its handle, kept where the model
    keeps it, still removes it), with the state it kept (:func:`_hook_state`). Those left in place
    keep what the block did to their state (it may record a registration the put-back does not
    undo, or be the caller's log: review 42d; a count and a flag beside it cannot be told from
    such a record: 42e), said by :func:`untouched` (:func:`_hooks_state_moved`), but what a pass
    captured there (:func:`_captures_back`, before). ``done``: the containers given back already
    (each once).
    A lasting hook the block took out and registered again under a new handle is kept once,
    under its old one (42c: it ran twice)."""
    lasting = {k for owner, name, before, _ in hooks if owner is m
               for k, hook in (getattr(m, name, None) or {}).items() if k not in before and _outlives(hook)}
    for owner, name, before, states in hooks:
        registered = getattr(owner, name, None)
        if not isinstance(registered, dict):  # (a parameter's, None: none registered since)
            continue
        for k in before:  # (one taken out: put back with its state; one left in place: left, said in a warning)
            if k not in registered:
                _state_back(states[k], done)
        again = {id(h) for h in before.values()}
        wanted = [*before.items(), *((k, h) for k, h in registered.items()
                                     if k not in before and k in lasting and (isinstance(h, bool) or id(h) not in again))]
        if list(registered.items()) != wanted:
            registered.clear()
            registered.update(wanted)


def _changed_attributes(now: dict[str, Any], held: dict[str, Any], contents: dict[str, Any]) -> list[str]:
    """The names of the attributes in ``now`` (a module's ``__dict__``) that differ from the
    snapshot ``held`` (by reference) and ``contents`` (its containers' contents, by reference):
    added, taken out, replaced, or a container changed in place."""
    def same(a: Any, b: Any) -> bool:
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(a[k] is b[k] for k in a)
        if isinstance(a, set):
            return len(a) == len(b) and all(x in b for x in a)
        return len(a) == len(b) and all(x is y for x, y in zip(a, b))

    names = [k for k in now if k not in held and k not in _MODULES_OWN]
    names += [k for k, v in held.items() if now.get(k, _GONE) is not v or (k in contents and not same(v, contents[k]))]
    return names


_OUTLIVES = "_ampguard_outlives_passes"


def outlives_passes(hook: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``hook``, a function ampguard registers on a user's module for the whole run, as one
    :func:`untouched` and :class:`BufferSnapshot` leave in place when a pass registered it (they
    take out every other hook a pass registered). A decorator; returns ``hook``.

    Example::

        >>> @outlives_passes
        ... def noted(module, args):
        ...     pass
        >>> model = torch.nn.Linear(2, 1)
        >>> with untouched(model):
        ...     kept = model.register_forward_pre_hook(noted)
        ...     gone = model.register_forward_pre_hook(lambda module, args: None)
        >>> kept.id in model._forward_pre_hooks, gone.id in model._forward_pre_hooks
        (True, False)
    """
    setattr(hook, _OUTLIVES, True)
    return hook


def _outlives(hook: Any) -> bool:
    """Whether ``hook`` (a hook dict's value: a function, or torch's wrapper of one) is marked by
    :func:`outlives_passes`."""
    return getattr(hook, _OUTLIVES, False) or getattr(getattr(hook, "func", None), _OUTLIVES, False)


_TENSOR_HOOK_DICTS = ("_backward_hooks", "_post_accumulate_grad_hooks")
"""A parameter's own hook dicts (``register_hook``, ``register_post_accumulate_grad_hook``), by
handle id, None until its first hook: one a pass registered keeps its module as the pass left it
(:func:`_put_attributes_back`)."""

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")
"""A module's own hook dicts of its passes (by handle id): those registered while a snapshot was
held are taken out when it is put back (:func:`_put_attributes_back`). Not its state-dict hooks:
no pass needs them made again, and FSDP2 registers its ``to_sharded`` ones at the root's first
forward, recording that it did on its parameter group: taken out, ``state_dict()`` gave plain
tensors, not DTensors, for good (review 41b)."""

def _overlaps(b: torch.Tensor) -> bool:
    """Whether tensor ``b`` has internal overlap (an expanded view, stride 0): no in-place write
    can go into it (``copy_`` refuses), so it is never copied back."""
    try:
        return torch._debug_has_internal_overlap(b) == 1
    except (RuntimeError, AttributeError, NotImplementedError):  # (a tensor without strides: take it as none)
        return False

_MODULES_OWN = frozenset(vars(torch.nn.Module()))
"""The attributes every ``nn.Module`` has (``training``, ``_parameters``, ``_buffers``, the hook
dicts): torch's, not a module's own state."""


def _version(p: torch.Tensor) -> int | None:
    """A tensor's version counter (bumped by each in-place change); None for an inference tensor."""
    try:
        return p._version
    except RuntimeError:  # (inference tensors keep no version)
        return None


def _memory(t: torch.Tensor) -> int | None:
    """The address of the storage tensor ``t`` views (every view of a buffer shares its storage, and
    its version counter); None for a tensor without one, or with an empty one (every empty
    storage's address is 0: review 41c)."""
    try:
        storage = t.untyped_storage()
        return storage.data_ptr() or None if storage.nbytes() else None
    except (RuntimeError, NotImplementedError, ValueError):  # (ValueError: a lazy module's, not made yet)
        return None


_Place = tuple[Any, int, torch.Size, tuple[int, ...], torch.dtype, int]
"""Where a buffer's values lie and how they read (:func:`_place`)."""


def _place(t: torch.Tensor) -> _Place | None:
    """Where tensor ``t``'s values lie and how they read: its storage, offset, size, strides and
    dtype (what ``Tensor.set_`` takes back), and the storage's bytes (a forward may free them:
    ``untyped_storage().resize_(0)``); None for a tensor whose storage cannot be read (a wrapper
    subclass: a DTensor's, review 41f), whose values are only copied back."""
    try:
        storage = t.untyped_storage()
        storage.data_ptr()
        return storage, t.storage_offset(), t.size(), t.stride(), t.dtype, storage.nbytes()
    except (RuntimeError, NotImplementedError, ValueError):
        return None


def _set_back(b: torch.Tensor, place: _Place | None, saved: torch.Tensor) -> None:
    """Buffer ``b`` where :func:`_place` found it (``place``), the same object, its values
    ``saved`` copied in: a storage a forward shrank or freed given its bytes back (copied into, the
    process crashed: review 41e), a buffer a forward gave another storage, layout, dtype or device
    (``self.table.data = ...to(x.dtype)``) set back to its own (its new dtype read the old storage
    with another item size: 41e; ``set_`` refuses another device's storage: 41f)."""
    with torch.inference_mode() if b.is_inference() else contextlib.nullcontext():
        if place is not None:
            storage, offset, size, stride, dtype, nbytes = place
            if storage.nbytes() < nbytes:
                storage.resize_(nbytes)
            if b.dtype != dtype or b.device != saved.device:
                b.data = torch.empty(0, dtype=dtype, device=saved.device).set_(storage, offset, size, stride)
            elif (b.storage_offset(), b.size(), b.stride()) != (offset, size, stride) or \
                    b.untyped_storage().data_ptr() != storage.data_ptr():  # (the same object, where it was)
                b.set_(storage, offset, size, stride)
        b.copy_(saved)


def _storage(p: torch.Tensor) -> int | None:
    """Where a tensor's values are (``p.data = ...`` moves them, bumping no version); None if unknown."""
    try:
        return p.data_ptr()
    except (RuntimeError, NotImplementedError):  # (a tensor without storage: a DTensor's, a fake one)
        return None


_ROW = 1023
"""The width of the table of 32-bit words a :func:`_checksum` sums by rows and by columns: odd, so
that a change of 2**31 in every word of a row (the sign bit of each fp32 value flipped, a weight
negated) moves its sum by 2**31, not by a multiple of 2**32."""

_CHUNK = 4096
"""The rows of that table :func:`_checksum` mixes at a time: its one temporary, 16 MiB."""


def _checksum(p: torch.Tensor) -> torch.Tensor | None:
    """A checksum of a tensor's bits, on its device (no host sync): its values' bytes read as
    32-bit words, laid out in rows of :data:`_ROW`, each word ``w`` mixed into ``w ^ (w << 16)``
    (a bijection that is not additive) and summed by row and by column (int32, modulo 2**32:
    exact, and the same in any order of summation, on any device), the words past the last whole
    row and the bytes past the last whole word as they are. A change of any one word changes its
    row's sum; two values swapped change two rows' or two columns' sums; a structured change
    whose plain sums would cancel (a weight negated: each word moved by 2**31; a rectangle of
    ``+d`` and ``-d`` in two rows and two columns) moves the mixed sums of an odd row (one that
    leaves them all as they were can be made on purpose, hardly by chance). One read of the
    tensor and one temporary of :data:`_CHUNK` rows (a tensor that is not contiguous, or whose
    bytes start off a word, is copied), about a thousandth of its size kept. None where it
    cannot be taken (a tensor without storage, a lazy module's parameter not made yet).

    Example::

        >>> w = torch.randn(3, 700)
        >>> torch.equal(_checksum(w), _checksum(w.clone())), torch.equal(_checksum(w), _checksum(w.flip(1)))
        (True, False)
        >>> v = w.clone(); v[1, 2] = torch.nextafter(v[1, 2], torch.tensor(1e9))  # one ulp
        >>> torch.equal(_checksum(w), _checksum(v)), _checksum(torch.ones(3, dtype=torch.bfloat16)).tolist()
        (False, [1065369472, 128, 63])
        >>> w = torch.randn(2, 1024)
        >>> torch.equal(_checksum(w), _checksum(-w))  # (every word moved by 2**31)
        False
    """
    try:
        t = p.detach()
        t = t.to_local() if hasattr(t, "to_local") else t  # (a DTensor: this rank's shard)
        if t.is_meta:  # (no values)
            return None
        data = t.reshape(-1).view(torch.uint8)
        whole = data.numel() // 4 * 4
        try:
            words = data[:whole].view(torch.int32)
        except RuntimeError:  # (bytes that start off a word: a view into a buffer of 16-bit values)
            words = data[:whole].clone().view(torch.int32)
        rows = words.numel() // _ROW
        parts = []
        if rows:
            table = words[:rows * _ROW].view(rows, _ROW)
            chunk = _CHUNK
            mixed = torch.empty(min(rows, chunk), _ROW, dtype=torch.int32, device=words.device)
            by_row, by_column = [], torch.zeros(_ROW, dtype=torch.int32, device=words.device)
            for start in range(0, rows, chunk):
                part = table[start:start + chunk]
                into = mixed[:len(part)]
                torch.bitwise_left_shift(part, 16, out=into)
                into ^= part
                by_row.append(into.sum(1, dtype=torch.int32))
                by_column += into.sum(0, dtype=torch.int32)
            parts += [torch.cat(by_row), by_column]
        return torch.cat(parts + [words[rows * _ROW:], data[whole:].to(torch.int32)])
    except (RuntimeError, TypeError, ValueError, NotImplementedError):  # (a tensor without storage; ValueError: a
        return None                                                      # lazy module's parameter not made yet)


def _changed(p: torch.Tensor, before: torch.Tensor | None, version: tuple[Any, ...] | None) -> bool:
    """Whether parameter ``p`` changed since :func:`untouched` took its checksum ``before`` and its
    version counter, storage, shape and dtype (``version``): another shape or dtype is a change
    whatever the bytes (``p.data = torch.zeros(2, 8)`` for a 4 x 4 of zeros); else the checksum
    judges, or, when none could be taken, the version counter and the storage."""
    if version is None or (p.shape, p.dtype) != version[2:]:
        return True
    if before is not None:
        after = _checksum(p)
        if after is not None:
            return not torch.equal(after, before)
    return (_version(p), _storage(p)) != version[:2]
