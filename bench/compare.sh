#!/usr/bin/env bash
# bench/compare.sh -- A/B benchmark of two git revisions of the extension,
# or of one revision without and with its statistics, on this machine, on
# one throwaway cluster
#
#   bash bench/compare.sh [options] REV_A REV_B   A = REV_A, B = REV_B
#   bash bench/compare.sh --stats [options] REV   A = REV with
#       shared_preload_libraries = 'pg_cron' (the extension counts nothing),
#       B = the same build with 'pg_cron,idempotency' (statistics kept)
#
# Builds the revisions from `git archive` copies and installs each into a
# private copy of the host's PostgreSQL 15 (bench/private_pg.sh, in a
# temporary folder: the host's installation is not touched, so no lock is
# needed and other runs may go on), starts a cluster of its own
# (scripts/common.sh) with the settings of bench/run.sh, and then, for each
# of --rounds rounds, runs both sides one after the other, in alternating
# order (A,B then B,A ...) so that a drift of the machine's load does not
# always favour the same one.  For each side in a round it
#
#   - checks that the side's installed .so and SQL script are its build's,
#   - restarts the cluster with the side's binaries and
#     shared_preload_libraries (both sides preload 'pg_cron,idempotency',
#     as scripts/common.sh does, unless --stats), so that new backends load
#     the side's .so, and checks with idem_stats_enabled() (1.1) that the
#     statistics are kept where they should be and only there,
#   - creates fresh databases with CREATE EXTENSION (so that revision's SQL
#     script applies): cmp_daily (default idempotency.partition_interval,
#     1 day) with --replay-records completed records (bench/load_records.sql,
#     expiring over the next --spread), and cmp_hourly (ALTER DATABASE ... SET
#     idempotency.partition_interval = '1h' before CREATE EXTENSION; with the
#     default max_ttl of 7 days that is about 170 partitions),
#   - builds the known-absent filters (idempotency.build_filters()), where
#     the revision has them and the library is preloaded,
#   - counts the relation locks a transaction holds at its business INSERT
#     (after idem_acquire of a new key), and how many are fast-path,
#   - runs the cases (--cases), `pgbench -n -M prepared -h 127.0.0.1 -c C
#     -j min(C,2) -T S -l`, at each client count of --clients, with a
#     CHECKPOINT before each:
#
#   ext_new         cmp_daily: BEGIN; idem_acquire new key; idem_complete; COMMIT
#   ext_new_biz_1d  cmp_daily: BEGIN; idem_acquire new key; INSERT INTO
#                   bench.orders (bigserial PK + 2 indexes); idem_complete; COMMIT
#   ext_new_biz_1h  the same on cmp_hourly
#   ext_replay      cmp_daily: idem_acquire of a random one of the prefilled
#                   completed records (the script fails unless it replays)
#
# The bench files (cases, SQL) are this checkout's, for both revisions; only
# the extension's build differs.  Honesty checks for every run of a case: no
# failed or aborted transaction, a per-transaction log line for every
# transaction, the new-key cases added exactly one completed record per
# transaction (and ext_new_biz one order), ext_replay added none.
#
# The report gives per case the median TPS and median p99 latency (from the
# per-transaction logs) of A and B over the rounds, the ratio B/A of the
# medians and the per-round ratios, and all per-round values; it is printed
# and written to bench/results/compare-<UTC time>.md.  Exit status 1 if any
# check failed.
#
#   bash bench/compare.sh [--stats] [--rounds N] [--duration S]
#                         [--clients C[,C...]] [--cases CASE[,CASE...]]
#                         [--replay-records N] [--spread INTERVAL]
#                         REV_A REV_B | REV
#
# --spread: the window over which the replay records expire, as in
# bench/run.sh: '1 day' (the default) puts them in two daily partitions,
# '6 days' (issue 13's mixed ttls) in seven.
#
# Defaults: 5 rounds, 10 s a case, 200,000 replay records; two revisions:
# all four cases at 8 clients, about 45 s a side a round (4 cases of 10 s,
# restart, set-up), so 8 minutes; --stats: ext_new and ext_replay at 2 and
# at 8 clients, about 50 s a side a round, 9 minutes.  Per-round ratios on
# this 2-CPU machine move by several per cent: a difference of 2 % needs
# more rounds than the default, or instruction counts (bench/callgrind.sh
# --stats both).
#
# as root on Debian 12.
set -euo pipefail

BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=scripts/common.sh
source "$BENCH_DIR/../scripts/common.sh"

ROUNDS=5
DURATION=10
CLIENTS=
CASE_LIST=
STATS_MODE=0
REPLAY_RECORDS=200000
SPREAD='1 day'
REQ='{"amount_cents": 2000, "currency": "EUR", "order": "A-1001"}'
RESP='{"payment_id": 7, "status": "succeeded", "amount_cents": 2000}'
ALL_CASES=(ext_new ext_new_biz_1d ext_new_biz_1h ext_replay)

usage() {
	sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
	exit "${1:-0}"
}

ARGS=("$@")
REVS=()
while (($#)); do
	case $1 in
	--rounds) ROUNDS=${2:?}; shift 2 ;;
	--duration) DURATION=${2:?}; shift 2 ;;
	--clients) CLIENTS=${2:?}; shift 2 ;;
	--cases) CASE_LIST=${2:?}; shift 2 ;;
	--stats) STATS_MODE=1; shift ;;
	--replay-records) REPLAY_RECORDS=${2:?}; shift 2 ;;
	--spread) SPREAD=${2:?}; shift 2 ;;
	-h | --help) usage 0 ;;
	-*) echo "unknown option: $1" >&2; usage 2 ;;
	*) REVS+=("$1"); shift ;;
	esac
done
if ((STATS_MODE)); then
	((${#REVS[@]} == 1)) || { echo "--stats takes one revision" >&2; usage 2; }
	REVS+=("${REVS[0]}")
	: "${CLIENTS:=2,8}" "${CASE_LIST:=ext_new,ext_replay}"
else
	((${#REVS[@]} == 2)) || { echo "two revisions, please: REV_A REV_B" >&2; usage 2; }
	: "${CLIENTS:=8}" "${CASE_LIST:=${ALL_CASES[*]}}"
fi
[[ $ROUNDS =~ ^[0-9]+$ && $ROUNDS -ge 1 ]] || die "--rounds takes a positive number"
[[ $DURATION =~ ^[0-9]+$ && $DURATION -ge 1 ]] || die "--duration takes whole seconds"
[[ $CLIENTS =~ ^[0-9]+(,[0-9]+)*$ && ! ,$CLIENTS, =~ ,0, ]] || die "--clients takes positive numbers, comma-separated"
[[ $REPLAY_RECORDS =~ ^[0-9]+$ && $REPLAY_RECORDS -ge 1 ]] || die "--replay-records takes a positive number"
[[ $SPREAD =~ ^[0-9]+\ (hour|hours|day|days)$ ]] || die "--spread takes an interval such as '1 day' or '6 days'"
IFS=', ' read -r -a CLIENT_COUNTS <<<"$CLIENTS"
IFS=', ' read -r -a CASE_NAMES <<<"$CASE_LIST"
for c in "${CASE_NAMES[@]}"; do
	[[ " ${ALL_CASES[*]} " == *" $c "* ]] || die "unknown case: $c (the cases: ${ALL_CASES[*]})"
done
# the runs of a side, in order: CASE@CLIENTS
CASES=()
for n in "${CLIENT_COUNTS[@]}"; do
	for c in "${ALL_CASES[@]}"; do
		[[ " ${CASE_NAMES[*]} " == *" $c "* ]] && CASES+=("$c@$n")
	done
done
NEED_HOURLY=0
[[ " ${CASE_NAMES[*]} " == *" ext_new_biz_1h "* ]] && NEED_HOURLY=1

# Both revisions as commits of this repository (any checkout of it); with
# --stats the same one twice, which differ in what they preload.
declare -A SHA DESC PRELOAD
for i in 0 1; do
	side=$([[ $i == 0 ]] && echo A || echo B)
	SHA[$side]=$(git -C "$REPO_ROOT" rev-parse --verify --quiet "${REVS[$i]}^{commit}") ||
		die "not a revision of this repository: ${REVS[$i]}"
	DESC[$side]=$(git -C "$REPO_ROOT" log --oneline --no-decorate -1 "${SHA[$side]}")
	PRELOAD[$side]='pg_cron,idempotency'
done
if ((STATS_MODE)); then
	PRELOAD[A]='pg_cron'
	DESC[A]="${DESC[A]} — statistics off (shared_preload_libraries = 'pg_cron')"
	DESC[B]="${DESC[B]} — statistics on (shared_preload_libraries = 'pg_cron,idempotency')"
fi

RESULTS_DIR=$BENCH_DIR/results
mkdir -p "$RESULTS_DIR"
T0=$EPOCHREALTIME
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
STAMP=$(date -u +%Y-%m-%dT%H:%M:%SZ)
COMMAND="bash bench/compare.sh${ARGS[*]:+ ${ARGS[*]}}"
BENCH_HEAD=$(git -C "$REPO_ROOT" log --oneline --no-decorate -1 2>/dev/null || echo "?")

IDEM_QUIET=1
install_deps
# shellcheck source=bench/private_pg.sh
source "$BENCH_DIR/private_pg.sh"

# The private PostgreSQL copies and builds live outside the cluster's folder
# (they exist before it); removed at exit, before scripts/common.sh's own
# clean-up.
PRIV=$(mktemp -d /tmp/idem-compare.XXXXXX)
chmod 755 "$PRIV"
_compare_on_exit() {
	local status=$?
	rm -rf "$PRIV"
	(exit "$status")
	_idem_on_exit
}
trap 'rm -rf "$PRIV"' EXIT

# ---------------------------------------------------------------------------
# build both sides: a private PostgreSQL 15 each (one for --stats), the
# revision's `git archive` copy built and installed into it
# ---------------------------------------------------------------------------
declare -A PREFIX
for side in A B; do
	if ((STATS_MODE)) && [[ $side == B ]]; then
		PREFIX[B]=${PREFIX[A]}
		continue
	fi
	PREFIX[$side]=$PRIV/pg-$side
	log "building $side: ${DESC[$side]}"
	private_pg_make "${PREFIX[$side]}"
	mkdir -p "$PRIV/src-$side"
	git -C "$REPO_ROOT" archive --format=tar "${SHA[$side]}" | tar -x -C "$PRIV/src-$side"
	run_step "make install ($side)" private_pg_install "${PREFIX[$side]}" "$PRIV/src-$side"
done
((STATS_MODE)) && ln -s "$PRIV/src-A" "$PRIV/src-B"
side_bindir() { echo "${PREFIX[$1]}/lib/postgresql/15/bin"; }

# The cluster runs A's binaries first (scripts/common.sh takes PG_BINDIR);
# every side's turn restarts it with that side's.
PG_BINDIR=$(side_bindir A)
PG_CONFIG=$PG_BINDIR/pg_config
# shellcheck disable=SC2119
start_cluster
# start_cluster set its own exit trap; this one runs it after removing $PRIV
trap _compare_on_exit EXIT

# bench/run.sh's benchmark settings; the first install's restart applies them
as_postgres tee -a "$IDEM_PGDATA/postgresql.conf" >/dev/null <<EOF

# bench/compare.sh (as bench/run.sh)
include_if_exists = 'compare_side.conf'
shared_buffers = 1GB
synchronous_commit = off
fsync = on
full_page_writes = on
max_connections = 100
max_wal_size = 20GB
min_wal_size = 2GB
checkpoint_timeout = 1h
autovacuum = off
max_locks_per_transaction = 128
EOF

# Everything of this run lives in the cluster's temporary folder, which the
# exit trap of scripts/common.sh removes.
WORK=$IDEM_TMPDIR/compare
mkdir -p "$WORK/log"
RESULTS=$WORK/results.tsv
LOCKS=$WORK/locks.tsv
: >"$RESULTS"
: >"$LOCKS"
PROBLEMS=()

psql_on() {
	local db=$1
	shift
	"$PG_BINDIR/psql" -X -q -A -t -v ON_ERROR_STOP=1 -h 127.0.0.1 -d "$db" "$@"
}

# installed_is SIDE: true if the .so and SQL script in SIDE's private
# PostgreSQL are SIDE's build.
installed_is() {
	local src=$PRIV/src-$1 prefix=${PREFIX[$1]}
	cmp -s "$src/idempotency.so" "$prefix/lib/postgresql/15/lib/idempotency.so" &&
		cmp -s "$src/idempotency--1.0.sql" "$prefix/share/postgresql/15/extension/idempotency--1.0.sql"
}

# stats_state DB: what the extension in DB says of its statistics
stats_state() {
	psql_on "$1" -c "SELECT CASE WHEN to_regprocedure('idempotency.idem_stats_enabled()') IS NULL
		THEN 'none' WHEN idempotency.idem_stats_enabled() THEN 'on' ELSE 'off' END"
}

# counts DB: "records|completed records|orders"
counts() {
	psql_on "$1" -c "SELECT (SELECT count(*) FROM idempotency.records),
	                        (SELECT count(*) FROM idempotency.records WHERE status = 'completed'),
	                        (SELECT count(*) FROM bench.orders)"
}

# lock_census DB: "relations locked|of them fast-path|order locks in the
# shared lock table|order locks" held by a transaction right after
# idem_acquire of a new key and an INSERT into bench.orders (rolled back).
# Only idempotency.* and bench.* count, not the catalogs the query itself
# locks.  The order's lasting locks are two (bench.orders and its sequence):
# the INSERT takes and releases its three index locks within the statement.
lock_census() {
	psql_on "$1" -v req="$REQ" <<-'EOF'
		\o /dev/null
		BEGIN;
		SELECT * FROM idempotency.idem_acquire('lock-census', :'req'::jsonb);
		INSERT INTO bench.orders (key, amount) VALUES ('lock-census', 1);
		\o
		SELECT count(DISTINCT l.relation),
		       count(DISTINCT l.relation) FILTER (WHERE l.fastpath),
		       count(*) FILTER (WHERE NOT l.fastpath AND n.nspname = 'bench'),
		       count(*) FILTER (WHERE n.nspname = 'bench')
		  FROM pg_locks l
		  JOIN pg_class c ON c.oid = l.relation
		  JOIN pg_namespace n ON n.oid = c.relnamespace
		 WHERE l.pid = pg_backend_pid() AND l.locktype = 'relation'
		   AND n.nspname IN ('idempotency', 'bench');
		ROLLBACK;
	EOF
}

# run_case SIDE ROUND CASE@CLIENTS DB [pgbench -D assignments...]
# Appends to $RESULTS: side round case@clients tps p99_us tx failed check note
run_case() {
	local side=$1 round=$2 run=$3 db=$4
	shift 4
	local case=${run%@*} clients=${run##*@}
	local label=r$round-$side-$case-c$clients script out rc=0 tps tx failed p99 nlog
	local before after check=ok note="" jobs
	jobs=$((clients < 2 ? clients : 2))
	script=${case%_1[dh]}
	out=$WORK/log/$label.out

	psql_on "$db" -c "CHECKPOINT"
	before=$(counts "$db")
	"$PG_BINDIR/pgbench" -n -M prepared -h 127.0.0.1 -c "$clients" -j "$jobs" -T "$DURATION" \
		-l --log-prefix="$WORK/log/$label" \
		-D n=0 -D "kp=$label-" -D "req=$REQ" -D "resp=$RESP" "$@" \
		-f "$BENCH_DIR/cases/$script.pgbench" "$db" >"$out" 2>&1 || rc=$?
	after=$(counts "$db")

	tps=$(sed -n 's/^tps = \([0-9.]*\) (without initial connection time)$/\1/p' "$out")
	tx=$(sed -n 's/^number of transactions actually processed: \([0-9]*\).*/\1/p' "$out")
	failed=$(sed -n 's/^number of failed transactions: \([0-9]*\).*/\1/p' "$out")
	: "${tps:=0}" "${tx:=0}" "${failed:=0}"

	# p99 latency (µs): the third field of every per-transaction log line
	read -r p99 nlog < <(cat "$WORK/log/$label".[0-9]* 2>/dev/null |
		awk '$3 ~ /^[0-9]+$/ { print $3 }' | sort -n |
		awk '{ a[NR] = $1 } END {
			if (NR == 0) { print "0 0"; exit }
			k = int(NR * 0.99); if (k < NR * 0.99) k++
			print a[k], NR }')
	rm -f "$WORK/log/$label".[0-9]*

	if ((rc != 0)) || grep -qi 'aborted\|error' "$out"; then
		check=FAIL
		note="pgbench exit $rc: $(grep -m 3 -i 'error\|aborted' "$out" | tr '\n\t' '  ' | cut -c 1-300);"
	fi
	((failed == 0)) || { check=FAIL; note="$note $failed failed transactions;"; }
	((tx > 0)) || { check=FAIL; note="$note no transaction;"; }
	((nlog == tx)) || { check=FAIL; note="$note per-transaction log has $nlog lines for $tx transactions;"; }

	local r0 c0 o0 r1 c1 o1 added completed orders
	IFS='|' read -r r0 c0 o0 <<<"$before"
	IFS='|' read -r r1 c1 o1 <<<"$after"
	added=$((r1 - r0)) completed=$((c1 - c0)) orders=$((o1 - o0))
	case $case in
	ext_new_biz_*)
		if ((added != tx || completed != tx || orders != tx)); then
			check=FAIL
			note="$note records added $added, completed $completed, orders $orders, transactions $tx;"
		fi
		;;
	ext_new)
		if ((added != tx || completed != tx)); then
			check=FAIL
			note="$note records added $added, completed $completed, transactions $tx;"
		fi
		;;
	ext_replay)
		if ((added != 0)); then
			check=FAIL
			note="$note $added records added by replays;"
		fi
		;;
	esac
	note=${note# }
	[[ $check == ok ]] || PROBLEMS+=("round $round, $side, $case, $clients clients: $note")
	printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' \
		"$side" "$round" "$run" "$tps" "$p99" "$tx" "$failed" "$check" "$note" >>"$RESULTS"
	printf '    %-18s %6.0f tps  p99 %6.3f ms  %s\n' "$run" "$tps" \
		"$(awk "BEGIN{print $p99/1000}")" "$check${note:+ ($note)}"
}

# run_side SIDE ROUND: install SIDE's build, restart, set up, run the cases.
run_side() {
	local side=$1 round=$2 db census parts
	local dbs=(cmp_daily) run state want
	((NEED_HOURLY)) && dbs+=(cmp_hourly)
	log "round $round/$ROUNDS, $side (${DESC[$side]})"
	installed_is "$side" || die "the extension in $side's private PostgreSQL is not $side's build"
	PG_BINDIR=$(side_bindir "$side")
	# The filters are built below once the records are in: a startup build
	# (the worker of revisions that have one) would hold the databases
	# dropped right after this restart.  Only where the library is
	# preloaded, which is where the setting exists.
	{
		echo "shared_preload_libraries = '${PRELOAD[$side]}'"
		if [[ ${PRELOAD[$side]} == *idempotency* ]]; then
			echo "idempotency.build_filters_at_start = off"
		fi
	} | as_postgres tee "$IDEM_PGDATA/compare_side.conf" >/dev/null
	# -p: pg_ctl restart would otherwise start the binary of the last start
	as_postgres "$PG_BINDIR/pg_ctl" restart -D "$IDEM_PGDATA" -m fast -w -t 120 \
		-p "$PG_BINDIR/postgres" -l "$IDEM_SERVER_LOG" >/dev/null || die "the server did not restart"

	psql_on postgres <<-'EOF'
		SET client_min_messages = warning;
		DROP DATABASE IF EXISTS cmp_daily;
		DROP DATABASE IF EXISTS cmp_hourly;
	EOF
	for db in "${dbs[@]}"; do
		psql_on postgres -c "CREATE DATABASE $db"
	done
	((NEED_HOURLY)) && psql_on postgres -c "ALTER DATABASE cmp_hourly SET idempotency.partition_interval = '1h'"
	for db in "${dbs[@]}"; do
		psql_on "$db" -f "$BENCH_DIR/compare_setup.sql"
	done
	psql_on cmp_daily -v from=1 -v to="$REPLAY_RECORDS" -v req="$REQ" -v resp="$RESP" \
		-v spread="$SPREAD" -f "$BENCH_DIR/load_records.sql"
	psql_on cmp_daily -c "VACUUM ANALYZE idempotency.records"
	# the known-absent filters, where the build has them and the library is
	# preloaded: built once the records are in, as idem_maintain() would
	for db in "${dbs[@]}"; do
		psql_on "$db" <<-'EOF'
			SET client_min_messages = warning;
			DO $$
			BEGIN
			    IF pg_catalog.to_regprocedure('idempotency.build_filters(interval)') IS NOT NULL THEN
			        PERFORM idempotency.build_filters();
			    END IF;
			EXCEPTION WHEN object_not_in_prerequisite_state THEN
			    NULL;	-- not preloaded: no filters
			END
			$$;
		EOF
	done

	# the server must run this side's build, and keep statistics only where
	# this side says so
	if [[ $(psql_on postgres -c "SHOW shared_preload_libraries") != "${PRELOAD[$side]}" ]]; then
		die "round $round, $side: the server did not take shared_preload_libraries = '${PRELOAD[$side]}'"
	fi
	state=$(stats_state cmp_daily)
	if ((STATS_MODE)); then
		want=$([[ $side == A ]] && echo off || echo on)
		[[ $state == "$want" ]] || die "round $round, $side: statistics $state, expected $want"
	fi
	STATS_SEEN[$side]=$state

	for db in "${dbs[@]}"; do
		parts=$(psql_on "$db" -c "SELECT count(*) FROM idempotency.partitions WHERE NOT is_default")
		census=$(lock_census "$db")
		printf '%s\t%s\t%s\t%s\t%s\n' "$side" "$round" "$db" "$parts" "${census//|/$'\t'}" >>"$LOCKS"
	done

	for run in "${CASES[@]}"; do
		case ${run%@*} in
		ext_new | ext_new_biz_1d) run_case "$side" "$round" "$run" cmp_daily ;;
		ext_new_biz_1h) run_case "$side" "$round" "$run" cmp_hourly ;;
		ext_replay) run_case "$side" "$round" "$run" cmp_daily -D rp=m -D "nrep=$REPLAY_RECORDS" ;;
		esac
	done

	if ! installed_is "$side"; then
		PROBLEMS+=("round $round, $side: the extension in the private PostgreSQL changed during the cases")
	fi
}

declare -A STATS_SEEN

ORDERS=()
for round in $(seq 1 "$ROUNDS"); do
	if ((round % 2)); then order=(A B); else order=(B A); fi
	ORDERS+=("${order[0]},${order[1]}")
	for side in "${order[@]}"; do
		run_side "$side" "$round"
	done
done

RUN_SECS=$(awk "BEGIN{printf \"%.0f\", $EPOCHREALTIME - $T0}")
LOAD_END=$(cut -d' ' -f1-3 /proc/loadavg)
PG_VERSION=$(psql_on postgres -c "SELECT version()")
SETTINGS=$(psql_on postgres -c "SELECT string_agg(name || ' = ' || current_setting(name), ', ' ORDER BY name)
	FROM pg_settings WHERE name IN ('shared_buffers', 'synchronous_commit', 'fsync', 'full_page_writes',
	'max_wal_size', 'checkpoint_timeout', 'autovacuum', 'max_connections', 'max_locks_per_transaction')")
CPU_MODEL=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)
MEM_TOTAL=$(awk '/^MemTotal/ { printf "%.1f GiB", $2 / 1048576 }' /proc/meminfo)

# ---------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------
report() {
	if ((STATS_MODE)); then
		echo "# A/B: statistics off → on, ${SHA[A]:0:7}"
	else
		echo "# A/B: ${SHA[A]:0:7} → ${SHA[B]:0:7}"
	fi
	echo
	echo "- A: \`${DESC[A]}\`; shared_preload_libraries = '${PRELOAD[A]}', statistics (idem_stats_enabled): ${STATS_SEEN[A]}"
	echo "- B: \`${DESC[B]}\`; shared_preload_libraries = '${PRELOAD[B]}', statistics (idem_stats_enabled): ${STATS_SEEN[B]}"
	echo "- date: $STAMP; command: \`$COMMAND\`; run time ${RUN_SECS}s"
	echo "- bench files from \`$BENCH_HEAD\`"
	echo "- machine: $(nproc) CPUs ($CPU_MODEL), $MEM_TOTAL memory, $(uname -r);" \
		"load average (1, 5, 15 min) before: $LOAD_START, after: $LOAD_END"
	echo "- PostgreSQL: $PG_VERSION"
	echo "- pgbench: \`pgbench -n -M prepared -h 127.0.0.1 -c C -j min(C,2) -T $DURATION -l\`, C = ${CLIENT_COUNTS[*]}; p99 from the per-transaction log (every transaction)"
	echo "- server: $SETTINGS; CHECKPOINT before every case; restarted with the side's binaries (a private copy of PostgreSQL 15 each) and preload at every turn"
	echo "- $ROUNDS rounds, order per round: ${ORDERS[*]}; fresh databases each time (cmp_daily: 1 d partitions," \
		"$REPLAY_RECORDS completed records expiring over the next $SPREAD$( ((NEED_HOURLY)) && echo "; cmp_hourly: 1 h partitions" || true))"
	echo
	echo "## Medians over the rounds"
	echo
	awk -F'\t' -v cases="${CASES[*]}" '
		function median(s,   v, n, i, j, t) {
			n = split(s, v, " ")
			for (i = 2; i <= n; i++) { t = v[i]; for (j = i - 1; j >= 1 && v[j] + 0 > t + 0; j--) v[j + 1] = v[j]; v[j + 1] = t }
			if (n == 0) return 0
			return (n % 2) ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2
		}
		function minmax(s,   v, n, i, lo, hi) {
			n = split(s, v, " "); lo = hi = v[1]
			for (i = 2; i <= n; i++) { if (v[i] + 0 < lo + 0) lo = v[i]; if (v[i] + 0 > hi + 0) hi = v[i] }
			return sprintf("%.2f–%.2f", lo, hi)
		}
		{ tps[$1, $3, $2] = $4; p99[$1, $3, $2] = $5; if ($2 > rounds) rounds = $2 }
		END {
			print "| case | clients | A TPS | B TPS | B/A TPS | B/A per round: median (min–max) | rounds B faster | A p99 ms | B p99 ms | B/A p99 |"
			print "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
			nc = split(cases, cs, " ")
			for (k = 1; k <= nc; k++) {
				c = cs[k]; ta = tb = pa = pb = rr = ""; faster = 0
				for (r = 1; r <= rounds; r++) {
					ta = ta " " tps["A", c, r]; tb = tb " " tps["B", c, r]
					pa = pa " " p99["A", c, r]; pb = pb " " p99["B", c, r]
					if (tps["A", c, r] > 0) rr = rr " " tps["B", c, r] / tps["A", c, r]
					if (tps["B", c, r] > tps["A", c, r]) faster++
				}
				mta = median(ta); mtb = median(tb); mpa = median(pa); mpb = median(pb)
				split(c, cc, "@")
				printf "| %s | %s | %.0f | %.0f | %.3f | %.3f (%s) | %d of %d | %.3f | %.3f | %.3f |\n", cc[1], cc[2], mta, mtb,
					(mta > 0 ? mtb / mta : 0), median(rr), minmax(rr), faster, rounds, mpa / 1000, mpb / 1000,
					(mpa > 0 ? mpb / mpa : 0)
			}
		}' "$RESULTS"
	echo
	echo "B/A TPS is the ratio of the medians; the per-round ratios pair each round's A and B, which ran back to back."
	echo
	echo "## Every round"
	echo
	awk -F'\t' -v cases="${CASES[*]}" '
		{ tps[$1, $3, $2] = $4; p99[$1, $3, $2] = $5; if ($2 > rounds) rounds = $2 }
		END {
			print "| case | clients | A TPS per round | B TPS per round | B/A per round | A p99 ms per round | B p99 ms per round |"
			print "|---|---:|---|---|---|---|---|"
			nc = split(cases, cs, " ")
			for (k = 1; k <= nc; k++) {
				c = cs[k]; ta = tb = rr = pa = pb = ""
				for (r = 1; r <= rounds; r++) {
					sep = (r > 1) ? ", " : ""
					ta = ta sep sprintf("%.0f", tps["A", c, r]); tb = tb sep sprintf("%.0f", tps["B", c, r])
					rr = rr sep sprintf("%.2f", tps["A", c, r] > 0 ? tps["B", c, r] / tps["A", c, r] : 0)
					pa = pa sep sprintf("%.2f", p99["A", c, r] / 1000); pb = pb sep sprintf("%.2f", p99["B", c, r] / 1000)
				}
				split(c, cc, "@")
				printf "| %s | %s | %s | %s | %s | %s | %s |\n", cc[1], cc[2], ta, tb, rr, pa, pb
			}
		}' "$RESULTS"
	echo
	echo "Rounds in order 1..$ROUNDS; in odd rounds A ran first, in even rounds B."
	echo
	echo "## Relation locks at the business INSERT"
	echo
	echo "One transaction: \`idem_acquire\` of a new key, then \`INSERT INTO bench.orders\`; the relations of idempotency.*" \
		"and bench.* it holds locks on at that point (pg_locks), then rolled back; the same in every round." \
		"A backend has 16 fast-path slots; a lock that finds none free goes to the shared lock table (partition LWLocks, shared memory)." \
		"The order's lasting locks are two (bench.orders, its sequence); the INSERT also takes and releases its three index locks," \
		"which go to the shared table too when no slot is free."
	echo
	echo "| revision | database | partitions | relations locked | of them in fast-path slots | the order's locks in the shared lock table |"
	echo "|---|---|---:|---:|---:|---:|"
	awk -F'\t' '!seen[$1, $3, $4, $5, $6, $7, $8]++ {
		printf "| %s | %s | %s | %s | %s | %s of %s |\n", $1, $3, $4, $5, $6, $7, $8 }' "$LOCKS" | sort
	echo
	echo "## Checks"
	echo
	if ((${#PROBLEMS[@]})); then
		echo "FAILED:"
		echo
		printf -- '- %s\n' "${PROBLEMS[@]}"
	else
		local n
		n=$(wc -l <"$RESULTS")
		echo "All $n runs passed: no failed or aborted transaction, a log line per transaction, one completed" \
			"record (and for ext_new_biz one order) per new-key transaction, no record added by ext_replay," \
			"the installed .so and SQL script were the side's own before and after its cases," \
			"and the server ran with the side's shared_preload_libraries$( ((STATS_MODE)) && echo " (statistics off in every A turn, on in every B turn, by idem_stats_enabled())" || true)."
	fi
}

OUT=$RESULTS_DIR/compare-$(date -u +%Y%m%dT%H%M%SZ).md
report >"$OUT"
echo
cat "$OUT"
echo
log "written to ${OUT#"$REPO_ROOT"/} (run time ${RUN_SECS}s)"
if ((${#PROBLEMS[@]})); then
	die "${#PROBLEMS[@]} check(s) failed"
fi
