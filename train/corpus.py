"""The demo models' corpus, rebuilt deterministically from inputs on every machine: English prose from the
repository's data/gutenberg (gzipped, detokenised here) and Python source from this interpreter's standard library
(no test folders, no site-packages). Validation holds out whole books and whole modules.

    python -m train.corpus [--out DIR]        # default ~/.cache/moetier/corpus (or $MOETIER_CACHE/corpus)
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import re
import sysconfig
from pathlib import Path

from moetier.atomic import atomic_dir
from moetier.errors import MoetierError
from moetier.paths import default_cache_dir

GUTENBERG = Path(__file__).resolve().parents[1] / "data" / "gutenberg"  # each book NAME.txt as NAME.txt.gz
DEFAULT_OUT = default_cache_dir() / "corpus"
VALID_BOOKS = ("carroll-alice.txt", "chesterton-thursday.txt")  # held out whole
VALID_EVERY = 12  # every 12th module (sorted by path) is held out whole
SEPARATOR = "\n<|endoftext|>\n"  # between documents (books, modules)

_DETOK = [
    (re.compile(r"``\s*"), '"'),  # opening double quote
    (re.compile(r"\s*''"), '"'),  # closing double quote
    (re.compile(r"(^|\s)`\s*"), r"\1'"),  # opening single quote
    (re.compile(r" (n't|'s|'re|'ve|'ll|'d|'m|')(?=\s|$)", re.IGNORECASE), r"\1"),  # contractions, closing quote
    (re.compile(r" ([,.;:!?)\]])"), r"\1"),  # no space before closing punctuation
    (re.compile(r"([(\[]) "), r"\1"),  # none after opening brackets
]


def detokenise(line: str) -> str:
    """Undo NLTK-style word tokenisation: `the bank , and` -> `the bank, and`; `` `` x '' `` -> `"x"`."""
    for pattern, repl in _DETOK:
        line = pattern.sub(repl, line)
    return line


def book_names() -> list[str]:
    """The books' names (`austen-emma.txt`, ...), sorted."""
    names = sorted(p.name.removesuffix(".gz") for p in GUTENBERG.glob("*.txt.gz"))
    if not names:
        raise MoetierError(f"no books in {GUTENBERG}: the demo models' texts ship in the repository's data folder",
                           hint="run from a whole checkout of moetier (git clone), or give your own text file")
    return names


def read_book(name: str) -> str:
    """A book's text as it came (word-tokenised)."""
    with gzip.open(GUTENBERG / f"{name}.gz", "rt", encoding="utf-8") as f:
        return f.read()


def prose_documents() -> dict[str, str]:
    return {name: "\n".join(detokenise(line) for line in read_book(name).splitlines()) for name in book_names()}


def prompt_lines(names: list[str], n: int, words: int = 40) -> list[str]:
    """`n` prompts of at most `words` words from the books `names`: lines of 20 words or more, spread evenly over
    each book (the predictors' training and benchmark prompts)."""
    books = []
    for name in names:
        lines = [detokenise(line) for line in read_book(name).splitlines()]
        books.append([" ".join(line.split()[:words]) for line in lines if len(line.split()) >= 20])
    per_book = (n + len(books) - 1) // len(books)
    return [book[i * len(book) // per_book] for book in books if book for i in range(per_book)][:n]


def code_documents() -> dict[str, str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = {}
    for p in sorted(root.rglob("*.py")):
        parts = p.relative_to(root).parts
        if "site-packages" in parts or any(x in ("test", "tests", "idle_test") for x in parts):
            continue
        try:
            docs[str(p.relative_to(root))] = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
    return docs


def split(docs: dict[str, str], is_valid) -> tuple[dict[str, str], dict[str, str]]:
    train = {k: v for i, (k, v) in enumerate(docs.items()) if not is_valid(i, k)}
    valid = {k: v for i, (k, v) in enumerate(docs.items()) if is_valid(i, k)}
    return train, valid


def build(out: Path = DEFAULT_OUT) -> Path:
    """Write prose_{train,valid}.txt, code_{train,valid}.txt and corpus.json into `out` (atomically)."""
    prose = split(prose_documents(), lambda i, k: k in VALID_BOOKS)
    code = split(code_documents(), lambda i, k: i % VALID_EVERY == 0)
    meta = {}
    with atomic_dir(out) as tmp:
        for domain, (train, valid) in (("prose", prose), ("code", code)):
            for name, docs in (("train", train), ("valid", valid)):
                text = SEPARATOR.join(docs.values())
                (tmp / f"{domain}_{name}.txt").write_text(text, encoding="utf-8")
                meta[f"{domain}_{name}"] = {"documents": list(docs), "chars": len(text),
                                            "sha256": hashlib.sha256(text.encode()).hexdigest()}
        (tmp / "corpus.json").write_text(json.dumps(meta, indent=1))
    return out


def load(out: Path = DEFAULT_OUT) -> dict[str, str]:
    """{'prose_train': text, ...}; builds the corpus first if it is not there."""
    if not (out / "corpus.json").exists():
        build(out)
    return {f"{d}_{s}": (out / f"{d}_{s}.txt").read_text(encoding="utf-8")
            for d in ("prose", "code") for s in ("train", "valid")}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    path = build(ap.parse_args().out)
    for k, v in json.loads((path / "corpus.json").read_text()).items():
        print(f"{k:12} {len(v['documents']):4} documents {v['chars'] / 1e6:6.2f} M chars")
