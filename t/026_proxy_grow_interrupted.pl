# Copyright (c) idempotency authors
#
# idempotency_proxy: a growth that stopped half way and is run again
# (issue 28).  The new layout reached one shard and not the other (an
# open transaction on the old shard held its shard_layout; the growth was
# cancelled).  Running cluster_grow() again with the same servers, as
# proxy/README.md says, must put the layout in force on every server only
# once every server has it: then a router still on the old layout cannot
# claim a moved key on its old shard while the grown router claims it on
# the new one.  Before the fix, the re-run put the layout in force on the
# new shard while the old one stayed on the old layout, and the key was
# acquired twice, on two shards.

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

my ($a, $c) = proxy_shards(2, 'gi');
my $r1 = proxy_router('girouter1', $a);
my $r2 = proxy_router('girouter2', $a);
my $servers = "ARRAY['" . shard_connstr($a) . "', '" . shard_connstr($c) . "']";

sub on { my ($node, $sql) = @_; return $node->safe_psql('postgres', $sql) }

sub layouts
{
	return on($r1, "SELECT string_agg(version || ':' || active, ' ' ORDER BY connstr = '"
		  . shard_connstr($a) . "' DESC) FROM idempotency.cluster_layouts($servers)");
}

# a key that moves from the first shard to the second with the growth
my $k = on($r1, "SELECT k FROM (SELECT 'gk' || g AS k FROM generate_series(1, 100) g) s
	WHERE idempotency.key_hash('gi', k) & 1 = 1 LIMIT 1");
ok($k ne '', "key $k moves to the new shard");
is(layouts(), '1:true', 'before: one shard at layout 1, in force');

# An open transaction on the old shard holds its layout table (as an
# in-transaction claim does): the growth's install waits there, after the
# new shard has the layout.  It is cancelled once the new shard has it and
# the old shard's install is seen waiting for that lock: states, not time
# (a slow machine may take any time to get there).
my $hold = $a->background_psql('postgres');
$hold->query_safe('BEGIN');
$hold->query_safe('SELECT count(*) FROM idempotency.shard_layout');
my @hg = run_clients_async($r1,
	"SELECT count(*) FROM idempotency.cluster_grow($servers, consult_previous => '1 hour');\n");
ok($c->poll_query_until('postgres',
		'SELECT EXISTS (SELECT FROM idempotency.shard_layout WHERE version = 2)'),
	'the new shard has layout 2');
# the install (its query, as PL/Proxy sends it) waiting for the lock
my $install_like = "'SELECT idempotency.shard_layout_install(%'";
ok($a->poll_query_until('postgres', qq{
		SELECT EXISTS (SELECT FROM pg_locks l JOIN pg_stat_activity s USING (pid)
		 WHERE l.relation = 'idempotency.shard_layout'::regclass AND NOT l.granted
		   AND l.mode = 'AccessExclusiveLock' AND s.query LIKE $install_like)}),
	'the old shard\'s install waits for the open transaction');
# The growth's own statement, by how it begins (not this query, nor the
# last one of a poll connection still ending), while it runs: exactly one.
ok($r1->poll_query_until('postgres', q{
		SELECT pg_cancel_backend(pid) FROM pg_stat_activity
		 WHERE query LIKE 'SELECT count(*) FROM idempotency.cluster_grow(%' AND state = 'active'}),
	'the growth is cancelled');
# The router passes its cancel on to the old shard's install and waits
# for that install to end (PL/Proxy's remote_cancel).  Should that cancel
# meet the install's own 20 ms lock_timeout there, PostgreSQL reports the
# lock timeout, the install takes it for one and tries again, and the
# router goes on waiting (seen on 18 in CI): cancel the install there until
# it is gone, so that the growth ends and can never install layout 2 on the
# old shard once the transaction ends.
ok($a->poll_query_until('postgres', qq{
		SELECT count(pg_cancel_backend(pid)) = 0 FROM pg_stat_activity
		 WHERE state = 'active' AND query LIKE $install_like}),
	'the old shard\'s install has ended');
my ($grow) = finish_clients(@hg);
like($grow->[1], qr/canceling statement/, 'the first growth stopped half way');
$hold->query_safe('COMMIT');
$hold->quit;
is(layouts(), '1:true 2:false', 'half way: old shard at layout 1, new shard has 2, not in force');

# Run again with the same servers: every server at layout 2, in force.
is(on($r1, "SELECT count(*) FROM idempotency.cluster_grow($servers, consult_previous => '1 hour')"),
	'2', 'cluster_grow() run again finishes the growth');
is(layouts(), '2:true 2:true', 'both shards at layout 2, in force');

# The second router was never told.  Each router claims the moved key:
# one acquired, on one shard.
my $o2 = on($r2, "SELECT outcome FROM idempotency.idem_acquire('$k', NULL, 'gi', lease => '10 min')");
my $o1 = on($r1, "SELECT outcome FROM idempotency.idem_acquire('$k', NULL, 'gi', lease => '10 min')");
is(join(' ', sort ($o1, $o2)), 'acquired in_progress',
	'the stale router and the grown one: one acquired, one in_progress');
my @homes = grep {
	on($_, "SELECT count(*) FROM idempotency.records
		 WHERE scope = 'gi' AND key = '$k' AND expires_at > now()") ne '0'
} ($a, $c);
is(scalar(@homes), 1, 'the key has a live record on one shard only');
is(on($c, "SELECT count(*) FROM idempotency.records WHERE scope = 'gi' AND key = '$k'"),
	'1', 'on the shard the new layout gives it');

done_testing();
