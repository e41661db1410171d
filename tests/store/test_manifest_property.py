"""Malformed manifests fed to the store's parser: only moetier's own errors come out."""

import json
import shutil

import pytest
from hypothesis import HealthCheck, given, settings

from moetier.errors import MoetierError
from moetier.store.names import MANIFEST
from moetier.store.store import Store
from tests.json_mutations import mutated


@pytest.fixture(scope="module")
def valid(tiny_store):
    _, path = tiny_store("qwen2_moe")
    return path, json.loads((path / MANIFEST).read_text())


def check(valid, tmp_path, doc):
    path, _ = valid
    store = tmp_path / "store"
    if not store.exists():
        shutil.copytree(path, store)
    (store / MANIFEST).write_text(json.dumps(doc))
    try:
        Store(store).load_dense()
    except MoetierError:
        pass


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=__import__("hypothesis").strategies.data())
def test_malformed_manifests_raise_only_moetier_errors(valid, tmp_path, data):
    doc = data.draw(mutated(valid[1]))
    check(valid, tmp_path, doc)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=__import__("hypothesis").strategies.data())
def test_malformed_model_configs_in_a_manifest_raise_only_moetier_errors(valid, tmp_path, data):
    doc = dict(valid[1], config=data.draw(mutated(valid[1]["config"])))
    check(valid, tmp_path, doc)
