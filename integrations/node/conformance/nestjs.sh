# shellcheck shell=bash
# integrations/node/conformance/nestjs.sh -- sourced by examples/run_tests.sh nestjs:
# the nestjs sample app (nestjs.js) over pg-idempotency installed from its .tgz.
# shellcheck source=integrations/node/conformance/common.sh
source "$REPO_ROOT/integrations/node/conformance/common.sh"
node_server nestjs.js
