# Copyright (c) idempotency authors
#
# idempotency_proxy: a router and 4 shards (PL/Proxy), on 127.0.0.1.
#   - the contract's outcomes through the router are those of a direct
#     call: one script of calls (claims, lease takeover, completion, fenced
#     claims, release, extend, lookup, tokens, bad input) run on the router
#     and on a plain node prints the same;
#   - session_bound => true raises 0A000 through the router; the router
#     refuses CREATE EXTENSION idempotency, and the other way round;
#   - an application role with README's grants works through the router;
#     PL/Proxy connects as that role, so the shards' grants apply (42501);
#   - the router passes its own default ttl and lease;
#   - 8 clients x the same 150 keys: exactly one acquired per key, the rest
#     replay or in_progress, one record per key in the whole cluster;
#   - the in-transaction pattern: an endpoint function on the shards, routed
#     by the same key, 8 clients x duplicates make one payment per key;
#   - 100,000 keys claimed through the router land on the shards within
#     +-10% of a quarter each, each on the shard its hash names;
#   - statistics and maintenance sum the shards; 3 servers mapped over 64
#     partitions count each server once;
#   - a shard stopped: its keys fail with 08006 naming the server (the
#     first call of a session whose cached connection it ended included),
#     the others keep working; back up, nothing is lost.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::RealBin/lib";
use IdemTest;
use IdemProxy;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use List::Util qw(shuffle);

skip_without_plproxy();

my @shards = proxy_shards(4, 'shard');
my $direct = idem_node(
	'direct', q{
shared_preload_libraries = 'pg_cron,idempotency'
idempotency.wait_timeout = 0
});
my $router = proxy_router('router', @shards);

# which shard (0..3) holds the live record of (scope, key), by looking
sub holder
{
	my ($scope, $key) = @_;
	my @h;
	for my $i (0 .. $#shards)
	{
		push @h, $i
		  if $shards[$i]->safe_psql('postgres',
			"SELECT count(*) FROM idempotency.idem_lookup('$key', '$scope')")
		  eq '1';
	}
	return join(',', @h);
}

# ------------------------------------------------------------------
# The contract, through the router and direct
my $contract = <<'EOF';
\set VERBOSITY sqlstate
\pset null '<null>'
SELECT outcome, response_status, response_body, attempt, claim IS NOT NULL AS has_claim, retry_after, expires_at > now() + '23h' AS default_ttl
  FROM idempotency.idem_acquire('c1', '{"amount": 10}', 'user:1/pay', lease => '30s');
SELECT outcome, attempt, claim IS NULL AS no_claim, retry_after BETWEEN 25 AND 30 AS retry_after_lease
  FROM idempotency.idem_acquire('c1', '{"amount": 10}', 'user:1/pay');
SELECT outcome FROM idempotency.idem_acquire('c1', '{"amount": 11}', 'user:1/pay');
SELECT status, response_status, attempt, locked_until - created_at AS lease, owner_pid
  FROM idempotency.idem_lookup('c1', 'user:1/pay');
SELECT claim AS c2 FROM idempotency.idem_acquire('c2', NULL, 'user:1/pay', lease => '20s') \gset
SELECT idempotency.idem_extend('c2', 'user:1/pay', :'c2', '40s') - now() > '39s' AS extended;
SELECT idempotency.idem_complete('c2', 201, '{"id": 7}', 'user:1/pay', claim => gen_random_uuid());
SELECT idempotency.idem_complete('c2', 201, '{"id": 7}', 'user:1/pay', claim => :'c2');
SELECT idempotency.idem_complete('c2', 201, '{"id": 8}', 'user:1/pay', claim => :'c2');
SELECT outcome, response_status, response_body, attempt FROM idempotency.idem_acquire('c2', NULL, 'user:1/pay');
SELECT status, response_status, response_body, attempt, completed_at IS NOT NULL FROM idempotency.idem_lookup('c2', 'user:1/pay');
SELECT claim AS c3 FROM idempotency.idem_acquire('c3', '[1,2]', lease => '10s') \gset
SELECT idempotency.idem_release('c3', claim => gen_random_uuid());
SELECT idempotency.idem_release('c3', '', 1, :'c3');
SELECT idempotency.idem_release('c3', '', 1, :'c3');
SELECT outcome, attempt FROM idempotency.idem_acquire('c3', '[1,2]');
SELECT idempotency.idem_extend('nothing', '', NULL, '1s');
SELECT outcome, attempt FROM idempotency.idem_acquire('c4', '{}', ttl => '1h', lease => '0.2s');
SELECT pg_sleep(0.3);
SELECT outcome, attempt, claim IS NOT NULL FROM idempotency.idem_acquire('c4', '{}');
SELECT idempotency.idem_complete('c4', 500, '{"e": 1}', attempt => 1);
SELECT expires_at - created_at AS ttl FROM idempotency.idem_lookup('c4');
SELECT count(*) FROM idempotency.idem_lookup('never');
SELECT idempotency.idem_complete('never', 200);
SELECT idempotency.idem_release('never');
SELECT * FROM idempotency.idem_acquire(NULL);
SELECT * FROM idempotency.idem_acquire('');
SELECT * FROM idempotency.idem_acquire(repeat('k', 256));
SELECT * FROM idempotency.idem_acquire('x', scope => NULL);
SELECT * FROM idempotency.idem_acquire('x', ttl => '0s');
SELECT * FROM idempotency.idem_acquire('x', ttl => '30 days');
SELECT * FROM idempotency.idem_acquire('x', ttl => '1h', lease => '2h');
SELECT idempotency.idem_complete('c3', 700);
SELECT idempotency.idem_complete('c3', NULL);
SELECT idempotency.idem_complete('c3', 200, attempt => 0);
SELECT idempotency.idem_request_hash('{"b": 1, "a": [1, 2]}') = sha256(convert_to('{"a": [1, 2], "b": 1}', 'UTF8'));
SELECT idempotency.idem_token_issue('form') AS t1 \gset
SELECT idempotency.idem_token_issue('form', '1h') AS t2 \gset
SELECT :'t1' ~ '^[A-Za-z0-9_-]+$' AND length(:'t1') >= 22 AS token_url_safe;
SELECT idempotency.idem_token_consume(:'t1', 'other');
SELECT idempotency.idem_token_consume(:'t1', 'form');
SELECT idempotency.idem_token_consume(:'t1', 'form');
SELECT idempotency.idem_token_consume(:'t2', 'form');
SELECT idempotency.idem_token_consume('no such token', 'form');
SELECT idempotency.idem_token_consume(NULL, 'form');
SELECT idempotency.idem_token_consume('', 'form');
SELECT idempotency.idem_token_issue('form', '0s');
SELECT outcome FROM idempotency.idem_acquire(:'t2', NULL, 'form');
EOF
my ($r_ret, $r_out, $r_err) = $router->psql('postgres', $contract, on_error_stop => 0);
my ($d_ret, $d_out, $d_err) = $direct->psql('postgres', $contract, on_error_stop => 0);
# PL/Proxy reports that it drops the connection that an error left
# behind, on the next call to that shard (NOTICE "dropping stale conn")
(my $r_errors = $r_err) =~ s/^psql:<stdin>:\d+: NOTICE:  00000\n?//mg;
$r_errors =~ s/\n\z//;
is($r_out, $d_out, 'the contract through the router: the same results as direct');
is($r_errors, $d_err, 'the same errors (SQLSTATEs) as direct');
like($d_out, qr/^acquired\|<null>\|<null>\|1\|t\|<null>\|t$/m,
	'(the direct run did claim)');
is(join(',', sort { $a cmp $b } keys %{ { map { $_ => 1 } ($d_err =~ /ERROR:  (\w{5})/g) } }),
	'22004,22023,55000,P0002', '(and did raise the contract errors)');
note "router stderr:\n$r_err" if $r_errors ne $d_err;

# a router token names its partition and ends with a check of the rest:
# changing any character of its tail (routing value or check) answers
# false, whichever shard the changed value names (the issue's overlay at
# 33 named the same shard and consumed the token), and leaves it
# consumable
is( $router->safe_psql('postgres', q{
SELECT idempotency.idem_token_issue('tamper') AS t \gset
SELECT length(:'t'), :'t' ~ '^[A-Za-z0-9_-]{42}$';
SELECT idempotency.idem_token_consume(substr(:'t', 1, 32) || idempotency.token_tag(idempotency.token_hash(:'t') # 1), 'tamper');
SELECT string_agg(DISTINCT idempotency.idem_token_consume(
           overlay(:'t' PLACING CASE WHEN substr(:'t', i, 1) = c THEN 'z' ELSE c END FROM i FOR 1), 'tamper')::text, ',')
  FROM generate_series(33, 42) i, unnest(ARRAY['B', 'A', 'Q', 'g', 'w', '-']) c;
SET idempotency.legacy_tokens = off;
SELECT idempotency.idem_token_consume(substr(:'t', 1, 38), 'tamper');
SELECT idempotency.idem_token_consume(:'t', 'tamper');
SELECT idempotency.idem_token_consume(:'t', 'tamper');}),
	"42|t\nf\nfalse\nf\nt\nf",
	'a router token is 42 URL-safe characters; with any character of its tail changed it answers false, as it is once');

my ($state, $out, $err) = sqlstate_of_psql($router, 'postgres',
	"SELECT * FROM idempotency.idem_acquire('sb', session_bound => true)");
is($state, '0A000', 'session_bound => true through the router raises 0A000');
like($err, qr/outlives the client/, 'saying why');
is( $router->safe_psql('postgres',
		"SELECT outcome FROM idempotency.idem_acquire('sb', session_bound => false)"),
	'acquired',
	'session_bound => false is a lease claim');

($state, $out, $err) = sqlstate_of_psql($router, 'postgres',
	'CREATE EXTENSION idempotency');
is($state, '42710', 'CREATE EXTENSION idempotency in the router database is refused');
like($err, qr/cannot be created in a database that has extension "idempotency_proxy"/,
	'with a clear message');
($state, $out, $err) = sqlstate_of_psql($shards[0], 'postgres',
	'CREATE EXTENSION idempotency_proxy CASCADE');
is($state, '42710', 'and idempotency_proxy beside idempotency too');

# The block of proxy/README.md that follows the text $after, as written.
sub proxy_readme_block
{
	my ($after) = @_;
	open my $fh, '<', "$FindBin::RealBin/../proxy/README.md" or die "proxy/README.md: $!";
	local $/;
	my $text = <$fh>;
	close $fh;
	$text =~ /\Q$after\E.*?```sql\n(.*?)```/s or die "no block after '$after' in proxy/README.md";
	return $1;
}

# An application role with the grants README gives, on the router and on
# the shards (and proxy/README's grants on the shards); PL/Proxy connects
# to the shards as that role
$_->safe_psql('postgres', "CREATE ROLE app LOGIN;\n"
	  . sql_fixture('readme_grants.sql', app_role => 'app')
	  . sql_fixture('readme_token_grants.sql', app_role => 'app')
	  . proxy_readme_block('Grants on the shards'))
  for @shards;
$router->safe_psql('postgres', q{
CREATE ROLE app LOGIN;
CREATE ROLE stranger LOGIN;
GRANT USAGE ON SCHEMA idempotency TO app, stranger;
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA idempotency TO app;
GRANT SELECT ON idempotency.cluster_state TO app;
GRANT USAGE ON FOREIGN SERVER idempotency_cluster TO app;});
($state, $out, $err) = sqlstate_of_psql($router, 'postgres', q{
SELECT claim AS c FROM idempotency.idem_acquire('priv1', '{}', 'app', lease => '10s') \gset
SELECT idempotency.idem_complete('priv1', 200, '{}', 'app', claim => :'c');
SELECT outcome FROM idempotency.idem_acquire('priv1', '{}', 'app');
SELECT idempotency.idem_token_consume(idempotency.idem_token_issue('app'), 'app');
SELECT current_user;}, extra_params => [ '-U', 'app' ]);
is("$state\n$out", "ok\nt\nreplay\nt\napp",
	'an application role with the README grants works through the router');
$_->safe_psql('postgres', 'CREATE ROLE halfway LOGIN') for @shards;
$router->safe_psql('postgres', q{
CREATE ROLE halfway LOGIN;
GRANT USAGE ON SCHEMA idempotency TO halfway;
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA idempotency TO halfway;
GRANT SELECT ON idempotency.cluster_state TO halfway;
GRANT USAGE ON FOREIGN SERVER idempotency_cluster TO halfway;});
($state, $out, $err) = sqlstate_of_psql($router, 'postgres',
	q{SELECT * FROM idempotency.idem_acquire('priv2')},
	extra_params => [ '-U', 'halfway', '-v', 'VERBOSITY=verbose' ]);
is($state, '42501',
	'a role with the router grants but none on the shards gets 42501 from the shard (PL/Proxy connects as the caller)');
($state, $out, $err) = sqlstate_of_psql($router, 'postgres',
	q{SELECT * FROM idempotency.idem_acquire('priv2')},
	extra_params => [ '-U', 'stranger', '-v', 'VERBOSITY=verbose' ]);
is($state, '42501', 'a role without the router grants gets 42501')
  or diag $err;

# the router's defaults travel with each call
$router->safe_psql('postgres',
	q{ALTER DATABASE postgres SET idempotency.default_ttl = '2h';
	  ALTER DATABASE postgres SET idempotency.default_lease = '7s'});
is( $router->safe_psql('postgres',
		q{SELECT outcome, expires_at - now() BETWEEN '1h59m' AND '2h1m', retry_after
		    FROM idempotency.idem_acquire('d1');
		  SELECT (locked_until - created_at)::text FROM idempotency.idem_lookup('d1');
		  SELECT outcome, retry_after BETWEEN 6 AND 7 FROM idempotency.idem_acquire('d1');}),
	"acquired|t|\n00:00:07\nin_progress|t",
	"the router's idempotency.default_ttl and default_lease are passed to the shards");
$router->safe_psql('postgres',
	q{ALTER DATABASE postgres RESET idempotency.default_ttl;
	  ALTER DATABASE postgres RESET idempotency.default_lease});

# ------------------------------------------------------------------
# 8 clients x the same 150 keys, in shuffled orders: claim and complete
my @keys = map { "dup$_" } 1 .. 150;
my @scripts;
for my $c (1 .. 8)
{
	my @order = shuffle(@keys);
	push @scripts, join('',
		map {
			"WITH a AS (SELECT * FROM idempotency.idem_acquire('$_', '{\"x\": 1}', 'dup', lease => '60s')) "
			  . "SELECT '$_', a.outcome, CASE WHEN a.outcome = 'acquired' THEN idempotency.idem_complete('$_', 201, '{\"by\": $c}', 'dup', claim => a.claim) END FROM a;\n"
		} @order);
}
my %acquired;
my %other;
my $errors = 0;
for my $r (run_clients($router, 'postgres', @scripts))
{
	$errors++ unless $r->[2] && $r->[1] eq '';
	for my $line (split /\n/, $r->[0])
	{
		my ($k, $outcome) = split /\|/, $line;
		if ($outcome eq 'acquired') { $acquired{$k}++ }
		else { $other{$outcome}++ }
	}
}
is($errors, 0, '8 clients x duplicates through the router: no client failed');
is(scalar(grep { ($acquired{$_} // 0) == 1 } @keys),
	150, 'exactly one acquired per key');
is(join(',', sort grep { $_ ne 'replay' && $_ ne 'in_progress' } keys %other),
	'', 'the other answers were replay or in_progress');
is((sum_shards("SELECT count(*) FROM idempotency.records WHERE scope = 'dup' AND status = 'completed'")),
	150, 'one completed record per key in the whole cluster');

sub sum_shards
{
	my ($sql, @nodes) = @_;
	@nodes = @shards unless @nodes;
	my $sum = 0;
	$sum += $_->safe_psql('postgres', $sql) for @nodes;
	return $sum;
}

# ------------------------------------------------------------------
# The in-transaction pattern: the endpoint lives on the shards, next to
# its table, and the router routes it by the same key
for my $s (@shards)
{
	$s->safe_psql('postgres', q{
CREATE SCHEMA app;
CREATE TABLE app.payments (id bigserial PRIMARY KEY, idempotency_key text NOT NULL,
                           user_id int NOT NULL, amount int NOT NULL);
CREATE FUNCTION app.pay(key text, user_id int, amount int,
                        layout bigint DEFAULT NULL,
                        OUT status int, OUT body jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    a       record;
    scope   text := 'user:' || user_id || '/payments';
    req     jsonb := jsonb_build_object('amount', amount);
    pid     bigint;
BEGIN
    SELECT * INTO a FROM idempotency.idem_acquire(key, req, scope);
    CASE a.outcome
    WHEN 'replay' THEN status := a.response_status; body := a.response_body;
    WHEN 'in_progress' THEN status := 409; body := jsonb_build_object('retry_after', a.retry_after);
    WHEN 'mismatch' THEN status := 422; body := '{}';
    ELSE
        IF a.attempt = 1 THEN
            -- 55R01 (rolls the claim back) unless this shard may claim
            -- the key for a router at that layout
            PERFORM idempotency.shard_owns(scope, key, layout);
        END IF;
        INSERT INTO app.payments (idempotency_key, user_id, amount)
        VALUES (key, user_id, amount) RETURNING id INTO pid;
        status := 201; body := jsonb_build_object('payment_id', pid);
        PERFORM idempotency.idem_complete(key, status, body, scope);
    END CASE;
END
$$;});
}
$router->safe_psql('postgres', q{
CREATE SCHEMA app;
CREATE FUNCTION app.pay(key text, user_id int, amount int,
                        layout bigint DEFAULT idempotency.layout_version(),
                        OUT status int, OUT body jsonb)
LANGUAGE plproxy AS $$
    CLUSTER idempotency.key_cluster('user:' || user_id || '/payments', key);
    RUN ON idempotency.key_hash('user:' || user_id || '/payments', key);
$$;});
@scripts = ();
for my $c (1 .. 8)
{
	push @scripts, join('',
		map { "SELECT '$_', status FROM app.pay('pay$_', $_ % 7, 100 + $_);\n" }
		  shuffle(1 .. 60));
}
my %st;
$errors = 0;
for my $r (run_clients($router, 'postgres', @scripts))
{
	$errors++ unless $r->[2] && $r->[1] eq '';
	$st{ (split /\|/, $_)[1] }++ for split /\n/, $r->[0];
}
is($errors, 0, 'in-transaction endpoint through the router: no client failed');
is(sum_shards('SELECT count(*) FROM app.payments'), 60,
	'8 clients x 60 keys: one payment per key in the whole cluster');
is(sum_shards('SELECT count(DISTINCT idempotency_key) FROM app.payments'),
	60, '(each key once)');
is(join(',', grep { $_ ne '201' && $_ ne '409' } sort keys %st), '',
	'every answer is 201 (first or replayed) or 409 (in progress)');

# ------------------------------------------------------------------
# Spread: 100,000 keys claimed through the router
$router->safe_psql('postgres',
	q{SELECT count(*) FROM generate_series(1, 100000) i,
	         LATERAL idempotency.idem_acquire('spread' || i, NULL, 'spread', ttl => '1h') a
	   WHERE a.outcome = 'acquired'});
my @counts = map {
	$_->safe_psql('postgres',
		"SELECT count(*) FROM idempotency.records WHERE scope = 'spread'")
} @shards;
is(eval { my $t = 0; $t += $_ for @counts; $t }, 100000,
	'100,000 keys through the router: 100,000 records on the shards');
is(scalar(grep { $_ >= 22500 && $_ <= 27500 } @counts),
	4, "each shard holds 25,000 +-10% (@counts)");
my @wrong = map {
	my $i = $_;
	$shards[$i]->safe_psql('postgres',
		qq{SELECT count(*) FROM idempotency.records r
		    WHERE r.scope = 'spread'
		      AND ('x' || encode(substr(sha256(convert_to(r.scope, 'UTF8') || '\\x00'::bytea || convert_to(r.key, 'UTF8')), 1, 4), 'hex'))::bit(32)::int & 3 <> $i})
} 0 .. 3;
is("@wrong", '0 0 0 0', 'each record is on the shard that its key_hash names');

# ------------------------------------------------------------------
# Statistics and maintenance sum the shards
my $cols = 'acquired, replayed, in_progress, mismatched, completed, released, tokens_issued, tokens_consumed';
my @sum = (0) x 8;
for my $s (@shards)
{
	my @v = split /\|/,
	  $s->safe_psql('postgres',
		"SELECT $cols FROM idempotency.stats WHERE datname = 'postgres'");
	$sum[$_] += $v[$_] for 0 .. 7;
}
is($router->safe_psql('postgres', "SELECT $cols FROM idempotency.stats"),
	join('|', @sum), 'idempotency.stats on the router: the sums of the shards');
ok($sum[0] > 100000, '(which counted the claims)');
is( $router->safe_psql('postgres',
		"SELECT count = (SELECT acquire_duration_count FROM idempotency.idem_stats()) FROM idempotency.acquire_duration WHERE le = 'Infinity'"),
	't', 'the summed histogram counts every acquire');
$_->safe_psql('postgres', 'DELETE FROM idempotency.daily') for @shards;
is($router->safe_psql('postgres', 'SELECT count(*) FROM idempotency.idem_maintain()'),
	'1', 'idem_maintain() on the router: one row of sums');
is(sum_shards("SELECT count(*) FROM idempotency.daily WHERE datname = 'postgres'"),
	4, 'it ran on every shard (each wrote its daily row)');

# 3 servers: 64 partitions, 22/21/21, each server counted once
is( $router->safe_psql('postgres',
		q{SELECT string_agg(n::text, '/' ORDER BY s) FROM (
		    SELECT s, count(*) n FROM unnest(idempotency.partition_map(ARRAY['a', 'b', 'c'])) s GROUP BY s) x}),
	'22/21/21', '3 servers map over 64 partitions: 22, 21 and 21');
# (a cluster of its own: databases three on 3 of the shard servers; the
# shards' databases postgres know the 4-server layout, which a router
# declared over them would take)
$router->safe_psql('postgres', 'CREATE DATABASE three');
$router->safe_psql('three', 'CREATE EXTENSION idempotency_proxy CASCADE');
for my $s (@shards[ 0 .. 2 ])
{
	$s->safe_psql('postgres', 'CREATE DATABASE three');
	$s->safe_psql('three', 'CREATE EXTENSION idempotency');
	$s->safe_psql('three', q{SELECT count(*) FROM idempotency.idem_acquire('warm')});
}
$router->safe_psql('three',
	'SELECT count(*) FROM idempotency.cluster_create(ARRAY['
	  . join(', ', map { "'" . (shard_connstr($_) =~ s/dbname=postgres/dbname=three/r) . "'" } @shards[ 0 .. 2 ])
	  . '])');
my $acq3 = 0;
$acq3 += $_->safe_psql('three', "SELECT acquired FROM idempotency.stats WHERE datname = 'three'") for @shards[ 0 .. 2 ];
is($router->safe_psql('three', 'SELECT acquired FROM idempotency.stats'),
	$acq3, 'with 3 servers over 64 partitions, RUN ON ALL counts each server once');
$router->safe_psql('three',
	q{SELECT count(*) FROM generate_series(1, 3000) i, idempotency.idem_acquire('three' || i, NULL, 'three')});
my @c3 = map { $_->safe_psql('three', "SELECT count(*) FROM idempotency.records WHERE scope = 'three'") } @shards[0..2];
is(scalar(grep { $_ >= 900 && $_ <= 1100 } @c3), 3, "3 servers: 3,000 keys spread 1,000 +-10% (@c3)");

# ------------------------------------------------------------------
# One shard stopped
my @live = map { "live$_" } 1 .. 40;
$router->safe_psql('postgres', join('',
	map { "SELECT outcome FROM idempotency.idem_acquire('$_', NULL, 'live');
	       SELECT idempotency.idem_complete('$_', 200, '{\"k\": \"$_\"}', 'live');\n" } @live));
my %home = map { $_ => holder('live', $_) } @live;
my @on2 = grep { $home{$_} eq '2' } @live;
ok(@on2 > 0 && @on2 < 40, scalar(@on2) . ' of 40 keys live on shard 2');
# two router sessions that have just called shard 2: their cached
# connections are ended by its shutdown (57P01 on the next use)
my @sessions = map { $router->background_psql('postgres', on_error_stop => 0) } 1 .. 2;
$_->query_safe("SELECT count(*) FROM idempotency.idem_lookup('$on2[0]', 'live')") for @sessions;
$shards[2]->stop('fast');
my $first_ok = 0;
for my $s (@sessions)
{
	$s->query("\\set VERBOSITY sqlstate\nSELECT outcome FROM idempotency.idem_acquire('$on2[0]', NULL, 'live')");
	$first_ok++ if $s->{stderr} =~ /ERROR:  08006/;
	note "first call after the shard stopped: $s->{stderr}";
	$s->{stderr} = '';
	$s->quit;
}
is($first_ok, 2, 'shard 2 stopped: the first call of a session whose connection it ended is 08006 too (not 57P01)');
my ($fail_ok, $work_ok) = (0, 0);
for my $k (@live)
{
	($state, $out, $err) = sqlstate_of_psql($router, 'postgres',
		"SELECT outcome, response_body FROM idempotency.idem_acquire('$k', NULL, 'live')");
	if ($home{$k} eq '2')
	{
		my $port = $shards[2]->port;
		$fail_ok++
		  if $state eq '08006'
		  && $err =~ /idempotency shard unavailable/
		  && $err =~ /DETAIL:  .*connection to server at "127\.0\.0\.1", port $port failed/;
	}
	else
	{
		$work_ok++ if $state eq 'ok' && $out eq "replay|{\"k\": \"$k\"}";
	}
}
is($fail_ok, scalar(@on2), 'shard 2 stopped: each of its keys fails with 08006 (connection_failure) naming the server');
is($work_ok, 40 - @on2, 'every other key keeps working (replay)');
my $newkey = $router->safe_psql('postgres',
	q{SELECT 'new' || i FROM generate_series(1, 100) i
	   WHERE idempotency.key_hash('live', 'new' || i) & 3 <> 2 LIMIT 1});
is( $router->safe_psql('postgres',
		"SELECT outcome FROM idempotency.idem_acquire('$newkey', NULL, 'live')"),
	'acquired', 'a new key of another shard is claimed meanwhile');
$shards[2]->start;
my $back = 0;
for my $k (@live)
{
	$back++ if $router->safe_psql('postgres',
		"SELECT outcome, response_body FROM idempotency.idem_acquire('$k', NULL, 'live')")
	  eq "replay|{\"k\": \"$k\"}";
}
is($back, 40, 'shard 2 back: every key replays its stored response, nothing lost');

done_testing();
