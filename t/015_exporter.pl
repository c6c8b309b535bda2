# Copyright (c) idempotency authors
#
# The statistics through the real Prometheus exporter: Debian's
# prometheus-postgres-exporter (postgres_exporter) runs against this test's
# cluster with monitoring/idempotency.yaml, listening on a free port of
# 127.0.0.1, and its /metrics page, fetched over HTTP, must show exactly the
# calls made.
#
#   1. the cluster preloads the library; the extension is in databases
#      postgres and shop, not in plain; the exporter connects as a role
#      with pg_monitor and USAGE on the schema, with
#      --auto-discover-databases: no idempotency series (EXECUTE on the
#      statistics functions is not granted to PUBLIC) until the README's
#      grants are given; with them the role still cannot reset the
#      statistics or read the records;
#   2. after idem_stats_reset in both databases every series reads 0 and
#      stats_reset is the reset's time;
#   3. known calls in each database (acquired, replay, mismatch, in_progress
#      behind an open transaction without and with a wait, behind a lease,
#      a release, a takeover of a claim whose lease ran out, tokens, a
#      forget): each
#      counter on /metrics is the number of those answers, and the same as
#      idempotency.stats says; one series per database (the query runs in
#      the database of the connection string only, not again in every
#      database the exporter discovers);
#   4. idempotency_check_duration_seconds is a Prometheus histogram: the
#      documented bounds and +Inf, cumulative buckets equal to
#      idem_acquire_histogram(), +Inf = _count = the number of idem_acquire
#      calls, a _sum that the buckets bound from below and above;
#   5. monitoring/idempotency-stale-claims.yaml in a second exporter: the
#      claim whose lease ran out is counted, in its database only, and is
#      gone from the count once taken over.
#
# Skipped only when the exporter is not installed (scripts/test.sh installs
# it with the other test dependencies).  IDEM_EXPORTER_BIN runs another
# build of it (the binary of another Debian suite's package, say).

use strict;
use warnings;

use FindBin;
use lib "$FindBin::RealBin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use HTTP::Tiny;
use IO::Socket::INET;
use POSIX ();
use Time::HiRes qw(usleep);

# IDEM_EXPORTER_BIN: another build of the exporter (another Debian suite's)
my $exporter_bin = $ENV{IDEM_EXPORTER_BIN} || '/usr/bin/prometheus-postgres-exporter';
if (!-x $exporter_bin)
{
	plan skip_all =>
	  "$exporter_bin is not installed (Debian package prometheus-postgres-exporter)";
}

my $queries = "$FindBin::RealBin/../monitoring/idempotency.yaml";
my $stale_queries = "$FindBin::RealBin/../monitoring/idempotency-stale-claims.yaml";
for my $f ($queries, $stale_queries)
{
	BAIL_OUT("$f is missing: the test needs the repository's monitoring/ folder")
	  unless -r $f;
}

# The upper bounds of the acquire-duration buckets, in seconds (docs/reference.md)
my @bounds = (
	0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
	0.05, 0.1, 0.25, 0.5, 1, 2.5, 5);

# idempotency.stats column => the name on /metrics
my %metric_of = (
	acquired => 'idempotency_acquired_total',
	taken_over => 'idempotency_taken_over_total',
	replayed => 'idempotency_cache_hit_total',
	mismatched => 'idempotency_mismatched_total',
	in_progress => 'idempotency_in_progress_total',
	completed => 'idempotency_completed_total',
	released => 'idempotency_released_total',
	waits => 'idempotency_waits_total',
	wait_time => 'idempotency_wait_seconds_total',    # ms in SQL, s here
	tokens_issued => 'idempotency_tokens_issued_total',
	tokens_consumed => 'idempotency_tokens_consumed_total',
	forgotten => 'idempotency_forgotten_total');
my @columns = sort keys %metric_of;

# ---------------------------------------------------------------------------
# The exporters: started with fork and exec, each stopped (by its own pid)
# at exit, whatever the outcome; a signal ends the test through die so that
# this END block runs.

my (%exporter_pid, %exporter_log);
$SIG{$_} = sub { die "killed by signal $_[0]\n" } for qw(INT TERM HUP);

END
{
	my $status = $?;
	for my $name (sort keys %exporter_pid)
	{
		my $pid = $exporter_pid{$name};
		kill 'TERM', $pid;
		my $gone = 0;
		for (1 .. 100)
		{
			if (waitpid($pid, POSIX::WNOHANG()) != 0)
			{
				$gone = 1;
				last;
			}
			usleep(50_000);
		}
		if (!$gone)
		{
			kill 'KILL', $pid;
			waitpid($pid, 0);
		}
	}
	$? = $status;
}

# a TCP port of 127.0.0.1 that nothing listens on now
sub loopback_port
{
	my $sock = IO::Socket::INET->new(
		LocalAddr => '127.0.0.1',
		LocalPort => 0,
		Proto => 'tcp',
		Listen => 1,
		ReuseAddr => 1) or die "no free port on 127.0.0.1: $!";
	my $port = $sock->sockport;
	close $sock;
	return $port;
}

my $http = HTTP::Tiny->new(timeout => 60, proxy => undef, http_proxy => undef);

# start_exporter(NAME, DSN, ARGS...): an exporter on a free port of
# 127.0.0.1, its output in the test's log folder; returns the port once
# /metrics answers
sub start_exporter
{
	my ($name, $dsn, @args) = @_;
	my $log = "$PostgreSQL::Test::Utils::log_path/015_exporter_prom_$name.log";
	$exporter_log{$name} = $log;

	for my $try (1 .. 5)
	{
		my $port = loopback_port();
		my @cmd = ($exporter_bin, "--web.listen-address=127.0.0.1:$port", @args);
		note "starting exporter $name: DATA_SOURCE_NAME='$dsn' @cmd";
		my $pid = fork() // die "fork: $!";
		if ($pid == 0)
		{
			# No END block of this test may run in the child.
			open(STDIN, '<', '/dev/null') or POSIX::_exit(126);
			open(STDOUT, '>>', $log) or POSIX::_exit(126);
			open(STDERR, '>&', \*STDOUT) or POSIX::_exit(126);
			$ENV{DATA_SOURCE_NAME} = $dsn;
			delete @ENV{qw(PGSERVICE PGSERVICEFILE PGPASSWORD PGOPTIONS PGSSLMODE)};
			exec { $cmd[0] } @cmd or POSIX::_exit(127);
		}
		$exporter_pid{$name} = $pid;

		my $deadline = time() + $PostgreSQL::Test::Utils::timeout_default;
		while (time() < $deadline)
		{
			if (waitpid($pid, POSIX::WNOHANG()) == $pid)
			{
				delete $exporter_pid{$name};
				last;
			}
			my $res = $http->get("http://127.0.0.1:$port/metrics");
			return $port if $res->{status} == 200;
			usleep(100_000);
		}
		if (exists $exporter_pid{$name})
		{
			diag(slurp_file($log));
			BAIL_OUT("exporter $name does not answer on 127.0.0.1:$port");
		}
		# it exited: the port was taken meanwhile, or a real failure
		my $out = slurp_file($log);
		BAIL_OUT("exporter $name exited:\n$out")
		  unless $out =~ /address already in use/i && $try < 5;
	}
}

# scrape(PORT, WHAT): /metrics parsed into { series => { name => { labels =>
# [values] } }, type => { name => type } }; the label "server", which the
# exporter adds, is left out of the labels key ("k=v,k=v", sorted)
sub scrape
{
	my ($port, $what) = @_;
	my $res = $http->get("http://127.0.0.1:$port/metrics");
	my (%series, %type);
	if (!is($res->{status}, 200, "$what: /metrics answers 200"))
	{
		diag($res->{content});
		return { series => \%series, type => \%type };
	}
	for my $line (split /\n/, $res->{content})
	{
		if ($line =~ /^# TYPE (\S+) (\S+)/)
		{
			$type{$1} = $2;
			next;
		}
		next if $line =~ /^#/ || $line !~ /\S/;
		if ($line !~ /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+-?\d+)?$/)
		{
			fail("$what: a line of the exposition format: $line");
			next;
		}
		my ($name, $labels, $value) = ($1, $2 // '', $3);
		my %l;
		while ($labels =~ /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g)
		{
			my ($k, $v) = ($1, $2);
			$v =~ s/\\(.)/$1 eq 'n' ? "\n" : $1/ge;
			$l{$k} = $v;
		}
		delete $l{server};
		my $key = join(',', map { "$_=$l{$_}" } sort keys %l);
		push @{ $series{$name}{$key} }, $value;
	}
	return { series => \%series, type => \%type };
}

# value(M, NAME, LABELS...): the one value of that series; undef (and a
# failed test) when it is missing or not unique
sub value
{
	my ($m, $name, %labels) = @_;
	my $key = join(',', map { "$_=$labels{$_}" } sort keys %labels);
	my $v = $m->{series}{$name}{$key};
	if (!$v || @$v != 1)
	{
		fail("$name\{$key\}: "
			  . (!$v ? 'missing' : scalar(@$v) . ' series instead of one'));
		return undef;
	}
	return $v->[0];
}

# all series of NAME whose labels include datname=DB
sub series_of_db
{
	my ($m, $name, $db) = @_;
	my $s = $m->{series}{$name} // {};
	return grep { /(?:^|,)datname=\Q$db\E(?:,|$)/ } keys %$s;
}

# two floating-point numbers equal up to rounding in the text format
sub near
{
	my ($a, $b) = @_;
	return defined $a && defined $b && abs($a - $b) <= 1e-9 * (1 + abs($a) + abs($b));
}

# ---------------------------------------------------------------------------
# 1. The cluster, the databases, the exporter's role

my $node = idem_node('node',
	"shared_preload_libraries = 'pg_cron,idempotency'\nlog_statement = none\n");
$node->safe_psql(
	'postgres', q{
CREATE DATABASE shop;
CREATE DATABASE plain;
CREATE ROLE prometheus LOGIN;
GRANT pg_monitor TO prometheus;
});
$node->safe_psql('shop', 'CREATE EXTENSION idempotency');
is($node->safe_psql('postgres', 'SELECT idempotency.idem_stats_enabled()'),
	't', 'the statistics are on (library preloaded)');

# the schema and the stale claims view, not yet the statistics functions
$node->safe_psql(
	$_, q{
GRANT USAGE ON SCHEMA idempotency TO prometheus;
GRANT SELECT ON idempotency.stale_claims TO prometheus;
GRANT EXECUTE ON FUNCTION idempotency.owner_alive(int, timestamptz) TO prometheus;
}) for qw(postgres shop);

my $dsn = sprintf('host=127.0.0.1 port=%d user=prometheus dbname=postgres sslmode=disable',
	$node->port);
my $port = start_exporter('main', $dsn, "--extend.query-path=$queries",
	'--auto-discover-databases');
my $version = `$exporter_bin --version 2>&1`;
note "exporter: " . (split /\n/, $version)[0];

my $m = scrape($port, 'without EXECUTE');
is_deeply([ grep { /^idempotency_/ } sort keys %{ $m->{series} } ],
	[], 'pg_monitor and USAGE on the schema: no idempotency series');
is(value($m, 'pg_up'), 1, 'the exporter is connected (pg_up 1)');
like(slurp_file($exporter_log{main}), qr/permission denied for function idem_stats/,
	'the exporter logs why');

# the rest of the README's grants ("Monitoring"), needed only in postgres (the
# database of the connection string); given in shop too, so that a query run
# again in every discovered database would export its series twice
$node->safe_psql($_,
	q{GRANT EXECUTE ON FUNCTION idempotency.idem_stats(), idempotency.idem_acquire_histogram()
	    TO prometheus}) for qw(postgres shop);

# ---------------------------------------------------------------------------
# 2. Reset

my %reset_at;
for my $db (qw(postgres shop))
{
	$reset_at{$db} = $node->safe_psql($db,
		'SELECT extract(epoch FROM idempotency.idem_stats_reset())');
}
$m = scrape($port, 'after the reset');
for my $db (qw(postgres shop))
{
	for my $name ((map { $metric_of{$_} } @columns),
		'idempotency_check_duration_seconds_count')
	{
		is(value($m, $name, datname => $db), 0, "after the reset: $name of $db is 0");
	}
	my $got = value($m, 'idempotency_stats_reset_timestamp_seconds', datname => $db);
	ok(defined $got && abs($got - $reset_at{$db}) < 0.001,
		"after the reset: stats_reset of $db is the reset's time")
	  or diag('got ' . ($got // 'nothing') . ", the reset answered $reset_at{$db}");
}

# the exporter's role reads the statistics, and nothing else
for my $sql ('SELECT idempotency.idem_stats_reset()',
	'SELECT count(*) FROM idempotency.records')
{
	my ($state) = sqlstate_of_psql($node, 'postgres', $sql,
		extra_params =>
		  [ '-U', 'prometheus', '-v', 'VERBOSITY=verbose', '-v', 'ON_ERROR_STOP=1' ]);
	is($state, '42501', "the exporter's role: $sql is refused");
}

# ---------------------------------------------------------------------------
# 3. Known calls

my %expect;    # db => column => count
my %calls;     # db => idem_acquire calls
for my $db (qw(postgres shop))
{
	$expect{$db}{$_} = 0 for @columns;
	$calls{$db} = 0;
}
my %counted = (
	acquired => 'acquired',
	replay => 'replayed',
	mismatch => 'mismatched',
	in_progress => 'in_progress');

# acquire(DB, KEY, REQUEST, WANT, SQL_BEFORE, ARGS): one idem_acquire on a
# connection of its own; checks the outcome is WANT and counts it; returns
# its claim
sub acquire
{
	my ($db, $key, $request, $want, $before, $args) = @_;
	my $out = $node->safe_psql(
		$db, ($before // '') . qq{
SELECT a.outcome || '|' || COALESCE(a.claim::text, '')
  FROM idempotency.idem_acquire('$key', '$request'} . ($args // '') . q{) a});
	my ($outcome, $claim) = split /\|/, $out;
	is($outcome, $want, "$db: acquire $key answers $want");
	$expect{$db}{ $counted{$outcome} }++ if defined $outcome && $counted{$outcome};
	$calls{$db}++;
	return $claim;
}

# acquired and completed in one transaction
for my $db (qw(postgres shop))
{
	my $n = $db eq 'postgres' ? 4 : 2;
	for my $i (1 .. $n)
	{
		my $out = $node->safe_psql(
			$db, qq{
BEGIN;
SELECT outcome FROM idempotency.idem_acquire('k$i', '{"n": $i}');
SELECT idempotency.idem_complete('k$i', 201, '{"id": $i}');
COMMIT;});
		is($out, "acquired\nt", "$db: k$i acquired and completed");
		$expect{$db}{acquired}++;
		$expect{$db}{completed}++;
		$calls{$db}++;
	}
}
# replays and mismatches
acquire('postgres', 'k1', '{"n": 1}', 'replay') for 1 .. 3;
acquire('postgres', 'k2', '{"n": 20}', 'mismatch') for 1 .. 2;
acquire('shop', 'k1', '{"n": 1}', 'replay');
acquire('shop', 'k2', '{"n": 2, "x": 0}', 'mismatch');

# in_progress behind a claim held by an open transaction: without waiting,
# then after a wait of 300 ms
my $holder = $node->background_psql('postgres');
is( $holder->query_safe(
		q{BEGIN; SELECT outcome FROM idempotency.idem_acquire('held', '{"n": 1}')}),
	'acquired', 'postgres: held acquired in an open transaction');
$expect{postgres}{acquired}++;
$calls{postgres}++;
acquire('postgres', 'held', '{"n": 1}', 'in_progress',
	'SET idempotency.wait_timeout = 0;');
my $t0 = now_ms();
acquire('postgres', 'held', '{"n": 1}', 'in_progress',
	q{SET idempotency.wait_timeout = '300ms';});
my $waited_ms = now_ms() - $t0;
$holder->query_safe('ROLLBACK');
$holder->quit;

# in_progress behind a committed claim with a lease; then released
my $claim = acquire('postgres', 'leased', '{"n": 1}', 'acquired', undef,
	q{, lease => '1 hour'});
acquire('postgres', 'leased', '{"n": 1}', 'in_progress',
	'SET idempotency.wait_timeout = 0;', q{, lease => '1 hour'});
$node->safe_psql('postgres', qq{SELECT idempotency.idem_release('leased', claim => '$claim')});
$expect{postgres}{released}++;

# a claim whose lease runs out: stale until taken over
my $stale_claim = acquire('postgres', 'stale', '{"n": 1}', 'acquired', undef,
	q{, lease => '1 second'});
$node->poll_query_until('postgres',
	q{SELECT count(*) = 1 FROM idempotency.stale_claims WHERE key = 'stale'})
  or die 'the claim of key stale never became stale';

# tokens: two issued in postgres, one consumed (then refused), one in shop
my $token = $node->safe_psql('postgres',
	q{SELECT idempotency.idem_token_issue(); SELECT idempotency.idem_token_issue()});
($token) = split /\n/, $token;
$expect{postgres}{tokens_issued} += 2;
is( $node->safe_psql(
		'postgres',
		qq{SELECT idempotency.idem_token_consume('$token');
		   SELECT idempotency.idem_token_consume('$token')}),
	"t\nf", 'postgres: a token consumed once');
$expect{postgres}{tokens_consumed}++;
$node->safe_psql('shop', q{SELECT idempotency.idem_token_issue()});
$expect{shop}{tokens_issued}++;

# a key forgotten (then not there to forget), in shop
is( $node->safe_psql(
		'shop',
		q{SELECT outcome FROM idempotency.idem_acquire('forget-me');
		  SELECT idempotency.idem_forget('forget-me');
		  SELECT idempotency.idem_forget('forget-me')}),
	"acquired\nt\nf", 'shop: a key forgotten once');
$expect{shop}{acquired}++;
$calls{shop}++;
$expect{shop}{forgotten}++;

# ---------------------------------------------------------------------------
# 5. (before the takeover) the stale claims, from a second exporter that
# reads every database holding the extension

my $stale_port = start_exporter('stale', $dsn, "--extend.query-path=$stale_queries",
	'--disable-default-metrics', '--disable-settings-metrics',
	'--auto-discover-databases', '--include-databases=postgres,shop');
my $s = scrape($stale_port, 'stale claims');
is(value($s, 'idempotency_stale_claims', datname => 'postgres'),
	1, 'stale claims: one in postgres');
is(value($s, 'idempotency_stale_claims', datname => 'shop'), 0, 'stale claims: none in shop');
my $age = value($s, 'idempotency_stale_oldest_claim_age_seconds', datname => 'postgres');
ok(defined $age && $age >= 1 && $age < $PostgreSQL::Test::Utils::timeout_default + 60,
	"stale claims: the oldest is as old as the claim ($age s)");
is($s->{type}{idempotency_stale_claims}, 'gauge', 'stale claims: a gauge');
is_deeply([ grep { /^idempotency_/ && !/^idempotency_stale_/ } sort keys %{ $s->{series} } ],
	[], 'the stale claims exporter exports nothing else of ours');

# the takeover, completed by the new owner
$claim = acquire('postgres', 'stale', '{"n": 1}', 'acquired', undef, q{, lease => '1 hour'});
isnt($claim, $stale_claim, 'postgres: the takeover has a new claim');
$expect{postgres}{taken_over}++;
is( $node->safe_psql('postgres',
		qq{SELECT idempotency.idem_complete('stale', 200, '{}', claim => '$claim')}),
	't', 'postgres: the new owner completes');
$expect{postgres}{completed}++;

$s = scrape($stale_port, 'stale claims after the takeover');
is(value($s, 'idempotency_stale_claims', datname => 'postgres'),
	0, 'stale claims: none once taken over');

# ---------------------------------------------------------------------------
# 3. (continued) the counters on /metrics

$m = scrape($port, 'after the calls');
my %sql;
for my $db (qw(postgres shop))
{
	my $row = $node->safe_psql(
		'postgres', qq{
SELECT } . join(', ', @columns) . qq{, acquire_duration_sum, acquire_duration_count
  FROM idempotency.idem_stats() WHERE datname = '$db'});
	my @v = split /\|/, $row;
	is(scalar(@v), @columns + 2, "$db: one row in idem_stats()");
	$sql{$db}{ $columns[$_] } = $v[$_] for 0 .. $#columns;
	$sql{$db}{acquire_duration_sum} = $v[-2];
	$sql{$db}{acquire_duration_count} = $v[-1];
}

for my $c (@columns)
{
	is($m->{type}{ $metric_of{$c} }, 'counter', "$metric_of{$c} is a counter");
}
for my $db (qw(postgres shop))
{
	for my $c (@columns)
	{
		my $name = $metric_of{$c};
		my $got = value($m, $name, datname => $db);
		my $want_sql = $c eq 'wait_time' ? $sql{$db}{$c} / 1000 : $sql{$db}{$c};
		ok(near($got, $want_sql), "$db: $name = idempotency.stats' $c")
		  or diag("got $got, stats say $sql{$db}{$c}");
		next if $c eq 'wait_time' || $c eq 'waits';
		is($got, $expect{$db}{$c}, "$db: $name counts the calls made");
	}
}

# waits: only the 300 ms one waited (a wait_timeout of 0 does not wait, a
# committed lease is not waited for)
is(value($m, 'idempotency_waits_total', datname => 'postgres'), 1,
	'postgres: one idem_acquire waited');
is(value($m, 'idempotency_waits_total', datname => 'shop'), 0, 'shop: none waited');
my $wait_s = value($m, 'idempotency_wait_seconds_total', datname => 'postgres');
ok(defined $wait_s && $wait_s >= 0.25 && $wait_s <= $waited_ms / 1000,
	"postgres: it waited 300 ms, in seconds ($wait_s s, the call took $waited_ms ms)");

# one series per database and metric, although the exporter discovered
# three databases (the query runs only where the connection string points)
for my $c (@columns)
{
	for my $db (qw(postgres shop))
	{
		is(scalar(series_of_db($m, $metric_of{$c}, $db)),
			1, "$metric_of{$c}: one series for $db");
	}
	is(scalar(series_of_db($m, $metric_of{$c}, 'plain')), 0,
		"$metric_of{$c}: none for plain, which never used the extension");
}

is(value($m, 'pg_exporter_last_scrape_error'), 0,
	'no query of the exporter failed, in any database it discovered');

# ---------------------------------------------------------------------------
# 4. The histogram

my $h = 'idempotency_check_duration_seconds';
is($m->{type}{$h}, 'histogram', "$h is a Prometheus histogram");
for my $db (qw(postgres shop))
{
	my $count = value($m, "${h}_count", datname => $db);
	my $sum = value($m, "${h}_sum", datname => $db);
	is($count, $calls{$db}, "$db: ${h}_count is the number of idem_acquire calls ($calls{$db})");
	is($count, $sql{$db}{acquire_duration_count}, "$db: ${h}_count = acquire_duration_count");
	ok(near($sum, $sql{$db}{acquire_duration_sum}), "$db: ${h}_sum = acquire_duration_sum");

	# the buckets on /metrics, in le order
	my %bucket;
	for my $key (series_of_db($m, "${h}_bucket", $db))
	{
		my ($le) = $key =~ /(?:^|,)le=([^,]*)/;
		$bucket{$le} = $m->{series}{"${h}_bucket"}{$key};
	}
	my @les = sort { ($a eq '+Inf') <=> ($b eq '+Inf') || $a <=> $b } keys %bucket;
	is_deeply([ map { $_ eq '+Inf' ? $_ : $_ + 0 } @les ],
		[ @bounds, '+Inf' ], "$db: the buckets' bounds are the documented ones");
	is(scalar(grep { @{ $bucket{$_} } != 1 } @les), 0, "$db: one series per bucket");
	my @cum = map { $bucket{$_}[0] } @les;
	is($cum[-1], $count, "$db: the +Inf bucket is ${h}_count");
	my $monotonic = 1;
	for my $i (1 .. $#cum)
	{
		$monotonic = 0 if $cum[$i] < $cum[ $i - 1 ];
	}
	ok($monotonic, "$db: the buckets are cumulative (@cum)");

	# the same as the SQL histogram
	my $sql_hist = $node->safe_psql('postgres',
		qq{SELECT string_agg(count::text, ' ' ORDER BY le)
		     FROM idempotency.idem_acquire_histogram() WHERE datname = '$db'});
	is("@cum", $sql_hist, "$db: the buckets are idem_acquire_histogram()'s");

	# the calls of each bucket took between its lower and upper bound
	my ($low, $high, $prev_count, $prev_le) = (0, 0, 0, 0);
	for my $i (0 .. $#bounds)
	{
		my $n = $cum[$i] - $prev_count;
		$low += $n * $prev_le;
		$high += $n * $bounds[$i];
		($prev_count, $prev_le) = ($cum[$i], $bounds[$i]);
	}
	$low += ($count - $prev_count) * $prev_le;
	$high = 'Inf' if $count > $prev_count;
	ok($sum >= $low * (1 - 1e-9) && $sum > 0, "$db: ${h}_sum ($sum) >= the buckets' lower bounds ($low)");
	ok($high eq 'Inf' || $sum <= $high * (1 + 1e-9),
		"$db: ${h}_sum ($sum) <= the buckets' upper bounds ($high)");
}
# the 300 ms wait is in its bucket: the slowest call of postgres
ok(value($m, "${h}_bucket", datname => 'postgres', le => '0.25')
	  < value($m, "${h}_count", datname => 'postgres'),
	'postgres: the call that waited 300 ms is above the 0.25 s bucket');

done_testing();
