"""Config: defaults, validation with YAML line numbers, exit status 78."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from inboxd.config import DEFAULT_CONFIG_PATH, ConfigError, load_config, parse_config
from inboxd.exit_codes import EX_CONFIG
from inboxd.files.layout import processing_dir


def test_embedded_default_is_valid_and_resolves_under_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    config = load_config(DEFAULT_CONFIG_PATH)
    assert config.inbox.paths == [tmp_path / "var" / "inbox"]
    assert config.results_dir == tmp_path / "var" / "results"
    assert config.capacity.queue == 1
    assert processing_dir(config, config.inbox.paths[0]) == (
        tmp_path / "var" / "inbox" / ".processing" / "default"
    )


def test_every_error_is_reported_with_its_line_and_key_path() -> None:
    text = """\
inbox:
  paths: [in]
  settle_ms: -5
capacity:
  queue: 0
  event_bufer: 10
batch:
  max_size: many
"""
    with pytest.raises(ConfigError) as caught:
        parse_config(text, "bad.yaml")
    problems = caught.value.problems
    assert len(problems) == 4, problems
    joined = "\n".join(problems)
    assert "line 3: inbox.settle_ms" in joined
    assert "line 5: capacity.queue" in joined
    assert "line 6: capacity.event_bufer: Extra inputs are not permitted" in joined
    assert "line 8: batch.max_size" in joined
    assert str(caught.value).startswith("bad.yaml: line")


def test_yaml_syntax_error_names_the_line() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config("inbox:\n  paths: [a\nqueue: 1\n", "broken.yaml")
    assert "line " in caught.value.problems[0]
    assert "invalid YAML" in caught.value.problems[0]


def test_several_inboxes_need_distinct_folder_names() -> None:
    with pytest.raises(ConfigError, match="distinct folder names"):
        parse_config("inbox: {paths: [a/in, b/in]}", "x.yaml")


@pytest.mark.daemon
@pytest.mark.slow
@pytest.mark.parametrize("command", ["check-config", "run", "once"])
def test_bad_config_exits_78_with_line_numbers(tmp_path: Path, command: str) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("capacity:\n  queue: -1\nsurprise: true\n")
    done = subprocess.run([sys.executable, "-m", "inboxd", command, "-c", str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == EX_CONFIG
    assert "line 2: capacity.queue" in done.stderr
    assert "line 3: surprise" in done.stderr


@pytest.mark.daemon
def test_missing_config_file_is_a_config_error(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "inboxd", "check-config", "-c",
                           str(tmp_path / "nope.yaml")], capture_output=True, text=True)
    assert done.returncode == EX_CONFIG
    assert "cannot read the config file" in done.stderr


@pytest.mark.daemon
def test_check_config_accepts_the_embedded_default() -> None:
    done = subprocess.run([sys.executable, "-m", "inboxd", "check-config"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "OK" in done.stdout


def test_errors_come_in_the_files_order_with_did_you_mean_for_a_misspelt_key() -> None:
    text = "model:\n  devcie: cpu\ninbox:\n  setle_ms: 3\nbatchh: 1\nxmp:\n  min_scor: 0.3\n"
    with pytest.raises(ConfigError) as caught:
        parse_config(text, "typos.yaml")
    assert caught.value.problems == [
        "line 2: model.devcie: Extra inputs are not permitted; did you mean device?",
        "line 4: inbox.setle_ms: Extra inputs are not permitted; did you mean settle_ms?",
        "line 5: batchh: Extra inputs are not permitted; did you mean batch?",
        "line 7: xmp.min_scor: Extra inputs are not permitted; did you mean min_score?"]


def test_a_yaml_syntax_error_is_one_readable_line() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config("inbox:\n  paths: [a\n  b: c\n", "broken.yaml")
    message = str(caught.value)
    assert message.startswith("broken.yaml: line 3, column 4: invalid YAML: expected ',' or "
                              "']', but got ':' (while parsing a flow sequence)"), message
    assert "\n" not in message and "\\x0a" not in message


@pytest.mark.daemon
@pytest.mark.parametrize("command", ["check-config", "run"])
def test_an_inbox_that_does_not_exist_is_exit_78_naming_it(tmp_path: Path,
                                                          command: str) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(f"inbox: {{paths: [{tmp_path / 'inbx'}]}}\nresults_dir: {tmp_path}/r\n"
                      f"done_dir: {tmp_path}/d\nfailed_dir: {tmp_path}/f\n")
    done = subprocess.run([sys.executable, "-m", "inboxd", command, "-c", str(config)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == EX_CONFIG, done.stderr
    assert f"inbox.paths[0]: {tmp_path / 'inbx'} does not exist; create it" in done.stderr
    assert not (tmp_path / "inbx").exists(), "not made: a typo must not become a folder"


@pytest.mark.daemon
def test_check_config_into_a_closed_pipe_prints_no_traceback() -> None:
    # `true` exits at once without reading: every write of check-config meets a closed pipe.
    done = subprocess.run(f"{sys.executable} -m inboxd check-config | true", shell=True,
                          capture_output=True, text=True, timeout=60)
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
