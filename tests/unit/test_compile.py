"""torch.compile of the model works under the guarded step (CPU, inductor: ~30 s, so one test)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ampguard import AmpTrainState


def _train(compiled: bool) -> tuple[nn.Module, list]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = AmpTrainState(torch.compile(model) if compiled else model, opt, F.mse_loss, precision="fp32")
    g = torch.Generator().manual_seed(1)
    records = []
    for i in range(8):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)
        if i == 3:
            y = y * float("nan")  # step 4: a non-finite loss through the compiled graph
        records.append(state.step(x, y))
    return model, records


def early(work: Path) -> dict[bool, tuple[list[torch.Tensor], list[tuple[bool, str | None, float]]]]:
    """Both trainings, eager and compiled, in an early job (conftest.py): Inductor's C++ build,
    ~17 s on a cold cache (a fresh CI machine), runs on the core the in-process tests leave idle.
    Per training: its parameters, and each step's (skipped, reason, loss)."""
    trained = {}
    for compiled in (False, True):
        model, records = _train(compiled)
        trained[compiled] = ([p.detach().clone() for p in model.parameters()],
                             [(r.skipped, r.reason, r.values()["loss"]) for r in records])
    return trained


@pytest.mark.slow
def test_a_compiled_model_trains_and_skips_like_the_eager_one(launches):
    (eager, eager_records), (compiled, records) = launches[False], launches[True]
    assert [skipped for skipped, _, _ in records] == [False, False, False, True, False, False, False, False]
    assert records[3][1] == "non_finite_loss"
    assert [skipped for skipped, _, _ in records] == [skipped for skipped, _, _ in eager_records]
    for a, b in zip(compiled, eager, strict=True):  # inductor may fuse: not bitwise
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    losses = [loss for skipped, _, loss in records if not skipped]
    assert losses[-1] < losses[0]


def test_the_guards_autocast_probe_is_not_traced_into_a_compiled_forward():
    # review_anyloop14: the plain module handed to Guard, a compiled wrapper doing the forward: the
    # probe (a forward pre-hook) read its registry inside the traced graph, so dynamo guarded on the
    # registry's entries by position (a model collected meanwhile: IndexError from the forward) and
    # the probe's removal at the first backward compiled the model a second time. The eager backend:
    # dynamo's tracing and guards, no inductor (fast)
    import gc
    import warnings

    from torch._dynamo.utils import counters

    from ampguard import Guard

    kept = []

    def gc_while_compiling(gm, example_inputs):  # (the cyclic GC inductor's allocations may trigger)
        kept.clear()
        gc.collect()
        return gm.forward

    for run, keep in ((0, True), (1, False)):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(run)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        compiled = torch.compile(model, backend=gc_while_compiling)
        guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (a compiled forward is not probed: nothing said)
            for _ in range(3):
                with guard.autocast():
                    loss = F.cross_entropy(compiled(torch.randn(6, 8)), torch.randint(0, 3, (6,)))
                guard.backward(loss)
                guard.step()
        assert counters["stats"]["unique_graphs"] == 1  # (compiled once: the probe left in place)
        if keep:
            kept.append(model)  # (garbage the next run's compile collects)


def test_the_first_skip_diagnosis_replays_a_compiled_model_eagerly_not_compiling_it_again():
    # review_27e #4: compile + diagnose.first_skip: the replay's hooks were traced by dynamo, which broke
    # the graph on them and compiled frame after frame (a page of graph-break warnings on stderr)
    from ampguard.guards import FirstSkipDiagnosis

    compiled = []

    def backend(gm, example_inputs):
        compiled.append(len(gm.graph.nodes))
        return gm.forward

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 4), nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.relu(self.a(x)))

    torch.manual_seed(0)
    model = Model()
    model.compile(backend=backend)
    state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, precision="fp16")
    diagnosis = FirstSkipDiagnosis(state, model)
    batch = (torch.full((4, 2), 3000.0), torch.zeros(4, 1))  # (its gradient overflows fp16 at the 65536 scale)
    diagnosis.capture(batch)
    record = state.step(*batch)
    assert record.skipped and compiled == compiled[:1]  # (the step's one compile)
    # (the first non-finite gradient: the model output's, made by the loss's backward, review 49a)
    assert diagnosis.after(record).startswith("step 1 (non_finite_grad): first inf under fp16: in backward, the "
                                              "gradient of the model's output")
    assert len(compiled) == 1  # the replay compiled nothing


def test_a_compiled_train_run_compiles_the_models_forward_alone(tmp_path, monkeypatch):
    # review 61d: train built the guard, whose autocast probe put a forward pre-hook on the model,
    # then compiled the model in place: dynamo compiled the hook as a frame of its own (noting
    # nothing, so it stayed for the run) and compiled it again at the first evaluation, under
    # no_grad: 4 frames where the bare compiled loop compiles 2. The eager backend: dynamo's
    # frames and guards without a compiler (~0.2 s of CPU)
    from torch._dynamo.utils import counters

    from ampguard.config import validate
    from ampguard.run_folder import RunPaths
    from ampguard.train import run

    (tmp_path / "mlp.py").write_text(
        "import torch\nfrom torch import nn\nimport torch.nn.functional as F\n\n"
        "class MLP(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 1)\n\n"
        "    def forward(self, x):\n        return self.b(F.gelu(self.a(x)))\n\n"
        "def build(config):\n    x, y = torch.randn(8, 4), torch.randn(8, 1)\n"
        "    return {'model': MLP(), 'data': [(x, y)], 'loss_fn': F.mse_loss, 'metrics': ('val_loss',),\n"
        "            'evaluate': lambda model, device: {'val_loss': F.mse_loss(model(x), y)}}\n")
    real_compile = nn.Module.compile
    monkeypatch.setattr(nn.Module, "compile", lambda module, *a, **k: real_compile(module, *a, **{**k, "backend": "eager"}))
    config = validate({"task": {"factory": f"{tmp_path / 'mlp.py'}:build"}, "eval": {"every": 1}, "steps": 2,
                       "precision": "bf16", "device": "cpu", "compile": True, "checkpoint": {"enabled": False}})
    torch._dynamo.reset()
    counters.clear()
    result = run(config, outputs=lambda: RunPaths(csv=tmp_path / "steps.csv"), console_every=100,
                 print_fn=lambda line: None)
    assert result.ended == "finished: 2 steps"
    # the model's forward, for training and for evaluation (no_grad), as the bare compiled loop's
    assert counters["frames"]["total"] == 2 and counters["stats"]["unique_graphs"] == 2
