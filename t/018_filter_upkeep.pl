# Copyright (c) idempotency authors
#
# What keeps the known-absent filters (filter.c) true and in place, across
# what one regression session cannot show:
#
# - a partition whose scope or key is a generated column never gets a
#   filter (PostgreSQL computes such a column after the BEFORE ROW trigger
#   that notes the keys; 15 attaches such a partition, 16 and later refuse
#   it), and its keys replay;
# - the filter slots are shared by every database of the server: a slot
#   whose partition's range has ended is taken back by another database's
#   build, and a build that finds none left says so once in the server log;
# - pg_restore --data-only --disable-triggers leaves the filter trigger
#   ENABLE instead of ENABLE ALWAYS: maintenance puts it back, and the next
#   build makes the filters again.
#
# Every outcome is asked in a session that has looked at every partition
# first: a backend asks a partition's filter only from its second look at
# the partition on (records.c, idem_trusted), so a check in a fresh session
# would pass with a wrong filter.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::RealBin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes ();

$PostgreSQL::Test::Cluster::use_tcp = 1;
$PostgreSQL::Test::Cluster::test_pghost = '127.0.0.1';

# Four slots: fewer than one database's live partitions (ten days ahead and
# DEFAULT), so that two databases compete for them.
my $node = PostgreSQL::Test::Cluster->new('upkeep');
$node->init;
$node->append_conf(
	'postgresql.conf', q{
shared_preload_libraries = 'idempotency'
idempotency.filters = 4
idempotency.filter_size = 64kB
idempotency.build_filters_at_start = off
});
$node->start;

# warm_outcomes(DB, N, CALL): the outcomes of CALL, an idem_acquire call
# of i, for i in 1 .. N, as "outcome=count ..." in outcome order, in one
# session that has looked at every partition first (a lookup of an absent
# key).
sub warm_outcomes
{
	my ($db, $n, $call) = @_;
	return $node->safe_psql(
		$db, warm_up_sql() . qq{
SELECT pg_catalog.string_agg(outcome || '=' || n, ' ' ORDER BY outcome)
  FROM (SELECT a.outcome, pg_catalog.count(*) AS n
          FROM pg_catalog.generate_series(1, $n) i,
               LATERAL $call a
         GROUP BY a.outcome) o;
});
}

sub ready_filters
{
	my ($db) = @_;
	return $node->safe_psql($db,
		"SELECT count(*) FROM idempotency.idem_filters() WHERE state = 'ready'");
}

my $log_start = -s $node->logfile;

# ---------------------------------------------------------------------
# Slots across databases.
# ---------------------------------------------------------------------
my $t0 = Time::HiRes::time();
foreach my $db ('da', 'db')
{
	$node->safe_psql('postgres', "CREATE DATABASE $db");
	$node->safe_psql($db, 'CREATE EXTENSION idempotency');
}
my $setup = Time::HiRes::time() - $t0;

# In da, today's partition is split in two: a range that ends a while from
# now, and the rest of the day.  The while is ten times what making two
# databases took here, and at least 10 s: the build right after it must
# still find that range live.
my $window = int(10 * $setup) + 10;
my $short_end = $node->safe_psql(
	'da', qq{
SELECT p.partition, p.range_start, p.range_end
  FROM idempotency.partitions p
 WHERE NOT p.is_default AND p.range_end > now()
 ORDER BY p.range_start LIMIT 1 \\gset
ALTER TABLE idempotency.records DETACH PARTITION :partition;
DROP TABLE :partition;
SELECT now() + interval '$window s' AS short_end \\gset
CREATE TABLE idempotency.records_short PARTITION OF idempotency.records
    FOR VALUES FROM (:'range_start') TO (:'short_end');
CREATE TABLE idempotency.records_rest PARTITION OF idempotency.records
    FOR VALUES FROM (:'short_end') TO (:'range_end');
SELECT :'short_end';
});
is($node->safe_psql('da', 'SELECT idempotency.build_filters()'), '4',
	'the first database takes every slot');
is( $node->safe_psql(
		'da',
		"SELECT state FROM idempotency.idem_filters() WHERE partition = 'idempotency.records_short'::regclass"
	),
	'ready',
	'one of them for the range that ends soon');
is($node->safe_psql('db', 'SELECT idempotency.build_filters()'),
	'0', 'the second database finds no slot while those ranges are live');
is($node->safe_psql('db', 'SELECT idempotency.build_filters()'),
	'0', 'nor at its next build');
# (the first database lacked slots too: the line names it)
my $starved = () = substr(slurp_file($node->logfile), $log_start) =~
  /LOG:  no idempotency filter slot left for partition "[^"]+" of database "d[ab]"/g;
is($starved, 1, 'the server log says once that slots are lacking');

# Once the short range has ended, no call looks in its filter: the second
# database's build takes the slot.
ok($node->poll_query_until('da', "SELECT now() > '$short_end'::timestamptz"),
	'the short range has ended');
is($node->safe_psql('db', 'SELECT idempotency.build_filters()'),
	'1', 'the second database takes the slot of the range that ended');
is($node->safe_psql('da', 'SELECT count(*) FROM idempotency.idem_filters()'),
	'3', 'the first database keeps its three live filters');
is(ready_filters('db'), '1', 'the second database has one filter');
# that filter is today's partition's: keys written there are found
$node->safe_psql('db', q{
SELECT idempotency.idem_acquire('slot-' || i, ttl => '10 min') FROM generate_series(1, 50) i;
SELECT idempotency.idem_complete('slot-' || i, 200, '{}') FROM generate_series(1, 50) i;
});
is(warm_outcomes('db', 50, "idempotency.idem_acquire('slot-' || i, ttl => '10 min')"),
	'replay=50', "keys of the second database's filtered partition replay");
$starved = () = substr(slurp_file($node->logfile), $log_start) =~
  /LOG:  no idempotency filter slot left for partition/g;
is($starved, 1, 'still one line in the log');

# A dropped database gives its slots back at once.
$node->safe_psql('postgres', 'DROP DATABASE da');
is($node->safe_psql('db', 'SELECT idempotency.build_filters()'),
	'3', "the dropped database's slots go to the other one");
$node->safe_psql('postgres', 'DROP DATABASE db');

# ---------------------------------------------------------------------
# A partition whose key or scope is generated.
# ---------------------------------------------------------------------
# room for every partition's filter from here on
$node->append_conf('postgresql.conf', 'idempotency.filters = 64');
$node->restart;
$node->safe_psql('postgres', 'CREATE EXTENSION idempotency');
foreach my $column ('key', 'scope')
{
	my ($part, $start, $end) = split /\|/, $node->safe_psql(
		'postgres', q{
SELECT p.partition, p.range_start, p.range_end
  FROM idempotency.partitions p
 WHERE NOT p.is_default AND p.range_start > now() + interval '2 days'
   AND NOT EXISTS (SELECT FROM pg_catalog.pg_attribute a
                    WHERE a.attrelid = p.partition AND a.attgenerated <> '')
 ORDER BY p.range_start LIMIT 1});
	my $other = $column eq 'key' ? 'scope' : 'key';
	# a table of the partition's columns, with the column generated from the
	# response body, as a partition of another origin could have it
	$node->safe_psql(
		'postgres', qq{
ALTER TABLE idempotency.records DETACH PARTITION $part;
DROP TABLE $part;
CREATE TABLE public.gen_$column (LIKE idempotency.records INCLUDING DEFAULTS INCLUDING CONSTRAINTS);
ALTER TABLE public.gen_$column DROP COLUMN $column;
ALTER TABLE public.gen_$column ADD COLUMN $column text COLLATE "C" NOT NULL
    GENERATED ALWAYS AS ('g-' || (response_body OPERATOR(pg_catalog.->>) 'n')) STORED;
CREATE UNIQUE INDEX ON public.gen_$column (scope, key, expires_at);
});
	my ($ret, $out, $err) = $node->psql('postgres',
		"ALTER TABLE idempotency.records ATTACH PARTITION public.gen_$column FOR VALUES FROM ('$start') TO ('$end')"
	);
	if ($node->pg_version >= 16)
	{
		isnt($ret, 0, "PostgreSQL 16 and later refuse a partition whose $column is generated");
		like($err, qr/generated/, 'for its generated column');
		next;
	}
	is($ret, 0, "PostgreSQL 15 attaches a partition whose $column is generated")
	  or diag($err);

	# a build, then 100 completed records, the generated column making its
	# value after the trigger has seen it NULL
	$node->safe_psql('postgres', 'SELECT idempotency.build_filters()');
	my $fixed = $column eq 'key' ? "'key-scope'" : "'scope-key'";
	$node->safe_psql(
		'postgres', qq{
INSERT INTO idempotency.records ($other, status, response_status, response_body,
                                 created_at, completed_at, expires_at)
SELECT $fixed, 'completed', 200, jsonb_build_object('n', i),
       now(), now(), '$start'::timestamptz + interval '1 hour'
  FROM generate_series(1, 100) i;
});
	is( $node->safe_psql(
			'postgres',
			"SELECT count(*) FROM idempotency.idem_filters() WHERE partition = 'public.gen_$column'::regclass"
		),
		'0',
		"a partition whose $column is generated gets no filter");
	my $call =
	  $column eq 'key'
	  ? "idempotency.idem_acquire('g-' || i, scope => 'key-scope')"
	  : "idempotency.idem_acquire('scope-key', scope => 'g-' || i)";
	is(warm_outcomes('postgres', 100, $call),
		'replay=100', "every record of that partition replays in a session that has looked at it");
}

# ---------------------------------------------------------------------
# pg_restore --data-only --disable-triggers
# ---------------------------------------------------------------------
# the slots go back with the partitions
$node->safe_psql('postgres', 'DROP EXTENSION idempotency CASCADE');
$node->safe_psql('postgres', 'CREATE DATABASE rs');
$node->safe_psql('rs', 'CREATE EXTENSION idempotency');
$node->safe_psql(
	'rs', q{
SELECT idempotency.idem_acquire('rs-' || i, ttl => (i % 3 + 1) * interval '1 day')
  FROM generate_series(1, 60) i;
SELECT idempotency.idem_complete('rs-' || i, 201, '{}') FROM generate_series(1, 60) i;
});
my $dump = $node->basedir . '/rs.dump';
$node->command_ok(
	[
		'pg_dump', '-Fc', '--data-only', '--load-via-partition-root', '-f',
		$dump, '-d', $node->connstr('rs')
	],
	'pg_dump --data-only');
$node->safe_psql('rs', 'DELETE FROM idempotency.records');
$node->command_ok(
	[
		'pg_restore', '--data-only', '--disable-triggers', '-d',
		$node->connstr('rs'), $dump
	],
	'pg_restore --data-only --disable-triggers');
is($node->safe_psql('rs', "SELECT count(*) FROM idempotency.records WHERE key LIKE 'rs-%'"),
	'60', 'the records are back');
cmp_ok(
	$node->safe_psql('rs',
		"SELECT count(*) FROM pg_trigger WHERE tgname = 'zz_records_filter' AND tgenabled = 'O'"),
	'>', 0, 'the restore left filter triggers ENABLE, not ENABLE ALWAYS');
is($node->safe_psql('rs', 'SELECT idempotency.build_filters()'),
	'0', 'no build trusts them');

$node->safe_psql('rs', 'SELECT * FROM idempotency.idem_maintain()');
is( $node->safe_psql(
		'rs',
		"SELECT count(*) FROM pg_trigger WHERE tgname = 'zz_records_filter' AND tgenabled <> 'A'"),
	'0',
	'maintenance puts every filter trigger back to ENABLE ALWAYS');
like(slurp_file($node->logfile),
	qr/set trigger "zz_records_filter" of table "idempotency\.records_[^"]+" back to ENABLE ALWAYS/,
	'and says so in the server log');
is( $node->safe_psql('rs', 'SELECT idempotency.build_filters()'),
	$node->safe_psql('rs',
		'SELECT count(*) FROM idempotency.partitions WHERE is_default OR range_end > now()'),
	'the next build makes the filters of every live partition again');
is(warm_outcomes('rs', 60, "idempotency.idem_acquire('rs-' || i, ttl => (i % 3 + 1) * interval '1 day')"),
	'replay=60', 'every restored record replays through the filters');

# A trigger disabled on purpose is left so, with a WARNING naming the fix.
$node->safe_psql('rs',
	'ALTER TABLE idempotency.records_default DISABLE TRIGGER zz_records_filter');
my ($ret, $out, $err) =
  $node->psql('rs', 'SELECT * FROM idempotency.idem_maintain()');
like(
	$err,
	qr/WARNING:  table "idempotency\.records_default" has no known-absent filter: its trigger "zz_records_filter" is disabled/,
	'a disabled trigger is named in a WARNING');
like(
	$err,
	qr/HINT:  .*ALTER TABLE ONLY idempotency\.records_default ENABLE ALWAYS TRIGGER zz_records_filter;/,
	'with the statement that puts it back');
is( $node->safe_psql(
		'rs',
		"SELECT tgenabled FROM pg_trigger WHERE tgname = 'zz_records_filter' AND tgrelid = 'idempotency.records_default'::regclass"
	),
	'D',
	'and is left disabled');

$node->stop;
done_testing();
