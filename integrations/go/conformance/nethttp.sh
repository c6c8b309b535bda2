# integrations/go/conformance/nethttp.sh -- the net/http sample app
# (integrations/go/sample/nethttp) for examples/run_tests.sh nethttp:
# sourced there with $work and $dsn set; builds the app under $work
# (integrations/go/build.sh: GOPATH mode, Debian's Go packages) and defines
# server, seed_flag and fault_flag (used there) as the gin arm does.
# shellcheck shell=bash disable=SC2034,SC2154
log "building integrations/go/sample/nethttp (GOPATH mode, Debian's Go packages)"
t0=$SECONDS
"$REPO_ROOT/integrations/go/build.sh" "$work/idempotency-nethttp" || did_not_run "the build failed"
log "built in $((SECONDS - t0))s"
server() { exec "$work/idempotency-nethttp" -dsn "$dsn" -charge-lease 2s -listen "127.0.0.1:$1" "${@:2}"; }
seed_flag=-replay-200 fault_flag=-fault-injection
