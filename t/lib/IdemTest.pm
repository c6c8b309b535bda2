# Copyright (c) idempotency authors
#
# Helpers shared by the TAP tests t/002_*.pl onwards: a throwaway cluster on
# 127.0.0.1 set up as scripts/common.sh does it (pg_cron preloaded), the
# SQLSTATE of a failed psql call, polling a server that is coming back from
# a crash, the SQL fixtures the tests share (sql/include: the README's
# grants, the SQLSTATE helper), a millisecond clock, windows (ttls, leases, pauses) sized from
# how fast the machine was measured to be, and the steps of an update behind
# an open claim transaction that t/012 and t/024 share.

package IdemTest;

use strict;
use warnings;

use Exporter 'import';
use File::Basename ();
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes ();

our @EXPORT = qw(idem_node sqlstate_of_psql poll_query_back now_ms
  window_secs sql_fixture warm_up_sql update_behind_open_claim);

# warm_up_sql(): the statements that make a session ask the known-absent
# filters: a backend asks a partition's filter only from its second look at
# the partition on (records.c, idem_trusted), so a check in a fresh session
# would pass with a wrong filter.  A lookup of an absent key looks at every
# live partition; no wait for a claim in progress.
sub warm_up_sql
{
	return q{
SET idempotency.wait_timeout = 0;
SELECT pg_catalog.count(*) AS warm FROM idempotency.idem_lookup('warm-up-absent') \gset
};
}

# idem_node(NAME, EXTRA_CONF): a started node on 127.0.0.1 with pg_cron
# preloaded and the extension created in database postgres.
sub idem_node
{
	my ($name, $extra_conf) = @_;

	# The throwaway clusters listen on 127.0.0.1 only.  (Set here, at run
	# time: PostgreSQL::Test::Cluster's INIT block would override a value
	# set while this module is compiled.)
	$PostgreSQL::Test::Cluster::use_tcp = 1;
	$PostgreSQL::Test::Cluster::test_pghost = '127.0.0.1';

	my $node = PostgreSQL::Test::Cluster->new($name);
	$node->init;
	$node->append_conf(
		'postgresql.conf', q{
shared_preload_libraries = 'pg_cron'
cron.database_name = 'postgres'
max_connections = 50
} . ($extra_conf // ''));
	$node->start;
	$node->safe_psql('postgres', 'CREATE EXTENSION idempotency');
	return $node;
}

# sqlstate_of_psql(NODE, DB, SQL): (sqlstate or 'ok', stdout, stderr) of SQL
# run by psql with ON_ERROR_STOP and verbose errors.
sub sqlstate_of_psql
{
	my ($node, $db, $sql, %params) = @_;
	my ($ret, $out, $err) = $node->psql($db, $sql,
		extra_params => [ '-v', 'VERBOSITY=verbose', '-v', 'ON_ERROR_STOP=1' ],
		%params);
	if ($err =~ /ERROR:\s+([0-9A-Z]{5}):/)
	{
		return ($1, $out, $err);
	}
	return ($ret == 0 ? 'ok' : "psql exit $ret", $out, $err);
}

# poll_query_back(NODE, DB, QUERY[, EXPECTED]): poll_query_until for a
# server that may still be restarting after a crash.  psql then exits as soon
# as its connection is refused, at times before IPC::Run has written the
# query to its standard input, and IPC::Run dies of the broken pipe: that is
# one more attempt that failed, not the end of the test.
sub poll_query_back
{
	my ($node, $db, $query, $expected) = @_;
	my $deadline = time + 10 * $PostgreSQL::Test::Utils::timeout_default;
	while (time < $deadline)
	{
		my $back = eval { $node->poll_query_until($db, $query, $expected) };
		return $back if defined $back;
		die $@ unless $@ =~ /Broken pipe/;
		Time::HiRes::usleep(100_000);
	}
	return 0;
}

# sql_fixture(FILE, VAR => VALUE...): the text of sql/include/FILE, the
# fixture sql/*.sql include with \i, preceded by a psql \set of each VAR
# (as app_role => 'idem_app' for the README's grants), to be run by psql.
sub sql_fixture
{
	my ($file, %vars) = @_;
	my $path = File::Basename::dirname(__FILE__) . "/../../sql/include/$file";
	open my $fh, '<', $path or die "$path: $!";
	local $/;
	my $text = <$fh>;
	close $fh;
	return join('', map { "\\set $_ $vars{$_}\n" } sort keys %vars) . $text;
}

sub now_ms
{
	return Time::HiRes::time() * 1000;
}

# window_secs(MEASURED, FACTOR, FLOOR): a window (a ttl, a lease, a pause)
# of FACTOR times MEASURED seconds, at least FLOOR, in whole seconds.  A test
# whose records or leases must outlive some of its steps measures a step
# like them first (a set-up of the same kind of work), so that on a machine
# slowed by others the window grows with it; on a quick one it is FLOOR, the
# window the test was written with.
sub window_secs
{
	my ($measured, $factor, $floor) = @_;
	my $w = $factor * $measured;
	$w = $floor if $w < $floor;
	return int($w) == $w ? $w : int($w) + 1;
}

# update_behind_open_claim(NODE, DB, FROM, TO, REPOINT, OPEN): ALTER EXTENSION
# idempotency UPDATE TO 'TO' in DB, at FROM, while the background session
# OPEN holds a claim in an open transaction, as tests of the steps: with
# lock_timeout the update fails at once (55P03) and changes nothing; without,
# it waits for ACCESS EXCLUSIVE on idempotency.records, and a new claim of
# key 'up-queued' (lease 1 hour) waits behind it; then OPEN commits, both go
# through, and DB is at TO.  REPOINT, SQL run in the update's transaction,
# points the C functions at the test's copy of the library again.  The
# caller checks what the queued claim became.
sub update_behind_open_claim
{
	my ($node, $db, $from, $to, $repoint, $open) = @_;

	my ($state) = sqlstate_of_psql($node, $db,
		qq{SET lock_timeout = '200ms'; ALTER EXTENSION idempotency UPDATE TO '$to'});
	is($state, '55P03', 'the update with lock_timeout fails (55P03) behind an open claim transaction');
	is( $node->safe_psql($db, q{SELECT extversion FROM pg_extension WHERE extname = 'idempotency'}),
		$from, 'and changed nothing');

	my $upd = $node->background_psql($db);
	$upd->query_until(qr/updating/, qq{\\echo updating
BEGIN;
ALTER EXTENSION idempotency UPDATE TO '$to';
$repoint;
COMMIT;
\\echo updated
});
	$node->poll_query_until($db,
		q{SELECT EXISTS (SELECT FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query ~ 'ALTER EXTENSION')})
	  or die 'the update does not wait';
	my $queued = $node->background_psql($db);
	$queued->query_until(qr/claiming/, q{\echo claiming
SELECT outcome || '|' || attempt FROM idempotency.idem_acquire('up-queued', lease => '1 hour');
\echo claimed
});
	ok( $node->poll_query_until($db,
			q{SELECT count(*) = 2 FROM pg_stat_activity WHERE wait_event_type = 'Lock'
			     AND (query ~ 'ALTER EXTENSION' OR query ~ 'up-queued')}),
		'the update waits for the open claim transaction, and a new claim waits behind the update');
	is( $node->safe_psql($db,
			q{SELECT count(*) FROM pg_locks WHERE relation = 'idempotency.records'::regclass
			     AND mode = 'AccessExclusiveLock' AND NOT granted}),
		'1', 'the update waits for ACCESS EXCLUSIVE on idempotency.records');

	$open->query_safe('COMMIT');
	$upd->query_until(qr/updated/, '');
	$queued->query_until(qr/claimed/, '');
	$upd->quit;
	$queued->quit;
	is( $node->safe_psql($db, q{SELECT extversion FROM pg_extension WHERE extname = 'idempotency'}),
		$to, 'the update ran once the claim transaction committed');
	return;
}

1;
