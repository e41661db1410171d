"""moetier/engine/grouping.py: a plan's (token, expert) pairs grouped by expert, and what goes to a GPU with them."""

import numpy as np
import torch

from moetier.engine.grouping import ExpertGroups, packed, to_device, unpacked


def test_what_goes_to_a_gpu_goes_in_one_buffer_each_tensor_a_view_of_its_own_bytes():
    """The grouping's token rows (int64) and routing weights (cast on the host), and any others, in one buffer: each
    at a multiple of 8 bytes, and read back as itself — its values and dtype (what one copy to a GPU carries)."""
    tensors = (torch.arange(5, dtype=torch.int64), torch.tensor([0.5, 0.25, 0.125]).bfloat16(),
               torch.tensor([1.5, -2.0], dtype=torch.float32), torch.tensor([7], dtype=torch.int64))
    staged, spans = packed(tensors, pin=False)
    assert staged.dtype == torch.uint8 and all(a % 8 == 0 for a, _ in spans)
    assert [b - a for a, b in spans] == [40, 6, 8, 8] and staged.numel() == spans[-1][1]
    for got, want in zip(unpacked(staged.clone(), tensors, spans), tensors, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_on_the_cpu_nothing_is_copied():
    t = torch.arange(3)
    assert to_device(torch.device("cpu"), t)[0] is t


def test_the_pairs_are_grouped_by_expert_with_their_tokens_rows_and_weights():
    """Two tokens' top-2 (a SKIP among them): pairs by ascending expert, tokens ascending within each, each with
    its token's row and its weight in the router's dtype."""
    x = torch.arange(8, dtype=torch.float32).view(2, 4)
    ids = np.array([[3, 1], [1, -1]])
    weights = np.array([[0.75, 0.25], [0.5, 0.0]], dtype=np.float32)
    groups = ExpertGroups(x, ids, weights, np.bincount(ids[ids >= 0], minlength=4), torch.bfloat16)
    assert groups.token_of.tolist() == [0, 1, 0] and groups.offsets == [0, 0, 2, 2, 3]
    assert groups.ws.dtype == torch.bfloat16 and groups.ws.tolist() == [0.25, 0.5, 0.75]
    assert torch.equal(groups.xs, x[[0, 1, 0]])
