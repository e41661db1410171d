"""The model's tokenizer (tokenizer.json through the `tokenizers` library), with incremental detokenising."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from moetier.errors import ModelNotFoundError


class Tokenizer:
    def __init__(self, path: Path, bos_token_id: int | None = None) -> None:
        self._tok = HFTokenizer.from_file(str(path))
        config = path.parent / "tokenizer_config.json"
        settings = json.loads(config.read_text()) if config.exists() else {}
        self.add_bos = bool(settings.get("add_bos_token", False)) and bos_token_id is not None
        self.bos_token_id = bos_token_id

    @classmethod
    def from_store(cls, store) -> Tokenizer:
        if store.tokenizer_path is None:
            raise ModelNotFoundError(f"{store.path} has no tokenizer.json",
                                     hint="pass token ids instead of text, or add the model's tokenizer.json")
        return cls(store.tokenizer_path, store.spec.bos_token_id)

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text).ids
        if self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


class TextStream:
    """Turns a growing list of token ids into text deltas, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.emitted = 0

    def delta(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids)
        if text.endswith("\ufffd"):
            return ""
        out, self.emitted = text[self.emitted:], len(text)
        return out
