"""``ampguard.validate.compare`` (issue 5, part 1): AMP vs an FP32 reference, by rules declared up
front, called directly on the tiny classifier of the ``factory`` fixture (tests/conftest.py: an
identity ``Linear``, logits = inputs). The ``ampguard validate`` verb, its reports, checkpoints and
``--train-steps`` are in ``tests/e2e/test_validate_cli.py``.
"""

from __future__ import annotations

import pytest
import torch

from ampguard.config import validate as make_config
from ampguard.tasks import build_task
from ampguard.validate import compare

CPU = torch.device("cpu")


def api_config(factory: str, options: dict | None = None, **validation):
    return make_config({"task": {"factory": factory, "options": options or {}}, "validation": validation})


def run_compare(config):
    task = build_task(config)
    return compare(task, task.model, config, CPU)


# ---------------------------------------------------------------------------- classifier


def test_boundary_probes_are_the_smallest_fp32_margins(factory):
    config = api_config(factory, {"tie": True}, typical=0, boundary=1, edge_cases=False, precisions=["fp16"])
    result = run_compare(config)
    assert result.probes == ["held_out:6"]
    assert result.tags == {"held_out:6": ["boundary"]}

    config = api_config(factory, {"tie": True}, typical=2, boundary=0, edge_cases=True, precisions=["fp16"])
    result = run_compare(config)
    assert result.probes == ["held_out:0", "held_out:1", "edge:big"]
    assert result.tags == {"held_out:0": ["typical"], "held_out:1": ["typical"], "edge:big": ["edge"]}


def test_the_tie_rule_is_applied_as_declared(factory):
    # [1.5, 1.0]: top-2 gap exactly 0.5 in fp32, fp16 and bf16; decision unchanged
    counted = run_compare(api_config(factory, {"narrow": True}, precisions=["fp16"], tie_margin=0.6))
    fp16 = counted.results[0]
    assert fp16.flips == []
    assert [row["probe"] for row in fp16.ties] == ["held_out:6"]  # typical and boundary: one probe
    assert all(row["amp_margin"] == 0.5 for row in fp16.ties)
    assert not fp16.ok and not counted.ok

    accepted = run_compare(api_config(factory, {"narrow": True}, precisions=["fp16"], tie_margin=0.6, ties="accept"))
    assert len(accepted.results[0].ties) == 1
    assert accepted.ok

    allowed = run_compare(api_config(factory, {"narrow": True}, precisions=["fp16"], tie_margin=0.6, max_flips=1))
    assert allowed.ok

    below = run_compare(api_config(factory, {"narrow": True}, precisions=["fp16"], tie_margin=0.4))
    assert below.results[0].ties == [] and below.ok


def test_a_low_quality_reference_is_not_trusted(factory):
    # one of six labels is wrong: FP32 accuracy 5/6 < 0.9
    result = run_compare(api_config(factory, {"mislabel": True}, min_accuracy=0.9))
    quality = next(rule for rule in result.reference if rule.criterion == "reference quality")
    assert not quality.ok
    assert not result.reference_ok and not result.ok
    assert result.results[0].stats["quality_fp32"] == pytest.approx(5 / 6)

    fine = run_compare(api_config(factory, {"mislabel": True}, min_accuracy=0.8))
    assert fine.reference_ok and fine.ok


def test_a_factory_predict_gives_the_scores(factory):
    # predict swaps the two classes: every FP32 decision is now wrong
    result = run_compare(api_config(factory, {"swap": True}, min_accuracy=0.5, precisions=["bf16"]))
    assert result.results[0].stats["quality_fp32"] == 0.0
    assert not result.reference_ok


# ---------------------------------------------------------------------------- refusals before the run (issue 16)


def test_a_quality_threshold_of_the_other_mode_is_refused(factory):
    from ampguard.errors import InputError
    from ampguard.validate import check_rules

    config = api_config(factory, max_mse=0.1)
    with pytest.raises(InputError, match=r"validation\.max_mse applies to regression tasks; task factory is a classifier"):
        check_rules(build_task(config), config.validation)
    config = api_config(factory, min_accuracy=0.9)
    check_rules(build_task(config), config.validation)  # a classifier's own threshold: fine


@pytest.mark.parametrize("probes, refused", [
    ({"typical": 0, "boundary": 0, "edge_cases": False}, True),
    ({"typical": 0, "boundary": 1, "edge_cases": False}, False),
    ({"typical": 0, "boundary": 0, "edge_cases": True}, False),  # the factory has an edge case
    ({"typical": 1, "boundary": 0, "edge_cases": False}, False),
])
def test_an_empty_probe_set_is_refused(factory, probes, refused):
    from ampguard.errors import InputError
    from ampguard.validate import build_probes, check_rules

    config = api_config(factory, **probes)
    task = build_task(config)
    if refused:
        with pytest.raises(InputError, match=r"the probe set is empty \(validation\.typical is 0, validation\.boundary "
                                             r"is 0, validation\.edge_cases is false\)"):
            check_rules(task, config.validation)
        with pytest.raises(InputError, match="the probe set is empty"):  # the API refuses it as well
            build_probes(task, task.model, CPU, config.validation)
    else:
        check_rules(task, config.validation)
        assert build_probes(task, task.model, CPU, config.validation)[0]


def test_the_output_folder_is_checked_before_the_run(tmp_path):
    from ampguard.errors import InputError
    from ampguard.validate import check_output_folder

    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    check_output_folder(tmp_path / "empty")
    check_output_folder(tmp_path / "new" / "deeper")
    for out, message in ((tmp_path / "file", "is a file, not a folder"),
                         (tmp_path / "file" / "sub", "file is a file, not a folder"),
                         (tmp_path, "exists and is not empty")):
        with pytest.raises(InputError, match=message):
            check_output_folder(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "file"]  # nothing made by a check


def test_a_failed_write_takes_back_what_it_made(tmp_path, monkeypatch):
    from ampguard import validate
    from ampguard.config import Config
    from ampguard.errors import InputError

    def half_then_fail(v, config, folder):
        (folder / "validation.md").write_text("half")
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(validate, "write_outputs", half_then_fail)
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "a" / "b", tmp_path / "empty"):
        with pytest.raises(InputError, match=r"cannot write the report \(Permission denied\)"):
            validate.write_report_folder(validate.Validation("t", "regression", [], [], []), Config(), out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]
    assert not list((tmp_path / "empty").iterdir())
