"""The memory a bring-your-own ``.onnx`` may take in its probe: the machine's MemAvailable,
and below it the memory cgroup's room (v1 and v2), read from a fake /proc and cgroup tree."""

from __future__ import annotations

from pathlib import Path

import pytest
from inboxd.models.onnx_probe import memory_headroom_bytes

GIB = 1 << 30


def fake_proc(root: Path, available_kib: int, cgroup_line: str) -> Path:
    proc = root / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {available_kib} kB\n")
    (proc / "self" / "cgroup").write_text(cgroup_line + "\n")
    return proc


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_the_cgroup_limit_bounds_the_headroom_with_its_file_cache_counted_free(
        tmp_path: Path, version: str) -> None:
    cgroups = tmp_path / "cgroup"
    if version == "v1":
        proc = fake_proc(tmp_path, 16 * GIB // 1024, "4:memory:/inboxd.service")
        folder = cgroups / "memory" / "inboxd.service"
        folder.mkdir(parents=True)
        (folder / "memory.limit_in_bytes").write_text(str(8 * GIB))
        (folder / "memory.usage_in_bytes").write_text(str(7 * GIB))
        (folder / "memory.stat").write_text(f"cache 5\ntotal_inactive_file {GIB}\n")
    else:
        proc = fake_proc(tmp_path, 16 * GIB // 1024, "0::/system.slice/inboxd.service")
        folder = cgroups / "system.slice" / "inboxd.service"
        folder.mkdir(parents=True)
        (folder / "memory.max").write_text(f"{8 * GIB}\n")
        (folder / "memory.current").write_text(str(7 * GIB))
        (folder / "memory.stat").write_text(f"anon 5\ninactive_file {GIB}\n")
    assert memory_headroom_bytes(proc, cgroups) == 2 * GIB  # 8 - 7 + 1 reclaimable


def test_without_a_limit_or_a_readable_cgroup_the_machine_s_figure_stands(
        tmp_path: Path) -> None:
    cgroups = tmp_path / "cgroup"
    proc = fake_proc(tmp_path, 3 * GIB // 1024, "0::/user.slice")
    (cgroups / "user.slice").mkdir(parents=True)
    (cgroups / "user.slice" / "memory.max").write_text("max\n")
    assert memory_headroom_bytes(proc, cgroups) == 3 * GIB
    proc = fake_proc(tmp_path / "b", 3 * GIB // 1024, "0::/nowhere")
    assert memory_headroom_bytes(proc, cgroups) == 3 * GIB
