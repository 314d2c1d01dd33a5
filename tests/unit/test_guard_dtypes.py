"""``Guard.autocast_dtypes``: in any loop, the first forward under ``guard.autocast()`` notes each
leaf module's output dtype (the layers autocast left in float32, as ``ampguard train``'s run card
names them; seed 001: "record the dtype and the regions that may stay in FP32"), with hooks for
that forward only; never for fp32, a compiled model, or a forward that raised."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ampguard import Guard


def normed() -> nn.Module:
    # under bf16 autocast on the CPU: the BatchNorm of the raw (float32) input stays float32
    torch.manual_seed(0)
    return nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


GRAPHS: list = []


def counting(gm, example_inputs):
    """A dynamo backend that counts the graphs it is given (module-level: a model compiled with it pickles)."""
    GRAPHS.append(gm)
    return gm.forward


def hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) for m in model.modules())


def step(guard: Guard, forward, loss_scale: float = 1.0):
    x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
    with guard.autocast():
        loss = F.cross_entropy(forward(x), y) * loss_scale
    guard.backward(loss)
    return guard.step()


@pytest.mark.parametrize("first_loss", [1.0, float("nan")])  # a first step skipped still ran its forward
def test_the_first_forward_names_the_layers_autocast_left_in_float32_and_its_hooks_go(first_loss):
    model = normed()
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16")
    assert guard.autocast_dtypes is None
    record = step(guard, model, first_loss)
    assert record.skipped == (first_loss != 1.0)
    assert guard.autocast_dtypes == {"0": "float32", "1": "bfloat16", "2": "bfloat16", "3": "bfloat16"}
    assert hooks(model) == 0
    noted = guard.autocast_dtypes
    step(guard, model)
    assert guard.autocast_dtypes is noted and hooks(model) == 0  # (the first forward's: nothing after it)


def test_fp32_notes_nothing_and_several_models_are_named_as_their_parameters_are():
    model = normed()
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp32")
    step(guard, model)
    assert guard.autocast_dtypes is None
    models = {"encoder": nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 8)), "head": nn.Linear(8, 2)}
    params = [p for m in models.values() for p in m.parameters()]
    guard = Guard(models, torch.optim.SGD(params, lr=0.1), precision="bf16")
    step(guard, lambda x: models["head"](models["encoder"](x)))
    assert guard.autocast_dtypes == {"encoder.0": "float32", "encoder.1": "bfloat16", "head": "bfloat16"}


def test_a_forward_that_raises_leaves_no_hooks_and_the_next_forward_notes_the_map():
    """A loop that retries after an out-of-memory: the failed forward's hooks stayed on every
    layer, a Python call each forward for the rest of the run."""
    model = normed()
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16")

    def out_of_memory(x):
        model[0](x)
        raise torch.OutOfMemoryError("CUDA out of memory (raised by the test)")

    with pytest.raises(torch.OutOfMemoryError):
        step(guard, out_of_memory)
    assert guard.autocast_dtypes is None and hooks(model) == 0
    step(guard, model)
    assert guard.autocast_dtypes["0"] == "float32" and hooks(model) == 0


def test_a_compiled_model_is_compiled_once_and_its_map_stays_empty():
    """Hooks traced into a compiled forward and removed after it made dynamo compile the model a
    second time. Compiled beside the guard's plain module, its hooks stay (no-ops, so the model
    still pickles); compiled in place, it gets none."""
    graphs = GRAPHS
    graphs.clear()
    torch._dynamo.reset()
    model = normed()
    compiled = torch.compile(model, backend=counting)
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16")
    for _ in range(3):
        step(guard, compiled)
    assert guard.autocast_dtypes == {} and len(graphs) == 1
    torch.save(model, io.BytesIO())  # (the hooks left on it pickle)
    assert hooks(copy.deepcopy(model)) == hooks(model) == 4
    model.eval()
    model(torch.randn(6, 4))  # an evaluation in float32, eager: the hooks left are closed (they wrote it into the map)
    assert guard.autocast_dtypes == {}

    torch._dynamo.reset()
    graphs.clear()
    model = normed()
    model.compile(backend=counting)
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16")
    for _ in range(2):
        step(guard, model)
    assert guard.autocast_dtypes == {} and hooks(model) == 0


def test_a_model_compiled_in_part_beside_the_guard_is_compiled_once():
    """Its body compiled on its own, its head eager: the head noted its dtype, so the hooks were
    removed at the block's exit, and the body's graph, which had traced them, compiled again.
    Hooks a graph compiled in the block traced stay, closed; the map has what ran eagerly."""
    GRAPHS.clear()
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.ModuleDict({"body": nn.Sequential(nn.Linear(4, 8), nn.ReLU()), "head": nn.Linear(8, 2)})
    body = torch.compile(model["body"], backend=counting)
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16")
    for _ in range(3):
        step(guard, lambda x: model["head"](body(x)))
    assert len(GRAPHS) == 1 and guard.autocast_dtypes == {"head": "bfloat16"}


def test_a_compile_that_is_not_the_models_leaves_no_hooks_on_it():
    """A compiled loss in the first block moved dynamo's graph count, and every leaf of the eager
    model kept a hook for the rest of the run (a Python call per layer per forward). A leaf that
    noted its dtype ran eagerly: its hook goes whatever else compiled."""
    GRAPHS.clear()
    torch._dynamo.reset()
    model = normed()
    loss_fn = torch.compile(lambda out, y: F.cross_entropy(out, y), backend=counting)
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16")
    for _ in range(2):
        with guard.autocast():
            loss = loss_fn(model(torch.randn(6, 4)), torch.randint(0, 2, (6,)))
        guard.backward(loss)
        guard.step()
    assert len(GRAPHS) == 1 and hooks(model) == 0 and guard.autocast_dtypes["0"] == "float32"
