# shellcheck shell=bash
# integrations/python/conformance/fastapi.sh -- examples/run_tests.sh fastapi:
# pg_idempotency.asgi's sample app on FastAPI, served by uvicorn.
# shellcheck source=integrations/python/conformance/_setup.sh
source "$(dirname "${BASH_SOURCE[0]}")/_setup.sh" || return 1
# shellcheck disable=SC2154  # $dsn: examples/run_tests.sh's
server() {
	exec "$venv_python" "$pyint_dir/conformance/asgi_shop.py" --framework fastapi --dsn "$dsn" \
		--charge-lease 2 --listen "127.0.0.1:$1" "${@:2}"
}
