#!/usr/bin/env bash
# sql-edition/move_test.sh -- move live data between the SQL edition and the
# C extension, both ways, with the procedures of docs/managed.md ("Moving
# between the editions"), read from that file (no second copy here):
#
#   1. plain script (psql -f)      -> C extension   (in place, "-- move: from the SQL edition")
#   2. C extension                 -> SQL edition, CREATE EXTENSION (in place)
#   3. SQL edition (extension)     -> C extension   (in place)
#   4. C extension in database app -> plain script in database app2 (the
#      two-server way: \copy through a file, no superuser)
#   5. plain script in app2 -> C extension in database app3 (the same way
#      back: the owner exports, a superuser creates the C extension and imports)
#
# Before each move the application role (docs/reference.md's grants) makes
# live data: a completed record, a lease claim, a checkpointed claim with a
# short lease, a one-time token and, for the in-place moves, a session-bound
# claim of a session that stays connected.  The move must refuse (55000)
# while that session is connected and run once it is gone.  After each
# move: the completed record replays with its response, a changed request
# is a mismatch, the lease claim refuses a wrong claim (55000) and
# completes with its own, the takeover of the checkpointed claim reads its
# checkpoint back with attempt 2, the token is consumed once, the
# session-bound claim is taken over once (one `acquired`, then in_progress).
#
# As root, like sql-edition/test.sh (which runs it): a throwaway cluster of
# the private PostgreSQL copy with nothing preloaded (the C extension needs
# shared_preload_libraries only for statistics and filters), the C
# extension and the edition installed into that copy.
# Closing line: "move: N of M checks passed."
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
# shellcheck source=../scripts/common.sh
source "$ROOT/scripts/common.sh"
if [[ -z ${IDEM_PG_PREFIX:-} || ! -x $IDEM_PG_PREFIX/lib/postgresql/$IDEM_PG_MAJOR/bin/pg_config ]]; then
	use_private_pg
	PG_BINDIR=$IDEM_PG_PREFIX/lib/postgresql/$IDEM_PG_MAJOR/bin
fi
PG_CONFIG=$PG_BINDIR/pg_config
t0=$SECONDS

# both editions' files, into the private copy only
if [[ ! -f $("$PG_CONFIG" --pkglibdir)/idempotency.so || ! -f $("$PG_CONFIG" --sharedir)/extension/idempotency--1.1--1.2.sql ]]; then
	IDEM_QUIET=1 run_step "make install (the C extension)" make -C "$ROOT" PG_CONFIG="$PG_CONFIG" install
fi
make -s --no-print-directory -C "$HERE" >/dev/null
install -m 644 "$HERE/build/idempotency_sql.control" "$HERE/build/idempotency_sql--1.2.sql" \
	"$("$PG_CONFIG" --sharedir)/extension/"

STAGE=$(mktemp -d "${TMPDIR:-/tmp}/sqled-move.XXXXXX")
printf '# the move test: nothing preloaded\nmax_connections = 50\n' >"$STAGE/regress.conf"
REPO_ROOT=$STAGE IDEM_QUIET=1 start_cluster fast >/dev/null    # its EXIT trap stops the server
REPO_ROOT=$ROOT
rm -rf "$STAGE"
SOCK=$IDEM_TMPDIR/socket
W=$IDEM_TMPDIR/move          # the postgres OS user's working folder (\copy's file)
mkdir -p "$W"

# The blocks of docs/managed.md: the two in-place moves (sql blocks whose
# first line is "-- move: from the ...") and the two-server way (the sh
# blocks that use $SOURCE and $TARGET).
python3 - "$ROOT/docs/managed.md" "$W" <<-'PY'
	import sys
	sys.path.insert(0, sys.argv[1].rsplit("/docs/", 1)[0] + "/scripts")
	import docs_test
	found = {}
	for line, lang, text, mark, expected in docs_test.parse(sys.argv[1]):
	    first = text.split("\n", 1)[0]
	    if lang == "sql" and first.startswith("-- move: from the SQL edition"):
	        found["to_c.sql"] = text
	    elif lang == "sql" and first.startswith("-- move: from the C extension"):
	        found["to_sql.sql"] = text
	    elif lang == "sh" and 'psql "$SOURCE"' in text:
	        found["export.sh"] = text
	    elif lang == "sh" and 'psql "$TARGET"' in text:
	        found["import.sh"] = text
	want = ["to_c.sql", "to_sql.sql", "export.sh", "import.sh"]
	missing = [w for w in want if w not in found]
	if missing:
	    sys.exit("docs/managed.md: no block for " + ", ".join(missing))
	for name in want:
	    open(sys.argv[2] + "/" + name, "w").write(found[name])
PY
cp "$ROOT/sql/include/readme_grants.sql" "$ROOT/sql/include/readme_token_grants.sql" "$W/"
cp "$HERE/build/idempotency_sql.psql" "$W/"
chown -R postgres: "$W"

# psql as ROLE in DB (-At, stops at the first error); the application's
# calls answer at once rather than wait (wait_timeout 0)
q() {	# q ROLE DB [psql args...]
	local role=$1 db=$2; shift 2
	as_postgres env PGOPTIONS="-c idempotency.wait_timeout=0" "$PG_BINDIR/psql" -X -q -At \
		-v ON_ERROR_STOP=1 -h "$SOCK" -p "$PGPORT" -U "$role" -d "$db" "$@"
}
n=0 ok=0
check() {	# check DESCRIPTION EXPECTED ACTUAL
	n=$((n + 1))
	if [[ $3 == "$2" ]]; then
		ok=$((ok + 1)); echo "ok $n - $1"
	else
		echo "not ok $n - $1"; echo "#   expected: $2"; echo "#   got:      $3"
	fi
}
check_match() {	# check_match DESCRIPTION REGEX ACTUAL
	n=$((n + 1))
	if [[ $3 =~ $2 ]]; then
		ok=$((ok + 1)); echo "ok $n - $1"
	else
		echo "not ok $n - $1"; echo "#   expected to match: $2"; echo "#   got: $3"
	fi
}
edition() {	# edition DB: which edition holds idempotency.records there
	q postgres "$1" -c "SELECT CASE WHEN EXISTS (SELECT FROM pg_extension WHERE extname = 'idempotency') THEN 'C'
	                              WHEN EXISTS (SELECT FROM pg_extension WHERE extname = 'idempotency_sql') THEN 'SQL extension'
	                              WHEN to_regclass('idempotency.records') IS NOT NULL THEN 'SQL plain' ELSE 'none' END"
}
grants() {	# grants ROLE DB: docs/reference.md's grants to app, by ROLE
	q "$1" "$2" -v app_role=app -f "$W/readme_grants.sql" -f "$W/readme_token_grants.sql"
}

declare -A claim_lease claim_cp token
# live R DB: the application's live data of round R
live() {
	local r=$1 db=$2
	q app "$db" -c "SELECT outcome FROM idempotency.idem_acquire('done-$r', '{\"n\": $r}')" \
		-c "SELECT idempotency.idem_complete('done-$r', 201, '{\"ok\": $r}', response_headers => '{\"Location\": \"/orders/$r\"}')" >/dev/null
	claim_lease[$r]=$(q app "$db" -c "SELECT claim FROM idempotency.idem_acquire('lease-$r', '{\"n\": $r}', lease => '1 hour')")
	claim_cp[$r]=$(q app "$db" -c "SELECT claim FROM idempotency.idem_acquire('cp-$r', '{\"n\": $r}', lease => '1 second')")
	q app "$db" -c "SELECT idempotency.idem_checkpoint('cp-$r', claim => '${claim_cp[$r]}', phase => 'charged', state => '{\"n\": $r}')" >/dev/null
	token[$r]=$(q app "$db" -c "SELECT idempotency.idem_token_issue()")
}
# after R DB: what must hold after the move of round R
after() {
	local r=$1 db=$2 out i
	check "round $r: the completed record replays with its response" \
		"replay|201|{\"ok\": $r}|{\"location\": \"/orders/$r\"}" \
		"$(q app "$db" -c "SELECT outcome, response_status, response_body, response_headers FROM idempotency.idem_acquire('done-$r', '{\"n\": $r}')" | tr -d '\n')"
	check "round $r: a changed request is a mismatch" "mismatch" \
		"$(q app "$db" -c "SELECT outcome FROM idempotency.idem_acquire('done-$r', '{\"n\": 0}')")"
	out=$(q app "$db" -v VERBOSITY=sqlstate -c "SELECT idempotency.idem_complete('lease-$r', 200, '{}', claim => gen_random_uuid())" 2>&1 || true)
	check_match "round $r: the lease claim refuses a wrong claim (55000)" "ERROR: +55000" "$out"
	check "round $r: the lease claim completes with its claim, then replays" "t|replay|200" \
		"$(q app "$db" -c "SELECT idempotency.idem_complete('lease-$r', 200, '{\"done\": true}', claim => '${claim_lease[$r]}')" \
			-c "SELECT outcome, response_status FROM idempotency.idem_acquire('lease-$r', '{\"n\": $r}')" | tr '\n' '|' | sed 's/|$//')"
	# the checkpointed claim's lease (1 s) runs out: its takeover reads the checkpoint back
	for ((i = 0; i < 200; i++)); do
		out=$(q app "$db" -c "SELECT outcome, attempt, phase, state FROM idempotency.idem_acquire('cp-$r', '{\"n\": $r}', lease => '1 hour')")
		[[ $out == in_progress* ]] || break
		sleep 0.1
	done
	check "round $r: the takeover reads the checkpoint back (attempt 2)" "acquired|2|charged|{\"n\": $r}" "$out"
	check "round $r: the token is consumed once" "t|f" \
		"$(q app "$db" -c "SELECT idempotency.idem_token_consume('${token[$r]}')" \
			-c "SELECT idempotency.idem_token_consume('${token[$r]}')" | tr '\n' '|' | sed 's/|$//')"
}
# session_bound R DB MOVE_FILE: a connected session's session-bound claim
# stops the move; once the session is gone the move runs and the claim is
# taken over exactly once
move_with_session() {
	local r=$1 db=$2 file=$3 bg pid out i
	as_postgres "$PG_BINDIR/psql" -X -q -At -h "$SOCK" -p "$PGPORT" -U app -d "$db" \
		-c "SELECT outcome FROM idempotency.idem_acquire('sb-$r', session_bound => true)" \
		-c "SELECT pg_sleep(300)" >/dev/null 2>&1 &
	bg=$!
	for ((i = 0; i < 300; i++)); do
		pid=$(q postgres "$db" -c "SELECT owner_pid FROM idempotency.records WHERE key = 'sb-$r' AND status = 'processing'")
		[[ -n $pid ]] && break
		sleep 0.1
	done
	[[ -n $pid ]] || die "round $r: the session-bound claim never appeared"
	out=$(q postgres postgres -v VERBOSITY=sqlstate -f "$file" 2>&1) && out="(the move ran)$out"
	check_match "round $r: the move refuses while a connected session holds a session-bound claim (55000)" "ERROR: +55000" "$out"
	check "round $r: the refused move changed nothing" "$4" "$(edition "$db")"
	q postgres postgres -c "SELECT pg_terminate_backend($pid)" >/dev/null
	wait "$bg" || true
	for ((i = 0; i < 300; i++)); do
		[[ $(q postgres "$db" -c "SELECT count(*) FROM pg_stat_activity WHERE pid = $pid") == 0 ]] && break
		sleep 0.1
	done
	local t1=$SECONDS
	q postgres postgres -f "$file" >"$W/move.out" 2>&1 || { cat "$W/move.out"; die "round $r: the move failed"; }
	echo "# move ($file) in $((SECONDS - t1)) s"
}
after_session() {
	local r=$1 db=$2 first second
	first=$(q app "$db" -c "SELECT outcome, attempt FROM idempotency.idem_acquire('sb-$r', lease => '1 hour')")
	second=$(q app "$db" -c "SELECT outcome FROM idempotency.idem_acquire('sb-$r', lease => '1 hour')")
	check "round $r: the session-bound claim of the gone session is taken over once" "acquired|2 in_progress" \
		"$first $second"
}

q postgres postgres -c "CREATE ROLE app_owner LOGIN NOSUPERUSER NOCREATEROLE NOCREATEDB" \
	-c "CREATE ROLE app LOGIN" -c "CREATE DATABASE app OWNER app_owner" -c "CREATE DATABASE app2 OWNER app_owner"
q app_owner app -f "$W/idempotency_sql.psql" >/dev/null
grants app_owner app
check "start: database app has the plain script's SQL edition" "SQL plain" "$(edition app)"

# 1. plain script -> C extension
live 1 app
move_with_session 1 app "$W/to_c.sql" "SQL plain"
check "round 1: database app has the C extension" "C" "$(edition app)"
grants postgres app
after 1 app
after_session 1 app

# 2. C extension -> SQL edition (CREATE EXTENSION by the owner)
live 2 app
move_with_session 2 app "$W/to_sql.sql" "C"
check "round 2: database app has the SQL edition, the owner's" "SQL extension|app_owner" \
	"$(edition app)|$(q postgres app -c "SELECT r.rolname FROM pg_extension e JOIN pg_roles r ON r.oid = e.extowner WHERE e.extname = 'idempotency_sql'")"
grants app_owner app
after 2 app
after_session 2 app

# 3. SQL edition (extension) -> C extension
live 3 app
move_with_session 3 app "$W/to_c.sql" "SQL extension"
check "round 3: database app has the C extension" "C" "$(edition app)"
grants postgres app
after 3 app
after_session 3 app

# 4. the two-server way, no superuser: C extension in app (export by the
# application role) -> plain script in app2 (install and import by its owner)
live 4 app
q app_owner app2 -f "$W/idempotency_sql.psql" >/dev/null
(cd "$W" && as_postgres env PATH="$PG_BINDIR:$PATH" SOURCE="host=$SOCK port=$PGPORT user=app dbname=app" bash -e -o pipefail -c "cd '$W'; $(cat "$W/export.sh")")
(cd "$W" && as_postgres env PATH="$PG_BINDIR:$PATH" TARGET="host=$SOCK port=$PGPORT user=app_owner dbname=app2" bash -e -o pipefail -c "cd '$W'; $(cat "$W/import.sh")")
check "round 4: every record of app is in app2" \
	"$(q postgres app -c "SELECT count(*), md5(string_agg(r::text, ',' ORDER BY scope, key, expires_at)) FROM idempotency.records r")" \
	"$(q postgres app2 -c "SELECT count(*), md5(string_agg(r::text, ',' ORDER BY scope, key, expires_at)) FROM idempotency.records r")"
grants app_owner app2
after 4 app2
# the earlier rounds' records came along too: replay one of each
for r in 1 2 3; do
	check "round 4: round $r's completed record replays in app2" "replay|201" \
		"$(q app app2 -c "SELECT outcome, response_status FROM idempotency.idem_acquire('done-$r', '{\"n\": $r}')")"
done

# 5. back, the two-server way: plain script in app2 (export by its owner)
# -> C extension in app3 (a superuser's CREATE EXTENSION and import)
live 5 app2
q postgres postgres -c "CREATE DATABASE app3"
q postgres app3 -c "CREATE EXTENSION idempotency"
(cd "$W" && as_postgres env PATH="$PG_BINDIR:$PATH" SOURCE="host=$SOCK port=$PGPORT user=app_owner dbname=app2" bash -e -o pipefail -c "cd '$W'; $(cat "$W/export.sh")")
(cd "$W" && as_postgres env PATH="$PG_BINDIR:$PATH" TARGET="host=$SOCK port=$PGPORT user=postgres dbname=app3" bash -e -o pipefail -c "cd '$W'; $(cat "$W/import.sh")")
check "round 5: every record of app2 is in app3" \
	"$(q postgres app2 -c "SELECT count(*), md5(string_agg(r::text, ',' ORDER BY scope, key, expires_at)) FROM idempotency.records r")" \
	"$(q postgres app3 -c "SELECT count(*), md5(string_agg(r::text, ',' ORDER BY scope, key, expires_at)) FROM idempotency.records r")"
grants postgres app3
after 5 app3
for r in 1 2 3 4; do
	check "round 5: round $r's completed record replays in app3" "replay|201" \
		"$(q app app3 -c "SELECT outcome, response_status FROM idempotency.idem_acquire('done-$r', '{\"n\": $r}')")"
done

echo "# move test: $((SECONDS - t0)) s"
echo "move: $ok of $n checks passed."
((ok == n))
