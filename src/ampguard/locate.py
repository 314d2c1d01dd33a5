"""Where was this NaN born? The first non-finite value of a batch, in execution order.

Forward hooks on every module and gradient hooks on every parameter watch one forward and
backward pass of the batch (under the run's autocast and loss scale, each micro-batch's loss
divided by the accumulation steps as the step does); the first place a non-finite value shows up
is the finding: the input, a module's output (qualified name, type, input and output dtypes), a
module's own code between its submodules (a functional or in-place op), the loss (or the targets
it was given), or a parameter's gradient in backward. The batch is then replayed in FP32 (no
autocast, no loss scale), from the same RNG state and the same buffers (dropout draws the same
masks in every pass, and a buffer the forward updates reads as the first pass saw it):
finite there means a precision-range problem;
non-finite there too means the data or the model. For a precision-range problem the batch is then
replayed with autocast disabled around the first offending module alone (its floating inputs cast
to FP32), then around its parent, and so on up to the model: the smallest module whose FP32 run
makes the whole batch finite is the answer a user can act on ("keeping ``blocks.3.mlp`` in FP32
fixes this batch").

Diagnostics only: the training step never imports this. Parameters are not changed; their
gradients, the module buffers and the RNG states are restored afterwards.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager, nullcontext, redirect_stdout
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from .errors import AmpguardWarning, InputError, brief, counted, user_code, whole_number, warn
from .precision import DEFAULT_MIN_SCALE, MAX_SCALE, Precision, finite_number, fp32_forward, round_float32


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors inside ``value`` (nested lists, tuples, dicts), in order; also inside the
    containers torch's pytree does not know: a dataclass's fields (one never set is skipped), a
    mapping's values (a ``transformers`` ``BatchEncoding``), each container once (one that holds
    itself is not read again).

    Example::

        >>> @dataclasses.dataclass
        ... class Batch:
        ...     x: torch.Tensor
        ...     extra: dict
        ...     parent: object = None
        >>> batch = Batch(torch.ones(1), {"m": torch.zeros(2)})
        >>> batch.parent = batch
        >>> [t.tolist() for t in _tensors((batch, "text"))]
        [[1.0], [0.0, 0.0]]
    """
    return _tensors_in(value, set())


def _tensors_in(value: Any, seen: set[int]) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for leaf in tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif id(leaf) in seen:
            continue
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            seen.add(id(leaf))
            found += _tensors_in([getattr(leaf, f.name, None) for f in dataclasses.fields(leaf)], seen)
        elif isinstance(leaf, Mapping):
            seen.add(id(leaf))
            found += _tensors_in(list(leaf.values()), seen)
    return found


def _floats(value: Any) -> list[torch.Tensor]:
    """The floating (and complex) tensors of ``value``, detached; a sparse one by its values."""
    out = []
    for t in _tensors(value):
        if (t.is_floating_point() or t.is_complex()) and not t.is_nested and t.layout in (torch.strided,
                                                                                          torch.sparse_coo):
            t = t.detach()  # (a CSR or nested side output is left out: isfinite takes neither)
            out.append(t.coalesce().values() if t.is_sparse else t)
    return out


NAN, POS_INF, NEG_INF = 1, 2, 3
"""The codes of :func:`_bad_at`'s ``where``: 0 for a finite element, then its non-finite kind
(a complex infinity is ``POS_INF``)."""


def _codes(t: torch.Tensor) -> torch.Tensor:
    """Each element's code (:data:`NAN`, ...), flattened, as int8 on ``t``'s device; float8 read
    through float32 (its own comparisons are not all there)."""
    t = t.float() if t.element_size() == 1 else t
    nan, inf = torch.isnan(t), torch.isinf(t)
    if t.is_complex():
        return (nan.to(torch.int8) * NAN + (inf & ~nan).to(torch.int8) * POS_INF).reshape(-1)
    return (nan.to(torch.int8) * NAN + (inf & (t > 0)).to(torch.int8) * POS_INF
            + (inf & (t < 0)).to(torch.int8) * NEG_INF).reshape(-1)


def _bad_at(value: Any, known: torch.Tensor | None = None) -> tuple[str | None, torch.Tensor | None]:
    """``(kind, where)``: ``where`` holds each element's code (:data:`NAN`, :data:`POS_INF`,
    :data:`NEG_INF`, 0 when finite) over ``value``'s floating tensors, flattened in order (None
    when all are finite); ``kind`` is ``"nan"`` or ``"inf"`` for the non-finite elements whose
    code differs from ``known``'s (what another pass had at the same place: a NaN where it had
    ``-inf`` is new), None when there are none.

    Example::

        >>> kind, where = _bad_at([torch.tensor([1.0, -math.inf]), torch.tensor([math.nan])])
        >>> kind, where.tolist()
        ('nan', [0, 3, 1])
        >>> _bad_at(torch.tensor([1.0, -math.inf]), known=torch.tensor([0, NEG_INF]))[0]  # (known: not new)
        >>> _bad_at(torch.tensor([math.inf, -math.inf]), known=torch.tensor([0, NEG_INF]))[0]
        'inf'
        >>> _bad_at(torch.tensor([1.0, math.nan]), known=torch.tensor([0, NEG_INF]))[0]  # (-inf there before)
        'nan'
    """
    floats = _floats(value)
    if all(bool(torch.isfinite(t).all()) for t in floats):  # (one reduction a tensor: the codes only for a bad one)
        return None, None
    device = floats[0].device
    where = torch.cat([_codes(t).to(device) for t in floats])
    bad = where != 0
    if not bool(bad.any()):
        return None, None
    new = bad if known is None or known.shape != where.shape else bad & (where != known.to(device))
    if not bool(new.any()):
        return None, where
    return ("nan" if bool((new & (where == NAN)).any()) else "inf"), where


def _bad(value: Any) -> str | None:
    """'nan', 'inf' or None: the first non-finite kind in any floating tensor of ``value``.

    Example::

        >>> _bad(torch.ones(2)), _bad([torch.ones(1), torch.tensor([math.inf, math.nan])])
        (None, 'nan')
    """
    return _bad_at(value)[0]


@dataclass
class _Seen:
    """Where one pass saw non-finite values, element by element: ``at`` by place (``input``, and
    for each module call in order, ``in:<name>#<n>`` its first input as it came in and
    ``out:<name>#<n>`` its output), the places whose non-finite values were all ``-inf``
    (``minus_inf``: what a mask looks like), and the place of the pass's finding (``first``).
    With ``every`` False only the finding's place is kept (what :meth:`also_in` reads). Places
    are kept on the host: a diagnosis holds no device memory for them (a NaN that flows through
    a deep model is non-finite at every place).

    Example::

        >>> seen = _Seen()
        >>> seen.note("out:mask#1", _bad_at(torch.tensor([-math.inf, 0.0]))[1])
        >>> seen.note("out:fc#1", _bad_at(torch.tensor([-math.inf, -math.inf]))[1])  # (all of it: an overflow)
        >>> seen.at["out:mask#1"].tolist(), seen.minus_inf
        ([3, 0], {'out:mask#1'})
    """

    at: dict[str, torch.Tensor] = field(default_factory=dict)
    first: str | None = None
    every: bool = True
    minus_inf: set[str] = field(default_factory=set)

    def note(self, place: str, where: torch.Tensor | None, first: bool = False) -> None:
        """Keep ``where`` (:func:`_bad_at`'s codes) for ``place``: every place, or the finding's.
        A place counts as a mask (``minus_inf``) when its non-finite elements are all ``-inf`` and
        some are finite (a mask that hides everything is no mask: an overflow of a whole output)."""
        if where is None or not (self.every or first):
            return
        self.at[place] = where = where.cpu()
        bad = where != 0
        if bool((where[bad] == NEG_INF).all()) and not bool(bad.all()):
            self.minus_inf.add(place)
        if first:
            self.first = place

    def masks(self) -> _Seen:
        """The places whose non-finite values were all ``-inf`` alone: masks the model writes or
        takes (a causal mask, logits of actions not allowed, an additive mask in the batch)."""
        return _Seen({k: v for k, v in self.at.items() if k in self.minus_inf})

    def also_in(self, other: _Seen) -> bool:
        """Whether every non-finite value at this pass's finding was non-finite at the same place
        in ``other`` too (a mask the model writes, a NaN it masks out: in FP32 as well).

        Example::

            >>> amp, fp32 = _Seen({"out:mask#1": torch.tensor([NEG_INF, 0])}, "out:mask#1"), _Seen()
            >>> amp.also_in(fp32), amp.also_in(_Seen({"out:mask#1": torch.tensor([NEG_INF, NEG_INF])}))
            (False, True)
            >>> amp.also_in(_Seen({"out:mask#1": torch.tensor([NAN, 0])}))  # (another kind there)
            False
        """
        mine, theirs = self.at.get(self.first or ""), other.at.get(self.first or "")
        return (mine is not None and theirs is not None and mine.shape == theirs.shape
                and not bool(((mine != 0) & (mine != theirs)).any()))


def _dtypes(value: Any) -> list[str]:
    return [str(t.dtype).removeprefix("torch.") for t in _tensors(value)]


@dataclass
class Finding:
    """The first non-finite value of one pass, or ``where == "none"``.

    Example::

        >>> f = Finding("forward", "0", "Linear", "inf", ["float16"], ["float16"], "fp16")
        >>> f.where, f.name, f.kind, Finding("none").name
        ('forward', '0', 'inf', '')
    """

    where: str  # input | forward | loss | backward | none
    name: str = ""  # module or parameter qualified name ("" for the inputs and the loss; "targets")
    op: str = ""  # module type, or the loss function's name
    kind: str = ""  # nan | inf
    input_dtypes: list[str] = field(default_factory=list)
    output_dtypes: list[str] = field(default_factory=list)
    precision: str = ""
    before: str = ""
    """For a value born in module ``name``'s own code (a functional or in-place op between its
    submodules): the submodule it was passed to, whose output it made non-finite."""
    loss: float | None = None
    """With ``where == "none"``: the (finite) loss of the pass (of a group, the micro-batches'
    mean, the step's loss): a loss spike's evidence replays finite, and this says how large. With
    ``where == "backward"``: the finite loss whose backward overflowed (this micro-batch's)."""
    absorbed: str = ""
    """With ``where == "none"``: the first non-finite value of a pass whose loss and gradients all
    ended finite (a NaN the model masks out, a ``-inf`` mask), said, not a finding."""
    call: int = 1
    """With ``where == "forward"``: which call of module ``name`` in the pass (1: the first; a
    module the forward calls more than once, a shared or weight-tied block, is named with the call
    that made the value: "(its call 2)")."""
    grad: str = ""
    """With ``where == "backward"``, which gradient: ``""`` parameter ``name``'s; ``"input"`` the
    gradient module ``name``'s backward passed to its input (from a finite gradient of its output;
    ``also``: further modules reading that input, their gradients summed; ``before``: the module
    whose output that input is, if one); ``"code"`` the gradient
    of module ``before``'s output, made by the backward of module ``name``'s own code that reads
    it (between its submodules), or, with ``also`` (the modules that read it, each one's own input
    gradient finite), by their sum; ``"loss"`` the gradient of the model's output, made by the
    loss's backward (``op``: the loss)."""
    also: list[str] = field(default_factory=list)
    micro_batch: int = 0
    """Of an accumulated step (:func:`diagnose_group`): which micro-batch (1-based) holds the
    value, of ``micro_batches``; 0: a single pass."""
    micro_batches: int = 0

    def place_text(self) -> str:
        """Where the value was, in words (the middle of :meth:`Diagnosis.message`).

        Example::

            >>> Finding("forward", "0", "Linear", "inf", ["float16"], ["float16"], "fp16").place_text()
            'in the forward output of 0 (Linear; inputs float16 -> outputs float16)'
            >>> Finding("forward", "l", "Linear", "inf", ["float16"], ["float16"], "fp16", call=2).place_text()
            'in the forward output of l (its call 2) (Linear; inputs float16 -> outputs float16)'
            >>> Finding("backward", "", NORM, "inf", precision="fp32", loss=2.0).place_text()
            'in backward, the global L2 norm of the gradients (float32; every gradient finite), from a finite loss 2'
        """
        dtypes = f"{','.join(self.input_dtypes) or '-'} -> outputs {','.join(self.output_dtypes) or '-'}"
        name = self.name or "<model>"
        call = f" (its call {self.call})" if self.call > 1 else ""
        if self.where == "input":
            return "in the batch's targets" if self.name == "targets" else "in the input batch"
        if self.where == "forward" and self.before:
            return f"in the forward code of {name} itself{call} ({self.op}; inputs {dtypes}), before it calls {self.before}"
        if self.where == "forward":
            return f"in the forward output of {name}{call} ({self.op}; inputs {dtypes})"
        if self.where == "loss":
            return f"in the loss ({self.op})"
        finite = f", from a finite loss {self.loss:.4g}" if self.loss is not None else ""
        if self.grad == "input":
            readers = ", ".join([name, *self.also])
            summed, its = (" (their input gradients summed)", "their") if self.also else ("", "its")
            return (f"in backward, the input gradient of {readers} ({self.op}){summed}, made by {its} backward from a "
                    f"finite gradient of its output{finite}")
        if self.grad == "code":
            value = f"the output of {self.before}" if self.before else f"a value the forward code of {name} makes"
            if self.also:  # (each reader's own input gradient finite: their sum, a residual's, or the code's)
                return (f"in backward, the gradient of {value}, summed from what reads it ({', '.join(self.also)}, "
                        f"each one's own input gradient finite, and any code of {name} ({self.op}) that reads it "
                        f"too){finite}")
            return (f"in backward, the gradient of {value}, made by the backward of the forward code of {name} itself "
                    f"({self.op}) that reads it{finite}")
        if self.grad == "loss":
            return f"in backward, the gradient of the model's output, made by the loss's backward ({self.op}){finite}"
        if not self.name:  # (every gradient finite, their norm not: the step's detector overflowed)
            return f"in backward, the {self.op}{finite}"
        return f"in backward, the gradient of parameter {self.name} ({self.op}){finite}"


@dataclass
class Diagnosis:
    """A finding under the run's precision, the FP32 replay's finding, and what it means.

    Example::

        >>> amp = Finding("loss", op="mse_loss", kind="nan", precision="bf16")
        >>> d = Diagnosis(amp, Finding("loss", op="mse_loss", kind="nan", precision="fp32"), "data/model")
        >>> d.verdict, d.fp32.precision
        ('data/model', 'fp32')
    """

    amp: Finding
    fp32: Finding | None
    verdict: str  # precision-range | data/model | none
    loss_scale: float = 1.0
    """The loss scale the backward ran with under the run's precision (1: none)."""
    fp32_scope: str | None = None
    """The smallest module that, run alone in FP32 (autocast off around it), makes the batch finite
    (with :attr:`fp32_also`: together with those); ``""`` is the whole model; None when no scope
    was tried or none fixed it."""
    fp32_also: list[str] = field(default_factory=list)
    """The further modules kept in FP32 beside :attr:`fp32_scope` for the fix (each one a replay
    with the modules before it kept named, :func:`find_fp32_scope`); empty: it alone."""
    scopes_tried: list[str] = field(default_factory=list)
    """The scopes replayed in FP32, in order (several together as ``a + b``), up to the first that
    fixed the batch."""
    scope_scale: float | None = None
    """The loss scale :attr:`fp32_scope`'s replay was finite at: :attr:`loss_scale`, or the lowest
    the scaler reaches (its floor, or 1) when at the step's own scale only the scaled gradient
    still overflowed, which the scaler answers by halving (:func:`find_fp32_scope`)."""
    injected: list[str] = field(default_factory=list)
    """The faults ``--inject`` put into the replayed step (their specs): what a finding FP32
    shares is then the fault's, not the data's or the model's."""
    bad_weight: str = ""
    """With ``data/model``: the first parameter that was not finite before the step (``"0.weight
    holds nan"``; a checkpoint of a diverged run): the weights' problem, not the batch's."""
    scale_floor: float | None = None
    """The loss scaler's floor (``scaler.min_scale``), when a scaler ran: a backward overflow at
    a scale above it is what the scaler answers (it halves and skips); at it, a range problem."""
    fp8_scales: list[str] = field(default_factory=list)
    """Under fp8: the float8 casts of the micro-batch whose scale broke though their tensor was
    finite (:class:`~ampguard.fp8.BadScale`, ``broken_scale``: a zero amax without torchao's
    floor), in the order they ran: the first is what made the first non-finite value, which the
    trace alone names only as a ``Float8Linear``'s output."""
    amp_range: bool = False
    """With ``data/model``: the AMP pass's first non-finite value is finite in the FP32 replay, whose
    own first non-finite value is elsewhere (:attr:`fp32`): a precision-range value before the
    data or model problem (review 52f: the verdict named the fp16 overflow's module alone)."""
    overflows_unscaled: bool = False
    """With a backward overflow at a loss scale above 1 that FP32 holds: the replay at a loss scale
    of 1, or at the scaler's floor (:attr:`scale_floor`) if that is higher, overflowed too. Halving the scale does not answer it (the scaler would skip step after
    step, down to its floor): a range problem, said as one, not as the scaler's routine back-off."""

    def message(self) -> str:
        """The finding in one sentence: where the first non-finite value was, and whose problem it is.

        Example::

            >>> amp = Finding("forward", "encoder.0", "Linear", "inf", ["float16"], ["float16"], "fp16")
            >>> print(Diagnosis(amp, Finding("none", precision="fp32"), "precision-range").message())
            first inf under fp16: in the forward output of encoder.0 (Linear; inputs float16 -> outputs float16). FP32
            replay is finite: a precision-range problem; run that module outside autocast or in FP32
            >>> Diagnosis(Finding("none", precision="bf16"), None, "none").message()
            'no non-finite value in forward, loss or backward under bf16'
            >>> Diagnosis(Finding("none", precision="bf16", loss=1.872e8), None, "none").message()  # a spike's evidence
            'no non-finite value in forward, loss or backward under bf16 (loss 1.872e+08)'
            >>> Diagnosis(Finding("backward", "weight", "Linear", "inf", precision="bf16"),
            ...           Finding("backward", "weight", "Linear", "inf", precision="fp32"),
            ...           "data/model", injected=["inf_grad@1"]).message()  # (locate --inject: the fault's, said so)
            'first inf under bf16: in backward, the gradient of parameter weight (Linear). FP32 replay is not finite either: the injected inf_grad@1, not a precision problem'
        """
        f = self.amp
        if f.where == "none":
            loss = f" (loss {f.loss:.4g})" if f.loss is not None else ""
            if f.absorbed:
                return (f"no non-finite value in the loss or backward under {f.precision}{loss}; {f.absorbed} did not "
                        "reach them")
            return f"no non-finite value in forward, loss or backward under {f.precision}{loss}"
        place = f.place_text()
        within = f" in micro-batch {f.micro_batch} of {f.micro_batches}" if f.micro_batch else ""  # (its loss: not the step's)
        first = f"first {f.kind} under {f.precision}{within}: {place}"
        if self.fp8_scales:
            first += f"; a float8 scale broke first: {self.fp8_scales[0]}"
        if self.verdict == "precision-range" and f.op.endswith(SUMMED):  # (float32 gradients summed: no dtype of AMP's)
            scaled = f" scaled by {self.loss_scale:g}" if self.loss_scale != 1.0 else ""
            hint = (f"FP32 replay is finite: the micro-batches' gradients{scaled} sum past float32's range"
                    + ("; the loss scaler answers it by halving the scale and skipping the step" if self._backs_off
                       else ""))
        elif self.verdict == "precision-range":
            if f.where != "backward":
                hint = "FP32 replay is finite: a precision-range problem"
            elif self.overflows_unscaled and self.loss_scale != 1.0:  # (halving cannot answer it)
                at = (f"at the scaler's floor {self.scale_floor:g}" if self.scale_floor is not None
                      and self.scale_floor != 1 else "with no loss scale")
                hint = (f"FP32 replay is finite: a precision-range problem (the gradient scaled by {self.loss_scale:g} "
                        f"overflows {f.precision}; it overflows {f.precision} {at} too, so halving the "
                        "scale does not answer it)")
            elif self._backs_off:  # (what the dynamic scaler is for: no module to move to FP32)
                hint = (f"FP32 replay is finite: a precision-range problem (the gradient scaled by "
                        f"{self.loss_scale:g} overflows {f.precision}), which the loss scaler answers by halving the "
                        "scale and skipping the step: routine while it settles; a skip rate that stays up is what "
                        "to watch")
            elif self.scale_floor is not None and self.loss_scale != 1.0 and not self._backs_off:
                hint = (f"FP32 replay is finite: a precision-range problem (the gradient overflows {f.precision} at "
                        f"the loss scaler's floor {self.scale_floor:g}, scaler.min_scale: it cannot halve further)")
            elif self.loss_scale != 1.0:
                hint = (f"FP32 replay is finite: a precision-range problem (the gradient scaled by "
                        f"{self.loss_scale:g} overflows {f.precision})")
            else:
                hint = f"FP32 replay is finite: a precision-range problem (the gradient overflows {f.precision} with no loss scale)"
            if self.injected:  # (a spike FP32 holds: the fault's values, past this precision's range)
                hint += f"; this step carries the injected {', '.join(self.injected)}"
            if not self._backs_off:
                hint += self._scope_hint()
        elif self.verdict == "data/model":
            # FP32's own first place when it is another (review 52f: an fp16 overflow FP32 holds, then a NaN
            # FP32 has too, elsewhere: the verdict sent the user to the module FP32 handles fine)
            other = self.fp32 is not None and self.fp32.where != "none" and _place(self.fp32) != _place(f)
            either = f"FP32 replay is not finite either, first {self.fp32.place_text()}" if other else \
                "FP32 replay is not finite either"
            there = " there" if other else ""
            if self.injected:
                hint = f"{either}: the injected {', '.join(self.injected)}, not a precision problem"
            elif self.bad_weight:
                hint = (f"{either}: the model's parameter {self.bad_weight} before the step (its weights, not the "
                        "batch, not a precision problem)")
            else:
                hint = f"{either}: a data or model problem{there}, not a precision one"
            if other and self.amp_range:
                hint += f"; the {f.precision} {f.kind} named first is finite in FP32: a precision-range problem"
        else:
            hint = ""
        return f"{first}. {hint}".strip()

    @property
    def _backs_off(self) -> bool:
        """A backward overflow at a loss scale the scaler can still halve (above its floor), and
        one that halving answers: finite with no loss scale (:attr:`overflows_unscaled`)."""
        return self.amp.where == "backward" and self.loss_scale != 1.0 and not self.overflows_unscaled and (  # (the scale is a float32: 0.1 is
            self.scale_floor is None or self.loss_scale > round_float32(self.scale_floor))  # 0.10000000149 there)

    def _scope_hint(self) -> str:
        """What the module-alone FP32 replays found, as the end of the message.

        Example::

            >>> d = Diagnosis(Finding("forward", "blocks.3.mlp.fc", "Linear", "inf", precision="fp16"),
            ...               Finding("none"), "precision-range", fp32_scope="blocks.3.mlp",
            ...               scopes_tried=["blocks.3.mlp.fc", "blocks.3.mlp"])
            >>> d._scope_hint()
            '; keeping blocks.3.mlp in FP32 (autocast off around it alone) fixes this batch'
            >>> Diagnosis(d.amp, d.fp32, "precision-range", scopes_tried=["blocks.3.mlp.fc", ""])._scope_hint()
            '; no module in FP32 fixes this batch (tried blocks.3.mlp.fc, <model>); run the whole step in FP32'
            >>> Diagnosis(Finding("forward", "blocks.3", "Block", "inf", precision="fp8"), d.fp32, "precision-range",
            ...           fp32_scope="blocks.3")._scope_hint()  # under fp8 its Linear layers leave float8 too
            '; keeping blocks.3 in FP32 (autocast and float8 off around it alone) fixes this batch'
        """
        lower = self.scope_scale is not None and self.scope_scale != self.loss_scale
        then = (f" at a loss scale the scaler backs off to (finite at {self.scope_scale:g}; scaled by "
                f"{self.loss_scale:g} its gradient still overflows {self.amp.precision}, which the scaler answers by "
                "halving the scale and skipping the step while it settles)") if lower else ""
        if self.fp32_scope == "":
            tried = " or ".join(name for name in self.scopes_tried[:-1] if name)  # (those that did not fix it)
            smaller = f"keeping {tried} in FP32 does not fix it; " if tried else ""
            return (f"; {smaller}the whole model in FP32 (autocast off, the same loss scale) fixes this batch"
                    if not lower else f"; {smaller}the whole model in FP32 (autocast off) fixes this batch{then}")
        if self.fp32_scope is not None and self.fp32_also:
            how = "autocast and float8 off" if self.amp.precision == "fp8" else "autocast off"
            kept = [self.fp32_scope, *self.fp32_also]
            return (f"; keeping {', '.join(kept[:-1])} and {kept[-1]} in FP32 together ({how} around each; fp32_modules="
                    f"[{','.join(kept)}]) fixes this batch{then}")
        if self.fp32_scope is not None:
            how = "autocast and float8 off" if self.amp.precision == "fp8" else "autocast off"
            return f"; keeping {self.fp32_scope} in FP32 ({how} around it alone) fixes this batch{then}"
        if self.scopes_tried:
            tried = ", ".join(name or "<model>" for name in self.scopes_tried)
            return f"; no module in FP32 fixes this batch (tried {tried}); run the whole step in FP32"
        if self.amp.where == "loss" or self.amp.grad == "loss":
            return "; compute the loss in FP32 (on the outputs cast to float32, outside autocast)"
        return "; run that module outside autocast or in FP32"

    def as_dict(self) -> dict[str, Any]:
        """Plain data for JSON (``ampguard locate --json``, the run's event log): verdict, both
        findings, the message.

        Example::

            >>> data = Diagnosis(Finding("input", kind="nan", precision="bf16"),
            ...                  Finding("input", kind="nan", precision="fp32"), "data/model").as_dict()
            >>> data["verdict"], data["amp"]["where"], data["fp32"]["precision"], data["message"][:28]
            ('data/model', 'input', 'fp32', 'first nan under bf16: in the')
        """
        return {"verdict": self.verdict, "amp": asdict(self.amp),
                "fp32": asdict(self.fp32) if self.fp32 else None, "loss_scale": self.loss_scale,
                "fp32_scope": self.fp32_scope, "fp32_also": list(self.fp32_also), "scopes_tried": list(self.scopes_tried),
                "scope_scale": self.scope_scale,
                "injected": list(self.injected),
                "bad_weight": self.bad_weight, "fp8_scales": list(self.fp8_scales),
                "overflows_unscaled": self.overflows_unscaled, "message": self.message()}


def _place(finding: Finding) -> tuple[Any, ...]:
    """Where a finding is, apart from its pass (its precision, dtypes, kind and loss) and its
    micro-batch (the FP32 replay runs the micro-batch AMP's finding names alone, and numbers none:
    the run's first-skip diagnosis named an input NaN's place twice): two passes' findings at the
    same place compare equal."""
    return (finding.where, finding.name, finding.op.partition(";")[0], finding.call, finding.grad, finding.before,
            tuple(finding.also))


def trace_first_non_finite(
    model: nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    inputs: Any,
    targets: Any,
    precision: Precision,
    loss_scale: float = 1.0,
    fp32_module: str | Sequence[str] | None = None,
    accumulation_steps: int = 1,
    seen: _Seen | None = None,
    known: _Seen | None = None,
) -> Finding:
    """One forward + backward of the batch, watching for the first non-finite value.

    The backward is the guarded step's for one micro-batch: ``(loss / accumulation_steps *
    loss_scale).backward()``, as ``scaler.scale(loss / N).backward()``. ``fp32_module`` names a
    module (``""``: the model) that runs with autocast disabled around it alone, its floating
    inputs cast to FP32 (:func:`fp32_around`); the rest keeps ``precision``.

    A module whose output is non-finite while its first input already was as it came in did not
    make the value: the code of the module that called it did, between its submodules (a
    ``torch.exp`` or an in-place op in its ``forward``); the finding names that caller, ``before``
    the module, or the caller's caller when the caller's own first input came in non-finite too (a
    ``Sequential`` passes on what it was given). The first input is the first tensor argument, a
    keyword one when none is positional (``self.b(input=t)``), judged as the module is entered (an
    in-place op of the module's own writes over it). (Only the first input counts: a mask of -inf
    in a later argument is no finding. A module that writes over an input in place and returns
    something else, or None, is not named: the code of its caller is, as the one whose next
    module takes the value; review 52f, left so: kept in FP32 such a module writes into a float32
    copy, and the scope search would call that a fix.) Non-finite targets are the finding when the loss is not
    finite and they could have made it so (a NaN loss, or an inf in the targets; a loss may mask
    them out, as ``nanmean`` does, and overflow on its own).

    A non-finite value counts only when the pass ends non-finite: a loss or a gradient, or their
    global L2 norm in float32 (the step's detector: it overflows past 3.4e38 with every gradient
    finite). A pass whose loss and gradients are all finite is ``"none"``, the first value that
    did not reach them said in ``absorbed`` (a NaN the model masks out, a ``-inf`` mask it
    outputs). Where the pass saw non-finite values, element by element, goes into ``seen``
    (:class:`_Seen`); with ``known`` (another pass's), only values not non-finite at the same
    place there count (:func:`diagnose`: the first value only the run's precision has).

    Every module output and every gradient is checked on the host (a host sync each): a
    diagnostic, never part of the step. The parameters' ``.grad`` are put back afterwards.

    Example::

        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
        >>> x, y = torch.ones(3, 2), torch.zeros(3, 1)
        >>> fp32 = Precision("fp32", "cpu")
        >>> trace_first_non_finite(model, nn.functional.mse_loss, x, y, fp32).where
        'none'
        >>> x[0, 0] = float("nan")
        >>> f = trace_first_non_finite(model, nn.functional.mse_loss, x, y, fp32)
        >>> f.where, f.kind, f.input_dtypes
        ('input', 'nan', ['float32'])
        >>> def inf_loss(out, target):
        ...     return (out - target).abs().sum() * float("inf")
        >>> f = trace_first_non_finite(model, inf_loss, torch.ones(3, 2), y, fp32)
        >>> f.where, f.op, f.kind, all(p.grad is None for p in model.parameters())
        ('loss', 'inf_loss', 'inf', True)
        >>> f = trace_first_non_finite(model, nn.functional.mse_loss, torch.ones(3, 2), y / 0, fp32)
        >>> f.where, f.name, f.kind
        ('input', 'targets', 'nan')
        >>> class Masked(nn.Module):  # (a NaN the model masks out of its input: no finding)
        ...     def forward(self, x):
        ...         return model(x.nan_to_num())
        >>> f = trace_first_non_finite(Masked(), nn.functional.mse_loss, x, y, fp32)
        >>> f.where, f.absorbed
        ('none', 'the nan in the input batch')
    """
    label = precision.name
    seen = _Seen() if seen is None else seen
    known_at = known.at if known is not None else {}
    found: list[Finding] = []
    kind, where = _bad_at(inputs, known_at.get("input"))
    seen.note("input", where, first=kind is not None)
    if kind is not None:
        found.append(Finding("input", kind=kind, input_dtypes=_dtypes(inputs), precision=label))
    names = {id(m): name for name, m in model.named_modules()}
    param_owner = {id(p): (name, type(model.get_submodule(name.rpartition(".")[0])).__name__)
                   for name, p in model.named_parameters()}
    # the modules in forward, outermost first: each with its place (name#call), its input dtypes, and
    # its first input as it came in (its non-finite kind and where, its dtypes): judged at the entry,
    # as an in-place op inside the module (a Dropout(inplace=True)) writes its output over that input
    calls: list[tuple[nn.Module, str, list[str], str | None, list[str], torch.Tensor | None]] = []
    counts: dict[int, int] = {}
    grad_found: list[Finding] = []
    flows = _Flows(model, names, grad_found, label)

    def pre_hook(module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        counts[id(module)] = n = counts.get(id(module), 0) + 1
        key = f"{names.get(id(module), '?')}#{n}"
        given = _tensors(args) + _tensors(kwargs)
        first = next(iter(_tensors(args) or _tensors(kwargs)), None)  # (self.b(input=t): a keyword's)
        born, where = (None, None) if first is None else _bad_at(first, known_at.get(f"in:{key}"))
        seen.note(f"in:{key}", where)
        if born is None:  # a NaN or +inf in a later argument came in non-finite too (a -inf there: a mask)
            for j, later in enumerate(given[1:], 1):
                kind, at = _bad_at(later, known_at.get(f"in{j}:{key}"))
                seen.note(f"in{j}:{key}", at)
                if at is not None and bool(((at == NAN) | (at == POS_INF)).any()):
                    born, first, where = ("nan" if bool((at == NAN).any()) else "inf"), later, at
                    break
        calls.append((module, key, _dtypes(args) or _dtypes(kwargs), born, _dtypes(first), where))
        return flows.read(module, args, kwargs, calls[-2][0] if len(calls) > 1 else None)

    def forward_hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> torch.Tensor | None:
        # (called after a forward that raised too, output None: a caller that caught it goes on; and
        # without its pre-hook when a hook of the user's before it raised: then nothing of its own)
        if not calls or calls[-1][0] is not module:
            return None
        flows.made(module, _tensors(args) + _tensors(kwargs), _tensors(output), calls[-2][0] if len(calls) > 1 else None)
        judge(module, output)
        return flows.passed_on(output)  # (its input passed on as it is: the caller's own tensor, as in the step)

    def judge(module: nn.Module, output: Any) -> None:
        _, key, dtypes, born, first_dtypes, first_where = calls.pop()
        kind, where = _bad_at(output, known_at.get(f"out:{key}"))
        seen.note(f"out:{key}", where, first=kind is not None and not found and born is None)
        if kind is None or found:
            return
        if born is None:
            found.append(Finding("forward", names.get(id(module), "?"), type(module).__name__, kind, dtypes,
                                 _dtypes(output), label, call=_call_of(key)))
            return
        # it came in non-finite: the code of the innermost caller whose own first input came in finite made it
        i, child, child_key = len(calls) - 1, module, key
        while i >= 0 and calls[i][3] is not None:
            child, child_key, _, born, first_dtypes, first_where = calls[i]
            i -= 1
        if i < 0:  # (the model's own first input: one the check of the inputs could not read)
            found.append(Finding("input", kind=born, input_dtypes=first_dtypes, precision=label))
        else:
            caller, caller_key, caller_dtypes = calls[i][:3]
            found.append(Finding("forward", names.get(id(caller), "?"), type(caller).__name__, born, caller_dtypes,
                                 first_dtypes, label, before=names.get(id(child), "?"), call=_call_of(caller_key)))
        seen.note(f"in:{child_key}", first_where, first=True)

    handles = [m.register_forward_pre_hook(pre_hook, with_kwargs=True) for m in model.modules()]
    handles += [m.register_forward_hook(forward_hook, with_kwargs=True, always_call=True) for m in model.modules()]
    saved_grads = {id(p): p.grad for p in model.parameters()}
    try:
        for p in model.parameters():
            p.grad = None
        for name, p in model.named_parameters():
            if p.requires_grad and not isinstance(p, nn.parameter.UninitializedParameter):
                owner = param_owner[id(p)]

                def grad_hook(grad: torch.Tensor, owner: tuple[str, str] = owner) -> None:
                    if not grad_found and (kind := _bad(grad)) is not None:
                        grad_found.append(Finding("backward", owner[0], owner[1], kind, [],
                                                  [str(grad.dtype).removeprefix("torch.")], label))

                handles.append(p.register_hook(grad_hook))
        with _replaying(model, precision, fp32_module):
            with precision.autocast():
                outputs = model(inputs)
                loss = loss_fn(outputs, targets)
            loss = loss.float()
            value = float(loss.detach()) if loss.numel() == 1 else None
            if (loss_kind := _bad(loss)) is None and loss.requires_grad:
                _scaled_backward(loss, accumulation_steps, loss_scale)
                if not grad_found:
                    grad_found += _gradients_after(model, loss_scale, label)
        if loss_kind is None and not grad_found:  # the pass ended finite: what went non-finite did not matter
            first = found[0] if found else None
            return Finding("none", precision=label, loss=value,
                           absorbed=f"the {first.kind} {first.place_text()}" if first else "")
        if found:
            return found[0]
        if loss_kind is not None:
            # (NaN targets make a NaN loss: an inf loss beside NaN targets alone is the loss's own overflow;
            # an inf among the targets can make either)
            codes = _bad_at(targets)[1]
            nan, inf = (codes is not None and bool((codes == NAN).any()),
                        codes is not None and bool((codes >= POS_INF).any()))
            if inf or nan and loss_kind == "nan":
                kind = "nan" if nan and loss_kind == "nan" else "inf"
                return Finding("input", "targets", kind=kind, input_dtypes=_dtypes(targets), precision=label)
            return Finding("loss", op=_loss_name(loss_fn), kind=loss_kind, output_dtypes=_dtypes(loss), precision=label)
        grad_found[0].loss = value  # (the backward's: the loss was finite, and its size is the evidence)
        if grad_found[0].grad == "loss":
            grad_found[0].op = _loss_name(loss_fn)
        return grad_found[0]
    finally:
        flows.close()
        for handle in handles:
            handle.remove()
        for p in model.parameters():
            p.grad = saved_grads.get(id(p))


class _Flows:
    """The backward's places between modules, for :func:`trace_first_non_finite`: each tensor a
    module call takes or returns that needs a gradient (by identity and in-place version: a
    ``ReLU(inplace=True)``'s output is another place than its input; held by weak reference, so
    autograd frees activations as it would), the module whose forward made it and the one whose
    code it was made in. Each module call is handed its own alias of each input it reads (a view,
    the values unchanged, as ``register_full_backward_hook`` does), so its input gradient is a place
    of its own, apart from what other modules or code that read the same tensor add to it.

    A hook on each place says, at the first gradient there that is not finite (those after it,
    nearer the loss, were all finite: the backward runs from the loss), where it was made: at a
    module's alias, by that module's backward ("input": from a finite gradient of its output); at
    a tensor whose readers' input gradients were all finite, by their sum or the code that reads
    it too ("code": a residual's ``h + fc(h)`` sums in h's fp16, review 49d); at the model's
    output, by the loss's backward ("loss"). ``before`` names the module with weights whose
    output the value is (through parameter-free ones, an activation, which FP32 would not change):
    kept in FP32, the gradient it takes is float32 (review 49a: a parameter's gradient alone
    named the module before the one whose backward overflowed).

    Example (``b``'s input gradient, 3e4 x 1e4, overflows fp16; its own weight's gradient does not)::

        >>> model = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))
        >>> with torch.no_grad():
        ...     _ = model[0].weight.fill_(1e-4), model[1].weight.fill_(3e4), model[0].bias.zero_(), model[1].bias.zero_()
        >>> def loss_fn(out, y):
        ...     return out.float().sum() * 1e4
        >>> f = trace_first_non_finite(model, loss_fn, torch.ones(1, 1), None, Precision("fp16", "cpu"))
        >>> f.place_text()
        'in backward, the input gradient of 1 (Linear), made by its backward from a finite gradient of its output, from a finite loss 3e+04'
    """

    def __init__(self, root: nn.Module, names: dict[int, str], found: list[Finding], label: str) -> None:
        self.root, self.names, self.found, self.label = root, names, found, label
        self.places: dict[tuple[int, int], dict[str, Any]] = {}
        self.handles: list[Any] = []

    @staticmethod
    def _key(t: torch.Tensor) -> tuple[int, int]:
        return id(t), t._version

    @staticmethod
    def _tracked(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()

    def _place(self, t: torch.Tensor, caller: nn.Module | None, **fields: Any) -> dict[str, Any]:
        """``t``'s place, made (and hooked) when it has none: one whose tensor died since (its id
        taken by another) is another's."""
        place = self.places.get(self._key(t))
        if place is None or place["ref"]() is not t:
            place = self.places[self._key(t)] = {"ref": weakref.ref(t), "readers": [], "maker": None,
                                                 "source": None, "caller": caller, **fields}
            self.handles.append(t.register_hook(lambda grad, place=place: self._seen(grad, place)))
        return place

    def read(self, module: nn.Module, args: Any, kwargs: Any, caller: nn.Module | None) -> tuple[Any, Any] | None:
        """``module`` is called with ``args``/``kwargs`` by ``caller``'s code (None: the model is
        called): the arguments, each tensor that needs a gradient replaced by the module's own
        alias of it (one per tensor in the call). A tensor inside a list, a dict or another object
        stays itself, read by the module (it may write into them: review 49i, a feature list's
        appends were lost)."""
        made: dict[int, torch.Tensor] = {}  # (one alias a tensor in this call: `x is kv` stays true inside it)

        def alias(t: Any) -> Any:
            if isinstance(t, tuple):  # (a tuple's tensors, an LSTM's (h0, c0); a list or a dict the module may
                return type(t)(*map(alias, t)) if hasattr(t, "_fields") else tuple(map(alias, t))  # write into: as is)
            if not self._tracked(t) or t.grad_fn is None or t.layout != torch.strided or t.is_nested:
                return t  # (a parameter, a leaf: its gradient hooked as one; a sparse or nested one: read as it is)
            if id(t) not in made:
                base = self._place(t, caller)
                base = base.get("base", base)  # (a container's alias passed on to its child: the tensor's own place)
                made[id(t)] = view = t.view_as(t)
                alias_place = self._place(view, caller, base=base, given=weakref.ref(t))
                alias_place["readers"].append(module)
                base.setdefault("aliases", []).append(alias_place)  # (kept here: the dict forgets a dead one's key)
            return made[id(t)]

        new_args, new_kwargs = tuple(map(alias, args)), {k: alias(v) for k, v in kwargs.items()}
        for t in _tensors((new_args, new_kwargs)):  # (inside a dataclass or a mapping: the tensor itself)
            if self._tracked(t) and t.grad_fn is not None and "base" not in (place := self._place(t, caller)) \
                    and module not in place["readers"]:
                place["readers"].append(module)
        return new_args, new_kwargs

    def made(self, module: nn.Module, given: list[torch.Tensor], outputs: list[torch.Tensor],
             caller: nn.Module | None) -> None:
        """``module``, called by ``caller``, returned ``outputs``; one it was given as it is
        (``nn.Identity``, a ``Sequential``'s last output) it passed on: it is not its reader."""
        taken = {self._key(t) for t in given}
        weighted = next(module.parameters(), None) is not None
        source = module if weighted else next(
            (p["source"] for t in given if (p := self._base_of(t)) is not None and p["source"] is not None), None)
        for t in outputs:
            if not self._tracked(t):
                continue
            if self._key(t) in taken:
                place = self.places.get(self._key(t))
                if place is not None and module in place["readers"]:
                    place["readers"].remove(module)
                continue
            place = self._place(t, caller)
            if place["maker"] is None:  # (the innermost module that made it)
                place["maker"], place["caller"], place["source"] = module, caller, source or module
            elif place["caller"] is module:  # (a child's output it passes out as its own: its caller's code reads it)
                place["caller"] = caller
            if module is self.root:  # (the model's output: the loss reads it; not a block a recompute calls alone)
                place["output"] = True

    def passed_on(self, output: Any) -> torch.Tensor | None:
        """The tensor the caller handed in, when a module returns its own alias of it as it is
        (``nn.Identity``, an ``if skip: return x``), to hand back instead: the caller's ``g is h``
        holds as in the step (review 52f: False in the replay, and a model that tests it took
        another branch there, a non-finite value the run never had); else None."""
        if not isinstance(output, torch.Tensor) or not self._tracked(output):
            return None
        place = self.places.get(self._key(output))  # (its key: id and version, unchanged since it was made)
        if place is None or place["ref"]() is not output or "given" not in place:
            return None
        return place["given"]()

    def _base_of(self, t: torch.Tensor) -> dict[str, Any] | None:
        place = self.places.get(self._key(t))
        return place.get("base", place) if place is not None else None

    def _name(self, module: nn.Module | None) -> str:
        return "" if module is None else self.names.get(id(module), "?")

    def _seen(self, grad: torch.Tensor, place: dict[str, Any]) -> None:
        if self.found or (kind := _bad(grad)) is None:
            return
        dtype = [str(grad.dtype).removeprefix("torch.")]
        readers, base = place["readers"], place.get("base", place)
        source = self._name(base["source"] or base["maker"])
        if readers:
            names = [self._name(m) for m in readers]
            self.found.append(Finding("backward", names[0], type(readers[0]).__name__, kind, [], dtype, self.label,
                                      before=source, grad="input", also=names[1:]))
        elif "base" in place:  # (an alias its module passed on as it is: the value flows on to the base)
            return
        elif place.get("output") and place["maker"] is not None:
            self.found.append(Finding("backward", "", "", kind, [], dtype, self.label, before=source, grad="loss"))
        else:  # (each module's own input gradient finite: their sum, or the code that reads it too)
            # (no caller: a block a reentrant checkpoint's recompute called alone, whose caller is the model's code)
            caller = place["caller"] if place["caller"] is not None else self.root
            self.found.append(Finding("backward", self._name(caller), "" if caller is None else type(caller).__name__,
                                      kind, [], dtype, self.label, before=source, grad="code",
                                      also=self._readers_of(place)))

    def _readers_of(self, base: dict[str, Any]) -> list[str]:
        """The innermost modules that read ``base``'s tensor through an alias (not a container
        that passed its alias on to a child), in the order they read it."""
        names = [self._name(m) for p in base.get("aliases", []) for m in p["readers"]]  # (in the order they read it)
        return [n for n in dict.fromkeys(names) if not any(o != n and _within(o, n) for o in names)]

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.places.clear()


def _loss_name(loss_fn: Callable[..., Any]) -> str:
    """The loss function's name, through a wrapper (the fault injector's) to the task's loss."""
    fn = inspect.unwrap(loss_fn)
    return getattr(fn, "__name__", type(fn).__name__)


def _call_of(key: str) -> int:
    """The call number of a place key ``name#n`` (:func:`trace_first_non_finite`'s)."""
    return int(key.rpartition("#")[2])


@contextmanager
def _replaying(model: nn.Module, precision: Precision, fp32_module: str | Sequence[str] | None) -> Iterator[None]:
    """A replay's forward and backward: the module kept in FP32 (:func:`fp32_around`) stays so
    through the backward (a recompute of activation checkpointing runs its forward again there),
    and an FP32 pass keeps FP32 strict (no TF32) through it too; autocast, which the caller puts
    around the forward alone as the step does, is not part of it."""
    strict = precision.reference() if precision.name == "fp32" else nullcontext()
    with fp32_around(model, fp32_module), strict:
        yield


def _scaled_backward(loss: torch.Tensor, accumulation_steps: int, loss_scale: float) -> None:
    """The step's ``scaler.scale(loss / N).backward()`` of one micro-batch's (finite) loss."""
    if accumulation_steps > 1:  # (x / 1 is x: the step skips it too)
        loss = loss / accumulation_steps
    (loss * loss_scale).backward()


NORM = "global L2 norm of the gradients (float32; every gradient finite)"
"""What a finding names when each gradient is finite and their global norm is not."""

SUMMED = "summed over the group's micro-batches"
"""What a finding adds when the group's summed gradients are not finite, each micro-batch's are."""


def _gradients_after(model: nn.Module, loss_scale: float, label: str, summed: bool = False) -> list[Finding]:
    """``[the finding]`` for the gradients as the backward left them (``summed``: the sum of a
    group's micro-batches): a ``.grad`` that is not finite (made so after the tensor hooks saw it:
    a post-accumulate hook, or the sum), else a global L2 norm that is not finite though each
    gradient is (unscaled, as the step's detector computes it: a sum of squares in the
    gradients' dtype, past float32's range once the gradients reach ~1e19); else ``[]``. The
    gradients are unscaled one at a time (no copy of them all).

    Example (two gradients of 1e20 each: finite, the sum of their squares not in float32)::

        >>> model = nn.Linear(2, 1, bias=False)
        >>> model.weight.grad = torch.full((1, 2), 1e20)
        >>> [(f.where, f.op, f.kind) for f in _gradients_after(model, 1.0, "fp32")], _gradients_after(model, 1e3, "fp32")
        ([('backward', 'global L2 norm of the gradients (float32; every gradient finite)', 'inf')], [])
        >>> model.weight.grad[0, 0] = math.inf
        >>> [(f.name, f.op) for f in _gradients_after(model, 1.0, "fp32", summed=True)]
        [('weight', "Linear; summed over the group's micro-batches")]
    """
    from .clipping import grad_values

    held = [(name, p.grad) for name, p in model.named_parameters() if p.grad is not None]
    for name, grad in held:
        if (kind := _bad(grad)) is not None:
            owner = type(model.get_submodule(name.rpartition(".")[0])).__name__
            op = f"{owner}; {SUMMED}" if summed else f"{owner}; after its hooks"
            return [Finding("backward", name, op, kind, [], [str(grad.dtype).removeprefix("torch.")], label)]
    if not held:
        return []
    inv_scale = torch.tensor(loss_scale, dtype=torch.float64).reciprocal().float()  # (GradScaler's unscale_)
    norms = [torch.linalg.vector_norm(grad_values(g) * inv_scale.to(g.device)).to(held[0][1].device)
             for _, g in held]
    if bool(torch.isfinite(torch.linalg.vector_norm(torch.stack(norms)))):
        return []
    return [Finding("backward", "", f"{NORM}; {SUMMED}" if summed else NORM, "inf", [], ["float32"], label)]


@contextmanager
def fp32_around(model: nn.Module, name: str | Sequence[str] | None) -> Iterator[None]:
    """While inside, the submodule ``name`` of ``model`` (``""``: the model itself; None: none; a
    list: each of them) runs with autocast disabled and its floating inputs cast to FP32: the usual
    fix, "keep this module in FP32" (``fp32_modules``), tried on one batch. Under fp8 its float8 layers (torchao's ``Float8Linear``) compute
    a plain FP32 ``F.linear`` on their master weights too: autocast does not reach their casts.
    The forwards are wrapped for the duration and put back.

    Example (under bf16 autocast the first Linear computes in bf16, unless it is kept in FP32)::

        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        >>> with torch.autocast("cpu", dtype=torch.bfloat16), fp32_around(model, "0"):
        ...     model[0](torch.ones(1, 2)).dtype, model[1](torch.ones(1, 2)).dtype
        (torch.float32, torch.bfloat16)
        >>> "forward" in vars(model[0])  # put back
        False
    """
    from .fp8 import float8_modules

    def plain_linear(layer: nn.Module) -> Callable[..., Any]:
        # (named as Float8Linear.forward names it: a model may call layer(input=x))
        return fp32_forward(lambda input: nn.functional.linear(input, layer.weight, layer.bias))

    with ExitStack() as stack:
        for each in [] if name is None else [name] if isinstance(name, str) else name:
            module = model.get_submodule(each)
            for layer in float8_modules(module):
                stack.enter_context(_forward_replaced(layer, plain_linear(layer)))
            stack.enter_context(_forward_replaced(module, fp32_forward(module.forward)))
        yield


@contextmanager
def _forward_replaced(module: nn.Module, forward: Callable[..., Any]) -> Iterator[None]:
    """``module.forward`` is ``forward`` while inside (an instance attribute), then what it was."""
    own = vars(module).get("forward")  # an instance attribute already there (rare) is put back
    module.forward = forward
    try:
        yield
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


def _scopes(name: str) -> list[str]:
    """A module's qualified name and each of its parents', innermost first, ending with the model (``""``).

    Example::

        >>> _scopes("blocks.3.mlp"), _scopes("")
        (['blocks.3.mlp', 'blocks.3', 'blocks', ''], [''])
    """
    parts = name.split(".") if name else []
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)] + [""]


MAX_KEPT = 4
"""The most modules :func:`find_fp32_scope` keeps in FP32 together before it tries their parents."""


def find_fp32_scope(
    model: nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    inputs: Any,
    targets: Any,
    precision: Precision,
    loss_scale: float,
    module: str | Sequence[str],
    accumulation_steps: int = 1,
    start: Callable[[], None] | None = None,
    lowest: float | None = None,
    known: _Seen | None = None,
) -> tuple[list[str] | None, list[str], float | None]:
    """Replay the batch with ``module`` (a list: those modules) in FP32 and, while a value is
    still non-finite, with the module that replay names kept in FP32 as well (up to
    :data:`MAX_KEPT` together); then with their enclosing module alone, then its parent, up to the
    model, until the batch is all finite: ``(the modules so kept or None, the scopes tried as
    ``a + b`` for several, the loss scale it was finite at)``. A value whose range a module's FP32
    output leaves to the next module (a sum that module casts back to fp16, a gradient the module
    before it takes back into fp16) is fixed by the two together, which no single enclosing module
    but the model is (review 49a: "only the whole model" was advised where two Linears did). Each
    replay keeps the run's precision elsewhere, its loss scale and accumulation steps, and starts
    from the RNG state and the buffers this was called with (dropout draws the same masks each
    time; a buffer the forward updates, a counter or a cache, reads the same); the buffers are
    put back afterwards. ``start``: what puts that state back before each replay and at the end
    (:func:`_diagnose`'s, which holds a snapshot already); None: one taken here (a copy of the
    buffers).

    ``lowest``: the lowest loss scale the run's scaler reaches (its floor ``min_scale``, or 1), when
    it is below ``loss_scale``. A scope whose replay is left with only a gradient overflow at
    ``loss_scale`` is replayed at ``lowest`` too, and a fix there counts: that overflow is the
    scaler's to answer, by halving and skipping, as it does while it settles (review 46a: at the
    first skip of an fp16 run, scale 65536, a forward overflow one Linear in FP32 fixes was
    blamed on the whole model, since the scaled backward overflowed too in every scope).
    ``known``: the FP32 pass's non-finite places (:func:`trace_first_non_finite`'s): a value
    non-finite there too (a ``-inf`` mask) names no module to keep.

    Example (a block's Linear outputs 1e5, past fp16's 65504; the LayerNorm after it brings it back
    in range, so that Linear alone in FP32 fixes the batch; the output Linear alone does not)::

        >>> model = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2)), nn.Linear(2, 1))
        >>> with torch.no_grad():
        ...     _ = model[0][0].weight.fill_(1e3), model[0][0].bias.zero_()
        >>> x, y = torch.full((1, 2), 50.0), torch.zeros(1, 1)
        >>> fp16 = Precision("fp16", "cpu")
        >>> find_fp32_scope(model, nn.functional.mse_loss, x, y, fp16, 1.0, "0.0")
        (['0.0'], ['0.0'], 1.0)
        >>> find_fp32_scope(model, nn.functional.mse_loss, x, y, fp16, 1.0, "1")  # not the culprit: it and the one that is
        (['1', '0.0'], ['1', '1 + 0.0'], 1.0)
    """
    from .checkpoint import rng_state, set_rng_state
    from .untouched import BufferSnapshot

    if start is None:
        rng, buffers = rng_state(), BufferSnapshot(model)

        def start() -> None:
            set_rng_state(rng)
            buffers.put_back()
    tried: list[str] = []

    def replay(kept: list[str]) -> tuple[Finding, float | None]:
        """The replay with ``kept`` in FP32: its finding, and the loss scale it was finite at (None: not)."""
        tried.append(" + ".join(kept))  # (a set never holds the model, "": it holds every module)
        start()
        found = trace_first_non_finite(model, loss_fn, inputs, targets, precision, loss_scale, fp32_module=kept,
                                       accumulation_steps=accumulation_steps, known=known)
        if found.where == "none":
            return found, loss_scale
        if found.where == "backward" and lowest is not None and loss_scale > round_float32(lowest):
            start()  # (what is left at the scale the scaler backs off to is the range problem to keep out)
            found = trace_first_non_finite(model, loss_fn, inputs, targets, precision, lowest, fp32_module=kept,
                                           accumulation_steps=accumulation_steps, known=known)
            if found.where == "none":
                return found, lowest
        return found, None

    first = [module] if isinstance(module, str) else list(module)
    try:
        kept = first
        while True:
            found, at = replay(kept)
            if at is not None and len(kept) > 1 and _holds_only(model, enclosing := _enclosing(kept), kept):
                # (they are every module with weights of the one that holds them: that one, said more simply)
                together = tried.pop()
                if (whole_at := replay([enclosing])[1]) is not None:
                    return [enclosing], tried, whole_at
                tried.append(together)
            if at is not None:
                return kept, tried, at

            def free(m: str) -> bool:  # (not kept, nor inside a kept one; one around kept ones takes their place)
                return m != "" and not any(_within(m, k) for k in kept)
            more = list(dict.fromkeys(m for m in _modules_of(found) or [] if free(m)))
            if not more and found.where == "backward":  # (what it names is kept already: the next one to keep)
                # an input gradient's reader in FP32 hands it back cast to the half output it came from: that
                # output's module; a gradient the code of a module makes from a kept one's output: that module
                after = {"input": found.before, "code": found.name}.get(found.grad)
                more = [after] if after and free(after) else []
            kept = _merged(model, [k for k in kept if not any(_within(k, m) for m in more)] + more)
            if not more or len(kept) > MAX_KEPT:
                break
        for scope in _scopes(_enclosing(first))[len(first) == 1:]:  # (one module alone: tried above)
            if (at := replay([scope])[1]) is not None:
                return [scope], tried, at
        return None, tried, None
    finally:
        start()


def _merged(model: nn.Module, kept: list[str]) -> list[str]:
    """``kept`` with the modules that are every module with weights of the one holding them (not
    the model) replaced by that one, outward while any are: counted against :data:`MAX_KEPT` as
    one (review 49i: a chain of blocks fell to the whole model where three blocks did).

    Example::

        >>> model = nn.Sequential(nn.Sequential(nn.Linear(1, 1), nn.ReLU(), nn.Linear(1, 1)), nn.Linear(1, 1))
        >>> _merged(model, ["0.0", "0.2"]), _merged(model, ["0.0", "1"])
        (['0'], ['0.0', '1'])
    """
    while True:
        parents = {k.rpartition(".")[0] for k in kept if "." in k}
        whole = next((p for p in sorted(parents, key=len, reverse=True)
                      if sum(_within(k, p) for k in kept) > 1 and _holds_only(model, p, kept)), None)
        if whole is None:
            return kept
        kept = [k for k in kept if not _within(k, whole)] + [whole]


def _holds_only(model: nn.Module, scope: str, kept: list[str]) -> bool:
    """Whether every module inside ``scope`` that holds parameters of its own is in ``kept`` or
    inside one of them (``scope`` in FP32 then computes little more than ``kept`` do).

    Example::

        >>> mlp = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
        >>> _holds_only(mlp, "", ["0", "2"]), _holds_only(mlp, "", ["0"])
        (True, False)
    """
    return all(any(_within(name, k) for k in kept)
               for name, module in model.get_submodule(scope).named_modules(prefix=scope)
               if next(module.parameters(recurse=False), None) is not None)


def _within(name: str, scope: str) -> bool:
    """Whether module ``name`` is ``scope`` or inside it (``""``: the model holds every module)."""
    return scope == "" or name == scope or name.startswith(scope + ".")


def _enclosing(names: list[str]) -> str:
    """The innermost module that holds each of ``names``.

    Example::

        >>> _enclosing(["blocks.0.attn.q", "blocks.0.attn.k"]), _enclosing(["a"]), _enclosing(["a.b", "c"])
        ('blocks.0.attn', 'a', '')
    """
    common = names[0].split(".") if names[0] else []
    for name in names[1:]:
        parts = name.split(".") if name else []
        n = 0
        while n < min(len(common), len(parts)) and common[n] == parts[n]:
            n += 1
        common = common[:n]
    return ".".join(common)


def _modules_of(finding: Finding) -> list[str] | None:
    """The modules a finding points at: a forward output's module, a gradient's owner, the
    module(s) whose backward made it; else None (the input, the loss)."""
    if finding.where == "forward":
        return [finding.name]
    if finding.where == "backward" and finding.grad == "input":
        return [finding.name, *finding.also]
    if finding.where == "backward" and finding.grad == "code":  # (the module whose output it is: then float32)
        return [finding.before] if finding.before else [finding.name]
    if finding.where == "backward" and finding.grad == "loss":  # (the module whose output it is)
        return [finding.before]
    if finding.where == "backward" and finding.grad == "" and finding.name:
        return [finding.name.rpartition(".")[0]]
    return None  # (the input, the loss, the gradients' norm)


def diagnose_group(
    model: nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    batches: list[tuple[Any, Any]],
    precision: Precision,
    loss_scale: float = 1.0,
    accumulation_steps: int | None = None,
    rng: Any = None,
    scale_floor: float | None = None,
) -> Diagnosis:
    """:func:`diagnose` each micro-batch of a step in turn; the first with a finding answers.
    Every micro-batch finite alone, their summed gradients are checked as the step sums them
    (a sum, or its norm, past float32's range: :func:`_group_gradients`).

    Each micro-batch's loss is divided by ``accumulation_steps`` before the loss scale, as the
    step's ``scaler.scale(loss / N)``; None: the number of ``batches`` (a whole step's). ``rng``
    is the RNG state each micro-batch began with in the step (a list, as
    :class:`~ampguard.guards.FirstSkipDiagnosis` keeps them: :func:`~ampguard.checkpoint.torch_rng_state`),
    or the one the step began with (each next micro-batch then from where the one before drew to):
    its passes draw the step's dropout masks; None: from the caller's. The caller's RNG state is
    put back. (Only torch's RNG is followed: a forward that draws from ``random`` or NumPy, a
    layerdrop, may take another branch in the replay.) Every pass of a micro-batch starts from the
    buffers its pass under the run's precision saw: the first micro-batch's are the model's as
    given, each next one's those the micro-batch before it left, as in the step; the group's
    summed gradients are replayed from the model's. The buffers are put back afterwards.
    ``scale_floor``: the loss scaler's floor (``scaler.min_scale``) when a scaler runs, as
    :func:`diagnose`'s.

    Example (the second micro-batch carries a NaN, in FP32 as well: not a precision problem)::

        >>> model = nn.Linear(2, 1)
        >>> clean, bad = torch.ones(4, 2), torch.ones(4, 2)
        >>> bad[1, 1] = float("nan")
        >>> d = diagnose_group(model, nn.functional.mse_loss, [(clean, torch.zeros(4, 1)), (bad, torch.zeros(4, 1))],
        ...                    Precision("bf16", "cpu"))
        >>> d.verdict, d.amp.where, d.fp32.where
        ('data/model', 'input', 'input')
        >>> d = diagnose_group(model, nn.functional.mse_loss, [(clean, torch.zeros(4, 1))], Precision("bf16", "cpu"))
        >>> d.verdict, d.fp32  # nothing found: no FP32 replay
        ('none', None)
    """
    from .checkpoint import rng_state, set_rng_state
    from .untouched import BufferSnapshot, rng_kept

    if not batches:
        raise ValueError("diagnose_group needs at least one batch")
    n = len(batches) if accumulation_steps is None else accumulation_steps
    losses: list[float | None] = []
    inner = _uncompiled(model)
    states = list(rng) if isinstance(rng, (list, tuple)) else [rng]
    states += [None] * (len(batches) - len(states))
    # (the group's start, of more than one micro-batch: put back for the summed replays, and at the end;
    # one micro-batch's _diagnose puts its buffers back itself)
    buffers = BufferSnapshot(inner) if len(batches) > 1 else None
    with _eager(), rng_kept():
        try:
            starts = []
            for i, ((inputs, targets), state) in enumerate(zip(batches, states)):
                if state is not None:
                    set_rng_state(state)
                starts.append(rng_state())
                after: list[Any] = []
                result = _diagnose(inner, loss_fn, inputs, targets, precision, loss_scale, n, after,
                                   buffers_after=i < len(batches) - 1, scale_floor=scale_floor)
                if result.verdict != "none":
                    if len(batches) > 1:  # (its loss is that micro-batch's, not the step's: which one, said)
                        result.amp.micro_batch, result.amp.micro_batches = i + 1, len(batches)
                    return result
                losses.append(result.amp.loss)
                set_rng_state(after[0])  # (the next micro-batch draws on from there, as in the step)
                if len(after) > 1:
                    after[1].put_back()  # (and starts from the buffers this one left)
            mean = sum(losses) / len(losses) if None not in losses else None  # type: ignore[arg-type]
            if buffers is not None:
                buffers.put_back()
            if buffers is not None and (summed := _group_gradients(inner, loss_fn, batches, precision, loss_scale, n,
                                                                starts)):
                from .fp8 import float8_modules

                fp32 = _group_gradients(inner, loss_fn, batches, Precision("fp32", precision.device_type), 1.0, n,
                                        starts, fp32_module="" if float8_modules(inner) else None)
                summed[0].loss = mean
                return Diagnosis(summed[0], fp32[0] if fp32 else Finding("none", precision="fp32"),
                                 "data/model" if fp32 else "precision-range", loss_scale, scale_floor=scale_floor)
        finally:
            if buffers is not None:
                buffers.put_back()
    result.amp.loss = mean  # the step's loss: the micro-batches' mean
    return result


def _group_gradients(model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor], batches: list[tuple[Any, Any]],
                     precision: Precision, loss_scale: float, n: int, rngs: list[Any],
                     fp32_module: str | None = None) -> list[Finding]:
    """The group's micro-batches replayed as the step runs them, each from its RNG state in
    ``rngs``, their gradients summed (each one finite alone): ``[the finding]`` when the sum, or
    its global norm, is not finite (:func:`_gradients_after`), else ``[]``. ``fp32_module`` as
    :func:`trace_first_non_finite`'s (fp8's FP32 replay: ``""``). The model is left as it was
    (:func:`untouched`).

    Example (two micro-batches whose gradients of 2e38 each sum past float32's 3.4e38)::

        >>> model = nn.Linear(1, 1, bias=False)
        >>> with torch.no_grad():
        ...     _ = model.weight.fill_(1.0)
        >>> def loss_fn(out, y):
        ...     return (out * 2e38).mean()
        >>> batch = (torch.ones(1, 1), torch.zeros(1, 1))
        >>> from ampguard.checkpoint import rng_state
        >>> [(f.name, f.kind) for f in _group_gradients(model, loss_fn, [batch, batch], Precision("fp32", "cpu"), 1.0,
        ...                                              1, [rng_state()] * 2)], model.weight.grad
        ([('weight', 'inf')], None)
    """
    from .checkpoint import set_rng_state
    from .untouched import untouched

    with untouched(model):
        for p in model.parameters():
            p.grad = None
        with _replaying(model, precision, fp32_module):
            for (inputs, targets), rng in zip(batches, rngs):
                set_rng_state(rng)
                with precision.autocast():
                    loss = loss_fn(model(inputs), targets)
                loss = loss.float()
                if _bad(loss) is not None or not loss.requires_grad:  # (a micro-batch's own: found already)
                    return []
                _scaled_backward(loss, n, loss_scale)
        return _gradients_after(model, loss_scale, precision.name, summed=True)


def diagnose(
    model: nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    inputs: Any,
    targets: Any,
    precision: Precision,
    loss_scale: float = 1.0,
    accumulation_steps: int = 1,
    scale_floor: float | None = None,
) -> Diagnosis:
    """Locate the first non-finite value, then replay in FP32 to say whose problem it is.

    For a precision-range problem in a module's output or a parameter's gradient it then looks
    for the smallest module that fixes the batch when kept in FP32 (:func:`find_fp32_scope`).
    Every pass starts from the RNG state and the buffers this was called with, so dropout draws
    the same masks in each and a buffer the forward updates (a counter, a running normaliser, a
    cache) reads the same: each replay is the same pass with only the precision changed. The
    caller's RNG state and buffers are put back afterwards. A backward overflow at a loss scale
    above 1 that FP32 holds is replayed once more at scale 1, or at the loss scaler's floor
    ``scale_floor`` (``scaler.min_scale``, when a scaler runs) if that is higher: one that
    overflows there too is no routine back-off of the scaler (:attr:`Diagnosis.overflows_unscaled`). A first value that the FP32 replay
    has non-finite at the same place too, element for element, while FP32's pass ends finite (a
    ``-inf`` mask the model writes, a NaN it masks out of its input) is the model's own: the
    finding is then the first value only the run's precision has.

    Example (an activation of 1e5 is finite in FP32 but overflows fp16's range of 65504; the
    LayerNorm after it brings it back, so that Linear alone in FP32 is enough)::

        >>> model = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2)), nn.Linear(2, 1))
        >>> with torch.no_grad():
        ...     _ = model[0][0].weight.fill_(1e3), model[0][0].bias.zero_()
        >>> x, y = torch.full((1, 2), 50.0), torch.zeros(1, 1)
        >>> d = diagnose(model, nn.functional.mse_loss, x, y, Precision("fp16", "cpu"))
        >>> d.verdict, d.amp.where, d.amp.name, d.fp32_scope
        ('precision-range', 'forward', '0.0', '0.0')
        >>> print(d.message())
        first inf under fp16: in the forward output of 0.0 (Linear; inputs float32 -> outputs float16). FP32 replay
        is finite: a precision-range problem; keeping 0.0 in FP32 (autocast off around it alone) fixes this batch
    """
    # The replays leave no trace in the run: buffers (BatchNorm statistics) and the RNGs (dropout)
    # are put back as they were, so a run that diagnosed goes on exactly as one that did not. A
    # compiled model is replayed eagerly, under its own module names.
    with _eager():
        return _diagnose(_uncompiled(model), loss_fn, inputs, targets, precision, loss_scale, accumulation_steps,
                         scale_floor=scale_floor)


def _eager() -> Any:
    """Compiled code runs eagerly while inside: the replays' hooks, traced by dynamo, broke a
    compiled model's graph and compiled it again (a page of graph-break warnings). Nothing was
    compiled when dynamo was never imported: it is not imported for this (a second or two)."""
    stance = getattr(torch.compiler, "set_stance", None)  # (torch < 2.6: none)
    return stance("force_eager") if stance is not None and "torch._dynamo" in sys.modules else nullcontext()


def _uncompiled(model: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped (its names are the model's: ``0.fc``, not
    ``_orig_mod.0.fc``, as ``fp32_modules`` takes them), or ``model`` itself.

    Example::

        >>> inner = nn.Linear(2, 1)
        >>> _uncompiled(torch.compile(inner)) is inner, _uncompiled(inner) is inner
        (True, True)
    """
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) and type(model).__name__ == "OptimizedModule" else model


def _diagnose(model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor], inputs: Any, targets: Any,
              precision: Precision, loss_scale: float, accumulation_steps: int,
              rng_after: list[Any] | None = None, buffers_after: bool = False,
              scale_floor: float | None = None) -> Diagnosis:
    """:func:`diagnose` of an uncompiled model, run eagerly; ``rng_after`` gets the RNG state
    after the pass under the run's precision (what the step drew to), then with ``buffers_after``
    the buffers it left (a :class:`~ampguard.untouched.BufferSnapshot`: what the step's next
    micro-batch starts from); ``scale_floor``: the loss scaler's floor, where the replay that
    asks whether halving answers a backward overflow runs (at 1 if it is lower, or None)."""
    from .checkpoint import rng_state, set_rng_state
    from .untouched import BufferSnapshot, untouched
    from .fp8 import find_bad_scales, float8_modules

    n = accumulation_steps
    whole = "" if float8_modules(model) else None  # fp8: its float8 layers compute in FP32 as well
    fp32_precision = Precision("fp32", precision.device_type)
    with untouched(model) as buffers:
        # each pass starts here: the RNG state (the FP32 replay sees the AMP pass's dropout masks) and
        # the buffers and plain attributes the AMP pass saw (a counter, a running normaliser, a cache its
        # forward updates: untouched's own snapshot, no second copy), so that each replay is the same pass
        # with only the precision (or the scope in FP32) changed
        rng = rng_state()

        def start() -> None:
            set_rng_state(rng)
            buffers.put_back()

        amp_seen, fp32_seen = _Seen(every=False), _Seen()
        amp = trace_first_non_finite(model, loss_fn, inputs, targets, precision, loss_scale, accumulation_steps=n,
                                     seen=amp_seen)
        if rng_after is not None:
            rng_after.append(rng_state())
            if buffers_after:
                rng_after.append(BufferSnapshot(model))  # (the buffers the step's next micro-batch starts from)
        if amp.where == "none":
            return Diagnosis(amp, None, "none", loss_scale, scale_floor=scale_floor)
        start()
        fp32 = trace_first_non_finite(model, loss_fn, inputs, targets, fp32_precision, 1.0, fp32_module=whole,
                                      accumulation_steps=n, seen=fp32_seen)
        if fp32.where == "none" and amp_seen.also_in(fp32_seen):
            # what AMP found first was non-finite in FP32 too, whose pass ended finite: the model's own
            # (a -inf mask it writes, a NaN it masks out); the finding is the first value AMP alone has
            start()
            amp = trace_first_non_finite(model, loss_fn, inputs, targets, precision, loss_scale,
                                         accumulation_steps=n, known=fp32_seen)
        elif amp_seen.also_in(fp32_seen) and amp_seen.first in fp32_seen.minus_inf:
            # a -inf mask (the model's, or the batch's) first in both, and FP32 non-finite for another
            # reason: both passes look past the masks, to what made the step non-finite
            masks = fp32_seen.masks()
            start()
            amp = trace_first_non_finite(model, loss_fn, inputs, targets, precision, loss_scale,
                                         accumulation_steps=n, known=masks)
            start()
            fp32 = trace_first_non_finite(model, loss_fn, inputs, targets, fp32_precision, 1.0, fp32_module=whole,
                                          accumulation_steps=n, known=masks)
        scales = []
        if float8_modules(model) and amp.where != "input":  # which float8 cast broke (its replay: the same draws)
            start()
            scales = [str(bad) for bad in find_bad_scales(model, loss_fn, inputs, targets, precision.autocast)
                      if bad.broken_scale]
        if fp32.where != "none":
            from .checkpoint import non_finite_weight

            bad = "" if amp.where == "input" else non_finite_weight(dict(model.named_parameters()))
            # (AMP's first value finite in FP32, FP32's first elsewhere: a range problem before it; the
            # AMP pass re-traced past the masks has no place of its own in amp_seen: not said)
            return Diagnosis(amp, fp32, "data/model", loss_scale, bad_weight=bad, fp8_scales=scales,
                             scale_floor=scale_floor, amp_range=amp_seen.first is not None and
                             amp_seen.first not in fp32_seen.minus_inf and not amp_seen.also_in(fp32_seen))
        unscaled = False
        lowest = 1.0 if scale_floor is None else scale_floor  # (the lowest scale the scaler reaches: its floor,
        # above or below 1 (review 40m: a floor of 0.5 answers what 1 does not); 1 with no scaler: no loss scale)
        if amp.where == "backward" and loss_scale != 1.0 and (lowest == 1.0 or loss_scale > round_float32(lowest)):
            # an overflow the scaler would answer by halving, unless it overflows at its floor (or with no
            # loss scale) too
            start()
            unscaled = trace_first_non_finite(model, loss_fn, inputs, targets, precision, lowest,
                                              accumulation_steps=n).where != "none"
        scope, tried, at = None, [], None
        module = _modules_of(amp)
        if module is not None and precision.name != "fp32":
            # a scope's own leftover gradient overflow is the scaler's (it halves down to `lowest`),
            # unless the finding is one halving answers already (then no scope is needed at all)
            lower = lowest if amp.where != "backward" or unscaled else None
            start()
            scope, tried, at = find_fp32_scope(model, loss_fn, inputs, targets, precision, loss_scale, module, n,
                                               start=start, lowest=lower, known=fp32_seen)
    return Diagnosis(amp, fp32, "precision-range", loss_scale, scope[0] if scope else None, scope[1:] if scope else [],
                     tried, fp8_scales=scales, overflows_unscaled=unscaled, scale_floor=scale_floor, scope_scale=at)


# ---------------------------------------------------------------------------- the verb


def run(config: Any, *, step: int = 1, batch: str | None = None, checkpoint: str | None = None,
        scale: float | None = None, as_json: bool = False) -> int:
    """``ampguard locate``: replay step ``step`` of the config's data (with its faults), or a saved
    ``batch``, and print the finding. Returns 0 when all is finite, 1 when a value is not.

    The model is the one ``train`` runs (fp8: its Linear layers converted, :func:`~ampguard.build.prepare_model`).
    The loss scale (fp16 with its scaler) is ``scale`` when given, else the one a batch file
    names (a rollback's ``rollback/step-N.pt``: the scale that step ran with), else the
    ``checkpoint``'s, else ``scaler.init_scale``; each micro-batch's loss is divided by
    ``accumulation_steps`` before it, as in the step.

    Bad input is refused before anything runs (:class:`~ampguard.errors.InputError`): a step
    beyond the config's ``steps``, a ``scale`` that is not a finite number > 0 or is given to a
    run without a loss scaler, ``nan_input`` on a task with integer inputs; a ``batch`` the
    model or the loss cannot take is one line naming the file.

    Example (a NaN injected into step 2's inputs; step 1 is clean)::

        >>> from ampguard.config import validate
        >>> config = validate({"task": {"name": "linear"}, "device": "cpu", "precision": "bf16",
        ...                    "inject": ["nan_input@2"], "steps": 5})
        >>> run(config, step=1)
        locate: step 1 of task linear (seed 0) (nan_input@2 not: it fires at other steps; --step N replays step N), bf16 on cpu, loss scale 1
        no non-finite value in forward, loss or backward under bf16 (loss 1.582)
        0
        >>> run(config, step=2)
        locate: step 2 of task linear (seed 0) with nan_input@2 injected, bf16 on cpu, loss scale 1
        first nan under bf16: in the input batch. FP32 replay is not finite either: the injected nan_input@2, not a
        precision problem
        1
        >>> for bad in ({"step": 6}, {"scale": 1024.0}):
        ...     try:
        ...         run(config, **bad)
        ...     except InputError as err:
        ...         print(err)
        locate: --step 6 is beyond the run's 5 steps (config steps)
        locate: --scale: bf16 uses no loss scaler
    """
    import json

    # with --json, stdout is the one JSON line: what a user's factory or model prints goes to stderr
    with redirect_stdout(sys.stderr) if as_json else nullcontext():
        result, where, device, (loss_scale, scale_from), saved_step = _replay(
            config, step=step, batch=batch, checkpoint=checkpoint, scale=scale)
    if as_json:
        print(json.dumps({"where": where, **result.as_dict()}))
    else:
        print(f"locate: {where}, {config.precision} on {device.type}, loss scale {loss_scale:g}")
        print(result.message())
    if not checkpoint:  # (a loss that is not the run's, said nowhere: the weights were not the run's)
        print(f"ampguard: warning: locate: {untrained_replay(config)}", file=sys.stderr)
    elif not batch and saved_step is not None and saved_step >= step:  # (a later one: not the step as it ran)
        print(f"ampguard: warning: locate: {later_checkpoint(checkpoint, saved_step, step, loss_scale, scale_from)}",
              file=sys.stderr)
    return 0 if result.verdict == "none" else 1


def later_checkpoint(path: str, saved_step: int, step: int, loss_scale: float, scale_from: str = "checkpoint") -> str:
    """The warning for a replay of ``step`` from a checkpoint saved at or after it: its weights
    and loss scale are not the ones the step ran with (a newer scale may be smaller, and an
    overflow of the step not happen again), though they may be what the user asks about (a
    diverged run's last weights on a batch). ``scale_from``: where the replay's scale came from
    (``checkpoint``, ``--scale``, ``init``: ``scaler.init_scale``, the checkpoint holding none,
    a bf16 run's replayed under fp16; ``none``: no loss scaler).

    Example::

        >>> print(later_checkpoint("step-00000020.pt", 20, 5, 512.0))
        --checkpoint step-00000020.pt holds the weights after step 20, not those step 5 ran with (after step 4): the replay ran them, at their loss scale 512, on step 5's batch; pass a checkpoint saved before step 5 (the run's newest before it) to replay the step as it ran
        >>> print(later_checkpoint("step-00000020.pt", 20, 5, 65536.0, "init").split(": ")[1].split(";")[0])
        the replay ran them, at scaler.init_scale 65536 (the checkpoint holds no loss scale), on step 5's batch
    """
    at = {"checkpoint": f"at their loss scale {loss_scale:g}", "--scale": f"at --scale {loss_scale:g}",
          "init": f"at scaler.init_scale {loss_scale:g} (the checkpoint holds no loss scale)",
          "none": "with no loss scaler"}.get(scale_from, f"at loss scale {loss_scale:g}")
    return (f"--checkpoint {path} holds the weights after step {saved_step}, not those step {step} ran with "
            f"({f'after step {step - 1}' if step > 1 else 'the initial ones'}): the replay ran them, {at}, on step "
            f"{step}'s batch; pass a checkpoint saved before step {step} (the run's newest before it) to replay the "
            f"step as it ran")


def untrained_replay(config: Any) -> str:
    """The warning for a replay with no checkpoint: the model is the one the task builds, untrained
    for a built-in task, not the weights the run had at the step.

    Example::

        >>> from ampguard.config import validate
        >>> print(untrained_replay(validate({"task": {"name": "linear"}})))
        no --checkpoint: the replay ran task linear freshly initialised (untrained weights), not the run's weights at that step; pass --checkpoint (the run's newest before the step) to replay those
    """
    from .tasks import untrained_model

    return (f"no --checkpoint: the replay ran {untrained_model(config)}, not the run's weights at that step; "
            "pass --checkpoint (the run's newest before the step) to replay those")


def _replay(config: Any, *, step: int, batch: str | None, checkpoint: str | None,
            scale: float | None) -> tuple[Any, str, torch.device, float, int | None]:
    """:func:`run`'s replay: the diagnosis, where it was made, the device, the loss scale and the
    step the checkpoint was saved after (None without one)."""
    import itertools

    from .build import initial_scale, precision_of, prepare_model, resolve_device, to_device
    from .checkpointer import DATA, POLICY, ROLLBACKS, check_data_position, check_field, load_trained_weights
    from .faults import FaultInjector, check_nan_input, check_steps, parse_fault
    from .tasks import build_task

    # a saved batch is replayed as it is: it holds the faults of its step already (a rollback's
    # evidence), and an every:K or rate fault of the run's config would fire on it at "step 0"
    faults = [] if batch else [parse_fault(spec, seed=config.seed) for spec in config.inject]
    try:  # (as train refuses it: a fault that fires at none of the run's steps is none of the step replayed, review 49a)
        check_steps(faults, config.steps)
    except ValueError as err:
        raise InputError(f"inject: {err}") from None
    device = resolve_device(config.device)
    precision = precision_of(config, device)
    _check_arguments(config, precision, step=step, batch=batch, scale=scale)
    task = build_task(config)
    check_nan_input(task, faults)
    model = prepare_model(config, task.model.to(device))  # fp8: the Float8Linear layers train runs
    try:
        precision.check(model, device)  # what train refuses (and fp16/fp8 on a CPU: a SlowPrecisionWarning)
    except ValueError as err:
        raise InputError(f"precision: {err}") from None
    checkpoint_scale = saved_step = saved = None
    if checkpoint:
        saved = load_trained_weights(model, checkpoint, config, data_id=task.data_id)
        checkpoint_scale = _checkpoint_scale(checkpoint, saved["state"].get("scaler"), config, precision)
        saved_step = saved["step"]  # (an int >= 0: load_trained_weights checks it, review 54n)
    injector = FaultInjector(faults, config.accumulation_steps)
    # a finding in the loss names the task's loss function, not the injector's wrapper
    loss_fn = functools.update_wrapper(injector.wrap_loss(task.loss_fn), task.loss_fn, updated=())
    injector.attach(model)
    batch_scale = None
    if batch:
        batches, batch_scale = load_batches(batch)
        where = f"batch {batch}"
    else:
        n = config.accumulation_steps
        if saved is not None and saved["step"] < step:  # (one saved at or after the step: its position is not used)
            for key in (DATA, ROLLBACKS, POLICY):  # (the position an int >= 0, where the run's data went on after it)
                check_field(checkpoint, saved, key)
            # within what its steps could have taken, as a resume checks it: a task that cannot seek
            # (a factory without batches_from) reads the stream up to it, a hand-edited 10**15 for ever
            check_data_position(checkpoint, saved, config)
        # where the run read the step: a rollback moved its data on (review 58d: (step - 1) x n was replayed)
        rollbacks = _run_rollbacks(config, checkpoint, saved, step)
        start = replay_position(step, n, saved=None if saved is None else (saved["step"], saved[DATA]),
                                rollbacks=rollbacks)
        if rollbacks is None and config.rollback.triggers:
            warn(f"locate: no events.jsonl of the run found (beside the checkpoint, nor in log.dir/log.name): "
                 f"step {step} is replayed on the batches at position {start}, as if no rollback had moved "
                 "the data on (pass the run's config.yaml, or a checkpoint in its run folder)",
                 AmpguardWarning, stacklevel=2)
        stream = injector.wrap_data(task.stream(start), first_step=step)  # seeks: no reading up to it
        batches = list(itertools.islice(stream, n))
    scaler_on = config.scaler_on  # else no saved scale applies
    loss_scale = _replay_scale(given=scale, batch_file=batch_scale if scaler_on else None,
                               checkpoint=checkpoint_scale if scaler_on else None, init=initial_scale(config, device))
    injector.current_step = step  # the faults of the replayed step (none for a saved batch)
    # the replay's warnings (a loss broadcasting a target of another shape) are shown once it
    # worked; when a saved batch does not fit, the one line says why and they are dropped
    with warnings.catch_warnings(record=True) as caught:
        # a batch the model or loss cannot take is bad input; the task's own data (train refuses it at
        # its first batch) too: one line, not the traceback whose exit 1 read as "a non-finite value found"
        with user_code(f"locate: batch {batch} does not fit the model of task {task.name}: " if batch else
                       f"locate: task {task.name}: the model or the loss failed on step {step}'s batch: "):
            batches = [(to_device(x, device), to_device(y, device)) for x, y in batches]
            result = diagnose_group(model, loss_fn, batches, precision, loss_scale, config.accumulation_steps,
                                    scale_floor=config.scaler.min_scale if scaler_on else None)
    # (review 52f: a gradient fault no backward of the replay fired, its step's loss not finite, is not said injected)
    missed = [] if batch else injector.missed(step)
    result.injected = [spec for spec in _faults_at(faults, step)[0] if spec not in missed]
    if not batch:
        where = f"step {step} of task {task.name} (seed {config.seed}){_injected_at(faults, step, missed)}"
    result.scale_floor = config.scaler.min_scale if scaler_on else None
    for w in caught:
        warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    # where the scale came from, for a later checkpoint's warning ("their loss scale" was said of
    # --scale's and of scaler.init_scale's where the checkpoint held none: review 51h)
    scale_from = ("--scale" if scale is not None else "none" if not scaler_on else
                  "batch" if batch_scale is not None else "checkpoint" if checkpoint_scale is not None else "init")
    return result, where, device, (loss_scale, scale_from), saved_step


def replay_position(step: int, n: int, *, saved: tuple[int, int] | None = None,
                    rollbacks: Sequence[Mapping[str, Any]] | None = ()) -> int:
    """The data position (micro-batches taken before it) where the run read step ``step``'s ``n``
    micro-batches. Each step takes ``n``, from the latest of: the run's start; the checkpoint
    ``saved`` (its step and data position) when it was saved before ``step``; and each of the run's
    ``rollbacks`` (its ``rollback`` events, ``{step, data_position}``) after that and before
    ``step``: a rollback seeks the data on past the batches that triggered it (``skip_batches``),
    and the step after it reads from its ``data_position``. ``rollbacks`` None: the run's events
    were not found (a checkpoint copied out of its run folder), read as no rollback.

    A rollback between them whose event names no position (a run from before its events held
    one, or a hand edit) is one :class:`InputError` line: where step ``step`` read is not known,
    and a checkpoint saved after the rollback says it.

    Example (a run that rolled back at step 25 and went on at position 40)::

        >>> replay_position(31, 1), replay_position(31, 2)  # no checkpoint, no rollback: (step - 1) x n
        (30, 60)
        >>> rollback = {"step": 25, "data_position": 40}
        >>> replay_position(31, 1, saved=(30, 45)), replay_position(31, 1, saved=(20, 20), rollbacks=[rollback])
        (45, 45)
        >>> replay_position(25, 1, saved=(20, 20), rollbacks=[rollback])  # the rollback's own step read before it
        24
        >>> replay_position(31, 1, saved=(40, 55), rollbacks=[rollback])  # (a later checkpoint says nothing of it)
        45
        >>> try:
        ...     replay_position(31, 1, saved=(20, 20), rollbacks=[{"step": 25}])
        ... except InputError as err:
        ...     print(err)
        locate: the run rolled back at step 25, after the checkpoint's step 20 and before step 31, and its events.jsonl does not say where the data went on from there: pass a --checkpoint saved after step 25 and before step 31 (its data position is the run's)
    """
    at, position = 0, 0
    if saved is not None and saved[0] < step:
        at, position = saved
    for event in rollbacks or ():
        if not at < event["step"] < step:  # (one at the checkpoint's step came before its save: in its position)
            continue
        if not whole_number(event.get("data_position")):
            since = f"the checkpoint's step {at}" if saved is not None and at == saved[0] and at else "the start"
            raise InputError(f"locate: the run rolled back at step {event['step']}, after {since} and before step "
                             f"{step}, and its events.jsonl does not say where the data went on from there: pass a "
                             f"--checkpoint saved after step {event['step']} and before step {step} (its data "
                             "position is the run's)")
        at, position = event["step"], event["data_position"]
    return position + (step - 1 - at) * n


def _run_rollbacks(config: Any, checkpoint: str | None, saved: Mapping[str, Any] | None, step: int
                   ) -> list[dict[str, Any]] | None:
    """The rollbacks of the run whose step ``locate`` replays, from its ``events.jsonl`` (those on
    the timeline the run kept, as ``report`` reads them: a resume from an earlier step abandoned
    the later ones): the run folder that holds ``checkpoint`` (in its ``checkpoints/``, a
    ``checkpoints/abandoned-*/`` or ``rollback/``), else ``log.dir/log.name`` of ``config`` (the
    run's own ``config.yaml`` names its folder); a folder whose run id is not the checkpoint's is
    another run's, passed over. None when no such folder holds an ``events.jsonl``.

    A checkpoint a resume set aside (``checkpoints/abandoned-*/``) is of a timeline the kept events
    no longer describe: with no rollback of any timeline between its step and ``step``, none moved
    its data (``[]``); with one, where its timeline read ``step`` is not known from here, one
    :class:`InputError` line (review 58l: the kept timeline's rollbacks were used, a clean verdict
    on batches no step ``step`` read). A rollback's position that the replay may read from (after
    the checkpoint's step and before ``step``) is refused past what its step could have taken, as a
    checkpoint's is (:func:`~ampguard.checkpointer.check_reachable_position`, with every rollback
    the events keep and the largest ``rollback.skip_batches`` of the config, the checkpoint and
    the events' ``policy_change``): a hand-edited 10**15 was read up to, for ever, on a task that
    cannot seek."""
    from pathlib import Path

    from .checkpointer import CONFIG, POLICY, check_reachable_position, skip_batches_used
    from .report import LoggedEvents
    from .run_folder import RunPaths

    folders, set_aside = [], None
    if checkpoint:
        parent = Path(checkpoint).resolve().parent
        if parent.name.startswith("abandoned-") and parent.parent.name == "checkpoints":
            set_aside, parent = parent, parent.parent
        if parent.name in ("checkpoints", "rollback"):
            folders.append(parent.parent)
    if isinstance(config.log.name, str) and config.log.name:
        folders.append(Path(config.log.dir, config.log.name))  # (the config expanded a ~ in log.dir)
    for folder in folders:
        if not (folder / "events.jsonl").is_file():
            continue
        try:
            folder_id = RunPaths.existing(folder).run_id()
        except InputError:  # (a damaged run-id file: not known to be the checkpoint's run)
            continue
        if saved is not None and isinstance(saved.get("run_id"), str) and folder_id and folder_id != saved["run_id"]:
            continue
        log = LoggedEvents(folder)
        if set_aside is not None and folder == folders[0]:
            since = saved["step"] if saved is not None else 0
            between = sorted({e["step"] for e in log.events()
                              if e.get("event") == "rollback" and since < e["step"] < step})
            if between:
                raise InputError(f"locate: {Path(checkpoint).name} is in {set_aside.parent.name}/{set_aside.name}/, "
                                 f"set aside by a resume, and the run rolled back at step {between[0]} between its "
                                 f"step {since} and step {step} in some timeline: where its own timeline read step "
                                 f"{step} is not known from the kept events; pass a checkpoint of the kept timeline "
                                 f"(in checkpoints/) saved before step {step}")
            return []
        rollbacks = log.kept(lambda event: event.get("event") == "rollback", at_resume=True)
        since = saved["step"] if saved is not None and saved["step"] < step else 0
        read = [e for e in rollbacks if since < e["step"] < step and whole_number(e.get("data_position"))]
        if read:  # (the positions replay_position may start from)
            policy = None if saved is None else saved.get(POLICY)  # (checked where the checkpoint's position is read)
            changes = [*(policy if isinstance(policy, list) else ()),
                       *(e for e in log.events() if e.get("event") == "policy_change")]
            skip = skip_batches_used(config, None if saved is None else saved[CONFIG], changes)
            for event in read:
                check_reachable_position(f"{folder / 'events.jsonl'} (the rollback at step {event['step']})",
                                         event["data_position"], event["step"], len(rollbacks), config, skip)
        return rollbacks
    return None


def _injected_at(faults: list[Any], step: int, missed: Sequence[str] = ()) -> str:
    """What the header adds for the config's faults: those that fire at ``step``, which the replay
    injects as the run did (a finding there is the fault's), except another rank's (one process
    replays) and the ``missed`` ones (gradient faults no backward of the replay fired: its loss was
    not finite, review 52f); and those that fire at other steps only, named too (review 50j:
    ``--inject nan_input@3`` replayed at step 1 came out clean with no word of the fault).

    Example::

        >>> from ampguard.faults import parse_fault
        >>> faults = [parse_fault(s) for s in ("nan_input@2", "spike@every:2@rank1", "nan_loss@3")]
        >>> for step in (1, 2, 3):
        ...     print(f"step {step}{_injected_at(faults, step)}")
        step 1 (nan_input@2, spike@every:2@rank1, nan_loss@3 not: they fire at other steps; --step N replays step N)
        step 2 with nan_input@2 injected (spike@every:2@rank1 not: another rank's; nan_loss@3 not: it fires at other steps)
        step 3 with nan_loss@3 injected (nan_input@2, spike@every:2@rank1 not: they fire at other steps)
        >>> print(_injected_at([parse_fault("nan_loss@3"), parse_fault("inf_grad@3")], 3, ["inf_grad@3"]))
         with nan_loss@3 injected (inf_grad@3 not: it did not fire, no backward reached a parameter)
    """
    here, other = _faults_at(faults, step)
    here = [spec for spec in here if spec not in missed]
    elsewhere = [f.spec() for f in faults if not f.hits(step)]
    notes = ([f"{', '.join(missed)} not: {'they' if len(missed) > 1 else 'it'} did not fire, no backward reached a parameter"]
             if missed else []) + ([f"{', '.join(other)} not: another rank's"] if other else []) + (
        [f"{', '.join(elsewhere)} not: {'they fire' if len(elsewhere) > 1 else 'it fires'} at other steps"
         + ("" if here or other else "; --step N replays step N")] if elsewhere else [])
    said = f" with {', '.join(here)} injected" if here else ""
    return said + (f" ({'; '.join(notes)})" if notes else "")


def _faults_at(faults: list[Any], step: int) -> tuple[list[str], list[str]]:
    """The specs of the faults that fire at ``step``: (the replay's, rank 0's or any rank's;
    another rank's, which one process does not replay)."""
    return ([f.spec() for f in faults if f.hits(step) and f.rank in (None, 0)],
            [f.spec() for f in faults if f.hits(step) and f.rank not in (None, 0)])


def _replay_scale(*, given: float | None, batch_file: float | None, checkpoint: float | None, init: float) -> float:
    """The loss scale ``locate`` replays with: the first of these that names one, in this order:
    ``--scale``, the batch file's (the scale its step ran with: a rollback's evidence names it),
    the checkpoint's, ``scaler.init_scale``.

    Example::

        >>> _replay_scale(given=8.0, batch_file=1024.0, checkpoint=512.0, init=65536.0)
        8.0
        >>> _replay_scale(given=None, batch_file=1024.0, checkpoint=512.0, init=65536.0)
        1024.0
        >>> _replay_scale(given=None, batch_file=None, checkpoint=None, init=65536.0)
        65536.0
    """
    return next((s for s in (given, batch_file, checkpoint) if s is not None), init)


def _checkpoint_scale(path: str, saved: Any, config: Any, precision: Precision) -> float | None:
    """The loss scale a run resumed from the checkpoint would step with (its ``state.scaler``
    loaded as a resume loads it: a collapsed 0 at the floor); None when the replay's precision
    uses no loss scaler, or the checkpoint holds no scaler state (a bf16 or fp32 run's, replayed
    under fp16 to ask whether it would overflow: ``scaler.init_scale``). A saved state the scaler
    cannot take is one :class:`InputError` line, as a resume refuses it (a scale of ``'x'`` was
    a traceback, one of -1 or NaN a replay under it).

    Example::

        >>> from ampguard.config import validate
        >>> fp16 = validate({"precision": "fp16", "scaler": {"min_scale": 2}})
        >>> saved = Precision("fp16", "cpu").make_scaler(init_scale=512.0, min_scale=2.0).state_dict()
        >>> _checkpoint_scale("c.pt", saved, fp16, Precision("fp16", "cpu"))
        512.0
        >>> _checkpoint_scale("c.pt", {**saved, "scale": 0.0}, fp16, Precision("fp16", "cpu"))  # (collapsed: the floor)
        2.0
        >>> _checkpoint_scale("c.pt", {}, validate({"precision": "bf16"}), Precision("bf16", "cpu")) is None
        True
        >>> _checkpoint_scale("c.pt", {}, fp16, Precision("fp16", "cpu")) is None  # (a bf16 run's checkpoint)
        True
        >>> _checkpoint_scale("c.pt", {**saved, "scale": float("nan")}, fp16, Precision("fp16", "cpu"))
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: c.pt: bad checkpoint: state.scaler.scale is nan, expected a number in [0, 3.40282e+38] (a float32)
    """
    from .build import scaler_settings
    from .checkpointer import check_scaler_state

    scaler = precision.make_scaler(**scaler_settings(config))
    if not scaler.is_enabled() or saved in (None, {}):
        return None
    check_scaler_state(path, saved, scaler)
    scaler.load_state_dict(saved)
    return scaler.get_scale()


def _check_arguments(config: Any, precision: Precision, *, step: int, batch: str | None, scale: float | None) -> None:
    """Refuse what ``locate`` cannot replay, before anything is built (one :class:`InputError`).

    Example::

        >>> from ampguard.config import validate
        >>> fp16 = validate({"precision": "fp16", "steps": 10})
        >>> for step, scale in ((11, None), (1, -1.0), (1, math.nan), (1, math.inf), (1, 1e39), (1, 1e-46)):
        ...     try:
        ...         _check_arguments(fp16, Precision("fp16", "cpu"), step=step, batch=None, scale=scale)
        ...     except InputError as err:
        ...         print(err)
        locate: --step 11 is beyond the run's 10 steps (config steps)
        locate: --scale must be a finite number > 0, got -1
        locate: --scale must be a finite number > 0, got nan
        locate: --scale must be a finite number > 0, got inf
        locate: --scale 1e+39 is not a float32 scale: it must be in [1.17549e-38, 3.40282e+38] (the loss scale is a float32)
        locate: --scale 1e-46 is not a float32 scale: it must be in [1.17549e-38, 3.40282e+38] (the loss scale is a float32)
        >>> no_scaler = validate({"precision": "fp16", "scaler": {"enabled": False}})
        >>> _check_arguments(no_scaler, Precision("fp16", "cpu"), step=1, batch=None, scale=8.0)
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: locate: --scale: fp16 with scaler.enabled=false uses no loss scaler
    """
    if scale is not None:
        if not (math.isfinite(scale) and scale > 0):
            raise InputError(f"locate: --scale must be a finite number > 0, got {scale:g}")
        if not DEFAULT_MIN_SCALE <= scale <= MAX_SCALE:  # (1e39 replayed as inf, 1e-46 as 0: every gradient 0)
            raise InputError(f"locate: --scale {scale:g} is not a float32 scale: it must be in [{DEFAULT_MIN_SCALE:g}, "
                             f"{MAX_SCALE:g}] (the loss scale is a float32)")
        if not precision.uses_scaler:
            raise InputError(f"locate: --scale: {precision.name} uses no loss scaler")
        if config.scaler.enabled is False:
            raise InputError(f"locate: --scale: {precision.name} with scaler.enabled=false uses no loss scaler")
    # the stream is read from its start up to the step: a step the run never reaches would be a
    # (near) endless read, and no run of this config ever took it
    if batch is None and step > config.steps:
        raise InputError(f"locate: --step {step} is beyond the run's {counted(config.steps, 'step')} (config steps)")


def load_batches(path: str) -> tuple[list[tuple[Any, Any]], float | None]:
    """A saved batch file, loaded weights-only: ``{"inputs": x, "targets": y}``, or a step's
    micro-batches ``{"micro_batches": [{"inputs": x, "targets": y}, ...], "loss_scale": s, ...}``
    (what a rollback saves as ``rollback/step-N.pt``). Returns the micro-batches and the loss scale
    the file names (None when it names none). A file that is not that, a ``loss_scale`` that is
    not a finite number > 0, or a batch with no examples is one :class:`InputError` line.

    Example::

        >>> import shutil, tempfile
        >>> from pathlib import Path
        >>> folder = Path(tempfile.mkdtemp())
        >>> one = {"inputs": torch.ones(2, 3), "targets": torch.zeros(2)}
        >>> torch.save({"micro_batches": [one, one], "loss_scale": 1024.0, "step": 7}, folder / "step-7.pt")
        >>> batches, scale = load_batches(str(folder / "step-7.pt"))
        >>> len(batches), scale
        (2, 1024.0)
        >>> torch.save({**one, "loss_scale": 8}, folder / "int.pt")  # an int scale is a number too
        >>> load_batches(str(folder / "int.pt"))[1]
        8.0
        >>> for name, data in (("bad", {"micro_batches": []}), ("scale", {**one, "loss_scale": "big"}),
        ...                    ("huge", {**one, "loss_scale": 1e39}),
        ...                    ("empty", {"inputs": torch.ones(0, 3), "targets": torch.zeros(0)})):
        ...     torch.save(data, folder / f"{name}.pt")
        ...     try:
        ...         load_batches(str(folder / f"{name}.pt"))
        ...     except InputError as err:
        ...         print(str(err).replace(str(folder), "DIR"))
        DIR/bad.pt: a batch file holds {'inputs': ..., 'targets': ...} (or 'micro_batches': a list of them)
        DIR/scale.pt: loss_scale must be a finite number > 0, got 'big'
        DIR/huge.pt: loss_scale 1e+39 is not a float32 scale: it must be in [1.17549e-38, 3.40282e+38]
        DIR/empty.pt: the batch holds no examples (inputs of shape (0, 3))
        >>> shutil.rmtree(folder)
    """
    from .checkpoint import safe_load

    data = safe_load(path, "batch")
    problem = InputError(f"{path}: a batch file holds {{'inputs': ..., 'targets': ...}} (or 'micro_batches': a list of them)")
    if not isinstance(data, dict):
        raise problem
    items = data.get("micro_batches", [data])
    if (not isinstance(items, list) or not items
            or not all(isinstance(b, dict) and {"inputs", "targets"} <= set(b) for b in items)):
        raise problem
    scale = data.get("loss_scale")
    # (an int is fine; NaN, inf and an int past the largest float are not finite numbers)
    if scale is not None and not (finite_number(scale) and scale > 0):
        raise InputError(f"{path}: loss_scale must be a finite number > 0, got {brief(scale)}")
    if scale is not None and not DEFAULT_MIN_SCALE <= scale <= MAX_SCALE:  # (as --scale: 1e39 is inf in float32)
        raise InputError(f"{path}: loss_scale {scale:g} is not a float32 scale: it must be in [{DEFAULT_MIN_SCALE:g}, "
                         f"{MAX_SCALE:g}]")
    try:  # (what the replay walks: a structure nested past Python's recursion limit is no batch)
        inputs = []
        for b in items:
            _tensors(b["targets"])  # (walked for its depth alone)
            inputs.append(_tensors(b["inputs"]))
    except RecursionError:
        raise InputError(f"{path}: the batch's inputs or targets are nested too deep to read") from None
    for i, tensors in enumerate(inputs):  # a loss over no examples is a NaN mean, not a finding
        first = next(iter(tensors), None)
        if first is not None and first.dim() > 0 and first.shape[0] == 0:
            which = f"micro-batch {i}" if "micro_batches" in data else "the batch"
            raise InputError(f"{path}: {which} holds no examples (inputs of shape {tuple(first.shape)})")
    return [(b["inputs"], b["targets"]) for b in items], None if scale is None else float(scale)
