"""FSDP2 state through torch.distributed.checkpoint: full weights for the portable model file, the optimizer
sharded (each rank writes its own part; DCP reshards on load, so the world size may change)."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as td
from torch import nn

OPTIMIZER_DIR = "optimizer"


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every weight gathered to rank 0 on the CPU (collective: all ranks call it; the others get {})."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def save_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Collective: each rank writes its shard of the optimizer state into `folder`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=str(folder / OPTIMIZER_DIR))


def save_optimizer_in_background(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path,
                                  group: td.ProcessGroup) -> Future[Any]:
    """Collective: each rank's optimizer shard copied to host memory now, written into `folder` by a DCP thread.

    Returns once the copy is made (training may change the optimizer from then on). The write plans and gathers
    on `group` (a group of its own, see distributed.setup.checkpoint_group). The future completes on every rank
    only after all of them wrote: DCP's last step (state_dict_saver._save_state_dict: `distW.all_reduce("write",
    write_data, finish_checkpoint)`, utils._DistWrapper.all_reduce) gathers every rank's write results on rank 0,
    which then writes `.metadata`, and broadcasts the outcome; a rank's failure fails every rank's future.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from kubetrain.torch_compat import save_completion

    written = dcp.async_save({"optimizer": get_optimizer_state_dict(model, optimizer)},
                             checkpoint_id=str(folder / OPTIMIZER_DIR), process_group=group)
    return save_completion(written)


def load_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Collective: read the sharded optimizer state back, resharded to this world size.

    Nothing in the checkpoint can run code: its optimizer files must match the digests in its meta.json, and
    DCP reads them through safe_dcp (metadata through a restricted unpickler, values as plain data only).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    from kubetrain.checkpoint.safe_dcp import SafeFileSystemReader, SafeLoadPlanner, load_metadata, verify_files

    verify_files(folder, OPTIMIZER_DIR)
    load_metadata(folder / OPTIMIZER_DIR / ".metadata")  # refused here, with our message, before DCP starts
    # get_optimizer_state_dict initialises empty AdamW state (a zero-lr step), giving DCP tensors to load into.
    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, storage_reader=SafeFileSystemReader(folder / OPTIMIZER_DIR), planner=SafeLoadPlanner())
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
