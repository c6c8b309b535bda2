#!/usr/bin/env bash
# proxy/grow_pause.sh -- how long a growth holds up the calls of other keys
#
# Starts 5 throwaway clusters as the postgres OS user on 127.0.0.1: a router
# and 4 shards (idempotency preloaded, wait_timeout 3 s), then, ROUNDS times
# and for each case in turn (idempotency_proxy 1.1 over idempotency 1.1,
# and 1.2 over 1.2, the order alternating from round to round), in fresh
# databases:
#   - cluster_create over 2 shards;
#   - a claim held open in a transaction directly on shard 1, and a client
#     that asks for that key through the router over and over (each call
#     waits out wait_timeout on the shard: a duplicate in flight);
#   - 8 pgbench clients claiming new keys through the router, every call's
#     latency logged, half of the calls (script 0) with keys that stay on
#     their shard in the growth, half (script 1) with keys that move;
#   - after 2 s, cluster_grow to 4 shards, timed.
# For each run it prints the growth's duration, the median latency of a
# plain call (those that ended before the growth or began after it), and
# the longest latency of the calls that were running at any moment of the
# growth (from pgbench's per-transaction log), for keys that stay and keys
# that move,
# in ms and as a multiple of the plain call, and the calls that failed
# (pgbench's aborted clients); then the medians per case.
# Everything stops on exit.  Needs PL/Proxy and both extensions installed
# in the PostgreSQL of PG_BINDIR (default /usr/lib/postgresql/15/bin).
#
#   bash proxy/grow_pause.sh [ROUNDS]        (as root; default 3)
set -euo pipefail

median() { sort -n | awk '{ a[NR] = $1 } END { print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }

PG_BINDIR=${PG_BINDIR:-/usr/lib/postgresql/15/bin}
ROUNDS=${1:-3}
BASE=$(mktemp -d /tmp/idem-grow-pause.XXXXXX)
chown postgres "$BASE"
PORTS=()
HOLDER=

as_pg() { (cd "$BASE" && runuser -u postgres -- "$@"); }

cleanup() {
	local d
	[[ -n $HOLDER ]] && kill "$HOLDER" 2>/dev/null || true
	for d in "$BASE"/n*; do
		[[ -f $d/postmaster.pid ]] && as_pg "$PG_BINDIR/pg_ctl" -D "$d" stop -m immediate -w >/dev/null 2>&1 || true
	done
	rm -rf "$BASE"
}
trap cleanup EXIT

for i in 0 1 2 3 4; do
	port=$((20000 + RANDOM % 10000))
	PORTS+=("$port")
	as_pg "$PG_BINDIR/initdb" -D "$BASE/n$i" -A trust -U postgres --no-sync >/dev/null
	cat >>"$BASE/n$i/postgresql.conf" <<-EOF
		listen_addresses = '127.0.0.1'
		port = $port
		unix_socket_directories = '$BASE'
		synchronous_commit = off
		autovacuum = off
		max_connections = 80
	EOF
	if ((i > 0)); then
		echo "shared_preload_libraries = 'idempotency'" >>"$BASE/n$i/postgresql.conf"
	fi
	as_pg "$PG_BINDIR/pg_ctl" -D "$BASE/n$i" -l "$BASE/n$i.log" -w start >/dev/null
done
psql_at() { local p=$1 db=$2; shift 2; as_pg "$PG_BINDIR/psql" -XAtq -h 127.0.0.1 -p "$p" -d "$db" -v ON_ERROR_STOP=1 "$@"; }
R=${PORTS[0]}
shard_cs() { echo "host=127.0.0.1 port=${PORTS[$1]} dbname=$2"; }

# keys that stay (bit 1 of the hash clear: 2 -> 4 partitions keeps them)
# and keys that move; the first of 8 candidates that fits
for kind in stay move; do
	bit=$([[ $kind == stay ]] && echo 0 || echo 2)
	cat >"$BASE/$kind.sql" <<-EOF
		\set r random(1, 2000000000)
		SELECT a.outcome FROM (SELECT c.k FROM (SELECT 'n' || :r || ':' || :client_id || ':' || g AS k
		    FROM generate_series(1, 8) g) c WHERE idempotency.key_hash('bench', c.k) & 2 = $bit LIMIT 1) s,
		  LATERAL idempotency.idem_acquire(s.k, NULL, 'bench', ttl => '1h', lease => '60s') a;
	EOF
done
chown postgres "$BASE"/*.sql

# run VERSION DB: one growth under load; prints
# "grow_ms plain_ms stay_max_ms move_max_ms failed"
run() {
	local v=$1 db=$2 i g0 g1 key
	for i in 1 2 3 4; do
		psql_at "${PORTS[$i]}" postgres -c "CREATE DATABASE $db"
		psql_at "${PORTS[$i]}" "$db" -c "CREATE EXTENSION idempotency VERSION '$v'"
	done
	psql_at "$R" postgres -c "CREATE DATABASE $db"
	psql_at "$R" "$db" -c "CREATE EXTENSION idempotency_proxy VERSION '$v' CASCADE" \
		-c "SELECT count(*) FROM idempotency.cluster_create(ARRAY['$(shard_cs 1 "$db")', '$(shard_cs 2 "$db")'])" >/dev/null
	# a key of shard 1 (partition 0 of 2), held open there
	key=$(psql_at "$R" "$db" -c "SELECT 'held' || i FROM generate_series(1, 100) i
		WHERE idempotency.key_hash('bench', 'held' || i) & 1 = 0 LIMIT 1")
	(printf 'BEGIN;\nSELECT count(*) FROM idempotency.idem_acquire(%s, NULL, %s);\nSELECT pg_sleep(3600);\n' \
		"'$key'" "'bench'" | as_pg "$PG_BINDIR/psql" -XAtq -h 127.0.0.1 -p "${PORTS[1]}" -d "$db" >/dev/null 2>&1) &
	HOLDER=$!
	sleep 0.5
	# its duplicate, through the router, waiting out wait_timeout each time
	(for _ in $(seq 1 8); do
		psql_at "$R" "$db" -c "SELECT outcome FROM idempotency.idem_acquire('$key', NULL, 'bench')" >/dev/null 2>&1 || true
	done) &
	local waiter=$!
	rm -f "$BASE"/log_"$db"*
	as_pg "$PG_BINDIR/pgbench" -n -h 127.0.0.1 -p "$R" -c 8 -j 2 -T 7 -f "$BASE/stay.sql" -f "$BASE/move.sql" \
		-l --log-prefix="$BASE/log_$db" "$db" >"$BASE/bench_$db.out" 2>&1 &
	local bench=$!
	sleep 2
	g0=$(date +%s%6N)
	if [[ -n ${SAMPLE:-} ]]; then
		(for _ in $(seq 1 40); do
			for i in 0 1 2 3 4; do
				psql_at "${PORTS[$i]}" postgres -c "SELECT $i, now(), state, wait_event_type, wait_event, now() - query_start, left(query, 60)
					FROM pg_stat_activity WHERE state <> 'idle' AND pid <> pg_backend_pid() AND backend_type = 'client backend'" 2>/dev/null
			done
			sleep 0.1
		done >"$BASE/sample_$db") &
	fi
	psql_at "$R" "$db" -c "SELECT count(*) FROM idempotency.cluster_grow(ARRAY['$(shard_cs 1 "$db")',
		'$(shard_cs 2 "$db")', '$(shard_cs 3 "$db")', '$(shard_cs 4 "$db")'], consult_previous => '1h')" >/dev/null
	g1=$(date +%s%6N)
	wait "$bench" || true
	kill "$waiter" 2>/dev/null || true
	kill "$HOLDER" 2>/dev/null || true
	HOLDER=
	wait 2>/dev/null || true
	# pgbench -l: client_id transaction_no time_us script_no time_epoch time_us_part
	# (the end of the transaction); it ran from end - time_us.
	local plain failed
	plain=$(cat "$BASE"/log_"$db"* | awk -v g0="$g0" -v g1="$g1" '
		{ end = $5 * 1000000 + $6 } end < g0 || end - $3 > g1 { print $3 / 1000 }' | median)
	failed=$(grep -c 'aborted' "$BASE/bench_$db.out" || true)
	cat "$BASE"/log_"$db"* | awk -v g0="$g0" -v g1="$g1" -v plain="$plain" -v failed="$failed" '
		{ end = $5 * 1000000 + $6; start = end - $3;
		  if (end >= g0 && start <= g1 && $3 > max[$4]) max[$4] = $3 }
		END { printf "%.1f %.2f %.1f %.1f %d\n", (g1 - g0) / 1000, plain, max[0] / 1000, max[1] / 1000, failed }'
}

echo "# growth pause: $(nproc) cores, PostgreSQL $(psql_at "$R" postgres -c 'SHOW server_version'), $ROUNDS rounds"
echo "| round | case | growth (ms) | plain call (ms) | longest call during it, key that stays (ms, x plain) | key that moves (ms, x plain) | failed |"
echo "|---|---|---|---|---|---|---|"
: >"$BASE/results"
for ((round = 1; round <= ROUNDS; round++)); do
	if ((round % 2)); then order="1.1 1.2"; else order="1.2 1.1"; fi
	for v in ${CASES:-$order}; do
		read -r g p s m f < <(run "$v" "r${round}_${v/./_}")
		echo "| $round | $v | $g | $p | $s ($(awk -v a="$s" -v b="$p" 'BEGIN { printf "%.0f", a / b }')) |" \
			"$m ($(awk -v a="$m" -v b="$p" 'BEGIN { printf "%.0f", a / b }')) | $f |"
		[[ -n ${SAMPLE:-} ]] && cp "$BASE/sample_r${round}_${v/./_}" "$SAMPLE.$round.$v"
		echo "$v $g $p $s $m $f" >>"$BASE/results"
	done
done
for v in 1.1 1.2; do
	echo "median $v: growth $(awk -v v="$v" '$1 == v { print $2 }' "$BASE/results" | median) ms," \
		"plain call $(awk -v v="$v" '$1 == v { print $3 }' "$BASE/results" | median) ms," \
		"longest call, key that stays $(awk -v v="$v" '$1 == v { print $4 }' "$BASE/results" | median) ms" \
		"($(awk -v v="$v" '$1 == v { print $4 / $3 }' "$BASE/results" | median) x plain)," \
		"key that moves $(awk -v v="$v" '$1 == v { print $5 }' "$BASE/results" | median) ms" \
		"($(awk -v v="$v" '$1 == v { print $5 / $3 }' "$BASE/results" | median) x plain)," \
		"failed calls $(awk -v v="$v" '$1 == v { s += $6 } END { print s + 0 }' "$BASE/results") in all"
done
