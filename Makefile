# contrib-style PGXS Makefile for the idempotency extension
#
# make && make install        build and install into the pg_config found on PATH
# make uninstall              remove what make install put there; the router
#                             (proxy/) is a second extension with its own
#                             Makefile: make -C proxy install / uninstall
# make installcheck           pg_regress (sql/) and isolation (specs/) tests,
#                             each on a server of its own set up by
#                             regress.conf, then the TAP tests (t/) on
#                             clusters of their own; not as root (initdb
#                             refuses), and with pg_cron installed
# make installcheck TEMP_INSTANCE=
#                             the same against the server named by
#                             PGHOST/PGPORT, which must have regress.conf's
#                             settings
# scripts/test.sh             the whole suite on a throwaway cluster (what CI runs)

MODULE_big = idempotency
OBJS = \
	$(WIN32RES) \
	idempotency.o \
	claim.o \
	keylock.o \
	reqhash.o \
	token.o \
	records.o \
	stats.o \
	filter.o \
	filterbuild.o \
	shard.o \
	worker.o

EXTENSION = idempotency
# One full script, the last released one, and the updates after it: CREATE
# EXTENSION runs idempotency--1.1.sql and then the updates 1.1--1.2, 1.2--1.3 (as
# for contrib's pg_stat_statements), so each SQL object is written once.
DATA = idempotency--1.0.sql idempotency--1.0--1.1.sql idempotency--1.1.sql idempotency--1.1--1.2.sql idempotency--1.2--1.3.sql
PGFILEDESC = "idempotency - exactly-once write endpoints from SQL"

# Test files run in name order; their numeric prefixes give that order.
REGRESS = $(sort $(basename $(notdir $(wildcard sql/*.sql))))
ISOLATION = $(sort $(basename $(notdir $(wildcard specs/*.spec))))
# A server of their own for each, on a socket in a temporary folder, with
# the libraries preloaded (as pg_cron and pg_stat_statements do); with
# TEMP_INSTANCE= (empty) the server of PGHOST/PGPORT instead.
TEMP_INSTANCE = yes
ifneq ($(TEMP_INSTANCE),)
REGRESS_OPTS = --temp-instance=./tmp_check --temp-config=./regress.conf \
	--no-locale --encoding=UTF8
ISOLATION_OPTS = --temp-instance=./tmp_check_iso --temp-config=./regress.conf \
	--no-locale --encoding=UTF8
endif
# t/*.pl start clusters of their own (pg_cron runs, load, restarts); they
# need IPC::Run and must not run as root
TAP_TESTS = 1

PG_CONFIG ?= pg_config
PGXS := $(shell $(PG_CONFIG) --pgxs)
include $(PGXS)

# A server built with OpenSSL has the request's SHA-256 computed through
# libcrypto directly (reqhash.c, idem_sha256), as pgcrypto links it.
SHLIB_LINK += $(filter -lcrypto, $(LIBS))

# PGXS tracks no header dependencies (only a server configured with
# --enable-depend does), so a changed idempotency.h or compat.h would leave
# stale objects behind, built against another layout of the shared structs.
# Every object and bitcode file depends on both headers: a header change
# rebuilds them all.  After the include, so that `all` stays the default.
$(OBJS) $(patsubst %.o,%.bc,$(OBJS)): idempotency.h compat.h

# The SQL edition (sql-edition/README.md): make sql-edition builds its
# extension, pg_tle and plain psql scripts from the released SQL and
# sql-edition/*.sql, and prints the plain script's path last.
.PHONY: sql-edition
sql-edition:
	@$(MAKE) --no-print-directory -s -C sql-edition
