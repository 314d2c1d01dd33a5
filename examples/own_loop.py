"""The guard in your own loop: a model that computes its own loss (as Hugging Face models do, an
output object with ``.loss``), and a multi-task model whose losses are summed.

    python examples/own_loop.py --model hf --precision fp16 --steps 40 --csv hf.csv --nan-at 7
    python examples/own_loop.py --model multitask --precision bf16 --steps 40 --csv multitask.csv
    python examples/own_loop.py --model gpt2 --precision bf16 --steps 40 --csv gpt2.csv --nan-at 7

``--model gpt2`` is a real ``transformers`` GPT2LMHeadModel, tiny and built from a GPT2Config (no
download; needs the ``transformers`` extra).

Every step is written to the per-step CSV; ``--nan-at N`` makes the loss of step N non-finite so
you can watch the guard skip it (and, in fp16, halve the loss scale).
"""

from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace

import torch
from torch import nn
from torch.nn import functional as F

from ampguard import CsvSink, Guard
from ampguard.errors import InputError


class TinyLM(nn.Module):
    """A two-layer causal language model that returns ``SimpleNamespace(logits=..., loss=...)``
    when given labels, the calling convention of ``transformers`` models (``model(**batch).loss``)."""

    def __init__(self, vocab: int = 32, width: int = 32, context: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(context, width))
        layer = nn.TransformerEncoderLayer(width, nhead=2, dim_feedforward=2 * width, batch_first=True, dropout=0.0)
        self.blocks = nn.TransformerEncoder(layer, num_layers=2)
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> SimpleNamespace:
        n = input_ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n)
        hidden = self.blocks(self.embed(input_ids) + self.pos[:n], mask=mask, is_causal=True)
        logits = self.head(hidden)
        loss = None if labels is None else F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        return SimpleNamespace(logits=logits, loss=loss)


def tiny_gpt2(vocab: int = 32, context: int = 16) -> nn.Module:
    """A two-layer GPT-2 from ``transformers``, built from its config: nothing is downloaded."""
    from transformers import GPT2Config, GPT2LMHeadModel  # the optional extra, only for --model gpt2

    # (bos/eos within the tiny vocabulary: transformers says so otherwise)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=vocab, n_positions=context,
                                      bos_token_id=0, eos_token_id=0))


class MultiTask(nn.Module):
    """One trunk, two heads: a classification loss and a regression loss, summed with weights."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 32), nn.GELU())
        self.classify, self.regress = nn.Linear(32, 3), nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return self.classify(h), self.regress(h).squeeze(1)


def batches(kind: str, steps: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        if kind in ("hf", "gpt2"):  # a repeating pattern to learn: token t is followed by t + 1
            start = torch.randint(0, 32, (8, 1), generator=g)
            ids = (start + torch.arange(17)) % 32
            # GPT-2 shifts the labels itself; TinyLM takes them shifted
            yield {"input_ids": ids[:, :-1], "labels": ids[:, :-1] if kind == "gpt2" else ids[:, 1:]}
        else:
            x = torch.randn(16, 8, generator=g)
            yield {"x": x, "label": (x[:, 0] > 0).long() + (x[:, 1] > 0).long(), "target": x[:, 2] - x[:, 3]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="own_loop.py", description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--model", choices=["hf", "gpt2", "multitask"], default="hf")
    parser.add_argument("--precision", choices=["fp16", "bf16", "fp32"], default="bf16")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--accumulation-steps", type=int, default=1)
    parser.add_argument("--csv", default="steps.csv")
    parser.add_argument("--nan-at", type=int, default=None, help="make the loss of this step non-finite")
    args = parser.parse_args(argv)
    if min(args.steps, args.accumulation_steps) < 1:  # (0 was a traceback from Guard(), or a run of nothing)
        parser.error("--steps and --accumulation-steps are whole numbers >= 1")
    if args.nan_at is not None and not 1 <= args.nan_at <= args.steps:  # (a fault that never fires: a clean run
        parser.error(f"--nan-at {args.nan_at} is no step of the run (1 to --steps {args.steps})")  # said as tested)
    try:
        return train(args)
    except InputError as err:  # e.g. the CSV exists already: never overwritten, said in one line
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2


def train(args: argparse.Namespace) -> int:
    """The guarded loop; writes the CSV, prints one line, returns 0."""
    torch.manual_seed(0)
    model = {"hf": TinyLM, "gpt2": tiny_gpt2, "multitask": MultiTask}[args.model]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2 if args.model == "multitask" else 3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: min(1.0, (update + 1) / 5))
    sink = CsvSink(args.csv)  # (first: a CSV there already is refused before the guard warns of anything)
    guard = Guard(model, optimizer, precision=args.precision, max_norm=1.0, scheduler=scheduler,
                  accumulation_steps=args.accumulation_steps,
                  scaler={"init_scale": 1024.0} if args.precision == "fp16" else None)  # (bf16 runs no loss scaler)
    try:
        for batch in batches(args.model, args.steps * args.accumulation_steps):
            with guard.autocast():
                if args.model in ("hf", "gpt2"):
                    loss = model(**batch).loss                       # the model computes its own loss
                else:
                    logits, value = model(batch["x"])                # two heads, two losses, one sum
                    loss = F.cross_entropy(logits.float(), batch["label"]) + 0.5 * F.mse_loss(value.float(), batch["target"])
                if args.nan_at is not None and guard.steps + 1 == args.nan_at:
                    loss = loss * float("nan")
            guard.backward(loss)                                     # checked, / N, scaled, backward
            if (record := guard.step()) is not None:                 # None inside an accumulation group
                sink.write(record)
    finally:
        sink.close()
    print(f"{args.model} {args.precision}: {guard.steps} steps, {guard.updates} updates, csv {args.csv}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
