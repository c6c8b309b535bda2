# shellcheck shell=bash disable=SC2034,SC2154,SC2317
# integrations/node/conformance/common.sh -- the part of express.sh,
# fastify.sh and nestjs.sh that is the same: sourced by them inside
# examples/run_tests.sh ($work, $dsn set).  With PG_IDEMPOTENCY_APP naming
# an app that integrations/node/build.sh made (test.sh does), that app is
# used; else the package is built and installed under $work.
# node_server APP.js: defines server PORT [FLAG...], seed_flag, fault_flag.
node_server() {
	node_app=${PG_IDEMPOTENCY_APP:-}
	if [[ -z $node_app ]]; then
		log "building pg-idempotency and a fresh app (integrations/node/build.sh)"
		bash "$REPO_ROOT/integrations/node/build.sh" "$work/node" >/dev/null || return 1
		node_app=$work/node/app
	fi
	node_main=$node_app/$1
	[[ -f $node_main ]] || { echo "# no $node_main" >&2; return 1; }
	server() { exec node "$node_main" --dsn "$dsn" --charge-lease 2 --listen "127.0.0.1:$1" "${@:2}"; }
	seed_flag=--replay-200 fault_flag=--fault-injection
}
