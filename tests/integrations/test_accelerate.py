"""ampguard with Accelerate, for real: the guard in a script under ``accelerate launch`` (2 CPU
processes, gloo), and the skip read from the scaler when Accelerate owns it (accelerate#4242)."""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path

import pytest
import torch

from helpers import EARLY_TIMEOUT_S, Ended, read_rows, run_to_end, torchrun_env, warm_workers

accelerate = pytest.importorskip("accelerate")
from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from ampguard.integrations.accelerate import found_inf, make_guard  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "accelerate_guard.py"
UNPREPARED = Path(__file__).resolve().parents[1] / "dist_scripts" / "accelerate_unprepared.py"


@pytest.fixture
def accelerator():
    """An ``Accelerator`` on the CPU; Accelerate's process-wide state is reset before and after: its
    gradient state too, which an earlier test's Trainer may leave between two accumulation steps
    (``sync_gradients`` False: ``AcceleratedOptimizer.step`` then does nothing, the scale stays)."""
    GradientState._reset_state()
    yield accelerate.Accelerator(cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _overflowing_step(optimizer: AcceleratedOptimizer, model: torch.nn.Module) -> torch.Tensor:
    optimizer.scaler.scale(model(torch.ones(2, 4)).sum() * float("inf")).backward()
    return found_inf(optimizer.scaler, optimizer)


@pytest.mark.parametrize("fused", [False, True])
def test_found_inf_is_the_skip_where_step_was_skipped_is_wrong_for_fused_adamw(accelerator, fused):
    model = torch.nn.Linear(4, 1)
    optimizer = AcceleratedOptimizer(torch.optim.AdamW(model.parameters(), fused=fused), device_placement=False,
                                     scaler=torch.amp.GradScaler("cpu", init_scale=8.0))
    before = [p.detach().clone() for p in model.parameters()]
    flag = _overflowing_step(optimizer, model)
    optimizer.step()
    assert flag.item() == 1.0  # ampguard's reading: skipped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # and it was
    assert optimizer.scaler.get_scale() == 4.0  # the scale backed off
    # Accelerate's own signal: right for a plain AdamW, "not skipped" for the fused one (accelerate#4242)
    assert optimizer.step_was_skipped is (not fused)


def test_found_inf_after_clip_grad_norm_and_on_a_clean_step(accelerator):
    model = torch.nn.Linear(4, 1)
    optimizer = AcceleratedOptimizer(torch.optim.AdamW(model.parameters(), fused=True), device_placement=False,
                                     scaler=torch.amp.GradScaler("cpu", init_scale=8.0))
    optimizer.scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    assert found_inf(optimizer.scaler, optimizer).item() == 0.0  # checked without unscaling ...
    optimizer.scaler.unscale_(optimizer.optimizer)  # ... so the usual unscale (clip_grad_norm_) still works
    assert found_inf(optimizer.scaler, optimizer).item() == 0.0
    optimizer.step()
    assert optimizer.scaler.get_scale() == 8.0
    assert found_inf(torch.amp.GradScaler("cpu", enabled=False), optimizer).item() == 0.0  # no scaler, no skip
    # Accelerate makes no scaler at all for bf16 (and for fp16 on a CPU): accelerator.scaler is None
    AcceleratorState._reset_state(reset_partial_state=True)
    bf16 = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    assert bf16.scaler is None and found_inf(bf16.scaler, optimizer).item() == 0.0


def test_make_guard_refuses_an_accelerator_that_does_the_amp_too(accelerator):
    model = torch.nn.Linear(4, 1)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    guard = make_guard(accelerator, model, optimizer, precision="bf16")
    assert guard.optimizer is optimizer.optimizer  # the torch optimizer inside Accelerate's wrapper
    AcceleratorState._reset_state(reset_partial_state=True)
    amp = accelerate.Accelerator(cpu=True, mixed_precision="bf16")  # Accelerate autocasts too: refused
    with pytest.raises(ValueError, match="mixed_precision='no'"):
        make_guard(amp, model, optimizer, precision="bf16")


def test_make_guard_refuses_an_accelerator_that_counts_other_processes_than_torch_distributed(accelerator,
                                                                                             monkeypatch):
    # accelerate launch --multi_gpu on a machine without a GPU, Accelerator() not told cpu=True:
    # torch.distributed held 2 processes, each accelerator counted 1 (each process "the main one",
    # the model not wrapped): both wrote the CSV, and one died in the guard's all-reduce. Here the
    # other way round (one process, an accelerator whose num_processes says 2)
    model = torch.nn.Linear(4, 1)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert accelerator.num_processes == 1
    make_guard(accelerator, model, optimizer, precision="bf16")  # the same count: taken
    monkeypatch.setattr(type(accelerator), "num_processes", property(lambda self: 2))
    assert accelerator.num_processes == 2
    with pytest.raises(ValueError, match=r"the accelerator counts 2 processes but torch.distributed has 1: "):
        make_guard(accelerator, model, optimizer, precision="bf16")
    monkeypatch.undo()  # the launch's case: a group of 2 (as the group reads), an accelerator of 1
    from ampguard import distributed

    monkeypatch.setattr(distributed, "current", lambda: distributed.DistInfo(rank=0, world_size=2))
    with pytest.raises(ValueError, match=r"the accelerator counts 1 process but torch.distributed has 2 \(accelerate "
                                         r"launch on a machine without a GPU: make it Accelerator\(cpu=True\)"):
        make_guard(accelerator, model, optimizer, precision="bf16")


def test_make_guard_takes_the_accelerators_gradient_accumulation_steps():
    model = torch.nn.Linear(4, 1)
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=4)
    try:
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        assert make_guard(accelerator, model, optimizer, precision="bf16").accumulation_steps == 4
        assert make_guard(accelerator, model, optimizer, precision="bf16", accumulation_steps=4).accumulation_steps == 4
        with pytest.raises(ValueError, match="accumulation_steps=2 but the accelerator has gradient_accumulation_steps=4"):
            make_guard(accelerator, model, optimizer, precision="bf16", accumulation_steps=2)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    default = accelerate.Accelerator(cpu=True)  # its default 1 asks nothing: the guard's own number stands
    try:
        assert make_guard(default, model, optimizer, precision="bf16", accumulation_steps=3).accumulation_steps == 3
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_make_guard_takes_the_accumulation_from_accelerates_environment_variable(monkeypatch):
    # what `accelerate launch --gradient_accumulation_steps` sets, for DeepSpeed launches only
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "3")
    model = torch.nn.Linear(4, 1)
    accelerator = accelerate.Accelerator(cpu=True)
    try:
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        assert make_guard(accelerator, model, optimizer, precision="bf16").accumulation_steps == 3
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_the_accelerators_own_clipping_is_refused_once_the_guard_clips(accelerator, precision):
    # left in a port, accelerator.clip_grad_norm_ (no scaler of its own with mixed_precision="no")
    # clipped the guard's still-scaled fp16 gradients: every update shrank by the scale, silently
    model = torch.nn.Linear(4, 1)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    guard = make_guard(accelerator, model, optimizer, precision=precision)
    with guard.autocast():
        loss = model(torch.randn(8, 4)).square().mean()
    guard.backward(loss)
    for call in (lambda: accelerator.clip_grad_norm_(model.parameters(), 1.0),
                 lambda: accelerator.clip_grad_value_(model.parameters(), 1.0)):
        with pytest.raises(ValueError, match=r"the guard clips at guard.step\(\) \(max_norm=\).*would clip twice.*remove the call"):
            call()
    assert guard.step().step == 1  # the step itself goes on (fp16 at 2**16 may skip it: an overflow)
    fresh = accelerate.Accelerator(cpu=True)  # another accelerator (the same process-wide state) is left alone
    other = torch.nn.Linear(2, 1)
    other(torch.ones(1, 2)).sum().backward()
    assert float(fresh.clip_grad_norm_(other.parameters(), 1.0)) > 0  # it clips, refusing nothing


def test_a_prepared_scheduler_the_loop_also_steps_is_refused(accelerator):
    # AcceleratedScheduler has no last_epoch of its own: the guard read nothing, and the stock
    # lr_scheduler.step() kept in the loop ran the schedule twice as fast, on the skips too
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model, opt, sched = accelerator.prepare(model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    assert type(sched).__name__ == "AcceleratedScheduler"
    guard = make_guard(accelerator, model, opt, precision="bf16", scheduler=sched)

    def step() -> None:
        with guard.autocast():
            loss = model(torch.ones(8, 4)).square().mean()
        guard.backward(loss)
        guard.step()

    step()
    sched.step()  # the stock line kept
    with pytest.raises(RuntimeError, match=r"^the AcceleratedScheduler of optimizer 'optimizer' was stepped outside "
                                           r"the guard \(last_epoch 2, the guard left it at 1\)"):
        step()
    assert guard.updates == 1


@pytest.mark.parametrize("form", ["single", "dict"])
def test_a_scheduler_built_over_the_prepared_optimizer_is_taken(accelerator, form):
    # the guard holds the torch optimizer inside Accelerate's wrapper: a scheduler made over the
    # wrapper was refused as "drives none of the guard's optimizers" (the dict form: "another")
    model = torch.nn.Linear(4, 1)
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 0.9 ** n)
    guard = make_guard(accelerator, model, opt, precision="bf16", scheduler=sched if form == "single" else
                       {"optimizer": sched})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with guard.autocast():
            loss = model(torch.ones(8, 4)).square().mean()
        guard.backward(loss)
        guard.step()
    assert sched.last_epoch == 1 and opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.9)
    # the guard stepped the torch optimizer inside the wrapper the scheduler watches: torch's first
    # scheduler step warned that the optimizer had not stepped ("the first value ... skipped")
    assert not [w for w in seen if "lr_scheduler.step()" in str(w.message)], [str(w.message) for w in seen]


def early(work: Path) -> dict[str, Ended]:
    """The two ``accelerate launch`` of the tests below (three processes each, each importing
    accelerate), each run to its end: an early job (conftest.py: started at collection, off the
    suite's own process; the tests that read it run last). The launcher is forked warm and so are
    its two processes (``--no_python`` and the stand-in of ``helpers.warm_workers``, as torchrun's
    in ``helpers.Launch``: a fresh one spent ~5 s of CPU importing torch); what they run is the
    script, under Accelerate's own launcher (its torchrun), as ``accelerate launch SCRIPT`` would."""
    (workers, env), folder = warm_workers(torchrun_env()), work / "launch"
    assert workers[0] == "--no-python"  # (torchrun's spelling; accelerate launch's is --no_python)
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
              "--no_python", *workers[1:]]
    cmd = [*launch, str(EXAMPLE), "--precision", "bf16", "--steps", "8", "--csv", str(folder / "steps.csv"),
           "--inf-at", "3", "--inf-rank", "1"]
    return {"launch": run_to_end("launch", cmd, folder, timeout_s=EARLY_TIMEOUT_S, env=env),
            "unprepared": run_to_end("unprepared", [*launch, str(UNPREPARED)], work / "unprepared",
                                     timeout_s=EARLY_TIMEOUT_S, env=env)}


@pytest.mark.slow
def test_two_processes_under_accelerate_launch_skip_the_fault_of_one_together(launches):
    done = launches["launch"]
    assert done.rc == 0, done.stderr[-3000:]
    lines = dict(re.findall(r"rank (\d): (\d+ steps, .*? checksum -?[\d.]+)", done.stdout))
    assert sorted(lines) == ["0", "1"]
    # the inf was on process 1 alone; both skipped step 3 and stayed identical
    assert all("8 steps, 7 updates, skipped [3]" in line for line in lines.values())
    assert lines["0"].split("checksum")[1] == lines["1"].split("checksum")[1]
    # the float32 map, noted in the first forward under guard.autocast(): DDP's module inside, by its own names
    assert all(line.endswith("; under autocast: 0 bfloat16, 1 bfloat16, 2 bfloat16") for line in done.stdout.splitlines()
               if line.startswith("rank ")), done.stdout
    rows = read_rows(done.cwd / "steps.csv")  # one CSV, written by process 0
    assert [r["step"] for r in rows] == [str(s) for s in range(1, 9)]
    assert [(r["step"], r["skip_reason"], r["grad_l2_pre_clip"]) for r in rows if r["skipped"] == "1"] == [
        ("3", "non_finite_grad", "inf")]
    lrs = [float(r["lr"]) for r in rows]
    assert lrs[1] < lrs[2] == lrs[3] < lrs[4]  # the warm-up held on the skipped step
    assert not list(done.cwd.glob("*.csv.*"))


@pytest.mark.slow
def test_make_guard_refuses_the_model_from_before_prepare_on_every_process(launches):
    # (review 48b: given it, each process trained its own replica while the guard tied their skips into one record)
    done = launches["unprepared"]
    assert done.rc == 0, done.stderr[-3000:]
    for rank in (0, 1):
        for case, which in (("before", ""), ("inside", ""), ("gan_dict_before", " (model 'g')"),
                            ("gan_modulelist_before", " (model 0)"), ("gan_moduledict_before", " (model 'g')")):
            # (review 48e: a GAN's dict or ModuleList of models from before prepare was taken; 48f: name which)
            assert f"rank {rank}: {case} refused: make_guard got the Linear{which} from before accelerator.prepare " \
                   f"(or from inside what it returned)" in done.stdout, done.stdout
        for case in ("prepared", "gan_dict_prepared"):
            assert f"rank {rank}: {case} taken" in done.stdout, done.stdout


def _guarded_run(folder: Path, micro_batches: int, *, load: Path | None = None, **accelerator_kw):
    """A fresh accelerator, model and guard (fp16, accumulation 2, a low first scale so it moves),
    ``load_state(load)`` if given, then ``micro_batches`` micro-batches: ``(accelerator, model, guard)``."""
    torch.manual_seed(0)
    accelerator = accelerate.Accelerator(cpu=True, project_dir=str(folder), **accelerator_kw)
    model = torch.nn.Linear(4, 1)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    guard = make_guard(accelerator, model, optimizer, precision="fp16", accumulation_steps=2,
                       scaler={"init_scale": 8.0, "growth_interval": 1})
    if load is not None:
        accelerator.load_state(str(load))
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    for _ in range(micro_batches):
        with guard.autocast():
            loss = model(x).square().mean()
        guard.backward(loss)
        guard.step()
    return accelerator, model, guard


def test_save_state_inside_a_group_keeps_the_last_closed_step_and_deletes_no_checkpoint(tmp_path):
    # make_guard left the guard for the user to register; its state_dict() refused inside a group,
    # but Accelerate asks for it only after deleting old checkpoints (total_limit) and writing the
    # model's files: the one good checkpoint was gone and the new one could not be loaded
    from accelerate.utils import ProjectConfiguration

    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=1)
    try:
        accelerator, model, guard = _guarded_run(tmp_path, 2, project_config=config)  # step 1
        accelerator.save_state()  # checkpoint_0, at the group's boundary
        with guard.autocast():
            loss = model(torch.randn(8, 4, generator=torch.Generator().manual_seed(1))).square().mean()
        guard.backward(loss)
        guard.step()  # micro-batch 1 of 2
        assert (guard.steps, guard.mid_group, guard.scaler.get_scale()) == (1, True, 16.0)
        weights = model.weight.detach().clone()
        with pytest.raises(ValueError, match="make_guard registered the guard's state already"):
            accelerator.register_for_checkpointing(guard)
        accelerator.save_state()  # mid-group: no refusal; total_limit 1 deletes checkpoint_0 for it
        saved = sorted((tmp_path / "checkpoints").iterdir())
        assert [p.name for p in saved] == ["checkpoint_1"]
        assert sorted(p.name for p in saved[0].iterdir() if p.name.startswith("custom_checkpoint")) == [
            "custom_checkpoint_0.pkl"]  # (whole: the guard's state is in it)
        # with the layers autocast left in float32 (here none: one Linear, in float16), a record kept with it
        kept = torch.load(saved[0] / "custom_checkpoint_0.pkl", weights_only=False)
        assert kept["step"] == 1 and kept["autocast_dtypes"] == guard.autocast_dtypes == {"Linear": "float16"}
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    try:
        _, model, guard = _guarded_run(tmp_path / "again", 0, load=saved[0])
        assert (guard.steps, guard.updates, guard.mid_group, guard.scaler.get_scale()) == (1, 1, False, 16.0)
        assert torch.equal(model.weight.detach(), weights)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_make_guard_twice_on_one_accelerator_keeps_one_checkpointed_guard_state(accelerator, tmp_path):
    # a rerun notebook cell: a second GuardState beside the first made a checkpoint another
    # script (one make_guard) could not load ("number of custom checkpoints ... does not match")
    model = torch.nn.Linear(4, 1)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    make_guard(accelerator, model, optimizer, precision="bf16")
    second = make_guard(accelerator, model, optimizer, precision="bf16")
    assert [type(o).__name__ for o in accelerator._custom_objects] == ["GuardState"]
    assert accelerator._custom_objects[0].guard is second
    accelerator.register_for_checkpointing(torch.optim.lr_scheduler.StepLR(optimizer, 1))  # others still go in
    assert len(accelerator._custom_objects) == 2


def test_a_folder_saved_without_the_guards_state_loads_with_register_state_false(tmp_path):
    # review_session14 B7: a checkpoint of an older ampguard (the guard not registered) holds no custom
    # state; with make_guard's registration Accelerate refused it ("Number of custom checkpoints ...")
    try:
        torch.manual_seed(0)
        accelerator = accelerate.Accelerator(cpu=True)
        model = torch.nn.Linear(4, 1)
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        accelerator.save_state(str(tmp_path / "old"))  # (no guard registered: as before make_guard did it)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    try:
        with pytest.raises(RuntimeError, match="Number of custom checkpoints"):
            _guarded_run(tmp_path / "a", 0, load=tmp_path / "old")
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    try:
        accelerator = accelerate.Accelerator(cpu=True)
        model = torch.nn.Linear(4, 1)
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        guard = make_guard(accelerator, model, optimizer, precision="bf16", register_state=False)
        accelerator.load_state(str(tmp_path / "old"))
        assert guard.steps == 0 and accelerator._custom_objects == []
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("fused", [False, True])
def test_found_inf_on_each_micro_batch_of_an_accumulation_group_is_that_micro_batchs_truth(fused):
    # review 52e: read on a micro-batch whose gradients were not unscaled, the check stayed in the
    # scaler's record and the next micro-batch read it back: an inf in a group's last micro-batch
    # read 0.0 while the scaler skipped the step (and, fused, step_was_skipped said False too)
    GradientState._reset_state()
    try:
        accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
        model = torch.nn.Linear(4, 1)
        scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
        optimizer = AcceleratedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused),
                                         device_placement=False, scaler=scaler)
        before = [p.detach().clone() for p in model.parameters()]
        flags = []
        for bad in (False, True):
            with accelerator.accumulate(model):
                x = torch.ones(2, 4) * (float("inf") if bad else 1.0)
                scaler.scale(model(x).sum()).backward()
                flags.append(found_inf(scaler, optimizer).item())
                optimizer.step()
                optimizer.zero_grad()
        assert flags == [0.0, 1.0]
        assert scaler.get_scale() == 4.0 and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def test_found_inf_after_unscale_is_what_unscale_found_though_the_gradients_were_cleaned_since():
    # review_tests14 #6: after unscale_ (accelerator.clip_grad_norm_ does it) a hook cleaned the
    # gradients (nan_to_num_): the step is still skipped, as GradScaler.step skips on what unscale_
    # found; a fresh check of the clean gradients said "applied" and overwrote the scaler's own flag
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(model(torch.ones(2, 4)).sum() * float("inf")).backward()
    scaler.unscale_(opt)
    for p in model.parameters():
        p.grad.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    before = [p.detach().clone() for p in model.parameters()]
    assert found_inf(scaler, opt).item() == 1.0
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0 and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def _one_step(guard, model) -> None:
    with guard.autocast():
        loss = model(torch.ones(8, 4)).square().mean()
    guard.backward(loss)
    guard.step()


def test_accumulate_around_the_guard_is_refused_and_a_stale_sync_flag_no_longer_holds_the_schedule():
    # review 36k: Accelerate's prepared scheduler steps only while its gradient state says "sync":
    # inside accumulate() (or after one left mid-group) the guard's scheduler steps went nowhere, its
    # updates at a frozen LR, unsaid
    from accelerate.state import GradientState

    try:
        accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
        warm = torch.nn.Linear(4, 1)
        warm, wopt = accelerator.prepare(warm, torch.optim.SGD(warm.parameters(), lr=0.1))
        with accelerator.accumulate(warm):  # (one micro-batch of a group of 2, the stock way: the flag left False)
            accelerator.backward(warm(torch.ones(8, 4)).square().mean())
        assert not accelerator.sync_gradients
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        model, opt, sched = accelerator.prepare(model, opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
        guard = make_guard(accelerator, model, opt, precision="fp32", scheduler=sched)
        for _ in range(4):
            _one_step(guard, model)
        assert guard.updates == 2 and sched.scheduler.last_epoch == 2 and opt.param_groups[0]["lr"] == 0.25
        with pytest.raises(ValueError, match=r"^accelerator.accumulate\(\) with the guard doing the AMP: the guard "
                                             "accumulates over gradient_accumulation_steps itself"):
            with accelerator.accumulate(model):
                pass
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def test_make_guard_takes_a_gans_prepared_optimizers_and_refuses_their_schedulers_swapped(accelerator):
    # review 36k: a dict of prepared optimizers reached the guard as Accelerate's wrappers (an
    # AttributeError), and prepared schedulers (no .optimizer of their own) were taken swapped
    gen, disc = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
    og, od = torch.optim.SGD(gen.parameters(), lr=0.1), torch.optim.SGD(disc.parameters(), lr=0.1)
    gen, disc, og, od, sg, sd = accelerator.prepare(gen, disc, og, od, torch.optim.lr_scheduler.StepLR(og, 1),
                                                    torch.optim.lr_scheduler.StepLR(od, 1))
    with pytest.raises(ValueError, match="scheduler 'G': the AcceleratedScheduler given drives another optimizer"):
        make_guard(accelerator, {"G": gen, "D": disc}, {"G": og, "D": od}, precision="fp32",
                   scheduler={"G": sd, "D": sg})
    guard = make_guard(accelerator, {"G": gen, "D": disc}, {"G": og, "D": od}, precision="fp32",
                       scheduler={"G": sg, "D": sd})
    assert guard.optimizers["G"] is og.optimizer and guard.optimizers["D"] is od.optimizer


def test_make_guard_refuses_uneven_batches_over_several_processes():
    # review 36k: with even_batches=False a process with fewer batches paired its next epoch's steps
    # with another's last (a hang, then a gloo error)
    from types import SimpleNamespace

    with pytest.raises(ValueError, match=r"^Accelerator\(even_batches=False\) over several processes"):
        make_guard(SimpleNamespace(mixed_precision="no", num_processes=2, even_batches=False),
                   torch.nn.Linear(4, 1), torch.optim.SGD(torch.nn.Linear(4, 1).parameters(), lr=0.1))


def test_a_prepared_plateau_scheduler_is_refused_up_front_and_a_schedulers_own_scheduler_field_is_left_alone(
        accelerator):
    # review 36l: a prepared ReduceLROnPlateau was taken, then its step() raised in the close, after the
    # update ran; and a scheduler of the user's own making with a .scheduler field of its own meaning
    # (a config) was read as Accelerate's wrapper and refused
    from types import SimpleNamespace

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, plateau = accelerator.prepare(model, opt, torch.optim.lr_scheduler.ReduceLROnPlateau(opt))
    with pytest.raises(ValueError, match="^ReduceLROnPlateau steps on a metric the guard does not have"):
        make_guard(accelerator, model, opt, precision="fp32", scheduler=plateau)

    class Own:
        scheduler = SimpleNamespace(optimizer="adamw")  # (a config, not Accelerate's inner scheduler)
        steps = 0

        def step(self):
            self.steps += 1

    own = Own()
    guard = make_guard(accelerator, model, opt, precision="fp32", scheduler=own)
    _one_step(guard, model)
    assert own.steps == 1
