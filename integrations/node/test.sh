#!/usr/bin/env bash
# integrations/node/test.sh -- the Node integration, tested the npm way.
#
# Against the cluster that PGHOST, PGPORT and PGUSER name (scripts/test.sh
# starts it; the extension installed there), as root:
#   1. build.sh: the package built from a copy of its sources (npm ci, npm
#      pack: tsc), and installed from its .tgz into a fresh app beside the
#      frameworks of conformance/package-lock.json; checks what the .tgz
#      ships and what the installed package depends on, and type-checks
#      against it a TypeScript consumer (conformance/types.ts) and each
#      ```ts block of README.md (the Shards example: not run, it needs a
#      sharded cluster; step 4 runs its calls);
#   2. README.md, every block as written, in order (the quick start, the
#      job, the replay cache's app), from a copy of this folder laid out as
#      in the repository (```sh blocks run, ```js FILE blocks written to
#      FILE, ```sql blocks run by psql in a fresh database, ```ts blocks
#      left to step 1), then checks what it answered and wrote;
#   3. conformance/wrapper.js: idempotent() driven directly (redelivery,
#      mismatch, a throw, release, ten concurrent deliveries, lease mode
#      resumed at a checkpoint, abort); conformance/cache.js: the replay
#      cache (no database call, same bytes, mismatch, expiry by the
#      database's clock, LRU, maxEntryBytes, forget) and logDuplicates;
#   4. conformance/shards.js: Shards against an idempotency_proxy cluster
#      on this server (make_shard_dbs idem_node: the router idem_node_router
#      and the shards idem_node_shard0..2, dropped afterwards), the steps of
#      the Go package's TestShards: keyHash is key_hash(), each key on its
#      owner only and none through the router, named prepared statements,
#      a growth half way (a stale layout refused and routed, a claim made
#      through the router completed by a stale Shards), then direct again
#      over the grown layout, one reading of a stale layout at a time;
#   5. examples/run_tests.sh for the sample apps express, fastify and
#      nestjs, over the app of step 1 (examples/http_test.py, 38 checks
#      each), then again with the replay cache on (IDEM_REPLAY_CACHE=1;
#      IDEM_NODE_CACHED_APPS="" skips those, "express+cache" runs one).
# Prints TAP-style lines, then "node integration: N of M tests passed."
# (each app's checks counted one by one); exits 1 if any failed.  Installs
# nodejs and npm (Debian's) when absent.  About 2 to 4 minutes, most of it
# npm's downloads; the sample apps' runs with the cache on add 30 to 50 s.
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=scripts/common.sh
source "$here/../../scripts/common.sh"
name="node integration"
[[ -n ${PGHOST:-} && -n ${PGPORT:-} ]] || die "PGHOST and PGPORT must name the test cluster"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/idempotency-node.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
n=0 passed=0
# ok COND WHAT [DETAIL FILE]
ok() {
	n=$((n + 1))
	if [[ $1 == 0 ]]; then
		passed=$((passed + 1))
		echo "ok $n - $2"
	else
		echo "not ok $n - $2"
		if [[ -n ${3:-} && -f $3 ]]; then
			tail -n 40 "$3" | sed 's/^/#   /'
		fi
	fi
}
finish() {
	echo "1..$n"
	echo "$name: $passed of $n tests passed."
	((passed == n)) || exit 1
	exit 0
}
t0=$SECONDS

# ---- 1. build, pack, install into a fresh app
log "building pg-idempotency and installing its .tgz into a fresh app"
tgz=$(bash "$here/build.sh" "$tmp/build" 2>"$tmp/build.log" | tail -n 1)
rc=$?
[[ $rc == 0 && -f $tgz ]]
ok $? "npm ci, npm pack, and npm install of the .tgz into a fresh app ($((SECONDS - t0)) s)" "$tmp/build.log"
if [[ ! -f ${tgz:-} ]]; then
	finish
fi
app=$tmp/build/app
files=$(tar -tzf "$tgz")
absent=
for f in package.json README.md dist/index.js dist/index.d.ts dist/core.d.ts dist/express.d.ts \
	dist/fastify.d.ts dist/nestjs.js dist/nestjs.d.ts dist/wrapper.d.ts; do
	grep -qx "package/$f" <<<"$files" || absent+=" $f"
done
surplus=$(grep -v -e '^package/dist/' -e '^package/package.json$' -e '^package/README.md$' <<<"$files" || true)
[[ -z $absent && -z $surplus ]]
ok $? "the .tgz ships dist/ with its .d.ts files, package.json and README.md, nothing else (absent:${absent:- none}; other: ${surplus:-none})"
deps=$(cd "$app" && node -e '
	const p = require("pg-idempotency/package.json");
	console.log(Object.keys(p.dependencies || {}).join(" ") + " | " + Object.keys(p.peerDependencies || {}).sort().join(" "));' 2>&1)
[[ $deps == "pg | @nestjs/common express fastify rxjs" ]]
ok $? "installed from the .tgz, it depends on pg only; the frameworks are peers ($deps)"
where=$(cd "$app" && node -e 'console.log(require.resolve("pg-idempotency"), require.resolve("pg-idempotency/nestjs"))' 2>&1)
[[ $where == "$app/node_modules/pg-idempotency/dist/index.js $app/node_modules/pg-idempotency/dist/nestjs.js" ]]
ok $? "the sample apps load the installed package ($where)"
(cd "$app" && node node_modules/typescript/bin/tsc --noEmit --strict --skipLibCheck --module node16 \
	--moduleResolution node16 --esModuleInterop --types node types.ts) >"$tmp/types.out" 2>&1
ok $? "a TypeScript consumer (conformance/types.ts) type-checks against the shipped .d.ts files, both entry points" "$tmp/types.out"
# README.md's ```ts blocks (not run in step 2), each a module of its own
nts=$(python3 - "$here/README.md" "$app" <<'EOF'
import re, sys
text = open(sys.argv[1]).read()
blocks = [b for info, b in re.findall(r"^```([^\n]*)\n(.*?)^```$", text, re.S | re.M) if info.split()[:1] == ["ts"]]
for i, body in enumerate(blocks, 1):
    open("%s/readme_%d.ts" % (sys.argv[2], i), "w").write(body)
print(len(blocks))
EOF
)
(cd "$app" && ((nts > 0)) && node node_modules/typescript/bin/tsc --noEmit --strict --skipLibCheck --module node16 \
	--moduleResolution node16 --esModuleInterop --types node readme_*.ts) >"$tmp/readme-ts.out" 2>&1
ok $? "README.md's ts blocks (${nts:-0}: the Shards example) type-check against the shipped .d.ts files" "$tmp/readme-ts.out"

# ---- 2. the README's quick start, as written
log "README.md's quick start"
db=idem_node_quickstart
psql=("$PG_BINDIR/psql" -X -q -v ON_ERROR_STOP=1)
"${psql[@]}" -d postgres -c "DROP DATABASE IF EXISTS $db" -c "CREATE DATABASE $db" >"$tmp/qs-db.log" 2>&1
ok $? "database $db for the quick start" "$tmp/qs-db.log"
# The repository's layout, with this folder's sources (not its
# node_modules, dist or .tgz files, if any).
mkdir -p "$tmp/repo/integrations/node"
(cd "$here" && tar --exclude=./node_modules --exclude=./dist --exclude='./*.tgz' -cf - .) |
	(cd "$tmp/repo/integrations/node" && tar -xf -)
port=$(free_port) cache_port=$(free_port)
python3 - "$here/README.md" "$tmp/quickstart.sh" <<'EOF'
import re, sys
text = open(sys.argv[1]).read()
out = ["set -euo pipefail",
       "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT",
       "wait_http() {  # a server started in the background answers on port $1",
       "  for _ in $(seq 1 300); do",
       "    curl -s -o /dev/null \"localhost:$1/\" && return 0",
       "    [[ -n $(jobs -rp) ]] || { echo 'the server died' >&2; return 1; }",
       "    sleep 0.1",
       "  done; return 1; }"]
blocks = re.findall(r"^```([^\n]*)\n(.*?)^```$", text, re.S | re.M)
for info, body in blocks:
    words = info.split()
    lang = words[0] if words else ""
    if lang == "sh":
        out.append(body)
        if body.rstrip().endswith("&"):
            # the port the block names: ${CACHE_PORT:-3001}, else $PORT
            m = re.search(r"\$\{(\w*PORT)\b", body)
            out.append("wait_http \"$%s\"" % (m.group(1) if m else "PORT"))
    elif lang == "js" and len(words) == 2:
        out.append("cat > %s <<'README_EOF'\n%sREADME_EOF" % (words[1], body))
    elif lang == "ts":
        pass  # not run: type-checked in step 1
    elif lang == "sql":
        out.append("\"$PSQL\" -X -q -v ON_ERROR_STOP=1 <<'README_EOF'\n%sREADME_EOF" % body)
    else:
        sys.exit("README.md: a ```%s block that the test cannot run" % info)
open(sys.argv[2], "w").write("\n".join(out) + "\n")
EOF
(cd "$tmp/repo" && PSQL=$PG_BINDIR/psql PGDATABASE=$db PORT=$port CACHE_PORT=$cache_port timeout 600 bash "$tmp/quickstart.sh") >"$tmp/qs.out" 2>&1
ok $? "README.md runs as written (install, SQL, Express app, curl, job, the replay cache's app)" "$tmp/qs.out"
# the output in order: the quick start's two answers, the job's two lines,
# the cache's three answers, {"forgotten":true}, the answer after it
mapfile -t ids < <(grep -E '^\{"(id|forgotten)":' "$tmp/qs.out")
mapfile -t replayed < <(grep -iE '^(HTTP/1.1 |Idempotent-Replayed: true)' "$tmp/qs.out" | tr -d '\r')
expect="HTTP/1.1 201 Created|HTTP/1.1 201 Created|Idempotent-Replayed: true|HTTP/1.1 201 Created|HTTP/1.1 201 Created|Idempotent-Replayed: true|HTTP/1.1 201 Created|Idempotent-Replayed: true|HTTP/1.1 201 Created"
got=$(IFS='|'; echo "${replayed[*]}")
[[ $got == "$expect" && ${#ids[@]} == 9 && ${ids[0]} == "${ids[1]}" && ${ids[2]} == "${ids[3]}" && ${ids[0]} != "${ids[2]}" ]]
ok $? "quick start: the Express retry is the same 201, replayed; the job prints one id twice" "$tmp/qs.out"
[[ ${ids[4]:-} == "${ids[5]:-}" && ${ids[5]:-} == "${ids[6]:-}" && ${ids[7]:-} == '{"forgotten":true}' && ${ids[8]:-x} != "${ids[4]:-}" ]]
ok $? "replay cache: two replays of the same 201 body, forget answers true, the next request a new order (${ids[*]:4})"
counts=$("${psql[@]}" -d "$db" -At -c "SELECT string_agg(item || '=' || n, ' ' ORDER BY item) FROM (SELECT item, count(*) n FROM orders GROUP BY item) s" 2>&1)
[[ $counts == "book=1 lamp=2 pen=1" ]]
ok $? "one order row per key, and a second after the forget ($counts)"
"${psql[@]}" -d postgres -c "DROP DATABASE IF EXISTS $db" >/dev/null 2>&1 || true

# count_conformance WHICH OUT T1: conformance/WHICH.js's lines in OUT
# echoed as this run's (prefixed WHICH), and its "WHICH: N of M tests
# passed." added to the counts (a run with no such line counts as one
# failure); T1 the SECONDS it started at.
count_conformance() {
	local which=$1 out=$2 t1=$3 line got total
	line=$(grep -E "^$which: [0-9]+ of [0-9]+ tests passed\.$" "$out" | tail -n 1)
	if [[ -n $line ]]; then
		read -r got total < <(sed -E 's/.*: ([0-9]+) of ([0-9]+) tests passed\./\1 \2/' <<<"$line")
	else
		got=0 total=1
		tail -n 20 "$out" | sed 's/^/#   /'
	fi
	sed -nE "s/^(not )?ok [0-9]+ - (.*)/\1ok - $which: \2/p; /^#   /p" "$out"
	echo "# ${line:-$which.js: no result} ($((SECONDS - t1)) s)"
	n=$((n + total)) passed=$((passed + got))
}

# ---- 3. idempotent() driven directly (conformance/wrapper.js), and the
# replay cache and the duplicate lines' sampling (conformance/cache.js)
for which in wrapper cache; do
	log "conformance/$which.js"
	t1=$SECONDS
	db=idem_node_$which
	out=$tmp/$which.out
	if "${psql[@]}" -d postgres -c "DROP DATABASE IF EXISTS $db" -c "CREATE DATABASE $db" >"$out" 2>&1 &&
		"${psql[@]}" -d "$db" -c "CREATE EXTENSION idempotency" >>"$out" 2>&1; then
		(cd "$app" && PGDATABASE=$db timeout 300 node "$which.js") >>"$out" 2>&1
	fi
	count_conformance "$which" "$out" "$t1"
	"${psql[@]}" -d postgres -c "DROP DATABASE IF EXISTS $db" >/dev/null 2>&1 || true
done

# ---- 4. Shards against a router and three shards (conformance/shards.js)
log "conformance/shards.js"
t1=$SECONDS
out=$tmp/shards.out
if make_shard_dbs idem_node >"$out" 2>&1; then
	(cd "$app" && IDEM_NODE_SHARDS=idem_node timeout 300 node shards.js) >>"$out" 2>&1
fi
count_conformance shards "$out" "$t1"
drop_shard_dbs idem_node

# ---- 5. the sample apps, driven by examples/http_test.py
IDEM_NODE_CACHED_APPS=${IDEM_NODE_CACHED_APPS-express+cache fastify+cache nestjs+cache}
# (then again with the replay cache on, IDEM_REPLAY_CACHE=1)
for run in express fastify nestjs $IDEM_NODE_CACHED_APPS; do
	which=${run%+cache} cache=
	[[ $run == *+cache ]] && cache=1
	log "examples/run_tests.sh $which${cache:+ (IDEM_REPLAY_CACHE=1)}"
	out=$tmp/run-$run.out
	t1=$SECONDS
	IDEM_REPLAY_CACHE=$cache PG_IDEMPOTENCY_APP=$app bash "$REPO_ROOT/examples/run_tests.sh" "$which" >"$out" 2>&1
	rc=$?
	line=$(grep -E "^$which example \(HTTP\): [0-9]+ of [0-9]+ tests passed\.$" "$out" | tail -n 1)
	if [[ -n $line ]]; then
		read -r got total < <(sed -E 's/.*: ([0-9]+) of ([0-9]+) tests passed\./\1 \2/' <<<"$line")
	else
		got=0 total=1
	fi
	sed -nE "s/^(not )?ok [0-9]+ - (.*)/\1ok - $run: \2/p" "$out"
	if ((rc != 0)); then
		grep -E '^#' "$out" | tail -n 60
		((total > got)) || total=$((got + 1))
	fi
	echo "# $line${cache:+ (replay cache on)} ($((SECONDS - t1)) s)"
	n=$((n + total)) passed=$((passed + got))
done

echo "# $name: $((SECONDS - t0)) s"
finish
