"""Early warnings from the value ranges: per-layer headroom, and per-parameter gradient norms at
every skipped step.

**Headroom** (``monitor.headroom.every: N``; off by default). Every N-th step (``step % N == 0``)
:class:`Headroom` puts a forward hook on every module that holds parameters of its own
(``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm``, a custom module's own ``nn.Parameter``...),
with a pre-hook on its inputs (those no measured module output and no earlier one took in: what
the code between modules computed, a gated MLP's ``silu(w1 x) * w3 x``), a tensor hook on each
output, which sees the gradient flowing back into it, and one on each of its own parameters,
which sees their gradient (a weight's sums over the batch: often the largest, the one that
overflows). What a module computes between modules is not an output of
any: an attention's logits ``q @ k.transpose(-2, -1)`` overflow fp16 first in a transformer, and
the softmax after them squashes them, so nothing downstream grows with them. So the measured
step also watches the products of the matmuls the model's own code calls (``torch.matmul``,
``@``, ``bmm``, ``baddbmm``, ``mm``, ``einsum``: :data:`MATMULS`, seen by a
``TorchFunctionMode``), as the ``matmul`` tensor of the innermost module whose forward computed
them (an attention module with no parameters of its own too). ``F.scaled_dot_product_attention``
keeps its logits inside itself, so for a call to it the probe computes them again beside it
(:func:`attention_logits`: ``q @ k.transpose(-2, -1)`` times the scale, in the dtype the call ran
in, the causal or boolean mask's entries left out): the ``matmul`` of the module that called it. A
math kernel computes them so and overflows with them; the fused ones keep them in float32, where
the row still says how large they grew. So are ``nn.MultiheadAttention``'s, inside
``F.multi_head_attention_forward`` (:func:`mha_logits`: projected again from the call's weights).
On a compiled model (``compile: true``, ``torch.compile`` inside the model) a measured step runs
eagerly (``torch.compiler.set_stance("force_eager")``, torch >= 2.6): dynamo compiled the model
without the hooks, and a graph it compiled keeps running without them (it does not recompile
for hooks added later), so a step measured under the graph saw no output nor its gradient; the
eager step sees what the eager model computes, the rounding of each op's own output, which a
fused graph may keep in float32 (a warning a little early, never late). Measure a compiled run
rarely: each measured step is an eager one. On an older torch the probe stays off a compiled
model, and its hooks are seen only when every step is measured (``every: 1``). For each (module, tensor:
:data:`TENSORS`) it keeps, on the device:

- ``amax``: the largest ``|value|`` (of the output, of the gradient of the output, or of the
  module's parameters' gradients), over every micro-batch of the step;
- ``headroom_bits = log2(format max / amax)``: how many doublings are left before the value
  overflows the run's low-precision format (:data:`FORMATS`: fp16 65504, bf16 ~3.39e38, fp8
  e4m3 448, e5m2 57344). It is ``inf`` when everything is zero, negative when the value is
  already beyond the format (a float32 tensor, e.g. a norm's output under autocast, overflows
  when the next op casts it), ``-inf`` once it is inf, ``nan`` when it holds a nan;
- ``underflow_share``: the share of the values with ``0 < |x| <`` the format's smallest normal
  number: subnormal in the format (they lose precision), or flushed to zero when cast into it.
  A value already flushed to zero in a half tensor cannot be told from a true zero, so for such
  tensors this is a lower bound.

Under fp16 the gradients in the backward are *scaled* by the loss scale: the hook sees (and
``headroom.csv`` records) the scaled gradient, the one that overflows. The dynamic scaler raises
the scale until a scaled gradient overflows and then halves it, so under fp16 a gradient's
headroom sinks towards 0-1 bits every ``scaler.growth_interval`` steps by design: the alert
judges a gradient without the scale (:meth:`Headroom.judged_bits`); the outputs' headroom is
what no scaler can fix.

The hooks exist only during a measured step (all removed when its micro-batches are done), so
the other steps pay nothing. A measured step pays: two small reductions per hooked tensor (``abs``,
``amax``, a count) on the device, and **one host read** after the step (all the numbers in one
transfer), then one ``headroom.csv`` row per (module, tensor). A module whose headroom falls
below ``monitor.headroom.alert_bits`` raises one ``headroom_alert`` (``ALERT`` on the console,
``events.jsonl``) naming the module, once per episode; ``headroom_clear`` when it is back,
:data:`CLEAR_MARGIN` above the threshold.

**Gradient norms at a skipped step** (:class:`SkipGradNorms`, always on in a run). While a
step's micro-batches run, a ``register_post_accumulate_grad_hook`` on each trainable parameter
keeps a reference to its gradient (no copy, no device work): the order in which backward
finished them is the record order. When the step was skipped, the norms of those gradients are
taken (one host read, on skipped steps only) and written to ``events.jsonl`` as a ``grad_norms``
event, the non-finite ones named in that order: the cheap part of ``ampguard locate``, for free.
On an applied step the references are dropped when the step's record is read: no host read, no
device work.
"""

from __future__ import annotations

import contextlib
import csv
import inspect
import math
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from . import distributed
from .clipping import GradSet, grad_values
from .errors import InputError, brief, failed_because
from .monitor import Event
from .watch import compiled_inside
from .records import StepRecord, format_number
from .sinks import CsvSink

HEADROOM_CSV = "headroom.csv"
"""The file name of the headroom telemetry in a run folder (beside ``steps.csv``)."""
HEADROOM_COLUMNS: tuple[str, ...] = ("step", "module", "tensor", "amax", "headroom_bits", "underflow_share")
"""``headroom.csv``'s header: one row per measured step, module and tensor (long format)."""
TENSORS: tuple[str, ...] = ("input", "output", "grad", "param_grad", "matmul")
"""What is measured of each module: its forward's ``input`` where no measured module's output is
it (what the code between modules computed: a gated MLP's ``silu(w1 x) * w3 x`` going into
``w2``, a residual stream going into a norm), its ``output``, the ``grad`` flowing back into it,
the gradient of its own parameters (``param_grad``: a weight's gradient sums over the batch, so
it is often the largest, and the one that overflows), and the products of the matmuls its
forward calls itself (``matmul``: an attention's logits)."""
UNSCALED: frozenset[str] = frozenset({"input", "output", "matmul"})
"""The tensors of the forward: no loss scale in them (the gradients carry it under fp16)."""
MATMULS = frozenset({torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__,
                     torch.bmm, torch.Tensor.bmm, torch.baddbmm, torch.Tensor.baddbmm, torch.mm, torch.Tensor.mm,
                     torch.addmm, torch.Tensor.addmm, torch.addbmm, torch.Tensor.addbmm, torch.einsum,
                     torch.tensordot})
"""The functions whose products are the ``matmul`` tensor, called by the model's own code
(``F.linear``, an ``nn.Linear``'s, is its ``output`` already; what a function computes inside
itself is not seen: the mode sees the call, not its insides; the logits of the two attention
functions are computed again beside the call, :data:`_ATTENTIONS`)."""
LOGITS_CHUNK = 2**22
"""The most logits :func:`attention_logits` and :func:`mha_logits` compute at once (16 MiB in
float32; with the reductions' temporaries a measured step holds about 6 times that more, whatever
the context's length): a long context's are taken a few (batch, head) slices, or query rows, at a
time (:func:`_parts`)."""
CLEAR_MARGIN = 1.0
"""A module's alert clears once its headroom is this many bits above ``alert_bits``, so a value
hovering at the threshold raises one alert, not one per measured step."""
ROOT = "(root)"
"""The name a model that holds parameters itself (``nn.Linear`` as the whole model) goes by."""


@dataclass(frozen=True)
class Format:
    """A floating-point format's range, from ``torch.finfo``: ``max`` (the largest finite value)
    and ``tiny`` (the smallest normal one; below it values are subnormal, then zero).

    Example::

        >>> f = FORMATS["fp16"]
        >>> f.max, f.tiny, FORMATS["fp8_e4m3"].max, FORMATS["fp8_e5m2"].max
        (65504.0, 6.103515625e-05, 448.0, 57344.0)
    """

    name: str
    dtype: torch.dtype

    @property
    def max(self) -> float:
        return float(torch.finfo(self.dtype).max)

    @property
    def tiny(self) -> float:
        return float(torch.finfo(self.dtype).tiny)


FORMATS: dict[str, Format] = {name: Format(name, dtype) for name, dtype in (
    ("fp16", torch.float16), ("bf16", torch.bfloat16), ("fp32", torch.float32),
    ("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2))}
"""The formats headroom is measured against (``monitor.headroom.format``); ``fp8_e4m3`` and
``fp8_e5m2`` are PyTorch's ``float8_e4m3fn`` (max 448) and ``float8_e5m2`` (max 57344)."""


def headroom_bits(amax: float, fmt: Format) -> float:
    """``log2(fmt.max / amax)``: the doublings left before ``amax`` overflows ``fmt``.

    Example::

        >>> fp16 = FORMATS["fp16"]
        >>> headroom_bits(65504 / 8, fp16), headroom_bits(0.0, fp16), headroom_bits(float("inf"), fp16)
        (3.0, inf, -inf)
        >>> headroom_bits(131008.0, fp16), math.isnan(headroom_bits(float("nan"), fp16))
        (-1.0, True)
    """
    if math.isnan(amax):
        return math.nan
    if amax == 0:
        return math.inf
    if math.isinf(amax):
        return -math.inf
    return math.log2(fmt.max / amax)


def bits_shown(bits: float, bound: float) -> str:
    """``bits`` to one decimal, or as many more as it takes to stay on its side of ``bound``
    (3.9993 below an alert_bits of 4 is "3.999", not "4.0"); closer to it than six decimals
    tell, the side itself (an alert's upper bound, :func:`overflow_bound`: just below it).

    Example::

        >>> bits_shown(3.25, 4.0), bits_shown(3.9993, 4.0), bits_shown(4.5, 4.5), bits_shown(-math.inf, 4.0)
        ('3.2', '3.999', '4.5', '-inf')
        >>> bits_shown(math.nextafter(4.0, -math.inf), 4.0)
        '< 4.0'
    """
    for digits in range(1, 7):
        text = f"{bits:.{digits}f}"
        if (float(text) < bound) == (bits < bound):
            return text
    return f"{'<' if bits < bound else '>='} {bound!r}"


class _Measured:
    """The tensors one measured forward has measured, each with its version counter then (bumped
    by each in-place change; none for an inference tensor, whose reading raised): a tensor is
    measured the first time a module takes it in or hands it on, and again once changed in place
    (``h.mul_(16)`` between two modules); held weakly.

    Example::

        >>> measured, x = _Measured(), torch.ones(2)
        >>> measured.first_time(x), measured.first_time(x), measured.first_time(x.mul_(2))
        (True, False, True)
    """

    def __init__(self) -> None:
        self._seen: dict[int, tuple[weakref.ReferenceType[torch.Tensor], int | None]] = {}

    def first_time(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is new to this forward, or changed since it was measured; it counts as measured now."""
        version = None if t.is_inference() else t._version
        seen = self._seen.get(id(t))
        if seen is not None and seen[0]() is t and seen[1] == version:
            return False
        self._seen[id(t)] = (weakref.ref(t), version)
        return True


def judged_bits(row: HeadroomRow, scale: float | None, alert_bits: float, floor: float = 1.0) -> float | None:
    """The headroom ``row`` is judged by (the alert, and the report's heatmap): an output's own;
    a gradient's without the loss ``scale`` its step ran with down to the scaler's ``floor``
    (``scaler.min_scale``; 1 or below: the unscaled gradient's, ``bits + log2(scale)``), what
    fp16 holds of it with all the help the scaler can give: a scaled gradient overflowing is the
    scaler's search (one skip, then a halved scale), not a warning, unless the scale cannot come
    down enough (at its floor, it cannot come down at all). None when the row says nothing: a
    nan, or a scaled gradient that overflowed at a scale above ``2**alert_bits`` times the floor
    (its unscaled size is unknown beyond ``> max / scale``). One that overflowed at a smaller
    scale is ``-inf``, below every other row of its module (the heatmap's dark red, the one an
    alert names); its headroom is below :func:`overflow_bound`, which its alert reports.

    Example::

        >>> [judged_bits(HeadroomRow(1, "fc", t, 1.0, b, 0.0), 1024.0, 4.0)
        ...  for t, b in [("output", 3.0), ("grad", 3.0), ("grad", -math.inf), ("grad", math.nan)]]
        [3.0, 13.0, None, None]
        >>> judged_bits(HeadroomRow(1, "fc", "grad", math.inf, -math.inf, 0.0), 8.0, 4.0)  # overflowed at 2**3
        -inf
        >>> judged_bits(HeadroomRow(1, "fc", "grad", 1.0, 3.0, 0.0), 8192.0, 4.0, floor=4096.0)  # one halving left
        4.0
    """
    bits = row.headroom_bits
    if math.isnan(bits):
        return None
    room = _room(row, scale, floor)
    if room is None:
        return bits
    bound = overflow_bound(row, scale, floor)
    if bound is not None:  # overflowed scaled: headroom at the floor < bound (the alert says so: Headroom._message)
        return bits if bound <= alert_bits else None
    return bits + math.log2(room)


def _room(row: HeadroomRow, scale: float | None, floor: float) -> float | None:
    """How far the loss ``scale`` ``row``'s step ran with can come down (to the scaler's
    ``floor``): ``scale / floor``; None for a row no loss scale is in (its own headroom, a scale
    of none or 0, one at or below the floor)."""
    room = scale / max(floor, 1.0) if scale is not None and scale > 0 else None
    return None if row.tensor in UNSCALED or room is None or room <= 1.0 else room


def overflow_bound(row: HeadroomRow, scale: float | None, floor: float = 1.0) -> float | None:
    """For a gradient that overflowed scaled (``-inf`` bits) at a loss ``scale`` above the
    scaler's ``floor``: the headroom it has at most without the scale, down to the floor,
    ``log2(scale / floor)`` (its unscaled amax is above ``max / scale``): an upper bound, the
    true figure strictly below it. None for any other row.

    Example::

        >>> overflow_bound(HeadroomRow(1, "fc", "param_grad", math.inf, -math.inf, 0.0), 16.0)
        4.0
        >>> overflow_bound(HeadroomRow(1, "fc", "param_grad", 1.0, 3.0, 0.0), 16.0)  # (its headroom is known)
    """
    room = _room(row, scale, floor)
    bits = row.headroom_bits
    return math.log2(room) if room is not None and math.isinf(bits) and bits < 0 else None


@dataclass(frozen=True)
class HeadroomRow:
    """One ``headroom.csv`` row.

    Example::

        >>> HeadroomRow(100, "fc", "grad", 8188.0, 3.0, 0.25).cells()
        ['100', 'fc', 'grad', '8188.0', '3.0', '0.25']
    """

    step: int
    module: str
    tensor: str
    amax: float
    headroom_bits: float
    underflow_share: float

    def cells(self) -> list[str]:
        return [str(self.step), self.module, self.tensor, format_number(self.amax), format_number(self.headroom_bits),
                format_number(self.underflow_share)]


def measured_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules :class:`Headroom` measures: every one that holds parameters of its own, by
    qualified name (the model itself is :data:`ROOT`), in registration order.

    Example::

        >>> model = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.LayerNorm(4), nn.Linear(4, 1))
        >>> [name for name, _ in measured_modules(model)]
        ['0', '2', '3']
        >>> [name for name, _ in measured_modules(nn.Linear(2, 1))]
        ['(root)']
    """
    return [(name or ROOT, m) for name, m in model.named_modules()
            if next(m.parameters(recurse=False), None) is not None]


@contextlib.contextmanager
def _installed(handles: list[RemovableHandle]) -> Iterator[None]:
    """The hooks behind ``handles`` for the time of the block: removed on the way out, also on an error.

    Example::

        >>> model, calls = nn.Linear(1, 1), []
        >>> with _installed([model.register_forward_hook(lambda *_: calls.append("seen"))]):
        ...     _ = model(torch.ones(1, 1))
        >>> _ = model(torch.ones(1, 1))  # after the block: no hook
        >>> calls
        ['seen']
    """
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _plain_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` whose only product is its output: its own forward, or torchao's ``Float8Linear``.

    Example::

        >>> class Lora(nn.Linear):
        ...     def forward(self, x):
        ...         return super().forward(x) + x @ self.weight.T
        >>> _plain_linear(nn.Linear(1, 1)), _plain_linear(Lora(1, 1)), _plain_linear(nn.ReLU())
        (True, False, False)
    """
    return isinstance(module, nn.Linear) and (type(module).forward is nn.Linear.forward
                                              or type(module).__name__ == "Float8Linear")


def attention_logits(args: tuple[Any, ...], kwargs: dict[str, Any], chunk: int = LOGITS_CHUNK) -> Iterator[torch.Tensor]:
    """The logits a ``F.scaled_dot_product_attention(*args, **kwargs)`` call computed inside
    itself: ``q @ k.transpose(-2, -1)``, each factor times the square root of the scale (1/sqrt of
    the head size unless ``scale`` is given), as its math kernel does, in the dtype the call's
    matmul runs in (autocast's, or the inputs'), without autograd; with a causal or boolean mask,
    or a float one's ``-inf`` entries (its other values are not added: the product is what
    overflows), only the entries it keeps, flat. Yielded in parts of at most about ``chunk`` values
    (:func:`_parts`: a batch, a head at a time); nothing for inputs the probe cannot read as plain
    tensors (nested, sparse, not floating).

    Example (two rows of ones, head size 16: each logit 16 / sqrt(16); causal: the first row sees
    one key, three logits a head, kept flat; one head's per chunk of 4, :func:`_parts`)::

        >>> q = k = torch.ones(1, 2, 2, 16)
        >>> [t.tolist() for t in attention_logits((q, k, k), {"is_causal": True}, chunk=4)]
        [[4.0, 4.0, 4.0], [4.0, 4.0, 4.0]]
        >>> [t.amax().item() for t in attention_logits((q * 100, k, k), {"scale": 1.0})]
        [1600.0]
        >>> additive = torch.tensor([[0.0, -math.inf], [0.0, 0.0]])  # (a float mask: -inf is not attended)
        >>> [t.tolist() for t in attention_logits((q, k, k, additive), {})]  # (both heads' kept entries)
        [[4.0, 4.0, 4.0, 4.0, 4.0, 4.0]]
    """
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    given = {**dict(zip(names, args)), **kwargs}
    q, k, mask = given.get("query"), given.get("key"), given.get("attn_mask")
    if not (_plain(q) and _plain(k) and q.dim() >= 2 and k.dim() >= 2):
        return
    scale = given.get("scale")  # (a negative one flips the logits' sign, not their size)
    root = math.sqrt(abs(scale) if scale is not None else 1.0 / math.sqrt(q.size(-1)))
    if given.get("enable_gqa") and q.dim() >= 3 and k.size(-3) != q.size(-3):
        k = k.repeat_interleave(q.size(-3) // k.size(-3), dim=-3)
    keeps = []
    if isinstance(mask, torch.Tensor) and not given.get("is_causal"):  # (True: attended; float: -inf is not)
        keeps.append(mask if mask.dtype == torch.bool else mask != -math.inf)
    yield from _logits(q, k, root, keeps, chunk, causal=bool(given.get("is_causal")))


_MHA_PARAMETERS = tuple(inspect.signature(torch.nn.functional.multi_head_attention_forward).parameters)


def mha_logits(args: tuple[Any, ...], kwargs: dict[str, Any], chunk: int = LOGITS_CHUNK) -> Iterator[torch.Tensor]:
    """The logits an ``nn.MultiheadAttention`` computes inside ``F.multi_head_attention_forward(*args,
    **kwargs)`` (sequence first, as the module calls it): each head's ``q @ k.transpose(-2, -1) /
    sqrt(head size)``, ``q`` and ``k`` projected again from the call's own weights (packed or
    separate, with ``bias_k``), the entries ``attn_mask`` or ``key_padding_mask`` hides left out
    (True in a boolean one; ``-inf`` in a float one, as the module hands them on); as
    :func:`attention_logits` otherwise. Nothing for a call with
    ``static_k`` or inputs the probe cannot read.

    Example (one head of 16, every logit 8 * 8 * 16 / sqrt(16) = 256; the last key padded away)::

        >>> mha = nn.MultiheadAttention(16, 1, bias=False)
        >>> _ = mha.in_proj_weight.data.copy_(torch.eye(16).repeat(3, 1))
        >>> x = torch.full((2, 1, 16), 8.0)  # (length 2, batch 1)
        >>> seen = []
        >>> with _MatmulProbe(lambda t: seen.append(t)):
        ...     _ = mha(x, x, x, key_padding_mask=torch.tensor([[False, True]]))
        >>> seen[0].tolist()
        [256.0, 256.0]
    """
    given = {**dict(zip(_MHA_PARAMETERS, args)), **kwargs}
    query, key, heads = given.get("query"), given.get("key"), given.get("num_heads")
    if not (_plain(query) and _plain(key) and isinstance(heads, int) and heads > 0) or given.get("static_k") is not None:
        return
    assert isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor)
    masks = [given.get("attn_mask"), given.get("key_padding_mask")]
    if query.dim() == 2:  # (unbatched: a batch of one, as the call makes it)
        query, key = query.unsqueeze(1), key.unsqueeze(1)
        if isinstance(masks[1], torch.Tensor):
            masks[1] = masks[1].unsqueeze(0)
    length, batch, width = query.shape
    size = width // heads
    bias = given.get("in_proj_bias")
    if given.get("use_separate_proj_weight"):
        w_q, w_k = given.get("q_proj_weight"), given.get("k_proj_weight")
    else:
        w_q, w_k = given["in_proj_weight"][:width], given["in_proj_weight"][width:2 * width]
    with torch.no_grad():
        q = torch.nn.functional.linear(query, w_q, None if bias is None else bias[:width])
        k = torch.nn.functional.linear(key, w_k, None if bias is None else bias[width:2 * width])
        if given.get("bias_k") is not None:  # (one more key, which every mask lets through)
            k = torch.cat([k, given["bias_k"].repeat(1, batch, 1)])
        source = k.size(0)
        q = q.reshape(length, batch, heads, size).permute(1, 2, 0, 3)
        k = k.reshape(source, batch, heads, size).permute(1, 2, 0, 3)
    keeps = []  # (each applied to each part on its own: never one mask of the logits' whole size)
    for i, mask in enumerate(masks):
        if isinstance(mask, torch.Tensor) and mask.numel():
            hidden = mask if mask.dtype == torch.bool else mask == -math.inf
            kept = ~torch.nn.functional.pad(hidden, (0, source - mask.size(-1)), value=False)
            if i == 1:  # key_padding_mask: (batch, source)
                kept = kept.view(batch, 1, 1, source)
            elif kept.dim() == 3:  # attn_mask by batch and head: (batch * heads, length, source)
                kept = kept.view(batch, heads, length, source)
            keeps.append(kept)
    yield from _logits(q, k, size ** -0.25, keeps, chunk)


def _largest(tops: torch.Tensor) -> torch.Tensor:
    """The largest of a row's per-call ``tops`` (one per micro-batch and per matmul of the step, each
    :meth:`Headroom._add`'s) by the same rule as within one: inf where one is inf whatever NaNs lie
    beside it, nan where a NaN lies beside finite values only. ``amax`` alone let a NaN win: an
    attention's logits overflowing to inf, then its ``softmax(inf) @ v`` NaN, read nan (a row
    that says nothing) instead of overflowed, and the overflow went unannounced (review 61f).

    Example::

        >>> [_largest(torch.tensor(t)).item() for t in ([math.inf, math.nan], [1.0, math.nan], [1.0, 2.0])]
        [inf, nan, 2.0]
    """
    top = torch.nan_to_num(tops, nan=0.0, posinf=math.inf).amax()
    return torch.where(tops.isnan().any() & ~top.isinf(), math.nan, top)


def _plain(t: Any) -> bool:
    """A tensor the attention probes read: floating, dense, with values."""
    return (isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_nested and t.is_floating_point()
            and t.numel() > 0)


def _logits(q: torch.Tensor, k: torch.Tensor, root: float, keeps: list[torch.Tensor], chunk: int,
            causal: bool = False) -> Iterator[torch.Tensor]:
    """``(q * root) @ (k * root).transpose(-2, -1)`` without autograd, in parts of at most about
    ``chunk`` values (:func:`_parts`) when ``q`` and ``k`` have the same leading dimensions, else
    whole. With ``keeps`` (boolean masks that broadcast to the logits) or ``causal`` (top-left
    aligned), a part is the entries they keep, flat: the entries a mask hides are no logits of
    the call, neither in the largest nor in the underflow share's count."""
    with torch.no_grad():
        whole = iter([(q, k, keeps, 0)])
        for qi, ki, kept, row in _parts(q, k, keeps, chunk) if q.shape[:-2] == k.shape[:-2] else whole:
            logits = (qi * root) @ (ki * root).transpose(-2, -1)
            masks = list(kept)
            if causal:  # (this part's rows start at ``row`` of the whole)
                rows, keys = logits.size(-2), logits.size(-1)
                masks.append(torch.ones(rows, keys, dtype=torch.bool, device=logits.device).tril(row))
            if masks:
                keep = masks[0]
                for mask in masks[1:]:
                    keep = keep & mask
                logits = logits.masked_select(keep)
            yield logits


def _parts(q: torch.Tensor, k: torch.Tensor, keeps: list[torch.Tensor],
           budget: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], int]]:
    """``q``, ``k`` and the masks ``keeps`` cut into parts whose logits are at most ``budget``
    values, with the first query row of each: along the leading dimensions, outermost first,
    then, where one (query, key) matrix alone is more, in blocks of query rows (a long context's
    logits are never held whole). A mask is cut where it has that dimension, else broadcast.

    Example (batch 2 x heads 3, 4 x 4 logits each: 96 values)::

        >>> q = torch.ones(2, 3, 4, 8)
        >>> [tuple(p[0].shape) for p in _parts(q, q, [], budget=40)]
        [(2, 4, 8), (1, 4, 8), (2, 4, 8), (1, 4, 8)]
        >>> [tuple(p[0].shape) for p in _parts(q, q, [], budget=50)]
        [(1, 3, 4, 8), (1, 3, 4, 8)]
        >>> [(tuple(p[0].shape), p[3]) for p in _parts(torch.ones(5, 8), torch.ones(4, 8), [], budget=8)]
        [((2, 8), 0), ((2, 8), 2), ((1, 8), 4)]
    """
    keys = k.size(-2)
    total = q.numel() // q.size(-1) * keys
    if total <= budget:
        yield q, k, keeps, 0
        return
    if q.dim() <= 2:  # one (query, key) matrix: blocks of its rows
        step = max(1, budget // keys)
        for i in range(0, q.size(-2), step):
            cut = [m[..., i:i + step, :] if m.dim() >= 2 and m.size(-2) == q.size(-2) > 1 else m for m in keeps]
            yield q[i:i + step], k, cut, i
        return
    per = total // q.size(0)  # (the logits of one slice of the first dimension)
    step = max(1, budget // per)
    for i in range(0, q.size(0), step):
        cut = [m[i:i + step] if m.dim() == q.dim() and m.size(0) > 1 else m for m in keeps]
        if per <= budget:
            yield q[i:i + step], k[i:i + step], cut, 0
        else:  # (one slice is still too many: its own dimensions, the next in)
            yield from _parts(q[i], k[i], [m[0] if m.dim() == q.dim() else m for m in cut], budget)


_ATTENTIONS: dict[Callable[..., Any], Callable[..., Iterator[torch.Tensor]]] = {
    torch.nn.functional.scaled_dot_product_attention: attention_logits,
    torch.nn.functional.multi_head_attention_forward: mha_logits,
}
"""The attention functions whose logits the probe computes again beside the call."""


class _MatmulProbe(torch.overrides.TorchFunctionMode):
    """Hands ``seen`` the product of each :data:`MATMULS` call made in the block (a floating one
    with values), and the logits of each ``F.scaled_dot_product_attention`` call
    (:func:`attention_logits`). The mode is off inside its own handler, so ``seen``'s reductions
    are not seen.

    Example::

        >>> seen = []
        >>> with _MatmulProbe(lambda t: seen.append(t.shape)):
        ...     _ = torch.ones(2, 3) @ torch.ones(3, 4), torch.ones(2) + 1, torch.einsum("ij->i", torch.ones(2, 2))
        >>> seen
        [torch.Size([2, 4]), torch.Size([2])]
        >>> q = torch.ones(1, 2, 3, 4)
        >>> with _MatmulProbe(lambda t: seen.append(t.shape)):
        ...     _ = torch.nn.functional.scaled_dot_product_attention(q, q, q)
        >>> seen[-1]
        torch.Size([1, 2, 3, 3])
    """

    def __init__(self, seen: Callable[[torch.Tensor], None], wanted: Callable[[], bool] = lambda: True) -> None:
        super().__init__()
        self.seen, self.wanted = seen, wanted  # (wanted: whether a product made now is anyone's)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in MATMULS and _plain(out):  # (a sparse product has no reductions to take)
            self.seen(out)
        elif func in _ATTENTIONS and self.wanted():  # (logits computed again only for a module that keeps them)
            for logits in _ATTENTIONS[func](args, kwargs or {}):
                self.seen(logits)
        return out


_force_eager: Callable[[], contextlib.AbstractContextManager[Any]] | None = (
    (lambda: torch.compiler.set_stance("force_eager")) if hasattr(torch.compiler, "set_stance") else None)
"""A block in which compiled code runs eagerly (torch >= 2.6; ``None`` before)."""


class Headroom:
    """Headroom telemetry every ``every`` steps, for the modules of ``model`` (see the module
    docstring): :meth:`measuring` around a step's micro-batches, then :meth:`read` (one host read)
    and :meth:`observe` (the alerts). ``scaled_grads``: the gradients carry the fp16 loss scale
    (the alert says so). ``state_dict`` carries which modules are alerting, so a resumed run does
    not alert twice for one episode.

    Example (fp32 arithmetic, measured against fp16: the output of ``fc`` is 1000, 6 bits below
    65504; its weight's gradient sums the three rows' ones)::

        >>> model = nn.Sequential()
        >>> model.add_module("fc", nn.Linear(1, 1, bias=False))
        >>> _ = model.fc.weight.data.fill_(1000.0)
        >>> h = Headroom(model, "fp16", every=2, alert_bits=7.0)
        >>> for step in (1, 2):
        ...     with h.measuring(step):
        ...         model(torch.ones(3, 1)).sum().backward()
        >>> h.read(1), [(r.module, r.tensor, r.amax, round(r.headroom_bits, 2)) for r in h.read(2)]  # doctest: +NORMALIZE_WHITESPACE
        ([], [('fc', 'input', 1.0, 16.0), ('fc', 'output', 1000.0, 6.03), ('fc', 'grad', 1.0, 16.0),
              ('fc', 'param_grad', 3.0, 14.41)])
        >>> [e.message for e in h.observe_step(2)]
        ['headroom_alert: fc output headroom 6.0 bits < alert_bits 7 (amax 1000, fp16 max 65504)']
        >>> h.observe_step(2), h.alerting  # once per episode
        ([], ['fc'])
    """

    def __init__(self, model: nn.Module, fmt: Format | str, *, every: int, alert_bits: float,
                 scaled_grads: bool = False, loss_scale: Callable[[], torch.Tensor | float] | None = None,
                 scale_floor: float = 1.0, compiled: bool = False) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.format = FORMATS[fmt] if isinstance(fmt, str) else fmt
        self.every, self.alert_bits = every, alert_bits
        self.scaled_grads = scaled_grads or loss_scale is not None
        self.loss_scale = loss_scale
        self.scale_floor = scale_floor  # (the scaler's min_scale: the scale comes down no further)
        self.modules = measured_modules(model)
        every_module = [(name or ROOT, m) for name, m in model.named_modules()]
        self._order = {name: i for i, (name, _) in enumerate(every_module)}
        # (the matmul probe's: whose forward is running; an nn.Linear's own product, torchao's
        # Float8Linear's too, is its output already: None, not noted; a subclass with a forward of
        # its own, a LoRA layer's low-rank product, is noted)
        self._names = {id(m): None if _plain_linear(m) else name for name, m in every_module}
        # a compiled model is measured eagerly (:meth:`measuring`); None on a torch without the stance:
        # then no probe either (its mode would make dynamo compile the model again). ``compiled``: a
        # wrapper around ``model`` is (train's DDP wrapper compiled under torchrun: the model inside it
        # is not, and dynamo compiled these hooks at each measured step, up to its recompile limit)
        self._eager = _force_eager if compiled or compiled_inside(model) else contextlib.nullcontext
        self._step: int | None = None  # the step being (or last) measured
        self._stats: dict[tuple[str, str], list[tuple[torch.Tensor, torch.Tensor, int]]] = {}
        self._scale: torch.Tensor | float | None = None  # the loss scale of the step being measured
        self._rows: tuple[int, list[HeadroomRow]] | None = None
        self._row_scale: float | None = None  # the loss scale of the step whose rows are kept
        self._observed: int | None = None  # the last step observe_step judged
        self.alerting: list[str] = []

    def due(self, step: int) -> bool:
        """Whether ``step`` is measured: ``step % every == 0``.

        Example::

            >>> h = Headroom(nn.Linear(1, 1), "bf16", every=100, alert_bits=4.0)
            >>> h.due(99), h.due(100)
            (False, True)
        """
        return step % self.every == 0

    @contextlib.contextmanager
    def measuring(self, step: int) -> Iterator[None]:
        """Around one step's micro-batches: on a measured step, the hooks for the time of the
        block (removed on the way out, also on an error); on any other step, nothing at all."""
        if not self.due(step):
            yield
            return
        self._step, self._stats, self._rows = step, {}, None
        # the scale the step's backward multiplies by (a device copy: no host read; read with the rows)
        self._scale = self.loss_scale() if self.loss_scale is not None else None
        handles: list[RemovableHandle] = []
        # the tensors measured already in the forward: one is not measured again unless changed since
        measured = _Measured()
        handles += [m.register_forward_pre_hook(self._input_hook(name, measured), with_kwargs=True)
                    for name, m in self.modules]
        handles += [m.register_forward_hook(self._forward_hook(name, handles, measured)) for name, m in self.modules]
        hooked: set[int] = set()  # a tied parameter (charlm's head.weight is tok.weight): its first module's
        for name, m in self.modules:
            for p in m.parameters(recurse=False):
                if p.requires_grad and id(p) not in hooked:  # each backward's gradient of it, before accumulation
                    hooked.add(id(p))
                    handles.append(p.register_hook(self._param_hook(name)))
        probed = self._eager is not None
        with _installed(handles), (self._products(handles) if probed else contextlib.nullcontext()), \
                (self._eager() if probed else contextlib.nullcontext()):
            yield  # (on the way out the output tensors' hooks go too: an output that outlives the step keeps none)

    @contextlib.contextmanager
    def _products(self, handles: list[RemovableHandle]) -> Iterator[None]:
        """The ``matmul`` tensor: every module's forward (the process's hooks, for the block)
        noted on a stack, and a :class:`_MatmulProbe` adding the products to the innermost one."""
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        inside: list[str] = []

        def enter(module: nn.Module, args: Any) -> None:
            if id(module) in self._names:
                inside.append(self._names[id(module)])

        def leave(module: nn.Module, args: Any, output: Any) -> None:
            # called also when the forward raised (always_call: a checkpoint's recompute stops early
            # so): the stack goes back to where this module entered, nothing left above it
            if id(module) in self._names and (name := self._names[id(module)]) in inside:
                del inside[len(inside) - 1 - inside[::-1].index(name):]

        handles += [register_module_forward_pre_hook(enter), register_module_forward_hook(leave, always_call=True)]
        wanted = lambda: bool(inside and inside[-1])  # noqa: E731 - (the innermost module notes products)
        with _MatmulProbe(lambda value: self._add(inside[-1], "matmul", value) if wanted() else None, wanted):
            yield

    def _input_hook(self, name: str, measured: _Measured) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            for t in tree_leaves((args, kwargs)):  # (one measured already, and unchanged since, is its first module's row)
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() and measured.first_time(t):
                    self._add(name, "input", t)

        return hook

    def _forward_hook(self, name: str, handles: list[RemovableHandle],
                      measured: _Measured) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            for t in tree_leaves(output):  # (one measured already, unchanged, is the inner module's: a root's
                # own parameter made it a module of its own, and its output, the head's, alerted twice)
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() and measured.first_time(t):
                    self._add(name, "output", t)
                    if t.requires_grad:
                        handles.append(t.register_hook(lambda grad: self._add(name, "grad", grad)))

        return hook

    def _param_hook(self, name: str) -> Callable[[torch.Tensor], None]:
        return lambda grad: self._add(name, "param_grad", grad)

    def _add(self, name: str, tensor: str, value: torch.Tensor) -> None:
        """Device reductions only (no host read): the largest |value|, inf where one is inf
        whatever NaNs lie beside it (an overflow's ``softmax(inf)`` beside the inf logits of the
        same row: ``amax`` read nan, a row never judged, and the overflow went unannounced), nan
        where a NaN lies beside finite values only (it says nothing: the largest finite value of
        an overflowed gradient that a wide layer of mixed signs made NaN and a ReLU zeros read as
        0, infinite headroom, and cleared an alert), and the count of values between 0 and the
        format's smallest normal. A sparse gradient (``nn.Embedding(sparse=True)``) by its
        values; another layout is left out.

        Example::

            >>> h = Headroom(nn.Linear(1, 1), "fp16", every=1, alert_bits=4.0)
            >>> for step, value in enumerate(([math.nan, 0.0, 0.0], [math.nan, math.inf, 1.0], [2.0, -3.0])):
            ...     h._step = step
            ...     h._add(ROOT, "grad", torch.tensor(value)); print(h.read(step)[0].amax)
            nan
            inf
            3.0
        """
        if value.layout != torch.strided:
            if value.layout != torch.sparse_coo:
                return
            value = value.coalesce().values()
            if not value.numel():  # (a batch of padding_idx alone: no value to measure)
                return
        a = value.detach().abs()
        under = ((a > 0) & (a < self.format.tiny)).sum()
        top = torch.nan_to_num(a, nan=0.0, posinf=math.inf).amax().float()
        top = torch.where(a.isnan().any() & ~top.isinf(), math.nan, top)
        self._stats.setdefault((name, tensor), []).append((top, under, a.numel()))

    def read(self, step: int) -> list[HeadroomRow]:
        """The rows of ``step`` (none unless it was measured): every number of the step copied to
        the host in one transfer, the first time it is asked for (a host sync); then kept."""
        if self._rows is not None and self._rows[0] == step:
            return self._rows[1]
        if step != self._step or not self._stats:
            return []
        keys = sorted(self._stats, key=lambda k: (self._order[k[0]], TENSORS.index(k[1])))
        amax = torch.stack([_largest(torch.stack([s[0] for s in self._stats[k]])) for k in keys])
        under = torch.stack([torch.stack([s[1] for s in self._stats[k]]).sum().float() for k in keys])
        numbers = [amax, under]
        if isinstance(self._scale, torch.Tensor):
            numbers.append(self._scale.detach().float().to(amax.device).reshape(1).expand_as(amax))
        host = torch.stack(numbers).tolist()  # the one host read of a measured step
        scale = host[2][0] if len(host) > 2 else self._scale
        rows = []
        for (module, tensor), top, count in zip(keys, host[0], host[1]):
            numel = sum(s[2] for s in self._stats[(module, tensor)])
            rows.append(HeadroomRow(step, module, tensor, top, headroom_bits(top, self.format), count / numel))
        self._stats, self._rows, self._row_scale = {}, (step, rows), None if scale is None else float(scale)
        return rows

    def rows_of(self, record: StepRecord) -> list[HeadroomRow]:
        """:meth:`read` for a step's record: on a step skipped for a non-finite loss the gradient
        rows say nothing (nan): its backward ran seeded with 0 (the guard's, to keep every rank's
        collectives), so its gradients are zeros or NaNs no loss made, and read as infinite
        headroom (the heatmap's greenest cells; an alert cleared by them). The forward's rows
        are the step's own. Kept: the CSV and :meth:`observe` read the same rows.

        Example::

            >>> from ampguard.records import SkipLog
            >>> model = nn.Linear(1, 1)
            >>> h = Headroom(model, "fp16", every=1, alert_bits=4.0)
            >>> with h.measuring(1):
            ...     (model(torch.ones(2, 1)).sum() * 0.0).backward()
            >>> skip = SkipLog(1, lr=0.1, loss=math.inf, grad_l2_pre_clip=None, grad_l2_post_clip=None,
            ...                scaler_scale=1.0, reason="non_finite_loss")
            >>> [(r.tensor, r.amax) for r in h.rows_of(skip)]  # doctest: +NORMALIZE_WHITESPACE
            [('input', 1.0), ('output', ...), ('grad', nan), ('param_grad', nan)]
        """
        rows = self.read(record.step)
        if rows and record.skipped and record.reason == "non_finite_loss":
            nothing = dict(amax=math.nan, headroom_bits=math.nan, underflow_share=math.nan)
            rows = [row if row.tensor in UNSCALED else replace(row, **nothing) for row in rows]
            self._rows = (record.step, rows)
        return rows

    def judged_bits(self, row: HeadroomRow) -> float | None:
        """The headroom the alert judges ``row`` by (:func:`judged_bits`, at the loss scale the
        row's step ran with).

        Example::

            >>> h = Headroom(nn.Linear(1, 1), "fp16", every=1, alert_bits=4.0, loss_scale=lambda: 1024.0)
            >>> h._row_scale = 1024.0
            >>> [h.judged_bits(HeadroomRow(1, "fc", t, 1.0, b, 0.0))
            ...  for t, b in [("output", 3.0), ("grad", 3.0), ("grad", -math.inf), ("grad", math.nan)]]
            [3.0, 13.0, None, None]
            >>> h._row_scale = 8.0  # overflowed at a scale of 2**3: unscaled headroom < 3 bits < alert_bits
            >>> h.judged_bits(HeadroomRow(1, "fc", "grad", math.inf, -math.inf, 0.0))
            -inf
        """
        return judged_bits(row, self._row_scale, self.alert_bits, self.scale_floor)

    def observe(self, record: StepRecord) -> list[Event]:
        """The alerts and clears a step's record brings (none on an unmeasured step), judged on
        :meth:`rows_of` the record."""
        self.rows_of(record)
        return self.observe_step(record.step)

    def observe_step(self, step: int) -> list[Event]:
        """:meth:`observe` by step number: one ``headroom_alert`` per module whose lowest judged
        headroom (:meth:`judged_bits`, over its output and gradients) is below ``alert_bits``
        and was not already, one ``headroom_clear`` per alerting module back at or above
        ``alert_bits +`` :data:`CLEAR_MARGIN` in every row (one that says nothing, a nan or a
        gradient overflowed at a high loss scale, keeps the alert: the tensor it named may be
        that one, and a clear on the module's other rows alerted again at the next step)."""
        rows = self.read(step)
        if not rows or self._observed == step:
            return []
        self._observed = step
        worst: dict[str, tuple[float, HeadroomRow]] = {}
        unjudged: set[str] = set()
        for row in rows:
            bits = self.judged_bits(row)
            if bits is None:
                unjudged.add(row.module)
            elif row.module not in worst or bits < worst[row.module][0]:
                worst[row.module] = (bits, row)
        events = []
        for module, (bits, row) in worst.items():
            if bits < self.alert_bits and module not in self.alerting:
                self.alerting.append(module)
                events.append(Event(step, "headroom_alert", self._message(row, bits), self._data(row, bits)))
            elif bits >= self.alert_bits + CLEAR_MARGIN and module in self.alerting and module not in unjudged:
                self.alerting.remove(module)
                events.append(Event(step, "headroom_clear", (
                    f"headroom_clear: {module} back to {bits_shown(bits, self.alert_bits + CLEAR_MARGIN)} bits >= "
                    f"alert_bits {self.alert_bits:g} + {CLEAR_MARGIN:g}"), self._data(row, bits)))
        return events

    def _message(self, row: HeadroomRow, bits: float) -> str:
        scale, what = self._row_scale, f"{row.module} {row.tensor} headroom {bits_shown(bits, self.alert_bits)} bits"
        # judged down to the scaler's floor: "without the loss scale" where the floor is 1 or below;
        # above it, the headroom at the floor (its amax there beside the unscaled one: the two agree)
        floor = max(self.scale_floor, 1.0)
        where = "without the loss scale" if floor == 1.0 else f"at the loss scale's floor {floor:g}"
        bound = self._overflow_bound(row)
        if bound is not None:  # (its -inf, judged_bits' for the ranking, would read as inf without the scale too)
            there = "" if floor == 1.0 else f" ({self.format.max / scale * floor:.4g} at the floor)"
            return (f"headroom_alert: {row.module} {row.tensor} overflowed at loss scale {scale:g}: headroom < "
                    f"{bound:g} bits {where}, alert_bits {self.alert_bits:g} (amax > "
                    f"{self.format.max / scale:.4g} unscaled{there}, {self.format.name} max {self.format.max:.6g})")
        if row.tensor in UNSCALED or not self.scaled_grads:
            amax = f"amax {row.amax:.4g}"
        elif scale is None or not scale > 0:
            amax = f"amax {row.amax:.4g} (the loss-scaled gradient)"
        elif bits == row.headroom_bits:  # unscaled (scale 1), or overflowed at a scale <= 2**alert_bits
            amax = f"amax {row.amax:.4g} at loss scale {scale:g}"
        else:
            what += f" {where}"
            there = "" if floor == 1.0 else f"{row.amax / scale * floor:.4g} at the floor, "
            amax = f"amax {there}{row.amax / scale:.4g} unscaled, {row.amax:.4g} at loss scale {scale:g}"
        return (f"headroom_alert: {what} < alert_bits {self.alert_bits:g} ({amax}, {self.format.name} max "
                f"{self.format.max:.6g})")

    def _data(self, row: HeadroomRow, bits: float) -> dict[str, Any]:
        bound = self._overflow_bound(row)  # (below it: the largest number that is, not its -inf)
        judged = bits if bound is None else math.nextafter(bound, -math.inf)
        return {"module": row.module, "tensor": row.tensor, "amax": row.amax, "headroom_bits": row.headroom_bits,
                "judged_bits": judged, "loss_scale": self._row_scale, "format": self.format.name,
                "alert_bits": self.alert_bits}

    def _overflow_bound(self, row: HeadroomRow) -> float | None:
        """:func:`overflow_bound` of ``row`` at the loss scale its step ran with."""
        return overflow_bound(row, self._row_scale, self.scale_floor)

    def state_dict(self) -> dict[str, Any]:
        """Plain data: the modules alerting now.

        Example::

            >>> Headroom(nn.Linear(1, 1), "fp16", every=1, alert_bits=4.0).state_dict()
            {'alerting': []}
        """
        return {"alerting": list(self.alerting)}

    def check_state(self, state: Any, where: str = "") -> None:
        """Raise ``ValueError`` naming the field (after the prefix ``where``) unless ``state`` is
        one :meth:`state_dict` writes: ``alerting``, a list of distinct module names.

        Example::

            >>> Headroom(nn.Linear(1, 1), "fp16", every=1, alert_bits=4.0).check_state({"alerting": "fc"}, "headroom.")
            Traceback (most recent call last):
            ...
            ValueError: headroom.alerting is 'fc', expected a list of distinct module names
        """
        if not isinstance(state, dict):
            raise ValueError(f"{where.rstrip('.') or 'the state'} is {brief(state)}, expected a mapping")
        alerting = state.get("alerting", [])
        if not (isinstance(alerting, list) and all(isinstance(n, str) for n in alerting)
                and len(set(alerting)) == len(alerting)):
            raise ValueError(f"{where}alerting is {brief(alerting)}, expected a list of distinct module names")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        self.alerting = list(state.get("alerting", []))


class HeadroomCsv(CsvSink):
    """``headroom.csv`` as a sink of the run: for each record, the rows :meth:`Headroom.read`
    gives for its step (none on an unmeasured step), each flushed when written. Like the per-step
    CSV, an existing file is never overwritten; ``append=True`` continues one with the same
    header, after dropping the rows past ``keep_through`` (a resume: no duplicate steps).

    Example::

        >>> import tempfile
        >>> from ampguard.records import StepLog
        >>> tmp = tempfile.TemporaryDirectory()
        >>> model = nn.Linear(1, 1)
        >>> h = Headroom(model, "bf16", every=1, alert_bits=4.0)
        >>> with h.measuring(1):
        ...     _ = model(torch.ones(2, 1))
        >>> sink = HeadroomCsv(Path(tmp.name) / "headroom.csv", h)
        >>> sink.write(StepLog(1, lr=0.1, loss=0.5, grad_l2_pre_clip=1.0, grad_l2_post_clip=1.0, scaler_scale=1.0))
        >>> sink.close()
        >>> print((Path(tmp.name) / "headroom.csv").read_text().splitlines()[0])
        step,module,tensor,amax,headroom_bits,underflow_share
        >>> [(row.module, row.tensor) for row in read_headroom_csv(Path(tmp.name) / "headroom.csv")]
        [('(root)', 'input'), ('(root)', 'output')]
        >>> tmp.cleanup()
    """

    def __init__(self, path: str | Path, headroom: Headroom, *, append: bool = False,
                 keep_through: int | None = None) -> None:
        self.path, self.headroom, self.columns = Path(path), headroom, HEADROOM_COLUMNS
        self._open(append, keep_through, ", ".join(self.columns))

    def write(self, record: StepRecord, extra: Any = None) -> None:
        """Append the step's rows, each flushed (:class:`~ampguard.files.DiskFull` when there is no room)."""
        for row in self.headroom.rows_of(record):
            self._append_row(row.cells())
            self.rows += 1


def read_headroom_csv(path: str | Path) -> list[HeadroomRow]:
    """The rows of a ``headroom.csv``; a file that is not one is one :class:`InputError` line.

    Example::

        >>> import tempfile
        >>> tmp = tempfile.TemporaryDirectory()
        >>> p = Path(tmp.name) / "headroom.csv"
        >>> _ = p.write_text("step,module,tensor,amax,headroom_bits,underflow_share\\n5,fc,grad,inf,-inf,0.0\\n")
        >>> read_headroom_csv(p)
        [HeadroomRow(step=5, module='fc', tensor='grad', amax=inf, headroom_bits=-inf, underflow_share=0.0)]
        >>> _ = p.write_text("step,module\\n5,fc\\n")
        >>> read_headroom_csv(p)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: .../headroom.csv: not a headroom CSV (header step, module)
        >>> tmp.cleanup()
    """
    path = Path(path)
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            header = tuple(next(reader, ()))
            if header != HEADROOM_COLUMNS:
                raise InputError(f"{path}: not a headroom CSV (header {', '.join(header) or 'missing'})")
            rows = []
            for n, cells in enumerate(reader, start=2):
                try:
                    rows.append(_headroom_row(cells))
                except ValueError:
                    if not f.read():  # a torn last line (a run killed mid-write): what came before stands
                        break
                    raise InputError(f"{path}: line {n} is not a headroom row: {','.join(cells)!r}") from None
            return rows
    except OSError as err:
        raise InputError(f"{path}: cannot read it ({failed_because(err)})") from None
    except UnicodeDecodeError:
        raise InputError(f"{path}: not a text file") from None


def _headroom_row(cells: list[str]) -> HeadroomRow:
    """The row of a ``headroom.csv`` line's ``cells``; ``ValueError`` when they are not one.

    Example::

        >>> _headroom_row(["5", "fc", "grad", "inf", "-inf", "0.0"]).headroom_bits
        -inf
        >>> _headroom_row(["4", "0", "output", "abc", "1", "0"])
        Traceback (most recent call last):
        ...
        ValueError: could not convert string to float: 'abc'
    """
    step, module, tensor, amax, bits, share = cells
    return HeadroomRow(int(step), module, tensor, float(amax), float(bits), float(share))


def check_headroom_rows(path: Path, kept: Iterable[str], refused: str) -> None:
    """One :class:`InputError` line (ending in ``refused``) unless every row of ``kept`` (the
    lines of the ``headroom.csv`` at ``path`` a resume keeps, the header first, read one at a
    time: :meth:`CsvSink.kept_rows`'s ``read_back``) reads as :func:`read_headroom_csv` reads it:
    a resume that appended after a row with a cell that is no number would leave a file whose
    heatmap ``report`` leaves out.

    Example::

        >>> kept = ["step,module,tensor,amax,headroom_bits,underflow_share\\n", "4,0,output,1.5,15.4,0\\n"]
        >>> check_headroom_rows(Path("headroom.csv"), kept, "cannot resume from it")
        >>> check_headroom_rows(Path("headroom.csv"), [kept[0], kept[1].replace("1.5", "abc")], "cannot resume from it")
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: headroom.csv: line 2 is not a headroom row: '4,0,output,abc,15.4,0'; cannot resume from it
    """
    reader = csv.reader(kept)  # (as the file reads)
    next(reader, None)  # (the header: checked by CsvSink.check_header)
    for n, cells in enumerate(reader, start=2):
        try:
            _headroom_row(cells)
        except ValueError:
            raise InputError(f"{path}: line {n} is not a headroom row: {','.join(cells)!r}; {refused}") from None


# ---------------------------------------------------------------------------- skipped steps


class SkipGradNorms:
    """Every trainable parameter's gradient norm at a skipped step, for ``events.jsonl``.

    Attached to the guard (:meth:`attach`), it is called at a skipped step before the step drops
    the gradients, and takes their norms there, on the device; :meth:`after` then returns the
    event (norms in backward's order, the non-finite ones named): one host read on a skipped
    step, nothing at all on an applied one. Backward's order (the order it finished the
    gradients, roughly the reverse of registration) is learned once, by hooks that
    :meth:`capturing` installs around the first step only; parameters that step gave no gradient
    follow in reverse registration order. Under FSDP2 the sharded parameters' gradients may be
    written outside autograd's hooks: the order is then reverse registration, and each norm is
    reduced over the shards (a collective every rank makes). ``enabled=False``
    (``diagnose.grad_norms: false``): no hooks, no event.

    Example (an inf planted in the first layer's weight gradient)::

        >>> from ampguard.step import AmpTrainState
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        >>> state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.mse_loss,
        ...                       precision="bf16")
        >>> _ = model[0].weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
        >>> norms = SkipGradNorms(model).attach(state)
        >>> with norms.capturing():
        ...     record = state.step(torch.ones(4, 2), torch.zeros(4, 1))
        >>> event = norms.after(record)
        >>> event["event"], list(event["norms"]), event["non_finite"]
        ('grad_norms', ['1.weight', '1.bias', '0.weight', '0.bias'], ['0.weight'])
        >>> event["message"]
        'step 1 skipped (non_finite_grad): 1 of 4 gradients non-finite, in backward order: 0.weight'
    """

    def __init__(self, model: nn.Module, enabled: bool = True) -> None:
        self.params = [(name, p) for name, p in model.named_parameters() if p.requires_grad] if enabled else []
        self.enabled = enabled
        self.order: list[str] | None = None  # backward's order, learned at the first step
        self._seen: list[str] = []
        # step -> (parameters, their norms), put in order only for a step that was skipped
        self._taken: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self._guard: Any = None
        self._covered = False  # the guard measures every parameter watched here (its norms cover them)

    def attach(self, guard: Any) -> SkipGradNorms:
        """Be called by ``guard`` at each skipped step (``Guard.skip_hooks``); returns self. On the
        sync-free path, which cannot know at the step whether it skips, at every step
        (``Guard.group_hooks``: one fused norm kernel a step), kept until :meth:`after` reads it."""
        if self.enabled:
            self._guard = guard
            owned = {id(p) for p, _ in guard._owned}
            self._covered = all(id(p) in owned for _, p in self.params)
            (guard.group_hooks if guard.sync_free else guard.skip_hooks).append(self.at_skip)
        return self

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Around a step: until backward's order is known, hooks that note it (removed on the
        way out); after that, nothing."""
        if not self.enabled or self.order is not None:
            yield
            return
        self._seen = []
        try:
            with _installed([p.register_post_accumulate_grad_hook(self._hook(name)) for name, p in self.params]):
                yield
        finally:
            if self._seen:  # also after an error: what backward finished so far fixes the order
                self.order = self._current_order()

    def _hook(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if param.grad is not None and name not in self._seen:  # the first arrival fixes the order
                self._seen.append(name)

        return hook

    def _current_order(self) -> list[str]:
        if self.order is not None:  # learned at the first step, every parameter in it
            return self.order
        known = self._seen
        seen = set(known)
        return known + [name for name, _ in reversed(self.params) if name not in seen]

    def at_skip(self, taken: GradSet | None = None) -> None:
        """The skipped step's gradient norms, on the device (no host read), kept with their
        parameters until :meth:`after` puts them in backward's order (for a skipped step only):
        those the step's global norm took on its way (``taken``, the guard's :class:`GradSet`)
        when they cover every parameter, else computed here.

        On the sync-free path (every step, skipped or not) the step's own per-parameter norms
        are kept as they are when the guard measures every parameter watched here: no kernel
        and next to no Python a step."""
        if self._guard.sync_free and self._covered and taken is not None and taken.norms is not None:
            self._taken[self._guard.steps] = (taken.params, taken.norms)
            return
        params = [p for _, p in self.params if p.grad is not None]
        shared = taken.norms_by_param() if taken is not None else {}
        if all(id(p) in shared for p in params):  # no second pass over the gradients
            norms = [shared[id(p)] for p in params]
        elif self._guard.sync_free:  # every step: one fused kernel (one process: no shards to reduce)
            norms = list(torch._foreach_norm([grad_values(p.grad) for p in params]))
        else:
            norms = [distributed.full_norm(torch.linalg.vector_norm(grad_values(p.grad), dtype=torch.float32))
                     for p in params]
        self._taken[self._guard.steps] = (params, norms)

    def _in_order(self, params: list[torch.Tensor], norms: list[torch.Tensor]) -> tuple[list[str], torch.Tensor | None]:
        """``(names, stacked float32 norms)`` in backward's order, from what :meth:`at_skip` kept."""
        by_param = {id(p): n for p, n in zip(params, norms)}
        named = dict(self.params)
        names = [name for name in self._current_order() if id(named[name]) in by_param]
        ordered = [n if n.dtype == torch.float32 else n.float() for n in (by_param[id(named[name])] for name in names)]
        return names, torch.stack(ordered) if ordered else None

    def after(self, record: StepRecord) -> dict[str, Any] | None:
        """For a skipped step the ``grad_norms`` event (a host read), else None. Norms taken for
        this step and any before it are let go."""
        taken = self._taken.pop(record.step, None)
        for step in [s for s in self._taken if s < record.step]:
            del self._taken[step]
        if not record.skipped or not self.enabled:
            return None
        names, norms = self._in_order(*taken) if taken is not None else ([], None)
        values = norms.tolist() if norms is not None else []
        bad = [name for name, value in zip(names, values) if not math.isfinite(value)]
        if not names:
            what = "no per-parameter gradients recorded (none flowed, or the guard was not attached)"
        elif bad:
            what = f"{len(bad)} of {len(names)} gradients non-finite, in backward order: {', '.join(bad[:5])}"
            what += f" (+{len(bad) - 5} more)" if len(bad) > 5 else ""
        else:
            what = f"all {len(names)} gradients finite"
        return {"step": record.step, "event": "grad_norms", "message": f"step {record.step} skipped ({record.reason}): {what}",
                "reason": record.reason, "order": "backward", "norms": dict(zip(names, values)), "non_finite": bad}
