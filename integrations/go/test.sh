#!/usr/bin/env bash
# integrations/go/test.sh -- the Go integration's tests (issue 38)
#
# Against the cluster that PGHOST, PGPORT and PGUSER name (scripts/test.sh
# starts it, with the extension installed), as root:
#   - Debian's Go packages, installed if missing (golang-go,
#     golang-github-gin-gonic-gin-dev, golang-github-jackc-pgx-v4-dev, curl);
#   - gofmt: the sources formatted;
#   - the package copied into a fresh GOPATH under its import path
#     (github.com/idempotency-pg/idempotency-go), as README.md tells a
#     user, then go vet and go build of it, its Gin adapter and the sample
#     app, and go test (unit tests; the core's against a database of their
#     own, idem_go_unit), GOPATH mode against /usr/share/gocode, nothing
#     downloaded;
#   - README.md's blocks run as written (scripts/docs_test.py, the docs
#     test's runner: the quick start's database, both programs built, one
#     request and its replay to each), with HOME a fresh folder, one test
#     a block;
#   - README.md's go blocks compiled as written (in a function with a
#     pool and a mux);
#   - the conformance test of the net/http sample app:
#     examples/run_tests.sh nethttp (examples/http_test.py, 38 tests), then
#     again with its replay cache on (IDEM_REPLAY_CACHE=1), as one test.
# Prints TAP-style lines and, last, "go integration: N of M tests passed.";
# exits 1 if any failed.  About 50 s with a warm Go build cache.
set -euo pipefail

# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/common.sh"

name="go integration"
here=$REPO_ROOT/integrations/go
[[ -n ${PGHOST:-} && -n ${PGPORT:-} ]] || die "PGHOST and PGPORT must name the test cluster"

work=$(mktemp -d "${TMPDIR:-/tmp}/idempotency-go-test.XXXXXX")
trap 'rm -rf "$work"' EXIT

n=0
failed=0
# ok COND_STATUS WHAT [OUTPUT_FILE]: one TAP line (the file's last lines
# as diagnostics when it failed).
ok() {
	local rc=$1 what=$2 out=${3:-}
	n=$((n + 1))
	if ((rc == 0)); then
		echo "ok $n - $what"
	else
		failed=$((failed + 1))
		echo "not ok $n - $what"
		if [[ -n $out && -f $out ]]; then
			tail -n 40 "$out" | sed 's/^/#   /'
		fi
	fi
}
finish() {
	echo "1..$n"
	echo "$name: $((n - failed)) of $n tests passed."
	exit $((failed > 0 ? 1 : 0))
}
t0=$SECONDS

# Debian's Go, Gin and pgx (and curl for the quick start), where missing
pkgs=(golang-go golang-github-gin-gonic-gin-dev golang-github-jackc-pgx-v4-dev curl)
missing=()
for p in "${pkgs[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
rc=0
if ((${#missing[@]})); then
	{ apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"; } \
		>"$work/apt.out" 2>&1 || rc=$?
fi
ok "$rc" "Debian's Go packages installed (${pkgs[*]})" "$work/apt.out"
((rc == 0)) || finish

# The build cache: the user's (the quick start below runs with a HOME of
# its own, whose cache would be cold).
export GOCACHE=${GOCACHE:-$(go env GOCACHE 2>/dev/null || true)}
if [[ -z $GOCACHE || $GOCACHE == off ]]; then
	export GOCACHE=$work/cache
fi

rc=0
(cd "$here" && gofmt -l .) >"$work/gofmt.out" 2>&1 || rc=$?
[[ -s $work/gofmt.out ]] && rc=1
ok "$rc" "gofmt: every source formatted (gofmt -l lists none)" "$work/gofmt.out"

# A fresh GOPATH, the package copied in as a user would (README.md, "Get
# it"): its files only, not a link to the clone.
gopath=$work/gopath
pkg=github.com/idempotency-pg/idempotency-go
mkdir -p "$gopath/src/github.com/idempotency-pg"
cp -r "$here" "$gopath/src/$pkg"
gomode() {
	(cd "$gopath/src/$pkg" && GO111MODULE=off GOPATH="$gopath:/usr/share/gocode" GOPROXY=off GOFLAGS='' "$@")
}
rc=0
gomode go vet "$pkg" "$pkg/gin" "$pkg/sample/nethttp" >"$work/vet.out" 2>&1 || rc=$?
ok "$rc" "go vet: $pkg, $pkg/gin, the sample app" "$work/vet.out"
rc=0
gomode go build -o "$work/bin/" "$pkg" "$pkg/gin" "$pkg/sample/nethttp" >"$work/build.out" 2>&1 || rc=$?
[[ -x $work/bin/nethttp ]] || rc=1
ok "$rc" "go build from a fresh GOPATH (Debian's sources, nothing downloaded)" "$work/build.out"
# README.md's go blocks (fragments, not run by the docs test): each one
# compiled as written, in a function that has a pool and a mux.
rc=0
mkdir -p "$gopath/src/readmego"
awk -v dir="$gopath/src/readmego" '
	/^```go[[:space:]]*$/ { n++; f = dir "/block" n ".go"; inblock = 1
		print "package readmego\n\nimport (\n\t\"context\"\n\t\"net/http\"\n\t\"time\"\n\n\tidempotency \"github.com/idempotency-pg/idempotency-go\"\n\t\"github.com/jackc/pgx/v4/pgxpool\"\n)\n\nvar _ = time.Second\nvar _ = context.Background\n\nfunc block" n "(pool *pgxpool.Pool, mux *http.ServeMux) http.Handler {" > f
		next }
	inblock && /^```[[:space:]]*$/ { print "\treturn h\n}" > f; close(f); inblock = 0; next }
	inblock { print > f }
' "$here/README.md"
goblocks=$(compgen -G "$gopath/src/readmego/block*.go" | wc -l)
{ ((goblocks > 0)) && gomode go vet readmego; } >"$work/readmego.out" 2>&1 || rc=$?
ok "$rc" "README.md: its $goblocks go block(s) compile as written (go vet)" "$work/readmego.out"
# go test: the unit tests, those of the core against a database of their
# own on the test cluster (IDEM_GO_TEST_DSN), one test a Test function.
psql=("$PG_BINDIR/psql" -X -q -v ON_ERROR_STOP=1 -d postgres)
unitdb=idem_go_unit
rc=0
{
	"${psql[@]}" -c "DROP DATABASE IF EXISTS $unitdb" -c "CREATE DATABASE $unitdb" &&
		"$PG_BINDIR/psql" -X -q -v ON_ERROR_STOP=1 -d "$unitdb" -c 'CREATE EXTENSION idempotency'
} >"$work/unitdb.out" 2>&1 || rc=$?
ok "$rc" "a database for the unit tests ($unitdb, with the extension)" "$work/unitdb.out"
# Shards' test (shards_db_test.go): a router database and three shard
# databases, empty, on the same server (PL/Proxy reaches them on loopback).
rc=0
make_shard_dbs idem_go >"$work/shardsdb.out" 2>&1 || rc=$?
ok "$rc" "a router and three shard databases for Shards' test (idempotency_proxy, idempotency)" "$work/shardsdb.out"
rc=0
IDEM_GO_TEST_DSN="host=$PGHOST port=$PGPORT user=${PGUSER:-postgres} dbname=$unitdb" \
	IDEM_GO_SHARDS_DSN="host=$PGHOST port=$PGPORT user=${PGUSER:-postgres}" \
	gomode go test -count=1 -v "$pkg" "$pkg/gin" >"$work/unit.out" 2>&1 || rc=$?
units=0
while IFS= read -r line; do
	if [[ $line =~ ^---\ (PASS|FAIL|SKIP):\ ([A-Za-z0-9_]+) ]]; then
		units=$((units + 1))
		st=0
		[[ ${BASH_REMATCH[1]} == PASS ]] || st=1
		ok "$st" "go test: ${BASH_REMATCH[2]} (${BASH_REMATCH[1]})"
	fi
done <"$work/unit.out"
if ((rc != 0 || units == 0)); then
	ok 1 "go test ran and passed (exit $rc)" "$work/unit.out"
fi
"${psql[@]}" -c "DROP DATABASE IF EXISTS $unitdb" >/dev/null 2>&1 || true
drop_shard_dbs idem_go

# README.md as written, by the docs test's own runner: its sql blocks as
# the postgres role (from /), its shell blocks as root in the clone's
# root, with a fresh HOME (the quick start's ~/go).  The database hello is
# the quick start's; made afresh.
"${psql[@]}" -c 'DROP DATABASE IF EXISTS hello' >/dev/null 2>&1 || true
mkdir -m 700 "$work/home"
rc=0
export PG_BINDIR REPO_ROOT
HOME=$work/home PORT=$(free_port) IDEM_TMPDIR=$work \
	python3 "$REPO_ROOT/scripts/docs_test.py" "$here/README.md" >"$work/readme.out" 2>&1 || rc=$?
blocks=0
while IFS= read -r line; do
	case $line in
		"ok     "*)
			ok 0 "README.md: ${line#ok     }"
			blocks=$((blocks + 1))
			;;
		"FAILED "*)
			ok 1 "README.md: ${line#FAILED }"
			blocks=$((blocks + 1))
			;;
	esac
done <"$work/readme.out"
if ((rc != 0 || blocks == 0)); then
	ok 1 "README.md: the runner finished and every block passed (exit $rc)" "$work/readme.out"
fi
"${psql[@]}" -c 'DROP DATABASE IF EXISTS hello' >/dev/null 2>&1 || true

# The conformance test: the net/http sample app driven by
# examples/http_test.py (integrations/go/conformance/nethttp.sh builds it).
rc=0
bash "$REPO_ROOT/examples/run_tests.sh" nethttp >"$work/conformance.out" 2>&1 || rc=$?
checks=0
while IFS= read -r line; do
	if [[ $line =~ ^ok\ [0-9]+\ -\ (.*)$ ]]; then
		ok 0 "nethttp: ${BASH_REMATCH[1]}"
	elif [[ $line =~ ^not\ ok\ [0-9]+\ -\ (.*)$ ]]; then
		ok 1 "nethttp: ${BASH_REMATCH[1]}"
	elif [[ $line =~ ^#\  ]]; then
		echo "$line"
	else
		continue
	fi
	checks=$((checks + 1))
done <"$work/conformance.out"
if ((rc != 0 || checks == 0)) || ! grep -Eq '^nethttp example \(HTTP\): [0-9]+ of [0-9]+ tests passed\.$' "$work/conformance.out"; then
	ok 1 "examples/run_tests.sh nethttp ran to its end and passed (exit $rc)" "$work/conformance.out"
fi

# The same with the replay cache on (IDEM_REPLAY_CACHE=1: the sample app's
# -replay-cache): every check holds when replays come from memory.
rc=0
IDEM_REPLAY_CACHE=1 bash "$REPO_ROOT/examples/run_tests.sh" nethttp >"$work/conformance-cache.out" 2>&1 || rc=$?
grep -Eq '^nethttp example \(HTTP\): ([0-9]+) of \1 tests passed\.$' "$work/conformance-cache.out" || rc=1
ok "$rc" "examples/run_tests.sh nethttp with IDEM_REPLAY_CACHE=1: $(grep -Eo '[0-9]+ of [0-9]+ tests passed' "$work/conformance-cache.out" || echo 'did not finish')" "$work/conformance-cache.out"

echo "# $((SECONDS - t0)) s"
finish
