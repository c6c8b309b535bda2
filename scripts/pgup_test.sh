#!/usr/bin/env bash
# scripts/pgup_test.sh -- a database that uses the extension, moved from
# PostgreSQL 15 to a newer major: by dump and restore, and by pg_upgrade
#
#   bash scripts/pgup_test.sh [MAJOR...]        (as root on Debian 12; 17 18)
#
# On the host's PostgreSQL 15 (a private copy with the extension installed:
# the one scripts/test.sh made, through IDEM_PG_PREFIX, or else one made
# here) it fills a database, shop, with live records of every kind:
# completed ones (some failed with 500) spread over the dated partitions
# and DEFAULT, a claim processing under a lease, a session-bound claim
# whose session has ended, a token issued and one consumed; statistics and
# their daily history; the pg_cron maintenance job; an application role.
# Then, for each MAJOR, in that major's Debian root of scripts/matrix.sh
# (used through an overlay, so the root stays as it was; the extension is
# built and installed there for MAJOR):
#   dump     MAJOR's pg_dumpall --globals-only and pg_dump, against the 15
#            server over 127.0.0.1, restored into a MAJOR server with
#            pg_restore
#   upgrade  pg_upgrade from a copy of the 15 cluster (stopped) to a new
#            MAJOR cluster; no Debian suite ships 15 beside 17 or 18, so
#            the host's 15 binaries are copied into the root, with the few
#            libraries they need that the root lacks
# and on each result the same checks (pgup_check_names): the records of
# every partition as they were, the daily statistics, the cron job and
# pg_cron's job id sequence, ALTER EXTENSION ... UPDATE, idem_maintain()
# and the partitions, the filters, replays, the fenced claims, tokens,
# statistics, the application role.
#
# A major whose root is missing (scripts/matrix.sh has not made it) is
# skipped, each of its checks counted as skipped.  Prints a TAP-like line
# per check and, last,
#   "postgresql upgrade (dump, pg_upgrade): N of M tests passed, S skipped."
# (M counts the checks that ran).  Exits 1 if a check failed.
#
# IDEM_MATRIX_CACHE as in scripts/matrix.sh; each root is locked as
# scripts/matrix.sh locks it, while it is used (IDEM_PGUP_LOCK_WAIT,
# default 3600 seconds).
set -euo pipefail

# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

((EUID == 0)) || die "scripts/pgup_test.sh needs root (chroot, mount)"
[[ $IDEM_PG_MAJOR == 15 ]] || die "scripts/pgup_test.sh starts from the host's PostgreSQL 15"

PGUP_CACHE=${IDEM_MATRIX_CACHE:-/var/cache/idempotency-matrix}
PGUP_LOCK_WAIT=${IDEM_PGUP_LOCK_WAIT:-3600}
if (($# > 0)); then
	PGUP_MAJORS=("$@")
else
	PGUP_MAJORS=(17 18)
fi
PGUP_METHODS=(dump upgrade)
NAME="postgresql upgrade (dump, pg_upgrade)"

# The checks, in the order pgup_checks runs them; each is one test.
pgup_check_names=(
	"every record of every partition (DEFAULT too) is there as it was"
	"the daily statistics are as they were"
	"ALTER EXTENSION ... UPDATE leaves idempotency at its default version"
	"the cron job is there once, and rescheduling keeps it once"
	"pg_cron's job id sequence continues after the restored jobs"
	"the maintenance job runs on the new server"
	"idem_maintain() moves DEFAULT's records out and covers max_ttl"
	"every partition has the filter trigger ENABLE ALWAYS and its replica identity"
	"the filters of the partitions that hold records are ready"
	"every live completed record replays with its response"
	"a changed request is a mismatch; a new key is acquired"
	"a lease claim is fenced by its claim: wrong 55000, right completes"
	"a session-bound claim whose session ended is taken over at once"
	"tokens consume once; the consumed one stays consumed"
	"statistics work, counted anew (shared memory does not move)"
	"the application role's grants work"
)

PGUP_TMP=$(mktemp -d /tmp/idempotency-pgup.XXXXXX)
chmod 755 "$PGUP_TMP"
# what to undo on exit: "MNT DATADIR BINDIR" of each server started in a
# root, the overlays, the lock
PGUP_SERVERS=()
PGUP_MOUNTS=()
PGUP_LOCK_FD=
SRC_DATA=$PGUP_TMP/src/data

# pgup_stop_servers: stop every server started in a root that still runs.
pgup_stop_servers() {
	local s mnt data bin
	for s in "${PGUP_SERVERS[@]}"; do
		read -r mnt data bin <<<"$s"
		if [[ -f $mnt$data/postmaster.pid ]]; then
			pgup_in_root "$mnt" runuser -u postgres -- "$bin/pg_ctl" stop -D "$data" -m immediate -w -t 30 \
				>/dev/null 2>&1 || true
		fi
	done
	PGUP_SERVERS=()
}

# shellcheck disable=SC2317  # run by the trap
pgup_cleanup() {
	local status=$? i
	trap - EXIT
	trap '' INT TERM HUP
	pgup_stop_servers
	if [[ -f $SRC_DATA/postmaster.pid ]]; then
		as_postgres "$PG_BINDIR/pg_ctl" stop -D "$SRC_DATA" -m immediate -w -t 30 >/dev/null 2>&1 || true
	fi
	for ((i = ${#PGUP_MOUNTS[@]} - 1; i >= 0; i--)); do
		umount "${PGUP_MOUNTS[i]}" 2>/dev/null || umount -l "${PGUP_MOUNTS[i]}" 2>/dev/null || true
	done
	rm -rf --one-file-system "$PGUP_TMP"
	if [[ -n $IDEM_PG_PREFIX_OWN && -d $IDEM_PG_PREFIX_OWN ]]; then
		rm -rf "$IDEM_PG_PREFIX_OWN"
	fi
	exit "$status"
}

# The private PostgreSQL 15 with the extension: scripts/test.sh's, or one of
# this script's own (use_private_pg sets a trap; ours replaces it below and
# removes the copy too).
if [[ -z ${IDEM_PG_PREFIX:-} || ! -f $PG_BINDIR/../lib/idempotency.so ]]; then
	# shellcheck disable=SC2034  # read by common.sh's run_step
	IDEM_QUIET=1
	use_private_pg
	build_install
fi
trap pgup_cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

# pgup_in_root MNT COMMAND...: COMMAND in the root MNT, clean environment.
pgup_in_root() {
	local mnt=$1
	shift
	chroot "$mnt" /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
		HOME=/root LANG=C.UTF-8 PGTZ=UTC DEBIAN_FRONTEND=noninteractive "$@"
}

# The counts and the TAP-like lines.
passed=0 failed=0 skipped=0 n=0
ok() {
	n=$((n + 1)) passed=$((passed + 1))
	echo "ok $n - $1"
}
not_ok() {
	n=$((n + 1)) failed=$((failed + 1))
	echo "not ok $n - $1"
	shift
	if (($# > 0)); then
		printf '#   %s\n' "$@"
	fi
}
skip() {
	n=$((n + 1)) skipped=$((skipped + 1))
	echo "ok $n - $1 # SKIP $2"
}

# conf_lines: the settings of every cluster here (regress.conf, which
# preloads both libraries, with pg_cron in shop)
conf_lines() {
	cat "$REPO_ROOT/regress.conf"
	cat <<-EOF
		# scripts/pgup_test.sh
		cron.database_name = 'shop'
		cron.use_background_workers = on
		max_worker_processes = 16
		listen_addresses = '127.0.0.1'
		fsync = off
		TimeZone = 'UTC'
	EOF
}

# ---- the source: PostgreSQL 15 on the host ----
src_psql() {
	as_postgres env PGTZ=UTC "$PG_BINDIR/psql" -XAtq -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$SRC_PORT" -U postgres "$@"
}

log "PostgreSQL 15 source cluster"
mkdir -p "$PGUP_TMP/src"
chown postgres: "$PGUP_TMP/src"
IDEM_QUIET=1 run_step initdb as_postgres "$PG_BINDIR/initdb" -D "$SRC_DATA" --auth=trust \
	--username=postgres --encoding=UTF8 --locale=C.UTF-8 --no-sync
conf_lines >>"$SRC_DATA/postgresql.conf"
echo "unix_socket_directories = '$PGUP_TMP/src'" >>"$SRC_DATA/postgresql.conf"
SRC_PORT=$(free_port)
as_postgres "$PG_BINDIR/pg_ctl" start -w -t 120 -D "$SRC_DATA" -l "$PGUP_TMP/src/server.log" \
	-o "-p $SRC_PORT" >/dev/null || { cat "$PGUP_TMP/src/server.log"; die "the 15 server did not start"; }

src_psql -d postgres >/dev/null <<'EOF'
CREATE ROLE app LOGIN;
CREATE DATABASE shop;
EOF
# Records of every kind.  CREATE EXTENSION and maintenance run with max_ttl
# at 2h, so the dated partitions reach now + 2h + two widths (50h): the
# records of a longer ttl wait in DEFAULT, where pg_dump must find them too.
src_psql -d shop >/dev/null <<'EOF'
SET idempotency.max_ttl = '2h';
CREATE EXTENSION idempotency;
RESET idempotency.max_ttl;
CREATE EXTENSION pg_cron;
GRANT USAGE ON SCHEMA idempotency TO app;
GRANT EXECUTE ON FUNCTION
    idempotency.idem_acquire(text, jsonb, text, interval, interval, boolean, text),
    idempotency.idem_complete(text, int, jsonb, text, int, uuid, jsonb),
    idempotency.idem_release(text, text, int, uuid)
    TO app;
GRANT SELECT, INSERT, UPDATE, DELETE ON idempotency.records TO app;
SET idempotency.max_ttl = '2h';
SELECT * FROM idempotency.idem_maintain();
RESET idempotency.max_ttl;
SELECT count(*) FROM generate_series(1, 300) i,
    LATERAL idempotency.idem_acquire('bulk-' || i, jsonb_build_object('n', i),
        'user:' || (i % 7) || '/payments', ttl => make_interval(hours => 24 + i % 100)) a
 WHERE a.outcome = 'acquired';
SELECT count(*) FROM generate_series(1, 300) i
 WHERE idempotency.idem_complete('bulk-' || i, CASE WHEN i % 10 = 0 THEN 500 ELSE 201 END,
        jsonb_build_object('payment', i), 'user:' || (i % 7) || '/payments');
SELECT outcome FROM idempotency.idem_acquire('bulk-1', '{"n": 1}', 'user:1/payments');
-- a schedule that does not come during the test: maintenance must not
-- change the source between the dumps
SELECT idempotency.idem_schedule_maintenance('0 0 29 2 *');
SET idempotency.max_ttl = '2h';
SELECT * FROM idempotency.idem_maintain();
EOF
LEASE_CLAIM=$(src_psql -d shop -c "SELECT claim FROM idempotency.idem_acquire('lease-1', '{\"order\": 1}',
	ttl => '2 days', lease => '1 day')")
# its session ends with this psql
SESSION_CLAIM=$(src_psql -d shop -c "SELECT claim FROM idempotency.idem_acquire('session-1', '{\"order\": 2}',
	ttl => '2 days', session_bound => true)")
TOKEN_LIVE=$(src_psql -d shop -c "SELECT idempotency.idem_token_issue('user:1/checkout', '2 days')")
TOKEN_USED=$(src_psql -d shop -c "SELECT idempotency.idem_token_issue('user:1/checkout', '2 days')")
src_psql -d shop -c "SELECT idempotency.idem_token_consume('$TOKEN_USED', 'user:1/checkout')" >/dev/null

# What the checks compare with: every record, the daily statistics.  (A
# restore puts the records into the partitions CREATE EXTENSION made there,
# so which partition holds a record is not compared.)
RECORDS_SQL="SELECT md5(string_agg(concat_ws('|', r.scope, r.key, r.status,
        encode(r.request_hash, 'hex'), r.response_status, r.response_body, r.attempt, r.created_at,
        r.locked_until, r.completed_at, r.expires_at, r.claim, r.owner_pid, r.owner_start, r.is_token),
        E'\n' ORDER BY r.scope, r.key, r.expires_at)) || ' ' || count(*)
  FROM idempotency.records r"
DAILY_SQL="SELECT md5(string_agg(d::text, E'\n' ORDER BY d.day, d.datname)) || ' ' || count(*)
  FROM idempotency.daily d"
SRC_RECORDS=$(src_psql -d shop -c "$RECORDS_SQL")
SRC_DAILY=$(src_psql -d shop -c "$DAILY_SQL")
# the set-up is what the checks assume: rows in DEFAULT and in two or more
# dated partitions, a daily row
layout=$(src_psql -d shop -c "SELECT (SELECT count(*) FROM idempotency.records_default) > 0
	AND (SELECT count(DISTINCT tableoid) FROM idempotency.records) >= 3
	AND (SELECT count(*) FROM idempotency.daily) > 0")
[[ $layout == t ]] || die "the 15 database is not laid out as the checks assume"
# Some builds of PostgreSQL (this machine's 15.20-0+deb12u1 and
# 17.12-0+deb13u1, not upstream's) give every column an attribute option
# pg_attver, which a major without that patch rejects in pg_upgrade's
# restore ("unrecognized parameter").  pg_upgrade into such a major is
# skipped, with that reason: nothing here can make it pass.
SRC_ATTVER=$(src_psql -d shop -c "SELECT EXISTS (SELECT FROM pg_attribute
	WHERE array_to_string(attoptions, ',') LIKE '%pg_attver=%')")
log "15 source ready: records ${SRC_RECORDS#* }, daily rows ${SRC_DAILY#* }"

# ---- the checks, on a cluster of MAJOR in a root ----

# tgt_psql: psql of MAJOR against the cluster under test ($TGT_*), as
# postgres, over 127.0.0.1; SQL on stdin or -c.
tgt_psql() {
	pgup_in_root "$TGT_MNT" runuser -u postgres -- "$TGT_BIN/psql" -XAtq -v ON_ERROR_STOP=1 \
		-h 127.0.0.1 -p "$TGT_PORT" -U postgres -d shop "$@"
}

# check NAME EXPECTED: run the SQL on stdin, compare its output.
check() {
	local name="[pg$TGT_MAJOR $TGT_METHOD] $1" want=$2 got
	got=$({ echo 'SET client_min_messages = warning;'; cat; } |
		tgt_psql -v lease_claim="$LEASE_CLAIM" -v session_claim="$SESSION_CLAIM" \
			-v token_live="$TOKEN_LIVE" -v token_used="$TOKEN_USED" -f - 2>&1) || true
	if [[ $got == "$want" ]]; then
		ok "$name"
	else
		not_ok "$name" "expected: $want" "got:" "${got//$'\n'/ | }"
	fi
}

# A helper every check session may use: the SQLSTATE a statement raises.
STATE_OF="CREATE FUNCTION pg_temp.state_of(q text) RETURNS text LANGUAGE plpgsql AS \$\$
BEGIN EXECUTE q; RETURN '00000'; EXCEPTION WHEN OTHERS THEN RETURN SQLSTATE; END \$\$;"

pgup_checks() {
	local i=0
	check "${pgup_check_names[i++]}" "$SRC_RECORDS" <<<"$RECORDS_SQL"
	check "${pgup_check_names[i++]}" "$SRC_DAILY" <<<"$DAILY_SQL"
	check "${pgup_check_names[i++]}" t <<-'EOF'
		ALTER EXTENSION idempotency UPDATE;
		ALTER EXTENSION pg_cron UPDATE;
		SELECT e.extversion = a.default_version
		  FROM pg_extension e JOIN pg_available_extensions a ON a.name = e.extname
		 WHERE e.extname = 'idempotency';
	EOF
	check "${pgup_check_names[i++]}" $'1\nt\n1' <<-'EOF'
		SELECT count(*) FROM cron.job WHERE jobname = 'idempotency-maintenance:shop' AND database = 'shop';
		SELECT idempotency.idem_schedule_maintenance() > 0;
		SELECT count(*) FROM cron.job WHERE jobname = 'idempotency-maintenance:shop' AND database = 'shop';
	EOF
	check "${pgup_check_names[i++]}" t <<-'EOF'
		SELECT max(jobid) AS before FROM cron.job \gset
		SELECT cron.schedule('pgup-probe', '0 0 1 1 *', 'SELECT 1') > :before;
		SELECT cron.unschedule('pgup-probe') AS ignored \gset
	EOF
	# pg_cron runs the job within a few seconds; up to 300 are allowed
	check "${pgup_check_names[i++]}" $'t\nt' <<-'EOF'
		CREATE FUNCTION pg_temp.ran(job bigint) RETURNS boolean LANGUAGE plpgsql AS $$
		BEGIN
		    FOR i IN 1..300 LOOP
		        IF EXISTS (SELECT FROM cron.job_run_details d
		                    WHERE d.jobid = job AND d.status = 'succeeded') THEN
		            RETURN true;
		        END IF;
		        PERFORM pg_sleep(1);
		    END LOOP;
		    RETURN false;
		END $$;
		SELECT idempotency.idem_schedule_maintenance('2 seconds') AS job \gset
		SELECT pg_temp.ran(:job);
		SELECT idempotency.idem_schedule_maintenance() > 0;
	EOF
	check "${pgup_check_names[i++]}" t <<-'EOF'
		SELECT count(*) AS n FROM idempotency.records \gset
		SELECT 1 AS ignored FROM idempotency.idem_maintain() \gset
		SELECT NOT EXISTS (SELECT FROM idempotency.records_default)
		   AND (SELECT count(*) FROM idempotency.records) = :n
		   AND (SELECT max(range_end) FROM idempotency.partitions) >= now() + current_setting('idempotency.max_ttl')::interval
		   AND (SELECT min(range_start) FROM idempotency.partitions) <= now();
	EOF
	check "${pgup_check_names[i++]}" t <<-'EOF'
		SELECT bool_and(t.tgenabled = 'A' AND c.relreplident = 'i')
		  FROM idempotency.partitions p
		  JOIN pg_class c ON c.oid = p.partition
		  LEFT JOIN pg_trigger t ON t.tgrelid = c.oid AND t.tgname = 'zz_records_filter';
	EOF
	check "${pgup_check_names[i++]}" t <<-'EOF'
		SELECT 1 AS ignored FROM idempotency.idem_maintain() \gset
		SELECT NOT EXISTS (
		    SELECT FROM idempotency.partitions p
		     WHERE NOT p.is_default
		       AND EXISTS (SELECT FROM idempotency.records r WHERE r.tableoid = p.partition)
		       AND p.partition NOT IN (SELECT f.partition FROM idempotency.idem_filters() f
		                                WHERE f.state = 'ready'));
	EOF
	check "${pgup_check_names[i++]}" t <<-'EOF'
		SET idempotency.wait_timeout = 0;
		WITH done AS MATERIALIZED (
		    SELECT r.scope, r.key, r.response_status, r.response_body FROM idempotency.records r
		     WHERE r.status = 'completed' AND NOT r.is_token AND r.expires_at > now())
		SELECT count(*) = 300 AND bool_and(a.outcome = 'replay' AND a.response_status = d.response_status
		                                   AND a.response_body = d.response_body)
		  FROM done d, LATERAL idempotency.idem_acquire(d.key, NULL, d.scope) a;
	EOF
	check "${pgup_check_names[i++]}" $'replay\nmismatch\nacquired|1\nt' <<-'EOF'
		SET idempotency.wait_timeout = 0;
		SELECT outcome FROM idempotency.idem_acquire('bulk-1', '{"n": 1}', 'user:1/payments');
		SELECT outcome FROM idempotency.idem_acquire('bulk-1', '{"n": -1}', 'user:1/payments');
		SELECT outcome, attempt FROM idempotency.idem_acquire('new-after-upgrade', '{"n": 0}');
		SELECT idempotency.idem_release('new-after-upgrade');
	EOF
	check "${pgup_check_names[i++]}" $'in_progress\n55000\n55000\nt\nreplay|201' <<-EOF
		$STATE_OF
		SET idempotency.wait_timeout = 0;
		SELECT outcome FROM idempotency.idem_acquire('lease-1', '{"order": 1}');
		SELECT pg_temp.state_of(\$\$SELECT idempotency.idem_complete('lease-1', 201, claim => gen_random_uuid())\$\$);
		SELECT pg_temp.state_of(\$\$SELECT idempotency.idem_release('lease-1', claim => gen_random_uuid())\$\$);
		SELECT idempotency.idem_complete('lease-1', 201, '{"charge": 1}', claim => :'lease_claim');
		SELECT outcome, response_status FROM idempotency.idem_acquire('lease-1', '{"order": 1}');
	EOF
	check "${pgup_check_names[i++]}" $'acquired|2\n55000\nt' <<-EOF
		$STATE_OF
		SET idempotency.wait_timeout = 0;
		SELECT outcome, attempt, claim AS new_claim
		  FROM idempotency.idem_acquire('session-1', '{"order": 2}') \\gset
		SELECT :'outcome' || '|' || :'attempt';
		SELECT pg_temp.state_of(format('SELECT idempotency.idem_complete(%L, 201, claim => %L)',
		                               'session-1', :'session_claim'));
		SELECT idempotency.idem_complete('session-1', 201, claim => :'new_claim');
	EOF
	check "${pgup_check_names[i++]}" $'t\nf\nf' <<-'EOF'
		SELECT idempotency.idem_token_consume(:'token_live', 'user:1/checkout');
		SELECT idempotency.idem_token_consume(:'token_live', 'user:1/checkout');
		SELECT idempotency.idem_token_consume(:'token_used', 'user:1/checkout');
	EOF
	check "${pgup_check_names[i++]}" t <<-'EOF'
		SELECT 1 AS ignored FROM idempotency.idem_maintain() \gset
		SELECT idempotency.idem_stats_enabled()
		   AND s.replayed >= 300 AND s.acquired < 300 AND s.tokens_consumed >= 1
		   AND NOT EXISTS (SELECT FROM idempotency.daily d
		                    WHERE d.acquired < 0 OR d.replayed < 0 OR d.completed < 0 OR d.tokens_consumed < 0)
		  FROM idempotency.stats s WHERE s.datname = 'shop';
	EOF
	check "${pgup_check_names[i++]}" acquired <<-'EOF'
		SET ROLE app;
		SELECT outcome FROM idempotency.idem_acquire('app-1', '{"n": 1}');
	EOF
	((i == ${#pgup_check_names[@]})) || die "pgup_checks ran $i checks of ${#pgup_check_names[@]}"
}

# fail_all WHY: every check of this major and method fails, with WHY.
fail_all() {
	local c
	for c in "${pgup_check_names[@]}"; do
		not_ok "[pg$TGT_MAJOR $TGT_METHOD] $c" "$1"
	done
}
skip_all() {
	local major=$1 why=$2 m c
	for m in "${PGUP_METHODS[@]}"; do
		for c in "${pgup_check_names[@]}"; do
			skip "[pg$major $m] $c" "$why"
		done
	done
}

# tgt_start MNT MAJOR DATADIR: start a server of MAJOR on DATADIR (a path
# inside the root) on a free port: $TGT_PORT.
tgt_start() {
	local mnt=$1 major=$2 data=$3 bin=/usr/lib/postgresql/$2/bin
	TGT_PORT=$(free_port)
	PGUP_SERVERS+=("$mnt $data $bin")
	pgup_in_root "$mnt" runuser -u postgres -- "$bin/pg_ctl" start -w -t 120 -D "$data" \
		-l "$data.log" -o "-p $TGT_PORT -c unix_socket_directories=/pgup" >/dev/null || {
		tail -n 30 "$mnt$data.log"
		return 1
	}
}
tgt_stop() {
	pgup_in_root "$1" runuser -u postgres -- "/usr/lib/postgresql/$2/bin/pg_ctl" stop -D "$3" -m fast -w -t 120 >/dev/null
}

# tgt_initdb MNT MAJOR DATADIR: a new cluster as the 15 one was made
# (pg_upgrade needs the same encoding, locale and checksum setting: 18
# turns checksums on by default).
tgt_initdb() {
	local mnt=$1 major=$2 data=$3 bin=/usr/lib/postgresql/$2/bin opts=()
	if pgup_in_root "$mnt" "$bin/initdb" --help | grep -q -- --no-data-checksums; then
		opts+=(--no-data-checksums)
	fi
	pgup_in_root "$mnt" runuser -u postgres -- "$bin/initdb" -D "$data" --auth=trust --username=postgres \
		--encoding=UTF8 --locale=C.UTF-8 --no-sync "${opts[@]}" >"$mnt$data.initdb.log" 2>&1 || {
		cat "$mnt$data.initdb.log"
		return 1
	}
	conf_lines >>"$mnt$data/postgresql.conf"
}

# pgup_prepare MNT MAJOR: the extension built and installed for MAJOR in the
# root, the folder /pgup for the clusters.
pgup_prepare() {
	local mnt=$1 major=$2
	mkdir -p "$mnt/pgup" "$mnt/pgup-src"
	tar -C "$REPO_ROOT" --exclude=./.git --exclude='*.o' --exclude='*.so' --exclude='*.bc' \
		--exclude=./results --exclude=./output_iso --exclude=./tmp_check --exclude=./tmp_check_iso \
		--exclude=./log --exclude=./bench/results -cf - . | tar -C "$mnt/pgup-src" -xf -
	if ! { pgup_in_root "$mnt" make -s -C /pgup-src PG_CONFIG="/usr/lib/postgresql/$major/bin/pg_config" &&
		pgup_in_root "$mnt" make -s -C /pgup-src PG_CONFIG="/usr/lib/postgresql/$major/bin/pg_config" install; } \
		>"$PGUP_TMP/make-$major.log" 2>&1; then
		tail -n 20 "$PGUP_TMP/make-$major.log"
		return 1
	fi
	pgup_in_root "$mnt" chown postgres: /pgup
}

# pgup_dump MNT MAJOR: MAJOR's pg_dumpall --globals-only and pg_dump against
# the 15 server, restored into a new MAJOR cluster.  The commands are those
# of docs/upgrading-postgresql.md.
pgup_dump() {
	local mnt=$1 major=$2 bin=/usr/lib/postgresql/$2/bin errs
	tgt_initdb "$mnt" "$major" /pgup/restored || return 1
	tgt_start "$mnt" "$major" /pgup/restored || return 1
	pgup_in_root "$mnt" runuser -u postgres -- sh -c "cd /pgup &&
		$bin/pg_dumpall -h 127.0.0.1 -p $SRC_PORT -U postgres --globals-only -f globals.sql &&
		$bin/pg_dump -h 127.0.0.1 -p $SRC_PORT -U postgres -Fc --load-via-partition-root -f shop.dump shop" || return 1
	# the role postgres exists already: the one error that may be
	errs=$(pgup_in_root "$mnt" runuser -u postgres -- "$bin/psql" -X -q -h 127.0.0.1 -p "$TGT_PORT" -U postgres \
		-d postgres -f /pgup/globals.sql 2>&1 | grep -F 'ERROR:' | grep -vF 'role "postgres" already exists' || true)
	if [[ -n $errs ]]; then
		echo "globals: $errs"
		return 1
	fi
	# CREATE EXTENSION idempotency makes the partitions of the coming days:
	# the dumped ones are left out (their rows load through
	# idempotency.records).  pg_cron is created first and its own entry left
	# out: a pg_cron older than 1.5 (Debian 12's 1.4.2) sits in schema
	# public, and 1.5 on refuses to be created there ("must be installed in
	# schema pg_catalog"); its tables' rows still load.
	pgup_in_root "$mnt" runuser -u postgres -- sh -c "cd /pgup &&
		$bin/pg_restore -l shop.dump |
			grep -v -E ' (TABLE|TABLE ATTACH|INDEX|INDEX ATTACH) idempotency records_p[0-9]| EXTENSION - pg_cron |COMMENT - EXTENSION pg_cron ' \
			>shop.list" &&
	pgup_in_root "$mnt" runuser -u postgres -- "$bin/createdb" -h 127.0.0.1 -p "$TGT_PORT" -U postgres shop &&
	pgup_in_root "$mnt" runuser -u postgres -- "$bin/psql" -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$TGT_PORT" \
		-U postgres -d shop -c 'CREATE EXTENSION pg_cron' &&
		pgup_in_root "$mnt" runuser -u postgres -- "$bin/pg_restore" --exit-on-error -h 127.0.0.1 \
			-p "$TGT_PORT" -U postgres -d shop -L /pgup/shop.list /pgup/shop.dump
}

# pgup_add_pg15 MNT: the host's PostgreSQL 15 (the private copy, with the
# extension) in the root as Debian lays it out, and the shared libraries
# its binaries and modules need that the root lacks (the host's, in a
# folder of their own that ldconfig knows).
pgup_add_pg15() {
	local mnt=$1 f lib path missing
	mkdir -p "$mnt/usr/lib/postgresql/15" "$mnt/usr/share/postgresql/15" "$mnt/usr/local/lib/pgup-pg15"
	cp -a "$PG_BINDIR/../." "$mnt/usr/lib/postgresql/15/"
	cp -a "$("$PG_CONFIG" --sharedir)/." "$mnt/usr/share/postgresql/15/"
	echo /usr/local/lib/pgup-pg15 >"$mnt/etc/ld.so.conf.d/pgup-pg15.conf"
	for _ in 1 2 3 4; do
		missing=$(for f in "$mnt"/usr/lib/postgresql/15/bin/* "$mnt"/usr/lib/postgresql/15/lib/{idempotency,pg_cron,plpgsql,dict_snowball,libpqwalreceiver,pgoutput}.so \
			"$mnt"/usr/local/lib/pgup-pg15/*; do
			[[ -f $f ]] || continue
			pgup_in_root "$mnt" ldd "${f#"$mnt"}" 2>/dev/null | awk '/not found/ { print $1 }'
		done | sort -u)
		[[ -n $missing ]] || return 0
		for lib in $missing; do
			path=$(ldconfig -p | awk -v l="$lib" '$1 == l && /x86-64/ { print $NF; exit }')
			[[ -n $path ]] || { echo "the host has no $lib"; return 1; }
			cp -L "$path" "$mnt/usr/local/lib/pgup-pg15/$lib"
		done
		pgup_in_root "$mnt" ldconfig
	done
	echo "libraries still missing: $missing"
	return 1
}

# pgup_upgrade MNT MAJOR: pg_upgrade of a copy of the stopped 15 cluster
# into a new MAJOR cluster, then the new one started.
pgup_upgrade() {
	local mnt=$1 major=$2 bin=/usr/lib/postgresql/$2/bin
	pgup_add_pg15 "$mnt" || return 1
	cp -a "$SRC_DATA" "$mnt/pgup/old15"
	# the postgres user of the root may have another uid than the host's
	pgup_in_root "$mnt" chown -R postgres: /pgup/old15 || return 1
	tgt_initdb "$mnt" "$major" /pgup/upgraded || return 1
	mkdir -p "$mnt/pgup/work"
	pgup_in_root "$mnt" chown postgres: /pgup/work
	pgup_in_root "$mnt" runuser -u postgres -- sh -c "cd /pgup/work && $bin/pg_upgrade \
		-b /usr/lib/postgresql/15/bin -B $bin -d /pgup/old15 -D /pgup/upgraded \
		-p $(free_port) -P $(free_port)" >"$PGUP_TMP/pg_upgrade-$major.log" 2>&1 || {
		tail -n 30 "$PGUP_TMP/pg_upgrade-$major.log"
		# and the end of the log it names ("Consult the last few lines of")
		sed -nE 's/.*Consult the last few lines of "([^"]+)".*/\1/p' "$PGUP_TMP/pg_upgrade-$major.log" |
			sort -u | while read -r f; do
				echo "==== $f (its errors) ===="
				grep -E -A 3 'error|ERROR' "$mnt$f" 2>/dev/null | head -n 30 || true
			done
		return 1
	}
	tgt_start "$mnt" "$major" /pgup/upgraded
}

# pgup_major MAJOR: both ways for MAJOR, in an overlay of its root.
pgup_major() {
	local major=$1 root=$PGUP_CACHE/pg$1 t0 mnt ov m
	t0=$(date +%s)
	if [[ ! -x $root/usr/lib/postgresql/$major/bin/pg_upgrade ]]; then
		log "PostgreSQL $major: SKIPPED: no root in $root (scripts/matrix.sh makes it)"
		skip_all "$major" "no PostgreSQL $major root in $PGUP_CACHE"
		return 0
	fi
	exec {PGUP_LOCK_FD}>"$PGUP_CACHE/pg$major.lock"
	if ! flock -w "$PGUP_LOCK_WAIT" "$PGUP_LOCK_FD"; then
		log "PostgreSQL $major: SKIPPED: its root stayed locked for ${PGUP_LOCK_WAIT}s"
		skip_all "$major" "root locked"
		exec {PGUP_LOCK_FD}>&-
		return 0
	fi
	log "PostgreSQL $major: root locked after $(($(date +%s) - t0))s of waiting"
	t0=$(date +%s)
	ov=$PGUP_TMP/ov$major
	mnt=$ov/merged
	mkdir -p "$ov/upper" "$ov/work" "$mnt"
	mount -t overlay overlay -o "lowerdir=$root,upperdir=$ov/upper,workdir=$ov/work" "$mnt"
	PGUP_MOUNTS+=("$mnt")
	mount -t proc proc "$mnt/proc"
	PGUP_MOUNTS+=("$mnt/proc")
	mkdir -p "$mnt/dev/shm"
	mount -t tmpfs -o mode=1777,nosuid,nodev shm "$mnt/dev/shm"
	PGUP_MOUNTS+=("$mnt/dev/shm")

	TGT_MNT=$mnt TGT_MAJOR=$major TGT_BIN=/usr/lib/postgresql/$major/bin
	log "PostgreSQL $major: building the extension in its root"
	if ! pgup_prepare "$mnt" "$major"; then
		for TGT_METHOD in "${PGUP_METHODS[@]}"; do
			fail_all "the extension did not build for $major"
		done
	else
		TGT_METHOD=dump
		log "PostgreSQL $major: pg_dump / pg_restore"
		if pgup_dump "$mnt" "$major"; then
			pgup_checks
			tgt_stop "$mnt" "$major" /pgup/restored || true
		else
			fail_all "dump and restore failed (above)"
		fi
		TGT_METHOD=upgrade
		log "PostgreSQL $major: pg_upgrade"
		# a copy of the 15 cluster, stopped
		as_postgres "$PG_BINDIR/pg_ctl" stop -D "$SRC_DATA" -m fast -w -t 120 >/dev/null
		if [[ $SRC_ATTVER == t ]] && ! grep -q pg_attver "$mnt$TGT_BIN/postgres"; then
			log "PostgreSQL $major: pg_upgrade SKIPPED: the 15 build sets column option pg_attver, which $major does not know"
			for m in "${pgup_check_names[@]}"; do
				skip "[pg$major upgrade] $m" "the 15 build's column option pg_attver is unknown to $major's build"
			done
		elif pgup_upgrade "$mnt" "$major"; then
			pgup_checks
			tgt_stop "$mnt" "$major" /pgup/upgraded || true
		else
			fail_all "pg_upgrade failed (above)"
		fi
	fi
	pgup_stop_servers
	for m in "$mnt/dev/shm" "$mnt/proc" "$mnt"; do
		umount "$m" 2>/dev/null || umount -l "$m"
	done
	PGUP_MOUNTS=()
	rm -rf --one-file-system "$ov"
	exec {PGUP_LOCK_FD}>&-
	PGUP_LOCK_FD=
	log "PostgreSQL $major: done in $(($(date +%s) - t0))s"
}

# pg_upgrade needs the 15 cluster stopped; it is stopped after the first
# major's dump, and started again for the next major's.
for major in "${PGUP_MAJORS[@]}"; do
	if [[ ! -f $SRC_DATA/postmaster.pid ]]; then
		as_postgres "$PG_BINDIR/pg_ctl" start -w -t 120 -D "$SRC_DATA" -l "$PGUP_TMP/src/server.log" \
			-o "-p $SRC_PORT" >/dev/null
	fi
	pgup_major "$major"
done

echo "$NAME: $passed of $((passed + failed)) tests passed, $skipped skipped."
((failed == 0))
