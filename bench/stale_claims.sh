#!/usr/bin/env bash
# bench/stale_claims.sh -- what reading idempotency.stale_claims costs on a
# big records table, and whether completions stay HOT updates
#
#   bash bench/stale_claims.sh [--records N] [--processing-every K]
#                              [--duration S] [REV] [PORT]
#
# Builds REV (default HEAD) from a `git archive` copy into a private copy of
# the host's PostgreSQL 15 (bench/private_pg.sh, under /tmp/idem-stale/REV:
# the host's installation is not touched, no lock needed), initdb's a
# cluster there with bench/run.sh's settings (shared_buffers 1GB,
# autovacuum off, synchronous_commit off) and the library preloaded, and
#
#   - loads N (default 10,000,000) completed records, as bench/run.sh's scale
#     load does (bench/load_records.sql, two sessions, expiring evenly over
#     the next day, VACUUM ANALYZE),
#   - turns every K-th of them (default 1000: 0.1 %) back into a claim in
#     progress: of each ten, eight with a live lease (locked_until in 5
#     minutes, not stale), one whose lease ran out a minute ago (stale:
#     'lease expired'), one session-bound to a backend that is gone (stale:
#     'owner gone'); then VACUUM ANALYZE again,
#   - reads `SELECT count(*) FROM idempotency.stale_claims` once to warm up,
#     then 3 times (psql \timing, the median reported), and prints
#     EXPLAIN (ANALYZE, BUFFERS) of the same query,
#   - lists the indexes of the records partitions (none may be on status:
#     that would stop completions from being HOT updates), runs
#     bench/cases/ext_new.pgbench for S seconds (default 10) at 8 clients,
#     and prints n_tup_upd and n_tup_hot_upd over the partitions before and
#     after it: each ext_new transaction completes its claim with one UPDATE.
#
# As root on Debian 12; with the defaults about 4 minutes (2 of them the
# load).  The cluster is stopped and its folder removed at exit.
set -euo pipefail
RECORDS=10000000 EVERY=1000 DURATION=10
while [[ ${1:-} == --* ]]; do
	case $1 in
	--records) RECORDS=${2:?}; shift 2 ;;
	--processing-every) EVERY=${2:?}; shift 2 ;;
	--duration) DURATION=${2:?}; shift 2 ;;
	*) echo "unknown option: $1" >&2; exit 2 ;;
	esac
done
[[ $RECORDS =~ ^[0-9]+$ && $RECORDS -ge 2 ]] || { echo "--records takes a number" >&2; exit 2; }
[[ $EVERY =~ ^[0-9]+$ && $EVERY -ge 1 ]] || { echo "--processing-every takes a number" >&2; exit 2; }
REV=${1:-HEAD} PORT=${2:-55412}
BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=bench/private_pg.sh
source "$BENCH_DIR/private_pg.sh"
W=/tmp/idem-stale/$(tr -c 'A-Za-z0-9._\n-' _ <<<"$REV")
P=$W/pg BIN=$W/pg/lib/postgresql/15/bin D=$W/data
REQ='{"amount_cents": 2000, "currency": "EUR", "order": "A-1001"}'
RESP='{"payment_id": 7, "status": "succeeded", "amount_cents": 2000}'
as_pg() { runuser -u postgres -- "$@"; }
log() { printf '==> %s\n' "$*"; }

mkdir -p /tmp/idem-stale; chmod 755 /tmp/idem-stale
rm -rf "$W"; mkdir -p "$W/src" "$W/sock"; chmod 755 "$W"
private_pg_make "$P"
git -C "$BENCH_DIR/.." archive "$REV" | tar -x -C "$W/src"
private_pg_install "$P" "$W/src"
DESC=$(git -C "$BENCH_DIR/.." log --oneline --no-decorate -1 "$REV")
mkdir -p "$D"; chown -R postgres: "$D" "$W/sock"; chmod 700 "$D"
as_pg "$BIN/initdb" -D "$D" --auth=trust -U postgres -E UTF8 --locale=C.UTF-8 --no-sync >/dev/null
cat >>"$D/postgresql.conf" <<CONF
listen_addresses = '127.0.0.1'
port = $PORT
unix_socket_directories = '$W/sock'
shared_preload_libraries = 'idempotency'
shared_buffers = 1GB
synchronous_commit = off
autovacuum = off
max_wal_size = 20GB
min_wal_size = 2GB
checkpoint_timeout = 1h
max_locks_per_transaction = 128
CONF
export PGHOST=127.0.0.1 PGPORT=$PORT PGUSER=postgres PGDATABASE=stale
cleanup() {
	as_pg "$BIN/pg_ctl" -D "$D" -w -m fast stop >/dev/null 2>&1 || true
	rm -rf "$W"
}
trap cleanup EXIT
as_pg "$BIN/pg_ctl" -D "$D" -l "$D/server.log" -w start >/dev/null
q() { "$BIN/psql" -X -q -A -t -v ON_ERROR_STOP=1 -c "$1"; }
"$BIN/createdb" stale
q 'CREATE EXTENSION idempotency'

log "$DESC: loading $RECORDS completed records (two sessions)"
t0=$EPOCHREALTIME
half=$((RECORDS / 2))
"$BIN/psql" -X -q -v ON_ERROR_STOP=1 -v from=1 -v to="$half" -v req="$REQ" -v resp="$RESP" \
	-v spread='1 day' -f "$BENCH_DIR/load_records.sql" & p1=$!
"$BIN/psql" -X -q -v ON_ERROR_STOP=1 -v from=$((half + 1)) -v to="$RECORDS" -v req="$REQ" -v resp="$RESP" \
	-v spread='1 day' -f "$BENCH_DIR/load_records.sql" & p2=$!
wait $p1; wait $p2
q 'VACUUM ANALYZE idempotency.records'
log "loaded in $(awk "BEGIN{printf \"%.0f\", $EPOCHREALTIME - $t0}")s"

# a pid no backend has now, with a start time: an owner that is gone
gone_pid=$(q 'SELECT pg_backend_pid()')
log "turning every ${EVERY}th record into a claim in progress (owner gone: pid $gone_pid)"
q "UPDATE idempotency.records r
      SET status = 'processing', completed_at = NULL, response_status = NULL, response_body = NULL,
          locked_until = CASE WHEN m.i / $EVERY % 10 = 8 THEN now() - interval '1 minute'
                              ELSE now() + interval '5 minutes' END,
          owner_pid = CASE WHEN m.i / $EVERY % 10 = 9 THEN $gone_pid END,
          owner_start = CASE WHEN m.i / $EVERY % 10 = 9 THEN now() - interval '1 hour' END
     FROM (SELECT i, md5('m' || i) COLLATE \"C\" AS key
             FROM generate_series($EVERY, $RECORDS, $EVERY) i) m
    WHERE r.scope = '' AND r.key = m.key"
q 'VACUUM ANALYZE idempotency.records'

SIZE=$(q "SELECT pg_size_pretty(sum(pg_table_size(c.oid))) || ' heap, ' ||
	pg_size_pretty(sum(pg_indexes_size(c.oid))) || ' indexes, ' || count(*) || ' partitions'
	FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
	WHERE i.inhparent = 'idempotency.records'::regclass")
COUNTS=$(q "SELECT count(*) FILTER (WHERE status = 'completed') || ' completed, ' ||
	count(*) FILTER (WHERE status = 'processing') || ' processing'
	FROM idempotency.records")
TIMES=$("$BIN/psql" -X -q -A -t -v ON_ERROR_STOP=1 <<'SQL'
SELECT count(*) FROM idempotency.stale_claims;
\timing on
SELECT count(*) FROM idempotency.stale_claims;
SELECT count(*) FROM idempotency.stale_claims;
SELECT count(*) FROM idempotency.stale_claims;
SQL
)
STALE=$(sed -n 1p <<<"$TIMES")
MS=$(grep -o 'Time: [0-9.]*' <<<"$TIMES" | awk '{print $2}' | sort -n | tr '\n' ' ')
MEDIAN=$(awk '{print $2}' <<<"$MS")
REASONS=$(q "SELECT string_agg(reason || ' ' || n, ', ') FROM (SELECT reason, count(*) n
	FROM idempotency.stale_claims GROUP BY reason ORDER BY reason) s")
EXPLAIN=$(q 'EXPLAIN (ANALYZE, BUFFERS) SELECT count(*) FROM idempotency.stale_claims')
INDEXES=$(q "SELECT DISTINCT regexp_replace(indexdef, '^CREATE (UNIQUE )?INDEX \S+ ON (ONLY )?\S+', '<partition>')
	FROM pg_indexes WHERE schemaname = 'idempotency' AND tablename LIKE 'records%'")

hot() {
	q "SELECT sum(n_tup_upd) || ' ' || sum(n_tup_hot_upd) || ' ' || sum(n_tup_ins)
	     FROM pg_stat_user_tables s JOIN pg_inherits i ON i.inhrelid = s.relid
	    WHERE i.inhparent = 'idempotency.records'::regclass"
}
sleep 1 # the statistics of the UPDATE above reach pg_stat_user_tables
read -r upd0 hot0 ins0 <<<"$(hot)"
log "ext_new, 8 clients, ${DURATION}s"
"$BIN/pgbench" -n -M prepared -c 8 -j 2 -T "$DURATION" -D n=0 -D kp=hot- \
	-D "req=$REQ" -D "resp=$RESP" -f "$BENCH_DIR/cases/ext_new.pgbench" >"$W/pgbench.log" 2>&1 ||
	{ cat "$W/pgbench.log"; exit 1; }
TPS=$(sed -n 's/^tps = \([0-9.]*\) (without.*/\1/p' "$W/pgbench.log")
TX=$(sed -n 's/^number of transactions actually processed: \([0-9]*\).*/\1/p' "$W/pgbench.log")
sleep 1
read -r upd1 hot1 ins1 <<<"$(hot)"

cat <<REPORT

# idempotency.stale_claims at $RECORDS records

- revision: \`$DESC\`; $(date -u +%Y-%m-%dT%H:%M:%SZ); $(nproc) CPUs, load average before the reads $(cut -d' ' -f1-3 /proc/loadavg)
- idempotency.records: $COUNTS; $SIZE; shared_buffers 1GB
- stale claims: $STALE ($REASONS)
- \`SELECT count(*) FROM idempotency.stale_claims\`, warm, 3 runs: $MS ms; median $MEDIAN ms

\`\`\`
$EXPLAIN
\`\`\`

Indexes of every records partition:

\`\`\`
$INDEXES
\`\`\`

ext_new, 8 clients, ${DURATION}s: $TX transactions ($TPS TPS); records partitions:
inserts +$((ins1 - ins0)), updates +$((upd1 - upd0)), of them HOT +$((hot1 - hot0))
REPORT
