#!/usr/bin/env bash
# scripts/packages.sh -- build the Debian packages of every major and test
# each in a clean root (what scripts/test.sh runs after the matrix)
#
#   bash scripts/packages.sh [--results FILE] [--failures FILE] [MAJOR...]
#                                                        (as root, Debian 12)
#
# For each MAJOR (default 15 17 18):
#   build    postgresql-MAJOR-idempotency and -idempotency-proxy with
#            scripts/package.sh (dpkg-buildpackage -us -uc -b, then lintian,
#            which must find no error): 15 on the host, 17 and 18 inside
#            their matrix roots (scripts/matrix.sh mx_enter: the same
#            locked, cached roots the matrix tests in)
#   test     scripts/package_test.sh in a clean root of MAJOR that has never
#            seen a build tree: install, the regression and isolation
#            suites against the installed package, CREATE EXTENSION
#            idempotency_proxy, purge, nothing left
#
# The clean roots are made the way scripts/matrix.sh makes its own (
# debootstrap --variant=minbase from the host's Debian mirror, no service
# starts, no cluster is made), holding only postgresql-MAJOR,
# postgresql-MAJOR-cron, postgresql-MAJOR-plproxy and make.  They are kept
# in $IDEM_MATRIX_CACHE/pkgMAJOR (default /var/cache/idempotency-matrix)
# and rebuilt when missing, older than a week, of another recipe or older
# than the postgresql-MAJOR the packages were built against (they depend on
# at least that version), in a new folder swapped in once complete.  The 15 one is Debian 12 with -updates
# and -security, so that its postgresql-15 is the host's; 17 and 18 have
# the suites of their matrix roots.  A root is only ever used through an
# overlay (package_test.sh), so it stays clean.
#
# A major whose build root or clean root cannot be had (mirror unreachable)
# is skipped with the reason, counted as one skipped test.
#
# --results FILE: append one line per major, "MAJOR PASSED FAILED SKIPPED
# SECONDS NOTE...", for scripts/test.sh's summary (one test for the build
# and lintian, then package_test.sh's).  Without it the script prints its
# own closing line.  --failures FILE: append what failed there instead of
# printing it.  Exits 1 if a test failed.
#
# Sourced, it only defines its functions (and scripts/matrix.sh's): after
# mx_init, pkg_enter MAJOR [VERSION] makes or refreshes MAJOR's clean root and holds
# a shared lock on it (a refresh waits for every user to leave), with its
# folder in $MX_TMP/pkgroot; pkg_leave releases it.  pkg_build MAJOR DIR
# builds MAJOR's packages into DIR.
#
# IDEM_PACKAGE_KEEP=DIR keeps the built .deb files in DIR/MAJOR.
# shellcheck disable=SC2317  # matrix.sh, sourced, returns early: not unreachable
set -euo pipefail

# shellcheck source=scripts/matrix.sh
source "$(dirname "${BASH_SOURCE[0]}")/matrix.sh"

# major -> "suite debootstrap-script check-valid-until extra-suites"
declare -A PKG_SUITE=(
	[15]="bookworm bookworm yes updates security"
	[17]="${MATRIX_SUITE[17]}"
	[18]="${MATRIX_SUITE[18]}"
)
# shellcheck disable=SC2034  # read by mx_main through a nameref
PKG_MAJORS=(15 17 18)
# A clean root is refreshed after a week (the matrix roots: a day), or as
# soon as the packages were built against a newer postgresql-MAJOR.
PKG_MAX_AGE=${IDEM_PKG_MAX_AGE:-604800}	# seconds
# The descriptor of the lock on the clean root in use.
PKG_LOCK_FD=
# The postgresql-MAJOR a clean root must have at least (pkg_enter's VERSION).
PKG_WANT=

# pkg_packages MAJOR: what a clean root of MAJOR holds.
pkg_packages() {
	echo "postgresql-$1 postgresql-$1-cron postgresql-$1-plproxy make"
}

# pkg_recipe MAJOR: what a clean root is made of; one of another recipe is
# rebuilt.
pkg_recipe() {
	echo "suite=${PKG_SUITE[$1]}"
	echo "packages=$(pkg_packages "$1")"
}

# pkg_security_mirror: the host's Debian security mirror, as apt knows it.
pkg_security_mirror() {
	local codename uri
	# shellcheck disable=SC1091
	codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
	# shellcheck disable=SC2016  # apt's own $(FIELD) syntax
	uri=$(apt-get indextargets --format '$(REPO_URI) $(RELEASE) $(IDENTIFIER)' 2>/dev/null |
		awk -v r="$codename-security" '$2 == r && $3 == "Packages" { print $1; exit }')
	echo "${uri:-http://deb.debian.org/debian-security}" | sed 's:/*$::'
}

# pkg_build_root MAJOR DIR: make a clean root for MAJOR in DIR (which must
# not exist); its log on stdout.  Non-zero on any failure, leaving DIR for
# the caller to remove.
pkg_build_root() {
	local major=$1 dir=$2 suite script check extra mirror x
	read -r suite script check extra <<<"${PKG_SUITE[$major]}"
	mirror=$(mx_mirror) || {
		echo "no Debian mirror found in the host's apt sources"
		return 1
	}
	echo "debootstrap $suite from $mirror (script $script)"
	debootstrap --variant=minbase "$suite" "$dir" "$mirror" \
		"/usr/share/debootstrap/scripts/$script" || return 1
	mx_unmount_all "$dir" || return 1

	echo "deb $mirror $suite main" >"$dir/etc/apt/sources.list"
	for x in $extra; do
		case $x in
			security) echo "deb $(pkg_security_mirror) $suite-security main" ;;
			*) echo "deb $mirror $suite-$x main" ;;
		esac
	done >>"$dir/etc/apt/sources.list"
	if [[ $check == no ]]; then
		echo 'Acquire::Check-Valid-Until "false";' >"$dir/etc/apt/apt.conf.d/99idempotency-matrix"
	fi
	printf '#!/bin/sh\nexit 101\n' >"$dir/usr/sbin/policy-rc.d"
	chmod 755 "$dir/usr/sbin/policy-rc.d"
	mkdir -p "$dir/etc/postgresql-common"
	echo 'create_main_cluster = false' >"$dir/etc/postgresql-common/createcluster.conf"

	mx_mount "$dir" || return 1
	echo "apt-get install $(pkg_packages "$major")"
	# shellcheck disable=SC2046
	if ! mx_in_root "$dir" apt-get update -q ||
		! mx_in_root "$dir" apt-get dist-upgrade -y -q -o Dpkg::Options::=--force-confold ||
		! mx_in_root "$dir" apt-get install -y -q --no-install-recommends \
			-o Dpkg::Options::=--force-confold $(pkg_packages "$major") ||
		! mx_in_root "$dir" apt-get clean; then
		mx_cleanup
		return 1
	fi
	mx_cleanup
	[[ -x $dir/usr/lib/postgresql/$major/bin/postgres ]] || {
		echo "no PostgreSQL $major server in the root after apt"
		return 1
	}
	pkg_recipe "$major" >"$dir/.idempotency-matrix"
}

# pkg_fresh MAJOR ROOT: a clean root is used for a week (IDEM_PKG_MAX_AGE),
# while of this recipe and while its postgresql-MAJOR is at least
# $PKG_WANT (mx_make_root's FRESH).
pkg_fresh() {
	local major=$1 root=$2 age have
	age=$(($(date +%s) - $(stat -c %Y "$root/.idempotency-matrix")))
	have=$(dpkg-query --admindir="$root/var/lib/dpkg" -W -f='${Version}' "postgresql-$major" 2>/dev/null || true)
	if ((age < PKG_MAX_AGE)) && [[ $(pkg_recipe "$major") == "$(cat "$root/.idempotency-matrix")" ]] &&
		{ [[ -z $PKG_WANT ]] || dpkg --compare-versions "$have" ge "$PKG_WANT"; }; then
		return 0
	fi
	echo "is older than a week, of another recipe or has postgresql-$major ${have:-none} (< ${PKG_WANT:-any})"
	return 1
}

# pkg_enter MAJOR [VERSION]: lock MAJOR's clean root ($MATRIX_CACHE/pkgMAJOR),
# make or refresh it if need be (under an exclusive lock: when missing,
# older than PKG_MAX_AGE, of another recipe, or with a postgresql-MAJOR older than
# VERSION, the one the packages were built against, since they depend on at
# least that; mx_make_root), then hold it shared
# (package_test.sh runs through an overlay, so several users may share it).
# Its folder goes to $MX_TMP/pkgroot.  Returns 1, with the reason in
# $MX_TMP/reason and the lock released, if there is none to use.
pkg_enter() {
	local major=$1
	PKG_WANT=${2:-}
	mkdir -p "$MATRIX_CACHE"
	exec {PKG_LOCK_FD}>"$MATRIX_CACHE/pkg$major.lock"
	flock -w 3600 "$PKG_LOCK_FD" || die "could not lock $MATRIX_CACHE/pkg$major.lock"
	if mx_make_root "$major" "pkg$major" "clean root" pkg_build_root pkg_fresh "$MX_TMP/pkgroot"; then
		flock -s "$PKG_LOCK_FD"
		return 0
	fi
	pkg_leave
	return 1
}

# pkg_leave: release the clean root's lock.
pkg_leave() {
	if [[ -n $PKG_LOCK_FD ]]; then
		exec {PKG_LOCK_FD}>&-
		PKG_LOCK_FD=
	fi
}

# pkg_build MAJOR DIR: build MAJOR's packages (and lintian them) into DIR,
# on the host for its own major, else in MAJOR's matrix root; the version of
# postgresql-MAJOR they were built against goes to $MX_TMP/built-against.  Returns 1
# if the build or lintian failed, 2 (the reason in $MX_TMP/reason) if there
# is no matrix root to build in.
pkg_build() {
	local major=$1 dir=$2 root rc=0
	mkdir -p "$dir"
	if [[ $major == "$(pkg_host_major)" ]]; then
		dpkg-query -W -f='${Version}' "postgresql-$major" >"$MX_TMP/built-against" 2>/dev/null || true
		IDEM_PACKAGE_OUT=$dir bash "$REPO_ROOT/scripts/package.sh" "$major" </dev/null || return 1
		return 0
	fi
	mx_enter "$major" || return 2
	root=$(cat "$MX_TMP/root")
	dpkg-query --admindir="$root/var/lib/dpkg" -W -f='${Version}' "postgresql-$major" \
		>"$MX_TMP/built-against" 2>/dev/null || true
	rm -rf "$root/build/debs"
	mx_in_root "$root" IDEM_PACKAGE_OUT=/build/debs bash /build/scripts/package.sh "$major" </dev/null || rc=1
	if ((rc == 0)); then
		cp "$root"/build/debs/*.deb "$dir/" || rc=1
	fi
	rm -rf "$root/build"
	mx_leave
	return "$rc"
}

# pkg_host_major: the PostgreSQL major of the host's Debian (15 on 12).
pkg_host_major() {
	echo "${IDEM_PG_MAJOR:-15}"
}

# pkg_run_major MAJOR: build and test MAJOR's packages; records the result.
pkg_run_major() {
	local major=$1 t0 debs rc=0 passed=0 failed=0 line out
	t0=$(date +%s)
	log "======== packages, PostgreSQL $major ========"
	debs=$MX_TMP/debs$major
	pkg_build "$major" "$debs" || rc=$?
	if ((rc == 2)); then
		log "packages, PostgreSQL $major: SKIPPED: no build root: $(cat "$MX_TMP/reason")"
		mx_result "$major" 0 0 1 $(($(date +%s) - t0)) "packages skipped: $(cat "$MX_TMP/reason")"
		return 0
	fi
	if ((rc != 0)); then
		log "packages, PostgreSQL $major: the build or lintian failed"
		echo "[pg$major] packages: the build or lintian failed (scripts/package.sh)" >>"$MX_FAILURES"
		mx_result "$major" 0 1 0 $(($(date +%s) - t0)) "package build failed"
		return 1
	fi
	passed=1
	log "packages, PostgreSQL $major: built in $(($(date +%s) - t0))s:"
	(cd "$debs" && ls -l -- *.deb)
	if [[ -n ${IDEM_PACKAGE_KEEP:-} ]]; then
		mkdir -p "$IDEM_PACKAGE_KEEP/$major"
		cp "$debs"/*.deb "$IDEM_PACKAGE_KEEP/$major/"
	fi
	if ! pkg_enter "$major" "$(cat "$MX_TMP/built-against" 2>/dev/null || true)"; then
		log "packages, PostgreSQL $major: SKIPPED the install test: $(cat "$MX_TMP/reason")"
		mx_result "$major" 1 0 1 $(($(date +%s) - t0)) "package install test skipped: $(cat "$MX_TMP/reason")"
		return 0
	fi
	out=$MX_TMP/pkgtest$major.out
	rc=0
	bash "$REPO_ROOT/scripts/package_test.sh" "$(cat "$MX_TMP/pkgroot")" "$debs" 2>&1 </dev/null |
		tee "$out" | sed -u "s/^/[pkg$major] /" || rc=$?
	pkg_leave
	line=$(sed -nE 's/^packages \(install, suites, purge\): ([0-9]+) of ([0-9]+) tests passed\.$/\1 \2/p' "$out" | tail -n 1)
	if [[ -n $line ]]; then
		read -r p m <<<"$line"
		passed=$((passed + p))
		failed=$((failed + m - p))
	fi
	if ((rc != 0 && failed == 0)); then
		failed=1
	fi
	if ((failed > 0)); then
		{
			grep -E '^package test failed: |^left behind after purge: ' "$out" || echo "package_test.sh exited $rc"
		} | head -n 20 | sed "s/^/[pg$major] packages: /" >>"$MX_FAILURES"
	fi
	mx_result "$major" "$passed" "$failed" 0 $(($(date +%s) - t0)) ""
	((failed == 0))
}

# Sourced: the functions only.
if [[ ${BASH_SOURCE[0]} != "$0" ]]; then
	return 0
fi

mx_main packages pkg_run_major PKG_MAJORS PKG_SUITE "apt, debootstrap, chroot, mount" "packages, " "$@"
