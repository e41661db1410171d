"""A GGUF model's tokenizer, built from its `tokenizer.ggml.*` metadata with the `tokenizers` library: the files a
store keeps (tokenizer.json, tokenizer_config.json with the chat template), as the Hugging Face folder the GGUF was
converted from had them.

Built here rather than through transformers' GGUF loader: transformers is not a dependency of moetier, and its
GGUF support names neither OLMoE nor several MoE architectures. Which tokenizers: byte-level BPE (`gpt2`, what
OLMoE, Qwen and DeepSeek files carry) with the pre-tokenizers llama.cpp names (`tokenizer.ggml.pre`) whose
expressions are known here; anything else is refused with its name."""

from __future__ import annotations

import json

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from moetier.store.gguf_file import GgufError

# tokenizer.json's own split expressions (llama.cpp's llama-vocab.cpp carries the same, adapted to its regex engine)
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
          r"\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
         r"\s+(?!\S)|\s+")
GPT2 = None  # the byte-level pre-tokenizer's own expression
PRE = {"gpt-2": GPT2, "olmo": GPT2, "phi-2": GPT2, "roberta-bpe": GPT2, "llama-bpe": LLAMA3, "llama-v3": LLAMA3,
       "qwen2": QWEN2, "deepseek-r1-qwen": QWEN2}
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types: special tokens, and tokens added to the vocabulary


def build(metadata: dict) -> Tokenizer:
    model = metadata.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise GgufError(f"the GGUF's tokenizer is {model!r}; moetier builds byte-level BPE ('gpt2') tokenizers",
                        hint="a Hugging Face folder of the same model carries its tokenizer.json")
    pre = metadata.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in PRE:
        raise GgufError(f"the GGUF's pre-tokenizer {pre!r} is not one moetier knows",
                        hint=f"known: {', '.join(PRE)}")
    tokens = list(metadata["tokenizer.ggml.tokens"])
    vocab = {t: i for i, t in enumerate(tokens)}
    # a merge whose pieces or result are not tokens can never apply (llama.cpp finds no token for it); a file made
    # from a vocabulary without merges carries a placeholder one ("a b": llama.cpp's loader wants a merge), which
    # the tokenizers library would refuse
    merges = [pair for pair in (tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", []))
              if len(pair) == 2 and pair[0] in vocab and pair[1] in vocab and pair[0] + pair[1] in vocab]
    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=pre in ("llama-bpe", "llama-v3")))
    if PRE[pre] is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRE[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    types = list(metadata.get("tokenizer.ggml.token_type", []))
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, kind in enumerate(types) if kind == CONTROL])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i, kind in enumerate(types) if kind == USER_DEFINED])
    return tok


def tokenizer_files(metadata: dict) -> dict[str, bytes]:
    """tokenizer.json and tokenizer_config.json (special tokens, whether a BOS starts a text, the chat template)."""
    tok = build(metadata)
    tokens = metadata["tokenizer.ggml.tokens"]
    settings: dict = {"tokenizer_class": "PreTrainedTokenizerFast",
                      "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False))}
    for ours, theirs in (("bos_token", "bos"), ("eos_token", "eos"), ("pad_token", "padding"), ("unk_token", "unknown")):
        key = f"tokenizer.ggml.{theirs}_token_id"
        if key in metadata and 0 <= int(metadata[key]) < len(tokens):
            settings[ours] = tokens[int(metadata[key])]
    if "tokenizer.chat_template" in metadata:
        settings["chat_template"] = str(metadata["tokenizer.chat_template"])
    return {"tokenizer.json": tok.to_str().encode(), "tokenizer_config.json": json.dumps(settings, indent=1).encode()}
