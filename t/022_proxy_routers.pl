# Copyright (c) idempotency authors
#
# idempotency_proxy with more than one router (issue 28): a key never runs
# on two shards, whatever the routers believe.
#   - two routers over the same 2 shards serve 8 clients (4 each) while the
#     first grows the cluster to 4 shards; the second is never told: every
#     key is acquired once and makes one business row, one record in the
#     cluster;
#   - a third router, idle and still on the old layout, answers a moved
#     key that was completed on its new shard with its replay (it is not
#     claimed again on its old shard), and then routes by the new layout;
#   - a router rebuilt from nothing, declared over any one shard, reads
#     the layout back from the shards and serves at once;
#   - a monitoring role with exactly the grants docs/reference.md (shards) and
#     proxy/README.md (router) give reads the router's statistics views;
#   - a shard refuses a claim of a key it does not own, and one of a key
#     that moved to it from a router at another layout, with a row
#     (outcome refused) and no record left; a key that did not move is
#     claimed from a router at any layout; the look at a previous shard
#     at another layout raises SQLSTATE 55R01.

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

skip_without_plproxy();

my @shards = proxy_shards(4, 'm');
my @old = @shards[ 0, 1 ];
my $r1 = proxy_router('mrouter1', @old);
my $r2 = proxy_router('mrouter2', @old);
my $r3 = proxy_router('mrouter3', @old);

sub on { my ($node, $sql) = @_; return $node->safe_psql('postgres', $sql) }

# homes(scope, keys...): key => the shards (0..3) holding a live record
sub homes
{
	my ($scope, @keys) = @_;
	my %home = map { $_ => [] } @keys;
	my $list = join(', ', map { "'$_'" } @keys);
	foreach my $i (0 .. 3)
	{
		push @{ $home{$_} }, $i for split /\n/, on($shards[$i],
			"SELECT DISTINCT key FROM idempotency.records
			  WHERE scope = '$scope' AND key IN ($list) AND NOT is_token AND expires_at > now()");
	}
	return { map { $_ => join(',', @{ $home{$_} }) } @keys };
}

# moved(scope, keys...): those the 4-shard placement puts elsewhere
sub moved
{
	my ($scope, @keys) = @_;
	my %m = map { $_ => 1 } split /\n/, on($r1,
		"SELECT k FROM unnest(ARRAY[" . join(', ', map { "'$_'" } @keys) . "]) k
		  WHERE idempotency.key_hash('$scope', k) & 2 <> 0");
	return grep { $m{$_} } @keys;
}

# Business rows: a table on each router, written by the client that got
# 'acquired', in the same statement as its claim's completion.
on($_, 'CREATE TABLE biz (key text NOT NULL, router text NOT NULL)')
  for $r1, $r2, $r3;

# Keys completed before the growth, through the first router
my @done = map { "done$_" } 1 .. 40;
on($r1, join('', map {
	"SELECT count(*) FROM idempotency.idem_acquire('$_', NULL, 'm');
	 SELECT idempotency.idem_complete('$_', 201, '{\"key\": \"$_\"}', 'm');\n" } @done));
my @moved_done = moved('m', @done);
ok(@moved_done >= 5, scalar(@moved_done) . ' of 40 completed keys move with the growth');
is(scalar(grep { on($r2, "SELECT outcome FROM idempotency.idem_acquire('$_', NULL, 'm')") eq 'replay' } @done),
	40, 'the second router replays what the first completed');

# ------------------------------------------------------------------
# Grow 2 -> 4 through the first router while 8 clients, 4 on each router,
# claim 120 keys twice each (first in order, a few apart, so that new keys
# are still being claimed after the switch, then shuffled); the second
# router is never told.
my @pool = map { "live$_" } 1 .. 120;
sub client_script
{
	my ($router_name, $c) = @_;
	return "\\set VERBOSITY sqlstate\nSELECT pg_sleep(0.2);\n" . join('',
		map {
			"WITH a AS (SELECT * FROM idempotency.idem_acquire('$_', NULL, 'm')), "
			  . "b AS (INSERT INTO biz SELECT '$_', '$router_name' FROM a WHERE a.outcome = 'acquired') "
			  . "SELECT '$_', a.outcome, CASE WHEN a.outcome = 'acquired' THEN idempotency.idem_complete('$_', 200, '{\"by\": $c}', 'm', claim => a.claim) END FROM a;\n"
		} (@pool[ 3 * $c .. $#pool ], @pool[ 0 .. 3 * $c - 1 ], shuffle(@pool)));
}
my $grow_sql = 'SELECT count(*) FROM idempotency.cluster_grow(ARRAY['
  . join(', ', map { "'" . shard_connstr($_) . "'" } @shards) . '], consult_previous => \'1h\')';
{
	# the first router's clients start further into the keys: they claim
	# new keys after the switch (moved ones on their new shards) that the
	# second router's clients reach later
	my @h1 = run_clients_async($r1, map { client_script('r1', $_) } 5 .. 8);
	my @h2 = run_clients_async($r2, map { client_script('r2', $_) } 1 .. 4);
	my @hg = run_clients_async($r1, "SELECT pg_sleep(0.5);\n$grow_sql;\n");
	my @res = finish_clients(@h1, @h2);
	my ($grow) = finish_clients(@hg);
	is($grow->[1], '', 'cluster_grow() to 4 shards on the first router while 8 clients work on two');

	my (%acq, %errs);
	for my $r (@res)
	{
		$errs{$1}++ while $r->[1] =~ /ERROR:  (\w{5})/g;
		for (split /\n/, $r->[0])
		{
			my ($k, $o) = split /\|/;
			$acq{$k}++ if ($o // '') eq 'acquired';
		}
	}
	note 'client errors: ' . join(', ', map { "$_ x $errs{$_}" } sort keys %errs)
	  if %errs;
	is(join(',', grep { $_ ne '55R01' } sort keys %errs), '',
		'no client call failed, but for a retryable 55R01 across the switch');
	is(scalar(grep { ($acq{$_} // 0) == 1 } @pool), 120,
		'each of 120 keys was acquired exactly once, on either router');
	my $rows = on($r1, 'SELECT count(*) FROM biz') + on($r2, 'SELECT count(*) FROM biz');
	is($rows, 120, 'business rows = keys (120)');
	is(on($r1, "SELECT count(DISTINCT key) FROM biz") + on($r2, "SELECT count(DISTINCT key) FROM biz"),
		120, '(each key once)');
	my $home = homes('m', @pool);
	is(scalar(grep { $home->{$_} =~ /^\d$/ } @pool), 120,
		'and each key has exactly one record in the whole cluster');
}
is(on($r2, 'SELECT cardinality(connstrs) FROM idempotency.cluster_state'), '4',
	'the router never told of the growth now routes by 4 partitions (read from the shards)');

# After the switch: 60 new keys claimed by 4 clients of the first router,
# then by 4 of the second (the moved ones are on their new shards by then)
{
	my @after = map { "after$_" } 1 .. 60;
	my $script = sub {
		my ($router_name, $c) = @_;
		return "\\set VERBOSITY sqlstate\n" . join('', map {
			"WITH a AS (SELECT * FROM idempotency.idem_acquire('$_', NULL, 'm')), "
			  . "b AS (INSERT INTO biz SELECT '$_', '$router_name' FROM a WHERE a.outcome = 'acquired') "
			  . "SELECT '$_', a.outcome, CASE WHEN a.outcome = 'acquired' THEN idempotency.idem_complete('$_', 200, '{\"by\": $c}', 'm', claim => a.claim) END FROM a;\n"
		} shuffle(@after));
	};
	my @res = run_clients($r1, 'postgres', map { $script->('r1', $_) } 1 .. 4);
	push @res, run_clients($r2, 'postgres', map { $script->('r2', $_) } 5 .. 8);
	my %acq;
	for my $r (@res)
	{
		for (split /\n/, $r->[0])
		{
			my ($k, $o) = split /\|/;
			$acq{$k}++ if ($o // '') eq 'acquired';
		}
	}
	is(scalar(grep { ($acq{$_} // 0) == 1 } @after), 60,
		'60 keys claimed after the switch through both routers: each acquired once');
	is(on($r1, "SELECT count(*) FROM biz WHERE key LIKE 'after%'") + on($r2, "SELECT count(*) FROM biz WHERE key LIKE 'after%'"),
		60, '(60 business rows)');
}

# ------------------------------------------------------------------
# A router still on the old layout: a moved key completed on its new shard
my $k = (moved('m', map { "late$_" } 1 .. 20))[0];
is(on($r1, "SELECT outcome FROM idempotency.idem_acquire('$k', NULL, 'm')"), 'acquired',
	"a moved key ($k) claimed through the grown router");
on($r1, "SELECT idempotency.idem_complete('$k', 201, '{\"once\": true}', 'm')");
is(homes('m', $k)->{$k}, on($r1, "SELECT idempotency.key_hash('m', '$k') & 3"),
	'on its new shard');
is(on($r3, 'SELECT cardinality(connstrs) FROM idempotency.cluster_state'), '2',
	'the third router still has the old layout');
is(on($r3, "SELECT outcome, response_body FROM idempotency.idem_acquire('$k', NULL, 'm')"),
	'replay|{"once": true}', 'and answers the moved key with its replay, not a second claim');
is(homes('m', $k)->{$k} =~ tr/,//, 0, '(still one record in the cluster)');
is(on($r3, 'SELECT cardinality(connstrs) FROM idempotency.cluster_state'), '4',
	'the third router reloaded the layout from the shard that refused it');

# ------------------------------------------------------------------
# A router rebuilt from nothing, over any one shard
my $r4 = proxy_router('mrouter4');
on($r4, "SELECT count(*) FROM idempotency.cluster_create(ARRAY['" . shard_connstr($shards[3]) . "'])");
is(on($r4, 'SELECT cardinality(connstrs), cardinality(previous) FROM idempotency.cluster_state'),
	'4|2', 'a router declared over one shard takes the layout the shards know');
is(scalar(grep { on($r4, "SELECT outcome FROM idempotency.idem_acquire('$_', NULL, 'm')") eq 'replay' } @done),
	40, 'and serves at once: every key completed before the growth replays, the moved ones too');
is(on($r4, "SELECT outcome, response_body FROM idempotency.idem_acquire('$k', NULL, 'm')"),
	'replay|{"once": true}', '(and the key completed after it)');

# ------------------------------------------------------------------
# Monitoring through a router with exactly the documented grants: docs/reference.md's
# monitoring block on every shard, proxy/README's on the router
sub doc_block
{
	my ($file, $after) = @_;
	open my $fh, '<', "$FindBin::RealBin/../$file" or die "$file: $!";
	local $/;
	my $text = <$fh>;
	close $fh;
	$text =~ /\Q$after\E.*?```sql\n(.*?)```/s or die "no block after '$after' in $file";
	return $1 =~ s/^\\c .*\n//mgr;
}
on($_, "CREATE ROLE monitor LOGIN;\n" . doc_block('docs/reference.md', 'A monitoring role reads the [statistics]')) for @shards;
on($r1, doc_block('proxy/README.md', '**Monitoring through the router.**'));
is( on($r1, q{SET ROLE monitor;
SELECT count(*) > 0 FROM idempotency.stats;
SELECT count(*) > 0 FROM idempotency.acquire_duration;
SELECT count(*) >= 0 FROM idempotency.stale_claims;}),
	"t\nt\nt",
	'a monitoring role with the documented grants reads stats, acquire_duration and stale_claims through the router');

# ------------------------------------------------------------------
# The shards' own refusals: a row (outcome 'refused'), so that PL/Proxy
# keeps its connection, and nothing left of the claim.  Layout 2 is in
# force, its window open: a key of partition 1 (of 4) stayed on shard 1, a
# key of partition 2 moved from shard 0 to shard 2.
my ($k_other, $k_moved, $k_stayed) = map {
	my $p = $_->[0];
	on($r1, "SELECT k FROM generate_series(1, 200) g, LATERAL (SELECT '$_->[1]' || g AS k) x
	          WHERE idempotency.key_hash('m', k) & 3 = $p LIMIT 1")
} ([ 1, 'own' ], [ 2, 'moved' ], [ 1, 'stayed' ]);
my $acq = sub {
	my ($shard, $layout, $key) = @_;
	return on($shard, "SELECT outcome, response_body->>'message' FROM idempotency.shard_acquire($layout, '$key', NULL, 'm', '1h', '1m')");
};
like($acq->($shards[0], '(SELECT version FROM idempotency.shard_layout_get())', $k_other),
	qr/^refused\|partition 1 of layout 2 is not owned by this shard$/,
	'a shard refuses a claim of a key another shard owns (a row: refused, and why)');
like($acq->($shards[2], 1, $k_moved), qr/^refused\|the router's layout 1 is not this shard's layout 2$/,
	'and a claim of a key that moved to it from a router at the older layout (that router did not look at its previous shard)');
like($acq->($shards[1], 1, $k_stayed), qr/^acquired\|$/,
	'a key that did not move is claimed from a router at any layout: a growth refuses no call of it');
is_deeply(homes('m', $k_other, $k_moved, $k_stayed), { $k_other => '', $k_moved => '', $k_stayed => '1' },
	'(the refused claims left no record)');
like(on($shards[1], "SELECT status, response_body->>'message' FROM idempotency.shard_lookup(1, '$k_stayed', 'm')"),
	qr/^refused\|the router's layout 1 is not this shard's layout 2$/,
	'the look at a previous shard is answered only at its own layout (a row: refused, and why)');
like(on($shards[1], "SELECT status FROM idempotency.shard_lookup(2, '$k_stayed', 'm')"),
	qr/^processing$/, 'and answered at it');
my ($state) = sqlstate_of_psql($shards[1], 'postgres',
	"SELECT * FROM idempotency.shard_acquire(1, NULL, NULL, 'm', '1h', '1m')");
is($state, '22004', 'bad input still raises what a direct call raises');

done_testing();
