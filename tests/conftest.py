import pytest

from moetier.store.convert import convert
from tests.tiny_models import build_tiny


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory):
    """(reference model, store path) for a family, built once per session."""
    made = {}

    def get(family: str, **overrides):
        key = (family, repr(sorted(overrides.items())))
        if key not in made:
            root = tmp_path_factory.mktemp(family)
            ref = build_tiny(family, root / "hf", **overrides)
            made[key] = (ref, convert(root / "hf", root / "store", progress=False))
        return made[key]

    return get
