# Copyright (c) idempotency authors
#
# Partition lifecycle on a cluster of its own: a real pg_cron run of the
# scheduled maintenance, maintenance under pgbench load, maintenance behind a
# long transaction, catch-up after maintenance was stopped for longer than
# max_ttl, and the schedule functions without pg_cron.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::RealBin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time usleep);

# The throwaway clusters listen on 127.0.0.1 only.
$PostgreSQL::Test::Cluster::use_tcp = 1;
$PostgreSQL::Test::Cluster::test_pghost = '127.0.0.1';

my $node = PostgreSQL::Test::Cluster->new('maintenance');
$node->init;
$node->append_conf(
	'postgresql.conf', q{
shared_preload_libraries = 'pg_cron'
cron.database_name = 'postgres'
cron.use_background_workers = on
max_worker_processes = 16
max_connections = 50
log_min_messages = log
});
$node->start;

# live_replays(DB, TABLE): retry every key of TABLE (key, expires_at, the
# records as they were made) with request {"n": 1}; return how many of
# them are still live once all the retries have run, and how many of those
# replayed a 201.  A record that expired meanwhile is claimed afresh, as it
# should be, and is left out of both.
sub live_replays
{
	my ($db, $table) = @_;
	return split /\|/, $node->safe_psql(
		$db, qq{
CREATE TEMP TABLE live_check AS
    SELECT k.expires_at, a.outcome, a.response_status
      FROM $table k, idempotency.idem_acquire(k.key, '{"n": 1}') a;
SELECT count(*),
       count(*) FILTER (WHERE outcome = 'replay' AND response_status = 201)
  FROM live_check WHERE expires_at > clock_timestamp()});
}

# ------------------------------------------------------------------
# A real pg_cron run.  Partitions of 10 s, records of 1 s (their partition
# ends within 20 s) and of 3 minutes (live long after the job has run).
# ------------------------------------------------------------------
$node->safe_psql(
	'postgres', q{
ALTER DATABASE postgres SET idempotency.partition_interval = '10s';
ALTER DATABASE postgres SET idempotency.max_ttl = '3min';
ALTER DATABASE postgres SET idempotency.default_ttl = '2min';
});
$node->safe_psql(
	'postgres', q{
CREATE EXTENSION pg_cron;
CREATE EXTENSION idempotency;
SELECT idempotency.idem_acquire('short-' || g, ttl => '1s') FROM generate_series(1, 20) g;
SELECT idempotency.idem_complete('short-' || g, 200) FROM generate_series(1, 20) g;
SELECT idempotency.idem_acquire('long-' || g, '{"n": 1}', ttl => '3min') FROM generate_series(1, 20) g;
SELECT idempotency.idem_complete('long-' || g, 201, '{"id": 1}') FROM generate_series(1, 20) g;
CREATE TABLE long_keys AS
    SELECT key, expires_at FROM idempotency.records WHERE key LIKE 'long-%';
});

my $short_parts = $node->safe_psql(
	'postgres', q{
SELECT string_agg(DISTINCT tableoid::regclass::text, ',')
  FROM idempotency.records WHERE key LIKE 'short-%'});
my $short_end = $node->safe_psql(
	'postgres', q{
SELECT max(p.range_end) FROM idempotency.partitions p
  JOIN (SELECT DISTINCT tableoid FROM idempotency.records WHERE key LIKE 'short-%') r
    ON r.tableoid = p.partition});

my $jobid = $node->safe_psql('postgres',
	q{SELECT idempotency.idem_schedule_maintenance('* * * * *')});
like($jobid, qr/^\d+$/, 'maintenance scheduled every minute');
is( $node->safe_psql(
		'postgres',
		q{SELECT count(*) FROM cron.job
		  WHERE jobname = 'idempotency-maintenance:postgres'
		    AND command = 'SELECT idempotency.idem_maintain()'
		    AND database = 'postgres'}),
	'1',
	'one job, named after the database, runs idem_maintain there');

# Wait for a run that started after the short records' partition ended.
ok( $node->poll_query_until(
		'postgres', qq{
SELECT EXISTS (SELECT FROM cron.job_run_details d
                WHERE d.jobid = $jobid AND d.status = 'succeeded'
                  AND d.start_time > '$short_end')}, 't'),
	'the scheduled job ran and succeeded');

is( $node->safe_psql(
		'postgres', qq{
SELECT count(*) FROM cron.job_run_details
 WHERE jobid = $jobid AND status <> 'succeeded'}),
	'0',
	'no failed runs in cron.job_run_details');

foreach my $part (split /,/, $short_parts)
{
	is($node->safe_psql('postgres', qq{SELECT to_regclass('$part') IS NULL}),
		't', "expired partition $part was dropped by the job");
}
# The check is on the records still live when it has run: the job runs
# on the minute, and on a slow machine the wait for it can outlast some of
# the 3-minute records (each then claimed afresh, as it should be).
my ($live, $replayed) = live_replays('postgres', 'long_keys');
cmp_ok($live, '>', 0, "records are still live after the job ($live of 20)");
is($replayed, $live, 'every one still live replays after the job');
is( $node->safe_psql(
		'postgres', q{
SELECT count(*) FROM idempotency.partitions
 WHERE NOT is_default AND range_end <= clock_timestamp() - interval '1 minute'}),
	'0',
	'no partition that ended before the last run is left');

is($node->safe_psql('postgres', q{SELECT idempotency.idem_unschedule_maintenance()}),
	't', 'unschedule removes the job');
is($node->safe_psql('postgres', q{SELECT idempotency.idem_unschedule_maintenance()}),
	'f', 'unschedule again finds none');

# ------------------------------------------------------------------
# Maintenance under load: pgbench clients claim and complete new keys while
# another session runs idem_maintain every 100 ms, with partitions of 1 s so
# that partitions are created and dropped throughout.
# ------------------------------------------------------------------
$node->safe_psql('postgres', 'CREATE DATABASE load');
$node->safe_psql(
	'load', q{
ALTER DATABASE load SET idempotency.partition_interval = '1s';
ALTER DATABASE load SET idempotency.max_ttl = '4s';
ALTER DATABASE load SET idempotency.default_ttl = '2s';
});
$node->safe_psql('load', 'CREATE EXTENSION idempotency');

my $load_secs = 8;
my $maint = $node->background_psql('load', on_error_stop => 0);
my $log_dir = PostgreSQL::Test::Utils::tempdir;
my $pgbench_script = "$log_dir/new_keys.sql";
open my $fh, '>', $pgbench_script or die $!;
# Every transaction claims a key of its own, which must be acquired: the
# division by zero makes any other outcome an error that aborts the client.
# The key is the transaction's id, unique by construction.  (Random keys
# repeated now and then within their 2 s ttl: the repeat replayed, the
# client aborted, and pgbench exited with status 2 while it reported 0
# failed transactions, since it counts only serialization and deadlock
# failures as failed transactions.)
print $fh q{BEGIN;
SELECT 1 / (outcome = 'acquired')::int FROM idempotency.idem_acquire('load-' || pg_current_xact_id(), '{"a": 1}');
SELECT idempotency.idem_complete('load-' || pg_current_xact_id(), 201, '{"id": 1}');
COMMIT;
};
close $fh;

# maintenance loop in the background session, one transaction per run as
# pg_cron would do it
$maint->query_safe('CREATE TEMP TABLE maint_runs (created int, dropped int)');
$maint->query_until(
	qr/started/, qq{
\\echo started
DO \$\$
BEGIN
    FOR i IN 1 .. $load_secs * 10 + 10 LOOP
        INSERT INTO maint_runs SELECT * FROM idempotency.idem_maintain();
        COMMIT;
        PERFORM pg_sleep(0.1);
    END LOOP;
END
\$\$;
});

my ($stdout, $stderr);
my $pgbench_ok = IPC::Run::run(
	[
		'pgbench', '-n', '-M', 'prepared', '-c', '4', '-j', '2',
		'-T', $load_secs, '-l', "--log-prefix=$log_dir/tx",
		'-h', $node->host, '-p', $node->port, '-f', $pgbench_script,
		'load'
	],
	'>', \$stdout, '2>', \$stderr);
ok($pgbench_ok, 'pgbench under maintenance exits cleanly')
  or diag("pgbench stderr:\n$stderr");
like($stdout, qr/number of failed transactions: 0 /,
	'no failed transaction while maintenance drops partitions');
my ($processed) = $stdout =~ /number of transactions actually processed: (\d+)/;
ok(defined $processed && $processed > 0, "transactions processed: "
	  . ($processed // 'none'));

# per-transaction latency, in microseconds, is the third field of the log
my ($max_us, $n, @lat) = (0, 0);
foreach my $f (glob("$log_dir/tx*"))
{
	open my $lf, '<', $f or die $!;
	while (<$lf>)
	{
		my @fields = split;
		push @lat, $fields[2];
		$max_us = $fields[2] if $fields[2] > $max_us;
	}
	close $lf;
}
@lat = sort { $a <=> $b } @lat;
my $p99 = @lat ? $lat[ int(0.99 * $#lat) ] : 0;
is(scalar(@lat), $processed, 'every transaction is in the latency log');

my ($created, $dropped) = split /\|/,
  $maint->query_safe('SELECT sum(created), sum(dropped) FROM maint_runs');
$maint->quit;
cmp_ok($dropped, '>', 0, "maintenance dropped partitions during the load ($dropped)");
cmp_ok($created, '>', 0, "maintenance created partitions during the load ($created)");
diag(sprintf(
		'under load: %d transactions, acquire+complete latency p99 %.2f ms, max %.2f ms; maintenance created %d and dropped %d partitions',
		$processed, $p99 / 1000, $max_us / 1000, $created, $dropped));

# ------------------------------------------------------------------
# Behind a long transaction: maintenance waits maintenance_lock_timeout,
# logs, and leaves the work for later.
# ------------------------------------------------------------------
$node->safe_psql('load', 'SELECT pg_sleep(1.1)');    # a partition has ended
my $holder = $node->background_psql('load');
$holder->query_safe('BEGIN');
$holder->query_safe('SELECT count(*) FROM idempotency.records');
# what a psql call costs on this machine now, without any lock to wait for
my $t0 = time;
$node->safe_psql('load', 'SELECT count(*) FROM idempotency.partitions');
my $psql_ms = (time - $t0) * 1000;
my $log_offset = -s $node->logfile;
$t0 = time;
my $res = $node->safe_psql('load', 'SELECT * FROM idempotency.idem_maintain()');
my $waited_ms = (time - $t0) * 1000;
is($res, '0|0', 'maintenance behind a long transaction gives up without error');
cmp_ok($waited_ms, '<', 1000 + 2 * $psql_ms,
	sprintf('and returns in %.0f ms (a psql call takes %.0f ms)', $waited_ms, $psql_ms));
ok($node->log_contains(qr/idempotency maintenance could not lock table/, $log_offset),
	'and logs that it left the work to its next run');
diag(sprintf('maintenance behind a long transaction returned after %.0f ms (maintenance_lock_timeout 100ms)', $waited_ms));
$holder->query_safe('COMMIT');
$holder->quit;
like($node->safe_psql('load', 'SELECT partitions_dropped FROM idempotency.idem_maintain()'),
	qr/^[1-9]/, 'the next run does the work');

# ------------------------------------------------------------------
# Catch-up: maintenance stopped for longer than max_ttl.  Claims go on (into
# DEFAULT); the next run moves the live ones to proper partitions, drops
# what expired, and loses nothing.
#
# The records' ttl (and max_ttl) is 3 s, or 4 times what the same steps
# (claims, completions, a maintenance run, replays) took just before, in
# database load, where that is longer: the records must outlive the steps
# between their claim and their replay.
# ------------------------------------------------------------------
$t0 = time;
$node->safe_psql('load',
	q{SELECT count(*) FROM generate_series(1, 50) g, idempotency.idem_acquire('calib-' || g, '{"n": 1}') a});
$node->safe_psql('load',
	q{SELECT idempotency.idem_complete('calib-' || g, 201, '{"ok": true}') FROM generate_series(1, 50) g});
$node->safe_psql('load', 'SELECT count(*) FROM idempotency.records_default');
$node->safe_psql('load', 'SELECT clock_timestamp()');
$node->safe_psql('load', 'SELECT * FROM idempotency.idem_maintain()');
$node->safe_psql('load', 'SELECT count(*) FROM idempotency.records_default');
$node->safe_psql('load',
	q{SELECT count(*) FROM generate_series(1, 50) g, idempotency.idem_acquire('calib-' || g, '{"n": 1}') a});
my $steps_secs = time - $t0;
my $ttl = window_secs($steps_secs, 4, 3);
note sprintf('catch-up: the steps took %.1f s; records of %d s', $steps_secs, $ttl);
$node->safe_psql('postgres', 'CREATE DATABASE catchup');
$node->safe_psql(
	'catchup', qq{
ALTER DATABASE catchup SET idempotency.partition_interval = '1s';
ALTER DATABASE catchup SET idempotency.max_ttl = '${ttl}s';
ALTER DATABASE catchup SET idempotency.default_ttl = '${ttl}s';
});
$node->safe_psql('catchup', 'CREATE EXTENSION idempotency');
$node->safe_psql('catchup', 'SELECT pg_sleep(' . 2 * $ttl . ')');    # every partition has ended
is( $node->safe_psql(
		'catchup', q{
SELECT count(*) FROM idempotency.partitions
 WHERE NOT is_default AND range_end > clock_timestamp()}),
	'0',
	'no live partition is left after the pause');
is( $node->safe_psql(
		'catchup', qq{
SELECT count(*) FILTER (WHERE a.outcome = 'acquired')
  FROM generate_series(1, 50) g, idempotency.idem_acquire('c-' || g, '{"n": 1}', ttl => '${ttl}s') a}),
	'50',
	'claims still succeed with no partition for them');
$node->safe_psql('catchup',
	q{SELECT idempotency.idem_complete('c-' || g, 201, '{"ok": true}') FROM generate_series(1, 50) g});
is($node->safe_psql('catchup', 'SELECT count(*) FROM idempotency.records_default'),
	'50', 'they wait in the DEFAULT partition');
$node->safe_psql('catchup',
	'CREATE TABLE c_keys AS SELECT key, expires_at FROM idempotency.records_default');

my $before_run = $node->safe_psql('catchup', 'SELECT clock_timestamp()');
$res = $node->safe_psql('catchup', 'SELECT * FROM idempotency.idem_maintain()');
my ($c_created, $c_dropped) = split /\|/, $res;
cmp_ok($c_created, '>', 0, "catch-up created partitions ($c_created)");
cmp_ok($c_dropped, '>', 0, "catch-up dropped the ended partitions ($c_dropped)");
is($node->safe_psql('catchup', 'SELECT count(*) FROM idempotency.records_default'),
	'0', 'DEFAULT is empty after catch-up');
# on the records still live once the replays have run (all 50 unless the
# machine slowed down further since the steps were measured)
($live, $replayed) = live_replays('catchup', 'c_keys');
cmp_ok($live, '>', 0, "records are still live after catch-up ($live of 50)");
is($replayed, $live, 'every live record survived catch-up and replays');
is( $node->safe_psql(
		'catchup', qq{
SELECT count(*) FROM idempotency.partitions
 WHERE NOT is_default AND range_end <= '$before_run'}),
	'0',
	'no partition that had ended before the run is left');

# ------------------------------------------------------------------
# Without pg_cron preloaded: the extension works, scheduling says how.
# ------------------------------------------------------------------
$node->stop;
$node->adjust_conf('postgresql.conf', 'shared_preload_libraries', "''");
$node->adjust_conf('postgresql.conf', 'cron.database_name', undef);
$node->adjust_conf('postgresql.conf', 'cron.use_background_workers', undef);
$node->start;
$node->safe_psql('postgres', 'CREATE DATABASE nocron');
$node->safe_psql('nocron', 'CREATE EXTENSION idempotency');
is($node->safe_psql('nocron', q{SELECT outcome FROM idempotency.idem_acquire('k')}),
	'acquired', 'CREATE EXTENSION and idem_acquire work without pg_cron');
my ($ret, $out, $err) = $node->psql('nocron',
	q{\set VERBOSITY verbose
SELECT idempotency.idem_schedule_maintenance()});
like($err, qr/ERROR:\s+55000: pg_cron is not loaded/, 'scheduling without pg_cron: 55000');
like($err, qr/HINT:.*shared_preload_libraries/, 'with a hint on how to install and preload it');
($ret, $out, $err) = $node->psql('nocron',
	q{\set VERBOSITY verbose
SELECT idempotency.idem_unschedule_maintenance()});
like($err, qr/ERROR:\s+55000: pg_cron is not loaded/, 'unscheduling without pg_cron: 55000');

$node->stop;
done_testing();
