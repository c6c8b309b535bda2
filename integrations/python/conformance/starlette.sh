# shellcheck shell=bash
# integrations/python/conformance/starlette.sh -- examples/run_tests.sh starlette:
# pg_idempotency.asgi's sample app on Starlette, served by uvicorn.
# shellcheck source=integrations/python/conformance/_setup.sh
source "$(dirname "${BASH_SOURCE[0]}")/_setup.sh" || return 1
# shellcheck disable=SC2154  # $dsn: examples/run_tests.sh's
server() {
	exec "$venv_python" "$pyint_dir/conformance/asgi_shop.py" --framework starlette --dsn "$dsn" \
		--charge-lease 2 --listen "127.0.0.1:$1" "${@:2}"
}
