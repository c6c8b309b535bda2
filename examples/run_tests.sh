#!/usr/bin/env bash
# examples/run_tests.sh gin|python|APP -- the HTTP test of one example
# (or of an integration's sample app APP, integrations/*/conformance/APP.sh)
#
# Against the cluster that PGHOST, PGPORT and PGUSER name (scripts/test.sh
# starts it): makes a database of the example's own (the extension and
# examples/schema.sql), builds the example (gin: examples/gin/build.sh),
# starts its server twice on free ports of 127.0.0.1 (the default mapping,
# with fault injection; the seed's rule, replay 200), drives both with
# examples/http_test.py (which reads the first one's log too), and stops
# them.  The last line is "<name>: N of M tests passed." (a failure
# before the requests counts as one failed test).  Exits 1 if anything
# failed.
#
# IDEM_EDITION=sql: the same over the SQL edition (sql-edition/) instead,
# installed by the database's owner, a role that is not superuser, with the
# plain script, and called by an app role with docs/reference.md's grants
# (see the sql arm below); <name> then ends in "(HTTP, sql edition)".
# sql-edition/test.sh runs it so.  Every check of examples/http_test.py
# applies to both editions.
set -euo pipefail

# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/common.sh"

which=${1:?usage: run_tests.sh gin|python|APP}
# IDEM_EDITION: c (the default), the C extension, made by the superuser
# with CREATE EXTENSION; sql, the SQL edition (sql-edition/), installed and
# used by a role that is not superuser.
edition=${IDEM_EDITION:-c}
case $edition in
	c) name="$which example (HTTP)" ;;
	sql) name="$which example (HTTP, sql edition)" ;;
	*) die "IDEM_EDITION must be c or sql, not $edition" ;;
esac
here=$REPO_ROOT/examples
# Debian's own Python: the one python3-psycopg and python3-psycopg-pool are for
python=/usr/bin/python3
[[ -n ${PGHOST:-} && -n ${PGPORT:-} ]] || die "PGHOST and PGPORT must name the test cluster"

work=$(mktemp -d "${TMPDIR:-/tmp}/idempotency-example.XXXXXX")
# The servers' pids, in a file: start_server runs in a command substitution,
# a subshell whose variables the cleanup would never see.  A server is also
# started with the flock of scripts/test.sh's caller closed (9>&-), so that
# even one that outlived us could not hold the lock.
pidfile=$work/pids
cleanup() {
	local pid
	if [[ -f $pidfile ]]; then
		while read -r pid; do
			kill "$pid" 2>/dev/null || true
		done <"$pidfile"
		while read -r pid; do
			for _ in $(seq 1 50); do
				kill -0 "$pid" 2>/dev/null || break
				sleep 0.1
			done
			kill -KILL "$pid" 2>/dev/null || true
		done <"$pidfile"
	fi
	rm -rf "$work"
}
trap cleanup EXIT

# did_not_run REASON: count the example as one failed test, and fail.
did_not_run() {
	echo "# $name: $*"
	echo "$name: 0 of 1 tests passed."
	exit 1
}

db=idem_example_$which
psql=("$PG_BINDIR/psql" -X -q -v ON_ERROR_STOP=1)
case $edition in
	c)
		"${psql[@]}" -d postgres -c "DROP DATABASE IF EXISTS $db" -c "CREATE DATABASE $db" ||
			did_not_run "could not create database $db"
		"${psql[@]}" -d "$db" -c 'CREATE EXTENSION idempotency' -f "$here/schema.sql" ||
			did_not_run "could not set up database $db"
		dsn="host=$PGHOST port=$PGPORT user=${PGUSER:-postgres} dbname=$db"
		;;
	sql)
		# As on a managed service: the superuser (the service's
		# administrator) makes two roles that are not superuser (no
		# CREATEROLE, no CREATEDB), the database's owner and the app's, and
		# the database; the owner runs the plain script (psql -f,
		# sql-edition/README.md) and examples/schema.sql, and grants the
		# app's role what docs/reference.md's "Privileges" lists (its first
		# sql block, read from there) and the example's tables; the app and
		# the driver connect as the app's role.  psql runs as this user,
		# over TCP: nothing is read as postgres.  One pair of roles per
		# example, dropped with its database.
		owner=${db}_owner app=${db}_app
		make -s --no-print-directory -C "$REPO_ROOT/sql-edition" >/dev/null ||
			did_not_run "make -C sql-edition failed"
		"${psql[@]}" -d postgres -c "SET client_min_messages = warning" \
			-c "DROP DATABASE IF EXISTS $db" -c "DROP ROLE IF EXISTS $owner" -c "DROP ROLE IF EXISTS $app" \
			-c "CREATE ROLE $owner LOGIN NOSUPERUSER NOCREATEROLE NOCREATEDB" \
			-c "CREATE ROLE $app LOGIN NOSUPERUSER NOCREATEROLE NOCREATEDB" \
			-c "CREATE DATABASE $db OWNER $owner" ||
			did_not_run "could not create the roles $owner, $app and database $db"
		grants=$(awk '/^## Privileges/ { p = 1; next } p && /^## / { exit }
			p && /^```sql/ { b = 1; next } b && /^```/ { exit } b' "$REPO_ROOT/docs/reference.md")
		grep -q 'TO app;' <<<"$grants" || did_not_run "no grants TO app in docs/reference.md's Privileges"
		"${psql[@]}" -U "$owner" -d "$db" -f "$REPO_ROOT/sql-edition/build/idempotency_sql.psql" \
			-f "$here/schema.sql" -c "${grants//TO app;/TO $app;}" \
			-c "GRANT USAGE ON SCHEMA shop TO $app" \
			-c "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA shop TO $app" \
			-c "GRANT USAGE ON ALL SEQUENCES IN SCHEMA shop TO $app" >/dev/null ||
			did_not_run "could not set up database $db (the SQL edition's plain script as $owner)"
		# the edition it is: its helpers' schema, no C extension, roles
		# that are not superuser, the app's not owning the records
		[[ $("${psql[@]}" -U "$app" -d "$db" -At -c "SELECT to_regnamespace('idempotency_sql') IS NOT NULL
			AND NOT EXISTS (SELECT FROM pg_extension WHERE extname = 'idempotency')
			AND NOT EXISTS (SELECT FROM pg_roles WHERE rolname IN ('$owner', '$app') AND rolsuper)
			AND (SELECT tableowner FROM pg_tables WHERE schemaname = 'idempotency'
			     AND tablename = 'records') = '$owner'") == t ]] ||
			did_not_run "database $db does not hold the SQL edition alone, owned by $owner (not superuser)"
		dsn="host=$PGHOST port=$PGPORT user=$app dbname=$db"
		;;
esac

case $which in
	gin)
		log "building examples/gin (GOPATH mode, Debian's Go packages)"
		t0=$SECONDS
		"$here/gin/build.sh" "$work/idempotency-gin" || did_not_run "the build failed"
		log "built in $((SECONDS - t0))s"
		server() { exec "$work/idempotency-gin" -dsn "$dsn" -charge-lease 2s -listen "127.0.0.1:$1" "${@:2}"; }
		seed_flag=-replay-200 fault_flag=-fault-injection
		;;
	python)
		server() { exec "$python" "$here/python/server.py" --dsn "$dsn" --charge-lease 2 --listen "127.0.0.1:$1" "${@:2}"; }
		seed_flag=--replay-200 fault_flag=--fault-injection
		;;
	*)
		# An integration's sample app (integrations/*/conformance/NAME.sh):
		# sourced here with $work, $dsn and $python set, it builds or
		# installs what it needs and defines server PORT [FLAG...] (exec
		# the app on 127.0.0.1:PORT against $dsn, with the charge lease of
		# 2 s), seed_flag (the seed's rule, replay 200) and fault_flag
		# (fault injection), as the two arms above do.
		hook=$(compgen -G "$REPO_ROOT/integrations/*/conformance/$which.sh" | head -n 1 || true)
		[[ -n $hook ]] || die "no example $which"
		# shellcheck disable=SC1090
		source "$hook" || did_not_run "$hook failed"
		;;
esac

# start_server LOG [FLAG...]: start the server on a free port, wait until
# /health answers; prints the port.
start_server() {
	local logfile=$1 port try i pid
	shift
	for try in 1 2 3; do
		port=$(free_port)
		server "$port" "$@" >"$logfile" 2>&1 9>&- &
		pid=$!
		echo "$pid" >>"$pidfile"
		for i in $(seq 1 100); do
			if "$python" - "$port" <<-'EOF' 2>/dev/null; then
				import http.client, sys
				c = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=2)
				c.request("GET", "/health")
				sys.exit(0 if c.getresponse().status == 200 else 1)
			EOF
				echo "$port"
				return 0
			fi
			kill -0 "$pid" 2>/dev/null || break
			sleep 0.1
		done
		# It died (the port was taken meanwhile?) or never answered.
		kill "$pid" 2>/dev/null || true
		sed 's/^/# /' "$logfile" >&2
	done
	return 1
}

port=$(start_server "$work/server.log" "$fault_flag") || did_not_run "the server did not start"
seed_port=$(start_server "$work/server-seed.log" "$seed_flag") || did_not_run "the server (seed's rule) did not start"
log "$which example: servers on 127.0.0.1:$port and 127.0.0.1:$seed_port (replay 200)"

rc=0
"$python" "$here/http_test.py" --name "$name" --url "http://127.0.0.1:$port" \
	--seed-url "http://127.0.0.1:$seed_port" --log "$work/server.log" "$dsn" | tee "$work/driver.out" || rc=$?
if ((rc != 0)); then
	for f in "$work"/server*.log; do
		echo "# ---- $(basename "$f"), last 40 lines"
		tail -n 40 "$f" | sed 's/^/# /'
	done
	grep -q "^$name: [0-9]* of [0-9]* tests passed\.$" "$work/driver.out" ||
		did_not_run "the driver did not finish (exit $rc)"
fi
exit "$rc"
