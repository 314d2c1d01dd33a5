"""``distributed.agree`` on two real gloo ranks (CPU, two processes of ``torch.multiprocessing``):
one rank's non-finite value becomes every rank's, whatever the norm's dtype; a value finite
everywhere comes back bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")


RANKS = """
import runpy, sys
import torch.multiprocessing as mp

script = runpy.run_path(sys.argv[1], run_name="agree_ranks")  # (its functions; its __main__ would spawn)
mp.start_processes(script["_rank"], args=(sys.argv[2],), nprocs=2, join=True, start_method="fork")
"""
"""``python -c RANKS SCRIPT OUT``: what ``python agree_ranks.py OUT`` does (``mp.spawn`` of its ``_rank``
over two processes, joined, an error in either an error of the whole), the two processes forked
from this one, which has torch and ampguard imported, where spawned ones each imported them afresh
(~5 s of CPU each)."""


def early(work: Path) -> dict[str, object]:
    """The two ranks (tests/dist_scripts/agree_ranks.py's ``_rank``: processes of
    ``torch.multiprocessing``, forked from a process forked warm, :data:`RANKS`), run to their
    end: an early job (conftest.py: started at collection, off the suite's own process; the tests
    that read it run last)."""
    import sys

    from helpers import EARLY_TIMEOUT_S, run_to_end, torchrun_env

    script = Path(__file__).resolve().parent.parent / "dist_scripts" / "agree_ranks.py"
    out = work / "agree"
    out.mkdir()
    return {"agree": run_to_end("agree", [sys.executable, "-c", RANKS, str(script), str(out)], out,
                                timeout_s=EARLY_TIMEOUT_S, env=torchrun_env())}


@pytest.fixture(scope="module")
def ranks(launches) -> list[dict]:
    done = launches["agree"]
    assert done.rc == 0, done.stderr[-3000:]
    return [torch.load(done.cwd / f"rank{r}.pt") for r in (0, 1)]


def test_one_ranks_non_finite_value_is_every_ranks(ranks):
    loss0, big0, inf0, same0 = ranks[0]["agreed"]
    loss1, big1, inf1, same1 = ranks[1]["agreed"]
    assert loss0 == loss1 == 1.0  # the mean over ranks
    # a float64 norm beyond float32's range is finite: both ranks keep it finite (no rank skips alone)
    assert big0 == 1e39 and big1 == 1.0
    # rank 1's inf: inf where it was, NaN on rank 0 (finite there): both read non-finite
    assert inf1 == float("inf") and inf0 != inf0
    assert same0 == same1 == 0.1  # finite everywhere: unchanged, bit for bit
    # the origin counts the ranks whose first value (the loss mark) was not finite: rank 0's 1e39
    # is finite in float64 (its mark 0), so none
    assert ranks[0]["origin"] == ranks[1]["origin"] == [0.0, 0.0]


@pytest.mark.parametrize("path", ["exact", "sync_free"])
def test_a_skip_for_a_non_finite_loss_names_the_rank_whose_loss_it_was(ranks, path):
    # (without it, a NaN born on one rank read the same on all: the first-skip diagnosis alone named it)
    for rank in (0, 1):
        steps = ranks[rank][path]
        assert [(reason, on, j) for reason, on, _, j in steps] == [
            (None, None, None),
            ("non_finite_loss", "rank 1", "rank 1"),  # the same words on both ranks
            ("non_finite_loss", "every rank", "every rank"),
            ("non_finite_grad", None, None),  # a gradient's: DDP or the norm's agreement reduced it, no rank to name
        ], (rank, steps)
        assert steps[1][2].startswith("SKIP 2 ") and steps[1][2].endswith(" reason=non_finite_loss (rank 1)")
        assert steps[3][2].endswith(" reason=non_finite_grad")


@pytest.mark.parametrize("world", [2, 3, 8, 24, 25, 64])
def test_the_origin_names_each_rank_whose_loss_was_not_finite(world):
    # the codes summed in float32, as agree's all-reduce sums them: up to NAMED_RANKS every set of
    # ranks reads back as itself; beyond, one rank by its number, several as a count
    from ampguard.distributed import NAMED_RANKS, rank_code
    from ampguard.records import loss_origin

    g = torch.Generator().manual_seed(world)
    for _ in range(50):
        chosen = sorted(torch.randperm(world, generator=g)[: int(torch.randint(1, world + 1, (), generator=g))].tolist())
        code = torch.tensor([rank_code(r, world) for r in chosen], dtype=torch.float32).sum().item()
        text = loss_origin(float(len(chosen)), code, world)
        if len(chosen) == world:
            assert text == "every rank"
        elif len(chosen) == 1:
            assert text == f"rank {chosen[0]}"
        elif world <= NAMED_RANKS:
            assert text == f"ranks {', '.join(map(str, chosen[:-1]))} and {chosen[-1]}"
        else:
            assert text == f"{len(chosen)} of {world} ranks"
    last = world - 1  # the highest rank alone: its bit (2 ** 23 at 24 ranks) exact in float32
    assert loss_origin(1.0, torch.tensor(rank_code(last, world), dtype=torch.float32).item(), world) == f"rank {last}"


def test_a_model_each_rank_trains_as_its_own_is_said_once_one_in_ddp_is_not(ranks):
    # (review 48b: an unwrapped model under torchrun trained diverging replicas whose records read as one run)
    # a warning about the run as a whole, the same on every rank: said once, by rank 0 (session 60c)
    assert all(said == [] for said in ranks[1]["replicas"].values()), ranks[1]["replicas"]
    seen = ranks[0]["replicas"]
    assert seen["ddp"] == []  # (DDP's all-reduced gradients: the same norm on every rank)
    for case, step in (("own", 1), ("first_skips", 2), ("first_zero", 2)):  # (a step that skips is not judged: the next is)
        [(message, where)] = seen[case]
        assert message.startswith(f"the ranks' gradient norms differ at step {step} (")
        assert "wrap the model (DistributedDataParallel, fully_shard)" in message
        assert where.endswith("agree_ranks.py")  # (the user's line, not ampguard's)
    # (review 48e: a GAN whose D, in DDP, stepped first was judged by D's step alone; G drifted unsaid)
    [(message, _)] = seen["gan"]
    assert message.startswith("the ranks' gradient norms of optimizer 'g' differ at step 2 ("), message
    # (review 48f: stepped together, they were judged by their joint norm)
    [message] = seen["together"]
    assert message.startswith("the ranks' gradient norms of optimizer 'g' differ at step 1 ("), message


def test_rank_0s_failure_inside_refused_on_every_rank_is_raised_on_every_rank(ranks):
    # (review 48f: only an InputError was shared; rank 0's full disk left rank 1 in the block's collective)
    assert ranks[0]["refusals"] == ["InputError: steps.csv already exists",
                                    "OSError: [Errno 28] No space left on device", "none"]
    assert ranks[1]["refusals"] == ["InputError: steps.csv already exists",
                                    "RuntimeError: rank 0 failed: [Errno 28] No space left on device", "none"]
