"""XMP sidecars (``xmp: true``, or ``xmp: {min_score: …}``): what the model saw, beside the photo
where it ends, for the photo tools people already use (darktable, digiKam, Lightroom, Immich).

Named after the whole file name (``done/cat.jpg.xmp`` for ``done/cat.jpg``), as darktable and
Immich look for them. Holds ``dc:subject`` keywords (the labels of every task at or above
``min_score``, detected things among them), OCR's ``full_text`` in ``dc:description``, and each
detection at or above ``min_score`` as an MWG region (``mwg-rs:Regions``: centre, width and
height normalised to the displayed photo, as digiKam and Immich read them).

Written to a hidden temp name in the photo's folder, fsynced, then renamed in without replacing
anything: a sidecar already there is the user's own (or their tool's), and is kept — this one is
skipped, with a warning. The folders are walked from the configured folder without following
links (the inbox with ``after_success: keep`` is the group's).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import Any
from xml.sax.saxutils import escape, quoteattr

from inboxd import __version__
from inboxd.config import Config, XmpConfig
from inboxd.files.index_rows import ocr_text, sections
from inboxd.files.renames import rename_noreplace
from inboxd.files.safe_paths import open_inside

SIDECAR_SUFFIX = ".xmp"
SIDECAR_MODE = 0o644

NAMESPACES = {
    "dc": "http://purl.org/dc/elements/1.1/",
    "xmp": "http://ns.adobe.com/xap/1.0/",
    "mwg-rs": "http://www.metadataworkinggroup.com/schemas/regions/",
    "stDim": "http://ns.adobe.com/xap/1.0/sType/Dimensions#",
    "stArea": "http://ns.adobe.com/xmp/sType/Area#",
}


def keywords(document: dict[str, Any], min_score: float) -> list[str]:
    """Every task's labels (top-k, and detected things) at or above ``min_score``, once each,
    best first."""
    scored: dict[str, float] = {}
    for _task, section in sections(document):
        for entry in [*_dicts(section.get("top_k")), *_dicts(section.get("detections"))]:
            label, score = entry.get("label"), entry.get("score")
            if isinstance(label, str) and label.strip() and isinstance(score, int | float) \
                    and score >= min_score:
                scored[label.strip()] = max(scored.get(label.strip(), 0.0), float(score))
    return sorted(scored, key=lambda label: -scored[label])


def description(document: dict[str, Any]) -> str:
    texts = [ocr_text(section).strip() for _task, section in sections(document)]
    return "\n".join(text for text in texts if text)


def regions(document: dict[str, Any],
            min_score: float) -> list[tuple[str, float, float, float, float]]:
    """(label, centre x, centre y, width, height), normalised to the displayed photo."""
    image = document.get("image")
    width = image.get("width") if isinstance(image, dict) else None
    height = image.get("height") if isinstance(image, dict) else None
    if not (isinstance(width, int) and isinstance(height, int) and width > 0 and height > 0):
        return []
    found = []
    for _task, section in sections(document):
        for entry in _dicts(section.get("detections")):
            box, label, score = entry.get("box"), entry.get("label"), entry.get("score")
            if not (isinstance(label, str) and isinstance(score, int | float)
                    and score >= min_score and isinstance(box, list) and len(box) == 4):
                continue
            x0, x1 = (min(max(float(v) / width, 0.0), 1.0) for v in (box[0], box[2]))
            y0, y1 = (min(max(float(v) / height, 0.0), 1.0) for v in (box[1], box[3]))
            if x1 > x0 and y1 > y0:
                found.append((label, (x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0))
    return found


def sidecar_xml(document: dict[str, Any], settings: XmpConfig) -> bytes:
    subjects = keywords(document, settings.min_score)
    text = description(document)
    boxes = regions(document, settings.min_score)
    namespaces = "".join(f"\n    xmlns:{prefix}={quoteattr(uri)}"
                         for prefix, uri in NAMESPACES.items())
    lines = [
        '<?xpacket begin="\ufeff" id="W5M0MpCehiHzreSzNTczkc9d"?>',
        '<x:xmpmeta xmlns:x="adobe:ns:meta/">',
        ' <rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">',
        f'  <rdf:Description rdf:about=""{namespaces}',
        f"    xmp:CreatorTool={quoteattr(f'inboxd {__version__}')}>",
    ]
    if subjects:
        lines += ["   <dc:subject>", "    <rdf:Bag>",
                  *(f"     <rdf:li>{escape(word)}</rdf:li>" for word in subjects),
                  "    </rdf:Bag>", "   </dc:subject>"]
    if text:
        lines += ["   <dc:description>", "    <rdf:Alt>",
                  f'     <rdf:li xml:lang="x-default">{escape(text)}</rdf:li>',
                  "    </rdf:Alt>", "   </dc:description>"]
    if boxes:
        image = document["image"]
        lines += ['   <mwg-rs:Regions rdf:parseType="Resource">',
                  '    <mwg-rs:AppliedToDimensions rdf:parseType="Resource">',
                  f"     <stDim:w>{int(image['width'])}</stDim:w>",
                  f"     <stDim:h>{int(image['height'])}</stDim:h>",
                  "     <stDim:unit>pixel</stDim:unit>",
                  "    </mwg-rs:AppliedToDimensions>",
                  "    <mwg-rs:RegionList>", "     <rdf:Bag>"]
        for label, x, y, w, h in boxes:
            lines += ['      <rdf:li rdf:parseType="Resource">',
                      f"       <mwg-rs:Name>{escape(label)}</mwg-rs:Name>",
                      '       <mwg-rs:Area rdf:parseType="Resource">',
                      f"        <stArea:x>{x:.6f}</stArea:x>",
                      f"        <stArea:y>{y:.6f}</stArea:y>",
                      f"        <stArea:w>{w:.6f}</stArea:w>",
                      f"        <stArea:h>{h:.6f}</stArea:h>",
                      "        <stArea:unit>normalized</stArea:unit>",
                      "       </mwg-rs:Area>", "      </rdf:li>"]
        lines += ["     </rdf:Bag>", "    </mwg-rs:RegionList>", "   </mwg-rs:Regions>"]
    lines += ["  </rdf:Description>", " </rdf:RDF>", "</x:xmpmeta>", '<?xpacket end="w"?>', ""]
    return "\n".join(lines).encode()


class Sidecars:
    def __init__(self, config: Config) -> None:
        assert config.xmp is not None
        self.settings = config.xmp
        # The folders a photo can end in, each walked from without following links.
        self.roots = [os.fspath(config.done_dir), *map(os.fspath, config.inbox.paths)]

    def write(self, photo: str, document: dict[str, Any]) -> str | None:
        """The sidecar of ``photo``; returns a warning when none was written (None: it was)."""
        root = next((r for r in self.roots if photo.startswith(r + os.sep)), None)
        if root is None:
            return f"no XMP sidecar for {photo}: not in done_dir or an inbox"
        folders, _, leaf = os.path.relpath(photo, root).rpartition(os.sep)
        target = leaf + SIDECAR_SUFFIX
        data = sidecar_xml(document, self.settings)
        try:
            with open_inside(root, folders.split(os.sep) if folders else []) as folder:
                tmp = f".{uuid.uuid4().hex}{SIDECAR_SUFFIX}.tmp"  # hidden .tmp: never taken
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | os.O_CLOEXEC, SIDECAR_MODE, dir_fd=folder)
                try:
                    with os.fdopen(fd, "wb") as file:
                        file.write(data)
                        file.flush()
                        os.fsync(file.fileno())
                    rename_noreplace(tmp, target, folder, folder)
                except BaseException:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(tmp, dir_fd=folder)
                    raise
        except FileExistsError:
            return (f"{photo}{SIDECAR_SUFFIX} is there already (the user's own, or a tool's): "
                    "kept, and no sidecar of inboxd's written beside it")
        except OSError as exc:
            return f"no XMP sidecar for {photo}: {exc.strerror or exc}"
        return None


def _dicts(value: Any) -> list[dict[str, Any]]:
    return [entry for entry in value if isinstance(entry, dict)] if isinstance(value, list) \
        else []
