"""Review 56b: the Hugging Face callback's ``ALERT``/``CLEAR`` lines were ``print``-ed past HF's live
progress bar and, on a terminal, stuck to it (`` 39%|████▌ | 47/120 [...]ALERT 63 rolling skip
rate ...``), where HF's own log lines (``ProgressCallback.on_log``: ``training_bar.write``) were
written clean. Its default ``print_fn`` now writes them off the bar as HF does."""

from __future__ import annotations

import contextlib
import functools
import io
import re

import pytest

transformers = pytest.importorskip("transformers")
from transformers.trainer_callback import ProgressCallback, TrainerControl, TrainerState  # noqa: E402

from ampguard.integrations.transformers import AmpGuardCallback  # noqa: E402


def test_the_callbacks_lines_are_written_off_hfs_live_progress_bar(monkeypatch):
    # (HF's bar shown, as a user's is: the suite's TQDM_DISABLE=1, tests/conftest.py, turns off a bar made without
    # disable=, HF's among them)
    import transformers.trainer_callback as hf
    from tqdm.auto import tqdm

    monkeypatch.setattr(hf, "tqdm", functools.partial(tqdm, disable=False))
    term = io.StringIO()  # (stdout and stderr: one terminal)
    progress, state, control = ProgressCallback(), TrainerState(max_steps=120), TrainerControl()
    alert = "ALERT 63 rolling skip rate 0.100 > alert_rate 0.05 over the last 1000 steps"
    with contextlib.redirect_stdout(term), contextlib.redirect_stderr(term):
        progress.on_train_begin(None, state, control)  # (HF's bar, as HF's Trainer makes it)
        state.global_step = 47
        progress.on_step_end(None, state, control)
        progress.training_bar.refresh()
        AmpGuardCallback().print_fn(alert)
        progress.on_train_end(None, state, control)
    text = term.getvalue()
    at = text.index(alert)
    assert re.search(r"47/120.*\r *\r$", text[:at]), repr(text)  # the bar wiped first (the line stuck to it)
    assert re.match(r"\n\r *\d+%\|.*47/120", text[at + len(alert):]), repr(text)  # then drawn again below the line
