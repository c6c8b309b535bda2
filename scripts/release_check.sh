#!/usr/bin/env bash
# scripts/release_check.sh -- the release checks scripts/test.sh runs
#
#   1. META.json's versions (SemVer, x.y.0) match idempotency.control's and
#      proxy/idempotency_proxy.control's default_version
#   2. every released script listed in released.sha256 is unchanged
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
check "released scripts unchanged (released.sha256)" sha256sum --quiet --strict -c released.sha256

echo "release checks: $passed of $total tests passed."
((passed == total))
