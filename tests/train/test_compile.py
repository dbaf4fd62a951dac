"""torch.compile from outside: blocks compiled in place keep their names and numerics; reset drops the graphs.

The "eager" backend runs the real Dynamo capture without Inductor's C++/Triton code generation (slow here).
"""

from __future__ import annotations

import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from kubetrain.config import load_config
from kubetrain.distributed.parallelize import compile_blocks
from kubetrain.models import build_model
from kubetrain.models.gpt import Block
from kubetrain.train.compile import reset_compiled


def test_blocks_compile_in_place_and_reset_drops_their_graphs() -> None:
    cfg = load_config(overrides=["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=16"])
    torch.manual_seed(0)
    model = build_model(cfg.model, 256)
    names = list(model.state_dict())
    ids = torch.randint(0, 256, (2, 16))
    eager = model(ids)
    reset_compiled()
    assert compile_blocks(model, backend="eager") == 2
    assert list(model.state_dict()) == names  # no `_orig_mod.`: checkpoints keep their keys
    assert torch.equal(model(ids), eager)
    assert _debug_get_cache_entry_list(Block.forward.__code__)  # the graph is there...
    reset_compiled()
    assert not _debug_get_cache_entry_list(Block.forward.__code__)  # ... and gone after a reset
    assert compile_blocks(torch.nn.Linear(2, 2)) == 0  # nothing to compile per block
