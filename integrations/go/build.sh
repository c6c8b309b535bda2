#!/usr/bin/env bash
# integrations/go/build.sh OUTPUT [PACKAGE] -- build a command of this
# package (default: the net/http sample app, sample/nethttp) from Debian's
# Go packages only (golang-go, golang-github-gin-gonic-gin-dev,
# golang-github-jackc-pgx-v4-dev): GOPATH mode, with the sources those
# packages put in /usr/share/gocode, nothing downloaded (GOPROXY=off,
# GOFLAGS emptied).  This folder is linked into a temporary GOPATH as
# github.com/idempotency-pg/idempotency-go, as examples/gin/build.sh does.
set -euo pipefail

out=$(realpath -m "${1:?usage: build.sh OUTPUT [PACKAGE]}")
pkg=${2:-github.com/idempotency-pg/idempotency-go/sample/nethttp}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
gopath=$(mktemp -d "${TMPDIR:-/tmp}/idempotency-go.XXXXXX")
trap 'rm -rf "$gopath"' EXIT
mkdir -p "$gopath/src/github.com/idempotency-pg"
ln -s "$here" "$gopath/src/github.com/idempotency-pg/idempotency-go"

# The build cache: the user's, or one of our own where there is no home.
if [[ -z ${GOCACHE:-} && ! -d ${HOME:-/nonexistent} ]]; then
	export GOCACHE=$gopath/cache
fi
cd "$gopath/src/github.com/idempotency-pg/idempotency-go"
GO111MODULE=off GOPATH="$gopath:/usr/share/gocode" GOPROXY=off GOFLAGS='' \
	go build -o "$out" "$pkg"
