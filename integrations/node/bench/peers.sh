#!/usr/bin/env bash
# integrations/node/bench/peers.sh -- the seed's payment endpoint on Express
# five ways, in one run (issues 38, 39): pg-idempotency (from its packed .tgz,
# as build.sh makes it), the same with its replay cache on (replayCache:
# true), express-idempotency with its Redis adapter, @node-idempotency/core
# with its Redis storage adapter, and no idempotency.
#
#   bash integrations/node/bench/peers.sh [--seconds S] [--rounds R] [--conns C]
#
# As root, on 127.0.0.1 only, against the cluster PGHOST/PGPORT/PGUSER name
# (the extension installed there), else (none named) a throwaway cluster of
# a private copy of PostgreSQL 15 with this tree's extension built and
# installed (scripts/common.sh, as bench/batch.sh; fsync and
# synchronous_commit off).  Starts its own redis-server (Debian's,
# installed when missing) on a free port, --save '' --appendonly no, and
# stops it and the five apps on exit.  Per round (R, default 3) and app, in
# an order rotated each round: S seconds (default 5) of new keys, then S
# seconds of replays of the keys that round completed (each app its own:
# with the cache, answers this process completed itself), C keep-alive
# connections (default 10), load.js as the client.  Then, three times per
# app, ten concurrent identical POSTs with one key, and the payment rows
# that key made, counted in PostgreSQL.
#
# The table's UNIQUE (user_id, idempotency_key) on shop.payments (the
# examples' last line of defence) is dropped: the count is then what the
# idempotency layer alone let through.
#
# Writes bench/results/node-peers-TIMESTAMP.{jsonl,txt} and prints the
# table (medians of the rounds, min-max).  Not part of scripts/test.sh.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../../.." && pwd)
seconds=5 rounds=3 conns=10
while (($#)); do
	case $1 in
	--seconds) seconds=$2; shift 2 ;;
	--rounds) rounds=$2; shift 2 ;;
	--conns) conns=$2; shift 2 ;;
	*) echo "usage: peers.sh [--seconds S] [--rounds R] [--conns C]" >&2; exit 2 ;;
	esac
done
own_cluster=0
if [[ -z ${PGHOST:-} || -z ${PGPORT:-} ]]; then
	# no cluster named: a private copy of PostgreSQL 15 with this tree's
	# extension and a throwaway cluster (as bench/batch.sh)
	IDEM_PG_MAJOR=15
	# shellcheck source=scripts/common.sh
	source "$repo/scripts/common.sh"
	IDEM_QUIET=1
	use_private_pg
	build_install
	start_cluster fast
	own_cluster=1
	PATH=$PG_BINDIR:$PATH
fi
export PGUSER=${PGUSER:-postgres} PGDATABASE=${PGDATABASE:-postgres}
if ! command -v redis-server >/dev/null; then
	apt-get update -qq >&2
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >&2
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/idempotency-peers.XXXXXX")
pids=()
cleanup() {
	local st=$? p
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
	for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
	rm -rf "$work"
	if ((own_cluster)); then
		stop_cluster "$st" || true
		[[ -z $IDEM_PG_PREFIX_OWN ]] || rm -rf "$IDEM_PG_PREFIX_OWN"
	fi
}
trap cleanup EXIT
log() { echo "# $*" >&2; }
free_port() { node -e 'const s=require("net").createServer().listen(0,"127.0.0.1",()=>{console.log(s.address().port);s.close()})'; }
wait_for() { # wait_for WHAT CMD...: until CMD succeeds (a started process's state), at most 60 s
	local what=$1 i
	shift
	for ((i = 0; i < 600; i++)); do
		"$@" >/dev/null 2>&1 && return 0
		sleep 0.1
	done
	echo "error: $what did not come up" >&2
	return 1
}

stamp=$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$repo/bench/results"
raw=$repo/bench/results/node-peers-$stamp.jsonl
txt=$repo/bench/results/node-peers-$stamp.txt
: >"$raw"
load_before=$(cut -d' ' -f1-3 /proc/loadavg)

# ---- the apps: pg-idempotency from its .tgz, the peers from package-lock.json
log "building pg-idempotency (build.sh) and the bench app (npm ci)"
tgz=$(bash "$repo/integrations/node/build.sh" "$work/build" 2>"$work/build.log" | tail -n 1) ||
	{ tail -n 30 "$work/build.log" >&2; exit 1; }
mkdir -p "$work/app"
cp "$here/package.json" "$here/package-lock.json" "$here/app.js" "$here/load.js" "$repo/integrations/node/conformance/shop.js" "$work/app/"
npm=(npm --no-audit --no-fund --loglevel=error)
(cd "$work/app" && "${npm[@]}" ci >&2 && "${npm[@]}" install --no-save "$tgz" >&2)
versions=$(cd "$work/app" && node -e '
for (const p of ["pg-idempotency", "express-idempotency", "express-idempotency-redis-adapter", "@node-idempotency/core",
  "@node-idempotency/storage-adapter-redis", "redis", "@redis/client", "express", "pg"])
  process.stdout.write(p + " " + require(p + "/package.json").version + "\n");')

# ---- the database: the examples' schema, without the business unique key
psql -qX -v ON_ERROR_STOP=1 <<SQL >/dev/null
DROP SCHEMA IF EXISTS shop CASCADE;
CREATE EXTENSION IF NOT EXISTS idempotency;
\i $repo/examples/schema.sql
ALTER TABLE shop.payments DROP CONSTRAINT payments_user_id_idempotency_key_key;
SQL
pgver=$(psql -XAtc "SELECT current_setting('server_version') || ', synchronous_commit = ' || current_setting('synchronous_commit')")
extver=$(psql -XAtc "SELECT extversion FROM pg_extension WHERE extname = 'idempotency'")

# ---- redis
rport=$(free_port)
redis-server --bind 127.0.0.1 --port "$rport" --save '' --appendonly no --daemonize no --logfile "$work/redis.log" &
pids+=($!)
redis_pid=$!
wait_for redis redis-cli -h 127.0.0.1 -p "$rport" ping
redisver=$(redis-server --version | sed -n 's/.* v=\([^ ]*\).*/\1/p')

# ---- the five apps
modes=(pg pgc ei ni none)
declare -A port app_pid
dsn="host=$PGHOST port=$PGPORT user=$PGUSER dbname=$PGDATABASE"
for m in "${modes[@]}"; do
	port[$m]=$(free_port)
	node "$work/app/app.js" --mode "$m" --listen "127.0.0.1:${port[$m]}" --dsn "$dsn" \
		--redis "redis://127.0.0.1:$rport" 2>"$work/app-$m.log" &
	pids+=($!)
	app_pid[$m]=$!
done
for m in "${modes[@]}"; do
	wait_for "app $m (see $work/app-$m.log)" curl -sf "http://127.0.0.1:${port[$m]}/health"
done

# ---- CPU time, which a shared machine's load moves far less than req/s:
# the app's, redis-server's and the cluster's (the postmaster and its
# children: the backends, which only the app under load uses), in ms
postmaster=$(psql -XAtc "SELECT pid FROM pg_stat_activity WHERE backend_type = 'checkpointer'")
postmaster=$(awk '/^PPid:/ {print $2}' "/proc/$postmaster/status")
hz=$(getconf CLK_TCK)
cpu_ms() { # cpu_ms PID...: utime + stime (+ waited-for children's) of PIDs, in ms
	local p t=0
	for p in "$@"; do
		[[ -r /proc/$p/stat ]] || continue
		t=$((t + $(sed 's/.*) //' "/proc/$p/stat" | awk '{print $12 + $13 + $14 + $15}')))
	done
	echo $((t * 1000 / hz))
}
pg_cpu_ms() { cpu_ms "$postmaster" $(pgrep -P "$postmaster"); }
# the replays PostgreSQL answered (idempotency.stats; 0 without the library preloaded)
db_replays() { psql -XAtc "SELECT coalesce((SELECT replayed FROM idempotency.stats WHERE datname = current_database()), 0)" 2>/dev/null || echo 0; }

# ---- load: a warm-up of each app (not counted: JIT, pools' connections),
# then the rounds, the order rotated each round
log "load average before: $load_before"
for m in "${modes[@]}"; do
	node "$work/app/load.js" new "http://127.0.0.1:${port[$m]}" "$m-warm" 2 "$conns" "$work/keys-$m-warm" >/dev/null
	node "$work/app/load.js" replay "http://127.0.0.1:${port[$m]}" "$m-warm" 2 "$conns" "$work/keys-$m-warm" >/dev/null
done
for ((r = 1; r <= rounds; r++)); do
	for ((i = 0; i < ${#modes[@]}; i++)); do
		m=${modes[$(((i + r - 1) % ${#modes[@]}))]}
		url=http://127.0.0.1:${port[$m]}
		for phase in new replay; do
			d0=$(db_replays)
			c_app=$(cpu_ms "${app_pid[$m]}") c_redis=$(cpu_ms "$redis_pid") c_pg=$(pg_cpu_ms)
			out=$(node "$work/app/load.js" "$phase" "$url" "$m-r$r" "$seconds" "$conns" "$work/keys-$m-$r")
			c_app=$(($(cpu_ms "${app_pid[$m]}") - c_app)) c_redis=$(($(cpu_ms "$redis_pid") - c_redis)) c_pg=$(($(pg_cpu_ms) - c_pg))
			d1=$(db_replays)
			echo "{\"app\":\"$m\",\"round\":$r,\"db_replays\":$((d1 - d0)),\"cpu_ms\":{\"app\":$c_app,\"redis\":$c_redis,\"pg\":$c_pg},${out#\{}" >>"$raw"
			log "round $r $m $phase: $out"
		done
	done
done

# ---- ten concurrent duplicates, three times each
for m in "${modes[@]}"; do
	for t in 1 2 3; do
		key=dup-$m-$t-$stamp
		out=$(node "$work/app/load.js" dup "http://127.0.0.1:${port[$m]}" "$key" 10)
		rows=$(psql -XAtc "SELECT count(*) FROM shop.payments WHERE idempotency_key = '$key'")
		runs=$(psql -XAtc "SELECT count(*) FROM shop.payment_attempts WHERE idempotency_key = '$key'")
		echo "{\"app\":\"$m\",\"try\":$t,\"payments\":$rows,\"runs\":$runs,${out#\{}" >>"$raw"
		log "dup $m try $t: payments $rows, $out"
	done
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
log "load average after: $load_after"

# ---- the report
{
	echo "node-peers $stamp  git $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo '?')"
	echo "PostgreSQL $pgver; extension $extver; redis-server $redisver; node $(node --version)"
	echo "rounds $rounds x $seconds s per phase, $conns connections; load average before $load_before, after $load_after ($(nproc) cores)"
	echo "$versions"
	echo
	node - "$raw" <<'JS'
const fs = require("fs");
const rows = fs.readFileSync(process.argv[2], "utf8").split("\n").filter(Boolean).map(JSON.parse);
const names = { pg: "pg-idempotency", pgc: "pg-idempotency, replayCache", ei: "express-idempotency + Redis adapter", ni: "@node-idempotency/core + Redis adapter", none: "no idempotency" };
const med = (a) => { const s = [...a].sort((x, y) => x - y); const n = s.length; return n % 2 ? s[(n - 1) / 2] : (s[n / 2 - 1] + s[n / 2]) / 2; };
const fmt = (a, d) => `${med(a).toFixed(d)} (${Math.min(...a).toFixed(d)}–${Math.max(...a).toFixed(d)})`;
const none = rows.filter((r) => r.app === "none" && r.mode === "new").map((r) => r.rps);
// the Redis-first peer of issue 39's goal: @node-idempotency/core with its Redis adapter
const niNew = rows.filter((r) => r.app === "ni" && r.mode === "new").map((r) => r.rps);
const niReplay = rows.filter((r) => r.app === "ni" && r.mode === "replay").map((r) => r.rps);
console.log("| app | new keys: req/s | new: p99 ms | replays: req/s | replays: p99 ms | new req/s / none's | new / @node-idempotency's | replays / @node-idempotency's | 10 concurrent duplicates: payment rows (3 tries) | their answers |");
console.log("|---|---:|---:|---:|---:|---:|---:|---:|---|---|");
const table2 = [];
for (const app of ["pg", "pgc", "ei", "ni", "none"]) {
  const n = rows.filter((r) => r.app === app && r.mode === "new");
  const p = rows.filter((r) => r.app === app && r.mode === "replay");
  const d = rows.filter((r) => r.app === app && r.mode === "dup");
  const ratio = n.map((r, i) => r.rps / none[i]);
  const vsNew = n.map((r, i) => r.rps / niNew[i]);
  const vsReplay = p.map((r, i) => r.rps / niReplay[i]);
  const answers = d.map((r) => Object.entries(r.statuses).map(([s, c]) => `${c}×${s}`).join(" ")).join("; ");
  // CPU per request: the app's + redis-server's + PostgreSQL's, in µs
  const us = (r) => ((r.cpu_ms.app + r.cpu_ms.redis + r.cpu_ms.pg) * 1000) / r.requests;
  const part = (rs, k) => fmt(rs.map((r) => (r.cpu_ms[k] * 1000) / r.requests), 0);
  table2.push(`| ${names[app]} | ${fmt(n.map(us), 0)} | ${part(n, "app")} / ${part(n, "redis")} / ${part(n, "pg")} | ${fmt(p.map(us), 0)} | ${part(p, "app")} / ${part(p, "redis")} / ${part(p, "pg")} | ${app.startsWith("pg") ? p.map((r) => r.db_replays).reduce((a, b) => a + b, 0) + " of " + p.map((r) => r.requests).reduce((a, b) => a + b, 0) : "-"} |`);
  console.log(`| ${names[app]} | ${fmt(n.map((r) => r.rps), 0)} | ${fmt(n.map((r) => r.p99_ms), 1)} | ${fmt(p.map((r) => r.rps), 0)} | ${fmt(p.map((r) => r.p99_ms), 1)} | ${fmt(ratio, 2)} | ${fmt(vsNew, 2)} | ${fmt(vsReplay, 2)} | ${d.map((r) => r.payments).join(", ")} | ${answers} |`);
}
console.log("");
console.log("CPU time per request, µs (app + redis-server + PostgreSQL; the load generator not counted):");
console.log("");
console.log("| app | new keys: CPU µs/request | app / Redis / PostgreSQL | replays: CPU µs/request | app / Redis / PostgreSQL | replays answered by PostgreSQL (idempotency.stats) |");
console.log("|---|---:|---|---:|---|---:|");
for (const line of table2) console.log(line);
// every answer under load is a 201 (a new payment or a replay of one); say so if not
for (const r of rows.filter((r) => r.mode !== "dup"))
  for (const [s, c] of Object.entries(r.statuses)) if (s !== "201") console.log(`note: ${names[r.app]}, round ${r.round}, ${r.mode}: ${c} answers ${s}`);
JS
} | tee "$txt"
log "raw: $raw"
