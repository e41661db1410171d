"""Malformed config.json contents fed to every family's parser: a ModelSpec or moetier's own error."""

from hypothesis import given, settings
from hypothesis import strategies as st

from moetier.config import ModelSpec
from moetier.errors import MoetierError
from moetier.model.families import parse_spec
from tests.json_mutations import json_values, mutated
from tests.tiny_models import FAMILY_CONFIGS, SEQ2SEQ_CONFIGS, tiny_config

CONFIGS = [tiny_config(family).to_dict() for family in [*FAMILY_CONFIGS, *SEQ2SEQ_CONFIGS]]


@settings(max_examples=400, deadline=None)
@given(cfg=st.sampled_from(CONFIGS).flatmap(mutated) | json_values)
def test_config_parsers_raise_only_moetier_errors(cfg):
    try:
        spec = parse_spec(cfg)
    except MoetierError:
        return
    assert isinstance(spec, ModelSpec)
