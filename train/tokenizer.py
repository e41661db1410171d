"""Byte-level BPE for the demo models, trained on the corpus's training split only.

    python -m train.tokenizer [--vocab 8192]     # writes ~/.cache/moetier/corpus/tokenizer/
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from moetier.atomic import atomic_dir
from train import corpus

EOS = "<|endoftext|>"


def train_tokenizer(texts: list[str], vocab_size: int = 8192) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=True,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def build(out: Path, vocab_size: int = 8192) -> Path:
    texts = corpus.load()
    tok = train_tokenizer([texts["prose_train"], texts["code_train"]], vocab_size)
    with atomic_dir(out) as tmp:
        tok.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": EOS, "bos_token": None,
             "add_bos_token": False, "model_max_length": 1024}, indent=1))
    return out


def load(out: Path = corpus.DEFAULT_OUT / "tokenizer", vocab_size: int = 8192) -> Path:
    if not (out / "tokenizer.json").exists():
        build(out, vocab_size)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--out", type=Path, default=corpus.DEFAULT_OUT / "tokenizer")
    print(build(ap.parse_args().out, ap.parse_args().vocab))
