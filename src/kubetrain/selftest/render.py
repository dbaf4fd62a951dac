"""The self-test's report for a terminal: one line per item as it finishes, a rich table at the end."""

from __future__ import annotations

import json
from typing import Any

from kubetrain.selftest import Outcome

STYLE = {"passed": "green", "failed": "bold red", "skipped": "yellow"}


def item_line(outcome: Outcome) -> str:
    return f"{outcome.status:>7}  {outcome.name} ({outcome.seconds:.1f}s): {outcome.why}"


def figures_text(figures: dict[str, Any]) -> str:
    def short(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        if isinstance(value, dict):
            return "{" + ", ".join(f"{k} {short(v)}" for k, v in value.items()) + "}"
        return json.dumps(value) if not isinstance(value, str) else value

    return ", ".join(f"{k} {short(v)}" for k, v in figures.items())


def table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    d = report["device"]
    title = (f"kubetrain doctor --check ({report['mode']}): {d['kind']} - {d['name']}, torch "
             f"{report['versions']['torch']}, {report['seconds']:.0f}s")
    grid = Table(title=title, show_lines=True, expand=True)
    grid.add_column("item", no_wrap=True, min_width=28)
    grid.add_column("status", no_wrap=True, min_width=7)
    for column, ratio in (("why", 5), ("figures", 5), ("tolerance", 3)):
        grid.add_column(column, ratio=ratio, overflow="fold")
    for item in report["items"]:
        grid.add_row(item["name"], f"[{STYLE[item['status']]}]{item['status']}[/]", item["why"],
                     figures_text(item["figures"]), item["tolerance"] or "")
    console = Console(width=max(120, Console().width))
    console.print(grid)
    s = report["summary"]
    console.print(f"{s['passed']} passed, {s['failed']} failed, {s['skipped']} skipped")
