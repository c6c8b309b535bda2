# shellcheck shell=bash
# integrations/python/conformance/starlette.sh -- examples/run_tests.sh starlette:
# pg_idempotency.asgi's sample app on Starlette, served by uvicorn.
source "$(dirname "${BASH_SOURCE[0]}")/_setup.sh" || return 1
server() {
	exec "$venv_python" "$pyint_dir/conformance/asgi_shop.py" --framework starlette --dsn "$dsn" \
		--charge-lease 2 --listen "127.0.0.1:$1" "${@:2}"
}
