"""A clone of the repository is whole: nothing in it reads, or sends a reader to, anything beside the checkout
(the folder the project was developed beside holds the originals of data/; a clone does not have it)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = {".py", ".md", ".sh", ".toml", ".json", ".txt", ".c", ".h", ".cfg", ".yml", ".yaml", ".jinja", ""}
OUTSIDE = ("../" + "shared", "shared/" + "data", '"shared" / "' + 'data"', '"shared", "' + 'data"')  # (split: this file)


def text_files():
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if (path.is_file() and path.suffix in TEXT and rel.parts[0] not in (".git", "build")
                and "egg-info" not in str(rel) and "__pycache__" not in rel.parts and ".pytest_cache" not in rel.parts):
            yield rel, path


def test_no_file_names_the_folder_beside_the_checkout():
    found = []
    for rel, path in text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        found += [f"{rel}: {needle}" for needle in OUTSIDE if needle in text]
    assert not found, "\n".join(found)


def test_what_the_commands_read_ships_in_the_repository():
    from train.corpus import VALID_BOOKS, book_names

    books = book_names()
    assert len(books) == 17 and set(VALID_BOOKS) <= set(books)
    for folder in ("mixtral-8x7b", "qwen1.5-moe-a2.7b", "olmoe-1b-7b"):
        assert list((ROOT / "data" / "traces" / folder).glob("*.jsonl.gz"))
    assert all((ROOT / "data" / name / "README.md").exists() for name in ("gutenberg", "traces"))
