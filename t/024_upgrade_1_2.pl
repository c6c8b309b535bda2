# Copyright (c) idempotency authors
#
# ALTER EXTENSION idempotency UPDATE from 1.1 to 1.2 on a live database, as
# t/012_upgrade.pl does for 1.0 to 1.1.
#
# A database is created at 1.1 and runs the 1.1 library, built from the last
# commit before idempotency--1.1--1.2.sql (IDEM_V11_LIBRARY, which
# scripts/test.sh builds; the extension's C functions point at a copy of it,
# so that "replacing the binaries" is a rename of that copy).  It holds
# records of every kind: completed, processing with a running lease, one
# whose lease ran out, a session-bound claim whose owner lives, a claim in
# an open transaction, a live and a consumed one-time token.  Then:
#   - a session opened before the binaries were replaced (1.1 library) and
#     one opened after them but before the update;
#   - the update with lock_timeout fails at once behind the open claim
#     transaction; without it, it waits, and a new claim queues behind it;
#   - after it: every record replays, completes, is taken over (no
#     checkpoint) or stays in_progress as the contract says; the tokens are
#     as they were; the old-library session fails cleanly (could not find
#     idem_acquire_1_2, idem_extend_1_2: nothing written) and the other
#     gets 1.2 answers; the application role keeps its privileges and gets
#     idem_checkpoint, the statistics reader keeps idem_stats() and the
#     stats view (with forgotten); the dated partitions that held records
#     keep their layout, the empty ones take 1.2's; pg_dump --schema-only
#     equals that of a fresh 1.2 install with the same grants (but for the
#     layout of those partitions); maintenance moves a 1.2 record out of
#     DEFAULT with its 1.2 columns.
# Without IDEM_V11_LIBRARY the old-library session is skipped.

use strict;
use warnings;

use File::Copy;
use FindBin;
use lib "$FindBin::RealBin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

# not preloaded: the database's functions load a copy of the library
my $node = idem_node('upgrade12', "log_statement = none\n");
my $v11 = $ENV{IDEM_V11_LIBRARY};
$v11 = undef unless defined $v11 && -f $v11;

# the documented grants at 1.1 and at 1.2 (sql/include), and a statistics
# reader's (docs/reference.md, Monitoring)
my $grants_11 = sql_fixture('readme_grants_1_1.sql', app_role => 'idem_app');
my $grants_12 = sql_fixture('readme_grants.sql', app_role => 'idem_app');
my $grants_stats = q{
GRANT USAGE ON SCHEMA idempotency TO idem_monitor;
GRANT EXECUTE ON FUNCTION idempotency.idem_stats(),
    idempotency.idem_acquire_histogram(),
    idempotency.owner_alive(int, timestamptz) TO idem_monitor;
GRANT SELECT ON idempotency.stats, idempotency.acquire_duration,
    idempotency.stale_claims, idempotency.daily TO idem_monitor;
};

$node->safe_psql('postgres',
	'CREATE ROLE idem_app LOGIN; CREATE ROLE idem_monitor LOGIN; CREATE DATABASE up; CREATE DATABASE fresh');
$node->safe_psql('up', "CREATE EXTENSION idempotency VERSION '1.1';\n$grants_11\n$grants_stats");

# The extension's C functions use a copy of the library that the test may
# replace, the 1.1 build where there is one.
my $pkglibdir = $node->config_data('--pkglibdir');
my $libcopy = $node->basedir . '/idempotency.so';
copy($v11 // "$pkglibdir/idempotency.so", $libcopy) or die "copy: $!";
my $repoint = qq{UPDATE pg_catalog.pg_proc SET probin = '$libcopy'
                  WHERE probin = '\$libdir/idempotency'
                    AND pronamespace = 'idempotency'::regnamespace};
$node->safe_psql('up', $repoint);

# records of every kind, made at 1.1
$node->safe_psql(
	'up', q{
SELECT outcome FROM idempotency.idem_acquire('up-done', '{"a": 1}');
SELECT idempotency.idem_complete('up-done', 201, '{"id": 1}');
SELECT outcome FROM idempotency.idem_acquire('up-lease', '{"a": 2}', lease => '1 hour');
SELECT outcome FROM idempotency.idem_acquire('up-short', '{"a": 3}', lease => '1 second');
CREATE TABLE public.tokens AS
SELECT idempotency.idem_token_issue('up') AS live, idempotency.idem_token_issue('up') AS spent;
SELECT idempotency.idem_token_consume(spent, 'up') FROM public.tokens;
});
my $open = $node->background_psql('up');
$open->query_safe(q{BEGIN; SELECT outcome FROM idempotency.idem_acquire('up-open', '{"a": 4}', lease => '1 hour')});
is( $node->safe_psql('up', q{SELECT extversion FROM pg_extension WHERE extname = 'idempotency'}),
	'1.1', 'the database is at 1.1 with a claim in an open transaction');

# a session with the old library loaded
my $pre11;
SKIP:
{
	skip 'IDEM_V11_LIBRARY not set: no session running the 1.1 library', 1 unless $v11;
	$pre11 = $node->background_psql('up', on_error_stop => 0);
	is($pre11->query_safe(q{SELECT count(*) FROM idempotency.idem_lookup('up-done')}),
		'1', 'a session runs the 1.1 library');
}

# "make install" of 1.2: the library file is replaced (a new file renamed
# over the old one, as install does)
copy("$pkglibdir/idempotency.so", "$libcopy.new") or die "copy: $!";
rename("$libcopy.new", $libcopy) or die "rename: $!";

# sessions opened after the binaries, before the update: 1.1's answers (one
# of them owns a session-bound claim made at 1.1)
my $owner = $node->background_psql('up');
$owner->query_safe(q{SELECT outcome FROM idempotency.idem_acquire('up-owned', '{"a": 5}', session_bound => true)});
my $pre12 = $node->background_psql('up', on_error_stop => 0);
is( $pre12->query_safe(
		q{SELECT outcome, attempt, claim IS NOT NULL FROM idempotency.idem_acquire('up-pre12', lease => '1 hour')}),
	'acquired|1|t', 'the 1.2 library serves the 1.1 database with 1.1 answers');
is( $pre12->query_safe(q{SELECT count(*) FROM pg_attribute WHERE attrelid = 'idempotency.acquire_result'::regclass AND attnum > 0}),
	'7', 'in seven columns');

# The update waits behind the open claim transaction (lock_timeout: it gives
# up at once), and a new claim queues behind the update.
my $before_update = $node->safe_psql('up', 'SELECT clock_timestamp()');
update_behind_open_claim($node, 'up', '1.1', '1.2', $repoint, $open);

# The dated partitions that held records at the update keep 1.1's layout
# and their records; the empty ones were made again in 1.2's (issue 36):
# one line a partition, "records made before the update|1.2's layout".
my $layout_12 = 'created_at,expires_at,owner_start,claim,attempt,owner_pid,is_token,'
  . 'scope,key,request_hash,trace,locked_until,status,response_status,completed_at,'
  . 'response_headers,response_body,phase,state {fillfactor=94}';
my $layouts = $node->safe_psql('up', qq{
SELECT EXISTS (SELECT FROM idempotency.records r
                WHERE r.tableoid = p.partition AND r.created_at < '$before_update')
       || '|' || ((SELECT string_agg(a.attname, ',' ORDER BY a.attnum)
                     FROM pg_attribute a
                    WHERE a.attrelid = p.partition AND a.attnum > 0 AND NOT a.attisdropped)
                  || ' ' || coalesce(c.reloptions::text, '-') = '$layout_12')
  FROM idempotency.partitions p JOIN pg_class c ON c.oid = p.partition
 WHERE NOT p.is_default});
my @layouts = split /\n/, $layouts;
ok( (grep { $_ eq 'true|false' } @layouts) && (grep { $_ eq 'false|true' } @layouts)
	  && !(grep { $_ ne 'true|false' && $_ ne 'false|true' } @layouts),
	'the update made the empty dated partitions again in 1.2\'s layout, and kept those holding records')
  or diag($layouts);
is( $node->safe_psql('up',
		q{SELECT attempt || '|' || (claim IS NOT NULL) || '|' || (trace IS NULL) FROM idempotency.records WHERE key = 'up-queued'}),
	'1|true|true', 'the queued claim went through after the update, as the 1.1 call it began as');

# the session with the old library fails cleanly and writes nothing
SKIP:
{
	skip 'IDEM_V11_LIBRARY not set', 5 unless $v11;
	$pre11->query(q{SELECT * FROM idempotency.idem_acquire('up-old-lib', lease => '1 hour')});
	like($pre11->{stderr}, qr/could not find function "idem_acquire_1_2"/,
		'the session running the 1.1 library cannot call the 1.2 idem_acquire');
	$pre11->{stderr} = '';
	$pre11->query(q{SELECT idempotency.idem_extend('up-lease')});
	like($pre11->{stderr}, qr/could not find function "idem_extend_1_2"/,
		'nor idem_extend, which would write a record without its 1.2 columns');
	$pre11->{stderr} = '';
	$pre11->query(q{SELECT * FROM idempotency.idem_lookup('up-done')});
	like($pre11->{stderr}, qr/could not find function "idem_lookup_1_2"/, 'nor idem_lookup');
	$pre11->{stderr} = '';
	is($pre11->query_safe('SELECT 1'), '1', 'and the session goes on');
	is($node->safe_psql('up', q{SELECT count(*) FROM idempotency.records WHERE key = 'up-old-lib'}),
		'0', 'no record written');
	$pre11->quit;
}

# the session opened before the update (1.2 library) uses the 1.2 functions
like( $pre12->query_safe(
		q{SELECT outcome || '|' || attempt || '|' || claim || '|' || COALESCE(origin_trace, '-')
		    FROM idempotency.idem_acquire('up-pre12-b', lease => '1 hour', trace => 'tp-pre12')}),
	qr/^acquired\|1\|[0-9a-f-]{36}\|-$/, 'the session opened before the update gets 1.2 answers after it');
is( $pre12->query_safe(q{SELECT origin_trace FROM idempotency.idem_lookup('up-pre12-b')}),
	'tp-pre12', 'and stores its trace');
$pre12->quit;

# every 1.1 record
is( $node->safe_psql('up',
		q{SET idempotency.wait_timeout = 0;
		  SELECT outcome, response_status, response_body, attempt, response_headers IS NULL, origin_trace IS NULL
		    FROM idempotency.idem_acquire('up-done', '{"a": 1}')}),
	'replay|201|{"id": 1}|1|t|t', 'the completed record replays, without headers or trace');
is( $node->safe_psql('up',
		q{SET idempotency.wait_timeout = 0;
		  SELECT outcome, attempt, retry_after > 3000 FROM idempotency.idem_acquire('up-lease', '{"a": 2}')}),
	'in_progress|1|t', 'the processing record is in_progress, retry_after its lease left');
is( $node->safe_psql('up', q{
SELECT idempotency.idem_checkpoint('up-lease', claim => (SELECT claim FROM idempotency.records WHERE key = 'up-lease'),
                                   phase => 'charged') IS NOT NULL;
SELECT idempotency.idem_complete('up-lease', 200, '{"ok": 1}',
                                 claim => (SELECT claim FROM idempotency.records WHERE key = 'up-lease'),
                                 response_headers => '{"Location": "/l"}');
SELECT phase, response_headers FROM idempotency.idem_lookup('up-lease')}),
	"t\nt\ncharged|{\"location\": \"/l\"}", 'its holder checkpoints and completes it with headers');
like( $node->safe_psql('up',
		q{SELECT outcome || '|' || attempt || '|' || claim || '|' || COALESCE(phase, 'none')
		    FROM idempotency.idem_acquire('up-short', '{"a": 3}')}),
	qr/^acquired\|2\|[0-9a-f-]{36}\|none$/, 'the record whose lease ran out is taken over, attempt 2, no checkpoint');
is( $node->safe_psql('up',
		q{SET idempotency.wait_timeout = 0;
		  SELECT outcome, attempt FROM idempotency.idem_acquire('up-owned', '{"a": 5}')}),
	'in_progress|1', 'the session-bound claim of a live owner is in_progress');
is( $owner->query_safe(q{SELECT idempotency.idem_complete('up-owned', 200)}),
	't', 'and its owner completes it');
$owner->quit;
is( $node->safe_psql('up',
		q{SET idempotency.wait_timeout = 0;
		  SELECT outcome, attempt FROM idempotency.idem_acquire('up-open', '{"a": 4}')}),
	'in_progress|1', 'the claim committed during the update is in_progress');
is( $node->safe_psql('up', q{
SELECT idempotency.idem_token_consume(live, 'up'), idempotency.idem_token_consume(spent, 'up')
  FROM public.tokens}),
	't|f', 'the live token is consumed once, the spent one stays spent');
is($node->safe_psql('up', q{SELECT idempotency.idem_forget('up-done')}), 't', 'a 1.1 record can be forgotten');

# the application role, granted at 1.1, after the update
is( $node->safe_psql(
		'up', q{
SET ROLE idem_app;
SELECT a.outcome FROM idempotency.idem_acquire('up-app', lease => '1 minute', trace => 'tp-app') a;
SELECT idempotency.idem_extend('up-app') IS NOT NULL;
SELECT idempotency.idem_checkpoint('up-app', claim => (SELECT claim FROM idempotency.records WHERE key = 'up-app'),
                                   phase => 'step-1') IS NOT NULL;
SELECT idempotency.idem_complete('up-app', 200,
           claim => (SELECT claim FROM idempotency.records WHERE key = 'up-app'),
           response_headers => '{"ETag": "x"}');
SELECT a.outcome, a.response_headers, a.origin_trace FROM idempotency.idem_acquire('up-app') a;
}),
	"acquired\nt\nt\nt\nreplay|{\"etag\": \"x\"}|tp-app",
	'the application role works after the update, idem_checkpoint included');
my ($app_forget) = sqlstate_of_psql($node, 'up', q{SET ROLE idem_app; SELECT idempotency.idem_forget('up-app')});
is($app_forget, '42501', 'but may not forget keys');
is( $node->safe_psql('up', q{
SELECT has_function_privilege('idem_monitor', 'idempotency.idem_stats()', 'EXECUTE'),
       has_table_privilege('idem_monitor', 'idempotency.stats', 'SELECT'),
       has_table_privilege('idem_monitor', 'idempotency.stale_claims', 'SELECT');
SELECT string_agg(attname, ',' ORDER BY attnum) FROM pg_attribute
 WHERE attrelid = 'idempotency.stats'::regclass AND attnum > 12;
SET ROLE idem_monitor; SELECT count(origin_trace) FROM idempotency.stale_claims}),
	"t|t|t\nstats_reset,forgotten\n0",
	'the statistics reader keeps idem_stats(), the stats view (forgotten at its end) and stale_claims (with origin_trace)');

# the same objects as a fresh 1.2 install with the same grants
$node->safe_psql('up', 'DROP TABLE public.tokens');
$node->safe_psql('up', q{UPDATE pg_catalog.pg_proc SET probin = '$libdir/idempotency'
                          WHERE pronamespace = 'idempotency'::regnamespace AND probin IS NOT NULL});
$node->safe_psql('fresh', "CREATE EXTENSION idempotency;\n$grants_12\n$grants_stats");
my %dump;
my $pg_dump = $node->config_data('--bindir') . '/pg_dump';
foreach my $db (qw(up fresh))
{
	my ($out, $err);
	IPC::Run::run(
		[ $pg_dump, '--schema-only', '-h', $node->host, '-p', $node->port, $db ],
		'>', \$out, '2>', \$err) or die "pg_dump $db: $err";
	# partitions are named by date: made at different seconds they may differ
	$out =~ s/records_p\d{8}_\d{6}/records_pDATE/g;
	# A dated partition that held records at the update keeps 1.1's column
	# order and fillfactor (checked above): their columns and constraints
	# are compared as sets.  On 18 its NOT NULL constraints also keep the
	# names they had (records_key_not_null, which pg_dump then prints),
	# where a partition made again names its own.
	$out =~ s{(CREATE TABLE idempotency\.records_pDATE \(\n)(.*?)\n\)(?:\nWITH \([^)]*\))?;}
	  {$1 . join(",\n", sort map { s/,$//r =~ s/ CONSTRAINT \S+_not_null NOT NULL/ NOT NULL/r } split /\n/, $2) . "\n);"}gse;
	$out =~ s/^\\(un)?restrict .*$//mg;    # a random key per dump
	$out =~ s/'\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[+-]\d\d'/'TIME'/g;
	$dump{$db} = $out;
}
is($dump{up}, $dump{fresh}, 'pg_dump --schema-only of the updated database equals a fresh 1.2 install');
like($dump{up}, qr/GRANT ALL ON FUNCTION idempotency\.idem_checkpoint\(.*\) TO idem_app;/,
	'and dumps the application role\'s grant on idem_checkpoint');

# Maintenance moves a 1.2 record out of DEFAULT with its 1.2 columns.
my $holder = $node->background_psql('up');
$holder->query_safe(q{SET idempotency.max_ttl = '30d';
SELECT outcome FROM idempotency.idem_acquire('up-moved', ttl => '12 days', session_bound => true, trace => 'tp-moved');
SELECT idempotency.idem_checkpoint('up-moved', claim => (SELECT claim FROM idempotency.records WHERE key = 'up-moved'),
                                   phase => 'half', state => '{"n": 1}') IS NOT NULL});
my $cols = q{SELECT tableoid::regclass, claim, phase, state, trace, attempt FROM idempotency.records WHERE key = 'up-moved'};
my $before_move = $node->safe_psql('up', $cols);
like($before_move, qr/^idempotency\.records_default\|[0-9a-f-]{36}\|half\|\{"n": 1\}\|tp-moved\|1$/,
	'a claim beyond the partitions made so far waits in DEFAULT with its checkpoint and trace');
$node->safe_psql('up', q{SET idempotency.max_ttl = '30d'; SELECT idempotency.idem_maintain()});
my $after_move = $node->safe_psql('up', $cols);
(my $expect = $before_move) =~ s/^idempotency\.records_default\|//;
like($after_move, qr/^idempotency\.records_p\d{8}_\d{6}\|\Q$expect\E$/,
	'maintenance moves it to its partition with phase, state and trace');
$holder->quit;

$node->stop;
done_testing();
