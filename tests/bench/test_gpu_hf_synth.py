"""bench/gpu/hf_synth.py: DeepSeek-V2-Lite's config, shrunk, written by transformers' own class and converted — the
store the GPU benchmark's second shape reads, its routing and MLA as the family's."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "gpu"))
import hf_synth  # noqa: E402

SMALL = dict(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16, kv_lora_rank=32,
             qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32)


def test_a_shrunk_deepseek_v2_lite_is_a_store_that_generates(tmp_path):
    from moetier import Engine

    store, hf = hf_synth.store("dsv2-lite-synth", tmp_path, **SMALL)
    assert (hf / "config.json").exists() and not hf.with_name(hf.name + ".tmp").exists()
    with Engine.from_pretrained(store, expert_memory="50%", progress=False) as engine:
        spec = engine.spec
        assert (spec.family, spec.num_experts, spec.top_k) == ("deepseek_v2", 16, 6)
        assert tuple(spec.moe_layers) == (1, 2)  # (first_k_dense_replace 1: the first layer is dense)
        out = engine.generate([[5, 6, 7]], max_new_tokens=3, ignore_eos=True)
    assert len(out.token_ids[0]) == 3
