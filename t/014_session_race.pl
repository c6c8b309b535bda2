# Copyright (c) idempotency authors
#
# 8 clients race on 4 keys with session-bound claims whose owners die at
# random: pgbench -C opens a new connection for every transaction, so each
# owner lives from its acquire to the end of its script (a random sleep of up
# to 30 ms, and one time in 150 a complete with its claim), then disconnects.
# Every acquire and every owner's last moment are logged, and afterwards:
#   - never two acquired for one attempt of a key, and the attempts of a key
#     run 1, 2, 3, ... (no claim lost);
#   - every takeover (attempt n + 1) came after the owner of attempt n had
#     logged its last statement, i.e. was no longer working: never two live
#     owners of one key;
#   - each key's record is at its last logged attempt, completed exactly by
#     the owner that held it;
#   - no client got an error (a complete with its own claim never got 55000).

use strict;
use warnings;

use FindBin;
use lib "$FindBin::RealBin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node = idem_node('race', "log_statement = none\nmax_connections = 50\n");

$node->safe_psql(
	'postgres', q{
CREATE TABLE public.race_acquired (k int, outcome text, attempt int, claim uuid,
                                   pid int, bstart timestamptz, t timestamptz);
CREATE TABLE public.race_end (pid int, bstart timestamptz, t timestamptz, completed boolean);
});

my $script = $node->basedir . '/race.pgbench';
open my $fh, '>', $script or die $!;
print $fh q{
\set k random(1, 4)
\set c random(1, 150)
SET idempotency.wait_timeout = '20ms';
INSERT INTO public.race_acquired
SELECT :k, a.outcome, a.attempt, a.claim, pg_backend_pid(),
       (SELECT backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()), clock_timestamp()
  FROM idempotency.idem_acquire('race-' || :k, ttl => '1 hour', lease => '1 hour', session_bound => true) a;
SELECT pg_sleep(random() * 0.03);
SELECT idempotency.idem_complete('race-' || :k, 200, '{"done": true}', claim => r.claim)
  FROM public.race_acquired r
 WHERE :c = 1 AND r.outcome = 'acquired' AND r.pid = pg_backend_pid()
   AND r.bstart = (SELECT backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid());
INSERT INTO public.race_end
SELECT pg_backend_pid(), (SELECT backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()),
       clock_timestamp(), :c = 1;
};
close $fh;

my ($stdout, $stderr);
my $ok = IPC::Run::run(
	[
		'pgbench', '-n', '-C', '-c', '8', '-j', '8', '-T', '10',
		'-h', $node->host, '-p', $node->port, '-f', $script, 'postgres'
	],
	'>', \$stdout, '2>', \$stderr);
ok($ok, 'pgbench ran 8 clients for 10 s with no client error') or diag($stderr);
like($stdout, qr/number of failed transactions: 0 /, 'pgbench reported no failed transaction');
diag(($stdout =~ /(number of transactions actually processed: \d+)/)[0] // $stdout);

my $stats = $node->safe_psql('postgres',
	q{SELECT count(*) FILTER (WHERE outcome = 'acquired'),
	         count(*) FILTER (WHERE outcome = 'acquired' AND attempt > 1),
	         count(*) FILTER (WHERE outcome = 'in_progress'),
	         count(*) FILTER (WHERE outcome = 'replay')
	    FROM public.race_acquired});
my ($acquired, $takeovers, $in_progress, $replays) = split /\|/, $stats;
diag("acquired $acquired (takeovers $takeovers), in_progress $in_progress, replay $replays");
ok($takeovers >= 20, "many takeovers of dead owners' claims ($takeovers)");
ok($in_progress >= 20, "many duplicates found a live owner ($in_progress)");

is( $node->safe_psql('postgres',
		q{SELECT count(*) FROM (SELECT k, attempt FROM public.race_acquired WHERE outcome = 'acquired'
		                        GROUP BY k, attempt HAVING count(*) > 1) d}),
	'0', 'never two acquired for one attempt of a key');
is( $node->safe_psql('postgres',
		q{SELECT count(*) FROM (SELECT k FROM public.race_acquired WHERE outcome = 'acquired'
		                        GROUP BY k HAVING max(attempt) <> count(*) OR min(attempt) <> 1) d}),
	'0', 'the attempts of every key run 1, 2, 3, ... (no claim lost)');
is( $node->safe_psql('postgres',
		q{SELECT count(*) FROM public.race_acquired n
		    JOIN public.race_acquired p ON p.k = n.k AND p.attempt = n.attempt - 1 AND p.outcome = 'acquired'
		    LEFT JOIN public.race_end e ON e.pid = p.pid AND e.bstart = p.bstart
		   WHERE n.outcome = 'acquired' AND (e.t IS NULL OR e.t >= n.t)}),
	'0', 'every takeover came after the previous owner\'s last statement');
is( $node->safe_psql('postgres',
		q{SELECT count(*) FROM generate_series(1, 4) k
		    LEFT JOIN LATERAL idempotency.idem_lookup('race-' || k) l ON true
		    LEFT JOIN LATERAL (SELECT max(attempt) AS attempt FROM public.race_acquired r
		                        WHERE r.k = k.k AND r.outcome = 'acquired') m ON true
		   WHERE l.attempt IS DISTINCT FROM m.attempt}),
	'0', 'every key\'s record is at its last acquired attempt');
is( $node->safe_psql('postgres',
		q{SELECT count(*) FROM generate_series(1, 4) k
		    JOIN LATERAL idempotency.idem_lookup('race-' || k) l ON true
		    JOIN public.race_acquired r ON r.k = k.k AND r.outcome = 'acquired' AND r.attempt = l.attempt
		    JOIN public.race_end e ON e.pid = r.pid AND e.bstart = r.bstart
		   WHERE (l.status = 'completed') <> e.completed}),
	'0', 'a key is completed exactly when the owner of its last attempt completed it');

$node->stop;
done_testing();
