#!/usr/bin/env bash
# scripts/package_test.sh -- install built packages in a clean root, run the
# regression and isolation suites against them, purge, check nothing is left
#
#   bash scripts/package_test.sh ROOT DEBDIR      (as root)
#
# ROOT is a Debian root holding postgresql-N, postgresql-N-cron,
# postgresql-N-plproxy and make, that has never seen a build tree
# (scripts/package_roots.sh makes and caches one per major).  It is used
# through an overlay (ROOT stays as it was, and several runs may use it at
# once): the .deb files of DEBDIR (not the -dbgsym ones) and the test
# sources (Makefile, regress.conf, sql/, expected/, specs/, debian/tests/)
# are copied in, apt-get installs the packages, debian/tests/installcheck
# runs the suites (and CREATE EXTENSION idempotency_proxy where that package
# is among them), apt-get purge removes them, and every file dpkg -L listed
# must be gone.
#
# Counts one test each for the install, the files shipped (the library and
# every script of the Makefiles' DATA, with the control files), CREATE
# EXTENSION idempotency_proxy, the purge and "nothing left", and one per
# regression and isolation test
# (PostgreSQL's own summaries; a suite that printed none counts as one
# failed test).  Its closing line, which scripts/test.sh adds up:
#   packages (install, suites, purge): N of M tests passed.
# Exits non-zero if any failed.  IDEM_PKGTEST_LOG=FILE keeps the output of
# the suites there too.
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
(($# == 2)) || { echo "usage: $0 ROOT DEBDIR" >&2; exit 2; }
root=$1 debs=$2
[[ -x $root/usr/bin/apt-get ]] || { echo "error: $root is no Debian root" >&2; exit 2; }
compgen -G "$debs/*.deb" >/dev/null || { echo "error: no .deb in $debs" >&2; exit 2; }
tmp=$(mktemp -d "${TMPDIR:-/tmp}/idempotency-pkgtest.XXXXXX")
mnt=$tmp/merged
mkdir -p "$tmp/upper" "$tmp/work" "$mnt"
# end_root_processes: a server a cut-short suite left running in the overlay
end_root_processes() {
	local p pids=() r
	r=$(realpath -m "$mnt")
	for p in /proc/[0-9]*; do
		[[ $(readlink "$p/root" 2>/dev/null) == "$r" ]] && pids+=("${p#/proc/}")
	done
	((${#pids[@]} > 0)) || return 0
	kill -TERM "${pids[@]}" 2>/dev/null || true
	sleep 2
	kill -KILL "${pids[@]}" 2>/dev/null || true
}
cleanup() {
	end_root_processes
	for m in "$mnt/dev/pts" "$mnt/dev/shm" "$mnt/proc" "$mnt"; do
		umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
	done
	rm -rf --one-file-system "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
mount -t overlay overlay -o "lowerdir=$root,upperdir=$tmp/upper,workdir=$tmp/work" "$mnt"
mount -t proc proc "$mnt/proc"
mkdir -p "$mnt/dev/shm" "$mnt/dev/pts"
mount -t tmpfs -o mode=1777,nosuid,nodev shm "$mnt/dev/shm"
# a pty for dpkg's log (else "Can not write log (Is /dev/pts mounted?)")
mount -t devpts -o newinstance,ptmxmode=0666 devpts "$mnt/dev/pts" 2>/dev/null || true
in_root() {
	chroot "$mnt" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
		DEBIAN_FRONTEND=noninteractive "$@"
}
mkdir -p "$mnt/pkg" "$mnt/src"
cp "$debs"/*.deb "$mnt/pkg/"
rm -f "$mnt"/pkg/*-dbgsym_*.deb
tar -C "$REPO_ROOT" -cf - Makefile regress.conf sql expected specs debian/tests | tar -C "$mnt/src" -xf -

passed=0 total=0
# ok NAME CONDITION-STATUS: count one test
ok() {
	total=$((total + 1))
	if (($2 == 0)); then
		passed=$((passed + 1))
	else
		echo "package test failed: $1"
	fi
}
pkgs=$(cd "$mnt/pkg" && for f in *.deb; do dpkg-deb -f "$f" Package; done)
has_proxy=0
grep -q -- '-idempotency-proxy$' <<<"$pkgs" && has_proxy=1
rc=0
in_root sh -c 'apt-get install -y -q --no-install-recommends ./pkg/*.deb' </dev/null || rc=$?
ok "apt-get install" "$rc"
# shellcheck disable=SC2086
in_root dpkg -L $pkgs | sort -u >"$tmp/files" || true

# Every SQL script the Makefiles install (DATA) and each control file must
# be in the packages, for each major they were built for.
# make_data MAKEFILE: the words of its DATA line (continuation lines joined)
make_data() {
	sed -e ':a' -e '/\\$/N; s/\\\n//; ta' "$1" | sed -nE 's/^DATA[[:space:]]*=[[:space:]]*//p'
}
shipped=0
# shellcheck disable=SC2013,SC2207  # words, on purpose
for major in $(sed -nE 's:^/usr/lib/postgresql/([0-9]+)/lib/idempotency\.so$:\1:p' "$tmp/files"); do
	want=("idempotency.control" $(make_data "$REPO_ROOT/Makefile"))
	if ((has_proxy)); then
		want+=("idempotency_proxy.control" $(make_data "$REPO_ROOT/proxy/Makefile"))
	fi
	for f in "${want[@]}"; do
		if ! grep -qxF "/usr/share/postgresql/$major/extension/$f" "$tmp/files"; then
			echo "not in the packages: /usr/share/postgresql/$major/extension/$f"
			shipped=1
		fi
	done
done
grep -q '/lib/idempotency\.so$' "$tmp/files" || shipped=1
ok "the packages ship the library, every SQL script and control file" "$shipped"

out=$tmp/installcheck.out
rc=0
in_root sh -c 'cd /src && debian/tests/installcheck' </dev/null 2>&1 | tee "$out" || rc=$?
if [[ -n ${IDEM_PKGTEST_LOG:-} ]]; then
	cp "$out" "$IDEM_PKGTEST_LOG"
fi
# PostgreSQL's summaries, one per suite: " All N tests passed. " or
# " M of N tests failed. " (and "N of M tests failed, K of these failures
# ignored" counts as failed here).
suites=0
while read -r line; do
	suites=$((suites + 1))
	if [[ $line =~ All\ ([0-9]+)\ tests?\ passed ]]; then
		total=$((total + BASH_REMATCH[1]))
		passed=$((passed + BASH_REMATCH[1]))
	elif [[ $line =~ ([0-9]+)\ of\ ([0-9]+)\ tests?\ failed ]]; then
		total=$((total + BASH_REMATCH[2]))
		passed=$((passed + BASH_REMATCH[2] - BASH_REMATCH[1]))
		echo "package test failed: $line"
	fi
done < <(grep -E 'All [0-9]+ tests? passed|[0-9]+ of [0-9]+ tests? failed' "$out" || true)
# the regression and the isolation suite each print one summary
for ((s = suites; s < 2; s++)); do
	ok "a suite that printed no summary (installcheck exit $rc)" 1
done
if ((has_proxy)); then
	rc=0
	grep -qx 'idempotency_proxy: ok' "$out" || rc=1
	ok "CREATE EXTENSION idempotency_proxy" "$rc"
fi

rc=0
# shellcheck disable=SC2086
in_root apt-get purge -y -q $pkgs </dev/null || rc=$?
ok "apt-get purge" "$rc"
left=0
while read -r f; do
	[[ $f == / || -d $mnt$f ]] && continue
	if [[ -e $mnt$f || -L $mnt$f ]]; then
		echo "left behind after purge: $f"
		left=1
	fi
done <"$tmp/files"
ok "no file left after purge" "$left"
echo "packages (install, suites, purge): $passed of $total tests passed."
((passed == total))
