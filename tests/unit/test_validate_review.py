"""``ampguard validate``, review_37a: defects a hostile review found in the FP32 reference, the
``--train-steps`` rules, the tie rule and the history of rejections. Each test builds its own tiny
task (a Linear on a few rows, fp32 / bf16; fp16 only where a loss scaler is the point).
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ampguard.config import validate as make_config
from ampguard.errors import AmpguardWarning, ExitCode, InputError
from ampguard.tasks.base import Task, cycle
from ampguard.validate import (HISTORY, PrecisionResult, _decisions, check_fp32_weights, check_rules, classify_probe,
                               compare, compare_training, earlier_rejections, run, training_rule, verdict_key)

CPU = torch.device("cpu")


def toy_task(x, y, *, model=None, mode="classifier", batches=None, **fields):
    """A task on ``x``: an identity ``Linear`` unless ``model`` is given; ``(x, y)`` is its data
    and its held-out set unless ``batches`` says otherwise."""
    if model is None:
        model = nn.Linear(x.shape[1], x.shape[1], bias=False)
        with torch.no_grad():
            model.weight.copy_(torch.eye(x.shape[1]))
    loss = F.cross_entropy if mode == "classifier" else F.mse_loss
    return Task("toy", model, loss, batches=batches or (lambda: cycle(lambda: [(x, y)])), mode=mode,
                held_out=lambda: (x, y), **fields)


def config_of(**validation):
    validation.setdefault("precisions", ["bf16"])
    return make_config({"device": "cpu", "validation": validation})


def write_factory(tmp_path, body: str) -> str:
    path = tmp_path / "factory.py"
    path.write_text("import torch\nfrom torch import nn\nfrom torch.nn import functional as F\n\n" + body,
                    encoding="utf-8")
    return f"{path}:build"


# ---------------------------------------------------------------------------- 1: the FP32 reference is FP32


def test_half_precision_weights_are_refused_not_taken_for_an_fp32_reference():
    # bf16 weights made the "FP32 reference" a bf16 run, which bf16 autocast matched exactly: ACCEPTED
    # with zero tolerance, output_dtypes.fp32 = torch.bfloat16. train refuses such weights; so does validate
    x = torch.tensor([[3.0, 0.0], [0.0, 3.0]])
    task = toy_task(x, torch.tensor([0, 1]))
    task.model.to(torch.bfloat16)
    with pytest.raises(InputError) as err:
        compare(task, task.model, config_of(abs_tol=0, rel_tol=0, min_accuracy=0.5), CPU)
    assert str(err.value) == (  # (review_37g: validate's own words, not train's optimizer ones)
        "validate: the FP32 reference needs float32 weights: parameter 'weight' is bfloat16, so the reference "
        "would compute in bfloat16, not float32; keep the model in float32 (no .to(torch.bfloat16))")


def test_the_verb_refuses_half_weights_in_one_line_and_writes_nothing(tmp_path):
    factory = write_factory(tmp_path, (
        "def build(config):\n"
        "    model = nn.Linear(2, 2).to(torch.bfloat16)\n"
        "    x = torch.tensor([[3.0, 0.0], [0.0, 3.0]]).bfloat16()\n"
        "    return {'model': model, 'data': [(x, torch.tensor([0, 1]))], 'loss_fn': F.cross_entropy,\n"
        "            'held_out': (x, torch.tensor([0, 1]))}\n"))
    config = make_config({"task": {"factory": factory}, "device": "cpu",
                          "validation": {"precisions": ["bf16"], "min_accuracy": 0}})
    with pytest.raises(InputError, match=r"^validate: the FP32 reference needs float32 weights: parameter '"):
        run(config, out=tmp_path / "report")
    assert not (tmp_path / "report").exists() and not (tmp_path / HISTORY).exists()


# ---------------------------------------------------------------------------- 2: every RNG seeded per pass


class NumpyNoise(nn.Module):
    """Adds noise drawn from NumPy (a factory's stochastic layer)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) + float(np.random.normal(0, 10))


def test_every_inference_pass_draws_the_same_numpy_numbers():
    # seed_pass reseeded torch only: the FP32 and bf16 passes added other noise, blamed on bf16
    torch.manual_seed(0)
    x = torch.randn(8, 4)
    task = toy_task(x, torch.randn(8, 4), model=NumpyNoise(), mode="regression")
    config = config_of(typical=8, edge_cases=False, max_mse=1e6)
    np.random.seed(1234)
    random.seed(1234)
    before = np.random.get_state()[1].copy(), random.getstate()
    result = compare(task, task.model, config, CPU)
    [scores] = [rule for rule in result.results[0].rules if rule.criterion.startswith("scores")]
    assert scores.ok and scores.amp.startswith("32/32 within"), scores.amp
    assert (np.random.get_state()[1] == before[0]).all() and random.getstate() == before[1]  # (the caller's, kept)


def test_each_training_run_reads_the_same_python_random_augmentation():
    drawn: list[float] = []
    x, y = torch.ones(4, 2), torch.tensor([0, 1, 0, 1])

    def batches():
        while True:
            jitter = random.random()  # an augmentation drawing from Python's random
            drawn.append(jitter)
            yield x + jitter, y

    task = toy_task(x, y, batches=batches)
    compare_training(task, config_of(), CPU, steps=2)
    assert len(drawn) == 4 and drawn[:2] == drawn[2:], drawn  # FP32's two batches, then bf16's: the same


# ---------------------------------------------------------------------------- 3, 4, 8: --train-steps


class SqrtOfZero(nn.Module):
    """A Linear on the first 4 features; the 5th, through ``0 * sqrt(w * x5)``, changes no output but
    gives a NaN gradient in every precision where it is 0."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return self.lin(x[:, :4]) + 0 * torch.sqrt(self.w * x[:, 4:5].float())


def test_opening_skips_on_steps_fp32_skipped_too_are_not_taken_from_fp32s_updates():
    # 3 batches NaN-gradient in every precision, 2 that overflow fp16 only, 1 benign: FP32 applies 3,
    # fp16 1. fp16's 3 opening skips were subtracted from FP32's 3 as a "loss-scale search": 1 >= 0.9 x 0
    torch.manual_seed(0)

    def batch(kind):
        x = torch.randn(4, 5)
        x[:, 4] = 0.0 if kind == "nan_grad" else 1.0
        if kind == "overflow":
            x[:, :4] = x[:, :4].sign() * 1e5
        return x, torch.tensor([0, 1, 2, 0])

    data = [batch("nan_grad")] * 3 + [batch("overflow")] * 2 + [batch("ok")]
    held = batch("ok")
    task = toy_task(held[0], held[1], model=SqrtOfZero(), batches=lambda: iter(data))
    with pytest.warns(Warning):  # (fp16 on a CPU is emulated: said, and no matter here)
        fp32, fp16 = compare_training(task, config_of(precisions=["fp16"]), CPU, steps=6)
    assert (fp32["updates_applied"], fp16["updates_applied"]) == (3, 1)
    assert fp16["opening_skips"] == 0  # (its search skipped only steps FP32 skipped too)
    rule = training_rule(fp16, fp32, 0.9)
    assert (rule.amp, rule.ok) == ("1 of 6 steps; 1/3 = 0.33 (>= 0.9)", False)


def test_an_fp32_training_reference_that_applies_no_update_is_not_trusted(tmp_path, capsys):
    # NaN training data: FP32 (and bf16) skip every step; the training rule compared 0 with 0 and the
    # verdict was ACCEPTED
    factory = write_factory(tmp_path, (
        "def build(config):\n"
        "    model = nn.Linear(2, 2, bias=False)\n"
        "    with torch.no_grad():\n"
        "        model.weight.copy_(torch.eye(2))\n"
        "    x = torch.tensor([[3.0, 0.0], [0.0, 3.0]])\n"
        "    nan = torch.full((2, 2), float('nan'))\n"
        "    return {'model': model, 'data': [(nan, torch.tensor([0, 1]))], 'loss_fn': F.cross_entropy,\n"
        "            'held_out': (x, torch.tensor([0, 1]))}\n"))
    config = make_config({"task": {"factory": factory}, "device": "cpu",
                          "validation": {"precisions": ["bf16"], "min_accuracy": 0.5, "checkpoint": None}})
    code = run(config, out=tmp_path / "report", train_steps=2)
    out = capsys.readouterr().out
    assert code == ExitCode.REJECTED, out
    data = json.loads((tmp_path / "report" / "validation.json").read_text(encoding="utf-8"))
    [rule] = [r for r in data["reference"] if r["criterion"].startswith("reference training")]
    assert (rule["reference"], rule["ok"]) == ("0 of 2 steps applied, final loss nan", False)
    assert data["reference_trusted"] is False and not data["accepted"]
    assert "reference: reference training: updates applied, final loss finite: 0 of 2 steps applied, final " \
           "loss nan -> FAIL" in out
    assert out.splitlines()[-1].startswith("validate: REJECTED (FP32 reference not trusted)")


def test_the_fp32_training_reference_runs_without_tf32_as_the_inference_reference_does(monkeypatch):
    # the inference reference forced every backend's FP32 to "ieee"; the FP32 training run kept the
    # process's (cuDNN's convolutions default to TF32)
    from ampguard import precision

    seen: list[dict] = []

    class Probe(nn.Linear):
        def forward(self, x):
            if torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu"):
                seen.append(dict(precision.fp32_settings()))
            return super().forward(x)

    settings = precision.fp32_settings()
    if not settings:
        pytest.skip("this PyTorch has no per-backend fp32_precision")
    saved = dict(settings)
    precision.set_fp32_settings(dict.fromkeys(saved, "tf32"))  # a process that allows TF32 everywhere
    try:
        x, y = torch.ones(4, 2), torch.tensor([0, 1, 0, 1])
        compare_training(toy_task(x, y, model=Probe(2, 2)), config_of(), CPU, steps=1)
        after = precision.fp32_settings()
    finally:
        precision.set_fp32_settings(saved)
    assert seen and all(set(s.values()) == {"ieee"} for s in seen), seen
    assert set(after.values()) == {"tf32"}  # (the process's settings, put back)


# ---------------------------------------------------------------------------- 5: loosened after a rejection


def history_with(path, **entry):
    line = {"time": "t", "report": "r1", "accepted": False, "verdict": "REJECTED", **entry}
    path.write_text(json.dumps(line) + "\n", encoding="utf-8")
    return path


def test_a_per_output_tolerance_declared_after_a_rejection_is_said(tmp_path):
    # validation.outputs: {} records no key: its abs_tol widened to 1000 was no change at all
    rules = {"validation.abs_tol": 0.05}
    path = history_with(tmp_path / HISTORY, weights="w", probe_set="p", rules=rules)
    now = {"weights": "w", "probe_set": "p",
           "rules": {**rules, "validation.outputs.output.abs_tol": 1000.0, "validation.outputs.output.rel_tol": None}}
    [earlier] = earlier_rejections(path, now)
    assert earlier["changed"] == ["validation.outputs.output.abs_tol: (not set) -> 1000.0"]


def test_the_failing_probes_dropped_after_a_rejection_are_said(tmp_path):
    # validation.edge_cases: false changed the probe set's SHA, and history matched on it: nothing said
    path = history_with(tmp_path / HISTORY, weights="w", probe_set="a" * 64, rules={"validation.edge_cases": True})
    now = {"weights": "w", "probe_set": "b" * 64, "rules": {"validation.edge_cases": False}}
    [earlier] = earlier_rejections(path, now)
    assert earlier["changed"] == [f"probe set: {'a' * 12} -> {'b' * 12}", "validation.edge_cases: true -> false"]
    # the same rules on another probe set (the task's data changed): said too; other weights: nothing
    assert earlier_rejections(path, {**now, "rules": {"validation.edge_cases": True}})[0]["changed"] == [
        f"probe set: {'a' * 12} -> {'b' * 12}"]
    assert earlier_rejections(path, {**now, "weights": "other"}) == []
    # another task whose weights hash the same (two factories seeded alike) is not these weights
    path = history_with(tmp_path / HISTORY, task="a.py:build", weights="w", probe_set="a" * 64, rules={})
    assert earlier_rejections(path, {**now, "task": "b.py:build", "rules": {}}) == []
    assert len(earlier_rejections(path, {**now, "task": "a.py:build", "rules": {}})) == 1


def test_the_verb_says_dropped_probes_beside_the_verdict(tmp_path, capsys):
    base = {"task": {"name": "linear"}, "device": "cpu", "log": {"dir": str(tmp_path)}}
    rules = {"precisions": ["bf16"], "max_mse": 100, "abs_tol": 0.0, "rel_tol": 0.0, "typical": 2}
    assert run(make_config({**base, "validation": rules}), out=tmp_path / "r1") == ExitCode.REJECTED
    capsys.readouterr()
    run(make_config({**base, "validation": {**rules, "edge_cases": False}}), out=tmp_path / "r2")
    note = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("validate: note: "))
    assert "probe set: " in note and "validation.edge_cases: true -> false" in note, note


# ---------------------------------------------------------------------------- 6: the tie rule


def test_a_confident_fp32_decision_that_amp_changes_is_a_flip_not_a_tie():
    assert classify_probe(0, 1, 3.0, 0.0005, 0.001) == "flip"
    cfg = make_config({"validation": {"tie_margin": 0.001, "ties": "accept", "max_flips": 0}}).validation
    result = PrecisionResult("bf16", records=[{"probe": "held_out:0", "tags": ["typical"]}])
    _decisions(result, cfg, torch.tensor([[3.0, 0.0]]), torch.tensor([[1.0, 1.0005]]))
    assert [row["probe"] for row in result.flips] == ["held_out:0"] and result.ties == []
    assert not result.rules[-1].ok


def test_a_tie_the_reference_has_and_amp_keeps_is_not_a_decision_change():
    # review_51b: an identity head with no bias ties exactly on a zero input in FP32; bf16 gives
    # the same outputs bit for bit, yet the default rules counted the reference's tie as a flip:
    # "0 flips; 1 tie: edge:zeros (0->0 ...) -> FAIL", REJECTED. FP32 against itself failed too
    x = torch.eye(4).repeat(2, 1) * 2.0
    task = toy_task(x, torch.arange(4).repeat(2), edge_cases=lambda: (["zeros"], torch.zeros(1, 4)))
    result = compare(task, task.model, config_of(min_accuracy=0.9, abs_tol=0, rel_tol=0), CPU)
    [bf16] = result.results
    decisions = next(rule for rule in bf16.rules if rule.criterion.startswith("decision changes"))
    assert decisions.ok and bf16.ties == [] and bf16.flips == [], decisions
    assert "reference ties AMP kept (not counted): 1: edge:zeros (0->0" in decisions.amp
    assert result.ok
    # a tie the reference has, AMP naming another class: still a tie, counted by the default
    cfg = make_config({"validation": {"tie_margin": 0.001}}).validation
    changed = PrecisionResult("bf16", records=[{"probe": "held_out:0", "tags": ["boundary"]}])
    _decisions(changed, cfg, torch.tensor([[1.0, 1.0003]]), torch.tensor([[1.0004, 1.0]]))
    assert [row["probe"] for row in changed.ties] == ["held_out:0"] and not changed.rules[-1].ok


# ---------------------------------------------------------------------------- 7: outputs only AMP changes


def test_an_output_whose_shape_changes_only_under_amp_fails_a_rule_not_the_input():
    x = torch.tensor([[3.0, 0.0, 1.0], [0.0, 3.0, 1.0]])

    def predict(model, inputs):
        out = model(inputs)
        return out[:, :2] if torch.is_autocast_enabled("cpu") else out

    task = toy_task(x, torch.tensor([0, 1]), predict=predict)
    result = compare(task, task.model, config_of(boundary=0, edge_cases=False, min_accuracy=0), CPU)
    [rule] = result.results[0].rules
    assert (rule.criterion, rule.amp, rule.ok) == (
        "outputs as FP32's (names, shapes)", "the model's output has shape (2, 2) under bf16, (2, 3) in FP32", False)
    assert not result.ok


# ---------------------------------------------------------------------------- classifier rules on regression


@pytest.mark.parametrize("rule", [{"ties": "accept"}, {"tie_margin": 0.5}, {"max_flips": 3}, {"boundary": 4}])
def test_a_decision_rule_declared_for_a_regression_task_is_refused(rule):
    x = torch.ones(4, 2)
    task = toy_task(x, x, mode="regression")
    [(key, _)] = rule.items()
    with pytest.raises(InputError) as err:
        check_rules(task, make_config({"validation": {**rule, "max_mse": 1}}).validation)
    assert str(err.value) == (f"validate: validation.{key} applies to classifiers; task toy is a regression task "
                              "(its rules: the score tolerance, extremes and quality)")
    check_rules(task, make_config({"validation": {"boundary": 0, "max_mse": 1}}).validation)  # (none: kept)
    # (environment.config writes every key, the classifier ones at their defaults: it still runs)
    dumped = make_config({"validation": {"max_mse": 1}}).validation.model_dump(mode="json")
    check_rules(task, make_config({"validation": dumped}).validation)


# ---------------------------------------------------------------------------- review_37g


def test_a_float64_model_is_refused_not_accepted_where_bf16_never_ran(tmp_path):
    # autocast lowers float32 work only: a float64 model's bf16 pass was its FP32 pass again, bit for
    # bit (output dtypes float64 in both), ACCEPTED at zero tolerance
    x = torch.tensor([[3.0, 0.0], [0.0, 3.0]], dtype=torch.float64)
    task = toy_task(x, torch.tensor([0, 1]))
    task.model.double()
    with pytest.raises(InputError) as err:
        compare(task, task.model, config_of(abs_tol=0, rel_tol=0, min_accuracy=0.5), CPU)
    assert str(err.value) == (
        "validate: the FP32 reference needs float32 weights: parameter 'weight' is float64, where autocast "
        "computes nothing in bf16 (it lowers float32 work only): bf16 would run as the reference does, in float64; "
        "keep the model in float32 (no .double())")
    factory = write_factory(tmp_path, (
        "def build(config):\n"
        "    model = nn.Linear(2, 2).double()\n"
        "    x = torch.tensor([[3.0, 0.0], [0.0, 3.0]], dtype=torch.float64)\n"
        "    return {'model': model, 'data': [(x, torch.tensor([0, 1]))], 'loss_fn': F.cross_entropy,\n"
        "            'held_out': (x, torch.tensor([0, 1]))}\n"))
    config = make_config({"task": {"factory": factory}, "device": "cpu",
                          "validation": {"precisions": ["bf16"], "min_accuracy": 0, "abs_tol": 0, "rel_tol": 0}})
    with pytest.raises(InputError, match=r"^validate: the FP32 reference needs float32 weights: parameter "):
        run(config, out=tmp_path / "report")  # (the verb: one line, exit 2, nothing written)
    assert not (tmp_path / "report").exists() and not (tmp_path / HISTORY).exists()


class FrozenProjection(nn.Module):
    """A projection held in a buffer (a frozen backbone's weights), a BatchNorm's int64 count and a
    bool mask beside it."""

    def __init__(self, dtype):
        super().__init__()
        self.bn = nn.BatchNorm1d(2)
        self.register_buffer("mask", torch.tensor([True, False]))
        self.register_buffer("proj", torch.eye(2, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(2))

    def forward(self, x):
        return (x.to(self.proj.dtype) @ self.proj).float() + self.bias


def test_weights_below_float32_in_a_buffer_are_warned_of_not_taken_for_float32():
    # the bf16 buffer passed: the "FP32 reference" computed its projection in bf16
    check_fp32_weights(FrozenProjection(torch.float32), ["bf16"])  # (int64 and bool buffers: fine)
    # review 37l: refused, it turned away 0/1 masks and caches train takes (type promotion keeps them float32): warned
    with pytest.warns(AmpguardWarning, match=r"^validate: buffer 'proj' is bfloat16: where the model computes with it"):
        check_fp32_weights(FrozenProjection(torch.bfloat16), ["bf16"])


def test_a_frozen_half_embedding_is_refused_in_validates_words():
    # train's words: "the optimizer updates float32 weights" (nothing trains here) and, under the default
    # precisions, ".half()" about a bfloat16 parameter
    model = nn.Sequential(nn.Embedding(5, 2).to(torch.bfloat16), nn.Linear(2, 2))
    model[0].weight.requires_grad_(False)
    with pytest.raises(InputError) as err:
        check_fp32_weights(model, ["fp16", "bf16"])
    assert str(err.value) == (
        "validate: the FP32 reference needs float32 weights: parameter '0.weight' is bfloat16, frozen, so the "
        "reference would compute in bfloat16, not float32; keep the model in float32 (no .to(torch.bfloat16))")
    with pytest.raises(InputError, match=r"parameter '0\.weight' is float16, .*\(no \.half\(\) / \.to\(torch\.float16\)\)$"):
        check_fp32_weights(model.to(torch.float16), ["bf16"])


def decide(ref, amp, tie_margin):
    cfg = make_config({"validation": {"tie_margin": tie_margin, "ties": "accept", "max_flips": 0}}).validation
    result = PrecisionResult("bf16", records=[{"probe": "held_out:0", "tags": ["typical"]}])
    _decisions(result, cfg, torch.tensor([ref]), torch.tensor([amp]))
    return [row["probe"] for row in result.flips], [row["probe"] for row in result.ties]


def test_an_exact_amp_tie_on_a_clear_fp32_decision_is_a_tie_in_either_class_order_a_flip_without_fp32s_class():
    # review_37g, decided: FP32 decides class 1 by 1.0 (> tie_margin 0.5), bf16 rounds 257 to 256: an exact tie
    # that holds FP32's class is AMP barely deciding (a tie), in whichever order the classes come, as
    # test_an_exact_amp_tie_is_a_tie_whichever_class_index_fp32_chose has it; one FP32's class is not in is a flip
    assert decide([256.0, 257.0], [256.0, 256.0], 0.5) == ([], ["held_out:0"])
    assert decide([257.0, 256.0], [256.0, 256.0], 0.5) == ([], ["held_out:0"])
    assert decide([0.0, 0.0, 3.0], [2.0, 2.0, 1.0], 0.5) == (["held_out:0"], [])


def test_a_rejection_under_other_task_options_is_said_with_the_options_changed(tmp_path):
    # 37g: the note named another model's rejection as one "on these weights" without saying the options
    # differed; 37l: keyed as another subject, an option the factory ignores (or left to its default, the
    # same model) hid the earlier rejection altogether. The options are a change said.
    from ampguard.validate import Validation

    def key(options):
        config = make_config({"task": {"factory": "m.py:build", "options": options}})
        return verdict_key(config, Validation("t", "classifier", [], [], [], environment={"weights_sha256": "w"}))

    dict_key, cols_key = key({"kind": "dict"}), key({"kind": "cols", "junk": 1})
    assert dict_key["task_options"] == {"kind": "dict"}
    path = history_with(tmp_path / HISTORY, **dict_key)
    [earlier] = earlier_rejections(path, {**cols_key, "rules": {**cols_key["rules"], "validation.ties": "accept"}})
    assert earlier["changed"] == ["task.options.junk: (not set) -> 1", "task.options.kind: dict -> cols",
                                  "validation.ties: count_as_flip -> accept"]
    # the same options, the same rules: nothing loosened
    assert earlier_rejections(path, dict_key) == []
    # a line written before options were keyed is matched on what it names
    old = {k: v for k, v in dict_key.items() if k != "task_options"}
    path = history_with(tmp_path / HISTORY, **old)
    assert len(earlier_rejections(path, {**cols_key, "rules": {**cols_key["rules"], "validation.ties": "accept"}})) == 1


def test_a_per_output_tolerance_declared_equal_to_the_global_one_is_no_change(tmp_path):
    # "validation.outputs.output.abs_tol: (not set) -> 0.05" was said where 0.05 was the global abs_tol:
    # the tolerance applied was the same
    rules = {"validation.abs_tol": 0.05, "validation.rel_tol": 0.0}
    path = history_with(tmp_path / HISTORY, weights="w", probe_set="p", rules=rules)
    same = {**rules, "validation.outputs.output.abs_tol": 0.05, "validation.outputs.output.rel_tol": None}
    assert earlier_rejections(path, {"weights": "w", "probe_set": "p", "rules": same}) == []
    wider = {**same, "validation.outputs.output.rel_tol": 0.5}
    [earlier] = earlier_rejections(path, {"weights": "w", "probe_set": "p", "rules": wider})
    assert earlier["changed"] == ["validation.outputs.output.rel_tol: (not set) -> 0.5"]
    # the global one widened since, the output's left equal to the old one: that output's is no change
    moved = {"validation.abs_tol": 1.0, "validation.rel_tol": 0.0, "validation.outputs.output.abs_tol": 0.05}
    [earlier] = earlier_rejections(path, {"weights": "w", "probe_set": "p", "rules": moved})
    assert earlier["changed"] == ["validation.abs_tol: 0.05 -> 1.0"]


def test_an_output_transposed_only_under_amp_fails_the_outputs_rule():
    # (N, 3, 2) in FP32, (N, 2, 3) under bf16: as many scores, flattened alike, compared in the wrong layout
    x = torch.tensor([[3.0, 0.0, 1.0, 2.0, 0.5, 1.5], [0.0, 3.0, 1.0, 2.0, 0.5, 1.5]])

    def predict(model, inputs):
        out = model(inputs).reshape(-1, 3, 2)
        return out.transpose(1, 2) if torch.is_autocast_enabled("cpu") else out

    # (a regression task: a classifier's first output is one score per class, review_51b)
    task = toy_task(x, x.reshape(-1, 3, 2), predict=predict, mode="regression")
    result = compare(task, task.model, config_of(boundary=0, edge_cases=False, max_mse=1, abs_tol=10), CPU)
    [rule] = result.results[0].rules
    assert (rule.criterion, rule.reference, rule.amp, rule.ok) == (
        "outputs as FP32's (names, shapes)", "output (2, 3, 2)",
        "the model's output has shape (2, 2, 3) under bf16, (2, 3, 2) in FP32", False)
    assert not result.ok


# ---------------------------------------------------------------------------- review_51b: shapes the rules misread


class Grid(nn.Module):
    """An identity on 6 numbers, returned as a (2, 3) grid per example (and a second output)."""

    def __init__(self, second=False):
        super().__init__()
        self.lin = nn.Linear(6, 6, bias=False)
        self.second = second
        with torch.no_grad():
            self.lin.weight.copy_(torch.eye(6))

    def forward(self, x):
        grid = self.lin(x).view(len(x), 2, 3)
        return (grid, self.lin(x) * 1.001) if self.second else grid


def test_a_classifier_whose_first_output_is_not_one_score_per_class_is_refused():
    # (N, 2, 3): two heads of three classes, flattened and argmaxed over six "classes" against
    # labels in [0, 3): accuracy and flips of a decision no head makes, never refused
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
    task = toy_task(x, x.view(8, 2, 3)[:, 0].argmax(1), model=Grid())
    with pytest.raises(InputError, match=r"^validate: task toy is a classifier, but its first output \(output\) has "
                                         r"shape \(2, 3\) per example: "):
        compare(task, task.model, config_of(min_accuracy=0.9), CPU)
    flat = toy_task(x, x.argmax(1))  # (N, 6): fine; so is (N, 1, 6), one size of 1 aside
    assert compare(flat, flat.model, config_of(min_accuracy=0.9), CPU).ok
    task = toy_task(x, x.argmax(1), model=nn.Sequential(Grid(), nn.Flatten(), nn.Unflatten(1, (1, 6))))
    assert compare(task, task.model, config_of(min_accuracy=0.9), CPU).ok


def test_regression_targets_in_another_layout_than_the_output_are_refused():
    # output (2, 3) per example, targets (3, 2): the same 6 numbers each, compared element by element
    # in the wrong order (an FP32 reference "not trusted" over a model exact in its own layout)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
    swapped = x.view(8, 2, 3).transpose(1, 2).contiguous()
    task = toy_task(x, swapped, model=Grid(), mode="regression")
    with pytest.raises(InputError, match=r"^validate: task toy: the held-out targets have shape \(3, 2\) per example, "
                                         r"but the first output has shape \(2, 3\)"):
        compare(task, task.model, config_of(max_mse=0.01, edge_cases=False), CPU)
    for targets in (x.view(8, 2, 3), x, x.view(8, 1, 2, 3)):  # its layout, flat, or with a size of 1: fine
        task = toy_task(x, targets, model=Grid(), mode="regression")
        assert compare(task, task.model, config_of(max_mse=0.01, edge_cases=False), CPU).reference_ok


def test_the_extremes_row_fails_on_the_first_outputs_deviation_only():
    # output 0 bit for bit FP32's under bf16, output 1 not (zero tolerance): the extremes row showed
    # equal numbers and FAIL; it is output 0's, and output 1 fails its own rule
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 1.875]]).repeat(4, 1)
    task = toy_task(x, x.view(4, 2, 3), model=Grid(second=True), mode="regression")
    result = compare(task, task.model, config_of(max_mse=100, abs_tol=0, rel_tol=0, edge_cases=False), CPU)
    rules = {rule.criterion: rule for rule in result.results[0].rules}
    extremes = rules["extremes of output 0 (min, max over probes)"]
    assert extremes.ok and extremes.reference == extremes.amp == "1, 5", extremes
    [one] = [rule for criterion, rule in rules.items() if criterion.startswith("output 1:")]
    assert not one.ok and not result.ok


@pytest.mark.parametrize("order", [[0, 1], [1, 0]])
def test_an_exact_fp32_tie_that_amp_breaks_is_a_tie_in_either_class_order(order):
    # review_51l: FP32 [0, 0], bf16 breaking it: ACCEPTED in one class order ("reference ties AMP kept",
    # AMP's gap 0.0079), REJECTED in the other; both a tie now, and AMP tied exactly as FP32 is the same
    cfg = make_config({"validation": {}}).validation
    result = PrecisionResult("bf16", records=[{"probe": "held_out:0", "tags": ["boundary"]}])
    _decisions(result, cfg, torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, 0.0079]])[:, order])
    assert [row["probe"] for row in result.ties] == ["held_out:0"] and not result.rules[-1].ok
    kept = PrecisionResult("bf16", records=[{"probe": "held_out:0", "tags": ["boundary"]}])
    _decisions(kept, cfg, torch.tensor([[1.0, 1.0, 0.5]])[:, order + [2]], torch.tensor([[2.0, 2.0, 1.0]])[:, order + [2]])
    assert kept.ties == [] and kept.rules[-1].ok and "reference ties AMP kept (not counted): 1" in kept.rules[-1].amp


def test_a_flat_regression_output_takes_targets_of_any_layout():
    # review_51l: (N, 6) beside (N, 3, 2) targets, a keypoint head's, was refused by the layout check
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
    task = toy_task(x, x.view(8, 3, 2), mode="regression")
    assert compare(task, task.model, config_of(max_mse=0.01, edge_cases=False), CPU).reference_ok
