#!/usr/bin/env bash
# bench/wal_storage.sh -- WAL per new key, records by type, full-page images
# after a CHECKPOINT, bytes per record and the fraction of HOT completions of
# ext_new, floor_new, article and plpgsql_new (issue 30)
#
# Builds and installs this tree (or --rev REV) into a private copy of
# PostgreSQL (scripts/common.sh use_private_pg), starts a throwaway cluster
# on 127.0.0.1 (autovacuum off, no checkpoint but the script's own), and,
# for each case of bench/cases in turn, with a 200-byte request and a
# 300-byte response and --clients clients:
#
#   fill       --records new keys (pgbench -t), so that the indexes and
#              the heap are in the steady state of a table that grows
#   window 1   CHECKPOINT, then --window new keys: full-page images per key
#              (every block reference pg_waldump marks FPW) and their
#              bytes per key
#   window 2,3 --window new keys each, no checkpoint: WAL bytes per key
#              without images (pg_waldump --stats=record's record sizes),
#              the records per key by type, and the HOT completions
#              (pg_stat_user_tables n_tup_hot_upd / n_tup_upd)
#   window 4   VACUUM of the case's tables (its WAL per record the tables
#              held), then --window new keys: the same
#   storage    heap (main fork) and index bytes per record of the tables
#              that hold rows, rows per heap page
#
# Windows 2 and 3 are two measures of the same steady state: the report
# gives both, so that their difference shows whether --records and
# --window are large enough (byte counts, not timings: one run suffices).
# The minimum per key is computed from window 2's own records: the mean
# Heap/INSERT + the mean Btree/INSERT_LEAF times the table's indexes + the
# mean Heap/HOT_UPDATE (Heap/UPDATE when none was HOT) + the mean
# Transaction/COMMIT: what a key writes with every completion HOT and no
# page split or prune.
#
#   bash bench/wal_storage.sh [--records N] [--window N] [--clients N]
#                             [--cases "ext floor article plpgsql"]
#                             [--ext-sql FILE] [--rev REV] [--pg MAJOR]
#
# --records: new keys before the windows (default 100000).
# --window: new keys per window (default 20000).
# --clients: pgbench clients (default 2).
# --cases: which cases, in this order (default all four).
# --ext-sql: a psql file run after the set-up, before the fill, as the
# extension's owner (to try a partition layout, say: ALTER TABLE ... SET
# (fillfactor = 85)); the report names it.
# --rev: measure the extension of git revision REV instead of this tree
# (a `git archive` copy, with this checkout's bench/ over its own).
# --pg: 15 (the host's, the default) or a major of scripts/matrix.sh: the
# script runs again in that major's Debian root, on a copy of the tree.
#
# The report is printed and written to bench/results/wal_storage-latest.md
# (and wal_storage-<UTC time>.md).  As root on Debian 12; about 6 minutes
# with the defaults on a quiet 2-core machine.
set -euo pipefail

BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
RECORDS=100000
WINDOW=20000
CLIENTS=2
CASES="ext floor article plpgsql"
EXT_SQL=
REV=
PG_MAJOR=15
ARGS=("$@")
while (($#)); do
	case $1 in
	--records) RECORDS=${2:?}; shift 2 ;;
	--window) WINDOW=${2:?}; shift 2 ;;
	--clients) CLIENTS=${2:?}; shift 2 ;;
	--cases) CASES=${2:?}; shift 2 ;;
	--ext-sql) EXT_SQL=$(realpath "${2:?}"); shift 2 ;;
	--rev) REV=${2:?}; shift 2 ;;
	--pg) PG_MAJOR=${2:?}; shift 2 ;;
	-h | --help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
	*) echo "unknown option: $1" >&2; exit 2 ;;
	esac
done
[[ $RECORDS =~ ^[0-9]+$ && $WINDOW =~ ^[0-9]+$ && $CLIENTS =~ ^[0-9]+$ ]] ||
	{ echo "--records, --window and --clients take numbers" >&2; exit 2; }
((WINDOW % CLIENTS == 0 && RECORDS % CLIENTS == 0)) ||
	{ echo "--records and --window must be multiples of --clients" >&2; exit 2; }
COMMAND="bash bench/wal_storage.sh"
for a in "${ARGS[@]}"; do COMMAND+=" $(printf '%q' "$a")"; done
COMMAND=${IDEM_WS_COMMAND:-$COMMAND}

# --rev: this script again, in a copy of REV with this checkout's bench/
if [[ -n $REV ]]; then
	src=$(mktemp -d /tmp/idem-wal-storage.XXXXXX)
	trap 'rm -rf "$src"' EXIT
	git -C "$BENCH_DIR/.." archive "$REV" | tar -x -C "$src"
	rm -rf "$src/bench"
	cp -a "$BENCH_DIR" "$src/bench"
	rm -rf "$src/bench/results"
	mkdir -p "$BENCH_DIR/results"
	ln -s "$BENCH_DIR/results" "$src/bench/results"
	args=()
	while ((${#ARGS[@]})); do
		if [[ ${ARGS[0]} == --rev ]]; then ARGS=("${ARGS[@]:2}"); continue; fi
		args+=("${ARGS[0]}"); ARGS=("${ARGS[@]:1}")
	done
	IDEM_WS_COMMAND=$COMMAND IDEM_WS_REV="$(git -C "$BENCH_DIR/.." log --oneline -1 "$REV")" \
		bash "$src/bench/wal_storage.sh" "${args[@]}"
	exit $?
fi

IN_ROOT=${IDEM_BENCH_IN_ROOT:-0}
if [[ $PG_MAJOR != 15 && $IN_ROOT != 1 ]]; then
	# shellcheck source=scripts/matrix.sh
	source "$BENCH_DIR/../scripts/matrix.sh"
	mx_init
	mx_enter "$PG_MAJOR" || die "no root for PostgreSQL $PG_MAJOR: $(cat "$MX_TMP/reason")"
	root=$(cat "$MX_TMP/root")
	# The root starts in / with an empty environment: --ext-sql goes in as a
	# copy under /build, and the WS_ settings it reads go along.
	args=()
	while ((${#ARGS[@]})); do
		if [[ ${ARGS[0]} == --ext-sql ]]; then ARGS=("${ARGS[@]:2}"); continue; fi
		args+=("${ARGS[0]}"); ARGS=("${ARGS[@]:1}")
	done
	if [[ -n $EXT_SQL ]]; then
		mkdir -p "$root/build/.ws_ext_sql"
		cp "$EXT_SQL" "$root/build/.ws_ext_sql/"
		args+=(--ext-sql "/build/.ws_ext_sql/$(basename "$EXT_SQL")")
	fi
	ws_env=()
	for v in WS_FILLFACTOR WS_ORDER WS_AUTOVACUUM; do
		if [[ -n ${!v:-} ]]; then ws_env+=("$v=${!v}"); fi
	done
	rc=0
	mx_in_root "$root" IDEM_BENCH_IN_ROOT=1 IDEM_WS_COMMAND="$COMMAND" \
		IDEM_WS_REV="${IDEM_WS_REV:-$(git -C "$BENCH_DIR/.." log --oneline -1 2>/dev/null)}" \
		"${ws_env[@]}" bash /build/bench/wal_storage.sh "${args[@]}" </dev/null || rc=$?
	mkdir -p "$BENCH_DIR/results"
	cp -a "$root/build/bench/results/." "$BENCH_DIR/results/" 2>/dev/null || true
	mx_leave
	exit "$rc"
fi
IDEM_PG_MAJOR=$PG_MAJOR
# shellcheck source=scripts/common.sh
source "$BENCH_DIR/../scripts/common.sh"
REV_LINE=${IDEM_WS_REV:-$(git -C "$REPO_ROOT" log --oneline -1 2>/dev/null || echo "a copy of the tree")}
DIRTY=$(git -C "$REPO_ROOT" status --short -- . ':!bench' ':!BENCHMARKS.md' 2>/dev/null | wc -l || true)
((${DIRTY:-0} > 0)) && REV_LINE+=" (with uncommitted changes)"

# a 200-byte request and a 300-byte response (their jsonb text)
pad() { local s=$1 n=$2 fill; fill=$(printf '%*s' $((n - ${#s} - 2)) '' | tr ' ' x); printf '%s"%s"}' "$s" "$fill"; }
REQ=$(pad '{"order": "A-1001", "currency": "EUR", "amount_cents": 2000, "note": ' 200)
RESP=$(pad '{"payment_id": 7, "status": "succeeded", "amount_cents": 2000, "receipt": ' 300)

IDEM_QUIET=1
((IN_ROOT)) || use_private_pg
# Only this tree's scripts: a full script of a version this tree has as an
# update (left in the host's installation by another build) would win.
rm -f "$("$PG_CONFIG" --sharedir)"/extension/idempotency--*.sql
install_deps
build_install
# shellcheck disable=SC2119
start_cluster
as_postgres tee -a "$IDEM_PGDATA/postgresql.conf" >/dev/null <<EOF

# bench/wal_storage.sh
shared_buffers = 512MB
synchronous_commit = off
full_page_writes = on
max_wal_size = 20GB
min_wal_size = 2GB
wal_keep_size = 4GB
checkpoint_timeout = 1h
autovacuum = off
max_locks_per_transaction = 128
EOF
as_postgres "$PG_BINDIR/pg_ctl" restart -D "$IDEM_PGDATA" -m fast -w -t 120 \
	-l "$IDEM_SERVER_LOG" >/dev/null || die "the server did not restart"

DB=idem_ws
WORK=$IDEM_TMPDIR/ws
mkdir -p "$WORK"
chmod 777 "$WORK"
psql_db() { "$PG_BINDIR/psql" -X -q -A -t -v ON_ERROR_STOP=1 -h 127.0.0.1 -d "$DB" "$@"; }
q() { psql_db -c "$1"; }
"$PG_BINDIR/psql" -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -d postgres -c "CREATE DATABASE $DB"
psql_db -f "$BENCH_DIR/setup.sql" >/dev/null
[[ -n $EXT_SQL ]] && psql_db -f "$EXT_SQL" >/dev/null
q "SELECT idempotency.build_filters()" >/dev/null 2>&1 || true
VERSION=$(q "SELECT extversion FROM pg_extension WHERE extname = 'idempotency'")

# relids CASE: the tables of a case, as a SQL array of regclass
relids() {
	case $1 in
	ext) echo "(SELECT array_agg(inhrelid::regclass) FROM pg_inherits WHERE inhparent = 'idempotency.records'::regclass)" ;;
	plpgsql) echo "(SELECT array_agg(inhrelid::regclass) FROM pg_inherits WHERE inhparent = 'plidem.records'::regclass)" ;;
	floor) echo "ARRAY['bench.floor'::regclass]" ;;
	article) echo "ARRAY['bench.idempotency_records'::regclass]" ;;
	esac
}
script_of() {
	case $1 in
	ext) echo ext_new ;; floor) echo floor_new ;; article) echo article ;; plpgsql) echo plpgsql_new ;;
	esac
}

wait_idle() {
	for _ in $(seq 1 300); do
		[[ $(q "SELECT count(*) FROM pg_stat_activity WHERE datname = '$DB' AND pid <> pg_backend_pid()") == 0 ]] && return 0
		sleep 0.1
	done
	log "warning: sessions still connected after 30s"
}

# upd CASE: "n_tup_upd n_tup_hot_upd" summed over the case's tables
upd() {
	q "SELECT coalesce(sum(n_tup_upd), 0) || ' ' || coalesce(sum(n_tup_hot_upd), 0)
	     FROM pg_stat_user_tables WHERE relid = ANY ($(relids "$1")::oid[])"
}

# keys CASE LABEL N: N new keys of the case, prefix LABEL
keys() {
	local case=$1 label=$2 n=$3 out=$WORK/$1-$2.out
	"$PG_BINDIR/pgbench" -n -M prepared -h 127.0.0.1 -c "$CLIENTS" -j "$CLIENTS" -t $((n / CLIENTS)) \
		-D n=0 -D "kp=$case-$label-" -D "req=$REQ" -D "resp=$RESP" \
		-f "$BENCH_DIR/cases/$(script_of "$case").pgbench" "$DB" >"$out" 2>&1 ||
		{ cat "$out" >&2; die "pgbench $case $label failed"; }
	grep -q "number of failed transactions: 0" "$out" || grep -q "^number of transactions actually processed: $n/$n" "$out" ||
		{ cat "$out" >&2; die "pgbench $case $label: not every transaction went through"; }
	wait_idle
}

# window CASE LABEL: one window of new keys; writes $WORK/CASE-LABEL.stats
# (pg_waldump --stats=record), .fpi (block images), .hot ("upd hot")
window() {
	local case=$1 label=$2 start end u0 u1
	u0=$(upd "$case")
	start=$(q "SELECT pg_current_wal_insert_lsn()")
	keys "$case" "$label" "$WINDOW"
	end=$(q "SELECT pg_current_wal_insert_lsn()")
	# synchronous_commit is off: a commit that waits for its flush
	q "BEGIN; SET LOCAL synchronous_commit = on; SELECT pg_current_xact_id(); COMMIT" >/dev/null
	u1=$(upd "$case")
	# (again after a pause if the window's last page is not on disk yet)
	for try in 1 2 3 4 5 6; do
		as_postgres "$PG_BINDIR/pg_waldump" -p "$IDEM_PGDATA/pg_wal" -s "$start" -e "$end" --stats=record \
			>"$WORK/$case-$label.stats" 2>"$WORK/$case-$label.err" && break
		((try < 6)) || { cat "$WORK/$case-$label.err" >&2; die "pg_waldump failed"; }
		sleep 1
		q "BEGIN; SET LOCAL synchronous_commit = on; SELECT pg_current_xact_id(); COMMIT" >/dev/null
	done
	as_postgres "$PG_BINDIR/pg_waldump" -p "$IDEM_PGDATA/pg_wal" -s "$start" -e "$end" 2>/dev/null |
		grep -o 'FPW' | wc -l >"$WORK/$case-$label.fpi" || true
	echo "$u0 $u1" | awk '{ print $3 - $1, $4 - $2 }' >"$WORK/$case-$label.hot"
}

# stat FILE TYPE FIELD: count (2), record bytes (3) or FPI bytes (4) of a
# record type in a --stats=record file; "Total" for the whole window
stat() {
	sed 's/([^)]*)//g; s/\[[^]]*\]//g' "$1" | awk -v t="$2" -v f="$3" '$1 == t { v = $f } END { print v + 0 }'
}

REPORT=$WORK/report.md
STAMP=$(date -u +%Y-%m-%dT%H:%M:%SZ)
{
	echo "# WAL and storage per new key (bench/wal_storage.sh)"
	echo
	echo "- $STAMP, PostgreSQL $("$PG_BINDIR/psql" -XAtq -c 'SHOW server_version'), extension $VERSION: $REV_LINE"
	echo "- $RECORDS keys before the windows, windows of $WINDOW keys, $CLIENTS clients; request ${#REQ} B, response ${#RESP} B (jsonb text)"
	[[ -n $EXT_SQL ]] && echo "- --ext-sql $(basename "$EXT_SQL")"
	echo "- \`$COMMAND\`"
	echo
} >"$REPORT"

SUMMARY=$WORK/summary.tsv
: >"$SUMMARY"
for case in $CASES; do
	log "$case: $RECORDS keys"
	keys "$case" fill "$RECORDS"
	q "CHECKPOINT" >/dev/null
	log "$case: window 1 (after CHECKPOINT)"
	window "$case" w1
	log "$case: windows 2 and 3"
	window "$case" w2
	window "$case" w3
	log "$case: VACUUM, window 4"
	v0=$(q "SELECT pg_current_wal_insert_lsn()")
	q "SELECT format('VACUUM %s', r) FROM unnest($(relids "$case")) r" | while read -r v; do q "$v"; done
	vacuum_wal=$(q "SELECT pg_current_wal_insert_lsn() - '$v0'::pg_lsn")
	window "$case" w4
	# storage of the tables that hold rows
	rows=0 heap=0 idx=0 pages=0 nidx=0
	for r in $(q "SELECT unnest($(relids "$case"))"); do
		read -r n hb ib pg ni <<<"$(q "SELECT count(*), pg_relation_size('$r'), pg_indexes_size('$r'),
			pg_relation_size('$r') / current_setting('block_size')::int,
			(SELECT count(*) FROM pg_index WHERE indrelid = '$r'::regclass) FROM $r" | tr '|' ' ')"
		((n > 0)) || continue
		rows=$((rows + n)) heap=$((heap + hb)) idx=$((idx + ib)) pages=$((pages + pg)) nidx=$ni
	done
	w=$WINDOW
	for l in w1 w2 w3 w4; do
		f=$WORK/$case-$l.stats
		read -r u h <"$WORK/$case-$l.hot"
		printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$case" "$l" \
			"$(stat "$f" Total 3)" "$(stat "$f" Total 4)" "$(cat "$WORK/$case-$l.fpi")" "$u" "$h" >>"$SUMMARY"
	done
	f=$WORK/$case-w2.stats
	hu=Heap/HOT_UPDATE
	(($(stat "$f" $hu 2) == 0)) && hu=Heap/UPDATE
	minimum=$(awk -v i="$(stat "$f" Heap/INSERT 3)" -v ni="$(stat "$f" Heap/INSERT 2)" \
		-v b="$(stat "$f" Btree/INSERT_LEAF 3)" -v nb="$(stat "$f" Btree/INSERT_LEAF 2)" \
		-v u="$(stat "$f" $hu 3)" -v nu="$(stat "$f" $hu 2)" \
		-v c="$(stat "$f" Transaction/COMMIT 3)" -v nc="$(stat "$f" Transaction/COMMIT 2)" -v k="$nidx" \
		'BEGIN { m = (ni ? i / ni : 0) + k * (nb ? b / nb : 0) + (nu ? u / nu : 0) + (nc ? c / nc : 0); printf "%.0f", m }')
	printf '%s\tstorage\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$case" "$rows" "$heap" "$idx" "$pages" "$nidx" "$minimum" "$vacuum_wal" >>"$SUMMARY"
	{
		echo "## $case: records per key by type (window 2, no images; window 3 beside it)"
		echo
		echo "| type | per key (w2) | bytes per key (w2) | per key (w3) | bytes per key (w3) |"
		echo "|---|---:|---:|---:|---:|"
		sed 's/([^)]*)//g' "$WORK/$case-w2.stats" | awk '$1 ~ /\// { print $1 }' | sort -u | while read -r t; do
			awk -v w="$w" -v t="$t" -v n2="$(stat "$WORK/$case-w2.stats" "$t" 2)" -v b2="$(stat "$WORK/$case-w2.stats" "$t" 3)" \
				-v n3="$(stat "$WORK/$case-w3.stats" "$t" 2)" -v b3="$(stat "$WORK/$case-w3.stats" "$t" 3)" \
				'BEGIN { if (n2 / w >= 0.0005) printf "| %s | %.4f | %.1f | %.4f | %.1f |\n", t, n2 / w, b2 / w, n3 / w, b3 / w }'
		done
		echo
	} >>"$REPORT"
done

# the summary table
{
	echo "## Per new key and per record"
	echo
	echo "WAL: record bytes per key without images (windows 2 / 3, after VACUUM: window 4); minimum: from window 2's records (see the script's head)."
	echo "FPI: block images per key right after a CHECKPOINT (window 1), and their bytes per key."
	echo "HOT: n_tup_hot_upd / n_tup_upd of windows 2+3 and of window 4 (after VACUUM)."
	echo
	echo "| case | WAL B/key w2 | w3 | after VACUUM | minimum | WAL / floor's | FPI/key after CHECKPOINT | FPI B/key | HOT | HOT after VACUUM | heap B/rec | index B/rec | B/rec | / floor's | rows/heap page | VACUUM WAL B/rec |"
	echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
	awk -F'\t' -v w="$WINDOW" '
		$2 == "w1" { fpi[$1] = $5 / w; fpib[$1] = $4 / w }
		$2 == "w2" { w2[$1] = $3 / w; u23[$1] += $6; h23[$1] += $7 }
		$2 == "w3" { w3[$1] = $3 / w; u23[$1] += $6; h23[$1] += $7 }
		$2 == "w4" { w4[$1] = $3 / w; u4[$1] = $6; h4[$1] = $7 }
		$2 == "storage" { rows[$1] = $3; heap[$1] = $4; idx[$1] = $5; pages[$1] = $6; min[$1] = $8; vac[$1] = $9; order[++n] = $1 }
		END {
			for (i = 1; i <= n; i++) {
				c = order[i]
				br = (heap[c] + idx[c]) / rows[c]
				fw = ("floor" in w2) ? sprintf("%.3f", w2[c] / w2["floor"]) : "-"
				fb = ("floor" in rows) ? sprintf("%.3f", br / ((heap["floor"] + idx["floor"]) / rows["floor"])) : "-"
				printf "| %s | %.1f | %.1f | %.1f | %d | %s | %.3f | %.1f | %.1f %% | %.1f %% | %.1f | %.1f | %.1f | %s | %.1f | %.1f |\n",
					c, w2[c], w3[c], w4[c], min[c], fw, fpi[c], fpib[c],
					u23[c] ? 100 * h23[c] / u23[c] : 0, u4[c] ? 100 * h4[c] / u4[c] : 0,
					heap[c] / rows[c], idx[c] / rows[c], br, fb, rows[c] / pages[c], vac[c] / (rows[c] - w)
			}
		}' "$SUMMARY"
	echo
} >"$WORK/table.md"
cat "$WORK/table.md" >>"$REPORT"
mkdir -p "$BENCH_DIR/results"
cp "$REPORT" "$BENCH_DIR/results/wal_storage-$STAMP.md"
cp "$REPORT" "$BENCH_DIR/results/wal_storage-latest.md"
cat "$REPORT"
