"""One layer's routed experts read out of a Hugging Face checkpoint into the store's layout (ModelSpec.expert_shapes),
whatever the checkpoint's own: `expert_source(ckpt, family, spec, layer).get(e)`. `locate(e)` says where an
expert's tensors lie in the checkpoint's files, for a store that reads them there instead of copying them: the
pieces of each of the store's tensors in order ({tensor: [Located, ...]}), or None where the checkpoint's layout is
not the store's (gpt-oss's transposed, interleaved or MXFP4 experts).

- `StackedExperts`: SwiGLU experts per expert (gate, up, down weights; the hub's layout and what transformers saves)
  or fused [E, 2I, H] / [E, H, I] (transformers 5's in-memory layout).
- `GptOssExperts`: gate_up_proj [E, H, 2I] with gate and up interleaved, down_proj [E, I, H], and their biases —
  in bf16, or as MXFP4 blocks and scales (the released checkpoints), dequantized here (moetier/store/mxfp4.py).
- `SwitchExperts`: per expert wi [I, H] and wo [H, I] (a ReLU MLP)."""

from __future__ import annotations

import torch

from moetier.config import ModelSpec
from moetier.model.families import Family
from moetier.store.checkpoint import Checkpoint, Located
from moetier.store.mxfp4 import dequantize_mxfp4


class StackedExperts:
    def __init__(self, ckpt: Checkpoint, family: Family, spec: ModelSpec, layer: int) -> None:
        self.ckpt, self.family, self.layer = ckpt, family, layer
        gate_up, down = family.fused_expert_names(layer)
        self.fused = (gate_up, down) if gate_up in ckpt and down in ckpt else None

    def get(self, expert: int) -> dict[str, torch.Tensor]:
        if self.fused is not None:
            gate_up, down = (self.ckpt.get_slice(name, expert) for name in self.fused)
            return {"gate_up_proj": gate_up, "down_proj": down}
        gate, up, down = (self.ckpt.get(n) for n in self.family.expert_names(self.layer, expert))
        return {"gate_up_proj": torch.cat([gate, up], dim=0), "down_proj": down}

    def locate(self, expert: int) -> dict[str, list[Located]]:
        if self.fused is not None:
            gate_up, down = (self.ckpt.locate(name).slice(expert) for name in self.fused)
            return {"gate_up_proj": [gate_up], "down_proj": [down]}
        gate, up, down = (self.ckpt.locate(n) for n in self.family.expert_names(self.layer, expert))
        return {"gate_up_proj": [gate, up], "down_proj": [down]}


class GptOssExperts:
    def __init__(self, ckpt: Checkpoint, family: Family, spec: ModelSpec, layer: int) -> None:
        self.ckpt = ckpt
        self.base = f"model.layers.{layer}.{family.moe_prefix}.experts."
        self.mxfp4 = self.base + "gate_up_proj_blocks" in ckpt

    def _matrix(self, name: str, expert: int) -> torch.Tensor:
        """[out, in] of one expert."""
        if self.mxfp4:
            return dequantize_mxfp4(self.ckpt.get_slice(self.base + name + "_blocks", expert),
                                    self.ckpt.get_slice(self.base + name + "_scales", expert))
        return self.ckpt.get_slice(self.base + name, expert).T  # stored [in, out]: the reference computes x @ W

    def locate(self, expert: int) -> None:
        return None  # stored transposed with gate and up interleaved (or as MXFP4): the store's layout is made

    def get(self, expert: int) -> dict[str, torch.Tensor]:
        gate_up = self._matrix("gate_up_proj", expert)  # [2I, H], rows gate0, up0, gate1, up1...
        bias = self.ckpt.get_slice(self.base + "gate_up_proj_bias", expert)
        return {"gate_up_proj": torch.cat((gate_up[0::2], gate_up[1::2])).contiguous(),
                "down_proj": self._matrix("down_proj", expert).contiguous(),
                "gate_up_proj.bias": torch.cat((bias[0::2], bias[1::2])),
                "down_proj.bias": self.ckpt.get_slice(self.base + "down_proj_bias", expert)}


class SwitchExperts:
    def __init__(self, ckpt: Checkpoint, family: Family, spec: ModelSpec, layer: int) -> None:
        self.ckpt, self.family, self.spec, self.layer = ckpt, family, spec, layer

    def get(self, expert: int) -> dict[str, torch.Tensor]:
        up, down = (self.ckpt.get(n) for n in self.family.expert_names(self.layer, expert, self.spec))
        return {"up_proj": up, "down_proj": down}

    def locate(self, expert: int) -> dict[str, list[Located]]:
        up, down = (self.ckpt.locate(n) for n in self.family.expert_names(self.layer, expert, self.spec))
        return {"up_proj": [up], "down_proj": [down]}


SOURCES = {"stacked": StackedExperts, "gpt-oss": GptOssExperts, "switch": SwitchExperts}


def expert_source(ckpt: Checkpoint, family: Family, spec: ModelSpec, layer: int):
    return SOURCES[family.expert_format](ckpt, family, spec, layer)
