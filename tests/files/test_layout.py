"""Layouts that would loop or destroy are refused before anything is touched (exit 78)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from inboxd.config import ConfigError
from inboxd.files.layout import load_checked_config

from tests.conftest import make_image, write_config


def problems(tmp_path: Path, **sections: Any) -> str:
    with pytest.raises(ConfigError) as refused:
        load_checked_config(write_config(tmp_path, **sections))
    return str(refused.value)


def test_output_folders_inside_or_equal_to_an_inbox_are_refused(tmp_path: Path) -> None:
    inbox = tmp_path / "inbox"
    assert "failed_dir" in problems(tmp_path, failed_dir=str(inbox / "failed"))
    assert "results_dir" in problems(tmp_path, results_dir=str(inbox))
    assert "inside results_dir" in problems(tmp_path, results_dir=str(tmp_path))
    assert "same folder as done_dir" in problems(tmp_path, failed_dir=str(tmp_path / "done"))


def test_an_output_folder_reached_through_a_link_is_still_inside(tmp_path: Path) -> None:
    (tmp_path / "inbox").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "inbox")
    assert "done_dir" in problems(tmp_path, done_dir=str(tmp_path / "alias" / "done"))


def test_instance_names_must_be_plain(tmp_path: Path) -> None:
    for name in ("..", ".", ".hidden", "a/b"):
        assert "instance" in problems(tmp_path, instance=name)


def test_an_inbox_that_is_a_file_and_patterns_that_never_match(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a folder")
    assert "not a folder" in problems(
        tmp_path, inbox={"paths": [str(tmp_path / "a-file")]})
    said = problems(tmp_path, inbox={"include": ["*.jpg", "*.tmp", "photos/*.png", ".*.jpg"]})
    assert "include[1]" in said and "include[2]" in said and "include[3]" in said
    assert "include[0]" not in said


@pytest.mark.daemon
@pytest.mark.slow
def test_check_config_and_start_up_refuse_with_78_and_touch_nothing(tmp_path: Path) -> None:
    """The `instance: ..` config once made start-up empty results/ and failed/."""
    config = write_config(tmp_path, instance="..")
    make_image(tmp_path / "results" / "keep-me.png")
    for command in ("check-config", "once"):
        done = subprocess.run([sys.executable, "-m", "inboxd", command, "-c", str(config)],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert done.returncode == 78, done.stderr
        assert "instance" in done.stderr
    assert (tmp_path / "results" / "keep-me.png").exists()
