# Copyright (c) idempotency authors
#
# Logical replication of idempotency.records to a subscriber.  Every change
# to a live record must reach it: claims, completions, releases and
# takeovers in the partitions maintenance makes (each needs a replica
# identity), and records that maintenance moves out of DEFAULT into a new
# partition (moved through the published table, so the subscriber sees a
# delete and an insert, not a delete alone).  Otherwise a completed request
# could run again on the subscriber after a failover to it.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::RealBin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(time usleep);

$PostgreSQL::Test::Cluster::use_tcp = 1;
$PostgreSQL::Test::Cluster::test_pghost = '127.0.0.1';

# The set-up of the two clusters is timed: the windows below are multiples
# of it.
my $t_setup = time;
my $pub = PostgreSQL::Test::Cluster->new('publisher');
$pub->init(allows_streaming => 'logical');
$pub->start;
my $sub = PostgreSQL::Test::Cluster->new('subscriber');
$sub->init;
$sub->start;
my $setup_secs = time - $t_setup;

# Short partitions, so that claims reach DEFAULT within seconds.  Records
# live $max_ttl (30 s, or 6 times the set-up where that is longer): each
# record must outlive the replication and the checks that follow its claim.
# A claim lands in DEFAULT once the partitions made ahead end less than
# $max_ttl from now, which takes 5 s whatever $max_ttl is.
my $max_ttl = window_secs($setup_secs, 6, 30);
my $default_ttl = $max_ttl - 10;
my $lease = $max_ttl - 5;
note sprintf('set-up took %.1f s: max_ttl %d s', $setup_secs, $max_ttl);
my $settings = qq{
ALTER DATABASE postgres SET idempotency.partition_interval = '2s';
ALTER DATABASE postgres SET idempotency.max_ttl = '${max_ttl}s';
ALTER DATABASE postgres SET idempotency.default_ttl = '${default_ttl}s';
ALTER DATABASE postgres SET idempotency.default_lease = '${default_ttl}s';
};

foreach my $node ($pub, $sub)
{
	$node->safe_psql('postgres', $settings);
	$node->safe_psql('postgres', 'CREATE EXTENSION idempotency');
}

# partitions of records whose replica identity is not an index
sub without_identity
{
	return $pub->safe_psql(
		'postgres', q{
SELECT count(*) FROM pg_class c
  JOIN idempotency.partitions p ON p.partition = c.oid
 WHERE c.relreplident <> 'i'});
}

is(without_identity(), '0',
	'every partition has its unique index as replica identity');

$pub->safe_psql('postgres', q{
CREATE PUBLICATION idem FOR TABLE idempotency.records
    WITH (publish_via_partition_root = true);
});
$sub->safe_psql('postgres',
	    "CREATE SUBSCRIPTION idem CONNECTION 'host="
	  . $pub->host
	  . ' port='
	  . $pub->port
	  . " dbname=postgres' PUBLICATION idem");
$sub->poll_query_until('postgres', q{
SELECT count(*) = 0 FROM pg_subscription_rel WHERE srsubstate NOT IN ('r', 's')})
  or die 'subscriber did not finish its initial copy';

# lookup(node, key): status|response_status|attempt of the live record
sub lookup
{
	my ($node, $key) = @_;
	return $node->safe_psql('postgres', qq{
SELECT status || '|' || coalesce(response_status::text, '') || '|' || attempt
  FROM idempotency.idem_lookup('$key', 'lr')});
}

# ------------------------------------------------------------------
# Claims, completions, releases and takeovers in partitions that
# maintenance made: each update or delete needs a replica identity there.
# ------------------------------------------------------------------
my $out = $pub->safe_psql('postgres', q{
SELECT outcome FROM idempotency.idem_acquire('in-part', '{"n": 1}', 'lr');
SELECT idempotency.idem_complete('in-part', 201, '{"id": 1}', 'lr');
SELECT outcome FROM idempotency.idem_acquire('released', '{"n": 2}', 'lr');
SELECT idempotency.idem_release('released', 'lr');
SELECT outcome FROM idempotency.idem_acquire('taken', '{"n": 3}', 'lr', lease => '1s');
SELECT pg_sleep(1.2);
SELECT outcome || ' ' || attempt FROM idempotency.idem_acquire('taken', '{"n": 3}', 'lr');
});
is( $out, "acquired\nt\nacquired\nt\nacquired\n\nacquired 2",
	'complete, release and takeover work on a published table');
$pub->wait_for_catchup('idem');
is(lookup($sub, 'in-part'), 'completed|201|1',
	'the completion reached the subscriber');
is(lookup($sub, 'released'), '', 'the release reached the subscriber');
is(lookup($sub, 'taken'), 'processing||2',
	'the takeover reached the subscriber');

# ------------------------------------------------------------------
# Records that wait in DEFAULT while maintenance is stopped, then are moved
# into a new partition by idem_maintain().
# ------------------------------------------------------------------
$pub->poll_query_until('postgres', qq{
SELECT max(range_end) < clock_timestamp() + interval '${lease}s'
  FROM idempotency.partitions WHERE NOT is_default})
  or die 'the partitions made ahead did not run out';

$out = $pub->safe_psql('postgres', qq{
SELECT outcome FROM idempotency.idem_acquire('moved-1', '{"n": 1}', 'lr', ttl => '${max_ttl}s');
SELECT idempotency.idem_complete('moved-1', 201, '{"charge": "ch_1"}', 'lr');
SELECT outcome FROM idempotency.idem_acquire('moved-2', '{"n": 2}', 'lr', ttl => '${max_ttl}s', lease => '${lease}s');
SELECT count(*) FROM idempotency.records_default WHERE scope = 'lr';
});
is($out, "acquired\nt\nacquired\n2", 'two records wait in DEFAULT');
$pub->wait_for_catchup('idem');
is(lookup($sub, 'moved-1'), 'completed|201|1',
	'the subscriber has the completed record');
is(lookup($sub, 'moved-2'), 'processing||1',
	'the subscriber has the claim');

my ($created) = split /\|/,
  $pub->safe_psql('postgres', 'SELECT * FROM idempotency.idem_maintain()');
cmp_ok($created, '>', 0, "maintenance created partitions ($created)");
is( $pub->safe_psql(
		'postgres',
		q{SELECT count(*) FROM idempotency.records_default WHERE scope = 'lr'}),
	'0',
	'maintenance moved them out of DEFAULT');
is(without_identity(), '0',
	'the new partitions have a replica identity too');

$pub->wait_for_catchup('idem');
is( $sub->safe_psql(
		'postgres',
		q{SELECT count(*) FROM idempotency.records WHERE key LIKE 'moved-%'}),
	'2',
	'the moved records are still on the subscriber');
is(lookup($sub, 'moved-1'), 'completed|201|1',
	'the moved completed record is found on the subscriber');
is( $sub->safe_psql(
		'postgres', q{
SELECT outcome || ' ' || response_body::text
  FROM idempotency.idem_acquire('moved-1', '{"n": 1}', 'lr')}),
	'replay {"charge": "ch_1"}',
	'a retry on the subscriber replays instead of running again');

# later changes to a moved record reach the subscriber as well
is( $pub->safe_psql(
		'postgres',
		q{SELECT idempotency.idem_complete('moved-2', 201, '{"charge": "ch_2"}', 'lr')}),
	't',
	'the moved claim completes on the publisher');
$pub->wait_for_catchup('idem');
is(lookup($sub, 'moved-2'), 'completed|201|1',
	'its completion reaches the subscriber');

is( $sub->safe_psql(
		'postgres',
		q{SELECT apply_error_count + sync_error_count
		    FROM pg_stat_subscription_stats WHERE subname = 'idem'}),
	'0',
	'the apply worker met no error');
my $sublog = slurp_file($sub->logfile);
unlike($sublog, qr/ERROR:/, 'no error in the subscriber log');

$sub->stop;
$pub->stop;
done_testing();
