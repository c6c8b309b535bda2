# shellcheck shell=bash
# integrations/node/conformance/express.sh -- sourced by examples/run_tests.sh express:
# the express sample app (express.js) over pg-idempotency installed from its .tgz.
# shellcheck source=integrations/node/conformance/common.sh
source "$REPO_ROOT/integrations/node/conformance/common.sh"
node_server express.js
