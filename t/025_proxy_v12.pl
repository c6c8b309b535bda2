# Copyright (c) idempotency authors
#
# idempotency_proxy 1.2: the main extension's 1.2 functions through the
# router (issue 29), a router and 2 shards (PL/Proxy), on 127.0.0.1:
#   - idem_acquire's trace is stored with the claim and returned as
#     origin_trace on a replay and to in_progress; idem_complete's
#     response_headers are replayed (names in lower case); idem_lookup
#     shows phase, state, response_headers and origin_trace, as the shard
#     holding the key does;
#   - a checkpoint (fenced by the claim: 55000 for another, 22004 with the
#     shard's hint for none, the holder's left as it was) is returned to
#     the takeover of an expired lease, with attempt 2;
#   - idem_forget through the router removes the record on its shard, the
#     next acquire answers acquired with attempt 1; false for no record;
#   - a router updated from 1.1 over a shard still at 1.1: the grants of
#     idem_acquire, idem_complete and idem_lookup are kept (idem_checkpoint
#     gets idem_complete's, idem_forget none); lookup answers 1.1's
#     columns; complete with headers, checkpoint and forget raise 0A000;
#     its functions are those of a router created at 1.2.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::RealBin/lib";
use IdemTest;
use IdemProxy;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

skip_without_plproxy();

my @shards = proxy_shards(2, 'shard');
my $router = proxy_router('router', @shards);

sub r { return $router->safe_psql('postgres', $_[0]); }

# the shard (0 or 1) that holds the live record of (scope, key)
sub holder
{
	my ($scope, $key) = @_;
	my @h = grep {
		$shards[$_]->safe_psql('postgres',
			"SELECT count(*) FROM idempotency.idem_lookup('$key', '$scope')") eq '1'
	} 0 .. $#shards;
	return join(',', @h);
}

my $t1 = '00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01';
my $t2 = '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01';

# ------------------------------------------------------------------
# trace and headers
is( r(  "SELECT outcome, attempt, origin_trace IS NULL, phase IS NULL, response_headers IS NULL
		   FROM idempotency.idem_acquire('k1', '{\"a\": 1}', 's', lease => '1h', trace => '$t1')"),
	'acquired|1|t|t|t',
	'a new key: acquired, the 1.2 columns NULL');
is(r("SELECT outcome, origin_trace FROM idempotency.idem_acquire('k1', '{\"a\": 1}', 's', trace => '$t2')"),
	"in_progress|$t1", 'in_progress returns the trace of the claim');
is( r(  "SELECT idempotency.idem_complete('k1', 201, '{\"id\": 7}', 's',
		   response_headers => '{\"Location\": \"/p/7\", \"ETag\": \"x1\"}')"),
	't', 'idem_complete with response_headers through the router');
is( r(  "SELECT outcome, response_status, response_body, response_headers, origin_trace
		   FROM idempotency.idem_acquire('k1', '{\"a\": 1}', 's', trace => '$t2')"),
	qq(replay|201|{"id": 7}|{"etag": "x1", "location": "/p/7"}|$t1),
	'a replay returns the stored headers and the origin trace');
is(r("SELECT outcome, origin_trace FROM idempotency.idem_acquire('k1', '{\"a\": 2}', 's')"),
	"mismatch|$t1", 'mismatch returns the origin trace');
my $where = holder('s', 'k1');
like($where, qr/^[01]$/, 'one shard holds k1');
my $cols = 'status, response_status, response_headers, origin_trace, phase, state';
is( r("SELECT $cols FROM idempotency.idem_lookup('k1', 's')"),
	$shards[$where]->safe_psql('postgres', "SELECT $cols FROM idempotency.idem_lookup('k1', 's')"),
	'lookup through the router is the shard\'s 1.2 row');
is(r("SELECT origin_trace FROM idempotency.idem_lookup('k1', 's')"), $t1,
	'lookup shows the origin trace');
my ($code) = sqlstate_of_psql($router, 'postgres',
	"SELECT * FROM idempotency.idem_acquire('k9', NULL, 's', trace => repeat('x', 256))");
is($code, '22023', 'a trace over 255 bytes: 22023 from the shard');

# ------------------------------------------------------------------
# checkpoint and takeover
my $claim = r("SELECT claim FROM idempotency.idem_acquire('k2', NULL, 's', lease => '2s')");
($code) = sqlstate_of_psql($router, 'postgres',
	"SELECT idempotency.idem_checkpoint('k2', 's', gen_random_uuid(), 'charged', '{}')");
is($code, '55000', 'a checkpoint with another claim: 55000');
is( r(  "SELECT idempotency.idem_checkpoint('k2', 's', '$claim', 'charged', '{\"charge\": \"ch_1\"}')
		   = locked_until FROM idempotency.idem_lookup('k2', 's')"),
	't', 'a checkpoint returns locked_until, unchanged');
is(r("SELECT phase, state FROM idempotency.idem_lookup('k2', 's')"),
	'charged|{"charge": "ch_1"}', 'lookup shows the checkpoint');
# the claim is required (issue 36): the shard refuses a checkpoint without
# one, with its hint, and the holder's checkpoint stays
my ($hint_out, $hint_err);
($code, $hint_out, $hint_err) = sqlstate_of_psql($router, 'postgres',
	"SELECT idempotency.idem_checkpoint('k2', 's', phase => 'started')");
is($code, '22004', 'a checkpoint without a claim: 22004 from the shard');
like($hint_err, qr/HINT:\s+Remote hint: Pass the claim that idem_acquire returned\./,
	'with the shard\'s hint, as PL/Proxy passes it on');
is(r("SELECT phase, state FROM idempotency.idem_lookup('k2', 's')"),
	'charged|{"charge": "ch_1"}', 'and the holder\'s checkpoint stays');
$router->poll_query_until('postgres',
	"SELECT locked_until < clock_timestamp() FROM idempotency.idem_lookup('k2', 's')")
  or die 'the lease of k2 did not expire';
is( r("SELECT outcome, attempt, phase, state FROM idempotency.idem_acquire('k2', NULL, 's')"),
	'acquired|2|charged|{"charge": "ch_1"}',
	'the takeover gets the last checkpoint');

# ------------------------------------------------------------------
# forget
is(r("SELECT idempotency.idem_forget('k1', 's')"), 't', 'forget a completed key: true');
is(holder('s', 'k1'), '', 'no shard holds k1 any more');
is(r("SELECT outcome, attempt FROM idempotency.idem_acquire('k1', '{\"a\": 2}', 's')"),
	'acquired|1', 'a forgotten key runs again');
is(r("SELECT idempotency.idem_forget('nothing', 's')"), 'f', 'forget of no record: false');

# ------------------------------------------------------------------
# a router updated from 1.1, over a shard still at 1.1
my $old = idem_node('old');
$old->safe_psql('postgres',
	"DROP EXTENSION idempotency; CREATE EXTENSION idempotency VERSION '1.1'");
my $r11 = proxy_router('router11');
$r11->safe_psql('postgres', q{
DROP EXTENSION idempotency_proxy;
CREATE EXTENSION idempotency_proxy VERSION '1.1';
CREATE ROLE app LOGIN;
GRANT USAGE ON SCHEMA idempotency TO app;
GRANT EXECUTE ON FUNCTION idempotency.idem_acquire(text, jsonb, text, interval, interval, boolean),
    idempotency.idem_complete(text, int, jsonb, text, int, uuid),
    idempotency.idem_lookup(text, text) TO app;});
$r11->safe_psql('postgres',
	"SELECT count(*) FROM idempotency.cluster_create(ARRAY['" . shard_connstr($old) . "'])");
my $o1_claim = $old->safe_psql('postgres',
	"SELECT claim FROM idempotency.idem_acquire('o1', NULL, 's', lease => '1h')");
$r11->safe_psql('postgres', "ALTER EXTENSION idempotency_proxy UPDATE TO '1.2'");
is( $r11->safe_psql('postgres', q{
SELECT string_agg(f || '=' || has_function_privilege('app', f, 'EXECUTE'), ' ' ORDER BY f)
  FROM unnest(ARRAY[
    'idempotency.idem_acquire(text, jsonb, text, interval, interval, boolean, text)',
    'idempotency.idem_checkpoint(text, text, uuid, text, jsonb)',
    'idempotency.idem_complete(text, int, jsonb, text, int, uuid, jsonb)',
    'idempotency.idem_forget(text, text)',
    'idempotency.idem_lookup(text, text)']) f}),
	'idempotency.idem_acquire(text, jsonb, text, interval, interval, boolean, text)=true '
	  . 'idempotency.idem_checkpoint(text, text, uuid, text, jsonb)=true '
	  . 'idempotency.idem_complete(text, int, jsonb, text, int, uuid, jsonb)=true '
	  . 'idempotency.idem_forget(text, text)=false '
	  . 'idempotency.idem_lookup(text, text)=true',
	'the update keeps the grants of the 1.1 functions');
is($r11->safe_psql('postgres',
	"SELECT status, attempt, phase IS NULL, origin_trace IS NULL FROM idempotency.idem_lookup('o1', 's')"),
	'processing|1|t|t', 'lookup over a 1.1 shard: its 1.1 row, the 1.2 columns NULL');
for my $call (
	"SELECT idempotency.idem_complete('o1', 200, NULL, 's', response_headers => '{}')",
	"SELECT idempotency.idem_checkpoint('o1', 's', '$o1_claim', 'p', NULL)",
	"SELECT idempotency.idem_forget('o1', 's')")
{
	($code) = sqlstate_of_psql($r11, 'postgres', $call);
	(my $shown = $call) =~ s/'\Q$o1_claim\E'/its claim/;
	is($code, '0A000', "over a 1.1 shard: $shown raises 0A000");
}
is($r11->safe_psql('postgres', "SELECT idempotency.idem_complete('o1', 200, NULL, 's')"),
	't', 'idem_complete without headers works over a 1.1 shard');

# the updated router's functions are the fresh 1.2 router's
my $defs = q{
SELECT string_agg(p.oid::regprocedure::text || ' ' || pg_get_function_result(p.oid)
                  || ' ' || md5(p.prosrc) || ' ' || p.provolatile::text || p.prorows, E'\n'
                  ORDER BY p.oid::regprocedure::text)
  FROM pg_proc p WHERE p.pronamespace = 'idempotency'::regnamespace};
is($r11->safe_psql('postgres', $defs), $router->safe_psql('postgres', $defs),
	'a router updated from 1.1 has the functions of a fresh 1.2 one');

done_testing();
