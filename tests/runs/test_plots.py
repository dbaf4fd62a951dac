"""`runs plot`: a PNG of real runs' loss curves that decodes at the documented size."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from kubetrain import runs
from kubetrain.errors import UserInputError
from kubetrain.runs.plots import HEIGHT_PX, WIDTH_PX, plot_losses


def test_png_of_two_runs(two_runs: tuple[Path, Path], tmp_path: Path) -> None:
    out = plot_losses(list(two_runs), tmp_path / "plots" / "loss.png")
    image = imread(out)
    assert (WIDTH_PX, HEIGHT_PX) == (1200, 500)
    assert image.shape == (500, 1200, 4)
    assert float(np.std(image[..., :3])) > 0.01  # curves, axes and text: not a blank canvas


def test_tokens_on_the_x_axis(two_runs: tuple[Path, Path], tmp_path: Path) -> None:
    out = plot_losses([two_runs[0]], tmp_path / "tokens.png", x="tokens")
    assert imread(out).shape == (500, 1200, 4)


def test_bad_output_and_empty_runs(two_runs: tuple[Path, Path], tmp_path: Path) -> None:
    with pytest.raises(UserInputError, match=r"\.png"):
        plot_losses([two_runs[0]], tmp_path / "loss.jpg")
    empty = tmp_path / "empty-run"
    empty.mkdir()
    (empty / runs.METRICS_FILE).write_text("")
    with pytest.raises(UserInputError, match="no loss records"):
        plot_losses([empty], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_plotting_is_part_of_the_base_install() -> None:
    # The README's setup (`scripts/setup`, no extras) installs what `runs plot` needs.
    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    assert any(dep.startswith("matplotlib") for dep in project["dependencies"])
    assert not any(dep.startswith("matplotlib") for extra in project["optional-dependencies"].values() for dep in extra)
