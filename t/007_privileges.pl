# Copyright (c) idempotency authors
#
# Privileges and search_path, complementing sql/08_privileges and
# sql/09_search_path (which check every API function and the table under
# SET ROLE, and the API under a hostile search_path):
#
#   1. the catalog: no SECURITY DEFINER function in the schema; every SQL or
#      PL/pgSQL function pins search_path to "pg_catalog, pg_temp"; every
#      object (schema, tables, partitions, view, index, types, functions) is
#      owned by the superuser who ran CREATE EXTENSION; nothing is granted to
#      PUBLIC; a non-superuser cannot install the extension;
#   2. a login role without the README's grants, on its own connection:
#      42501 from every function (internal ones included), the table, its
#      partitions and the partitions view;
#   3. an application role with exactly the README's grants cannot widen
#      its rights through the extension: not the maintenance or internal
#      functions, not the partitions directly, no CREATE in the schema, no
#      ALTER/DROP/REPLACE of the extension's objects, no trigger or rule on
#      the table (code that would run with other roles' rights), no
#      superuser-only setting;
#   4. maintenance run by the superuser with the application's hostile
#      schema first on search_path (functions and operators named like the
#      built-ins it uses) runs none of them; temporary tables named like the
#      extension's and the catalogs' relations change nothing either;
#   5. a record the application inserts directly, with an expires_at far
#      beyond max_ttl, does not make the owner's maintenance run (holding
#      its ACCESS EXCLUSIVE lock) for long: it stays in DEFAULT.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::RealBin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time);

my $node = idem_node('privs', "log_statement = none\n");

$node->safe_psql(
	'postgres', q{
CREATE ROLE idem_installer LOGIN SUPERUSER;
CREATE ROLE idem_app LOGIN;
CREATE ROLE idem_nogrant LOGIN;
CREATE ROLE idem_creator LOGIN;
CREATE DATABASE privs OWNER idem_installer;
GRANT CREATE ON DATABASE privs TO idem_creator;
});

# run SQL in database privs as ROLE, on its own connection
sub as_role
{
	my ($role, $sql) = @_;
	my ($ret, $out, $err) = $node->psql('privs', $sql,
		extra_params => [ '-U', $role, '-v', 'VERBOSITY=verbose' ]);
	return ($ret, $out, $err);
}

sub as_role_safe
{
	my ($role, $sql) = @_;
	my ($ret, $out, $err) = as_role($role, $sql);
	die "as $role: $sql: $err" if $ret != 0;
	return $out;
}

# a non-superuser cannot install it (superuser = true, not trusted)
my ($ret, $out, $err) = as_role('idem_creator', 'CREATE EXTENSION idempotency');
like($err, qr/ERROR:\s+42501:/, 'a non-superuser with CREATE on the database cannot CREATE EXTENSION (42501)');

as_role_safe(
	'idem_installer', "CREATE EXTENSION idempotency;\n"
	  # the README's grants
	  . sql_fixture('readme_grants.sql', app_role => 'idem_app')
	  # a helper every role may call: 'ok' or the SQLSTATE of a statement
	  . sql_fixture('sqlstate_of.sql') . q{
GRANT EXECUTE ON FUNCTION public.sqlstate_of(text) TO PUBLIC;
SELECT * FROM idempotency.idem_maintain();
});
my $dated = as_role_safe('idem_installer',
	q{SELECT partition FROM idempotency.partitions WHERE NOT is_default ORDER BY range_start LIMIT 1});
like($dated, qr/^idempotency\.records_p\d/, "a dated partition to try ($dated)");

# ---------------------------------------------------------------------
# 1. the catalog
# ---------------------------------------------------------------------
is( as_role_safe(
		'idem_installer', q{
SELECT count(*) FROM pg_proc WHERE pronamespace = 'idempotency'::regnamespace AND prosecdef}),
	'0', 'no SECURITY DEFINER function in schema idempotency');
is( as_role_safe(
		'idem_installer', q{
SELECT coalesce(string_agg(p.oid::regprocedure::text || ' ' || coalesce(array_to_string(p.proconfig, ','), 'no SET'), '; '), '')
  FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
 WHERE p.pronamespace = 'idempotency'::regnamespace
   AND l.lanname NOT IN ('c', 'internal')
   AND NOT coalesce('search_path=pg_catalog, pg_temp' = ANY (p.proconfig), false)}),
	'', 'every SQL and PL/pgSQL function pins search_path = pg_catalog, pg_temp');
is( as_role_safe(
		'idem_installer', q{
SELECT coalesce(string_agg(p.oid::regprocedure::text, ', '), '')
  FROM pg_proc p
 WHERE p.pronamespace = 'idempotency'::regnamespace
   AND EXISTS (SELECT FROM unnest(p.proconfig) c WHERE c LIKE 'search_path=%'
                AND c <> 'search_path=pg_catalog, pg_temp')}),
	'', 'no function sets any other search_path');

my $owners = as_role_safe(
	'idem_installer', q{
SELECT string_agg(DISTINCT kind || ':' || owner, ',' ORDER BY kind || ':' || owner) FROM (
    SELECT 'schema' kind, nspowner::regrole::text owner FROM pg_namespace WHERE nspname = 'idempotency'
    UNION ALL
    SELECT 'relation', relowner::regrole::text FROM pg_class WHERE relnamespace = 'idempotency'::regnamespace
    UNION ALL
    SELECT 'function', proowner::regrole::text FROM pg_proc WHERE pronamespace = 'idempotency'::regnamespace
    UNION ALL
    SELECT 'type', typowner::regrole::text FROM pg_type WHERE typnamespace = 'idempotency'::regnamespace
) o});
is($owners, 'function:idem_installer,relation:idem_installer,schema:idem_installer,type:idem_installer',
	'schema, relations (partitions included), functions and types are owned by the installing superuser');
is( as_role_safe(
		'idem_installer', q{
SELECT coalesce(string_agg(what, ', '), '') FROM (
    SELECT 'schema ' || privilege_type AS what
      FROM pg_namespace n, aclexplode(n.nspacl) a
     WHERE n.nspname = 'idempotency' AND a.grantee = 0
    UNION ALL
    SELECT c.oid::regclass || ' ' || a.privilege_type
      FROM pg_class c, aclexplode(c.relacl) a
     WHERE c.relnamespace = 'idempotency'::regnamespace AND a.grantee = 0
    UNION ALL
    SELECT p.oid::regprocedure || ' ' || a.privilege_type
      FROM pg_proc p, aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a
     WHERE p.pronamespace = 'idempotency'::regnamespace AND a.grantee = 0
) w}),
	'', 'nothing in the schema is granted to PUBLIC (schema, relations, view, partitions, functions)');

# ---------------------------------------------------------------------
# 2 and 3: what each role may do
# ---------------------------------------------------------------------
my @everything = (
	[ 'idem_acquire', q{SELECT * FROM idempotency.idem_acquire('p-1')} ],
	[ 'idem_complete', q{SELECT idempotency.idem_complete('p-1', 200)} ],
	[ 'idem_release', q{SELECT idempotency.idem_release('p-1')} ],
	[ 'idem_lookup', q{SELECT * FROM idempotency.idem_lookup('p-1')} ],
	[ 'idem_request_hash', q{SELECT idempotency.idem_request_hash('{}')} ],
	[ 'idem_maintain', q{SELECT * FROM idempotency.idem_maintain()} ],
	[ 'idem_schedule_maintenance', q{SELECT idempotency.idem_schedule_maintenance()} ],
	[ 'idem_unschedule_maintenance', q{SELECT idempotency.idem_unschedule_maintenance()} ],
	[ 'maintenance_settings (internal)', q{SELECT * FROM idempotency.maintenance_settings()} ],
	[ 'cron_check (internal)', q{SELECT idempotency.cron_check('* * * * *')} ],
	[ 'SELECT records', q{SELECT count(*) FROM idempotency.records} ],
	[ 'SELECT records_default', q{SELECT count(*) FROM idempotency.records_default} ],
	[ 'SELECT dated partition', qq{SELECT count(*) FROM $dated} ],
	[ 'INSERT dated partition', qq{INSERT INTO $dated (scope, key, status, created_at, expires_at) SELECT '', 'x', 'processing', now(), range_start FROM idempotency.partitions WHERE partition = '$dated'::regclass} ],
	[ 'INSERT records_default', q{INSERT INTO idempotency.records_default (scope, key, status, created_at, expires_at) VALUES ('', 'x', 'processing', now(), now() + interval '1000 days')} ],
	[ 'UPDATE records_default', q{UPDATE idempotency.records_default SET attempt = attempt} ],
	[ 'DELETE dated partition', qq{DELETE FROM $dated} ],
	[ 'SELECT partitions view', q{SELECT count(*) FROM idempotency.partitions} ],
);
my @app_must_not = (
	[ 'CREATE TABLE in the schema', q{CREATE TABLE idempotency.mine (x int)} ],
	[ 'CREATE FUNCTION in the schema', q{CREATE FUNCTION idempotency.now() RETURNS timestamptz LANGUAGE sql AS 'SELECT NULL::timestamptz'} ],
	[ 'CREATE VIEW in the schema', q{CREATE VIEW idempotency.v AS SELECT 1} ],
	[ 'CREATE TYPE in the schema', q{CREATE TYPE idempotency.t AS (x int)} ],
	[ 'CREATE OPERATOR in the schema', q{CREATE OPERATOR idempotency.= (LEFTARG = text, RIGHTARG = text, FUNCTION = texteq)} ],
	[ 'CREATE OR REPLACE idem_acquire', q{CREATE OR REPLACE FUNCTION idempotency.idem_acquire(key text, request jsonb DEFAULT NULL, scope text DEFAULT '', ttl interval DEFAULT NULL, lease interval DEFAULT NULL) RETURNS TABLE (outcome text, response_status int, response_body jsonb, attempt int, expires_at timestamptz) LANGUAGE sql AS $$SELECT 'replay', 200, NULL::jsonb, 1, now()$$} ],
	[ 'ALTER FUNCTION ... SECURITY DEFINER', q{ALTER FUNCTION idempotency.idem_acquire(text, jsonb, text, interval, interval, boolean, text) SECURITY DEFINER} ],
	[ 'ALTER FUNCTION ... SET search_path', q{ALTER FUNCTION idempotency.idem_maintain() SET search_path = public} ],
	[ 'ALTER FUNCTION ... OWNER', q{ALTER FUNCTION idempotency.idem_lookup(text, text) OWNER TO idem_app} ],
	[ 'DROP FUNCTION', q{DROP FUNCTION idempotency.idem_request_hash(jsonb)} ],
	[ 'ALTER TABLE records', q{ALTER TABLE idempotency.records ADD COLUMN x int} ],
	[ 'ALTER TABLE records OWNER', q{ALTER TABLE idempotency.records OWNER TO idem_app} ],
	[ 'ALTER TABLE ... ENABLE ROW LEVEL SECURITY', q{ALTER TABLE idempotency.records ENABLE ROW LEVEL SECURITY} ],
	[ 'CREATE POLICY', q{CREATE POLICY p ON idempotency.records USING (false)} ],
	[ 'ATTACH PARTITION', q{CREATE TABLE public.mine (LIKE idempotency.records); ALTER TABLE idempotency.records ATTACH PARTITION public.mine FOR VALUES FROM ('2200-01-01') TO ('2200-01-02')} ],
	[ 'DETACH PARTITION', q{ALTER TABLE idempotency.records DETACH PARTITION idempotency.records_default} ],
	[ 'DROP TABLE records_default', q{DROP TABLE idempotency.records_default} ],
	[ 'TRUNCATE records', q{TRUNCATE idempotency.records} ],
	[ 'CREATE TRIGGER on records', q{CREATE FUNCTION public.trg() RETURNS trigger LANGUAGE plpgsql AS 'BEGIN RETURN NEW; END'; CREATE TRIGGER t BEFORE INSERT ON idempotency.records FOR EACH ROW EXECUTE FUNCTION public.trg()} ],
	[ 'CREATE RULE on records', q{CREATE RULE r AS ON INSERT TO idempotency.records DO ALSO NOTIFY x} ],
	[ 'CREATE INDEX on records', q{CREATE INDEX ON idempotency.records (key)} ],
	[ 'ALTER EXTENSION', q{ALTER EXTENSION idempotency ADD FUNCTION public.sqlstate_of(text)} ],
	[ 'DROP EXTENSION', q{DROP EXTENSION idempotency} ],
	[ 'ALTER SCHEMA OWNER', q{ALTER SCHEMA idempotency OWNER TO idem_app} ],
	[ 'ALTER ROLE self SET idempotency.max_ttl', q{ALTER ROLE idem_app SET idempotency.max_ttl = '3650d'} ],
);

# states(ROLE, [[what, sql], ...]): { what => 'ok' or SQLSTATE }, each
# statement run by ROLE in a subtransaction of its own, all rolled back
sub states
{
	my ($role, $list) = @_;
	my @rows = map { [ $list->[$_][0], $list->[$_][1] ] } 0 .. $#$list;
	my $values = join(",\n",
		map {
			my ($what, $sql) = @{ $rows[$_] };
			$sql =~ s/'/''/g;
			$what =~ s/'/''/g;
			"($_, '$what', '$sql')"
		} 0 .. $#rows);
	my $out = as_role_safe(
		$role, qq{
BEGIN;
SELECT n, what, public.sqlstate_of(stmt) FROM (VALUES $values) v(n, what, stmt) ORDER BY n;
ROLLBACK;
});
	my %got;
	foreach (split /\n/, $out)
	{
		my ($n, $what, $state) = split /\|/;
		$got{$what} = $state;
	}
	return \%got;
}

my $before = as_role_safe('idem_installer', q{SELECT count(*) || '/' || coalesce(md5(string_agg(r::text, '|' ORDER BY r::text)), '') FROM idempotency.records r});

# 2. no grants at all: 42501 from everything
my $got = states('idem_nogrant', \@everything);
foreach my $e (@everything)
{
	is($got->{ $e->[0] }, '42501', "no grants: $e->[0]: 42501");
}

# 3. the README's grants: the API works ...
is( as_role_safe(
		'idem_app', q{
SET idempotency.wait_timeout = 0;
SELECT outcome FROM idempotency.idem_acquire('app-1', '{"a": 1}');
SELECT idempotency.idem_complete('app-1', 201, '{"id": 1}');
SELECT outcome FROM idempotency.idem_acquire('app-1', '{"a": 1}');
SELECT count(*) FROM idempotency.records WHERE key = 'app-1';
}),
	"acquired\nt\nreplay\n1", 'README grants: the API and the table work');

# ... and nothing more (SELECT on records is one of the grants)
my @app_refused = ((grep { $_->[0] ne 'SELECT records' } @everything[ 5 .. $#everything ]), @app_must_not);
$got = states('idem_app', \@app_refused);
foreach my $e (@app_refused)
{
	is($got->{ $e->[0] }, '42501', "README grants: $e->[0]: 42501");
}

# GRANT without the grant option only warns: check that nothing was granted
($ret, $out, $err) = as_role('idem_app', 'GRANT SELECT, INSERT ON idempotency.records TO idem_nogrant');
like($err, qr/no privileges were granted/, 'README grants: GRANT on records to another role grants nothing');
is( as_role_safe('idem_installer',
		q{SELECT has_table_privilege('idem_nogrant', 'idempotency.records', 'SELECT')
		      OR has_table_privilege('idem_nogrant', 'idempotency.records', 'INSERT')}),
	'f', 'README grants: the other role still has no privilege on records');

# the superuser-only settings: 42501 once the library is loaded; set as
# placeholders before it is loaded, they are dropped (with a warning) when
# it loads, so the limits in force stay the server's
($ret, $out, $err) = as_role(
	'idem_app', q{
SELECT idempotency.idem_request_hash('{}') IS NOT NULL;
SELECT public.sqlstate_of($$SET idempotency.max_ttl = '3650d'$$),
       public.sqlstate_of($$SET idempotency.max_response_bytes = '1GB'$$),
       public.sqlstate_of($$SET idempotency.partition_interval = '1s'$$),
       public.sqlstate_of($$SET idempotency.maintenance_lock_timeout = '1h'$$),
       public.sqlstate_of($$ALTER ROLE idem_app SET idempotency.max_ttl = '3650d'$$);
});
is($out, "t\n42501|42501|42501|42501|42501",
	'README grants: SET of max_ttl, max_response_bytes, partition_interval, maintenance_lock_timeout and ALTER ROLE SET max_ttl: 42501');
($ret, $out, $err) = as_role(
	'idem_app', q{
SET idempotency.max_ttl = '3650d';
SET idempotency.max_response_bytes = '1GB';
SET idempotency.partition_interval = '1s';
SET idempotency.maintenance_lock_timeout = '1h';
SELECT public.sqlstate_of($$SELECT * FROM idempotency.idem_acquire('esc-1', ttl => '100 days')$$);
SELECT outcome FROM idempotency.idem_acquire('esc-2');
SELECT public.sqlstate_of($$SELECT idempotency.idem_complete('esc-2', 200, jsonb_build_object('p', repeat('x', 2000000)))$$);
SHOW idempotency.max_ttl;
SHOW idempotency.max_response_bytes;
SHOW idempotency.partition_interval;
SHOW idempotency.maintenance_lock_timeout;
SELECT idempotency.idem_release('esc-2');
});
is($out, "22023\nacquired\n54000\n7d\n1MB\n1d\n100ms\nt",
	'README grants: superuser-only settings set before the library loads are dropped: ttl 100 days still 22023, a 2 MB body still 54000');
like($err, qr/permission denied to set parameter "idempotency.max_ttl"/, 'with a warning when the library loads');

is( as_role_safe('idem_installer',
		q{SELECT count(*) || '/' || coalesce(md5(string_agg(r::text, '|' ORDER BY r::text)), '') FROM idempotency.records r WHERE key <> 'app-1'}),
	$before, 'the refused statements changed no record');
is( as_role_safe(
		'idem_installer', q{
SELECT count(*) FROM pg_proc WHERE pronamespace = 'idempotency'::regnamespace AND prosecdef}),
	'0', 'still no SECURITY DEFINER function');

# ---------------------------------------------------------------------
# 4. hostile search_path for maintenance; temporary look-alikes
# ---------------------------------------------------------------------
as_role_safe('idem_installer', 'CREATE SCHEMA app AUTHORIZATION idem_app');
as_role_safe(
	'idem_app', q{
CREATE FUNCTION app.trap(what text) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'hostile % called', what;
END
$$;
CREATE FUNCTION app.format(text, text) RETURNS text LANGUAGE sql AS $$ SELECT NULL::text WHERE app.trap('format') $$;
CREATE FUNCTION app.format(text, regclass) RETURNS text LANGUAGE sql AS $$ SELECT NULL::text WHERE app.trap('format') $$;
CREATE FUNCTION app.format(text, text, timestamptz, timestamptz) RETURNS text LANGUAGE sql AS $$ SELECT NULL::text WHERE app.trap('format') $$;
CREATE FUNCTION app.format(text, regclass, timestamptz, timestamptz) RETURNS text LANGUAGE sql AS $$ SELECT NULL::text WHERE app.trap('format') $$;
CREATE FUNCTION app.format(text, timestamptz, timestamptz, regclass) RETURNS text LANGUAGE sql AS $$ SELECT NULL::text WHERE app.trap('format') $$;
CREATE FUNCTION app.to_char(timestamp, text) RETURNS text LANGUAGE sql AS $$ SELECT NULL::text WHERE app.trap('to_char') $$;
CREATE FUNCTION app.to_timestamp(double precision) RETURNS timestamptz LANGUAGE sql AS $$ SELECT NULL::timestamptz WHERE app.trap('to_timestamp') $$;
CREATE FUNCTION app.floor(double precision) RETURNS double precision LANGUAGE sql AS $$ SELECT NULL::float8 WHERE app.trap('floor') $$;
CREATE FUNCTION app.clock_timestamp() RETURNS timestamptz LANGUAGE sql AS $$ SELECT NULL::timestamptz WHERE app.trap('clock_timestamp') $$;
CREATE FUNCTION app.now() RETURNS timestamptz LANGUAGE sql AS $$ SELECT NULL::timestamptz WHERE app.trap('now') $$;
CREATE FUNCTION app.set_config(text, text, boolean) RETURNS text LANGUAGE sql AS $$ SELECT NULL::text WHERE app.trap('set_config') $$;
CREATE FUNCTION app.current_setting(text, boolean) RETURNS text LANGUAGE sql AS $$ SELECT NULL::text WHERE app.trap('current_setting') $$;
CREATE FUNCTION app.current_database() RETURNS name LANGUAGE sql AS $$ SELECT NULL::name WHERE app.trap('current_database') $$;
CREATE FUNCTION app.regexp_match(text, text) RETURNS text[] LANGUAGE sql AS $$ SELECT NULL::text[] WHERE app.trap('regexp_match') $$;
CREATE FUNCTION app.pg_get_expr(pg_node_tree, oid) RETURNS text LANGUAGE sql AS $$ SELECT NULL::text WHERE app.trap('pg_get_expr') $$;
CREATE FUNCTION app.tstz_cmp(timestamptz, timestamptz) RETURNS boolean LANGUAGE sql AS $$ SELECT app.trap('timestamptz comparison') $$;
CREATE FUNCTION app.tstz_plus(timestamptz, interval) RETURNS timestamptz LANGUAGE sql AS $$ SELECT NULL::timestamptz WHERE app.trap('timestamptz + interval') $$;
CREATE FUNCTION app.text_cat(text, text) RETURNS text LANGUAGE sql AS $$ SELECT NULL::text WHERE app.trap('text || text') $$;
CREATE FUNCTION app.text_eq(text, text) RETURNS boolean LANGUAGE sql AS $$ SELECT app.trap('text = text') $$;
CREATE FUNCTION app.oid_eq(oid, oid) RETURNS boolean LANGUAGE sql AS $$ SELECT app.trap('oid = oid') $$;
CREATE OPERATOR app.<= (LEFTARG = timestamptz, RIGHTARG = timestamptz, FUNCTION = app.tstz_cmp);
CREATE OPERATOR app.<  (LEFTARG = timestamptz, RIGHTARG = timestamptz, FUNCTION = app.tstz_cmp);
CREATE OPERATOR app.>  (LEFTARG = timestamptz, RIGHTARG = timestamptz, FUNCTION = app.tstz_cmp);
CREATE OPERATOR app.>= (LEFTARG = timestamptz, RIGHTARG = timestamptz, FUNCTION = app.tstz_cmp);
CREATE OPERATOR app.+  (LEFTARG = timestamptz, RIGHTARG = interval, FUNCTION = app.tstz_plus);
CREATE OPERATOR app.|| (LEFTARG = text, RIGHTARG = text, FUNCTION = app.text_cat);
CREATE OPERATOR app.=  (LEFTARG = text, RIGHTARG = text, FUNCTION = app.text_eq);
CREATE OPERATOR app.=  (LEFTARG = oid, RIGHTARG = oid, FUNCTION = app.oid_eq);
CREATE TABLE app.records (LIKE idempotency.records);
CREATE TABLE app.partitions (partition regclass, range_start timestamptz, range_end timestamptz, is_default boolean);
CREATE TABLE app.pg_inherits (inhrelid oid, inhparent oid);
GRANT USAGE ON SCHEMA app TO PUBLIC;
GRANT SELECT ON ALL TABLES IN SCHEMA app TO PUBLIC;
});
($ret, $out, $err) = as_role(
	'idem_installer', q{
SET search_path = app, pg_catalog, public;
SET idempotency.partition_interval = '1h';
SET idempotency.max_ttl = '10d';             -- so that there are partitions to make
SELECT partitions_created > 0 FROM idempotency.idem_maintain();
SELECT outcome FROM idempotency.idem_acquire('su-1', '{"a": 1}');
});
is($ret, 0, 'maintenance by the superuser under the app\'s hostile search_path runs') or diag($err);
unlike($err, qr/hostile/, 'and calls none of the app\'s look-alike functions or operators');
is($out, "t\nacquired", 'it did its work (created partitions), and the API still answers');
is(as_role_safe('idem_installer', 'SELECT (SELECT count(*) FROM app.records) + (SELECT count(*) FROM app.partitions) + (SELECT count(*) FROM app.pg_inherits)'),
	'0', 'the look-alike tables were not touched');

# temporary tables come first on any search_path (for relations, unless
# pg_temp is placed explicitly): look-alikes there must change nothing
($ret, $out, $err) = as_role(
	'idem_installer', q{
CREATE TEMP TABLE records (LIKE idempotency.records);
CREATE TEMP TABLE records_default (LIKE idempotency.records);
CREATE TEMP TABLE partitions (partition regclass, range_start timestamptz, range_end timestamptz, is_default boolean);
CREATE TEMP TABLE pg_inherits (inhrelid oid, inhparent oid, inhseqno int, inhdetachpending boolean);
CREATE TEMP TABLE pg_class (oid oid, relname name);
CREATE TEMP TABLE pg_namespace (oid oid, nspname name);
CREATE TEMP TABLE pg_locks (pid int);
CREATE TEMP TABLE pg_settings (name text, setting text);
CREATE TEMP TABLE pg_extension (extname name);
SET search_path = idempotency, public;
SET idempotency.wait_timeout = 0;
SELECT outcome FROM idem_acquire('tmp-1', '{"a": 1}');
SELECT idem_complete('tmp-1', 201, '{"id": 1}');
SELECT outcome, response_status FROM idem_acquire('tmp-1', '{"a": 1}');
SELECT status FROM idem_lookup('tmp-1');
SELECT outcome FROM idem_acquire('tmp-2', lease => '1 hour');
SELECT idem_release('tmp-2');
SELECT partitions_created >= 0 FROM idem_maintain();
SELECT (SELECT count(*) FROM pg_temp.records) + (SELECT count(*) FROM pg_temp.records_default)
     + (SELECT count(*) FROM pg_temp.partitions) + (SELECT count(*) FROM pg_temp.pg_inherits);
SELECT count(*) FROM idempotency.records WHERE key IN ('tmp-1', 'tmp-2');
});
is($ret, 0, 'with temporary look-alike relations, the API and maintenance run') or diag($err);
is($out, "acquired\nt\nreplay|201\ncompleted\nacquired\nt\nt\n0\n1",
	'and answer as without them; the look-alikes stay empty, the records land in idempotency.records');

# ---------------------------------------------------------------------
# 5. a record planted with a far expires_at
# ---------------------------------------------------------------------
# The owner's maintenance must finish well within its statement_timeout:
# 3 s, or 3 times (half a second and twice a maintenance run with nothing
# to do, psql's start included) where that is longer on a slow machine.
my $t_maint = time;
as_role_safe('idem_installer', 'SELECT * FROM idempotency.idem_maintain()');
my $maint_secs = time - $t_maint;
my $stmt_timeout = window_secs(3 * (0.5 + 2 * $maint_secs), 1, 3);
note sprintf('a maintenance run takes %.2f s: statement_timeout %d s', $maint_secs, $stmt_timeout);
as_role_safe(
	'idem_app', q{
INSERT INTO idempotency.records (scope, key, status, created_at, expires_at)
VALUES ('', 'planted', 'processing', now(), now() + interval '30 years')});
# the owner's maintenance in the background, stopped by statement_timeout
my $maint = $node->background_psql('privs', on_error_stop => 0,
	extra_params => [ '-U', 'idem_installer', '-v', 'VERBOSITY=verbose' ]);
my $t0 = time;
$maint->query_until(qr/started/, qq{
SET statement_timeout = '${stmt_timeout}s';
\\echo started
SELECT * FROM idempotency.idem_maintain();
\\echo done
\\warn done
});
select(undef, undef, undef, 0.5);
# meanwhile, the application's traffic
my ($bret, $bout, $berr) = as_role(
	'idem_app', q{
SET lock_timeout = '500ms';
SET idempotency.wait_timeout = 0;
SELECT outcome FROM idempotency.idem_acquire('during-maintenance');
});
pump_until($maint->{run}, $maint->{timeout}, \$maint->{stderr}, qr/done/);
my $secs = time - $t0;
($ret, $err) = ($maint->{stderr} =~ /ERROR/ ? 1 : 0, $maint->{stderr});
$maint->quit;
is($ret, 0,
	sprintf('maintenance is not held up by a record 30 years ahead (took %.1f s; %s)',
		$secs, ($err =~ /ERROR:\s+(\S+ [^\n]*)/)[0] // 'no error'));
cmp_ok($secs, '<', $stmt_timeout - 0.5,
	"and finishes well before its $stmt_timeout s statement_timeout");
is($bout, 'acquired',
	'and the application\'s acquire meanwhile is not blocked (lock_timeout 500ms: '
	  . (($berr =~ /ERROR:\s+(\S+ [^\n]*)/)[0] // 'no error') . ')');
as_role_safe('idem_installer', q{DELETE FROM idempotency.records WHERE key = 'planted'});

ok(!$node->log_contains(qr/terminated by signal|PANIC|TRAP:/), 'no backend crashed');
$node->stop;
done_testing();
