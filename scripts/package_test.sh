#!/usr/bin/env bash
# scripts/package_test.sh -- install built packages in a clean root, run the
# regression and isolation suites against them, purge, check nothing is left
#
#   bash scripts/package_test.sh ROOT DEBDIR      (as root)
#
# ROOT is a Debian root holding postgresql-N, postgresql-N-cron,
# postgresql-N-plproxy and make, that has never seen a build tree.  It is
# used through an overlay (ROOT stays as it was): the .deb files of DEBDIR
# and the test sources (Makefile, sql/, expected/, specs/, debian/tests/)
# are copied in, apt-get installs the packages, debian/tests/installcheck
# runs, apt-get purge removes them, and every file dpkg -L listed must be
# gone.  Prints "packages (install, suites, purge): N of M tests passed."
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
root=$1 debs=$2
tmp=$(mktemp -d "${TMPDIR:-/tmp}/idempotency-pkgtest.XXXXXX")
mnt=$tmp/merged
mkdir -p "$tmp/upper" "$tmp/work" "$mnt"
cleanup() {
	for m in "$mnt/dev/shm" "$mnt/proc" "$mnt"; do
		umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
	done
	rm -rf --one-file-system "$tmp"
}
trap cleanup EXIT
mount -t overlay overlay -o "lowerdir=$root,upperdir=$tmp/upper,workdir=$tmp/work" "$mnt"
mount -t proc proc "$mnt/proc"
mkdir -p "$mnt/dev/shm"
mount -t tmpfs -o mode=1777 shm "$mnt/dev/shm"
in_root() {
	chroot "$mnt" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
		DEBIAN_FRONTEND=noninteractive "$@"
}
mkdir -p "$mnt/pkg" "$mnt/src"
cp "$debs"/*.deb "$mnt/pkg/"
rm -f "$mnt"/pkg/*-dbgsym_*.deb
tar -C "$REPO_ROOT" -cf - Makefile sql expected specs debian/tests | tar -C "$mnt/src" -xf -

passed=0 total=4
pkgs=$(cd "$mnt/pkg" && for f in *.deb; do dpkg-deb -f "$f" Package; done)
if in_root sh -c 'apt-get install -y -q --no-install-recommends ./pkg/*.deb' </dev/null; then
	passed=$((passed + 1))
fi
# shellcheck disable=SC2086
in_root dpkg -L $pkgs | sort -u >"$tmp/files"
if in_root sh -c 'cd /src && debian/tests/installcheck' </dev/null; then
	passed=$((passed + 1))
fi
# shellcheck disable=SC2086
if in_root apt-get purge -y -q $pkgs </dev/null; then
	passed=$((passed + 1))
fi
left=0
while read -r f; do
	[[ $f == / || -d $mnt$f ]] && continue
	if [[ -e $mnt$f ]]; then
		echo "left behind after purge: $f"
		left=1
	fi
done <"$tmp/files"
((left == 0)) && passed=$((passed + 1))
echo "packages (install, suites, purge): $passed of $total tests passed."
((passed == total))
