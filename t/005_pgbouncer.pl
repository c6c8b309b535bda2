# Copyright (c) idempotency authors
#
# Through pgbouncer in transaction pooling mode, with the extended protocol
# (pgbench -M extended: unnamed statements, which pgbouncer 1.18 passes in
# transaction mode), every outcome behaves as it does direct, and nothing
# relies on session state: settings are given with SET LOCAL inside the
# transaction, and a lease-mode claim is completed from whatever server
# connection the pooler hands out.
#
#   1. A scenario script (acquired, replay, mismatch, in_progress, lease
#      takeover, complete, release, lookup, request hash, the errors 55000,
#      P0002, 22023) runs once through pgbouncer and once direct, on keys of
#      its own; each step records its answer in a table.  The two runs must
#      give the same answers, and the answers the contract gives.
#   2. Load: 8 pgbench clients on 2 server connections claim and complete
#      keys drawn from a small set (so duplicates meet and wait); each client
#      lands on several server connections; no key is done twice, and every
#      done key has its completed record.
#
# pgbouncer (Debian package pgbouncer) is started by the test on a free port
# of 127.0.0.1, as the OS user running the test, and stopped at the end.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::RealBin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time usleep);

my ($pgbouncer) = grep { -x $_ } ((map { "$_/pgbouncer" } split /:/, ($ENV{PATH} // '')),
	'/usr/sbin/pgbouncer', '/usr/bin/pgbouncer');
plan skip_all => 'pgbouncer is not installed (Debian: apt-get install pgbouncer)'
  unless $pgbouncer;

my $node = idem_node('bouncer', "log_statement = none\n");
my $user = $node->safe_psql('postgres', 'SELECT current_user');
my $pool_size = 2;

# ---------------------------------------------------------------------
# pgbouncer
# ---------------------------------------------------------------------
my $dir = PostgreSQL::Test::Utils::tempdir;
my $bport = PostgreSQL::Test::Cluster::get_free_port();
open my $ul, '>', "$dir/userlist.txt" or die $!;
print $ul qq{"$user" ""\n};
close $ul;
open my $cf, '>', "$dir/pgbouncer.ini" or die $!;
print $cf sprintf(q{[databases]
postgres = host=127.0.0.1 port=%d dbname=postgres

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
unix_socket_dir =
auth_type = trust
auth_file = %s/userlist.txt
admin_users = %s
pool_mode = transaction
default_pool_size = %d
min_pool_size = 0
reserve_pool_size = 0
max_client_conn = 100
server_reset_query =
ignore_startup_parameters = extra_float_digits
logfile = %s/pgbouncer.log
pidfile = %s/pgbouncer.pid
}, $node->port, $bport, $dir, $user, $pool_size, $dir, $dir);
close $cf;

my ($b_out, $b_err) = ('', '');
my $bouncer = IPC::Run::start([ $pgbouncer, "$dir/pgbouncer.ini" ],
	'>', \$b_out, '2>', \$b_err);
END
{
	# never leave pgbouncer running, whatever happened
	if ($bouncer && $bouncer->pumpable)
	{
		$bouncer->signal('TERM');
		eval { $bouncer->finish };
	}
}

# wait until it answers
my $up = 0;
for (1 .. 100)
{
	my ($ret, $out) = run_psql_bouncer('pgbouncer', 'SHOW VERSION');
	if ($ret == 0) { $up = 1; last; }
	usleep(100_000);
}
ok($up, "pgbouncer is up on 127.0.0.1:$bport")
  or BAIL_OUT("pgbouncer did not start: $b_err " . slurp_file("$dir/pgbouncer.log"));

sub run_psql_bouncer
{
	my ($db, $sql) = @_;
	my ($out, $err) = ('', '');
	my $ok = IPC::Run::run(
		[ 'psql', '-XAtq', '-h', '127.0.0.1', '-p', $bport, '-U', $user, '-d', $db, '-c', $sql ],
		'>', \$out, '2>', \$err);
	chomp $out;
	return ($ok ? 0 : 1, $out, $err);
}

my (undef, $databases) = run_psql_bouncer('pgbouncer', 'SHOW DATABASES');
like($databases, qr/^postgres\|127\.0\.0\.1\|\d+\|postgres\|/m,
	'pgbouncer serves database postgres from the node');
my (undef, $config) = run_psql_bouncer('pgbouncer', 'SHOW CONFIG');
like($config, qr/^pool_mode\|transaction\|/m, 'in transaction pooling mode');

# ---------------------------------------------------------------------
# 1. the scenario, through pgbouncer and direct
# ---------------------------------------------------------------------
$node->safe_psql(
	'postgres', q{
CREATE TABLE px_results (run text, step int, result text, backend int);
CREATE TABLE biz (id bigserial PRIMARY KEY, key text NOT NULL, client int, backend int);
} . sql_fixture('sqlstate_of.sql'));

# step NUM SQL: record SQL's one-row, one-column answer as step NUM
my (@steps, @step_sql);
my $n = 0;
sub step
{
	my ($sql) = @_;
	$n++;
	push @step_sql, $sql;
	push @steps,
	  "INSERT INTO px_results SELECT (:run)::text, $n, ($sql), pg_backend_pid();";
}
sub raw { push @steps, @_; }

my $A = q{concat_ws('|', a.outcome, a.attempt, a.response_status, a.response_body)};
my $L = q{concat_ws('|', l.status, l.attempt, l.response_status, l.response_body, l.completed_at IS NOT NULL)};

# the in-transaction flow: acquire, business row, complete, commit
raw('BEGIN;');
step(qq{SELECT $A FROM idempotency.idem_acquire((:run)::text || '-k1', '{"amount": 100}') a});
raw(q{INSERT INTO biz (key) VALUES ((:run)::text || '-k1');});
step(q{SELECT idempotency.idem_complete((:run)::text || '-k1', 201, '{"id": 1}')::text});
raw('COMMIT;');
step(qq{SELECT $A FROM idempotency.idem_acquire((:run)::text || '-k1', '{"amount": 100}') a});    # replay
step(qq{SELECT $A FROM idempotency.idem_acquire((:run)::text || '-k1', '{ "amount" : 100 }') a}); # replay
step(qq{SELECT $A FROM idempotency.idem_acquire((:run)::text || '-k1', '{"amount": 200}') a});    # mismatch
step(qq{SELECT $A FROM idempotency.idem_acquire((:run)::text || '-k1') a});                       # replay
step(qq{SELECT $L FROM idempotency.idem_lookup((:run)::text || '-k1') l});
step(q{SELECT idempotency.idem_complete((:run)::text || '-k1', 500, '{"id": 2}')::text});         # false
step(q{SELECT idempotency.idem_release((:run)::text || '-k1')::text});                            # false
# a rolled-back claim leaves nothing
raw('BEGIN;',
	qq{SELECT $A AS k0_answer FROM idempotency.idem_acquire((:run)::text || '-k0', '{"amount": 1}') a \\gset},
	'ROLLBACK;');
step(q{SELECT (:k0_answer)::text});
step(qq{SELECT count(*)::text FROM idempotency.idem_lookup((:run)::text || '-k0') l});
# lease mode: claim, commit, in_progress for a duplicate, complete later
step(qq{SELECT $A FROM idempotency.idem_acquire((:run)::text || '-k2', '{"amount": 5}', lease => '1 hour') a});
raw('BEGIN;', q{SET LOCAL idempotency.wait_timeout = '100ms';});
step(qq{SELECT $A FROM idempotency.idem_acquire((:run)::text || '-k2', '{"amount": 5}') a});      # in_progress
step(qq{SELECT $A FROM idempotency.idem_acquire((:run)::text || '-k2', '{"amount": 6}') a});      # mismatch
raw('COMMIT;');
step(qq{SELECT $L FROM idempotency.idem_lookup((:run)::text || '-k2') l});
step(q{SELECT idempotency.idem_release((:run)::text || '-k2', attempt => 1)::text});              # true
step(qq{SELECT count(*)::text FROM idempotency.idem_lookup((:run)::text || '-k2') l});
step(qq{SELECT $A FROM idempotency.idem_acquire((:run)::text || '-k2', '{"amount": 5}', lease => '1 hour') a}); # acquired 1
step(q{SELECT idempotency.idem_complete((:run)::text || '-k2', 422, '{"error": "card declined"}', attempt => 1)::text});
step(qq{SELECT $A FROM idempotency.idem_acquire((:run)::text || '-k2', '{"amount": 5}') a});      # replay 422
# lease takeover
step(qq{SELECT $A FROM idempotency.idem_acquire((:run)::text || '-k3', '{"amount": 7}', lease => '1 second') a});
raw('\sleep 1100 ms');
step(qq{SELECT $A FROM idempotency.idem_acquire((:run)::text || '-k3', '{"amount": 7}') a});      # acquired 2
step(q{SELECT public.sqlstate_of(format('SELECT idempotency.idem_complete(%L, 201, NULL, attempt => 1)', (:run)::text || '-k3'))}); # 55000
step(q{SELECT idempotency.idem_complete((:run)::text || '-k3', 201, '{"id": 3}', attempt => 2)::text});
step(qq{SELECT $A FROM idempotency.idem_acquire((:run)::text || '-k3', '{"amount": 7}') a});      # replay, attempt 2
# errors
step(q{SELECT public.sqlstate_of(format('SELECT idempotency.idem_complete(%L, 201)', (:run)::text || '-none'))});   # P0002
step(q{SELECT public.sqlstate_of($$SELECT * FROM idempotency.idem_acquire('', '{}')$$)});             # 22023
step(q{SELECT public.sqlstate_of($$SELECT idempotency.idem_complete('x', 99)$$)});                    # 22023
# the hash
step(q{SELECT (idempotency.idem_request_hash('{"b": 1, "a": [1, 2]}') = sha256(convert_to('{"a": [1, 2], "b": 1}', 'UTF8')))::text});

my @expected = (
	'acquired|1',
	'true',
	'replay|1|201|{"id": 1}',
	'replay|1|201|{"id": 1}',
	'mismatch|1',
	'replay|1|201|{"id": 1}',
	'completed|1|201|{"id": 1}|t',
	'false',
	'false',
	'acquired|1',
	'0',
	'acquired|1',
	'in_progress|1',
	'mismatch|1',
	'processing|1|f',
	'true',
	'0',
	'acquired|1',
	'true',
	'replay|1|422|{"error": "card declined"}',
	'acquired|1',
	'acquired|2',
	'55000',
	'true',
	'replay|2|201|{"id": 3}',
	'P0002',
	'22023',
	'22023',
	'true');
is(scalar(@expected), $n, 'an expected answer for every step');

my $script = "$dir/scenario.sql";
open my $sf, '>', $script or die $!;
print $sf join("\n", @steps), "\n";
close $sf;

sub run_pgbench
{
	my ($port, @args) = @_;
	my ($out, $err) = ('', '');
	my $ok = IPC::Run::run(
		[ 'pgbench', '-n', '-M', 'extended', '-h', '127.0.0.1', '-p', $port, '-U', $user, @args, 'postgres' ],
		'>', \$out, '2>', \$err);
	return ($ok, $out, $err);
}

foreach my $run ([ 'bouncer', $bport ], [ 'direct', $node->port ])
{
	my ($label, $port) = @$run;
	my ($ok, $out, $err) = run_pgbench($port, '-c', '1', '-t', '1', '-D', "run=$label", '-f', $script);
	ok($ok, "scenario via $label: pgbench -M extended ran it") or diag($err);
}

my @bouncer = split /\n/, $node->safe_psql('postgres',
	q{SELECT result FROM px_results WHERE run = 'bouncer' ORDER BY step});
my @direct = split /\n/, $node->safe_psql('postgres',
	q{SELECT result FROM px_results WHERE run = 'direct' ORDER BY step});
is_deeply(\@bouncer, \@direct, 'every step answers the same through pgbouncer as direct');
is_deeply(\@bouncer, \@expected, 'and as the contract says');
for my $i (0 .. $#expected)
{
	next if ($bouncer[$i] // '') eq $expected[$i];
	diag(sprintf('step %d: %s: via pgbouncer %s, direct %s, expected %s',
			$i + 1, $step_sql[$i], $bouncer[$i] // 'none', $direct[$i] // 'none', $expected[$i]));
}
my $backends = $node->safe_psql('postgres',
	q{SELECT count(DISTINCT backend) FROM px_results WHERE run = 'bouncer'});
note("scenario via pgbouncer ran on $backends server connection(s)");

# ---------------------------------------------------------------------
# 2. load through the pooler: 8 clients, 2 server connections
# ---------------------------------------------------------------------
my $load = "$dir/load.sql";
open my $lf, '>', $load or die $!;
print $lf q{\set k random(1, 150)
BEGIN;
SET LOCAL idempotency.wait_timeout = '5s';
SELECT (outcome = 'acquired')::int AS acq, (outcome IN ('acquired', 'replay'))::int AS fine
  FROM idempotency.idem_acquire('load-' || :k, '{"n": 1}') \gset
\if :acq
INSERT INTO biz (key, client, backend) VALUES ('load-' || :k, :client_id, pg_backend_pid());
SELECT idempotency.idem_complete('load-' || :k, 201, jsonb_build_object('k', (:k)::int));
\elif :fine
\else
SELECT 1 / 0 AS unexpected_outcome;
\endif
COMMIT;
};
close $lf;
my $t0 = time;
my ($ok, $out, $err) = run_pgbench($bport, '-c', '8', '-j', '2', '-t', '150', '-f', $load);
my $secs = time - $t0;
ok($ok, 'load via pgbouncer: pgbench -M extended, 8 clients, ran') or diag($err);
like($out, qr/number of transactions actually processed: 1200\b/, 'load: all 1200 transactions processed');
like($out, qr/number of failed transactions: 0 /, 'load: none failed (no unexpected outcome)');
my ($done, $distinct, $dups, $no_rec, $server_conns, $multi_conn_clients) = split /\|/,
  $node->safe_psql(
	'postgres', q{
SELECT (SELECT count(*) FROM biz WHERE key LIKE 'load-%'),
       (SELECT count(DISTINCT key) FROM biz WHERE key LIKE 'load-%'),
       (SELECT count(*) FROM (SELECT key FROM biz WHERE key LIKE 'load-%' GROUP BY key HAVING count(*) > 1) d),
       (SELECT count(*) FROM biz b WHERE b.key LIKE 'load-%' AND NOT EXISTS (
            SELECT FROM idempotency.idem_lookup(b.key) l WHERE l.status = 'completed' AND l.response_status = 201)),
       (SELECT count(DISTINCT backend) FROM biz WHERE key LIKE 'load-%'),
       (SELECT count(*) FROM (SELECT client FROM biz WHERE key LIKE 'load-%' GROUP BY client
                               HAVING count(DISTINCT backend) > 1) c)});
is($dups, 0, "load: no key done twice ($done done, $distinct distinct keys)");
is($no_rec, 0, 'load: every done key has its completed record');
cmp_ok($server_conns, '<=', $pool_size,
	"load: the work ran on at most $pool_size server connections ($server_conns)");
cmp_ok($multi_conn_clients, '>', 0,
	"load: clients were moved between server connections ($multi_conn_clients clients used more than one)");
my $replays = 1200 - $done;

# lease mode across transactions: claim in one, complete in the next, each
# on whatever server connection the pooler gives
$node->safe_psql('postgres',
	'CREATE TABLE lease_done (key text, claimed_on int, completed_on int, completed boolean)');
my $lease_script = "$dir/lease.sql";
open my $lsf, '>', $lease_script or die $!;
print $lsf q{\set k random(1, 1000000000)
SELECT a.attempt AS att, pg_backend_pid() AS claimed_on
  FROM idempotency.idem_acquire('lease-' || :client_id || '-' || :k, '{"n": 1}', lease => '1 minute') a \gset
\sleep 2 ms
INSERT INTO lease_done
SELECT 'lease-' || :client_id || '-' || :k, :claimed_on, pg_backend_pid(),
       idempotency.idem_complete('lease-' || :client_id || '-' || :k, 201, NULL, '', (:att)::int);
};
close $lsf;
($ok, $out, $err) = run_pgbench($bport, '-c', '8', '-j', '2', '-t', '50', '-f', $lease_script);
ok($ok, 'lease mode via pgbouncer: claims completed in a later transaction') or diag($err);
my ($l_total, $l_completed, $l_moved, $l_left) = split /\|/, $node->safe_psql(
	'postgres', q{
SELECT count(*), count(*) FILTER (WHERE completed), count(*) FILTER (WHERE claimed_on <> completed_on),
       (SELECT count(*) FROM idempotency.records WHERE key LIKE 'lease-%' AND status <> 'completed')
  FROM lease_done});
is("$l_total|$l_completed", '400|400', 'lease mode: all 400 claims completed (true)');
cmp_ok($l_moved, '>', 0, "lease mode: $l_moved of them completed on another server connection than claimed");
is($l_left, 0, 'lease mode: no claim left processing');
diag(sprintf('pgbouncer (transaction pooling, pool %d): scenario of %d steps identical to direct; load %d transactions by 8 clients in %.1f s: %d acquired, %d replayed, 0 duplicates; lease mode: %d claims completed in a later transaction, %d of them on another server connection',
		$pool_size, $n, 1200, $secs, $done, $replays, $l_total, $l_moved));

# Session-bound claims behind a transaction pooler (README: use leases
# there): the owner is the pooler's server connection, not the client.  A
# client that claims session-bound and disconnects leaves the claim
# in_progress, because the server connection lives on in the pool; the claim
# is taken over only once that server connection ends.
my (undef, $sb) = run_psql_bouncer('postgres',
	q{SELECT a.outcome || '|' || pg_backend_pid()
	    FROM idempotency.idem_acquire('pool-sb', ttl => '1 hour', lease => '1 second', session_bound => true) a});
my ($sb_outcome, $sb_server) = split /\|/, $sb;
is($sb_outcome, 'acquired', 'session-bound via pgbouncer: the client acquires, then disconnects');
usleep(1_100_000);
my (undef, $sb_again) = run_psql_bouncer('postgres',
	q{BEGIN; SET LOCAL idempotency.wait_timeout = 0;
	  SELECT a.outcome || '|' || a.retry_after FROM idempotency.idem_acquire('pool-sb', lease => '1 minute') a; COMMIT;});
is($sb_again, 'in_progress|1',
	'session-bound via pgbouncer: after the client is gone (and its lease would have run out) the claim is still in_progress: its owner is the pooled server connection');
is($node->safe_psql('postgres', q{SELECT owner_pid FROM idempotency.idem_lookup('pool-sb')}),
	$sb_server, 'session-bound via pgbouncer: the owner is the server connection');
$node->safe_psql('postgres', "SELECT pg_terminate_backend($sb_server)");
$node->poll_query_until('postgres',
	"SELECT NOT EXISTS (SELECT FROM pg_stat_activity WHERE pid = $sb_server)")
  or die 'the server connection did not end';
is( $node->safe_psql('postgres',
		q{SELECT outcome || '|' || attempt FROM idempotency.idem_acquire('pool-sb', lease => '1 minute')}),
	'acquired|2', 'session-bound via pgbouncer: taken over only once the server connection ends');

# ---------------------------------------------------------------------
$bouncer->signal('TERM');
$bouncer->finish;
ok(!$bouncer->pumpable, 'pgbouncer stopped');
ok(!$node->log_contains(qr/terminated by signal|PANIC|TRAP:/), 'no backend crashed');
$node->stop;
done_testing();
