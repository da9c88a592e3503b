"""A GGUF's mixture-of-experts tensors under the Hugging Face names of the MoE layer.

llama.cpp's converter stacks a layer's experts into one tensor per matrix:
``blk.N.ffn_{gate,up,down}_exps.weight`` with GGUF dims ``[cols, rows, num_experts]`` (the
expert index slowest), and stores the router as ``blk.N.ffn_gate_inp.weight``. Each expert's
slice is contiguous in the file, so it is served as a tensor of its own (`ExpertSlice`) under
its HF name (``model.layers.N.block_sparse_moe.experts.E.w1.weight`` …, per
``moe_options``): the store dequantizes it alone, or keeps its blocks for the packed GGUF matmul.
Names: gguf-py's ``constants.py`` (``FFN_GATE_EXP``, ``FFN_GATE_INP``…).
"""

from __future__ import annotations

import re
from typing import Any, Iterator, Mapping

import numpy as np

from localgen.models.moe_options import expert_name, moe_options, router_name

# blk.N.<part>.weight: the stacked expert matrices (-> short) and the router
EXPERT_TENSORS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}
ROUTER_TENSOR = "ffn_gate_inp"
_MOE_TENSOR_RE = re.compile(rf"blk\.(\d+)\.({'|'.join([*EXPERT_TENSORS, ROUTER_TENSOR])})\.weight")


def is_moe_tensor(name: str) -> bool:
    """Whether `name` is a router or stacked-expert tensor."""
    return _MOE_TENSOR_RE.fullmatch(name) is not None


class ExpertSlice:
    """Expert ``e`` of a stacked ``gguf.ReaderTensor``, with the attributes the store reads:
    ``data`` (a view into the memory map), ``shape`` (GGUF order, ``[cols, rows]``),
    ``tensor_type``, ``n_bytes``, ``data_offset``, ``name``."""

    def __init__(self, stacked, e: int):
        n = int(stacked.shape[-1])
        if not 0 <= e < n:
            raise IndexError(f"{stacked.name} holds {n} experts, not expert {e}")
        self.name = f"{stacked.name}[{e}]"
        self.tensor_type = stacked.tensor_type
        self.shape = np.asarray(stacked.shape[:-1])
        self.n_bytes = int(stacked.n_bytes) // n
        self.data_offset = int(stacked.data_offset) + e * self.n_bytes
        self.data = stacked.data[e]


def moe_tensors(reader, hf_config: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """(HF name, tensor) of each router and each expert slice of an MoE file (nothing for a
    dense one); ``hf_config`` is the file's `gguf_config.gguf_hf_config`."""
    arch = hf_config["architectures"][0]
    moe = moe_options(arch, hf_config, int(hf_config["num_hidden_layers"]))
    if moe is None:
        return
    for t in reader.tensors:
        m = _MOE_TENSOR_RE.fullmatch(t.name)
        if m is None:
            continue
        i = int(m.group(1))
        if m.group(2) == ROUTER_TENSOR:
            yield router_name(moe, i), t
            continue
        for e in range(moe.num_experts):
            yield expert_name(moe, i, e, EXPERT_TENSORS[m.group(2)]), ExpertSlice(t, e)
