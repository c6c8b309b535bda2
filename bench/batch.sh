#!/usr/bin/env bash
# bench/batch.sh -- queue consumers: a batch of messages claimed in one
# statement against one message per statement, with the extension and with
# the article's idempotency_records table (issue 39)
#
#   bash bench/batch.sh [--rounds N] [--duration S] [--clients C[,C...]]
#                       [--batch B]
#
# On a private copy of the host's PostgreSQL 15 (scripts/common.sh's
# use_private_pg) with this tree's extension, a throwaway cluster (fsync
# and synchronous_commit off: CPU cost, as BENCHMARKS.md's main figures),
# the library preloaded.  Each consumer (a pgbench client, -M prepared)
# runs one of four cases, each one statement or one transaction per
# delivery:
#
#   ext_batch       README.md's "Queue consumers" statement over a batch of
#                   --batch messages: the distinct ids, sorted, each claimed
#                   by idem_acquire (request NULL), the acquired ones shipped
#                   (INSERT INTO bench.shipped) and completed, in one
#                   statement
#   ext_single      the same statement over a batch of one message
#   article_batch   the article's scheme over a batch: INSERT ... ON
#                   CONFLICT DO NOTHING RETURNING into its table, ship what
#                   it inserted, UPDATE those to COMPLETED; one transaction
#   article_single  the same over one message
#
# The messages: a batch is ids m<b+0> .. m<b+89> and m<b+0> .. m<b+9> again
# (ten duplicates inside the batch), b drawn at random from --space (so
# batches of different consumers and of one consumer over time overlap:
# redeliveries).  A single message is one id of such a batch.  Every run
# starts from empty tables (TRUNCATE, the known-absent filters built,
# CHECKPOINT).  Its honesty checks: no
# failed transaction, every message shipped at most once (bench.shipped's
# ids are distinct), and every shipped id has a completed record.
#
# Rounds interleave the cases (the order rotates each round); the report
# gives per case and client count the median messages a second (delivered,
# duplicates included) and shipped a second over the rounds, and the
# per-round ratios ext_batch/ext_single, ext_batch/article_batch and
# ext_single/article_single with their medians.  It is printed and written
# to bench/results/batch-<UTC time>.md.
#
# as root on Debian 12; with the defaults (3 rounds, 10 s, 2 and 8
# clients) about 6 minutes.
set -euo pipefail

BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROUNDS=3
DURATION=10
CLIENTS=2,8
BATCH=100
SPACE=2000000

usage() {
	sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
	exit "${1:-0}"
}
while (($#)); do
	case $1 in
	--rounds) ROUNDS=${2:?}; shift 2 ;;
	--duration) DURATION=${2:?}; shift 2 ;;
	--clients) CLIENTS=${2:?}; shift 2 ;;
	--batch) BATCH=${2:?}; shift 2 ;;
	--space) SPACE=${2:?}; shift 2 ;;
	-h | --help) usage 0 ;;
	*) echo "unknown option: $1" >&2; usage 2 ;;
	esac
done
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || { echo "--rounds takes a number of at least 1" >&2; exit 2; }
[[ $DURATION =~ ^[1-9][0-9]*$ ]] || { echo "--duration takes whole seconds" >&2; exit 2; }
[[ $BATCH =~ ^[0-9]+$ && $BATCH -ge 10 ]] || { echo "--batch takes a number of at least 10" >&2; exit 2; }
IFS=, read -r -a CLIENT_COUNTS <<<"$CLIENTS"

IDEM_PG_MAJOR=15
# shellcheck source=scripts/common.sh
source "$BENCH_DIR/../scripts/common.sh"
IDEM_QUIET=1
use_private_pg
build_install
start_cluster fast
PGBENCH=$PG_BINDIR/pgbench
psql=("$PG_BINDIR/psql" -X -q -v ON_ERROR_STOP=1 -d idem_batch)
"$PG_BINDIR/psql" -X -q -c 'CREATE DATABASE idem_batch'
"${psql[@]}" -c 'CREATE SCHEMA bench' -f "$BENCH_DIR/article_table.sql"
"${psql[@]}" <<-'EOF'
	CREATE EXTENSION idempotency;
	-- no unique index: a message shipped twice is counted, not refused
	CREATE TABLE bench.shipped (event_id text NOT NULL, tx bigint NOT NULL);
	CREATE INDEX ON bench.shipped (tx);
EOF

CASES=(ext_batch ext_single article_batch article_single)
W=$IDEM_TMPDIR/batch
mkdir -p "$W"
chmod 755 "$W"
# The messages of a delivery: n ids from b (n = 1 or --batch), the first
# tenth of them twice when n > 1.
ids_sql="SELECT 'm' || (:b + g % (:n - :n / 10)) AS id FROM generate_series(0, :n - 1) g"
for c in "${CASES[@]}"; do
	f=$W/$c.pgbench
	{
		echo "\\set b random(1, $SPACE)"
		case $c in
		*_batch) echo "\\set n $BATCH" ;;
		*_single) echo "\\set n 1" ;;
		esac
		case $c in
		ext_*)
			cat <<-EOF
				WITH claimed AS (
				    SELECT m.id, a.outcome
				      FROM (SELECT DISTINCT id FROM ($ids_sql) d ORDER BY id) m
				     CROSS JOIN LATERAL idempotency.idem_acquire(m.id, NULL, 'queue-bench') a),
				shipped AS (
				    INSERT INTO bench.shipped SELECT id, txid_current() FROM claimed WHERE outcome = 'acquired'
				    RETURNING event_id)
				SELECT count(*) FILTER (WHERE c.outcome = 'acquired') AS acquired,
				       count(CASE WHEN s.event_id IS NOT NULL
				                  THEN idempotency.idem_complete(s.event_id, 200, scope => 'queue-bench') END) AS completed
				  FROM claimed c LEFT JOIN shipped s ON s.event_id = c.id;
			EOF
			;;
		article_*)
			cat <<-EOF
				BEGIN;
				WITH m AS (SELECT DISTINCT id FROM ($ids_sql) d ORDER BY id),
				ins AS (
				    INSERT INTO bench.idempotency_records (idempotency_key, status, expires_at)
				    SELECT id, 'PROCESSING', now() + interval '24 hours' FROM m ORDER BY id
				    ON CONFLICT (idempotency_key) DO NOTHING
				    RETURNING idempotency_key)
				INSERT INTO bench.shipped SELECT idempotency_key, txid_current() FROM ins;
				UPDATE bench.idempotency_records r
				   SET status = 'COMPLETED', response_status = 200, updated_at = now()
				  FROM bench.shipped s
				 WHERE s.tx = txid_current() AND r.idempotency_key = s.event_id;
				COMMIT;
			EOF
			;;
		esac
	} >"$f"
done

# run CASE CLIENTS ROUND: one pgbench run from empty tables; prints
# "messages/s shipped/s" and checks its honesty.
run() {
	local c=$1 n=$2 out tps per shipped dup orphan
	"${psql[@]}" -c 'TRUNCATE idempotency.records, bench.shipped, bench.idempotency_records' \
		-c 'SELECT idempotency.build_filters()' -c 'CHECKPOINT' >/dev/null
	out=$W/$c-$n-$3.out
	"$PGBENCH" -n -M prepared -c "$n" -j "$((n < 2 ? n : 2))" -T "$DURATION" \
		-f "$W/$c.pgbench" idem_batch >"$out" 2>&1 || { cat "$out" >&2; die "$c: pgbench failed"; }
	grep -q '^number of failed transactions: 0 ' "$out" ||
		! grep -q '^number of failed transactions' "$out" || { cat "$out" >&2; die "$c: failed transactions"; }
	tps=$(sed -n 's/^tps = \([0-9.]*\) .*/\1/p' "$out")
	[[ $c == *_batch ]] && per=$BATCH || per=1
	read -r shipped dup orphan < <("${psql[@]}" -At -F ' ' -c "
		SELECT (SELECT count(*) FROM bench.shipped),
		       (SELECT count(*) - count(DISTINCT event_id) FROM bench.shipped),
		       (SELECT count(*) FROM bench.shipped s WHERE NOT EXISTS (
		            SELECT FROM idempotency.records r
		             WHERE r.scope = 'queue-bench' AND r.key = s.event_id AND r.status = 'completed'
		            UNION ALL
		            SELECT FROM bench.idempotency_records a
		             WHERE a.idempotency_key = s.event_id AND a.status = 'COMPLETED'))")
	((dup == 0)) || die "$c: $dup messages shipped twice"
	((orphan == 0)) || die "$c: $orphan shipped messages without a completed record"
	awk -v t="$tps" -v p="$per" -v s="$shipped" -v d="$DURATION" \
		'BEGIN { printf "%.0f %.0f\n", t * p, s / d }'
}

STAMP=$(date -u +%Y-%m-%dT%H:%M:%SZ)
REPORT=$BENCH_DIR/results/batch-$STAMP.md
mkdir -p "$BENCH_DIR/results"
LOAD=$(cut -d' ' -f1-3 /proc/loadavg)
declare -A MSGS SHIP
for ((r = 1; r <= ROUNDS; r++)); do
	for n in "${CLIENT_COUNTS[@]}"; do
		# the order rotates each round
		for ((i = 0; i < ${#CASES[@]}; i++)); do
			c=${CASES[$(((i + r - 1) % ${#CASES[@]}))]}
			read -r m s < <(run "$c" "$n" "$r")
			MSGS[$c,$n,$r]=$m
			SHIP[$c,$n,$r]=$s
			log "round $r, $n clients, $c: $m messages/s, $s shipped/s"
		done
	done
done

median() { sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else printf "%.2f\n", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
{
	echo "# bench/batch.sh, $STAMP"
	echo
	echo "\`bash bench/batch.sh --rounds $ROUNDS --duration $DURATION --clients $CLIENTS --batch $BATCH\`"
	echo "at $(git -C "$BENCH_DIR/.." rev-parse --short HEAD 2>/dev/null || echo '?'),"
	echo "PostgreSQL $("$PG_BINDIR/psql" -XAtq -c 'SHOW server_version'), load before: $LOAD, after: $(cut -d' ' -f1-3 /proc/loadavg)."
	echo
	echo "| case | clients | messages/s (median) | shipped/s (median) | per round (messages/s) |"
	echo "|---|---:|---:|---:|---|"
	for n in "${CLIENT_COUNTS[@]}"; do
		for c in "${CASES[@]}"; do
			rounds=$(for ((r = 1; r <= ROUNDS; r++)); do echo "${MSGS[$c,$n,$r]}"; done)
			ships=$(for ((r = 1; r <= ROUNDS; r++)); do echo "${SHIP[$c,$n,$r]}"; done)
			echo "| $c | $n | $(median <<<"$rounds") | $(median <<<"$ships") | $(echo $rounds | tr ' ' ',') |"
		done
	done
	echo
	echo "| ratio (messages/s, per round) | clients | median | rounds |"
	echo "|---|---:|---:|---|"
	for n in "${CLIENT_COUNTS[@]}"; do
		for pair in ext_batch/ext_single ext_batch/article_batch ext_single/article_single article_batch/article_single; do
			a=${pair%/*} b=${pair#*/}
			ratios=$(for ((r = 1; r <= ROUNDS; r++)); do
				awk -v x="${MSGS[$a,$n,$r]}" -v y="${MSGS[$b,$n,$r]}" 'BEGIN { printf "%.2f\n", x / y }'
			done)
			echo "| $pair | $n | $(median <<<"$ratios") | $(echo $ratios | tr ' ' ',') |"
		done
	done
} | tee "$REPORT"
log "report: $REPORT"
