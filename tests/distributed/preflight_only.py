"""A job that runs only the preflight, as `kubetrain train` does before step 1 (train/phases.py), REPEAT times on its
process group (each time on a group of its own, with its own deadline, as a new job's would be), and leaves: the unit
of the false-failure count in test_preflight_load.py, seconds a preflight where a training run costs minutes here.

Run by torch.distributed.run: preflight_only.py RUN_DIR ON_FAILURE REPEAT (reports in RUN_DIR/<i>/preflight.json)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from kubetrain.config.schema import Config
from kubetrain.distributed import preflight
from kubetrain.distributed import setup as dist
from kubetrain.errors import PreflightFailed


def main(run_dir: Path, on_failure: str, repeat: int) -> int:
    cfg = Config.model_validate({"run": {"device": "cpu", "threads": 1},
                                 "dist": {"preflight": {"on_failure": on_failure}}})
    torch.set_num_threads(1)
    device = torch.device("cpu")
    penv = dist.init(cfg.dist, device)
    prefix = f"[rank {penv.rank}] "
    healthy = False
    try:
        for i in range(repeat):
            preflight.check_job(cfg.dist.preflight, penv, device, run_dir / str(i),
                                lambda line: print(prefix + line, flush=True))
        healthy = True
    except PreflightFailed as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    finally:
        dist.teardown(healthy)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])))
