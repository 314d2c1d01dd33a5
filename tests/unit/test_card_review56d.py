"""Review 56d F1: RUN.md's table did not escape ``|``: a module or a metric named with one, or an
error message holding `` | ``, cut its cell in a Markdown view (the value dropped, unsaid), and
``read_card`` lost the row. Each cell goes through ``errors.table_cell`` now, and ``read_card``
reads ``\\|`` back as ``|``; an ordinary card is as it was."""

from __future__ import annotations

import re

import pytest
import torch

from ampguard.config import validate
from ampguard.errors import ExitCode
from ampguard.report import read_card, replay, write_run_card
from ampguard.run_folder import RunPaths, RunResult
from ampguard.sinks import CSV_COLUMNS, read_steps_csv

pytestmark = pytest.mark.usefixtures("_one_thread")  # tests/conftest.py

CRASH = "crashed after step 3: ValueError: column a | b does not fit"


def card_of(folder, ended: str, dtypes: dict[str, str], metric: str, plot: str | None = None) -> str:
    """A 3-step bf16 run's card: the leaf modules' dtypes under autocast ``dtypes``, one held-out
    ``metric`` evaluated at 0.5, the run ended as ``ended``; its text."""
    (folder / "steps.csv").write_text(",".join(CSV_COLUMNS) + "\n" + "".join(
        f"{s},0.001,1.5,1.0,0.5,0,,1.0\n" for s in range(1, 4)), encoding="utf-8")
    monitor = replay(read_steps_csv(folder / "steps.csv"), init_scale=1.0)
    monitor.observe_eval({metric: 0.5})
    result = RunResult(ExitCode.CRASHED, monitor, RunPaths.existing(folder), ended, torch.device("cpu"),
                       autocast_dtypes=dtypes)
    write_run_card(folder / "RUN.md", validate({"precision": "bf16"}), result, plot)
    return (folder / "RUN.md").read_text(encoding="utf-8")


def cells(line: str) -> int:
    """How many cells a Markdown table's row has, as GFM splits it (on each ``|`` not escaped)."""
    return len(re.findall(r"(?<!\\)\|", line)) - 1


def test_a_pipe_in_a_module_a_metric_or_an_error_keeps_its_cell_and_reads_back(tmp_path):
    text = card_of(tmp_path, CRASH, {"parts.emb|x": "float32", "head": "bfloat16"}, "acc|top1",
                   "not drawn: no | room (`ampguard report` draws it)")
    rows = [line for line in text.splitlines() if line.startswith("|")]
    assert rows and all(cells(line) == 2 for line in rows), [line for line in rows if cells(line) != 2]
    assert "| held-out acc\\|top1 | final 0.5, best 0.5 |" in rows
    assert "| plot | not drawn: no \\| room (`ampguard report` draws it) |" in rows  # (escaped once, not twice)
    ended, table = read_card(tmp_path / "RUN.md")
    assert ended == CRASH  # (the bold line: no table, nothing escaped)
    assert table["ended"] == CRASH
    assert table["float32 under autocast"] == "parts.emb|x (1 of 2 layers; the others bfloat16)"
    assert table["held-out acc|top1"] == "final 0.5, best 0.5"
    assert table["plot"] == "not drawn: no | room (`ampguard report` draws it)"
    # an ordinary run's card: written and read as before, nothing escaped
    (tmp_path / "ordinary").mkdir()
    text = card_of(tmp_path / "ordinary", "finished: 3 steps", {"fc": "float32", "head": "bfloat16"}, "val_loss")
    assert "\\" not in text
    assert "| float32 under autocast | fc (1 of 2 layers; the others bfloat16) |" in text.splitlines()
    ended, table = read_card(tmp_path / "ordinary" / "RUN.md")
    plain = {k.strip(): v.strip() for k, v in (line.strip("|").split(" | ") for line in text.splitlines()
                                               if line.startswith("| ") and line.count(" | ") == 1)}
    assert ended == "finished: 3 steps" and table == {k: v for k, v in plain.items() if k}
