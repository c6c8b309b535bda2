#!/usr/bin/env bash
# integrations/go/bench/seed.sh -- the seed's payment endpoint on net/http
# four ways, in one run (issue 39): idempotency-go with its replay cache,
# idempotency-go without it, the seed article's three layers Redis first
# (GET of the cached answer, SETNX of the key with a TTL, a records table
# with a unique index, the payment, the answer stored in both), and no
# idempotency (the ceiling for new keys).  bench/app/main.go is the app
# (-mode cache|nocache|redis|none), bench/load/main.go the load generator.
#
#   bash integrations/go/bench/seed.sh [--seconds S] [--rounds R] [--conns C]
#
# As root, on 127.0.0.1 only, against the cluster PGHOST/PGPORT/PGUSER name
# (the extension installed there), else (none named) a throwaway cluster of
# a private copy of PostgreSQL 15 with this tree's extension built and
# installed (scripts/common.sh, as integrations/node/bench/peers.sh; fsync
# and synchronous_commit off).  Debian's Go, pgx, Gin and redigo packages
# and redis-server are installed when missing; its own redis-server runs on
# a free port, --save '' --appendonly no, stopped on exit with the apps.
# Per round (R, default 3) and app, in an order rotated each round: S
# seconds (default 5) of new keys, then S seconds of replays of ONE hot
# completed key (made first, not timed; not for no idempotency), C
# keep-alive connections (default 10).  A warm-up of each app first (not counted).
#
# Honesty checks, printed with the table: every answer under load is a
# 201; every replay answer carries Idempotent-Replayed: true and no new-key
# answer does; each key made one payment, and the payments counted in
# PostgreSQL are the new-key answers plus the hot keys.  The table's
# UNIQUE (user_id, idempotency_key) on shop.payments (the examples' last
# line of defence) is dropped, so that the count is what the idempotency
# layer alone let through.
#
# Writes bench/results/go-seed-TIMESTAMP.{jsonl,txt} and prints the table
# (medians of the rounds, min-max) and the ratios.  Not part of the tests.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../../.." && pwd)
seconds=5 rounds=3 conns=10
while (($#)); do
	case $1 in
	--seconds) seconds=$2; shift 2 ;;
	--rounds) rounds=$2; shift 2 ;;
	--conns) conns=$2; shift 2 ;;
	*) echo "usage: seed.sh [--seconds S] [--rounds R] [--conns C]" >&2; exit 2 ;;
	esac
done
log() { echo "# $*" >&2; }

pkgs=(golang-go golang-github-gin-gonic-gin-dev golang-github-jackc-pgx-v4-dev golang-github-gomodule-redigo-dev redis-server curl)
missing=()
for p in "${pkgs[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
	log "installing ${missing[*]}"
	apt-get update -qq >&2
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >&2
fi

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

work=$(mktemp -d "${TMPDIR:-/tmp}/idempotency-go-seed.XXXXXX")
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
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
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
raw=$repo/bench/results/go-seed-$stamp.jsonl
txt=$repo/bench/results/go-seed-$stamp.txt
: >"$raw"

# ---- the app and the load generator (GOPATH mode, Debian's packages)
log "building bench/app and bench/load"
bash "$repo/integrations/go/build.sh" "$work/app" github.com/idempotency-pg/idempotency-go/bench/app
bash "$repo/integrations/go/build.sh" "$work/load" github.com/idempotency-pg/idempotency-go/bench/load

# ---- the database: the examples' schema, without the business unique key
psql -qX -v ON_ERROR_STOP=1 <<SQL >/dev/null
SET client_min_messages = warning;
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
wait_for redis redis-cli -h 127.0.0.1 -p "$rport" ping
redisver=$(redis-server --version | sed -n 's/.* v=\([^ ]*\).*/\1/p')

# ---- the four apps, one user id each (their payments told apart)
modes=(cache nocache redis none)
declare -A port user
dsn="host=$PGHOST port=$PGPORT user=$PGUSER dbname=$PGDATABASE"
i=0
for m in "${modes[@]}"; do
	i=$((i + 1))
	user[$m]=$i
	port[$m]=$(free_port)
	"$work/app" -mode "$m" -listen "127.0.0.1:${port[$m]}" -dsn "$dsn" -redis "127.0.0.1:$rport" 2>"$work/app-$m.log" &
	pids+=($!)
done
for m in "${modes[@]}"; do
	wait_for "app $m (see $work/app-$m.log)" curl -sf "http://127.0.0.1:${port[$m]}/health"
done

# load APP ROUND PHASE [SECONDS]: one run, its JSON line appended to $raw
load() {
	local m=$1 r=$2 phase=$3 s=${4:-$seconds} out args
	args=(-url "http://127.0.0.1:${port[$m]}" -user "${user[$m]}" -seconds "$s" -conns "$conns")
	case $phase in
	*new) args+=(-phase new -prefix "$m-r$r-$stamp") ;;
	*replay) args+=(-phase replay -key "hot-$m-r$r-$stamp") ;;
	esac
	out=$("$work/load" "${args[@]}")
	echo "{\"app\":\"$m\",\"round\":\"$r\",\"run\":\"$phase\",${out#\{}" >>"$raw"
	log "round $r $m $phase: $out"
}

load_before=$(cut -d' ' -f1-3 /proc/loadavg)
log "load average before: $load_before"
for m in "${modes[@]}"; do
	load "$m" warm warm-new 2
	[[ $m == none ]] || load "$m" warm warm-replay 2
done
for ((r = 1; r <= rounds; r++)); do
	for ((i = 0; i < ${#modes[@]}; i++)); do
		m=${modes[$(((i + r - 1) % ${#modes[@]}))]}
		load "$m" "$r" new
		[[ $m == none ]] || load "$m" "$r" replay # none: nothing to replay
	done
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
log "load average after: $load_after"

# ---- payments per app: made per key, and in all
for m in "${modes[@]}"; do
	psql -XAt -F ' ' -c "SELECT '$m', count(*), count(DISTINCT idempotency_key),
	                            count(*) FILTER (WHERE idempotency_key LIKE 'hot-%')
	                       FROM shop.payments WHERE user_id = ${user[$m]}"
done >"$work/payments"

# ---- the report
{
	echo "go-seed $stamp  git $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo '?')"
	echo "PostgreSQL $pgver; extension $extver; redis-server $redisver; $(go version | cut -d' ' -f3-4)"
	echo "rounds $rounds x $seconds s per phase, $conns connections; load average before $load_before, after $load_after ($(nproc) cores)"
	echo
	python3 - "$raw" "$work/payments" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
pay = {l.split()[0]: list(map(int, l.split()[1:])) for l in open(sys.argv[2]) if l.strip()}
names = {"cache": "idempotency-go, replay cache", "nocache": "idempotency-go, no cache",
         "redis": "seed: Redis SETNX + records table", "none": "no idempotency"}
def runs(app, phase):
    return [r for r in rows if r["app"] == app and r["run"] == phase]
def fmt(a, d=0):
    return f"{statistics.median(a):.{d}f} ({min(a):.{d}f}–{max(a):.{d}f})"
print("| app | new keys: req/s | new: p99 ms | replays of one key: req/s | replays: p99 ms |")
print("|---|---:|---:|---:|---:|")
for app in names:
    n, p = runs(app, "new"), runs(app, "replay")
    print(f"| {names[app]} | {fmt([r['rps'] for r in n])} | {fmt([r['p99_ms'] for r in n], 1)} | "
          + (f"{fmt([r['rps'] for r in p])} | {fmt([r['p99_ms'] for r in p], 1)} |" if app != "none" else "(no replays) | |"))
def ratio(a, b, phase):
    # per round, the two apps' figures of that round
    x = {r["round"]: r["rps"] for r in runs(a, phase)}
    y = {r["round"]: r["rps"] for r in runs(b, phase)}
    return [x[k] / y[k] for k in sorted(x) if k in y]
print()
for label, a, b, phase in [
        ("replays: cache / redis (goal >= 1.0)", "cache", "redis", "replay"),
        ("replays: no cache / redis", "nocache", "redis", "replay"),
        ("new keys: cache / redis (goal > 1.0)", "cache", "redis", "new"),
        ("new keys: no cache / redis (goal > 1.0)", "nocache", "redis", "new"),
        ("new keys: cache / none", "cache", "none", "new"),
        ("new keys: redis / none", "redis", "none", "new")]:
    rs = ratio(a, b, phase)
    print(f"- {label}: median {statistics.median(rs):.2f} (rounds: {', '.join(f'{v:.2f}' for v in rs)})")
print()
# honesty
bad = []
for r in rows:
    st = r["statuses"]
    if set(st) != {"201"}:
        bad.append(f"{r['app']} {r['round']} {r['run']}: answers {st}")
    if r["run"].endswith("replay") and r["app"] != "none" and r["replayed"] != r["requests"]:
        bad.append(f"{r['app']} {r['round']} {r['run']}: {r['replayed']} of {r['requests']} replay answers marked replayed")
    if r["run"].endswith("new") and r["replayed"] != 0:
        bad.append(f"{r['app']} {r['round']} {r['run']}: {r['replayed']} new-key answers marked replayed")
for app in names:
    total, keys, hot = pay[app]
    want = sum(r["statuses"].get("201", 0) for r in rows if r["app"] == app and r["run"].endswith("new"))
    nrep = len([r for r in rows if r["app"] == app and r["run"].endswith("replay")])
    want += nrep
    if total != keys or total != want or hot != nrep:
        bad.append(f"{names[app]}: {total} payments for {keys} keys ({hot} for {nrep} hot keys); {want} expected")
    else:
        print(f"- {names[app]}: {total} payments for {keys} keys, one each ({nrep} hot keys, one payment each)")
print("- honesty checks: " + ("all hold (every answer 201, replays marked replayed, new keys not)" if not bad else "FAILED"))
for b in bad:
    print("  - " + b)
PY
} | tee "$txt"
log "raw: $raw"
