# Copyright (c) idempotency authors
#
# Storage review: records.c writes idempotency.records without the executor
# (simple_heap_insert/update/delete and its own index inserts), so the heap,
# its TOAST tables and the (scope, key, expires_at) indexes must stay what
# PostgreSQL's own checkers expect, on the primary and on a physical standby
# that replays the WAL of those writes.
#
# A primary with a streaming standby, one-second partitions and a 30 s
# max_ttl, runs a mixed pgbench load (new keys completed with bodies of
# ~1 kB, ~8 kB and ~100 kB, so most are TOASTed; replays; request
# mismatches; lease claims completed in a later transaction or abandoned and
# taken over; claim, release and claim again; a few hot keys taken over again
# and again) while a second session runs VACUUM of idempotency.records over
# and over, and idem_maintain() each time claims have piled up in DEFAULT
# (maintenance is otherwise not run, so new claims with a long ttl land
# there, and each run moves them out).  Then:
#   - the load was honest: pgbench failed no transaction; every answer the
#     load got is logged, and per key: at most one completion, every replay
#     returns the completed body, no two claims with the same attempt, the
#     stored record is the one the log says (status, attempt, body);
#   - it did what it is meant to exercise: TOASTed bodies, non-HOT
#     updates, takeovers, releases, records moved out of DEFAULT;
#   - pg_amcheck --heapallindexed --parent-check --rootdescend on the schema
#     (partitions, their TOAST tables and all their indexes) finds nothing,
#     and neither do verify_heapam and bt_index_parent_check called directly;
#   - the standby, caught up, holds the same rows, answers idem_lookup the
#     same, refuses claims with 25006, and bt_index_check with
#     heapallindexed finds nothing there.

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

my $clients = 4;
my $load_secs = 9;

my $primary = PostgreSQL::Test::Cluster->new('primary');
$primary->init(allows_streaming => 1);
$primary->append_conf(
	'postgresql.conf', q{
max_connections = 40
log_statement = none
autovacuum = off
});
$primary->start;

# One-second partitions: a claim with the largest ttl lands in DEFAULT two
# or three seconds after the last maintenance run.  Short waits, so that a
# duplicate of a running lease does not stall a pgbench client.
$primary->safe_psql(
	'postgres', q{
ALTER DATABASE postgres SET idempotency.partition_interval = '1s';
ALTER DATABASE postgres SET idempotency.max_ttl = '30s';
ALTER DATABASE postgres SET idempotency.default_ttl = '30s';
ALTER DATABASE postgres SET idempotency.wait_timeout = '100ms';
ALTER DATABASE postgres SET idempotency.maintenance_lock_timeout = '5s';
});
$primary->safe_psql(
	'postgres', q{
CREATE EXTENSION idempotency;
CREATE EXTENSION amcheck;

CREATE SEQUENCE ks;
-- every answer the load got; per key in the order it got them
CREATE TABLE ev (
    id        bigserial PRIMARY KEY,
    key       text NOT NULL,
    src       text NOT NULL,
    outcome   text NOT NULL,
    attempt   int,
    body_md5  text
);
CREATE INDEX ON ev (key);
-- committed claims of keys never released: what replays, mismatches and
-- takeovers pick from
CREATE TABLE pool (id bigserial PRIMARY KEY, n bigint NOT NULL);

-- a response body of about 32 * blobs bytes of random hex, naming its key
CREATE FUNCTION body(k text, blobs int) RETURNS jsonb LANGUAGE sql VOLATILE AS $$
SELECT jsonb_build_object('k', k, 'blob',
       (SELECT string_agg(md5(random()::text || g), '') FROM generate_series(1, blobs) g))
$$;

-- claim k; if acquired and blobs is given, complete it at once
CREATE FUNCTION work(src text, k text, req jsonb, blobs int, ttl int, lease_ms int)
RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    a   record;
    b   jsonb;
    ok  boolean;
BEGIN
    SELECT * INTO a FROM idempotency.idem_acquire(k, req, '', make_interval(secs => ttl),
                                                  make_interval(secs => lease_ms / 1000.0));
    INSERT INTO ev (key, src, outcome, attempt, body_md5)
    VALUES (k, src, a.outcome, a.attempt, md5(a.response_body::text));
    IF a.outcome = 'acquired' AND blobs IS NOT NULL THEN
        b := body(k, blobs);
        ok := idempotency.idem_complete(k, 201, b, '', a.attempt);
        INSERT INTO ev (key, src, outcome, attempt, body_md5)
        VALUES (k, src, CASE WHEN ok THEN 'completed' ELSE 'complete-false' END,
                a.attempt, md5(b::text));
    END IF;
    RETURN a.outcome;
END
$$;

-- complete a lease claim in a later transaction; refused if taken over
CREATE FUNCTION finish(k text, att int, blobs int) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    b   jsonb := body(k, blobs);
    ok  boolean;
BEGIN
    ok := idempotency.idem_complete(k, 201, b, '', att);
    INSERT INTO ev (key, src, outcome, attempt, body_md5)
    VALUES (k, 'lease', CASE WHEN ok THEN 'completed' ELSE 'complete-false' END, att, md5(b::text));
    RETURN 'done';
EXCEPTION WHEN object_not_in_prerequisite_state THEN
    INSERT INTO ev (key, src, outcome, attempt) VALUES (k, 'lease', 'late-refused', att);
    RETURN 'late';
END
$$;

CREATE FUNCTION rel(k text) RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    ok  boolean := idempotency.idem_release(k, '', 1);
BEGIN
    INSERT INTO ev (key, src, outcome, attempt)
    VALUES (k, 'rel', CASE WHEN ok THEN 'released' ELSE 'release-false' END, 1);
    RETURN ok;
END
$$;

-- a random key of the pool
CREATE FUNCTION pick() RETURNS bigint LANGUAGE sql AS $$
SELECT n FROM pool
 WHERE id >= (SELECT floor(random() * max(id))::bigint + 1 FROM pool)
 ORDER BY id LIMIT 1
$$;
});

# a few completed keys for the first replays to find
$primary->safe_psql(
	'postgres', q{
SELECT work('new', 'k' || n, jsonb_build_object('k', 'k' || n), 20, 30, NULL)
  FROM (SELECT nextval('ks') AS n FROM generate_series(1, 20)) s;
INSERT INTO pool (n) SELECT generate_series(1, 20);
});

$primary->backup('base');
my $standby = PostgreSQL::Test::Cluster->new('standby');
$standby->init_from_backup($primary, 'base', has_streaming => 1);
$standby->start;

# ------------------------------------------------------------------
# The load
# ------------------------------------------------------------------
my $tmp = PostgreSQL::Test::Utils::tempdir;
my %scripts = (
	# a new key, completed at once: ~1 kB inline, ~8 kB and ~100 kB TOASTed
	new => q{
\set ttl random(20, 30)
\set r random(1, 100)
\set blobs CASE WHEN :r <= 40 THEN 30 WHEN :r <= 90 THEN 250 ELSE 3000 END
SELECT nextval('ks') AS n \gset
SELECT work('new', 'k' || :n, jsonb_build_object('k', 'k' || :n), :blobs, :ttl, NULL);
INSERT INTO pool (n) VALUES (:n);
},
	# a retry of a known key: replay, or a takeover of an abandoned lease
	replay => q{
\set blobs random(10, 300)
SELECT pick() AS n \gset
SELECT work('replay', 'k' || :n, jsonb_build_object('k', 'k' || :n), :blobs, 30, NULL);
},
	# a known key with another request
	wrong => q{
SELECT pick() AS n \gset
SELECT work('wrong', 'k' || :n, jsonb_build_object('k', 'k' || :n, 'x', 1), 30, 30, NULL);
},
	# a lease claim, completed in a later transaction or abandoned
	lease => q{
\set ttl random(20, 30)
\set fin random(0, 1)
SELECT nextval('ks') AS n \gset
SELECT work('lease', 'k' || :n, jsonb_build_object('k', 'k' || :n), NULL, :ttl, 300);
INSERT INTO pool (n) VALUES (:n);
\if :fin
\sleep 150 ms
SELECT finish('k' || :n, 1, 250);
\endif
},
	# claim, release, claim again and complete
	rel => q{
SELECT nextval('ks') AS n \gset
SELECT work('rel', 'r' || :n, jsonb_build_object('k', 'r' || :n), NULL, 30, 5000);
SELECT rel('r' || :n);
SELECT work('rel', 'r' || :n, jsonb_build_object('k', 'r' || :n), 250, 30, NULL);
},
	# eight hot keys, claimed with a 50 ms lease and taken over again and again
	hot => q{
\set h random(1, 8)
SELECT work('hot', 'h' || :h, jsonb_build_object('k', 'h' || :h), NULL, 30, 50);
},);
my %weights = (new => 4, replay => 4, wrong => 1, lease => 2, rel => 1, hot => 2);
my @script_args;
foreach my $name (sort keys %scripts)
{
	my $file = "$tmp/$name.sql";
	open my $fh, '>', $file or die $!;
	print $fh $scripts{$name};
	close $fh;
	push @script_args, '-f', "$file\@$weights{$name}";
}

# maintenance now, then only when claims wait in DEFAULT
$primary->safe_psql('postgres', 'SELECT idempotency.idem_maintain()');

my @vacuums = (
	'VACUUM idempotency.records',
	'VACUUM (INDEX_CLEANUP on) idempotency.records',
	'VACUUM (INDEX_CLEANUP on, DISABLE_PAGE_SKIPPING) idempotency.records_default');
my ($nvacuum, @maint, @results) = (0);
my ($out, $err) = ('', '');
# the maintenance runs that found claims waiting in DEFAULT and emptied it
my $moves = sub {
	return scalar grep {
		my ($in, $created, $left) = split /\n/;
		$in > 0 && $created > 0 && $left == 0
	} @maint;
};

# The load runs in rounds of $load_secs, as many as it takes (ten at most)
# for VACUUM to have run five times and maintenance to have emptied DEFAULT
# twice while a round was under way: a slow or shared machine gets a longer
# load, not a check that fails for want of time.
my $t0 = time;
for (my $round = 1; $round <= 10; $round++)
{
	my ($o, $e) = ('', '');
	my $t_round = time;
	my $h = IPC::Run::start(
		[
			'pgbench', '-n', '-M', 'prepared', '-c', $clients, '-j', '2',
			'-T', $load_secs, '-h', $primary->host, '-p', $primary->port,
			@script_args, 'postgres'
		],
		'>', \$o, '2>', \$e);
	while (time - $t_round < $load_secs - 0.3)
	{
		$primary->safe_psql('postgres', $vacuums[ $nvacuum++ % @vacuums ]);
		my $waiting = $primary->safe_psql('postgres',
			'SELECT count(*) FROM idempotency.records_default');
		next if $waiting < 3;
		# the rows in DEFAULT, maintenance, and what is left there
		push @maint,
		  $primary->safe_psql(
			'postgres', q{
SELECT count(*) FROM idempotency.records_default;
SELECT partitions_created FROM idempotency.idem_maintain();
SELECT count(*) FROM idempotency.records_default;
});
		usleep(100_000);
	}
	$h->finish;
	push @results, $h->result(0);
	$out .= $o;
	$err .= $e;
	last if $nvacuum >= 5 && $moves->() >= 2;
}
my $load_time = time - $t0;
note "load ran ${load_time}s in " . scalar(@results)
  . " rounds: $nvacuum vacuums, maintenance runs (in DEFAULT, created, left): "
  . join('; ', map { join ',', split /\n/ } @maint);
note $out;

is(join(',', @results), join(',', (0) x @results), 'pgbench exited 0 in every round');
is($err =~ s/^pgbench: warning:.*\n//mgr, '', 'pgbench printed no error');
my $clean_rounds = () = $out =~ /^number of failed transactions: 0 /mg;
is($clean_rounds, scalar(@results), 'no pgbench transaction failed');
my $processed = 0;
$processed += $1 while $out =~ /^number of transactions actually processed: (\d+)/mg;
cmp_ok($processed, '>=', 300, "the load processed transactions ($processed)");

cmp_ok($nvacuum, '>=', 5, "VACUUM ran during the load ($nvacuum times)");
cmp_ok($moves->(), '>=', 2,
	'maintenance ran at least twice during the load and emptied DEFAULT each time ('
	  . $moves->() . ' of ' . scalar(@maint) . ' runs)');

# ------------------------------------------------------------------
# Honesty of the load, from the log of every answer
# ------------------------------------------------------------------
my $stats = $primary->safe_psql(
	'postgres', q{
SELECT
  (SELECT count(*) FROM ev WHERE src = 'new' AND outcome NOT IN ('acquired', 'completed')),
  (SELECT count(*) FROM ev WHERE outcome = 'complete-false'),
  (SELECT count(*) FROM (SELECT key FROM ev WHERE outcome = 'completed'
                          GROUP BY key HAVING count(*) > 1) d),
  (SELECT count(*) FROM ev WHERE outcome = 'replay'),
  (SELECT count(*) FROM ev r WHERE r.outcome = 'replay' AND NOT EXISTS (
       SELECT FROM ev c WHERE c.key = r.key AND c.outcome = 'completed'
          AND c.body_md5 = r.body_md5 AND c.id < r.id)),
  (SELECT count(*) FROM (SELECT key, attempt FROM ev
                          WHERE outcome = 'acquired' AND src <> 'rel'
                          GROUP BY 1, 2 HAVING count(*) > 1) d),
  (SELECT count(*) FROM ev WHERE outcome = 'acquired' AND attempt > 1 AND src = 'hot'),
  (SELECT count(*) FROM ev WHERE outcome = 'acquired' AND attempt > 1 AND src = 'replay'),
  (SELECT count(*) FROM ev WHERE src = 'wrong'),
  (SELECT count(*) FROM ev WHERE (src = 'wrong') <> (outcome = 'mismatch')),
  (SELECT count(*) FROM ev WHERE outcome = 'released'),
  (SELECT count(*) FROM (SELECT key FROM ev WHERE src = 'rel' GROUP BY key
                          HAVING string_agg(outcome || attempt, ' ' ORDER BY id)
                                 <> 'acquired1 released1 acquired1 completed1') d),
  (SELECT count(*) FROM ev WHERE src = 'lease' AND outcome = 'completed'),
  (SELECT count(*) FROM ev WHERE outcome = 'in_progress')
});
my ($new_bad, $complete_false, $twice, $replays, $bad_replays, $dup_attempts,
	$hot_takeovers, $lease_takeovers, $wrongs, $bad_mismatch, $releases,
	$bad_rel, $lease_completed, $in_progress) = split /\|/, $stats;
note "replays $replays, takeovers hot $hot_takeovers and abandoned $lease_takeovers, "
  . "mismatches $wrongs, releases $releases, lease completions $lease_completed, in_progress $in_progress";
is($new_bad, 0, 'every new key was acquired');
is($complete_false, 0, 'no completion found its record completed already');
is($twice, 0, 'no key was completed twice');
cmp_ok($replays, '>=', 30, "replays happened ($replays)");
is($bad_replays, 0, 'every replay returned the body its key was completed with');
is($dup_attempts, 0, 'no two claims of a key got the same attempt');
cmp_ok($hot_takeovers, '>=', 10, "hot keys were taken over ($hot_takeovers)");
cmp_ok($lease_takeovers, '>=', 1, "abandoned lease claims were taken over ($lease_takeovers)");
cmp_ok($wrongs, '>=', 5, "requests with another payload were made ($wrongs)");
is($bad_mismatch, 0, 'exactly the requests with another payload got mismatch');
cmp_ok($releases, '>=', 5, "claims were released ($releases)");
is($bad_rel, 0, 'every released key was claimed again as attempt 1 and completed');
cmp_ok($lease_completed, '>=', 5, "lease claims were completed in a later transaction ($lease_completed)");

# the stored records are what the log says, key by key
my $agree = $primary->safe_psql(
	'postgres', q{
WITH keys AS (
    SELECT key,
           max(attempt) FILTER (WHERE outcome = 'acquired') AS attempt,
           max(body_md5) FILTER (WHERE outcome = 'completed') AS body_md5,
           max(attempt) FILTER (WHERE outcome = 'completed') AS completed_attempt
      FROM ev GROUP BY key)
SELECT (SELECT count(*) FROM keys),
       (SELECT count(*) FROM idempotency.records),
       (SELECT count(*) FROM keys k WHERE (SELECT count(*) FROM idempotency.records r
                                            WHERE r.scope = '' AND r.key = k.key) <> 1),
       (SELECT count(*) FROM keys k JOIN idempotency.records r ON r.scope = '' AND r.key = k.key
         WHERE k.body_md5 IS NOT NULL
           AND (r.status <> 'completed' OR r.attempt <> k.completed_attempt
                OR md5(r.response_body::text) <> k.body_md5
                OR r.response_body->>'k' <> k.key)),
       (SELECT count(*) FROM keys k JOIN idempotency.records r ON r.scope = '' AND r.key = k.key
         WHERE k.body_md5 IS NULL
           AND (r.status <> 'processing' OR r.attempt <> k.attempt
                OR r.response_body IS NOT NULL)),
       (SELECT count(*) FROM idempotency.records
         WHERE request_hash <> idempotency.idem_request_hash(jsonb_build_object('k', key)))
});
my ($nkeys, $nrecords, $not_one, $bad_completed, $bad_processing, $bad_hash) = split /\|/, $agree;
cmp_ok($nkeys, '>=', 100, "keys claimed ($nkeys)");
is($nrecords, $nkeys, 'one record for each key the log names, and no other');
is($not_one, 0, 'every key has exactly one record');
is($bad_completed, 0, 'every completed key has its record completed with its attempt and body');
is($bad_processing, 0, 'every key never completed has its record processing at its last attempt');
is($bad_hash, 0, 'every record has the hash of the request it was claimed with');

# what the load was meant to exercise
my ($toast_bytes, $big, $huge, $nonhot, $hot, $deleted, $nparts) = split /\|/,
  $primary->safe_psql(
	'postgres', q{
SELECT (SELECT sum(pg_relation_size(c.reltoastrelid))
          FROM pg_class c JOIN idempotency.partitions p ON p.partition = c.oid),
       (SELECT count(*) FROM idempotency.records WHERE length(response_body::text) > 4000),
       (SELECT count(*) FROM idempotency.records WHERE length(response_body::text) > 90000),
       (SELECT sum(s.n_tup_upd - s.n_tup_hot_upd) FROM pg_stat_user_tables s
          JOIN idempotency.partitions p ON p.partition = s.relid),
       (SELECT sum(s.n_tup_hot_upd) FROM pg_stat_user_tables s
          JOIN idempotency.partitions p ON p.partition = s.relid),
       (SELECT sum(s.n_tup_del) FROM pg_stat_user_tables s
          JOIN idempotency.partitions p ON p.partition = s.relid),
       (SELECT count(*) FROM idempotency.partitions p
         WHERE EXISTS (SELECT FROM idempotency.records r WHERE r.tableoid = p.partition))
});
note "TOAST $toast_bytes bytes, bodies > 4 kB $big, > 90 kB $huge, "
  . "updates non-HOT $nonhot HOT $hot, deletes $deleted, partitions with records $nparts";
cmp_ok($toast_bytes, '>', 256 * 1024, "bodies were TOASTed ($toast_bytes bytes)");
cmp_ok($big, '>=', 30, "bodies over 4 kB stored ($big)");
cmp_ok($huge, '>=', 3, "bodies of ~100 kB stored ($huge)");
cmp_ok($nonhot, '>=', 20, "updates that were not HOT ($nonhot)");
cmp_ok($deleted, '>=', 5, "records deleted ($deleted)");
cmp_ok($nparts, '>=', 5, "records spread over partitions ($nparts)");

# ------------------------------------------------------------------
# amcheck on the primary
# ------------------------------------------------------------------
# the extension's tables (the partitions, and the statistics tables of
# 1.1), their TOAST tables and all their indexes
my $rels_sql = q{
WITH tables AS (
    SELECT c.oid AS relid, c.reltoastrelid FROM pg_class c
     WHERE c.relnamespace = 'idempotency'::regnamespace AND c.relkind = 'r'),
heaps AS (
    SELECT t.relid FROM tables t
    UNION ALL
    SELECT t.reltoastrelid FROM tables t WHERE t.reltoastrelid <> 0),
idx AS (
    SELECT i.indexrelid FROM pg_index i JOIN heaps h ON h.relid = i.indrelid)
};
my ($nheaps, $nidx) = split /\|/, $primary->safe_psql('postgres',
	"$rels_sql SELECT (SELECT count(*) FROM heaps), (SELECT count(*) FROM idx)");
my ($partitions, $toasted) = split /\|/, $primary->safe_psql('postgres',
	'SELECT count(*), count(*) FILTER (WHERE c.reltoastrelid <> 0)
	   FROM idempotency.partitions p JOIN pg_class c ON c.oid = p.partition');
is($toasted, $partitions, "every partition has its TOAST table ($partitions partitions, $nheaps heaps)");
is($nidx, $nheaps, "and every heap its one index ($nidx indexes)");

my ($ret, $stdout, $stderr) = $primary->psql(
	'postgres', qq{
$rels_sql
SELECT count(*) FROM heaps, verify_heapam(relid::regclass, check_toast => true);
$rels_sql
SELECT count(*) FROM idx, bt_index_parent_check(indexrelid::regclass, true, true);
});
is($ret, 0, 'verify_heapam and bt_index_parent_check ran on the primary');
is($stdout, "0\n$nidx", 'verify_heapam found nothing; bt_index_parent_check (heapallindexed, rootdescend) checked every index');
is($stderr, '', 'and raised nothing');

($ret, $stdout, $stderr) = (0, '', '');
my $amcheck = IPC::Run::run(
	[
		'pg_amcheck', '-h', $primary->host, '-p', $primary->port,
		'-d', 'postgres', '--schema', 'idempotency',
		'--heapallindexed', '--parent-check', '--rootdescend', '--verbose'
	],
	'>', \$stdout, '2>', \$stderr);
ok($amcheck, 'pg_amcheck --heapallindexed --parent-check --rootdescend exits 0');
is($stdout, '', 'pg_amcheck reports no corruption');
my %checked;
$checked{$1}++ while $stderr =~ /checking (heap table|btree index) "postgres\.(?:idempotency|pg_toast)\.[^"]+"/g;
is(($checked{'heap table'} // 0) . ' ' . ($checked{'btree index'} // 0), "$nheaps $nidx",
	'pg_amcheck checked every partition, TOAST table and index');

# ------------------------------------------------------------------
# The standby
# ------------------------------------------------------------------
$primary->wait_for_catchup($standby, 'replay', $primary->lsn('insert'));

my $digest = q{
SELECT (SELECT string_agg(status || ':' || n, ' ' ORDER BY status)
          FROM (SELECT status, count(*) AS n FROM idempotency.records GROUP BY status) s),
       (SELECT md5(string_agg(md5(r::text), '' ORDER BY scope, key, expires_at))
          FROM idempotency.records r)
};
my $pdigest = $primary->safe_psql('postgres', $digest);
like($pdigest, qr/^completed:\d+ processing:\d+\|[0-9a-f]{32}$/, "primary records: $pdigest");
is($standby->safe_psql('postgres', $digest), $pdigest,
	'the standby holds the same records (counts by status and every row)');

my $sample = $primary->safe_psql(
	'postgres', q{
SELECT string_agg(quote_literal(key), ',') FROM (
    SELECT key FROM idempotency.records WHERE expires_at > clock_timestamp() + interval '8s'
     ORDER BY md5(key) LIMIT 40) s});
my $lookups = qq{
SELECT count(l.status), md5(string_agg(k || '=' || coalesce(l::text, ''), ',' ORDER BY k))
  FROM unnest(ARRAY[$sample]::text[]) k
  LEFT JOIN LATERAL idempotency.idem_lookup(k) l ON true};
my $plookups = $primary->safe_psql('postgres', $lookups);
like($plookups, qr/^40\|/, 'idem_lookup finds the 40 sample keys on the primary');
is($standby->safe_psql('postgres', $lookups), $plookups,
	'idem_lookup answers the same on the standby');

foreach my $call (
	q{SELECT * FROM idempotency.idem_acquire('standby-new', '{}')},
	q{SELECT * FROM idempotency.idem_acquire('k1', '{"k": "k1"}')},
	q{SELECT idempotency.idem_complete('h1', 201, '{}')},
	q{SELECT idempotency.idem_release('h1')})
{
	my ($state) = sqlstate_of_psql($standby, 'postgres', $call);
	is($state, '25006', "on the standby: $call raises 25006");
}

($ret, $stdout, $stderr) = $standby->psql(
	'postgres', qq{
$rels_sql
SELECT count(*) FROM idx, bt_index_check(indexrelid::regclass, true);
$rels_sql
SELECT count(*) FROM heaps, verify_heapam(relid::regclass, check_toast => true);
});
is($ret, 0, 'bt_index_check and verify_heapam ran on the standby');
is($stdout, "$nidx\n0", 'bt_index_check (heapallindexed) checked every index; verify_heapam found nothing');
is($stderr, '', 'and raised nothing');

$standby->stop;
$primary->stop;
done_testing();
