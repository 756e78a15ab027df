"""Which names are taken, and what the log says about each one that is not."""

from __future__ import annotations

import pytest
from inboxd.decode import formats
from inboxd.files.names import NameFilter, folder_skipped, portable_key, portable_name


def test_the_default_takes_every_decodable_format_in_any_case() -> None:
    names = NameFilter(None)
    for fmt in formats.decodable():
        for ext in fmt.extensions:
            assert names.wanted(f"IMG_0001{ext.upper()}"), ext
            assert names.wanted(f"photo{ext}"), ext
    decodable = {fmt.pillow for fmt in formats.decodable()}
    # What this build must decode: Pillow's own codecs and pillow-heif, a runtime dependency.
    assert {"JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF", "AVIF", "HEIF"} <= decodable


@pytest.mark.parametrize(("name", "says"), [
    ("notes.txt", "add `*.txt` to inbox.include"),
    ("photo.xyz", "add `*.xyz` to inbox.include"),
    ("README", "add `README` to inbox.include"),
    (".hidden.jpg", "rename it without the dot"),
])
def test_a_name_not_taken_says_why_and_what_to_do(name: str, says: str) -> None:
    assert says in (NameFilter(None).refusal(name) or "")


def test_a_known_format_left_out_of_include_names_the_pattern_to_add() -> None:
    names = NameFilter(["*.jpg"])
    assert names.wanted("a.JPG")
    assert "add `*.png` to inbox.include" in (names.refusal("a.png") or "")


@pytest.mark.parametrize("name", [".DS_Store", "._IMG_0001.jpg", "Thumbs.db", "desktop.ini",
                                  "photo.jpg.part", "x.jpg.crdownload", "a.jpg", "B.HEIC",
                                  "cat.jpg.xmp", "IMG_1.CR2.XMP"])
def test_litter_temp_names_and_taken_names_get_no_word(name: str) -> None:
    assert NameFilter(None).refusal(name) is None


def test_litter_and_hidden_folders_are_not_entered() -> None:
    for name in ("@eaDir", ".stfolder", "__MACOSX", "#recycle", ".processing"):
        assert folder_skipped(name), name
    assert not folder_skipped("holiday")


@pytest.mark.parametrize(("name", "portable"), [
    ("plain.jpg", "plain.jpg"),
    ("what?.jpg", "what%3F.jpg"),
    ("c:d.jpg", "c%3Ad.jpg"),
    ("caf\udce9.jpg", "caf%E9.jpg"),  # the byte 0xE9, not UTF-8 (os.fsdecode's stand-in)
    ("café.jpg", "café.jpg"),  # UTF-8 is held everywhere: kept
    ("50%.jpg", "50%25.jpg"),  # the escape itself, so no two names meet
    ('a*b"c<d>e|f\\g.jpg', "a%2Ab%22c%3Cd%3Ee%7Cf%5Cg.jpg"),
    ("tab\tname.jpg", "tab%09name.jpg"),
    ("trailing. ", "trailing%2E%20"),
    ("end.", "end%2E"),
    ("del\x7f.jpg", "del%7F.jpg"),
    ("\udc80\udcff", "%80%FF"),
    ("~!@#$&()[]{};',= +^é€.jpg", "~!@#$&()[]{};',= +^é€.jpg"),
])
def test_a_portable_name_encodes_only_what_some_filesystem_refuses(name: str,
                                                                   portable: str) -> None:
    assert portable_name(name) == portable
    assert portable_key(f"q?dir/{name}") == f"q%3Fdir/{portable}"
