#!/usr/bin/env bash
# scripts/test.sh -- the whole test suite on a throwaway cluster (what CI runs)
#
# Installs what is missing (apt), builds and installs the extension, starts a
# cluster of its own (scripts/common.sh), then runs through PGXS:
#   pg_regress            sql/*.sql    against expected/*.out
#   pg_isolation_regress  specs/*.spec against expected/*.out
#   prove (TAP)           t/*.pl, on clusters of their own
#   the HTTP examples     examples/run_tests.sh gin|python, real requests
#                         to each example's server on 127.0.0.1
#   the integrations      integrations/*/test.sh (15 only): each package
#                         built, installed into a fresh app, its sample
#                         apps driven by examples/http_test.py
#   the docs              scripts/docs_test.sh: every sql, shell and
#                         postgresql.conf block of the Markdown files, each
#                         file on a fresh cluster of its own (docs/testing.md),
#                         from a copy of the tree in a folder of mode 700
# then the same on PostgreSQL 17 and 18, each in a Debian root of its own
# (scripts/matrix.sh; IDEM_MATRIX=0 leaves it out), and last the Debian
# packages of 15, 17 and 18, each built and tested installed in a clean
# root (scripts/packages.sh; IDEM_PKG=0 leaves them out, IDEM_MATRIX=0
# keeps 15's only), and a database moved from 15 to 17 and 18 by dump and
# restore and by pg_upgrade (scripts/pgup_test.sh; IDEM_PGUP=0 or IDEM_MATRIX=0 leave it out).
# Exits non-zero if anything fails, after printing the diffs.
#
#   bash scripts/test.sh          (as root on Debian 12)
set -euo pipefail

# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

install_deps
# On the host, into a private copy of its PostgreSQL (common.sh); a matrix
# root is private already.  IDEM_PRIVATE_PG=0 installs into the host's.
if [[ $IDEM_PG_MAJOR == 15 && ${IDEM_PRIVATE_PG:-1} != 0 ]]; then
	use_private_pg
fi
build_install
start_cluster fast

cd "$REPO_ROOT"
rm -rf results output_iso regression.diffs regression.out

# The two suites run as two make calls, so that a regression failure does not
# keep the isolation tests from running (one make installcheck stops at the
# first failing command).  They run against this cluster (TEMP_INSTANCE=
# leaves out the Makefile's --temp-instance), as root, and without a server
# start of their own each.
status=0
summary=$IDEM_TMPDIR/summary.txt  # removed with the cluster
# What failed, in a few lines per suite, printed again at the very end (after
# the other majors' output), where a log cut to its tail still shows it.
failures=''
# note_failures NAME OUT: the lines of a failed suite's OUT that say what
# failed (pg_regress's FAILED or "not ok" lines, prove's failed tests, the
# line a test died at and its summary report), at most 40, each prefixed
# with the major and NAME, and a TAP test's lines with the file they came
# from: the one they name ("at t/021_proxy_grow.pl line 80"), else the one
# whose header ("t/021_proxy_grow.pl .. ") they follow.  That holds because
# prove runs with --merge (run_tap): without it a test's standard error (its
# diagnostics, its die) passes prove by and lands under the header of the
# file before it.
note_failures() {
	local name="[pg$IDEM_PG_MAJOR] $1" out=$2 lines
	lines=$(awk -v name="$name" '
		/^t\/[0-9]+_[A-Za-z0-9_]+\.pl \.\.+/ { file = $1; next }
		/^Test Summary Report/ { report = 1 }
		/^Files=[0-9]+, Tests=/ { report = 0; file = "" }
		/^-+$/ { next }
		report || /^not ok|^# +Failed test|^# +Looks like| at t\/[^ ]+\.pl line [0-9]+|timed out|Bail|BAIL|\.\.\. FAILED/ {
			if (!report && $0 !~ /^t\//) {
				from = file
				if (match($0, / at t\/[0-9]+_[A-Za-z0-9_]+\.pl line [0-9]+/))
					from = substr($0, RSTART + 4, RLENGTH - 4)
				sub(/ line [0-9]+$/, "", from)
				if (from != "")
					$0 = from " " $0
			}
			print name ": " $0
		}' "$out" | head -n 40 || true)
	if [[ -n $lines ]]; then
		failures+=$lines$'\n'
	fi
}
run_suite() {
	local name=$1 out rc=0
	shift
	log "$name"
	out=$IDEM_TMPDIR/suite.out
	make --no-print-directory installcheck PG_CONFIG="$PG_CONFIG" "$@" 2>&1 | tee "$out" || rc=$?
	if ((rc != 0)); then
		status=1
		note_failures "$name" "$out"
	fi
	# PostgreSQL's own summary: " All N tests passed. " / " M of N tests failed. "
	if grep -Eq 'tests? (passed|failed)' "$out"; then
		grep -E 'tests? (passed|failed)|tests? (was|were) ignored' "$out" |
			sed -e 's/^ *//' -e 's/ *$//' -e "s/^/$name: /" >>"$summary"
	elif ((rc != 0)); then
		echo "$name: did not run (make exit $rc)" >>"$summary"
	else
		echo "$name: no tests" >>"$summary"
	fi
}
if compgen -G 'sql/*.sql' >/dev/null; then
	run_suite "regression (pg_regress)" ISOLATION= TAP_TESTS= TEMP_INSTANCE=
else
	echo "regression (pg_regress): no tests in sql/" | tee -a "$summary"
fi
if compgen -G 'specs/*.spec' >/dev/null; then
	run_suite "isolation (pg_isolation_regress)" REGRESS= TAP_TESTS= TEMP_INSTANCE=
else
	echo "isolation (pg_isolation_regress): no tests in specs/" | tee -a "$summary"
fi

# TAP tests (t/*.pl) start clusters of their own, and PostgreSQL refuses to
# run as root: they run as the postgres OS user in a copy of the tree that it
# owns, inside the temporary folder removed on exit.
#
# t/012_upgrade.pl also runs a session on the 1.0 library, and
# t/024_upgrade_1_2.pl one on the 1.1 library, built here from their
# sources: those scripts/matrix.sh put in $IDEM_V10_SRC and $IDEM_V11_SRC (a
# root has no git history), or else the tree of v10_revision and
# v11_revision (common.sh).  Where neither can be had the test skips that
# session, with a note.
build_old_library() {
	local version=$1 src=$2 dir=$IDEM_TMPDIR/$1 rev
	mkdir -p "$dir"
	if [[ -n $src && -d $src ]]; then
		cp -r "$src/." "$dir"
	else
		rev=$("${version}_revision") || return 0
		git -C "$REPO_ROOT" archive "$rev" | tar -x -C "$dir" || return 0
	fi
	if make -s -C "$dir" PG_CONFIG="$PG_CONFIG" >/dev/null 2>&1; then
		chmod -R a+rX "$dir"
		echo "$dir/idempotency.so"
	fi
}
run_tap() {
	local name="TAP (prove)" out rc=0 copy=$IDEM_TMPDIR/tap v10 v11 f errs
	log "$name"
	mkdir -p "$copy"
	cp -r "$REPO_ROOT/Makefile" "$REPO_ROOT/t" "$REPO_ROOT/monitoring" "$copy/"
	# the SQL fixtures the tests share (IdemTest::sql_fixture)
	mkdir -p "$copy/sql"
	cp -r "$REPO_ROOT/sql/include" "$copy/sql/"
	# the grants t/020_proxy.pl and t/022_proxy_routers.pl run as the docs
	# give them
	mkdir -p "$copy/proxy" "$copy/docs"
	cp "$REPO_ROOT/README.md" "$copy/"
	cp "$REPO_ROOT/docs/reference.md" "$copy/docs/"
	cp "$REPO_ROOT/proxy/README.md" "$copy/proxy/"
	chown -R postgres "$copy"
	v10=$(build_old_library v10 "${IDEM_V10_SRC:-}" || true)
	[[ -n $v10 ]] || log "no 1.0 library built: t/012_upgrade.pl skips its 1.0-library session"
	v11=$(build_old_library v11 "${IDEM_V11_SRC:-}" || true)
	[[ -n $v11 ]] || log "no 1.1 library built: t/024_upgrade_1_2.pl skips its 1.1-library session"
	out=$IDEM_TMPDIR/tap.out
	(cd "$copy" && runuser -u postgres -- env -u PGHOST -u PGPORT -u PGUSER -u PGDATABASE \
		IDEM_V10_LIBRARY="$v10" IDEM_V11_LIBRARY="$v11" make --no-print-directory installcheck PG_CONFIG="$PG_CONFIG" REGRESS= ISOLATION= \
		PROVE_FLAGS='--verbose --merge') 2>&1 | tee "$out" || rc=$?
	if ((rc != 0)); then
		status=1
		note_failures "$name" "$out"
		# The files that failed, from prove's summary report; a test's own
		# errors (a die, a failed safe_psql) are in its log only.  Only
		# their logs are printed: the test's own (regress_log_NNN_name)
		# and its servers' (NNN_name_NODE.log).
		local failed log_file
		failed=$(sed -nE 's/^t\/([0-9]+_[A-Za-z0-9_]+)\.pl +\(Wstat.*/\1/p' "$out")
		for f in $(head -n 5 <<<"$failed"); do
			[[ -f $copy/tmp_check/log/regress_log_$f ]] || continue
			errs=$(grep -E 'error running SQL|ERROR: | at t/[^ ]+\.pl line [0-9]+|timed out|Failed test|BAIL' \
				"$copy/tmp_check/log/regress_log_$f" | tail -n 8 || true)
			if [[ -n $errs ]]; then
				failures+=$(sed "s/^/[pg$IDEM_PG_MAJOR] $name: regress_log_$f: /" <<<"$errs")$'\n'
			fi
		done
		for f in $failed; do
			for log_file in "$copy/tmp_check/log/regress_log_$f" "$copy/tmp_check/log/${f}"_*.log; do
				[[ -f $log_file ]] || continue
				echo "======== $(basename "$log_file") (last 60 lines) ========"
				tail -n 60 "$log_file"
			done
		done
	fi
	if grep -Eq '^Files=[0-9]+, Tests=[0-9]+' "$out"; then
		local tests bad=0
		tests=$(sed -nE 's/^Files=[0-9]+, Tests=([0-9]+).*/\1/p' "$out" | tail -n 1)
		if ((rc != 0)); then
			bad=$(grep -cE '^not ok' "$out" || true)
			((bad > 0)) || bad=1
		fi
		echo "$name: $((tests - bad)) of $tests tests passed." >>"$summary"
	else
		echo "$name: did not run (make exit $rc)" >>"$summary"
	fi
}
if compgen -G 't/*.pl' >/dev/null; then
	run_tap
fi

# The HTTP examples (examples/gin, examples/python): each one's server on
# free ports of 127.0.0.1 against this cluster (a database of its own),
# driven with real HTTP requests by examples/http_test.py.
run_example() {
	local which=$1 name="$1 example (HTTP)" out rc=0 line
	log "$name"
	out=$IDEM_TMPDIR/example-$which.out
	bash "$REPO_ROOT/examples/run_tests.sh" "$which" 2>&1 | tee "$out" || rc=$?
	if ((rc != 0)); then
		status=1
		note_failures "$name" "$out"
	fi
	# Its closing line: "<name>: N of M tests passed." (a failure before
	# the requests says 0 of 1).
	line=$(grep -F "$name: " "$out" | grep -E ' [0-9]+ of [0-9]+ tests passed\.$' | tail -n 1 || true)
	if [[ -n $line ]]; then
		echo "$line" >>"$summary"
	else
		echo "$name: 0 of 1 tests passed." >>"$summary"
	fi
}
run_example gin
run_example python

# The integrations (integrations/*/: node, python, go): each one's
# integrations/NAME/test.sh builds its package the ecosystem's way,
# installs it from that artifact into a fresh app, runs its README's quick
# start and drives its sample apps through examples/http_test.py (the
# conformance test), against this cluster.  On 15 only: the matrix roots
# have no npm.  Its closing line: "NAME integration: N of M tests passed."
run_integration() {
	local dir=$1 name out rc=0 line
	name="$(basename "$dir") integration"
	log "$name"
	out=$IDEM_TMPDIR/integration-$(basename "$dir").out
	bash "$dir/test.sh" 2>&1 | tee "$out" || rc=$?
	if ((rc != 0)); then
		status=1
		note_failures "$name" "$out"
	fi
	line=$(grep -F "$name: " "$out" | grep -E " [0-9]+ of [0-9]+ tests passed\.$" | tail -n 1 || true)
	echo "${line:-$name: 0 of 1 tests passed.}" >>"$summary"
}
if [[ $IDEM_PG_MAJOR == 15 ]]; then
	for dir in "$REPO_ROOT"/integrations/*/; do
		if [[ -f $dir/test.sh ]]; then
			run_integration "${dir%/}"
		fi
	done
fi

# The SQL edition (sql-edition/): the suites above, as far as they apply,
# against the edition installed and called by a role that is not
# superuser, on a cluster of its own, with the moves between the editions
# and the HTTP test of examples/python and examples/gin over the edition
# (about two and a half minutes).  Its closing line: "sql edition: N of M
# tests passed."
run_sql_edition() {
	local name="sql edition" out rc=0 line
	log "$name"
	out=$IDEM_TMPDIR/sql-edition.out
	bash "$REPO_ROOT/sql-edition/test.sh" 2>&1 | tee "$out" || rc=$?
	if ((rc != 0)); then
		status=1
		note_failures "$name" "$out"
	fi
	line=$(grep -F "$name: " "$out" | grep -E " [0-9]+ of [0-9]+ tests passed\.$" | tail -n 1 || true)
	echo "${line:-$name: 0 of 1 tests passed.}" >>"$summary"
}
run_sql_edition

# The docs: every block of README.md, docs/*.md and the examples' READMEs,
# run as written (scripts/docs_test.sh starts a cluster per file).  They
# run from a copy of the tree in a fresh folder of mode 700 (--private-copy),
# as from a clone under /root: wherever this clone lives, nothing may run
# as postgres in a folder it cannot enter.  Its closing line: "docs
# (examples): N of M tests passed."
run_docs() {
	local name="docs (examples)" out rc=0 line old=$IDEM_TMPDIR/v11
	log "$name"
	out=$IDEM_TMPDIR/docs.out
	# release 1.1 as the TAP tests built it, for the blocks that start
	# from it (README.md, "Upgrading the extension"); else the docs test
	# builds it
	[[ -f $old/idempotency.so ]] || old=
	IDEM_DOCS_OLD_SRC=$old bash "$REPO_ROOT/scripts/docs_test.sh" --private-copy 2>&1 | tee "$out" || rc=$?
	if ((rc != 0)); then
		status=1
		note_failures "$name" "$out"
		# (a broken link prints no FAILED line: grep finding nothing must
		# not end the run under set -e before the summary and the matrix)
		failures+=$({ grep -E '^FAILED |: no such (heading|file)' "$out" || true; } | head -n 20 |
			sed "s/^/[pg$IDEM_PG_MAJOR] $name: /")$'\n'
	fi
	line=$(grep -F "$name: " "$out" | grep -E " [0-9]+ of [0-9]+ tests passed\.$" | tail -n 1 || true)
	echo "${line:-$name: 0 of 1 tests passed.}" >>"$summary"
}
run_docs

# META.json's versions against the control files, and the released SQL
# scripts against released.sha256 (scripts/release_check.sh).
log "release checks"
release_out=$IDEM_TMPDIR/release.out
if ! bash "$REPO_ROOT/scripts/release_check.sh" 2>&1 | tee "$release_out"; then
	status=1
	failures+=$({ grep -E '^release check failed' "$release_out" || true; } | sed "s/^/[pg$IDEM_PG_MAJOR] /")$'\n'
fi
grep -E '^release checks: [0-9]+ of [0-9]+ tests passed\.$' "$release_out" >>"$summary" ||
	echo "release checks: 0 of 1 tests passed." >>"$summary"

for diffs in regression.diffs output_iso/regression.diffs; do
	if [[ -s $diffs ]]; then
		echo
		echo "======== $diffs ========"
		cat "$diffs"
	fi
done

# Totals for tools that read a plain "N passed, N failed" closing line.
passed=0
failed=0
while read -r line; do
	if [[ $line =~ All\ ([0-9]+)\ tests?\ passed ]]; then
		passed=$((passed + BASH_REMATCH[1]))
	elif [[ $line =~ ([0-9]+)\ of\ ([0-9]+)\ tests?\ failed ]]; then
		failed=$((failed + BASH_REMATCH[1]))
		passed=$((passed + BASH_REMATCH[2] - BASH_REMATCH[1]))
	elif [[ $line =~ ([0-9]+)\ of\ ([0-9]+)\ tests?\ passed ]]; then
		passed=$((passed + BASH_REMATCH[1]))
		failed=$((failed + BASH_REMATCH[2] - BASH_REMATCH[1]))
	fi
done <"$summary"

echo
echo "======== summary ========"
cat "$summary"
stop_cluster "$status"

# The other majors, each in a Debian root of its own (scripts/matrix.sh);
# not when this run is itself one of them.  Each line of $results is
# "MAJOR PASSED FAILED SKIPPED SECONDS NOTE...".
results=$(mktemp "${TMPDIR:-/tmp}/idempotency-results.XXXXXX")
echo "$IDEM_PG_MAJOR $passed $failed 0 $SECONDS" >"$results"
if [[ $IDEM_PG_MAJOR == 15 && ${IDEM_MATRIX:-1} != 0 ]]; then
	matrix_failures=$(mktemp "${TMPDIR:-/tmp}/idempotency-matrix-failures.XXXXXX")
	bash "$REPO_ROOT/scripts/matrix.sh" --results "$results" --failures "$matrix_failures" || status=1
	if [[ -s $matrix_failures ]]; then
		failures+=$(cat "$matrix_failures")$'\n'
	fi
	rm -f "$matrix_failures"
fi
# The Debian packages of each major, built and installed in clean roots
# (scripts/packages.sh): 15 here, 17 and 18 too unless IDEM_MATRIX=0;
# IDEM_PKG=0 leaves them out.  Counted in each major's line.
if [[ $IDEM_PG_MAJOR == 15 && ${IDEM_PKG:-1} != 0 ]]; then
	pkg_majors=(15)
	[[ ${IDEM_MATRIX:-1} == 0 ]] || pkg_majors+=(17 18)
	pkg_failures=$(mktemp "${TMPDIR:-/tmp}/idempotency-pkg-failures.XXXXXX")
	bash "$REPO_ROOT/scripts/packages.sh" --results "$results" --failures "$pkg_failures" \
		"${pkg_majors[@]}" || status=1
	if [[ -s $pkg_failures ]]; then
		failures+=$(cat "$pkg_failures")$'\n'
	fi
	rm -f "$pkg_failures"
fi
# A database moved from 15 to 17 and 18, by dump and restore and by
# pg_upgrade (scripts/pgup_test.sh), in the roots the matrix has just made
# or refreshed: on the host only, so once a run.  A major without a root is
# counted as skipped.  IDEM_PGUP=0 or IDEM_MATRIX=0 leaves it out.
if [[ $IDEM_PG_MAJOR == 15 && ${IDEM_PGUP:-1} != 0 && ${IDEM_MATRIX:-1} != 0 ]]; then
	pgup_out=$(mktemp "${TMPDIR:-/tmp}/idempotency-pgup-out.XXXXXX")
	pgup_t0=$SECONDS
	log "moving a database from PostgreSQL 15 to newer majors (scripts/pgup_test.sh)"
	bash "$REPO_ROOT/scripts/pgup_test.sh" 2>&1 | tee "$pgup_out" || status=1
	# its closing line; without one, a failure
	pgup_p=0 pgup_m=1 pgup_s=0
	pgup_line=$(sed -nE \
		's/^postgresql upgrade \(dump, pg_upgrade\): ([0-9]+) of ([0-9]+) tests passed, ([0-9]+) skipped\.$/\1 \2 \3/p' \
		"$pgup_out" | tail -n 1)
	if [[ -n $pgup_line ]]; then
		read -r pgup_p pgup_m pgup_s <<<"$pgup_line"
	fi
	# one line of its own in the summary: "PostgreSQL 15-to-17,18: ..."
	echo "15-to-17,18 $pgup_p $((pgup_m - pgup_p)) $pgup_s $((SECONDS - pgup_t0)) dump and pg_upgrade" >>"$results"
	if grep -q '^not ok' "$pgup_out"; then
		failures+=$({ grep '^not ok' "$pgup_out" || true; } | head -n 20 | sed 's/^/[pgup] /')$'\n'
	fi
	rm -f "$pgup_out"
fi
# One line per major, its results added up in the order they came.
bymajor=$(awk '
	!($1 in p) { order[++n] = $1 }
	{
		p[$1] += $2; f[$1] += $3; s[$1] += $4; t[$1] += $5
		note = ""
		for (i = 6; i <= NF; i++)
			note = note (i > 6 ? " " : "") $i
		if (note != "")
			notes[$1] = notes[$1] (notes[$1] != "" ? "; " : "") note
	}
	END {
		for (i = 1; i <= n; i++) {
			m = order[i]
			printf "PostgreSQL %s: %d passed, %d failed, %d skipped in %ds%s\n", m, p[m], f[m], s[m], t[m],
				(notes[m] != "" ? " (" notes[m] ")" : "")
		}
	}' "$results")
read -r passed failed skipped < <(awk '{ p += $2; f += $3; s += $4 } END { print p + 0, f + 0, s + 0 }' "$results")
rm -f "$results"
if [[ -n $failures ]]; then
	echo
	echo "$WHAT_FAILED"
	printf '%s\n' "${failures%$'\n'}"
fi
echo
echo "======== by PostgreSQL major ========"
echo "$bymajor"
echo "tests: $passed passed, $failed failed, $skipped skipped"
exit "$status"
