"""Global-L2 gradient clipping and the non-finite detector.

The global L2 norm is the Euclidean norm of *all* gradients concatenated into one vector, not a
norm per parameter: ``sqrt(sum_p ||g_p||^2)``. One bad batch shows up as one huge number, and
clipping rescales every gradient by the same factor, so the update keeps its direction.

The norm is PyTorch's own ``get_total_norm`` (on torch 2.4/2.5, which lack it, a copy of the same
lines of their ``clip_grad_norm_``: :func:`_total_norm_torch24`); the clip is the other half of ``clip_grad_norm_``,
``clip_grads_with_norm_``, done as it does it (the factor ``min(1, max_norm / (norm + 1e-6))``,
then one foreach multiply per device and dtype) but split in two (:func:`clip_factor`,
:func:`scale_grads_`) so the factor is computed once and the reported post-clip norm reuses it.
The result is bit-for-bit ``torch.nn.utils.clip_grad_norm_`` (tested), and nothing makes a host
sync: the clip coefficient is clamped on the device instead of being tested with a Python ``if``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.utils._foreach_utils import (_device_has_foreach_support, _group_tensors_by_device_and_dtype,
                                        _has_foreach_support)

from . import distributed
from .precision import round_float32

Params = torch.Tensor | Iterable[torch.Tensor]


@torch.no_grad()
def _total_norm_torch24(tensors: Sequence[torch.Tensor], norm_type: float = 2.0,
                        error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    """``get_total_norm`` as torch 2.4 and 2.5 compute it, for those versions: they have none, public
    or private (it appeared in 2.6), only the same lines inside ``clip_grad_norm_``. Copied from
    2.4's ``clip_grad_norm_``: per device and dtype, ``_foreach_norm`` where foreach runs (else a
    ``vector_norm`` each), then the norm of the stacked norms on the first tensor's device; so
    the guard's norm stays bit-for-bit that torch's recipe (tested against the real one)."""
    tensors = list(tensors)
    norm_type = float(norm_type)
    if not tensors:
        return torch.tensor(0.0)
    first_device = tensors[0].device
    norms: list[torch.Tensor] = []
    for (device, _), ([group], _) in _group_tensors_by_device_and_dtype([tensors]).items():  # type: ignore[assignment]
        if (foreach is None and _has_foreach_support(group, device)) or (foreach and _device_has_foreach_support(device)):
            norms.extend(torch._foreach_norm(group, norm_type))
        elif foreach:
            raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
        else:
            norms.extend(torch.linalg.vector_norm(g, norm_type) for g in group)
    total = torch.linalg.vector_norm(torch.stack([n.to(first_device) for n in norms]), norm_type)
    if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite")
    return total


try:  # torch >= 2.6
    from torch.nn.utils import get_total_norm
except ImportError:  # torch 2.4/2.5 (review 54e: the fallback imported a private _get_total_norm they lack)
    get_total_norm = _total_norm_torch24

# torch.nn.utils.clip_grads_with_norm_ divides by (total_norm + 1e-6); the post-clip norm we
# report is derived from the same coefficient, so it is what the clip really did.
_EPS = 1e-6
_EPS_F32 = round_float32(_EPS)  # (the scalar as a float32 kernel adds it)


class GradSet:
    """The gradients of some parameters, looked up once for both halves of a step's clip: their
    global norm (:meth:`norm`) and the multiply by the clip factor (:meth:`scale_`).

    ``grads`` are the gradients, ``values`` what is measured: a sparse gradient
    (``nn.Embedding(sparse=True)``) by the values it holds, coalesced (duplicate indices
    summed), as ``GradScaler`` checks it. The methods build no
    autograd graph as long as the gradients do not require grad (a plain backward's never do);
    :func:`global_l2_norm` and :func:`scale_grads_` wrap them in ``no_grad`` for any caller.

    Example::

        >>> a = torch.nn.Parameter(torch.zeros(1)); a.grad = torch.tensor([3.0])
        >>> b = torch.nn.Parameter(torch.zeros(1)); b.grad = torch.tensor([4.0])
        >>> grads = GradSet([a, b, torch.nn.Parameter(torch.zeros(1))])  # (no gradient: left out)
        >>> grads.norm().item()
        5.0
        >>> grads.scale_(torch.tensor(0.5)); a.grad.item(), b.grad.item()
        (1.5, 2.0)
    """

    __slots__ = ("params", "grads", "values", "norms", "_one_group", "_device")

    def __init__(self, parameters: Params) -> None:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        self._device = params[0].device if params else torch.device("cpu")  # (a norm of no gradients: 0 there)
        grads = [p.grad for p in params]
        if any(g is None for g in grads):
            if all(g is None for g in grads):
                _refuse_gradients(params)
            params = [p for p, g in zip(params, grads) if g is not None]
            grads = [g for g in grads if g is not None]
        self.params, self.grads = params, grads
        # each gradient's own norm, once :meth:`norm` has taken them on its way (one foreach group)
        self.norms: list[torch.Tensor] | None = None
        self._one_group = bool(grads) and _one_foreach_group(grads)  # (dense: the values are the gradients)
        self.values = grads if self._one_group else [grad_values(g) for g in grads]

    def norm(self) -> torch.Tensor:
        """The global L2 norm, a 0-dim device tensor (``inf``/``nan`` if any gradient is; 0 with none)."""
        if not self.values:
            return torch.zeros((), device=self._device)
        if self._one_group:  # get_total_norm's own operations for its one group, minus its wrappers
            self.norms = torch._foreach_norm(self.values, 2.0)
            return torch.linalg.vector_norm(torch.stack(self.norms), 2.0)
        return get_total_norm(self.values, norm_type=2.0, error_if_nonfinite=False, foreach=None)

    def norm_of(self, parameters: Sequence[torch.Tensor]) -> torch.Tensor:
        """The global L2 norm of some of these parameters' gradients: from the per-parameter
        norms :meth:`norm` took, when it took them (no second pass over the gradients), else
        measured anew (:func:`global_l2_norm`).

        Example::

            >>> a = torch.nn.Parameter(torch.zeros(1)); a.grad = torch.tensor([3.0])
            >>> b = torch.nn.Parameter(torch.zeros(2)); b.grad = torch.tensor([4.0, 12.0])
            >>> grads = GradSet([a, b]); _ = grads.norm()
            >>> grads.norm_of([b]).item(), grads.norm_of([a, b]).item()
            (12.649110794067383, 13.0)
        """
        by_param = self.norms_by_param()
        if not by_param:
            return global_l2_norm(parameters)
        taken = [by_param[id(p)] for p in parameters if id(p) in by_param]
        return torch.linalg.vector_norm(torch.stack(taken), 2.0) if taken else torch.zeros((), device=self._device)

    def norms_by_param(self) -> dict[int, torch.Tensor]:
        """Each gradient's own norm by ``id`` of its parameter, where :meth:`norm` took them (else empty).

        Example::

            >>> w = torch.nn.Parameter(torch.zeros(2)); w.grad = torch.tensor([3.0, 4.0])
            >>> grads = GradSet([w]); _ = grads.norm()
            >>> grads.norms_by_param()[id(w)].item()
            5.0
        """
        return {} if self.norms is None else {id(p): n for p, n in zip(self.params, self.norms)}

    def scale_(self, factor: torch.Tensor | float) -> None:
        """Every gradient multiplied by ``factor`` in place, with the foreach kernel per device
        and dtype, as ``clip_grads_with_norm_`` does it.

        A float (the exact step's factor, taken on the host: :func:`clip_coefficient_value`) is a
        value of the gradients' dtype and multiplies them as a 0-dim tensor of it would: on a CPU
        as such a tensor (``_foreach_mul_`` takes one ~3x faster than a Python scalar there), on an
        accelerator as the kernel's scalar argument (a host tensor would be copied over first).
        The choice is made here, so the step passes the value either way."""
        if not self.grads:
            return
        if not isinstance(factor, torch.Tensor):
            factor = self._operand(factor)
            if not isinstance(factor, torch.Tensor):
                torch._foreach_mul_(self.grads, factor)
                return
        if self._one_group:
            torch._foreach_mul_(self.grads, factor.to(self.grads[0].device))
            return
        for (device, _), ([group], _) in _group_tensors_by_device_and_dtype([self.grads]).items():  # type: ignore[assignment]
            on_device = factor.to(device)
            if _has_foreach_support(group, device):
                torch._foreach_mul_(group, on_device)
            else:
                for g in group:
                    g.mul_(on_device)


    def _operand(self, value: float) -> torch.Tensor | float:
        """A float factor as :meth:`scale_` multiplies by it: the value itself for one foreach
        group on an accelerator, else a 0-dim CPU tensor (of the group's dtype where that is a
        :data:`HOST_ROUNDED` one, whose values the host's factors are; float64, exact for any
        value, for other gradients)."""
        grad = self.grads[0]
        if self._one_group and grad.device.type != "cpu":
            return value
        return torch.scalar_tensor(value, dtype=grad.dtype if self._one_group and grad.dtype in HOST_ROUNDED
                                   else torch.float64)


def grad_values(grad: torch.Tensor) -> torch.Tensor:
    """A gradient's values: itself, or a sparse one's coalesced values (duplicate indices summed).

    Example::

        >>> sparse = torch.sparse_coo_tensor([[0, 0, 2]], [1.0, 2.0, 4.0], (4,))
        >>> grad_values(sparse).tolist(), grad_values(torch.ones(2)).tolist()
        ([3.0, 4.0], [1.0, 1.0])
    """
    return grad.coalesce().values() if grad.is_sparse else grad


@torch.no_grad()
def global_l2_norm(parameters: Params) -> torch.Tensor:
    """The global L2 norm of the gradients, a 0-dim device tensor (``inf``/``nan`` if any is).

    No host sync (reading it with ``float()`` costs a host sync on an accelerator). Parameters
    without a gradient are ignored; with none at all the norm is 0.

    Example::

        >>> a = torch.nn.Parameter(torch.zeros(1)); a.grad = torch.tensor([3.0])
        >>> b = torch.nn.Parameter(torch.zeros(1)); b.grad = torch.tensor([4.0])
        >>> float(global_l2_norm([a, b]))  # sqrt(3**2 + 4**2), not a norm per parameter
        5.0
        >>> float(global_l2_norm([torch.nn.Parameter(torch.zeros(1))]))  # no gradient at all
        0.0
    """
    return GradSet(parameters).norm()


def _refuse_gradients(tensors: Sequence[torch.Tensor]) -> None:
    """Refuse tensors that cannot hold a gradient: a frozen parameter is skipped (it has none), so
    ``has_non_finite_grad([p.grad for p in params])`` would say ``False`` for NaN gradients.

    Checked only when no tensor given has a ``.grad`` (the step's path never gets here)::

        >>> w = torch.nn.Parameter(torch.zeros(2)); w.grad = torch.tensor([1.0, float("nan")])
        >>> GradSet([w.grad])
        Traceback (most recent call last):
        TypeError: given a tensor that is neither a parameter nor requires grad (a gradient?): pass the parameters, whose .grad is read
    """
    if any(not isinstance(t, torch.nn.Parameter) and not t.requires_grad for t in tensors):
        raise TypeError("given a tensor that is neither a parameter nor requires grad (a gradient?): "
                        "pass the parameters, whose .grad is read")


def _one_foreach_group(tensors: list[torch.Tensor]) -> bool:
    """Plain dense (not sparse) tensors on one device, of one dtype, where foreach kernels run: the case in
    which ``get_total_norm`` and ``clip_grads_with_norm_`` make one foreach call (the step's
    usual case; a DTensor, a second dtype or device takes PyTorch's own grouping)."""
    first = tensors[0]
    device, dtype = first.device, first.dtype
    return (all(type(t) is torch.Tensor and t.device == device and t.dtype == dtype and not t.is_sparse
                for t in tensors) and _device_has_foreach_support(device))


def check_max_norm(max_norm: Any) -> None:
    """Raise unless ``max_norm`` is None, a real number or a one-element tensor, and not NaN
    (NaN is neither a threshold nor "off": ``clip_grad_norm_`` turns every gradient into NaN
    with it, and ``max_norm > 0`` read it as "clipping off"). ``Guard()`` and
    :func:`clip_global_l2_norm` both check it.

    Example::

        >>> check_max_norm(1.0); check_max_norm(None); check_max_norm(torch.tensor(2.0))
        >>> check_max_norm(float("nan"))
        Traceback (most recent call last):
        ...
        ValueError: max_norm must be a number or None, got nan
    """
    if max_norm is None:
        return
    if isinstance(max_norm, bool) or not isinstance(max_norm, (numbers.Real, torch.Tensor)):
        raise TypeError(f"max_norm must be a number or None, got {max_norm!r} (a {type(max_norm).__name__})")
    if isinstance(max_norm, torch.Tensor) and (max_norm.numel() != 1 or not max_norm.is_floating_point()):
        raise TypeError(f"max_norm must be a number or None, got a tensor of {max_norm.numel()} "
                        f"{str(max_norm.dtype).removeprefix('torch.')} values")
    if not max_norm == max_norm:
        raise ValueError("max_norm must be a number or None, got nan")


def clip_threshold(max_norm: float | None) -> float | None:
    """The clip threshold, or None when clipping is off (``max_norm`` null, 0 or negative): the
    one place that reads "clipping off".

    Example::

        >>> clip_threshold(1.0), clip_threshold(0.0), clip_threshold(-1), clip_threshold(None)
        (1.0, None, None, None)
    """
    if isinstance(max_norm, torch.Tensor):  # read once, as PyTorch's clip reads it (``float(max_norm)``)
        max_norm = float(max_norm)
    return max_norm if max_norm is not None and max_norm > 0 else None


@torch.no_grad()
def clip_to_norm_(parameters: Params, max_norm: float | None, pre: torch.Tensor) -> torch.Tensor:
    """Scale gradients in place so their global norm ``pre`` becomes at most ``max_norm``.

    Returns the post-clip norm, ``pre * min(1, max_norm / (pre + 1e-6))`` (the factor the
    gradients were really multiplied by), capped at ``max_norm`` so float32 rounding of the
    product never reports a norm an ulp above the threshold; computed on the device (no host
    sync). ``max_norm`` of ``None`` or ``<= 0`` leaves the gradients alone and returns ``pre``.

    Example::

        >>> w = torch.nn.Parameter(torch.zeros(2)); w.grad = torch.tensor([3.0, 4.0])
        >>> post = clip_to_norm_([w], 2.5, global_l2_norm([w]))
        >>> round(float(post), 4), [round(g, 4) for g in w.grad.tolist()]
        (2.5, [1.5, 2.0])
        >>> float(clip_to_norm_([w], None, torch.tensor(7.0)))  # disabled: pre comes back
        7.0
    """
    factor, post = clip_factor(pre, max_norm)  # the factor clip_grads_with_norm_ computes, once
    if factor is not None:
        scale_grads_(parameters, factor)
    return post


def clip_factor(pre: torch.Tensor, max_norm: float | None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The clip's scalar half: ``(factor, post)``, the factor ``min(1, max_norm / (pre + 1e-6))``
    that ``clip_grads_with_norm_`` multiplies the gradients by (:func:`clip_coefficient`) and the
    post-clip norm :func:`clip_to_norm_` reports (:func:`post_clip_norm`); ``(None, pre)`` when
    clipping is off. No host sync.

    Example::

        >>> factor, post = clip_factor(torch.tensor(4.0), 1.0)  # 1 / (4 + 1e-6), as PyTorch's clip
        >>> round(factor.item(), 6), round(post.item(), 6)
        (0.25, 1.0)
        >>> clip_factor(torch.tensor(4.0), None)
        (None, tensor(4.))
    """
    factor = clip_coefficient(pre, max_norm)
    return (None, pre) if factor is None else (factor, post_clip_norm(pre, factor, max_norm))  # type: ignore[arg-type]


def clip_coefficient(pre: torch.Tensor, max_norm: float | None) -> torch.Tensor | None:
    """``min(1, max_norm / (pre + 1e-6))`` on the device, computed with the operations
    ``clip_grads_with_norm_`` uses; ``None`` when clipping is off.

    Example::

        >>> clip_coefficient(torch.tensor(0.5), 1.0).item(), clip_coefficient(torch.tensor(0.5), 0.0)
        (1.0, None)
    """
    max_norm = clip_threshold(max_norm)
    return None if max_norm is None else coefficient(pre, max_norm)


def coefficient(pre: torch.Tensor, threshold: float | torch.Tensor) -> torch.Tensor:
    """:func:`clip_coefficient` for a threshold that is on: a number, or a 0-dim tensor on
    ``pre``'s device (the compiled sync-free tail's: an input of its graph, where a number is a
    constant that dynamo compiles the graph again for at each new value).

    Example::

        >>> coefficient(torch.tensor(3.0), 1.0).item() == coefficient(torch.tensor(3.0), torch.tensor(1.0)).item()
        True
    """
    # ``max_norm / (pre + 1e-6)`` is ``reciprocal() * max_norm`` in PyTorch (Tensor.__rdiv__):
    # the same kernels, called without the operator's Python wrapper, on the temporary in place
    return (pre + _EPS).reciprocal_().mul_(threshold).clamp_(max=1.0)


def factor_on_host(grads: GradSet, pre: torch.Tensor, max_norm: float | None) -> bool:
    """Whether the exact step takes the clip factor on the host, from the norm its one read brings
    (:func:`clip_coefficient_value`: four kernels and one element of the read fewer a step, review
    54f), rather than on the device before the read: when clipping is on, the norm is of a
    :data:`HOST_ROUNDED` dtype and the gradients are one foreach group of that dtype (their float
    factor then multiplies them as the factor tensor would, :meth:`GradSet.scale_`). Else, and
    always on the sync-free path, which reads nothing, the device computes it.

    Example::

        >>> w = torch.nn.Parameter(torch.zeros(2)); w.grad = torch.tensor([3.0, 4.0]); grads = GradSet([w])
        >>> factor_on_host(grads, grads.norm(), 1.0), factor_on_host(grads, grads.norm(), None)
        (True, False)
        >>> factor_on_host(grads, grads.norm().half(), 1.0)  # (a half norm: each device op rounds to it)
        False
    """
    return (pre.dtype in HOST_ROUNDED and grads._one_group and grads.grads[0].dtype == pre.dtype
            and clip_threshold(max_norm) is not None)


def clip_coefficient_value(pre: float, max_norm: float, dtype: torch.dtype) -> float:
    """:func:`clip_coefficient` on the host, from the value of ``pre`` read back, bit for bit what
    the device computes for a ``dtype`` in :data:`HOST_ROUNDED` (review 54f; tested over many norms
    against the device). Float64: the same four IEEE double operations. Float32: each of the
    device's float32 operations (``pre + 1e-6``, the reciprocal, ``x max_norm``, the clamp at 1)
    is computed in a double and rounded to float32 once, which is the float32 operation's own
    result: a sum, product or quotient of two float32 values, computed to 53 bits and rounded to
    24, is never double-rounded wrong since 53 >= 2 x 24 + 2; the scalars (``1e-6``,
    ``max_norm``) become float32 first, as the kernels' scalars do. ``pre`` is finite and >= 0
    (a non-finite norm skips the step: no factor is applied). ``max_norm`` is on (> 0). One
    difference left (review 54i): under ``torch.set_flush_denormal(True)`` a factor below float32's
    smallest normal (a finite norm above ~1e38 times ``max_norm``) is flushed to 0 by the kernels,
    not by the host; either leaves the gradients at ~0.

    Example::

        >>> all(clip_coefficient_value(v, m, torch.float32) == clip_coefficient(torch.tensor(v), m).item()
        ...     for v in (0.0, 1e-7, 0.5, 0.999999, 1.0, 3.7, 1e30, 3e38) for m in (1.0, 0.3, 5.0))
        True
        >>> clip_coefficient_value(4.0, 1.0, torch.float32)  # (1 / (4 + 1e-6), in float32)
        0.24999994039535522
    """
    max_norm = float(max_norm)  # (a one-element tensor threshold, as clip_threshold reads it)
    if dtype == torch.float64:
        return min(1.0 / (pre + _EPS) * max_norm, 1.0)
    if dtype != torch.float32:
        raise ValueError(f"clip_coefficient_value rounds float32 and float64, not {dtype}")
    shifted = round_float32(pre + _EPS_F32)  # (> 0: pre >= 0)
    inverse = round_float32(1.0 / shifted) if shifted else math.inf
    return min(round_float32(inverse * round_float32(max_norm)), 1.0)


def post_clip_norm(pre: torch.Tensor, factor: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``pre * factor`` (the factor the gradients were really multiplied by), capped at
    ``max_norm`` so float32 rounding of the product never reports a norm an ulp above it (a
    ``max_norm`` past the dtype's largest number caps nothing: the clamp takes that largest,
    where the number itself would not convert)."""
    return (pre * factor).clamp_(max=min(float(max_norm), torch.finfo(pre.dtype).max))


# the dtypes whose post-clip norm :func:`post_clip_value` computes on the host, bit for bit
HOST_ROUNDED = (torch.float32, torch.float64)


def post_clip_value(pre: float, factor: float, max_norm: float, dtype: torch.dtype) -> float:
    """:func:`post_clip_norm` on the host, from the values of ``pre`` and ``factor`` read back,
    bit for bit what the device computes for a ``dtype`` in :data:`HOST_ROUNDED`: a product
    of two float32 values is exact in a double, so rounding it to float32 once is the device's
    float32 multiply; ``max_norm`` becomes a float32 as the clamp's scalar does. The exact step
    takes the post-clip norm this way, two kernels fewer per step.

    Example::

        >>> pre = torch.tensor(3.7); factor = clip_coefficient(pre, 1.0)
        >>> post_clip_value(pre.item(), factor.item(), 1.0, torch.float32) == post_clip_norm(pre, factor, 1.0).item()
        True
    """
    max_norm = float(max_norm)  # (a one-element tensor threshold, as clip_threshold reads it)
    if dtype == torch.float64:
        return min(pre * factor, max_norm)
    if dtype != torch.float32:
        raise ValueError(f"post_clip_value rounds float32 and float64, not {dtype}")
    return min(round_float32(pre * factor), round_float32(max_norm))


@torch.no_grad()
def scale_grads_(parameters: Params, factor: torch.Tensor) -> None:
    """The clip's other half: every gradient multiplied by ``factor`` in place, with the foreach
    kernel per device and dtype, as ``clip_grads_with_norm_`` does it.

    Example::

        >>> w = torch.nn.Parameter(torch.ones(2)); w.grad = torch.tensor([3.0, 4.0])
        >>> scale_grads_([w], torch.tensor(0.5)); w.grad.tolist()
        [1.5, 2.0]
    """
    GradSet(parameters).scale_(factor)


def clip_global_l2_norm(
    parameters: Params, max_norm: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip gradients in place to a global L2 norm of ``max_norm``; return ``(pre, post)``.

    ``pre`` is the global norm before clipping (it may be ``inf`` or ``nan``: that is how a
    non-finite gradient is detected), ``post`` the norm after it. Both are 0-dim device tensors;
    ``float()`` gives the value (and costs a host sync on an accelerator). ``max_norm`` of
    ``None`` or ``<= 0`` disables clipping (``post`` is ``pre``). The result is bit-for-bit
    ``torch.nn.utils.clip_grad_norm_``, which returns only ``pre``.

    No host sync: the clip factor is ``min(1, max_norm / (pre + 1e-6))`` computed on the
    device, exactly as ``torch.nn.utils.clip_grad_norm_`` computes it.

    Example::

        >>> w = torch.nn.Parameter(torch.zeros(2)); w.grad = torch.tensor([3.0, 4.0])
        >>> pre, post = clip_global_l2_norm([w], max_norm=1.0)
        >>> float(pre), round(float(post), 4)
        (5.0, 1.0)
    """
    check_max_norm(max_norm)
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    pre = global_l2_norm(params)
    return pre, clip_to_norm_(params, max_norm, pre)


@torch.no_grad()
def has_non_finite_grad(parameters: Params) -> bool:
    """True if any gradient holds ``inf`` or ``nan``.

    A convenience for users and tests: it returns a Python ``bool`` and so reads one value on
    the host. The guarded step does not call it; it reads the same fact off the global norm,
    which is non-finite whenever some gradient element is (and also when the norm itself
    overflows, a gradient no update should use either).

    Sharded gradients (FSDP2's DTensors) are checked shard by shard and the answer is agreed
    over the process group (``distributed.any_ranks``: one all-reduce, a collective, so call it
    on every rank): true on every rank when any rank's shard holds a non-finite value. Other
    gradients are checked as they are on this rank (DDP's, once all-reduced, are the same on
    every rank).

    Example::

        >>> w = torch.nn.Parameter(torch.zeros(2)); w.grad = torch.tensor([1.0, float("inf")])
        >>> has_non_finite_grad([w])
        True
    """
    grads = GradSet(parameters).values
    if not grads:
        return False
    sharded = [callable(getattr(g, "to_local", None)) for g in grads]
    local = [g.to_local() if s else g for g, s in zip(grads, sharded)]
    device = local[0].device
    flags = torch.stack([torch.isfinite(g).all().to(device) for g in local])
    bad = not bool(flags.all())
    if any(sharded):
        bad = distributed.any_ranks([bad], device)[0]
    return bad
