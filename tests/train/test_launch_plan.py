"""The launch plan's decisions from a config and stated machine facts: the device, the processes, the micro-batch
and the memory verdict, as the launcher and a worker each make them once."""

from __future__ import annotations

import pytest
import torch

from kubetrain.config import load_config
from kubetrain.errors import ConfigError, UserInputError
from kubetrain.train.device import DeviceFacts, choose_device
from kubetrain.train.launch_plan import plan_launch, plan_worker
from tests.train.conftest import TINY

CPU_ONLY = DeviceFacts(cuda_available=False, gpu_build=False, visible_gpus=0, mps_available=False)
FOUR_GPUS = DeviceFacts(cuda_available=True, gpu_build=True, visible_gpus=4, mps_available=False)
PLENTY = 2**50  # bytes free: more than any tiny run needs
AUTO = [*TINY, "run.device=cpu", "train.micro_batch_size=auto", "train.global_batch_size=64",
        "train.memory_budget_gib=1000"]


def test_the_device_is_the_one_asked_for_else_the_first_available_and_a_worker_takes_its_local_rank_s_gpu() -> None:
    assert choose_device("auto", CPU_ONLY) == torch.device("cpu")
    assert choose_device("cpu", FOUR_GPUS) == torch.device("cpu")
    # torchrun's LOCAL_RANK picks the node's GPU; more ranks than GPUs wrap around
    assert choose_device("auto", DeviceFacts(True, True, 4, False, local_rank=2)) == torch.device("cuda", 2)
    assert choose_device("cuda", DeviceFacts(True, True, 4, False, local_rank=5)) == torch.device("cuda", 1)
    with pytest.raises(UserInputError, match="CPU-only build"):
        choose_device("cuda", CPU_ONLY)
    with pytest.raises(UserInputError, match="no Metal GPU"):
        choose_device("mps", CPU_ONLY)


def test_the_launcher_gives_each_process_a_gpu_and_leaves_the_memory_of_a_gpu_run_to_its_workers() -> None:
    cfg = load_config(None, None, [*TINY, "run.device=auto", "train.micro_batch_size=auto",
                                   "train.global_batch_size=64"])
    plan = plan_launch(cfg, nproc=4, min_nodes=2, fixed_nodes=2, facts=FOUR_GPUS)
    assert plan.device == torch.device("cuda", 0)
    assert (plan.layout.world_size, plan.layout.local_processes, plan.layout.launcher) == (8, 4, True)
    # no estimate, no budget read here: either would take a CUDA context for the whole job
    assert plan.memory is None and plan.micro_batch is None and plan.cfg.train.micro_batch_size == "auto"
    with pytest.raises(UserInputError, match=r"--nproc 5 is more than the 4 GPU\(s\)"):
        plan_launch(cfg, nproc=5, min_nodes=1, fixed_nodes=1, facts=FOUR_GPUS)


def test_the_launcher_plans_the_fewest_nodes_and_checks_hsdp_s_shard_group_only_for_a_fixed_count() -> None:
    cfg = load_config(None, None, [*TINY, "run.device=cpu", "dist.strategy=hsdp", "dist.shard_size=4"])
    elastic = plan_launch(cfg, nproc=3, min_nodes=2, fixed_nodes=None, facts=CPU_ONLY, free=PLENTY)
    assert (elastic.layout.world_size, elastic.layout.local_processes) == (6, 3)  # MIN nodes of 3 processes
    with pytest.raises(ConfigError, match="must divide the world size 6"):
        plan_launch(cfg, nproc=3, min_nodes=2, fixed_nodes=2, facts=CPU_ONLY, free=PLENTY)


def test_auto_becomes_the_largest_micro_batch_of_the_process_s_share_that_the_budget_holds() -> None:
    plan = plan_worker(load_config(None, None, AUTO), world_size=2, local_world_size=2, facts=CPU_ONLY, free=PLENTY)
    # 64 sequences over 2 processes: 32 each, in one micro-batch under a budget of 1000 GiB
    assert plan.micro_batch is not None and plan.micro_batch.fits
    assert (plan.cfg.train.micro_batch_size, plan.cfg.train.grad_accum_steps) == (32, 1)
    given = plan_worker(load_config(None, None, [*AUTO, "train.micro_batch_size=4"]), world_size=2,
                        local_world_size=2, facts=CPU_ONLY, free=PLENTY)
    assert given.micro_batch is None  # a number given is kept; accumulation makes up the global batch
    assert (given.cfg.train.micro_batch_size, given.cfg.train.grad_accum_steps) == (4, 8)


def test_the_memory_verdict_refuses_in_one_line_what_the_free_memory_cannot_hold() -> None:
    cfg = load_config(None, None, [*TINY, "run.device=cpu"])
    fits = plan_worker(cfg, 1, 1, facts=CPU_ONLY, free=PLENTY)
    assert fits.memory is not None and fits.memory.refusal is None and 0 < fits.memory.need < PLENTY
    fits.refuse_what_does_not_fit()
    tight = plan_worker(cfg, 1, 1, facts=CPU_ONLY, free=fits.memory.need - 1)
    assert tight.memory is not None and tight.memory.refusal is not None and "\n" not in tight.memory.refusal
    with pytest.raises(UserInputError, match="GiB is free on cpu"):
        tight.refuse_what_does_not_fit()
    off = plan_worker(load_config(None, None, [*AUTO, "run.check_memory=false"]), 1, 1, facts=CPU_ONLY, free=1)
    assert off.memory is None and off.micro_batch is not None  # not judged, but auto still resolved


def test_the_launcher_judges_the_node_s_processes_together_and_a_worker_what_it_has_still_to_allocate() -> None:
    cfg = load_config(None, None, [*TINY, "run.device=cpu"])
    node = plan_launch(cfg, nproc=3, min_nodes=1, fixed_nodes=1, facts=CPU_ONLY, free=PLENTY)
    worker = plan_worker(cfg, world_size=3, local_world_size=3, facts=CPU_ONLY, free=PLENTY)
    assert node.memory is not None and worker.memory is not None
    # three processes with their runtimes and the launcher's, against one process less the runtime it holds
    assert node.memory.need > 3 * worker.memory.need
    refused = plan_launch(cfg, nproc=3, min_nodes=1, fixed_nodes=1, facts=CPU_ONLY, free=node.memory.need - 1)
    assert refused.memory is not None and "x3 processes on this node" in (refused.memory.refusal or "")
