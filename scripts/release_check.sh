#!/usr/bin/env bash
# scripts/release_check.sh -- the release checks scripts/test.sh runs
#
#   1. META.json's versions (SemVer, x.y.0) match idempotency.control's and
#      proxy/idempotency_proxy.control's default_version
#   2. every released script listed in released.sha256 is there, unchanged,
#      and shipped (in its Makefile's DATA)
#   3. CREATE EXTENSION reaches the default_version of each control file
#      from the shipped scripts: a full install script (idempotency--1.1.sql)
#      and the updates after it (idempotency--1.1--1.2.sql), as contrib does;
#      and every shipped full install script is a released one, so that no
#      SQL object is written twice (once in a hand-kept full script of an
#      unreleased version, once in the update to it)
#   4. debian/changelog's newest entry packages that version: its upstream
#      version is META.json's (1.2.0-1), or, while no script that ends at
#      X.Y (idempotency--W--X.Y.sql) is in released.sha256, may carry a ~dev
#      suffix (1.2.0~dev-1, which sorts before the release's 1.2.0-1)
#
# Prints "release checks: N of M tests passed." and exits non-zero on a
# failure.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1

passed=0 total=0
check() {
	local what=$1
	shift
	total=$((total + 1))
	if "$@"; then
		passed=$((passed + 1))
	else
		echo "release check failed: $what"
	fi
}
control_version() { sed -nE "s/^default_version *= *'([^']+)'.*/\1/p" "$1"; }
meta_version() { python3 -c 'import json,sys; m=json.load(open("META.json")); print(m["provides"][sys.argv[1]]["version"] if sys.argv[1] else m["version"])' "$1"; }
same() { [[ $1 == "$2" ]] || { echo "  $1 != $2"; return 1; }; }

ext=$(control_version idempotency.control)
proxy=$(control_version proxy/idempotency_proxy.control)
check "META.json version = idempotency.control's" same "$(meta_version '')" "$ext.0"
check "META.json provides.idempotency = idempotency.control's" same "$(meta_version idempotency)" "$ext.0"
check "META.json provides.idempotency_proxy = proxy's control" same "$(meta_version idempotency_proxy)" "$proxy.0"
# A released script is never edited (STYLE.md): released.sha256 lists them.
# Git tags do not reach main, so this list is the record of what was released.
released=$(sed -nE 's/^[0-9a-f]{64}  (.+)$/\1/p' released.sha256)
all_there() {
	local f ok=0
	for f in $released; do
		[[ -f $f ]] || { echo "  released script $f is missing"; ok=1; }
	done
	return $ok
}
# data_of MAKEFILE: the words of its DATA line
data_of() { sed -nE 's/^DATA *= *//p' "$1"; }
shipped() {
	local f dir base ok=0
	for f in "$@"; do
		dir=$(dirname "$f") base=$(basename "$f")
		[[ " $(data_of "$dir/Makefile") " == *" $base "* ]] ||
			{ echo "  $f is not in $dir/Makefile's DATA"; ok=1; }
	done
	return $ok
}
check "released scripts present (released.sha256)" all_there
check "released scripts unchanged (released.sha256)" sha256sum --quiet --strict -c released.sha256
# shellcheck disable=SC2086
check "released scripts shipped (Makefile DATA)" shipped $released
# reachable DIR EXTNAME VERSION: DIR's Makefile ships a full install script
# of some version and updates that lead from it to VERSION (what CREATE
# EXTENSION looks for when there is no full script of VERSION)
reachable() {
	local dir=$1 name=$2 want=$3 f v from to changed=1 reached=' '
	for f in $(data_of "$dir/Makefile"); do
		v=${f#"$name"--}
		v=${v%.sql}
		[[ $f == "$name--"*.sql && $v != *--* ]] && reached+="$v "
	done
	while ((changed)); do
		changed=0
		for f in $(data_of "$dir/Makefile"); do
			v=${f#"$name"--}
			v=${v%.sql}
			[[ $f == "$name--"*.sql && $v == *--* ]] || continue
			from=${v%%--*} to=${v#*--}
			if [[ $reached == *" $from "* && $reached != *" $to "* ]]; then
				reached+="$to "
				changed=1
			fi
		done
	done
	[[ $reached == *" $want "* ]] ||
		{ echo "  no shipped script of $dir/Makefile installs $name $want (reached:$reached)"; return 1; }
}
# full_scripts_released DIR EXTNAME: every full install script DIR ships is
# in released.sha256
full_scripts_released() {
	local dir=$1 name=$2 f path ok=0
	for f in $(data_of "$dir/Makefile"); do
		[[ $f == "$name--"*.sql && $f != "$name--"*--*.sql ]] || continue
		path=$f
		[[ $dir == . ]] || path=$dir/$f
		grep -qxF "$path" <<<"$released" ||
			{ echo "  $path is a full install script of an unreleased version: put its changes in the update script instead"; ok=1; }
	done
	return $ok
}
check "CREATE EXTENSION idempotency reaches $ext" reachable . idempotency "$ext"
check "CREATE EXTENSION idempotency_proxy reaches $proxy" reachable proxy idempotency_proxy "$proxy"
check "full install scripts of idempotency are released ones" full_scripts_released . idempotency
check "full install scripts of idempotency_proxy are released ones" full_scripts_released proxy idempotency_proxy

# debian_upstream: the upstream part of the version of debian/changelog's
# newest entry (no epoch, no Debian revision)
debian_upstream() {
	sed -nE '1s/^idempotency \(([^)]+)\).*/\1/p' debian/changelog |
		sed -E 's/^[0-9]+://; s/-[^-]+$//'
}
# debian_matches VERSION: debian/changelog packages VERSION (META.json's),
# with ~dev allowed until a script that ends at that version is released
debian_matches() {
	local want=$1 got
	got=$(debian_upstream)
	[[ $got == "$want" ]] && return 0
	if [[ $got =~ ^${want//./\.}~dev[0-9]*$ ]]; then
		grep -qE "^idempotency--([0-9.]+--)?${ext//./\.}\.sql$" <<<"$released" || return 0
		echo "  debian/changelog says $got, but version $ext is released (released.sha256): say $want"
		return 1
	fi
	echo "  debian/changelog says ${got:-nothing}, META.json $want"
	return 1
}
check "debian/changelog's upstream version = META.json's" debian_matches "$(meta_version '')"

# The PGXN zip (scripts/dist.sh, from git archive of HEAD) holds what a
# build and install need: the Makefiles, the control files, every shipped
# script, the C sources and META.json with the files it names.  Only in a
# git checkout (a matrix root has a copy of the tree without history).
zip_complete() {
	local tmp zip ok=0 f want
	tmp=$(mktemp -d)
	zip=$(IDEM_DIST_DIR=$tmp bash scripts/dist.sh HEAD) || { rm -rf "$tmp"; return 1; }
	want="Makefile proxy/Makefile META.json idempotency.control proxy/idempotency_proxy.control"
	want+=" $(data_of Makefile) $(for f in $(data_of proxy/Makefile); do echo "proxy/$f"; done)"
	want+=" $(git ls-files '*.c' '*.h' | tr '\n' ' ')"
	want+=" $(python3 -c 'import json; print(" ".join(p["file"] for p in json.load(open("META.json"))["provides"].values()))')"
	for f in $want; do
		python3 -c 'import sys, zipfile; sys.exit(sys.argv[2] not in zipfile.ZipFile(sys.argv[1]).namelist())' \
			"$zip" "$(basename "$zip" .zip)/$f" || { echo "  $(basename "$zip") lacks $f"; ok=1; }
	done
	rm -rf "$tmp"
	return $ok
}
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
	check "the PGXN zip of HEAD holds the sources and scripts" zip_complete
fi

echo "release checks: $passed of $total tests passed."
((passed == total))
