"""The suite and every command keep to the cache directory they are given: $MOETIER_CACHE, never ~/.cache."""

import subprocess
import sys
from pathlib import Path

from moetier.paths import default_cache_dir

TOUCH_THE_CACHE = """
from moetier.resolve import resolve_model
from moetier.sim.profile import HardwareProfile, known_profiles, user_profiles_dir
from moetier.cli.models import model_shape
from moetier.store.store import Store
model_shape("demo-coarse-xl")                      # reads config.json alone: converts nothing
Store(resolve_model("demo-fine", progress=False))  # converts a built-in model
known_profiles(); HardwareProfile.load("rtx4090")
print(user_profiles_dir())
"""


def test_the_suite_runs_under_a_private_cache(private_cache):
    assert default_cache_dir() == private_cache
    assert private_cache != Path.home() / ".cache" / "moetier"


def test_nothing_is_written_outside_moetier_cache(tmp_path):
    home, cache = tmp_path / "home", tmp_path / "cache"
    home.mkdir()
    env = {"HOME": str(home), "MOETIER_CACHE": str(cache), "PATH": "/usr/bin:/bin",
           "MPLCONFIGDIR": str(tmp_path / "mpl")}
    r = subprocess.run([sys.executable, "-c", TOUCH_THE_CACHE], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(cache / "profiles")
    assert not (home / ".cache" / "moetier").exists()
    assert sorted(p.name.split("-")[1] for p in cache.iterdir() if not p.name.startswith(".")) == ["fine"]
