#!/usr/bin/env bash
# scripts/dist.sh -- the PGXN archive, from git archive of a commit
#
#   bash scripts/dist.sh [COMMIT]        (default HEAD)
#
# Writes idempotency-VERSION.zip (VERSION from META.json) into the top of
# the tree (or into $IDEM_DIST_DIR), every file under idempotency-VERSION/,
# and prints its path.  scripts/release_check.sh checks what it holds.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rev=${1:-HEAD}
version=$(git show "$rev:META.json" | python3 -c 'import json,sys; print(json.load(sys.stdin)["version"])')
out=${IDEM_DIST_DIR:-$PWD}/idempotency-$version.zip
git archive --format=zip --prefix="idempotency-$version/" -o "$out" "$rev"
echo "$out"
