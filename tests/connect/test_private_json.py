"""write_private_json: the run's metadata appears whole or not at all, never over another file."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from tdbg.connect.runtime import write_private_json


def test_the_file_appears_whole_private_and_leaves_nothing_else(tmp_path: Path) -> None:
    path = tmp_path / "0-42.json"
    write_private_json(path, {"pid": 42, "socket": "x"})
    assert json.loads(path.read_text()) == {"pid": 42, "socket": "x"}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert os.listdir(tmp_path) == ["0-42.json"], "a temporary file was left behind"


def test_an_existing_file_or_planted_symlink_is_never_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "0-42.json"
    path.write_text("theirs")
    with pytest.raises(FileExistsError):
        write_private_json(path, {"pid": 42})
    assert path.read_text() == "theirs"
    target = tmp_path / "elsewhere"
    link = tmp_path / "0-43.json"
    link.symlink_to(target)
    with pytest.raises(FileExistsError):
        write_private_json(link, {"pid": 43})
    assert not target.exists()
    assert sorted(os.listdir(tmp_path)) == ["0-42.json", "0-43.json"]
