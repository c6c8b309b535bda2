#!/usr/bin/env bash
# sql-edition/pgtle_test.sh -- the pg_tle script (build/idempotency_sql.pgtle.sql)
# as far as it can be checked without pg_tle, which Debian does not package
# and this machine cannot download:
#
#   1. a stand-in pgtle.install_extension(name, version, description, ext,
#      requires) with pg_tle's signature, callable only by members of a
#      pgtle_admin role as pg_tle's is, refuses what pg_tle refuses (ext
#      holding either of pg_tle's own dollar quotes, $_pgtle_o_$ and
#      $_pgtle_i_$, or a name of the generated functions over 63 bytes) and
#      keeps its arguments; the script runs, unchanged, as the database owner
#      (not superuser, no CREATEROLE) and must call it exactly once, for
#      idempotency_sql 1.2;
#   2. the extension pg_tle would then offer is made of what was kept: a
#      control with pg_tle's settings (relocatable, superuser and trusted
#      all false, so that any role with CREATE on the database creates it,
#      as itself) and the ext text as its script; the owner runs CREATE
#      EXTENSION idempotency_sql, and the API answers acquired, replay with
#      the stored response, mismatch, a fenced completion (55000), a token
#      consumed once; DROP EXTENSION removes everything it made;
#   3. its members are those of CREATE EXTENSION idempotency_sql from the
#      regular files (sql-edition/build/), compared by pg_describe_object,
#      but for the schema the pg_tle script makes itself (pg_tle takes no
#      control file, so no "schema =").
#
# What this cannot show: pg_tle's own execution of the text (its copy of
# PostgreSQL's extension code) and its catalog.  docs/managed.md says so.
# As root, like sql-edition/test.sh (which runs it): a throwaway cluster of
# the private PostgreSQL copy (IDEM_PG_PREFIX, else one of our own); the
# regular edition files are installed in that copy, and put back on exit.  Closing line: "pg_tle: N of M checks passed."
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
# shellcheck source=../scripts/common.sh
source "$ROOT/scripts/common.sh"
if [[ -z ${IDEM_PG_PREFIX:-} || ! -x $IDEM_PG_PREFIX/lib/postgresql/$IDEM_PG_MAJOR/bin/pg_config ]]; then
	use_private_pg
	PG_BINDIR=$IDEM_PG_PREFIX/lib/postgresql/$IDEM_PG_MAJOR/bin
fi
EXTDIR=$("$PG_BINDIR/pg_config" --sharedir)/extension
make -s --no-print-directory -C "$HERE" >/dev/null
# the regular files (the comparison's side), into the private copy only
restore() {
	install -m 644 "$HERE/build/idempotency_sql.control" "$HERE/build/idempotency_sql--1.2.sql" "$EXTDIR/"
}
restore

STAGE=$(mktemp -d "${TMPDIR:-/tmp}/sqled-tle.XXXXXX")
printf '# the pg_tle test: nothing preloaded\nmax_connections = 20\n' >"$STAGE/regress.conf"
REPO_ROOT=$STAGE IDEM_QUIET=1 start_cluster fast >/dev/null    # its EXIT trap stops the server
REPO_ROOT=$ROOT
rm -rf "$STAGE"
SOCK=$IDEM_TMPDIR/socket
W=$IDEM_TMPDIR/tle
mkdir -p "$W"
cp "$HERE/build/idempotency_sql.pgtle.sql" "$W/"    # as root: postgres may not enter the clone
chown -R postgres: "$W"

# the regular files back in place whatever happens, then common.sh's own
# clean-up (the server, its log kept on failure, a private copy of our own)
trap 'st=$?; restore || true; (exit "$st"); _idem_on_exit' EXIT

P() {	# P ROLE DB [psql args]: psql -XAt as ROLE in DB
	local role=$1 db=$2
	shift 2
	as_postgres "$PG_BINDIR/psql" -X -A -t -q -v ON_ERROR_STOP=1 -h "$SOCK" -p "$PGPORT" -U "$role" -d "$db" "$@"
}
passed=0 total=0
check() {	# check WHAT EXPECTED ACTUAL
	total=$((total + 1))
	if [[ $2 == "$3" ]]; then
		passed=$((passed + 1))
		echo "ok $total - $1"
	else
		echo "not ok $total - $1: expected [$2], got [$3]"
	fi
}

P postgres postgres <<-'SQL'
	CREATE ROLE tle_owner LOGIN NOSUPERUSER NOCREATEROLE NOCREATEDB;
	CREATE ROLE pgtle_admin NOLOGIN;
	GRANT pgtle_admin TO tle_owner;
	CREATE DATABASE tle OWNER tle_owner;
	CREATE DATABASE files OWNER tle_owner;
SQL
# The stand-in: pg_tle 1.5's signature and refusals (src/tleextension.c:
# the two delimiters it wraps the text in; names of the generated
# functions "NAME--VERSION.sql" and "NAME.control" within NAMEDATALEN).
P postgres tle <<-'SQL'
	CREATE SCHEMA pgtle;
	GRANT USAGE ON SCHEMA pgtle TO pgtle_admin;
	CREATE TABLE pgtle.kept (name text, version text, description text, ext text, requires text[]);
	CREATE FUNCTION pgtle.install_extension(name text, version text, description text, ext text,
	                                        requires text[] DEFAULT NULL)
	RETURNS boolean LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog AS $$
	BEGIN
	    IF strpos(ext, '$_pgtle_o_$') > 0 OR strpos(ext, '$_pgtle_i_$') > 0 THEN
	        RAISE EXCEPTION 'invalid character in extension definition' USING ERRCODE = '22023';
	    END IF;
	    IF octet_length(name || '--' || version || '.sql') > 63 OR octet_length(name || '.control') > 63 THEN
	        RAISE EXCEPTION 'extension name or version too long' USING ERRCODE = '22023';
	    END IF;
	    INSERT INTO pgtle.kept VALUES (name, version, description, ext, requires);
	    RETURN true;
	END
	$$;
	REVOKE ALL ON FUNCTION pgtle.install_extension(text, text, text, text, text[]) FROM PUBLIC;
	GRANT EXECUTE ON FUNCTION pgtle.install_extension(text, text, text, text, text[]) TO pgtle_admin;
SQL

# 1. the script as the owner
out=$(P tle_owner tle -f "$W/idempotency_sql.pgtle.sql" 2>&1) && rc=0 || rc=$?
check "the pg_tle script runs as the database owner" "0" "$rc"
[[ $rc == 0 ]] || echo "$out"
check "it calls pgtle.install_extension once, for idempotency_sql 1.2, requiring nothing more" \
	"1|idempotency_sql|1.2|t" \
	"$(P postgres tle -c "SELECT count(*) OVER (), name, version, requires IS NULL FROM pgtle.kept")"

# 2. the extension pg_tle would offer, made of what was kept
P postgres tle -c "SELECT ext FROM pgtle.kept" >"$W/ext.sql"
check "the kept text is the edition's script (without its psql guard, with CREATE SCHEMA)" \
	"$(sed -n '/^\$_idem_tle_\$$/,/^\$_idem_tle_\$$/p' "$HERE/build/idempotency_sql.pgtle.sql" | sed '1d;$d' | md5sum)" \
	"$(sed '1d;$d' "$W/ext.sql" | md5sum)"
{
	echo "# what pg_tle builds for idempotency_sql (pgtle.install_extension)"
	echo "comment = '$(P postgres tle -c "SELECT replace(description, '''', '''''') FROM pgtle.kept")'"
	echo "default_version = '1.2'"
	echo "relocatable = false"
	echo "superuser = false"
	echo "trusted = false"
} >"$EXTDIR/idempotency_sql.control"
install -m 644 "$W/ext.sql" "$EXTDIR/idempotency_sql--1.2.sql"
out=$(P tle_owner tle -c 'CREATE EXTENSION idempotency_sql' 2>&1) && rc=0 || rc=$?
check "CREATE EXTENSION idempotency_sql as the owner (not superuser)" "0" "$rc"
[[ $rc == 0 ]] || echo "$out"
api=$(P tle_owner tle 2>/dev/null <<-'SQL'
	\set ON_ERROR_STOP 0
	SELECT claim AS c FROM idempotency.idem_acquire('k1', '{"a": 1}', 's', lease => '1 min') \gset
	SELECT 'acquired' WHERE :'c' IS NOT NULL;
	SELECT idempotency.idem_complete('k1', 201, '{"id": 7}', 's', claim => :'c') \g /dev/null
	SELECT outcome, response_status, response_body FROM idempotency.idem_acquire('k1', '{"a": 1}', 's');
	SELECT outcome FROM idempotency.idem_acquire('k1', '{"a": 2}', 's');
	SELECT claim AS c2 FROM idempotency.idem_acquire('k2', lease => '1 min') \gset
	SELECT idempotency.idem_complete('k2', 200, '{}', claim => gen_random_uuid());
	\echo :SQLSTATE
	SELECT idempotency.idem_token_issue() AS t \gset
	SELECT idempotency.idem_token_consume(:'t');
	SELECT idempotency.idem_token_consume(:'t');
SQL
) || true
check "the API: acquired, replay with the response, mismatch, a wrong claim refused, a token once" \
	"acquired|replay|201|{\"id\": 7}|mismatch|55000|t|f" "$(paste -sd'|' <<<"$api")"

# 3. the same members as CREATE EXTENSION from the regular files
members() {
	P tle_owner "$1" -c "SELECT pg_describe_object(classid, objid, objsubid) FROM pg_depend
		WHERE refclassid = 'pg_extension'::regclass AND deptype = 'e'
		  AND refobjid = (SELECT oid FROM pg_extension WHERE extname = 'idempotency_sql')
		  AND classid <> 'pg_namespace'::regclass ORDER BY 1"
}
members tle >"$W/tle.members"
restore
P tle_owner files -c 'CREATE EXTENSION idempotency_sql'
members files >"$W/files.members"
check "the same $(wc -l <"$W/files.members") members as from the regular files" "" \
	"$(diff "$W/files.members" "$W/tle.members" | head -5)"
out=$(P tle_owner tle -c 'DROP EXTENSION idempotency_sql' -c "SELECT count(*) FROM pg_namespace WHERE nspname LIKE 'idempotency%'" 2>&1) && rc=0 || rc=$?
check "DROP EXTENSION removes it, its schemas included" "0" "$out"

echo "pg_tle: $passed of $total checks passed."
((passed == total))
