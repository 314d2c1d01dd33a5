"""``ampguard bench``: what the guard rails cost, measured side by side in one process.

The same model, data, optimizer and seed run under each contender: the bare canonical PyTorch
AMP loop, ampguard's guarded step with per-step CSV logging on, and, when installed, Hugging
Face Accelerate and Lightning Fabric doing the same work. Contenders are interleaved in rounds
(in a rotating order) so that drift of the machine (clocks, other load) falls on all of them
alike; the figure per contender is the median over rounds of its mean ms/step in that round.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
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
    """One way of running a training step; ``step()`` runs one, ``close()`` cleans up."""

    name = ""
    model: nn.Module
    opt: torch.optim.Optimizer

    def persistent_bytes(self) -> int:
        """What this contender keeps between steps: parameters and optimizer state."""
        tensors = list(self.model.parameters())
        for state in self.opt.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors if t.is_cuda)

    def step(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


def _optimizer(model: nn.Module, fused: bool) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused or None)


class Bare(Contender):
    """The canonical loop, as the PyTorch AMP recipe writes it."""

    name = "bare loop"

    def __init__(self, w: Workload, precision: Precision, device: torch.device, fused: bool) -> None:
        self.model = w.make_model().to(device)
        self.opt = _optimizer(self.model, fused)
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision.uses_scaler)
        self.precision, self.w = precision, w

    def step(self) -> None:
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
    """ampguard's step, with every record written to a per-step CSV."""

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
        record = self.state.step(*self.w.batch)
        if record is not None:
            self.sink.write(record)

    def close(self) -> None:
        self.sink.close()
        self._dir.cleanup()


class GuardedSyncFree(Guarded):
    """ampguard's sync-free path: fused AdamW takes the skip flag, no host read per step."""

    name = "ampguard sync-free + csv"
    sync_free = True


class AccelerateLoop(Contender):
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
        x, y = self.w.batch
        with self.acc.autocast():
            loss = self.w.loss_fn(self.model(x), y)
        self.acc.backward(loss)
        self.acc.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class FabricLoop(Contender):
    name = "lightning fabric"

    def __init__(self, w: Workload, precision: Precision, device: torch.device, fused: bool) -> None:
        from lightning.fabric import Fabric

        mp = {"fp16": "16-mixed", "bf16": "bf16-mixed", "fp32": "32-true"}[precision.name]
        self.fabric = Fabric(accelerator=device.type, devices=1, precision=mp)
        model = w.make_model()
        self.model, self.opt = self.fabric.setup(model, _optimizer(model, fused))
        self.w = w

    def step(self) -> None:
        x, y = self.w.batch
        loss = self.w.loss_fn(self.model(x), y)
        self.fabric.backward(loss)
        self.fabric.clip_gradients(self.model, self.opt, max_norm=1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def available_peers() -> list[type[Contender]]:
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
    """Interleaved rounds: in each round every contender runs ``steps`` steps, in rotating order."""
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
    """AMP against FP32, per workload, for the bare loop and for ampguard."""
    out = []
    for workload in dict.fromkeys(r.workload for r in results):
        for contender in (Bare.name, Guarded.name):
            rows = {r.precision: r.median_ms for r in results if r.workload == workload and r.contender == contender}
            if "fp32" in rows:
                for p in ("bf16", "fp16"):
                    if p in rows:
                        out.append(f"{workload}, {contender}: {p} is {rows['fp32'] / rows[p]:.2f}x faster than fp32")
    return out


def run_bench(
    *, device: torch.device, workloads: list[str], precisions: list[str], steps: int, rounds: int,
    warmup: int, peers: bool = True, fused: bool = False, peak_tflops: float | None = None,
) -> list[Result]:
    # the sync-free path needs fused AdamW: it runs when every contender uses it (--fused)
    contenders: list[type[Contender]] = [Bare, Guarded] + ([GuardedSyncFree] if fused else [])
    contenders += available_peers() if peers else []
    results: list[Result] = []
    for name in workloads:
        w = _mlp(device) if name == "mlp" else _transformer(device, "gpt2-small" if name == "gpt2" else "small")
        for p in precisions:
            if p == "fp16" and device.type == "cpu" and name != "mlp":
                continue  # fp16 autocast on a CPU is far too slow for anything but the tiny MLP
            print(f"{w.name} {p}: {', '.join(c.name for c in contenders)}", flush=True)
            results += measure(w, Precision(p, device.type), device, contenders, steps=steps, rounds=rounds,
                               warmup=warmup, fused=fused, peak_flops=peak_tflops * 1e12 if peak_tflops else None)
    return results


def machine() -> str:
    import os
    import platform

    text = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
    if torch.cuda.is_available():
        text += f", {torch.cuda.get_device_name()}"
    return text


def to_json(results: list[Result]) -> str:
    return json.dumps({"machine": machine(), "results": [asdict(r) for r in results]}, indent=2)


WORKLOADS = ("mlp", "transformer", "gpt2")
PRECISIONS = ("fp32", "bf16", "fp16")


def run(*, device: str = "cpu", models: str = "mlp,transformer", precisions: str = "fp32,bf16,fp16", steps: int = 30,
        rounds: int = 7, warmup: int = 5, fused: bool = False, peers: bool = True, peak_tflops: float | None = None,
        quick: bool = False, as_json: bool = False) -> int:
    """``ampguard bench``: measure, then print a table (or JSON) and the speed-ups. Returns 0."""
    from .build import resolve_device
    from .errors import InputError

    where = resolve_device(device)
    workloads, names = models.split(","), precisions.split(",")
    for kind, given, known in (("model", workloads, WORKLOADS), ("precision", names, PRECISIONS)):
        for name in given:
            if name not in known:
                raise InputError(f"bench: unknown {kind} {name!r} ({', '.join(known)})")
    if quick:
        steps, rounds, warmup = 3, 2, 1
    torch.manual_seed(0)
    print(f"ampguard bench on {where} ({machine()}): {rounds} rounds x {steps} steps, interleaved")
    results = run_bench(device=where, workloads=workloads, precisions=names, steps=steps, rounds=rounds,
                        warmup=warmup, peers=peers, fused=fused, peak_tflops=peak_tflops)
    print(to_json(results) if as_json else "\n".join([table(results), *speedups(results)]))
    return 0
