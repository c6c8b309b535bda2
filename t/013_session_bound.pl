# Copyright (c) idempotency authors
#
# Session-bound claims (1.1) whose owner session ends.  The owner claims
# with session_bound => true, a 2-hour ttl and a 1-hour lease, commits and
# stays connected; while it lives (idle, or busy in a long call) a duplicate
# answers in_progress with retry_after 1, long after its lease would have
# run out.  Then the owner ends, five ways:
#   quit       its connection ends (psql quits);
#   terminate  pg_terminate_backend;
#   sigkill    SIGKILL to its backend (the postmaster restarts every backend);
#   crash      pg_ctl stop -m immediate, then start;
#   restart    pg_ctl stop -m fast, then start.
# Each time the next idem_acquire takes the claim over at once (acquired,
# attempt 2, a new claim), measured from the owner's end: it waits for no
# lease.  The old owner's late complete and release with its claim get 55000.
# Last, the owner's identity: a dead owner's record naming the pid of a live
# backend (which holds an owner lock of its own) is still taken over.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::RealBin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(usleep);

my $node = idem_node('session', "restart_after_crash = on\nlog_statement = none\n");

# claim KEY session-bound in a session of its own; return the session, its
# pid and the claim
sub owner_claim
{
	my ($key) = @_;
	my $s = $node->background_psql('postgres');
	my $res = $s->query_safe(
		qq{SELECT a.outcome || '|' || a.attempt || '|' || a.claim || '|' || pg_backend_pid()
		     FROM idempotency.idem_acquire('$key', '{"n": 1}', ttl => '2 hours',
		                                   lease => '1 hour', session_bound => true) a});
	my ($outcome, $attempt, $claim, $pid) = split /\|/, $res;
	is("$outcome|$attempt", 'acquired|1', "$key: the owner acquires, attempt 1");
	like($claim, qr/^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$/,
		"$key: with a version 4 UUID claim");
	is( $node->safe_psql('postgres',
			qq{SELECT owner_pid, locked_until = expires_at FROM idempotency.idem_lookup('$key')}),
		"$pid|t", "$key: committed, owner_pid is the owner's backend, locked until expires_at");
	return ($s, $pid, $claim);
}

# one duplicate acquire (a lease claim), waiting at most wait_ms
sub duplicate
{
	my ($key, $wait_ms) = @_;
	return $node->safe_psql(
		'postgres', qq{
SET idempotency.wait_timeout = '${wait_ms}ms';
SELECT a.outcome || '|' || a.attempt || '|' || COALESCE(a.claim::text, '') || '|' || COALESCE(a.retry_after::text, '')
  FROM idempotency.idem_acquire('$key', '{"n": 1}', lease => '1 hour') a});
}

# acquire KEY over and over (each in a new connection, failures such as a
# server still in recovery ignored, and psql's broken pipe when it exits at
# once on a refused connection: see poll_query_back) until acquired; return
# the answer and the milliseconds since t0
sub acquire_after_death
{
	my ($key, $t0) = @_;
	while (now_ms() - $t0 < 60_000)
	{
		my ($ret, $out) = eval {
			$node->psql(
				'postgres', qq{
SET idempotency.wait_timeout = 0;
SELECT a.outcome || '|' || a.attempt || '|' || COALESCE(a.claim::text, '') || '|' || COALESCE(a.retry_after::text, '')
  FROM idempotency.idem_acquire('$key', '{"n": 1}', lease => '1 hour') a});
		};
		if (!defined $ret)
		{
			die $@ unless $@ =~ /Broken pipe/;
			$ret = -1;
		}
		if ($ret == 0 && $out =~ /^acquired/)
		{
			return ($out, now_ms() - $t0);
		}
		if ($ret == 0)
		{
			like($out, qr/^in_progress\|1\|\|1$/, "$key: until then, in_progress with retry_after 1");
		}
		usleep(10_000);
	}
	return ('timeout', now_ms() - $t0);
}

my %latency;
foreach my $mode (qw(quit terminate sigkill crash restart))
{
	my $key = "sb-$mode";
	my ($s, $pid, $claim) = owner_claim($key);

	# while the owner lives, idle: in_progress, retry_after 1, no claim
	is(duplicate($key, 200), 'in_progress|1||1',
		"$key: a duplicate while the owner is idle waits 200ms and answers in_progress, retry_after 1");

	if ($mode eq 'quit')
	{
		# while the owner is busy in a long call (not in a transaction on
		# the record): in_progress too
		$s->query_until(qr/sleeping/, "\\echo sleeping\nSELECT pg_sleep(2);\n");
		is(duplicate($key, 500), 'in_progress|1||1',
			"$key: a duplicate while the owner is in a long call answers in_progress");
		$s->query_safe('SELECT 1');    # the sleep has ended
	}

	my $t0;
	if ($mode eq 'quit')
	{
		$t0 = now_ms();
		$s->quit;
	}
	elsif ($mode eq 'terminate')
	{
		$t0 = now_ms();
		$node->safe_psql('postgres', "SELECT pg_terminate_backend($pid)");
		eval { $s->quit };
	}
	elsif ($mode eq 'sigkill')
	{
		$t0 = now_ms();
		kill 'KILL', $pid;
		eval { $s->quit };
	}
	elsif ($mode eq 'crash')
	{
		$t0 = now_ms();
		$node->stop('immediate');
		eval { $s->quit };
		$node->start;
	}
	else
	{
		$t0 = now_ms();
		eval { $s->quit };    # a fast stop ends the session, as a shutdown would
		$node->stop('fast');
		$node->start;
	}

	my ($answer, $ms) = acquire_after_death($key, $t0);
	my ($outcome, $attempt, $new_claim, $retry_after) = split /\|/, $answer;
	is("$outcome|$attempt", 'acquired|2', "$key: after the owner's end ($mode) the next acquire takes over, attempt 2");
	ok($new_claim ne '' && $new_claim ne $claim, "$key: with a new claim");
	ok($ms < 30_000, "$key: within " . int($ms) . "ms of the owner's end, not after its 1-hour lease");
	$latency{$mode} = $ms;

	my ($state) = sqlstate_of_psql($node, 'postgres',
		qq{SELECT idempotency.idem_complete('$key', 200, '{"late": true}', claim => '$claim')});
	is($state, '55000', "$key: the old owner's late complete with its claim gets 55000");
	($state) = sqlstate_of_psql($node, 'postgres',
		qq{SELECT idempotency.idem_release('$key', claim => '$claim')});
	is($state, '55000', "$key: and its late release too");
	is( $node->safe_psql('postgres',
			qq{SELECT status, attempt, owner_pid IS NULL FROM idempotency.idem_lookup('$key')}),
		'processing|2|t', "$key: the record is the new claim's, unchanged by the late calls");
	is( $node->safe_psql('postgres',
			qq{SELECT idempotency.idem_complete('$key', 201, '{"by": 2}', attempt => 2, claim => '$new_claim')}),
		't', "$key: the new claim completes it");
}
diag(join(', ', map { "$_ ${\ int($latency{$_})}ms" } qw(quit terminate sigkill crash restart))
	  . ' from the owner\'s end to acquired (including connection set-up, and recovery for sigkill/crash)');

# The owner's identity is pid and backend start.  A live backend that owns a
# session-bound claim of its own holds an owner lock under its pid; a dead
# owner's record rewritten to name that pid (as if the pid had been reused)
# is still taken over at once, while the live one's own claim is not.
{
	my ($live, $live_pid, $live_claim) = owner_claim('sb-live');
	my ($dead, $dead_pid, $dead_claim) = owner_claim('sb-dead');
	$dead->quit;
	$node->poll_query_until('postgres',
		"SELECT NOT EXISTS (SELECT FROM pg_stat_activity WHERE pid = $dead_pid)")
	  or die 'the dead owner did not go';
	$node->safe_psql('postgres',
		"UPDATE idempotency.records SET owner_pid = $live_pid WHERE key = 'sb-dead'");
	is( $node->safe_psql('postgres', q{SELECT owner_pid FROM idempotency.idem_lookup('sb-dead')}),
		$live_pid, 'sb-dead: the dead owner\'s record names a live backend\'s pid');
	is(duplicate('sb-live', 0), 'in_progress|1||1', 'sb-live: the live owner\'s own claim is in_progress');
	like(duplicate('sb-dead', 0), qr/^acquired\|2\|[0-9a-f-]{36}\|$/,
		'sb-dead: the record with the live pid but another backend start is taken over at once');
	$live->quit;
}

# Nothing crashed but what the test killed.
my $log = slurp_file($node->logfile);
my @crashes = ($log =~ /was terminated by signal (\d+)/g);
is_deeply(\@crashes, ['9'], 'only the SIGKILLed backend died of a signal');

$node->stop;
done_testing();
