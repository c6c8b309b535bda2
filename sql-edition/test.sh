#!/usr/bin/env bash
# sql-edition/test.sh -- the project's regression (sql/) and isolation
# (specs/) suites against the SQL edition, installed and called by a role
# that is neither superuser nor CREATEROLE (what managed services give).
#
#   sql-edition/test.sh            every test not in sql-edition/excluded.txt,
#                                  the edition's own (sql-edition/sql/, sql-edition/specs/),
#                                  a stress run, sql-edition/move_test.sh,
#                                  sql-edition/pgtle_test.sh and
#                                  the HTTP test of examples/python and examples/gin
#                                  (examples/run_tests.sh, IDEM_EDITION=sql)
#   sql-edition/test.sh NAME...    only those (00_setup is always run first)
#
# As root on Debian 12, like scripts/test.sh, for IDEM_PG_MAJOR (default 15).
# PostgreSQL is a private copy (IDEM_PG_PREFIX, the one scripts/test.sh
# made, else one of our own): the host's installation is never written to.  The server runs
# as the postgres OS user on a throwaway cluster (scripts/common.sh), with
# pg_cron preloaded as on the managed services and nothing of idempotency.
#
# Two install ways are exercised:
#   - the regression suite runs in a database whose owner (idem_owner, not
#     superuser) creates the edition with CREATE EXTENSION idempotency_sql
#     (a trusted extension): sql/00_setup.sql does it;
#   - the isolation suite runs in a database where idem_owner ran the plain
#     script, psql -f idempotency_sql.psql, before the tests.
# The tests are copied, with these changes only: CREATE/DROP EXTENSION
# idempotency names idempotency_sql (regression) or is dropped (isolation,
# plain script), and sql-edition/expected/*.out replace the C extension's
# expected output where the edition's differs by design (each says why in
# sql-edition/excluded.txt's notes).  pg_regress's and
# pg_isolation_regress's diffs are kept in the output folder on failure.
#
# Closing line: "sql edition: N of M tests passed."
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
# shellcheck source=../scripts/common.sh
source "$ROOT/scripts/common.sh"
# A private copy of PostgreSQL: the one scripts/test.sh made (it exports
# IDEM_PG_PREFIX), or one of our own, removed on exit.
if [[ -z ${IDEM_PG_PREFIX:-} || ! -x $IDEM_PG_PREFIX/lib/postgresql/$IDEM_PG_MAJOR/bin/pg_config ]]; then
	use_private_pg
	PG_BINDIR=$IDEM_PG_PREFIX/lib/postgresql/$IDEM_PG_MAJOR/bin
fi
PGXS_DIR=$PG_BINDIR/../lib/pgxs/src/test

# the edition's files, into the private copy only
make -s --no-print-directory -C "$HERE" >/dev/null
install -m 644 "$HERE/build/idempotency_sql.control" "$HERE/build/idempotency_sql--1.2.sql" \
	"$("$PG_BINDIR/pg_config" --sharedir)/extension/"

# which tests: all but the excluded, or those named
mapfile -t excluded < <(sed -e 's/#.*//' -e 's/[[:space:]].*//' "$HERE/excluded.txt" | grep -v '^$' || true)
is_excluded() { local t; for t in "${excluded[@]}"; do [[ $t == "$1" ]] && return 0; done; return 1; }
regress=() isolation=()
if (($# > 0)); then
	for t in "$@"; do
		if [[ -f $ROOT/sql/$t.sql || -f $HERE/sql/$t.sql ]]; then regress+=("$t");
		elif [[ -f $ROOT/specs/$t.spec || -f $HERE/specs/$t.spec ]]; then isolation+=("$t");
		else die "no test $t"; fi
	done
	[[ ${regress[0]:-} == 00_setup ]] || regress=(00_setup "${regress[@]}")
else
	for f in "$ROOT"/sql/*.sql; do t=$(basename "$f" .sql); is_excluded "$t" || regress+=("$t"); done
	for f in "$ROOT"/specs/*.spec; do t=$(basename "$f" .spec); is_excluded "$t" || isolation+=("$t"); done
	# the edition's own tests, after the project's
	for f in "$HERE"/sql/*.sql; do regress+=("$(basename "$f" .sql)"); done
	for f in "$HERE"/specs/*.spec; do isolation+=("$(basename "$f" .spec)"); done
fi

# The cluster: scripts/common.sh's start_cluster appends $REPO_ROOT/regress.conf,
# which preloads the C library; point it at the edition's settings instead.
STAGE=$(mktemp -d "${TMPDIR:-/tmp}/sqled-stage.XXXXXX")
cat >"$STAGE/regress.conf" <<-CONF
	# the SQL edition: nothing of idempotency preloaded; pg_cron as on the managed services
	shared_preload_libraries = 'pg_cron'
	cron.database_name = 'postgres'
	max_connections = 100
CONF
REPO_ROOT=$STAGE start_cluster fast    # its EXIT trap stops the server
REPO_ROOT=$ROOT
rm -rf "$STAGE"

SOCK=$IDEM_TMPDIR/socket
psql_su() { as_postgres "$PG_BINDIR/psql" -X -q -v ON_ERROR_STOP=1 -h "$SOCK" -p "$PGPORT" -U postgres "$@"; }
psql_su -d postgres <<-SQL
	CREATE ROLE idem_owner LOGIN NOSUPERUSER NOCREATEROLE NOCREATEDB;
	CREATE DATABASE contrib_regression OWNER idem_owner;
	CREATE DATABASE isolation_regression OWNER idem_owner;
	-- what a managed service's administrator makes for sql-edition/sql/90_edition.sql
	CREATE ROLE regress_idem_sql_app NOLOGIN;
	CREATE ROLE regress_idem_sql_ops NOLOGIN;
	GRANT regress_idem_sql_app, regress_idem_sql_ops TO idem_owner;
SQL

# The tests, copied where the postgres OS user can read them
T=$IDEM_TMPDIR   # pg_regress runs psql there: sql/include/ is found
as_postgres mkdir -p "$T/sql/include" "$T/expected" "$T/specs" "$T/out" "$T/out_iso"
cp "$ROOT"/sql/*.sql "$T/sql/"; cp "$ROOT"/sql/include/*.sql "$T/sql/include/"
cp "$ROOT"/expected/*.out "$T/expected/"; cp "$ROOT"/specs/*.spec "$T/specs/"
sed -i -E 's/\b(CREATE|DROP) EXTENSION( IF NOT EXISTS| IF EXISTS)? idempotency\b;/\1 EXTENSION\2 idempotency_sql;/' \
	"$T"/sql/*.sql "$T"/expected/*.out
sed -i -E "s/extname = 'idempotency'/extname = 'idempotency_sql'/" "$T"/sql/*.sql "$T"/expected/*.out
sed -i -E 's/^(\s*)CREATE EXTENSION IF NOT EXISTS idempotency;/\1SET client_min_messages = warning;/' "$T"/specs/*.spec
cp "$HERE"/sql/*.sql "$T/sql/"; cp "$HERE"/specs/*.spec "$T/specs/"
cp "$HERE"/expected/*.out "$T/expected/"
# The edition's errors are raised in PL/pgSQL, which adds a CONTEXT line
# (the function and line) that the C extension's errors have not; no
# expected output holds one.  psql leaves them out with SHOW_CONTEXT=never
# (pg_regress's --launcher runs it so): messages, details and hints are
# still compared.
printf '#!/bin/sh\nexec "$@" -v SHOW_CONTEXT=never\n' >"$T/psql_launcher"
chmod 755 "$T/psql_launcher"
chown -R postgres: "$T"

# the plain script, run by the database owner (no extension)
# (copied as root: the postgres OS user may not enter the clone, /root/...)
cp "$HERE/build/idempotency_sql.psql" "$T/idempotency_sql.psql"
chown postgres: "$T/idempotency_sql.psql"
as_postgres "$PG_BINDIR/psql" -X -q -v ON_ERROR_STOP=1 -h "$SOCK" -p "$PGPORT" -U idem_owner \
	-d isolation_regression -f "$T/idempotency_sql.psql" >/dev/null

passed=0 total=0
count() {	# count OUTPUT: the "... ok" and "... FAILED" lines of a run
	local ok bad
	# 15: "test NAME ... ok"; 16 and later: "ok N - NAME" / "not ok N - NAME"
	ok=$(grep -cE '\.\.\. ok|^ok +[0-9]+ +- ' "$1" || true)
	bad=$(grep -cE '\.\.\. (FAILED|failed)|^not ok +[0-9]+ +- ' "$1" || true)
	passed=$((passed + ok)); total=$((total + ok + bad))
}
rc=0
if ((${#regress[@]} > 0)); then
	log "regression: ${#regress[@]} tests, CREATE EXTENSION idempotency_sql as idem_owner"
	(cd "$T" && as_postgres "$PGXS_DIR/regress/pg_regress" --inputdir="$T" --outputdir="$T/out" \
		--bindir="$PG_BINDIR" --host="$SOCK" --port="$PGPORT" --user=idem_owner \
		--launcher="$T/psql_launcher" --dbname=contrib_regression --use-existing "${regress[@]}") >"$T/regress.log" 2>&1 || rc=1
	cat "$T/regress.log"
	count "$T/regress.log"
fi
if ((${#isolation[@]} > 0)); then
	log "isolation: ${#isolation[@]} tests, plain script (psql -f) run by idem_owner"
	(cd "$T" && as_postgres "$PGXS_DIR/isolation/pg_isolation_regress" --inputdir="$T" \
		--outputdir="$T/out_iso" --bindir="$PG_BINDIR" --host="$SOCK" --port="$PGPORT" \
		--user=idem_owner --dbname=isolation_regression --use-existing "${isolation[@]}") >"$T/isolation.log" 2>&1 || rc=1
	cat "$T/isolation.log"
	count "$T/isolation.log"
fi
# Stress: 8 clients claim 10 keys for 5 s under each isolation level, each
# holder takes a row of public.holders (primary key: a second holder at
# the same time would fail on it, and pgbench would fail) and releases its
# claim.  Not a measure of speed: on a shared machine only correctness counts.
stress() {
	local iso=$1 out=$T/stress.out
	cat >"$T/stress.sql" <<-SQL
		\set n random(1, 10)
		BEGIN ISOLATION LEVEL $iso;
		SELECT (outcome = 'acquired')::int AS got, claim AS c FROM idempotency.idem_acquire('s' || :n, lease => '1 hour') \gset
		COMMIT;
		\if :got
		INSERT INTO public.holders VALUES ('s' || :n);
		DELETE FROM public.holders WHERE k = 's' || :n;
		SELECT idempotency.idem_release('s' || :n, claim => ':c');
		\endif
	SQL
	chown postgres "$T/stress.sql"
	total=$((total + 1))
	if as_postgres env PGOPTIONS="-c idempotency.wait_timeout=0" "$PG_BINDIR/pgbench" -n -h "$SOCK" -p "$PGPORT" \
		-U idem_owner -c 8 -j 2 -T 5 --max-tries=50 -f "$T/stress.sql" isolation_regression >"$out" 2>&1 &&
		grep -q '^number of failed transactions: 0 ' "$out"; then
		passed=$((passed + 1))
		echo "stress ($iso, 8 clients, 10 keys): ok, $(grep -E '^number of transactions actually processed' "$out" | sed 's/.*: //') transactions"
	else
		rc=1
		echo "stress ($iso, 8 clients, 10 keys) ... FAILED"
		cat "$out"
	fi
}
if (($# == 0)); then
	as_postgres "$PG_BINDIR/psql" -X -q -v ON_ERROR_STOP=1 -h "$SOCK" -p "$PGPORT" -U idem_owner \
		-d isolation_regression -c 'CREATE TABLE public.holders (k text PRIMARY KEY)'
	stress 'read committed'
	stress 'repeatable read'
fi

# Moving live data between the editions, both ways (docs/managed.md's
# procedures, on a cluster of its own): one test
if (($# == 0)); then
	total=$((total + 1))
	if bash "$HERE/move_test.sh" >"$T/move.log" 2>&1; then
		passed=$((passed + 1))
		echo "move between the editions: ok, $(grep -E '^move: ' "$T/move.log" | sed 's/^move: //;s/\.$//'), $(grep -E '^# move test: ' "$T/move.log" | sed 's/^# move test: //')"
	else
		rc=1
		echo "move between the editions ... FAILED"
		cat "$T/move.log"
	fi
fi

# The pg_tle script against a stand-in of pg_tle (sql-edition/pgtle_test.sh,
# a cluster of its own): one test
if (($# == 0)); then
	total=$((total + 1))
	if bash "$HERE/pgtle_test.sh" >"$T/pgtle.log" 2>&1; then
		passed=$((passed + 1))
		echo "pg_tle script (stand-in): ok, $(grep -E '^pg_tle: ' "$T/pgtle.log" | sed 's/^pg_tle: //;s/\.$//')"
	else
		rc=1
		echo "pg_tle script (stand-in) ... FAILED"
		cat "$T/pgtle.log"
	fi
fi

# The HTTP examples over the edition: examples/run_tests.sh APP with
# IDEM_EDITION=sql against this cluster (the database owned by a role that
# is not superuser, the plain script run by it, the app connected as a
# role with docs/reference.md's grants): one test each, about 15 s.  Go and
# psycopg are scripts/test.sh's packages (every major's root has them).
if (($# == 0)); then
	for app in python gin; do
		total=$((total + 1))
		out=$T/http-$app.log t0=$SECONDS
		if IDEM_EDITION=sql bash "$ROOT/examples/run_tests.sh" "$app" >"$out" 2>&1; then
			passed=$((passed + 1))
			echo "$app example over the edition: ok, $(grep -E '^[a-z]+ example \(HTTP, sql edition\): [0-9]+ of [0-9]+ tests passed\.$' "$out" | sed 's/.*: //;s/\.$//'), $((SECONDS - t0)) s"
		else
			rc=1
			echo "$app example over the edition ... FAILED"
			cat "$out"
		fi
	done
fi

if ((rc != 0)); then
	mkdir -p "$HERE/build/diffs"
	cp "$T"/out/regression.diffs "$HERE/build/diffs/regress.diffs" 2>/dev/null || true
	cp "$T"/out_iso/regression.diffs "$HERE/build/diffs/isolation.diffs" 2>/dev/null || true
	rm -rf "$HERE/build/results"; mkdir -p "$HERE/build/results"
	cp "$T"/out/results/*.out "$T"/out_iso/results/*.out "$HERE/build/results/" 2>/dev/null || true
	log "diffs kept in $HERE/build/diffs/, outputs in $HERE/build/results/"
fi
echo "sql edition: $passed of $total tests passed."
exit "$rc"
