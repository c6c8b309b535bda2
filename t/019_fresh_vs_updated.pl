# Copyright (c) idempotency authors
#
# A fresh install of the default version, 1.3 (CREATE EXTENSION runs
# idempotency--1.1.sql, then idempotency--1.1--1.2.sql and
# idempotency--1.2--1.3.sql) equals 1.0 updated to 1.3
# (idempotency--1.0.sql, then every update) and 1.1 updated to 1.3; a fresh
# 1.1 install equals 1.0 updated to 1.1.  In each 1.3 database every dated partition
# (all empty) has 1.2's layout: the completion's columns last, fillfactor
# 94 (issue 36; t/024_upgrade_1_2.pl updates one holding records).
#
# On one cluster with the library preloaded, database "fresh" runs CREATE
# EXTENSION idempotency, "updated" CREATE EXTENSION idempotency VERSION
# '1.0' then ALTER EXTENSION idempotency UPDATE, and "updated11" CREATE
# EXTENSION idempotency VERSION '1.1' then the update ("fresh11" and
# "updated10to11" stop at 1.1).  Then, each compared with its fresh one:
#   - every object of the extension (pg_depend, deptype 'e'), by identity
#     and definition: functions (arguments and defaults, result, language,
#     prosrc, probin, proconfig, volatility, strictness, security, parallel,
#     rows, cost), relations (kind, columns with types, collations,
#     defaults and NOT NULL, constraints, indexes, triggers and their
#     enabled state, replica identity, reloptions, partition key, view
#     definitions), types (with their attributes), the schema; with the
#     owner-relative ACL and the comment of each;
#   - the extension's config tables (pg_extension_config_dump) in order;
#   - pg_init_privs (the initial privileges pg_dump leaves out);
#   - the partitions that install made (columns, triggers, not members);
#   - pg_dump --schema-only, whole;
# first as installed, then with the README's grants given to an application
# role in each (at the old version before the update in the updated ones).  Last, each runs the
# core calls (a claim, completion and replay, a token, maintenance, the
# statistics) to show both work.  t/012_upgrade.pl updates a live database;
# sql/15_upgrade.sql compares a smaller catalog view in the regression suite.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::RealBin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node = idem_node('fresh_vs_updated',
	"shared_preload_libraries = 'pg_cron,idempotency'\nlog_statement = none\n");

# What a catalog holds of the extension's objects, one line each, sorted.
# No OIDs: identities and definitions only.  ACLs and init privs name the
# owner as "owner", so that the two databases compare as text.
my $catalog_sql = q{
WITH ext AS (
    SELECT oid, extconfig, extcondition, extversion
      FROM pg_catalog.pg_extension WHERE extname = 'idempotency'),
member AS (
    SELECT d.classid, d.objid, d.objsubid
      FROM pg_catalog.pg_depend d, ext
     WHERE d.refclassid = 'pg_catalog.pg_extension'::pg_catalog.regclass
       AND d.refobjid = ext.oid AND d.deptype = 'e'),
lines AS (
    SELECT 'member ' || pg_catalog.pg_describe_object(m.classid, m.objid, m.objsubid)
           || ' comment=' || coalesce(pg_catalog.obj_description(m.objid, (SELECT c.relname FROM pg_catalog.pg_class c WHERE c.oid = m.classid)), '-') AS line
      FROM member m
    UNION ALL
    SELECT 'function ' || p.oid::pg_catalog.regprocedure::text
           || ' args=' || pg_catalog.pg_get_function_arguments(p.oid)
           || ' result=' || pg_catalog.pg_get_function_result(p.oid)
           || ' lang=' || l.lanname || ' kind=' || p.prokind::text
           || ' volatile=' || p.provolatile::text || ' strict=' || p.proisstrict
           || ' secdef=' || p.prosecdef || ' leakproof=' || p.proleakproof
           || ' parallel=' || p.proparallel::text || ' rows=' || p.prorows
           || ' cost=' || p.procost || ' retset=' || p.proretset
           || ' probin=' || coalesce(p.probin, '-')
           || ' config=' || coalesce(p.proconfig::text, '-')
           || ' acl=' || coalesce(pg_catalog.replace(p.proacl::text, p.proowner::pg_catalog.regrole::text, 'owner'), '-')
           || ' src=' || pg_catalog.md5(p.prosrc)
      FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_language l ON l.oid = p.prolang
     WHERE p.oid IN (SELECT objid FROM member WHERE classid = 'pg_catalog.pg_proc'::pg_catalog.regclass)
    UNION ALL
    SELECT 'relation ' || c.oid::pg_catalog.regclass::text || ' kind=' || c.relkind::text
           || ' persistence=' || c.relpersistence::text || ' replident=' || c.relreplident::text
           || ' options=' || coalesce(c.reloptions::text, '-')
           || ' partkey=' || coalesce(pg_catalog.pg_get_partkeydef(c.oid), '-')
           || ' bound=' || coalesce(pg_catalog.pg_get_expr(c.relpartbound, c.oid), '-')
           || ' acl=' || coalesce(pg_catalog.replace(c.relacl::text, c.relowner::pg_catalog.regrole::text, 'owner'), '-')
           || ' view=' || coalesce(pg_catalog.md5(pg_catalog.pg_get_viewdef(c.oid)), '-')
      FROM pg_catalog.pg_class c
     WHERE c.oid IN (SELECT objid FROM member WHERE classid = 'pg_catalog.pg_class'::pg_catalog.regclass)
    UNION ALL
    SELECT 'column ' || c.oid::pg_catalog.regclass::text || '.' || a.attnum || ' ' || a.attname
           || ' ' || pg_catalog.format_type(a.atttypid, a.atttypmod)
           || ' collation=' || coalesce((SELECT co.collname FROM pg_catalog.pg_collation co WHERE co.oid = a.attcollation), '-')
           || ' notnull=' || a.attnotnull || ' identity=' || a.attidentity::text || ' generated=' || a.attgenerated::text
           || ' default=' || coalesce(pg_catalog.pg_get_expr(ad.adbin, ad.adrelid), '-')
           || ' acl=' || coalesce(a.attacl::text, '-')
      FROM pg_catalog.pg_attribute a
      JOIN pg_catalog.pg_class c ON c.oid = a.attrelid
      LEFT JOIN pg_catalog.pg_attrdef ad ON ad.adrelid = a.attrelid AND ad.adnum = a.attnum
     WHERE a.attnum > 0 AND NOT a.attisdropped
       AND (c.oid IN (SELECT objid FROM member WHERE classid = 'pg_catalog.pg_class'::pg_catalog.regclass)
            OR c.oid IN (SELECT i.inhrelid FROM pg_catalog.pg_inherits i
                          WHERE i.inhparent = 'idempotency.records'::pg_catalog.regclass)
            OR c.reltype IN (SELECT objid FROM member WHERE classid = 'pg_catalog.pg_type'::pg_catalog.regclass))
    UNION ALL
    SELECT 'constraint ' || co.conrelid::pg_catalog.regclass::text || ' ' || co.conname
           || ' ' || pg_catalog.pg_get_constraintdef(co.oid) || ' local=' || co.conislocal
           || ' inh=' || co.coninhcount
      FROM pg_catalog.pg_constraint co
     WHERE co.conrelid IN (SELECT objid FROM member WHERE classid = 'pg_catalog.pg_class'::pg_catalog.regclass)
        OR co.conrelid IN (SELECT i.inhrelid FROM pg_catalog.pg_inherits i
                            WHERE i.inhparent = 'idempotency.records'::pg_catalog.regclass)
    UNION ALL
    SELECT 'index ' || pg_catalog.pg_get_indexdef(x.indexrelid) || ' replident=' || x.indisreplident
      FROM pg_catalog.pg_index x
     WHERE x.indrelid IN (SELECT objid FROM member WHERE classid = 'pg_catalog.pg_class'::pg_catalog.regclass)
        OR x.indrelid IN (SELECT i.inhrelid FROM pg_catalog.pg_inherits i
                           WHERE i.inhparent = 'idempotency.records'::pg_catalog.regclass)
    UNION ALL
    SELECT 'trigger ' || t.tgrelid::pg_catalog.regclass::text || ' ' || pg_catalog.pg_get_triggerdef(t.oid)
           || ' enabled=' || t.tgenabled::text || ' cloned=' || (t.tgparentid <> 0)
      FROM pg_catalog.pg_trigger t
     WHERE NOT t.tgisinternal
       AND (t.tgrelid IN (SELECT objid FROM member WHERE classid = 'pg_catalog.pg_class'::pg_catalog.regclass)
            OR t.tgrelid IN (SELECT i.inhrelid FROM pg_catalog.pg_inherits i
                              WHERE i.inhparent = 'idempotency.records'::pg_catalog.regclass))
    UNION ALL
    SELECT 'type ' || t.oid::pg_catalog.regtype::text || ' kind=' || t.typtype::text
           || ' acl=' || coalesce(t.typacl::text, '-')
      FROM pg_catalog.pg_type t
     WHERE t.oid IN (SELECT objid FROM member WHERE classid = 'pg_catalog.pg_type'::pg_catalog.regclass)
    UNION ALL
    SELECT 'schema ' || n.nspname
           || ' acl=' || coalesce(pg_catalog.replace(n.nspacl::text, n.nspowner::pg_catalog.regrole::text, 'owner'), '-')
      FROM pg_catalog.pg_namespace n
     WHERE n.oid IN (SELECT objid FROM member WHERE classid = 'pg_catalog.pg_namespace'::pg_catalog.regclass)
    UNION ALL
    SELECT 'partition ' || i.inhrelid::pg_catalog.regclass::text || ' member='
           || EXISTS (SELECT FROM member m WHERE m.objid = i.inhrelid)
      FROM pg_catalog.pg_inherits i
     WHERE i.inhparent = 'idempotency.records'::pg_catalog.regclass
    UNION ALL
    SELECT 'init_privs ' || pg_catalog.pg_describe_object(ip.classoid, ip.objoid, ip.objsubid)
           || ' type=' || ip.privtype::text
           || ' privs=' || pg_catalog.replace(ip.initprivs::text, CURRENT_USER, 'owner')
      FROM pg_catalog.pg_init_privs ip
     WHERE ip.privtype::text = 'e'
    UNION ALL
    SELECT 'extension version=' || ext.extversion
           || ' config=' || coalesce(ext.extconfig::pg_catalog.regclass[]::text, '-')
           || ' condition=' || coalesce(ext.extcondition::text, '-')
      FROM ext)
SELECT line FROM lines ORDER BY line COLLATE "C";
};

my $pg_dump = $node->config_data('--bindir') . '/pg_dump';

# pg_dump --schema-only of DB, normalized only for what cannot be equal:
# the dated partitions' names and bounds (the two installs may fall in
# different slots on a slow machine) and pg_dump's per-dump \restrict key.
sub schema_dump
{
	my ($db) = @_;
	my ($out, $err);
	IPC::Run::run(
		[ $pg_dump, '--schema-only', '-h', $node->host, '-p', $node->port, $db ],
		'>', \$out, '2>', \$err) or die "pg_dump $db: $err";
	$out =~ s/records_p\d{8}_\d{6}/records_pDATE/g;
	$out =~ s/'\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[+-]\d\d'/'TIME'/g;
	$out =~ s/^\\(un)?restrict .*$//mg;
	return $out;
}

# The dated partitions' names, normalized as in schema_dump.
sub catalog_of
{
	my ($db) = @_;
	my $lines = $node->safe_psql($db, $catalog_sql);
	$lines =~ s/records_p\d{8}_\d{6}/records_pDATE/g;
	$lines =~ s/"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[+-]\d\d"|'\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[+-]\d\d'/'TIME'/g;
	return $lines;
}

# What one side has and the other lacks, for the test's diagnostics.
sub differences
{
	my ($a, $b) = @_;
	my %in_b = map { $_ => 1 } split /\n/, $b;
	my %in_a = map { $_ => 1 } split /\n/, $a;
	return join("\n",
		(map { "only updated: $_" } grep { !$in_b{$_} } split /\n/, $a),
		(map { "only fresh:   $_" } grep { !$in_a{$_} } split /\n/, $b));
}

sub compare
{
	my ($updated, $fresh, $what) = @_;
	my $cu = catalog_of($updated);
	my $cf = catalog_of($fresh);
	ok(length($cf) > 5000 && $cf =~ /^function idempotency\.idem_maintain\(\)/m
		  && $cf =~ /^trigger idempotency\.records .*zz_records_filter/m,
		"$what: the catalog query sees the extension's objects");
	is($cu, $cf, "$what: the extension's catalog objects are the same")
	  or diag(differences($cu, $cf));
	my $du = schema_dump($updated);
	my $df = schema_dump($fresh);
	like($df, qr/CREATE EXTENSION IF NOT EXISTS idempotency WITH SCHEMA idempotency;.*CREATE TABLE idempotency\.records_pDATE/s,
		"$what: pg_dump --schema-only dumps the extension and its dated partitions");
	is($du, $df, "$what: pg_dump --schema-only is the same")
	  or diag(differences($du, $df));
}

$node->safe_psql('postgres', q{
CREATE ROLE idem_app LOGIN;
CREATE DATABASE updated;
CREATE DATABASE updated11;
CREATE DATABASE fresh;
CREATE DATABASE updated_granted;
CREATE DATABASE updated11_granted;
CREATE DATABASE fresh_granted;
CREATE DATABASE updated10to11;
CREATE DATABASE fresh11;
});

sub extversion
{
	my ($db) = @_;
	return $node->safe_psql($db, q{SELECT extversion FROM pg_extension WHERE extname = 'idempotency'});
}

# As installed.
$node->safe_psql('fresh', 'CREATE EXTENSION idempotency');
$node->safe_psql('updated',
	"CREATE EXTENSION idempotency VERSION '1.0';\nALTER EXTENSION idempotency UPDATE");
$node->safe_psql('updated11',
	"CREATE EXTENSION idempotency VERSION '1.1';\nALTER EXTENSION idempotency UPDATE");
is(extversion('fresh'), '1.3', 'CREATE EXTENSION idempotency installs 1.3');
is(extversion('updated'), '1.3', 'ALTER EXTENSION idempotency UPDATE moves 1.0 to 1.3');
is(extversion('updated11'), '1.3', 'ALTER EXTENSION idempotency UPDATE moves 1.1 to 1.3');

# 1.2's partition layout (idempotency--1.1--1.2.sql, partition_columns),
# in every dated partition: what each database's partitions have, one line
# a distinct layout.
my $layout_sql = q{
SELECT count(*) || ' ' || layout
  FROM (SELECT (SELECT pg_catalog.string_agg(a.attname, ',' ORDER BY a.attnum)
                  FROM pg_catalog.pg_attribute a
                 WHERE a.attrelid = p.partition AND a.attnum > 0 AND NOT a.attisdropped)
               || ' ' || coalesce(c.reloptions::text, '-') AS layout
          FROM idempotency.partitions p
          JOIN pg_catalog.pg_class c ON c.oid = p.partition
         WHERE NOT p.is_default) l
 GROUP BY layout};
my $layout_12 = 'created_at,expires_at,owner_start,claim,attempt,owner_pid,is_token,'
  . 'scope,key,request_hash,trace,locked_until,status,response_status,completed_at,'
  . 'response_headers,response_body,phase,state {fillfactor=94}';
foreach my $db (qw(fresh updated updated11))
{
	like($node->safe_psql($db, $layout_sql), qr/^\d+ \Q$layout_12\E$/,
		"$db: every dated partition has 1.2's layout");
}

# With hourly partitions (172 for a week) the update makes them again
# nearest first while it holds less than half the lock table: some, not all,
# and every one made again before every one left as it was.
$node->safe_psql('postgres', q{CREATE DATABASE hourly; ALTER DATABASE hourly SET idempotency.partition_interval = '1h'});
$node->safe_psql('hourly', 'CREATE EXTENSION idempotency');
my ($remade, $kept, $in_order) = split /\|/, $node->safe_psql('hourly', q{
WITH p AS (
    SELECT p.range_start, c.reloptions IS NOT NULL AS remade
      FROM idempotency.partitions p JOIN pg_catalog.pg_class c ON c.oid = p.partition
     WHERE NOT p.is_default)
SELECT count(*) FILTER (WHERE remade), count(*) FILTER (WHERE NOT remade),
       coalesce((SELECT max(range_start) FROM p WHERE remade) < (SELECT min(range_start) FROM p WHERE NOT remade), true)
  FROM p});
ok($remade > 0 && $kept > 0 && $in_order eq 't',
	"hourly partitions: the nearest made again in 1.2's layout ($remade), the rest kept ($kept)");

compare('updated', 'fresh', 'as installed, 1.0 updated');
compare('updated11', 'fresh', 'as installed, 1.1 updated');

# 1.1 as released: a fresh install of it equals 1.0 updated to it.
$node->safe_psql('fresh11', "CREATE EXTENSION idempotency VERSION '1.1'");
$node->safe_psql('updated10to11',
	"CREATE EXTENSION idempotency VERSION '1.0';\nALTER EXTENSION idempotency UPDATE TO '1.1'");
is(extversion('updated10to11'), '1.1', 'UPDATE TO 1.1 stops at 1.1');
compare('updated10to11', 'fresh11', 'at 1.1');

# With the README's grants: the old version's before the update, 1.2's on
# the fresh one.
$node->safe_psql('fresh_granted',
	"CREATE EXTENSION idempotency;\n" . sql_fixture('readme_grants.sql', app_role => 'idem_app'));
$node->safe_psql('updated_granted',
	"CREATE EXTENSION idempotency VERSION '1.0';\n"
	  . sql_fixture('readme_grants_1_0.sql', app_role => 'idem_app')
	  . "\nALTER EXTENSION idempotency UPDATE;\n");
$node->safe_psql('updated11_granted',
	"CREATE EXTENSION idempotency VERSION '1.1';\n"
	  . sql_fixture('readme_grants_1_1.sql', app_role => 'idem_app')
	  . "\nALTER EXTENSION idempotency UPDATE;\n");
compare('updated_granted', 'fresh_granted', 'with the README grants, 1.0 updated');
compare('updated11_granted', 'fresh_granted', 'with the README grants, 1.1 updated');

# Both work: the core calls, as the application role where it has grants.
foreach my $db (qw(updated updated11 fresh updated_granted updated11_granted fresh_granted))
{
	my $out = $node->safe_psql($db, q{
SET idempotency.wait_timeout = 0;
SELECT outcome FROM idempotency.idem_acquire('k', '{"a": 1}') \gset
SELECT claim AS c FROM idempotency.records WHERE key = 'k' \gset
SELECT idempotency.idem_complete('k', 201, '{"id": 1}', claim => :'c') AS done \gset
SELECT outcome AS again, response_status AS st FROM idempotency.idem_acquire('k', '{"a": 1}') \gset
SELECT idempotency.idem_token_issue() AS tok \gset
SELECT idempotency.idem_token_consume(:'tok') AS first, idempotency.idem_token_consume(:'tok') AS second \gset
SELECT count(*) AS maint FROM idempotency.idem_maintain() \gset
SELECT acquired + replayed AS acq FROM idempotency.stats WHERE datname = current_database() \gset
SELECT :'outcome', :'done', :'again', :'st', :'first', :'second', :'maint', :'acq' >= 2, count(*) FROM idempotency.stale_claims;
});
	is($out, 'acquired|t|replay|201|t|f|1|t|0', "$db: claim, completion, replay, token, maintenance, statistics");
}

$node->stop;
done_testing();
