"""``ampguard train``: guarded training from a config, into a run folder.

:func:`run` builds a :class:`~ampguard.trainer.Trainer` and runs it; :func:`train` is the verb
(a new run folder or the resumed run's, a progress bar, the closing lines); :func:`finish` prints
those lines, for ``ampguard demo`` too.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable

from . import checkpointer as ck
from . import distributed
from .config import Config
from .errors import ExitCode, InputError, counted
from .run_folder import RunPaths, RunResult
from .signals import leave_now, opening
from .trainer import Trainer


def run(config: Config, *, outputs: Callable[[], RunPaths] = RunPaths, console_every: int,
        stats_every: int | None = None, print_fn: Callable[[str], None] = print, progress: bool = False,
        resume: ck.Resume | None = None, announce: Callable[[RunPaths], str] | None = None,
        take_back: Callable[[], None] | None = None, check_outputs: Callable[[], None] | None = None) -> RunResult:
    """Train until ``config.steps`` guarded steps, writing records, events, checkpoints and (with
    a run folder) the run card and plot. The console gets a step line every ``console_every``
    steps (and every skip), a ``STATS`` line every ``stats_every`` steps, and every alert.

    ``outputs()`` is called once everything that can reject the input has been built; it
    creates whatever the run writes. So bad input leaves nothing behind. ``check_outputs()``, when
    given, refuses what ``outputs()`` would, making nothing: before anything is built. ``announce(paths)``,
    when given, is the line printed once the outputs are open (the run folder's). ``take_back()``,
    when given, undoes what ``outputs()`` made when a stop signal ends the process while the main
    thread waits in C in the start-up (:func:`~ampguard.signals.opening`).

    Example::

        >>> from ampguard.config import validate
        >>> config = validate({"task": {"name": "linear"}, "steps": 3, "precision": "bf16", "device": "cpu"})
        >>> result = run(config, console_every=1, print_fn=lambda line: None)
        >>> int(result.exit_code), result.monitor.steps, result.ended
        (0, 3, 'finished: 3 steps')
    """
    # (SIGTERM unwinds the build as Ctrl-C does; Trainer.run opens the outputs under its own)
    with opening(functools.partial(leave_now, take_back=take_back), distributed.PEERS):
        trainer = Trainer(config, outputs=outputs, console_every=console_every, stats_every=stats_every,
                          print_fn=print_fn, progress=progress, resume=resume, announce=announce, take_back=take_back,
                          check_outputs=check_outputs)
    return trainer.run()


def finish(result: RunResult) -> ExitCode:
    """The closing lines every run prints (rank 0): summary, why it ended, where its records are.
    Returns the run's exit code.

    Example::

        >>> import pathlib, shutil, tempfile
        >>> from ampguard.config import validate
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> config = validate({"task": {"name": "linear"}, "steps": 2, "precision": "bf16", "device": "cpu"})
        >>> result = run(config, outputs=lambda: RunPaths(csv=folder / "steps.csv"), console_every=1,
        ...              print_fn=lambda line: None)
        >>> finish(result)  # doctest: +ELLIPSIS
        summary: steps=2 updates=2 skips=0 (none) final_scale=1 final_loss=...
        ended: finished: 2 steps
        csv: .../steps.csv (2 rows)
        <ExitCode.OK: 0>
        >>> shutil.rmtree(folder)
    """
    if not distributed.current().is_main:
        return result.exit_code
    print(f"summary: {result.monitor.summary()}")
    print(f"ended: {result.ended}")
    csv_path, run_dir = result.paths.csv, result.paths.dir
    if run_dir is not None:
        written = [name for name in ("RUN.md", "steps.csv", "events.jsonl", "report.png", "checkpoints/",
                                     "headroom.csv", "steps.jsonl", "tensorboard/", "wandb/", "rollback/")
                   if (run_dir / name.rstrip("/")).exists()]
        print(f"run folder: {run_dir} ({', '.join(written)})")
    elif csv_path is not None:
        print(f"csv: {csv_path} ({counted(result.monitor.steps, 'row')})")
    if result.exit_code in (ExitCode.INTERRUPTED, ExitCode.TERMINATED, ExitCode.BROKEN_PIPE):
        import sys

        # (review 52m: no "ampguard:", "1 complete rows", and no word of the checkpoint --resume takes, which
        # after a second signal may be older than the step named, or none)
        rows = f"; {counted(result.monitor.steps, 'complete row')} in {csv_path}" if csv_path else ""
        saved = result.checkpoints[-1].name if result.checkpoints else None
        resume = (f"; --resume goes on from checkpoints/{saved}" if saved else "; no checkpoint to --resume from"
                  ) if run_dir is not None else ""
        print(f"ampguard: interrupted after step {result.monitor.steps}{rows}{resume}", file=sys.stderr)
    elif result.exit_code == ExitCode.BAD_INPUT:  # a batch found bad mid-run: the steps before it stand
        import sys

        saved = result.checkpoints[-1].name if result.checkpoints else None
        resume = f"checkpoints/{saved}: --resume continues from there once the data is fixed" if saved else \
            "no checkpoint"
        print(f"ampguard: error: {result.ended}; the run is intact up to step {result.monitor.steps} ({resume})",
              file=sys.stderr)
    return result.exit_code


def train(config: Config, resume: ck.Resume | None = None) -> ExitCode:
    """``ampguard train``: a new run folder (or the resumed run's), progress, closing lines.

    Example (a console line every ``log.every`` steps and at every skip; the summary at the end)::

        >>> import pathlib, shutil, tempfile
        >>> from ampguard.config import validate
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> config = validate({"task": {"name": "linear"}, "steps": 3, "precision": "bf16", "device": "cpu",
        ...                    "log": {"dir": str(folder / "runs"), "name": "a"}, "checkpoint": {"every": 2}})
        >>> code = train(config)  # doctest: +ELLIPSIS
        run folder: .../runs/a
        EVAL 3 val_loss=...
        summary: steps=3 updates=3 skips=0 (none) final_scale=1 final_loss=...
        ended: finished: 3 steps
        run folder: .../runs/a (RUN.md, steps.csv, events.jsonl, report.png, checkpoints/)
        >>> code, sorted(p.name for p in (folder / "runs" / "a" / "checkpoints").iterdir())
        (<ExitCode.OK: 0>, ['step-00000002.pt', 'step-00000003.pt'])
        >>> train(config)
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: run folder .../runs/a already exists; choose another log.name
        >>> shutil.rmtree(folder)
    """

    made: list[RunPaths] = []
    held: list[RunPaths] = []  # the run folder this process holds while it trains (RunPaths.lock)

    def outputs() -> RunPaths:
        if resume is not None:
            paths = RunPaths.existing(resume.run_dir)  # config.yaml: rewritten once the logs are open
            paths.lock()  # before anything in it changes: a run still training there refuses the resume
        else:
            # (locked before it takes its name: a folder at it whose lock nobody holds, holding nothing
            # of a run, is a killed start-up's, which a rerun takes; review 54c)
            paths = RunPaths.new_run_dir(config, on_made=made.append, lock=True)
        held.append(paths)
        return paths

    def check_outputs() -> None:  # (a resume's folder: find_resume checked it, that it is not written to and can be)
        if resume is None:
            RunPaths.check_new(config)

    def announce(paths: RunPaths) -> str:
        if resume is not None:
            return f"run folder: {paths.dir} (resuming from {resume.path.name}, step {resume.loaded.step})"
        return f"run folder: {paths.dir}"

    once = threading.Lock()  # (the start-up's stuck-watcher may take back while the main thread comes out of C)

    def take_back() -> None:  # refused or stopped while opening: leave nothing
        if not once.acquire(blocking=False):
            return
        removed = bool(made) and made[0].remove_unused()  # (only a folder that holds nothing of a run;
        for paths in held:  # removed before its lock is let go: a rerun may take a killed start-up's
            paths.unlock()  # folder whose lock nobody holds, review 54c)
        if removed:  # (not the console's first line: a warning held until then, fp16 on a CPU, stays held, and
            # a refusal is stderr's one line; review 58f: the W&B key's refusal came second)
            hook = getattr(sys.stdout, "before_write", None)
            if hook is not None:
                sys.stdout.before_write = None
            try:
                print(f"run folder: {made[0].dir} removed (nothing was run)")
            finally:
                if hook is not None:
                    sys.stdout.before_write = hook

    every = config.log.every
    try:
        result = run(config, outputs=outputs, console_every=every, stats_every=every, progress=True, resume=resume,
                     announce=announce, take_back=take_back, check_outputs=check_outputs)
        distributed.ending()  # (the code is decided: torchrun's SIGTERM, once a peer left with it, must not change it)
        distributed.barrier()  # ranks leave together, once rank 0 has written the run card
        try:
            return finish(result)
        except KeyboardInterrupt:  # (Interrupted among them) the code is decided and the card written: a signal
            # while the closing lines are printed ends the printing, not the run's code (review 52m: a finished
            # run exited 143, a guard's stop 143 for its 3, "ampguard: interrupted" said of a run that was not)
            return result.exit_code
    except BaseException as err:
        # (the rank's end: torchrun's SIGTERM to the ranks left must neither cut the taking back short nor
        # turn a crash, whose traceback is the end, into a stop)
        distributed.ending()
        if isinstance(err, (InputError, KeyboardInterrupt)):  # (Interrupted among them)
            take_back()
        raise
    finally:
        for paths in held:  # the card and the last checkpoint are written: the folder is free
            paths.unlock()
        distributed.shutdown()
