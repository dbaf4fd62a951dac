"""One group of checks in its own process: `python -m kubetrain.selftest.group NAME --device D --work DIR [--quick]`.

Each item's outcome is printed as one line, `MARK` then its JSON, as soon as it is known; anything else on
stdout (a library's chatter) is ignored by the runner. An item that raises is failed with its error's first line.
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
import traceback
from pathlib import Path

from kubetrain.selftest import GROUPS, Outcome
from kubetrain.selftest.context import Context

MARK = "kubetrain-selftest-item: "


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kubetrain.selftest.group")
    parser.add_argument("group", choices=sorted(GROUPS))
    parser.add_argument("--device", required=True)
    parser.add_argument("--work", required=True, type=Path)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--nproc", type=int, default=1)
    args = parser.parse_args(argv)
    ctx = Context(device=args.device, quick=args.quick, work=args.work, nproc=args.nproc)
    module = importlib.import_module(f"kubetrain.selftest.{args.group}")
    prepare = getattr(module, "prepare", None)
    if prepare is not None:
        prepare(ctx)
    for name in GROUPS[args.group]:
        started = time.perf_counter()
        try:
            outcome = module.CHECKS[name](ctx)
        except Exception as e:  # the item failed; the report names the error and the group goes on
            first = (str(e).strip().splitlines() or [""])[0]
            outcome = Outcome(name, "failed", f"{type(e).__name__}: {first}"[:500])
            traceback.print_exc()  # to stderr: the whole story for whoever reads the group's log
        outcome.seconds = round(time.perf_counter() - started, 2)
        print(MARK + json.dumps(outcome.to_json(), default=str), flush=True)
    finish = getattr(module, "finish", None)
    if finish is not None:
        finish()


if __name__ == "__main__":
    main()
