"""``ampguard VERB ...``: the command line. Exit codes: 0 done, 2 bad input, 130 interrupted."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from .errors import InputError

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (exit 2), not a usage block."""

    def error(self, message: str) -> NoReturn:
        verb = self.prog.removeprefix("ampguard").strip()  # "demo" for `ampguard demo`, "" at the top
        raise InputError(f"{verb}: {message}" if verb else message)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _rate(text: str) -> float:
    value = _number(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a rate in [0, 1], got {text}")
    return value


def _fault(text: str) -> str:
    from .faults import parse_fault

    if text != "none":
        try:
            parse_fault(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return text


# ---------------------------------------------------------------------------- demo

DEMO_INIT_SCALE = 2.0**10  # small enough that clean fp16 gradients never overflow in the demo


def _demo(args: argparse.Namespace) -> int:
    from .config import validate
    from .train import run

    precision = "bf16" if args.bf16 else args.precision
    if args.bf16 and args.precision not in (None, "bf16"):
        raise InputError(f"demo: --bf16 contradicts --precision {args.precision}")
    precision = precision or "fp16"
    inject = [f for f in (args.inject or ["spike@5" if args.spike else "inf_grad@5"]) if f != "none"]
    if args.spike and args.inject:
        inject.append("spike@5")
    config = validate(
        {
            "precision": precision,
            "steps": args.steps,
            "max_norm": args.max_norm,
            "seed": args.seed,
            "device": args.device,
            "inject": inject,
            "task": {"name": "linear", "batch_size": 32},
            "optimizer": {"name": "sgd", "lr": 0.2, "momentum": 0.0},
            "schedule": {"decay": "constant"},
            "eval": {"enabled": False},
            "diagnose": {"strict": args.strict},
            "scaler": {"init_scale": DEMO_INIT_SCALE, "growth_interval": 1_000_000},
            "monitor": _monitor_flags(args),
        }
    )
    csv_path = Path(args.csv) if args.csv else None
    if csv_path is not None and csv_path.exists():
        raise InputError(f"--csv {csv_path} already exists; refusing to overwrite it")
    from .train import RunPaths

    scaler = f"GradScaler(init_scale={DEMO_INIT_SCALE:g})" if precision == "fp16" else "no loss scaler"
    print(
        f"ampguard demo: nn.Linear, {config.steps} steps, {precision} with {scaler}, "
        f"max_norm={config.max_norm}, inject: {', '.join(inject) or 'none'}"
    )
    result = run(config, outputs=lambda: RunPaths(csv=csv_path), console_every=1)
    return _finish(result)


def _monitor_flags(args: argparse.Namespace) -> dict[str, Any]:
    flags: dict[str, Any] = {}
    if args.fail_skip_rate is not None:
        flags["fail_rate"] = args.fail_skip_rate
    if args.fail_after is not None:
        flags["fail_after"] = args.fail_after
    return flags


def _finish(result: Any) -> int:
    """The closing lines every run prints: summary, why it ended, where its records are."""
    from . import distributed

    if not distributed.current().is_main:  # under torchrun, rank 0 speaks for the run
        return result.exit_code
    print(f"summary: {result.monitor.summary()}")
    print(f"ended: {result.ended}")
    csv_path, run_dir = result.paths.csv, result.paths.dir
    if run_dir is not None:
        print(f"run folder: {run_dir} (RUN.md, steps.csv, events.jsonl, report.png, checkpoints/)")
    elif csv_path is not None:
        print(f"csv: {csv_path} ({result.monitor.steps} rows)")
    if result.exit_code == EXIT_INTERRUPTED:
        where = f"; {result.monitor.steps} complete rows in {csv_path}" if csv_path else ""
        print(f"interrupted after step {result.monitor.steps}{where}", file=sys.stderr)
    return result.exit_code


# ---------------------------------------------------------------------------- train


def _train(args: argparse.Namespace) -> int:
    from .config import dump_config
    from .train import RunPaths, check_resume_config, prepare_resume, run

    resume, saved = prepare_resume(args.resume) if args.resume else (None, None)
    sections: dict[str, dict[str, Any]] = {"monitor": _monitor_flags(args)}
    if args.strict:
        sections["diagnose"] = {"strict": True}
    config = _config_from(args, base=saved, sections=sections)
    if resume is not None:
        assert saved is not None
        check_resume_config(saved, config)
        step = int(resume.payload["step"])
        if step >= config.steps:
            raise InputError(f"--resume: {resume.path} is at step {step}, the run asks for {config.steps} steps; "
                             "raise steps (--set steps=N) to continue")
    if args.print_config:
        print(dump_config(config), end="")
        return 0

    def outputs() -> RunPaths:
        if resume is not None:
            paths = RunPaths.existing(resume.run_dir)
            paths.write_config(config)
            print(f"run folder: {paths.dir} (resuming from {resume.path.name}, step {resume.payload['step']})")
        else:
            paths = RunPaths.new_run_dir(config)
            print(f"run folder: {paths.dir}")
        return paths

    every = config.log.every
    try:
        result = run(config, outputs=outputs, console_every=every, stats_every=every, progress=True, resume=resume)
        return _finish(result)
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


# ---------------------------------------------------------------------------- validate


def _validate(args: argparse.Namespace) -> int:
    import time

    from .checkpoint import load_weights
    from .tasks import build_task
    from .train import resolve_device
    from .validate import compare, compare_training, write_outputs

    config = _config_from(args)
    cfg = config.validation
    if args.train_steps is not None:
        cfg = cfg.model_copy(update={"train_steps": args.train_steps})
        config = config.model_copy(update={"validation": cfg})
    device = resolve_device(config.device)
    task = build_task(config)
    model = task.model.to(device)
    weights = "freshly initialised (no checkpoint given)"
    checkpoint = args.checkpoint or cfg.checkpoint
    if checkpoint:
        payload = load_weights(model, checkpoint, map_location=device)
        weights = f"from {checkpoint} (step {payload['step']})"
    out = Path(args.out) if args.out else Path(config.log.dir) / time.strftime("validate-%Y%m%d-%H%M%S")
    if out.exists() and any(out.iterdir()):
        raise InputError(f"--out {out} exists and is not empty; refusing to overwrite it")

    training = compare_training(task, config, device, cfg.train_steps) if cfg.train_steps else []
    result = compare(task, model, config, device)
    result.weights, result.training = weights, training
    out.mkdir(parents=True, exist_ok=True)
    md, js = write_outputs(result, config, out)
    for r in result.reference:
        print(f"reference: {r.criterion}: {r.reference} -> {r.decision}")
    for precision in result.results:
        for r in precision.rules:
            print(f"{precision.precision}: {r.criterion}: {r.amp} -> {r.decision}")
    for t in training:
        print(f"train {t['precision']}: {t['updates_applied']} updates applied, final loss {t['final_loss']:.4g}")
    verdict = "ACCEPTED" if result.ok else "REJECTED" + ("" if result.reference_ok else " (FP32 reference not trusted)")
    print(f"validate: {verdict}; report {md}, {js}")
    return 0 if result.ok else 1


# ---------------------------------------------------------------------------- bench


def _bench(args: argparse.Namespace) -> int:
    import torch

    from .bench import machine, run_bench, speedups, table, to_json
    from .train import resolve_device

    device = resolve_device(args.device)
    workloads = args.models.split(",")
    precisions = args.precisions.split(",")
    for name in workloads:
        if name not in ("mlp", "transformer", "gpt2"):
            raise InputError(f"bench: unknown model {name!r} (mlp, transformer, gpt2)")
    for name in precisions:
        if name not in ("fp32", "bf16", "fp16"):
            raise InputError(f"bench: unknown precision {name!r} (fp32, bf16, fp16)")
    if args.quick:
        args.steps, args.rounds, args.warmup = 3, 2, 1
    torch.manual_seed(0)
    print(f"ampguard bench on {device} ({machine()}): {args.rounds} rounds x {args.steps} steps, interleaved")
    results = run_bench(device=device, workloads=workloads, precisions=precisions, steps=args.steps,
                        rounds=args.rounds, warmup=args.warmup, peers=not args.no_peers, fused=args.fused,
                        peak_tflops=args.peak_tflops)
    if args.json:
        print(to_json(results))
    else:
        print(table(results))
        for line in speedups(results):
            print(line)
    return 0


# ---------------------------------------------------------------------------- locate


def _config_from(
    args: argparse.Namespace, base: dict[str, Any] | None = None, sections: dict[str, dict[str, Any]] | None = None
) -> Any:
    """The effective, validated config: CONFIG (or ``base``, or the defaults), then --set, then
    --inject, then flags that fill config sections (e.g. --fail-skip-rate -> monitor.fail_rate)."""
    from .config import apply_overrides, read_file, validate

    data = read_file(args.config) if args.config else dict(base or {})
    data = apply_overrides(data, args.set or [])
    if getattr(args, "inject", None):
        data["inject"] = list(data.get("inject") or []) + [f for f in args.inject if f != "none"]
    for section, values in (sections or {}).items():
        if values:
            data[section] = {**(data.get(section) or {}), **values}
    return validate(data)


def _locate(args: argparse.Namespace) -> int:
    import itertools
    import json

    from .checkpoint import load_weights
    from .faults import FaultInjector, parse_fault
    from .locate import diagnose_group
    from .precision import Precision
    from .tasks import build_task
    from .train import _to_device, resolve_device

    config = _config_from(args)
    device = resolve_device(config.device)
    task = build_task(config)
    model = task.model.to(device)
    scale = config.scaler.init_scale if config.precision == "fp16" else 1.0
    if args.checkpoint:
        payload = load_weights(model, args.checkpoint, map_location=device)
        scaler_state = payload["state"].get("scaler") or {}
        scale = float(scaler_state.get("scale", scale)) if config.precision == "fp16" else 1.0
    if args.scale is not None:
        scale = args.scale
    faults = [parse_fault(spec, seed=config.seed) for spec in config.inject]
    injector = FaultInjector(faults, config.accumulation_steps)
    loss_fn = injector.wrap_loss(task.loss_fn)
    injector.attach(model)
    if args.batch:
        batch = load_checkpoint_batch(args.batch)
        batches = [batch]
        where = f"batch {args.batch}"
    else:
        n = config.accumulation_steps
        stream = injector.wrap_data(task.batches(), first_step=1)
        batches = list(itertools.islice(stream, (args.step - 1) * n, args.step * n))
        where = f"step {args.step} of task {task.name} (seed {config.seed})"
    injector.current_step = args.step if not args.batch else 0  # the faults of the replayed step
    batches = [(_to_device(x, device), _to_device(y, device)) for x, y in batches]
    result = diagnose_group(model, loss_fn, batches, Precision(config.precision, device.type), scale)
    if args.json:
        print(json.dumps({"where": where, **result.as_dict()}))
    else:
        print(f"locate: {where}, {config.precision} on {device.type}, loss scale {scale:g}")
        print(result.message())
    return 0


def load_checkpoint_batch(path: str) -> tuple[Any, Any]:
    """A saved batch: ``torch.save({"inputs": x, "targets": y}, path)``, loaded weights-only."""
    from .checkpoint import safe_load

    data = safe_load(path, "batch")
    if not isinstance(data, dict) or not {"inputs", "targets"} <= set(data):
        raise InputError(f"{path}: a batch file holds {{'inputs': ..., 'targets': ...}}")
    return data["inputs"], data["targets"]


# ---------------------------------------------------------------------------- report


def _report(args: argparse.Namespace) -> int:
    from .config import read_file, validate
    from .report import plot_run, read_steps_csv, replay

    target = Path(args.path)
    if target.is_dir():
        csv_path, out = target / "steps.csv", target / "report.png"
        config_path = target / "config.yaml"
    else:
        csv_path, out = target, target.with_suffix(".png")
        config_path = target.parent / "config.yaml"
    if not csv_path.is_file():
        raise InputError(f"no per-step CSV at {csv_path}")
    settings: dict[str, Any] = {"max_norm": 1.0, "window": 1000, "alert_rate": 0.05, "fail_rate": None}
    scaler: dict[str, Any] = {}
    if config_path.is_file():
        config = validate(read_file(config_path))
        settings = {"max_norm": config.max_norm, "window": config.monitor.window,
                    "alert_rate": config.monitor.alert_rate, "fail_rate": config.monitor.fail_rate}
        scaler = {"init_scale": config.scaler.init_scale, "min_scale": config.scaler.min_scale}
    for key in settings:
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    out = Path(args.out) if args.out else out

    rows = read_steps_csv(csv_path)
    if not rows:
        raise InputError(f"{csv_path}: no steps recorded, nothing to report")
    scaler_on = any(r.scaler_scale not in (None, 1.0) for r in rows)
    monitor = replay(rows, window=settings["window"], alert_rate=settings["alert_rate"],
                     fail_rate=settings["fail_rate"], max_norm=settings["max_norm"],
                     scaler_enabled=scaler_on, **scaler)
    plot_run(csv_path, out, **settings)
    print(f"summary: {monitor.summary()}")
    print(f"max rolling skip rate {monitor.max_skip_rate:.4f} (window {settings['window']}), "
          f"alert episodes {monitor.alert_episodes}, clip rate {monitor.clip_rate:.3f}, scale {monitor.scale_verdict}")
    print(f"plot: {out}")
    return 0


# ---------------------------------------------------------------------------- main


def _config_arguments(parser: argparse.ArgumentParser, example: str) -> None:
    """CONFIG and --set, the same for every verb that reads a config."""
    parser.add_argument("config", nargs="?", metavar="CONFIG", help="a .yaml, .yml, .json or .toml config file")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", help=f"override a config key, e.g. {example}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ampguard", description="Mixed-precision training made safe and observable.")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)
    verbs.required = True

    fault_help = (
        "inject a fault, KIND@WHEN (repeatable): KIND is inf_grad, nan_grad, nan_loss, spike (targets x 1e8) "
        "or nan_input; WHEN is 5, 5,9,12, every:10 or rate:0.05; 'none' injects nothing"
    )

    demo = verbs.add_parser(
        "demo",
        help="the teaching demo: nn.Linear, fp16, an Inf gradient at step 5",
        description="nn.Linear trained for 20 steps in fp16 with a GradScaler; an Inf is injected into the "
        "gradients at step 5, which is skipped, and the scale halves there.",
    )
    demo.add_argument("--precision", choices=["fp16", "bf16", "fp32"], default=None, help="default fp16")
    demo.add_argument("--bf16", action="store_true", help="same as --precision bf16")
    demo.add_argument("--steps", type=_positive_int, default=20)
    demo.add_argument("--inject", action="append", type=_fault, metavar="KIND@WHEN", help=fault_help)
    demo.add_argument("--spike", action="store_true", help="a real loss spike at step 5 (spike@5) instead of the Inf")
    demo.add_argument("--csv", metavar="PATH", help="also write the per-step CSV here (must not exist)")
    demo.add_argument("--max-norm", type=_number, default=1.0, help="global L2 clip threshold (0: off)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    demo.set_defaults(func=_demo)

    train = verbs.add_parser(
        "train",
        help="guarded training from a config (YAML, JSON, TOML) or the embedded default",
        description="Guarded training. Without CONFIG it trains the embedded default: a small character-level "
        "transformer on Python's standard-library sources. Writes runs/<name>/ with steps.csv and config.yaml.",
    )
    _config_arguments(train, example="optimizer.lr=1e-3")
    train.add_argument("--inject", action="append", type=_fault, metavar="KIND@WHEN", help=fault_help)
    train.add_argument("--print-config", action="store_true", help="print the effective config and exit")
    train.add_argument("--resume", metavar="RUN_DIR|CHECKPOINT",
                       help="continue a run from its latest loadable checkpoint (or the one named), in its run folder")
    for verb in (demo, train):
        verb.add_argument("--strict", action="store_true",
                          help="debugging: stop (exit 3) at the first non-finite loss or gradient, saying which and where")
        verb.add_argument("--fail-skip-rate", type=_rate, metavar="RATE",
                          help="stop with exit code 3 when the rolling skip rate stays above RATE (monitor.fail_rate)")
        verb.add_argument("--fail-after", type=_positive_int, metavar="N",
                          help="...for N consecutive steps (monitor.fail_after, default 100)")
    train.set_defaults(func=_train)

    validate = verbs.add_parser(
        "validate",
        help="AMP vs an FP32 reference on a fixed probe set, with rules declared before the run",
        description="Runs the FP32 reference (checked first), then each AMP precision in validation.precisions, on "
        "a fixed probe set (typical, nearest-a-boundary and edge-case inputs) and a fixed evaluation set. Rules come "
        "from the config's validation section. Writes validation.md and validation.json; exit 0 when every rule "
        "holds, 1 when any is violated.",
    )
    _config_arguments(validate, example="validation.max_flips=2")
    validate.add_argument("--checkpoint", metavar="CKPT", help="model weights from an ampguard checkpoint")
    validate.add_argument("--train-steps", dest="train_steps", type=_positive_int, metavar="N",
                          help="also train N steps from the same state in FP32 and AMP and compare")
    validate.add_argument("--out", metavar="DIR", help="where to write the report (default: runs/validate-<time>)")
    validate.set_defaults(func=_validate)

    bench = verbs.add_parser(
        "bench",
        help="the guarded step vs the bare canonical loop (and Accelerate / Fabric when installed), interleaved",
        description="Times the same model, data, optimizer and seed under the bare canonical AMP loop, ampguard's "
        "step with per-step CSV logging, and Accelerate / Lightning Fabric when installed, interleaved in rounds. "
        "Prints median and min ms/step, the ratio to the bare loop, peak memory (CUDA), tokens/s and MFU.",
    )
    bench.add_argument("--device", choices=["auto", "cpu", "cuda"], default="cpu")
    bench.add_argument("--models", default="mlp,transformer", help="comma-separated: mlp, transformer, gpt2")
    bench.add_argument("--precisions", default="fp32,bf16,fp16", help="comma-separated: fp32, bf16, fp16")
    bench.add_argument("--steps", type=_positive_int, default=30, help="steps per contender per round")
    bench.add_argument("--rounds", type=_positive_int, default=7)
    bench.add_argument("--warmup", type=_positive_int, default=5)
    bench.add_argument("--fused", action="store_true", help="fused AdamW for every contender")
    bench.add_argument("--no-peers", action="store_true", help="leave Accelerate and Fabric out")
    bench.add_argument("--peak-tflops", type=_number, help="the accelerator's peak, for model FLOP utilisation")
    bench.add_argument("--quick", action="store_true", help="a few steps only (a smoke test, not a measurement)")
    bench.add_argument("--json", action="store_true", help="print the results as JSON")
    bench.set_defaults(func=_bench)

    locate = verbs.add_parser(
        "locate",
        help="find the first module/op where a non-finite value appears, and whether FP32 replay is clean",
        description="Replays one batch (step N of a config's data, with its faults, or a saved batch) with hooks on "
        "every module and parameter, names the first non-finite value (input, a module's forward output, the "
        "loss, or a parameter's gradient), then replays it in FP32: finite there means a precision-range problem.",
    )
    _config_arguments(locate, example="precision=fp16")
    locate.add_argument("--inject", action="append", type=_fault, metavar="KIND@WHEN", help=fault_help)
    locate.add_argument("--step", type=_positive_int, default=1, help="which step's micro-batches to replay (default 1)")
    locate.add_argument("--batch", metavar="FILE.pt", help="a saved batch {'inputs': ..., 'targets': ...} instead")
    locate.add_argument("--checkpoint", metavar="CKPT", help="load the model's weights (and loss scale) from a checkpoint")
    locate.add_argument("--scale", type=_number, help="loss scale for the backward pass (default: the scaler's)")
    locate.add_argument("--json", action="store_true", help="print the finding as JSON")
    locate.set_defaults(func=_locate)

    report = verbs.add_parser(
        "report",
        help="plot a run's per-step CSV and summarise it",
        description="Draws report.png (loss, gradient norms, loss scale, lr, rolling skip rate; skipped steps "
        "marked) from a run folder or a per-step CSV, and prints a summary.",
    )
    report.add_argument("path", metavar="RUN_DIR|CSV")
    report.add_argument("--out", metavar="PNG", help="where to write the plot (default: RUN_DIR/report.png or CSV's .png)")
    report.add_argument("--max-norm", dest="max_norm", type=_number, help="clip threshold line (default: the run's config)")
    report.add_argument("--window", type=_positive_int, help="rolling skip-rate window (default: the run's config)")
    report.add_argument("--alert-rate", dest="alert_rate", type=_rate, help="alert threshold line")
    report.add_argument("--fail-rate", dest="fail_rate", type=_rate, help="fail threshold line")
    report.set_defaults(func=_report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except InputError as err:
        print(f"ampguard: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("ampguard: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # e.g. `ampguard demo | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
