# Copyright (c) idempotency authors
#
# A replay of a completed key never waits for the key lock, whatever the
# known-absent filters (filter.c) are doing: where no filter answers for a
# partition, idem_acquire takes the key lock only if it is free, and else
# reads the completed record without it in every live partition
# (idempotency.c, idem_acquire_replay_busy).  Under a hot-key storm (16
# pgbench clients replaying one completed key):
#
# - library preloaded, extension created after the server started,
#   maintenance never run, no filter built: idempotency.stats counts no wait
#   (stats.c counts a call that blocked on the key lock or on a writer), and
#   pg_locks, sampled while the storm runs, never shows a session waiting
#   for the key lock;
# - the same with idempotency.use_filters = off;
# - library not preloaded (no statistics there): pg_locks never shows a
#   wait for the key lock while the storm runs;
# - a second database whose build found no filter slot left: no wait.
#
# And the default of idempotency.filters serves several databases: with it,
# three databases each get a filter for every live partition, and no build
# runs out of slots.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::RealBin/lib";
use IdemTest;
use IPC::Run;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

$PostgreSQL::Test::Cluster::use_tcp = 1;
$PostgreSQL::Test::Cluster::test_pghost = '127.0.0.1';

my $clients = 16;
my $storm_secs = 3;
my $lock_field4 = 18756;    # the key lock's objsubid in pg_locks

# A completed record of key 'hot' in database $db
sub complete_hot
{
	my ($node, $db) = @_;
	$node->safe_psql($db, q{
SELECT outcome FROM idempotency.idem_acquire('hot', '{"amount": 10}');
SELECT idempotency.idem_complete('hot', 201, '{"paid": true}');
});
	is( $node->safe_psql(
			$db,
			"SELECT status FROM idempotency.idem_lookup('hot')"),
		'completed',
		"$db: key 'hot' is completed");
}

sub ready_filters
{
	my ($node, $db) = @_;
	return $node->safe_psql($db,
		"SELECT count(*) FROM idempotency.idem_filters() WHERE state = 'ready'"
	);
}

# The live partitions of $db (those a call looks in): the filters a build
# makes where slots are enough
sub live_partitions
{
	my ($node, $db) = @_;
	return $node->safe_psql($db,
		'SELECT count(*) FROM idempotency.partitions WHERE is_default OR range_end > now()'
	);
}

# waits and replayed of $db in idempotency.stats
sub stats_of
{
	my ($node, $db) = @_;
	my $row = $node->safe_psql($db,
		'SELECT waits, replayed FROM idempotency.stats WHERE datname = current_database()'
	);
	my ($waits, $replayed) = split /\|/, ($row || '0|0');
	return ($waits, $replayed);
}

# storm(NODE, DB, PGOPTIONS): $clients pgbench clients replay key 'hot'
# for $storm_secs seconds (any other answer fails the transaction), while
# this process samples pg_locks for the key lock until pgbench is done
# (its clients are the database's only other sessions).
# Returns (samples taken while pgbench's clients were connected, samples
# that showed a session waiting for the key lock, replays pgbench counted).
sub storm
{
	my ($node, $db, $options) = @_;
	my $script = $node->basedir . '/storm.pgbench';
	open my $fh, '>', $script or die "$script: $!";
	print $fh q{
SELECT 1 / (outcome = 'replay')::int AS ok
  FROM idempotency.idem_acquire('hot', '{"amount": 10}');
};
	close $fh;

	my $sampler = $node->background_psql($db);
	my ($out, $err) = ('', '');
	my $h = IPC::Run::start(
		[
			'env', 'PGOPTIONS=' . ($options // ''), 'pgbench', '-n', '-M', 'prepared', '-c', $clients, '-j', 2,
			'-T', $storm_secs, '-h', $node->host, '-p', $node->port,
			'-f', $script, $db
		],
		'>', \$out, '2>', \$err);

	my ($during, $seen) = (0, 0);
	while ($h->pumpable)
	{
		my $row = $sampler->query_safe(qq{
SELECT (SELECT count(*) FROM pg_catalog.pg_stat_activity
         WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()
           AND datname = current_database()),
       (SELECT count(*) FROM pg_catalog.pg_locks
         WHERE locktype = 'advisory' AND objsubid = $lock_field4
           AND NOT granted)});
		my ($active, $locks) = split /\|/, $row;
		$during++ if $active > 0;
		$seen++ if $locks > 0;
		$h->pump_nb;
	}
	my $ok = $h->finish;
	$sampler->quit;
	ok($ok, "$db: pgbench ran") or diag($err);
	my ($done) = $out =~ /number of transactions actually processed: (\d+)/;
	like($out, qr/number of failed transactions: 0 /,
		"$db: every one of the storm's replays answered replay");
	cmp_ok($done // 0, '>', 0, "$db: the storm replayed");
	return ($during, $seen, $done // 0);
}

# One storm in $db, with the statistics: no wait, and every replay counted
sub storm_no_wait
{
	my ($node, $db, $what, $options) = @_;
	my ($waits0, $replayed0) = stats_of($node, $db);
	my ($during, $seen, $done) = storm($node, $db, $options);
	my ($waits1, $replayed1) = stats_of($node, $db);
	is($replayed1 - $replayed0, $done,
		"$what: idempotency.stats counted every replay");
	is($waits1 - $waits0, 0, "$what: no replay waited for the key lock");
	note("$what: waits $waits0 -> $waits1, replayed $replayed0 -> $replayed1; "
		  . "$seen of $during samples showed a wait for the key lock");
	cmp_ok($during, '>', 0, "$what: pg_locks sampled during the storm");
	is($seen, 0, "$what: no wait for the key lock in pg_locks");
}


# 1. Preloaded with the defaults, the extension created after the start
# (the launcher found nothing to build), no maintenance.
my $node = PostgreSQL::Test::Cluster->new('storm');
$node->init;
$node->append_conf('postgresql.conf', q{
shared_preload_libraries = 'idempotency'
max_connections = 40
});
$node->start;
$node->safe_psql('postgres', 'CREATE EXTENSION idempotency');
complete_hot($node, 'postgres');
is(ready_filters($node, 'postgres'), 0, 'no filter built');
storm_no_wait($node, 'postgres', 'preloaded, filters not built');
is(ready_filters($node, 'postgres'), 0, 'still no filter built');
storm_no_wait($node, 'postgres', 'use_filters off',
	'-c idempotency.use_filters=off');

# 2. The default of idempotency.filters is enough for three databases
# with the default partitioning: every live partition of each gets a
# filter, and no build runs out of slots.
foreach my $db ('second', 'third')
{
	$node->safe_psql('postgres', "CREATE DATABASE $db");
	$node->safe_psql($db, 'CREATE EXTENSION idempotency');
}
foreach my $db ('postgres', 'second', 'third')
{
	my ($ret, $stdout, $stderr) = $node->psql($db,
		'SELECT idempotency.build_filters()', on_error_stop => 1);
	is($ret, 0, "$db: build_filters ran");
	unlike($stderr, qr/no idempotency filter slot left/,
		"$db: the build found a slot for every partition");
	is(ready_filters($node, $db), live_partitions($node, $db),
		"$db: every live partition has a ready filter");
}
$node->stop;

# 3. Not preloaded: no statistics, no filters; pg_locks shows the key lock
# to any sampler while a call holds it or waits for it.
my $plain = PostgreSQL::Test::Cluster->new('plain');
$plain->init;
$plain->append_conf('postgresql.conf', 'max_connections = 40');
$plain->start;
$plain->safe_psql('postgres', 'CREATE EXTENSION idempotency');
complete_hot($plain, 'postgres');
my ($during, $seen) = storm($plain, 'postgres');
note("not preloaded: $seen of $during samples showed a wait for the key lock");
cmp_ok($during, '>', 0, 'not preloaded: pg_locks sampled during the storm');
is($seen, 0, 'not preloaded: no wait for the key lock in pg_locks');
$plain->stop;

# 4. A second database whose build found no slot left: one database's
# worth of slots, taken by the first.
my $starved = PostgreSQL::Test::Cluster->new('starved');
$starved->init;
$starved->append_conf('postgresql.conf', q{
shared_preload_libraries = 'idempotency'
idempotency.filters = 11
max_connections = 40
});
$starved->start;
$starved->safe_psql('postgres', 'CREATE DATABASE second');
foreach my $db ('postgres', 'second')
{
	$starved->safe_psql($db, 'CREATE EXTENSION idempotency');
}
$starved->safe_psql('postgres', 'SELECT idempotency.build_filters()');
cmp_ok(ready_filters($starved, 'postgres'), '>', 0,
	'first database: its build took the slots');
my ($ret, $stdout, $stderr) = $starved->psql('second',
	'SELECT idempotency.build_filters()', on_error_stop => 1);
like($stderr, qr/no idempotency filter slot left/,
	'second database: its build found no slot left');
is(ready_filters($starved, 'second'), 0, 'second database: no filter');
complete_hot($starved, 'second');
storm_no_wait($starved, 'second', 'second database without slots');
$starved->stop;

done_testing();
