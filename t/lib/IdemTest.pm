# Copyright (c) idempotency authors
#
# Helpers shared by the TAP tests t/002_*.pl onwards: a throwaway cluster on
# 127.0.0.1 set up as scripts/common.sh does it (pg_cron preloaded), the
# SQLSTATE of a failed psql call, polling a server that is coming back from
# a crash, the SQL fixtures the tests share (sql/include: the README's
# grants, the SQLSTATE helper), a millisecond clock, and windows (ttls, leases, pauses) sized from
# how fast the machine was measured to be.

package IdemTest;

use strict;
use warnings;

use Exporter 'import';
use File::Basename ();
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Time::HiRes ();

our @EXPORT = qw(idem_node sqlstate_of_psql poll_query_back now_ms
  window_secs sql_fixture warm_up_sql);

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

1;
