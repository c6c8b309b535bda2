# Copyright (c) idempotency authors
#
# Helpers of the PL/Proxy tests (t/020_proxy*.pl): shard clusters with the
# idempotency extension (preloaded, wait_timeout 0), a router cluster with
# idempotency_proxy, and psql clients run in parallel.  Every node is a
# PostgreSQL::Test::Cluster, stopped by its END block whatever happens.

package IdemProxy;

use strict;
use warnings;

use Exporter 'import';
use File::Temp ();
use IPC::Run ();
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use IdemTest;

our @EXPORT = qw(proxy_shards proxy_router shard_connstr run_clients
  run_clients_async finish_clients skip_without_plproxy);

# skip_without_plproxy(): skip the whole file, with the reason, where this
# PostgreSQL has no PL/Proxy (Debian: postgresql-N-plproxy).
sub skip_without_plproxy
{
	my $pkglibdir = `pg_config --pkglibdir`;
	chomp $pkglibdir;
	plan skip_all =>
	  "PL/Proxy is not installed for this PostgreSQL ($pkglibdir/plproxy.so missing; Debian: postgresql-N-plproxy)"
	  unless -e "$pkglibdir/plproxy.so";
	return;
}

# proxy_shards(N, PREFIX): N started shard nodes, idempotency created in
# database postgres (updated to 1.2 where the build has it: the shards'
# ownership checks), the library preloaded (statistics), no waiting for a
# duplicate in progress (the tests check outcomes, not waits).
sub proxy_shards
{
	my ($n, $prefix) = @_;
	my @shards;
	for my $i (0 .. $n - 1)
	{
		push @shards,
		  idem_node(
			"${prefix}$i", q{
shared_preload_libraries = 'pg_cron,idempotency'
idempotency.wait_timeout = 0
max_connections = 60
});
		# the newest version, whatever the node made first (a no-op at the default)
		$shards[-1]->safe_psql('postgres', 'ALTER EXTENSION idempotency UPDATE');
	}
	return @shards;
}

sub shard_connstr
{
	my ($node) = @_;
	return sprintf('host=%s port=%d dbname=postgres', $node->host,
		$node->port);
}

# proxy_router(NAME, SHARDS...): a started router node whose database
# postgres has idempotency_proxy, declared over the shards given.
sub proxy_router
{
	my ($name, @shards) = @_;
	my $router = PostgreSQL::Test::Cluster->new($name);
	$router->init;
	$router->append_conf('postgresql.conf', "max_connections = 60\n");
	$router->start;
	$router->safe_psql('postgres',
		'CREATE EXTENSION idempotency_proxy CASCADE');
	if (@shards)
	{
		my $list = join(', ', map { "'" . shard_connstr($_) . "'" } @shards);
		$router->safe_psql('postgres',
			"SELECT count(*) FROM idempotency.cluster_create(ARRAY[$list])");
	}
	return $router;
}

# run_clients(NODE, DB, SCRIPTS...): run one psql per SQL script text, all
# at once; returns a list of [stdout, stderr, ok] in the same order.
sub run_clients
{
	my ($node, $db, @scripts) = @_;
	return finish_clients(run_clients_async($node, @scripts)) if $db eq 'postgres';
	die "run_clients: database $db";
}

# run_clients_async(NODE, SCRIPTS...): start one psql per SQL script text
# on database postgres of NODE; returns handles for finish_clients().
sub run_clients_async
{
	my ($node, @scripts) = @_;
	my @h;
	for my $script (@scripts)
	{
		my $c = { out => '', err => '', file => File::Temp->new(SUFFIX => '.sql') };
		print { $c->{file} } $script;
		close $c->{file};
		$c->{run} = IPC::Run::start(
			[
				'psql', '-XAtq', '-h', $node->host, '-p', $node->port,
				'-d', 'postgres', '-f', $c->{file}->filename
			],
			'>', \$c->{out}, '2>', \$c->{err},
			IPC::Run::timeout($PostgreSQL::Test::Utils::timeout_default));
		push @h, $c;
	}
	return @h;
}

# finish_clients(HANDLES...): wait for them; a list of [stdout, stderr, ok]
# in the same order.
sub finish_clients
{
	my @res;
	for my $c (@_)
	{
		my $ok = eval { $c->{run}->finish };
		push @res, [ $c->{out}, $c->{err}, $ok ? 1 : 0 ];
	}
	return @res;
}

1;
