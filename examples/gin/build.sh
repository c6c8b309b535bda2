#!/usr/bin/env bash
# examples/gin/build.sh OUTPUT -- build the Gin example from Debian's Go
# packages only (golang-go, golang-github-gin-gonic-gin-dev,
# golang-github-jackc-pgx-v4-dev): GOPATH mode, with the sources that those
# packages put in /usr/share/gocode, and nothing downloaded (GOPROXY=off,
# GOFLAGS emptied).  This folder is the package example.com/idempotency-gin
# of a temporary GOPATH, and ../../integrations/go the middleware it
# imports, github.com/idempotency-pg/idempotency-go (with its Gin adapter,
# .../gin).
set -euo pipefail

out=$(realpath -m "${1:?usage: build.sh OUTPUT}")
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
gopath=$(mktemp -d "${TMPDIR:-/tmp}/idempotency-gin.XXXXXX")
trap 'rm -rf "$gopath"' EXIT
mkdir -p "$gopath/src/example.com"
ln -s "$here" "$gopath/src/example.com/idempotency-gin"
mkdir -p "$gopath/src/github.com/idempotency-pg"
ln -s "$(cd "$here/../../integrations/go" && pwd)" "$gopath/src/github.com/idempotency-pg/idempotency-go"

# The build cache: the user's, or one of our own where there is no home.
if [[ -z ${GOCACHE:-} && ! -d ${HOME:-/nonexistent} ]]; then
	export GOCACHE=$gopath/cache
fi
cd "$gopath/src/example.com/idempotency-gin"
GO111MODULE=off GOPATH="$gopath:/usr/share/gocode" GOPROXY=off GOFLAGS='' \
	go build -o "$out" example.com/idempotency-gin
