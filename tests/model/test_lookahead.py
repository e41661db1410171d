"""The model's look-ahead (SMoE §IV-C, used by `smoe-lookahead`): the next MoE layer's router on the hidden state
before this layer's experts. With experts that add nothing it is exactly that router's input, so its logits equal
the router's own; and its writes into the KV cache never change the output."""

import pytest
import torch
import torch.nn.functional as F

from moetier.model.batch import StepBatch
from moetier.model.kv_cache import KVCache
from moetier.model.transformer import Transformer
from moetier.store.store import Store


class NoExperts:
    """Experts that add `scale`·x (nothing by default); records the real router logits and, if asked, the
    look-ahead's."""

    def __init__(self, spec, look: bool, scale: float = 0.0) -> None:
        self.spec, self.look, self.scale, self.model = spec, look, scale, None
        self.router_logits, self.looked = {}, {}

    def __call__(self, layer, x, scores, topk_ids, topk_weights, shared=None):
        self.router_logits[layer] = F.linear(x, self.model.layers[layer]["router"]).clone()
        later = [m for m in self.spec.moe_layers if m > layer]
        if self.look and later:
            self.looked[later[0]] = self.model.lookahead(layer, later[0]).clone()
        return self.scale * x


def run(store: Store, look: bool, tokens: list[int], scale: float = 0.0):
    dense = store.load_dense()
    experts = NoExperts(store.spec, look, scale)
    model = Transformer(store.spec, dense, experts)
    experts.model = model
    kv = KVCache(store.spec, 1, 64, dense["embed_tokens"].dtype)
    prefill = StepBatch.prefill([tokens], [0])
    logits = [model.forward(prefill, kv)]
    decode = StepBatch.decode_step([int(logits[0].argmax())], [0], [len(tokens)], 1)
    logits.append(model.forward(decode, kv))
    return experts, logits


@pytest.mark.parametrize("family,overrides", [("olmoe", dict(num_hidden_layers=4)),
                                              ("qwen3_moe", dict(num_hidden_layers=4, mlp_only_layers=[1]))])
def test_lookahead_is_the_next_router_on_the_state_before_the_experts(tiny_store, family, overrides):
    _, path = tiny_store(family, **overrides)
    store = Store(path)
    looked, _ = run(store, True, [5, 9, 17, 3, 44])
    assert looked.looked and set(looked.looked) == set(store.spec.moe_layers[1:])
    for layer, predicted in looked.looked.items():  # (the decode step's, the last recorded)
        torch.testing.assert_close(predicted, looked.router_logits[layer])
    # with experts that do add something the look-ahead's state is off, and so are the keys and values it writes;
    # the real forward overwrites them before reading
    looked, logits = run(store, True, [5, 9, 17, 3, 44], scale=0.5)
    plain, plain_logits = run(store, False, [5, 9, 17, 3, 44], scale=0.5)
    assert not torch.allclose(looked.looked[store.spec.moe_layers[1]], looked.router_logits[store.spec.moe_layers[1]])
    for a, b in zip(logits, plain_logits):
        assert torch.equal(a, b)


def test_lookahead_refuses_outside_a_step_and_beyond_the_next_moe_layer(tiny_store):
    _, path = tiny_store("olmoe", num_hidden_layers=4)
    store = Store(path)
    model = Transformer(store.spec, store.load_dense(), NoExperts(store.spec, False))
    with pytest.raises(RuntimeError, match="inside a forward step"):
        model.lookahead(0, 1)
    model._step, model._h = object(), object()  # as inside a step
    with pytest.raises(ValueError, match="only the next MoE layer"):
        model.lookahead(0, 2)
