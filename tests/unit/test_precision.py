"""precision.py: the Precision object and GuardedGradScaler, its floor above all.

The floor exists because PyTorch's GradScaler has none: 200 back-offs from 2**16 take its scale
to exactly 0, and from then on every clean step is skipped (gradients unscaled by 1/0 = inf,
inf x 0 = NaN). Every expected scale here is computed from the scaler arithmetic
(x backoff on a skip, x growth after ``growth_interval`` clean steps, clamped to the floor),
or read from a plain ``torch.amp.GradScaler`` fed the same flags.
"""

from __future__ import annotations

import json
import random
import warnings

import pytest
import torch

from helpers import HostReads

from ampguard.precision import DEFAULT_MIN_SCALE, PRECISIONS, GuardedGradScaler, Precision, SlowPrecisionWarning

TINY = torch.finfo(torch.float32).tiny


def optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)


def one_update(scaler: torch.amp.GradScaler, opt: torch.optim.Optimizer, bad: bool) -> float:
    """One iteration's update: found_inf recorded as ``unscale_`` would, then ``update()``."""
    if isinstance(scaler, GuardedGradScaler):
        scaler.add_found_inf_(opt, torch.tensor(float(bad)))
    else:  # a plain GradScaler: record the flag the way unscale_ does
        if scaler._scale is None:
            scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
        scaler._per_optimizer_states[id(opt)]["found_inf_per_device"][torch.device("cpu")] = torch.tensor(
            float(bad))
    scaler.update()
    return scaler.get_scale()


def expected_scales(flags: list[bool], init: float, floor: float, growth_interval: int,
                    growth: float = 2.0, backoff: float = 0.5) -> list[float]:
    scale, tracker, out = init, 0, []
    for bad in flags:
        if bad:
            scale, tracker = max(scale * backoff, floor), 0
        else:
            tracker += 1
            if tracker == growth_interval:
                scale, tracker = scale * growth, 0
        out.append(scale)
    return out


# ---------------------------------------------------------------------------- the floor


def test_default_floor_is_the_smallest_normal_float32():
    assert DEFAULT_MIN_SCALE == TINY == 2.0**-126
    assert GuardedGradScaler("cpu").get_min_scale() == DEFAULT_MIN_SCALE
    # the unscale factor 1/scale stays finite in float32 at the floor
    assert torch.isfinite(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(DEFAULT_MIN_SCALE))


def test_plain_gradscaler_decays_to_exactly_zero():
    # The defect the floor fixes, shown on PyTorch's own scaler: no floor, 200 back-offs -> 0.
    scaler, opt = torch.amp.GradScaler("cpu", init_scale=2.0**16), optimizer()
    for _ in range(200):
        one_update(scaler, opt, bad=True)
    assert scaler.get_scale() == 0.0


@pytest.mark.parametrize("floor", [DEFAULT_MIN_SCALE, 1.0, 2.0**-20])
def test_200_backoffs_stop_at_the_floor_never_zero(floor):
    scaler, opt = GuardedGradScaler("cpu", init_scale=2.0**16, min_scale=floor), optimizer()
    scales = [one_update(scaler, opt, bad=True) for _ in range(200)]
    assert scales == expected_scales([True] * 200, 2.0**16, floor, 2000)
    assert min(scales) == scales[-1] == floor > 0.0
    assert all(s >= TINY for s in scales)  # never 0, never a subnormal
    assert scales[:16] == [2.0 ** (15 - k) for k in range(16)]  # halving as PyTorch does above it


@pytest.mark.parametrize("floor", [DEFAULT_MIN_SCALE, 1.0])
def test_clean_steps_after_the_floor_grow_the_scale_again(floor):
    growth_interval = 3
    scaler = GuardedGradScaler("cpu", init_scale=2.0**16, growth_interval=growth_interval, min_scale=floor)
    opt = optimizer()
    for _ in range(200):
        one_update(scaler, opt, bad=True)
    assert scaler.get_scale() == floor
    clean = [one_update(scaler, opt, bad=False) for _ in range(3 * growth_interval)]
    assert clean == [floor, floor, 2 * floor, 2 * floor, 2 * floor, 4 * floor, 4 * floor, 4 * floor, 8 * floor]


def test_floor_is_not_float32_exact_value_clamps_to_its_float32():
    scaler, opt = GuardedGradScaler("cpu", init_scale=1.0, min_scale=0.1), optimizer()
    for _ in range(10):
        one_update(scaler, opt, bad=True)
    assert scaler.get_scale() == float(torch.tensor(0.1, dtype=torch.float32))


def test_equal_to_plain_gradscaler_above_the_floor():
    # Random skip/clean flags that never take the scale to the floor: scale and growth tracker
    # equal PyTorch's GradScaler's at every step (the clamp is then a no-op).
    rng = random.Random(0)
    flags = [rng.random() < 0.15 for _ in range(300)]
    kw = dict(init_scale=2.0**16, growth_interval=4, growth_factor=2.0, backoff_factor=0.5)
    ours, theirs = GuardedGradScaler("cpu", min_scale=1.0, **kw), torch.amp.GradScaler("cpu", **kw)
    o_opt, t_opt = optimizer(), optimizer()
    lowest = float("inf")
    for bad in flags:
        a, b = one_update(ours, o_opt, bad), one_update(theirs, t_opt, bad)
        assert a == b
        assert ours._get_growth_tracker() == theirs._get_growth_tracker()
        lowest = min(lowest, b)
    assert lowest > 1.0  # the sequence really stayed above the floor
    assert {k: v for k, v in ours.state_dict().items() if k != "min_scale"} == theirs.state_dict()


def test_floor_against_the_arithmetic_on_a_long_random_run():
    rng = random.Random(1)
    flags = [rng.random() < 0.6 for _ in range(400)]  # mostly bad: the floor is hit often
    scaler, opt = GuardedGradScaler("cpu", init_scale=64.0, growth_interval=2, min_scale=0.5), optimizer()
    got = [one_update(scaler, opt, bad) for bad in flags]
    want = expected_scales(flags, 64.0, 0.5, 2)
    assert got == want
    assert want.count(0.5) > 50  # it sat at the floor many times


def test_update_with_a_new_scale_below_the_floor_is_clamped():
    scaler = GuardedGradScaler("cpu", init_scale=8.0, min_scale=2.0)
    scaler.scale(torch.ones(()))
    scaler.update(0.0)
    assert scaler.get_scale() == 2.0
    scaler.update(torch.tensor(16.0))
    assert scaler.get_scale() == 16.0


def test_update_makes_no_host_read():
    scaler, opt = GuardedGradScaler("cpu", init_scale=4.0, min_scale=1.0), optimizer()
    one_update(scaler, opt, bad=True)  # lazy init outside the count
    with HostReads() as reads:
        for _ in range(5):
            scaler.add_found_inf_(opt, torch.ones(()))
            scaler.update()
    assert reads.count == 0, reads.names
    assert scaler.get_scale() == 1.0


def test_first_step_bad_before_anything_was_scaled():
    scaler, opt = GuardedGradScaler("cpu", init_scale=1.0, min_scale=1.0), optimizer()
    scaler.mark_found_inf_(opt)  # no scale() call yet: the scale tensor is created here
    scaler.update()
    assert scaler.get_scale() == 1.0 and float(scaler.scale_value()) == 1.0


@pytest.mark.parametrize("bad", [0.0, -1.0, 2.0**-127, 2.0**-149, float("nan"), float("inf")])
def test_refuses_a_floor_that_is_not_a_normal_positive_float32(bad):
    with pytest.raises(ValueError, match="min_scale"):
        GuardedGradScaler("cpu", min_scale=bad)


def test_refuses_init_scale_below_the_floor_when_enabled():
    with pytest.raises(ValueError, match="init_scale"):
        GuardedGradScaler("cpu", init_scale=0.5, min_scale=1.0)
    assert not GuardedGradScaler("cpu", init_scale=0.5, min_scale=1.0, enabled=False).is_enabled()
    assert GuardedGradScaler("cpu", init_scale=1.0, min_scale=1.0).get_scale() == 1.0  # equal is fine


def test_refuses_init_scale_past_float32():
    # PyTorch's scaler would fail at the first scale() ("value cannot be converted to type float")
    with pytest.raises(ValueError, match="init_scale .* largest float32"):
        GuardedGradScaler("cpu", init_scale=1e39)
    biggest = torch.finfo(torch.float32).max
    scaler = GuardedGradScaler("cpu", init_scale=biggest)
    assert scaler.scale(torch.ones(())).item() == biggest and scaler.get_scale() == biggest


# ---------------------------------------------------------------------------- state_dict


def test_state_dict_round_trip_keeps_the_floor_and_continues_identically():
    rng = random.Random(2)
    flags = [rng.random() < 0.5 for _ in range(60)]
    live, opt = GuardedGradScaler("cpu", init_scale=16.0, growth_interval=3, min_scale=4.0), optimizer()
    for bad in flags[:30]:
        one_update(live, opt, bad)
    state = json.loads(json.dumps(live.state_dict()))  # plain data, as a checkpoint holds it
    assert state["min_scale"] == 4.0
    restored = GuardedGradScaler("cpu", min_scale=1.0)  # another floor: the saved one wins
    restored.load_state_dict(state)
    assert restored.get_min_scale() == 4.0
    r_opt = optimizer()
    for bad in flags[30:]:
        assert one_update(restored, r_opt, bad) == one_update(live, opt, bad)
    assert restored.state_dict() == live.state_dict()
    assert min(expected_scales(flags, 16.0, 4.0, 3)) == 4.0  # the continuation crossed the floor


def test_loads_a_state_without_a_floor_and_lifts_a_collapsed_scale():
    # A plain GradScaler's state (or one saved before floors existed) whose scale decayed to 0.
    plain, opt = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2), optimizer()
    for _ in range(200):
        one_update(plain, opt, bad=True)
    state = plain.state_dict()
    assert state["scale"] == 0.0 and "min_scale" not in state
    for warm in (False, True):  # before and after this scaler made its scale tensor
        scaler = GuardedGradScaler("cpu", init_scale=8.0, min_scale=1.0)
        if warm:
            scaler.scale(torch.ones(()))
        scaler.load_state_dict(state)
        assert scaler.get_min_scale() == 1.0 and scaler.get_scale() == 1.0
        s_opt = optimizer()
        assert [one_update(scaler, s_opt, bad=False) for _ in range(4)] == [1.0, 2.0, 2.0, 4.0]


def test_disabled_scaler_state_is_empty_and_load_is_a_no_op():
    scaler = GuardedGradScaler("cpu", enabled=False)
    assert scaler.state_dict() == {}
    scaler.load_state_dict({"scale": 0.0, "min_scale": 0.0})  # ignored, as PyTorch's does
    assert float(scaler.scale_value()) == 1.0


def test_load_refuses_a_bad_saved_floor():
    state = GuardedGradScaler("cpu", init_scale=4.0).state_dict()
    state["min_scale"] = 0.0
    scaler = GuardedGradScaler("cpu", init_scale=4.0)
    with pytest.raises(ValueError, match="min_scale"):
        scaler.load_state_dict(state)
    assert scaler.get_scale() == 4.0 and scaler.get_min_scale() == DEFAULT_MIN_SCALE  # untouched


def saved_scaler() -> dict:
    """A scaler's state mid-run, as a checkpoint holds it (scale grown, a count of clean steps)."""
    scaler, opt = GuardedGradScaler("cpu", init_scale=16.0, growth_interval=4, min_scale=2.0), optimizer()
    for bad in (False, False, False, False, False, True, False):
        one_update(scaler, opt, bad)
    return json.loads(json.dumps(scaler.state_dict()))


# A checkpoint's scaler state is taken as it is by PyTorch: each of these used to load, then fail at
# the first update() mid-run (a str factor, a tracker past the interval or int32) or go quietly wrong.
BAD_SCALER = [
    ("growth_factor", "x", "growth_factor is 'x', expected a finite number > 1"),
    ("growth_factor", 0.0, "growth_factor is 0.0, expected a finite number > 1"),
    ("backoff_factor", float("nan"), "backoff_factor is nan, expected in (0, 1)"),
    ("backoff_factor", True, "backoff_factor is True"),
    ("scale", float("inf"), "scale is inf, expected a number in [0, "),
    ("scale", -1.0, "scale is -1.0"),
    ("scale", 1e39, "scale is 1e+39"),  # past float32: the scale tensor would hold inf
    ("scale", [8.0], "scale is a list"),
    ("growth_interval", 0, "growth_interval is 0, expected an int >= 1"),
    ("growth_interval", 2.5, "growth_interval is 2.5"),
    ("growth_interval", 2**63, "growth_interval is 9223372036854775808"),  # past the kernel's int64
    ("_growth_tracker", "x", "_growth_tracker is 'x', expected an int in [0, growth_interval 4)"),
    ("_growth_tracker", -1, "_growth_tracker is -1"),
    ("_growth_tracker", 4, "_growth_tracker is 4, expected an int in [0, growth_interval 4)"),  # would never grow
    ("min_scale", 10**400, "min_scale is 1000000000"),  # float() of it raises OverflowError
    ("min_scale", "1", "min_scale is '1'"),
]


@pytest.mark.parametrize(("key", "value", "said"), BAD_SCALER,
                         ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(BAD_SCALER)])
def test_load_refuses_a_saved_field_of_the_wrong_kind_naming_it_and_leaves_the_scaler_untouched(key, value, said):
    scaler = GuardedGradScaler("cpu", init_scale=64.0, growth_interval=10, min_scale=1.0)
    scaler.scale(torch.ones(()))  # its tensors exist: a load would fill them
    before = scaler.state_dict()
    with pytest.raises(ValueError) as err:
        scaler.load_state_dict({**saved_scaler(), key: value})
    assert str(err.value).startswith(said) and "\n" not in str(err.value)
    assert scaler.state_dict() == before


def test_a_tracker_past_int32_is_refused_under_a_longer_interval():
    state = {**saved_scaler(), "growth_interval": 2**40, "_growth_tracker": 2**31}
    with pytest.raises(ValueError, match=r"_growth_tracker is 2147483648"):
        GuardedGradScaler("cpu").load_state_dict(state)


@pytest.mark.parametrize("missing", ["scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"])
def test_load_refuses_a_state_missing_a_field(missing):
    state = saved_scaler()
    del state[missing]
    with pytest.raises(ValueError, match=f"^{missing} is missing$"):
        GuardedGradScaler("cpu").load_state_dict(state)
    with pytest.raises(ValueError, match="^the scaler state is 'x', expected a mapping$"):
        GuardedGradScaler("cpu").load_state_dict("x")


def test_check_state_names_the_field_under_a_prefix():
    with pytest.raises(ValueError, match=r"^state\.scaler\.growth_factor is 'x'"):
        GuardedGradScaler("cpu").check_state({**saved_scaler(), "growth_factor": "x"}, "state.scaler.")


def test_a_state_of_whole_numbers_loads_as_floats_and_goes_on_updating():
    state = {**saved_scaler(), "scale": 32, "growth_factor": 2, "min_scale": 2}
    scaler, opt = GuardedGradScaler("cpu"), optimizer()
    scaler.load_state_dict(state)
    assert scaler.state_dict()["scale"] == 32.0 and isinstance(scaler.get_growth_factor(), float)
    assert [one_update(scaler, opt, bad) for bad in (False, False, False, True)] == [32.0, 32.0, 64.0, 32.0]


# ---------------------------------------------------------------------------- Precision


def test_make_scaler_passes_the_floor_and_the_settings():
    s = Precision("fp16", "cpu").make_scaler(init_scale=256.0, growth_interval=5, backoff_factor=0.25,
                                             min_scale=16.0)
    assert (s.is_enabled(), s.get_scale(), s.get_growth_interval(), s.get_backoff_factor(), s.get_min_scale()) == (
        True, 256.0, 5, 0.25, 16.0)
    opt = optimizer()
    assert [one_update(s, opt, bad=True) for _ in range(3)] == [64.0, 16.0, 16.0]
    assert Precision("fp16", "cpu").make_scaler().get_min_scale() == DEFAULT_MIN_SCALE


@pytest.mark.parametrize("name", ["bf16", "fp32"])
def test_make_scaler_without_fp16_is_disabled_and_refuses_enabled(name):
    p = Precision(name, "cpu")
    assert not p.make_scaler(min_scale=1.0).is_enabled()
    with pytest.raises(ValueError, match=name):
        p.make_scaler(enabled=True)


def test_precision_dtypes_scaler_and_autocast():
    x = torch.randn(2, 4)
    lin = torch.nn.Linear(4, 3)
    got = {}
    for name in PRECISIONS:
        p = Precision(name, "cpu")
        with p.autocast():
            got[name] = (lin(x).dtype, p.dtype, p.uses_scaler)
    # fp8: bf16 autocast around torchao's Float8Linear layers (a plain Linear stays bf16), no scaler
    assert got == {"fp16": (torch.float16, torch.float16, True), "bf16": (torch.bfloat16, torch.bfloat16, False),
                   "fp32": (torch.float32, torch.float32, False), "fp8": (torch.bfloat16, torch.bfloat16, False)}


def test_bf16_on_a_cuda_device_without_bf16_is_refused(monkeypatch):
    # review_seeds8 #9 (seed 001: check what the target supports). No GPU here: the device's capability
    # answers (is_bf16_supported, its name) are stubbed; the model stays on the CPU, which check() allows
    # (AmpTrainState refuses a model/autocast device mismatch before it gets there).
    asked = []
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: asked.append("bf16") or False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    cuda, model = torch.device("cuda"), torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"^bf16 is not supported on Tesla V100-SXM2-16GB: use fp16$"):
        Precision("bf16", "cuda").check(model, cuda)
    assert asked == ["bf16"]
    Precision("fp16", "cuda").check(model, cuda)  # what the line suggests instead is not refused
    Precision("bf16", "cpu").check(model, torch.device("cpu"))  # a CPU's bf16 is not the GPU's question
    assert asked == ["bf16"]

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Precision("bf16", "cuda").check(model, cuda)  # a GPU that has it: fine, nothing said


def test_bf16_emulated_on_a_gpu_before_ampere_is_said_slow_not_taken_for_support(monkeypatch):
    # review_seeds14 #1: torch's is_bf16_supported() counts an emulation as support (a bf16 tensor
    # can be made on a V100 or a T4), so bf16 ran there without bf16 kernels, unsaid
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    monkeypatch.setattr(torch.version, "hip", None)
    cuda = torch.device("cuda")
    assert Precision("bf16", "cuda").support(cuda) == (True, (
        "bf16 on Tesla T4 (compute capability 7.5) is emulated, without bf16 kernels: much slower than fp16 "
        "there; prefer fp16 on this GPU"))
    with pytest.warns(SlowPrecisionWarning, match="^bf16 on Tesla T4 .* is emulated"):
        Precision("bf16", "cuda").check(torch.nn.Linear(2, 2), cuda)
    assert Precision("fp16", "cuda").support(cuda) == (True, None)


def test_a_cpu_without_bf16_kernels_says_bf16_is_emulated_too(cpu_kind):
    # 2026-12-04: on an AVX2-only CPU (no AVX-512, no AMX) oneDNN has no bf16 kernels: a bf16
    # 512 x 512 matmul took 100x fp32's, the main job 6 minutes instead of one, with no word of why
    cpu, model = torch.device("cpu"), torch.nn.Linear(2, 2)
    cpu_kind(bf16=True)
    assert Precision("bf16", "cpu").support(cpu) == (True, None)
    assert Precision("fp16", "cpu").support(cpu) == (
        True, "fp16 autocast on a CPU is emulated, about 10x slower than bf16 there; prefer bf16 on CPUs")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Precision("bf16", "cpu").check(model, cpu)  # nothing said
    cpu_kind(bf16=True, fp16=True)  # AMX-FP16: fp16 has kernels too
    assert Precision("fp16", "cpu").support(cpu) == (True, None)
    cpu_kind(bf16=False)
    assert Precision("bf16", "cpu").support(cpu) == (True, (
        "bf16 autocast on this CPU is emulated (oneDNN has no bf16 kernels without AVX-512 or AMX): its matmuls "
        "run about 100x slower than fp32's; fp32 trains faster here"))
    assert Precision("fp16", "cpu").support(cpu)[1].startswith("fp16 autocast on this CPU is emulated, as bf16 is")
    with pytest.warns(SlowPrecisionWarning, match="^bf16 autocast on this CPU is emulated"):
        Precision("bf16", "cpu").check(model, cpu)
    assert Precision("fp32", "cpu").support(cpu) == (True, None)


def test_the_run_card_keeps_the_note_of_a_precision_the_cpu_only_emulates(cpu_kind, tmp_path):
    # the one stderr line is gone once the terminal is: the card says it too, beside the precision
    from ampguard.config import validate
    from ampguard.errors import ExitCode
    from ampguard.monitor import RunMonitor
    from ampguard.report import write_run_card
    from ampguard.run_folder import RunPaths, RunResult

    (tmp_path / "steps.csv").write_text("step\n", encoding="utf-8")

    def rows(precision: str) -> list[str]:
        result = RunResult(ExitCode.OK, RunMonitor(), RunPaths.existing(tmp_path), "finished", torch.device("cpu"))
        write_run_card(tmp_path / "RUN.md", validate({"precision": precision}), result)
        return [line for line in (tmp_path / "RUN.md").read_text().splitlines() if line.startswith("| precision")]

    cpu_kind(bf16=False)
    assert rows("bf16") == ["| precision | bf16 (autocast on cpu) |",
                            "| precision support | " + Precision("bf16", "cpu").support(torch.device("cpu"))[1] + " |"]
    cpu_kind(bf16=True)
    assert rows("bf16") == ["| precision | bf16 (autocast on cpu) |"]
    assert rows("fp32") == ["| precision | fp32 (no autocast) |"]


def test_precision_refuses_an_unknown_name():
    with pytest.raises(ValueError, match="fp4"):
        Precision("fp4", "cpu")  # type: ignore[arg-type]


def test_a_found_inf_mark_is_a_number_filled_in_on_the_device_and_zero_marks_nothing():
    from ampguard.precision import GuardedGradScaler

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GuardedGradScaler("cpu", init_scale=64.0, growth_interval=1)
    scaler.add_found_inf_(opt, 0.0)  # a clean step: the scale grows
    scaler.update()
    assert scaler.get_scale() == 128.0
    scaler.mark_found_inf_(opt)  # 1.0: backs off
    record = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
    assert [flag.item() for flag in record.values()] == [1.0]
    scaler.update()
    assert scaler.get_scale() == 64.0


# ---------------------------------------------------------------------------- the scale on the host


def test_the_host_scale_after_update_is_the_devices_bit_for_bit():
    """scale_after (the exact step's host copy of update(): x backoff, x growth on the
    growth_interval-th clean step unless that overflows, the floor) against the device's
    update() itself, over scales from the floor's neighbourhood to float32's largest, odd
    factors and floors, every tracker position, a clean step, the step's own skip mark and
    another optimizer's unscale_ flag: 0 mismatches."""
    rng = random.Random(7)
    opt, other = optimizer(), optimizer()
    huge = torch.finfo(torch.float32).max
    cases = 0
    for growth, backoff, interval, floor in [(2.0, 0.5, 3, DEFAULT_MIN_SCALE), (1.7, 0.37, 2, 0.1),
                                             (3.3, 0.9, 1, 7.3), (1e30, 1e-30, 2, 1.0)]:
        scaler = GuardedGradScaler("cpu", init_scale=max(floor, 1.0), growth_factor=growth, backoff_factor=backoff,
                                   growth_interval=interval, min_scale=floor)
        scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
        scales = [huge, huge / 1.5, floor, floor * 1.01, TINY] + [
            float(torch.tensor(rng.uniform(-130, 128)).exp2()) for _ in range(300)]
        for scale in scales:
            for tracker in range(interval):
                # the step's own mark (found, added after the read), or a flag unscale_ had
                # recorded before it (read with the inputs), or neither
                for found, flagged in ((False, False), (True, False), (False, True)):
                    scaler._scale.fill_(scale)
                    scaler._growth_tracker.fill_(tracker)
                    if flagged:
                        scaler.add_found_inf_(other, 1.0)
                    inputs = [t.item() for t in scaler.update_inputs(torch.device("cpu"))]
                    predicted = scaler.scale_after(inputs, found)
                    scaler.add_found_inf_(opt, torch.tensor(float(found)))
                    scaler.update()
                    assert predicted == scaler.get_scale(), (scale, tracker, found, flagged, growth, backoff, floor)
                    cases += 1
    assert cases > 3000


def test_the_host_cannot_tell_a_non_finite_scale_or_a_subclass_update():
    scaler = GuardedGradScaler("cpu", init_scale=8.0)
    assert scaler.update_inputs(torch.device("cpu")) == []  # nothing scaled yet: nothing to read
    assert scaler.scale_after([], False) is None
    assert scaler.scale_after([float("inf"), 0], False) is None
    assert scaler.scale_after([8.0, 2.0**24], False) is None  # a tracker float32 cannot hold exactly

    class Own(GuardedGradScaler):
        def update(self, new_scale=None):
            super().update(4.0)

    assert Own("cpu", init_scale=8.0).scale_after([8.0, 0], False) is None
    assert GuardedGradScaler("cpu", enabled=False).update_inputs(torch.device("cpu")) == []


def test_a_found_flag_that_covers_unscales_replaces_it_for_a_lone_optimizer_and_merges_otherwise():
    """add_found_inf_(covers=True), the sync-free step's flag: with one optimizer on one device
    the flag replaces what unscale_ recorded (no kernel); with several optimizers it is merged,
    so a 0 never hides another optimizer's overflow."""
    scaler = GuardedGradScaler("cpu", init_scale=64.0, growth_interval=100)
    opt, other = optimizer(), optimizer()
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    found = torch.ones(())
    scaler.add_found_inf_(opt, found, covers=True)
    assert scaler._per_optimizer_states[id(opt)]["found_inf_per_device"][torch.device("cpu")] is found
    scaler.update()
    assert scaler.get_scale() == 32.0

    clean = torch.zeros(())
    scaler._per_optimizer_states[id(opt)]  # (this optimizer's record first: update() adds the others into it)
    scaler.add_found_inf_(other, 1.0)  # another optimizer overflowed
    scaler.add_found_inf_(opt, clean, covers=True)  # merged into its own record, not put in its place
    scaler.update()
    assert scaler.get_scale() == 16.0 and clean.item() == 0.0  # (in its place, update()'s sum wrote into it)


# ---------------------------------------------------------------------------- the FP32 reference


class _Seen(torch.nn.Module):
    """A Linear that records, at each forward, the FP32 settings it ran under."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.seen = torch.nn.Linear(2, 2), []

    def forward(self, x):
        from ampguard.precision import fp32_settings

        self.seen.append((sorted(set(fp32_settings().values())), torch.is_autocast_enabled("cpu")))
        return self.lin(x)


@pytest.mark.parametrize("how", ["legacy", "per backend"])
def test_the_fp32_reference_is_fp32_inside_a_callers_autocast_and_without_tf32(how):
    # validate's reference and locate's replay ran in bf16 under an autocast their caller had open
    # (a reference of dtype bfloat16), and in TF32 where the process allowed it; settings put back.
    # A process that set TF32 with PyTorch's per-backend API made the legacy read raise: the first
    # skip's diagnosis raised in the training step
    from ampguard.precision import _fp32_backends, fp32_settings

    if how == "per backend" and not _fp32_backends():
        pytest.skip("this PyTorch has no per-backend fp32_precision")
    model, x = _Seen(), torch.ones(1, 2)
    original = fp32_settings()
    try:
        if how == "legacy":
            torch.set_float32_matmul_precision("high")
        else:
            torch.backends.cuda.matmul.fp32_precision = "tf32"
        chosen = fp32_settings()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with Precision("fp32", "cpu").reference():
                out = model(x)
            assert torch.is_autocast_enabled("cpu")  # the caller's, back
            with Precision("bf16", "cpu").reference():  # an AMP pass runs as training does
                amp = model(x)
        assert out.dtype == torch.float32 and amp.dtype == torch.bfloat16
        assert model.seen[0] == (["ieee"] if _fp32_backends() else [False, "highest"], False)
        assert model.seen[1][1] is True and fp32_settings() == chosen
        with pytest.raises(RuntimeError, match="boom"), Precision("fp32", "cpu").reference():
            raise RuntimeError("boom")
        assert fp32_settings() == chosen
    finally:
        from ampguard.precision import set_fp32_settings

        set_fp32_settings(original)


def test_validate_and_locate_take_their_fp32_pass_out_of_a_callers_autocast():
    from ampguard.locate import diagnose
    from ampguard.tasks.base import Task
    from ampguard.validate import _scores

    lin = torch.nn.Linear(4, 3)
    task = Task("toy", lin, torch.nn.functional.cross_entropy, batches=lambda: iter(()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _scores(task, lin, torch.randn(5, 4), Precision("fp32", "cpu")).dtypes == {"output": "torch.float32"}
    # an activation of 5e4 overflows fp16 but not FP32: under the caller's fp16 autocast the "FP32"
    # replay overflowed too, and the verdict read data/model
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2), torch.nn.Linear(2, 1))
    with torch.no_grad():
        model[0].weight.fill_(1e3), model[0].bias.zero_()
    x, y = torch.full((1, 2), 50.0), torch.zeros(1, 1)
    with torch.autocast("cpu", dtype=torch.float16):
        d = diagnose(model, torch.nn.functional.mse_loss, x, y, Precision("fp16", "cpu"))
    assert d.verdict == "precision-range" and d.fp32.where == "none"


def test_a_module_kept_in_fp32_keeps_its_own_instance_forward_and_gets_it_back_on_release():
    # review 38d: keep_in_fp32 replaced an instance forward of the user's (a patched attention) with the
    # class's, under autocast and out of it, and release_fp32 left the class's: the user's forward was lost
    import types

    from ampguard.precision import keep_in_fp32, release_fp32

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    own = types.MethodType(lambda self, x: torch.nn.Linear.forward(self, x) / 2, model[0])
    model[0].forward = own
    x = torch.randn(3, 4)
    expected = model(x)
    keep_in_fp32(model, ["0"])
    keep_in_fp32(model, ["0"])  # (again: nothing changes)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kept = model(x)
    assert kept.dtype == torch.float32 and torch.equal(kept, expected)  # the user's forward, in FP32
    assert torch.equal(model(x), expected)
    release_fp32(model)
    assert vars(model[0])["forward"] is own and set(vars(model[0])) & {"_forward_before_fp32"} == set()
