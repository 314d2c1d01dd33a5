"""``ampguard VERB ...``: the command line. Exit codes are :class:`~ampguard.errors.ExitCode`."""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import math
import os
import signal
import sys
import threading
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

from .errors import (
    MAX_COUNT, MAX_WINDOW, AmpguardWarning, ConfigError, ExitCode, InputError, an_interrupt, counted, failed_because,
    has_control, interrupt_in, one_line, plain_digits, process_rank, shortened, shown, warn,
)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (exit 2), not a usage block, and an option that
    takes one value is given once (:class:`_Once`). ``intermixed=True`` (a verb's parser with
    no REMAINDER or sub-verb positional): its options may come between its positionals
    (``compare A --out x.png B``: review 53b, B was refused as an unrecognized argument)."""

    def __init__(self, *args: Any, intermixed: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.intermixed, self._intermixing = intermixed, False

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        # (the sub-verbs action calls this; parse_known_intermixed_args calls it back before Python 3.13)
        if not self.intermixed or self._intermixing:
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False

    def error(self, message: str) -> NoReturn:
        verb = self.prog.removeprefix("ampguard").strip()  # "demo" for `ampguard demo`, "" at the top
        raise InputError(f"{verb}: {message}" if verb else message)

    def add_argument(self, *names: Any, **kwargs: Any) -> argparse.Action:
        if names and str(names[0]).startswith("-") and kwargs.get("action", "store") == "store" \
                and "nargs" not in kwargs:
            kwargs["action"] = _Once
        return super().add_argument(*names, **kwargs)


class _Once(argparse.Action):
    """An option that takes one value, refused when given twice: argparse keeps the last, unsaid
    (``demo --csv a.csv --csv b.csv`` wrote b.csv alone; two ``--resume`` resumed one of them).
    ``--set`` and ``--inject`` repeat by design (``append``).

    Example::

        >>> build_parser().parse_args(["report", "r", "--window", "5", "--window", "6"])
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: report: argument --window: given twice (5, then 6): give it once
    """

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        given = namespace.__dict__.setdefault("_given_once", set())
        if self.dest in given:
            parser.error(f"argument {'/'.join(self.option_strings)}: given twice ({getattr(namespace, self.dest)}, "
                         f"then {values}): give it once")
        given.add(self.dest)
        setattr(namespace, self.dest, values)


def _positive_int(text: str, at_least: int = 1) -> int:
    try:
        value = int(_ascii(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not at_least <= value <= MAX_COUNT:
        raise argparse.ArgumentTypeError(f"must be in [{at_least}, {MAX_COUNT:.0e}], got {value}")
    return value


def _whole(text: str) -> int:
    """A whole number in ASCII digits, its range the config's to judge (``demo --seed``)."""
    try:
        return int(_ascii(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def _count(text: str) -> int:
    """A whole number >= 0 (``report --min-steps``)."""
    return _positive_int(text, at_least=0)


def _path(text: str) -> str:
    """A path: an empty one is refused (it would read as "not given" and fall back to a default)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a path, got an empty string")
    return text


def _window(text: str) -> int:
    """A rolling window's size, at most ``MAX_WINDOW`` (its ring is kept in memory)."""
    value = _whole(text)
    if not 1 <= value <= MAX_WINDOW:  # (one range said, whatever the value: review 47b)
        raise argparse.ArgumentTypeError(f"must be in [1, {MAX_WINDOW:.0e}], got {value}")
    return value


def _threads(text: str) -> int:
    """``bench --threads``: at most 4096 (torch takes an int32; no machine has more cores)."""
    try:
        value = int(_ascii(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 1 <= value <= 4096:
        raise argparse.ArgumentTypeError(f"must be in [1, 4096], got {value}")
    return value


def _clip(text: str) -> float:
    """A clip threshold: a finite number (0 or below: off), as ``max_norm`` in a config."""
    value = _number(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number (0 or below: off), got {text}")
    return value


def _ascii(text: str) -> str:
    """``text`` when its number is written as the run's files and config write one
    (:func:`~ampguard.errors.plain_digits`), else ``ValueError``, raised as the caller's own refusal.

    Example::

        >>> _ascii("12"), _positive_int("3")
        ('12', 3)
        >>> _positive_int("٣")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: expected a whole number, got '٣'
    """
    if not plain_digits(text):
        raise ValueError(text)
    return text


def _number(text: str) -> float:
    try:
        return float(_ascii(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _rate(text: str) -> float:
    value = _number(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a rate in [0, 1], got {text}")
    return value


def _fail_rate(text: str) -> float:
    """A rate the fail-fast can trip on: below 1 (no skip rate is above 1: the flag asks for a
    guard, and at 1 a run skipping every step ended "finished", exit 0)."""
    value = _rate(text)
    if value == 1.0:
        raise argparse.ArgumentTypeError(f"must be a rate in [0, 1), got {text}: no skip rate is above 1, so the "
                                         "fail-fast would never trip (a run skipping every step trips any rate below 1)")
    return value


def _fault(text: str) -> str:
    from .fault_specs import parse_fault

    if text != "none":
        try:
            parse_fault(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return text


def _folder_of(log_dir: Any, name: Any) -> Path | None:
    """The run folder ``log.dir/log.name`` names, resolved (None when they name none: not text, or
    text that holds a control character, which no folder's path holds; a NUL made ``resolve``
    raise "embedded null byte").

    Example::

        >>> _folder_of("runs", "a") == Path("runs/a").resolve(), _folder_of("runs", None), _folder_of("runs", "a\\0b")
        (True, None, None)
    """
    if not (isinstance(log_dir, str) and isinstance(name, str) and name) or _unusable(log_dir) or _unusable(name):
        return None
    return Path(os.path.expanduser(log_dir), name).resolve()


def _unusable(value: Any) -> bool:
    """Whether ``value`` is text that the config refuses as a path (``log.dir``, ``log.name``): it
    holds a control character (:func:`~ampguard.errors.has_control`).

    Example::

        >>> _unusable("runs"), _unusable("ru\\0ns"), _unusable(None)
        (False, True, False)
    """
    return isinstance(value, str) and has_control(value)


def _without_none(given: list[str]) -> list[str]:
    """The ``--inject`` faults, ``none`` (inject nothing) taken out; ``none`` beside a fault says
    two things at once: refused.

    Example::

        >>> _without_none(["none"]), _without_none(["nan_loss@2", "spike@3"])
        ([], ['nan_loss@2', 'spike@3'])
    """
    faults = [f for f in given if f != "none"]
    if faults and len(faults) < len(given):
        raise InputError(f"--inject none injects nothing, but --inject {shortened(faults[0], 60)} asks for a fault: "
                         "give one or the other")  # (a spec of thousands of characters: cut short)
    return faults


# ---------------------------------------------------------------------------- verbs
# Each verb parses, then calls one function of its module; main() maps exceptions to exit codes.


def _demo(args: argparse.Namespace) -> int:
    from . import demo

    if args.bf16 and args.precision not in (None, "bf16"):
        raise InputError(f"demo: --bf16 contradicts --precision {args.precision}")
    if args.spike and args.steps < 5:  # (the fault's own line said "drop it: --inject none", which keeps it)
        raise InputError(f"demo: --spike is a loss spike at step 5, past the demo's {counted(args.steps, 'step')}: drop --spike, "
                         "or give --steps 5 or more")
    _spike_as_inject(args, "demo")
    inject = None if not args.inject else _without_none(args.inject)  # None: the demo's default fault
    config = demo.demo_config(precision="bf16" if args.bf16 else args.precision or "fp16", steps=args.steps,
                              inject=inject, max_norm=args.max_norm, seed=args.seed, device=args.device,
                              strict=args.strict, monitor=_monitor_flags(args))
    _check_fail_after(args, config)
    return demo.run(config, csv=args.csv)


def _train(args: argparse.Namespace) -> int:
    from .config import dump_config

    if args.resume and args.config:
        raise InputError("train: --resume takes the run's config from its config.yaml; change it with --set, not CONFIG")
    _spike_as_inject(args)
    resume = _found_resume(args.resume) if args.resume else None  # the run folder's config, never the checkpoint's
    sections = {"monitor": _monitor_flags(args), "diagnose": {"strict": True} if args.strict else {}}
    base = None if resume is None else _resumed_base(resume)
    config = _config_from(args, base=base, sections=sections, verb="train",
                          saved=None if resume is None else resume.run_dir / "config.yaml")
    if args.spike and config.steps < 5:  # (the fault's own line said "given with --inject", which was not given)
        raise InputError(f"train: --spike is a loss spike at step 5, past the run's {counted(config.steps, 'step')}: "
                         "drop --spike, or raise steps to 5 or more")
    if resume is not None:
        _check_resumed(config, resume, base)
    _check_fail_after(args, config)
    _refused_before_the_run(config, resume, printed=args.print_config)  # (none to print: review 50j)
    if args.print_config:
        print(dump_config(config), end="")
        return ExitCode.OK
    return _trained(config, resume)


def _trained(config: Any, resume: Any) -> int:
    """``train``'s run (:func:`~ampguard.train.train`), torch imported first
    (:func:`_import_torch`): once what needs neither is refused (review 60b)."""
    _import_torch()
    from . import train

    return train.train(config, resume)


def _found_resume(given: str) -> Any:
    """``--resume``'s checkpoint (:func:`~ampguard.checkpointer.find_resume`), read with torch."""
    _import_torch()
    from .checkpointer import find_resume

    return find_resume(given)


def _import_torch() -> None:
    """Import torch with stop signals held (:func:`_import_held`). Every verb's first step
    (:func:`main`) but ``train``'s, which refuses what it can first (:func:`_needs_torch`)."""
    _import_held("torch")


def _import_held(*modules: str) -> None:
    """Import ``modules`` with stop signals held (``held_signals``): a Ctrl-C inside an import
    could be swallowed or break numpy (torch's), or come out of pydantic's schema building, as
    the config module is imported, wrapped in a ``SchemaError`` (exit 1 and a traceback; review
    60f); after the block a signal stops the verb."""
    from .signals import held_signals

    with held_signals():
        for module in modules:
            importlib.import_module(module)


def _spike_as_inject(args: argparse.Namespace, verb: str = "train") -> None:
    """``--spike`` is ``--inject spike@5`` (DESIGN §4), added once, for ``demo`` and ``train``
    alike (the demo kept its own copy: ``--inject none --spike`` injected the spike, and
    ``--spike --inject spike@5`` was refused as listed twice)."""
    if not args.spike:
        return
    if "none" in (args.inject or []):
        raise InputError(f"{verb}: --spike injects spike@5, --inject none nothing: give one of them")
    args.inject = [*(args.inject or []), *([] if "spike@5" in (args.inject or []) else ["spike@5"])]


def _refused_before_the_run(config: Any, resume: Any, *, printed: bool) -> None:
    """What ``train`` refuses from the config and the checkpoint alone, before it builds anything
    (the task, the model) or imports torch (seconds of CPU): the resume's checks, the faults, a
    run folder that exists or cannot be made (:meth:`~ampguard.run_folder.RunPaths.check_new`). So
    ``--print-config`` does not print, exit 0, a config the same command line would refuse, exit 2,
    from those alone. ``train`` (not ``printed``) in one process refuses them first, before torch
    is imported (review 60b); under torchrun its trainer does, every rank alike (rank 0's run
    folder). What only the built task or model can refuse (a fault the task's data cannot take,
    an ``fp32_modules`` name the model lacks, a ``rollback.val_metric`` the task does not report,
    a resume whose logs differ) is refused when ``train`` starts: ``--print-config`` builds
    nothing (review 58a: building the start-up calls a factory, loads its model and runs a
    forward, the time and memory of a run's start, for a command that prints a config)."""
    from .config import check_fast
    from .fault_specs import parse_faults
    from .launch import launched_by_torchrun, launched_rank, launched_world_size
    from .run_folder import RunPaths

    if not printed and launched_by_torchrun():
        return
    world = launched_world_size()
    check_fast(config, world)
    if resume is not None:
        from . import checkpointer as ck

        ck.check_resume(resume, config, world, launched_rank())
        ck.check_left_to_train(resume, config)
    else:
        RunPaths.check_new(config)
    parse_faults(config.inject, seed=config.seed, steps=config.steps, world_size=world)


def _resumed_base(resume: Any) -> dict[str, Any]:
    """A resumed run's saved config, training in its own folder wherever that is now (a moved one
    too): ``log.dir``/``log.name`` as saved unless they name another place now. A name or folder
    the config refuses (a NUL in a hand-edited ``config.yaml``) is left for the config to refuse,
    naming the file."""
    base, here = resume.run_config(), resume.run_dir.resolve()
    log = base.get("log") if isinstance(base.get("log"), dict) else {}
    if not (_unusable(log.get("dir")) or _unusable(log.get("name"))) and \
            _folder_of(log.get("dir"), log.get("name")) != here:
        base["log"] = {**log, "dir": str(here.parent), "name": here.name}
    return base


def _check_resumed(config: Any, resume: Any, saved: dict[str, Any]) -> None:
    """What a resume's config may not say: another run folder than its own (a new folder is a new
    run), or a fault (one not in the run's saved ``inject``) for steps the run already trained,
    which never fires (a clean run for the wrong reason; the run's own faults fired before the
    checkpoint, as they were meant to)."""
    from .fault_specs import parse_faults
    from .launch import launched_world_size

    if _folder_of(config.log.dir, config.log.name) != resume.run_dir.resolve():
        raise InputError(f"train --resume trains in its own run folder {resume.run_dir}: log.dir and log.name "
                         "cannot name another (a new folder is a new run: leave out --resume)")
    old = saved.get("inject") if isinstance(saved.get("inject"), list) else []
    # (against the processes torchrun started: a fault @rank1 was refused as aimed past a world of one)
    parse_faults([spec for spec in config.inject if spec not in old], seed=config.seed, steps=config.steps,
                 start=resume.loaded.step + 1, world_size=launched_world_size())


def _validate(args: argparse.Namespace) -> int:
    from . import validate

    return validate.run(_config_from(args, verb="validate"), checkpoint=args.checkpoint, out=args.out,
                        train_steps=args.train_steps)


def _locate(args: argparse.Namespace) -> int:
    from . import locate

    if args.batch and (args.step is not None or args.inject):  # (they were ignored: a clean replay read as a finding's absence)
        raise InputError(f"locate: --batch replays the saved batch as it is; {'--step' if args.step else '--inject'} "
                         "does not apply to it (leave out --batch to replay a step of the data)")
    return locate.run(_config_from(args), step=args.step or 1, batch=args.batch, checkpoint=args.checkpoint,
                      scale=args.scale, as_json=args.json)


def _report(args: argparse.Namespace) -> int:
    from . import report

    return report.run(args.path, out=args.out, max_norm=args.max_norm, window=args.window,
                      alert_rate=args.alert_rate, fail_rate=args.fail_rate, min_steps=args.min_steps,
                      plot=not args.no_plot)


def _compare(args: argparse.Namespace) -> int:
    from . import compare

    return compare.run(args.runs, out=args.out)


def _bench(args: argparse.Namespace) -> int:
    from . import bench

    # (--rounds past the most a --resolve may take: bench._check_args, after --quick's own rounds; review 52b)
    settings = dict(device=args.device, models=args.models, precisions=args.precisions, steps=args.steps,
                    rounds=args.rounds, warmup=args.warmup, fused=args.fused, peers=not args.no_peers,
                    peak_tflops=args.peak_tflops, quick=args.quick, as_json=args.json, resolve_pct=args.resolve,
                    budget_s=args.budget, threads=args.threads, aa=not args.no_aa, batch=args.batch)
    if args.processes > 1:  # the same bench in fresh processes, each ratio across them
        from . import bench_processes

        return bench_processes.run(processes=args.processes, **settings)
    return bench.run(**settings)


def _monitor_flags(args: argparse.Namespace) -> dict[str, Any]:
    """--fail-skip-rate and --fail-after, as the monitor section's keys."""
    flags = {"fail_rate": args.fail_skip_rate, "fail_after": args.fail_after}
    return {key: value for key, value in flags.items() if value is not None}


def _check_fail_after(args: argparse.Namespace, config: Any) -> None:
    """--fail-after counts steps above a fail rate (or skipped at a collapsed scale): without
    either it would do nothing, so it is refused rather than silently ignored."""
    monitor = config.monitor
    if args.fail_after is not None and monitor.fail_rate is None and not monitor.fail_on_scale_collapse:
        raise InputError("--fail-after needs a fail rate: add --fail-skip-rate RATE (or set monitor.fail_rate, "
                         "or monitor.fail_on_scale_collapse=true)")


def _config_from(
    args: argparse.Namespace, base: dict[str, Any] | None = None, sections: dict[str, dict[str, Any]] | None = None,
    *, verb: str | None = None, saved: Path | None = None,
) -> Any:
    """The effective, validated config of CONFIG, --set, --inject and the flags that fill sections.

    ``saved``: the file ``base`` was read from (a resume's ``config.yaml``): a refusal that is the
    file's own (it does not validate by itself) names the file, as ``report`` and ``compare`` do.
    ``verb`` (``train``, ``validate``): the settings given that such a run does not read are said,
    a warning each (:func:`~ampguard.config.ignored_settings`; on a resume, those ``--set`` gives).
    """
    from .config import ignored_settings, load_config, validate

    given = getattr(args, "inject", None) or []
    inject = _without_none(given)
    try:
        config = load_config(args.config, args.set, base=base, inject=inject, no_inject="none" in given,
                             sections=sections)
    except ConfigError:
        if saved is not None:  # (the file alone first: `config: bogus: unknown key` did not say which file)
            try:
                validate(base or {})
            except ConfigError as err:
                raise ConfigError(f"config file {saved}: {err}") from None
        raise
    only = None if saved is None else [item.partition("=")[0].strip() for item in args.set or []]
    for line in ignored_settings(config, verb, only) if verb else ():
        warn(line, AmpguardWarning, stacklevel=2)
    return config


# ---------------------------------------------------------------------------- main


class _Version(argparse.Action):
    """``ampguard --version``: ampguard's version, the torch it runs on and Python's, then exit 0.
    torch's version is its installed package's (its metadata), so torch is not imported for it.

    Example::

        >>> import contextlib, io, platform
        >>> from ampguard import __version__
        >>> out = io.StringIO()
        >>> with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        ...     build_parser().parse_args(["--version"])
        >>> out.getvalue().startswith(f"ampguard {__version__} (torch "), out.getvalue().endswith(
        ...     f", Python {platform.python_version()})\\n")
        (True, True)
    """

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> NoReturn:
        import platform
        from importlib import metadata

        from . import __version__

        try:
            torch_version = metadata.version("torch")
        except metadata.PackageNotFoundError:
            torch_version = "not installed"
        print(f"ampguard {__version__} (torch {torch_version}, Python {platform.python_version()})")
        parser.exit(0)


def _config_arguments(parser: argparse.ArgumentParser, example: str) -> None:
    """CONFIG and --set, the same for every verb that reads a config."""
    parser.add_argument("config", nargs="?", type=_path, metavar="CONFIG", help="a .yaml, .yml, .json or .toml config file")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", help=f"override a config key, e.g. {example}")


def build_parser() -> argparse.ArgumentParser:
    """The ``ampguard`` parser: one subparser per verb, each with ``func`` set to its ``_verb``.
    A usage error raises :class:`InputError` (one line) instead of printing a usage block.

    Example::

        >>> args = build_parser().parse_args(["demo", "--bf16", "--steps", "3"])
        >>> args.verb, args.bf16, args.steps, args.precision, args.func.__name__
        ('demo', True, 3, None, '_demo')
        >>> build_parser().parse_args(["report", "runs/a", "--alert-rate", "2"])
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: report: argument --alert-rate: must be a rate in [0, 1], got 2
    """
    parser = _Parser(prog="ampguard", description="Mixed-precision training made safe and observable.")
    parser.add_argument("--version", action=_Version, help="print ampguard's, torch's and Python's versions and exit")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)
    verbs.required = True

    fault_help = (
        "inject a fault, KIND@WHEN (repeatable): KIND is inf_grad, nan_grad, nan_loss, spike (floating-point "
        "targets x 1e8; the loss x 1e8 for any other targets) or nan_input; WHEN is 5, 5,9,12, every:10 or rate:0.05; 'none' injects nothing (not even the config's)"
    )

    demo = verbs.add_parser(
        "demo",
        help="the teaching demo: nn.Linear, fp16, an Inf gradient at step 5",
        description="nn.Linear trained for 20 steps in fp16 with a GradScaler; an Inf is injected into the "
        "gradients at step 5, which is skipped, and the scale halves there. In bf16 (--bf16) the fault is a real loss "
        "spike at step 5 instead, which bf16's range takes: no step is skipped.",
    )
    demo.add_argument("--precision", choices=["fp16", "bf16", "fp32"], default=None, help="default fp16")
    demo.add_argument("--bf16", action="store_true",
                      help="same as --precision bf16 (its default fault: the real loss spike, no skip)")
    demo.add_argument("--steps", type=_positive_int, default=20, help="optimizer steps to train (default 20)")
    demo.add_argument("--inject", action="append", type=_fault, metavar="KIND@WHEN", help=fault_help)
    demo.add_argument("--spike", action="store_true", help="a real loss spike at step 5 (spike@5) instead of the Inf")
    demo.add_argument("--csv", type=_path, metavar="PATH", help="also write the per-step CSV here (must not exist)")
    demo.add_argument("--max-norm", type=_clip, default=1.0, help="global L2 clip threshold (0 or below: off)")
    demo.add_argument("--seed", type=_whole, default=0, help="seeds the data and the weights (default 0)")
    demo.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                      help="where it trains (default auto: CUDA when there is one)")
    demo.set_defaults(func=_demo)

    train = verbs.add_parser(
        "train",
        help="guarded training from a config (YAML, JSON, TOML) or the embedded default",
        description="Guarded training. Without CONFIG it trains the embedded default: a small character-level "
        "transformer on Python's standard-library sources. Writes the run folder runs/<name>/: config.yaml, "
        "steps.csv (a row per step), events.jsonl, checkpoints/, RUN.md (the run card) and report.png.",
    )
    _config_arguments(train, example="optimizer.lr=1e-3")
    train.add_argument("--inject", action="append", type=_fault, metavar="KIND@WHEN", help=fault_help)
    train.add_argument("--spike", action="store_true", help="a real loss spike at step 5: --inject spike@5")
    train.add_argument("--print-config", action="store_true", help="print the effective config and exit")
    train.add_argument("--resume", type=_path, metavar="RUN_DIR|CHECKPOINT",
                       help="continue a run from its latest loadable checkpoint (or the one named), in its run folder")
    for verb in (demo, train):
        verb.add_argument("--strict", action="store_true",
                          help="debugging: stop (exit 3) at the first non-finite loss or gradient, saying which and where")
        verb.add_argument("--fail-skip-rate", type=_fail_rate, metavar="RATE",
                          help="stop with exit code 3 when the rolling skip rate stays above RATE (monitor.fail_rate)")
        verb.add_argument("--fail-after", type=_positive_int, metavar="N",
                          help="...for N consecutive steps (monitor.fail_after, default 100; under fp16 the "
                               "scaler's opening search, its halvings from init_scale, is set aside: a run that "
                               "skips every step fails at step N, or when its scale reaches the floor if later)")
    train.set_defaults(func=_train)

    validate = verbs.add_parser(
        "validate",
        help="AMP vs an FP32 reference on a fixed probe set, with rules declared before the run",
        description="Runs the FP32 reference (checked first), then each AMP precision in validation.precisions, on "
        "a fixed probe set (typical, nearest-a-boundary and edge-case inputs) and a fixed evaluation set. Rules come "
        "from the config's validation section. Writes validation.md and validation.json; exit 0 when every rule "
        "holds, 1 when any is violated or the reference's quality was not checked (declare validation.min_accuracy "
        "or max_mse).",
    )
    _config_arguments(validate, example="validation.max_flips=2")
    validate.add_argument("--checkpoint", type=_path, metavar="CKPT", help="model weights from an ampguard checkpoint")
    validate.add_argument("--train-steps", dest="train_steps", type=_positive_int, metavar="N",
                          help="also train N steps from the same state in FP32 and AMP and compare")
    validate.add_argument("--out", type=_path, metavar="DIR",
                          help="where to write the report, a new or empty folder (default: <log.dir>/validate-<time>, log.dir runs/ unless set)")
    validate.set_defaults(func=_validate)

    bench = verbs.add_parser(
        "bench",
        help="the guarded step vs the bare canonical loop (and Accelerate / Fabric when installed), interleaved",
        description="Times the same model, data, optimizer and seed under the bare canonical AMP loop, ampguard's "
        "step with per-step CSV logging, and Accelerate / Lightning Fabric when installed, interleaved in rounds. "
        "Prints median and min ms/step, the ratio to the bare loop, peak memory (CUDA), tokens/s and MFU.",
    )
    bench.add_argument("--device", choices=["auto", "cpu", "cuda"], default="cpu",
                       help="where to time (default cpu, also on a GPU machine; auto: cuda when one is available)")
    bench.add_argument("--models", default="mlp,transformer",
                       help="comma-separated: mlp, nano, transformer, gpt2 (default mlp,transformer)")
    bench.add_argument("--precisions", default="fp32,bf16,fp16",
                       help="comma-separated: fp32, bf16, fp16, fp8 (default fp32,bf16,fp16)")
    bench.add_argument("--steps", type=_positive_int, default=30, help="steps per contender per round (default 30)")
    bench.add_argument("--rounds", type=_positive_int, default=7,
                       help="the least number of paired rounds a case runs (default 7); more are added until every "
                       "ratio is resolved as --resolve says or --budget runs out (--resolve 0: this many); rounded up "
                       "to whole cycles of the round orders (with --resolve, down where that would pass 1000)")
    bench.add_argument("--batch", type=_positive_int, metavar="N",
                       help="every model's batch size (default each its own: mlp 64, nano 4, transformer 16, gpt2 8); a "
                       "bigger one makes a GPU step compute-bound, so host jitter stops showing in its time")
    bench.add_argument("--warmup", type=_positive_int, default=5,
                       help="untimed steps of each contender before its rounds (default 5)")
    bench.add_argument("--fused", action="store_true", help="fused AdamW for every contender")
    bench.add_argument("--no-peers", action="store_true", help="leave Accelerate and Fabric out")
    bench.add_argument("--peak-tflops", type=_number, help="the accelerator's peak, for model FLOP utilisation")
    bench.add_argument("--quick", action="store_true", help="a smoke test, not a measurement: 2 rounds of 3 steps, 1 "
                       "warm-up step, no A/A and no --resolve (it overrides --rounds, --steps, --warmup, --resolve)")
    bench.add_argument("--json", action="store_true", help="print the results as JSON")
    bench.add_argument("--resolve", type=_number, default=1.0, metavar="PCT",
                       help="add rounds until every ratio's 99%% interval (which holds the 95%% one reported) is "
                       "within ±PCT%%, judged at the end of each whole cycle of the round orders from 8 rounds on "
                       "(0: just --rounds, in whole cycles)")
    bench.add_argument("--budget", type=_number, default=120.0, metavar="SECONDS",
                       help="stop adding rounds to a case after this long (the table says it was not resolved)")
    bench.add_argument("--threads", type=_threads, help="CPU intra-op threads, pinned (default: the CPUs this process "
                       "may run on; --device cpu only)")
    bench.add_argument("--no-aa", action="store_true", help="leave out the A/A contender (a second bare loop)")
    bench.add_argument("--processes", type=_positive_int, default=1, metavar="N",
                       help="run the bench N times in fresh processes, one after another (--budget / N a case each), "
                       "and give each ratio across them: what one process's interval cannot show (6 or more for a 95%% "
                       "interval)")
    bench.set_defaults(func=_bench)

    locate = verbs.add_parser(
        "locate",
        help="find the first module/op where a non-finite value appears, and whether FP32 replay is clean",
        description="Replays one batch (step N of a config's data, with its faults, or a saved batch) with hooks on "
        "every module and parameter, names the first non-finite value (input, a module's forward output, the "
        "loss, or a parameter's gradient), then replays it in FP32: finite there means a precision-range problem, "
        "and then keeps the offending module alone in FP32 (then its parent, up to the model) to name the smallest "
        "module whose FP32 run fixes the batch. Exit status: 0 all finite, 1 a non-finite value found, 2 bad input.",
    )
    _config_arguments(locate, example="precision=fp16")
    locate.add_argument("--inject", action="append", type=_fault, metavar="KIND@WHEN", help=fault_help)
    locate.add_argument("--step", type=_positive_int, default=None,
                        help="which step's micro-batches to replay (default 1; at most the config's steps)")
    locate.add_argument("--batch", type=_path, metavar="FILE.pt", help="a saved batch {'inputs': ..., 'targets': ...} instead")
    locate.add_argument("--checkpoint", type=_path, metavar="CKPT", help="load the model's weights (and loss scale) from a checkpoint")
    locate.add_argument("--scale", type=_number,
                        help="loss scale for the backward pass, a finite number > 0 (default: the scaler's; fp16 only)")
    locate.add_argument("--json", action="store_true", help="print the finding as JSON")
    locate.set_defaults(func=_locate)

    report = verbs.add_parser(
        "report",
        help="plot a run's per-step CSV and summarise it",
        description="Draws report.png (loss, gradient norms, loss scale, lr, rolling skip rate; skipped steps "
        "marked) from a run folder or a per-step CSV, and prints a summary.",
    )
    report.add_argument("path", type=_path, metavar="RUN_DIR|CSV")
    report.add_argument("--out", type=_path, metavar="PNG",
                        help="where to write the plot, a .png in an existing folder (default: RUN_DIR/report.png or "
                        "CSV's .png); only a plot ampguard drew there is drawn again, never another file, another PNG, "
                        "or another run's report.png")
    report.add_argument("--max-norm", dest="max_norm", type=_clip,
                        help="clip threshold line on the plot (default: the run's config); the summary's clip rate "
                        "stays the run's")
    report.add_argument("--window", type=_window, help="rolling skip-rate window (default: the run's config); given, "
                        "the alerts are judged again and the summary says so")
    report.add_argument("--alert-rate", dest="alert_rate", type=_rate,
                        help="alert threshold line; given, the alert episodes are judged again at it and the summary "
                        "says so")
    report.add_argument("--min-steps", dest="min_steps", type=_count, metavar="N",
                        help="steps seen before an alert may start (default: the run's config); given, the alerts are "
                        "judged again and the summary says so")
    report.add_argument("--fail-rate", dest="fail_rate", type=_rate,
                        help="fail threshold line on the plot (the summary does not change)")
    report.add_argument("--no-plot", dest="no_plot", action="store_true",
                        help="print the summary only: no plot drawn, no file written")
    report.set_defaults(func=_report)

    compare = verbs.add_parser(
        "compare", intermixed=True,
        help="several runs side by side: one table from their run folders, one overlay plot",
        description="Reads each RUN_DIR's config.yaml, steps.csv and run card and prints one table, a column per "
        "run: precision, max_norm, steps / updates / skips by reason, max rolling skip rate, clip rate, scale "
        "health, final and best loss and held-out metrics. --out draws loss, pre-clip norm, log2 of the loss "
        "scale and the rolling skip rate of every run over each other.",
    )
    compare.add_argument("runs", nargs="+", type=_path, metavar="RUN_DIR", help="two or more run folders (runs/<name>)")
    compare.add_argument("--out", type=_path, metavar="PNG",
                         help="draw the overlay plot here: a .png in an existing folder (a plot ampguard drew there is "
                         "drawn again; any other file, a PNG included, or a run folder's report.png is refused)")
    compare.set_defaults(func=_compare)
    return parser


@contextlib.contextmanager
def _file_size_limit_a_write_error() -> Iterator[None]:
    """SIGXFSZ ignored while :func:`main` runs (``ulimit -f`` reached: a write error, disk full,
    not a kill), the caller's handler back after it: a notebook or a test that calls ``main`` in
    its process keeps its own (review 55r: left ignored for the process's life)."""
    if not hasattr(signal, "SIGXFSZ") or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGXFSZ, previous if previous is not None else signal.SIG_DFL)


def _handled_keyboard_interrupt() -> None:
    """Tell CPython the KeyboardInterrupt was handled. When one is raised inside code that C
    extensions (torch) run through ``PyRun_*``, CPython notes it as unhandled and, at exit, kills
    the process with SIGINT (status -2) whatever ``main`` returned; running an empty string
    through the same door clears that note, so the exit status is ours (130)."""
    if sys.implementation.name == "cpython":
        import ctypes

        ctypes.pythonapi.PyRun_SimpleString(b"")


class _HeldWarnings:
    """``ampguard: warning: ...`` lines held back until the verb writes its first line to stdout
    (or returns): a refusal found after the warning was raised (a resume's checkpoint checked
    once the fp16 model is built) is then the only line on stderr, as bad input must be."""

    def __init__(self) -> None:
        self.lines: list[str] | None = []

    def say(self, line: str) -> None:
        if self.lines is None:
            print(line, file=sys.stderr)
        else:
            self.lines.append(line)

    def release(self) -> None:
        lines, self.lines = self.lines or [], None
        for line in lines:
            print(line, file=sys.stderr)


def _slow_precision_in_one_line(*, quiet: bool, console: Any = None) -> _HeldWarnings:
    """Show a :class:`~ampguard.precision.SlowPrecisionWarning` as ``ampguard: warning: ...`` (or not
    at all), held back (:class:`_HeldWarnings`) until ``console`` (stdout) is first written to.

    fp16 or fp8 on a CPU is emulated: worth one line on stderr, not Python's two-line warning
    with a source line (``quiet``: none, the other ampguard warnings still one line each). Other
    warnings are shown as Python shows them. Under torchrun which rank says one was decided as it
    was raised (:func:`~ampguard.errors.warn`: rank 0 one about the run as a whole, each rank its
    own state's, labelled); errors are every rank's own. A warning shown while a progress
    bar is live is written clear of it (:func:`~ampguard.signals.clear_of_bars`). Those held back
    are written as stdout's first line is, inside the bar's own clearing (``tqdm.write``): plainly.

    Example::

        >>> import contextlib, io
        >>> from ampguard.precision import SlowPrecisionWarning
        >>> from ampguard.signals import TolerantStream
        >>> out, err = TolerantStream(io.StringIO(), "stdout"), io.StringIO()
        >>> with warnings.catch_warnings(), contextlib.redirect_stderr(err):
        ...     warnings.simplefilter("always")  # (shown even if this warning was shown before)
        ...     held = _slow_precision_in_one_line(quiet=False, console=out)
        ...     warnings.warn("fp16 on a CPU is slow", SlowPrecisionWarning)
        ...     before = err.getvalue()
        ...     _ = out.write("run folder: runs/a\\n")
        >>> before, err.getvalue()
        ('', 'ampguard: warning: fp16 on a CPU is slow\\n')
    """
    from .signals import clear_of_bars

    held = _HeldWarnings()
    if quiet:  # (the demo's other warnings still one line each; precision imports torch)
        from .precision import SlowPrecisionWarning

        warnings.filterwarnings("ignore", category=SlowPrecisionWarning)
    if console is not None:
        console.before_write = held.release
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        # (a warning mid-run stuck to a live progress bar on a terminal: review 56b)
        with clear_of_bars(file if file is not None else sys.stderr):
            if issubclass(category, AmpguardWarning):  # (SlowPrecisionWarning among them)
                held.say(f"ampguard: warning: {message}")
            else:
                shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    return held


def _another_rank() -> tuple[int, int] | None:
    """``(RANK, WORLD_SIZE)`` where torchrun started this process as a rank other than 0 of a
    world of several (the variables it sets beside them there too: a ``RANK`` and ``WORLD_SIZE``
    left in the environment alone, or values that do not read as such: None, the verb runs as
    anywhere; review 51k: a leftover pair made validate exit 0 unrun).

    Example::

        >>> import unittest.mock
        >>> torchrun = {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
        >>> with unittest.mock.patch.dict(os.environ, torchrun):
        ...     _another_rank()
        (1, 2)
        >>> with unittest.mock.patch.dict(os.environ, {"WORLD_SIZE": "2", "RANK": "1"}):
        ...     for name in ("MASTER_ADDR", "MASTER_PORT"):
        ...         _ = os.environ.pop(name, None)
        ...     _another_rank() is None
        True
    """
    rank, world = process_rank()  # (the process group is never joined in a verb's process: torchrun's variables)
    return (rank, world) if rank != 0 else None


def entry() -> int:
    """The ``ampguard`` command (the console script; ``python -m ampguard``): :func:`main` on this
    process's own command line. The process ends next, so once the exit code is decided a SIGTERM
    is ignored (``settle``): under torchrun a rank stopped with the others must not be reported
    as killed by the SIGTERM torchrun sends the ranks still running, and a Ctrl-C ends it with
    that code (``signals.settled``), not killed by SIGINT."""
    from .signals import settled

    try:
        code = main(settle=True)
    except KeyboardInterrupt:  # (a Ctrl-C as main returned, past its own handling: an interrupt all the same)
        print("ampguard: interrupted", file=sys.stderr)
        _handled_keyboard_interrupt()
        code = ExitCode.INTERRUPTED
    settled(int(code))
    return code


def _needs_torch(args: argparse.Namespace) -> bool:
    """Whether :func:`main` imports torch before the verb runs (:func:`_import_torch`): every verb
    needs it but ``train``, which imports it itself once it has refused what the config, the
    command line and the run folder refuse (torch's import is seconds of CPU), and
    ``train --print-config`` of a config (no ``--resume``) never does.

    Example::

        >>> [_needs_torch(build_parser().parse_args(argv)) for argv in (["train", "--print-config"], ["train"],
        ...  ["report", "runs/a"])]
        [False, False, True]
    """
    return args.func is not _train


def _result_on_stdout(args: argparse.Namespace) -> bool:
    """Whether what the verb writes on stdout is its result (a report, a table, a finding, a
    config), so that losing it (``> /dev/full``) fails the command, exit 74, instead of the
    console's "the run goes on" (review 50j: report and --print-config exited 0 with nothing
    written). A run's lines (train, demo) are its console: the run folder is the record."""
    return args.func in (_report, _compare, _locate, _bench) or (args.func is _train and args.print_config)


def main(argv: Sequence[str] | None = None, *, settle: bool = False) -> int:
    """Run ``ampguard ARGV`` and return its exit code (:class:`ExitCode`): bad input is one line
    ``ampguard: error: ...`` on stderr and 2, Ctrl-C is 130, SIGTERM 143; anything else is a bug
    and raises. ``settle``: this process ends when it returns (:func:`entry`).

    Example::

        >>> import contextlib, io
        >>> err = io.StringIO()
        >>> with contextlib.redirect_stderr(err):
        ...     code = main(["demo", "--steps", "0"])
        >>> code, err.getvalue()
        (<ExitCode.BAD_INPUT: 2>, 'ampguard: error: demo: argument --steps: must be in [1, 1e+09], got 0\\n')
        >>> main(["demo", "--steps", "2", "--bf16", "--device", "cpu", "--inject", "nan_loss@2"])  # doctest: +ELLIPSIS
        ampguard demo: nn.Linear, 2 steps, bf16 with no loss scaler, max_norm=1.0, inject: nan_loss@2
        STEP 1 loss=... pre=... post=1 scale=1 lr=0.02
        SKIP 2 loss=nan pre=- post=- scale=1 lr=0.04 reason=non_finite_loss
        ALERT 2 skip rate 0.500 > alert_rate 0.05 over the run's 2 steps, which ended before the rolling ALERT armed (monitor.min_steps 100)
        summary: steps=2 updates=1 skips=1 (non_finite_loss=1) final_scale=1 final_loss=... (step 1)
        ended: finished: 2 steps
        0
    """
    from .signals import Interrupted, lost_stdout, terminated_as_interrupted, tolerant_console

    held = _HeldWarnings()
    # a reader that left, a full /dev/full, an ASCII terminal: never a traceback
    with _file_size_limit_a_write_error(), tolerant_console() as console:
        try:
            args, extra = build_parser().parse_known_args(argv)
            if extra:  # (argparse's own line did not name the verb, as every other usage error does)
                raise InputError(f"{args.verb}: unrecognized arguments: {' '.join(extra)}")
            # torch for every verb but train (it refuses what it can first), the config's schemas for all
            _import_held(*(("torch",) if _needs_torch(args) else ()), "ampguard.config")
            with warnings.catch_warnings():  # restores the caller's filters (main() runs in-process in tests)
                # (the CPU demo is fp16 on purpose: quiet)
                held = _slow_precision_in_one_line(quiet=args.func is _demo, console=console)
                console.result = _result_on_stdout(args)
                other = _another_rank() if args.func not in (_demo, _train) else None
                if other is not None:  # (each rank ran it whole: two reports, or one rank refused the
                    # other's --out folder and the job failed for an ACCEPTED validation; review 51g)
                    print(f"ampguard: {args.verb} runs in one process: this is rank {other[0]} of {other[1]} "
                          "(torchrun's RANK, WORLD_SIZE), rank 0 runs it", file=sys.stderr)
                    return 0
                with terminated_as_interrupted(settle=settle):
                    code = int(args.func(args))
            held.release()
            if console.result and args.func is not _bench and (lost := lost_stdout()) is not None:
                # (its output is the command's result: lost, the command failed; bench says so itself)
                print(f"ampguard: error: {args.verb}: its output could not be written to stdout "
                      f"({failed_because(lost)})", file=sys.stderr)
                return ExitCode.DISK_FULL
            return code
        except InputError as err:  # (a warning held back stays so: the refusal is the one line)
            print(f"ampguard: error: {one_line(str(err))}", file=sys.stderr)
            return ExitCode.BAD_INPUT
        except Interrupted as err:
            held.release()  # (a Ctrl-C because fp16 on a CPU is slow: the line says why it was)
            print("ampguard: interrupted", file=sys.stderr)
            return err.exit_code
        except (KeyboardInterrupt, RuntimeError) as err:
            if not an_interrupt(err):
                raise
            held.release()
            print("ampguard: interrupted", file=sys.stderr)
            _handled_keyboard_interrupt()
            # (a start-up SIGTERM that Python wrapped on its way out: its own code)
            return stop.exit_code if isinstance(stop := interrupt_in(err), Interrupted) else ExitCode.INTERRUPTED
        except BrokenPipeError:  # a write past the console's guard: the reader left, as SIGPIPE says
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return ExitCode.BROKEN_PIPE
        except OSError as err:  # (after BrokenPipeError, an OSError too)
            if err.errno != errno.ENAMETOOLONG:
                raise
            # a path the user gave has a part over the file system's limit (255 bytes): bad input
            print(f"ampguard: error: file name too long: {shown(err.filename or '')}", file=sys.stderr)
            return ExitCode.BAD_INPUT


