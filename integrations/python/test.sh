#!/usr/bin/env bash
# integrations/python/test.sh -- build, install and test pg-idempotency
#
# Against the cluster that PGHOST, PGPORT and PGUSER name, with the
# extension installed (scripts/test.sh runs it on PostgreSQL 15):
#   1. installs what is missing from Debian, builds the wheel and installs
#      it from the file into a fresh virtualenv (--system-site-packages:
#      Debian's psycopg, FastAPI, Django; nothing downloaded);
#   2. runs README.md's blocks as written, in a copy of this folder, on a
#      database of their own (tests/readme_test.py; its Shards section
#      makes the databases shop_router, shop_shard0 and shop_shard1, with
#      idempotency_proxy and PL/Proxy: dropped after);
#   3. checks idempotent() and idempotent_async() (tests/wrapper_test.py);
#   4. checks the round trips, the literals, the replay cache and the
#      duplicate log lines (tests/cache_test.py, about 3 s);
#   5. checks Shards and AsyncShards against a router database
#      idem_py_router (idempotency_proxy) and three shard databases
#      idem_py_shard0..2 (scripts/common.sh, make_shard_dbs), grown from 2
#      to 4 partitions half way through, then drops them
#      (tests/shards_test.py, about 5 s);
#   6. runs examples/run_tests.sh for each sample app (conformance/*.sh:
#      fastapi, starlette, django), which use the installed wheel; then
#      starlette's and django's again with the replay cache on
#      (IDEM_REPLAY_CACHE=1: fastapi's middleware is starlette's).
# Everything runs as root (builds and the README in temporary folders);
# nothing runs as the postgres OS user.  Prints TAP-style lines, then
# "python integration: N of M tests passed."; exits 1 if any failed.  One
# to three minutes (83 to 147 s measured on a busy 2-core machine, load 8
# to 14; cache_test.py 3 s of it, the two runs with the cache on about
# 50 s), plus apt-get where packages are missing.
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=scripts/common.sh
source "$here/../../scripts/common.sh"
[[ -n ${PGHOST:-} && -n ${PGPORT:-} ]] || die "PGHOST and PGPORT must name the test cluster"

name="python integration"
n=0
failed=0
# result OK WHAT: one test
result() {
	n=$((n + 1))
	if [[ $1 == 0 ]]; then
		echo "ok $n - $2"
	else
		failed=$((failed + 1))
		echo "not ok $n - $2"
	fi
}
# results FILE: a test for each "ok - ..." or "not ok - ..." line of FILE
results() {
	local line
	while IFS= read -r line; do
		case $line in
			"ok - "*) result 0 "${line#ok - }" ;;
			"not ok - "*) result 1 "${line#not ok - }" ;;
			*) echo "$line" ;;
		esac
	done <"$1"
}
finish() {
	echo "1..$n"
	echo "$name: $((n - failed)) of $n tests passed."
	((failed == 0)) || exit 1
	exit 0
}

work=$(mktemp -d "${TMPDIR:-/tmp}/idempotency-python.XXXXXX")
trap 'rm -rf "$work"' EXIT
t0=$SECONDS
psql=("$PG_BINDIR/psql" -X -q -v ON_ERROR_STOP=1)
# fresh_db NAME: a new database with the extension
fresh_db() {
	"${psql[@]}" -d postgres -c "DROP DATABASE IF EXISTS $1" -c "CREATE DATABASE $1" &&
		"${psql[@]}" -d "$1" -c 'CREATE EXTENSION idempotency'
}

# 1. the wheel, in a fresh virtualenv
log "$name: building the wheel and its virtualenv"
rc=0
# shellcheck source=integrations/python/conformance/_setup.sh
source "$here/conformance/_setup.sh" || rc=1
result $rc "the wheel builds and installs from its file into a fresh virtualenv"
((rc == 0)) || finish
export PG_IDEMPOTENCY_VENV=$work/pyint/venv
(cd "$work" && "$venv_python" -c 'import pg_idempotency, sys; sys.exit("/site-packages/" not in pg_idempotency.__file__)')
result $? "the virtualenv imports pg_idempotency from the wheel, not the clone"
pyint_apt curl >/dev/null || true

# 2. the README, as written
log "$name: README.md"
mkdir "$work/readme"
cp -r "$here/pyproject.toml" "$here/README.md" "$here/src" "$work/readme/"
if fresh_db idem_python_readme >"$work/readme-db.out" 2>&1; then
	port=$(free_port)
	django_port=$(free_port)
	while [[ $django_port == "$port" ]]; do django_port=$(free_port); done
	PATH=/usr/bin:/bin:$PATH PGDATABASE=idem_python_readme PORT=$port DJANGO_PORT=$django_port \
		/usr/bin/python3 "$here/tests/readme_test.py" "$here/README.md" "$work/readme" >"$work/readme.out" 2>&1
	results "$work/readme.out"
else
	cat "$work/readme-db.out"
	result 1 "README: could not make its database"
fi
# the databases of its Shards section
drop_shard_dbs shop

# 3. the wrapper (tests/wrapper_test.py), and 4. the round trips, the
# literals, the replay cache and the log lines (tests/cache_test.py): each
# on a database of its own
# py_test NAME ARG...: tests/NAME_test.py ARG... with the virtualenv's
# python, a test for each of its "ok - " and "not ok - " lines
py_test() {
	local test=$1 rc
	shift
	(cd "$work" && "$venv_python" "$here/tests/${test}_test.py" "$@") >"$work/$test.out" 2>&1
	rc=$?
	results "$work/$test.out"
	if ((rc != 0)) && ! grep -q '^not ok - ' "$work/$test.out"; then
		result 1 "tests/${test}_test.py ran to its end (exit $rc)"
	fi
}
unit_test() {	# unit_test NAME WHAT
	local db=idem_python_$1
	log "$name: $2"
	if fresh_db "$db" >"$work/$1-db.out" 2>&1; then
		py_test "$1" "host=$PGHOST port=$PGPORT user=${PGUSER:-postgres} dbname=$db"
	else
		cat "$work/$1-db.out"
		result 1 "$1: could not make its database"
	fi
}
unit_test wrapper "idempotent() and idempotent_async()"
unit_test cache "round trips, replay cache, duplicate log lines"

# 5. Shards and AsyncShards (tests/shards_test.py): a router database
# (idempotency_proxy) and three shard databases, empty (scripts/common.sh),
# dropped after
log "$name: Shards, behind a PL/Proxy router"
if make_shard_dbs idem_py >"$work/shards-db.out" 2>&1; then
	py_test shards "host=$PGHOST port=$PGPORT user=${PGUSER:-postgres}" idem_py
else
	cat "$work/shards-db.out"
	result 1 "shards: could not make the router and shard databases"
fi
drop_shard_dbs idem_py

# 6. the HTTP conformance test, for each sample app; starlette's and
# django's again with the replay cache on
for run in fastapi starlette django starlette:cache django:cache; do
	app=${run%:cache}
	cache=0
	[[ $run == *:cache ]] && cache=1
	log "$name: examples/run_tests.sh $app$( ((cache)) && echo ', IDEM_REPLAY_CACHE=1')"
	: >"$work/$run.lines"
	IDEM_REPLAY_CACHE=$cache IDEM_LOG_COPY=$work/$run.lines \
		bash "$here/../../examples/run_tests.sh" "$app" >"$work/$app.out" 2>&1
	rc=$?
	sed 's/^/    /' "$work/$app.out"
	line=$(grep -E "^$app example \(HTTP\): [0-9]+ of [0-9]+ tests passed\.$" "$work/$app.out" | tail -n 1)
	result $rc "$( ((cache)) && echo 'replay cache on: ')${line:-$app example (HTTP): did not finish}"
	if ((cache)); then
		# the servers' duplicate lines (IDEM_LOG_COPY): some replays came from the cache
		hits=$(grep -c '^idempotency: replay (cached)' "$work/$run.lines")
		result $((hits > 0 ? 0 : 1)) "$app, replay cache on: $hits replays answered from the cache"
	fi
done

log "$name: $((SECONDS - t0)) s"
finish
