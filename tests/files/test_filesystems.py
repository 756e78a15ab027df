"""statfs decides, per inbox, between inotify and polling (a fake statfs at the boundary; the
real forced polling runs end to end in tests/test_inputs_e2e.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from inboxd.files.filesystems import plan_watch, statfs_type

FUSE, NFS, CIFS, NINE_P, EXT4 = 0x65735546, 0x6969, 0xFF534D42, 0x01021997, 0xEF53


@pytest.mark.parametrize(("magic", "name"), [(FUSE, "fuse"), (NFS, "nfs"), (CIFS, "cifs"),
                                             (NINE_P, "9p")])
def test_auto_polls_network_and_fuse_mounts(tmp_path: Path, magic: int, name: str) -> None:
    plan = plan_watch(tmp_path, "auto", statfs=lambda _: magic)
    assert plan.polling and plan.filesystem == name


def test_auto_trusts_inotify_on_a_local_filesystem_and_the_modes_override(tmp_path: Path) -> None:
    assert not plan_watch(tmp_path, "auto", statfs=lambda _: EXT4).polling
    assert plan_watch(tmp_path, "always", statfs=lambda _: EXT4).polling
    assert not plan_watch(tmp_path, "never", statfs=lambda _: FUSE).polling


def test_an_inbox_not_created_yet_is_judged_by_the_folder_it_will_be_made_in(
    tmp_path: Path,
) -> None:
    asked: list[Path] = []
    plan_watch(tmp_path / "a" / "b", "auto", statfs=lambda p: asked.append(p) or EXT4)
    assert asked == [tmp_path]


def test_the_real_statfs_reads_this_machines_filesystem(tmp_path: Path) -> None:
    assert statfs_type(tmp_path) not in (0, FUSE)
    assert statfs_type(Path("/proc")) == 0x9FA0  # PROC_SUPER_MAGIC
