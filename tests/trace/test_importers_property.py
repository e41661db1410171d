"""Malformed JSON lines fed to the trace importers: only moetier's own errors come out."""

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moetier.errors import MoetierError
from moetier.trace.format import Trace
from moetier.trace.importers import import_trace
from tests.json_mutations import json_values, mutated

VLLM_META = {"type": "meta", "model_id": "allenai/OLMoE-1B-7B-0924", "top_k": 2}
VLLM_ROUTE = {"type": "route", "layer": 0, "topk_ids": [1, 5], "topk_weights": [0.6, 0.4]}
MIXTRAL = {"dataset": "gsm8k", "problem_id": 3, "layer": 0, "experts": [1, 5], "gating_probs": [0.6, 0.4],
           "token_idx": 0}


def corrupt(record) -> st.SearchStrategy:
    """One bad line: the record with a few values replaced or removed, any JSON value, or not JSON at all."""
    return st.one_of(mutated(record), mutated(record), json_values, st.text(max_size=20)).map(
        lambda r: r if isinstance(r, str) else json.dumps(r))


@st.composite
def files(draw):
    """A valid file of one of the two formats (varied routing, so not all of it is warm-up), with one or two of
    its lines corrupted."""
    first, rest = draw(st.sampled_from([(VLLM_META, VLLM_ROUTE), (MIXTRAL, MIXTRAL)]))
    ids_key = "experts" if "experts" in rest else "topk_ids"
    records = [first]
    for i in range(draw(st.integers(1, 8))):
        ids = draw(st.lists(st.integers(0, 63), min_size=2, max_size=2, unique=True))
        records.append(dict(rest, layer=0, **{ids_key: ids}, **({"token_idx": i} if "token_idx" in rest else {})))
    lines = [json.dumps(r) for r in records]
    for _ in range(draw(st.integers(1, 2))):
        i = draw(st.integers(0, len(lines) - 1))
        lines[i] = draw(corrupt(records[i]))
    return "\n".join(lines) + "\n"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=files())
def test_importers_raise_only_moetier_errors(tmp_path, text):
    path = tmp_path / "trace.jsonl"
    path.write_text(text)
    try:
        trace = import_trace(path, num_layers=4, num_experts=64)
    except MoetierError:
        return
    assert isinstance(trace, Trace) and trace.num_tokens > 0
