"""``compile: true``: ``ampguard train`` runs the model through ``torch.compile``, with every guard
intact. Traced by dynamo and AOT autograd, its kernels not generated: Inductor's C++ build cost this
one run 20-30 s of CPU on a cold cache (a fresh CI machine), and its kernels under the guard are
tests/unit/test_compile.py's and the fused tail's (test_sync_free.py)."""

from __future__ import annotations

import pytest
import torch

from helpers import read_rows


@pytest.mark.slow
def test_a_compiled_train_run_skips_the_injected_nan_and_finishes(cli, tmp_path, monkeypatch):
    compiled = []
    real_compile = torch.nn.Module.compile

    def compile_and_watch(module, *args, **kwargs):  # the real compile, and a hook that sees dynamo trace
        compiled.append(type(module).__name__)
        module.register_forward_pre_hook(lambda m, a: compiled.append(torch.compiler.is_compiling()))
        return real_compile(module, *args, **{**kwargs, "backend": "aot_eager"})  # (no C++ build: above)

    monkeypatch.setattr(torch.nn.Module, "compile", compile_and_watch)
    code, out, err = cli("train", "--set", "task.name=linear", "--set", "steps=6", "--set", "compile=true",
                         "--set", "log.name=c", "--set", "checkpoint.enabled=false", "--set", "log.plot=false",
                         "--inject", "nan_loss@3")
    assert code == 0, err
    rows = read_rows(tmp_path / "runs" / "c" / "steps.csv")
    assert [r["skipped"] for r in rows] == ["0", "0", "1", "0", "0", "0"]
    assert rows[2]["skip_reason"] == "non_finite_loss"
    assert compiled[0] == "Linear" and True in compiled[1:]  # compiled once, and the forward traced by dynamo
    assert "compiled" in (tmp_path / "runs" / "c" / "events.jsonl").read_text()
    assert "model compiled (torch.compile)" in (tmp_path / "runs" / "c" / "RUN.md").read_text()
