# shellcheck shell=bash
# integrations/python/conformance/django.sh -- examples/run_tests.sh django:
# pg_idempotency.django's sample app, Django views served by the standard
# library's threaded WSGI server.
# shellcheck source=integrations/python/conformance/_setup.sh
source "$(dirname "${BASH_SOURCE[0]}")/_setup.sh" || return 1
# shellcheck disable=SC2154  # $dsn: examples/run_tests.sh's
server() {
	exec "$venv_python" "$pyint_dir/conformance/django_shop.py" --dsn "$dsn" \
		--charge-lease 2 --listen "127.0.0.1:$1" "${@:2}"
}
