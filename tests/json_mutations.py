"""Hypothesis strategies for malformed JSON documents: a valid document with a few values replaced by arbitrary
JSON, or removed."""

from __future__ import annotations

import copy

from hypothesis import strategies as st

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=8)


def slots(doc, out=None):
    """Every (container, key) in a JSON document."""
    out = [] if out is None else out
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        out.append((doc, key))
        slots(value, out)
    return out


@st.composite
def mutated(draw, doc, max_changes: int = 3):
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, max_changes))):
        places = slots(doc)
        if not places:
            return draw(json_values)
        container, key = draw(st.sampled_from(places))
        if isinstance(container, dict) and draw(st.booleans()):
            del container[key]
        else:
            container[key] = draw(json_values)
    return doc
