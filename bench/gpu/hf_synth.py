"""A second shape for the GPU benchmark (issue 52, item 7): DeepSeek-V2-Lite's (64 routed experts of 17.3 MB, top-6,
two shared experts, MLA attention, 27 layers of which the first is dense; 15.7 B parameters, 31 GB in bf16) with
random weights, written as a Hugging Face checkpoint by transformers' own class — so its names and layout are
the family's — then converted to a (linked) store. `moetier synth` writes OLMoE's family only.

Departures from the real model's config, none of which changes a shape: no YaRN rope scaling (the positions a
benchmark reaches need none) and router weights drawn wider (std 0.5, as the tests' tiny models: decisive routing,
as a trained router's is).

    python bench/gpu/hf_synth.py dsv2-lite-synth --cache DIR          # DIR/bench-gpu/dsv2-lite-synth{,-hf}
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch

# DeepSeek-V2-Lite's config.json (deepseek-ai/DeepSeek-V2-Lite), the fields that set shapes and routing
DSV2_LITE = dict(vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
                 num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
                 n_routed_experts=64, num_experts_per_tok=6, routed_scaling_factor=1.0, kv_lora_rank=512,
                 q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, topk_method="greedy",
                 n_group=1, topk_group=1, first_k_dense_replace=1, norm_topk_prob=False, rms_norm_eps=1e-6,
                 max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
HF_SYNTHS = {"dsv2-lite-synth": ("deepseek_v2", DSV2_LITE)}  # name -> (family, config)


def checkpoint(family: str, config: dict, out: Path, seed: int = 0) -> Path:
    """A random bf16 checkpoint of `family` with `config` in `out` (written under a temporary name, renamed whole)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    torch.manual_seed(seed)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **config), dtype=torch.bfloat16)
    with torch.no_grad():  # a wider router: decisive routing, as a trained one's (the tests' tiny models do the same)
        for name, p in model.named_parameters():
            if name.endswith("gate.weight") and p.dim() == 2 and p.shape[0] > 1:
                p.normal_(0, 0.5)
    model.save_pretrained(tmp, max_shard_size="4GB")
    del model
    tmp.rename(out)
    print(f"wrote {out} in {time.perf_counter() - start:.0f} s", flush=True)
    return out


def store(name: str, cache: Path, **overrides) -> tuple[Path, Path]:
    """(store, its Hugging Face checkpoint) of a shape in HF_SYNTHS, made once under cache/bench-gpu; `overrides`
    change its config (a smaller one tries the pipeline out)."""
    from moetier.store.convert import convert

    family, config = HF_SYNTHS[name]
    hf = checkpoint(family, {**config, **overrides}, cache / "bench-gpu" / f"{name}-hf")
    path = cache / "bench-gpu" / name
    if not (path / "manifest.json").exists():
        convert(hf, path, progress=False)
    return path, hf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", choices=sorted(HF_SYNTHS))
    ap.add_argument("--cache", type=Path, default=None, help="default: moetier's cache")
    args = ap.parse_args()
    from moetier.paths import default_cache_dir

    print(store(args.name, args.cache or default_cache_dir()))


if __name__ == "__main__":
    main()
