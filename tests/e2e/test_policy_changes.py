"""Policy changes on resume are recorded, not silent (issue item 10): a setting that changes the
numerics is either refused on resume (as precision is) or applied and recorded (key, old, new,
step) in events.jsonl, the console, the checkpoints and the run card. docs/resume.md has the
table; the last test holds it to the config tree. Tiny linear runs on the CPU.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers import ROOT, ag, ok, one_error_line, read_rows, run_events, snapshot_of, train

from ampguard import checkpoint as ckpt
from ampguard.checkpointer import POLICY, POLICY_UNRECORDED, RESUME_FIXED
from ampguard.config import Config

BASE = ["--set", "task.name=linear", "--set", "device=cpu", "--set", "schedule.decay=constant",
        "--set", "checkpoint.every=5", "--set", "steps=10", "--set", "log.every=1"]


@pytest.fixture(scope="module")
def fp16_run(tmp_path_factory) -> Path:
    """A finished 10-step fp16 run with checkpoints at 5 and 10 (copied by each test that resumes it)."""
    folder = tmp_path_factory.mktemp("policy")
    ok(train(folder, "R", *BASE, "--set", "precision=fp16"))
    return folder / "R"


def _copy(run: Path, tmp_path: Path) -> Path:
    import shutil

    target = tmp_path / "R"
    shutil.copytree(run, target)
    return target


def _policy_events(run: Path) -> list[dict]:
    return [e for e in run_events(run) if e["event"] == "policy_change"]


def _card_row(run: Path, label: str) -> str:
    return next(line for line in (run / "RUN.md").read_text(encoding="utf-8").splitlines()
                if line.startswith(f"| {label} |"))


def test_turning_the_loss_scaler_off_on_resume_is_refused_in_one_line(fp16_run, tmp_path):
    run = _copy(fp16_run, tmp_path)
    before = snapshot_of(run)
    line = one_error_line(ag("train", "--resume", run / "checkpoints" / "step-00000005.pt",
                             "--set", "scaler.enabled=false"))
    assert line == ("ampguard: error: --resume: scaler.enabled was true in the checkpoint, now false; "
                    "a resumed run must keep it")
    assert snapshot_of(run) == before  # nothing written, nothing moved


def test_a_resume_applies_and_records_each_changed_setting(fp16_run, tmp_path):
    run = _copy(fp16_run, tmp_path)
    out = ok(ag("train", "--resume", run / "checkpoints" / "step-00000005.pt",
                "--set", "optimizer.lr=0.001", "--set", "optimizer.weight_decay=0.1",
                "--set", "scaler.growth_interval=3", "--set", "max_norm=0.5", "--set", "log.every=2"))
    changes = {e["key"]: (e["old"], e["new"], e["step"]) for e in _policy_events(run)}
    # log.every is no policy: it changes nothing the run trains or decides
    assert changes == {"optimizer.lr": (0.003, 0.001, 5), "optimizer.weight_decay": (0.0, 0.1, 5),
                       "scaler.growth_interval": (2000, 3, 5), "max_norm": (1.0, 0.5, 5)}
    assert "POLICY 5 optimizer.lr 0.003 -> 0.001 from step 6" in out

    # applied, not only recorded: the LR, the clip, the optimizer's and the scaler's settings
    rows = {int(r["step"]): r for r in read_rows(run / "steps.csv")}
    assert {float(rows[s]["lr"]) for s in range(1, 6)} == {0.003}
    assert {float(rows[s]["lr"]) for s in range(6, 11)} == {0.001}
    assert all(float(rows[s]["grad_l2_post_clip"]) <= 0.5 + 1e-6 for s in range(6, 11) if rows[s]["skipped"] == "0")
    final = ckpt.load_checkpoint(run / "checkpoints" / "step-00000010.pt")
    group = final["optimizer"]["param_groups"][0]
    assert group["lr"] == 0.001 and group["weight_decay"] == 0.1
    assert final["state"]["scaler"]["growth_interval"] == 3
    assert final["scheduler"]["base_lrs"] == [0.001]
    assert [c["key"] for c in final[POLICY]] == sorted(changes, key=list(changes).index)

    row = _card_row(run, "policy changes on resume")
    assert "optimizer.lr 0.003 -> 0.001 from step 6" in row and "max_norm 1.0 -> 0.5 from step 6" in row


def test_a_resume_that_changes_the_scaler_settings_saves_them_in_the_scaler_and_its_config_alike(fp16_run, tmp_path):
    # review 54b: a resume refuses a checkpoint whose scaler state disagrees with its own config's scaler
    # settings; a changed setting is set in the scaler (apply_policy_changes), so a real run's agree
    run = _copy(fp16_run, tmp_path)
    ok(ag("train", "--resume", run / "checkpoints" / "step-00000005.pt", "--set", "scaler.backoff_factor=0.25",
          "--set", "scaler.growth_factor=4", "--set", "scaler.min_scale=2", "--set", "scaler.growth_interval=7"))
    final = ckpt.load_checkpoint(run / "checkpoints" / "step-00000010.pt")
    saved, config = final["state"]["scaler"], final["config"]["scaler"]
    assert [saved[k] for k in ("backoff_factor", "growth_factor", "min_scale", "growth_interval")] == [0.25, 4.0, 2.0, 7]
    assert all(saved[k] == config[k] for k in ("backoff_factor", "growth_factor", "min_scale", "growth_interval"))
    ok(ag("train", "--resume", run, "--set", "steps=12"))


def test_a_second_resume_keeps_the_first_ones_changes_on_the_card(fp16_run, tmp_path):
    run = _copy(fp16_run, tmp_path)
    ok(ag("train", "--resume", run / "checkpoints" / "step-00000005.pt", "--set", "optimizer.lr=0.001"))
    ok(ag("train", "--resume", run, "--set", "steps=12"))
    assert [(e["key"], e["step"]) for e in _policy_events(run)] == [("optimizer.lr", 5), ("steps", 10)]
    row = _card_row(run, "policy changes on resume")
    assert "optimizer.lr 0.003 -> 0.001 from step 6; steps 10 -> 12 from step 11" in row
    assert {float(r["lr"]) for r in read_rows(run / "steps.csv")[10:]} == {0.001}  # still the changed LR


def test_an_unchanged_resume_records_nothing(fp16_run, tmp_path):
    run = _copy(fp16_run, tmp_path)
    ok(ag("train", "--resume", run / "checkpoints" / "step-00000005.pt"))
    assert _policy_events(run) == []
    assert _card_row(run, "policy changes on resume") == "| policy changes on resume | none |"
    assert POLICY not in ckpt.load_checkpoint(run / "checkpoints" / "step-00000010.pt")


def test_a_scaler_setting_a_run_without_a_loss_scaler_ignores_is_not_recorded(tmp_path):
    # review 50e: a bf16 resume warned the settings were ignored, then wrote them as POLICY changes
    # (console, events.jsonl, the card, later checkpoints) while the scale stayed 1.0
    ok(train(tmp_path, "R", *BASE, "--set", "precision=bf16"))
    run = tmp_path / "R"
    result = ag("train", "--resume", run / "checkpoints" / "step-00000005.pt",
                "--set", "scaler.init_scale=1024", "--set", "scaler.growth_interval=10")
    out, err = ok(result), result[2]
    assert "scaler.init_scale, scaler.growth_interval ignored" in err
    assert not [line for line in out.splitlines() if line.startswith("POLICY")]
    assert _policy_events(run) == []
    assert _card_row(run, "policy changes on resume") == "| policy changes on resume | none |"


def test_a_rollback_to_a_checkpoint_older_than_the_change_keeps_the_new_setting(tmp_path):
    # resumed at step 4 with a new LR; the spike at 5 rolls back to step 4's checkpoint, which was
    # saved with the old LR: the new one must hold after the rollback too
    ok(train(tmp_path, "R", "--set", "task.name=linear", "--set", "device=cpu", "--set", "precision=bf16",
             "--set", "schedule.decay=constant", "--set", "checkpoint.every=2", "--set", "steps=8",
             "--set", "rollback.window=3", "--set", "rollback.triggers=[loss_spike]"))
    run = tmp_path / "R"
    out = ok(ag("train", "--resume", run / "checkpoints" / "step-00000004.pt", "--set", "optimizer.lr=0.001",
                "--set", "rollback.skip_batches=1", "--inject", "spike@5"))
    assert "ROLLBACK 5" in out and "rolled back to step-00000004.pt" in out
    assert {e["key"] for e in _policy_events(run)} == {"optimizer.lr", "rollback.skip_batches", "inject"}
    rows = {int(r["step"]): float(r["lr"]) for r in read_rows(run / "steps.csv")}
    assert [rows[s] for s in range(5, 9)] == [0.001] * 4


def test_loss_spike_turned_on_at_resume_gets_its_own_window(tmp_path):
    # review 58a: a run without the loss_spike trigger saves no spike window, yet a resume refused
    # any rollback.window: the trigger turned on at resume was stuck with the default 50 (never
    # full in a short run). With window 3 it judges from the fourth step after the resume.
    ok(train(tmp_path, "R", *BASE, "--set", "precision=bf16", "--set", "checkpoint.every=2", "--set", "checkpoint.keep=10"))
    run = tmp_path / "R"
    out = ok(ag("train", "--resume", run / "checkpoints" / "step-00000004.pt", "--set", "rollback.triggers=[loss_spike]",
                "--set", "rollback.window=3", "--set", "rollback.skip_batches=1", "--inject", "spike@8"))
    assert "POLICY 4 rollback.window 50 -> 3 from step 5" in out
    assert "ROLLBACK 8" in out and "rolled back to step-00000006.pt" in out
    # its window is in the checkpoints now: a later resume keeps it
    line = one_error_line(ag("train", "--resume", run / "checkpoints" / "step-00000008.pt", "--set", "rollback.window=4"))
    assert line == "ampguard: error: --resume: rollback.window was 3 in the checkpoint, now 4; a resumed run must keep it"


def test_docs_resume_table_decides_every_setting():
    text = (ROOT / "docs" / "resume.md").read_text(encoding="utf-8")
    table = text[text.index("## Changing settings on resume"):]
    named = set(re.findall(r"`([a-z0-9_.*]+)`", table))
    for key in RESUME_FIXED:
        assert key in named, key
    for section in POLICY_UNRECORDED:
        assert f"{section}.*" in named, section
    # every setting of the config tree is decided by a row: its own key or its section's `section.*`
    for key, value in Config().model_dump(mode="json").items():
        keys = [f"{key}.{sub}" for sub in value] if isinstance(value, dict) else [key]
        for k in keys:
            assert k in named or f"{k.split('.')[0]}.*" in named or k.split(".")[0] in named, k


def test_report_and_compare_replay_each_step_under_the_max_norm_it_ran_with(fp16_run, tmp_path):
    # review: after a resume that raised max_norm, `report` replayed every step under the final
    # max_norm (config.yaml's) and printed a clip rate the run card did not have
    run = _copy(fp16_run, tmp_path)
    before = read_rows(run / "steps.csv")
    clipped_before = sum(float(r["grad_l2_pre_clip"]) > 1.0 for r in before[:5] if r["skipped"] == "0")
    assert clipped_before > 0  # steps 1-5 ran under max_norm 1 and some were clipped
    ok(ag("train", "--resume", run / "checkpoints" / "step-00000005.pt", "--set", "max_norm=1e9"))
    card = _card_row(run, "clip rate (whole run)")
    assert f"({clipped_before} of 10 steps clipped: applied with pre-clip norm > max_norm)" in card
    rate = re.search(r"\| ([\d.]+) \(", card).group(1)
    out = ok(ag("report", run))
    assert f"clip rate {rate}," in out
    assert f"clip rate {rate}," in ok(ag("report", run, "--max-norm", "1e9"))  # --max-norm draws a line; the clip rate stays the run's
    other = _copy(fp16_run, tmp_path / "other")
    table = ok(ag("compare", run, other))
    row = next(line for line in table.splitlines() if line.startswith("| clip rate"))
    assert row.split("|")[2].strip().startswith(rate), row


def test_a_card_whose_resume_turned_clipping_off_keeps_the_steps_clipped_before(fp16_run, tmp_path):
    # review_session26: `--set max_norm=-1` (off) on resume made the card say "n/a (clipping off)" though
    # steps 1-5 were clipped; report said 0.5 and compare "1, off from step 6"
    run = _copy(fp16_run, tmp_path)
    clipped_before = sum(float(r["grad_l2_pre_clip"]) > 1.0 for r in read_rows(run / "steps.csv")[:5]
                         if r["skipped"] == "0")
    ok(ag("train", "--resume", run / "checkpoints" / "step-00000005.pt", "--set", "max_norm=-1"))
    card = _card_row(run, "clip rate (whole run)")
    assert f"({clipped_before} of 10 steps clipped: applied with pre-clip norm > max_norm)" in card, card
    rate = re.search(r"\| ([\d.]+) \(", card).group(1)
    assert f"clip rate {rate}," in ok(ag("report", run))
    # review_27e: the set-up row said "off" of a run clipped at 1 for its first 5 steps
    assert _card_row(run, "clipping") == "| clipping | global L2, max_norm 1, off from step 6 |"


def test_the_replay_drops_the_policy_changes_of_a_future_a_resume_abandoned(tmp_path):
    # review: max_norm 100 -> 0.01 at step 8, then a resume from step 4 at max_norm 100 trained 5..16 again
    # without the change; report and compare still applied it and read a clip rate the run card did not have
    base = [*BASE, "--set", "precision=fp32", "--set", "checkpoint.every=4", "--set", "checkpoint.keep=10"]
    ok(train(tmp_path, "p", *base, "--set", "steps=8", "--set", "max_norm=100"))
    run = tmp_path / "p"
    ok(ag("train", "--resume", run, "--set", "steps=16", "--set", "max_norm=0.01"))
    ok(ag("train", "--resume", run / "checkpoints" / "step-00000004.pt", "--set", "max_norm=100"))
    card = _card_row(run, "clip rate (whole run)")
    assert "(0 of 16 steps clipped: applied with pre-clip norm > max_norm)" in card  # max_norm 100 throughout the surviving run
    assert _card_row(run, "clipping") == "| clipping | global L2, max_norm 100 |"  # (the abandoned change gone)
    assert "clip rate 0.000," in ok(ag("report", run))


def test_a_longer_run_on_resume_says_where_the_stretched_schedule_puts_the_lr(tmp_path):
    # review_walk C3: steps 10 -> 20 stretches the decay, and the next step's LR jumped back up
    # (0.0007 -> 0.0016 in the walk's run) with only "steps 10 -> 20" said; on the fast path the
    # "before" was the last step's LR, not the next one's (review_session14 B6): both paths say the same
    lines = {}
    for fast in ("false", "true"):
        path = ["--set", f"fast={fast}"]
        ok(train(tmp_path, f"fast-{fast}", *BASE[:4], "--set", "schedule.decay=cosine", *BASE[6:],
                 "--set", "precision=bf16", *path))
        run = tmp_path / f"fast-{fast}"
        out = ok(ag("train", "--resume", run, "--set", "steps=20", *path))
        [lines[fast]] = [line for line in out.splitlines() if line.startswith("POLICY")]
        rows = read_rows(run / "steps.csv")
        last, after = float(rows[9]["lr"]), float(rows[10]["lr"])
        assert after > last  # (the stretched cosine is earlier in its decay at step 11)
        assert lines[fast].startswith("POLICY 10 steps 10 -> 20 from step 11 (the next step's LR ")
        said = [float(v) for v in lines[fast].rsplit("(the next step's LR ", 1)[1].rstrip(")").split(" -> ")]
        assert said[1] == pytest.approx(after, rel=1e-3)
    assert lines["true"] == lines["false"]


def test_a_schedule_change_that_leaves_the_lr_where_it_was_adds_no_note(tmp_path):
    # a warm-up then constant: steps 10 -> 20 moves nothing (the fast path said "0.0015 -> 0.00165")
    for fast in ("false", "true"):
        run = tmp_path / f"fast-{fast}"
        ok(train(tmp_path, f"fast-{fast}", *BASE, "--set", "precision=bf16", "--set", "fast=" + fast))
        out = ok(ag("train", "--resume", run, "--set", "steps=20", "--set", "fast=" + fast))
        assert "POLICY 10 steps 10 -> 20 from step 11\n" in out + "\n", out


def test_a_resume_that_makes_the_warm_up_longer_than_the_run_says_so_once(tmp_path):
    # review_session26: the warning was said only at a run's first start, not for a resume that set it
    base = [*BASE, "--set", "precision=fp32", "--set", "checkpoint.every=3"]
    code, out, err = ag("train", "--set", f"log.dir={tmp_path}", "--set", "log.name=w", *base, "--set", "steps=6",
                        "--set", "schedule.warmup=2")
    assert code == 0 and "never reaches optimizer.lr" not in err, err
    code, out, err = ag("train", "--resume", tmp_path / "w" / "checkpoints" / "step-00000003.pt",
                        "--set", "schedule.warmup=30")
    assert code == 0 and err.count("schedule.warmup 30 > steps 6: the learning rate never reaches optimizer.lr") == 1, err
    code, out, err = ag("train", "--resume", tmp_path / "w" / "checkpoints" / "step-00000006.pt", "--set", "steps=9")
    assert code == 0 and "never reaches" not in err, err  # (said by the resume that made it so, whose checkpoint this is)


def test_a_resume_that_ends_the_run_at_its_checkpoint_says_so_not_a_next_step(tmp_path):
    # review 52a: steps 20 -> 10 from step 10's checkpoint said "from step 11 (the next step's LR ...)",
    # on the console, in events.jsonl and on the card, of a step that never runs
    ok(train(tmp_path, "short", *BASE[:4], "--set", "schedule.decay=cosine", *BASE[6:], "--set", "precision=fp32",
             "--set", "steps=20", "--set", "checkpoint.every=10"))
    run = tmp_path / "short"
    out = ok(ag("train", "--resume", run / "checkpoints" / "step-00000010.pt", "--set", "steps=10"))
    [line] = [line for line in out.splitlines() if line.startswith("POLICY")]
    assert line == "POLICY 10 steps 20 -> 10: the run ends at step 10", line
    assert "| policy changes on resume | steps 20 -> 10: the run ends at step 10 |" in (run / "RUN.md").read_text()
