#!/usr/bin/env bash
# proxy/bench.sh -- what routing through idempotency_proxy costs (one run)
#
# Starts 5 throwaway clusters as the postgres OS user on 127.0.0.1: a router
# and 4 shards (idempotency preloaded), synchronous_commit = off, and
# measures with pgbench:
#   1. latency of one client, idem_acquire of a new key and of a replay,
#      direct on a shard and through the router (1 shard): the router's cost;
#   2. throughput of 8 clients through the router over 1, 2 and 4 shards
#      (router databases r1, r2, r4 on the same router server);
#   3. CPU seconds per call of the router and of the shards (from
#      /proc: the postmaster's own and reaped children's time, plus the
#      live children's), over the 4-shard run.
# Everything stops on exit.  Needs PL/Proxy and both extensions installed
# in the PostgreSQL of PG_BINDIR (default /usr/lib/postgresql/15/bin).
#
#   bash proxy/bench.sh [SECONDS]        (as root; default 10 s a case)
set -euo pipefail

PG_BINDIR=${PG_BINDIR:-/usr/lib/postgresql/15/bin}
DUR=${1:-10}
BASE=$(mktemp -d /tmp/idem-proxy-bench.XXXXXX)
chown postgres "$BASE"
PORTS=()

as_pg() { (cd "$BASE" && runuser -u postgres -- "$@"); }

cleanup() {
	local d
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
		shared_buffers = 256MB
		autovacuum = off
		max_connections = 60
	EOF
	if ((i > 0)); then
		echo "shared_preload_libraries = 'idempotency'" >>"$BASE/n$i/postgresql.conf"
	fi
	as_pg "$PG_BINDIR/pg_ctl" -D "$BASE/n$i" -l "$BASE/n$i.log" -w start >/dev/null
done
psql_at() { local p=$1 db=$2; shift 2; as_pg "$PG_BINDIR/psql" -XAtq -h 127.0.0.1 -p "$p" -d "$db" -v ON_ERROR_STOP=1 "$@"; }
R=${PORTS[0]}
shard_cs() { echo "host=127.0.0.1 port=${PORTS[$1]} dbname=postgres"; }
for i in 1 2 3 4; do
	psql_at "${PORTS[$i]}" postgres -c 'CREATE EXTENSION idempotency'
done
for n in 1 2 4; do
	list=$(for ((s = 1; s <= n; s++)); do printf "'%s'," "$(shard_cs $s)"; done)
	psql_at "$R" postgres -c "CREATE DATABASE r$n"
	psql_at "$R" "r$n" -c 'CREATE EXTENSION idempotency_proxy CASCADE' \
		-c "SELECT count(*) FROM idempotency.cluster_create(ARRAY[${list%,}])" >/dev/null
done
# 2,000 completed keys to replay, on the shards of each router database
for n in 1 2 4; do
	psql_at "$R" "r$n" -c "SELECT count(*) FROM generate_series(1, 2000) i,
		LATERAL idempotency.idem_acquire('rep' || i, NULL, 'bench', ttl => '1h') a,
		LATERAL idempotency.idem_complete('rep' || i, 200, '{\"ok\": true}', 'bench') c" >/dev/null
done
psql_at "${PORTS[1]}" postgres -c "SELECT count(*) FROM idempotency.idem_maintain()" >/dev/null

cat >"$BASE/new.sql" <<'EOF'
\set r random(1, 2000000000)
SELECT outcome FROM idempotency.idem_acquire('n' || :r || ':' || :client_id, NULL, 'bench', ttl => '1h', lease => '60s');
EOF
cat >"$BASE/replay.sql" <<'EOF'
\set r random(1, 2000)
SELECT outcome FROM idempotency.idem_acquire('rep' || :r, NULL, 'bench', ttl => '1h', lease => '60s');
EOF
chown postgres "$BASE"/*.sql

# pgbench PORT DB SCRIPT CLIENTS -> "tps latency_ms transactions"
bench() {
	local out
	out=$(as_pg "$PG_BINDIR/pgbench" -n -h 127.0.0.1 -p "$1" -c "$4" -j "$(( $4 > 1 ? 2 : 1 ))" -T "$DUR" -f "$3" "$2" 2>&1)
	printf '%s %s %s\n' \
		"$(sed -nE 's/^tps = ([0-9.]+) .*/\1/p' <<<"$out")" \
		"$(sed -nE 's/^latency average = ([0-9.]+) ms/\1/p' <<<"$out")" \
		"$(sed -nE 's/^number of transactions actually processed: ([0-9]+).*/\1/p' <<<"$out")"
}

# cpu_of PORT: CPU seconds of that cluster so far (postmaster, its reaped
# children, its live children)
cpu_of() {
	local pm t=0 p
	pm=$(head -n 1 "$BASE/n$1/postmaster.pid")
	t=$(awk '{ print $14 + $15 + $16 + $17 }' "/proc/$pm/stat")
	for p in $(pgrep -P "$pm"); do
		t=$((t + $(awk '{ print $14 + $15 }' "/proc/$p/stat" 2>/dev/null || echo 0)))
	done
	echo "scale=3; $t / $(getconf CLK_TCK)" | bc
}

echo "# idempotency_proxy bench: $(nproc) cores, PostgreSQL $(psql_at "$R" postgres -c 'SHOW server_version'), $DUR s a case"
echo
echo "## 1. One client: latency per call (ms)"
echo "| call | direct on a shard | through the router (1 shard) | router's cost |"
echo "|---|---|---|---|"
for s in new replay; do
	read -r _ dl _ < <(bench "${PORTS[1]}" postgres "$BASE/$s.sql" 1)
	read -r _ rl _ < <(bench "$R" r1 "$BASE/$s.sql" 1)
	echo "| idem_acquire, $s | $dl | $rl | +$(echo "scale=3; $rl - $dl" | bc) |"
done
echo
echo "## 2. 8 clients through the router: throughput (calls/s)"
echo "| shards | new keys | replays |"
echo "|---|---|---|"
for n in 1 2 4; do
	read -r tn _ _ < <(bench "$R" "r$n" "$BASE/new.sql" 8)
	read -r tr _ _ < <(bench "$R" "r$n" "$BASE/replay.sql" 8)
	echo "| $n | $tn | $tr |"
done
read -r td _ _ < <(bench "${PORTS[1]}" postgres "$BASE/new.sql" 8)
echo "| direct, 1 shard, no router | $td | |"
echo
echo "## 3. CPU per call, 8 clients over 4 shards, new keys"
sleep 1
declare -a c0 c1
for i in 0 1 2 3 4; do c0[i]=$(cpu_of "$i"); done
read -r t4 _ calls < <(bench "$R" r4 "$BASE/new.sql" 8)
sleep 1
for i in 0 1 2 3 4; do c1[i]=$(cpu_of "$i"); done
router_us=$(echo "scale=1; (${c1[0]} - ${c0[0]}) * 1000000 / $calls" | bc)
shards=0
for i in 1 2 3 4; do shards=$(echo "$shards + ${c1[i]} - ${c0[i]}" | bc); done
shard_us=$(echo "scale=1; $shards * 1000000 / $calls" | bc)
echo "calls: $calls ($t4/s); router CPU: $router_us us a call; shards' CPU: $shard_us us a call (all 4 together)"
for i in 1 2 3 4; do
	echo "  shard $i: $(echo "scale=1; (${c1[i]} - ${c0[i]}) * 1000000 / $calls" | bc) us of every call routed"
done
echo "predicted: one shard core serves $(echo "1000000 / $shard_us" | bc) calls/s, one router core $(echo "1000000 / $router_us" | bc) calls/s"
