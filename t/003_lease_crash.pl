# Copyright (c) idempotency authors
#
# Lease-mode crash: a caller claims across transactions (acquire, COMMIT,
# "call the outside service") and dies without completing.  A retry is
# in_progress until the lease runs out, then acquired with attempt 2 (and
# the record's expires_at unchanged); the first caller's late complete or
# release with attempt => 1 fails with 55000.  The caller dies three ways:
#   A. its connection ends (psql quits);
#   B. pg_terminate_backend;
#   C. the whole server crashes (pg_ctl stop -m immediate) and restarts.
# D. A retry that waits (wait_timeout longer than the lease left) gets
#    acquired as soon as the lease runs out, not at the end of its wait.
# E. In-transaction mode for contrast: a caller killed inside its open
#    transaction leaves no claim at all (attempt 1 for the retry, at once).

use strict;
use warnings;

use FindBin;
use lib "$FindBin::RealBin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time usleep);

my $node = idem_node('lease', "log_statement = none\n");

# The leases must still run when the first retry starts, a few psql calls
# (and in C a restart) after the claim: each is the lease the test was
# written with (2 s for A and B, 3 s for C, 1 s for D), or a multiple of
# what those steps were measured to take here where that is longer.
my $call = 0;    # seconds: the longest of three psql calls
for (1 .. 3)
{
	my $t = time;
	$node->safe_psql('postgres', 'SELECT 1');
	$call = time - $t if time - $t > $call;
}
my $t_restart = time;
$node->restart;
my $restart = time - $t_restart;
my $lease = window_secs(8 * $call, 1, 2);    # seconds
my $lease_crash = window_secs(3 * ($restart + 3 * $call), 1, 3);
my $lease_wait = window_secs(6 * $call, 1, 1);
note sprintf('a psql call takes %.2f s, a restart %.1f s: leases of %d s, %d s (crash), %d s (wait)',
	$call, $restart, $lease, $lease_crash, $lease_wait);

# claim KEY in a session of its own with a lease, committed; return the
# session, its backend pid, and the record's locked_until and expires_at
sub claim
{
	my ($key, $lease_secs) = @_;
	my $s = $node->background_psql('postgres');
	my $res = $s->query_safe(
		qq{SELECT a.outcome, a.attempt, pg_backend_pid()
		     FROM idempotency.idem_acquire('$key', '{"order": 9}', lease => '$lease_secs seconds') a});
	my ($outcome, $attempt, $pid) = split /\|/, $res;
	is("$outcome|$attempt", 'acquired|1', "$key: the first caller acquires, attempt 1, lease ${lease_secs}s");
	my ($status, $locked_until, $expires_at) = split /\|/,
	  $node->safe_psql('postgres',
		qq{SELECT status, locked_until, expires_at FROM idempotency.idem_lookup('$key')});
	is($status, 'processing', "$key: the claim is committed and visible as processing");
	return ($s, $pid, $locked_until, $expires_at);
}

# retry KEY (wait_timeout 100ms) until it is acquired; check every answer
sub retry_until_acquired
{
	my ($key, $locked_until, $expires_at) = @_;
	my (@answers, $final);
	my $deadline = time + 30;
	while (time < $deadline)
	{
		my $r = $node->safe_psql(
			'postgres', qq{
SET idempotency.wait_timeout = '100ms';
SELECT a.outcome, a.attempt, a.response_status IS NULL AND a.response_body IS NULL,
       a.expires_at = '$expires_at',
       statement_timestamp() < '$locked_until',
       clock_timestamp() >= '$locked_until'
  FROM idempotency.idem_acquire('$key', '{"order": 9}') a});
		push @answers, $r;
		if ($r =~ /^acquired/)
		{
			$final = $r;
			last;
		}
		usleep(150_000);
	}
	my @early = @answers[ 0 .. $#answers - 1 ];
	ok(scalar(@early) > 0, "$key: retries before the lease ran out (" . scalar(@early) . ')');
	my @bad = grep { !/^in_progress\|(1)?\|t\|(t)?\|t\|f$/ } @early;
	is(scalar(@bad), 0,
		"$key: every retry that started before locked_until is in_progress, response columns NULL")
	  or diag("answers (outcome|attempt|response NULL|same expires_at|started before locked_until|ended after): @answers");
	ok(defined $final, "$key: a retry gets acquired once the lease has run out");
	my ($outcome, $attempt, $null_response, $same_expiry, $started_before, $after) = split /\|/, ($final // '|||||');
	is($null_response, 't', "$key: acquired, with NULL response columns");
	is($attempt, 2, "$key: the takeover is attempt 2");
	is($same_expiry, 't', "$key: the takeover keeps the record's expires_at");
	is($after, 't', "$key: and comes no earlier than locked_until");
	return scalar(@early);
}

sub late_caller_refused
{
	my ($key) = @_;
	my ($state) = sqlstate_of_psql($node, 'postgres',
		qq{SELECT idempotency.idem_complete('$key', 201, '{"by": "first"}', attempt => 1)});
	is($state, '55000', "$key: the first caller's late complete(attempt => 1) fails with 55000");
	($state) = sqlstate_of_psql($node, 'postgres',
		qq{SELECT idempotency.idem_release('$key', attempt => 1)});
	is($state, '55000', "$key: and its late release(attempt => 1) too");
	is( $node->safe_psql('postgres',
			qq{SELECT status, attempt FROM idempotency.idem_lookup('$key')}),
		'processing|2', "$key: the record still belongs to attempt 2");
	is( $node->safe_psql('postgres',
			qq{SELECT idempotency.idem_complete('$key', 201, '{"by": "second"}', attempt => 2)}),
		't', "$key: attempt 2 completes");
	is( $node->safe_psql('postgres',
			qq{SELECT a.outcome, a.response_status, a.response_body, a.attempt
			     FROM idempotency.idem_acquire('$key', '{"order": 9}') a}),
		'replay|201|{"by": "second"}|2', "$key: and the next retry replays attempt 2's response");
	($state) = sqlstate_of_psql($node, 'postgres',
		qq{SELECT idempotency.idem_complete('$key', 500, '{"by": "first"}', attempt => 1)});
	is($state, '55000', "$key: a late complete(attempt => 1) after that is still 55000");
}

# A. the caller's connection ends
{
	my ($s, $pid, $locked_until, $expires_at) = claim('lease-quit', $lease);
	$s->quit;
	ok($node->poll_query_until('postgres',
			"SELECT NOT EXISTS (SELECT FROM pg_stat_activity WHERE pid = $pid)"),
		'lease-quit: the first caller is gone');
	my $n = retry_until_acquired('lease-quit', $locked_until, $expires_at);
	late_caller_refused('lease-quit');
	diag("A (connection closed): $n retries answered in_progress before the ${lease}s lease ran out, then acquired attempt 2");
}

# B. the caller's backend is terminated
{
	my ($s, $pid, $locked_until, $expires_at) = claim('lease-term', $lease);
	is($node->safe_psql('postgres', "SELECT pg_terminate_backend($pid, 5000)"),
		't', 'lease-term: the first caller is terminated');
	eval { $s->quit };    # its connection is gone already
	my $n = retry_until_acquired('lease-term', $locked_until, $expires_at);
	late_caller_refused('lease-term');
	diag("B (pg_terminate_backend): $n retries answered in_progress, then acquired attempt 2");
}

# C. the server crashes while the claim is out
{
	my ($s, $pid, $locked_until, $expires_at) = claim('lease-crash', $lease_crash);
	$node->stop('immediate');
	eval { $s->quit };
	$node->start;
	is( $node->safe_psql('postgres',
			q{SELECT status, attempt FROM idempotency.idem_lookup('lease-crash')}),
		'processing|1', 'lease-crash: the committed claim survives the crash');
	my $n = retry_until_acquired('lease-crash', $locked_until, $expires_at);
	late_caller_refused('lease-crash');
	diag("C (server crash and restart): $n retries answered in_progress, then acquired attempt 2");
}

# D. a retry that waits longer than the lease left
{
	my ($s, $pid, $locked_until, $expires_at) = claim('lease-wait', $lease_wait);
	$s->quit;
	my $r = $node->safe_psql(
		'postgres', qq{
SET idempotency.wait_timeout = '10s';
SELECT a.outcome, a.attempt,
       round(extract(epoch FROM clock_timestamp() - '$locked_until'::timestamptz) * 1000)
  FROM idempotency.idem_acquire('lease-wait', '{"order": 9}') a});
	my ($outcome, $attempt, $late_ms) = split /\|/, $r;
	is("$outcome|$attempt", 'acquired|2',
		'lease-wait: a retry waiting on the lease gets acquired, attempt 2, within its wait');
	ok($late_ms >= 0 && $late_ms < 500,
		"lease-wait: it answers ${late_ms} ms after locked_until (not at the end of wait_timeout)");
	diag("D: a retry waiting on a running lease got acquired $late_ms ms after locked_until (wait_timeout 10s)");
	late_caller_refused('lease-wait');
}

# E. in-transaction mode: a caller killed in its open transaction leaves nothing
{
	my $s = $node->background_psql('postgres');
	$s->query_safe('BEGIN');
	my $pid = $s->query_safe(
		q{SELECT pg_backend_pid() FROM idempotency.idem_acquire('tx-kill', '{"order": 9}', lease => '1 hour')});
	is($node->safe_psql('postgres', "SELECT pg_terminate_backend($pid, 5000)"),
		't', 'tx-kill: the caller is terminated inside its transaction');
	eval { $s->quit };
	is( $node->safe_psql('postgres', q{SELECT count(*) FROM idempotency.idem_lookup('tx-kill')}),
		'0', 'tx-kill: no claim is left');
	is( $node->safe_psql('postgres',
			q{SET idempotency.wait_timeout = 0;
			  SELECT outcome, attempt FROM idempotency.idem_acquire('tx-kill', '{"order": 9}')}),
		'acquired|1', 'tx-kill: the retry acquires at once, attempt 1');
}

ok(!$node->log_contains(qr/terminated by signal|PANIC|TRAP:/),
	'no backend died of a signal (no crash but the test\'s own immediate stop)');
$node->stop;
done_testing();
