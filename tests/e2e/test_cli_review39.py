"""Review 39a on the command line: a run's ``config.yaml`` whose ``log.name`` or ``log.dir`` holds
a NUL is refused naming the file, not a traceback (item 1); a long ``--inject`` spec is cut short
(item 2); a ``#`` after a number setting is told to go, not to be quoted (item 3); a built-in
task's batch too large for memory names ``task.batch_size`` (item 4); ``<<: *base`` is named a
merge key (item 5). The config tree's side is ``tests/unit/test_config_review39.py``."""

from __future__ import annotations

import pytest

from helpers import snapshot_of

L = ["--set", "task.name=linear", "--set", "steps=2", "--set", "precision=fp32", "--set", "log.plot=false",
     "--set", "eval.enabled=false"]


def _one_line(err: str) -> str:
    assert err.count("\n") == 1 and err.startswith("ampguard: error: "), err[:400]
    return err.removeprefix("ampguard: error: ").rstrip("\n")


# ---------------------------------------------------------------------------- item 1


@pytest.mark.parametrize("saved, edited, said", [
    ("  name: n\n", '  name: "a\\0b"\n', "log.name: must be a plain folder name (got 'a\\x00b')"),
    ("  dir: runs\n", '  dir: "ru\\0ns"\n', "log.dir: holds a control character (got 'ru\\x00ns')"),
    ("  name: n\n", '  name: "a\\tb"\n', "log.name: must be a plain folder name (got 'a\\tb')")])
def test_a_resume_whose_config_yaml_holds_a_nul_in_log_is_one_line(cli, tmp_path, saved, edited, said):
    code, _, err = cli("train", *L, "--set", "log.name=n")
    assert code == 0, err
    path = tmp_path / "runs" / "n" / "config.yaml"
    text = path.read_text(encoding="utf-8")
    assert saved in text
    path.write_text(text.replace(saved, edited, 1), encoding="utf-8")
    before = snapshot_of(tmp_path)
    code, out, err = cli("train", "--resume", "runs/n", "--set", "steps=3")  # (a traceback: embedded null byte)
    assert (code, out) == (2, "")
    assert _one_line(err) == f"config file runs/n/config.yaml: config: {said}"
    assert snapshot_of(tmp_path) == before  # nothing written, nothing changed


def test_a_resume_whose_set_mends_a_nul_in_log_name_goes_on(cli, tmp_path):
    code, _, err = cli("train", *L, "--set", "log.name=n")
    assert code == 0, err
    path = tmp_path / "runs" / "n" / "config.yaml"
    path.write_text(path.read_text(encoding="utf-8").replace("  name: n\n", '  name: "a\\0b"\n'), encoding="utf-8")
    code, _, err = cli("train", "--resume", "runs/n", "--set", "steps=3", "--set", "log.name=n")
    assert code == 0, err
    assert "  name: n\n" in path.read_text(encoding="utf-8")


def test_a_resume_of_a_moved_run_folder_still_trains_in_it(cli, tmp_path):
    code, _, err = cli("train", *L, "--set", "log.name=n")
    assert code == 0, err
    (tmp_path / "runs" / "n").rename(tmp_path / "runs" / "moved")
    code, _, err = cli("train", "--resume", "runs/moved", "--set", "steps=3")
    assert code == 0, err
    assert "  name: moved\n" in (tmp_path / "runs" / "moved" / "config.yaml").read_text(encoding="utf-8")


# ---------------------------------------------------------------------------- item 2


@pytest.mark.parametrize("argv", [["--inject", "nan_loss@" + "9" * 5000], ["--inject", "k" * 5000 + "@3"],
                                  ["--set", "inject=[" + "k" * 5000 + "@3]"],
                                  ["--set", "inject=[nan_loss@" + "9" * 5000 + "]"],
                                  ["--inject", "spike@" + "9" * 4000],
                                  ["--inject", "none", "--inject", "spike@" + "9" * 4000]])
def test_a_long_fault_spec_is_cut_short(cli, tmp_path, argv):
    code, out, err = cli("train", *L, *argv)
    assert (code, out) == (2, "")
    said = _one_line(err)
    assert len(said) < 300 and "..." in said, len(said)
    assert list(tmp_path.iterdir()) == []


def test_a_short_fault_spec_is_still_named_whole(cli, tmp_path):
    code, _, err = cli("train", *L, "--inject", "inf_grad@6")
    assert code == 2 and _one_line(err).startswith("inject: fault 'inf_grad@6' never fires: the run has 2 steps")


# ---------------------------------------------------------------------------- item 3


def test_a_comment_after_a_number_is_told_to_go_and_that_advice_runs(cli, tmp_path):
    code, out, err = cli("train", *L, "--set", "optimizer.lr=1e-3 # from the paper", "--print-config")
    assert (code, out) == (2, "")
    assert _one_line(err) == ("--set optimizer.lr: '# from the paper' is a YAML comment there, which would be dropped: "
                              "optimizer.lr is not text, so leave the comment out (optimizer.lr=1e-3)")
    code, out, err = cli("train", *L, "--set", "optimizer.lr=1e-3", "--print-config")  # (the advice, taken)
    assert code == 0 and "lr: 0.001" in out, err


def test_a_quoted_option_with_a_comment_is_not_told_to_quote_it_again(cli, tmp_path):
    code, _, err = cli("train", *L, "--set", "task.options.s='a' #b", "--print-config")
    assert code == 2
    assert _one_line(err) == ("--set task.options.s: '#b' is a YAML comment there, which would be dropped: the value "
                              "is quoted already, so leave the comment out (task.options.s='a')")


# ---------------------------------------------------------------------------- item 4


def test_a_batch_too_large_for_memory_names_task_batch_size(cli, tmp_path, monkeypatch):
    def too_large(*args, **kwargs):  # (the CPU allocator's refusal, without allocating anything)
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                           "memory: you tried to allocate 64000000000 bytes. Error code 12 (Cannot allocate memory)")

    from ampguard.tasks import linear

    made = linear.linear_batches
    # (the held-out set is two batches of 256, drawn at build: only the training stream is too large)
    monkeypatch.setattr(linear, "linear_batches", lambda seed, batch_size, *args, **kwargs: too_large() if
                        batch_size == 1_000_000_000 else made(seed, batch_size, *args, **kwargs))
    code, out, err = cli("train", *L, "--set", "task.batch_size=1e9", "--set", "log.name=big")
    assert (code, out) == (2, "")
    assert _one_line(err) == ("task linear: its batches do not fit in memory at these sizes (one tensor of 59.6 GiB); "
                              "give smaller task.batch_size")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------- item 5


def test_the_usual_merge_key_in_a_file_is_named_a_merge_key(cli, tmp_path):
    (tmp_path / "c.yaml").write_text("base: &base {lr: 0.01}\noptimizer:\n  <<: *base\n", encoding="utf-8")
    code, _, err = cli("train", "c.yaml", "--print-config")
    assert code == 2
    assert _one_line(err) == ("config file c.yaml: cannot parse: YAML merge keys (<<) are not supported (line 3): "
                              "write the keys out")
