# Copyright (c) idempotency authors
#
# idempotency_proxy: the end of a growth's window (issue 28).  For a key
# that moved, routers look where it used to be until the window is closed
# with cluster_growth_finish(), which refuses while the previous shards
# hold a live record of a moved key.  Before the fix:
#   - routers stopped looking at consult_until, and a record still live
#     there (made while the growth waited, a ttl longer than
#     consult_previous, a router clock ahead of the shard's) was claimed
#     again on the new shard: the key ran twice;
#   - cluster_growth_pending() answered 0 after consult_until, so
#     cluster_growth_finish() closed the window over live records;
#   - a second growth was taken after consult_until, the window of the
#     first still open;
#   - a token issued on its old shard after the router's switch time but
#     before that shard installed the growth was not counted, and its
#     consume answered false once the window was closed.
#
# Growth 1 (one shard to two) is the token race; growth 2 (two shards to
# three, four partitions) is the window's end.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::RealBin/lib";
use IdemTest;
use IdemProxy;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(usleep);

skip_without_plproxy();

my ($a, $c, $d) = proxy_shards(3, 'we');
my $r1 = proxy_router('werouter1', $a);
# routers set up now and never told of a growth
my $r0 = proxy_router('werouter0', $a);
my $r5 = proxy_router('werouter5', $a);
my $r6 = proxy_router('werouter6', $a);

# an endpoint of the application's own (proxy/README.md, the
# in-transaction mode): on the shards, and routed on both routers
for my $s ($a, $c, $d)
{
	$s->safe_psql('postgres', q{
CREATE SCHEMA app;
CREATE TABLE app.payments (key text NOT NULL);
CREATE FUNCTION app.pay(key text, layout bigint DEFAULT NULL,
                        OUT status int, OUT body jsonb)
LANGUAGE plpgsql AS $$
DECLARE
    a   record;
BEGIN
    SELECT * INTO a FROM idempotency.idem_acquire(key, NULL, 'we', ttl => '1 hour');
    IF a.outcome = 'acquired' THEN
        IF a.attempt = 1 THEN
            PERFORM idempotency.shard_owns('we', key, layout);
        END IF;
        INSERT INTO app.payments VALUES (key);
        status := 201;
        body := jsonb_build_object('paid', key, 'port', current_setting('port'));
        PERFORM idempotency.idem_complete(key, status, body, 'we');
    ELSE
        status := coalesce(a.response_status, 409);
        body := a.response_body;
    END IF;
END
$$;});
}
for my $r ($r0, $r1)
{
	$r->safe_psql('postgres', q{
CREATE SCHEMA app;
CREATE FUNCTION app.pay(key text, layout bigint DEFAULT idempotency.layout_version(),
                        OUT status int, OUT body jsonb)
LANGUAGE plproxy AS $$
    CLUSTER idempotency.key_cluster('we', key);
    RUN ON idempotency.key_hash('we', key);
$$;});
}
sub payments
{
	my ($key) = @_;
	my $n = 0;
	$n += on($_, "SELECT count(*) FROM app.payments WHERE key = '$key'") for ($a, $c, $d);
	return $n;
}

sub on { my ($node, $sql) = @_; return $node->safe_psql('postgres', $sql) }
sub cs { return "'" . shard_connstr($_[0]) . "'" }

# live(scope, key): the shards (a, c, d) holding a live record of the key
sub live
{
	my ($scope, $key) = @_;
	my %name = ($a->name => 'a', $c->name => 'c', $d->name => 'd');
	return join(',', map { $name{ $_->name } } grep {
		on($_, "SELECT count(*) FROM idempotency.records
			 WHERE scope = '$scope' AND key = '$key' AND expires_at > now()") ne '0'
	} ($a, $c, $d));
}

# ------------------------------------------------------------------
# Growth 1, [a] -> [a, c]: tokens issued on a while its install waits.
# An open transaction on a holds its layout table (as an in-transaction
# claim does); c has the new layout at once.  Tokens issued through the
# router meanwhile are made on a, under the old layout, after the
# router's switch time; those of partition 1 belong to c once the growth
# is in force.  The transaction is let go as soon as a token call waits
# behind the growth (or all are done).
my $hold = $a->background_psql('postgres');
$hold->query_safe('BEGIN');
$hold->query_safe('SELECT count(*) FROM idempotency.shard_layout');
my ($grow1) = run_clients_async($r1,
	"SELECT count(*) FROM idempotency.cluster_grow(ARRAY[" . cs($a) . ', ' . cs($c) . "]);\n");
ok($c->poll_query_until('postgres',
		'SELECT EXISTS (SELECT FROM idempotency.shard_layout WHERE version = 2)'),
	'growth 1: the new shard has layout 2, the old one waits');
my ($issue) = run_clients_async($r1,
	join('', map { "SELECT idempotency.idem_token_issue('form');\n" } 1 .. 16));
my $held = 1;
while ($issue->{run}->pumpable)
{
	$issue->{run}->pump_nb;
	if ($held
		&& on($a, "SELECT count(*) FROM pg_stat_activity
			 WHERE wait_event_type = 'Lock' AND query NOT LIKE '%shard_layout_install%'") ne '0')
	{
		$hold->query_safe('COMMIT');
		$held = 0;
	}
	usleep(20_000);
}
my ($issued) = finish_clients($issue);
if ($held)
{
	$hold->query_safe('COMMIT');
}
$hold->quit;
my ($g1) = finish_clients($grow1);
is($g1->[1], '', 'growth 1 is in force');
my @tokens = grep { length } split /\n/, $issued->[0];
ok(@tokens > 0, scalar(@tokens) . ' tokens issued during growth 1');
my %on_a = map { $_ => 1 } split /\n/,
  on($a, "SELECT key FROM idempotency.records WHERE is_token AND scope = 'form'");
my @gap = grep { $on_a{ substr($_, 0, 32) } && (on($r1, "SELECT idempotency.token_hash('$_') & 1") eq '1') } @tokens;
note scalar(@gap) . ' of them were made on the old shard for a partition the growth gave away';
SKIP:
{
	skip 'no token was issued before the old shard installed the growth (a slow machine)', 1
	  unless @gap;
	my ($state) = sqlstate_of_psql($r1, 'postgres', 'SELECT idempotency.cluster_growth_finish()');
	is($state, '55000',
		'the window is not closed while those tokens are live on the old shard');
}
is(join('', map { on($r1, "SELECT idempotency.idem_token_consume('$_', 'form')") } @tokens),
	't' x @tokens, 'every token issued during growth 1 is consumed');
is(join('', map { on($r1, "SELECT idempotency.idem_token_consume('$_', 'form')") } @tokens),
	'f' x @tokens, 'once');
# routers set up now have growth 1's window open, and keep it (they are
# not told of the close, nor of growth 2)
my $r3 = proxy_router('werouter3', $a);
my $r4 = proxy_router('werouter4', $a);
is(on($r3, 'SELECT cardinality(connstrs), cardinality(previous) FROM idempotency.cluster_state'),
	'2|1', 'a router set up during the window of growth 1 consults the previous placement');
is(on($r1, 'SELECT idempotency.cluster_growth_finish()'), 't',
	'then the window of growth 1 closes');
# a key that moved in growth 1, new: r4's look at its previous shard is
# refused (the window is closed there); r4 takes the close and claims it
my ($fresh) = split /\n/, on($r1,
	"SELECT k FROM (SELECT 'wf' || g AS k FROM generate_series(1, 200) g) s
	  WHERE idempotency.key_hash('we', k) & 1 = 1 LIMIT 1");
is(on($r4, "SELECT outcome, attempt FROM idempotency.idem_acquire('$fresh', NULL, 'we')"),
	'acquired|1', 'a router still in the closed window claims a moved key');
is(live('we', $fresh) . ' ' . on($r4, 'SELECT previous IS NULL FROM idempotency.cluster_state'),
	'c t', 'on its new shard, and its window is closed too');

# ------------------------------------------------------------------
# Growth 2, [a, c] -> [a, c, d, a]: keys with hash & 3 = 2 move from a to
# d.  The window is given one second; records of the moved keys live
# for an hour (a paid key, a key whose holder still works).
my ($paid, $held_key) = split /\n/, on($r1,
	"SELECT k FROM (SELECT 'wk' || g AS k FROM generate_series(1, 200) g) s
	  WHERE idempotency.key_hash('we', k) & 3 = 2 LIMIT 2");
is(on($r1, "SELECT outcome FROM idempotency.idem_acquire('$paid', '{\"n\": 1}', 'we', ttl => '1 hour')"),
	'acquired', "before growth 2: $paid is paid");
on($r1, "SELECT idempotency.idem_complete('$paid', 200, '{\"paid\": 1}', 'we')");
is(on($r1, "SELECT outcome FROM idempotency.idem_acquire('$held_key', NULL, 'we', ttl => '1 hour', lease => '1 hour')"),
	'acquired', "and $held_key is being worked on");
is(live('we', $paid) . ' ' . live('we', $held_key), 'a a', 'both on shard a');
my ($stay) = split /\n/, on($r1,
	"SELECT k FROM (SELECT 'ws' || g AS k FROM generate_series(1, 200) g) s
	  WHERE idempotency.key_hash('we', k) & 3 = 1 LIMIT 1");
on($r1, "SELECT idempotency.idem_acquire('$stay', NULL, 'we', ttl => '1 hour')");
on($r1, "SELECT idempotency.idem_complete('$stay', 200, '{\"stay\": 1}', 'we')");
is(live('we', $stay), 'c', "$stay is completed on shard c");

# the endpoint: a key paid on c that growth 2 moves back to a
my ($back) = split /\n/, on($r1,
	"SELECT k FROM (SELECT 'wb' || g AS k FROM generate_series(1, 200) g) s
	  WHERE idempotency.key_hash('we', k) & 3 = 3 LIMIT 1");
my $paid_back = on($r1, "SELECT status, body FROM app.pay('$back')");
like($paid_back, qr/^201\|/, "the endpoint pays $back");
is(live('we', $back), 'c', 'on shard c');

my $servers2 = 'ARRAY[' . join(', ', map { cs($_) } ($a, $c, $d)) . ']';
is(on($r1, "SELECT count(*) FROM idempotency.cluster_grow($servers2, partitions => 4, consult_previous => '1 second')"),
	'4', 'growth 2 to four partitions, consult_previous of one second');
on($r1, "SELECT pg_sleep(greatest(0, extract(epoch FROM consult_until - clock_timestamp())) + 0.2)
		   FROM idempotency.cluster_state");
is(on($r1, 'SELECT consult_until < clock_timestamp() FROM idempotency.cluster_state'),
	't', 'consult_until has passed');

is(on($r1, "SELECT outcome, response_body FROM idempotency.idem_acquire('$paid', '{\"n\": 1}', 'we')"),
	'replay|{"paid": 1}', 'after consult_until the paid key still replays');
is(on($r1, "SELECT outcome FROM idempotency.idem_acquire('$held_key', NULL, 'we')"),
	'in_progress', 'the key being worked on still answers in_progress');
is(live('we', $paid) . ' ' . live('we', $held_key), 'a a',
	'no record of either was made on its new shard');
my $r2 = proxy_router('werouter2', $a);
is(on($r2, "SELECT outcome FROM idempotency.idem_acquire('$paid', '{\"n\": 1}', 'we')"),
	'replay', 'a router set up from nothing now replays it too');
is(on($r1, 'SELECT pending FROM idempotency.cluster_growth_pending()'), '3',
	"cluster_growth_pending() counts the moved keys' records after consult_until");
my ($state, $out, $err) = sqlstate_of_psql($r1, 'postgres',
	"SELECT count(*) FROM idempotency.cluster_grow($servers2, partitions => 8)");
is($state, '55000', 'a second growth is refused while the window is open');
like($err, qr/window of the last growth is still open/, 'saying why');
($state) = sqlstate_of_psql($r1, 'postgres', 'SELECT idempotency.cluster_growth_finish()');
is($state, '55000', 'and the window is not closed while they are live');
# the router that never heard of either growth sends the endpoint call of
# $back to a, which owns it now but may not take a new claim of it from a
# router at layout 1 (that router did not look on c)
($state, $out, $err) = sqlstate_of_psql($r0, 'postgres', "SELECT status FROM app.pay('$back')");
is($state, '55R01', 'the endpoint through a router two growths behind is refused');
is(payments($back), 1, 'no second payment');
is(on($r0, 'SELECT idempotency.cluster_reload()'), 't', 'cluster_reload() gives that router the layout');
is(on($r0, "SELECT status, body FROM app.pay('$back')"), $paid_back,
	'then the endpoint replays the payment from c');
is(payments($back), 1, 'still one payment');

# the stale router: a key that moved in growth 1 (hash & 1 = 1) and stays
# on c in growth 2; its look at the key's growth-1 shard is refused
# (that shard is at layout 3), it reloads and answers from c
is(on($r3, "SELECT outcome, response_body FROM idempotency.idem_acquire('$stay', NULL, 'we')"),
	'replay|{"stay": 1}', 'a router still in the window of growth 1 reloads and replays a key of c');
is(on($r3, 'SELECT cardinality(connstrs), cardinality(previous) FROM idempotency.cluster_state'),
	'4|2', 'and now has growth 2');
is(on($r1, "SELECT idempotency.idem_complete('$held_key', 201, '{\"done\": 1}', 'we')"),
	't', 'the holder completes its key on its previous shard');
is(on($r2, "SELECT outcome, response_body FROM idempotency.idem_acquire('$held_key', NULL, 'we')"),
	'replay|{"done": 1}', 'and it replays through the other router');

# routers never told of either growth (at layout 1: every key on a) and
# claims made on d: a completion or a release that finds no record where
# the router looks reloads its layout and runs once more
my ($late1, $late2) = split /\n/, on($r1,
	"SELECT k FROM (SELECT 'wl' || g AS k FROM generate_series(1, 200) g) s
	  WHERE idempotency.key_hash('we', k) & 3 = 2 LIMIT 2");
my %cl = map { $_ => on($r1, "SELECT claim FROM idempotency.idem_acquire('$_', NULL, 'we', lease => '1 hour')") } ($late1, $late2);
is(live('we', $late1) . ' ' . live('we', $late2), 'd d', 'two keys claimed on d');
is(on($r5, "SELECT idempotency.idem_complete('$late1', 200, '{\"late\": 1}', 'we', claim => '$cl{$late1}')"),
	't', 'a router two growths behind completes a claim on d');
is(on($r5, 'SELECT layout_version FROM idempotency.cluster_state'), '3', '(it took layout 3)');
is(on($r6, "SELECT idempotency.idem_release('$late2', 'we', claim => '$cl{$late2}')"),
	't', 'another releases one');
is(live('we', $late1) . ' ' . live('we', $late2), 'd ', 'the completed one is kept, the released one gone');

done_testing();
