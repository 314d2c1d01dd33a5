"""A small GPT-style character-level language model trained on Python's own standard library.

The text is read at run time from a fixed list of standard-library source files (real data, no
download), as bytes, so the vocabulary is the 256 byte values. The last 10% of the text is held
out.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import InputError, counted, failed_because
from .base import Task, batch_generator, mean_loss

SOURCES: tuple[str, ...] = (
    "argparse.py", "bisect.py", "calendar.py", "csv.py", "dataclasses.py", "fractions.py",
    "functools.py", "heapq.py", "random.py", "string.py", "textwrap.py", "shlex.py",
)
VOCAB = 256
VAL_FRACTION = 0.1


def read_corpus() -> torch.Tensor:
    """The standard-library sources in :data:`SOURCES` as one uint8 tensor. One :class:`InputError`
    line when one cannot be read (naming it and why: a source left unreadable to this user by an
    install under ``umask 077``, which imports from its ``.pyc`` hide; a disk error), when none is
    there, or when they hold no text (review 58d: a traceback, exit 1; and an empty corpus blamed
    ``task.block_size``).

    Example::

        >>> corpus = read_corpus()
        >>> corpus.dtype, len(corpus) > 100_000, bytes(corpus[:200].tolist()).isascii()
        (torch.uint8, True, True)
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks = []
    for name in SOURCES:
        path = stdlib / name
        try:  # (is_file too: a folder it cannot search raises PermissionError there)
            if path.is_file():
                chunks.append(path.read_bytes())
        except OSError as err:
            raise InputError(f"charlm: cannot read the standard-library source {path}: {failed_because(err)}") from None
    if not chunks:
        raise InputError(f"charlm: none of the standard-library sources were found under {stdlib}")
    if not any(chunks):
        raise InputError(f"charlm: the standard-library sources under {stdlib} are empty "
                         f"({counted(len(chunks), 'file')}, 0 bytes): no text to train on")
    data = b"\n".join(chunks)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def corpus_id(corpus: torch.Tensor) -> str:
    """The corpus's identity: the Python whose standard library it is read from (another version's
    sources are other text), its size and the start of its SHA-256.

    Example::

        >>> corpus_id(torch.tensor([104, 105], dtype=torch.uint8))  # doctest: +ELLIPSIS
        'Python 3... standard library, 2 bytes, sha256 8f434346648f'
    """
    digest = hashlib.sha256(corpus.numpy().tobytes()).hexdigest()[:12]
    return f"Python {sys.version_info.major}.{sys.version_info.minor} standard library, {len(corpus)} bytes, " \
           f"sha256 {digest}"


def split(corpus: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) by position: the last :data:`VAL_FRACTION` of the text is held out.

    Example::

        >>> train, held_out = split(torch.arange(100))
        >>> len(train), len(held_out), int(held_out[0])
        (90, 10, 90)
    """
    cut = int(len(corpus) * (1 - VAL_FRACTION))
    return corpus[:cut], corpus[cut:]


def char_batches(
    text: torch.Tensor, seed: int, batch_size: int, block_size: int, start: int = 0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless batches of random windows: inputs ``text[i:i+T]``, targets ``text[i+1:i+T+1]``;
    batch ``k`` drawn from its own generator (:func:`~ampguard.tasks.batch_generator` of ``seed``
    and ``k``), from batch ``start`` on.

    Example::

        >>> x, y = next(char_batches(torch.arange(50, dtype=torch.uint8), seed=0, batch_size=2, block_size=4))
        >>> tuple(x.shape), x.dtype, torch.equal(x[:, 1:], y[:, :-1]), torch.equal(y - x, torch.ones(2, 4).long())
        ((2, 4), torch.int64, True, True)
        >>> stream = char_batches(torch.arange(50, dtype=torch.uint8), seed=0, batch_size=2, block_size=4)
        >>> _ = next(stream)
        >>> torch.equal(next(stream)[0], next(char_batches(torch.arange(50, dtype=torch.uint8), 0, 2, 4, start=1))[0])
        True

    Every window is drawn, the last one too (its target ends at the text's last byte): a text of
    ``T + 1`` bytes has one window::

        >>> x, y = next(char_batches(torch.arange(5, dtype=torch.uint8), seed=0, batch_size=3, block_size=4))
        >>> x.tolist(), y[0].tolist()
        ([[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3]], [1, 2, 3, 4])
    """
    if len(text) < block_size + 1:
        raise ValueError(f"a context of {block_size} needs at least {block_size + 1} bytes of text, not {len(text)}")
    offsets = torch.arange(block_size)
    for index in itertools.count(start):  # (a window starts at 0 to len - T - 1: the last byte is a target too)
        starts = torch.randint(len(text) - block_size, (batch_size,), generator=batch_generator(seed, index))
        idx = starts[:, None] + offsets
        yield text[idx].long(), text[idx + 1].long()


EVAL_WINDOWS = 32
"""Windows in each held-out batch of ``val_loss`` (``eval.batches`` of them): a fixed number, not
``task.batch_size`` (nor, under torchrun, the global batch), so that runs of other batch sizes or
process counts are scored on the same windows."""


def held_out_batches(val_text: torch.Tensor, block_size: int, batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed windows ``val_loss`` is the mean loss on: ``batches`` batches of
    :data:`EVAL_WINDOWS` windows of the held-out text, the same for every run seed, batch size
    and process count (each process scores them all: the ranks agree on the value).

    Example::

        >>> text = torch.arange(200, dtype=torch.uint8)
        >>> held = held_out_batches(text, block_size=8, batches=2)
        >>> len(held), tuple(held[0][0].shape)
        (2, (32, 8))
        >>> all(torch.equal(a, b) for a, b in zip(held[0], held_out_batches(text, 8, 3)[0]))  # a prefix of more
        True
    """
    stream = char_batches(val_text, 0, EVAL_WINDOWS, block_size)
    return [next(stream) for _ in range(batches)]


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then an MLP, each with a residual.

    Example::

        >>> block = Block(n_embd=8, n_head=2)
        >>> x = torch.randn(1, 5, 8)
        >>> later = x.clone(); later[0, 4] += 1.0  # change only the last position
        >>> block(x).shape, torch.allclose(block(x)[:, :4], block(later)[:, :4])  # causal
        (torch.Size([1, 5, 8]), True)
    """

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln_2(x))


class CharLM(nn.Module):
    """Token + position embeddings, ``n_layer`` pre-norm transformer blocks, a tied output head.

    Example::

        >>> model = CharLM(block_size=8, n_layer=1, n_head=2, n_embd=16)
        >>> logits = model(torch.randint(0, VOCAB, (2, 8)))
        >>> tuple(logits.shape), model.head.weight is model.tok.weight
        ((2, 8, 256), True)
    """

    def __init__(self, block_size: int, n_layer: int, n_head: int, n_embd: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, VOCAB, bias=False)
        self.head.weight = self.tok.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _next_char_set(text: torch.Tensor, block_size: int, n: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed held-out examples for validation: a context window and the character after it, the
    windows spread evenly over the text, from its start to the one whose next character is its
    last byte.

    Example::

        >>> x, y = _next_char_set(torch.arange(10, dtype=torch.uint8), block_size=4, n=3)
        >>> x[:, 0].tolist(), y.tolist()
        ([0, 2, 5], [4, 6, 9])
    """
    starts = torch.linspace(0, len(text) - block_size - 1, n).long()
    idx = starts[:, None] + torch.arange(block_size)
    return text[idx].long(), text[starts + block_size].long()


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over every position: ``(B, T, V)`` logits against ``(B, T)`` next bytes.

    Example::

        >>> round(lm_loss(torch.zeros(2, 3, VOCAB), torch.zeros(2, 3, dtype=torch.long)).item(), 4)  # ln 256
        5.5452
    """
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def flops_per_token(model: CharLM, n_layer: int, n_embd: int, block_size: int) -> float:
    """Training FLOPs per token, nanoGPT's estimate (the PaLM paper's appendix B): ``6 N`` for the
    weights (forward 2, backward 4 per parameter; position embeddings left out, the tied head
    counted once) plus ``12 L C T`` for attention over a context of ``T``.

    Example (GPT-2 small's shape with a byte vocabulary)::

        >>> with torch.device("meta"):  # (shapes only: no 124M weights to initialise)
        ...     model = CharLM(block_size=1024, n_layer=12, n_head=12, n_embd=768)
        >>> round(flops_per_token(model, 12, 768, 1024) / 1e6)
        625
    """
    n = sum(p.numel() for p in model.parameters()) - model.pos.weight.numel()
    return 6.0 * n + 12.0 * n_layer * n_embd * block_size


def build(config: Any) -> Task:
    """The ``charlm`` task: a :class:`CharLM` sized by ``config.task``, a held-out ``val_loss``.

    Example::

        >>> from ampguard.config import load_config
        >>> task = build(load_config(None, ["task.name=charlm", "task.n_layer=1", "task.n_embd=16", "task.n_head=2",
        ...                                 "task.block_size=16", "task.batch_size=4", "eval.batches=1"]))
        >>> x, y = next(task.batches())
        >>> tuple(x.shape), task.float_inputs, task.metrics, tuple(task.scores(task.model, x).shape)
        ((4, 16), False, ('val_loss',), (4, 256))
    """
    corpus = read_corpus()
    train_text, val_text = split(corpus)
    t = config.task
    if t.block_size + 1 > len(val_text):
        raise InputError(f"task.block_size: a context of {t.block_size} is longer than the held-out text allows "
                         f"(at most {len(val_text) - 1} bytes)")
    torch.manual_seed(config.seed)
    model = CharLM(t.block_size, t.n_layer, t.n_head, t.n_embd)
    # made at the first evaluation, not with the task (eval.batches of 20,000 held 1.2 GB with
    # evaluation off; review 51f)
    held_out = functools.cache(lambda: held_out_batches(val_text, t.block_size, config.eval.batches))
    return Task(
        name="charlm",
        model=model,
        flops_per_token=flops_per_token(model, t.n_layer, t.n_embd, t.block_size),
        loss_fn=lm_loss,
        batches=lambda: char_batches(train_text, config.seed + 1, t.batch_size, t.block_size),
        batches_from=lambda start: char_batches(train_text, config.seed + 1, t.batch_size, t.block_size, start),
        evaluate=lambda m, device: {"val_loss": mean_loss(m, lm_loss, held_out(), device)},
        metrics=("val_loss",),
        float_inputs=False,
        held_out=lambda: _next_char_set(val_text, t.block_size),
        edge_cases=lambda: (["spaces", "repeated_char", "all_bytes_cycle"], torch.stack([
            torch.full((t.block_size,), ord(" ")), torch.full((t.block_size,), ord("x")),
            torch.arange(t.block_size) % VOCAB])),
        predict=lambda m, x: m(x)[:, -1, :],  # the decision: the next character after the context
        data_id=corpus_id(corpus),
        description=(
            f"character-level transformer ({counted(t.n_layer, 'layer')}, {t.n_embd} wide, "
            f"context {t.block_size}) "
            f"on {len(train_text):,} bytes of Python's standard library ({len(val_text):,} held out)"
        ),
    )
