import pytest

from moetier.config import MemoryBudget
from moetier.errors import BudgetError


@pytest.mark.parametrize("text,kind,value", [
    ("30%", "share", 0.3), ("100%", "share", 1.0), ("512MiB", "bytes", 512 * 2**20), ("2GB", "bytes", 2e9),
    ("1.5 GiB", "bytes", 1.5 * 2**30), ("4096", "bytes", 4096), ("auto", "auto", 0.0), ("AUTO", "auto", 0.0),
])
def test_parse_budget(text, kind, value):
    b = MemoryBudget.parse(text)
    assert (b.kind, b.value) == (kind, pytest.approx(value))


@pytest.mark.parametrize("text", ["lots", "30", "0%", "150%", "-5MB", "12 parsecs", ""])
def test_bad_budget_says_what_is_accepted(text):
    if text == "30":  # a bare number is bytes, and valid
        assert MemoryBudget.parse(text).value == 30
        return
    with pytest.raises(BudgetError):
        MemoryBudget.parse(text)


def test_resolve():
    assert MemoryBudget.parse("25%").resolve(1000) == 250
    assert MemoryBudget.parse("1KiB").resolve(10**9) == 1024
    assert MemoryBudget.parse("auto").resolve(1000, available_bytes=5000) == 1000
    assert MemoryBudget.parse("auto").resolve(1000, available_bytes=300) == 300
