#!/usr/bin/env bash
# bench/run.sh -- the idempotency benchmark (issues 4 and 13), in one run on
# one throwaway cluster
#
# Installs what is missing (apt), builds and installs the current tree,
# starts a cluster of its own (scripts/common.sh) with benchmark settings,
# and measures with `pgbench -n -M prepared` on 127.0.0.1, every case for the
# same duration, at 2 and 8 clients (-j = clients, at most 2):
#
#   floor_new       unpartitioned table, PRIMARY KEY (scope, key):
#                   INSERT ... ON CONFLICT DO NOTHING RETURNING, UPDATE to completed
#   article         idempotency_records with a UNIQUE key: INSERT ... ON
#                   CONFLICT DO NOTHING, UPDATE to completed
#   plpgsql_new     the contract in PL/pgSQL over the same partitioned layout
#   ext_new         BEGIN; idem_acquire new key; idem_complete 201; COMMIT
#   floor_replay    the same table, 200,000 completed rows: one SELECT by (scope, key)
#   plpgsql_replay  (bench/plpgsql_idem.sql), replay
#   ext_replay      idem_acquire of a random one of 200,000 completed records
#   ext_hot_key     8 clients on one key at a time, a new key every --hot-n
#                   transactions (8 clients only)
#   ext_new_nf, ext_replay_nf
#                   with --filters-compare: ext_new and ext_replay with
#                   idempotency.use_filters = off (every live partition's
#                   index descended, as without filters), in the same rounds
#   floor_replay_check, ext_replay_nocheck
#                   with --request-compare: floor_replay that also receives
#                   the request, hashes it as the extension does and compares
#                   it with the stored hash (what a hand-written replay needs
#                   to answer mismatch), and ext_replay with request NULL
#                   (no payload check), in the same rounds
#
# The main cases (all but ext_hot_key) run in --rounds interleaved rounds:
# every round runs each of them once at each client count, in the order
# above (2 clients, then 8) in odd rounds and in the reverse order in even
# ones, so that no case always runs first or last.  The report gives per
# case the median over the rounds and every round's TPS, and each ratio to a
# floor as the median, with the min-max, of the ratios within each round
# (same round, same clients).  ext_hot_key runs once, after the rounds.
#
# Then ext_replay and ext_new, once each, with 100,000 and with --records
# (10,000,000) live records, then a backend's memory after 1,000 and after
# --memory-calls acquire/complete pairs.  Every run of a case checks its own
# honesty: new-key cases added exactly one completed row per transaction
# pgbench counted, replay cases got 'replay' every time (the script fails
# otherwise), no transaction failed.  The report, with the targets of issue
# 13 and of issue 4, is printed and written to bench/results/latest.md (and
# bench/results/run-<UTC time>.md).  Exit status 1 if any check failed.
#
#   bash bench/run.sh [--rounds N] [--quick] [--spread-compare] [--pg MAJOR]
#                     [--duration S] [--sync on|off] [--records N]
#                     [--memory-calls N] [--hot-n N] [--spread INTERVAL]
#                     [--stats on|off] [--filters-compare]
#                     [--request-compare] [--perf] [--clients LIST]
#
# --rounds: how many rounds of the main cases (default 3, at least 1; issue
# 13's targets are medians of at least 3).
#
# --quick: the main cases' rounds only, to iterate on them: no ext_hot_key,
# no scale section (its 10,000,000-record load), no memory loop; the report
# says they were skipped.
#
# --spread: the prefilled records (the replay sets, the scale loads) expire
# evenly over this window from now.  The default, '1 day', is records
# claimed over the last day with the default 24 h ttl (they sit in two daily
# partitions); '6 days' is a mix of ttls up to a week, the worst case for
# lookups (seven daily partitions hold data).  The report counts the
# partitions that hold the replay set.
#
# --spread-compare: run the main cases' rounds twice, first with the replay
# sets expiring over --spread, then, the four tables emptied and the replay
# sets loaded again (bench/replay_set.sql), over '6 days'; the report has
# the cases of both and issue 13's target that each ratio at '6 days' is
# within 10 % of the one at --spread.  ext_hot_key runs after the first.
#
# --stats: on (the default) runs with shared_preload_libraries =
# 'pg_cron,idempotency', as scripts/common.sh starts its clusters, so the
# extension keeps its statistics (version 1.1); off preloads only pg_cron,
# so the same build counts nothing.  The report's header says which, as
# idem_stats_enabled() answered.  To measure what the statistics cost,
# compare the two in interleaved rounds: bench/compare.sh --stats REV.
#
# Filters: with --stats on the cluster has the known-absent filters, set as
# 1.2's defaults were (idempotency.filters = 16: one database takes 11 of
# them; idempotency.filter_size = 1MB), so that figures stay comparable; they
# are rebuilt (build_filters()) after every load, so that each holds the
# keys of its partition's current rows only.  --filters-compare adds the
# _nf cases above, so that filters on and off are compared in one run.
#
# --request-compare adds floor_replay_check and ext_replay_nocheck above,
# and a report section with what the request check costs each side: the
# extension's replay against the hand-written one that checks the request
# too, and the extension's replay without the check against floor_replay.
# Neither case is one of issue 13's targets.
#
# --clients: the client counts of the main cases, comma-separated
# (default 2,8; issue 39's durable-commit figures use 2,8,32).
#
# --pg: the PostgreSQL major, 15 (the default: the host's own) or 17 or 18:
# then the whole benchmark runs, with the same options, in the Debian root
# of that major that scripts/matrix.sh makes and keeps (made or refreshed as
# for the test suite, under the same lock), on a copy of this tree, and the
# run's bench/results/ files are copied back to this checkout's.  perf is
# not in those roots: with --perf the report says there is no profile.
#
# as root on Debian 12; about 12 minutes with the defaults on 2 cores (the
# 42 runs of the main cases 7, the 10,000,000-record load and the memory
# loop 2 each); --quick --duration 3 about 2.5 minutes, --spread-compare
# twice the main cases' time.
set -euo pipefail

BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

DURATION=10
ROUNDS=3
QUICK=0
SPREAD_COMPARE=0
PG_MAJOR=15
SYNC=off
BIG_RECORDS=10000000
SMALL_RECORDS=100000
REPLAY_RECORDS=200000
MEMORY_CALLS=1000000
HOT_N=20
SPREAD='1 day'
WIDE_SPREAD='6 days'	# --spread-compare's second spread, issue 13's
STATS=on
PERF=0
FILTERS_COMPARE=0
REQUEST_COMPARE=0
CLIENT_COUNTS=(2 8)
DB=idem_bench
REQ='{"amount_cents": 2000, "currency": "EUR", "order": "A-1001"}'
RESP='{"payment_id": 7, "status": "succeeded", "amount_cents": 2000}'

usage() {
	sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
	exit "${1:-0}"
}

ARGS=("$@")
while (($#)); do
	case $1 in
	--duration) DURATION=${2:?}; shift 2 ;;
	--rounds) ROUNDS=${2:?}; shift 2 ;;
	--quick) QUICK=1; shift ;;
	--spread-compare) SPREAD_COMPARE=1; shift ;;
	--pg) PG_MAJOR=${2:?}; shift 2 ;;
	--sync) SYNC=${2:?}; shift 2 ;;
	--records) BIG_RECORDS=${2:?}; shift 2 ;;
	--memory-calls) MEMORY_CALLS=${2:?}; shift 2 ;;
	--hot-n) HOT_N=${2:?}; shift 2 ;;
	--spread) SPREAD=${2:?}; shift 2 ;;
	--stats) STATS=${2:?}; shift 2 ;;
	--perf) PERF=1; shift ;;
	--filters-compare) FILTERS_COMPARE=1; shift ;;
	--request-compare) REQUEST_COMPARE=1; shift ;;
	--clients) IFS=, read -r -a CLIENT_COUNTS <<<"${2:?}"; shift 2 ;;
	-h | --help) usage 0 ;;
	*) echo "unknown option: $1" >&2; usage 2 ;;
	esac
done

# Another major than the host's runs in scripts/matrix.sh's root of it:
# this script again in there (IDEM_BENCH_IN_ROOT=1), with the same options.
IN_ROOT=${IDEM_BENCH_IN_ROOT:-0}
if [[ $PG_MAJOR != 15 && $IN_ROOT != 1 ]]; then
	# shellcheck source=scripts/matrix.sh
	source "$BENCH_DIR/../scripts/matrix.sh"
else
	IDEM_PG_MAJOR=$PG_MAJOR
	# shellcheck source=scripts/common.sh
	source "$BENCH_DIR/../scripts/common.sh"
fi

[[ $SYNC == on || $SYNC == off ]] || die "--sync takes on or off"
[[ $STATS == on || $STATS == off ]] || die "--stats takes on or off"
[[ $DURATION =~ ^[0-9]+$ && $DURATION -ge 1 ]] || die "--duration takes whole seconds"
[[ $ROUNDS =~ ^[0-9]+$ && $ROUNDS -ge 1 ]] || die "--rounds takes a number of at least 1"
[[ $PG_MAJOR =~ ^[0-9]+$ ]] || die "--pg takes a PostgreSQL major: 15, 17 or 18"
[[ $BIG_RECORDS =~ ^[0-9]+$ && $BIG_RECORDS -ge $SMALL_RECORDS ]] ||
	die "--records takes a number of at least $SMALL_RECORDS"
[[ $MEMORY_CALLS =~ ^[0-9]+$ && $MEMORY_CALLS -gt 1000 ]] || die "--memory-calls takes a number above 1000"
[[ $HOT_N =~ ^[0-9]+$ && $HOT_N -ge 1 ]] || die "--hot-n takes a positive number"
for c in "${CLIENT_COUNTS[@]}"; do
	[[ $c =~ ^[0-9]+$ && $c -ge 1 && $c -le 64 ]] || die "--clients takes client counts from 1 to 64, comma-separated"
done
if ((FILTERS_COMPARE)); then
	[[ $STATS == on ]] || die "--filters-compare needs --stats on (the filters need the library preloaded)"
fi
# the main cases with the extra ones of --filters-compare and
# --request-compare, each after the case it is a variant of
MAIN_CASES=(floor_new article plpgsql_new ext_new)
((FILTERS_COMPARE)) && MAIN_CASES+=(ext_new_nf)
MAIN_CASES+=(floor_replay)
((REQUEST_COMPARE)) && MAIN_CASES+=(floor_replay_check)
MAIN_CASES+=(plpgsql_replay ext_replay)
((FILTERS_COMPARE)) && MAIN_CASES+=(ext_replay_nf)
((REQUEST_COMPARE)) && MAIN_CASES+=(ext_replay_nocheck)
if ((SPREAD_COMPARE)) && [[ $SPREAD == "$WIDE_SPREAD" ]]; then
	die "--spread-compare compares --spread with '$WIDE_SPREAD': give --spread another window"
fi

RESULTS_DIR=$BENCH_DIR/results
mkdir -p "$RESULTS_DIR"
T0=$EPOCHREALTIME
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
STAMP=$(date -u +%Y-%m-%dT%H:%M:%SZ)
# In the root, the host's run tells what it ran and on which tree (the copy
# there has no git history).
COMMAND="bash bench/run.sh"
for a in "${ARGS[@]}"; do
	COMMAND+=" $(printf '%q' "$a")"
done
COMMAND=${IDEM_BENCH_COMMAND:-$COMMAND}
if [[ $IN_ROOT == 1 ]]; then
	GIT_HEAD=${IDEM_BENCH_GIT_HEAD:-unknown}
	GIT_DIRTY=${IDEM_BENCH_GIT_DIRTY:-}
else
	GIT_HEAD=$(git -C "$REPO_ROOT" log --oneline -1 2>/dev/null || echo "not a git work tree")
	GIT_DIRTY=$(git -C "$REPO_ROOT" status --short -- . ':!bench' ':!BENCHMARKS.md' 2>/dev/null |
		awk '{ printf "%s%s %s", (NR > 1 ? ", " : ""), $1, $2 }' || true)
fi
# what was built, when it is not a commit: a digest of the C and SQL sources
SRC_DIGEST=$(cd "$REPO_ROOT" && cat ./*.c ./*.h ./*.sql ./*.control Makefile 2>/dev/null | sha256sum | cut -c 1-16)

# bench_in_root: run this benchmark in scripts/matrix.sh's root of
# $PG_MAJOR, bring its bench/results/ back, exit with its status.
bench_in_root() {
	local root where rc=0
	[[ -n ${MATRIX_SUITE[$PG_MAJOR]:-} ]] ||
		die "--pg takes 15 (the host's) or a major of scripts/matrix.sh: ${!MATRIX_SUITE[*]}"
	((EUID == 0)) || die "--pg $PG_MAJOR needs root (debootstrap, chroot, mount)"
	mx_init
	log "PostgreSQL $PG_MAJOR: the benchmark runs in scripts/matrix.sh's Debian root of it"
	mx_enter "$PG_MAJOR" || die "no root for PostgreSQL $PG_MAJOR: $(cat "$MX_TMP/reason")"
	root=$(cat "$MX_TMP/root")
	where="in the Debian root $root (Debian ${MATRIX_SUITE[$PG_MAJOR]%% *}, made by scripts/matrix.sh), on a copy of the tree"
	if ((PERF)) && [[ ! -x $root/usr/bin/perf ]]; then
		log "--perf: perf is not in the root; the report will say there is no profile"
	fi
	mx_in_root "$root" IDEM_BENCH_IN_ROOT=1 IDEM_BENCH_WHERE="$where" \
		IDEM_BENCH_COMMAND="$COMMAND" IDEM_BENCH_GIT_HEAD="$GIT_HEAD" IDEM_BENCH_GIT_DIRTY="$GIT_DIRTY" \
		bash /build/bench/run.sh "${ARGS[@]}" </dev/null || rc=$?
	if [[ -d $root/build/bench/results ]]; then
		cp -a "$root/build/bench/results/." "$RESULTS_DIR/"
		log "the run's bench/results/ copied to $RESULTS_DIR: $(cd "$root/build/bench/results" && echo ./*)"
	fi
	if [[ -d $root/build/log ]]; then
		mkdir -p "$REPO_ROOT/log"
		cp -a "$root/build/log/." "$REPO_ROOT/log/"
	fi
	mx_leave
	exit "$rc"
}
if [[ $PG_MAJOR != 15 && $IN_ROOT != 1 ]]; then
	bench_in_root
fi
if [[ $IN_ROOT == 1 ]]; then
	WHERE=${IDEM_BENCH_WHERE:-in a Debian root}
elif [[ -n ${IDEM_PG_PREFIX:-} ]]; then
	WHERE="a private copy in $IDEM_PG_PREFIX"
else
	WHERE="the host's own installation"
fi

IDEM_QUIET=1
install_deps
build_install
# shellcheck disable=SC2119
start_cluster

if [[ $STATS == on ]]; then PRELOAD='pg_cron,idempotency'; else PRELOAD='pg_cron'; fi
log "benchmark settings (synchronous_commit = $SYNC, shared_preload_libraries = '$PRELOAD'), restarting"
as_postgres tee -a "$IDEM_PGDATA/postgresql.conf" >/dev/null <<EOF

# bench/run.sh
shared_preload_libraries = '$PRELOAD'
shared_buffers = 1GB
synchronous_commit = $SYNC
fsync = on
full_page_writes = on
max_connections = 100
max_wal_size = 20GB
min_wal_size = 2GB
checkpoint_timeout = 1h
autovacuum = off
max_locks_per_transaction = 128
idempotency.filters = 16
idempotency.filter_size = 1MB
EOF
as_postgres "$PG_BINDIR/pg_ctl" restart -D "$IDEM_PGDATA" -m fast -w -t 120 \
	-l "$IDEM_SERVER_LOG" >/dev/null || die "the server did not restart"

WORK=$IDEM_TMPDIR/bench
mkdir -p "$WORK"
RESULTS=$WORK/results.tsv
: >"$RESULTS"
PROBLEMS=()

psql_db() { "$PG_BINDIR/psql" -X -q -A -t -v ON_ERROR_STOP=1 -h 127.0.0.1 -d "$DB" "$@"; }
q() { psql_db -c "$1"; }

"$PG_BINDIR/psql" -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -d postgres -c "CREATE DATABASE $DB"

log "setup: tables, PL/pgSQL version"
psql_db -f "$BENCH_DIR/setup.sql" >/dev/null
# what the extension says (1.0 has no statistics at all)
STATS_ENABLED=$(q "SELECT CASE WHEN to_regprocedure('idempotency.idem_stats_enabled()') IS NULL
	THEN 'no statistics in this version' WHEN idempotency.idem_stats_enabled() THEN 'enabled' ELSE 'not enabled' END")
if [[ $STATS == on && $STATS_ENABLED == 'not enabled' ]] || [[ $STATS == off && $STATS_ENABLED == enabled ]]; then
	die "--stats $STATS, but idem_stats_enabled() says: $STATS_ENABLED"
fi
log "statistics: $STATS_ENABLED"

# ---------------------------------------------------------------------------
# one case
# ---------------------------------------------------------------------------

# count_rows CASE: "rows completed" in the table that CASE writes new keys to
count_rows() {
	case $1 in
	floor_new) q "SELECT count(*), count(*) FILTER (WHERE status = 'completed') FROM bench.floor" ;;
	article) q "SELECT count(*), count(*) FILTER (WHERE status = 'COMPLETED') FROM bench.idempotency_records" ;;
	plpgsql_new) q "SELECT count(*), count(*) FILTER (WHERE status = 'completed') FROM plidem.records" ;;
	ext_new | ext_new_nf) q "SELECT count(*), count(*) FILTER (WHERE status = 'completed') FROM idempotency.records" ;;
	*) echo "0|0" ;;
	esac
}

# io_stats CASE: "index scans|buffer hits|buffer reads" so far on the tables
# CASE works on (for the partitioned ones, all their partitions): read from
# pg_stat_user_tables / pg_statio_user_tables (heap, index and TOAST blocks).
io_stats() {
	local where
	case $1 in
	floor_*) where="t.relid = 'bench.floor'::regclass" ;;
	article) where="t.relid = 'bench.idempotency_records'::regclass" ;;
	plpgsql_*) where="t.schemaname = 'plidem'" ;;
	*) where="t.schemaname = 'idempotency'" ;;
	esac
	q "SELECT coalesce(sum(t.idx_scan), 0),
	          coalesce(sum(coalesce(s.heap_blks_hit, 0) + coalesce(s.idx_blks_hit, 0)
	                       + coalesce(s.toast_blks_hit, 0) + coalesce(s.tidx_blks_hit, 0)), 0),
	          coalesce(sum(coalesce(s.heap_blks_read, 0) + coalesce(s.idx_blks_read, 0)
	                       + coalesce(s.toast_blks_read, 0) + coalesce(s.tidx_blks_read, 0)), 0)
	     FROM pg_stat_user_tables t JOIN pg_statio_user_tables s USING (relid)
	    WHERE $where"
}

# wait_idle: until no other session is connected to the benchmark database,
# so that every backend has flushed its statistics (they do at exit).
wait_idle() {
	local i
	for i in $(seq 1 100); do
		[[ $(q "SELECT count(*) FROM pg_stat_activity WHERE datname = '$DB' AND pid <> pg_backend_pid()") == 0 ]] && return 0
		sleep 0.1
	done
	log "warning: sessions still connected after 10s"
}

# run_case CASE CLIENTS GROUP RECORDS ROUND [pgbench -D assignments...]
# Appends one line to $RESULTS:
#   group case clients records tps avg_us p50_us p99_us tx failed check note
#   index_scans buffer_hits buffer_reads round spread
# where spread is $SPREAD_NOW, the window the prefilled records expire over.
run_case() {
	local case=$1 clients=$2 group=$3 records=$4 round=$5
	shift 5
	# the label names the run's files and prefixes its new keys: unique
	local label=$group-$case-c$clients-r$round-${SPREAD_NOW// /} jobs out rc=0 tps tx failed
	local before after lat stats check=ok note="" script=$case pgopts=${PGOPTIONS:-}
	jobs=$((clients < 2 ? clients : 2))
	# the _nf cases: the same script with the filters switched off
	if [[ $case == *_nf ]]; then
		script=${case%_nf}
		pgopts="$pgopts -c idempotency.use_filters=off"
	fi
	out=$WORK/$label.out

	q "CHECKPOINT" >/dev/null
	before=$(count_rows "$case")
	local hot_before=0
	[[ $case == ext_hot_key ]] && hot_before=$(q "SELECT last_value - (NOT is_called)::int FROM bench.hot_seq")

	wait_idle
	local io_before io_after
	io_before=$(io_stats "$case")

	log "$label: $clients clients, ${DURATION}s, records expiring over $SPREAD_NOW"
	PGOPTIONS=$pgopts "$PG_BINDIR/pgbench" -n -M prepared -h 127.0.0.1 -c "$clients" -j "$jobs" -T "$DURATION" \
		-l --log-prefix="$WORK/$label" \
		-D n=0 -D "kp=$label-" -D "req=$REQ" -D "resp=$RESP" "$@" \
		-f "$BENCH_DIR/cases/$script.pgbench" "$DB" >"$out" 2>&1 || rc=$?

	wait_idle
	io_after=$(io_stats "$case")
	local scans hits reads s0 h0 r0
	IFS='|' read -r scans hits reads <<<"$io_after"
	IFS='|' read -r s0 h0 r0 <<<"$io_before"
	scans=$((scans - s0)) hits=$((hits - h0)) reads=$((reads - r0))

	tps=$(sed -n 's/^tps = \([0-9.]*\) (without initial connection time)$/\1/p' "$out")
	tx=$(sed -n 's/^number of transactions actually processed: \([0-9]*\).*/\1/p' "$out")
	failed=$(sed -n 's/^number of failed transactions: \([0-9]*\).*/\1/p' "$out")
	: "${tps:=0}" "${tx:=0}" "${failed:=0}"

	# latency: third field of every line of the per-transaction logs, in µs
	lat=$WORK/$label.lat
	cat "$WORK/$label".[0-9]* 2>/dev/null | awk '$3 ~ /^[0-9]+$/ { print $3 }' | sort -n >"$lat"
	stats=$(awk '{ a[NR] = $1; s += $1 }
		END {
			if (NR == 0) { print "0 0 0 0"; exit }
			p50 = int(NR * 0.50); if (p50 < NR * 0.50) p50++
			p99 = int(NR * 0.99); if (p99 < NR * 0.99) p99++
			printf "%.1f %d %d %d\n", s / NR, a[p50], a[p99], NR
		}' "$lat")
	read -r avg p50 p99 nlog <<<"$stats"
	rm -f "$WORK/$label".[0-9]* "$lat"

	if ((rc != 0)) || grep -q 'aborted\|error' "$out"; then
		check="FAIL"
		note="pgbench exit $rc: $(grep -m 3 -i 'error\|aborted' "$out" | tr '\n\t' '  ' | cut -c 1-300)"
		cp "$out" "$RESULTS_DIR/failed-$label.out"
	fi
	if ((failed != 0)); then
		check="FAIL"
		note="$note $failed failed transactions;"
	fi
	if ((tx == 0)); then
		check="FAIL"
		note="$note no transaction;"
	fi
	if ((nlog != tx)); then
		check="FAIL"
		note="$note per-transaction log has $nlog lines for $tx transactions;"
	fi

	case $case in
	floor_new | article | plpgsql_new | ext_new | ext_new_nf)
		after=$(count_rows "$case")
		local added=$((${after%%|*} - ${before%%|*})) completed=$((${after##*|} - ${before##*|}))
		if ((added != tx || completed != tx)); then
			check="FAIL"
			note="$note rows added $added, completed $completed, transactions $tx;"
		else
			note="$note +$added completed rows = transactions;"
		fi
		;;
	*_replay*)
		[[ $check == ok ]] && note="$note every outcome replay;"
		;;
	ext_hot_key)
		local hot_after rows distinct ndone buckets
		hot_after=$(q "SELECT last_value FROM bench.hot_seq")
		IFS='|' read -r rows distinct ndone <<<"$(q "SELECT count(*), count(DISTINCT key), count(*) FILTER (WHERE status = 'completed') FROM idempotency.records WHERE scope = 'hot-key'")"
		buckets=$((hot_after / HOT_N - (hot_before + 1) / HOT_N + 1))
		if ((hot_after - hot_before != tx)); then
			# a failed transaction also took a number
			check="FAIL"
			note="$note $((hot_after - hot_before)) numbers taken for $tx transactions;"
		fi
		# shellcheck disable=SC2056  # any one of them differing is a failure
		if ((rows != distinct || rows != ndone || rows != buckets)); then
			check="FAIL"
			note="$note keys used $buckets, records $rows, distinct $distinct, completed $ndone;"
		fi
		note="$note outcomes: acquired $rows, replay $((tx - rows)), other 0 (any other fails the script); $buckets keys, $HOT_N transactions a key;"
		;;
	esac
	note=${note# }
	[[ $check == ok ]] || PROBLEMS+=("$label: $note")
	printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' \
		"$group" "$case" "$clients" "$records" "$tps" "$avg" "$p50" "$p99" "$tx" "$failed" "$check" "$note" \
		"$scans" "$hits" "$reads" "$round" "$SPREAD_NOW" >>"$RESULTS"
	printf '    tps %.0f  avg %.3f ms  p50 %.3f ms  p99 %.3f ms  %s\n' \
		"$tps" "$(awk "BEGIN{print $avg/1000}")" "$(awk "BEGIN{print $p50/1000}")" "$(awk "BEGIN{print $p99/1000}")" "$check"
}

live_records() { q "SELECT count(*) FROM idempotency.records WHERE expires_at > now()"; }

# rebuild_filters WHAT: after a load, the known-absent filters of
# idempotency.records afresh (TRUNCATE keeps a partition's filter, bits of
# the keys gone included): DISABLE and ENABLE of their trigger drop every
# filter, build_filters() makes them from the rows.  Nothing without them.
FILTER_NOTES=()
rebuild_filters() {
	local what=$1 built info
	[[ $(q "SELECT to_regprocedure('idempotency.build_filters(interval)') IS NOT NULL
		AND coalesce(current_setting('idempotency.filters', true), '0') <> '0'") == t ]] || return 0
	q "ALTER TABLE idempotency.records DISABLE TRIGGER zz_records_filter" >/dev/null
	q "ALTER TABLE idempotency.records ENABLE ALWAYS TRIGGER zz_records_filter" >/dev/null
	built=$(q "SELECT idempotency.build_filters()")
	info=$(q "SELECT count(*) FILTER (WHERE f.state = 'ready') || ' ready, '
		|| coalesce(string_agg(regexp_replace(f.partition::text, '^.*[.]', '') || ' ~' || f.estimated_keys
		                       || ' keys ' || round(100.0 * f.bits_set / (8 * f.size_bytes)) || '% bits set', ', '
		                       ORDER BY f.partition::text) FILTER (WHERE f.estimated_keys > 0), 'none holds keys')
		FROM idempotency.idem_filters() f")
	log "filters after $what: $built built; $info"
	FILTER_NOTES+=("after $what: $info")
}

# load_replay_sets SPREAD: empty the four tables the cases write to and put
# the replay set, expiring over SPREAD, in each (bench/replay_set.sql); then
# note where idempotency.records and plidem.records hold it, for the report.
PREFILL=()
load_replay_sets() {
	local spread=$1 t info rows nparts ndefault nall first last per line
	log "replay sets: $REPLAY_RECORDS completed records in each replay table, expiring over the next $spread"
	psql_db -v req="$REQ" -v resp="$RESP" -v nrep="$REPLAY_RECORDS" -v spread="$spread" \
		-f "$BENCH_DIR/replay_set.sql" >/dev/null
	rebuild_filters "the replay sets over $spread"
	SPREAD_NOW=$spread
	line="$spread:"
	for t in idempotency.records plidem.records; do
		info=$(q "SELECT count(*), count(DISTINCT tableoid),
		             count(*) FILTER (WHERE tableoid = '${t}_default'::regclass),
		             (SELECT count(*) FROM pg_inherits WHERE inhparent = '$t'::regclass),
		             to_char(min(expires_at) AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI'),
		             to_char(max(expires_at) AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI'),
		             (SELECT string_agg(regexp_replace(p::text, '^.*[.]', '') || ' ' || n, ', ' ORDER BY p::text)
		                FROM (SELECT tableoid::regclass AS p, count(*) AS n FROM $t GROUP BY 1) x)
		        FROM $t")
		IFS='|' read -r rows nparts ndefault nall first last per <<<"$info"
		log "  $t: $rows rows in $nparts of its $nall partitions (DEFAULT: $ndefault rows): $per"
		line="$line $t holds $rows rows in $nparts of its $nall partitions (DEFAULT: $ndefault), expires_at $first to $last UTC ($per);"
		if ((ndefault > 0)); then
			PROBLEMS+=("replay set over $spread: $ndefault rows of $t in its DEFAULT partition (the spread goes past the partitions made ahead)")
		fi
	done
	PREFILL+=("${line%;}")
}

# run_rounds: --rounds rounds of the main cases at every client count; odd
# rounds in the order of CLIENT_COUNTS x MAIN_CASES, even ones reversed.
run_rounds() {
	local r k i n c case order seq=()
	for c in "${CLIENT_COUNTS[@]}"; do
		for case in "${MAIN_CASES[@]}"; do
			seq+=("$c $case")
		done
	done
	n=${#seq[@]}
	for ((r = 1; r <= ROUNDS; r++)); do
		if ((r % 2 == 1)); then order=forward; else order=reversed; fi
		log "round $r of $ROUNDS ($order), records expiring over $SPREAD_NOW"
		for ((k = 0; k < n; k++)); do
			if [[ $order == forward ]]; then i=$k; else i=$((n - 1 - k)); fi
			read -r c case <<<"${seq[i]}"
			if [[ $case == *_replay* ]]; then
				run_case "$case" "$c" main "$REPLAY_RECORDS" "$r" -D rp=r -D "nrep=$REPLAY_RECORDS"
			else
				run_case "$case" "$c" main "" "$r"
			fi
		done
	done
}

# ---------------------------------------------------------------------------
# the cases: the main ones in rounds, for each spread; then the hot key
# ---------------------------------------------------------------------------
SPREADS=("$SPREAD")
((SPREAD_COMPARE)) && SPREADS+=("$WIDE_SPREAD")
t_main=$EPOCHREALTIME
for sp in "${SPREADS[@]}"; do
	load_replay_sets "$sp"
	run_rounds
	if [[ $sp == "$SPREAD" ]] && ((!QUICK)); then
		run_case ext_hot_key 8 main "" 1 -D "hotn=$HOT_N"
	fi
done
MAIN_SECS=$(awk "BEGIN{printf \"%.0f\", $EPOCHREALTIME - $t_main}")
SPREAD_NOW=$SPREAD

# ---------------------------------------------------------------------------
# scale: 100,000 then --records live records, 8 clients
# ---------------------------------------------------------------------------
SCALE_CLIENTS=8
LOAD_SECS=0
if ((!QUICK)); then
	log "scale: $SMALL_RECORDS live records"
	q "TRUNCATE idempotency.records"
	psql_db -v from=1 -v to="$SMALL_RECORDS" -v req="$REQ" -v resp="$RESP" -v spread="$SPREAD" -f "$BENCH_DIR/load_records.sql"
	q "VACUUM ANALYZE idempotency.records"
	rebuild_filters "the $SMALL_RECORDS-record load"
	n=$(live_records)
	run_case ext_replay "$SCALE_CLIENTS" scale "$n" 1 -D rp=m -D "nrep=$SMALL_RECORDS"
	n=$(live_records)
	run_case ext_new "$SCALE_CLIENTS" scale "$n" 1

	log "scale: loading up to $BIG_RECORDS live records (two sessions)"
	t_load=$EPOCHREALTIME
	q "TRUNCATE idempotency.records"
	half=$((BIG_RECORDS / 2))
	pids=()
	psql_db -v from=1 -v to="$half" -v req="$REQ" -v resp="$RESP" -v spread="$SPREAD" -f "$BENCH_DIR/load_records.sql" & pids+=($!)
	psql_db -v from=$((half + 1)) -v to="$BIG_RECORDS" -v req="$REQ" -v resp="$RESP" -v spread="$SPREAD" -f "$BENCH_DIR/load_records.sql" & pids+=($!)
	for p in "${pids[@]}"; do wait "$p" || die "loading the records failed"; done
	q "VACUUM ANALYZE idempotency.records"
	rebuild_filters "the $BIG_RECORDS-record load"
	LOAD_SECS=$(awk "BEGIN{printf \"%.0f\", $EPOCHREALTIME - $t_load}")
	log "loaded in ${LOAD_SECS}s"
	n=$(live_records)
	run_case ext_replay "$SCALE_CLIENTS" scale "$n" 1 -D rp=m -D "nrep=$BIG_RECORDS"
	n=$(live_records)
	run_case ext_new "$SCALE_CLIENTS" scale "$n" 1
fi

# ---------------------------------------------------------------------------
# memory: one backend, 1,000 then --memory-calls acquire/complete pairs
# ---------------------------------------------------------------------------
MEM_SECS=0
if ((!QUICK)); then
	log "memory: one session, $MEMORY_CALLS acquire/complete pairs"
	t_mem=$EPOCHREALTIME
	MEM=$(psql_db -v calls="$MEMORY_CALLS" -f "$BENCH_DIR/memory.sql")
	MEM_SECS=$(awk "BEGIN{printf \"%.0f\", $EPOCHREALTIME - $t_mem}")
	read -r _ m1_calls m1_ctx m1_anon m1_rss <<<"$(sed -n 1p <<<"$MEM")"
	read -r _ m2_calls m2_ctx m2_anon m2_rss <<<"$(sed -n 2p <<<"$MEM")"
	log "memory: contexts $m1_ctx -> $m2_ctx bytes, RssAnon $m1_anon -> $m2_anon kB (${MEM_SECS}s)"
fi

# ---------------------------------------------------------------------------
# optional: profile of the backends during ext_replay and ext_new (8 clients)
# ---------------------------------------------------------------------------
RUN_SECS=$(awk "BEGIN{printf \"%.0f\", $EPOCHREALTIME - $T0}")
LOAD_END=$(cut -d' ' -f1-3 /proc/loadavg)

PERF_REPORT=
PERF_SECS=0
if ((PERF)); then
	t_perf=$EPOCHREALTIME
	if ! command -v perf >/dev/null 2>&1; then
		if [[ $IN_ROOT == 1 ]]; then
			PERF_REPORT="perf is not installed in this PostgreSQL $IDEM_PG_MAJOR root (--perf is not supported with --pg $IDEM_PG_MAJOR): no profile."
		else
			PERF_REPORT="perf is not installed: no profile."
		fi
	else
		pdur=$((DURATION < 10 ? DURATION : 10))
		for case in ext_replay floor_replay ext_new floor_new; do
			log "perf: $case, 8 clients, ${pdur}s"
			# ext's table holds the big load now (with --quick, still the
			# replay set); the floor's its replay set
			extra=()
			if [[ $case == ext_replay ]] && ((QUICK)); then
				extra=(-D rp=r -D "nrep=$REPLAY_RECORDS")
			elif [[ $case == ext_replay ]]; then
				extra=(-D rp=m -D "nrep=$BIG_RECORDS")
			fi
			[[ $case == floor_replay ]] && extra=(-D rp=r -D "nrep=$REPLAY_RECORDS")
			"$PG_BINDIR/pgbench" -n -M prepared -h 127.0.0.1 -c 8 -j 2 -T $((pdur + 2)) \
				-D n=0 -D "kp=perf-$case-" -D "req=$REQ" -D "resp=$RESP" "${extra[@]}" \
				-f "$BENCH_DIR/cases/$case.pgbench" "$DB" >"$WORK/perf-$case.out" 2>&1 &
			bpid=$!
			sleep 1
			# the backends of this pgbench only: not other clusters on the machine
			backends=$(q "SELECT string_agg(pid::text, ',') FROM pg_stat_activity
				WHERE datname = '$DB' AND application_name = 'pgbench'")
			# in a subshell, so that the shell's "Terminated" notice goes to the log too
			(perf record -q -F 997 -g -p "$backends" -o "$WORK/perf-$case.data" -- sleep "$pdur" || true) \
				>"$WORK/perf-$case.log" 2>&1
			prc=0
			wait "$bpid" || prc=$?
			{
				echo "#### $case, 8 clients: where the backends spend their time"
				echo
				((prc == 0)) || echo "pgbench failed (exit $prc): $(grep -m 1 -i error "$WORK/perf-$case.out")"
				echo '```'
				perf report -q -i "$WORK/perf-$case.data" --no-children --sort dso \
					-g none --percent-limit 2 --stdio 2>/dev/null | sed '/^$/d; s/ *$//' || true
				echo '--- top symbols, self time'
				perf report -q -i "$WORK/perf-$case.data" --no-children --sort dso,symbol \
					-g none --percent-limit 0.8 --stdio 2>/dev/null |
					sed '/^$/d; s/ *$//' | head -n 30 || true
				echo '```'
				echo
			} >>"$WORK/perf.md"
			rm -f "$WORK/perf-$case.data"
		done
		PERF_REPORT=$(cat "$WORK/perf.md")
	fi
	PERF_SECS=$(awk "BEGIN{printf \"%.0f\", $EPOCHREALTIME - $t_perf}")
fi

# ---------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------
PG_VERSION=$(q "SELECT version()")
SETTINGS=$(q "SELECT string_agg(name || ' = ' || current_setting(name), ', ' ORDER BY name)
	FROM pg_settings WHERE name IN ('shared_buffers', 'synchronous_commit', 'fsync', 'full_page_writes',
	'wal_level', 'max_wal_size', 'checkpoint_timeout', 'autovacuum', 'max_connections', 'huge_pages',
	'work_mem', 'jit', 'max_locks_per_transaction')")
CPU_MODEL=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)
MEM_TOTAL=$(awk '/^MemTotal/ { printf "%.1f GiB", $2 / 1048576 }' /proc/meminfo)

# awk functions of the report's tables.  The main runs are kept by
# k = spread SUBSEP case SUBSEP clients and round; lists are numbers
# separated by spaces.
# shellcheck disable=SC2016
AWK_LIB='
function median(s,   v, n, i, j, t) {
	n = split(s, v, " ")
	for (i = 2; i <= n; i++) { t = v[i]; for (j = i - 1; j >= 1 && v[j] + 0 > t + 0; j--) v[j + 1] = v[j]; v[j + 1] = t }
	if (n == 0) return 0
	return (n % 2) ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2
}
function lo_of(s,   v, n, i, x) { n = split(s, v, " "); x = v[1]; for (i = 2; i <= n; i++) if (v[i] + 0 < x + 0) x = v[i]; return x }
function hi_of(s,   v, n, i, x) { n = split(s, v, " "); x = v[1]; for (i = 2; i <= n; i++) if (v[i] + 0 > x + 0) x = v[i]; return x }
function floor_of(c) {
	if (c == "ext_new" || c == "ext_new_nf" || c == "plpgsql_new" || c == "article" || c == "floor_new") return "floor_new"
	if (c ~ /^(ext|plpgsql|floor)_replay/) return "floor_replay"
	return ""
}
# ratios(SP, NUM, DEN, C): TPS of NUM / TPS of DEN in each round (spread SP, C clients)
function ratios(sp, num, den, c,   kn, kd, r, s) {
	kn = sp SUBSEP num SUBSEP c; kd = sp SUBSEP den SUBSEP c; s = ""
	for (r = 1; r <= nr[kn]; r++)
		if (((kn, r) in tps) && ((kd, r) in tps) && tps[kd, r] > 0) s = s " " tps[kn, r] / tps[kd, r]
	return s
}
# rstat(LIST[, UNIT]): "median (min–max)"
function rstat(s, u) { return s == "" ? "—" : sprintf("%.2f%s (%.2f–%.2f)", median(s), u, lo_of(s), hi_of(s)) }
function verdict(ok) { return ok ? "met" : "**missed**" }
$1 == "main" {
	k = $17 SUBSEP $2 SUBSEP $3
	if (!(k in nr)) { order[++norder] = k; nr[k] = 0 }
	r = $16 + 0
	if (r > nr[k]) nr[k] = r
	tps[k, r] = $5; avg[k, r] = $6; p50[k, r] = $7; p99[k, r] = $8
	sct[k, r] = ($9 > 0 ? $13 / $9 : 0)
	tx[k] += $9; scans[k] += $13; bufs[k] += $14 + $15; reads[k] += $15
	if ($11 != "ok") bad[k] = bad[k] " " r
}
'

# cases_table SPREAD: the main runs with the replay sets over SPREAD
cases_table() {
	awk -F'\t' -v sp="$1" "$AWK_LIB"'
		END {
			print "| case | clients | TPS: median | TPS per round | avg ms | p50 ms | p99 ms | TPS / floor: median of rounds | min–max | transactions | index scans / tx | buffers / tx | OS reads / tx | check |"
			print "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
			for (i = 1; i <= norder; i++) {
				k = order[i]; split(k, kk, SUBSEP)
				if (kk[1] != sp) continue
				cs = kk[2]; c = kk[3]
				lt = la = l50 = l99 = per = ""
				for (r = 1; r <= nr[k]; r++) {
					lt = lt " " tps[k, r]; la = la " " avg[k, r]; l50 = l50 " " p50[k, r]; l99 = l99 " " p99[k, r]
					per = per (r > 1 ? ", " : "") sprintf("%.0f", tps[k, r])
				}
				fl = floor_of(cs); rmed = rrange = "—"
				if (fl == cs) rmed = "1.00"
				else if (fl != "") {
					rl = ratios(sp, cs, fl, c)
					if (rl != "") { rmed = sprintf("%.2f", median(rl)); rrange = sprintf("%.2f–%.2f", lo_of(rl), hi_of(rl)) }
				}
				printf "| %s | %s | %.0f | %s | %.3f | %.3f | %.3f | %s | %s | %d | %.2f | %.1f | %.2f | %s |\n",
					cs, c, median(lt), per, median(la) / 1000, median(l50) / 1000, median(l99) / 1000, rmed, rrange, tx[k],
					(tx[k] > 0 ? scans[k] / tx[k] : 0), (tx[k] > 0 ? bufs[k] / tx[k] : 0), (tx[k] > 0 ? reads[k] / tx[k] : 0),
					((k in bad) ? "FAIL (round" bad[k] ")" : "ok")
			}
		}' "$RESULTS"
}

report() {
	local sp perf_note=
	echo "# idempotency benchmark"
	echo
	echo "- date: $STAMP"
	echo "- machine: $(nproc) CPUs ($CPU_MODEL), $MEM_TOTAL memory, $(uname -r)"
	echo "- PostgreSQL: $PG_VERSION"
	echo "- PostgreSQL major: $IDEM_PG_MAJOR (--pg $PG_MAJOR), $WHERE"
	echo "- statistics: --stats $STATS, shared_preload_libraries = '$PRELOAD'; idem_stats_enabled(): $STATS_ENABLED"
	echo "- rounds: $ROUNDS (--rounds) of the main cases, interleaved: each round runs every main case at ${CLIENT_COUNTS[*]} clients once," \
		"odd rounds in the order of the table, even rounds in the reverse order; ext_hot_key, scale and memory run once"
	if ((SPREAD_COMPARE)); then
		echo "- prefilled records (replay sets) expire evenly over the next $SPREAD (--spread), then, the tables emptied and" \
			"the replay sets loaded again, over the next $WIDE_SPREAD (--spread-compare); scale loads over $SPREAD"
	else
		echo "- prefilled records (replay sets, scale loads) expire evenly over the next $SPREAD (--spread)"
	fi
	for sp in "${PREFILL[@]}"; do
		echo "- replay sets over $sp"
	done
	if ((${#FILTER_NOTES[@]})); then
		echo "- known-absent filters (idempotency.filters = $(q "SELECT current_setting('idempotency.filters')"), filter_size = $(q "SELECT current_setting('idempotency.filter_size')"); rebuilt after every load):"
		for sp in "${FILTER_NOTES[@]}"; do
			echo "  - $sp"
		done
	else
		echo "- known-absent filters: none (not preloaded, or a version without them)"
	fi
	if ((FILTERS_COMPARE)); then
		echo "- --filters-compare: ext_new_nf and ext_replay_nf are ext_new and ext_replay with idempotency.use_filters = off, in the same rounds"
	fi
	if ((REQUEST_COMPARE)); then
		echo "- --request-compare: floor_replay_check is floor_replay that receives the request, hashes it and compares it with the stored hash;" \
			"ext_replay_nocheck is ext_replay with request NULL (no payload check); in the same rounds"
	fi
	if ((QUICK)); then
		echo "- --quick: ext_hot_key, the scale section (its $BIG_RECORDS-record load) and the memory loop were skipped"
	fi
	((PERF)) && perf_note=", then ${PERF_SECS}s of profiling"
	echo "- command: \`$COMMAND\`; run time ${RUN_SECS}s (main cases ${MAIN_SECS}s)$perf_note"
	echo "- load average (1, 5, 15 min) before the run: $LOAD_START; after it: $LOAD_END (other work on the machine shows here)"
	echo "- tree: \`$GIT_HEAD\`; uncommitted changes outside bench/: ${GIT_DIRTY:-none};" \
		"sha256 of the extension's sources (*.c *.h *.sql *.control Makefile) as built: ${SRC_DIGEST:0:16}"
	echo "- pgbench: \`pgbench -n -M prepared -h 127.0.0.1 -c C -j min(C,2) -T $DURATION -l\`, the scripts in bench/cases/;" \
		"latency from the per-transaction log (every transaction); pgbench runs on the same $(nproc) CPUs"
	echo "- server: $SETTINGS; CHECKPOINT before every case"
	echo "- request \`$REQ\`, response \`$RESP\`, keys md5 hex (32 characters), scope ''"
	for sp in "${SPREADS[@]}"; do
		echo
		if ((SPREAD_COMPARE)); then
			echo "## Cases, replay sets expiring over $sp"
		else
			echo "## Cases"
		fi
		echo
		cases_table "$sp"
	done
	echo
	echo "TPS, avg, p50 and p99: the median over the rounds of each round's value (of an even number of rounds, the mean of the middle two);" \
		"TPS per round in round order."
	echo "TPS / floor: ext_new, plpgsql_new and article against floor_new; ext_replay and plpgsql_replay against floor_replay;" \
		"the ratio is taken within each round (same round, same clients), then the median and the min–max of those ratios over the rounds."
	echo "Transactions: all rounds together.  Index scans, buffers (shared buffer hits + reads) and OS reads (blocks not in shared buffers," \
		"read from the kernel) per transaction: pooled over all rounds (their sums over all transactions), from" \
		"pg_stat_user_tables / pg_statio_user_tables over the tables the case uses (all partitions), heap, indexes and TOAST."
	echo
	echo "## Targets (issue 13)"
	echo
	local tg_ratio="ext_new article 1.00,ext_new floor_new 0.95,ext_replay floor_replay 0.90"
	local tg_scans="ext_new 4,ext_replay 1.5" tg_within="ext_new floor_new,ext_replay floor_replay"
	if ((FILTERS_COMPARE)); then
		tg_ratio+=",ext_new_nf article 1.00,ext_new_nf floor_new 0.95,ext_replay_nf floor_replay 0.90"
		tg_scans+=",ext_new_nf 4,ext_replay_nf 1.5" tg_within+=",ext_new_nf floor_new,ext_replay_nf floor_replay"
	fi
	awk -F'\t' -v spreads="$(IFS='|'; echo "${SPREADS[*]}")" -v clients="${CLIENT_COUNTS[*]}" \
		-v tg_ratio="$tg_ratio" -v tg_scans="$tg_scans" -v tg_within="$tg_within" "$AWK_LIB"'
		END {
			ns = split(spreads, sps, "|"); nc = split(clients, cl, " ")
			print "| target | spread | clients | measured: median of the rounds (min–max) | verdict |"
			print "|---|---|---:|---|---|"
			nt = split(tg_ratio, tg, ",")
			for (t = 1; t <= nt; t++) {
				split(tg[t], f, " ")
				for (s = 1; s <= ns; s++)
					for (j = 1; j <= nc; j++) {
						rl = ratios(sps[s], f[1], f[2], cl[j])
						printf "| %s ≥ %s × %s | %s | %s | %s | %s |\n", f[1], f[3], f[2], sps[s], cl[j], rstat(rl),
							(rl == "" ? "not measured" : verdict(median(rl) >= f[3] + 0))
					}
			}
			nt = split(tg_scans, tg, ",")
			for (t = 1; t <= nt; t++) {
				split(tg[t], f, " ")
				for (s = 1; s <= ns; s++)
					for (j = 1; j <= nc; j++) {
						k = sps[s] SUBSEP f[1] SUBSEP cl[j]; l = ""
						for (r = 1; r <= nr[k]; r++) l = l " " sct[k, r]
						if (tx[k] > 0)
							printf "| %s index scans / transaction ≤ %s | %s | %s | %.2f pooled (%.2f–%.2f) | %s |\n", f[1], f[2],
								sps[s], cl[j], scans[k] / tx[k], lo_of(l), hi_of(l), verdict(scans[k] / tx[k] <= f[2] + 0)
						else
							printf "| %s index scans / transaction ≤ %s | %s | %s | — | not measured |\n", f[1], f[2], sps[s], cl[j]
					}
			}
			if (ns == 2) {
				nt = split(tg_within, tg, ",")
				for (t = 1; t <= nt; t++) {
					split(tg[t], f, " ")
					for (j = 1; j <= nc; j++) {
						a = ratios(sps[2], f[1], f[2], cl[j]); b = ratios(sps[1], f[1], f[2], cl[j])
						if (a == "" || b == "" || median(b) <= 0)
							printf "| %s/%s at %s ≥ 0.90 × at %s | %s vs %s | %s | — | not measured |\n", f[1], f[2], sps[2], sps[1], sps[2], sps[1], cl[j]
						else
							printf "| %s/%s at %s ≥ 0.90 × at %s | %s vs %s | %s | %.2f / %.2f = %.2f | %s |\n", f[1], f[2], sps[2], sps[1],
								sps[2], sps[1], cl[j], median(a), median(b), median(a) / median(b), verdict(median(a) / median(b) >= 0.90)
					}
				}
			}
		}' "$RESULTS"
	echo
	echo "Ratios: the median over the rounds of the ratio within each round (same round, same clients), min–max of those in brackets;" \
		"the verdict is on the median.  Index scans (index descents) per transaction: pooled over all rounds, min–max of the rounds in brackets."
	if ((SPREAD_COMPARE)); then
		echo "Within 10 %: the median ratio with the replay sets over $WIDE_SPREAD divided by the one over $SPREAD, same clients."
	fi
	if ((ROUNDS < 3)); then
		echo
		echo "**Only $ROUNDS round(s): issue 13's targets are medians of at least 3 interleaved rounds; these verdicts are indicative.**"
	fi
	if [[ $SPREAD != "$WIDE_SPREAD" ]] && ((!SPREAD_COMPARE)); then
		echo
		echo "Issue 13 sets the index-scan targets and the within-10 % ones at \`--spread '$WIDE_SPREAD'\`, which this run did not measure" \
			"(\`--spread-compare\` runs both spreads)."
	elif ((!SPREAD_COMPARE)); then
		echo
		echo "The within-10 % targets compare $WIDE_SPREAD with the default spread: \`--spread-compare\` runs both."
	fi
	if ((REQUEST_COMPARE)); then
		echo
		echo "## The request check (--request-compare; not targets)"
		echo
		awk -F'\t' -v spreads="$(IFS='|'; echo "${SPREADS[*]}")" -v clients="${CLIENT_COUNTS[*]}" "$AWK_LIB"'
			END {
				ns = split(spreads, sps, "|"); nc = split(clients, cl, " ")
				nt = split("ext_replay floor_replay_check the extension against a hand-written replay that checks the request too|" \
					"ext_replay_nocheck floor_replay both without the check|" \
					"floor_replay_check floor_replay what the check costs the hand-written replay|" \
					"ext_replay ext_replay_nocheck what the check costs the extension", tg, "|")
				print "| ratio | what it shows | spread | clients | median of the rounds (min–max) |"
				print "|---|---|---|---:|---|"
				for (t = 1; t <= nt; t++) {
					split(tg[t], f, " "); what = tg[t]; sub(/^[^ ]+ [^ ]+ /, "", what)
					for (s = 1; s <= ns; s++)
						for (j = 1; j <= nc; j++)
							printf "| %s / %s | %s | %s | %s | %s |\n", f[1], f[2], what, sps[s], cl[j], rstat(ratios(sps[s], f[1], f[2], cl[j]))
				}
			}' "$RESULTS"
		echo
		echo "TPS ratios within each round, as above.  The contract hashes every request (SHA-256 of its canonical JSON) to answer" \
			"mismatch; floor_replay neither receives nor checks one."
	fi
	echo
	echo "## Scale (8 clients; live records in idempotency.records when the case starts)"
	echo
	if ((QUICK)); then
		echo "Skipped (--quick)."
	else
		awk -F'\t' '
			{ row[NR] = $0 }
			END {
				print "| case | live records | TPS | avg ms | p50 ms | p99 ms | TPS / TPS at fewest records | transactions | index scans / tx | buffers / tx | OS reads / tx | check |"
				print "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
				for (i = 1; i <= NR; i++) {
					split(row[i], f, "\t")
					if (f[1] != "scale") continue
					if (!(f[2] in base)) base[f[2]] = f[5]
					printf "| %s | %d | %.0f | %.3f | %.3f | %.3f | %.2f | %d | %.2f | %.1f | %.2f | %s |\n",
						f[2], f[4], f[5], f[6] / 1000, f[7] / 1000, f[8] / 1000,
						(base[f[2]] > 0 ? f[5] / base[f[2]] : 0), f[9],
						(f[9] > 0 ? f[13] / f[9] : 0), (f[9] > 0 ? (f[14] + f[15]) / f[9] : 0),
						(f[9] > 0 ? f[15] / f[9] : 0), f[11]
				}
			}' "$RESULTS"
		echo
		echo "Loading $BIG_RECORDS records (INSERT ... SELECT in two sessions, then VACUUM ANALYZE): ${LOAD_SECS}s."
	fi
	echo
	if ((QUICK)); then
		echo "## Memory of one backend"
		echo
		echo "Skipped (--quick)."
	else
		echo "## Memory of one backend ($MEMORY_CALLS acquire/complete pairs, each its own transaction, in a DO block; ${MEM_SECS}s)"
		echo
		echo "| after pairs | memory contexts (sum of total_bytes) | RssAnon | VmRSS (counts shared buffers touched) |"
		echo "|---:|---:|---:|---:|"
		echo "| $m1_calls | $m1_ctx B | $m1_anon kB | $m1_rss kB |"
		echo "| $m2_calls | $m2_ctx B | $m2_anon kB | $m2_rss kB |"
		echo "| growth | $((m2_ctx - m1_ctx)) B | $((m2_anon - m1_anon)) kB | $((m2_rss - m1_rss)) kB |"
	fi
	echo
	echo "## Checks"
	echo
	awk -F'\t' '{ printf "- %s %s, %s clients, round %s, records over %s: %s — %s\n", $1, $2, $3, $16, $17, $11, $12 }' "$RESULTS"
	echo
	echo "## Targets (issue 4)"
	echo
	awk -F'\t' -v sp="$SPREAD" -v small="$SMALL_RECORDS" -v quick="$QUICK" \
		-v mctx=$((${m2_ctx:-0} - ${m1_ctx:-0})) -v manon=$((${m2_anon:-0} - ${m1_anon:-0})) "$AWK_LIB"'
		$1 == "scale" { if (!($2 in s0)) s0[$2] = $5; else s1[$2] = $5 }
		function p99_of(cs, c,   k, l, r) {
			k = sp SUBSEP cs SUBSEP c; l = ""
			for (r = 1; r <= nr[k]; r++) l = l " " p99[k, r]
			return median(l)
		}
		END {
			print "| target | measured: median of the rounds (min–max) | verdict |"
			print "|---|---|---|"
			nt = split("ext_new floor_new 0.75 ,ext_new plpgsql_new 2 ×,ext_replay floor_replay 0.7 ,ext_replay plpgsql_replay 3 ×", tg, ",")
			split("2 8", cs, " ")
			for (j = 1; j <= 2; j++)
				for (t = 1; t <= nt; t++) {
					split(tg[t], f, " ")
					rl = ratios(sp, f[1], f[2], cs[j])
					printf "| %s ≥ %s × %s, %s clients | %s | %s |\n", f[1], f[3], f[2], cs[j], rstat(rl, f[4]),
						(rl == "" ? "not measured" : verdict(median(rl) >= f[3] + 0))
				}
			x = p99_of("ext_new", 8)
			printf "| p99 of ext_new < 1 ms, 8 clients | %.3f ms | %s |\n", x / 1000, verdict(x > 0 && x < 1000)
			x = p99_of("ext_replay", 8)
			printf "| p99 of ext_replay < 1 ms, 8 clients | %.3f ms | %s |\n", x / 1000, verdict(x > 0 && x < 1000)
			if (quick) {
				printf "| ext_replay, ext_new at the most records within 15%% of at %d | skipped (--quick) | — |\n", small
				printf "| backend memory growth < 1 MB, 1,000 → many pairs | skipped (--quick) | — |\n"
			} else {
				for (c in s0) {
					r = (s0[c] > 0) ? s1[c] / s0[c] : 0
					printf "| %s at the most records within 15%% of at %d | %.2f (single runs) | %s |\n", c, small, r, verdict(r >= 0.85)
				}
				printf "| backend memory growth < 1 MB, 1,000 → many pairs | contexts %+d B, RssAnon %+d kB | %s |\n", mctx, manon, verdict(mctx < 1048576 && manon < 1024)
			}
		}' "$RESULTS"
	if ((SPREAD_COMPARE)); then
		echo
		echo "Issue 4's ratios and p99 with the replay sets over $SPREAD."
	fi
	if [[ -n $PERF_REPORT ]]; then
		echo
		echo "## Profile"
		echo
		if ((QUICK)); then
			echo "\`perf record -F 997 -g -p <the 8 backends>\` for ${pdur:-0}s during extra 8-client runs after the measurements" \
				"(ext_replay and floor_replay on their $REPLAY_RECORDS-record replay sets); not part of the numbers above." \
				"Symbols of static functions of the stripped postgres binary show as addresses."
		else
			echo "\`perf record -F 997 -g -p <the 8 backends>\` for ${pdur:-0}s during extra 8-client runs after the measurements" \
				"(ext_replay on the $BIG_RECORDS-record table, floor_replay on its $REPLAY_RECORDS rows); not part of the numbers above." \
				"Symbols of static functions of the stripped postgres binary show as addresses."
		fi
		echo
		echo "$PERF_REPORT"
	fi
	if ((${#PROBLEMS[@]})); then
		echo
		echo "## FAILED CHECKS"
		echo
		printf -- '- %s\n' "${PROBLEMS[@]}"
	fi
}

report >"$RESULTS_DIR/latest.md"
cp "$RESULTS_DIR/latest.md" "$RESULTS_DIR/run-$(date -u +%Y%m%dT%H%M%SZ).md"
echo
cat "$RESULTS_DIR/latest.md"
echo
log "written to bench/results/latest.md (run time ${RUN_SECS}s)"
if ((${#PROBLEMS[@]})); then
	die "${#PROBLEMS[@]} check(s) failed"
fi
