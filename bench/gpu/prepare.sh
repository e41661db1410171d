#!/usr/bin/env bash
# Readies this checkout for the device tool's call of bench/gpu/run.sh on a lent GPU machine (its python 3.12 has
# torch with CUDA, transformers, accelerate and triton; no network), and puts it back afterwards:
#
#     bash bench/gpu/prepare.sh             # wheels, the tree under the tool's 64 MiB, the run() call printed
#     bash bench/gpu/prepare.sh --llama     # the same with llama.cpp's source archive carried (its own call)
#     bash bench/gpu/prepare.sh restore     # the index as it was: do this before any commit or CI run
#
# What it does: the wheels that python lacks into .whl/ (in .gitignore: zlib-ng, threadpoolctl, gguf; transformers
# 5.24 with a cp312 regex in .whl/tf/, the parity tests' reference), fetched from PyPI for cp312 manylinux; the paths
# the check does not need — the other demo models, the docs' images, the corpora and traces — taken out of the index
# for the call (a tracked file always travels) and ignored through .git/info/exclude, so the tree and what is
# carried stay under the tool's 64 MiB; then it adds up what would travel and prints the run() call, or says what
# is over.
# While prepared, a pre-commit hook refuses commits (the index would commit the models' deletion).
set -euo pipefail
cd "$(dirname "$0")/../.."
LIMIT=$((64 << 20))
OUT_OF_CALL=(models/demo-deep models/demo-coarse docs/img data)  # (the check needs models/demo-fine alone)
EXCLUDE=$(git rev-parse --git-path info/exclude)
HOOK=$(git rev-parse --git-path hooks)/pre-commit
MARK="# bench/gpu/prepare.sh"
BEGIN="# >>> bench\/gpu\/prepare.sh" END="# <<< bench\/gpu\/prepare.sh"  # (the exclude file's lines it adds, between)
WHEELS=(zlib-ng threadpoolctl gguf)
TF=(transformers==5.24.0 regex)

restore() {
    git reset -q HEAD -- "${OUT_OF_CALL[@]}"
    [ -f "$EXCLUDE" ] && sed -i "/^$BEGIN\$/,/^$END\$/d" "$EXCLUDE"
    if [ -f "$HOOK" ] && grep -q -F "$MARK" "$HOOK"; then rm "$HOOK"; fi
    echo "prepare: restored (the index holds every tracked path again; .whl/ stays, ignored by .gitignore)"
}

if [ "${1:-}" = restore ]; then restore; exit 0; fi
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
    echo "prepare: error: the checkout has changes not committed; commit them first (the call carries the tree)" >&2
    exit 1
fi

fetch() {  # DIR PACKAGES...: cp312 manylinux wheels, without their dependencies
    local dir=$1; shift
    mkdir -p "$dir"
    python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$dir" "$@"
}
[ -n "$(ls .whl/*.whl 2>/dev/null)" ] || fetch .whl "${WHEELS[@]}"
[ -n "$(ls .whl/tf/*.whl 2>/dev/null)" ] || fetch .whl/tf "${TF[@]}"
if [ "${1:-}" = --llama ] && [ ! -f .whl/llama/llama.cpp-src.tar.xz ]; then
    python bench/gpu/llamacpp_cuda.py pack
fi

if [ -f "$HOOK" ]; then
    echo "prepare: error: $HOOK exists (prepared already? then restore first; else a hook of yours: set it aside)" >&2
    exit 1
fi
trap 'restore >&2' ERR  # (a step failing part way: nothing left half done)
mkdir -p "$(dirname "$EXCLUDE")" "$(dirname "$HOOK")"
git rm -r -q --cached "${OUT_OF_CALL[@]}"
{ echo "# >>> bench/gpu/prepare.sh"; for p in "${OUT_OF_CALL[@]}"; do echo "/$p/"; done
  echo "# <<< bench/gpu/prepare.sh"; } >> "$EXCLUDE"
printf '#!/bin/sh\n%s\necho "%s" >&2\nexit 1\n' "$MARK" \
    "bench/gpu/prepare.sh has taken paths out of the index for a GPU call: run it with restore first" > "$HOOK"
chmod +x "$HOOK"

# what travels: the tracked files, the untracked ones not ignored, and what is carried
carry=(.whl/tf)
for w in .whl/*.whl; do carry+=("$w"); done
[ "${1:-}" = --llama ] && carry+=(.whl/llama)
sum() { awk '{s += $1} END {print s + 0}'; }  # (sizes, one a line: xargs may split a long list into several calls)
tree=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 -r stat -c %s 2>/dev/null | sum)
carried=$(find "${carry[@]}" -type f -printf '%s\n' | sum)
total=$((tree + carried))
mb() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 1e6}'; }
echo "prepare: the tree $(mb "$tree") MB, carried $(mb "$carried") MB: $(mb "$total") MB of the tool's $(mb "$LIMIT")"
trap - ERR
if (( total > LIMIT )); then
    restore
    echo "prepare: error: over the tool's 64 MiB; take more out of the call (OUT_OF_CALL in this script)" >&2
    exit 1
fi
json=$(printf '"%s", ' "${carry[@]}")
echo "prepare: ready. The call (the main one; bench/gpu/run.sh's header names the others), then restore:"
echo "    run(command=\"bash bench/gpu/run.sh\", carry=[${json%, }], timeout_s=570)"
echo "    bash bench/gpu/prepare.sh restore"
