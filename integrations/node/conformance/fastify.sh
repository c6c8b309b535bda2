# shellcheck shell=bash
# integrations/node/conformance/fastify.sh -- sourced by examples/run_tests.sh fastify:
# the fastify sample app (fastify.js) over pg-idempotency installed from its .tgz.
# shellcheck source=integrations/node/conformance/common.sh
source "$REPO_ROOT/integrations/node/conformance/common.sh"
node_server fastify.js
