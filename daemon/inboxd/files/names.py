"""Which names in an inbox are ours to take, and where their outcomes go.

Only names are judged here (no I/O); what kind of file a name is, and whether it has settled, is
decided when the file is claimed (``inboxd.pipeline.intake``).
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
from pathlib import Path

from inboxd.decode import formats

# Names that editors, browsers and copy tools use while a file is still being written.
TEMP_SUFFIXES = (".tmp", ".part", ".crdownload", ".partial", ".swp", "~")
# The longest file name Linux filesystems take (NAME_MAX), in bytes.
NAME_MAX_BYTES = 255
# A name of this many characters fits NAME_MAX in any encoding (4 bytes a character at most).
SHORT_NAME_CHARS = NAME_MAX_BYTES // 4
# Characters exFAT, FAT, NTFS and SMB refuse in a name, and "%", the escape itself
# (files/portable_names.py says when they are encoded).
UNPORTABLE_CHARS = frozenset('"*:<>?\\|%')
_SURROGATES = range(0xDC80, 0xDD00)  # os.fsdecode's stand-ins for bytes that are not UTF-8
# A name with none of the characters portable_name encodes: every result's name, nearly.
_NOTHING_TO_ENCODE = re.compile(
    "[^\x00-\x1f\x7f" + re.escape("".join(sorted(UNPORTABLE_CHARS))) + "\udc80-\udcff]*")
# What operating systems and NAS boxes leave beside photos: never an input, never worth a word.
OS_LITTER_FILES = frozenset({".ds_store", "thumbs.db", "desktop.ini", "ehthumbs.db"})
OS_LITTER_PREFIX = "._"  # macOS AppleDouble resource forks on non-Apple filesystems
# Photo tools' sidecars (XMP, inboxd's own with after_success: keep among them): beside a
# photo, never one.
SIDECAR_SUFFIXES = (".xmp",)
OS_LITTER_FOLDERS = frozenset({"@eadir", ".stfolder", "__macosx", "#recycle", "#snapshot"})


def is_litter(name: str) -> bool:
    lowered = name.lower()
    return (lowered in OS_LITTER_FILES or name.startswith(OS_LITTER_PREFIX)
            or lowered.endswith(SIDECAR_SUFFIXES))


def folder_skipped(name: str) -> bool:
    """A folder never walked, silently: hidden (our own .processing/ among them) or OS litter
    (a NAS's thumbnails, a zip's __MACOSX, a recycle bin)."""
    return name.startswith(".") or name.lower() in OS_LITTER_FOLDERS


class NameFilter:
    def __init__(self, include: list[str] | None) -> None:
        # Unset: every format this build decodes (decode/formats.py), in any letter case.
        self.include = [p.lower() for p in (include or formats.default_include())]

    def wanted(self, name: str) -> bool:
        """A file name we would process: matches an include pattern, not hidden, not a temp."""
        lowered = name.lower()
        if name.startswith(".") or lowered.endswith(TEMP_SUFFIXES):
            return False
        return any(fnmatch.fnmatchcase(lowered, pattern) for pattern in self.include)

    def refusal(self, name: str) -> str | None:
        """Why a file name is not taken, and what to do about it; None when it is taken, or is
        skipped without a word: OS litter, and temp names (renamed once their writer is done)."""
        lowered = name.lower()
        if self.wanted(name) or is_litter(name) or lowered.endswith(TEMP_SUFFIXES):
            return None
        if name.startswith("."):
            return "hidden names (starting with a dot) are never taken; rename it without the dot"
        ext = os.path.splitext(lowered)[1]
        pattern = f"*{ext}" if ext else name
        fmt = formats.format_for_name(name)
        if fmt is not None and not formats.can_decode(fmt):
            return (f"{fmt.name} is not decoded by this build; it needs {fmt.install} "
                    "(`inboxd check-config` lists what this build decodes)")
        if fmt is not None:
            return f"it matches no inbox.include pattern; add `{pattern}` to inbox.include"
        known = ", ".join(f.name for f in formats.decodable())
        return (f"not a name inboxd takes: {ext or 'no extension'} is not an image format this "
                f"build decodes ({known}); if it is an image Pillow reads, add `{pattern}` to "
                "inbox.include")


def relative_inside(path: str | os.PathLike[str], inbox: str | os.PathLike[str]) -> str | None:
    """``path`` relative to ``inbox`` as "a/b.jpg", or None when it is not inside the inbox.

    Purely lexical: paths come from our own walk or the watcher, both rooted at ``inbox``, and
    links are never followed, so there is nothing to resolve. On strings, not ``Path``: this
    runs for every file, and pathlib interns each name it parses.
    """
    path, root = os.fspath(path), os.fspath(inbox).rstrip("/") + "/"
    if not path.startswith(root):
        return None
    parts = [part for part in path[len(root):].split("/") if part not in ("", ".")]
    if not parts or ".." in parts:
        return None
    return "/".join(parts)


def output_path(root: Path, key: str, suffix: str = "") -> Path:
    """``root/key+suffix``, guaranteed to stay under ``root`` and within NAME_MAX per part.

    ``key`` comes from real paths under an inbox, so it has no ``..``; the check is kept anyway
    because an outcome path escaping its folder would be a security hole, not a bug.
    """
    return root.joinpath(*_output_parts(key, suffix))


def output_str(root: str, key: str, suffix: str = "") -> str:
    """:func:`output_path` as a ``str``, for the per-file path (no pathlib parsing)."""
    if len(key) + len(suffix) <= SHORT_NAME_CHARS and "/" not in key and key not in ("", ".", ".."):
        return os.path.join(root, key + suffix)  # one short part: nothing to check or shorten
    return os.path.join(root, *_output_parts(key, suffix))


def _output_parts(key: str, suffix: str) -> list[str]:
    parts = key.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"refusing unsafe output key {key!r}")
    parts[-1] = fit_name(parts[-1], suffix)
    parts[:-1] = [fit_name(part, "") for part in parts[:-1]]
    return parts


def fit_name(name: str, suffix: str) -> str:
    """Shorten over-long names (keeping a hash, so distinct names stay distinct)."""
    full = name + suffix
    if len(os.fsencode(full)) <= NAME_MAX_BYTES:
        return full
    digest = hashlib.sha256(os.fsencode(name)).hexdigest()[:16]
    keep = NAME_MAX_BYTES - len(os.fsencode(suffix)) - len(digest) - 1
    if keep < 1:  # the suffix alone is too long: shorten the whole name instead
        return fit_name(full, "")
    head = os.fsencode(name)[:keep].decode("utf-8", "ignore")
    return f"{head}~{digest}{suffix}"


def portable_name(name: str) -> str:
    """``name`` with every character some filesystem refuses as ``%XX`` of its bytes: the
    characters above, control characters, bytes that are not UTF-8, and trailing dots and
    spaces (which some drivers drop). Any other character, accents included, stays."""
    if _NOTHING_TO_ENCODE.fullmatch(name) and not name.endswith((".", " ")):
        return fit_name(name, "")  # looked at in C, not a character at a time in Python
    out = []
    for char in name:
        code = ord(char)
        if code in _SURROGATES:
            out.append(f"%{code - 0xDC00:02X}")
        elif code < 0x20 or code == 0x7F or char in UNPORTABLE_CHARS:
            out.append("".join(f"%{byte:02X}" for byte in char.encode()))
        else:
            out.append(char)
    encoded = "".join(out)
    kept = encoded.rstrip(". ")
    return fit_name(kept + "".join(f"%{ord(c):02X}" for c in encoded[len(kept):]), "")


def portable_key(key: str) -> str:
    """:func:`portable_name` of each part of ``key``."""
    return "/".join(portable_name(part) for part in key.split("/"))
