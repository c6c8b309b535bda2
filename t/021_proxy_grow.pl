# Copyright (c) idempotency authors
#
# idempotency_proxy: growing from 2 shards to 4 without losing a live key
# or executing one twice.
#   - before: keys completed, keys in progress (leases held by their
#     callers, one whose lease has run out), one-time tokens, on 2 shards;
#   - cluster_grow() to 4 shards while 8 clients claim and complete keys
#     through the router: each key is executed (acquired) exactly once and
#     has one record in the whole cluster;
#   - after: every completed key replays its response from its previous
#     shard, in-progress keys answer in_progress and their holders complete
#     them there, a released key is claimed afresh on its new shard, the
#     expired lease is taken over once among 8 racing clients, every token
#     is consumed exactly once;
#   - an application endpoint on the shards, routed with key_cluster(),
#     replays the 40 payments made before the growth and makes none twice;
#   - cluster_growth_finish() is refused while the previous shards hold
#     live records of moved keys, and succeeds once they have expired.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::RealBin/lib";
use IdemTest;
use IdemProxy;
use List::Util qw(shuffle);
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time);

skip_without_plproxy();

my @shards = proxy_shards(4, 'g');
my $router = proxy_router('grouter', @shards[ 0, 1 ]);

sub q1 { return $router->safe_psql('postgres', $_[0]) }

# where(scope, key): the shards (0..3) holding a live record
sub where
{
	my ($scope, $key) = @_;
	return homes($scope, $key)->{$key};
}

# homes(scope, keys...): key => the shards (0..3) holding a live record of
# it ('' for none), one query per shard
sub homes
{
	my ($scope, @keys) = @_;
	my %home = map { $_ => [] } @keys;
	my $list = join(', ', map { "'$_'" } @keys);
	foreach my $i (0 .. 3)
	{
		push @{ $home{$_} }, $i for split /\n/, $shards[$i]->safe_psql('postgres',
			"SELECT DISTINCT key FROM idempotency.records
			  WHERE scope = '$scope' AND key IN ($list) AND NOT is_token AND expires_at > now()");
	}
	return { map { $_ => join(',', @{ $home{$_} }) } @keys };
}

# moved(scope, keys...): those of the keys that 4-shard placement puts
# elsewhere, in their order, from one query
sub moved
{
	my ($scope, @keys) = @_;
	my %moves = map { $_ => 1 } split /\n/, q1(
		"SELECT k FROM unnest(ARRAY[" . join(', ', map { "'$_'" } @keys) . "]) k
		  WHERE idempotency.key_hash('$scope', k) & 2 <> 0");
	return grep { $moves{$_} } @keys;
}

# ------------------------------------------------------------------
# Before: 2 shards.  Records live 90 seconds, or twice what the test's
# psql calls from their making to their last check take on this machine,
# measured now, where that is longer: short, so that the window can be seen
# to close within the test, and long enough that what is made before the
# growth is still live (and the held keys' leases, 10 s shorter, still
# run) when the checks after it read it.  With the machine five times
# overloaded those checks came 83 s after the records were made, and 99 s
# after beside two busy loops while others ran their tests: fixed windows of
# 90 s and 80 s ran out.
my $calls = 400;    # about: one per q1() or shard query, up to the payments' replays
my $t_calib = time;
q1("SELECT count(*) FROM idempotency.idem_lookup('calibrate$_', 'g')") for 1 .. 10;
my $call_secs = (time - $t_calib) / 10;
my $ttl_secs = window_secs($calls * $call_secs, 2, 90);
my $ttl = "${ttl_secs}s";
my $lease = ($ttl_secs - 10) . 's';
note sprintf('a psql call takes %.2f s: records of %s, held leases of %s',
	$call_secs, $ttl, $lease);
my $t_made = time;
my @done = map { "done$_" } 1 .. 60;
q1(join('', map {
	"SELECT count(*) FROM idempotency.idem_acquire('$_', '{\"n\": 1}', 'g', ttl => '$ttl');
	 SELECT idempotency.idem_complete('$_', 201, '{\"key\": \"$_\"}', 'g');\n"
} @done));
my @held = map { "held$_" } 1 .. 20;
my %claim;
for my $k (@held)
{
	$claim{$k} = q1("SELECT claim FROM idempotency.idem_acquire('$k', NULL, 'g', ttl => '$ttl', lease => '$lease')");
}
my @stale = moved('g', map { "stale$_" } 1 .. 20);
q1("SELECT count(*) FROM idempotency.idem_acquire('$_', NULL, 'g', ttl => '$ttl', lease => '0.5s')")
  for @stale;
my @tokens = map { q1("SELECT idempotency.idem_token_issue('form', '$ttl')") } 1 .. 30;

# An application's own endpoint, in one shard transaction (README), routed
# by idempotency.key_cluster() so that it follows its key's record
for my $s (@shards)
{
	$s->safe_psql('postgres', q{
CREATE SCHEMA app;
CREATE TABLE app.payments (id bigserial PRIMARY KEY, idempotency_key text NOT NULL);
CREATE FUNCTION app.pay(key text, OUT status int, OUT body jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    a record;
    pid bigint;
BEGIN
    SELECT * INTO a FROM idempotency.idem_acquire(key, NULL, 'pay', ttl => :'ttl');
    IF a.outcome = 'acquired' THEN
        INSERT INTO app.payments (idempotency_key) VALUES (key) RETURNING id INTO pid;
        status := 201;
        body := jsonb_build_object('payment', pid, 'shard', current_setting('port'));
        PERFORM idempotency.idem_complete(key, status, body, 'pay');
    ELSE
        status := coalesce(a.response_status, 409);
        body := a.response_body;
    END IF;
END
$$;} =~ s/:'ttl'/'$ttl'/r);
}
q1(q{
CREATE SCHEMA app;
CREATE FUNCTION app.pay(key text, OUT status int, OUT body jsonb)
LANGUAGE plproxy AS $$
    CLUSTER idempotency.key_cluster('pay', key, '5s');
    RUN ON idempotency.key_hash('pay', key);
$$;});
my %paid = map { $_ => q1("SELECT status, body FROM app.pay('p$_')") } 1 .. 40;

my @moved_done = moved('g', @done);
ok(@moved_done > 10 && @moved_done < 50,
	scalar(@moved_done) . ' of 60 completed keys move to the new shards');
my $home = homes('g', @done, @held);
is(scalar(grep { $home->{$_} =~ /^[01]$/ } @done, @held), 80,
	'before: every record is on shard 0 or 1');

# ------------------------------------------------------------------
# Grow while 8 clients claim and complete keys through the router
my @pool = map { "live$_" } 1 .. 120;
my @scripts;
for my $c (1 .. 8)
{
	push @scripts, "SELECT pg_sleep(0.2);\n" . join('',
		map {
			"WITH a AS (SELECT * FROM idempotency.idem_acquire('$_', NULL, 'g', ttl => '$ttl')) "
			  . "SELECT '$_', a.outcome, CASE WHEN a.outcome = 'acquired' THEN idempotency.idem_complete('$_', 200, '{\"by\": $c}', 'g', claim => a.claim) END FROM a;\n"
		} (shuffle(@pool), shuffle(@pool)));
}
my $grow_sql = 'SELECT count(*) FROM idempotency.cluster_grow(ARRAY['
  . join(', ', map { "'" . shard_connstr($_) . "'" } @shards) . '])';
{
	# the clients, and the growth in the middle of their run
	my @res = run_clients($router, 'postgres', @scripts,
		"SELECT pg_sleep(0.6);\n$grow_sql;\n");
	my $grow = pop @res;
	is($grow->[1], '', 'cluster_grow() to 4 shards while 8 clients work');

	my (%acq, $errs);
	$errs = 0;
	for my $r (@res)
	{
		# a call refused by a shard of the new layout (55R01) is retried by
		# the router; PL/Proxy then says, on the next call to that shard,
		# that it drops the connection the error left behind (a NOTICE)
		(my $e = $r->[1]) =~ s/^[^\n]*NOTICE:  [^\n]*\n?//mg;
		$errs++ unless $r->[2] && $e eq '';
		diag($e) if $e ne '';
		for (split /\n/, $r->[0])
		{
			my ($k, $o) = split /\|/;
			$acq{$k}++ if ($o // '') eq 'acquired';    # pg_sleep's lines have none
		}
	}
	is($errs, 0, 'no client call failed across the switch');
	is(scalar(grep { ($acq{$_} // 0) == 1 } @pool), 120,
		'each key claimed across the switch was acquired exactly once');
	$home = homes('g', @pool);
	is(scalar(grep { $home->{$_} =~ /^\d$/ } @pool), 120,
		'and has exactly one record in the whole cluster');
}
is(q1('SELECT cardinality(connstrs), cardinality(previous) FROM idempotency.cluster_state'),
	'4|2', 'the router now places keys over 4 partitions, consulting the previous 2');

# ------------------------------------------------------------------
# After: nothing lost, nothing run twice
my $replays = 0;
for my $k (@done)
{
	$replays++ if q1("SELECT outcome, response_body FROM idempotency.idem_acquire('$k', '{\"n\": 1}', 'g')")
	  eq "replay|{\"key\": \"$k\"}";
}
is($replays, 60, 'every key completed before the growth replays its response');
$home = homes('g', @moved_done);
is(scalar(grep { $home->{$_} =~ /^[01]$/ } @moved_done), scalar(@moved_done),
	'(the moved ones from their previous shard: no record was made on the new ones)');
is(q1("SELECT count(*) FROM idempotency.idem_lookup('$moved_done[0]', 'g')"),
	'1', 'idem_lookup finds a moved key on its previous shard');

my @moved_held = moved('g', @held);
note sprintf('the held keys are checked %.1f s after they were made (leases of %s)',
	time - $t_made, $lease);
ok(@moved_held > 0, scalar(@moved_held) . ' of 20 held keys moved');
is(scalar(grep { q1("SELECT outcome FROM idempotency.idem_acquire('$_', NULL, 'g')") eq 'in_progress' } @held),
	20, 'every key in progress before the growth answers in_progress');
my $release_key = $moved_held[0];
is(q1("SELECT idempotency.idem_release('$release_key', 'g', claim => '$claim{$release_key}')"),
	't', 'a moved key is released by its holder (on its previous shard)');
my @completed = grep { $_ ne $release_key } @held;
is(scalar(grep { q1("SELECT idempotency.idem_complete('$_', 201, '{\"late\": true}', 'g', claim => '$claim{$_}')") eq 't' } @completed),
	19, 'the holders of the others complete them, wherever they are');
is(scalar(grep { q1("SELECT outcome, response_body FROM idempotency.idem_acquire('$_', NULL, 'g')") eq 'replay|{"late": true}' } @completed),
	19, 'and they replay');
is(q1("SELECT outcome, attempt FROM idempotency.idem_acquire('$release_key', NULL, 'g')"),
	'acquired|1', 'the released key is claimed afresh');
my $new_home = q1("SELECT idempotency.key_hash('g', '$release_key') & 3");
is(where('g', $release_key), $new_home, "on its new shard ($new_home)");

# 8 clients race for the stale leases of moved keys
my @res = run_clients($router, 'postgres',
	map { join('', map { "SELECT '$_', outcome, attempt FROM idempotency.idem_acquire('$_', NULL, 'g');\n" } shuffle(@stale)) } 1 .. 8);
my %take;
for my $r (@res)
{
	for (split /\n/, $r->[0])
	{
		my ($k, $o, $a) = split /\|/;
		$take{$k}++ if $o eq 'acquired';
		$take{"$k attempt $a"}++ if $o eq 'acquired';
	}
}
is(scalar(grep { ($take{$_} // 0) == 1 && ($take{"$_ attempt 2"} // 0) == 1 } @stale),
	scalar(@stale), scalar(@stale) . ' moved keys whose lease ran out: each taken over once (attempt 2) by 8 racing clients');
$home = homes('g', @stale);
is(scalar(grep { $home->{$_} =~ /^[01]$/ } @stale), scalar(@stale),
	'(on their previous shard)');

# tokens made before the growth, consumed twice each by 8 clients
@res = run_clients($router, 'postgres',
	map { join('', map { "SELECT idempotency.idem_token_consume('$_', 'form');\n" } (shuffle(@tokens), @tokens)) } 1 .. 8);
my $true = 0;
$true += () = $_->[0] =~ /^t$/mg for @res;
is($true, 30, 'every token issued before the growth is consumed exactly once');
my $t_new = q1("SELECT idempotency.idem_token_issue('form')");
is(q1("SELECT idempotency.idem_token_consume('$t_new', 'form')") . q1("SELECT idempotency.idem_token_consume('$t_new', 'form')"),
	'tf', 'a token issued after the growth too');

# the endpoint after the growth: every payment made before replays
my @moved_pay = moved('pay', map { "p$_" } 1 .. 40);
ok(@moved_pay > 0, scalar(@moved_pay) . ' of 40 paid keys moved');
is(scalar(grep { q1("SELECT status, body FROM app.pay('p$_')") eq $paid{$_} } 1 .. 40),
	40, 'the routed endpoint: each of 40 payments made before the growth replays the same payment');
my $pays = 0;
$pays += $_->safe_psql('postgres', 'SELECT count(*) FROM app.payments') for @shards;
note sprintf('the payments made before the growth are checked %.1f s after they were made (records of %s)',
	time - $t_made, $ttl);
is($pays, 40, 'no payment was made twice');
q1("SELECT status FROM app.pay('q$_')") for 1 .. 20;
$home = homes('pay', map { "q$_" } 1 .. 20);
is(scalar(grep { $home->{"q$_"} eq q1("SELECT idempotency.key_hash('pay', 'q$_') & 3") } 1 .. 20),
	20, 'new keys are paid on their new shards');

# ------------------------------------------------------------------
# Closing the window
my ($state, $out, $err) = sqlstate_of_psql($router, 'postgres',
	'SELECT idempotency.cluster_growth_finish()');
is($state, '55000', 'cluster_growth_finish() is refused while moved keys live on the previous shards');
like($err, qr/still holds \d+ live records/, 'saying how many');
my $until = q1('SELECT until - now() FROM idempotency.cluster_growth_pending()');
note "waiting $until for the records made before the growth to expire";
q1("SELECT pg_sleep(greatest(0, extract(epoch FROM (SELECT until FROM idempotency.cluster_growth_pending()) - clock_timestamp())) + 0.5)");
is(q1('SELECT pending FROM idempotency.cluster_growth_pending()'), '0',
	'once they expired none is pending');
is(q1('SELECT idempotency.cluster_growth_finish()'), 't', 'and the window closes');
is(q1("SELECT outcome, attempt FROM idempotency.idem_acquire('$moved_done[0]', '{\"n\": 1}', 'g')"),
	'acquired|1', 'an expired moved key is claimed afresh');
is(where('g', $moved_done[0]), q1("SELECT idempotency.key_hash('g', '$moved_done[0]') & 3"),
	'on its new shard');

done_testing();
