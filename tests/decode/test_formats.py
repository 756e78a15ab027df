"""What this build decodes, said by `inboxd check-config`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from inboxd.decode import formats

from tests.conftest import write_config


def test_check_config_lists_what_this_build_decodes(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "inboxd", "check-config", "-c",
                          str(write_config(tmp_path))], capture_output=True, text=True,
                         check=True).stdout
    assert "formats this build decodes" in out
    for fmt in formats.decodable():
        assert f"{fmt.name}: {' '.join(fmt.extensions)}" in out
    assert "*.heic" in out and "*.jfif" in out
