#!/usr/bin/env bash
# bench/callgrind.sh -- instructions per transaction of ext_new and
# ext_replay for one git revision of the extension, counted by callgrind
#
#   bash bench/callgrind.sh REV [PORT]
#
# Builds REV from a `git archive` copy, installs it into a private copy of
# the host's PostgreSQL 15 (relocated under /tmp/idem-callgrind/REV: the
# host's installation is not touched, so no lock is needed), initdb's a
# cluster there (as postgres, 127.0.0.1:PORT, default 55411, autovacuum off),
# loads 20,000 completed records (bench/load_records.sql), and restarts the
# server under valgrind --tool=callgrind.  Then it runs this checkout's
# bench/cases/ext_new.pgbench and ext_replay.pgbench with one client,
# `pgbench -n -M prepared -c 1 -t N`, for N = 200 and N = 1200, and prints
# (total Ir of the 1200-transaction backend - total Ir of the 200 one) / 1000:
# instructions per transaction, without the backend's start and warm-up.
# The count is deterministic to within a few hundred instructions (ext_replay
# picks its keys at random).  The callgrind files stay in the folder, for
# callgrind_annotate.  As root on Debian 12.
set -euo pipefail
REV=$1 PORT=${2:-55411}
BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
W=/tmp/idem-callgrind/$REV
P=$W/pg BIN=$W/pg/lib/postgresql/15/bin D=$W/data OUT=$W/callgrind
REQ='{"amount_cents": 2000, "currency": "EUR", "order": "A-1001"}'
RESP='{"payment_id": 7, "status": "succeeded", "amount_cents": 2000}'
as_pg() { runuser -u postgres -- "$@"; }

rm -rf "$W"; mkdir -p "$W/src" "$P/lib/postgresql" "$P/share/postgresql" "$OUT/sock" "$D"
chmod 755 /tmp/idem-callgrind "$W"
git -C "$BENCH_DIR/.." archive "$REV" | tar -x -C "$W/src"
make -s -C "$W/src" >/dev/null
cp -a /usr/lib/postgresql/15 "$P/lib/postgresql/"
cp -a /usr/share/postgresql/15 "$P/share/postgresql/"
cp "$W/src/idempotency.so" "$P/lib/postgresql/15/lib/"
cp "$W/src/idempotency.control" "$W"/src/idempotency--*.sql "$P/share/postgresql/15/extension/"
chown -R postgres: "$OUT" "$D"; chmod 700 "$D"
as_pg "$BIN/initdb" -D "$D" --auth=trust -U postgres -E UTF8 --locale=C.UTF-8 --no-sync >/dev/null
cat >>"$D/postgresql.conf" <<CONF
listen_addresses = '127.0.0.1'
port = $PORT
unix_socket_directories = '$OUT/sock'
autovacuum = off
fsync = off
shared_buffers = 256MB
max_wal_size = 4GB
CONF
export PGHOST=127.0.0.1 PGPORT=$PORT PGUSER=postgres
as_pg "$BIN/pg_ctl" -D "$D" -l "$D/server.log" -w start >/dev/null
trap 'as_pg "$BIN/pg_ctl" -D "$D" -w -m fast stop >/dev/null 2>&1 || true' EXIT
"$BIN/createdb" cmp
"$BIN/psql" -qXAt -d cmp -c 'CREATE EXTENSION idempotency' \
	-c "SELECT 'extension ' || extversion FROM pg_extension WHERE extname = 'idempotency'"
"$BIN/psql" -qX -d cmp -v from=1 -v to=20000 -v req="$REQ" -v resp="$RESP" \
	-v spread='1 day' -f "$BENCH_DIR/load_records.sql"
"$BIN/psql" -qX -d cmp -c 'VACUUM ANALYZE' -c CHECKPOINT
as_pg "$BIN/pg_ctl" -D "$D" -w -m fast stop >/dev/null
# every backend the server forks writes a callgrind file of its own at exit
as_pg bash -c "cd $OUT && exec valgrind --tool=callgrind --callgrind-out-file=$OUT/callgrind.out.%p $BIN/postgres -D $D" >"$W/valgrind.log" 2>&1 &
for _ in $(seq 120); do "$BIN/pg_isready" -q && break; sleep 1; done

# run LABEL CASE N [pgbench options]: Ir of the pgbench client's backend
# (the largest new file: pgbench opens a short connection of its own too)
run() {
	local label=$1 case=$2 n=$3 before f ir=0 x
	shift 3
	before=$(ls "$OUT")
	"$BIN/pgbench" -n -M prepared -c 1 -t "$n" -D n=0 -D "kp=$label-" \
		-D "req=$REQ" -D "resp=$RESP" "$@" -f "$BENCH_DIR/cases/$case.pgbench" cmp \
		>"$W/pgbench-$label.log" 2>&1 || { cat "$W/pgbench-$label.log"; exit 1; }
	sleep 2
	for f in $(comm -13 <(echo "$before") <(ls "$OUT")); do
		x=$(awk '/^summary:/ {print $2; exit}' "$OUT/$f")
		((x > ir)) && ir=$x
	done
	echo "$ir"
}
n200=$(run new200 ext_new 200); n1200=$(run new1200 ext_new 1200)
r200=$(run rep200 ext_replay 200 -D rp=m -D nrep=20000)
r1200=$(run rep1200 ext_replay 1200 -D rp=m -D nrep=20000)
echo "$REV ext_new: $(((n1200 - n200) / 1000)) instructions a transaction"
echo "$REV ext_replay: $(((r1200 - r200) / 1000)) instructions a transaction"
