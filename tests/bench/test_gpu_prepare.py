"""bench/gpu/prepare.sh, which readies a checkout for the device tool's GPU call: on a repository laid out as ours
(the wheels stood in for: no network here) it takes the paths the check does not need out of the index and ignores
them, refuses commits while prepared (the index would commit the models' deletion), and `restore` leaves the
repository as it was; a call over the tool's 64 MiB is refused and undone. On a clone of this repository (where the
checkout is one: CI's copy has no .git), the call's real tree fits beside the wheels it carries."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu" / "prepare.sh"
WHEELS_MB = 15  # what prepare.sh fetched on 2026-11-29: transformers 5.24, regex, zlib-ng, threadpoolctl, gguf

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def git(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=check)


def prepare(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "bench/gpu/prepare.sh", *args], cwd=repo, capture_output=True, text=True)


def laid_out(repo: Path, big: int = 0) -> Path:
    """A repository with our layout (and the script), committed; `big`: bytes of a file the check needs."""
    for path in ("models/demo-fine/w.bin", "models/demo-deep/w.bin", "models/demo-coarse/w.bin", "docs/img/a.png",
                 "data/t.txt", "moetier/__init__.py"):
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(path)
    if big:
        with open(repo / "models" / "demo-fine" / "big.bin", "wb") as f:
            f.truncate(big)
    (repo / "bench" / "gpu").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "bench" / "gpu" / "prepare.sh")
    (repo / ".gitignore").write_text("/.whl/\n")
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "layout")
    return stand_in_wheels(repo)


def stand_in_wheels(repo: Path) -> Path:
    (repo / ".whl" / "tf").mkdir(parents=True)
    (repo / ".whl" / "zlib_ng-1-cp312-cp312-manylinux2014_x86_64.whl").write_bytes(b"z")
    (repo / ".whl" / "tf" / "transformers-5-py3-none-any.whl").write_bytes(b"t")
    return repo


def test_prepared_then_restored(tmp_path):
    repo = laid_out(tmp_path / "repo")
    tracked = git(repo, "ls-files").stdout
    done = prepare(repo)
    assert done.returncode == 0, done.stderr
    assert 'run(command="bash bench/gpu/run.sh", carry=[".whl/tf", ".whl/zlib_ng-1-' in done.stdout
    assert sorted(git(repo, "ls-files").stdout.split()) == sorted(
        [".gitignore", "bench/gpu/prepare.sh", "models/demo-fine/w.bin", "moetier/__init__.py"])
    assert git(repo, "status", "--porcelain", "--untracked-files=all").stdout.startswith("D ")  # (none untracked)
    assert "??" not in git(repo, "status", "--porcelain", "--untracked-files=all").stdout
    refused = git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "x", check=False)
    assert refused.returncode != 0 and "restore first" in refused.stderr
    assert prepare(repo).returncode == 1  # (prepared already: its index differs from HEAD)
    done = prepare(repo, "restore")
    assert done.returncode == 0, done.stderr
    assert git(repo, "ls-files").stdout == tracked and git(repo, "status", "--porcelain").stdout == ""
    assert ">>> bench/gpu/prepare.sh" not in (repo / ".git" / "info" / "exclude").read_text()
    assert not (repo / ".git" / "hooks" / "pre-commit").exists()


def test_a_call_over_the_tools_64_mib_is_refused_and_undone(tmp_path):
    repo = laid_out(tmp_path / "repo", big=65 << 20)  # (a sparse file: its size, no disk)
    tracked = git(repo, "ls-files").stdout
    done = prepare(repo)
    assert done.returncode == 1 and "over the tool's 64 MiB" in done.stderr
    assert git(repo, "ls-files").stdout == tracked and git(repo, "status", "--porcelain").stdout == ""
    assert not (repo / ".git" / "hooks" / "pre-commit").exists()


def test_a_checkout_with_changes_not_committed_is_refused(tmp_path):
    repo = laid_out(tmp_path / "repo")
    (repo / "moetier" / "__init__.py").write_text("changed")
    done = prepare(repo)
    assert done.returncode == 1 and "not committed" in done.stderr
    assert not (repo / ".git" / "hooks" / "pre-commit").exists()


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="this checkout is not a git repository (CI's copy)")
def test_this_repositorys_call_fits_beside_the_wheels_it_carries(tmp_path):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    stand_in_wheels(clone)
    done = prepare(clone)
    assert done.returncode == 0, done.stderr
    tree = float(re.search(r"the tree ([\d.]+) MB", done.stdout).group(1))
    assert (tree + WHEELS_MB) * 1e6 < 64 << 20, f"the call's tree is {tree} MB: take more out of it (OUT_OF_CALL)"
    assert (clone / "models" / "demo-fine").is_dir() and not git(clone, "ls-files", "models/demo-deep").stdout
    assert prepare(clone, "restore").returncode == 0 and git(clone, "status", "--porcelain").stdout == ""
