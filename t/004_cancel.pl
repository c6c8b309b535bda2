# Copyright (c) idempotency authors
#
# Cancel and timeouts.  A backend waiting on a duplicate (wait_timeout 30s)
# must answer, within a small fraction of wait_timeout:
#   - pg_cancel_backend (57014);
#   - statement_timeout (57014), here 300ms;
#   - lock_timeout shorter than wait_timeout (55P03), here 200ms;
# and leave nothing behind: no record, no key lock in pg_locks, and the key
# free for the next caller once the holder rolls back.  Both kinds of wait:
#   - on a claim made in a transaction still open (in the lock manager's
#     queue, on the claiming transaction: README, "Waiting");
#   - on a committed processing claim whose lease runs (latch sleeps).
# And a lock_timeout longer than wait_timeout leaves wait_timeout in charge
# (in_progress, not 55P03).

use strict;
use warnings;

use FindBin;
use lib "$FindBin::RealBin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time usleep);

my $node = idem_node('cancel', "log_statement = none\n");
my $lock_field4 = 18756;    # README: the key lock shows as objsubid 18756

# a waiting session: psql with verbose errors, on_error_stop off
sub waiter
{
	my $s = $node->background_psql('postgres', on_error_stop => 0,
		extra_params => [ '-v', 'VERBOSITY=verbose' ]);
	my $pid = $s->query_safe('SELECT pg_backend_pid()');
	# warm up: the statements the extension prepares once per backend
	$s->query_safe(qq{SELECT outcome FROM idempotency.idem_acquire('warm-up-$pid')});
	$s->query_safe(qq{SELECT idempotency.idem_release('warm-up-$pid')});
	$s->query_safe(q{SET idempotency.wait_timeout = '30s'});
	return ($s, $pid);
}

my $tag = 0;

# send SQL to the session without waiting for it
sub send_sql
{
	my ($s, $sql) = @_;
	$tag++;
	$s->{stderr} = '';
	$s->{stdout} = '';
	$s->{stdin} .= "$sql;\n\\echo done-$tag\n\\warn done-$tag\n";
	$s->{run}->pump_nb();
	return $tag;
}

# wait for the statement sent with send_sql to end; return (stdout, stderr)
sub wait_done
{
	my ($s, $t) = @_;
	pump_until($s->{run}, $s->{timeout}, \$s->{stderr}, qr/done-$t\n/)
	  or die "statement $t did not end";
	pump_until($s->{run}, $s->{timeout}, \$s->{stdout}, qr/done-$t\n/)
	  or die "statement $t did not end";
	my ($out, $err) = ($s->{stdout}, $s->{stderr});
	($s->{stdout}, $s->{stderr}) = ('', '');
	$out =~ s/done-$t\n//;
	$err =~ s/done-$t\n//;
	return ($out, $err);
}

# wait until PID waits: in the lock queue (Lock) or on its latch (Extension)
sub wait_until_waiting
{
	my ($pid, $type) = @_;
	return $node->poll_query_until('postgres',
		qq{SELECT wait_event_type = '$type' FROM pg_stat_activity WHERE pid = $pid});
}

# locks of PID other than its own virtual transaction id
sub other_locks_of
{
	my ($pid) = @_;
	return $node->safe_psql('postgres',
		qq{SELECT count(*) FROM pg_locks WHERE pid = $pid AND locktype <> 'virtualxid'});
}

sub key_locks_of
{
	my ($pid) = @_;
	return $node->safe_psql('postgres',
		qq{SELECT count(*) FROM pg_locks WHERE pid = $pid AND locktype = 'advisory' AND objsubid = $lock_field4});
}

my %figures;

# cancels are sent from a session of its own, so that the time measured is
# the waiter's, not a psql start-up's
my $ctl = $node->background_psql('postgres');

# What a statement and a cancel cost on this machine now, with nothing to
# wait for: the most of three round trips (a query from $ctl, a statement
# through send_sql and wait_done).  The upper bounds below are the figures
# the test was written with plus twice that ($slack_ms), so that a slow
# machine does not fail them, while a wait that ran on to wait_timeout
# (30 s) still would.
my $slack_ms = 0;
{
	my ($w, $wpid) = waiter();
	for (1 .. 3)
	{
		my $t0 = time;
		$ctl->query_safe('SELECT 1');
		wait_done($w, send_sql($w, 'SELECT 1'));
		my $ms = (time - $t0) * 1000;
		$slack_ms = $ms if $ms > $slack_ms;
	}
	$w->quit;
	$slack_ms *= 2;
}
note sprintf('a statement and a cancel take %.1f ms: upper bounds raised by %.1f ms',
	$slack_ms / 2, $slack_ms);
sub cancel
{
	my ($pid) = @_;
	return $ctl->query_safe("SELECT pg_cancel_backend($pid)");
}

# ---------------------------------------------------------------------
# 1. Waiting on a claim in an open transaction
# ---------------------------------------------------------------------
my $holder = $node->background_psql('postgres');
$holder->query_safe('BEGIN');
is($holder->query_safe(q{SELECT outcome FROM idempotency.idem_acquire('cx-tx', '{"a": 1}')}),
	'acquired', 'holder claims cx-tx in an open transaction');
my $holder_pid = $holder->query_safe('SELECT pg_backend_pid()');

# 1a. pg_cancel_backend
{
	my ($w, $wpid) = waiter();
	my $t = send_sql($w, q{SELECT outcome FROM idempotency.idem_acquire('cx-tx', '{"a": 1}')});
	ok(wait_until_waiting($wpid, 'Lock'), 'tx: the duplicate waits in the lock queue');
	is( $node->safe_psql('postgres', qq{SELECT $holder_pid = ANY (pg_blocking_pids($wpid))}),
		't', 'tx: blocked by the holder (pg_blocking_pids)');
	my $t0 = time;
	is(cancel($wpid), 't', 'tx: cancel sent');
	my ($out, $err) = wait_done($w, $t);
	my $ms = (time - $t0) * 1000;
	like($err, qr/ERROR:\s+57014: canceling statement due to user request/,
		'tx: the waiting acquire is canceled (57014)');
	cmp_ok($ms, '<', 300 + $slack_ms, sprintf('tx: cancel answered in %.1f ms (wait_timeout 30 s)', $ms));
	$figures{'cancel, claim in open transaction'} = $ms;
	is(key_locks_of($wpid), '0', 'tx: the canceled backend holds no key lock');
	is(other_locks_of($wpid), '0', 'tx: nor any other lock');
	is( $node->safe_psql('postgres',
			q{SET idempotency.wait_timeout = 0; SELECT outcome FROM idempotency.idem_acquire('cx-tx', '{"a": 1}')}),
		'in_progress', 'tx: the holder\'s claim is untouched (a new duplicate: in_progress)');
	is($w->query_safe('SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = \'advisory\''),
		'0', 'tx: nor any advisory lock, seen from itself');
	$w->quit;
}

# 1b. statement_timeout
{
	my ($w, $wpid) = waiter();
	$w->query_safe(q{SET statement_timeout = '300ms'});
	my $t0 = time;
	my $t = send_sql($w, q{SELECT outcome FROM idempotency.idem_acquire('cx-tx', '{"a": 1}')});
	my ($out, $err) = wait_done($w, $t);
	my $ms = (time - $t0) * 1000;
	like($err, qr/ERROR:\s+57014: canceling statement due to statement timeout/,
		'tx: statement_timeout interrupts the wait (57014)');
	ok($ms >= 290 && $ms < 800 + $slack_ms,
		sprintf('tx: after %.1f ms (statement_timeout 300 ms, wait_timeout 30 s)', $ms));
	$figures{'statement_timeout 300ms, claim in open transaction'} = $ms;
	is(key_locks_of($wpid), '0', 'tx: no key lock left after statement_timeout');
	is(other_locks_of($wpid), '0', 'tx: nor any other lock');
	$w->quit;
}

# 1c. lock_timeout shorter than wait_timeout
{
	my ($w, $wpid) = waiter();
	$w->query_safe(q{SET lock_timeout = '200ms'});
	my $t0 = time;
	my $t = send_sql($w, q{SELECT outcome FROM idempotency.idem_acquire('cx-tx', '{"a": 1}')});
	my ($out, $err) = wait_done($w, $t);
	my $ms = (time - $t0) * 1000;
	like($err, qr/ERROR:\s+55P03:/, 'tx: lock_timeout 200ms < wait_timeout: 55P03');
	ok($ms >= 190 && $ms < 700 + $slack_ms, sprintf('tx: after %.1f ms', $ms));
	$figures{'lock_timeout 200ms, claim in open transaction'} = $ms;
	is(key_locks_of($wpid), '0', 'tx: no key lock left after lock_timeout');
	is(other_locks_of($wpid), '0', 'tx: nor any other lock');

	# lock_timeout longer than wait_timeout: wait_timeout decides
	$w->query_safe(q{SET lock_timeout = '5s'; SET idempotency.wait_timeout = '200ms'});
	$t0 = time;
	$t = send_sql($w, q{SELECT outcome FROM idempotency.idem_acquire('cx-tx', '{"a": 1}')});
	($out, $err) = wait_done($w, $t);
	$ms = (time - $t0) * 1000;
	is($out =~ s/\s+$//r, 'in_progress', 'tx: lock_timeout 5s > wait_timeout 200ms: in_progress');
	is($err, '', 'tx: and no error');
	ok($ms >= 190 && $ms < 1500 + $slack_ms, sprintf('tx: after %.1f ms', $ms));
	$w->quit;
}

# 1d. statement_timeout inside a transaction block of the waiter, then the
# waiter's transaction goes on after ROLLBACK TO SAVEPOINT
{
	my ($w, $wpid) = waiter();
	$w->query_safe(q{BEGIN; SAVEPOINT s1; SET LOCAL statement_timeout = '200ms'});
	my $t = send_sql($w, q{SELECT outcome FROM idempotency.idem_acquire('cx-tx', '{"a": 1}')});
	my ($out, $err) = wait_done($w, $t);
	like($err, qr/57014/, 'tx, in a savepoint: statement_timeout');
	$w->query_safe(q{ROLLBACK TO SAVEPOINT s1});
	is(key_locks_of($wpid), '0', 'tx, in a savepoint: no key lock left once rolled back to the savepoint');
	is($w->query_safe(q{SELECT count(*) FROM idempotency.idem_lookup('cx-tx')}),
		'0', 'tx, in a savepoint: no record visible');
	$w->query_safe('ROLLBACK');
	$w->quit;
}

# the holder rolls back: the key is free, no claim of any waiter is left
$holder->query_safe('ROLLBACK');
is($node->safe_psql('postgres', q{SELECT count(*) FROM idempotency.idem_lookup('cx-tx')}),
	'0', 'tx: after the holder rolls back, no record for the key');
is($node->safe_psql('postgres', q{SELECT count(*) FROM idempotency.records WHERE key = 'cx-tx'}),
	'0', 'tx: not even a dead one in the table');
is( $node->safe_psql('postgres',
		q{SET idempotency.wait_timeout = 0; SELECT outcome, attempt FROM idempotency.idem_acquire('cx-tx', '{"a": 1}')}),
	'acquired|1', 'tx: the next caller acquires at once, attempt 1');
is( $node->safe_psql('postgres',
		qq{SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = $lock_field4}),
	'0', 'no key lock held by anyone at the end');

# ---------------------------------------------------------------------
# 2. Waiting on a committed processing claim whose lease runs (latch sleeps)
# ---------------------------------------------------------------------
$node->safe_psql('postgres',
	q{SELECT outcome FROM idempotency.idem_acquire('cx-lease', '{"a": 1}', lease => '1 hour')});
my $before = $node->safe_psql('postgres',
	q{SELECT status, attempt, locked_until FROM idempotency.idem_lookup('cx-lease')});

# 2a. pg_cancel_backend
{
	my ($w, $wpid) = waiter();
	my $t = send_sql($w, q{SELECT outcome FROM idempotency.idem_acquire('cx-lease', '{"a": 1}')});
	ok(wait_until_waiting($wpid, 'Extension'), 'lease: the duplicate sleeps on its latch');
	usleep(200_000);    # well into the 50 ms sleeps
	my $t0 = time;
	is(cancel($wpid), 't', 'lease: cancel sent');
	my ($out, $err) = wait_done($w, $t);
	my $ms = (time - $t0) * 1000;
	like($err, qr/ERROR:\s+57014: canceling statement due to user request/,
		'lease: the sleeping acquire is canceled (57014)');
	cmp_ok($ms, '<', 300 + $slack_ms, sprintf('lease: cancel answered in %.1f ms', $ms));
	$figures{'cancel, committed claim under lease'} = $ms;
	is(key_locks_of($wpid), '0', 'lease: the canceled backend holds no key lock');
	is(other_locks_of($wpid), '0', 'lease: nor any other lock');
	$w->quit;
}

# 2b. statement_timeout
{
	my ($w, $wpid) = waiter();
	$w->query_safe(q{SET statement_timeout = '300ms'});
	my $t0 = time;
	my $t = send_sql($w, q{SELECT outcome FROM idempotency.idem_acquire('cx-lease', '{"a": 1}')});
	my ($out, $err) = wait_done($w, $t);
	my $ms = (time - $t0) * 1000;
	like($err, qr/ERROR:\s+57014: canceling statement due to statement timeout/,
		'lease: statement_timeout interrupts the sleep (57014)');
	ok($ms >= 290 && $ms < 800 + $slack_ms, sprintf('lease: after %.1f ms', $ms));
	$figures{'statement_timeout 300ms, committed claim under lease'} = $ms;
	$w->quit;
}

is( $node->safe_psql('postgres',
		q{SELECT status, attempt, locked_until FROM idempotency.idem_lookup('cx-lease')}),
	$before, 'lease: the record is untouched by the canceled waiters');

foreach my $k (sort keys %figures)
{
	diag(sprintf('%s: %.1f ms', $k, $figures{$k}));
}

ok(!$node->log_contains(qr/terminated by signal|PANIC|TRAP:/), 'no backend crashed');
$holder->quit;
$ctl->quit;
$node->stop;
done_testing();
