"""The model a spec describes: the decoder-only transformer, or Switch's encoder-decoder."""

from __future__ import annotations

import torch

from moetier.config import ModelSpec
from moetier.model.kernels import TorchKernels
from moetier.model.seq2seq import EncoderDecoder
from moetier.model.transformer import Experts, Transformer


def make_model(spec: ModelSpec, dense: dict[str, torch.Tensor], experts: Experts,
               kernels: TorchKernels | None = None) -> Transformer | EncoderDecoder:
    cls = EncoderDecoder if spec.encoder_decoder is not None else Transformer
    return cls(spec, dense, experts, kernels)
