"""``ampguard validate``: did mixed precision change what the model decides?

The acceptance test of a precision choice, with every rule declared in the config before the
run (``validation``): a fixed probe set (typical held-out examples, edge cases, and the
examples nearest a decision boundary in FP32), a score tolerance, a tie rule, a minimum quality
on a fixed evaluation set, and no non-finite output. The model is fixed (weights, eval mode).
The FP32 reference runs first and is checked itself: a non-finite or low-quality reference is
reported as such, never trusted. Then each AMP precision is compared with it, rule by rule.

Diagnostics only: the training step never imports this.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .build import prepare_model, resolve_device, to_device
from .config import Config
from .errors import ExitCode, InputError
from .precision import Precision
from .records import strict_json
from .tasks import Task

CHUNK = 256


@dataclass
class Rule:
    """One declared rule and how it came out: the reference's value, the AMP value, pass or not.

    Example::

        >>> Rule("complete and finite", "7/7", "6/7", ok=False).decision
        'FAIL'
    """

    criterion: str
    reference: str
    amp: str
    ok: bool

    @property
    def decision(self) -> str:
        """``pass`` or ``FAIL``, as the report's tables write it.

        Example::

            >>> [Rule("c", "", "", ok).decision for ok in (True, False)]
            ['pass', 'FAIL']
        """
        return "pass" if self.ok else "FAIL"


@dataclass
class PrecisionResult:
    """One AMP precision against the FP32 reference: its rules, decision flips and ties, stats.

    Example::

        >>> result = PrecisionResult("fp16", rules=[Rule("complete and finite", "7/7", "7/7", True)])
        >>> result.ok, result.flips
        (True, [])
    """

    precision: str
    rules: list[Rule] = field(default_factory=list)
    flips: list[dict[str, Any]] = field(default_factory=list)
    ties: list[dict[str, Any]] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Every rule of this precision holds.

        Example::

            >>> result = PrecisionResult("bf16", rules=[Rule("a", "", "", True), Rule("b", "", "", False)])
            >>> result.ok, PrecisionResult("bf16", rules=result.rules[:1]).ok
            (False, True)
        """
        return all(rule.ok for rule in self.rules)


@dataclass
class Validation:
    """The whole comparison: the probes, the reference's own checks, one result per precision.

    Example::

        >>> v = Validation("linear", "regression", ["typical:0"], [Rule("reference quality", "mse 0.1", "", True)],
        ...                [PrecisionResult("bf16", [Rule("complete and finite", "1/1", "1/1", True)])])
        >>> v.ok, v.weights
        (True, 'freshly initialised')
    """

    task: str
    mode: str
    probes: list[str]
    reference: list[Rule]
    results: list[PrecisionResult]
    training: list[dict[str, Any]] = field(default_factory=list)
    weights: str = "freshly initialised"

    @property
    def reference_ok(self) -> bool:
        """The FP32 reference passed its own checks (finite, quality): it can be trusted.

        Example::

            >>> Validation("t", "regression", [], [Rule("reference outputs finite", "1/1", "", False)], []).reference_ok
            False
        """
        return all(rule.ok for rule in self.reference)

    @property
    def ok(self) -> bool:
        """Accepted: the reference is trusted and every precision passes every rule.

        Example (an untrusted reference rejects, even with no precision failing)::

            >>> bad_reference = [Rule("reference quality", "mse 9", "", False)]
            >>> Validation("t", "regression", [], bad_reference, [PrecisionResult("bf16")]).ok
            False
        """
        return self.reference_ok and all(result.ok for result in self.results)


@torch.no_grad()
def _scores(task: Task, model: nn.Module, inputs: torch.Tensor, precision: Precision) -> torch.Tensor:
    device = next(model.parameters()).device
    rows = []
    for start in range(0, len(inputs), CHUNK):
        with precision.autocast():
            rows.append(task.scores(model, inputs[start : start + CHUNK].to(device)).float())
    out = torch.cat(rows)
    return out.reshape(len(inputs), -1)


def _top2(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(decision, margin): the argmax and the gap between the two best scores."""
    if scores.shape[1] < 2:
        return scores.argmax(1), torch.full((len(scores),), math.inf)
    top = scores.topk(2, dim=1)
    return top.indices[:, 0], top.values[:, 0] - top.values[:, 1]


def _quality(mode: str, scores: torch.Tensor, targets: torch.Tensor) -> float:
    if mode == "classifier":
        return float((scores.argmax(1) == targets.to(scores.device)).float().mean())
    return float(((scores - targets.to(scores.device).reshape(len(scores), -1).float()) ** 2).mean())


def _quality_rule(mode: str, cfg: Any, value: float) -> tuple[str, bool]:
    if mode == "classifier":
        if cfg.min_accuracy is None:
            return f"accuracy {value:.4f} (no minimum declared)", math.isfinite(value)
        return f"accuracy {value:.4f} (>= {cfg.min_accuracy:g})", value >= cfg.min_accuracy
    if cfg.max_mse is None:
        return f"mse {value:.4g} (no maximum declared)", math.isfinite(value)
    return f"mse {value:.4g} (<= {cfg.max_mse:g})", math.isfinite(value) and value <= cfg.max_mse


def _finite_count(scores: torch.Tensor) -> int:
    return int(torch.isfinite(scores).all(dim=1).sum())


def build_probes(task: Task, model: nn.Module, device: torch.device, cfg: Any) -> tuple[list[str], torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fixed probe set and evaluation set: (probe ids, probe inputs, eval inputs, eval targets).

    Example (a regression task: typical examples and edge cases, no decision boundary)::

        >>> from ampguard.config import validate
        >>> from ampguard.tasks import build_task
        >>> config = validate({"task": {"name": "linear"}, "validation": {"typical": 2}})
        >>> task = build_task(config)
        >>> ids, probes, x_eval, y_eval = build_probes(task, task.model, torch.device("cpu"), config.validation)
        >>> ids
        ['typical:0', 'typical:1', 'edge:zeros', 'edge:large', 'edge:large_negative']
        >>> tuple(probes.shape), tuple(x_eval.shape), torch.equal(probes[:2], x_eval[:2])
        ((5, 16), (512, 16), True)
    """
    if task.held_out is None or task.held_out() is None:
        raise InputError(f"validate: task {task.name} has no held-out set (a factory can return 'held_out')")
    x_eval, y_eval = task.held_out()
    if not isinstance(x_eval, torch.Tensor):
        raise InputError("validate: the held-out inputs must be a tensor")
    if len(x_eval) == 0:
        raise InputError(f"validate: task {task.name} has an empty held-out set: nothing to evaluate")
    ids = [f"typical:{i}" for i in range(min(cfg.typical, len(x_eval)))]
    parts = [x_eval[: len(ids)]]
    if task.mode == "classifier" and cfg.boundary:
        _, margin = _top2(_scores(task, model, x_eval, Precision("fp32", device.type)))
        margin = torch.where(torch.isfinite(margin), margin, torch.full_like(margin, math.inf))
        nearest = margin.cpu().argsort()[: min(cfg.boundary, len(x_eval))]
        ids += [f"boundary:{int(i)}" for i in nearest]
        parts.append(x_eval[nearest])
    if cfg.edge_cases and task.edge_cases is not None:
        names, edge = task.edge_cases()
        ids += [f"edge:{name}" for name in names]
        parts.append(edge.to(x_eval.dtype))
    if not ids:
        raise InputError(_empty_probe_set(task, cfg))
    return ids, torch.cat(parts), x_eval, y_eval


def check_rules(task: Task, cfg: Any) -> None:
    """Refuse rules that cannot apply to ``task`` before anything runs or is written: a quality
    threshold of the other mode (``min_accuracy`` is for classifiers, ``max_mse`` for regression)
    and a probe set that would be empty (nothing compared would read ACCEPTED).

    Example::

        >>> from ampguard.config import validate
        >>> from ampguard.tasks import build_task
        >>> task = build_task(validate({"task": {"name": "linear"}}))
        >>> for rules in ({"min_accuracy": 0.9}, {"typical": 0, "edge_cases": False}):
        ...     try:
        ...         check_rules(task, validate({"validation": rules}).validation)
        ...     except InputError as err:
        ...         print(err)
        validate: validation.min_accuracy applies to classifiers; task linear is a regression task (declare validation.max_mse)
        validate: the probe set is empty (validation.typical is 0, validation.boundary applies to classifiers only, validation.edge_cases is false): set validation.typical > 0
        >>> check_rules(task, validate({"validation": {"max_mse": 1.0}}).validation)  # fine: nothing printed
    """
    if task.mode == "classifier" and cfg.max_mse is not None:
        raise InputError(f"validate: validation.max_mse applies to regression tasks; task {task.name} is a "
                         "classifier (declare validation.min_accuracy)")
    if task.mode != "classifier" and cfg.min_accuracy is not None:
        raise InputError(f"validate: validation.min_accuracy applies to classifiers; task {task.name} is a "
                         f"{task.mode} task (declare validation.max_mse)")
    classifier = task.mode == "classifier"
    if not (cfg.typical or (classifier and cfg.boundary) or (cfg.edge_cases and task.edge_cases is not None)):
        raise InputError(_empty_probe_set(task, cfg))


def _empty_probe_set(task: Task, cfg: Any) -> str:
    """The one line for a probe set with nothing in it, naming the keys that made it so."""
    why = ["validation.typical is 0" if not cfg.typical else "the held-out set is empty",
           ("validation.boundary is 0" if task.mode == "classifier"
            else "validation.boundary applies to classifiers only"),
           "validation.edge_cases is false" if not cfg.edge_cases else f"task {task.name} has no edge cases"]
    return f"validate: the probe set is empty ({', '.join(why)}): set validation.typical > 0"


def compare(task: Task, model: nn.Module, config: Config, device: torch.device) -> Validation:
    """Run the reference and every AMP precision on the probes and the evaluation set.

    Reads every score back to the host (several host syncs per precision): a diagnostic, run
    outside the training loop. The model is left in eval mode.

    Example::

        >>> from ampguard.config import validate
        >>> from ampguard.tasks import build_task
        >>> config = validate({"task": {"name": "linear"}, "validation": {"precisions": ["bf16"], "typical": 4}})
        >>> task = build_task(config)
        >>> v = compare(task, task.model, config, torch.device("cpu"))
        >>> v.ok, len(v.probes), [r.precision for r in v.results]
        (True, 7, ['bf16'])
        >>> [(rule.criterion, rule.decision) for rule in v.results[0].rules]  # doctest: +NORMALIZE_WHITESPACE
        [('complete and finite', 'pass'), ('scores within abs 0.05 + rel 0.05', 'pass'),
         ('extremes (min, max over probes)', 'pass'), ('quality on the fixed evaluation set', 'pass')]
    """
    cfg = config.validation
    model.eval()
    ids, probes, x_eval, y_eval = build_probes(task, model, device, cfg)
    fp32 = Precision("fp32", device.type)
    ref = _scores(task, model, probes, fp32)
    ref_eval = _scores(task, model, x_eval, fp32)
    ref_quality = _quality(task.mode, ref_eval, y_eval)
    n = len(ids)
    text, ok = _quality_rule(task.mode, cfg, ref_quality)
    reference = [
        Rule("reference outputs finite", f"{_finite_count(ref)}/{n} probes, "
             f"{_finite_count(ref_eval)}/{len(x_eval)} eval", "", _finite_count(ref) == n
             and _finite_count(ref_eval) == len(x_eval)),
        Rule("reference quality", text, "", ok),
    ]
    ref_decision, ref_margin = _top2(ref)
    results = []
    for name in cfg.precisions:
        amp_p = Precision(name, device.type)
        amp_model = prepare_model(config, model, name, copy_model=True)  # fp8: a converted copy; else model
        amp = _scores(task, amp_model, probes, amp_p)
        amp_eval = _scores(task, amp_model, x_eval, amp_p)
        result = PrecisionResult(name)
        finite = _finite_count(amp)
        result.rules.append(Rule("complete and finite", f"{_finite_count(ref)}/{n}", f"{finite}/{n}", finite == n))
        err = (amp - ref).abs()
        rel = err / ref.abs().clamp_min(torch.finfo(torch.float32).tiny)
        allowed = cfg.abs_tol + cfg.rel_tol * ref.abs()
        within = bool((err <= allowed).all()) and finite == n
        max_abs, max_rel = float(err.max()), float(rel.max())
        result.stats.update(max_abs_error=max_abs, max_rel_error=max_rel)
        result.rules.append(Rule(f"scores within abs {cfg.abs_tol:g} + rel {cfg.rel_tol:g}", "(reference)",
                                 f"max abs {max_abs:.3g}, max rel {max_rel:.3g}", within))
        if task.mode == "classifier":
            decision, margin = _top2(amp)
            for i in range(n):
                row = {"probe": ids[i], "fp32": int(ref_decision[i]), "amp": int(decision[i]),
                       "fp32_margin": float(ref_margin[i]), "amp_margin": float(margin[i])}
                if int(decision[i]) != int(ref_decision[i]):
                    result.flips.append(row)
                elif float(margin[i]) <= cfg.tie_margin:
                    result.ties.append(row)
            changes = len(result.flips) + (len(result.ties) if cfg.ties == "count_as_flip" else 0)
            listed = ", ".join(f"{r['probe']} ({r['fp32']}->{r['amp']}, fp32 margin {r['fp32_margin']:.3g})"
                               for r in result.flips) or "none"
            result.rules.append(Rule(f"decision changes <= {cfg.max_flips} (ties {cfg.ties.replace('_', ' ')})",
                                     "0", f"{len(result.flips)} flips, {len(result.ties)} ties: {listed}",
                                     changes <= cfg.max_flips))
        else:
            targets = y_eval.to(amp_eval.device).reshape(len(amp_eval), -1).float()
            result.stats.update(
                max_abs_error_vs_target_fp32=float((ref_eval - targets).abs().max()),
                max_abs_error_vs_target_amp=float((amp_eval - targets).abs().max()),
                extremes_fp32=[float(ref.min()), float(ref.max())],
                extremes_amp=[float(amp.min()), float(amp.max())],
            )
            result.rules.append(Rule("extremes (min, max over probes)",
                                     f"{float(ref.min()):.4g}, {float(ref.max()):.4g}",
                                     f"{float(amp.min()):.4g}, {float(amp.max()):.4g}", within))
        amp_quality = _quality(task.mode, amp_eval, y_eval)
        text_amp, ok_amp = _quality_rule(task.mode, cfg, amp_quality)
        result.stats.update(quality_fp32=ref_quality, quality_amp=amp_quality)
        result.rules.append(Rule("quality on the fixed evaluation set", text, text_amp, ok_amp))
        results.append(result)
    return Validation(task.name, task.mode, ids, reference, results)


def compare_training(task: Task, config: Config, device: torch.device, steps: int) -> list[dict[str, Any]]:
    """Train ``steps`` steps from the same state in FP32 and each AMP precision; compare curves.

    Reads each step's record on the host (one host sync a step, as in a run). The model's
    weights are put back as they were afterwards.

    Example::

        >>> from ampguard.config import validate
        >>> from ampguard.tasks import build_task
        >>> config = validate({"task": {"name": "linear"}, "device": "cpu", "validation": {"precisions": ["bf16"]}})
        >>> task = build_task(config)
        >>> before = task.model.weight.detach().clone()
        >>> curves = compare_training(task, config, torch.device("cpu"), steps=2)
        >>> [(c["precision"], c["updates_applied"], len(c["losses"])) for c in curves]
        [('fp32', 2, 2), ('bf16', 2, 2)]
        >>> curves[0]["max_loss_diff_vs_fp32"], torch.equal(task.model.weight, before)
        (0.0, True)
    """
    from .build import build_state
    from .step import AmpTrainState

    start = copy.deepcopy(task.model.state_dict())
    runs: dict[str, dict[str, Any]] = {}
    for name in ["fp32", *config.validation.precisions]:
        task.model.load_state_dict(start)
        task.model.train()
        scales = Precision(name, device.type).uses_scaler  # a scaler setting applies where one is used
        scaler = config.scaler.model_copy(update={"enabled": config.scaler.enabled if scales else None})
        run_config = config.model_copy(update={"precision": name, "steps": steps, "scaler": scaler})
        model = prepare_model(run_config, task.model, copy_model=True)  # fp8: a converted copy; else task.model
        state: AmpTrainState = build_state(run_config, model, task.loss_fn, device)
        losses, norms, updates = [], [], 0
        stream = itertools.islice(task.batches(), steps * config.accumulation_steps)
        for inputs, targets in stream:
            record = state.step(to_device(inputs, device), to_device(targets, device))
            if record is None:
                continue
            v = record.values()
            losses.append(v["loss"])
            norms.append(v["grad_l2_pre_clip"])
            updates += not record.skipped
        runs[name] = {"losses": losses, "norms": norms, "updates": updates}
    task.model.load_state_dict(start)
    ref = runs["fp32"]
    out = []
    for name, r in runs.items():
        pairs = [(a, b) for a, b in zip(r["losses"], ref["losses"]) if a is not None and b is not None
                 and math.isfinite(a) and math.isfinite(b)]
        norm_pairs = [(a, b) for a, b in zip(r["norms"], ref["norms"]) if a and b and math.isfinite(a) and math.isfinite(b)]
        out.append({
            "precision": name,
            "updates_applied": r["updates"],
            "final_loss": r["losses"][-1] if r["losses"] else None,
            "max_loss_diff_vs_fp32": max((abs(a - b) for a, b in pairs), default=0.0),
            "mean_grad_norm_ratio_vs_fp32": (sum(a / b for a, b in norm_pairs) / len(norm_pairs)) if norm_pairs else None,
            "losses": r["losses"],
        })
    return out


# ---------------------------------------------------------------------------- output


def markdown(v: Validation, config: Config) -> str:
    """``validation.md``: the verdict, the rules declared, then one table per precision.

    Example::

        >>> v = Validation("linear", "regression", ["typical:0"], [Rule("reference quality", "mse 0.1", "", True)],
        ...                [PrecisionResult("fp16", [Rule("complete and finite", "1/1", "0/1", False)])])
        >>> lines = markdown(v, Config()).splitlines()
        >>> lines[0], lines[2]
        ('# AMP validation: linear (regression)', '**REJECTED**')
        >>> [line for line in lines if line.startswith("## ") or "complete and finite" in line]
        ['## FP32 reference', '## fp16 vs FP32: FAIL', '| complete and finite | 1/1 | 0/1 | FAIL |']
    """
    cfg = config.validation
    lines = [
        f"# AMP validation: {v.task} ({v.mode})",
        "",
        f"**{'ACCEPTED' if v.ok else 'REJECTED'}**" + ("" if v.reference_ok else " (the FP32 reference itself is not trusted)"),
        "",
        f"Weights: {v.weights}. Model in eval mode. Probe set ({len(v.probes)}): {cfg.typical} typical, "
        f"{cfg.boundary if v.mode == 'classifier' else 0} nearest a decision boundary in FP32, "
        f"{'the task edge cases' if cfg.edge_cases else 'no edge cases'}. Rules declared before the run: scores within "
        f"abs {cfg.abs_tol:g} + rel {cfg.rel_tol:g}; at most {cfg.max_flips} decision changes (tie margin "
        f"{cfg.tie_margin:g}, ties {cfg.ties.replace('_', ' ')}); no non-finite output; "
        + (f"accuracy >= {cfg.min_accuracy:g}" if v.mode == "classifier" and cfg.min_accuracy is not None
           else f"mse <= {cfg.max_mse:g}" if v.mode == "regression" and cfg.max_mse is not None
           else "no quality threshold") + ".",
        "",
        "## FP32 reference",
        "",
        "| criterion | reference | decision |",
        "|---|---|---|",
        *(f"| {r.criterion} | {r.reference} | {r.decision} |" for r in v.reference),
    ]
    for result in v.results:
        lines += ["", f"## {result.precision} vs FP32: {'pass' if result.ok else 'FAIL'}", "",
                  "| criterion | reference (FP32) | AMP | decision |", "|---|---|---|---|"]
        lines += [f"| {r.criterion} | {r.reference} | {r.amp} | {r.decision} |" for r in result.rules]
        if result.flips or result.ties:
            lines += ["", "| probe | FP32 decision | AMP decision | FP32 margin | AMP margin | change |",
                      "|---|---|---|---|---|---|"]
            lines += [f"| {r['probe']} | {r['fp32']} | {r['amp']} | {r['fp32_margin']:.4g} | {r['amp_margin']:.4g} | flip |"
                      for r in result.flips]
            lines += [f"| {r['probe']} | {r['fp32']} | {r['amp']} | {r['fp32_margin']:.4g} | {r['amp_margin']:.4g} | tie |"
                      for r in result.ties]
    if v.training:
        lines += ["", "## Training from the same state (informational)", "",
                  "| precision | updates applied | final loss | max loss diff vs FP32 | mean grad-norm ratio vs FP32 |",
                  "|---|---|---|---|---|"]
        for t in v.training:
            ratio = t["mean_grad_norm_ratio_vs_fp32"]
            lines.append(f"| {t['precision']} | {t['updates_applied']} | {t['final_loss']:.4g} | "
                         f"{t['max_loss_diff_vs_fp32']:.3g} | {'n/a' if ratio is None else format(ratio, '.4f')} |")
    return "\n".join(lines) + "\n"


def as_json(v: Validation) -> dict[str, Any]:
    """``validation.json``'s content: the same verdict and rules as the markdown, as data.

    Example::

        >>> v = Validation("linear", "regression", ["typical:0"], [Rule("reference quality", "mse 0.1", "", True)],
        ...                [PrecisionResult("bf16", [Rule("complete and finite", "1/1", "1/1", True)])])
        >>> data = as_json(v)
        >>> data["accepted"], data["precisions"][0]["rules"]
        (True, [{'criterion': 'complete and finite', 'reference': '1/1', 'amp': '1/1', 'ok': True}])
    """

    def rules(rs: list[Rule]) -> list[dict[str, Any]]:
        return [{"criterion": r.criterion, "reference": r.reference, "amp": r.amp, "ok": r.ok} for r in rs]

    return {
        "accepted": v.ok, "reference_trusted": v.reference_ok, "task": v.task, "mode": v.mode,
        "weights": v.weights, "probes": v.probes, "reference": rules(v.reference),
        "precisions": [{"precision": r.precision, "ok": r.ok, "rules": rules(r.rules), "flips": r.flips,
                        "ties": r.ties, "stats": r.stats} for r in v.results],
        "training": v.training,
    }


def write_outputs(v: Validation, config: Config, folder: Path) -> tuple[Path, Path]:
    """Write ``validation.md`` and ``validation.json`` into ``folder`` (which must exist).

    Example (non-finite stats are written as strict JSON)::

        >>> import shutil, tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> result = PrecisionResult("fp16", [Rule("complete and finite", "1/1", "0/1", False)],
        ...                          stats={"max_abs_error": math.inf})
        >>> md, js = write_outputs(Validation("linear", "regression", [], [], [result]), Config(), folder)
        >>> data = json.loads(js.read_text())
        >>> md.name, data["accepted"], data["precisions"][0]["stats"]["max_abs_error"]
        ('validation.md', False, 'inf')
        >>> shutil.rmtree(folder)
    """
    md, js = folder / "validation.md", folder / "validation.json"
    md.write_text(markdown(v, config), encoding="utf-8")
    js.write_text(json.dumps(strict_json(as_json(v)), indent=2) + "\n", encoding="utf-8")
    return md, js


# ---------------------------------------------------------------------------- the verb


def run(config: Config, *, checkpoint: str | None = None, out: str | Path | None = None,
        train_steps: int | None = None) -> ExitCode:
    """``ampguard validate``: compare, write ``validation.md`` and ``validation.json`` into ``out``
    (default ``log.dir/validate-<time>``; an existing non-empty folder, a file, or a place that
    cannot be written is refused), print the verdict. ``ExitCode.OK`` when every rule holds,
    ``ExitCode.REJECTED`` when any is violated. Every refusal (:class:`InputError`) comes before
    anything is written.

    Example (an untrained model misses a declared ``max_mse``: the reference is not trusted)::

        >>> import shutil, tempfile
        >>> from ampguard.config import validate
        >>> folder = Path(tempfile.mkdtemp())
        >>> config = validate({"task": {"name": "linear"}, "device": "cpu",
        ...                    "validation": {"precisions": ["bf16"], "typical": 4, "max_mse": 0.5}})
        >>> code = run(config, out=folder / "v")  # doctest: +ELLIPSIS
        reference: reference outputs finite: 7/7 probes, 512/512 eval -> pass
        reference: reference quality: mse ... (<= 0.5) -> FAIL
        ...
        validate: REJECTED (FP32 reference not trusted); report .../validation.md, .../validation.json
        >>> code, sorted(p.name for p in (folder / "v").iterdir())
        (<ExitCode.REJECTED: 1>, ['validation.json', 'validation.md'])
        >>> for out in (folder / "v", folder / "v" / "validation.md"):
        ...     try:
        ...         run(config, out=out)
        ...     except InputError as err:
        ...         print(str(err).replace(str(folder), "DIR"))
        --out DIR/v exists and is not empty; refusing to overwrite it
        --out DIR/v/validation.md is a file, not a folder
        >>> shutil.rmtree(folder)
    """
    import time

    from .checkpoint import load_weights
    from .tasks import build_task

    cfg = config.validation
    if train_steps is not None:
        cfg = cfg.model_copy(update={"train_steps": train_steps})
        config = config.model_copy(update={"validation": cfg})
    folder = Path(out) if out else Path(config.log.dir) / time.strftime("validate-%Y%m%d-%H%M%S")
    check_output_folder(folder)
    device = resolve_device(config.device)
    task = build_task(config)
    check_rules(task, cfg)
    model = task.model.to(device)
    weights = "freshly initialised (no checkpoint given)"
    checkpoint = checkpoint or cfg.checkpoint
    if checkpoint:
        payload = load_weights(model, checkpoint, map_location=device)
        weights = f"from {checkpoint} (step {payload['step']})"

    training = compare_training(task, config, device, cfg.train_steps) if cfg.train_steps else []
    result = compare(task, model, config, device)
    result.weights, result.training = weights, training
    md, js = write_report_folder(result, config, folder)
    for r in result.reference:
        print(f"reference: {r.criterion}: {r.reference} -> {r.decision}")
    for precision in result.results:
        for r in precision.rules:
            print(f"{precision.precision}: {r.criterion}: {r.amp} -> {r.decision}")
    for t in training:
        print(f"train {t['precision']}: {t['updates_applied']} updates applied, final loss {t['final_loss']:.4g}")
    verdict = "ACCEPTED" if result.ok else "REJECTED" + ("" if result.reference_ok else " (FP32 reference not trusted)")
    print(f"validate: {verdict}; report {md}, {js}")
    return ExitCode.OK if result.ok else ExitCode.REJECTED


def check_output_folder(folder: Path) -> None:
    """Refuse an ``--out`` the report cannot go to, before anything runs: a file, a non-empty
    folder, a path under a file, or a place this process may not write.

    Example::

        >>> import os, shutil, tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> _ = (root / "notes.txt").write_text("keep me")
        >>> check_output_folder(root / "new" / "deeper")  # made later, with its parents: fine
        >>> for out in (root, root / "notes.txt", root / "notes.txt" / "sub"):
        ...     try:
        ...         check_output_folder(out)
        ...     except InputError as err:
        ...         print(str(err).replace(str(root), "DIR"))
        --out DIR exists and is not empty; refusing to overwrite it
        --out DIR/notes.txt is a file, not a folder
        --out DIR/notes.txt/sub: DIR/notes.txt is a file, not a folder
        >>> shutil.rmtree(root)
    """
    if folder.is_dir():
        if any(folder.iterdir()):
            raise InputError(f"--out {folder} exists and is not empty; refusing to overwrite it")
        existing = folder
    elif folder.exists() or folder.is_symlink():
        raise InputError(f"--out {folder} is a file, not a folder")
    else:
        existing = next(p for p in folder.absolute().parents if p.exists() or p.is_symlink())
        if not existing.is_dir():
            raise InputError(f"--out {folder}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"--out {folder}: {existing} is not writable")


def write_report_folder(v: Validation, config: Config, folder: Path) -> tuple[Path, Path]:
    """Create ``folder`` (and its missing parents) and write the report into it; a write that
    fails (permissions, a full disk) takes back what it made and is one :class:`InputError`.

    Example::

        >>> import shutil, tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> v = Validation("linear", "regression", [], [], [])
        >>> [p.name for p in write_report_folder(v, Config(), root / "a" / "b")]
        ['validation.md', 'validation.json']
        >>> shutil.rmtree(root)
    """
    made = [p for p in (folder, *folder.parents) if not p.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        return write_outputs(v, config, folder)
    except OSError as err:
        for name in ("validation.md", "validation.json"):
            (folder / name).unlink(missing_ok=True)
        for p in made:  # deepest first
            with contextlib.suppress(OSError):
                p.rmdir()
        raise InputError(f"--out {folder}: cannot write the report ({err.strerror or err})") from None
