"""``ampguard bench``: what the guard rails cost, measured side by side in one process.

The same model, data, optimizer and seed run under each contender: the bare canonical PyTorch
AMP loop, ampguard's guarded step with per-step CSV logging on, and, when installed, Hugging
Face Accelerate and Lightning Fabric doing the same work. Contenders are interleaved in rounds
(in a rotating order) so that drift of the machine (clocks, other load) falls on all of them
alike; the figure per contender is the median over rounds of its mean ms/step in that round.
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from .precision import Precision
from .sinks import BackgroundSink, CsvSink, Sink
from .step import AmpTrainState

# ---------------------------------------------------------------------------- workloads


@dataclass
class Workload:
    """What every contender trains: a model factory (the same seed each call), one fixed batch,
    the loss, and the work per step (for tokens/s and MFU).

    Example::

        >>> def make():
        ...     torch.manual_seed(0)
        ...     return nn.Linear(4, 2)
        >>> w = Workload("toy", make, (torch.ones(8, 4), torch.zeros(8, 2)), F.mse_loss)
        >>> torch.equal(w.make_model().weight, w.make_model().weight), w.tokens_per_step
        (True, 0)
    """

    name: str
    make_model: Callable[[], nn.Module]
    batch: tuple[torch.Tensor, torch.Tensor]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    tokens_per_step: int = 0
    flops_per_step: float = 0.0  # model FLOPs (6 N per token for a transformer), for MFU


def _mlp(device: torch.device) -> Workload:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 32, generator=g), torch.randint(0, 10, (64,), generator=g)

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10))

    return Workload("tiny-mlp", make, (x.to(device), y.to(device)), F.cross_entropy)


def _transformer(device: torch.device, size: str) -> Workload:
    from .tasks.charlm import CharLM, lm_loss

    if size == "gpt2-small":  # GPT-2 small's shape (12 x 768, 12 heads, context 1024), byte vocabulary
        layers, width, heads, block, batch = 12, 768, 12, 1024, 8
    else:
        layers, width, heads, block, batch = 2, 64, 4, 64, 16
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 256, (batch, block + 1), generator=g)

    def make() -> nn.Module:
        torch.manual_seed(0)
        return CharLM(block, layers, heads, width)

    n_params = sum(p.numel() for p in make().parameters())
    tokens = batch * block
    # 6 N per token (forward + backward) plus attention's 12 * layers * width * block per token
    flops = 6 * n_params * tokens + 12 * layers * width * block * tokens
    name = "transformer-gpt2-small" if size == "gpt2-small" else "small-transformer"
    return Workload(name, make, (idx[:, :-1].to(device), idx[:, 1:].to(device)), lm_loss, tokens, flops)


# ---------------------------------------------------------------------------- contenders


class Contender:
    """One way of running a training step; ``step()`` runs one, ``close()`` cleans up.

    Example (a subclass sets ``name``, ``model`` and ``opt`` and implements ``step``)::

        >>> class PlainSGD(Contender):
        ...     name = "plain sgd"
        ...     def __init__(self, w):
        ...         self.model, self.w = w.make_model(), w
        ...         self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        ...     def step(self):
        ...         self.w.loss_fn(self.model(self.w.batch[0]), self.w.batch[1]).backward()
        ...         self.opt.step()
        ...         self.opt.zero_grad()
        >>> results = measure(_mlp(torch.device("cpu")), Precision("fp32", "cpu"), torch.device("cpu"),
        ...                   [lambda w, p, d, f: PlainSGD(w)], steps=1, rounds=1, warmup=1, fused=False)
        >>> [r.contender for r in results], math.isnan(results[0].ratio_to_bare)  # no bare loop to compare with
        (['plain sgd'], True)
    """

    name = ""
    model: nn.Module
    opt: torch.optim.Optimizer

    def persistent_bytes(self) -> int:
        """What this contender keeps between steps: parameters and optimizer state.

        Only CUDA tensors count (it goes with the CUDA peak-memory figure); a CPU run keeps 0.

        Example::

        >>> cpu, fp32 = torch.device("cpu"), Precision("fp32", "cpu")
        >>> Bare(_mlp(cpu), fp32, cpu, fused=False).persistent_bytes()
        0
        """
        tensors = list(self.model.parameters())
        for state in self.opt.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors if t.is_cuda)

    def step(self) -> None:
        """One training step on the workload's batch; each subclass says how.

        Example::

            >>> Contender().step()
            Traceback (most recent call last):
            ...
            NotImplementedError
        """
        raise NotImplementedError

    def close(self) -> None:
        """Release what the contender holds (files, threads); nothing by default.

        Example::

            >>> Contender().close() is None
            True
        """
        pass


def _optimizer(model: nn.Module, fused: bool) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused or None)


class Bare(Contender):
    """The canonical loop, as the PyTorch AMP recipe writes it.

    Example::

        >>> cpu, fp32 = torch.device("cpu"), Precision("fp32", "cpu")
        >>> bare = Bare(_mlp(cpu), fp32, cpu, fused=False)
        >>> bare.scaler.is_enabled(), Bare(_mlp(cpu), Precision("fp16", "cpu"), cpu, fused=False).scaler.is_enabled()
        (False, True)
    """

    name = "bare loop"

    def __init__(self, w: Workload, precision: Precision, device: torch.device, fused: bool) -> None:
        self.model = w.make_model().to(device)
        self.opt = _optimizer(self.model, fused)
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision.uses_scaler)
        self.precision, self.w = precision, w

    def step(self) -> None:
        """Autocast forward, scaled backward, unscale, ``clip_grad_norm_`` to 1.0, scaler step and
        update (``scaler.step`` reads the found-inf flag: a host sync), ``zero_grad``.

        Example (in FP32 ampguard's guarded step lands on the same weights, bit for bit)::

            >>> cpu, fp32 = torch.device("cpu"), Precision("fp32", "cpu")
            >>> bare, guarded = Bare(_mlp(cpu), fp32, cpu, False), Guarded(_mlp(cpu), fp32, cpu, False)
            >>> for _ in range(3):
            ...     bare.step(); guarded.step()
            >>> all(torch.equal(a, b) for a, b in zip(bare.model.parameters(), guarded.model.parameters()))
            True
            >>> guarded.close()
        """
        x, y = self.w.batch
        with self.precision.autocast():
            loss = self.w.loss_fn(self.model(x), y)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.opt)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)


class Guarded(Contender):
    """ampguard's step, with every record written to a per-step CSV.

    The CSV goes to a temporary folder that :meth:`close` deletes.

    Example::

        >>> cpu, fp32 = torch.device("cpu"), Precision("fp32", "cpu")
        >>> guarded = Guarded(_mlp(cpu), fp32, cpu, fused=False)
        >>> csv = Path(guarded._dir.name) / "steps.csv"
        >>> type(guarded.sink).__name__, csv.is_file()  # on CUDA a BackgroundSink
        ('CsvSink', True)
        >>> guarded.close()
        >>> csv.exists()
        False
    """

    name = "ampguard + csv"
    sync_free = False

    def __init__(self, w: Workload, precision: Precision, device: torch.device, fused: bool) -> None:
        self.model = w.make_model().to(device)
        if self.sync_free:  # fused AdamW takes the skip flag; the LR is a device tensor
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=torch.tensor(1e-4, device=device), fused=True)
        else:
            self.opt = _optimizer(self.model, fused)
        self.state = AmpTrainState(self.model, self.opt, w.loss_fn, precision=precision, sync_free=self.sync_free)
        self._dir = tempfile.TemporaryDirectory(prefix="ampguard-bench-")
        csv = CsvSink(Path(self._dir.name) / "steps.csv")
        # on CUDA the rows are read back by a background writer (non-blocking copies into pinned
        # memory); the sync-free path always needs one, or the CSV row would read them back itself
        self.sink: Sink = BackgroundSink(csv) if device.type == "cuda" or self.sync_free else csv
        self.w = w

    def step(self) -> None:
        """One guarded step and its CSV row. The step reads its skip flags on the host (its one
        host sync) unless ``sync_free``; the row is read on the host by the sink (in a background
        thread for a :class:`BackgroundSink`).

        Example::

            >>> cpu, fp32 = torch.device("cpu"), Precision("fp32", "cpu")
            >>> guarded = Guarded(_mlp(cpu), fp32, cpu, fused=False)
            >>> guarded.step(); guarded.step()
            >>> rows = (Path(guarded._dir.name) / "steps.csv").read_text().splitlines()
            >>> guarded.state.steps, len(rows), rows[2].split(",")[0]
            (2, 3, '2')
            >>> guarded.close()
        """
        record = self.state.step(*self.w.batch)
        if record is not None:
            self.sink.write(record)

    def close(self) -> None:
        """Flush and close the sink, then delete the temporary folder with the CSV.

        Example::

            >>> cpu, fp32 = torch.device("cpu"), Precision("fp32", "cpu")
            >>> guarded = Guarded(_mlp(cpu), fp32, cpu, fused=False)
            >>> folder = Path(guarded._dir.name)
            >>> guarded.step(); guarded.close()
            >>> folder.exists()
            False
        """
        self.sink.close()
        self._dir.cleanup()


class GuardedSyncFree(Guarded):
    """ampguard's sync-free path: fused AdamW takes the skip flag, no host read per step.

    Example (the rows are read back by a background writer, never by the step)::

        >>> cpu, fp32 = torch.device("cpu"), Precision("fp32", "cpu")
        >>> sync_free = GuardedSyncFree(_mlp(cpu), fp32, cpu, fused=True)
        >>> sync_free.step(); sync_free.step()
        >>> type(sync_free.sink).__name__, sync_free.state.sync_free, sync_free.opt.defaults["fused"]
        ('BackgroundSink', True, True)
        >>> csv = Path(sync_free._dir.name) / "steps.csv"
        >>> sync_free.sink.close(); len(csv.read_text().splitlines())  # header and two rows
        3
        >>> sync_free.close()
    """

    name = "ampguard sync-free + csv"
    sync_free = True


class AccelerateLoop(Contender):
    """Hugging Face Accelerate doing the same work (``Accelerator(mixed_precision=...)``); listed
    by :func:`available_peers` only when ``accelerate`` is installed.

    Example (``measure`` leaves out a peer it cannot build, and says so)::

        >>> import contextlib, importlib.util, io
        >>> installed = importlib.util.find_spec("accelerate") is not None
        >>> said = io.StringIO()
        >>> with contextlib.redirect_stdout(said):
        ...     results = measure(_mlp(torch.device("cpu")), Precision("fp32", "cpu"), torch.device("cpu"),
        ...                       [Bare, AccelerateLoop], steps=1, rounds=1, warmup=1, fused=False)
        >>> [r.contender for r in results] == ["bare loop"] + (["accelerate"] if installed else [])
        True
        >>> ("accelerate: not run (ModuleNotFoundError" in said.getvalue()) == (not installed)
        True
    """

    name = "accelerate"

    def __init__(self, w: Workload, precision: Precision, device: torch.device, fused: bool) -> None:
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(True)  # a process-wide singleton: one precision per process otherwise
        mp = {"fp16": "fp16", "bf16": "bf16", "fp32": "no"}[precision.name]
        self.acc = Accelerator(mixed_precision=mp, cpu=device.type == "cpu")
        model = w.make_model()
        self.model, self.opt = self.acc.prepare(model, _optimizer(model, fused))
        self.w = w

    def step(self) -> None:
        """Accelerate's autocast, ``backward`` (it scales the loss for fp16), ``clip_grad_norm_``
        to 1.0, the optimizer step and ``zero_grad``.

        Example (runs only where ``accelerate`` is installed)::

            >>> import importlib.util
            >>> if importlib.util.find_spec("accelerate") is not None:
            ...     cpu = torch.device("cpu")
            ...     loop = AccelerateLoop(_mlp(cpu), Precision("fp32", "cpu"), cpu, fused=False)
            ...     before = [p.detach().clone() for p in loop.model.parameters()]
            ...     loop.step()
            ...     assert any(not torch.equal(a, b) for a, b in zip(before, loop.model.parameters()))
        """
        x, y = self.w.batch
        with self.acc.autocast():
            loss = self.w.loss_fn(self.model(x), y)
        self.acc.backward(loss)
        self.acc.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class FabricLoop(Contender):
    """Lightning Fabric doing the same work (``Fabric(precision="16-mixed" | "bf16-mixed" |
    "32-true")``); listed by :func:`available_peers` only when ``lightning`` is installed.

    Example (``measure`` leaves out a peer it cannot build, and says so)::

        >>> import contextlib, importlib.util, io
        >>> installed = importlib.util.find_spec("lightning") is not None
        >>> said = io.StringIO()
        >>> with contextlib.redirect_stdout(said):
        ...     results = measure(_mlp(torch.device("cpu")), Precision("fp32", "cpu"), torch.device("cpu"),
        ...                       [Bare, FabricLoop], steps=1, rounds=1, warmup=1, fused=False)
        >>> [r.contender for r in results] == ["bare loop"] + (["lightning fabric"] if installed else [])
        True
        >>> ("lightning fabric: not run (ModuleNotFoundError" in said.getvalue()) == (not installed)
        True
    """

    name = "lightning fabric"

    def __init__(self, w: Workload, precision: Precision, device: torch.device, fused: bool) -> None:
        from lightning.fabric import Fabric

        mp = {"fp16": "16-mixed", "bf16": "bf16-mixed", "fp32": "32-true"}[precision.name]
        self.fabric = Fabric(accelerator=device.type, devices=1, precision=mp)
        model = w.make_model()
        self.model, self.opt = self.fabric.setup(model, _optimizer(model, fused))
        self.w = w

    def step(self) -> None:
        """Forward (Fabric's wrapped model autocasts), ``fabric.backward``, ``clip_gradients`` to
        1.0, the optimizer step and ``zero_grad``.

        Example (runs only where ``lightning`` is installed)::

            >>> import importlib.util
            >>> if importlib.util.find_spec("lightning") is not None:
            ...     cpu = torch.device("cpu")
            ...     loop = FabricLoop(_mlp(cpu), Precision("fp32", "cpu"), cpu, fused=False)
            ...     before = [p.detach().clone() for p in loop.model.parameters()]
            ...     loop.step()
            ...     assert any(not torch.equal(a, b) for a, b in zip(before, loop.model.parameters()))
        """
        x, y = self.w.batch
        loss = self.w.loss_fn(self.model(x), y)
        self.fabric.backward(loss)
        self.fabric.clip_gradients(self.model, self.opt, max_norm=1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def available_peers() -> list[type[Contender]]:
    """The peer contenders whose package is installed (Accelerate, Lightning Fabric).

    Example::

        >>> import importlib.util
        >>> expected = [cls for cls, package in ((AccelerateLoop, "accelerate"), (FabricLoop, "lightning"))
        ...             if importlib.util.find_spec(package) is not None]
        >>> available_peers() == expected
        True
    """
    import importlib.util

    peers: list[type[Contender]] = []
    if importlib.util.find_spec("accelerate") is not None:
        peers.append(AccelerateLoop)
    if importlib.util.find_spec("lightning") is not None:
        peers.append(FabricLoop)
    return peers


# ---------------------------------------------------------------------------- measuring


@dataclass
class Result:
    """One contender's figures on one workload and precision (times in ms per step).

    Example::

        >>> r = Result("tiny-mlp", "fp32", "bare loop", median_ms=0.5, min_ms=0.4)
        >>> math.isnan(r.ratio_to_bare), r.peak_mem_mib, r.rounds
        (True, None, [])
    """

    workload: str
    precision: str
    contender: str
    median_ms: float
    min_ms: float
    ratio_to_bare: float = math.nan
    peak_mem_mib: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    rounds: list[float] = field(default_factory=list)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    w: Workload, precision: Precision, device: torch.device, contenders: list[type[Contender]],
    *, steps: int, rounds: int, warmup: int, fused: bool, peak_flops: float | None = None,
) -> list[Result]:
    """Interleaved rounds: in each round every contender runs ``steps`` steps, in rotating order.

    Each timed round is bracketed by ``torch.cuda.synchronize`` on CUDA (a host sync), so the
    time covers the device's work, not just the launches.

    Example::

        >>> cpu, fp32 = torch.device("cpu"), Precision("fp32", "cpu")
        >>> results = measure(_mlp(cpu), fp32, cpu, [Bare, Guarded], steps=1, rounds=3, warmup=1, fused=False)
        >>> [(r.contender, len(r.rounds), r.median_ms > 0) for r in results]
        [('bare loop', 3, True), ('ampguard + csv', 3, True)]
        >>> results[0].ratio_to_bare, results[1].ratio_to_bare == results[1].median_ms / results[0].median_ms
        (1.0, True)

    A contender that cannot be built, or fails its warm-up, is left out with a line saying why;
    when none is left the result is empty::

        >>> class Broken(Bare):
        ...     name = "broken"
        ...     def step(self):
        ...         raise RuntimeError("no kernel for this")
        >>> measure(_mlp(cpu), fp32, cpu, [Broken], steps=1, rounds=3, warmup=1, fused=False)
          broken: not run (RuntimeError: no kernel for this)
          tiny-mlp fp32: no contender could run, nothing measured
        []
    """
    built: list[Contender] = []
    for cls in contenders:
        try:
            built.append(cls(w, precision, device, fused))
        except Exception as err:  # noqa: BLE001 - a peer that cannot run this case is left out, said so
            print(f"  {cls.name}: not run ({type(err).__name__}: {err})")
    times: dict[str, list[float]] = {c.name: [] for c in built}
    peaks: dict[str, float | None] = {c.name: None for c in built}
    for c in list(built):  # warm-up, and the peak memory of a steady-state step
        try:
            for _ in range(warmup):
                c.step()
            _sync(device)
        except Exception as err:  # noqa: BLE001 - a peer that fails on this case is left out, said so
            print(f"  {c.name}: not run ({type(err).__name__}: {err})")
            built.remove(c)
            del times[c.name], peaks[c.name]
            with contextlib.suppress(Exception):  # its files and threads go, whatever state it is in
                c.close()
            continue
        if device.type == "cuda":
            # all contenders live in this process: count this one's own tensors (parameters,
            # optimizer state) plus the most one of its steps allocates on top of what was there
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            c.step()
            _sync(device)
            transient = torch.cuda.max_memory_allocated(device) - before
            peaks[c.name] = (c.persistent_bytes() + transient) / 2**20
    if not built:  # nothing to time: say so, rather than divide by no contenders
        print(f"  {w.name} {precision.name}: no contender could run, nothing measured")
        return []
    for r in range(rounds):
        order = built[r % len(built):] + built[: r % len(built)]
        for c in order:
            _sync(device)
            start = time.perf_counter()
            for _ in range(steps):
                c.step()
            _sync(device)
            times[c.name].append((time.perf_counter() - start) * 1000 / steps)
    for c in built:
        c.close()
    results = []
    for c in built:
        med = statistics.median(times[c.name])
        res = Result(w.name, precision.name, c.name, med, min(times[c.name]), peak_mem_mib=peaks[c.name],
                     rounds=times[c.name])
        if w.tokens_per_step:
            res.tokens_per_s = w.tokens_per_step / (med / 1000)
            if peak_flops:
                res.mfu = w.flops_per_step / (med / 1000) / peak_flops
        results.append(res)
    bare = next((r.median_ms for r in results if r.contender == Bare.name), None)
    for res in results:
        if bare:
            res.ratio_to_bare = res.median_ms / bare
    return results


def table(results: list[Result]) -> str:
    """The results as a markdown table, one row per contender (``n/a`` memory off CUDA).

    Example::

        >>> rows = table([Result("tiny-mlp", "fp32", "bare loop", 0.5, 0.4, ratio_to_bare=1.0)]).splitlines()
        >>> len(rows), rows[2]
        (3, '| tiny-mlp | fp32 | bare loop | 0.500 | 0.400 | 1.000 | n/a |  |  |')
    """
    lines = ["| workload | precision | contender | median ms/step | min ms/step | ratio to bare | peak MiB | tokens/s | MFU |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        mem = "n/a" if r.peak_mem_mib is None else f"{r.peak_mem_mib:.1f}"
        tps = "" if r.tokens_per_s is None else f"{r.tokens_per_s:,.0f}"
        mfu = "" if r.mfu is None else f"{r.mfu:.1%}"
        lines.append(f"| {r.workload} | {r.precision} | {r.contender} | {r.median_ms:.3f} | {r.min_ms:.3f} | "
                     f"{r.ratio_to_bare:.3f} | {mem} | {tps} | {mfu} |")
    return "\n".join(lines)


def speedups(results: list[Result]) -> list[str]:
    """AMP against FP32, per workload, for the bare loop and for ampguard.

    Example::

        >>> results = [Result("tiny-mlp", "fp32", Bare.name, 2.0, 2.0), Result("tiny-mlp", "bf16", Bare.name, 1.0, 1.0),
        ...            Result("tiny-mlp", "bf16", Guarded.name, 1.2, 1.2)]  # ampguard has no fp32 row
        >>> speedups(results)
        ['tiny-mlp, bare loop: bf16 is 2.00x faster than fp32']
        >>> speedups([Result("mlp", "fp32", Bare.name, 1.0, 1.0), Result("mlp", "bf16", Bare.name, 1.4, 1.4)])
        ['mlp, bare loop: bf16 is 1.40x slower than fp32']
        >>> speedups([Result("gpt2", "bf16", Bare.name, 3.0, 3.0), Result("gpt2", "fp8", Bare.name, 2.0, 2.0)])
        ['gpt2, bare loop: fp8 is 1.50x faster than bf16']
    """
    out = []
    for workload in dict.fromkeys(r.workload for r in results):
        for contender in (Bare.name, Guarded.name):
            rows = {r.precision: r.median_ms for r in results if r.workload == workload and r.contender == contender}
            if "fp32" in rows:
                for p in ("bf16", "fp16", "fp8"):
                    if p in rows:
                        ratio = rows["fp32"] / rows[p]  # > 1: faster; a slower one says so, never "0.7x faster"
                        how = f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower"
                        out.append(f"{workload}, {contender}: {p} is {how} than fp32")
            if "bf16" in rows and "fp8" in rows:  # what fp8 is for: its gain over bf16
                ratio = rows["bf16"] / rows["fp8"]
                how = f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower"
                out.append(f"{workload}, {contender}: fp8 is {how} than bf16")
    return out


def run_bench(
    *, device: torch.device, workloads: list[str], precisions: list[str], steps: int, rounds: int,
    warmup: int, peers: bool = True, fused: bool = False, peak_tflops: float | None = None,
    compiled: bool = False,
) -> list[Result]:
    """Every workload x precision, measured with the bare loop, the guarded step (and its
    sync-free path with ``fused``) and the installed peers. fp16 on a CPU runs only the MLP.
    fp8 converts the model (:func:`fp8_workload`); ``compiled`` runs every model through
    ``torch.compile`` (:func:`compiled_workload`), as torchao's float8 needs to be fast.

    Example::

        >>> results = run_bench(device=torch.device("cpu"), workloads=["mlp"], precisions=["fp32"], steps=1,
        ...                     rounds=1, warmup=1, peers=False)
        tiny-mlp fp32: bare loop, ampguard + csv
        >>> [(r.workload, r.precision, r.contender) for r in results]
        [('tiny-mlp', 'fp32', 'bare loop'), ('tiny-mlp', 'fp32', 'ampguard + csv')]
    """
    # the sync-free path needs fused AdamW: it runs when every contender uses it (--fused)
    contenders: list[type[Contender]] = [Bare, Guarded] + ([GuardedSyncFree] if fused else [])
    contenders += available_peers() if peers else []
    results: list[Result] = []
    for name in workloads:
        w = _mlp(device) if name == "mlp" else _transformer(device, "gpt2-small" if name == "gpt2" else "small")
        for p in precisions:
            if p == "fp16" and device.type == "cpu" and name != "mlp":
                # fp16 autocast on a CPU is far too slow for anything but the tiny MLP
                print(f"{w.name} fp16: not run (on a CPU fp16 runs only the mlp model)", flush=True)
                continue
            run_w, run_c = (fp8_workload(w), [Bare, Guarded] + ([GuardedSyncFree] if fused else [])) if p == "fp8" \
                else (w, contenders)
            run_w = compiled_workload(run_w) if compiled else run_w
            print(f"{w.name} {p}: {', '.join(c.name for c in run_c)}", flush=True)
            results += measure(run_w, Precision(p, device.type), device, run_c, steps=steps, rounds=rounds,
                               warmup=warmup, fused=fused, peak_flops=peak_tflops * 1e12 if peak_tflops else None)
    return results


def fp8_workload(w: Workload) -> Workload:
    """The same workload with its model converted to torchao float8 training (the default
    layers: :func:`ampguard.fp8.convert_to_fp8`); its FLOPs are counted as before, so MFU stays
    against ``--peak-tflops`` (give the bf16 peak to compare fp8 with bf16 on one scale). The
    peers (Accelerate, Fabric) have no such setting here: fp8 runs the bare loop and ampguard.
    On a CPU torchao emulates the float8 matmuls: a correctness smoke test, not a speed figure.

    Example::

        >>> w = fp8_workload(_mlp(torch.device("cpu")))
        >>> [type(m).__name__ for m in w.make_model()]
        ['Linear', 'GELU', 'Float8Linear', 'GELU', 'Linear']
    """
    from .fp8 import convert_to_fp8

    def make() -> nn.Module:
        model = w.make_model()
        convert_to_fp8(model)
        return model

    return replace(w, make_model=make)


def compiled_workload(w: Workload) -> Workload:
    """The same workload with its model wrapped in ``torch.compile`` (compiled on its first
    steps, which the warm-up takes). torchao's float8 casts are separate eager kernels without
    it: fp8 against bf16 is a fair race only when both are compiled.

    Example::

        >>> type(compiled_workload(_mlp(torch.device("cpu"))).make_model()).__name__
        'OptimizedModule'
    """

    def make() -> nn.Module:
        return torch.compile(w.make_model())

    return replace(w, make_model=make)


def machine() -> str:
    """The machine in one line: processor, CPU count, torch version (and the GPU's name).

    Example::

        >>> f"torch {torch.__version__}" in machine()
        True
    """
    import os
    import platform

    text = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
    if torch.cuda.is_available():
        text += f", {torch.cuda.get_device_name()}"
    return text


def to_json(results: list[Result]) -> str:
    """The machine and every result as JSON (``ampguard bench --json``).

    Example::

        >>> data = json.loads(to_json([Result("tiny-mlp", "fp32", "bare loop", 0.5, 0.4, rounds=[0.5])]))
        >>> sorted(data), data["results"][0]["median_ms"], data["results"][0]["rounds"]
        (['machine', 'results'], 0.5, [0.5])
    """
    return json.dumps({"machine": machine(), "results": [asdict(r) for r in results]}, indent=2)


WORKLOADS = ("mlp", "transformer", "gpt2")
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")


def run(*, device: str = "cpu", models: str = "mlp,transformer", precisions: str = "fp32,bf16,fp16", steps: int = 30,
        rounds: int = 7, warmup: int = 5, fused: bool = False, peers: bool = True, peak_tflops: float | None = None,
        quick: bool = False, as_json: bool = False, compiled: bool = False) -> int:
    """``ampguard bench``: measure, then print a table (or JSON) and the speed-ups. Returns 0.
    ``compiled`` runs every model through ``torch.compile`` (from Python, e.g.
    ``benchmarks/gpu/fp8_vs_bf16.sh``; fp8 is fast only compiled).

    Example (``quick``: 2 rounds of 3 steps, a smoke test rather than a measurement)::

        >>> run(models="mlp", precisions="fp32", quick=True, peers=False)  # doctest: +ELLIPSIS
        ampguard bench on cpu (...): 2 rounds x 3 steps, interleaved
        tiny-mlp fp32: bare loop, ampguard + csv
        | workload | precision | contender | median ms/step | ...
        |---|---|---|---|---|---|---|---|---|
        | tiny-mlp | fp32 | bare loop | ... | 1.000 | n/a |  |  |
        | tiny-mlp | fp32 | ampguard + csv | ...
        0
        >>> run(models="mlp,resnet")
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: bench: unknown model 'resnet' (mlp, transformer, gpt2)
        >>> run(models="transformer", precisions="fp16")
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: bench: on a CPU fp16 runs only the mlp model; nothing to measure for transformer
    """
    from .build import resolve_device
    from .errors import InputError

    where = resolve_device(device)
    workloads, names = models.split(","), precisions.split(",")
    for kind, given, known in (("model", workloads, WORKLOADS), ("precision", names, PRECISIONS)):
        for name in given:
            if name not in known:
                raise InputError(f"bench: unknown {kind} {name!r} ({', '.join(known)})")
    if peak_tflops is not None and not (math.isfinite(peak_tflops) and peak_tflops > 0):
        raise InputError(f"bench: --peak-tflops must be a finite number > 0, got {peak_tflops:g}")
    if where.type == "cpu" and set(names) == {"fp16"} and "mlp" not in workloads:
        raise InputError(f"bench: on a CPU fp16 runs only the mlp model; nothing to measure for {models}")
    if quick:
        steps, rounds, warmup = 3, 2, 1
    torch.manual_seed(0)
    print(f"ampguard bench on {where} ({machine()}): {rounds} rounds x {steps} steps, interleaved")
    results = run_bench(device=where, workloads=workloads, precisions=names, steps=steps, rounds=rounds,
                        warmup=warmup, peers=peers, fused=fused, peak_tflops=peak_tflops, compiled=compiled)
    if not results:
        raise InputError(f"bench: no contender could run {models} in {precisions} on {where} (why: the lines above)")
    print(to_json(results) if as_json else "\n".join([table(results), *speedups(results)]))
    return 0
