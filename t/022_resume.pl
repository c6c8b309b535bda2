# Copyright (c) idempotency authors
#
# Resuming a half-done operation (1.2).  A worker claims a payment, charges
# the "provider" (a row in provider_charges) and records the checkpoint
# 'charged' with the charge id in the same transaction, then dies before it
# completes.  The takeover's acquired answers that phase and state, so the
# new holder completes with the charge id without charging again: the
# provider is called once.  The worker dies three ways:
#   A. pg_terminate_backend, a lease-mode claim (taken over once the lease
#      has run out);
#   B. SIGKILL of its backend (the server restarts after the crash), a
#      session-bound claim (taken over at once: the owner is gone);
#   C. killed inside the transaction that charges and checkpoints: neither
#      is kept, so the takeover sees the checkpoint before it ('started')
#      and charges, once.
# Each time the dead worker's late checkpoint and complete with its claim
# get 55000.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::RealBin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time usleep);

my $node = idem_node('resume', "log_statement = none\nrestart_after_crash = on\n");
$node->safe_psql(
	'postgres', q{
CREATE TABLE provider_charges (payment text, charge_id text, charged_by int);
});

# the lease must still run a few psql calls after the claim (2 s, or more
# where those calls were measured to be slow)
my $call = 0;
for (1 .. 3)
{
	my $t = time;
	$node->safe_psql('postgres', 'SELECT 1');
	$call = time - $t if time - $t > $call;
}
my $lease = window_secs(8 * $call, 1, 2);
note sprintf('a psql call takes %.2f s: lease of %d s', $call, $lease);

# A worker session: claim KEY and charge, checkpointing 'charged' with the
# charge id in the transaction of the charge.  Returns the session, its pid
# and its claim.
sub worker_charges
{
	my ($key, $claim_args) = @_;
	my $w = $node->background_psql('postgres', on_error_stop => 0);
	my ($outcome, $attempt, $claim, $pid) = split /\|/, $w->query_safe(
		qq{SELECT a.outcome, a.attempt, a.claim, pg_backend_pid()
		     FROM idempotency.idem_acquire('$key', '{"amount": 10}', $claim_args) a});
	is("$outcome|$attempt", 'acquired|1', "$key: the worker acquires, attempt 1");
	$w->query_safe(
		qq{SELECT idempotency.idem_checkpoint('$key', claim => '$claim', phase => 'started') IS NOT NULL});
	$w->query_safe(
		qq{BEGIN;
INSERT INTO provider_charges VALUES ('$key', 'ch-$key-1', 1);
SELECT idempotency.idem_checkpoint('$key', claim => '$claim', phase => 'charged',
                                   state => '{"charge_id": "ch-$key-1"}') IS NOT NULL;
COMMIT;});
	return ($w, $pid, $claim);
}

# The takeover, as the application does it: acquire (retrying while
# in_progress); on 'charged' complete with the charge id, otherwise charge
# first.  Returns what the takeover's acquired said.
sub take_over
{
	my ($key) = @_;
	my ($res, $deadline) = ('', time + 10 * $PostgreSQL::Test::Utils::timeout_default);
	while (time < $deadline)
	{
		$res = $node->safe_psql(
			'postgres', qq{
SET idempotency.wait_timeout = '100ms';
SELECT a.outcome, a.attempt, COALESCE(a.phase, '-'), COALESCE(a.state->>'charge_id', '-'), a.claim
  FROM idempotency.idem_acquire('$key', '{"amount": 10}') a});
		last if $res =~ /^acquired/;
		usleep(50_000);
	}
	my ($outcome, $attempt, $phase, $charge, $claim) = split /\|/, $res;
	if ($phase ne 'charged')
	{
		$charge = "ch-$key-2";
		$node->safe_psql('postgres', qq{
BEGIN;
INSERT INTO provider_charges VALUES ('$key', '$charge', 2);
SELECT idempotency.idem_checkpoint('$key', claim => '$claim', phase => 'charged',
                                   state => '{"charge_id": "$charge"}');
COMMIT;});
	}
	$node->safe_psql('postgres', qq{
SELECT idempotency.idem_complete('$key', 201, '{"charge_id": "$charge"}', claim => '$claim')});
	return ($outcome, $attempt, $phase, $charge);
}

# the provider was called once for KEY, and the record replays its charge
sub check_once
{
	my ($key, $charge) = @_;
	is( $node->safe_psql('postgres',
			qq{SELECT count(*) || ':' || string_agg(charge_id, ',') FROM provider_charges WHERE payment = '$key'}),
		"1:$charge", "$key: the provider was called once");
	is( $node->safe_psql('postgres',
			qq{SELECT a.outcome || ':' || (a.response_body->>'charge_id') || ':' || a.response_status
			     FROM idempotency.idem_acquire('$key', '{"amount": 10}') a}),
		"replay:$charge:201", "$key: a retry replays the completed charge");
	is( $node->safe_psql('postgres', qq{SELECT status || ':' || phase FROM idempotency.idem_lookup('$key')}),
		'completed:charged', "$key: the completed record keeps its checkpoint");
}

# the dead worker's claim is fenced off: its checkpoint and complete get 55000
sub check_fenced
{
	my ($key, $claim) = @_;
	my ($state) = sqlstate_of_psql($node, 'postgres',
		qq{SELECT idempotency.idem_checkpoint('$key', claim => '$claim', phase => 'late')});
	is($state, '55000', "$key: the dead worker's late checkpoint gets 55000");
	($state) = sqlstate_of_psql($node, 'postgres',
		qq{SELECT idempotency.idem_complete('$key', 500, claim => '$claim')});
	is($state, '55000', "$key: the dead worker's late complete gets 55000");
}

# A. terminated after its checkpoint; lease-mode claim
{
	my ($w, $pid, $claim) = worker_charges('pay-a', "lease => '$lease seconds'");
	$node->safe_psql('postgres', "SELECT pg_terminate_backend($pid)");
	eval { $w->quit };
	my ($outcome, $attempt, $phase, $charge) = take_over('pay-a');
	is("$outcome|$attempt|$phase|$charge", 'acquired|2|charged|ch-pay-a-1',
		'A: the takeover resumes at charged with the charge id');
	check_once('pay-a', 'ch-pay-a-1');
	check_fenced('pay-a', $claim);
}

# B. its backend SIGKILLed (a crash: the server restarts); session-bound
{
	my ($w, $pid, $claim) = worker_charges('pay-b', 'session_bound => true');
	kill 'KILL', $pid;
	eval { $w->quit };
	ok(poll_query_back($node, 'postgres', 'SELECT true'), 'B: the server is back after the crash');
	my ($outcome, $attempt, $phase, $charge) = take_over('pay-b');
	is("$outcome|$attempt|$phase|$charge", 'acquired|2|charged|ch-pay-b-1',
		'B: the takeover resumes at charged with the charge id');
	check_once('pay-b', 'ch-pay-b-1');
	check_fenced('pay-b', $claim);
}

# C. killed inside the transaction of the charge and its checkpoint
{
	my $w = $node->background_psql('postgres', on_error_stop => 0);
	my ($claim, $pid) = split /\|/, $w->query_safe(
		q{SELECT a.claim, pg_backend_pid() FROM idempotency.idem_acquire('pay-c', '{"amount": 10}', session_bound => true) a});
	$w->query_safe(
		qq{SELECT idempotency.idem_checkpoint('pay-c', claim => '$claim', phase => 'started') IS NOT NULL});
	$w->query_safe(
		qq{BEGIN;
INSERT INTO provider_charges VALUES ('pay-c', 'ch-pay-c-1', 1);
SELECT idempotency.idem_checkpoint('pay-c', claim => '$claim', phase => 'charged',
                                   state => '{"charge_id": "ch-pay-c-1"}') IS NOT NULL;});
	$node->safe_psql('postgres', "SELECT pg_terminate_backend($pid)");
	eval { $w->quit };
	my ($outcome, $attempt, $phase, $charge) = take_over('pay-c');
	is("$outcome|$attempt|$phase|$charge", 'acquired|2|started|ch-pay-c-2',
		'C: the charge and its checkpoint were rolled back together: the takeover sees started and charges');
	check_once('pay-c', 'ch-pay-c-2');
	check_fenced('pay-c', $claim);
}

$node->stop;
done_testing();
