# shellcheck shell=bash
# scripts/common.sh -- shared set-up for scripts/test.sh and scripts/demo.sh
#
# Sourced, not run.  Works under `set -euo pipefail`, as root on Debian 12.
#
#   install_deps [demo]  apt-get install what is missing (nothing when all
#                    is there): every package the tests use, or with "demo"
#                    only what scripts/demo.sh uses
#   build_install    make && make install against PostgreSQL $IDEM_PG_MAJOR
#   start_cluster    throwaway cluster as the postgres OS user, in a fresh
#                    temporary folder, on a free port of 127.0.0.1; exports
#                    PGHOST PGPORT PGUSER PGDATABASE; a trap on EXIT stops it
#   stop_cluster     stop the server and remove its folder (also run by the trap)
#
# Debian's own cluster (15/main on 5432), if any, is never touched.
#
# IDEM_PG_MAJOR (default 15, the host's) picks the PostgreSQL major: the
# matrix (scripts/matrix.sh) runs scripts/test.sh with 17 and 18 inside
# Debian roots of their own.

IDEM_PG_MAJOR=${IDEM_PG_MAJOR:-15}
# A script that scripts/test.sh runs (scripts/docs_test.sh, say) inherits
# its private copy of PostgreSQL (use_private_pg) through IDEM_PG_PREFIX.
if [[ -n ${IDEM_PG_PREFIX:-} && -x $IDEM_PG_PREFIX/lib/postgresql/$IDEM_PG_MAJOR/bin/pg_config ]]; then
	PG_BINDIR=$IDEM_PG_PREFIX/lib/postgresql/$IDEM_PG_MAJOR/bin
else
	PG_BINDIR=/usr/lib/postgresql/$IDEM_PG_MAJOR/bin
fi
PG_CONFIG=$PG_BINDIR/pg_config
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# postgresql-server-dev-N does not pull in the compiler and make that PGXS
# calls, so a bare Debian needs them too.  Since PostgreSQL 10 the contrib
# modules ship in postgresql-N; postgresql-contrib (the default major's) is
# only asked for where that default is the host's 15.
#
# The HTTP examples (examples/) are built from Debian's packages only: the Go
# compiler and the Go sources of Gin and pgx (GOPATH mode against
# /usr/share/gocode, nothing downloaded), psycopg 3 and its pool for Python.
# prometheus-postgres-exporter is the real exporter that t/015_exporter.pl
# runs against monitoring/idempotency.yaml.  postgresql-N-plproxy is for
# idempotency_proxy (proxy/) and t/020_proxy*.pl.
#
# The demo (scripts/demo.sh) needs only the server (pgbench is in it), its
# headers, pg_cron (the cluster preloads it) and the compiler and make:
# IDEM_DEMO_PACKAGES.  curl is for the examples' walk-throughs that the docs
# test runs (scripts/docs_test.sh).
IDEM_DEMO_PACKAGES=("postgresql-$IDEM_PG_MAJOR" "postgresql-server-dev-$IDEM_PG_MAJOR"
                    "postgresql-$IDEM_PG_MAJOR-cron" make gcc)
IDEM_PACKAGES=("${IDEM_DEMO_PACKAGES[@]}" "postgresql-$IDEM_PG_MAJOR-plproxy"
               libipc-run-perl pgbouncer curl
               golang-go golang-github-gin-gonic-gin-dev golang-github-jackc-pgx-v4-dev
               python3-psycopg python3-psycopg-pool prometheus-postgres-exporter)
if [[ $IDEM_PG_MAJOR == 15 ]]; then
	IDEM_PACKAGES+=(postgresql-contrib)
fi

# IDEM_QUIET=1: keep the output of apt, make and initdb in a file and show it
# only when a step fails (the demo wants a short report).
IDEM_QUIET=${IDEM_QUIET:-0}

IDEM_TMPDIR=
IDEM_PGDATA=
IDEM_SERVER_LOG=

log() { printf '==> %s\n' "$*"; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# The header of scripts/test.sh's closing list of what failed (each line
# prefixed [pgN]), which scripts/matrix.sh reads back from each major's run
WHAT_FAILED='======== what failed ========'

# run_step DESCRIPTION COMMAND...: run a noisy command, straight through, or
# (IDEM_QUIET=1) into a file that is printed only if the command fails.
run_step() {
	local what=$1 out rc=0
	shift
	if [[ $IDEM_QUIET != 1 ]]; then
		"$@" || die "$what failed (exit $?)"
		return 0
	fi
	out=$(mktemp "${TMPDIR:-/tmp}/idempotency-step.XXXXXX")
	"$@" >"$out" 2>&1 || rc=$?
	if ((rc != 0)); then
		cat "$out" >&2
		rm -f "$out"
		die "$what failed (exit $rc)"
	fi
	rm -f "$out"
}

# as_postgres COMMAND...: run as the postgres OS user (the server refuses
# root), from a folder it may enter.
as_postgres() {
	if [[ $(id -un) == postgres ]]; then
		(cd "${IDEM_TMPDIR:-/}" && "$@")
	else
		(cd "${IDEM_TMPDIR:-/}" && runuser -u postgres -- "$@")
	fi
}

# v10_revision: the commit of release 1.0 (tag v1.0, or else the parent of
# the commit that added the 1.0--1.1 update script, for a clone without
# tags); fails where git or the history is missing.
v10_revision() {
	local rev
	rev=$(git -C "$REPO_ROOT" rev-parse -q --verify 'v1.0^{commit}' 2>/dev/null) ||
		rev=$(git -C "$REPO_ROOT" log --diff-filter=A --format=%H -1 \
			-- idempotency--1.0--1.1.sql 2>/dev/null | sed 's/$/^/')
	[[ -n $rev ]] && echo "$rev"
}

# v11_revision: the commit of release 1.1 (tag v1.1, or else the parent of
# the commit that added the 1.1--1.2 update script), as v10_revision.
v11_revision() {
	local rev
	rev=$(git -C "$REPO_ROOT" rev-parse -q --verify 'v1.1^{commit}' 2>/dev/null) ||
		rev=$(git -C "$REPO_ROOT" log --diff-filter=A --format=%H -1 \
			-- idempotency--1.1--1.2.sql 2>/dev/null | sed 's/$/^/')
	[[ -n $rev ]] && echo "$rev"
}

install_deps() {
	local p missing=() wanted=("${IDEM_PACKAGES[@]}") extra=()
	if [[ ${1:-} == demo ]]; then
		wanted=("${IDEM_DEMO_PACKAGES[@]}")
		# no recommended packages: the demo needs none of them
		extra=(--no-install-recommends)
	fi
	for p in "${wanted[@]}"; do
		if [[ $(dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null) != ii* ]]; then
			missing+=("$p")
		fi
	done
	if ((${#missing[@]} == 0)); then
		log "packages: all present"
		return 0
	fi
	((EUID == 0)) || die "missing packages (${missing[*]}); run as root to install them"
	log "installing packages: ${missing[*]}"
	export DEBIAN_FRONTEND=noninteractive
	if [[ ${1:-} == demo ]]; then
		# Measured with apt-get install -s against a fresh root's package
		# list: 191 packages with the recommended ones, 122 without.  About
		# 600 MB of the 1.1 GB come with postgresql-server-dev-N, which
		# depends on clang and LLVM (for JIT bitcode), needed or not.
		log "(with what they depend on; on a fresh Debian 12 root: 122 packages, 223 MB to download, 1.1 GB on disk, about half of it for the server headers, which depend on clang and LLVM; a few minutes; apt's progress below)"
	fi
	run_step "apt-get update" apt-get update -q
	# No service of these packages may start: prometheus-postgres-exporter's
	# would listen on every interface (and Debian's own PostgreSQL cluster is
	# not ours).  A policy-rc.d that refuses every start, for the install
	# only, unless the machine has one of its own; then the exporter's
	# service is disabled for the next boot too.
	local policy=/usr/sbin/policy-rc.d own_policy=0
	if [[ ! -e $policy ]]; then
		printf '#!/bin/sh\n# scripts/common.sh: no service starts during its install\nexit 101\n' >"$policy"
		chmod 755 "$policy"
		own_policy=1
	fi
	local rc=0
	if [[ ${1:-} == demo ]]; then
		# progress: one line per package fetched and set up
		(set -o pipefail
		 apt-get install -y -q "${extra[@]}" "${wanted[@]}" 2>&1 |
			grep --line-buffered -E '^(Need to get|After this operation|Get:|Setting up|E:)' | sed -u 's/^/    /') || rc=$?
	else
		(run_step "apt-get install" apt-get install -y -q "${wanted[@]}") || rc=$?
	fi
	if ((own_policy)); then
		rm -f "$policy"
	fi
	((rc == 0)) || exit "$rc"
	if command -v systemctl >/dev/null 2>&1; then
		systemctl disable --now prometheus-postgres-exporter >/dev/null 2>&1 || true
	fi
	[[ -x $PG_CONFIG ]] || die "$PG_CONFIG missing after install"
}

build_install() {
	local out rc=0 warnings
	log "building the extension (make PG_CONFIG=$PG_CONFIG)"
	out=$(make -C "$REPO_ROOT" PG_CONFIG="$PG_CONFIG" 2>&1) || rc=$?
	if [[ $IDEM_QUIET != 1 || $rc != 0 ]]; then
		printf '%s\n' "$out"
	fi
	((rc == 0)) || die "make failed (exit $rc)"
	warnings=$(grep -c 'warning:' <<<"$out" || true)
	if ((warnings > 0)); then
		log "compiler warnings: $warnings"
		[[ $IDEM_QUIET == 1 ]] && grep 'warning:' <<<"$out"
	fi
	run_step "make install" make -C "$REPO_ROOT" PG_CONFIG="$PG_CONFIG" install
	# the router side of scale-out (SQL only), for t/020_proxy*.pl
	run_step "make install (proxy/)" make -C "$REPO_ROOT/proxy" PG_CONFIG="$PG_CONFIG" install
}

# use_private_pg: from here on build, install and run against a private
# copy of the host's PostgreSQL (its binaries, libraries and extension
# files, about 50 MB) in a temporary folder removed on exit, so that
# `make install` never writes into the host's installation and two runs at
# once (two work trees, say) never load each other's library.  PostgreSQL
# finds its files relative to its binaries, so the copy's pg_config answers
# paths inside the copy; the headers are the host's, through a link.
# The copy this process made, removed on its exit (not one it inherited).
IDEM_PG_PREFIX_OWN=
use_private_pg() {
	local prefix
	prefix=$(mktemp -d "${TMPDIR:-/tmp}/idempotency-pg.XXXXXX")
	IDEM_PG_PREFIX_OWN=$prefix
	export IDEM_PG_PREFIX=$prefix
	trap _idem_on_exit EXIT
	chmod 755 "$prefix"
	mkdir -p "$prefix/lib/postgresql" "$prefix/share/postgresql" "$prefix/include"
	cp -a "/usr/lib/postgresql/$IDEM_PG_MAJOR" "$prefix/lib/postgresql/"
	cp -a "/usr/share/postgresql/$IDEM_PG_MAJOR" "$prefix/share/postgresql/"
	ln -s /usr/include/postgresql "$prefix/include/postgresql"
	# What an earlier install left in the host's own directories (a run
	# with IDEM_PRIVATE_PG=0, a by-hand make install) must not leak into
	# this run: a stale script there (an idempotency--1.2.sql of an earlier
	# layout of the tree, say) would shadow the tree's.
	rm -f "$prefix/share/postgresql/$IDEM_PG_MAJOR"/extension/idempotency{,_proxy}{.control,--*.sql} \
		"$prefix/lib/postgresql/$IDEM_PG_MAJOR"/lib/idempotency.so
	rm -rf "$prefix/lib/postgresql/$IDEM_PG_MAJOR"/lib/bitcode/idempotency{,.index.bc}
	PG_BINDIR=$prefix/lib/postgresql/$IDEM_PG_MAJOR/bin
	PG_CONFIG=$PG_BINDIR/pg_config
	[[ $("$PG_CONFIG" --pkglibdir) == "$prefix"/* ]] ||
		die "the private copy's pg_config does not answer paths inside $prefix"
	log "private PostgreSQL $IDEM_PG_MAJOR in $prefix"
}

# _idem_port_in_use PORT: true if a TCP socket of this machine uses PORT.
_idem_port_in_use() {
	local port=$1
	if command -v ss >/dev/null 2>&1; then
		[[ -n $(ss -Htan "( sport = :$port )" 2>/dev/null) ]]
	else
		(exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null
	fi
}

# free_port: a TCP port that nothing uses now, below the kernel's ephemeral
# range (32768 up) so that outgoing connections do not take it meanwhile.
free_port() {
	local port
	for _ in $(seq 1 200); do
		port=$((20000 + RANDOM % 12000))
		if ! _idem_port_in_use "$port"; then
			echo "$port"
			return 0
		fi
	done
	die "no free TCP port found"
}

# make_shard_dbs PREFIX: on the test cluster (PGHOST, PGPORT), the
# databases PREFIX_router (idempotency_proxy, with PL/Proxy) and
# PREFIX_shard0, 1 and 2 (idempotency), dropped first if left over, all
# empty: the cluster of the integrations' Shards tests, whose router
# reaches its shards on loopback.  drop_shard_dbs PREFIX drops them.
make_shard_dbs() {
	local prefix=$1 db ext
	for db in "${prefix}_router" "${prefix}_shard0" "${prefix}_shard1" "${prefix}_shard2"; do
		ext=idempotency
		[[ $db == "${prefix}_router" ]] && ext='idempotency_proxy CASCADE'
		"$PG_BINDIR/psql" -X -q -v ON_ERROR_STOP=1 -d postgres \
			-c "DROP DATABASE IF EXISTS $db" -c "CREATE DATABASE $db" || return 1
		"$PG_BINDIR/psql" -X -q -v ON_ERROR_STOP=1 -d "$db" -c "CREATE EXTENSION $ext" || return 1
	done
}
drop_shard_dbs() {
	local prefix=$1 db
	for db in "${prefix}_router" "${prefix}_shard0" "${prefix}_shard1" "${prefix}_shard2"; do
		"$PG_BINDIR/psql" -X -q -d postgres -c "DROP DATABASE IF EXISTS $db" >/dev/null 2>&1 || true
	done
}

# start_cluster [fast]: "fast" turns fsync off (tests only).
start_cluster() {
	local mode=${1:-} base locale try port rc

	id postgres >/dev/null 2>&1 || die "no postgres OS user (is postgresql-$IDEM_PG_MAJOR installed?)"
	# The postgres user must reach the folder, and the socket path must stay
	# short (about 100 bytes at most): else /tmp.
	base=${TMPDIR:-/tmp}
	if ((${#base} > 60)) || ! (cd / && runuser -u postgres -- test -x "$base" -a -d "$base") 2>/dev/null; then
		base=/tmp
	fi
	IDEM_TMPDIR=$(mktemp -d "$base/idempotency.XXXXXX")
	trap _idem_on_exit EXIT
	trap 'exit 130' INT
	trap 'exit 143' TERM
	trap 'exit 129' HUP
	chown postgres: "$IDEM_TMPDIR"
	chmod 700 "$IDEM_TMPDIR"
	IDEM_PGDATA=$IDEM_TMPDIR/data
	IDEM_SERVER_LOG=$IDEM_TMPDIR/server.log
	as_postgres mkdir "$IDEM_TMPDIR/socket"

	locale=C
	if locale -a 2>/dev/null | grep -qix 'c\.utf-\?8'; then
		locale=C.UTF-8
	fi
	log "initdb in $IDEM_TMPDIR (as postgres, trust, UTF8, locale $locale)"
	IDEM_QUIET=1 run_step initdb as_postgres "$PG_BINDIR/initdb" -D "$IDEM_PGDATA" \
		--auth=trust --username=postgres --encoding=UTF8 --locale="$locale" --no-sync

	# the settings the tests need (regress.conf, which make installcheck's
	# own servers have too), on 127.0.0.1 and a socket of its own
	cat >>"$IDEM_PGDATA/postgresql.conf" <<-EOF

		# throwaway cluster of scripts/common.sh
		listen_addresses = '127.0.0.1'
		unix_socket_directories = '$IDEM_TMPDIR/socket'
	EOF
	cat "$REPO_ROOT/regress.conf" >>"$IDEM_PGDATA/postgresql.conf"
	if [[ $mode == fast ]]; then
		cat >>"$IDEM_PGDATA/postgresql.conf" <<-EOF
			fsync = off
			synchronous_commit = off
			full_page_writes = off
		EOF
	fi

	# The port is free when chosen, but could be taken before the server
	# binds it: then try another.
	for try in 1 2 3 4 5; do
		port=$(free_port)
		rc=0
		as_postgres "$PG_BINDIR/pg_ctl" start -w -t 60 -D "$IDEM_PGDATA" \
			-l "$IDEM_SERVER_LOG" -o "-p $port" >/dev/null 2>&1 || rc=$?
		if ((rc == 0)); then
			break
		fi
		if ! grep -q 'Address already in use' "$IDEM_SERVER_LOG" 2>/dev/null || ((try == 5)); then
			cat "$IDEM_SERVER_LOG" >&2 2>/dev/null || true
			die "the server did not start (pg_ctl exit $rc)"
		fi
		log "port $port was taken meanwhile; trying another"
	done

	export PGHOST=127.0.0.1 PGPORT=$port PGUSER=postgres PGDATABASE=postgres
	unset PGSERVICE PGSERVICEFILE PGPASSWORD PGOPTIONS PGHOSTADDR PGSSLMODE
	log "server up: PostgreSQL $("$PG_BINDIR/psql" -XAtq -c 'SHOW server_version'), 127.0.0.1:$port"
}

# stop_cluster [EXIT_STATUS]: stop the server (fast, else immediate) and
# remove its folder.  With a non-zero status the server log is printed and
# kept in $REPO_ROOT/log/.
stop_cluster() {
	local status=${1:-0} pid kept
	[[ -n $IDEM_TMPDIR && -d $IDEM_TMPDIR ]] || return 0
	if [[ -f $IDEM_PGDATA/postmaster.pid ]]; then
		if ! as_postgres "$PG_BINDIR/pg_ctl" stop -D "$IDEM_PGDATA" -m fast -w -t 30 >/dev/null 2>&1; then
			as_postgres "$PG_BINDIR/pg_ctl" stop -D "$IDEM_PGDATA" -m immediate -w -t 30 >/dev/null 2>&1 || true
		fi
		# Last resort: the postmaster named in this cluster's own pid file.
		if [[ -f $IDEM_PGDATA/postmaster.pid ]]; then
			pid=$(head -n 1 "$IDEM_PGDATA/postmaster.pid" 2>/dev/null || true)
			if [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null; then
				kill -KILL "$pid" 2>/dev/null || true
			fi
		fi
	fi
	if [[ $status != 0 && -s $IDEM_SERVER_LOG ]]; then
		mkdir -p "$REPO_ROOT/log"
		kept=$REPO_ROOT/log/server-$(date +%Y%m%d-%H%M%S).log
		cp "$IDEM_SERVER_LOG" "$kept" || true
		{
			echo "---- last lines of the server log (whole log kept in $kept) ----"
			tail -n 40 "$IDEM_SERVER_LOG"
			echo "----"
		} >&2
	fi
	rm -rf "$IDEM_TMPDIR"
	IDEM_TMPDIR=
}

_idem_on_exit() {
	local status=$?
	# A second Ctrl-C must not cut the clean-up short.
	trap - EXIT
	trap '' INT TERM HUP
	stop_cluster "$status" || true
	if [[ -n $IDEM_PG_PREFIX_OWN && -d $IDEM_PG_PREFIX_OWN ]]; then
		rm -rf "$IDEM_PG_PREFIX_OWN"
	fi
	exit "$status"
}
