"""Rank 0's refusal of its files raised on every rank (review 48b, M2), under torchrun (2 CPU
ranks, gloo): ``torchrun ... ranks_review48.py FRAMEWORK WORK TARGET...``.

FRAMEWORK ``hf``: a ``GuardedTrainer`` per TARGET, its ``AmpGuardCallback(out_dir=TARGET)``;
``pl``: a Lightning ``strategy="ddp"`` fit per TARGET, its ``AmpGuardPlugin(csv=TARGET)``. Each
fit is tried in turn: a refusal is one line on this rank's stderr (``ampguard: error: ...``, as
the CLI writes it), a fit that trains a line ``trained TARGET`` on stdout (the third fit given
an MLflow sink on every rank: :func:`tracker_sinks`); the ranks wait for
each other after each fit (:func:`in_step`). Then each rank exits 2, the CLI's input-error code
(``ExitCode.BAD_INPUT``), when any fit was refused, else 0. A rank that went on into the
training loop while another refused waits there until the other gives up waiting for it and
ends; it then crashes (gloo's "Connection closed by peer"), a traceback on its stderr.
tests/integrations/test_ranks_review48.py runs it and reads each rank's stderr.
"""

import datetime
import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ampguard import distributed
from ampguard.errors import ExitCode, InputError


def tracker_sinks(work: Path, framework: str) -> list:
    """An MLflow sink (a file store under WORK), made on every rank, as a script that did not
    heed "build them on process 0" makes it: process 0's logs; another's ends unused, said."""
    from ampguard import MLflowSink

    return [MLflowSink(tracking_uri=f"file:{work / 'mlruns'}", experiment=framework)]


def hf_fit(work: Path, target: str, sinks: list):
    """A ``GuardedTrainer``'s fit; TARGET ``callable:PATH``: its sinks a function of the state
    (called on process 0 alone); ``stock:PATH``: a stock ``Trainer`` given the callback (its
    refusals shared on every process as GuardedTrainer's); ``retry:PATH``:
    ``auto_find_batch_size``, an out-of-memory on every rank at the first attempt's step 2, and
    tracker sinks on every rank (the retry told alike on each)."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from ampguard.integrations.transformers import AmpGuardCallback, GuardedTrainer

    kind, _, path = target.rpartition(":")
    if kind == "callable":
        sinks = lambda state: tracker_sinks(work, "hf_callable")  # noqa: E731
    elif kind == "retry":  # (sinks on every rank, as with fit 3)
        sinks = tracker_sinks(work, "hf_retry")

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=4,
                                                bos_token_id=None, eos_token_id=None))
    ids = torch.arange(32).reshape(8, 4) % 16
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(str(work / "hf_output"), per_device_train_batch_size=2, max_steps=2, use_cpu=True,
                             report_to=[], ddp_backend="gloo", disable_tqdm=True, save_strategy="no", bf16=True,
                             logging_steps=1, auto_find_batch_size=kind == "retry")
    callback = AmpGuardCallback(path, print_fn=lambda line: None, sinks=sinks)
    if kind == "stock":
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    else:
        trainer = GuardedTrainer(model=model, args=args, train_dataset=data, ampguard=callback)
    if kind == "retry":  # a CPU out-of-memory at the first attempt's step 2, on every rank: HF begins again, batch 1
        first = []

        def out_of_memory(module, inputs, output):
            if trainer.state.global_step == 1 and not first:
                first.append(True)
                raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")
            return output

        model.transformer.wte.register_forward_hook(out_of_memory)
    return trainer.train


def pl_fit(work: Path, target: str, sinks: list):
    """A Lightning DDP fit; TARGET ``rank0:PATH``: the csv given on rank 0 alone (as a script may)."""
    import lightning as L
    from torch import nn
    from torch.nn import functional as F

    from ampguard.integrations.lightning import AmpGuardPlugin

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Linear(4, 1)

        def training_step(self, batch, i):
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            d = torch.utils.data.TensorDataset(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g))
            return torch.utils.data.DataLoader(d, batch_size=2)

    kind, _, path = target.rpartition(":")
    csv = path if kind != "rank0" or dist.get_rank() == 0 else None
    trainer = L.Trainer(max_steps=2, plugins=[AmpGuardPlugin("bf16-mixed", csv=csv, sinks=sinks)], strategy="ddp", devices=2,
                        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
    module = Module()
    return lambda: trainer.fit(module)


def in_step(case: int, outcome: str) -> None:
    """Every rank through fit ``case`` with the same ``outcome``, waited for through the process
    group's key-value store (not a collective: a rank that went on into a training loop would pair
    a barrier here with a collective of the loop, and both wait until gloo's half-hour timeout).
    A rank whose peer is not through within :data:`IN_STEP_S` raises (a traceback), and so ends."""
    store = dist.distributed_c10d._get_default_store()
    key = f"ranks_review48/{case}/"
    store.set(key + str(dist.get_rank()), outcome)
    store.wait([key + str(r) for r in range(dist.get_world_size())], datetime.timedelta(seconds=IN_STEP_S))
    outcomes = {store.get(key + str(r)).decode() for r in range(dist.get_world_size())}
    if len(outcomes) > 1:
        raise SystemExit(f"the ranks disagree on fit {case}: {sorted(outcomes)}")


IN_STEP_S = 600
"""How long a rank waits in :func:`in_step` for its peer: only a rank left in a training loop's
collective (the defect these launches look for) should outwait it, not a peer that is merely
slow. Rank 0 alone ends a fit that trained (its CSV, its MLflow run) while rank 1 waits here:
about 1 s, but with rank 0 at a nice-19 share beside busy cores 60 s to 290 s (review 60a); at
120 s rank 1 gave up, its exit failed rank 0's next collective ("Connection closed by peer ...
a remote worker crashing") or torchrun ended it, and rank 0's last refusal went unsaid, a flaky
failure. A wait of 600 s leaves too little of helpers.EARLY_TIMEOUT_S (900 s) for the rest of a
launch so starved, so it never fails one that could pass; a rank left in a collective still
ends the launch as a peer crash the test names, not as the launch's timeout."""


def main(framework: str, work: Path, targets: list[str]) -> int:
    refused = False
    for case, target in enumerate(targets):
        with_sinks = case == 2  # (the first fit that trains: with tracker sinks on every rank)
        fit = (hf_fit if framework == "hf" else pl_fit)(work, target, tracker_sinks(work, framework) if with_sinks
                                                        else [])
        try:
            fit()
        except InputError as err:
            refused, outcome = True, f"refused: {err}"
            sys.stderr.write(f"ampguard: error: {err}\n")  # (one write: the line whole)
            sys.stderr.flush()
        else:
            outcome = f"trained {target}"
            sys.stdout.write(outcome + "\n")
            sys.stdout.flush()
        del fit
        gc.collect()
        in_step(case, outcome)
    distributed.shutdown()  # (torchrun's SIGTERM, once a rank exited 2, ignored: each rank's own code stands)
    return int(ExitCode.BAD_INPUT) if refused else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2]), sys.argv[3:]))
