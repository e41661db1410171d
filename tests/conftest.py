import os

import pytest
import torch

from moetier.store.convert import convert
from tests.tiny_models import build_tiny


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--every-budget", action="store_true", help="hold exact mode to every expert budget from a "
                     "layer's top-k to all experts (default: the cache's edges and two drawn: tests/model/budgets.py)")


@pytest.fixture(scope="session")
def every_budget(request) -> bool:
    return request.config.getoption("--every-budget")


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    """Every test, and every process a test starts, converts and calibrates into a fresh cache directory: the
    suite never touches the user's ~/.cache/moetier."""
    path = tmp_path_factory.mktemp("moetier-cache")
    old = os.environ.get("MOETIER_CACHE")
    os.environ["MOETIER_CACHE"] = str(path)
    yield path
    if old is None:
        del os.environ["MOETIER_CACHE"]
    else:
        os.environ["MOETIER_CACHE"] = old


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory):
    """(reference model, store path) for a family, built once per session."""
    made = {}

    def get(family: str, dtype: torch.dtype = torch.float32, copy: bool = False, **overrides):
        """`copy`: the experts copied into the store's own blobs (default: a linked store reading the checkpoint's
        files, as `convert` makes by default)."""
        key = (family, dtype, copy, repr(sorted(overrides.items())))
        if key not in made:
            root = tmp_path_factory.mktemp(family)
            ref = build_tiny(family, root / "hf", dtype=dtype, **overrides)
            made[key] = (ref, convert(root / "hf", root / "store", progress=False, copy=copy))
        return made[key]

    return get
