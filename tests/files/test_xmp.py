"""XMP sidecars (``files.xmp``), read back by a real consumer: exiftool (Debian's
libimage-exiftool-perl), not by the writer's own parser."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from inboxd.config import load_config
from inboxd.files.xmp import Sidecars

from tests.conftest import REPO, make_image, write_config

DOCUMENT: dict[str, Any] = {
    "source": "street.jpg", "sha256": "ab" * 32, "model": "m",
    "image": {"width": 400, "height": 200},
    "top_k": [{"label": "street sign", "index": 919, "score": 0.8},
              {"label": "traffic light", "index": 920, "score": 0.3},
              {"label": "pole", "index": 733, "score": 0.05}],
    "objects": {"detections": [
        {"label": "person", "index": 0, "score": 0.9, "box": [100, 50, 200, 150]},
        {"label": "dog", "index": 16, "score": 0.1, "box": [0, 0, 10, 10]}]},
    "text": {"full_text": "RUE DE LA PAIX\n75002 <Paris> & co", "lines": []},
}


def exiftool(path: Path) -> dict[str, Any]:
    binary = shutil.which("exiftool")
    if binary is None:
        message = ("exiftool is not installed (apt-get install libimage-exiftool-perl; "
                   "`make setup-test` does it as root)")
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    out = subprocess.run([binary, "-j", "-struct", "-XMP:all", str(path)], capture_output=True,
                         text=True, check=True, timeout=60).stdout
    found: dict[str, Any] = json.loads(out)[0]
    return found


def sidecars(root: Path, **xmp: Any) -> Sidecars:
    return Sidecars(load_config(write_config(root, xmp=xmp or True)))


def test_exiftool_reads_keywords_description_and_regions(tmp_path: Path) -> None:
    photo = make_image(tmp_path / "done" / "street.jpg")
    assert sidecars(tmp_path, min_score=0.25).write(str(photo), DOCUMENT) is None
    read = exiftool(tmp_path / "done" / "street.jpg.xmp")
    # At or above min_score, best first; detected things are keywords too.
    assert read["Subject"] == ["person", "street sign", "traffic light"]
    assert read["Description"] == "RUE DE LA PAIX\n75002 <Paris> & co"
    regions = read["RegionInfo"]
    assert regions["AppliedToDimensions"] == {"W": 400, "H": 200, "Unit": "pixel"}
    assert regions["RegionList"] == [{"Name": "person", "Area": {
        "X": 0.375, "Y": 0.5, "W": 0.25, "H": 0.5, "Unit": "normalized"}}]


def test_a_users_own_sidecar_is_never_replaced(tmp_path: Path) -> None:
    photo = make_image(tmp_path / "done" / "street.jpg")
    own = tmp_path / "done" / "street.jpg.xmp"
    own.write_bytes(b"<x:xmpmeta xmlns:x='adobe:ns:meta/'/>  my own")
    note = sidecars(tmp_path).write(str(photo), DOCUMENT)
    assert note is not None and "kept" in note
    assert own.read_bytes() == b"<x:xmpmeta xmlns:x='adobe:ns:meta/'/>  my own"
    assert sorted(p.name for p in own.parent.iterdir()) == ["street.jpg", "street.jpg.xmp"]


def test_a_sidecar_is_never_written_through_a_link(tmp_path: Path) -> None:
    """With after_success: keep the sidecar goes into the group's inbox: a folder there
    swapped for a link must not lead the write elsewhere."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "inbox").mkdir(exist_ok=True)
    os.symlink(elsewhere, tmp_path / "inbox" / "sub")
    note = sidecars(tmp_path).write(str(tmp_path / "inbox" / "sub" / "a.jpg"), DOCUMENT)
    assert note is not None and list(elsewhere.iterdir()) == []


@pytest.mark.daemon
@pytest.mark.timeout(300)
@pytest.mark.slow  # a costly run: `make test`, not the fast tier
def test_the_daemon_writes_sidecars_beside_the_filed_photos(tmp_path: Path) -> None:
    config = write_config(tmp_path, xmp={"min_score": 0.0}, inbox={"settle_ms": 0},
                          model={"device": "cpu"})
    make_image(tmp_path / "inbox" / "red.jpg", size=(96, 64))
    make_image(tmp_path / "inbox" / "kept.jpg", size=(96, 64), color=(10, 200, 10))
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "kept.jpg.xmp").write_text("mine")  # the user's, already there
    run = subprocess.run([sys.executable, "-m", "inboxd", "once", "-c", str(config)],
                         capture_output=True, text=True, cwd=REPO, timeout=240,
                         env={**os.environ, "PYTHONPATH": str(REPO / "daemon")})
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "results" / "red.jpg.json").read_text())
    read = exiftool(tmp_path / "done" / "red.jpg.xmp")
    assert read["Subject"] == [entry["label"] for entry in result["top_k"]]
    # The user's sidecar stays; the photo is filed beside it all the same.
    assert (tmp_path / "done" / "kept.jpg.xmp").read_text() == "mine"
    assert (tmp_path / "done" / "kept.jpg").exists()
    assert "kept.jpg.xmp is there already" in run.stderr
