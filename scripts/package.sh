#!/usr/bin/env bash
# scripts/package.sh -- build the Debian packages for a user
#
#   bash scripts/package.sh [MAJOR...]      (Debian, as root for apt)
#
# Builds postgresql-MAJOR-idempotency and postgresql-MAJOR-idempotency-proxy
# with dpkg-buildpackage -b from a copy of this tree (the files git knows,
# so no build debris lands here), for each MAJOR (default: every major
# debian/pgversions and this machine's postgresql-common support), runs
# lintian, and prints the folder the .deb files are in
# ($IDEM_PACKAGE_OUT, default a new folder under /tmp).
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
log() { printf '==> %s\n' "$*"; }

need=(build-essential dpkg-dev debhelper fakeroot lintian postgresql-server-dev-all libssl-dev)
missing=()
for p in "${need[@]}"; do
	[[ $(dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null) == ii* ]] || missing+=("$p")
done
if ((${#missing[@]} > 0)); then
	log "installing ${missing[*]}"
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

out=${IDEM_PACKAGE_OUT:-$(mktemp -d "${TMPDIR:-/tmp}/idempotency-packages.XXXXXX")}
mkdir -p "$out"
work=$(mktemp -d "${TMPDIR:-/tmp}/idempotency-build.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir "$work/src"
if git -C "$REPO_ROOT" rev-parse --git-dir >/dev/null 2>&1; then
	(cd "$REPO_ROOT" && { git ls-files; git ls-files -o --exclude-standard; } | tar -cf - -T -) |
		tar -C "$work/src" -xf -
else
	tar -C "$REPO_ROOT" --exclude=./.git --exclude='*.o' --exclude='*.so' --exclude='*.bc' \
		-cf - . | tar -C "$work/src" -xf -
fi

cd "$work/src"
if (($# > 0)); then
	export PG_SUPPORTED_VERSIONS="$*"
fi
pg_buildext updatecontrol
log "dpkg-buildpackage -us -uc -b for PostgreSQL $(pg_buildext supported-versions | tr '\n' ' ')"
dpkg-buildpackage -us -uc -b
cd "$work"
log "lintian"
lintian --tag-display-limit 0 ./*.changes || { log "lintian found errors"; exit 1; }
mv ./*.deb "$out/"
ls -l "$out"
echo "packages in: $out"
