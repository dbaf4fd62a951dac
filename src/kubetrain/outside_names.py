"""Names that come from outside (a store's listing, a checkpoint's meta.json, a pod's archive) stay in their folder.

A leaf module: checkpoint/ (restore, sync) and k8s/fetch both join such names onto local folders.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from kubetrain.errors import UserInputError


class OutsideName(UserInputError):
    """A name from outside that would leave the folder it is meant for. Exit code 2 for a command that meets one."""

    def __init__(self, name: object, folder: Path, why: str) -> None:
        super().__init__(f"{name!r} is not a name inside {folder}: {why}")
        self.name, self.why = name, why


def join_inside(folder: Path, name: str) -> Path:
    """`folder / name` for a relative name from outside; OutsideName if it would resolve anywhere else.

    Refused: an empty name or `.`, an absolute path, any `..`, a name that is not written the one plain way
    (`a//b`, `./a`, `a/`), a backslash or a NUL, and a name that a symlink already in `folder` leads outside.
    """
    why = _problem(name)
    if why is None:
        try:
            base = folder.resolve()
            target = (folder / name).resolve()  # follows the symlinks that exist, lexically past them
        except (OSError, RuntimeError):  # a loop of links
            why = "it leads into a loop of links"
        else:
            if target == base or not target.is_relative_to(base):
                why = "it leads outside through a link" if target != base else "it names the folder itself"
    if why is not None:
        raise OutsideName(name, folder, why)
    return folder / name


def _problem(name: object) -> str | None:
    if not isinstance(name, str):
        return "it is not text"
    if not name:
        return "it is empty"
    if "\0" in name or "\\" in name:
        return "it holds a NUL or a backslash"
    p = PurePosixPath(name)
    if p.is_absolute():
        return "it is absolute"
    if ".." in p.parts:
        return "it climbs out with .."
    if not p.parts or str(p) != name:
        return "it is not a plain relative name"
    return None
