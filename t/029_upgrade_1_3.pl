# Copyright (c) idempotency authors
#
# ALTER EXTENSION idempotency UPDATE from 1.2 to 1.3 on a shard that holds
# live records (issue 39).  1.3 binds shard_key_hash, shard_refusal and
# shard_acquire, PL/pgSQL in 1.2, to the library's C.  The test:
#   - at 1.2, on a database with a layout and records of every kind a
#     shard answers (completed, processing with a running lease, one whose
#     lease ran out, of a key the shard owns and of one it does not, a claim
#     in an open transaction), records the answers of the three functions:
#     shard_refusal over every layout state a growth goes through (none; in
#     force; installed, not yet in force, with the previous placement; in
#     force with it) for routers at every version, partitions and both
#     kinds of call; shard_key_hash of ASCII, non-ASCII, empty and NULL
#     strings; shard_acquire's rows, refusals and 55R01 as the application
#     role, with proxy/README.md's grants;
#   - updates, with a session that prepared a shard_acquire call before
#     and a claim in an open transaction;
#   - at 1.3: the three functions are C, their grants kept, and every
#     answer is the same, byte for byte; the prepared call and the open
#     transaction's claim go on; the records complete and replay; a refused
#     new claim leaves no record;
#   - at 1.3, a claim that waited for a layout being written is checked
#     against that layout (READ COMMITTED), and under REPEATABLE READ a
#     layout changed since the transaction's snapshot fails with 40001.
# So a router, or an application calling the shards itself, sees no
# difference but the time a call takes.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::RealBin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node = idem_node('upgrade13', "shared_preload_libraries = 'pg_cron,idempotency'\n");
$node->safe_psql('postgres', 'CREATE ROLE app LOGIN; CREATE DATABASE up');
$node->safe_psql('up',
	"CREATE EXTENSION idempotency VERSION '1.2';\n"
	  . sql_fixture('readme_grants.sql', app_role => 'app') . q{
GRANT EXECUTE ON FUNCTION
    idempotency.shard_acquire(bigint, text, jsonb, text, interval, interval, text),
    idempotency.shard_lookup(bigint, text, text),
    idempotency.shard_token_issue(bigint, int, text, interval),
    idempotency.shard_check(bigint, int, boolean),
    idempotency.shard_refusal(bigint, int, boolean),
    idempotency.shard_key_hash(text, text),
    idempotency.shard_owns(text, text, bigint)
    TO app;
GRANT SELECT ON idempotency.shard_layout TO app;
});

# Keys by partition of a 4-partition map (hash & 3), the first of PREFIX1,
# PREFIX2, ... in PART: the shard owns partitions 0 and 2.
sub key_in
{
	my ($prefix, $part) = @_;
	return $node->safe_psql('up', qq{
SELECT k FROM generate_series(1, 1000) g, LATERAL (SELECT '$prefix' || g AS k) x
 WHERE idempotency.shard_key_hash('s', k) & 3 = $part ORDER BY g LIMIT 1});
}
my $k_done = key_in('done', 0);
my $k_lease = key_in('lease', 2);
my $k_open = key_in('open', 0);
my $k_new = key_in('new', 2);
my $k_other = key_in('other', 1);
my $k_taken = key_in('taken', 3);

my $layout_v2 = q{
DELETE FROM idempotency.shard_layout;
SELECT idempotency.shard_layout_install(2, true, ARRAY['a', 'b', 'c', 'd'], ARRAY[0, 2],
                                        NULL, NULL, NULL, NULL);
};
$node->safe_psql('up', $layout_v2);

# Records, made at 1.2 through shard_acquire as the application role (and
# one of a key the shard does not own, as a forced end of a growth window
# can leave, by idem_acquire: its lease runs out)
$node->safe_psql('up', qq{
SET ROLE app;
SELECT outcome FROM idempotency.shard_acquire(2, '$k_done', '{"a": 1}', 's', '1 day', '1 hour');
SELECT idempotency.idem_complete('$k_done', 201, '{"id": 1}', 's');
SELECT outcome FROM idempotency.shard_acquire(2, '$k_lease', '{"a": 2}', 's', '1 day', '1 hour');
SELECT outcome FROM idempotency.idem_acquire('$k_taken', '{"a": 3}', 's', '1 day', '1 second');
});
ok( $node->poll_query_until('up', qq{
SELECT locked_until < clock_timestamp() FROM idempotency.idem_lookup('$k_taken', 's')}),
	'the lease of the record of a key the shard does not own ran out');

# shard_refusal over the layout states of a growth, each row: layout, hash,
# fresh, message, detail
my $refusal_matrix = q{
SELECT string_agg(format('%s|%s|%s|%s|%s', l, h, f, r.message, r.detail), E'\n'
                  ORDER BY l NULLS FIRST, h, f)
  FROM unnest(ARRAY[NULL, 1, 2, 3, 4]::bigint[]) l,
       unnest(ARRAY[0, 1, 2, 3, 5, 6, 7, -1, -2, -8, 2147483647, -2147483648]) h,
       unnest(ARRAY[false, true]) f,
       LATERAL idempotency.shard_refusal(l, h, f) r;
};
my $matrix_sql = join(
	"\n",
	'BEGIN;',
	'DELETE FROM idempotency.shard_layout;',
	$refusal_matrix,
	q{SELECT idempotency.shard_layout_install(2, true, ARRAY['a', 'b', 'c', 'd'], ARRAY[0, 2], NULL, NULL, NULL, NULL);},
	$refusal_matrix,
	q{SELECT idempotency.shard_layout_install(3, false, ARRAY['a', 'b', 'c', 'd', 'e', 'f', 'g', 'h'], ARRAY[0, 2, 5], ARRAY['a', 'b', 'c', 'd'], ARRAY[0, 2], now(), now() + interval '1 hour');},
	$refusal_matrix,
	'SELECT idempotency.shard_layout_activate(3);',
	$refusal_matrix,
	'ROLLBACK;');

my $hash_sql = q{
SELECT string_agg(format('%s|%s|%s', s, k, idempotency.shard_key_hash(s, k)), E'\n' ORDER BY s NULLS FIRST, k NULLS FIRST)
  FROM unnest(ARRAY[NULL, '', 's', 'payments']) s,
       unnest(ARRAY[NULL, '', 'a', 'k1', 'ключ', 'clé-✓', repeat('x', 255)]) k;
};

# shard_acquire's answers as the application role; a call that raises
# shows its SQLSTATE, message, detail and hint
sub acquire_answers
{
	my @calls = (
		"2, '$k_done', '{\"a\": 1}'",     # replay
		"2, '$k_done', '{\"a\": 9}'",     # mismatch
		"1, '$k_done', '{\"a\": 1}'",     # an older router: the key did not move
		"3, '$k_done', '{\"a\": 1}'",     # a newer one
		"NULL, '$k_done', '{\"a\": 1}'",  # none: refused
		"2, '$k_other', '{\"a\": 4}'",    # a new claim not owned: refused
		"1, '$k_other', '{\"a\": 4}'",
		"2, '$k_taken', '{\"a\": 3}'",    # a takeover not owned: 55R01
		"2, '', NULL",                    # bad input: what idem_acquire raises
	);
	my @out;
	for my $c (@calls)
	{
		my ($state, $out, $err) = sqlstate_of_psql($node, 'up', qq{
SET ROLE app;
SELECT outcome, response_status, response_body, attempt, expires_at, claim IS NOT NULL,
       phase, state, response_headers, origin_trace
  FROM idempotency.shard_acquire($c, 's', '1 day', '1 hour');
});
		# the error's own lines (where it was raised, and from which
		# PL/pgSQL, is what changed)
		$err =~ s/^psql:<stdin>:\d+: //mg;
		$err = join('', grep { /^(ERROR|DETAIL|HINT):/ } split(/^/m, $err));
		push @out, "$c => $state | $out | $err";
	}
	# the processing claim: its retry_after moves with the clock
	push @out, $node->safe_psql('up', qq{
SET ROLE app;
SELECT outcome, attempt, expires_at, retry_after > 0
  FROM idempotency.shard_acquire(2, '$k_lease', '{"a": 2}', 's', '1 day', '1 hour');
});
	push @out, $node->safe_psql('up',
		qq{SELECT count(*) FROM idempotency.records WHERE key = '$k_other'});
	return join("\n", @out);
}

my %before = (
	matrix => $node->safe_psql('up', $matrix_sql),
	hash => $node->safe_psql('up', $hash_sql),
	acquire => acquire_answers());
like($before{acquire}, qr/^NULL, '\Q$k_done\E', .* => ok \| refused\|\|\{"detail": "The router has not heard of the newest growth.", "message": "the router's layout none is not this shard's layout 2"\}/m,
	'at 1.2, a router that sends no layout is refused with a row');
like($before{acquire}, qr/\Q$k_taken\E.* => 55R01 \|/, 'at 1.2, a takeover of a key not owned raises 55R01');
is(scalar(() = $before{matrix} =~ /\|t\|partition/g) > 0, 1, 'the refusal matrix holds refusals of partitions');

# A session that prepared a routed call at 1.2, and a claim in an open
# transaction
my $prepared = $node->background_psql('up');
$prepared->query_safe(qq{SET ROLE app; PREPARE acq(bigint, text) AS
SELECT outcome FROM idempotency.shard_acquire(\$1, \$2, '{"a": 1}', 's', '1 day', '1 hour')});
is($prepared->query_safe(qq{EXECUTE acq(2, '$k_done')}), 'replay', 'a prepared routed call at 1.2');
my $open = $node->background_psql('up');
$open->query_safe(qq{SET ROLE app; BEGIN;
SELECT outcome FROM idempotency.shard_acquire(2, '$k_open', '{"a": 5}', 's', '1 day', '1 hour')});

$node->safe_psql('up', 'ALTER EXTENSION idempotency UPDATE');
is($node->safe_psql('up', q{SELECT extversion FROM pg_extension WHERE extname = 'idempotency'}),
	'1.3', 'the shard is at 1.3');
is( $node->safe_psql('up', q{
SELECT string_agg(p.proname || ':' || l.lanname, ',' ORDER BY p.proname)
  FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
 WHERE p.pronamespace = 'idempotency'::regnamespace
   AND p.proname IN ('shard_acquire', 'shard_refusal', 'shard_key_hash')}),
	'shard_acquire:c,shard_key_hash:c,shard_refusal:c',
	'shard_acquire, shard_refusal and shard_key_hash are C');
is( $node->safe_psql('up', q{
SELECT count(*) FROM pg_proc p
 WHERE p.pronamespace = 'idempotency'::regnamespace
   AND p.proname IN ('shard_acquire', 'shard_refusal', 'shard_key_hash')
   AND has_function_privilege('app', p.oid, 'EXECUTE')}),
	'3', 'the application role keeps EXECUTE on them');

is($prepared->query_safe(qq{EXECUTE acq(2, '$k_done')}), 'replay',
	'the call prepared at 1.2 runs at 1.3');
$open->query_safe(qq{SELECT idempotency.idem_complete('$k_open', 201, '{"id": 5}', 's'); COMMIT});
# (the open transaction held the layout table: the matrix's installs wait
# for it)
is($node->safe_psql('up', $matrix_sql), $before{matrix},
	'shard_refusal answers as at 1.2 in every layout state');
is($node->safe_psql('up', $hash_sql), $before{hash}, 'shard_key_hash answers as at 1.2');
is(acquire_answers(), $before{acquire},
	'shard_acquire answers as at 1.2: rows, refusals, errors; a refused new claim leaves no record');

is( $node->safe_psql('up', qq{
SET ROLE app;
SELECT outcome, response_body FROM idempotency.shard_acquire(2, '$k_open', '{"a": 5}', 's', '1 day', '1 hour');
SELECT idempotency.idem_complete('$k_lease', 201, '{"id": 2}', 's');
SELECT outcome, response_body FROM idempotency.shard_acquire(2, '$k_lease', '{"a": 2}', 's', '1 day', '1 hour');
SELECT outcome, attempt FROM idempotency.shard_acquire(2, '$k_new', NULL, 's', '1 day', '1 hour');
}),
	qq{replay|{"id": 5}\nt\nreplay|{"id": 2}\nacquired|1},
	'the open transaction\'s claim and the running lease complete at 1.3 and replay; a new key is claimed');

# READ COMMITTED: a claim that waited for a layout being written reads the
# layout written (its snapshot is taken after the lock)
my $k_wait = key_in('wait', 2);
my $writer = $node->background_psql('up');
$writer->query_safe(q{BEGIN; LOCK TABLE idempotency.shard_layout IN ACCESS EXCLUSIVE MODE;
UPDATE idempotency.shard_layout SET owned = ARRAY[0]});
my $claimer = $node->background_psql('up');
$claimer->query_until(qr/claiming/, qq{\\echo claiming
SELECT outcome FROM idempotency.shard_acquire(2, '$k_wait', NULL, 's', '1 day', '1 hour');
\\echo claimed
});
ok( $node->poll_query_until('up', q{
SELECT count(*) = 1 FROM pg_locks
 WHERE relation = 'idempotency.shard_layout'::regclass AND NOT granted}),
	'a claim waits for the layout being written');
$writer->query_safe('COMMIT');
like($claimer->query_until(qr/claimed/, ''), qr/^refused$/m,
	'then it is refused by that layout (its partition given away meanwhile)');
is($node->safe_psql('up', qq{SELECT count(*) FROM idempotency.records WHERE key = '$k_wait'}),
	'0', 'and leaves no record');

# REPEATABLE READ: a layout changed since the transaction's snapshot is a
# serialization failure, where 1.2 checked the claim against the old one
$node->safe_psql('up', 'UPDATE idempotency.shard_layout SET owned = ARRAY[0, 2]');
my $k_rr = key_in('rr', 2);
my $rr = $node->background_psql('up');
$rr->query_safe(q{CREATE TEMP TABLE rr_result (sqlstate text);
BEGIN ISOLATION LEVEL REPEATABLE READ;
SELECT count(*) FROM idempotency.records});
$node->safe_psql('up', 'UPDATE idempotency.shard_layout SET owned = ARRAY[0]');
my $rr_claim = qq{
DO \$\$
BEGIN
    PERFORM * FROM idempotency.shard_acquire(2, '$k_rr', NULL, 's', '1 day', '1 hour');
    INSERT INTO rr_result VALUES ('ok');
EXCEPTION WHEN OTHERS THEN
    INSERT INTO rr_result VALUES (SQLSTATE);
END
\$\$;
SELECT sqlstate FROM rr_result;
ROLLBACK;};
is($rr->query_safe($rr_claim), '40001',
	'under REPEATABLE READ, a claim whose snapshot predates the layout fails with 40001');
$rr->query_safe(q{BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM idempotency.records});
is($rr->query_safe($rr_claim), 'ok',
	'and with no change since its snapshot, it is answered (a row)');
is($node->safe_psql('up', qq{SELECT count(*) FROM idempotency.records WHERE key = '$k_rr'}),
	'0', 'neither left a record');

$rr->quit;
$writer->quit;
$claimer->quit;
$prepared->quit;
$open->quit;
done_testing();
