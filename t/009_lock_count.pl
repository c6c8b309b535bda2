# Copyright (c) idempotency authors
#
# Relation locks held by a claim.  A call looks in every partition whose range
# has not ended, but must keep locks only on the partitions that hold records:
# with hourly partitions and a week's max_ttl (about 170 of them), holding a
# lock on each filled the shared lock table after a few concurrent claim
# transactions ("out of shared memory"), and even with daily ones an acquire
# plus complete took every fast-path slot, pushing the application's own
# writes in the same transaction into the shared lock table.

use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

$PostgreSQL::Test::Cluster::use_tcp = 1;
$PostgreSQL::Test::Cluster::test_pghost = '127.0.0.1';

my $node = PostgreSQL::Test::Cluster->new('locks');
$node->init;
$node->start;

$node->safe_psql('postgres', q{
CREATE DATABASE hourly;
CREATE DATABASE daily;
CREATE DATABASE quarter;
ALTER DATABASE hourly SET idempotency.partition_interval = '1h';
ALTER DATABASE quarter SET idempotency.partition_interval = '15min';
});
$node->safe_psql('quarter', 'CREATE EXTENSION idempotency');
foreach my $db ('hourly', 'daily')
{
	$node->safe_psql($db, q{
CREATE EXTENSION idempotency;
CREATE TABLE orders (id serial PRIMARY KEY, note text);
});
}

my $nparts = $node->safe_psql('hourly',
	'SELECT count(*) FROM idempotency.partitions WHERE NOT is_default');
cmp_ok($nparts, '>=', 168, "hourly partitions for a week ahead ($nparts)");

# Relation locks this transaction holds, by name and mode, captured into a
# temporary table first so that looking at them takes no lock of its own
# that could be counted.
my $capture = q{
CREATE TEMP TABLE held ON COMMIT DROP AS
SELECT l.relation::regclass::text AS rel, l.mode, l.fastpath
  FROM pg_locks l
 WHERE l.pid = pg_backend_pid() AND l.locktype = 'relation'
   AND l.relation IN (SELECT c.oid FROM pg_class c
                       WHERE c.relnamespace = 'idempotency'::regnamespace);
};

# The partitions that hold rows, and their indexes: what may be locked.
my $expected = q{
SELECT count(*) FROM held h
 WHERE h.rel NOT IN (
        SELECT p.partition::text FROM idempotency.partitions p
         WHERE EXISTS (SELECT FROM idempotency.records r
                        WHERE r.tableoid = p.partition)
        UNION ALL
        SELECT i.indexrelid::regclass::text
          FROM pg_index i JOIN idempotency.partitions p
            ON i.indrelid = p.partition
         WHERE EXISTS (SELECT FROM idempotency.records r
                        WHERE r.tableoid = p.partition)
        UNION ALL
        SELECT 'idempotency.records')
};

foreach my $db ('hourly', 'daily')
{
	# some records of other ttls, so that more than one partition is in use
	$node->safe_psql($db, q{
SELECT idempotency.idem_acquire('old-' || g, ttl => make_interval(hours => g))
  FROM generate_series(1, 3) g;
});
	my $nfilled = $node->safe_psql($db,
		'SELECT count(DISTINCT tableoid) FROM idempotency.records');

	my $out = $node->safe_psql($db, qq{
BEGIN;
SELECT outcome FROM idempotency.idem_acquire('new-key', '{"a": 1}');
$capture
SELECT count(*) FROM held;
SELECT string_agg(rel || ' ' || mode, ', ' ORDER BY rel, mode) FROM held;
$expected;
COMMIT;
});
	my ($outcome, $nheld, $list, $stray) = split /\n/, $out;
	is($outcome, 'acquired', "$db: new key acquired");
	is($stray, '0',
		"$db: acquire locks no partition without records (held: $list)");
	# parent twice (read, write), and each filled partition with its index
	# at most twice (probed, written)
	cmp_ok($nheld, '<=', 2 + 4 * ($nfilled + 1),
		"$db: acquire holds $nheld relation locks with $nfilled filled partitions");
	cmp_ok($nheld, '<=', 12, "$db: acquire holds at most 12 relation locks");

	# acquire, complete and the application's own insert: all fast-path
	$out = $node->safe_psql($db, qq{
BEGIN;
SELECT outcome FROM idempotency.idem_acquire('biz-key', '{"a": 1}');
INSERT INTO orders (note) VALUES ('paid');
SELECT idempotency.idem_complete('biz-key', 201, '{"id": 1}');
SELECT count(*) FILTER (WHERE NOT fastpath)
  FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'relation';
COMMIT;
});
	my (undef, undef, $slow) = split /\n/, $out;
	is($slow, '0',
		"$db: acquire + business insert + complete: every relation lock on the fast path");

	# a replay reads the one filled partition it finds the record in
	$out = $node->safe_psql($db, qq{
BEGIN;
SELECT outcome FROM idempotency.idem_acquire('biz-key', '{"a": 1}');
$capture
$expected;
COMMIT;
});
	my (undef, $stray_replay) = split /\n/, $out;
	is($stray_replay, '0', "$db: replay locks no partition without records");
}

# Many concurrent open claim transactions on 15-minute partitions, in a small
# lock table: max_locks_per_transaction entries for each backend slot, and
# the fewest slots the server allows besides the connections.  Each
# transaction held some 1,370 relation locks before, one for each of the
# 680 partitions and their indexes, and the lock table ran out ("out of
# shared memory").  (CREATE EXTENSION, which makes the partitions in one
# transaction, needed the default lock table above.)
$node->append_conf(
	'postgresql.conf', q{
max_connections = 10
max_locks_per_transaction = 32
wal_level = minimal
max_wal_senders = 0
max_worker_processes = 1
autovacuum_max_workers = 1
});
$node->restart;

my @sessions;
my $ok = 1;
foreach my $i (1 .. 6)
{
	my $s = $node->background_psql('quarter', on_error_stop => 0);
	my ($res, $err) = ('', '');
	$res = $s->query(qq{
BEGIN;
SELECT outcome FROM idempotency.idem_acquire('open-$i', '{"n": $i}');
});
	$err = $s->{stderr} // '';
	if ($res !~ /acquired/)
	{
		$ok = 0;
		diag("session $i: $res $err");
	}
	push @sessions, $s;
}
diag('relation locks held by the open claim transactions: '
	  . $node->safe_psql('quarter',
		q{SELECT count(*) FROM pg_locks WHERE locktype = 'relation'}));
ok($ok, 'six claim transactions held open at once all acquire');
$_->query_safe('COMMIT') foreach @sessions;
$_->quit foreach @sessions;

# (read through the API: a plain SELECT on idempotency.records locks every
# partition and would not fit in this lock table)
is( $node->safe_psql('quarter',
		q{SELECT count(*) FROM generate_series(1, 6) g,
		         idempotency.idem_lookup('open-' || g) l
		   WHERE l.status = 'processing'}),
	'6', 'their six claims are committed');

$node->stop;
done_testing();
