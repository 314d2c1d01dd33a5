"""Review 39a, the config tree and the faults: a long fault spec is cut short in every refusal
(item 2), a ``#`` in a ``--set`` value is told what keeps the setting valid (item 3), a built-in
task too large for memory names the settings it reads (item 4), and ``<<: *base`` is named a
merge key (item 5). The command line's side is ``tests/e2e/test_cli_review39.py``."""

from __future__ import annotations

import pytest

from ampguard.config import apply_overrides, load_config, read_file, validate
from ampguard.errors import ConfigError, InputError, has_control
from ampguard.faults import check_ranks, check_steps, parse_fault, parse_faults
from ampguard.tasks import build_task

ALLOCATOR = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried "
             "to allocate 8000000000000 bytes. Error code 12 (Cannot allocate memory)")
"""What the CPU allocator raises for a tensor too large (a RuntimeError), without allocating it."""

# ---------------------------------------------------------------------------- item 2: a long fault spec


@pytest.mark.parametrize("spec", ["nan_loss@" + "9" * 5000, "k" * 5000 + "@3", "k" * 5000,
                                  "nan_loss@3@rank" + "9" * 5000, "nan_loss@3@rankx" + "x" * 5000,
                                  "nan_loss@every:" + "x" * 5000])
def test_a_long_fault_spec_is_cut_short_in_its_refusal(spec):
    with pytest.raises(ValueError) as caught:
        parse_fault(spec)
    said = str(caught.value)
    assert len(said) < 300 and "\n" not in said and "..." in said, said[:400]
    assert "Exceeds the limit" not in said  # (int()'s own words named no fault)


def test_a_fault_that_never_fires_is_cut_short_too():
    far = parse_fault("nan_loss@" + "9" * 4000)  # (a step number int() still reads)
    with pytest.raises(ValueError, match=r"^fault 'nan_loss@999.*\.\.\..*999' never fires: the run has 5 steps") as caught:
        check_steps([far], steps=5)
    assert len(str(caught.value)) < 400
    with pytest.raises(ValueError) as caught:
        check_steps([parse_fault("nan_loss@" + ",".join(str(s) for s in range(1, 3000)))], steps=8, start=5000)
    assert len(str(caught.value)) < 300 and "never fires: the run resumes after step 4999" in str(caught.value)
    with pytest.raises(ValueError) as caught:
        check_ranks([parse_fault("nan_loss@" + ",".join(str(s) for s in range(1, 3000)) + "@rank3")], world_size=1)
    assert len(str(caught.value)) < 300 and "targets rank 3" in str(caught.value)
    with pytest.raises(InputError) as caught:
        parse_faults(["spike@" + "9" * 4000], seed=0, steps=5)
    assert len(str(caught.value)) < 400 and str(caught.value).startswith("inject: fault 'spike@999")


@pytest.mark.parametrize("item", ["inject=[nan_loss@" + "9" * 5000 + "]", "inject=[" + "k" * 5000 + "@3]",
                                  'inject=[nan_loss@3, "nan_loss@3,' + "x" * 5000 + '"]'])
def test_a_long_fault_spec_in_the_config_is_cut_short(item):
    with pytest.raises(ConfigError) as caught:
        load_config(None, [item])
    assert len(str(caught.value)) < 300 and "\n" not in str(caught.value), str(caught.value)[:400]


def test_a_short_fault_spec_is_still_shown_whole():
    with pytest.raises(ValueError, match=r"^unknown fault kind 'bogus' in 'bogus@5' \(kinds: "):
        parse_fault("bogus@5")
    with pytest.raises(ValueError, match=r"^bad rank in fault 'nan_loss@5@rankx': use @rankR after WHEN, "
                                         r"e\.g\. nan_loss@5@rank1$"):
        parse_fault("nan_loss@5@rankx")
    assert parse_fault("nan_loss@5@rank0000000000000000000000001").rank == 1  # (a rank is its number)


# ---------------------------------------------------------------------------- item 3: '#' in a --set value


def _refusal(item: str) -> str:
    with pytest.raises(ConfigError) as caught:
        apply_overrides({}, [item])
    said = str(caught.value)
    assert "\n" not in said and " is a YAML comment there, which would be dropped: " in said
    return said.partition("which would be dropped: ")[2]


@pytest.mark.parametrize("item, fixed", [("optimizer.lr=1e-3 # from the paper", "optimizer.lr=1e-3"),
                                         ("steps=10 #ten", "steps=10"), ("precision=fp16 # fast", "precision=fp16"),
                                         ("compile=true # on a GPU", "compile=true"),
                                         ("inject=[nan_loss@2] # the usual", "inject=[nan_loss@2]"),
                                         ("log.wandb.tags=[a, b] # c", "log.wandb.tags=[a, b]")])
def test_a_comment_after_a_setting_that_is_not_text_is_told_to_go(item, fixed):
    advice = _refusal(item)
    assert "quote" not in advice and advice.endswith(f"leave the comment out ({fixed})"), advice
    validate(apply_overrides({}, [fixed]))  # (the advice taken: valid)


def test_quoting_a_number_setting_as_it_was_told_was_refused_next():
    # (the advice before: quote it, then "expected a number, got the text")
    advice = _refusal("optimizer.lr=1e-3 # from the paper")
    assert "optimizer.lr is not text" in advice


@pytest.mark.parametrize("item, fixed", [("task.options.s='a' #b", "task.options.s='a'"),
                                         ('log.name="exp" #3', 'log.name="exp"')])
def test_a_quoted_value_with_a_comment_is_not_told_to_quote_its_quotes(item, fixed):
    advice = _refusal(item)
    assert advice == f"the value is quoted already, so leave the comment out ({fixed})"
    validate(apply_overrides({}, [fixed]))


@pytest.mark.parametrize("item, quoted", [("log.name=exp #3", 'log.name="exp #3"'), ("log.name=#3", 'log.name="#3"'),
                                          ("log.wandb.name=a #b", 'log.wandb.name="a #b"'),
                                          ("log.mlflow.tags.t=a #b", 'log.mlflow.tags.t="a #b"'),
                                          ("task.options.note=a #b", 'task.options.note="a #b"')])
def test_a_text_setting_is_still_told_to_quote_it(item, quoted):
    advice = _refusal(item)
    assert advice.startswith("quote the value to keep it") and f"({quoted})" in advice, advice
    validate(apply_overrides({}, [quoted]))


def test_a_free_form_option_is_told_both_ways():
    advice = _refusal("task.options.n=3 # three")
    assert advice == ('quote the value to keep it as text (task.options.n="3 # three"), or leave the comment out '
                      "(task.options.n=3)")


def test_a_setting_that_is_all_comment_is_asked_for_a_value():
    assert _refusal("steps=#3") == "give steps a value without a comment"


# ---------------------------------------------------------------------------- item 4: out of memory


def _out_of_memory(*args, **kwargs):
    raise RuntimeError(ALLOCATOR)


@pytest.mark.parametrize("name, keys", [("digits", "task.n_embd"),
                                        ("charlm", "task.n_embd, task.n_layer or task.block_size")])
def test_a_model_too_large_names_the_settings_its_task_reads(monkeypatch, name, keys):
    monkeypatch.setattr(f"ampguard.tasks.{name}.build", _out_of_memory)
    with pytest.raises(InputError) as caught:
        build_task(load_config(None, [f"task.name={name}"]))
    assert str(caught.value) == (f"task {name}: its model does not fit in memory at these sizes (one tensor of "
                                 f"7450.6 GiB); give smaller {keys}")


@pytest.mark.parametrize("name, stream, keys", [("linear", "linear_batches", "task.batch_size"),
                                                ("charlm", "char_batches", "task.batch_size or task.block_size")])
def test_a_batch_too_large_names_the_batch_size(monkeypatch, name, stream, keys):
    overrides = [f"task.name={name}", "task.batch_size=1000000000"]
    if name == "charlm":
        overrides += ["task.n_layer=1", "task.n_embd=8", "task.n_head=1", "task.block_size=8", "eval.batches=1"]
    task = build_task(load_config(None, overrides))
    monkeypatch.setattr(f"ampguard.tasks.{name}.{stream}", _out_of_memory)  # (after the build: its held-out set too)
    expected = (f"task {name}: its batches do not fit in memory at these sizes (one tensor of 7450.6 GiB); "
                f"give smaller {keys}")
    for read in (lambda: next(task.batches()), lambda: next(task.stream(3))):
        with pytest.raises(InputError) as caught:
            read()
        assert str(caught.value) == expected and caught.value.key == "task.batch_size"


def test_another_error_of_the_data_is_its_own(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("size mismatch")
        yield  # pragma: no cover

    task = build_task(load_config(None, ["task.name=linear"]))
    monkeypatch.setattr("ampguard.tasks.linear.linear_batches", broken)
    with pytest.raises(RuntimeError, match="^size mismatch$"):
        next(task.batches())


def test_the_built_in_streams_are_as_before():
    task = build_task(load_config(None, ["task.name=linear", "task.batch_size=3"]))
    first = [next(iter(task.batches())) for _ in range(2)]
    later = next(task.stream(1))
    stream = task.batches()
    next(stream)
    assert all(a.equal(b) for a, b in zip(first[0], first[1])) and all(a.equal(b) for a, b in zip(next(stream), later))


# ---------------------------------------------------------------------------- item 5: `<<: *base`


@pytest.mark.parametrize("text, line", [("base: &b {lr: 0.01}\noptimizer:\n  <<: *b\n", 3),
                                        ("a: &a {lr: 1}\nb: &b {eps: 1}\noptimizer:\n  <<: [*a, *b]\n", 4),
                                        ("optimizer:\n  <<: &b {lr: 1}\n", 2)])
def test_the_usual_merge_of_an_anchor_is_named_a_merge_key(tmp_path, text, line):
    (tmp_path / "c.yaml").write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        read_file(tmp_path / "c.yaml")
    assert str(caught.value) == (f"config file {tmp_path / 'c.yaml'}: cannot parse: YAML merge keys (<<) are not "
                                 f"supported (line {line}): write the keys out")


def test_an_alias_elsewhere_is_still_named_an_alias(tmp_path):
    (tmp_path / "c.yaml").write_text("task:\n  options: &o {a: 1}\nlog: {name: *o}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"cannot parse: aliases \(\*name\) are not allowed in a config \(line 3\)$"):
        read_file(tmp_path / "c.yaml")
    assert validate(apply_overrides({}, ["log.name=<<"])).log.name == "<<"  # (a value `<<` is text)


# ---------------------------------------------------------------------------- review 39g


def test_visible_format_characters_of_real_scripts_are_names_and_hidden_tag_text_is_not():
    # Mongolian spelling's vowel separator, a hieroglyph's joiner, a shorthand's overlap: shown
    for name in ("\u182c\u1820\u1837\u180e\u1820", "\U00013000\U00013430\U00013001", "\U0001bc00\U0001bca0"):
        assert not has_control(name), ascii(name)
    # text hidden in tag characters behind a black flag is no flag
    hidden = "run\U0001f3f4" + "".join(chr(0xE0000 + ord(c)) for c in "SECRET") + "\U000e007f"
    assert has_control(hidden)


def test_a_rank_of_leading_zeros_is_read_not_refused_in_pythons_words():
    assert parse_fault("nan_loss@5@rank" + "0" * 5000 + "1").rank == 1


def test_a_comment_after_a_list_settings_one_item_is_told_the_list_that_loads():
    with pytest.raises(ConfigError) as err:
        apply_overrides({}, ["inject=nan_loss@5 #x"])
    assert str(err.value).endswith("leave the comment out (inject=[nan_loss@5])")
    assert apply_overrides({}, ["inject=[nan_loss@5]"]) == {"inject": ["nan_loss@5"]}
