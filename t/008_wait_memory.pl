# Copyright (c) idempotency authors
#
# Memory of a long wait.  A duplicate of a committed processing claim (lease
# mode) polls the record every 50 ms for up to idempotency.wait_timeout,
# which any user may raise.  Each poll reads the live partitions, so with
# many of them a poll that kept what it allocated would grow the backend by
# kilobytes each time.  The waiting backend's memory is sampled twice during
# one wait with pg_log_backend_memory_contexts(), and the two "Grand total"
# lines it writes to the server log must agree within a small margin.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::RealBin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time usleep);

# Hourly partitions over a 7-day max_ttl: about 170 live partitions, as in
# the review that found the growth.
my $node = idem_node(
	'wait_memory', q{
idempotency.partition_interval = '1h'
idempotency.max_ttl = '7d'
});

my $nparts = $node->safe_psql('postgres',
	q{SELECT count(*) FROM idempotency.partitions WHERE NOT is_default});
cmp_ok($nparts, '>', 150, "many partitions to read at every poll ($nparts)");

# A claim committed as processing, with a lease longer than the test.
is( $node->safe_psql(
		'postgres',
		q{SELECT outcome FROM idempotency.idem_acquire('held', '{"a": 1}', lease => '1 hour')}),
	'acquired',
	'a lease-mode claim is committed');

# A duplicate that waits for it for 14 s, or longer on a slow machine (below).
my $waiter = $node->background_psql('postgres');
my $pid = $waiter->query_safe('SELECT pg_backend_pid()');

# memory_total(): ask the waiter to log its memory contexts, and return the
# bytes of its "Grand total" line.
sub memory_total
{
	my $offset = -s $node->logfile;
	$node->safe_psql('postgres', "SELECT pg_log_backend_memory_contexts($pid)");
	my $deadline = time + 10;
	while (time < $deadline)
	{
		my $log = slurp_file($node->logfile, $offset);
		return $1 if $log =~ /\[$pid\][^\n]*LOG:\s+Grand total: (\d+) bytes/;
		usleep(20_000);
	}
	return undef;
}

# The two samples are taken 2 s and 10 s into the wait, each of them a
# memory_total(): the wait lasts 14 s, or 10 s plus 4 times what a sample of
# the idle waiter takes now (the most of three) where that is longer.  A
# sample can still take far longer on a loaded machine (seen once: 29.8 s
# for both): then the samples did not both fall within the wait, and the
# wait is run again, twice as long, up to three times.  The state waited
# for is "both samples inside one wait", not a wall-clock window.
my $sample_secs = 0;
for (1 .. 3)
{
	my $t = time;
	defined memory_total() or die 'the idle waiter did not log its memory';
	$sample_secs = time - $t if time - $t > $sample_secs;
}
my $wait_secs = window_secs(10 + 4 * $sample_secs, 1, 14);
my ($first, $second, $elapsed, $within, $answer);
for my $try (1 .. 3)
{
	note sprintf('try %d: a sample takes %.2f s: a wait of %d s', $try, $sample_secs, $wait_secs);
	$waiter->query_safe(qq{SET idempotency.wait_timeout = '${wait_secs}s'});
	my $t0 = time;
	$waiter->query_until(
		qr/waiting/, q{\echo waiting
SELECT outcome FROM idempotency.idem_acquire('held', '{"a": 1}');
});
	$node->poll_query_until(
		'postgres',
		qq{SELECT wait_event_type = 'Extension' FROM pg_stat_activity WHERE pid = $pid})
	  or die 'the duplicate never polled';

	# Sample once the polls have reached their longest step, and again
	# 8 s (some 160 polls) later.
	usleep(int(1_000_000 * (2 - (time - $t0)))) if time - $t0 < 2;
	$first = memory_total();
	usleep(8_000_000);
	$second = memory_total();
	$elapsed = time - $t0;
	# the wait ends (in_progress) whether or not the samples fit in it
	$answer = $waiter->query_safe(q{SELECT 'after'});
	$within = defined $first && defined $second && $elapsed < $wait_secs;
	last if $within;
	note sprintf('try %d: the samples took until %.1f s of a %d s wait: again, longer', $try, $elapsed, $wait_secs);
	$wait_secs *= 2;
}
ok(defined $first && defined $second, 'the waiter logged its memory twice during the wait');
ok($within,
	sprintf('both samples were taken within one wait (%.1f s of %d s)', $elapsed, $wait_secs));

my $growth = ($second // 0) - ($first // 0);
cmp_ok($growth, '<', 64 * 1024,
	sprintf('memory stays flat during the wait: %d bytes, then %d bytes (%+d)',
		$first // -1, $second // -1, $growth));
diag(sprintf('waiting backend, %d partitions: %d bytes after 2 s, %d bytes after 10 s (%+d)',
		$nparts, $first // -1, $second // -1, $growth));

# The wait still ends as it should, and so does the session.
like($answer, qr/^in_progress\nafter$/,
	'the duplicate answers in_progress at the end of wait_timeout');
$waiter->quit;

$node->stop;
done_testing();
