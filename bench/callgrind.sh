#!/usr/bin/env bash
# bench/callgrind.sh -- instructions per transaction of ext_new and
# ext_replay for one git revision of the extension, counted by callgrind
#
#   bash bench/callgrind.sh [--stats off|on|both] [--spread INTERVAL]
#                           [--filters on|off|both] [--v12] REV [PORT]
#
# Builds REV from a `git archive` copy, installs it into a private copy of
# the host's PostgreSQL 15 (bench/private_pg.sh, under
# /tmp/idem-callgrind/REV: the host's installation is not touched, so no
# lock is needed), initdb's a cluster there (as postgres, 127.0.0.1:PORT,
# default 55411, autovacuum off), loads 20,000 completed records
# (bench/load_records.sql), and restarts the server under valgrind
# --tool=callgrind.  Then it runs this checkout's bench/cases/ext_new.pgbench
# and ext_replay.pgbench with one client, `pgbench -n -M prepared -c 1 -t N`,
# for N = 200 and N = 1200, and prints (total Ir of the 1200-transaction
# backend - total Ir of the 200 one) / 1000: instructions per transaction,
# without the backend's start and warm-up.  pgbench runs with
# --random-seed=1, so ext_replay replays the same keys every time; the
# counts repeat to within a few hundred instructions.
#
# --stats: off (the default, as every count before version 1.1's
# statistics) starts the server without shared_preload_libraries, so the
# extension counts nothing; on preloads 'idempotency' (statistics kept, as
# in bench/run.sh); both measures off and then on, each on a fresh copy of
# the same loaded cluster, and prints the difference and what the
# statistics functions themselves cost (callgrind_annotate, inclusive).
# Under valgrind clock_gettime is a system call, whose instructions are not
# counted: the clock reads of the statistics show only as their libc
# wrapper.  The callgrind files stay in /tmp/idem-callgrind/REV/callgrind-*
# for callgrind_annotate.
#
# --spread: the 20,000 records expire evenly over this window (default
# '1 day': two daily partitions hold them; '6 days': seven).
#
# --filters (with --stats on or both, versions with known-absent filters):
# on (the default) builds the filters (build_filters()) once the server is
# up and runs the cases as they are; off runs them with
# idempotency.use_filters = off; both runs each case both ways on the same
# server, off first.
#
# --v12 (versions 1.2 and later): also loads 20,000 completed records
# whose answer has three response headers (keys md5('h' || i)) and counts
# 1.2's arguments when used, each beside the same calls without them:
# ext_new_trace (idem_acquire's trace), ext_new_headers (idem_complete's
# response_headers), ext_new_checkpoint (one idem_checkpoint between the
# claim and the completion) against ext_new, and ext_replay_headers (a
# replay returning the stored headers) against ext_replay.  As root on
# Debian 12; about 2 minutes a setting, --v12 included.
set -euo pipefail
STATS=off
SPREAD='1 day'
FILTERS=on
V12=
while [[ ${1:-} == --* ]]; do
	case $1 in
	--stats) STATS=${2:?}; shift 2 ;;
	--spread) SPREAD=${2:?}; shift 2 ;;
	--filters) FILTERS=${2:?}; shift 2 ;;
	--v12) V12=1; shift ;;
	*) echo "unknown option: $1" >&2; exit 2 ;;
	esac
done
[[ $STATS == off || $STATS == on || $STATS == both ]] || { echo "--stats takes off, on or both" >&2; exit 2; }
[[ $FILTERS == off || $FILTERS == on || $FILTERS == both ]] || { echo "--filters takes off, on or both" >&2; exit 2; }
REV=${1:?usage: bash bench/callgrind.sh [--stats off|on|both] REV [PORT]} PORT=${2:-55411}
BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=bench/private_pg.sh
source "$BENCH_DIR/private_pg.sh"
W=/tmp/idem-callgrind/$REV
P=$W/pg BIN=$W/pg/lib/postgresql/15/bin T=$W/template
REQ='{"amount_cents": 2000, "currency": "EUR", "order": "A-1001"}'
RESP='{"payment_id": 7, "status": "succeeded", "amount_cents": 2000}'
as_pg() { runuser -u postgres -- "$@"; }

mkdir -p /tmp/idem-callgrind; chmod 755 /tmp/idem-callgrind
rm -rf "$W"; mkdir -p "$W/src"; chmod 755 "$W"
private_pg_make "$P"
git -C "$BENCH_DIR/.." archive "$REV" | tar -x -C "$W/src"
private_pg_install "$P" "$W/src"
mkdir -p "$T/data" "$T/sock"; chown -R postgres: "$T"; chmod 700 "$T/data"
as_pg "$BIN/initdb" -D "$T/data" --auth=trust -U postgres -E UTF8 --locale=C.UTF-8 --no-sync >/dev/null
cat >>"$T/data/postgresql.conf" <<CONF
listen_addresses = '127.0.0.1'
port = $PORT
autovacuum = off
fsync = off
shared_buffers = 256MB
max_wal_size = 4GB
CONF
export PGHOST=127.0.0.1 PGPORT=$PORT PGUSER=postgres
D=$T/data
stop_server() { as_pg "$BIN/pg_ctl" -D "$D" -w -m fast stop >/dev/null 2>&1 || true; }
trap stop_server EXIT
as_pg "$BIN/pg_ctl" -D "$D" -l "$T/server.log" -o "-k $T/sock" -w start >/dev/null
"$BIN/createdb" cmp
"$BIN/psql" -qXAt -d cmp -c 'CREATE EXTENSION idempotency' \
	-c "SELECT 'extension ' || extversion FROM pg_extension WHERE extname = 'idempotency'"
"$BIN/psql" -qX -d cmp -v from=1 -v to=20000 -v req="$REQ" -v resp="$RESP" \
	-v spread="$SPREAD" -f "$BENCH_DIR/load_records.sql"
if [[ -n $V12 ]]; then
	"$BIN/psql" -qX -d cmp -v ON_ERROR_STOP=1 -v req="$REQ" -v resp="$RESP" -v spread="$SPREAD" <<-'SQL'
		SET work_mem = '1GB';
		INSERT INTO idempotency.records (scope, key, status, request_hash, response_status,
		                                 response_body, response_headers, created_at, completed_at, expires_at)
		SELECT '', k.key, 'completed', h.hash, 201, :'resp'::jsonb,
		       '{"location": "/api/payments/7", "etag": "\"pay-7-1\"", "content-type": "application/json; charset=utf-8"}',
		       now() - interval '1 minute', now() - interval '1 minute',
		       now() + interval '1 hour' + (k.i % 1000) * (:'spread'::interval / 1000)
		  FROM (SELECT idempotency.idem_request_hash(:'req'::jsonb) AS hash) h,
		       (SELECT i, md5('h' || i) COLLATE "C" AS key FROM generate_series(1, 20000) i) k
		 ORDER BY k.key;
	SQL
fi
"$BIN/psql" -qX -d cmp -c 'VACUUM ANALYZE' -c CHECKPOINT
stop_server

# run LABEL CASE N [pgbench options]: Ir of the pgbench client's backend
# (the largest new file: pgbench opens a short connection of its own too);
# the file is kept as $OUT/LABEL.out
run() {
	local label=$1 case=$2 n=$3 before f ir=0 x best=
	shift 3
	before=$(ls "$OUT")
	PGOPTIONS=${RUN_PGOPTIONS:-} "$BIN/pgbench" -n -M prepared -c 1 -t "$n" --random-seed=1 -D n=0 -D "kp=$label-" \
		-D "req=$REQ" -D "resp=$RESP" "$@" -f "$BENCH_DIR/cases/$case.pgbench" cmp \
		>"$W/pgbench-$S-$label.log" 2>&1 || { cat "$W/pgbench-$S-$label.log" >&2; exit 1; }
	sleep 2
	for f in $(comm -13 <(echo "$before") <(ls "$OUT")); do
		x=$(awk '/^summary:/ {print $2; exit}' "$OUT/$f")
		if ((x > ir)); then ir=$x best=$f; fi
	done
	[[ -n $best ]] && mv "$OUT/$best" "$OUT/$label.out"
	echo "$ir"
}

# stats_ir FILE: self Ir in FILE of the statistics' code: the functions of
# stats.c (idem_stats_*), the counter adds inlined from idempotency.h (and
# the atomics they use) into the entry points, and libc's clock_gettime
# (the statistics' clock reads; other callers cancel out in the difference
# of two runs)
stats_ir() {
	callgrind_annotate --threshold=100 "$1" 2>/dev/null |
		awk '/^ *[0-9,]+ +\(/ {
				ir = $1; gsub(",", "", ir)
				fn = $0; sub(/^ *[0-9,]+ +\([^)]*\) +/, "", fn); sub(/ .*/, "", fn)
				if (fn ~ /:idem_stats_/ || fn ~ /(idempotency\.h|atomics\/generic\.h):idem_[a-z_]*_common$/ ||
					fn ~ /:clock_gettime/)
					s += ir
			}
			END { print s + 0 }'
}

declare -A NEW REP SNEW SREP
SETTINGS=(off on)
[[ $STATS == both ]] || SETTINGS=("$STATS")
for S in "${SETTINGS[@]}"; do
	D=$W/data-$S OUT=$W/callgrind-$S
	rm -rf "$D" "$OUT"; mkdir -p "$OUT"; cp -a "$T/data" "$D"; chown -R postgres: "$OUT"
	if [[ $S == on ]]; then
		echo "shared_preload_libraries = 'idempotency'" >>"$D/postgresql.conf"
	fi
	# every backend the server forks writes a callgrind file of its own at exit
	as_pg bash -c "cd $OUT && exec valgrind --tool=callgrind --callgrind-out-file=$OUT/callgrind.out.%p $BIN/postgres -D $D -k $T/sock" \
		>"$W/valgrind-$S.log" 2>&1 &
	for _ in $(seq 120); do "$BIN/pg_isready" -q && break; sleep 1; done
	on=$("$BIN/psql" -qXAt -d cmp -c 'SELECT idempotency.idem_stats_enabled()' 2>/dev/null || echo "n/a")
	echo "$REV, statistics $S (idem_stats_enabled: $on), records expiring over $SPREAD"
	fmodes=(none)
	if [[ $S == on ]] && [[ $("$BIN/psql" -qXAt -d cmp -c "SELECT to_regprocedure('idempotency.build_filters(interval)') IS NOT NULL") == t ]]; then
		echo "filters built: $("$BIN/psql" -qXAt -d cmp -c 'SELECT idempotency.build_filters()')"
		case $FILTERS in both) fmodes=(off on) ;; *) fmodes=("$FILTERS") ;; esac
	fi
	for F in "${fmodes[@]}"; do
		RUN_PGOPTIONS=
		[[ $F == off ]] && RUN_PGOPTIONS='-c idempotency.use_filters=off'
		n200=$(run new200-f$F ext_new 200); n1200=$(run new1200-f$F ext_new 1200)
		r200=$(run rep200-f$F ext_replay 200 -D rp=m -D nrep=20000)
		r1200=$(run rep1200-f$F ext_replay 1200 -D rp=m -D nrep=20000)
		[[ $F == none ]] || echo "$REV stats $S filters $F: ext_new $(((n1200 - n200) / 1000)), ext_replay $(((r1200 - r200) / 1000)) instructions a transaction"
		if [[ -n $V12 ]]; then
			for c in ext_new_trace ext_new_headers ext_new_checkpoint; do
				a=$(run "${c#ext_}200-f$F" "$c" 200); b=$(run "${c#ext_}1200-f$F" "$c" 1200)
				echo "$REV stats $S filters $F: $c $(((b - a) / 1000)) instructions a transaction (ext_new $(((n1200 - n200) / 1000)), $(((b - a - n1200 + n200) / 1000)) more)"
			done
			a=$(run "rephdr200-f$F" ext_replay_headers 200 -D rp=h -D nrep=20000)
			b=$(run "rephdr1200-f$F" ext_replay_headers 1200 -D rp=h -D nrep=20000)
			echo "$REV stats $S filters $F: ext_replay_headers $(((b - a) / 1000)) instructions a transaction (ext_replay $(((r1200 - r200) / 1000)), $(((b - a - r1200 + r200) / 1000)) more)"
		fi
	done
	stop_server
	NEW[$S]=$(((n1200 - n200) / 1000)) REP[$S]=$(((r1200 - r200) / 1000))
	SNEW[$S]=$((($(stats_ir "$OUT/new1200-f$F.out") - $(stats_ir "$OUT/new200-f$F.out")) / 1000))
	SREP[$S]=$((($(stats_ir "$OUT/rep1200-f$F.out") - $(stats_ir "$OUT/rep200-f$F.out")) / 1000))
	echo "$REV stats $S ext_new: ${NEW[$S]} instructions a transaction (statistics functions ${SNEW[$S]})"
	echo "$REV stats $S ext_replay: ${REP[$S]} instructions a transaction (statistics functions ${SREP[$S]})"
done
D=$T/data
if [[ $STATS == both ]]; then
	for c in new rep; do
		if [[ $c == new ]]; then a=${NEW[off]} b=${NEW[on]} sa=${SNEW[off]} sb=${SNEW[on]} name=ext_new
		else a=${REP[off]} b=${REP[on]} sa=${SREP[off]} sb=${SREP[on]} name=ext_replay; fi
		awk -v n="$name" -v a="$a" -v b="$b" -v sa="$sa" -v sb="$sb" -v rev="$REV" 'BEGIN {
			printf "%s %s: off %d, on %d, on - off %+d (%+.2f %%); statistics code off %d, on %d (%+d, %.3f %% of on)\n",
				rev, n, a, b, b - a, (b - a) * 100 / a, sa, sb, sb - sa, (sb - sa) * 100 / b }'
	done
fi
