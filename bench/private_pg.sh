# shellcheck shell=bash
# bench/private_pg.sh -- a private copy of the host's PostgreSQL 15, so that
# a benchmark can install the extension without touching the host's
# installation (and without the lock other runs hold on it)
#
# Sourced, not run.  As root on Debian 12.
#
#   private_pg_make PREFIX          copy /usr/lib/postgresql/15 and
#                                   /usr/share/postgresql/15 under PREFIX
#                                   (about 50 MB); its pg_config then answers
#                                   paths under PREFIX (PostgreSQL finds its
#                                   files relative to its binaries), and
#                                   PREFIX/include/postgresql is a symlink to
#                                   the host's headers, so PGXS builds with it
#   private_pg_install PREFIX SRC   make && make install the extension in the
#                                   folder SRC into PREFIX
#
# Afterwards PREFIX/lib/postgresql/15/bin holds initdb, pg_ctl, postgres,
# psql and pgbench, and PREFIX/lib/postgresql/15/lib holds pg_cron.so too.

private_pg_make() {
	local prefix=$1
	rm -rf "$prefix"
	mkdir -p "$prefix/lib/postgresql" "$prefix/share/postgresql" "$prefix/include"
	cp -a /usr/lib/postgresql/15 "$prefix/lib/postgresql/"
	cp -a /usr/share/postgresql/15 "$prefix/share/postgresql/"
	ln -s /usr/include/postgresql "$prefix/include/postgresql"
	# nothing of an earlier install into the host's directories
	rm -f "$prefix"/share/postgresql/15/extension/idempotency{,_proxy}{.control,--*.sql} \
		"$prefix"/lib/postgresql/15/lib/idempotency.so
	rm -rf "$prefix"/lib/postgresql/15/lib/bitcode/idempotency{,.index.bc}
	# the postgres OS user runs the binaries from here
	chmod 755 "$prefix"
}

private_pg_install() {
	local prefix=$1 src=$2 pgc=$1/lib/postgresql/15/bin/pg_config
	make -s -C "$src" PG_CONFIG="$pgc" >/dev/null
	make -s -C "$src" PG_CONFIG="$pgc" install >/dev/null
	[[ -f $prefix/lib/postgresql/15/lib/idempotency.so ]] ||
		{ echo "error: make install did not install into $prefix" >&2; return 1; }
}
