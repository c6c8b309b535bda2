#!/usr/bin/env bash
# scripts/matrix.sh -- the test suite on the PostgreSQL majors the host lacks
#
# For each major, a Debian root made with debootstrap from the Debian mirror
# that this machine's apt already uses (read from apt at run time), holding
# postgresql-N, postgresql-server-dev-N, postgresql-N-cron and what the tests
# need.  In each root it builds the extension from a copy of this tree and
# runs scripts/test.sh there (IDEM_PG_MAJOR=N): pg_regress, isolation and TAP
# tests against throwaway clusters of that major, as the postgres user of the
# root, on 127.0.0.1.
#
#   major  Debian suite       debootstrap script
#   17     trixie (13)        trixie
#   18     forky (testing)    sid (Debian 12's debootstrap has no forky)
#
# The host's own major (15, Debian 12) is tested by scripts/test.sh itself,
# which then runs this script.
#
# Roots are kept in $IDEM_MATRIX_CACHE (default /var/cache/idempotency-matrix)
# and rebuilt when older than a day: in a new folder, swapped in only once
# complete, so a failed refresh keeps the old root.  A major whose root
# cannot be had at all (mirror unreachable) is skipped with the reason: its
# tests are counted as skipped, and that alone does not fail the run.
#
# While a root is used, /proc and a /dev/shm of its own are mounted in it;
# they are unmounted on exit whatever happens, and a root is never removed
# while anything is mounted below it.
#
#   bash scripts/matrix.sh [--results FILE] [--failures FILE] [MAJOR...]
#                                                        (as root, Debian 12)
#
# IDEM_MATRIX_MIRROR overrides the mirror (to try a mirror that fails, say).
#
# --results FILE: append one line per major, "MAJOR PASSED FAILED SKIPPED
# SECONDS NOTE...", for scripts/test.sh's summary.  Exits 1 if a test failed
# (or a build had warnings), else 0.
#
# --failures FILE: append each major's list of what failed (its test.sh's
# closing "what failed" lines, or the last lines of a suite that did not
# finish), for scripts/test.sh to print at the very end.  Without it this
# script prints the list itself, after its summary.
#
# Sourced (bench/run.sh --pg does), it only defines its functions and runs
# nothing: mx_init, then mx_enter MAJOR, which locks, makes or refreshes and
# mounts MAJOR's root with a copy of this tree in its /build, and mx_leave.
set -euo pipefail

# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

MATRIX_CACHE=${IDEM_MATRIX_CACHE:-/var/cache/idempotency-matrix}
MATRIX_MAX_AGE=${IDEM_MATRIX_MAX_AGE:-86400}	# seconds
MATRIX_TIMEOUT=${IDEM_MATRIX_TIMEOUT:-2400}	# one major's suite, seconds

# major -> "suite debootstrap-script check-valid-until"
declare -A MATRIX_SUITE=(
	[17]="trixie trixie yes"
	[18]="forky sid no"
)
# shellcheck disable=SC2034  # read by mx_main through a nameref
MATRIX_MAJORS=(17 18)

# --results FILE of the command line (mx_result).
results_file=
failures_file=

# Mount points made by this script, in the order they were made.
MX_MOUNTS=()
# The root in use, whose processes are ended before its mounts go.
MX_ROOT=
# The descriptor of the lock on the root in use (mx_enter, mx_leave).
MX_LOCK_FD=

# mx_mounts_under DIR: the mount points at or below DIR, deepest first.
mx_mounts_under() {
	local dir
	dir=$(realpath -m "$1")
	awk -v d="$dir" '$5 == d || index($5, d "/") == 1 { print $5 }' /proc/self/mountinfo |
		sort -r
}

# mx_unmount_all DIR: unmount everything at or below DIR (lazily if busy).
# Fails if something is still mounted there afterwards.
mx_unmount_all() {
	local m
	for m in $(mx_mounts_under "$1"); do
		umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
	done
	[[ -z $(mx_mounts_under "$1") ]]
}

# mx_kill_root_processes ROOT: end the processes this script started in ROOT
# (a server left behind by a suite that was cut short), found by their root
# directory.
mx_kill_root_processes() {
	local root p pids=()
	root=$(realpath -m "$1")
	for p in /proc/[0-9]*; do
		if [[ $(readlink "$p/root" 2>/dev/null) == "$root" ]]; then
			pids+=("${p#/proc/}")
		fi
	done
	((${#pids[@]} > 0)) || return 0
	log "ending ${#pids[@]} process(es) left in $root: ${pids[*]}"
	kill -TERM "${pids[@]}" 2>/dev/null || true
	sleep 2
	kill -KILL "${pids[@]}" 2>/dev/null || true
}

# mx_remove_root DIR: rm -rf a root, only once nothing is mounted below it.
mx_remove_root() {
	local dir=$1
	[[ -e $dir ]] || return 0
	if ! mx_unmount_all "$dir"; then
		log "not removing $dir: still mounted: $(mx_mounts_under "$dir" | tr '\n' ' ')"
		return 1
	fi
	rm -rf --one-file-system "$dir"
}

mx_cleanup() {
	local i
	if [[ -n $MX_ROOT ]]; then
		mx_kill_root_processes "$MX_ROOT"
	fi
	for ((i = ${#MX_MOUNTS[@]} - 1; i >= 0; i--)); do
		umount "${MX_MOUNTS[i]}" 2>/dev/null || umount -l "${MX_MOUNTS[i]}" 2>/dev/null || true
	done
	MX_MOUNTS=()
	MX_ROOT=
}

# shellcheck disable=SC2317  # run by the trap
_mx_on_exit() {
	local status=$?
	trap - EXIT
	trap '' INT TERM HUP
	mx_cleanup
	if [[ -n ${MX_TMP:-} ]]; then
		rm -rf "$MX_TMP"
	fi
	exit "$status"
}

# mx_init: this run's temporary folder ($MX_TMP) and the traps that unmount
# and clean up on exit, whatever happens.
mx_init() {
	MX_TMP=$(mktemp -d "${TMPDIR:-/tmp}/idempotency-matrix.XXXXXX")
	trap _mx_on_exit EXIT
	trap 'exit 130' INT
	trap 'exit 143' TERM
	trap 'exit 129' HUP
}

# mx_mount ROOT: what a server and apt need inside ROOT: /proc, device nodes
# (debootstrap makes them; where it could not, a tmpfs /dev with the few
# nodes bound from the host) and a /dev/shm of its own.
mx_mount() {
	local root=$1 d
	MX_ROOT=$root
	mount -t proc proc "$root/proc"
	MX_MOUNTS+=("$root/proc")
	if [[ ! -c $root/dev/null || ! -c $root/dev/urandom ]]; then
		mount -t tmpfs -o mode=755 nodev "$root/dev"
		MX_MOUNTS+=("$root/dev")
		for d in null zero full random urandom tty; do
			[[ -c /dev/$d ]] || continue
			touch "$root/dev/$d"
			mount --bind "/dev/$d" "$root/dev/$d"
			MX_MOUNTS+=("$root/dev/$d")
		done
		ln -s /proc/self/fd "$root/dev/fd"
	fi
	mkdir -p "$root/dev/shm"
	mount -t tmpfs -o mode=1777,nosuid,nodev shm "$root/dev/shm"
	MX_MOUNTS+=("$root/dev/shm")
}

# mx_in_root ROOT COMMAND...: run COMMAND in ROOT with a clean environment.
mx_in_root() {
	local root=$1
	shift
	chroot "$root" /usr/bin/env -i \
		PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
		HOME=/root LANG=C.UTF-8 TERM="${TERM:-dumb}" DEBIAN_FRONTEND=noninteractive \
		CI="${CI:-}" "$@"
}

# mx_mirror: the Debian mirror that serves the host's own suite, as apt
# knows it (whether it comes from sources.list or a .sources file).
mx_mirror() {
	local codename uri
	if [[ -n ${IDEM_MATRIX_MIRROR:-} ]]; then
		echo "${IDEM_MATRIX_MIRROR%/}"
		return 0
	fi
	# shellcheck disable=SC1091
	codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
	[[ -n $codename ]] || return 1
	# shellcheck disable=SC2016  # apt's own $(FIELD) syntax
	uri=$(apt-get indextargets --format '$(REPO_URI) $(RELEASE) $(IDENTIFIER)' 2>/dev/null |
		awk -v c="$codename" '$2 == c && $3 == "Packages" { print $1; exit }')
	[[ -n $uri ]] || return 1
	echo "${uri%/}"
}

# mx_recipe MAJOR: what a root of MAJOR is made of; a root made from another
# recipe is rebuilt.
mx_recipe() {
	local major=$1
	echo "suite=${MATRIX_SUITE[$major]}"
	# shellcheck disable=SC2016
	IDEM_PG_MAJOR=$major bash -c 'source "$1/scripts/common.sh" && echo "packages=${IDEM_PACKAGES[*]}"' _ "$REPO_ROOT"
}

# mx_build_root MAJOR DIR: make a root for MAJOR in DIR (which must not
# exist).  Prints what it does into the log on stdout; returns non-zero on
# any failure, leaving DIR for the caller to remove.
mx_build_root() {
	local major=$1 dir=$2 suite script check mirror packages
	read -r suite script check <<<"${MATRIX_SUITE[$major]}"
	mirror=$(mx_mirror) || {
		echo "no Debian mirror found in the host's apt sources"
		return 1
	}
	# shellcheck disable=SC2016
	packages=$(IDEM_PG_MAJOR=$major bash -c 'source "$1/scripts/common.sh" && echo "${IDEM_PACKAGES[*]}"' _ "$REPO_ROOT")

	echo "debootstrap $suite from $mirror (script $script)"
	debootstrap --variant=minbase "$suite" "$dir" "$mirror" \
		"/usr/share/debootstrap/scripts/$script" || return 1
	# debootstrap unmounts what it mounted, but make sure.
	mx_unmount_all "$dir" || return 1

	echo "deb $mirror $suite main" >"$dir/etc/apt/sources.list"
	if [[ $check == no ]]; then
		# This suite's Release file may be past its Valid-Until on the mirror.
		echo 'Acquire::Check-Valid-Until "false";' >"$dir/etc/apt/apt.conf.d/99idempotency-matrix"
	fi
	# No service starts in the root, and no cluster is made by the packages.
	printf '#!/bin/sh\nexit 101\n' >"$dir/usr/sbin/policy-rc.d"
	chmod 755 "$dir/usr/sbin/policy-rc.d"
	mkdir -p "$dir/etc/postgresql-common"
	echo 'create_main_cluster = false' >"$dir/etc/postgresql-common/createcluster.conf"

	mx_mount "$dir" || return 1
	echo "apt-get install $packages"
	# shellcheck disable=SC2086
	if ! mx_in_root "$dir" apt-get update -q ||
		! mx_in_root "$dir" apt-get install -y -q --no-install-recommends \
			-o Dpkg::Options::=--force-confold $packages ||
		! mx_in_root "$dir" apt-get clean; then
		mx_cleanup
		return 1
	fi
	mx_cleanup
	[[ -x $dir/usr/lib/postgresql/$major/bin/pg_config ]] || {
		echo "no pg_config $major in the root after apt"
		return 1
	}
	mx_recipe "$major" >"$dir/.idempotency-matrix"
}

# mx_make_root MAJOR NAME KIND BUILD FRESH OUT: make sure
# $MATRIX_CACHE/NAME is a root that FRESH accepts and write its folder to
# OUT; the root of the matrix (mx_root) and the clean root of the packages
# (packages.sh, pkg_enter), under the caller's lock.  KIND names it in the
# log ("root", "clean root").  FRESH MAJOR ROOT: true if the existing ROOT
# may be used as it is, else it prints why not (the log's "... is older
# than a day or of another recipe").  BUILD MAJOR DIR makes a new one in
# DIR, which must not exist (its log on stdout), into NAME.new, swapped in
# only once complete; where that fails, the old root, if any, is used.
# Returns 1, with the reason in $MX_TMP/reason, if there is none to use.
mx_make_root() {
	local major=$1 kind=$3 build=$4 fresh=$5 out=$6 root new old buildlog age stale reason=
	root=$MATRIX_CACHE/$2
	new=$root.new
	old=$root.old
	buildlog=$MATRIX_CACHE/$2-build.log

	# Left-overs of an earlier run that was cut short.
	if ! mx_remove_root "$new" || ! mx_remove_root "$old"; then
		echo "a left-over $kind is still mounted" >"$MX_TMP/reason"
		return 1
	fi

	if [[ -f $root/.idempotency-matrix ]]; then
		age=$(($(date +%s) - $(stat -c %Y "$root/.idempotency-matrix")))
		if stale=$("$fresh" "$major" "$root"); then
			log "PostgreSQL $major: $kind $root (built $((age / 60)) min ago)"
			echo "$root" >"$out"
			return 0
		fi
		log "PostgreSQL $major: $kind $root $stale: rebuilding it (log: $buildlog)"
	else
		log "PostgreSQL $major: building a $kind in $root (log: $buildlog)"
	fi

	if ! command -v debootstrap >/dev/null 2>&1; then
		log "installing debootstrap"
		{ DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap ||
			{ apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap; }; } \
			>"$buildlog" 2>&1 || reason="debootstrap could not be installed: $(tail -n 2 "$buildlog" | tr '\n' ' ')"
	fi
	if [[ -z $reason ]]; then
		if "$build" "$major" "$new" >"$buildlog" 2>&1; then
			if [[ -e $root ]]; then
				mv "$root" "$old"
			fi
			mv "$new" "$root"
			mx_remove_root "$old" || true
			log "PostgreSQL $major: $kind ready"
			echo "$root" >"$out"
			return 0
		fi
		reason="building the $kind failed: $(tail -n 3 "$buildlog" | tr '\n' ' ')(whole log: $buildlog)"
		mx_remove_root "$new" || true
	fi

	if [[ -f $root/.idempotency-matrix ]]; then
		log "PostgreSQL $major: $reason; using the old $kind"
		echo "$root" >"$out"
		return 0
	fi
	echo "$reason" >"$MX_TMP/reason"
	return 1
}

# mx_fresh MAJOR ROOT: a matrix root is used for a day
# (IDEM_MATRIX_MAX_AGE), while of this recipe (mx_make_root's FRESH).
mx_fresh() {
	local major=$1 root=$2 age
	age=$(($(date +%s) - $(stat -c %Y "$root/.idempotency-matrix")))
	if ((age < MATRIX_MAX_AGE)) && [[ $(mx_recipe "$major") == "$(cat "$root/.idempotency-matrix")" ]]; then
		return 0
	fi
	echo "is older than a day or of another recipe"
	return 1
}

# mx_root MAJOR: make sure a fresh enough root for MAJOR exists and write
# its folder to $MX_TMP/root.  Returns 1, with the reason in $MX_TMP/reason,
# if there is none to use.
mx_root() {
	mx_make_root "$1" "pg$1" root mx_build_root mx_fresh "$MX_TMP/root"
}

# mx_count_tests: how many tests a major that cannot run skips: one per
# regression, isolation and TAP file.
mx_count_tests() {
	local n=0 f
	for f in "$REPO_ROOT"/sql/*.sql "$REPO_ROOT"/specs/*.spec "$REPO_ROOT"/t/*.pl; do
		[[ -e $f ]] && n=$((n + 1))
	done
	echo "$n"
}

# mx_result MAJOR PASSED FAILED SKIPPED SECONDS NOTE
mx_result() {
	local major=$1 passed=$2 failed=$3 skipped=$4 secs=$5 note=$6
	printf 'PostgreSQL %s: %s passed, %s failed, %s skipped in %ss%s\n' \
		"$major" "$passed" "$failed" "$skipped" "$secs" "${note:+ ($note)}" >>"$MX_SUMMARY"
	if [[ -n $results_file ]]; then
		echo "$major $passed $failed $skipped $secs $note" >>"$results_file"
	fi
}

# mx_enter MAJOR: take MAJOR's root for this run: lock it (one run at a time
# builds or uses a root), make sure it is there and fresh (mx_root), put a
# copy of this tree without build products in its /build (and the 1.0 and
# 1.1 sources in /build/.v10 and /build/.v11), and mount what a server needs (mx_mount).  The
# root's folder is then in $MX_TMP/root.  Returns 1, with the reason in
# $MX_TMP/reason and the lock released, if there is no root to use.
# mx_leave gives the root back.
mx_enter() {
	local major=$1 root v10 v11
	mkdir -p "$MATRIX_CACHE"
	exec {MX_LOCK_FD}>"$MATRIX_CACHE/pg$major.lock"
	flock -w 3600 "$MX_LOCK_FD" || die "could not lock $MATRIX_CACHE/pg$major.lock"
	if ! mx_root "$major"; then
		mx_leave
		return 1
	fi
	root=$(cat "$MX_TMP/root")

	# A copy of the tree, without build products, owned by root in the root
	# (scripts/test.sh copies what the postgres user must own).
	rm -rf --one-file-system "$root/build"
	mkdir "$root/build"
	tar -C "$REPO_ROOT" --exclude=./.git --exclude='*.o' --exclude='*.so' \
		--exclude='*.bc' --exclude=./results --exclude=./output_iso \
		--exclude=./tmp_check --exclude=./tmp_check_iso --exclude=./log \
		--exclude=./bench/results -cf - . | tar -C "$root/build" -xf -
	# and the 1.0 sources, for t/012_upgrade.pl's session on the 1.0 library
	# (the copy has no git history)
	if v10=$(v10_revision); then
		mkdir "$root/build/.v10"
		git -C "$REPO_ROOT" archive "$v10" | tar -C "$root/build/.v10" -xf - ||
			rm -rf "$root/build/.v10"
	fi
	# and the 1.1 sources, for t/024_upgrade_1_2.pl's
	if v11=$(v11_revision); then
		mkdir "$root/build/.v11"
		git -C "$REPO_ROOT" archive "$v11" | tar -C "$root/build/.v11" -xf - ||
			rm -rf "$root/build/.v11"
	fi

	mx_mount "$root"
}

# mx_leave: end what still runs in the root in use, unmount what was
# mounted, release the root's lock.
mx_leave() {
	mx_cleanup
	if [[ -n $MX_LOCK_FD ]]; then
		exec {MX_LOCK_FD}>&-
		MX_LOCK_FD=
	fi
}

# mx_run_major MAJOR: build and test in MAJOR's root; records the result.
mx_run_major() {
	local major=$1 t0 root reason rc=0 out passed failed skipped warnings note=''
	t0=$(date +%s)
	log "======== PostgreSQL $major ========"
	if ! mx_enter "$major"; then
		reason=$(cat "$MX_TMP/reason")
		log "PostgreSQL $major: SKIPPED: $reason"
		mx_result "$major" 0 0 "$(mx_count_tests)" $(($(date +%s) - t0)) "skipped: $reason"
		return 0
	fi
	root=$(cat "$MX_TMP/root")

	out=$MATRIX_CACHE/pg$major-test.log
	log "PostgreSQL $major: scripts/test.sh in $root (output prefixed [pg$major], kept in $out)"
	timeout -k 60 "$MATRIX_TIMEOUT" chroot "$root" /usr/bin/env -i \
		PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
		HOME=/root LANG=C.UTF-8 TERM="${TERM:-dumb}" CI="${CI:-}" \
		IDEM_PG_MAJOR="$major" IDEM_MATRIX=0 IDEM_V10_SRC=/build/.v10 IDEM_V11_SRC=/build/.v11 \
		bash /build/scripts/test.sh 2>&1 </dev/null |
		tee "$out" | sed -u "s/^/[pg$major] /" || rc=$?
	mx_leave

	# The suite's own closing line: "tests: N passed, N failed, N skipped".
	passed=0 failed=0 skipped=0
	if read -r passed failed skipped < <(sed -nE \
		's/^tests: ([0-9]+) passed, ([0-9]+) failed, ([0-9]+) skipped$/\1 \2 \3/p' "$out" | tail -n 1) &&
		[[ -n $passed ]]; then
		:
	else
		passed=0 failed=1 skipped=0
		note="the suite did not finish (exit $rc)"
	fi
	if ((rc != 0 && failed == 0)); then
		failed=1
		note="the suite exited $rc"
	fi
	# what failed, from the suite's own closing list (already prefixed), or
	# the last lines of a suite that never got to it
	if grep -qxF "$WHAT_FAILED" "$out"; then
		sed -n "/^$WHAT_FAILED\$/,/^======== by PostgreSQL major ========\$/p" "$out" |
			sed -e '1d' -e '$d' -e '/^$/d' >>"$MX_FAILURES"
	elif [[ -n $note ]]; then
		{
			echo "[pg$major] $note; its last lines:"
			tail -n 10 "$out" | sed "s/^/[pg$major] /"
		} >>"$MX_FAILURES"
	fi
	warnings=$(sed -nE 's/^==> compiler warnings: ([0-9]+)$/\1/p' "$out" | head -n 1)
	if [[ -n $warnings ]] && ((warnings > 0)); then
		failed=$((failed + 1))
		note="${note:+$note; }$warnings compiler warning(s)"
		grep 'warning:' "$out" | sed "s/^/[pg$major] /" || true
	fi
	mx_result "$major" "$passed" "$failed" "$skipped" $(($(date +%s) - t0)) "$note"
	((failed == 0))
}

# mx_main NAME RUN_MAJOR MAJORS SUITES NEEDS PREFIX [ARG...]: what
# scripts/NAME.sh does when run, not sourced (this script and packages.sh):
# read its options (--results FILE, --failures FILE, --help), take ARG...
# as the majors (default: the array named MAJORS, each of which must have an
# entry in the associative array named SUITES), run RUN_MAJOR for each, print
# the "NAME summary" (PREFIX before each of its "PostgreSQL N:" lines), what
# failed and the totals, and exit 1 if a major failed.  NEEDS says what root
# is needed for.
mx_main() {
	local name=$1 run_major=$2 needs=$5 prefix=$6 major status=0
	local -n mx_majors=$3 mx_suites=$4
	shift 6
	while (($# > 0)); do
		case $1 in
			--results)
				results_file=$2
				shift 2
				;;
			--failures)
				failures_file=$2
				shift 2
				;;
			-h | --help)
				sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
				exit 0
				;;
			*)
				break
				;;
		esac
	done
	if (($# > 0)); then
		mx_majors=("$@")
	fi
	((EUID == 0)) || die "scripts/$name.sh needs root ($needs)"
	mx_init
	MX_SUMMARY=$MX_TMP/summary
	MX_FAILURES=${failures_file:-$MX_TMP/failures}
	: >"$MX_SUMMARY"
	for major in "${mx_majors[@]}"; do
		[[ -n ${mx_suites[$major]:-} ]] || die "no Debian suite known for PostgreSQL $major"
		"$run_major" "$major" || status=1
	done

	echo
	echo "======== $name summary ========"
	sed "s/^PostgreSQL \([0-9]*\):/${prefix}PostgreSQL \1:/" "$MX_SUMMARY"
	if [[ -z $failures_file && -s $MX_FAILURES ]]; then
		echo
		echo "$WHAT_FAILED"
		cat "$MX_FAILURES"
	fi
	if [[ -z $results_file ]]; then
		awk '{ p += $3; f += $5; s += $7 } END { printf "tests: %d passed, %d failed, %d skipped\n", p, f, s }' \
			"$MX_SUMMARY"
	fi
	exit "$status"
}

# Sourced: the functions only.
if [[ ${BASH_SOURCE[0]} != "$0" ]]; then
	return 0
fi

mx_main matrix mx_run_major MATRIX_MAJORS MATRIX_SUITE "debootstrap, chroot, mount" "" "$@"
