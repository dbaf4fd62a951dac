"""join_inside: a name from outside resolves inside its folder, or is refused (kubetrain/outside_names.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kubetrain.errors import EXIT_BAD_INPUT
from kubetrain.outside_names import OutsideName, join_inside


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer/__0_0.distcp", "a/b/c.json", ".verified",
                                  "step-000003/meta.json", "x..y", "...", "café"])
def test_plain_relative_names_join(tmp_path: Path, name: str) -> None:
    assert join_inside(tmp_path, name) == tmp_path / name


@pytest.mark.parametrize(("name", "why"), [
    ("../x", "climbs out"), ("../../../../etc/cron.d/x", "climbs out"), ("a/../../x", "climbs out"),
    ("a/../b", "climbs out"), ("..", "climbs out"), ("/etc/passwd", "absolute"), ("//x", "absolute"),
    ("", "empty"), (".", "not a plain"), ("./a", "not a plain"), ("a//b", "not a plain"), ("a/", "not a plain"),
    ("a/./b", "not a plain"), ("..\\x", "backslash"), ("a\0b", "NUL"), (7, "not text"), (None, "not text"),
])
def test_names_that_leave_or_are_not_plain_are_refused(tmp_path: Path, name: object, why: str) -> None:
    with pytest.raises(OutsideName, match=why) as refused:
        join_inside(tmp_path, name)  # type: ignore[arg-type]
    assert refused.value.exit_code == EXIT_BAD_INPUT and "\n" not in str(refused.value)


def test_a_link_in_the_folder_that_leads_outside_is_refused(tmp_path: Path) -> None:
    folder, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    folder.mkdir()
    elsewhere.mkdir()
    (folder / "out").symlink_to(elsewhere)
    (folder / "file").symlink_to(elsewhere / "f")
    (folder / "inner").mkdir()
    (folder / "here").symlink_to(folder / "inner")
    for name in ("out/x", "out", "file"):
        with pytest.raises(OutsideName, match="through a link"):
            join_inside(folder, name)
    assert join_inside(folder, "here/x") == folder / "here" / "x"  # a link that stays inside is fine
    (folder / "loop").symlink_to(folder / "loop")
    with pytest.raises(OutsideName):
        join_inside(folder, "loop/x")


def test_a_folder_reached_through_a_link_is_its_own_inside(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    assert join_inside(tmp_path / "alias", "a/b") == tmp_path / "alias" / "a" / "b"
    assert os.path.realpath(join_inside(tmp_path / "alias", "a")) == str(tmp_path / "real" / "a")
