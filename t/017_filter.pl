# Copyright (c) idempotency authors
#
# The known-absent filters (filter.c) across what a single session cannot
# show: logical replication apply on a subscriber whose filters were built
# first, a standby's replayed rows after promotion (nothing trusted until
# built), pg_dump/pg_restore --load-via-partition-root into a database
# whose filters are built, maintenance moving rows out of DEFAULT, and a
# restart.  Each checks that idem_acquire never answers "acquired" for a
# key that is present, in a session that asks the filters.  Then the workers that build the filters by
# themselves when a server starts, a standby is promoted, or the first
# call after a crash asks (idempotency.build_filters_at_start, off until
# then).

use strict;
use warnings;

use FindBin;
use lib "$FindBin::RealBin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

$PostgreSQL::Test::Cluster::use_tcp = 1;
$PostgreSQL::Test::Cluster::test_pghost = '127.0.0.1';

my $conf = q{
shared_preload_libraries = 'idempotency'
idempotency.filters = 64
idempotency.filter_size = 64kB
idempotency.build_filters_at_start = off
};

# the outcome of idem_acquire for a key that must be present, in a session
# that asks the filters (warm_up_sql)
sub outcome
{
	my ($node, $db, $key) = @_;
	return $node->safe_psql($db,
		warm_up_sql() . "SELECT outcome FROM idempotency.idem_acquire('$key');");
}

sub ready_filters
{
	my ($node, $db) = @_;
	return $node->safe_psql($db,
		"SELECT count(*) FROM idempotency.idem_filters() WHERE state = 'ready'");
}

my $pub = PostgreSQL::Test::Cluster->new('publisher');
$pub->init(allows_streaming => 'logical');
$pub->append_conf('postgresql.conf', $conf);
$pub->start;
$pub->backup('base');
my $sub = PostgreSQL::Test::Cluster->new('subscriber');
$sub->init;
$sub->append_conf('postgresql.conf', $conf);
$sub->start;

foreach my $node ($pub, $sub)
{
	$node->safe_psql('postgres', 'CREATE EXTENSION idempotency');
}

# A standby of the publisher, from before any record existed.
my $standby = PostgreSQL::Test::Cluster->new('standby');
$standby->init_from_backup($pub, 'base', has_streaming => 1);
$standby->start;

# Logical replication: the subscriber builds its filters first, then rows
# arrive through apply (session_replication_role = replica).
$pub->safe_psql('postgres', q{
CREATE PUBLICATION idem FOR TABLE idempotency.records
    WITH (publish_via_partition_root = true);
});
my $connstr = $pub->connstr . ' dbname=postgres';
$sub->safe_psql('postgres', qq{
CREATE SUBSCRIPTION idem CONNECTION '$connstr' PUBLICATION idem;
});
$sub->wait_for_subscription_sync($pub, 'idem');
ok(ready_filters($sub, 'postgres') > 0 || $sub->safe_psql('postgres', 'SELECT idempotency.build_filters()') > 0,
	'subscriber filters built');
cmp_ok(ready_filters($sub, 'postgres'), '>', 0, 'subscriber has READY filters');

$pub->safe_psql('postgres', q{
SELECT idempotency.idem_acquire('rep-' || i, ttl => i * interval '1 day')
  FROM generate_series(1, 5) i;
SELECT idempotency.idem_complete('rep-1', 200, '{}');
});
$pub->wait_for_catchup('idem');
is($sub->safe_psql('postgres', "SELECT count(*) FROM idempotency.records WHERE key LIKE 'rep-%'"),
	'5', 'rows applied on the subscriber');
cmp_ok(ready_filters($sub, 'postgres'), '>', 0, 'subscriber filters still READY');
foreach my $i (1 .. 5)
{
	isnt(outcome($sub, 'postgres', "rep-$i"), 'acquired',
		"subscriber finds applied key rep-$i");
}

# Standby promotion: rows replayed, filters untrusted until built.
$pub->wait_for_catchup($standby);
$standby->promote;
is(ready_filters($standby, 'postgres'), '0', 'no filter after promotion until built');
foreach my $i (2 .. 5)
{
	isnt(outcome($standby, 'postgres', "rep-$i"), 'acquired',
		"promoted standby finds rep-$i before a build");
}
$standby->safe_psql('postgres', 'SELECT idempotency.build_filters()');
cmp_ok(ready_filters($standby, 'postgres'), '>', 0, 'promoted standby builds filters');
is(outcome($standby, 'postgres', 'rep-1'), 'replay',
	'promoted standby replays rep-1 with filters');

# pg_dump / pg_restore --load-via-partition-root into a database whose
# filters are built before the data arrives.
my $dump = $pub->basedir . '/idem.dump';
$pub->command_ok(
	[ 'pg_dump', '-Fc', '--load-via-partition-root', '-f', $dump,
	  '-d', $pub->connstr('postgres') ], 'pg_dump');
$pub->safe_psql('postgres', 'CREATE DATABASE restored');
# CREATE EXTENSION has made partitions already: pg_restore reports those
# it cannot create again, and goes on.
run_log([ 'pg_restore', '--section=pre-data', '-d', $pub->connstr('restored'), $dump ]);
$pub->safe_psql('restored', 'SELECT idempotency.build_filters()');
cmp_ok(ready_filters($pub, 'restored'), '>', 0, 'restored database has READY filters before data');
run_log([ 'pg_restore', '--section=data', '--section=post-data', '-d',
	  $pub->connstr('restored'), $dump ]);
is($pub->safe_psql('restored', "SELECT count(*) FROM idempotency.records WHERE key LIKE 'rep-%'"),
	'5', 'rows restored');
foreach my $i (1 .. 5)
{
	isnt(outcome($pub, 'restored', "rep-$i"), 'acquired',
		"restored database finds rep-$i");
}

# Maintenance moving rows out of DEFAULT into new partitions.
$pub->safe_psql('postgres', q{
SELECT idempotency.build_filters();
INSERT INTO idempotency.records (scope, key, status, attempt, created_at, locked_until, expires_at)
SELECT '', 'far-' || i, 'processing', 1, now(), now() + interval '1 day',
       now() + interval '8 days' + i * interval '1 hour'
  FROM generate_series(1, 3) i;
});
$pub->safe_psql('postgres', q{
ALTER SYSTEM SET idempotency.max_ttl = '10d';
SELECT pg_reload_conf();
});
$pub->safe_psql('postgres', 'SELECT * FROM idempotency.idem_maintain()');
is($pub->safe_psql('postgres', "SELECT count(*) FROM idempotency.records_default WHERE key LIKE 'far-%'"),
	'0', 'maintenance moved the rows out of DEFAULT');
foreach my $i (1 .. 3)
{
	isnt(outcome($pub, 'postgres', "far-$i"), 'acquired',
		"far-$i found after the move");
}

# A restart: filters start empty, nothing is trusted until built.
$pub->restart;
is(ready_filters($pub, 'postgres'), '0', 'no filter after restart until built');
$pub->safe_psql('postgres', 'SELECT idempotency.build_filters()');
foreach my $i (1 .. 3)
{
	isnt(outcome($pub, 'postgres', "far-$i"), 'acquired',
		"far-$i found after restart and build");
}
is(outcome($pub, 'postgres', 'rep-1'), 'replay', 'rep-1 replays after restart');

# idempotency.build_filters_at_start: a restart builds the filters of every
# database with the extension, without a call.  Not those of a template,
# and never a function of the same name that is not the extension's.
$pub->safe_psql('postgres', 'CREATE DATABASE tmpl');
$pub->safe_psql('tmpl', 'CREATE EXTENSION idempotency');
$pub->safe_psql('postgres', 'ALTER DATABASE tmpl IS_TEMPLATE true');
$pub->safe_psql('postgres', 'CREATE DATABASE fake');
$pub->safe_psql('fake', q{
CREATE TABLE public.trace (x int);
CREATE SCHEMA idempotency;
CREATE FUNCTION idempotency.build_filters(max_wait interval DEFAULT NULL)
RETURNS integer LANGUAGE sql
AS $$ INSERT INTO public.trace VALUES (1) RETURNING 1 $$;
});
$pub->safe_psql('postgres', q{
ALTER SYSTEM SET idempotency.build_filters_at_start = on;
SELECT pg_reload_conf();
});
$pub->backup('started');
my $logstart = -s $pub->logfile;
$pub->restart;
foreach my $db ('postgres', 'restored')
{
	ok( defined $pub->wait_for_log(
			qr/idempotency built \d+ known-absent filters in database "$db"/,
			$logstart),
		"the startup build of $db is logged");
	cmp_ok(ready_filters($pub, $db), '>', 0, "filters of $db built at startup");
}
ok( $pub->poll_query_until('postgres', q{
SELECT count(*) = 0 FROM pg_stat_activity
 WHERE backend_type LIKE 'idempotency filter%'}),
	'the startup workers are done');
my $log = substr(slurp_file($pub->logfile), $logstart);
is(ready_filters($pub, 'tmpl'), '0', 'no filter built in a template');
unlike($log, qr/database "(tmpl|fake|template[01])"/,
	'no build logged for a template or a database without the extension');
is($pub->safe_psql('fake', 'SELECT count(*) FROM public.trace'), '0',
	'a build_filters() that is not the extension\'s is never called');
foreach my $i (1 .. 3)
{
	isnt(outcome($pub, 'postgres', "far-$i"), 'acquired',
		"far-$i found with the filters built at startup");
}
is(outcome($pub, 'postgres', 'rep-1'), 'replay', 'rep-1 replays with the filters built at startup');
is(outcome($pub, 'postgres', 'new-after-start'), 'acquired', 'a new key is acquired');

# A standby builds nothing while in recovery, and builds at promotion.
my $standby2 = PostgreSQL::Test::Cluster->new('standby2');
$standby2->init_from_backup($pub, 'started', has_streaming => 1);
$standby2->start;
$pub->wait_for_catchup($standby2);
is(ready_filters($standby2, 'postgres'), '0', 'no filter on a standby in recovery');
my $promoted = -s $standby2->logfile;
$standby2->promote;
ok( defined $standby2->wait_for_log(
		qr/idempotency built \d+ known-absent filters in database "postgres"/,
		$promoted),
	'the build at promotion is logged');
cmp_ok(ready_filters($standby2, 'postgres'), '>', 0, 'filters built at promotion');
unlike(slurp_file($standby2->logfile), qr/cannot be built during recovery/,
	'no build was tried during recovery');
foreach my $i (1 .. 3)
{
	isnt(outcome($standby2, 'postgres', "far-$i"), 'acquired',
		"far-$i found on the promoted standby");
}
$standby2->stop;

# A crash makes shared memory anew, and the postmaster forgets the
# launcher: the first call that may use the filters starts it again.
$pub->safe_psql('postgres', q{
ALTER SYSTEM SET restart_after_crash = on;
SELECT pg_reload_conf();
});

# crash $node (its checkpointer killed), wait until it accepts writes
# again; the log's length before the crash
sub crash
{
	my ($node, $which) = @_;
	my $offset = -s $node->logfile;
	my $pid = $node->safe_psql('postgres',
		"SELECT pid FROM pg_stat_activity WHERE backend_type = 'checkpointer'");
	is(kill('KILL', $pid), 1, "the checkpointer is killed ($which crash)");
	ok( defined $node->wait_for_log(
			qr/all server processes terminated; reinitializing/, $offset),
		"the server restarts after the $which crash");
	poll_query_back($node, 'postgres', 'SELECT NOT pg_is_in_recovery()')
	  or die "the server did not come back after the $which crash";
	return $offset;
}

crash($pub, 'first');
is(ready_filters($pub, 'postgres'), '0', 'no filter after a crash');
my $rebuilt = -s $pub->logfile;
isnt(outcome($pub, 'postgres', 'far-1'), 'acquired',
	'far-1 found after a crash, before any filter is built');
ok( defined $pub->wait_for_log(
		qr/idempotency built \d+ known-absent filters in database "postgres"/,
		$rebuilt),
	'the first call after a crash has the filters built again');
cmp_ok(ready_filters($pub, 'postgres'), '>', 0, 'filters built after a crash');
foreach my $i (2 .. 3)
{
	isnt(outcome($pub, 'postgres', "far-$i"), 'acquired',
		"far-$i found with the filters built after a crash");
}
ok( $pub->poll_query_until('postgres', q{
SELECT count(*) = 0 FROM pg_stat_activity
 WHERE backend_type LIKE 'idempotency filter%'}),
	'the workers started after the crash are done');
my @builds = (substr(slurp_file($pub->logfile), $rebuilt) =~
	  /idempotency built \d+ known-absent filters in database "postgres"/g);
is(scalar(@builds), 1, 'one build after the crash, however many calls');

# A second crash within five minutes of the first: no build is started, in
# case a build is what crashes; maintenance builds them.
my $crashed = crash($pub, 'second');
foreach my $i (1 .. 3)
{
	isnt(outcome($pub, 'postgres', "far-$i"), 'acquired',
		"far-$i found after a second crash, without filters");
}
# time for a build that the calls above started to log its line
sleep(2);
unlike(substr(slurp_file($pub->logfile), $crashed),
	qr/idempotency built \d+ known-absent filters/,
	'no build started after a second crash within five minutes');
is(ready_filters($pub, 'postgres'), '0', 'no filter after a second crash');

done_testing();
