# Copyright (c) idempotency authors
#
# Hostile input.  A corpus generated deterministically (t/lib/IdemFuzz.pm,
# seeded) of some 6000 cases -- edge and random keys and scopes (empty,
# 255/256 bytes, multibyte characters across byte 255, control characters,
# SQL fragments, quotes, backslashes), JSON (1000+ levels deep, 100 kB,
# unicode-escaped, duplicate keys, around and over max_response_bytes), ttl
# and lease extremes, status codes and attempts at and past the bounds -- is
# fed to every function by a PL/pgSQL driver in one session.  Each call must
# succeed as the contract says, or fail with the contract's SQLSTATE; a call
# that succeeds is followed by the calls that check its effect (lookup,
# in_progress, mismatch, complete, replay, release), and a call that fails
# must leave the records exactly as they were.  Every case runs in a
# subtransaction rolled back at its end, so each starts from a clean slate.
#
# Then 100,000 calls in the same kind of session, in transactions of 1,000:
# backend memory (the sum of pg_backend_memory_contexts and RssAnon from
# /proc) after 100,000 calls must be within a few MB of where it was after
# 1,000.  The server must never crash: no "terminated by signal" in its log.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::RealBin/lib";
use IdemTest;
use IdemFuzz qw(generate_corpus write_copy_file);
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time);

my $max_bytes = 65536;    # idempotency.max_response_bytes in the fuzz session
my $seed = $ENV{IDEM_FUZZ_SEED} // 20260529;

my $node = idem_node('fuzz', "log_statement = none\n");

# ---------------------------------------------------------------------
# the corpus
# ---------------------------------------------------------------------
my $t0 = time;
my $cases = generate_corpus(seed => $seed, max_response_bytes => $max_bytes, random_cases => 5000);
my $dir = PostgreSQL::Test::Utils::tempdir;
write_copy_file($cases, "$dir/corpus.copy");
chmod 0644, "$dir/corpus.copy";
note(sprintf('corpus of %d cases generated (seed %d) in %.1f s', scalar(@$cases), $seed, time - $t0));

$node->safe_psql(
	'postgres', qq{
CREATE TABLE fuzz_cases (
    id int PRIMARY KEY, fn text, key text, scope text, request text, ttl text,
    lease text, status int, body text, attempt int, setup boolean,
    expected text, ttl_us bigint, lease_us bigint, note text);
COPY fuzz_cases FROM '$dir/corpus.copy';
CREATE TABLE fuzz_fail (id int, step text, got text, want text);
CREATE TABLE fuzz_stats (cases int, calls bigint, input_side int, chains int);
});
is($node->safe_psql('postgres', 'SELECT count(*) FROM fuzz_cases'),
	scalar(@$cases), 'the whole corpus is loaded');
# spot checks that hostile bytes survived the trip
is( $node->safe_psql(
		'postgres', q{
SELECT count(DISTINCT key) FROM fuzz_cases
 WHERE key IN (chr(1), chr(92), chr(92) || 'N', chr(92) || '.',
               'a' || chr(9) || 'b' || chr(10) || 'c' || chr(13) || 'd',
               repeat('x', 254) || 'é', chr(1114111), repeat('😀', 64))}),
	'8', 'control characters, backslashes and multibyte keys are loaded intact');

# ---------------------------------------------------------------------
# the driver
# ---------------------------------------------------------------------
$node->safe_psql('postgres',
	sql_fixture('sqlstate_of.sql') . slurp_file("$FindBin::RealBin/lib/fuzz_driver.sql"));

my ($ret, $out, $err) = $node->psql(
	'postgres', qq{
SET idempotency.wait_timeout = 0;
SET idempotency.max_response_bytes = $max_bytes;
CALL fuzz_run($max_bytes);
}, timeout => 600);
is($ret, 0, 'the driver ran to the end') or diag($err);
my $secs = time - $t0;

my ($n_cases, $n_calls, $n_input, $n_chains) = split /\|/,
  $node->safe_psql('postgres', 'SELECT cases, calls, input_side, chains FROM fuzz_stats');
is($n_cases, scalar(@$cases), "every case ran ($n_cases)");
my $fails = $node->safe_psql('postgres',
	q{SELECT count(*) FROM fuzz_fail});
is($fails, '0', "every call answered as the contract says ($n_calls calls)");
if ($fails ne '0')
{
	my $list = $node->safe_psql(
		'postgres', q{
SELECT f.id || ' [' || f.step || '] got ' || coalesce(f.got, 'NULL') || ', contract: '
       || coalesce(f.want, 'NULL') || ' -- ' || left(c.note, 300)
  FROM fuzz_fail f JOIN fuzz_cases c USING (id) ORDER BY f.id LIMIT 40});
	diag("first failures:\n$list");
	diag($node->safe_psql('postgres',
			q{SELECT step || ': ' || count(*) FROM fuzz_fail GROUP BY step ORDER BY count(*) DESC}));
}
diag(sprintf('fuzz: %d cases (seed %d), %d function calls in %.1f s; %d cases refused by PostgreSQL input functions before reaching the extension; %d successful calls followed by effect checks',
		$n_cases, $seed, $n_calls, $secs, $n_input, $n_chains));

# every function, every kind of answer was exercised
my $coverage = $node->safe_psql(
	'postgres', q{
SELECT string_agg(fn || ':' || n, ' ' ORDER BY fn)
  FROM (SELECT fn, count(DISTINCT expected) n FROM fuzz_cases GROUP BY fn) s});
note("distinct expected answers per function: $coverage");

# ---------------------------------------------------------------------
# settings at their edges (the corpus uses the defaults)
# ---------------------------------------------------------------------
is( $node->safe_psql(
		'postgres', q{
SET idempotency.wait_timeout = 0;
SET idempotency.default_ttl = '8d';	-- above max_ttl (7d)
SELECT public.sqlstate_of($$SELECT * FROM idempotency.idem_acquire('g-1')$$);
SET idempotency.default_ttl = '7d';
SELECT public.sqlstate_of($$SELECT * FROM idempotency.idem_acquire('g-2')$$);
SET idempotency.default_lease = '1h';
SELECT extract(epoch FROM locked_until - created_at)
  FROM idempotency.idem_acquire('g-3', ttl => '10 seconds'), idempotency.idem_lookup('g-3');
SET idempotency.max_ttl = '1s';
SELECT public.sqlstate_of($$SELECT * FROM idempotency.idem_acquire('g-4', ttl => '2 seconds')$$);
SELECT public.sqlstate_of($$SELECT * FROM idempotency.idem_acquire('g-5', ttl => '1 second')$$);
}),
	"22023\nok\n10.000000\n22023\nok",
	'default_ttl above max_ttl: 22023; default_lease is capped at the ttl; a lowered max_ttl is enforced');

is( $node->safe_psql(
		'postgres', q{
SET idempotency.wait_timeout = 0;
-- a body stored compressed: pg_column_size (the contract's measure) is small
CREATE TEMP TABLE big_bodies (b jsonb);
INSERT INTO big_bodies SELECT jsonb_build_object('p', repeat('ab', 800000));
SELECT pg_column_size(b) < 1048576, octet_length(b::text) > 1048576 FROM big_bodies;
SELECT outcome FROM idempotency.idem_acquire('g-compressed');
SELECT public.sqlstate_of($$SELECT idempotency.idem_complete('g-compressed', 200, (SELECT b FROM big_bodies))$$);
SELECT octet_length(response_body::text) FROM idempotency.idem_acquire('g-compressed');
-- the default 1MB limit, uncompressed, just under and just over
SELECT outcome FROM idempotency.idem_acquire('g-1mb');
SELECT public.sqlstate_of(format($$SELECT idempotency.idem_complete('g-1mb', 200, jsonb_build_object('p', repeat('x', %s)))$$, 1048576 - 17 + 1));
SELECT public.sqlstate_of(format($$SELECT idempotency.idem_complete('g-1mb', 200, jsonb_build_object('p', repeat('x', %s)))$$, 1048576 - 17));
SELECT pg_column_size(response_body) FROM idempotency.idem_lookup('g-1mb');
}),
	"t|t\nacquired\nok\n1600009\nacquired\n54000\nok\n1048576",
	'max_response_bytes: by pg_column_size (a compressed 1.6 MB body passes); at the default 1MB, 1048577 bytes refused, 1048576 accepted');

# ---------------------------------------------------------------------
# A claim made earlier in the same transaction whose lease has run out.
# API.md: acquired "when the live record was processing and its lease had
# run out (then attempt = previous attempt + 1)"; in_progress only "whose
# lease has not run out".
# ---------------------------------------------------------------------
is( $node->safe_psql(
		'postgres', q{
BEGIN;
SET LOCAL idempotency.wait_timeout = 0;
SELECT outcome || '|' || attempt FROM idempotency.idem_acquire('own-lease', lease => '1 millisecond');
SELECT pg_sleep(0.01);
SELECT outcome || '|' || attempt FROM idempotency.idem_acquire('own-lease');
SELECT outcome || '|' || attempt FROM idempotency.idem_acquire('own-lease');
ROLLBACK;
}),
	"acquired|1\n\nacquired|2\nin_progress|2",
	'same transaction, lease run out: a second acquire takes the claim over (attempt 2), a third finds it running');

# ---------------------------------------------------------------------
# memory: 100,000 calls, in transactions of 1,000
# ---------------------------------------------------------------------
$t0 = time;
($ret, $out, $err) = $node->psql(
	'postgres', q{
SET idempotency.wait_timeout = 0;
CALL fuzz_memory(100, 1000);
SELECT calls, contexts_bytes, rss_anon_kb, vm_rss_kb FROM fuzz_mem ORDER BY calls;
}, timeout => 600);
is($ret, 0, 'the memory loop ran') or diag($err);
my $mem_secs = time - $t0;
my @rows = map { [ split /\|/ ] } split /\n/, $out;
my ($first) = grep { $_->[0] == 1000 } @rows;
my ($last) = grep { $_->[0] == 100000 } @rows;
ok($first && $last, 'memory measured after 1,000 and after 100,000 calls');
if ($first && $last)
{
	my $ctx_growth = $last->[1] - $first->[1];
	my $rss_growth = ($last->[2] - $first->[2]) * 1024;
	cmp_ok($ctx_growth, '<', 2 * 1024 * 1024,
		sprintf('memory contexts grew by %.2f MB between 1,000 and 100,000 calls', $ctx_growth / 1048576));
	cmp_ok($rss_growth, '<', 4 * 1024 * 1024,
		sprintf('anonymous RSS grew by %.2f MB between 1,000 and 100,000 calls', $rss_growth / 1048576));
	diag(sprintf('memory, 100,000 calls in %.1f s: contexts %.2f MB after 1,000 calls, %.2f MB after 100,000 (%+.2f MB); RssAnon %.1f MB -> %.1f MB (%+.2f MB); VmRSS %.1f MB -> %.1f MB',
			$mem_secs, $first->[1] / 1048576, $last->[1] / 1048576, $ctx_growth / 1048576,
			$first->[2] / 1024, $last->[2] / 1024, $rss_growth / 1048576,
			$first->[3] / 1024, $last->[3] / 1024));
	note('calls | contexts bytes | RssAnon kB | VmRSS kB');
	note(join(' | ', @$_)) foreach grep { $_->[0] % 10000 == 0 || $_->[0] == 1000 } @rows;
}

# ---------------------------------------------------------------------
ok(!$node->log_contains(qr/terminated by signal|PANIC|TRAP:/), 'no backend crashed');
is($node->safe_psql('postgres', 'SELECT 1'), '1', 'the server is up');
$node->stop;
done_testing();
