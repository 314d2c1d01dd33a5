"""FSDP2's wrap of models that are not a row of plain children: CPU, gloo, 2 processes.

``distributed.wrap(..., "fsdp2")`` shards the items of a ModuleList/ModuleDict (a container has no
``forward`` for ``fully_shard``), leaves a unit whose parameters are shared with another (tied
weights) to the root's group, and turns what ``fully_shard`` still refuses into one line.

One torchrun launch, started in an early job (conftest.py) and shared by the tests: CF, T, H, BN,
BNR, RI and E one after another in it (``helpers.Batch``):

- ``CF``: the built-in ``charlm`` (a ModuleList of blocks, the head tied to the embedding), tiny,
  fp32, under FSDP2: the steps.csv of one process reading batches of twice the size (in this
  process: a launch is ~10 s of CPU, a run here well under one);
- ``T``: a ``task.factory`` model (written to the test's folder) with tied weights, nested
  containers and a 0-dim tensor in its batches, trained under FSDP2;
- ``BN``: a BatchNorm model whose rank 1 reads a NaN batch at step 3 (skipped), evaluated each
  step; ``BNR``: a copy of it resumed from its step-3 checkpoint; ``RI``: the same model with an
  init that differs by rank (rank 0's weights are everyone's);
- ``E``: a ``task.factory`` model with a 0-dim parameter, which ``fully_shard`` refuses: one
  line and exit 2 on every rank;
- ``H``: this file run as a script (``python test_fsdp2_wrap.py OUT`` under torchrun): which
  modules ``wrap`` shards, the sharded model's loss and gradient norm against the unsharded
  one, the refusals as :class:`InputError`, and ``has_non_finite_grad`` agreed over the ranks.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from helpers import BN_FACTORY, EARLY_TIMEOUT_S, TORCHRUN, Ended, end_launches, rank_codes

from ampguard.cli import main

TIMEOUT_S = EARLY_TIMEOUT_S
TESTS = Path(__file__).resolve().parent.parent
CHARLM = ["--set", "task.name=charlm", "--set", "task.n_layer=1", "--set", "task.n_embd=16", "--set", "task.n_head=2",
          "--set", "task.block_size=16", "--set", "task.batch_size=2", "--set", "eval.batches=1",
          "--set", "precision=fp32", "--set", "device=cpu", "--set", "steps=3", "--set", "checkpoint.every=3"]

TIED_FACTORY = '''
import torch
from torch import nn


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.ModuleDict({"a": nn.Linear(8, 8)})])
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, batch):
        h = torch.tanh(self.blocks[0](self.tok(batch["x"])))
        return self.head(torch.tanh(self.blocks[1]["a"](h))) * batch["temp"]


def build(config):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = [({"x": torch.randint(0, 16, (4, 5), generator=g), "temp": torch.tensor(0.5)},
             torch.randint(0, 16, (4, 5), generator=g)) for _ in range(4)]
    loss = lambda out, y: nn.functional.cross_entropy(out.reshape(-1, 16), y.reshape(-1))
    return Tied(), data, loss
'''

SCALAR_FACTORY = '''
import torch
from torch import nn


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.gain = nn.Parameter(torch.tensor(1.0))  # 0-dim: fully_shard cannot shard it

    def forward(self, x):
        return self.lin(x) * self.gain


def build(config):
    g = torch.Generator().manual_seed(0)
    return Scaled(), [(torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g))], nn.functional.mse_loss
'''

BN_RUN = ["--set", "precision=fp32", "--set", "device=cpu", "--set", "steps=6", "--set", "task.batch_size=8",
          "--set", "eval.every=1", "--set", "checkpoint.every=3", "--set", "distributed.strategy=fsdp2"]


pytestmark = TORCHRUN


def early(work: Path) -> dict[str, Ended]:
    """CF, T, H (this file's script) and E, one after another in one launch in ``work``
    (``helpers.Batch``: a launch is ~12 s of CPU, a run in it ~2 s), each once it ended (an early
    job: see conftest.py)."""
    from helpers import Batch, Run, torchrun_env

    (work / "tied.py").write_text(TIED_FACTORY)
    (work / "scalar.py").write_text(SCALAR_FACTORY)
    (work / "bn.py").write_text(BN_FACTORY)
    bn = ["--set", f"task.factory={work / 'bn.py'}:build", *BN_RUN]
    runs = {
        "BN": ["train", *bn, "--inject", "nan_input@3@rank1"],
        "RI": ["train", *bn, "--set", "steps=1", "--set", "optimizer.lr=0", "--set", "task.options.rank_init=true"],
        "BD": ["train", *bn, "--set", "distributed.strategy=ddp", "--set", "steps=3", "--set", "checkpoint.enabled=false",
               "--set", f"task.options.evals_to={work / 'BD_evals'}"],
        "CF": ["train", *CHARLM, "--set", "distributed.strategy=fsdp2"],
        "T": ["train", "--set", f"task.factory={work / 'tied.py'}:build", "--set", "precision=fp32",
              "--set", "device=cpu", "--set", "steps=4", "--set", "eval.enabled=false",
              "--set", "checkpoint.enabled=false", "--set", "distributed.strategy=fsdp2"],
        "E": ["train", "--set", f"task.factory={work / 'scalar.py'}:build", "--set", "precision=fp32",
              "--set", "device=cpu", "--set", "steps=2", "--set", "distributed.strategy=fsdp2"],
    }
    env = torchrun_env(PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    # (no test reads a plot: rank 0 drawing one costs a fresh process ~2 s of CPU)
    train = {name: Run([*args, "--set", f"log.dir={work / 'runs'}", "--set", f"log.name={name}",
                        "--set", "log.plot=false"]) for name, args in runs.items()}
    script = Run([str(work / "H_out")], cwd="H_cwd", script=str(Path(__file__).resolve()))
    resumed = work / "BNR_runs" / "BN"  # (a copy of BN resumed from its step-3 checkpoint)
    train["BNR"] = Run(["train", "--resume", str(resumed / "checkpoints" / "step-00000003.pt")], cwd="BNR_cwd",
                       copy=(f"{work / 'runs'}/BN", str(resumed)))
    (work / "BD_evals").mkdir()
    batch = Batch("batch", {"CF": train["CF"], "T": train["T"], "H": script, "BN": train["BN"], "BNR": train["BNR"],
                            "RI": train["RI"], "BD": train["BD"], "E": train["E"]}, work, timeout_s=TIMEOUT_S, env=env)
    try:
        return batch.results()
    finally:
        end_launches([batch.launch])


def _steps(work: Path, name: str) -> str:
    return (work / "runs" / name / "steps.csv").read_text()


def _cells(csv: str) -> list[list[object]]:
    """The CSV's cells, a number as a float (``pytest.approx`` compares those)."""
    def cell(text: str) -> object:
        try:
            return float(text)
        except ValueError:
            return text

    return [[cell(c) for c in line.split(",")] for line in csv.splitlines()]


def test_charlm_under_fsdp2_trains_as_one_process_with_twice_the_batch(launches, work, tmp_path):
    launches["CF"].ok()
    # each of the two ranks reads its half of a global batch of 4: one process reading batches of 4
    assert main(["train", *CHARLM, "--set", "task.batch_size=4", "--set", f"log.dir={tmp_path}",
                 "--set", "log.name=one", "--set", "log.plot=false"]) == 0
    fsdp, one = _steps(work, "CF"), (tmp_path / "one" / "steps.csv").read_text()
    rows = fsdp.splitlines()[1:]
    assert len(rows) == 3 and all(",0,," in row for row in rows), fsdp  # three steps, none skipped
    # the same steps, losses and norms up to float rounding (a mean of the ranks' means, a
    # reduce-scatter's order of sums)
    expected = [[pytest.approx(c, rel=1e-6) if isinstance(c, float) else c for c in row] for row in _cells(one)]
    assert _cells(fsdp) == expected
    assert (work / "runs" / "CF" / "checkpoints" / "step-00000003.pt").exists()


def test_a_tied_weight_factory_model_trains_under_fsdp2(launches, work):
    launches["T"].ok()
    rows = _steps(work, "T").splitlines()[1:]
    assert len(rows) == 4 and all(",0,," in row for row in rows), rows
    assert "Traceback" not in launches["T"].stderr


def test_a_model_fully_shard_refuses_is_one_line_and_exit_2_on_every_rank(launches, work):
    launch = launches["E"].wait()
    assert rank_codes(work / "E") == {0: 2, 1: 2}, launch.stderr  # every rank
    assert launch.stderr.count("exitcode  : 2 ") == 2, launch.stderr  # (the batch's last run) torchrun's report
    lines = [line for line in launch.stderr.splitlines() if line.startswith("ampguard: error:")]
    assert lines == ["ampguard: error: distributed.strategy=fsdp2: fully_shard cannot shard this model: "
                     "fully_shard doesn't support scalar parameters. Change gain to a 1D tensor with numel "
                     "equal to 1."] * 2, launch.stderr
    assert "[rank0]: Traceback" not in launch.stderr and "[rank1]: Traceback" not in launch.stderr
    assert not (work / "runs" / "E").exists()


def test_fsdp2_shares_rank_0s_buffers_so_a_skip_on_one_rank_leaves_no_nan_and_a_resume_is_the_run(launches, work):
    # review 34a: FSDP2 shards parameters, not buffers: rank 1's BatchNorm statistics took its NaN
    # batch at the skipped step 3 and kept it (val_loss nan from there on: DDP broadcasts rank 0's
    # buffers, it healed), and only rank 0's reached a checkpoint (the resume's val_loss differed)
    launches["BN"].ok()
    rows = [line.split(",") for line in _steps(work, "BN").splitlines()]
    header, rows = rows[0], rows[1:]
    val = header.index("val_loss")
    assert [(row[0], row[5], row[6]) for row in rows if row[5] == "1"] == [("3", "1", "non_finite_loss")]
    assert all(row[val] and float(row[val]) == float(row[val]) for row in rows), rows  # (no nan)
    launches["BNR"].ok()
    assert (work / "BNR_runs" / "BN" / "steps.csv").read_text() == _steps(work, "BN")  # bit for bit


def test_fsdp2_starts_every_rank_from_rank_0s_weights(launches, work):
    # review 34a: a factory whose init differs by rank trained, under FSDP2, a model whose rows came
    # from different ranks' inits (DDP's wrap broadcasts rank 0's; FSDP2's shards kept their own)
    launches["RI"].ok()
    saved = torch.load(work / "runs" / "RI" / "checkpoints" / "step-00000001.pt", weights_only=True)
    assert saved["model"]["0.weight"].eq(0.0).all(), saved["model"]["0.weight"]  # (lr 0: the start's weights)


def test_under_ddp_every_rank_evaluates_rank_0s_statistics(launches, work):
    # review 35a: DDP broadcasts buffers at the next training forward; an evaluation (the wrapped
    # model's) read each rank's own statistics: the logged mean was of two models, neither saved
    launches["BD"].ok()
    ranks = [(work / "BD_evals" / f"rank{r}").read_text().splitlines() for r in range(2)]
    assert len(ranks[0]) == 4 and ranks[0] == ranks[1], ranks  # (the start-up's try of evaluate, then 3 steps)


@pytest.fixture(scope="module")
def wrap_results(launches, work) -> list[dict]:
    launches["H"].ok()
    return [json.loads((work / "H_out" / f"rank{r}.json").read_text()) for r in range(2)]


def test_wrap_shards_container_items_and_leaves_tied_units_to_the_root(wrap_results):
    for got in wrap_results:
        assert got["sharded"] == ["", "blocks.0", "blocks.1.a", "blocks.1.b.0", "mid"]
        assert got["loss"] == pytest.approx(got["ref_loss"], rel=1e-6)
        assert got["norm"] == pytest.approx(got["ref_norm"], rel=1e-5)


def test_what_fully_shard_refuses_is_one_input_error_line(wrap_results):
    for got in wrap_results:
        assert got["scalar"].startswith("distributed.strategy=fsdp2: fully_shard cannot shard this model: ")
        assert "scalar parameters" in got["scalar"]
        assert "containers that do not implement forward" in got["container"]
        assert "\n" not in got["scalar"] + got["container"]


def test_broadcast_from_rank_0_sets_every_ranks_tensors_bucket_by_bucket(wrap_results):
    rank0, rank1 = (got["broadcast"] for got in wrap_results)
    assert rank0 == rank1
    assert rank0[:4] == [[1.0] * 3, [2.0] * 30, [3.0] * 4, [4.0] * 2]  # (rank 0's: + 0)
    assert rank0[4] == torch.arange(40.0).reshape(5, 8).t().tolist()


def test_has_non_finite_grad_agrees_over_the_ranks_under_fsdp2(wrap_results):
    # an inf in rank 1's shard only: every rank says so; before it, none does
    assert [got["non_finite"] for got in wrap_results] == [[False, True], [False, True]]


# ---------------------------------------------------------------------------- the H script (torchrun)


def _script(out: Path) -> None:
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import FSDPModule

    from ampguard import distributed as agd
    from ampguard.clipping import global_l2_norm, has_non_finite_grad
    from ampguard.errors import InputError

    joined = not dist.is_initialized()  # (a helpers.Batch run finds the group of the runs before it)
    if joined:
        dist.init_process_group("gloo")
    rank, cpu = dist.get_rank(), torch.device("cpu")
    got: dict = {}

    class Nested(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(16, 8)
            self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.ModuleDict({"a": nn.Linear(8, 8),
                                                                         "b": nn.ModuleList([nn.Linear(8, 8)])})])
            self.mid = nn.Linear(8, 8)
            self.frozen = nn.LayerNorm(8).requires_grad_(False)
            self.head = nn.Linear(8, 16, bias=False)
            self.head.weight = self.tok.weight

        def forward(self, x):
            h = self.tok(x)
            for layer in (self.blocks[0], self.blocks[1]["a"], self.blocks[1]["b"][0], self.mid):
                h = torch.tanh(layer(h))
            return self.head(self.frozen(h))

    torch.manual_seed(0)
    model, ref = Nested(), Nested()
    ref.load_state_dict(model.state_dict())
    agd.wrap(model, "fsdp2", cpu)
    got["sharded"] = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    x = torch.randint(0, 16, (4, 5), generator=torch.Generator().manual_seed(1))
    losses = []
    for m in (model, ref):
        loss = nn.functional.cross_entropy(m(x).reshape(-1, 16), x.reshape(-1))
        loss.backward()
        losses.append(loss.item())
    got["loss"], got["ref_loss"] = losses
    got["norm"] = agd.full_norm(global_l2_norm(model.parameters())).item()
    got["ref_norm"] = global_l2_norm(ref.parameters()).item()

    first = next(p for p in model.parameters() if p.grad is not None and p.grad.to_local().numel())
    got["non_finite"] = [has_non_finite_grad(model.parameters())]
    if rank == 1:
        first.grad.to_local().view(-1)[0] = float("inf")
    got["non_finite"].append(has_non_finite_grad(model.parameters()))

    class Scalar(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.scale = nn.Parameter(torch.tensor(1.0))

    for key, bad in (("scalar", Scalar()), ("container", nn.ModuleList([nn.Linear(2, 2)]))):
        try:
            agd.wrap(bad, "fsdp2", cpu)
            got[key] = "accepted"
        except InputError as err:
            got[key] = str(err)
    # rank 0's values everywhere, in buckets of 64 bytes: a small tensor's, a large one alone, bf16 and
    # int64 apart, a tensor given twice, a non-contiguous one
    bucket, agd.BROADCAST_BUCKET_BYTES = agd.BROADCAST_BUCKET_BYTES, 64
    try:
        base = torch.arange(40.0).reshape(5, 8)
        parts = [torch.full((3,), 1.0), torch.full((30,), 2.0), torch.full((4,), 3, dtype=torch.int64),
                 torch.full((2,), 4.0, dtype=torch.bfloat16), (base * (1 + rank)).t()]
        parts = [p + rank if p.dtype != torch.int64 else p + rank for p in parts[:4]] + [parts[4]]
        agd.broadcast_from_rank_0([*parts, parts[0]])
        got["broadcast"] = [p.float().tolist() for p in parts]
    finally:
        agd.BROADCAST_BUCKET_BYTES = bucket
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(got))
    if joined:
        dist.destroy_process_group()


if __name__ == "__main__":
    _script(Path(sys.argv[1]))
