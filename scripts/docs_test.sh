#!/usr/bin/env bash
# scripts/docs_test.sh [FILE.md...] -- run every code block of the docs
#
# For each Markdown file (default: README.md, docs/*.md, proxy/README.md,
# sql-edition/README.md, examples/*/README.md, in that order) that has
# blocks to run, a fresh throwaway cluster (scripts/common.sh) set up as a
# Debian server is: the pg_hba.conf that Debian's postgresql-common writes
# (peer on the socket, scram-sha-256 on 127.0.0.1), its socket in
# /var/run/postgresql, both libraries preloaded.  scripts/docs_test.py then runs the file's blocks in
# order (the convention is in docs/testing.md).  The extension must be
# installed (scripts/test.sh does it first).  Last, without a cluster, each
# file's links (scripts/docs_test.py --links): one test a file.
#
# Prints one line per block and, last, "docs (examples): N of M tests
# passed." over all files; exits 1 if a block failed.
#
# A block marked <!-- docs-test: from 1.1 --> starts from release 1.1, as
# on a server that runs it (docs/testing.md): the release is built from
# $IDEM_DOCS_OLD_SRC (a built tree; scripts/test.sh passes its TAP tests'),
# else from $IDEM_V11_SRC or git (v11_revision), and this tree's files are
# installed again after the file.
#
# --private-copy runs it all from a copy of the tree in a fresh folder of
# mode 700 that only root may enter, as a newcomer's clone under /root is:
# a block, or this test itself, that runs something as postgres in the
# clone's folder fails there ("could not change directory", issue 36).
# scripts/test.sh runs the docs that way.
#
#   bash scripts/docs_test.sh                 (as root)
#   bash scripts/docs_test.sh docs/reference.md
#   bash scripts/docs_test.sh --private-copy [FILE.md...]
set -euo pipefail

# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# old_release DIR: release 1.1 built in DIR, exported as IDEM_DOCS_OLD_SRC,
# unless that names a tree of it already: from $IDEM_V11_SRC (a matrix
# root has no git history) or else the tree of v11_revision (common.sh).
# Fails where neither can be had.
old_release() {
	local dir=$1 rev
	if [[ -n ${IDEM_DOCS_OLD_SRC:-} && -f $IDEM_DOCS_OLD_SRC/idempotency.so ]]; then
		return 0
	fi
	mkdir -p "$dir"
	if [[ -n ${IDEM_V11_SRC:-} && -d $IDEM_V11_SRC ]]; then
		cp -r "$IDEM_V11_SRC/." "$dir"
	else
		rev=$(v11_revision) || return 1
		git -C "$REPO_ROOT" archive "$rev" | tar -x -C "$dir" || return 1
	fi
	make -s -C "$dir" PG_CONFIG="$PG_CONFIG" >/dev/null 2>&1 || return 1
	export IDEM_DOCS_OLD_SRC=$dir
}
# the marker of a block that starts from release 1.1
from_mark='^<!-- docs-test: from 1\.1 -->$'

private_copy=0
if [[ ${1:-} == --private-copy ]]; then
	private_copy=1
	shift
fi
cd "$REPO_ROOT"
if (($# == 0)); then
	set -- README.md docs/*.md proxy/README.md sql-edition/README.md examples/*/README.md
fi

if ((private_copy)); then
	((EUID == 0)) || die "--private-copy needs root (a folder the postgres user may not enter)"
	private=$(mktemp -d "${TMPDIR:-/tmp}/idempotency-docs.XXXXXX")
	trap 'rm -rf "$private"' EXIT
	[[ $(stat -c '%a %U' "$private") == '700 root' ]] || die "$private is not root's with mode 700"
	# The build products come along (a block's `make` has nothing to do);
	# the logs of earlier runs and the test folders do not.
	mkdir "$private/idempotency"
	tar -C "$REPO_ROOT" --exclude=./.git --exclude=./results --exclude=./output_iso \
		--exclude=./tmp_check --exclude=./tmp_check_iso --exclude=./log \
		--exclude=./bench/results -cf - . | tar -C "$private/idempotency" -xf -
	# release 1.1 from this clone's history, which the copy has not
	if grep -qs "$from_mark" "$@"; then
		old_release "$private/v11" || log "release 1.1 could not be built: its blocks fail"
	fi
	log "the docs from a copy in $private (mode 700, root's)"
	rc=0
	bash "$private/idempotency/scripts/docs_test.sh" "$@" || rc=$?
	# the server logs that stop_cluster kept of failed files
	if [[ -d $private/idempotency/log ]]; then
		mkdir -p "$REPO_ROOT/log"
		cp -r "$private/idempotency/log/." "$REPO_ROOT/log/"
	fi
	exit "$rc"
fi

name="docs (examples)"
runner=$REPO_ROOT/scripts/docs_test.py
sockdir=/var/run/postgresql
passed=0
total=0
status=0
t0=$SECONDS

for f in "$@"; do
	[[ -f $f ]] || continue
	# no cluster for a file with nothing to run
	grep -Eq '^[[:space:]]*```(sql|sh|bash|ini)[[:space:]]*$' "$f" || continue
	IDEM_QUIET=1 start_cluster >/dev/null
	from_old=0
	if grep -q "$from_mark" "$f"; then
		from_old=1
		old_release "$IDEM_TMPDIR/v11" || log "release 1.1 could not be built: the blocks of $f that start from it fail"
	fi
	if [[ ! -d $sockdir ]]; then
		install -d -o postgres -g postgres -m 2775 "$sockdir"
	fi
	cat >"$IDEM_PGDATA/pg_hba.conf" <<-'EOF'
		# Debian's default (postgresql-common)
		local   all             postgres                                peer
		local   all             all                                     peer
		host    all             all             127.0.0.1/32            scram-sha-256
		host    all             all             ::1/128                 scram-sha-256
	EOF
	chown postgres: "$IDEM_PGDATA/pg_hba.conf"
	echo "unix_socket_directories = '$sockdir'" >>"$IDEM_PGDATA/postgresql.conf"
	as_postgres "$PG_BINDIR/pg_ctl" restart -w -t 60 -D "$IDEM_PGDATA" -l "$IDEM_SERVER_LOG" \
		-o "-p $PGPORT" >/dev/null || die "the cluster for $f did not restart"
	out=$IDEM_TMPDIR/docs.out
	rc=0
	# PORT: the port an example's HTTP server listens on (docs say 8080).
	# PG_CONFIG: a block's `make install` goes where the cluster's binaries
	# are (a private copy under scripts/test.sh), never elsewhere.
	PORT=$(free_port) PG_CONFIG=$PG_CONFIG PGHOST=$sockdir PGUSER=postgres PGDATABASE=postgres PG_BINDIR=$PG_BINDIR REPO_ROOT=$REPO_ROOT \
		IDEM_PGDATA=$IDEM_PGDATA IDEM_SERVER_LOG=$IDEM_SERVER_LOG IDEM_TMPDIR=$IDEM_TMPDIR \
		python3 "$runner" "$f" 2>&1 | tee "$out" || rc=$?
	line=$(tail -n 1 "$out")
	if [[ $line =~ :\ ([0-9]+)\ of\ ([0-9]+)\ tests\ passed\.$ ]]; then
		passed=$((passed + BASH_REMATCH[1]))
		total=$((total + BASH_REMATCH[2]))
	else
		total=$((total + 1))
	fi
	((rc == 0)) || status=1
	stop_cluster "$rc"
	# this tree's files again, whatever the blocks left
	if ((from_old)); then
		IDEM_QUIET=1 run_step "make install" make -C "$REPO_ROOT" PG_CONFIG="$PG_CONFIG" install
	fi
done

# The grants the tests give (sql/include) are the ones docs/reference.md
# shows, word for word, with the role app.
for fixture in sql/include/readme_grants.sql sql/include/readme_token_grants.sql; do
	total=$((total + 1))
	if python3 - "$fixture" docs/reference.md <<-'PY'; then
		import sys
		fixture, doc = (open(f).read() for f in sys.argv[1:3])
		grants = "".join(l for l in fixture.splitlines(True) if not l.startswith("--"))
		sys.exit(0 if grants.replace(':"app_role"', "app") in doc else 1)
	PY
		passed=$((passed + 1))
		echo "ok: $fixture is the block docs/reference.md shows"
	else
		status=1
		echo "not ok: $fixture differs from the block docs/reference.md shows"
	fi
done

# Every relative link names a file that exists, and a heading where it has
# an #anchor; every section cited as NAME.md, "Heading" exists (one test a
# file, run blocks or not).
for f in "$@"; do
	[[ -f $f ]] || continue
	total=$((total + 1))
	if python3 "$runner" --links "$f"; then
		passed=$((passed + 1))
	else
		status=1
	fi
done

log "docs blocks run in $((SECONDS - t0))s"
echo "$name: $passed of $total tests passed."
exit "$status"
