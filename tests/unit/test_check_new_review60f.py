"""Review 60f: RunPaths.check_new (train's look at the run folder before it builds anything)
refuses what RunPaths.new_run_dir refuses, in the same line, and raises nothing but that line."""
import os
import re

import pytest

from ampguard.config import validate
from ampguard.errors import InputError
from ampguard.run_folder import RunPaths


def _lines(log_dir, name=None):
    """check_new's refusal and new_run_dir's, each one line (or "ok")."""
    config = validate({"log": {"dir": str(log_dir), **({"name": name} if name else {})}})
    said = []
    for attempt in (RunPaths.check_new, lambda c: RunPaths.new_run_dir(c, lock=True)):
        try:
            attempt(config)
            said.append("ok")
        except InputError as err:
            said.append(re.sub(r"\d{8}-\d{6}", "STAMP", str(err)))
    return said


@pytest.mark.parametrize("name", ["a", None])
@pytest.mark.parametrize("link", ["nowhere", "loop"])
def test_a_link_on_the_way_that_leads_nowhere_is_refused_before_the_run_in_the_making_s_words(tmp_path, link, name):
    os.symlink(tmp_path / "missing" if link == "nowhere" else "loop", tmp_path / link)
    checked, made = _lines(tmp_path / link / "runs", name)
    why = "No such file or directory" if link == "nowhere" else "Too many levels of symbolic links"
    folder = f"{tmp_path}/{link}/runs/{name or 'STAMP'}"
    assert checked == made == f"cannot create run folder {folder}: {why}"


def test_a_generated_name_s_refusal_names_a_timestamp_as_the_making_does(tmp_path):
    (tmp_path / "a-file").write_text("")
    checked, made = _lines(tmp_path / "a-file" / "runs")
    assert checked == made == f"cannot create run folder {tmp_path}/a-file/runs/STAMP: Not a directory"


def test_a_log_dir_whose_look_fails_is_one_line_not_an_os_error(tmp_path):
    # (a name longer than NAME_MAX right under a folder that is there: the look at log.name's folder
    # raised ENAMETOOLONG, a traceback of the library's, rank 0's alone under torchrun)
    log_dir = tmp_path / ("y" * 256)
    checked, made = _lines(log_dir, "a")
    assert checked == made == f"cannot create run folder {log_dir}/a: File name too long"
    assert list(tmp_path.iterdir()) == []
