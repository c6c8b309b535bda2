# Copyright (c) idempotency authors
#
# ALTER EXTENSION idempotency UPDATE from 1.0 to 1.1 on a live database
# (1.1 to 1.2: t/024_upgrade_1_2.pl).
#
# A database is created at 1.0 and runs the 1.0 library, built from the last
# commit before idempotency--1.0--1.1.sql (IDEM_V10_LIBRARY, which
# scripts/test.sh builds; the test points the extension's C functions at a
# copy of it, so that "replacing the binaries" is a rename of that copy).
# It holds records of every kind: completed, processing with a running lease,
# processing with a lease run out, and a claim in an open transaction.  Then:
#   - a session opened before the binaries were replaced (the 1.0 library
#     loaded) and one opened after them but before the update;
#   - the update with lock_timeout set fails at once while the open claim
#     transaction holds its lock; without lock_timeout it waits, and a new
#     claim queues behind it until the claim transaction commits;
#   - after it: every record replays, completes with its attempt, or is
#     taken over as the contract says; the old-library session fails cleanly
#     (42883, no row written) and the other keeps working; the README's
#     application role keeps its privileges; pg_dump --schema-only of the
#     updated database equals that of a fresh 1.1 install with the same grants
#     (of the whole database: pg_dump 15.20 -n idempotency crashes, at 1.0
#     too); maintenance moves a 1.1 record out of DEFAULT with its columns.
# Without IDEM_V10_LIBRARY the old-library session is skipped.

use strict;
use warnings;

use File::Copy;
use FindBin;
use lib "$FindBin::RealBin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node = idem_node('upgrade', "log_statement = none\n");
my $v10 = $ENV{IDEM_V10_LIBRARY};
$v10 = undef unless defined $v10 && -f $v10;

# the README's grants at 1.0 and at 1.1 (sql/include)
my $grants_10 = sql_fixture('readme_grants_1_0.sql', app_role => 'idem_app');
my $grants_11 = sql_fixture('readme_grants_1_1.sql', app_role => 'idem_app');

$node->safe_psql('postgres', 'CREATE ROLE idem_app LOGIN; CREATE DATABASE up; CREATE DATABASE fresh');
$node->safe_psql('up', "CREATE EXTENSION idempotency VERSION '1.0';\n$grants_10");

# The extension's C functions use a copy of the library that the test may
# replace, the 1.0 build where there is one.
my $pkglibdir = $node->config_data('--pkglibdir');
my $libcopy = $node->basedir . '/idempotency.so';
copy($v10 // "$pkglibdir/idempotency.so", $libcopy) or die "copy: $!";
my $repoint = qq{UPDATE pg_catalog.pg_proc SET probin = '$libcopy'
                  WHERE probin = '\$libdir/idempotency'
                    AND pronamespace = 'idempotency'::regnamespace};
$node->safe_psql('up', $repoint);

# records of every kind, made by 1.0
$node->safe_psql(
	'up', q{
SELECT outcome FROM idempotency.idem_acquire('up-done', '{"a": 1}');
SELECT idempotency.idem_complete('up-done', 201, '{"id": 1}');
SELECT outcome FROM idempotency.idem_acquire('up-lease', '{"a": 2}', lease => '1 hour');
SELECT outcome FROM idempotency.idem_acquire('up-short', '{"a": 3}', lease => '1 second');
});
my $open = $node->background_psql('up');
$open->query_safe(q{BEGIN; SELECT outcome FROM idempotency.idem_acquire('up-open', '{"a": 4}', lease => '1 hour')});
is( $node->safe_psql('up', q{SELECT extversion FROM pg_extension WHERE extname = 'idempotency'}),
	'1.0', 'the database is at 1.0 with a claim in an open transaction');

# a session with the old library loaded
my $pre10;
SKIP:
{
	skip 'IDEM_V10_LIBRARY not set: no session running the 1.0 library', 1 unless $v10;
	$pre10 = $node->background_psql('up', on_error_stop => 0);
	is($pre10->query_safe(q{SELECT count(*) FROM idempotency.idem_lookup('up-done')}),
		'1', 'a session runs the 1.0 library');
}

# "make install" of 1.1: the library file is replaced (a new file renamed
# over the old one, as install does)
copy("$pkglibdir/idempotency.so", "$libcopy.new") or die "copy: $!";
rename("$libcopy.new", $libcopy) or die "rename: $!";

# a session opened after the binaries, before the update: 1.0's answers
my $pre11 = $node->background_psql('up', on_error_stop => 0);
is( $pre11->query_safe(q{SELECT * FROM idempotency.idem_acquire('up-pre11', lease => '1 hour') WHERE false}),
	'', 'the 1.1 library serves the 1.0 database');
is( $pre11->query_safe(
		q{SELECT outcome, attempt FROM idempotency.idem_acquire('up-pre11', lease => '1 hour')}),
	'acquired|1', 'with 1.0 answers (five columns)');

# The update waits behind the open claim transaction (lock_timeout: it gives
# up at once), and a new claim queues behind the update.
update_behind_open_claim($node, 'up', '1.0', '1.1', $repoint, $open);
is( $node->safe_psql('up',
		q{SELECT attempt || '|' || (claim IS NOT NULL) FROM idempotency.records WHERE key = 'up-queued'}),
	'1|false', 'the queued claim went through after the update, as the 1.0 call it began as (no claim)');

# the session with the old library fails cleanly and writes nothing
SKIP:
{
	skip 'IDEM_V10_LIBRARY not set', 4 unless $v10;
	my $res = $pre10->query(q{SELECT * FROM idempotency.idem_acquire('up-old-lib', lease => '1 hour')});
	like($pre10->{stderr}, qr/could not find function "idem_acquire_1_1"/,
		'the session running the 1.0 library cannot call the 1.1 functions');
	$pre10->{stderr} = '';
	$pre10->query(q{SELECT * FROM idempotency.idem_lookup('up-done')});
	like($pre10->{stderr}, qr/could not find function "idem_lookup_1_1"/, 'nor idem_lookup');
	$pre10->{stderr} = '';
	is($pre10->query_safe('SELECT 1'), '1', 'and the session goes on');
	is($node->safe_psql('up', q{SELECT count(*) FROM idempotency.records WHERE key = 'up-old-lib'}),
		'0', 'no record written');
	$pre10->quit;
}

# the session opened before the update (1.1 library) uses the 1.1 functions
like( $pre11->query_safe(
		q{SELECT outcome || '|' || attempt || '|' || claim FROM idempotency.idem_acquire('up-pre11-b', lease => '1 hour')}),
	qr/^acquired\|1\|[0-9a-f-]{36}$/, 'the session opened before the update gets 1.1 answers after it');
$pre11->quit;

# every 1.0 record
is( $node->safe_psql('up',
		q{SET idempotency.wait_timeout = 0;
		  SELECT outcome, response_status, response_body, attempt, claim IS NULL
		    FROM idempotency.idem_acquire('up-done', '{"a": 1}')}),
	'replay|201|{"id": 1}|1|t', 'the completed record replays');
is( $node->safe_psql('up',
		q{SET idempotency.wait_timeout = 0;
		  SELECT outcome, attempt, retry_after > 3000 FROM idempotency.idem_acquire('up-lease', '{"a": 2}')}),
	'in_progress|1|t', 'the processing record is in_progress, retry_after its lease left');
my ($state) = sqlstate_of_psql($node, 'up',
	q{SELECT idempotency.idem_complete('up-lease', 200, claim => gen_random_uuid())});
is($state, '55000', 'a claim given for a 1.0 record gets 55000');
is($node->safe_psql('up', q{SELECT idempotency.idem_complete('up-lease', 200, '{"ok": 1}', attempt => 1)}),
	't', 'it completes with its attempt');
like( $node->safe_psql('up',
		q{SELECT outcome || '|' || attempt || '|' || claim FROM idempotency.idem_acquire('up-short', '{"a": 3}')}),
	qr/^acquired\|2\|[0-9a-f-]{36}$/, 'the record whose lease ran out is taken over, attempt 2, with a claim');
is( $node->safe_psql('up',
		q{SET idempotency.wait_timeout = 0;
		  SELECT outcome, attempt FROM idempotency.idem_acquire('up-open', '{"a": 4}')}),
	'in_progress|1', 'the claim committed during the update is in_progress');
is($node->safe_psql('up', q{SELECT idempotency.idem_complete('up-open', 200, attempt => 1)}),
	't', 'and completes with its attempt');

# the README's application role, granted on 1.0, after the update
is( $node->safe_psql(
		'up', q{
SET ROLE idem_app;
SELECT a.outcome FROM idempotency.idem_acquire('up-app', lease => '1 minute') a;
SELECT idempotency.idem_extend('up-app') IS NOT NULL;
SELECT idempotency.idem_complete('up-app', 200,
           claim => (SELECT claim FROM idempotency.records WHERE key = 'up-app'));
SELECT status FROM idempotency.idem_lookup('up-app');
SELECT outcome FROM idempotency.idem_acquire('up-app-sb', session_bound => true);
}),
	"acquired\nt\nt\ncompleted\nacquired", 'the application role works after the update, idem_extend included');

# the same objects as a fresh 1.1 install with the README's grants
$node->safe_psql('up', q{UPDATE pg_catalog.pg_proc SET probin = '$libdir/idempotency'
                          WHERE pronamespace = 'idempotency'::regnamespace AND probin IS NOT NULL});
$node->safe_psql('fresh', "CREATE EXTENSION idempotency VERSION '1.1';\n$grants_11");
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
	$out =~ s/^\\(un)?restrict .*$//mg;    # a random key per dump
	$out =~ s/'\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[+-]\d\d'/'TIME'/g;
	$dump{$db} = $out;
}
is($dump{up}, $dump{fresh}, 'pg_dump --schema-only of the updated database equals a fresh 1.1 install');
like($dump{up}, qr/GRANT ALL ON FUNCTION idempotency\.idem_acquire\(.*session_bound boolean\) TO idem_app;/,
	'and dumps the application role\'s grant on the new idem_acquire');

# Maintenance moves a 1.1 record out of DEFAULT with its 1.1 columns (the
# temporary table and the partitions it makes are LIKE idempotency.records,
# whose columns the update appended in the same order as a fresh install).
my $owner = $node->background_psql('up');
$owner->query_safe(q{SET idempotency.max_ttl = '30d';
SELECT outcome FROM idempotency.idem_acquire('up-moved', ttl => '12 days', session_bound => true)});
my $before_move = $node->safe_psql('up',
	q{SELECT tableoid::regclass, claim, owner_pid, owner_start, attempt FROM idempotency.records WHERE key = 'up-moved'});
like($before_move, qr/^idempotency\.records_default\|[0-9a-f-]{36}\|\d+\|.+\|1$/,
	'a session-bound claim beyond the partitions made so far waits in DEFAULT');
$node->safe_psql('up', q{SET idempotency.max_ttl = '30d'; SELECT idempotency.idem_maintain()});
my $after_move = $node->safe_psql('up',
	q{SELECT tableoid::regclass, claim, owner_pid, owner_start, attempt FROM idempotency.records WHERE key = 'up-moved'});
(my $expect = $before_move) =~ s/^idempotency\.records_default\|//;
like($after_move, qr/^idempotency\.records_p\d{8}_\d{6}\|\Q$expect\E$/, 'maintenance moves it to its partition with claim, owner_pid and owner_start');
is( $node->safe_psql('up',
		q{SET idempotency.wait_timeout = 0; SELECT outcome, retry_after FROM idempotency.idem_acquire('up-moved')}),
	'in_progress|1', 'and its owner still holds it');
$owner->quit;

$node->stop;
done_testing();
