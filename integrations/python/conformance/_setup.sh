# shellcheck shell=bash
# integrations/python/conformance/_setup.sh -- sourced by the sample apps'
# hooks (fastapi.sh, starlette.sh, django.sh), which examples/run_tests.sh
# sources with $work set: installs what is missing from Debian, builds the
# wheel of pg-idempotency and installs it from the file into a fresh
# virtualenv under $work (made with --system-site-packages: Debian's
# psycopg, FastAPI, Django... are used, nothing is downloaded).  Sets
# $venv_python.  With PG_IDEMPOTENCY_VENV set (integrations/python/test.sh
# builds it once), that virtualenv is used instead.
# shellcheck disable=SC2034,SC2154  # $work in, venv_python and the flags out

pyint_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# pyint_apt PACKAGE...: apt-get install those that are missing
pyint_apt() {
	local p missing=()
	for p in "$@"; do
		dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
	done
	((${#missing[@]} == 0)) && return 0
	echo "# apt-get install ${missing[*]}"
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null ||
		{ apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null; }
}

# pyint_venv DIR: the wheel built into DIR/dist, a virtualenv DIR/venv with
# it installed from the file
pyint_venv() {
	local dir=$1
	pyint_apt python3-psycopg python3-psycopg-pool python3-fastapi python3-starlette python3-uvicorn \
		python3-django python3-setuptools python3-wheel python3-pip python3-venv || return 1
	mkdir -p "$dir/build"
	# built from a copy: setuptools writes build/ and *.egg-info beside the sources
	cp -r "$pyint_dir/pyproject.toml" "$pyint_dir/README.md" "$pyint_dir/src" "$dir/build/" || return 1
	/usr/bin/python3 -m pip wheel -q --no-deps --no-build-isolation --no-index -w "$dir/dist" "$dir/build" || return 1
	# without a pip of its own (ensurepip takes 20 s): Debian's pip, seen
	# through the system site-packages, installs into the virtualenv
	/usr/bin/python3 -m venv --without-pip --system-site-packages "$dir/venv" || return 1
	"$dir/venv/bin/python" -m pip install -q --no-deps --no-index "$dir"/dist/pg_idempotency-*.whl || return 1
}

if [[ -n ${PG_IDEMPOTENCY_VENV:-} ]]; then
	venv_python=$PG_IDEMPOTENCY_VENV/bin/python
else
	pyint_venv "$work/pyint" || return 1
	venv_python=$work/pyint/venv/bin/python
fi
seed_flag=--replay-200 fault_flag=--fault-injection
