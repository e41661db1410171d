"""Eq. 25's cosine however the parameters are split, this package's S_func on outputs whose answer is known, and
Eq. 30's frequency-weighted average."""

import math

import torch

from moetier.merge.merge import averaged
from moetier.merge.similarity import expert_output, functional_similarity, parameter_similarity


def test_parameter_similarity_is_the_cosine_whatever_the_chunks():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 300, generator=g, dtype=torch.float64)
    w[3] = -2 * w[1]  # opposite direction, another norm
    direct = torch.nn.functional.cosine_similarity(w[:, None], w[None], dim=-1)
    chunked = parameter_similarity([w[:, :7], w[:, 7:200], w[:, 200:]])
    torch.testing.assert_close(chunked, direct)
    assert math.isclose(chunked[1, 3].item(), -1.0, abs_tol=1e-12)


def test_functional_similarity_on_known_outputs():
    a = torch.tensor([[1.0, 0.0], [0.0, 2.0]])  # two tokens' outputs
    outputs = torch.stack([a, a, -a, torch.tensor([[0.0, 1.0], [2.0, 0.0]])])  # same, opposite, orthogonal
    s = functional_similarity(outputs)
    assert s[0, 1] == 1.0 and s[0, 2] == 0.0
    assert math.isclose(s[0, 3].item(), 1 - math.sqrt(2) / 2, rel_tol=1e-12)
    torch.testing.assert_close(s, s.T)


def test_expert_output_is_swiglu_or_relu():
    g = torch.Generator().manual_seed(1)
    x, gate, up, down = (torch.randn(*shape, generator=g) for shape in ((3, 4), (6, 4), (6, 4), (4, 6)))
    swiglu = expert_output({"gate_up_proj": torch.cat([gate, up]), "down_proj": down}, x)
    torch.testing.assert_close(swiglu, (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T)
    relu = expert_output({"up_proj": up, "down_proj": down}, x, "relu")
    torch.testing.assert_close(relu, torch.relu(x @ up.T) @ down.T)


def test_groups_average_with_their_frequencies():
    experts = {2: {"w": torch.full((2,), 1.0, dtype=torch.bfloat16)}, 5: {"w": torch.full((2,), 4.0,
                                                                                       dtype=torch.bfloat16)}}
    freq = (0, 0, 0.2, 0, 0, 0.1)
    out = averaged(experts, freq)["w"]
    assert out.dtype == torch.bfloat16 and out.tolist() == [2.0, 2.0]  # (0.2·1 + 0.1·4) / 0.3
    assert averaged(experts, (0,) * 6)["w"].tolist() == [2.5, 2.5]  # never routed to: evenly
