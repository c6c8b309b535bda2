#!/usr/bin/env bash
# integrations/node/build.sh DIR -- build pg-idempotency the npm way and
# install it into a fresh app, as a user would:
#   DIR/pkg   a copy of the package's sources: npm ci, then npm pack (its
#             prepack runs tsc): DIR/pkg/pg-idempotency-VERSION.tgz
#   DIR/app   the sample apps (conformance/*.js, *.ts) with the frameworks from
#             conformance/package-lock.json (npm ci) and the package
#             installed from the .tgz, not from this tree
# Installs nodejs and npm (Debian's) when missing.  Prints the .tgz's path
# last.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
dir=${1:?usage: build.sh DIR}
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
	apt-get update -qq >&2
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >&2
fi
npm=(npm --no-audit --no-fund --loglevel=error)
rm -rf "$dir/pkg" "$dir/app"
mkdir -p "$dir/pkg" "$dir/app"
cp -r "$here/package.json" "$here/package-lock.json" "$here/tsconfig.json" "$here/README.md" "$here/src" "$dir/pkg/"
(cd "$dir/pkg" && "${npm[@]}" ci >&2)
tgz=$(cd "$dir/pkg" && "${npm[@]}" pack --silent | tail -n 1)
cp "$here/conformance/package.json" "$here/conformance/package-lock.json" "$here"/conformance/*.js "$here"/conformance/*.ts "$dir/app/"
(cd "$dir/app" && "${npm[@]}" ci >&2 && "${npm[@]}" install --no-save "$dir/pkg/$tgz" >&2)
echo "$dir/pkg/$tgz"
