"""crc32_combine against zlib on the whole, for any split."""

import zlib

from hypothesis import given, settings
from hypothesis import strategies as st

from moetier.store.crc import crc32_combine


@settings(max_examples=200, deadline=None)
@given(a=st.binary(max_size=300), b=st.binary(max_size=300))
def test_combine_equals_the_crc_of_the_concatenation(a, b):
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_combine_over_many_megabyte_chunks():
    data = bytes(range(251)) * 20_000  # ~5 MB, not a multiple of the chunk
    chunk = 1 << 20
    pieces = [data[i:i + chunk] for i in range(0, len(data), chunk)]
    crc = zlib.crc32(pieces[0])
    for p in pieces[1:]:
        crc = crc32_combine(crc, zlib.crc32(p), len(p))
    assert crc == zlib.crc32(data)
