#!/usr/bin/env bash
# bench/filter_build_load.sh -- does the busiest partition get its
# known-absent filter while clients hold claim transactions open?
#
# A throwaway PostgreSQL 15 cluster (a private copy of the host's, with the
# extension built from SRC, default this tree), CLIENTS pgbench clients each
# claiming a new key and holding the transaction open 0.5 to 1.5 times HOLD
# seconds (so that they do not end together), and RUNS calls
# of idem_maintain() one second apart, as pg_cron would make them a minute
# apart.  The filters are dropped first; after each run it prints the state
# of the filter of the partition that the claims go to, and at the end how
# many runs left it READY and after which run it first was.
#
#   bash bench/filter_build_load.sh [--src DIR] [--clients N] [--hold S] [--runs N]
#                                                         (as root, Debian 12)
# Before issue 24's fix (a build that could not wait for every inserter
# within maintenance_lock_timeout gave the partition up):
#   git worktree add /tmp/base 5ece213
#   bash bench/filter_build_load.sh --src /tmp/base
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=bench/private_pg.sh
source "$here/private_pg.sh"

src=$(cd "$here/.." && pwd)
clients=16
hold=1
runs=10
while (($# > 0)); do
	case $1 in
		--src) src=$(cd "$2" && pwd); shift 2 ;;
		--clients) clients=$2; shift 2 ;;
		--hold) hold=$2; shift 2 ;;
		--runs) runs=$2; shift 2 ;;
		*) echo "usage: $0 [--src DIR] [--clients N] [--hold S] [--runs N]" >&2; exit 2 ;;
	esac
done

work=$(mktemp -d /tmp/idem-fbl.XXXXXX)
chmod 755 "$work"
prefix=$work/pg
bin=$prefix/lib/postgresql/15/bin
cleanup() {
	[[ -f $work/data/postmaster.pid ]] &&
		runuser -u postgres -- "$bin/pg_ctl" stop -D "$work/data" -m immediate >/dev/null 2>&1
	rm -rf "$work"
}
trap cleanup EXIT

private_pg_make "$prefix"
private_pg_install "$prefix" "$src"
mkdir "$work/data" "$work/sock" "$work/run"
chown postgres "$work/data" "$work/sock" "$work/run"
runuser -u postgres -- "$bin/initdb" -D "$work/data" -A trust -U postgres >/dev/null
port=$((20000 + RANDOM % 10000))
cat >>"$work/data/postgresql.conf" <<EOF
listen_addresses = ''
unix_socket_directories = '$work/sock'
port = $port
max_connections = $((clients + 10))
shared_preload_libraries = 'idempotency'
idempotency.build_filters_at_start = off
synchronous_commit = off
EOF
runuser -u postgres -- "$bin/pg_ctl" start -w -D "$work/data" -l "$work/run/log" >/dev/null ||
	{ cat "$work/run/log" >&2; exit 1; }
psql=("$bin/psql" -X -q -At -h "$work/sock" -p "$port" -U postgres -d postgres)
"${psql[@]}" -c 'CREATE EXTENSION idempotency'
# every filter of the database goes with the trigger's DISABLE and ENABLE
"${psql[@]}" -c 'ALTER TABLE idempotency.records DISABLE TRIGGER zz_records_filter' \
	-c 'ALTER TABLE idempotency.records ENABLE ALWAYS TRIGGER zz_records_filter'

cat >"$work/claim.sql" <<EOF
\set k random(1, 2000000000)
\set ms random(500 * $hold, 1500 * $hold)
BEGIN;
SELECT outcome FROM idempotency.idem_acquire('fbl-' || :k || '-' || :client_id);
SELECT pg_catalog.pg_sleep(:ms / 1000.0);
COMMIT;
EOF
chown postgres "$work/claim.sql"
duration=$((runs + 3 + 2 * ${hold%.*} + 2))
runuser -u postgres -- "$bin/pgbench" -n -h "$work/sock" -p "$port" -U postgres \
	-c "$clients" -T "$duration" -f "$work/claim.sql" postgres >"$work/pgbench.out" 2>&1 &
load=$!
sleep $((2 + ${hold%.*}))

# the partition that claims with the default ttl go to
state_sql="SELECT COALESCE(max(f.state), 'none') FROM idempotency.partitions p
  LEFT JOIN idempotency.idem_filters() f ON f.partition = p.partition
 WHERE NOT p.is_default
   AND now() + current_setting('idempotency.default_ttl')::interval >= p.range_start
   AND now() + current_setting('idempotency.default_ttl')::interval < p.range_end"
ready=0
first=
for ((i = 1; i <= runs; i++)); do
	"${psql[@]}" -c 'SELECT * FROM idempotency.idem_maintain()' 2>&1 | grep -E "not built|still running" | sed "s/^/  /" || true
	state=$("${psql[@]}" -c "$state_sql")
	echo "run $i: $state"
	if [[ $state == ready ]]; then
		ready=$((ready + 1))
		[[ -n $first ]] || first=$i
	fi
	sleep 1
done
wait "$load" || true
tps=$(sed -nE 's/^tps = ([0-9.]+).*/\1/p' "$work/pgbench.out" | head -n 1)
echo "src $src: $clients clients holding claims ${hold}s ($tps claims/s), maintenance_lock_timeout $("${psql[@]}" -c 'SHOW idempotency.maintenance_lock_timeout')"
echo "READY after $ready of $runs maintenance runs; first after run ${first:-none}"
