"""RoPE frequencies of every type a supported family ships, against transformers' own, and config.json spelled
either way (transformers 5's rope_parameters, or the hub's older rope_scaling beside rope_theta)."""

import pytest
import torch

from moetier.model.families import parse_spec
from moetier.model.rope import inverse_frequencies
from tests.tiny_models import tiny_config

CASES = [
    ("deepseek_v3", {}),  # yarn, mscale ≠ mscale_all_dim
    ("deepseek_v3", {"rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                                      "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}}),
    ("gpt_oss", {}),  # yarn, truncate false
    ("phimoe", {}),  # longrope
    ("glm4_moe", {}),  # partial rotary
    ("mixtral", {}),
]


@pytest.mark.parametrize("family,overrides", CASES, ids=[f"{f}-{i}" for i, (f, _) in enumerate(CASES)])
def test_frequencies_match_transformers(family, overrides):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = tiny_config(family, **overrides)
    spec = parse_spec(config.to_dict())
    mla = spec.latent_attention
    head_dim = mla.qk_rope_head_dim if mla else spec.head_dim
    ours, scale = inverse_frequencies(spec.rope, spec.rope.dim or head_dim)
    kind = config.rope_parameters["rope_type"]
    if kind == "default":
        theirs = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, spec.rope.dim, 2).float() /
                                                                   spec.rope.dim))
        their_scale = 1.0
    else:
        theirs, their_scale = ROPE_INIT_FUNCTIONS[kind](config)
    assert torch.equal(ours, theirs) and scale == pytest.approx(their_scale, rel=1e-12)


def test_the_hubs_rope_scaling_reads_as_rope_parameters():
    """DeepSeek-V3's config.json as released: rope_scaling and a top-level rope_theta, no rope_parameters."""
    cfg = tiny_config("deepseek_v3").to_dict()
    del cfg["rope_parameters"]
    cfg.update(rope_theta=5000.0, rope_scaling={"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                                                "original_max_position_embeddings": 4096, "beta_fast": 32,
                                                "beta_slow": 1})
    rope = parse_spec(cfg).rope
    assert (rope.kind, rope.theta, rope.factor, rope.original_max_position_embeddings) == ("yarn", 5000.0, 40.0, 4096)
    assert rope.interleaved and rope.dim == cfg["qk_rope_head_dim"]
