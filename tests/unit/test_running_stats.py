"""A skipped step leaves the running statistics a forward writes (BatchNorm's) as it found them,
as it leaves the parameters and the optimizer's state: review 34a found a NaN batch the guard
skipped left a BatchNorm's statistics NaN for good (every evaluation after it NaN), in one
process and on the process that read it under torchrun (``watch.RunningStats``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from helpers import BN_FACTORY

from ampguard import Guard
from ampguard.cli import main


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 1))


def _batches(bad: set[int] = frozenset(), n: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 4, generator=g) for _ in range(n)]
    return [torch.full_like(x, float("nan")) if i in bad else x for i, x in enumerate(xs)]


def _guard(model: nn.Module, sync_free: bool = False, accumulation_steps: int = 1) -> Guard:
    if sync_free:
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2), fused=True)
        return Guard(model, opt, precision="fp32", sync_free=True, accumulation_steps=accumulation_steps)
    return Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp32",
                 accumulation_steps=accumulation_steps)


def _train(model: nn.Module, guard: Guard, batches: list[torch.Tensor]) -> list:
    records = []
    for x in batches:
        with guard.autocast():
            loss = model(x).pow(2).mean()
        guard.backward(loss)
        record = guard.step()
        if record is not None:
            records.append(record)
    return records


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _after_a_step() -> tuple[nn.Module, Guard, dict[str, torch.Tensor]]:
    """A BatchNorm model, its guard, one applied step, and the state it left."""
    model = _model()
    guard = _guard(model)
    _train(model, guard, _batches(n=1))
    return model, guard, _state(model)


def _unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    now = _state(model)
    assert now.keys() == before.keys() and all(torch.equal(now[k], before[k]) for k in before)


@pytest.mark.parametrize("sync_free", [False, True], ids=["exact", "sync-free"])
def test_a_skipped_nan_batch_leaves_the_statistics_as_a_run_that_never_read_it(sync_free):
    # the model and its statistics after batches 0, 1 (NaN: skipped), 2, 3 are bit for bit those
    # of a run that read 0, 2, 3 alone
    model = _model()
    records = _train(model, _guard(model, sync_free), _batches({1}))
    assert [r.skipped for r in records] == [False, True, False, False]
    clean = _model()
    _train(clean, _guard(clean, sync_free), [b for i, b in enumerate(_batches()) if i != 1])
    got, expected = _state(model), _state(clean)
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    assert int(model[1].num_batches_tracked) == 3 and torch.isfinite(model[1].running_var).all()


def test_a_skipped_group_puts_back_what_each_of_its_micro_batches_wrote():
    model = _model()
    guard = _guard(model, accumulation_steps=2)
    _train(model, guard, _batches(n=2))  # step 1: applied
    before = _state(model)
    records = _train(model, guard, _batches({1}, n=2))  # step 2: a clean micro-batch, then a NaN one
    assert [r.skipped for r in records] == [True]
    _unchanged(model, before)


def test_the_copy_is_taken_at_the_steps_first_training_forward_after_a_load_not_at_an_evaluation():
    # a load between steps (a resume, a rollback) is what the next skip puts back; an evaluation's
    # forward (eval mode, no gradients) takes no copy
    model = _model()
    guard = _guard(model)
    _train(model, guard, _batches(n=2))
    saved = _state(model)
    _train(model, guard, _batches(n=2))
    model.eval()
    with torch.no_grad():
        model(_batches()[0])
    model.train()
    model.load_state_dict(saved)  # back to step 2's statistics, as a rollback would
    _train(model, guard, _batches({0}, n=1))  # skipped
    _unchanged(model, saved)


def test_an_applied_step_keeps_what_its_forward_wrote():
    model = _model()
    guard = _guard(model)
    _train(model, guard, _batches(n=1))
    assert int(model[1].num_batches_tracked) == 1 and not torch.equal(model[1].running_mean, torch.zeros(4))


def test_a_copy_of_the_guard_keeps_its_own_models_statistics():
    model = _model()
    guard = _guard(model)
    _train(model, guard, _batches(n=1))
    twin = copy.deepcopy(guard)  # (its model is a copy too)
    before = _state(twin.model)
    _train(twin.model, twin, _batches({0}, n=1))
    _unchanged(twin.model, before)
    assert int(model[1].num_batches_tracked) == 1  # (the original untouched)


def test_a_model_without_running_statistics_gets_no_hook():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.BatchNorm1d(4, track_running_stats=False))
    _guard(model)
    assert not any(m._forward_pre_hooks for m in model.modules())


def test_train_evaluates_a_finite_model_after_a_skipped_nan_batch(tmp_path, monkeypatch, capsys):
    # review 34a: `ampguard train` with a BatchNorm model and `--inject nan_input@3` read val_loss
    # nan at every evaluation after step 3
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bn.py").write_text(BN_FACTORY)
    assert main(["train", "--set", "task.factory=bn.py:build", "--set", "precision=fp32", "--set", "device=cpu",
                 "--set", "steps=6", "--set", "eval.every=1", "--set", "checkpoint.enabled=false",
                 "--set", "log.plot=false", "--set", "log.dir=.", "--set", "log.name=run",
                 "--inject", "nan_input@3"]) == 0
    out = capsys.readouterr().out
    assert "SKIP 3 " in out
    evals = [line for line in out.splitlines() if line.startswith("EVAL ")]
    assert len(evals) == 6 and "nan" not in " ".join(evals), evals


def test_a_model_with_the_hook_still_pickles_and_its_copy_trains():
    import pickle

    model = _model()
    guard = _guard(model)
    _train(model, guard, _batches(n=1))
    again = pickle.loads(pickle.dumps(model))  # (torch.save(model) pickles its hooks: a module-level function)
    assert torch.equal(again[1].running_mean, model[1].running_mean)
    again(_batches()[0])  # (a forward through the copied hook, with no guard of its own: nothing)


def test_a_no_grad_forward_in_training_mode_that_comes_first_is_put_back_too():
    # review 35a: targets computed by the same network in train mode under no_grad (mean-teacher,
    # pseudo-labels) wrote the NaN batch's statistics before the first forward that records
    # gradients took the copy: they stayed NaN
    model, guard, before = _after_a_step()
    bad = _batches({0}, n=1)[0]
    with torch.no_grad():
        target = model(bad)
    with guard.autocast():
        loss = (model(bad) - target).pow(2).mean()
    guard.backward(loss)
    assert guard.step().skipped
    _unchanged(model, before)


def test_a_skip_hook_that_raises_leaves_the_statistics_put_back():
    # review 35a: "step 2 was skipped, nothing was applied", and the statistics stayed NaN: the
    # dropped group forgot the copy instead of putting it back
    model, guard, before = _after_a_step()

    def broken(grads):
        raise RuntimeError("a diagnostic's bug")

    guard.skip_hooks.append(broken)
    with pytest.raises(RuntimeError, match="a diagnostic's bug"):
        _train(model, guard, _batches({0}, n=1))
    _unchanged(model, before)


def test_a_compiled_model_in_amptrainstate_is_put_back():
    # review 35a: the copy is taken by AmpTrainState.step itself (a compiled model's forward runs no
    # hook of ours while dynamo traces)
    from ampguard import AmpTrainState

    model = _model()
    model.compile(backend="eager")
    state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda out, y: out.pow(2).mean(),
                          precision="fp32")
    good, bad = _batches({1}, n=2)
    assert not state.step(good, None).skipped
    before = _state(model)
    assert state.step(bad, None).skipped
    _unchanged(model, before)


def test_a_compiled_model_in_your_own_guard_loop_is_put_back():
    # review 35b: the forward inside `with guard.autocast():` is where the copy can be taken for a
    # compiled model, whose layers' hooks run nothing while dynamo traces
    model = _model()
    model.compile(backend="eager")
    guard = _guard(model)
    _train(model, guard, _batches(n=1))
    before = _state(model)
    assert [r.skipped for r in _train(model, guard, _batches({0}, n=1))] == [True]
    _unchanged(model, before)


def test_one_hook_a_layer_whatever_the_guards_and_none_once_they_are_gone():
    # review 35a: each Guard() on a model stacked another hook on every BatchNorm; review 35b: a
    # process-wide hook instead slowed every module of the process by half while a guard lived
    import gc

    model = _model()
    first, second = _guard(model), _guard(model)
    assert len(model[1]._forward_pre_hooks) == 1
    assert not model[0]._forward_pre_hooks and not torch.nn.modules.module._global_forward_pre_hooks
    del first
    gc.collect()
    assert len(model[1]._forward_pre_hooks) == 1  # (the second guard still watches it)
    _train(model, second, _batches({0}, n=1))
    assert int(model[1].num_batches_tracked) == 0  # (put back: the hook still copied)
    del second
    gc.collect()
    assert not model[1]._forward_pre_hooks


def test_keepers_made_and_dropped_from_several_threads_leave_no_hook():
    # review 35b: the process-wide hook's unlocked install leaked hooks that nothing could remove
    import gc
    import threading

    from ampguard.watch import RunningStats

    bn = nn.BatchNorm1d(2)

    def churn():
        for _ in range(200):
            RunningStats([bn])

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gc.collect()
    assert not bn._forward_pre_hooks
    kept = RunningStats([bn])
    assert len(bn._forward_pre_hooks) == 1 and kept.layers == [bn]


def test_the_copy_follows_the_layers_mode_not_the_roots():
    # review 35c: guard.autocast() copied whenever the root trained: a guard of several models has a
    # root of its own, always training (an eval forward of both took a copy that a later skip put
    # back over the user's own load), and a frozen BatchNorm under a training root was copied
    # (and put back over a load) though nothing wrote it; a compiled model whose root is in eval
    # mode but whose BatchNorm trains was not copied at all
    gen, disc = _model(), _model()
    guard = Guard([gen, disc], torch.optim.SGD([*gen.parameters(), *disc.parameters()], lr=0.1),
                  precision="fp32")
    _train(gen, guard, _batches(n=1))
    saved = _state(gen)
    _train(gen, guard, _batches(n=1))
    gen.eval(), disc.eval()
    with guard.autocast():
        gen(_batches()[0])
    gen.train(), disc.train()
    gen.load_state_dict(saved)
    _train(gen, guard, _batches({0}, n=1))  # skipped: the loaded statistics stay
    _unchanged(gen, saved)

    model = _model()
    model.compile(backend="eager")
    guard = _guard(model)
    model.eval()
    model[1].train()  # (the BatchNorm alone trains)
    _train(model, guard, _batches(n=1))
    before = _state(model)
    assert [r.skipped for r in _train(model, guard, _batches({0}, n=1))] == [True]
    _unchanged(model, before)


@pytest.mark.parametrize("sync_free", [False, True], ids=["exact", "sync-free"])
def test_a_batchnorm_added_after_the_guard_is_put_back_from_its_first_step(sync_free):
    # review 36a: the layers were read once, at Guard(): one added later (a growing model;
    # affine=False registers no parameter, Sequential.insert registers nothing) stayed NaN for good
    model = _model()
    guard = _guard(model, sync_free)
    _train(model, guard, _batches(n=1))
    model.insert(3, nn.BatchNorm1d(4, affine=False))
    before = _state(model)
    assert [bool(r.skipped) for r in _train(model, guard, _batches({0}, n=1))] == [True]  # its first step
    _unchanged(model, before)
    _train(model, guard, _batches(n=1))
    assert int(model[3].num_batches_tracked) == 1


def test_a_model_without_batchnorm_is_watched_once_one_is_added_and_a_replaced_one_is_let_go():
    import gc
    import weakref

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    guard = _guard(model)
    _train(model, guard, _batches(n=1))
    model[1] = nn.BatchNorm1d(4, affine=False)  # (the ReLU's place)
    _train(model, guard, _batches(n=1))
    before = _state(model)
    _train(model, guard, _batches({0}, n=1))
    _unchanged(model, before)
    old = weakref.ref(model[1])
    model[1] = nn.BatchNorm1d(4, affine=False)
    _train(model, guard, _batches(n=1))
    gc.collect()
    assert old() is None and guard._running_stats.layers == [model[1]]  # (not kept alive, nor copied)
    before = _state(model)
    _train(model, guard, _batches({0}, n=1))
    _unchanged(model, before)


def test_a_lazy_batchnorm_trains_and_is_put_back_once_it_has_statistics():
    # review 36a: guard.autocast() copied the LazyBatchNorm's uninitialized buffers: a ValueError
    # before the first forward (a model without lazy parameters, so an optimizer built before it)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.LazyBatchNorm1d(affine=False), nn.ReLU(), nn.Linear(4, 1))
    guard = _guard(model)
    _train(model, guard, _batches(n=2))
    before = _state(model)
    _train(model, guard, _batches({0}, n=1))
    _unchanged(model, before)


def test_the_hook_reads_its_keepers_while_another_thread_adds_one():
    # review 36a: the hook iterated the layer's WeakSet of keepers without the lock: a forward in one
    # thread while another built a guard on the same layers raised "Set changed size during iteration"
    import sys
    import threading

    from ampguard.watch import RunningStats

    bn = nn.BatchNorm1d(2)
    keepers = [RunningStats([bn]) for _ in range(50)]
    errors, done = [], threading.Event()

    def forwards():
        x = torch.randn(4, 2)
        try:
            while not done.is_set():
                bn(x)
                for keeper in keepers:
                    keeper.end_step(skipped=False)
        except RuntimeError as err:
            errors.append(err)

    def churn():
        for _ in range(3000):
            keepers.append(RunningStats([bn]))
            keepers.pop()
            if errors:
                break
        done.set()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=forwards), threading.Thread(target=churn)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors


def test_a_compiled_forward_that_assigns_a_buffer_compiles_once_beside_a_guard():
    # review 36d: the buffer-registration count (a BatchNorm made after the guard) counted a forward's
    # assignment to a buffer it has; read inside the compiled forward, the count was a guard of its
    # graph: a recompile at every call, then dynamo's limit left the module uncompiled
    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x):
            self.calls = self.calls + 1
            return self.lin(x)

    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = _model()
    guard = _guard(model)
    torch._dynamo.reset()
    compiled = torch.compile(Counting(), backend=counting)
    for x in _batches(n=4):
        compiled(x)
        _train(model, guard, [x])
    assert len(graphs) == 1 and int(compiled.calls) == 4


@pytest.mark.parametrize("sync_free", [False, True], ids=["exact", "sync-free"])
def test_a_lazy_batchnorm_whose_first_batch_is_skipped_starts_again_as_a_new_one(sync_free):
    # review 36d: its first forward made the statistics the copy could not hold: the NaN stayed for good
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.LazyBatchNorm1d(affine=False), nn.ReLU(), nn.Linear(4, 1))
    guard = _guard(model, sync_free)
    assert [bool(r.skipped) for r in _train(model, guard, _batches({0}, n=1))] == [True]
    bn = model[1]
    assert torch.equal(bn.running_mean, torch.zeros(4)) and torch.equal(bn.running_var, torch.ones(4))
    assert int(bn.num_batches_tracked) == 0
    _train(model, guard, _batches(n=2))
    assert torch.isfinite(bn.running_mean).all() and int(bn.num_batches_tracked) == 2


def test_a_batchnorm_taken_out_of_the_model_is_let_go_within_unfrozen_every_steps():
    # review 36d: a layer deleted registers nothing: it stayed hooked, copied and alive for good
    import gc
    import weakref

    from ampguard.watch import UNFROZEN_EVERY

    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.BatchNorm1d(4, affine=False), nn.ReLU(),
                          nn.Linear(4, 1))
    guard = _guard(model)
    _train(model, guard, _batches(n=1))
    gone = weakref.ref(model[2])
    del model[2]
    _train(model, guard, _batches(n=1) * UNFROZEN_EVERY)
    gc.collect()
    assert gone() is None and guard._running_stats.layers == [model[1]]


class _Grows(nn.Module):
    """A model whose forward makes a layer the first time ``grow`` is set (``make``: an adapter, a BatchNorm)."""

    def __init__(self, make):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.grow, self.make = nn.Linear(4, 4), nn.Linear(4, 1), False, make

    def forward(self, x):
        h = self.a(x)
        if self.grow and not hasattr(self, "extra"):
            self.extra = self.make()
        if hasattr(self, "extra"):
            h = self.extra(h)
        return self.b(h.relu())


def _refused_once_its_compiled_forward_makes(model: nn.Module, switch: str, name: str) -> Guard:
    """``model`` compiled, one step, then ``switch`` set (its forward makes parameter ``name``, which
    no optimizer holds): refused within UNFROZEN_EVERY steps. The guard."""
    from ampguard.watch import UNFROZEN_EVERY

    guard = _guard(model)
    model.compile(backend="eager")
    _train(model, guard, _batches(n=1))
    setattr(model, switch, True)
    with pytest.raises(ValueError, match=f"parameter '{name}' requires grad but no optimizer updates it"):
        _train(model, guard, _batches(n=1) * UNFROZEN_EVERY)
    return guard


def test_a_layer_a_compiled_forward_makes_is_found_within_unfrozen_every_steps():
    # review 36g: a layer a compiled forward made was never found (the counts skip while dynamo
    # traces: counted there, they guarded its graph, and 36h: counted eagerly, through a disabled
    # function, fullgraph=True and a strict export refused the forward): an adapter went unclipped,
    # its gradient growing for good, a BatchNorm unwatched; the guard's look every UNFROZEN_EVERY
    # steps finds them (the parameters' count, the normalization layers)
    from ampguard.watch import UNFROZEN_EVERY

    guard = _refused_once_its_compiled_forward_makes(_Grows(lambda: nn.Linear(4, 4)), "grow", "extra.weight")
    assert guard.steps <= UNFROZEN_EVERY

    model = _Grows(lambda: nn.BatchNorm1d(4, affine=False))
    guard = _guard(model)
    model.compile(backend="eager")
    _train(model, guard, _batches(n=1))
    model.grow = True
    _train(model, guard, _batches(n=1) * UNFROZEN_EVERY)
    before = _state(model)
    assert [bool(r.skipped) for r in _train(model, guard, _batches({0}, n=1))] == [True]
    _unchanged(model, before)


def test_a_fullgraph_forward_that_makes_a_layer_compiles_beside_a_guard_and_a_reset_cache_counts_nothing():
    # review 36h: the counts through a torch.compiler.disable'd function were a graph break, an
    # error under fullgraph=True (and a strict torch.export); a buffer set to None and back each
    # forward (a cache) was counted at every step (a recompile each call under compile)
    from ampguard.watch import WATCHED

    class Builds(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.register_buffer("last", None)

        def forward(self, x):
            self.last = None
            h = nn.Sequential(nn.ReLU())(self.fc(x))
            self.last = h.detach()
            return h

    model = _model()
    guard = _guard(model)
    _train(model, guard, _batches(n=1))
    torch._dynamo.reset()
    compiled = torch.compile(Builds(), backend="eager", fullgraph=True)
    compiled(torch.ones(2, 4))
    eager, counts = Builds(), (WATCHED.registered, WATCHED.buffers)
    for _ in range(3):
        eager(torch.ones(2, 4))
    assert WATCHED.buffers == counts[1]  # (the Sequential made each call is a registration, not a buffer)


def test_a_batchnorm_that_begins_to_track_or_comes_unregistered_is_watched():
    # review 36g: turning track_running_stats on for a BatchNorm (its buffers held None) registered
    # names it had; a prebuilt one inserted into a model that had none (Sequential.insert registers
    # nothing) was never looked for: the every-64-steps look ran only for a model with such layers
    from ampguard.watch import UNFROZEN_EVERY

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, affine=False, track_running_stats=False), nn.ReLU(),
                          nn.Linear(4, 1))
    guard = _guard(model)
    bn = model[1]
    bn.track_running_stats = True
    bn.running_mean, bn.running_var = torch.zeros(4), torch.ones(4)
    bn.num_batches_tracked = torch.tensor(0)
    _train(model, guard, _batches(n=1))
    before = _state(model)
    _train(model, guard, _batches({0}, n=1))
    _unchanged(model, before)

    prebuilt = nn.BatchNorm1d(4, affine=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    guard = _guard(model)
    model.insert(1, prebuilt)
    _train(model, guard, _batches(n=1) * UNFROZEN_EVERY)
    before = _state(model)
    _train(model, guard, _batches({0}, n=1))
    _unchanged(model, before)


def test_a_gradient_on_a_parameter_taken_out_of_the_model_is_refused_in_words_not_a_stopiteration():
    # review 36g: a layer moved to another model kept its parameters in this guard's optimizer; the
    # refusal of their gradient looked its name up in the model: a bare StopIteration
    model, guard, _ = _after_a_step()
    moved = model[1]
    del model[1]
    moved.weight.grad = torch.ones(4)
    with pytest.raises(RuntimeError, match=r"^Guard.backward\(\): a parameter of shape \[4\], no longer in the model, "
                                           "already holds a gradient"):
        _train(model, guard, _batches(n=1))


def test_a_parameter_taken_out_of_the_model_is_refused_by_name_at_the_look_and_lightnings_path_looks_too():
    # review 36i: a bias set to None (or a deleted adapter), still in the optimizer, was refused at the
    # next multiple of 64 steps as "a loss module's own parameters"; 36j/36l: tolerating it let a
    # gradient that still reached it (used functionally, moved into the loss) go unclipped and
    # unchecked; and keep_running_stats(), the Lightning plugin's call, never looked again: a
    # BatchNorm a compiled forward made stayed NaN
    from ampguard.watch import UNFROZEN_EVERY

    model, guard, _ = _after_a_step()
    model[3].bias = None
    with pytest.raises(ValueError, match=r"^the optimizer holds a parameter of shape \[1\] the model no longer does "
                                         r"\(taken out since the guard read it"):
        _train(model, guard, _batches(n=1) * (UNFROZEN_EVERY + 1))
    assert guard.steps == UNFROZEN_EVERY

    # review 36j: a compiled forward that fills a slot holding None (counted as a slot) was never seen
    class Fills(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.fill = nn.Linear(4, 4, bias=False), nn.Linear(4, 1), False

        def forward(self, x):
            if self.fill and self.a.bias is None:
                self.a.bias = nn.Parameter(torch.zeros(4))
            return self.b(self.a(x))

    _refused_once_its_compiled_forward_makes(Fills(), "fill", "a.bias")

    model = _Grows(lambda: nn.BatchNorm1d(4, affine=False))
    guard = _guard(model)
    model.compile(backend="eager")
    model.grow = True
    for x in _batches(n=1) * (UNFROZEN_EVERY + 1):  # (as the plugin: its own autocast, the copy asked for first)
        guard.keep_running_stats()
        loss = model(x).pow(2).mean()
        guard.backward(loss)
        guard.step()
    assert guard._running_stats.layers == [model.extra]
