"""Review 58f F4: a warning raised while ``make_guard`` built its ``Guard`` named ampguard's own
line (``integrations/accelerate.py``), not the user's call: ``errors.user_stacklevel`` stopped at
any integration's frame. The integrations' functions a user's line calls (``make_guard``,
``AmpGuardPlugin(...)``, ``GuardedTrainer(...)``) are walked past to that line; a framework's
callback still names the integration's line."""

from __future__ import annotations

import warnings

import pytest
import torch

from ampguard.errors import AmpguardWarning
from ampguard.precision import HalfWeightsWarning


def _sites(build):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build()
    return [(w.category, w.filename, w.lineno) for w in caught if issubclass(w.category, AmpguardWarning)]


def test_a_warning_of_the_guard_make_guard_builds_names_the_users_line():
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    from ampguard.integrations.accelerate import make_guard

    GradientState._reset_state()
    try:
        accelerator = accelerate.Accelerator(cpu=True)
        model = torch.nn.Linear(4, 1).to(torch.bfloat16)  # half weights under fp32: HalfWeightsWarning
        model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        line = _line() + 1
        said = _sites(lambda: make_guard(accelerator, model, opt, precision="fp32"))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    assert said == [(HalfWeightsWarning, __file__, line)]  # (it was accelerate.py's line 150)


def test_a_warning_of_the_plugins_settings_names_the_users_line():
    pytest.importorskip("lightning")
    from ampguard.integrations.lightning import AmpGuardPlugin

    line = _line() + 1
    said = _sites(lambda: AmpGuardPlugin("bf16-mixed", scaler={"init_scale": 4.0}))  # (bf16 runs no scaler)
    assert said == [(AmpguardWarning, __file__, line)]  # (it was lightning.py's own)


def test_a_warning_of_the_guarded_trainers_settings_names_the_users_line(tmp_path):
    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    from ampguard.integrations.transformers import GuardedTrainer

    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to=[])
    line = _line() + 1
    said = _sites(lambda: GuardedTrainer(model=torch.nn.Linear(2, 1), args=args, scaler={"init_scale": 4.0}))
    assert said == [(AmpguardWarning, __file__, line)]  # (fp32 runs no scaler; it was transformers.py's own)


def _line():
    import sys

    return sys._getframe(1).f_lineno
