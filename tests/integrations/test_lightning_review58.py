"""Review 58f F1: the plugin's ALERT and stop lines were ``rank_zero_warn``, ``warnings.warn``, which
shows a (text, category, line) once a process: a second fit in the same process (a notebook cell
run again, a sweep's trials) stopped at the same step without a word. Each fit says its own; a
filter of the user's still silences them."""

from __future__ import annotations

import warnings

import pytest

from test_lightning import Digits, fit

L = pytest.importorskip("lightning")

from ampguard.errors import AmpguardWarning  # noqa: E402
from ampguard.integrations.lightning import AmpGuardPlugin  # noqa: E402


def _said(fits, filters):
    """The plugin's lines of each fit (run one after the other in this process), under ``filters``."""
    said = []
    with warnings.catch_warnings(record=True) as caught:
        filters()
        for run in fits:
            before = len(caught)
            run()
            said.append([str(w.message).split(":")[0] for w in caught[before:] if w.category is AmpguardWarning])
    return said


def _stopped_mid_fit():  # the fail-fast, at step 3 of 20 (the step's own line)
    plugin = AmpGuardPlugin("32-true", fail_rate=0.5, fail_after=3, min_steps=1)
    fit(Digits(faults=["nan_loss@every:1"], hidden=8), plugin, steps=20)
    assert plugin.stop_reason.startswith("ampguard stopped the trainer at step 3")


def _failed_at_its_end():  # a fit too short to arm the ALERT: judged whole at its end (the end's own line)
    plugin = AmpGuardPlugin("32-true", fail_rate=0.5)
    fit(Digits(faults=["nan_loss@every:1"], hidden=8), plugin, steps=3)
    assert plugin.stop_reason.startswith("ampguard failed the fit at its end (step 3)")


def test_a_second_fit_in_the_same_process_says_its_alert_and_its_stop_as_the_first_did():
    fits = [_stopped_mid_fit, _failed_at_its_end] * 2
    said = _said(fits, lambda: warnings.simplefilter("default"))  # (Python's own: a script's, a notebook's)
    stopped = ["ampguard ALERT at step 1", "ampguard stopped the trainer at step 3"]
    failed = ["ampguard ALERT at step 3", "ampguard failed the fit at its end (step 3)"]
    assert said == [stopped, failed, stopped, failed]  # (fits 3 and 4 said nothing)
    # a user's filter still decides
    assert _said(fits[:2], lambda: warnings.filterwarnings("ignore", category=AmpguardWarning)) == [[], []]
