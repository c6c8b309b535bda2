#!/usr/bin/env bash
# sql-edition/bench.sh -- an indicative first look at the SQL edition's
# speed against bench/'s floors: floor_new vs ext_new, floor_replay_check vs
# ext_replay (bench/cases/*.pgbench, unchanged), ROUNDS interleaved rounds
# (default 3) of DURATION seconds (default 5) at each of CLIENTS (default
# "2 8"; each round runs every case at every count, the cases' order
# reversed every other round), 100,000 replay records; per round and
# client count the two ratios, then their medians and the median TPS.  Not
# BENCHMARKS.md's protocol (bench/run.sh): no spread, no C extension beside
# it; a shared machine makes single figures noisy, so read the medians and
# say the load.  As root; a throwaway cluster as in sql-edition/test.sh.
#
#   sql-edition/bench.sh [ROUNDS [DURATION [CLIENTS]]]
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
ROUNDS=${1:-3} DURATION=${2:-5} CLIENTS=${3:-2 8} NREP=100000
# shellcheck source=../scripts/common.sh
source "$ROOT/scripts/common.sh"
if [[ -z ${IDEM_PG_PREFIX:-} || ! -x $IDEM_PG_PREFIX/lib/postgresql/$IDEM_PG_MAJOR/bin/pg_config ]]; then
	use_private_pg
	PG_BINDIR=$IDEM_PG_PREFIX/lib/postgresql/$IDEM_PG_MAJOR/bin
fi
make -s --no-print-directory -C "$HERE" >/dev/null
REQ='{"amount_cents": 2000, "currency": "EUR", "order": "A-1001"}'
RESP='{"payment_id": 7, "status": "succeeded", "amount_cents": 2000}'
STAGE=$(mktemp -d "${TMPDIR:-/tmp}/sqled-stage.XXXXXX")
cat >"$STAGE/regress.conf" <<-CONF
	shared_preload_libraries = 'pg_cron'
	shared_buffers = 256MB
	synchronous_commit = off
CONF
REPO_ROOT=$STAGE start_cluster
REPO_ROOT=$ROOT
rm -rf "$STAGE"
SOCK=$IDEM_TMPDIR/socket
P() { as_postgres "$PG_BINDIR/psql" -X -q -v ON_ERROR_STOP=1 -h "$SOCK" -p "$PGPORT" "$@"; }
P -U postgres -d postgres -c "CREATE ROLE idem_owner LOGIN" -c "CREATE DATABASE bench OWNER idem_owner"
cp "$HERE/build/idempotency_sql.psql" "$ROOT/bench/cases/"*.pgbench "$IDEM_TMPDIR/"    # as root: postgres may not enter the clone
chown postgres: "$IDEM_TMPDIR/idempotency_sql.psql" "$IDEM_TMPDIR/"*.pgbench
P -U idem_owner -d bench -f "$IDEM_TMPDIR/idempotency_sql.psql" >/dev/null
P -U idem_owner -d bench -v req="$REQ" -v resp="$RESP" -v nrep="$NREP" <<-'SQL'
	CREATE SCHEMA bench;
	CREATE TABLE bench.floor (
	    scope text COLLATE "C" NOT NULL, key text COLLATE "C" NOT NULL, status text NOT NULL,
	    request_hash bytea, response_status int, response_body jsonb, attempt int NOT NULL DEFAULT 1,
	    created_at timestamptz NOT NULL, locked_until timestamptz, completed_at timestamptz,
	    expires_at timestamptz NOT NULL, PRIMARY KEY (scope, key));
	INSERT INTO bench.floor (scope, key, status, request_hash, response_status, response_body,
	                         created_at, completed_at, expires_at)
	SELECT '', md5('r' || i), 'completed', sha256(convert_to((:'req'::jsonb)::text, 'UTF8')), 201,
	       :'resp'::jsonb, now(), now(), now() + interval '1 day'
	  FROM generate_series(1, :nrep) i;
	INSERT INTO idempotency.records (scope, key, status, request_hash, response_status, response_body,
	                                 created_at, completed_at, expires_at, claim)
	SELECT '', md5('r' || i), 'completed', sha256(convert_to((:'req'::jsonb)::text, 'UTF8')), 201,
	       :'resp'::jsonb, now(), now(), now() + interval '1 day', gen_random_uuid()
	  FROM generate_series(1, :nrep) i;
	VACUUM ANALYZE bench.floor, idempotency.records;
SQL
declare -A tps
run() {	# run CASE CLIENTS ROUND
	local out
	out=$(as_postgres "$PG_BINDIR/pgbench" -n -M prepared -h 127.0.0.1 -p "$PGPORT" -U idem_owner \
		-c "$2" -j "$2" -T "$DURATION" -D n=0 -D "kp=$1-$2-$3-" -D "req=$REQ" -D "resp=$RESP" -D rp=r \
		-D "nrep=$NREP" -f "$IDEM_TMPDIR/$1.pgbench" bench 2>&1)
	if ! grep -q '^number of failed transactions: 0 ' <<<"$out"; then
		echo "$out"
		die "$1 at $2 clients failed"
	fi
	tps[$1,$2,$3]=$(sed -n 's/^tps = \([0-9.]*\) .*/\1/p' <<<"$out")
}
cases=(floor_new ext_new floor_replay_check ext_replay)
log "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
for ((r = 1; r <= ROUNDS; r++)); do
	for c in $CLIENTS; do
		order=("${cases[@]}")
		((r % 2 == 0)) && order=(ext_replay floor_replay_check ext_new floor_new)
		for k in "${order[@]}"; do run "$k" "$c" "$r"; done
		log "round $r, $c clients: $(for k in "${cases[@]}"; do printf '%s %s  ' "$k" "${tps[$k,$c,$r]}"; done)"
	done
done
log "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else printf "%.2f\n", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
ratios() {	# ratios EXT FLOOR CLIENTS: each round's ratio, one a line
	local r; for ((r = 1; r <= ROUNDS; r++)); do
		awk -v a="${tps[$1,$3,$r]}" -v b="${tps[$2,$3,$r]}" 'BEGIN { printf "%.2f\n", a / b }'; done
}
tpsof() { local r; for ((r = 1; r <= ROUNDS; r++)); do echo "${tps[$1,$2,$r]}"; done; }
for c in $CLIENTS; do
	for pair in "ext_new floor_new" "ext_replay floor_replay_check"; do
		read -r e f <<<"$pair"
		echo "$e / $f ($c clients): rounds $(ratios "$e" "$f" "$c" | paste -sd' '), median $(ratios "$e" "$f" "$c" | median) (goal 0.60); median TPS $e $(tpsof "$e" "$c" | median | cut -d. -f1), $f $(tpsof "$f" "$c" | median | cut -d. -f1)"
	done
done
