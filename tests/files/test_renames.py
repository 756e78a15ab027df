"""No rename may replace a different file, and a taken name always has a next free one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from inboxd.files import renames
from inboxd.files.names import NAME_MAX_BYTES
from inboxd.files.renames import name_variants, place, rename_noreplace


def test_rename_noreplace_refuses_a_taken_name_and_keeps_both_files(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"first")
    (tmp_path / "b").write_bytes(b"second")
    with pytest.raises(FileExistsError):
        rename_noreplace(tmp_path / "b", tmp_path / "a")
    assert (tmp_path / "a").read_bytes() == b"first"
    assert (tmp_path / "b").read_bytes() == b"second"


def test_a_link_at_the_target_is_a_taken_name_not_a_way_through(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.write_bytes(b"theirs")
    (tmp_path / "link").symlink_to(outside)
    (tmp_path / "mine").write_bytes(b"mine")
    with pytest.raises(FileExistsError):
        rename_noreplace(tmp_path / "mine", tmp_path / "link")
    assert outside.read_bytes() == b"theirs"


def test_the_link_fallback_never_replaces_either(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Filesystems without RENAME_NOREPLACE (some FUSE/NFS) take the link + unlink path."""
    monkeypatch.setattr(renames, "_renameat2", None)
    (tmp_path / "a").write_bytes(b"first")
    (tmp_path / "b").write_bytes(b"second")
    with pytest.raises(FileExistsError):
        rename_noreplace(tmp_path / "b", tmp_path / "a")
    rename_noreplace(tmp_path / "b", tmp_path / "c")
    assert (tmp_path / "c").read_bytes() == b"second" and not (tmp_path / "b").exists()


def test_name_variants_are_distinct_within_name_max_and_end() -> None:
    """Distinct names up to MAX_NAME_VARIANTS, then no more: a loop over them always ends
    (it did not, and a name no variant could take made the commit spin for ever)."""
    seen = set()
    for name in name_variants("scan.jpg", "0123456789ab"):
        assert len(os.fsencode(name)) <= NAME_MAX_BYTES
        seen.add(name)
    assert len(seen) == renames.MAX_NAME_VARIANTS
    first = list(zip(name_variants("scan.jpg", "tok"), range(3), strict=False))
    assert [n for n, _ in first] == ["scan.jpg", "scan.tok.jpg", "scan.tok.1.jpg"]
    long_name = "x" * 250 + ".jpg"
    assert all(len(os.fsencode(n)) <= NAME_MAX_BYTES
               for n, _ in zip(name_variants(long_name, "tok"), range(5), strict=False))


def test_place_takes_the_first_free_variant_however_many_are_taken(tmp_path: Path) -> None:
    """Many taken names are skipped (the bound is far above them: the variants themselves are
    checked to it above; creating that many files is slow)."""
    taken = list(zip(name_variants("scan.jpg", "tok"), range(1_201), strict=False))
    for name, _ in taken:
        (tmp_path / name).write_bytes(b"earlier")
    (tmp_path / "new").write_bytes(b"new")
    where = Path(place(tmp_path / "new", tmp_path / "scan.jpg", "tok"))
    assert where.name == "scan.tok.1200.jpg"
    assert where.read_bytes() == b"new"
    assert all((tmp_path / n).read_bytes() == b"earlier" for n, _ in taken)


def test_a_name_whose_extension_alone_is_too_long_still_fits() -> None:
    """A variant of a name with a ~250-byte extension used to come out over NAME_MAX, so
    every free-name search ended in ENAMETOOLONG."""
    name = "a." + "x" * 250
    for variant, _ in zip(name_variants(name, "0123456789ab"), range(3), strict=False):
        assert len(os.fsencode(variant)) <= NAME_MAX_BYTES
