#!/usr/bin/env bash
# scripts/asan.sh -- the regression and isolation suites against the
# extension built with AddressSanitizer (a separate command, not part of CI)
#
#   bash scripts/asan.sh                 the work tree as it is now
#   bash scripts/asan.sh --commit REV    a clean checkout of REV (git archive)
#
# As root on Debian 12, after scripts/test.sh has installed the packages.
#
# What it does, all of it under one temporary folder removed on exit:
#   1. copies the sources (the work tree's tracked and untracked files, or
#      REV) and builds them with -fsanitize=address;
#   2. makes a private copy of the PostgreSQL 15 installation (its bin, lib
#      and share folders, about 50 MB; PostgreSQL finds its lib and share
#      folders relative to its binaries) and installs the ASan build there
#      (make install DESTDIR=...).  The system installation is never touched:
#      other clusters and test runs on this machine keep the normal build;
#   3. puts a wrapper in place of the copy's postgres binary that starts the
#      real one with gcc's ASan runtime preloaded (LD_PRELOAD, with a small
#      shim that makes ASan initialize before glibc's gettext lock is first
#      taken -- without it Debian's postgres hangs at start, see step 3
#      below) and ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:log_path=...;
#      the server is an uninstrumented PostgreSQL with an instrumented
#      extension;
#   4. starts a throwaway cluster from the copy (scripts/common.sh:
#      127.0.0.1, free port, pg_cron preloaded) and runs, like
#      scripts/test.sh, make installcheck for REGRESS (sql/) and ISOLATION
#      (specs/), without the TAP tests;
#   5. prints every sanitizer report found in the log_path files (kept in
#      log/asan-DATE/ when there are any) and any backend that died of a
#      signal; then runs a canary (a C function with a deliberate one-byte
#      stack overflow, built the same way) that must be reported, so that a
#      clean result means something.  Exits non-zero on any report, signal,
#      failed suite or silent canary.
#
# What it can and cannot see: every stack and global buffer overflow in the
# extension's code, and misuse of malloc'd memory.  Memory from palloc comes
# in large malloc'd blocks that PostgreSQL carves up without ASan redzones,
# so an overrun inside a palloc'd chunk is seen only when it leaves the
# block (PostgreSQL's own checks, e.g. a debug build's sentinels, are the
# tool for that).
#
# Takes about a minute.  Last clean run: 2026-11-29, commit 0eb325d (the
# regression suite's 11 files and the isolation suite's 6 specs; canary
# reported).
set -euo pipefail

# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

COMMIT=
while (($# > 0)); do
	case $1 in
	--commit)
		COMMIT=${2:?--commit needs a revision}
		shift 2
		;;
	-h | --help)
		sed -n '2,45p' "${BASH_SOURCE[0]}"
		exit 0
		;;
	*) die "unknown argument: $1 (see --help)" ;;
	esac
done

((EUID == 0)) || die "run as root (the server runs as the postgres OS user)"
[[ -x $PG_CONFIG ]] || die "$PG_CONFIG missing: run scripts/test.sh once first"
LIBASAN=$(gcc -print-file-name=libasan.so)
[[ -e $LIBASAN ]] || die "gcc's libasan.so not found ($LIBASAN)"
LIBASAN=$(readlink -f "$LIBASAN")

ASAN_WORK=$(mktemp -d "${TMPDIR:-/tmp}/idempotency-asan.XXXXXX")
chmod 755 "$ASAN_WORK"
# common.sh's exit handler (start_cluster installs it) stops the cluster;
# this one also removes the build, the private installation and the logs
_idem_on_exit() {
	local status=$?
	trap - EXIT
	trap '' INT TERM HUP
	stop_cluster "$status" || true
	rm -rf "$ASAN_WORK"
	exit "$status"
}
trap _idem_on_exit EXIT

# ------------------------------------------------------------------
# 1. sources and the ASan build
# ------------------------------------------------------------------
SRC=$ASAN_WORK/src
mkdir -p "$SRC"
if [[ -n $COMMIT ]]; then
	tested=$(git -C "$REPO_ROOT" rev-parse --verify "$COMMIT^{commit}") || die "no commit $COMMIT"
	git -C "$REPO_ROOT" archive "$tested" | tar -x -C "$SRC"
	tested_desc="commit $tested"
else
	tested=$(git -C "$REPO_ROOT" rev-parse HEAD 2>/dev/null || echo unknown)
	(cd "$REPO_ROOT" && git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$SRC")
	changed=$(cd "$REPO_ROOT" && git status --porcelain -- ':(glob)*.c' ':(glob)*.h' Makefile \
		':(glob)*.sql' ':(glob)*.control' ':(glob)sql/**' ':(glob)expected/**' ':(glob)specs/**' | wc -l)
	if ((changed > 0)); then
		tested_desc="work tree on commit $tested, with $changed changed or new source/test files"
	else
		tested_desc="commit $tested (clean work tree)"
	fi
fi
log "testing $tested_desc"

ASAN_CFLAGS="-fsanitize=address -fno-omit-frame-pointer -fno-common -g -O1"
log "building with $ASAN_CFLAGS"
make -C "$SRC" -s PG_CONFIG="$PG_CONFIG" COPT="$ASAN_CFLAGS" >"$ASAN_WORK/build.log" 2>&1 ||
	{
		cat "$ASAN_WORK/build.log"
		die "the ASan build failed (is the C mid-edit?)"
	}
warnings=$(grep -c 'warning:' "$ASAN_WORK/build.log" || true)
((warnings == 0)) || { grep 'warning:' "$ASAN_WORK/build.log"; log "compiler warnings: $warnings"; }
asan_syms=$(nm -D "$SRC"/*.so | grep -c __asan_ || true)
((asan_syms > 0)) || die "the built library has no ASan instrumentation"

# ------------------------------------------------------------------
# 2. a private copy of the installation, with the ASan build in it
# ------------------------------------------------------------------
SHADOW=$ASAN_WORK/root
bindir=$("$PG_CONFIG" --bindir)
pkglibdir=$("$PG_CONFIG" --pkglibdir)
sharedir=$("$PG_CONFIG" --sharedir)
# the folders that hold bin/lib (Debian: /usr/lib/postgresql/15) and share
for d in "$(dirname "$bindir")" "$sharedir"; do
	mkdir -p "$SHADOW$(dirname "$d")"
	cp -a "$d" "$SHADOW$(dirname "$d")/"
done
[[ $pkglibdir == "$(dirname "$bindir")"/* ]] || cp -a "$pkglibdir" "$SHADOW$(dirname "$pkglibdir")/"
make -C "$SRC" -s PG_CONFIG="$PG_CONFIG" install DESTDIR="$SHADOW" >>"$ASAN_WORK/build.log" 2>&1 ||
	{
		cat "$ASAN_WORK/build.log"
		die "make install DESTDIR=... failed"
	}

# 3. the wrapper: the server, and only the server, runs with ASan preloaded.
#
# Preloaded into Debian's postgres, the ASan runtime initializes lazily, at
# the first malloc -- and that comes from inside bindtextdomain(), called by
# the constructor of libgpg-error (libsystemd -> libgcrypt -> libgpg-error)
# while it holds glibc's gettext lock.  ASan's initialization calls
# dlerror() -> dcgettext(), which takes and releases the same lock: the lock
# is left broken and the process hangs in its next bindtextdomain()
# (postgres -V never returns).  A small preloaded shim in front of
# bindtextdomain() makes that first malloc happen before the lock is taken.
ASAN_LOGS=$ASAN_WORK/asan-logs
mkdir -p "$ASAN_LOGS"
chown postgres "$ASAN_LOGS"
cat >"$ASAN_WORK/asan_init_first.c" <<-'SHIM_EOF'
	/* scripts/asan.sh: initialize ASan before the first gettext lock is held */
	#define _GNU_SOURCE
	#include <dlfcn.h>
	#include <stdlib.h>

	char *bindtextdomain(const char *domainname, const char *dirname);

	char *
	bindtextdomain(const char *domainname, const char *dirname)
	{
		static char *(*real) (const char *, const char *);

		if (real == NULL)
		{
			void *volatile p = malloc(1);	/* ASan initializes here */

			free(p);
			real = (char *(*) (const char *, const char *))
				dlsym(RTLD_NEXT, "bindtextdomain");
		}
		return real(domainname, dirname);
	}
SHIM_EOF
SHIM=$ASAN_WORK/asan_init_first.so
gcc -shared -fPIC -O2 -fno-builtin -Wall -o "$SHIM" "$ASAN_WORK/asan_init_first.c" -ldl ||
	die "could not build $SHIM"
mv "$SHADOW$bindir/postgres" "$SHADOW$bindir/postgres.real"
cat >"$SHADOW$bindir/postgres" <<-EOF
	#!/bin/sh
	# scripts/asan.sh: the real server with the ASan runtime preloaded
	LD_PRELOAD="$LIBASAN $SHIM"
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:disable_coredump=1:log_path=$ASAN_LOGS/asan
	export LD_PRELOAD ASAN_OPTIONS
	exec "\$(dirname "\$0")/postgres.real" "\$@"
EOF
chmod 755 "$SHADOW$bindir/postgres"

PG_BINDIR=$SHADOW$bindir
export PATH="$PG_BINDIR:$PATH"

# ------------------------------------------------------------------
# 4. the cluster and the suites
# ------------------------------------------------------------------
start_cluster fast

libdir_in_use=$(psql -XAtq -c "SELECT setting FROM pg_config WHERE name = 'PKGLIBDIR'")
[[ $libdir_in_use == "$SHADOW"* ]] || die "the server uses $libdir_in_use, not the private copy"
asan_maps=$(psql -XAtq -c "SELECT pg_read_file('/proc/' || pg_backend_pid() || '/maps')" | grep -c libasan || true)
((asan_maps > 0)) || die "the ASan runtime is not in the server's memory"
log "server from $SHADOW$bindir with $LIBASAN preloaded"

cd "$SRC"
status=0
summary=$ASAN_WORK/summary.txt
: >"$summary"
run_suite() {
	local name=$1 out rc=0
	shift
	log "$name (ASan)"
	out=$ASAN_WORK/suite.out
	make --no-print-directory installcheck PG_CONFIG="$PG_CONFIG" TAP_TESTS= "$@" 2>&1 | tee "$out" || rc=$?
	((rc == 0)) || status=1
	if grep -Eq 'tests? (passed|failed)' "$out"; then
		grep -E 'tests? (passed|failed)' "$out" | sed -e 's/^ *//' -e 's/ *$//' -e "s/^/$name: /" >>"$summary"
	else
		echo "$name: did not run (make exit $rc)" >>"$summary"
	fi
	for diffs in regression.diffs output_iso/regression.diffs; do
		[[ -s $diffs ]] && cat "$diffs"
	done
	return 0
}
run_suite "regression (pg_regress)" ISOLATION= TEMP_INSTANCE=
run_suite "isolation (pg_isolation_regress)" REGRESS= TEMP_INSTANCE=

# ------------------------------------------------------------------
# 5. the verdict
# ------------------------------------------------------------------
signals=$(grep -c 'terminated by signal' "$IDEM_SERVER_LOG" || true)
reports=$(grep -l 'ERROR: AddressSanitizer' "$ASAN_LOGS"/asan* 2>/dev/null | wc -l || true)

# The canary: a function with a deliberate one-byte stack overflow, built
# like the extension and run in this server, must produce a report -- else
# "no report" above would prove nothing.  (The backend aborts; the server
# restarts; its report is kept apart from the suites'.)
mkdir -p "$ASAN_WORK/canary"
cat >"$ASAN_WORK/canary/canary.c" <<-'CANARY_EOF'
	#include "postgres.h"
	#include "fmgr.h"
	PG_MODULE_MAGIC;
	PG_FUNCTION_INFO_V1(asan_canary);
	Datum asan_canary(PG_FUNCTION_ARGS);
	Datum
	asan_canary(PG_FUNCTION_ARGS)
	{
		int i = PG_GETARG_INT32(0);
		char buf[8];
		char *volatile p = buf;	/* keeps the compiler from folding the read */

		memset(buf, 'x', sizeof(buf));
		PG_RETURN_INT32(p[i]);	/* i = 8: one byte past the end */
	}
CANARY_EOF
canary_ok=0
if gcc $ASAN_CFLAGS -fPIC -shared -I"$("$PG_CONFIG" --includedir-server)" \
	-o "$ASAN_WORK/canary/canary.so" "$ASAN_WORK/canary/canary.c" 2>"$ASAN_WORK/canary/build.log"; then
	mv "$ASAN_LOGS" "$ASAN_WORK/suite-logs"
	ASAN_SUITE_LOGS=$ASAN_WORK/suite-logs
	mkdir -p "$ASAN_LOGS"
	chown postgres "$ASAN_LOGS"
	psql -XAtq -c "CREATE FUNCTION pg_temp.asan_canary(int) RETURNS int AS '$ASAN_WORK/canary/canary.so' LANGUAGE C STRICT;
	               SELECT pg_temp.asan_canary(8)" >"$ASAN_WORK/canary/psql.log" 2>&1 || true
	if grep -qs 'stack-buffer-overflow' "$ASAN_LOGS"/asan*; then
		canary_ok=1
	fi
	rm -rf "$ASAN_LOGS"
	ASAN_LOGS=$ASAN_SUITE_LOGS
fi
if ((canary_ok == 1)); then
	log "canary: a deliberate stack overflow was reported (ASan is live in the server)"
else
	status=1
	log "canary: a deliberate stack overflow was NOT reported: this run proves nothing"
	cat "$ASAN_WORK/canary/build.log" "$ASAN_WORK/canary/psql.log" 2>/dev/null || true
fi
echo
echo "======== ASan summary ($tested_desc) ========"
cat "$summary"
if ((reports > 0 || signals > 0)); then
	status=1
	kept=$REPO_ROOT/log/asan-$(date +%Y%m%d-%H%M%S)
	mkdir -p "$kept"
	cp "$ASAN_LOGS"/asan* "$IDEM_SERVER_LOG" "$kept/" 2>/dev/null || true
	echo "sanitizer reports: $reports file(s); backends killed by a signal: $signals (kept in $kept)"
	for f in "$ASAN_LOGS"/asan*; do
		[[ -f $f ]] || continue
		echo "---- $(basename "$f") ----"
		cat "$f"
	done
	grep -B2 -A2 'terminated by signal' "$IDEM_SERVER_LOG" || true
else
	echo "sanitizer reports: none; backends killed by a signal: none"
fi
if ((status == 0)); then
	echo "ASan run clean on $(date -u '+%Y-%m-%d %H:%M UTC'): $tested_desc"
else
	echo "ASan run NOT clean: $tested_desc"
fi
exit "$status"
