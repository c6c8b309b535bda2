# Copyright (c) idempotency authors
#
# idem_forget racing replays (1.2).  Readers (pgbench, 4 clients) call
# idem_acquire on one key over and over with the known-absent filters
# READY, so that replays take the lock-free read; a reader answered
# acquired completes at once with a body of a new id.  One forgetter
# (pgbench, 1 client) forgets the key's completed record, noting its id and
# a time taken after the forget committed.  Every answer is logged with its
# statement's start.  Then no replay whose statement began after the forget
# of its record committed may answer that record: a statement starting
# later has a snapshot with the delete in it.  There must also have been
# forgets and replays, and replays of records later forgotten (else the
# test proves nothing).

use strict;
use warnings;

use FindBin;
use lib "$FindBin::RealBin/lib";
use IdemTest;
use IPC::Run;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node = idem_node('forget_race',
	"log_statement = none\nshared_preload_libraries = 'pg_cron,idempotency'\n");
$node->safe_psql(
	'postgres', q{
CREATE TABLE race_log (started timestamptz, outcome text, id text);
CREATE TABLE forget_log (id text, forgotten boolean, committed_after timestamptz, pid int);
SELECT outcome FROM idempotency.idem_acquire('race', '{"r": 1}');
SELECT idempotency.idem_complete('race', 200, '{"id": "first"}');
});
$node->safe_psql('postgres', 'SELECT idempotency.build_filters()');
is( $node->safe_psql('postgres', q{SELECT count(*) > 0 FROM idempotency.idem_filters() WHERE state = 'ready'}),
	't', 'the filters are ready');

my $dir = PostgreSQL::Test::Utils::tempdir;
my $reader = "$dir/reader.sql";
my $forgetter = "$dir/forgetter.sql";
PostgreSQL::Test::Utils::append_to_file($reader, q{
SELECT pg_catalog.count(*) FROM idempotency.idem_lookup('warm-up-absent');
WITH a AS MATERIALIZED (SELECT * FROM idempotency.idem_acquire('race', '{"r": 1}'))
INSERT INTO race_log
SELECT statement_timestamp(), a.outcome, a.response_body->>'id'
  FROM a
 WHERE a.outcome <> 'acquired'
    OR idempotency.idem_complete('race', 200, jsonb_build_object('id', gen_random_uuid()::text));
});
PostgreSQL::Test::Utils::append_to_file($forgetter, q{
INSERT INTO forget_log
SELECT l.response_body->>'id', idempotency.idem_forget('race'), NULL, pg_backend_pid()
  FROM idempotency.idem_lookup('race') l WHERE l.status = 'completed';
UPDATE forget_log SET committed_after = clock_timestamp()
 WHERE committed_after IS NULL AND pid = pg_backend_pid();
\sleep 5 ms
});

# pgbench against the node for SECS seconds, in the background
my $secs = 8;
sub start_pgbench
{
	my ($script, $clients, $options) = @_;
	my ($out, $err) = ('', '');
	local $ENV{PGOPTIONS} = $options;
	my $h = IPC::Run::start(
		[ 'pgbench', '-n', '-c', $clients, '-T', $secs, '-f', $script, $node->connstr('postgres') ],
		'>', \$out, '2>', \$err);
	return ($h, \$out, \$err);
}
my ($hr, $rout, $rerr) = start_pgbench($reader, 4, '-c idempotency.wait_timeout=30s');
my ($hf, $fout, $ferr) = start_pgbench($forgetter, 1, '-c idempotency.wait_timeout=30s');
ok($hf->finish, 'the forgetter ran without errors') or diag($$ferr);
ok($hr->finish, 'the readers ran without errors') or diag($$rerr);

my ($forgets, $replays, $replays_of_forgotten) = split /\|/, $node->safe_psql(
	'postgres', q{
SELECT (SELECT count(*) FROM forget_log WHERE forgotten),
       (SELECT count(*) FROM race_log WHERE outcome = 'replay'),
       (SELECT count(*) FROM race_log r JOIN forget_log f ON f.id = r.id AND f.forgotten
         WHERE r.outcome = 'replay')});
note "forgets $forgets, replays $replays, of records later forgotten $replays_of_forgotten";
cmp_ok($forgets, '>', 5, 'the forgetter forgot records');
cmp_ok($replays_of_forgotten, '>', 0, 'readers replayed records that were then forgotten');

is( $node->safe_psql(
		'postgres', q{
SELECT count(*) FROM race_log r JOIN forget_log f ON f.id = r.id AND f.forgotten
 WHERE r.outcome = 'replay' AND r.started > f.committed_after}),
	'0', 'no statement begun after a forget committed replayed the forgotten record');
is( $node->safe_psql('postgres',
		q{SELECT count(*) FROM race_log WHERE outcome NOT IN ('replay', 'acquired')}),
	'0', 'every reader was answered replay or acquired (a forget never leaves in_progress or mismatch)');

$node->stop;
done_testing();
