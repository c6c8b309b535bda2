#!/usr/bin/env bash
# proxy/cpu_bench.sh -- the router's CPU per call, against a direct call
#
# Starts 2 throwaway clusters as the postgres OS user on 127.0.0.1: a router
# and one shard (idempotency preloaded), synchronous_commit = off.  Then,
# ROUNDS times, the four cases in turn (the order reversed every other
# round): idem_acquire of a new key and of a replay, direct on the shard
# and through the router, each one pgbench client for SECONDS.  For each it
# takes the CPU seconds of each cluster from /proc (the postmaster's own
# and its reaped children's, plus the live children's) before and after,
# and prints per call: the latency, the shard's CPU, the router's CPU, and
# the ratio of all the servers' CPU through the router to a direct call's;
# then the medians per case.  A third case, noop, is the floor of any
# PL/Proxy router: a PL/Proxy function on the router that runs a one-line
# SQL function on the shard (bench.noop(int), outside the extensions), against
# the same SQL function called directly: what routing alone costs, whatever
# the routed function does.  A fourth, bare, is a new key through the
# router's PL/Proxy function px_owned_acquire called by the client itself,
# without the router's PL/pgSQL idem_acquire around it (its hash, layout,
# retries and error mapping): what a leaner router could reach with the
# shards of today (direct: the same as new).  Two more, app and
# app_replay, are what an application that routes by itself costs (the Go
# package's Shards; proxy/README.md, "Calls that skip the router"): the client calls
# the owning shard's shard_acquire with the layout version, a prepared
# statement, and no router is in the path; against idem_acquire called
# directly, prepared too (pgbench -M prepared on both sides; the other
# cases run -M simple).  CPU time depends far less on what else the
# machine runs than wall time does.  Everything stops on exit.  Needs
# PL/Proxy and both extensions installed in the PostgreSQL of PG_BINDIR
# (default /usr/lib/postgresql/15/bin).  PERF=1 also records a profile
# (perf record -g) of the router's backend in round 1, new keys, and
# prints its top functions.
#
#   bash proxy/cpu_bench.sh [ROUNDS] [SECONDS]   (as root; default 3, 10)
set -euo pipefail

PG_BINDIR=${PG_BINDIR:-/usr/lib/postgresql/15/bin}
ROUNDS=${1:-3}
DUR=${2:-10}
BASE=$(mktemp -d /tmp/idem-proxy-cpu.XXXXXX)
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

median() { sort -n | awk '{ a[NR] = $1 } END { print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }

for i in 0 1; do
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
	EOF
	if ((i > 0)); then
		echo "shared_preload_libraries = 'idempotency'" >>"$BASE/n$i/postgresql.conf"
	fi
	as_pg "$PG_BINDIR/pg_ctl" -D "$BASE/n$i" -l "$BASE/n$i.log" -w start >/dev/null
done
psql_at() { local p=$1 db=$2; shift 2; as_pg "$PG_BINDIR/psql" -XAtq -h 127.0.0.1 -p "$p" -d "$db" -v ON_ERROR_STOP=1 "$@"; }
R=${PORTS[0]}
S=${PORTS[1]}
psql_at "$S" postgres -c 'CREATE EXTENSION idempotency'
psql_at "$R" postgres -c 'CREATE EXTENSION idempotency_proxy CASCADE' \
	-c "SELECT count(*) FROM idempotency.cluster_create(ARRAY['host=127.0.0.1 port=$S dbname=postgres'])" >/dev/null
# 2,000 completed keys to replay (the same records direct and routed)
psql_at "$S" postgres -c "SELECT count(*) FROM generate_series(1, 2000) i,
	LATERAL idempotency.idem_acquire('rep' || i, NULL, 'bench', ttl => '1h') a,
	LATERAL idempotency.idem_complete('rep' || i, 200, '{\"ok\": true}', 'bench') c" >/dev/null
cat >"$BASE/new.sql" <<'EOF'
\set r random(1, 2000000000)
SELECT outcome FROM idempotency.idem_acquire('n' || :r || ':' || :client_id, NULL, 'bench', ttl => '1h', lease => '60s');
EOF
cat >"$BASE/replay.sql" <<'EOF'
\set r random(1, 2000)
SELECT outcome FROM idempotency.idem_acquire('rep' || :r, NULL, 'bench', ttl => '1h', lease => '60s');
EOF
# the floor of routing: one trivial function on the shard, and a PL/Proxy
# function of the same name on the router that only runs it there
psql_at "$S" postgres -c 'CREATE SCHEMA bench' \
	-c 'CREATE FUNCTION bench.noop(h int) RETURNS int LANGUAGE sql IMMUTABLE AS $$SELECT h$$'
psql_at "$R" postgres -c 'CREATE SCHEMA bench' \
	-c "CREATE FUNCTION bench.noop(h int) RETURNS int LANGUAGE plproxy AS \$\$
		CLUSTER 'idempotency_cluster'; RUN ON h; SELECT bench.noop(h) AS noop; \$\$"
LV=$(psql_at "$R" postgres -c 'SELECT layout_version FROM idempotency.cluster_state')
cat >"$BASE/bare.sql" <<EOF
\\set r random(1, 2000000000)
SELECT outcome FROM idempotency.px_owned_acquire(false, idempotency.key_hash('bench', 'b' || :r || ':' || :client_id),
	$LV, 'b' || :r || ':' || :client_id, NULL, 'bench', '1h', '60s', NULL);
EOF
cat >"$BASE/noop.sql" <<'EOF'
\set r random(1, 2000000000)
SELECT bench.noop(:r);
EOF
# an application that routes by itself: the owning shard's shard_acquire
cat >"$BASE/app.sql" <<EOF
\\set r random(1, 2000000000)
SELECT outcome FROM idempotency.shard_acquire($LV, 'a' || :r || ':' || :client_id, NULL, 'bench', '1h', '60s', NULL);
EOF
cat >"$BASE/app_replay.sql" <<EOF
\\set r random(1, 2000)
SELECT outcome FROM idempotency.shard_acquire($LV, 'rep' || :r, NULL, 'bench', '1h', '60s', NULL);
EOF
chown postgres "$BASE"/*.sql

# cpu_of N: CPU seconds of cluster N so far
cpu_of() {
	local pm t p
	pm=$(head -n 1 "$BASE/n$1/postmaster.pid")
	t=$(awk '{ print $14 + $15 + $16 + $17 }' "/proc/$pm/stat")
	for p in $(pgrep -P "$pm"); do
		t=$((t + $(awk '{ print $14 + $15 }' "/proc/$p/stat" 2>/dev/null || echo 0)))
	done
	echo "scale=6; $t / $(getconf CLK_TCK)" | bc
}

# one CASE (direct|router) SCRIPT: "latency_ms shard_us router_us"
one() {
	local port=$S r0 r1 s0 s1 n lat prof= script=$2 mode=simple
	[[ $1 == router ]] && port=$R
	[[ $1 == direct && $2 == bare ]] && script=new
	if [[ $2 == app* ]]; then
		# no router: the application calls the shard, prepared
		port=$S mode=prepared
		[[ $1 == direct && $2 == app ]] && script=new
		[[ $1 == direct && $2 == app_replay ]] && script=replay
	fi
	sleep 0.5
	r0=$(cpu_of 0)
	s0=$(cpu_of 1)
	as_pg "$PG_BINDIR/pgbench" -n -h 127.0.0.1 -p "$port" -c 1 -T "$DUR" -M "$mode" -f "$BASE/$script.sql" postgres >"$BASE/out" 2>&1 &
	local bench=$!
	if [[ -n ${PERF:-} && $1 == router && $2 == new && $round == 1 ]]; then
		sleep 1
		prof=$(pgrep -P "$(head -n 1 "$BASE/n0/postmaster.pid")" -f 'postgres: postgres postgres' | head -n 1)
		perf record -q -g -p "$prof" -o "$BASE/perf.data" -- sleep 5 >/dev/null 2>&1 || true
	fi
	wait "$bench"
	sleep 0.5
	r1=$(cpu_of 0)
	s1=$(cpu_of 1)
	n=$(sed -nE 's/^number of transactions actually processed: ([0-9]+).*/\1/p' "$BASE/out")
	lat=$(sed -nE 's/^latency average = ([0-9.]+) ms/\1/p' "$BASE/out")
	echo "$lat $(echo "scale=1; ($s1 - $s0) * 1000000 / $n" | bc) $(echo "scale=1; ($r1 - $r0) * 1000000 / $n" | bc)"
}

echo "# idempotency_proxy CPU per call: $(nproc) cores, PostgreSQL $(psql_at "$R" postgres -c 'SHOW server_version'), $ROUNDS rounds of $DUR s a case, 1 client"
echo "| round | call | direct: latency (ms), shard CPU (us) | routed: latency (ms), shard CPU (us), router CPU (us) | routed / direct, CPU | routed / direct, latency |"
echo "|---|---|---|---|---|---|"
: >"$BASE/results"
for ((round = 1; round <= ROUNDS; round++)); do
	if ((round % 2)); then order="new replay noop bare app app_replay"; else order="app_replay app bare noop replay new"; fi
	for s in $order; do
		if ((round % 2)); then
			read -r dl ds _ < <(one direct "$s")
			read -r rl rs rr < <(one router "$s")
		else
			read -r rl rs rr < <(one router "$s")
			read -r dl ds _ < <(one direct "$s")
		fi
		cpu=$(echo "scale=2; ($rs + $rr) / $ds" | bc)
		lat=$(echo "scale=2; $rl / $dl" | bc)
		echo "| $round | $s | $dl, $ds | $rl, $rs, $rr | $cpu | $lat |"
		echo "$s $dl $ds $rl $rs $rr $cpu $lat" >>"$BASE/results"
	done
done
for s in new replay noop bare app app_replay; do
	m() { awk -v s="$s" -v c="$1" '$1 == s { print $c }' "$BASE/results" | median; }
	echo "median $s: direct $(m 2) ms, shard $(m 3) us; routed $(m 4) ms, shard $(m 5) us, router $(m 6) us;" \
		"routed / direct: CPU $(m 7), latency $(m 8)"
done
if [[ -f $BASE/perf.data ]]; then
	echo
	echo "## the router's backend, new keys (perf, self time)"
	perf report -q -i "$BASE/perf.data" --no-children -g none --sort dso --percent-limit 1 2>/dev/null | grep -v '^$' | head -12
	echo
	perf report -q -i "$BASE/perf.data" --no-children -g none --sort symbol --percent-limit 1 2>/dev/null | grep -v '^$' | head -40
fi
