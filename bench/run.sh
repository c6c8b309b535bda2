#!/usr/bin/env bash
# bench/run.sh -- the idempotency benchmark (issue 4), in one run on one
# throwaway cluster
#
# Installs what is missing (apt), builds and installs the current tree,
# starts a cluster of its own (scripts/common.sh) with benchmark settings,
# and measures with `pgbench -n -M prepared` on 127.0.0.1, every case for the
# same duration, at 2 and 8 clients (-j = clients, at most 2):
#
#   floor_new       unpartitioned table, PRIMARY KEY (scope, key):
#                   INSERT ... ON CONFLICT DO NOTHING RETURNING, UPDATE to completed
#   floor_replay    the same table, 200,000 completed rows: one SELECT by (scope, key)
#   article         idempotency_records with a UNIQUE key: INSERT ... ON
#                   CONFLICT DO NOTHING, UPDATE to completed
#   plpgsql_new     the contract in PL/pgSQL over the same partitioned layout
#   plpgsql_replay  (bench/plpgsql_idem.sql), new key / replay
#   ext_new         BEGIN; idem_acquire new key; idem_complete 201; COMMIT
#   ext_replay      idem_acquire of a random one of 200,000 completed records
#   ext_hot_key     8 clients on one key at a time, a new key every --hot-n
#                   transactions (8 clients only)
#
# then ext_replay and ext_new with 100,000 and with --records (10,000,000)
# live records, then a backend's memory after 1,000 and after --memory-calls
# acquire/complete pairs.  Every case checks its own honesty: new-key cases
# added exactly one completed row per transaction pgbench counted, replay
# cases got 'replay' every time (the script fails otherwise), no transaction
# failed.  The report is printed and written to bench/results/latest.md
# (and bench/results/run-<UTC time>.md).  Exit status 1 if any check failed.
#
#   bash bench/run.sh [--duration S] [--sync on|off] [--records N]
#                     [--memory-calls N] [--hot-n N] [--spread INTERVAL]
#                     [--stats on|off] [--perf]
#
# --stats: on (the default) runs with shared_preload_libraries =
# 'pg_cron,idempotency', as scripts/common.sh starts its clusters, so the
# extension keeps its statistics (version 1.1); off preloads only pg_cron,
# so the same build counts nothing.  The report's header says which, as
# idem_stats_enabled() answered.  To measure what the statistics cost,
# compare the two in interleaved rounds: bench/compare.sh --stats REV.
#
# --spread: the prefilled records expire evenly over this window from now.
# The default, '1 day', is records claimed over the last day with the
# default 24 h ttl (they sit in two daily partitions); '6 days' is a mix of
# ttls up to a week, the worst case for lookups (six partitions hold data).
#
# as root on Debian 12; about 9 minutes with the defaults on 2 cores (a third
# of it the 1,000,000-pair memory loop, a fifth the 10,000,000-record load).
set -euo pipefail

BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=scripts/common.sh
source "$BENCH_DIR/../scripts/common.sh"

DURATION=10
SYNC=off
BIG_RECORDS=10000000
SMALL_RECORDS=100000
REPLAY_RECORDS=200000
MEMORY_CALLS=1000000
HOT_N=20
SPREAD='1 day'
STATS=on
PERF=0
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
	--sync) SYNC=${2:?}; shift 2 ;;
	--records) BIG_RECORDS=${2:?}; shift 2 ;;
	--memory-calls) MEMORY_CALLS=${2:?}; shift 2 ;;
	--hot-n) HOT_N=${2:?}; shift 2 ;;
	--spread) SPREAD=${2:?}; shift 2 ;;
	--stats) STATS=${2:?}; shift 2 ;;
	--perf) PERF=1; shift ;;
	-h | --help) usage 0 ;;
	*) echo "unknown option: $1" >&2; usage 2 ;;
	esac
done
[[ $SYNC == on || $SYNC == off ]] || die "--sync takes on or off"
[[ $STATS == on || $STATS == off ]] || die "--stats takes on or off"
[[ $DURATION =~ ^[0-9]+$ && $DURATION -ge 1 ]] || die "--duration takes whole seconds"
[[ $BIG_RECORDS =~ ^[0-9]+$ && $BIG_RECORDS -ge $SMALL_RECORDS ]] ||
	die "--records takes a number of at least $SMALL_RECORDS"
[[ $MEMORY_CALLS =~ ^[0-9]+$ && $MEMORY_CALLS -gt 1000 ]] || die "--memory-calls takes a number above 1000"
[[ $HOT_N =~ ^[0-9]+$ && $HOT_N -ge 1 ]] || die "--hot-n takes a positive number"

RESULTS_DIR=$BENCH_DIR/results
mkdir -p "$RESULTS_DIR"
T0=$EPOCHREALTIME
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
STAMP=$(date -u +%Y-%m-%dT%H:%M:%SZ)
COMMAND="bash bench/run.sh${ARGS[*]:+ ${ARGS[*]}}"
GIT_HEAD=$(git -C "$REPO_ROOT" log --oneline -1 2>/dev/null || echo "not a git work tree")
GIT_DIRTY=$(git -C "$REPO_ROOT" status --short -- . ':!bench' ':!BENCHMARKS.md' 2>/dev/null |
	awk '{ printf "%s%s %s", (NR > 1 ? ", " : ""), $1, $2 }' || true)
# what was built, when it is not a commit: a digest of the C and SQL sources
SRC_DIGEST=$(cd "$REPO_ROOT" && cat ./*.c ./*.h ./*.sql ./*.control Makefile 2>/dev/null | sha256sum | cut -c 1-16)

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

log "setup: tables, PL/pgSQL version, $REPLAY_RECORDS completed records in each replay table"
psql_db -v req="$REQ" -v resp="$RESP" -v nrep="$REPLAY_RECORDS" -v spread="$SPREAD" -f "$BENCH_DIR/setup.sql" >/dev/null
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
	ext_new) q "SELECT count(*), count(*) FILTER (WHERE status = 'completed') FROM idempotency.records" ;;
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

# run_case CASE CLIENTS GROUP RECORDS [pgbench -D assignments...]
# Appends one line to $RESULTS:
#   group case clients records tps avg_us p50_us p99_us tx failed check note
#   index_scans buffer_hits buffer_reads
run_case() {
	local case=$1 clients=$2 group=$3 records=$4
	shift 4
	local label=$group-$case-c$clients jobs out rc=0 tps tx failed
	local before after lat stats check=ok note=""
	jobs=$((clients < 2 ? clients : 2))
	out=$WORK/$label.out

	q "CHECKPOINT" >/dev/null
	before=$(count_rows "$case")
	local hot_before=0
	[[ $case == ext_hot_key ]] && hot_before=$(q "SELECT last_value - (NOT is_called)::int FROM bench.hot_seq")

	wait_idle
	local io_before io_after
	io_before=$(io_stats "$case")

	log "$label: $clients clients, ${DURATION}s"
	"$PG_BINDIR/pgbench" -n -M prepared -h 127.0.0.1 -c "$clients" -j "$jobs" -T "$DURATION" \
		-l --log-prefix="$WORK/$label" \
		-D n=0 -D "kp=$label-" -D "req=$REQ" -D "resp=$RESP" "$@" \
		-f "$BENCH_DIR/cases/$case.pgbench" "$DB" >"$out" 2>&1 || rc=$?

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
	floor_new | article | plpgsql_new | ext_new)
		after=$(count_rows "$case")
		local added=$((${after%%|*} - ${before%%|*})) completed=$((${after##*|} - ${before##*|}))
		if ((added != tx || completed != tx)); then
			check="FAIL"
			note="$note rows added $added, completed $completed, transactions $tx;"
		else
			note="$note +$added completed rows = transactions;"
		fi
		;;
	*_replay)
		[[ $check == ok ]] && note="$note every outcome replay;"
		;;
	ext_hot_key)
		local hot_after keys rows distinct done buckets
		hot_after=$(q "SELECT last_value FROM bench.hot_seq")
		IFS='|' read -r rows distinct done <<<"$(q "SELECT count(*), count(DISTINCT key), count(*) FILTER (WHERE status = 'completed') FROM idempotency.records WHERE scope = 'hot-key'")"
		buckets=$((hot_after / HOT_N - (hot_before + 1) / HOT_N + 1))
		if ((hot_after - hot_before != tx)); then
			# a failed transaction also took a number
			check="FAIL"
			note="$note $((hot_after - hot_before)) numbers taken for $tx transactions;"
		fi
		if ((rows != distinct || rows != done || rows != buckets)); then
			check="FAIL"
			note="$note keys used $buckets, records $rows, distinct $distinct, completed $done;"
		fi
		note="$note outcomes: acquired $rows, replay $((tx - rows)), other 0 (any other fails the script); $buckets keys, $HOT_N transactions a key;"
		;;
	esac
	note=${note# }
	[[ $check == ok ]] || PROBLEMS+=("$label: $note")
	printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' \
		"$group" "$case" "$clients" "$records" "$tps" "$avg" "$p50" "$p99" "$tx" "$failed" "$check" "$note" \
		"$scans" "$hits" "$reads" >>"$RESULTS"
	printf '    tps %.0f  avg %.3f ms  p50 %.3f ms  p99 %.3f ms  %s\n' \
		"$tps" "$(awk "BEGIN{print $avg/1000}")" "$(awk "BEGIN{print $p50/1000}")" "$(awk "BEGIN{print $p99/1000}")" "$check"
}

live_records() { q "SELECT count(*) FROM idempotency.records WHERE expires_at > now()"; }

# ---------------------------------------------------------------------------
# the cases
# ---------------------------------------------------------------------------
for c in "${CLIENT_COUNTS[@]}"; do
	for case in floor_new article plpgsql_new ext_new; do
		run_case "$case" "$c" main ""
	done
	for case in floor_replay plpgsql_replay ext_replay; do
		run_case "$case" "$c" main "$REPLAY_RECORDS" -D rp=r -D "nrep=$REPLAY_RECORDS"
	done
done
run_case ext_hot_key 8 main "" -D "hotn=$HOT_N"

# ---------------------------------------------------------------------------
# scale: 100,000 then --records live records, 8 clients
# ---------------------------------------------------------------------------
SCALE_CLIENTS=8
log "scale: $SMALL_RECORDS live records"
q "TRUNCATE idempotency.records"
psql_db -v from=1 -v to="$SMALL_RECORDS" -v req="$REQ" -v resp="$RESP" -v spread="$SPREAD" -f "$BENCH_DIR/load_records.sql"
q "VACUUM ANALYZE idempotency.records"
n=$(live_records)
run_case ext_replay "$SCALE_CLIENTS" scale "$n" -D rp=m -D "nrep=$SMALL_RECORDS"
n=$(live_records)
run_case ext_new "$SCALE_CLIENTS" scale "$n"

log "scale: loading up to $BIG_RECORDS live records (two sessions)"
t_load=$EPOCHREALTIME
q "TRUNCATE idempotency.records"
half=$((BIG_RECORDS / 2))
pids=()
psql_db -v from=1 -v to="$half" -v req="$REQ" -v resp="$RESP" -v spread="$SPREAD" -f "$BENCH_DIR/load_records.sql" & pids+=($!)
psql_db -v from=$((half + 1)) -v to="$BIG_RECORDS" -v req="$REQ" -v resp="$RESP" -v spread="$SPREAD" -f "$BENCH_DIR/load_records.sql" & pids+=($!)
for p in "${pids[@]}"; do wait "$p" || die "loading the records failed"; done
q "VACUUM ANALYZE idempotency.records"
LOAD_SECS=$(awk "BEGIN{printf \"%.0f\", $EPOCHREALTIME - $t_load}")
log "loaded in ${LOAD_SECS}s"
n=$(live_records)
run_case ext_replay "$SCALE_CLIENTS" scale "$n" -D rp=m -D "nrep=$BIG_RECORDS"
n=$(live_records)
run_case ext_new "$SCALE_CLIENTS" scale "$n"

# ---------------------------------------------------------------------------
# memory: one backend, 1,000 then --memory-calls acquire/complete pairs
# ---------------------------------------------------------------------------
log "memory: one session, $MEMORY_CALLS acquire/complete pairs"
t_mem=$EPOCHREALTIME
MEM=$(psql_db -v calls="$MEMORY_CALLS" -f "$BENCH_DIR/memory.sql")
MEM_SECS=$(awk "BEGIN{printf \"%.0f\", $EPOCHREALTIME - $t_mem}")
read -r _ m1_calls m1_ctx m1_anon m1_rss <<<"$(sed -n 1p <<<"$MEM")"
read -r _ m2_calls m2_ctx m2_anon m2_rss <<<"$(sed -n 2p <<<"$MEM")"
log "memory: contexts $m1_ctx -> $m2_ctx bytes, RssAnon $m1_anon -> $m2_anon kB (${MEM_SECS}s)"

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
		PERF_REPORT="perf is not installed: no profile."
	else
		pdur=$((DURATION < 10 ? DURATION : 10))
		for case in ext_replay floor_replay ext_new floor_new; do
			log "perf: $case, 8 clients, ${pdur}s"
			# ext's table holds the big load now; the floor's its replay set
			extra=()
			[[ $case == ext_replay ]] && extra=(-D rp=m -D "nrep=$BIG_RECORDS")
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

report() {
	echo "# idempotency benchmark"
	echo
	echo "- date: $STAMP"
	echo "- machine: $(nproc) CPUs ($CPU_MODEL), $MEM_TOTAL memory, $(uname -r)"
	echo "- PostgreSQL: $PG_VERSION"
	echo "- statistics: --stats $STATS, shared_preload_libraries = '$PRELOAD'; idem_stats_enabled(): $STATS_ENABLED"
	echo "- prefilled records (replay sets, scale loads) expire evenly over the next $SPREAD (--spread)"
	echo "- command: \`$COMMAND\`; run time ${RUN_SECS}s$( ((PERF)) && echo ", then ${PERF_SECS}s of profiling" || true)"
	echo "- load average (1, 5, 15 min) before the run: $LOAD_START; after it: $LOAD_END (other work on the machine shows here)"
	echo "- tree: \`$GIT_HEAD\`; uncommitted changes outside bench/: ${GIT_DIRTY:-none};" \
		"sha256 of the extension's sources (*.c *.h *.sql *.control Makefile) as built: ${SRC_DIGEST:0:16}"
	echo "- pgbench: \`pgbench -n -M prepared -h 127.0.0.1 -c C -j min(C,2) -T $DURATION -l\`, the scripts in bench/cases/;" \
		"latency from the per-transaction log (every transaction); pgbench runs on the same 2 CPUs"
	echo "- server: $SETTINGS; CHECKPOINT before every case"
	echo "- request \`$REQ\`, response \`$RESP\`, keys md5 hex (32 characters), scope ''"
	echo
	echo "## Cases"
	echo
	awk -F'\t' -v OFS=' | ' '
		function floor_of(c) {
			if (c == "ext_new" || c == "plpgsql_new" || c == "article" || c == "floor_new") return "floor_new"
			if (c == "ext_replay" || c == "plpgsql_replay" || c == "floor_replay") return "floor_replay"
			return ""
		}
		{ row[NR] = $0; tps[$1, $2, $3] = $5 }
		END {
			print "| case | clients | TPS | avg ms | p50 ms | p99 ms | TPS / floor | transactions | index scans / tx | buffers / tx | OS reads / tx | check |"
			print "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
			for (i = 1; i <= NR; i++) {
				split(row[i], f, "\t")
				if (f[1] != "main") continue
				fl = floor_of(f[2]); ratio = "—"
				if (fl != "" && tps["main", fl, f[3]] > 0)
					ratio = sprintf("%.2f", f[5] / tps["main", fl, f[3]])
				printf "| %s | %s | %.0f | %.3f | %.3f | %.3f | %s | %d | %.2f | %.1f | %.2f | %s |\n",
					f[2], f[3], f[5], f[6] / 1000, f[7] / 1000, f[8] / 1000, ratio, f[9],
					(f[9] > 0 ? f[13] / f[9] : 0), (f[9] > 0 ? (f[14] + f[15]) / f[9] : 0),
					(f[9] > 0 ? f[15] / f[9] : 0), f[11]
			}
		}' "$RESULTS"
	echo
	echo "Floors: ext_new, plpgsql_new and article against floor_new; ext_replay and plpgsql_replay against floor_replay (same run, same clients)."
	echo "Index scans, buffers (shared buffer hits + reads) and OS reads (blocks not in shared buffers, read from the kernel) per transaction:" \
		"from pg_stat_user_tables / pg_statio_user_tables over the tables the case uses (all partitions), heap, indexes and TOAST."
	echo
	echo "## Scale (8 clients; live records in idempotency.records when the case starts)"
	echo
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
	echo
	echo "## Memory of one backend ($MEMORY_CALLS acquire/complete pairs, each its own transaction, in a DO block; ${MEM_SECS}s)"
	echo
	echo "| after pairs | memory contexts (sum of total_bytes) | RssAnon | VmRSS (counts shared buffers touched) |"
	echo "|---:|---:|---:|---:|"
	echo "| $m1_calls | $m1_ctx B | $m1_anon kB | $m1_rss kB |"
	echo "| $m2_calls | $m2_ctx B | $m2_anon kB | $m2_rss kB |"
	echo "| growth | $((m2_ctx - m1_ctx)) B | $((m2_anon - m1_anon)) kB | $((m2_rss - m1_rss)) kB |"
	echo
	echo "## Checks"
	echo
	awk -F'\t' '{ printf "- %s %s, %s clients: %s — %s\n", $1, $2, $3, $11, $12 }' "$RESULTS"
	echo
	echo "## Targets (issue 4)"
	echo
	awk -F'\t' -v small="$SMALL_RECORDS" \
		-v mctx=$((m2_ctx - m1_ctx)) -v manon=$((m2_anon - m1_anon)) '
		$1 == "main" { tps[$2, $3] = $5; p99[$2, $3] = $8 }
		$1 == "scale" { if (!($2 in s0)) s0[$2] = $5; else s1[$2] = $5 }
		function verdict(ok) { return ok ? "met" : "**missed**" }
		END {
			print "| target | measured | verdict |"
			print "|---|---|---|"
			split("2 8", cs, " ")
			for (k = 1; k <= 2; k++) {
				c = cs[k]
				r = (tps["floor_new", c] > 0) ? tps["ext_new", c] / tps["floor_new", c] : 0
				printf "| ext_new ≥ 0.75 × floor_new, %s clients | %.2f | %s |\n", c, r, verdict(r >= 0.75)
				r = (tps["plpgsql_new", c] > 0) ? tps["ext_new", c] / tps["plpgsql_new", c] : 0
				printf "| ext_new ≥ 2 × plpgsql_new, %s clients | %.2f× | %s |\n", c, r, verdict(r >= 2)
				r = (tps["floor_replay", c] > 0) ? tps["ext_replay", c] / tps["floor_replay", c] : 0
				printf "| ext_replay ≥ 0.7 × floor_replay, %s clients | %.2f | %s |\n", c, r, verdict(r >= 0.7)
				r = (tps["plpgsql_replay", c] > 0) ? tps["ext_replay", c] / tps["plpgsql_replay", c] : 0
				printf "| ext_replay ≥ 3 × plpgsql_replay, %s clients | %.2f× | %s |\n", c, r, verdict(r >= 3)
			}
			printf "| p99 of ext_new < 1 ms, 8 clients | %.3f ms | %s |\n", p99["ext_new", 8] / 1000, verdict(p99["ext_new", 8] > 0 && p99["ext_new", 8] < 1000)
			printf "| p99 of ext_replay < 1 ms, 8 clients | %.3f ms | %s |\n", p99["ext_replay", 8] / 1000, verdict(p99["ext_replay", 8] > 0 && p99["ext_replay", 8] < 1000)
			for (c in s0) {
				r = (s0[c] > 0) ? s1[c] / s0[c] : 0
				printf "| %s at the most records within 15%% of at %d | %.2f | %s |\n", c, small, r, verdict(r >= 0.85)
			}
			printf "| backend memory growth < 1 MB, 1,000 → many pairs | contexts %+d B, RssAnon %+d kB | %s |\n", mctx, manon, verdict(mctx < 1048576 && manon < 1024)
		}' "$RESULTS"
	if [[ -n $PERF_REPORT ]]; then
		echo
		echo "## Profile"
		echo
		echo "\`perf record -F 997 -g -p <the 8 backends>\` for ${pdur:-0}s during extra 8-client runs after the measurements" \
			"(ext_replay on the $BIG_RECORDS-record table, floor_replay on its $REPLAY_RECORDS rows); not part of the numbers above." \
			"Symbols of static functions of the stripped postgres binary show as addresses."
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
