# Copyright (c) idempotency authors
#
# Crash: pgbench clients run acquire -> business INSERT -> complete, each in
# one transaction on keys of their own, while the server dies under them:
#   round 1: SIGKILL to one of their backends (the postmaster then kills the
#            others and runs crash recovery: restart_after_crash = on);
#   round 2: pg_ctl stop -m immediate, then a start (crash recovery again).
# After each restart:
#   - every transaction pgbench saw committed is there, with its record
#     completed, and nothing else is: a record is completed exactly when its
#     business row exists;
#   - retrying every key attempted gives replay for those committed and
#     acquired for the one a client had in flight (then done once);
#   - the business table never holds two rows for one key.
#
# Keys.  Each client numbers its transactions with a per-client counter row
# updated in the same transaction (so a rolled-back or lost transaction
# leaves the number free for the next one): client c's committed keys are
# exactly "c<c>-1" .. "c<c>-<n>" where n is the counter after the restart,
# and the key it had in flight, if any, is "c<c>-<n+1>".  pgbench's log (-l)
# has one line per transaction it saw commit, so the keys pgbench saw
# committed are "c<c>-1" .. "c<c>-<lines of client c>", which must be at most
# n and at least n - 1 (at most one commit per client can have reached the
# disk without its answer reaching pgbench).
#
# The business table deliberately has no unique index on the idempotency
# key (its primary key is a serial): a duplicate would be stored and counted,
# not refused by the table.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::RealBin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time usleep);

my $clients = 6;
my $crash_after = 2;    # seconds of load before each crash

my $node = idem_node(
	'crash', q{
restart_after_crash = on
log_statement = none
synchronous_commit = on
});

$node->safe_psql(
	'postgres', qq{
CREATE TABLE biz (
    id      bigserial PRIMARY KEY,
    key     text NOT NULL,
    client  int NOT NULL,
    seq     int NOT NULL,
    amount  int NOT NULL
);
CREATE INDEX ON biz (key);
CREATE TABLE counters (client int PRIMARY KEY, n int NOT NULL);
INSERT INTO counters SELECT g, 0 FROM generate_series(0, $clients - 1) g;

-- the retry an application makes after the crash: one transaction per key
CREATE TABLE retries (key text, outcome text, status int, body jsonb);
CREATE PROCEDURE retry_all() LANGUAGE plpgsql AS \$\$
DECLARE
    c record;
    k text;
    a record;
BEGIN
    FOR c IN SELECT client, n FROM counters ORDER BY client LOOP
        FOR i IN 1 .. c.n + 1 LOOP
            k := 'c' || c.client || '-' || i;
            SELECT * INTO a FROM idempotency.idem_acquire(k, '{"op": "pay"}');
            IF a.outcome = 'acquired' THEN
                INSERT INTO biz (key, client, seq, amount) VALUES (k, c.client, i, 100);
                PERFORM idempotency.idem_complete(k, 201, jsonb_build_object('key', k));
            END IF;
            INSERT INTO retries VALUES (k, a.outcome, a.response_status, a.response_body);
            COMMIT;
        END LOOP;
    END LOOP;
END
\$\$;
});

my $tmp = PostgreSQL::Test::Utils::tempdir;
my $script = "$tmp/pay.sql";
open my $fh, '>', $script or die $!;
print $fh q{BEGIN;
UPDATE counters SET n = n + 1 WHERE client = :client_id RETURNING n AS seq \gset
SELECT 1 / (outcome = 'acquired')::int AS must_be_acquired FROM idempotency.idem_acquire('c' || :client_id || '-' || :seq, '{"op": "pay"}');
INSERT INTO biz (key, client, seq, amount) VALUES ('c' || :client_id || '-' || :seq, :client_id, :seq, 100);
SELECT idempotency.idem_complete('c' || :client_id || '-' || :seq, 201, jsonb_build_object('key', 'c' || :client_id || '-' || :seq));
COMMIT;
};
close $fh;

sub counters
{
	my %n = map { split /\|/ } split /\n/,
	  $node->safe_psql('postgres', 'SELECT client, n FROM counters');
	return \%n;
}

# one round: load, crash with $how, restart, check; returns the figures
sub crash_round
{
	my ($round, $how) = @_;
	my $before = counters();
	my $prefix = "$tmp/round$round";
	my ($out, $err) = ('', '');
	my $t0 = time;
	local $ENV{PGAPPNAME} = 'pgbench_crash';
	my $h = IPC::Run::start(
		[
			'pgbench', '-n', '-M', 'prepared', '-c', $clients, '-j', '2',
			'-T', '60', '-l', "--log-prefix=$prefix",
			'-h', $node->host, '-p', $node->port, '-f', $script, 'postgres'
		],
		'>', \$out, '2>', \$err);

	# let the load run, then crash
	usleep(100_000) while time - $t0 < $crash_after;
	my $rows_seen = $node->safe_psql('postgres', 'SELECT count(*) FROM biz');
	if ($how eq 'kill9-backend')
	{
		# Not the backend of this very query: PGAPPNAME, set above for
		# pgbench, names it too, and it has exited (a zombie that kill still
		# signals) by the time the kill is sent; picking it once in nine
		# left the server running.
		my $pid = $node->safe_psql(
			'postgres', q{
SELECT pid FROM pg_stat_activity
 WHERE application_name = 'pgbench_crash' AND backend_type = 'client backend'
   AND pid <> pg_backend_pid()
 ORDER BY random() LIMIT 1});
		ok($pid =~ /^\d+$/, "round $round: a pgbench backend to kill ($pid)");
		my $log_offset = -s $node->logfile;
		ok(kill('KILL', $pid), "round $round: kill -9 $pid sent") or diag("kill: $!");
		# the postmaster kills the rest and runs crash recovery: wait for the
		# reset before asking whether the server is back
		my $deadline = time + 60;
		usleep(50_000)
		  until $node->log_contains(qr/all server processes terminated; reinitializing/, $log_offset)
		  || time > $deadline;
		ok(poll_query_back($node, 'postgres', 'SELECT NOT pg_is_in_recovery()', 't'),
			"round $round: the server is back after the crash of backend $pid");
		# "server process (PID n)" up to 17, "client backend (PID n)" from 18
		ok($node->log_contains(qr/ \(PID $pid\) was terminated by signal 9/),
			"round $round: the postmaster saw backend $pid die");
	}
	else
	{
		$node->stop('immediate');
		$node->start;
	}
	$h->finish;
	my $secs = time - $t0;

	unlike($err, qr/division by zero|must_be_acquired/,
		"round $round: every pgbench transaction got acquired for its new key");
	like($err, qr/(server closed the connection|terminat|connection to server|could not receive)/i,
		"round $round: pgbench lost its connections in the crash");

	# what pgbench saw committed: one numeric log line per transaction
	my %acked = map { $_ => 0 } 0 .. $clients - 1;
	foreach my $f (glob("$prefix*"))
	{
		open my $lf, '<', $f or die $!;
		while (<$lf>)
		{
			my @fields = split;
			$acked{ $fields[0] }++ if $fields[2] =~ /^\d+$/;
		}
		close $lf;
	}
	my $acked = 0;
	$acked += $_ foreach values %acked;
	my ($pgbench_processed) = $out =~ /number of transactions actually processed: (\d+)/;
	diag("round $round: pgbench reports " . ($pgbench_processed // 'no count') .
		  " transactions processed; its log has $acked")
	  if !defined $pgbench_processed || $pgbench_processed != $acked;

	my $after = counters();
	my ($committed, $bad_clients) = (0, '');
	foreach my $c (0 .. $clients - 1)
	{
		my $delta = $after->{$c} - $before->{$c};
		$committed += $delta;
		$bad_clients .= " c$c(acked $acked{$c}, committed $delta)"
		  unless $delta >= $acked{$c} && $delta <= $acked{$c} + 1;
	}
	is($bad_clients, '',
		"round $round: per client, every acknowledged transaction committed, and at most one more");

	# the business table and the records agree, key by key
	my $check = $node->safe_psql(
		'postgres', q{
WITH expected AS (
    SELECT 'c' || c.client || '-' || g AS key
      FROM counters c, generate_series(1, c.n) g),
rec AS (
    SELECT r.key, r.status, r.response_status, r.response_body
      FROM idempotency.records r
     WHERE r.scope = '' AND r.expires_at > clock_timestamp())
SELECT (SELECT count(*) FROM biz),
       (SELECT count(*) FROM expected e WHERE NOT EXISTS (SELECT FROM biz b WHERE b.key = e.key)),
       (SELECT count(*) FROM biz b WHERE NOT EXISTS (SELECT FROM expected e WHERE e.key = b.key)),
       (SELECT count(*) FROM (SELECT key FROM biz GROUP BY key HAVING count(*) > 1) d),
       (SELECT count(*) FROM biz b WHERE NOT EXISTS (
            SELECT FROM rec WHERE rec.key = b.key AND rec.status = 'completed'
               AND rec.response_status = 201 AND rec.response_body = jsonb_build_object('key', b.key))),
       (SELECT count(*) FROM rec WHERE NOT EXISTS (SELECT FROM biz b WHERE b.key = rec.key)),
       (SELECT count(*) FROM rec WHERE status <> 'completed'),
       (SELECT count(*) FROM (SELECT key FROM rec GROUP BY key HAVING count(*) > 1) d)
});
	my ($found, $missing, $extra, $dups, $biz_no_rec, $rec_no_biz, $processing, $rec_dups) =
	  split /\|/, $check;
	is($missing, 0, "round $round: no committed key lacks its business row");
	is($extra, 0, "round $round: no business row outside the committed keys");
	is($dups, 0, "round $round: no key has two business rows");
	is($biz_no_rec, 0, "round $round: every business row has its completed record (201, its body)");
	is($rec_no_biz, 0, "round $round: no record without its business row");
	is($processing, 0, "round $round: no record left processing");
	is($rec_dups, 0, "round $round: at most one live record per key");

	# the application's retry of every key attempted: replay or acquired
	$node->safe_psql('postgres', 'TRUNCATE retries; CALL retry_all()');
	my ($replays, $good_replays, $acquired, $other) = split /\|/,
	  $node->safe_psql(
		'postgres', q{
SELECT count(*) FILTER (WHERE outcome = 'replay'),
       count(*) FILTER (WHERE outcome = 'replay' AND status = 201 AND body = jsonb_build_object('key', key)),
       count(*) FILTER (WHERE outcome = 'acquired'),
       count(*) FILTER (WHERE outcome NOT IN ('replay', 'acquired'))
  FROM retries});
	my $total_committed = 0;
	$total_committed += $after->{$_} foreach keys %$after;
	is($replays, $total_committed, "round $round: retrying each committed key gives replay ($replays)");
	is($good_replays, $replays, "round $round: each replay returns the stored 201 and body");
	is($acquired, $clients,
		"round $round: retrying each client's next key gives acquired ($acquired), then done once");
	is($other, 0, "round $round: no other outcome on retry");
	$node->safe_psql('postgres', 'UPDATE counters SET n = n + 1');    # the retries' keys are done

	# a second retry of everything: all replay, still no duplicates
	$node->safe_psql('postgres', 'TRUNCATE retries; CALL retry_all()');
	my $second = $node->safe_psql(
		'postgres', q{
SELECT count(*) FILTER (WHERE outcome <> 'replay') AS non_replay,
       (SELECT count(*) FROM (SELECT key FROM biz GROUP BY key HAVING count(*) > 1) d)
  FROM retries});
	# retry_all also tries each client's next, never-used key: that one is acquired
	$node->safe_psql('postgres', 'UPDATE counters SET n = n + 1');
	my ($non_replay, $dups2) = split /\|/, $second;
	is($non_replay, $clients,
		"round $round: a second retry replays every done key (only each client's next, unused key is acquired)");
	is($dups2, 0, "round $round: still no key with two business rows");

	diag(sprintf(
			'round %d (%s): %d transactions acknowledged to pgbench before the crash (%.1f s of load, %d rows seen at the crash), %d committed found after restart (%d committed but unacknowledged), %d duplicates; retry of every key so far: %d replay, %d acquired (each client\'s next key)',
			$round, $how, $acked, $secs, $rows_seen, $committed,
			$committed - $acked, $dups, $replays, $acquired));
	return ($acked, $committed, $dups);
}

my @r1 = crash_round(1, 'kill9-backend');
my @r2 = crash_round(2, 'stop-immediate');
cmp_ok($r1[0] + $r2[0], '>', 0, 'pgbench committed transactions before the crashes');

ok($node->safe_psql('postgres', 'SELECT 1') eq '1', 'node up at the end');
$node->stop;
done_testing();
