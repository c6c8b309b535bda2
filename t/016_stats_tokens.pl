# Copyright (c) idempotency authors
#
# Statistics and one-time tokens where a cluster of their own is needed:
#   - without shared_preload_libraries every idem_* function works, and the
#     statistics objects raise 55000 with a hint giving the exact setting;
#   - with it, under 8 pgbench clients that connect for every transaction
#     (each backend's counters are folded into its database's at exit) and
#     then 8 that stay connected, every counter equals what the clients
#     logged of their own answers, and the histogram counts every acquire;
#   - a clean restart keeps the counters and stats_reset; a crash starts
#     them again from zero with a new stats_reset, and the daily
#     reconciliation writes no negative increase across it;
#   - with idempotency.stats_max_databases databases counted, one more is
#     not counted (the server log says so once), until a counted database
#     is dropped;
#   - 8 concurrent consumers of one token, round after round: exactly one
#     gets true, as a table the consumers write to shows; when the winner
#     rolls back, exactly one other wins;
#   - fuzzed input to the token functions (the edge and random strings and
#     intervals of t/lib/IdemFuzz.pm): each call succeeds or raises the
#     contract's SQLSTATE, and a failing call writes nothing.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::RealBin/lib";
use IdemTest;
use IdemFuzz;
use Encode qw(encode_utf8);
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

sub pgbench
{
	my ($node, $script, @args) = @_;
	my ($stdout, $stderr);
	my $ok = IPC::Run::run(
		[
			'pgbench', '-n', @args, '-h', $node->host, '-p', $node->port,
			'-f', $script, 'postgres'
		],
		'>', \$stdout, '2>', \$stderr);
	return ($ok, $stdout, $stderr);
}

sub write_file
{
	my ($path, $text) = @_;
	open my $fh, '>', $path or die "$path: $!";
	print $fh $text;
	close $fh;
	return $path;
}

# ------------------------------------------------------------------
# Without preloading
my $plain = idem_node('plain');
is( $plain->safe_psql('postgres',
		q{SELECT outcome FROM idempotency.idem_acquire('p1', '{}');
		  SELECT idempotency.idem_complete('p1', 200);
		  SELECT outcome FROM idempotency.idem_acquire('p1', '{}');
		  SELECT idempotency.idem_token_consume(idempotency.idem_token_issue());
		  SELECT count(*) FROM idempotency.idem_maintain();
		  SELECT count(*) FROM idempotency.stale_claims;
		  SELECT idempotency.idem_stats_enabled();}),
	"acquired\nt\nreplay\nt\n1\n0\nf",
	'without preloading: claims, tokens, maintenance and stale_claims work, idem_stats_enabled() is false');
foreach my $object ('SELECT * FROM idempotency.stats',
	'SELECT * FROM idempotency.acquire_duration',
	'SELECT * FROM idempotency.idem_stats()',
	'SELECT idempotency.idem_stats_reset()')
{
	my ($state, $out, $err) = sqlstate_of_psql($plain, 'postgres', $object);
	is($state, '55000', "without preloading: $object raises 55000");
	like($err, qr/HINT:  Set shared_preload_libraries = 'pg_cron, idempotency' in postgresql\.conf and restart the server\./,
		'with a hint giving the exact setting');
}
$plain->stop;

# ------------------------------------------------------------------
# Preloaded: counters against what the clients saw
my $node = idem_node('stats', q{
shared_preload_libraries = 'pg_cron,idempotency'
idempotency.stats_max_databases = 3
max_connections = 40
restart_after_crash = on
log_statement = none
});
$node->safe_psql(
	'postgres', q{
CREATE TABLE public.answers (outcome text, taken_over boolean);
CREATE TABLE public.completions (done boolean);
SELECT idempotency.idem_stats_reset();
});

my $script = write_file($node->basedir . '/count.pgbench', q{
\set k random(1, 300)
\set c random(1, 3)
INSERT INTO public.answers
SELECT a.outcome, a.outcome = 'acquired' AND a.attempt > 1
  FROM idempotency.idem_acquire('k' || :k, jsonb_build_object('v', :k % 7 + (:c = 3 AND :k % 5 = 0)::int),
                                lease => CASE WHEN :k % 10 = 0 THEN interval '1 millisecond' ELSE interval '1 hour' END) a;
INSERT INTO public.completions
SELECT idempotency.idem_complete('k' || :k, 200) FROM idempotency.idem_lookup('k' || :k) l
 WHERE :c = 1 AND l.status = 'processing';
});
$ENV{PGOPTIONS} = '-c idempotency.wait_timeout=0';
my ($ok, $out, $err) = pgbench($node, $script, '-C', '-c', '8', '-j', '8', '-T', '4');
ok($ok, 'pgbench -C: 8 clients, a connection per transaction') or diag($err);
like($out, qr/number of failed transactions: 0 /, 'no failed transaction');
($ok, $out, $err) = pgbench($node, $script, '-c', '8', '-j', '8', '-T', '3');
ok($ok, 'pgbench: 8 clients that stay connected') or diag($err);
delete $ENV{PGOPTIONS};

my $expected = $node->safe_psql('postgres', q{
SELECT (SELECT count(*) FROM public.answers WHERE outcome = 'acquired') || '|' ||
       (SELECT count(*) FROM public.answers WHERE taken_over) || '|' ||
       (SELECT count(*) FROM public.answers WHERE outcome = 'replay') || '|' ||
       (SELECT count(*) FROM public.answers WHERE outcome = 'mismatch') || '|' ||
       (SELECT count(*) FROM public.answers WHERE outcome = 'in_progress') || '|' ||
       (SELECT count(*) FROM public.completions WHERE done) || '|' ||
       (SELECT count(*) FROM public.answers)});
my $counted = $node->safe_psql('postgres', q{
SELECT acquired || '|' || taken_over || '|' || replayed || '|' || mismatched || '|' ||
       in_progress || '|' || completed || '|' || acquire_duration_count
  FROM idempotency.idem_stats() WHERE datname = 'postgres'});
my @e = split /\|/, $expected;
diag("answers: acquired $e[0] (taken over $e[1]), replay $e[2], mismatch $e[3], in_progress $e[4], completed $e[5]");
ok($e[0] > 100 && $e[1] > 10 && $e[2] > 100 && $e[3] > 10 && $e[4] > 10,
	'every outcome occurred many times');
is($counted, $expected, 'every counter equals what the clients were answered');
is( $node->safe_psql('postgres', q{
	SELECT count FROM idempotency.acquire_duration WHERE datname = 'postgres' AND le = 'Infinity'}),
	$e[6], 'the histogram counts every acquire');

# ------------------------------------------------------------------
# Restarts
$node->safe_psql('postgres', 'SELECT idempotency.idem_maintain()');
my $before = $node->safe_psql('postgres',
	q{SELECT acquired || '|' || replayed || '|' || stats_reset FROM idempotency.stats WHERE datname = 'postgres'});
$node->restart;
is( $node->safe_psql('postgres',
		q{SELECT acquired || '|' || replayed || '|' || stats_reset FROM idempotency.stats WHERE datname = 'postgres'}),
	$before, 'a clean restart keeps the counters and stats_reset');
ok(!-e $node->data_dir . '/pg_stat/idempotency.stat', 'and the saved file is gone once read');

my $daily_before = $node->safe_psql('postgres', q{SELECT acquired FROM idempotency.daily});
is($daily_before, $e[0], "the daily row holds today's increase ($daily_before acquired)");

# a crash: kill -9 a backend (one that counted), the postmaster
# reinitializes shared memory
my $victim = $node->background_psql('postgres');
my $pid = $victim->query_safe(q{SELECT pg_backend_pid() FROM idempotency.idem_acquire('victim')});
kill 'KILL', $pid;
eval { $victim->quit };
poll_query_back($node, 'postgres', 'SELECT true') or die 'no restart after the crash';
my ($after_acq, $after_reset) = split /\|/, $node->safe_psql('postgres',
	q{SELECT coalesce(sum(acquired), 0) || '|' || coalesce(bool_and(stats_reset > now() - interval '1 minute'), true)
	    FROM idempotency.stats WHERE datname = 'postgres'});
is($after_acq, 0, 'a crash starts the counters from zero');
ok($after_reset, 'with a new stats_reset');
$node->safe_psql('postgres', q{
SELECT idempotency.idem_acquire('after-crash-' || i) FROM generate_series(1, 3) i;
SELECT idempotency.idem_maintain();});
is( $node->safe_psql('postgres', q{SELECT acquired FROM idempotency.daily}),
	$daily_before + 3, 'the daily increase goes on from a new base after the crash');
is( $node->safe_psql('postgres',
		q{SELECT count(*) FROM idempotency.daily WHERE least(acquired, taken_over, replayed, mismatched,
		    in_progress, completed, released, waits, tokens_issued, tokens_consumed, acquire_count) < 0
		    OR wait_time < 0 OR acquire_time < 0}),
	0, 'no negative increase');

# ------------------------------------------------------------------
# idempotency.stats_max_databases = 3: postgres and two more are counted
foreach my $db ('d1', 'd2', 'd3')
{
	$node->safe_psql('postgres', "CREATE DATABASE $db");
	$node->safe_psql($db, 'CREATE EXTENSION idempotency');
}
$node->safe_psql('d1', q{SELECT idempotency.idem_acquire('x')});
$node->safe_psql('d2', q{SELECT idempotency.idem_acquire('x')});
my $log_offset = -s $node->logfile;
my ($ret, $o, $e3) = $node->psql('d3', q{SELECT outcome FROM idempotency.idem_acquire('x')});
is($o, 'acquired', 'a database beyond the limit still works');
is($e3, '', 'and says nothing to its clients');
$node->psql('d3', q{SELECT outcome FROM idempotency.idem_acquire('x2')});
my @said = (slurp_file($node->logfile, $log_offset) =~
	  /LOG:  idempotency statistics of database "d3" are not kept/g);
is(scalar(@said), 1, 'the server log says once that it is not counted');
is( $node->safe_psql('postgres', q{SELECT string_agg(datname, ',' ORDER BY datname) FROM idempotency.stats}),
	'd1,d2,postgres', 'its statistics are not kept');
$node->safe_psql('postgres', 'DROP DATABASE d2');
($ret, $o, $e3) = $node->psql('d3', q{SELECT outcome FROM idempotency.idem_acquire('y')});
is($e3, '', 'once a counted database is dropped, the next session counts');
is( $node->safe_psql('postgres',
		q{SELECT string_agg(datname || ':' || acquired, ',' ORDER BY datname) FROM idempotency.stats}),
	'd1:1,d3:1,postgres:3', 'in the dropped database\'s entry');

# ------------------------------------------------------------------
# 8 concurrent consumers of one token, 15 rounds; in the last 5 the winner
# rolls back, and exactly one of the others must win instead.
$node->safe_psql(
	'postgres', q{
CREATE TABLE public.tok (round int, t text);
CREATE TABLE public.winners (round int, pid int, kept boolean);
});
my $consume = write_file($node->basedir . '/consume.pgbench', q{
BEGIN;
INSERT INTO public.winners
SELECT tok.round, pg_backend_pid(), true
  FROM (SELECT round, t FROM public.tok ORDER BY round DESC LIMIT 1) tok
 WHERE idempotency.idem_token_consume(tok.t, 'race');
SELECT pg_sleep(0.02);
COMMIT;
});
# The first consumer to get true in a round gives up: it rolls back (a
# sequence, which no rollback undoes, says who was first).
my $consume_rb = write_file($node->basedir . '/consume_rb.pgbench', q{
BEGIN;
SELECT tok.round AS r, idempotency.idem_token_consume(tok.t, 'race')::int AS won
  FROM (SELECT round, t FROM public.tok ORDER BY round DESC LIMIT 1) tok \gset
SELECT pg_sleep(0.02);
\if :won
SELECT (nextval(('public.giveup_' || :r)::regclass) = 1)::int AS first \gset
\if :first
ROLLBACK;
INSERT INTO public.winners VALUES (:r, pg_backend_pid(), false);
\else
INSERT INTO public.winners VALUES (:r, pg_backend_pid(), true);
COMMIT;
\endif
\else
COMMIT;
\endif
});
my $bad = 0;
foreach my $round (1 .. 15)
{
	my $rollback = $round > 10;
	$node->safe_psql('postgres',
		"CREATE SEQUENCE public.giveup_$round;
		 INSERT INTO public.tok SELECT $round, idempotency.idem_token_issue('race')");
	($ok, $out, $err) = pgbench($node, $rollback ? $consume_rb : $consume,
		'-c', '8', '-j', '8', '-t', '1');
	$bad++ unless $ok && $out =~ /number of failed transactions: 0 /;
	diag($err) unless $ok;
}
is($bad, 0, '15 rounds of 8 concurrent consumers ran without an error');
is( $node->safe_psql('postgres', q{
	SELECT string_agg(n::text, ',' ORDER BY round)
	  FROM (SELECT round, count(*) FILTER (WHERE kept) AS n FROM public.winners GROUP BY round) w}),
	join(',', ('1') x 15), 'exactly one consumer of each token kept true');
is( $node->safe_psql('postgres', q{
	SELECT count(DISTINCT round) FROM public.winners WHERE NOT kept}),
	5, 'in the rollback rounds, the first winner rolled back and another one won');
is( $node->safe_psql('postgres', q{
	SELECT count(*) FROM public.tok t JOIN idempotency.records r ON r.key = t.t AND r.is_token
	 WHERE r.status = 'completed'}),
	15, 'every token is consumed');

# ------------------------------------------------------------------
# Fuzzed input to the token functions
srand($ENV{IDEM_FUZZ_SEED} // 20261130);
my @idents = map { $_->[0] } IdemFuzz::edge_idents();
push @idents, IdemFuzz::random_ident(300) for 1 .. 150;
my @intervals = IdemFuzz::edge_intervals();
push @intervals, IdemFuzz::random_interval() for 1 .. 50;
my @cases;
foreach my $i (0 .. $#idents)
{
	my $scope = $idents[ int(rand(@idents)) ];
	my $iv = $intervals[ int(rand(@intervals)) ];
	my @ttl = IdemFuzz::ttl_lease_errors($iv, [undef]);   # (error) or (ttl, lease)
	my @issue_err = (IdemFuzz::ident_errors($scope, 0), @ttl == 1 ? @ttl : ());
	@issue_err = ($iv->[3]) if defined $iv->[3];    # refused by interval input
	push @cases, [ 'issue', $scope, $iv->[0], $issue_err[0] // 'ok' ];
	my @consume_err = (IdemFuzz::ident_errors($idents[$i], 1), IdemFuzz::ident_errors($scope, 0));
	push @cases, [ 'consume', $idents[$i], $scope, $consume_err[0] // 'false' ];
}
my $copy = $node->basedir . '/token_fuzz.copy';
open my $cf, '>:raw', $copy or die $!;
foreach my $c (@cases)
{
	print $cf encode_utf8(join("\t", map { IdemFuzz::copy_field($_) } @$c)), "\n";
}
close $cf;
$node->safe_psql('postgres', qq{
CREATE TABLE public.token_fuzz (id serial, fn text, a text, b text, expected text, got text);
COPY public.token_fuzz (fn, a, b, expected) FROM '$copy';
DO \$\$
DECLARE
    c record;
    before text;
    result text;
BEGIN
    FOR c IN SELECT * FROM public.token_fuzz ORDER BY id LOOP
        SELECT count(*) || md5(string_agg(r::text, '|' ORDER BY r::text)) INTO before
          FROM idempotency.records r;
        BEGIN
            IF c.fn = 'issue' THEN
                result := CASE WHEN idempotency.idem_token_issue(c.a, c.b::interval) ~ '^[A-Za-z0-9_-]{32}\$'
                               THEN 'ok' ELSE 'bad token' END;
            ELSE
                result := idempotency.idem_token_consume(c.a, c.b)::text;
            END IF;
        EXCEPTION WHEN OTHERS THEN
            result := SQLSTATE;
            IF (SELECT count(*) || md5(string_agg(r::text, '|' ORDER BY r::text))
                  FROM idempotency.records r) IS DISTINCT FROM before THEN
                result := result || ' and wrote';
            END IF;
        END;
        UPDATE public.token_fuzz SET got = result WHERE id = c.id;
    END LOOP;
END
\$\$;
});
my $wrong = $node->safe_psql('postgres', q{
	SELECT count(*) FROM public.token_fuzz WHERE got IS DISTINCT FROM expected});
is($wrong, 0, scalar(@cases) . ' fuzzed calls of the token functions answered as the contract says')
  or diag($node->safe_psql('postgres', q{
	SELECT fn, left(a, 40), left(b, 40), expected, got FROM public.token_fuzz
	 WHERE got IS DISTINCT FROM expected LIMIT 10}));
is( $node->safe_psql('postgres', q{
	SELECT count(DISTINCT expected) FROM public.token_fuzz
	 WHERE expected IN ('ok', 'false', '22004', '22023')}),
	4, 'with outcomes of every kind (ok, false, 22004, 22023)');

$node->stop;
done_testing();
