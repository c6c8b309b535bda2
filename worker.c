/*-------------------------------------------------------------------------
 *
 * worker.c
 *		Background workers that build the known-absent filters (filter.c)
 *		when the server starts, so that new keys do not descend every live
 *		partition's index until the next maintenance run.
 *
 * Shared memory starts empty at every server start and after a crash,
 * and a standby builds nothing before it is promoted.  When the library is
 * preloaded with filters, a launcher is registered that starts once the
 * server accepts writes: at startup, or at the promotion of a standby.
 * Not bound to a database, it lists the databases that allow connections
 * (templates aside) from the shared catalog pg_database, and starts for
 * each, one after the other, a worker that connects to it and, where the
 * extension is installed at a version that has it, calls the extension's
 * own build_filters('1s') as the bootstrap superuser (who may build as the
 * owner can); a filter whose inserters outlast that second is finished by
 * the next maintenance run.  Both exit when done, and are not restarted.  SIGTERM (a
 * fast shutdown) ends them at the next interrupt check.
 *
 * The postmaster forgets such a launcher at a crash, and makes shared
 * memory anew.  Then the first backend that asks whether it may use the
 * filters registers the same launcher as a dynamic worker: a flag in the
 * filters' shared memory, clear only after a crash, lets one backend do so
 * (filter.c; not after two crashes within five minutes, in case a build is
 * what crashes).
 *
 * idempotency.build_filters_at_start = off leaves the launcher with nothing
 * to do.
 *
 * IDENTIFICATION
 *	  worker.c
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/parallel.h"
#include "access/table.h"
#include "access/tableam.h"
#include "access/xact.h"
#include "catalog/dependency.h"
#include "catalog/pg_database.h"
#include "catalog/pg_proc.h"
#include "catalog/pg_type.h"
#include "commands/dbcommands.h"
#include "commands/extension.h"
#include "datatype/timestamp.h"
#include "fmgr.h"
#include "miscadmin.h"
#include "nodes/pg_list.h"
#include "nodes/value.h"
#include "parser/parse_func.h"
#include "pgstat.h"
#include "postmaster/bgworker.h"
#include "storage/ipc.h"
#include "tcop/tcopprot.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"

#include "idempotency.h"

PGDLLEXPORT void idem_filter_launcher_main(Datum main_arg);
PGDLLEXPORT void idem_filter_builder_main(Datum main_arg);

/* GUC variable */
static bool idem_build_filters_at_start = true;

/* A database the launcher will visit */
typedef struct IdemWorkerDatabase
{
	Oid			oid;
	char		name[NAMEDATALEN];
} IdemWorkerDatabase;

/*
 * What the launcher and the builders have in common: they attach to shared
 * memory, may connect to a database, start once the server accepts writes
 * and are never restarted by the postmaster (after a crash, see the file
 * header).
 */
static void
idem_worker_fill(BackgroundWorker *worker, const char *function,
				 const char *type)
{
	memset(worker, 0, sizeof(BackgroundWorker));
	worker->bgw_flags = BGWORKER_SHMEM_ACCESS |
		BGWORKER_BACKEND_DATABASE_CONNECTION;
	worker->bgw_start_time = BgWorkerStart_RecoveryFinished;
	worker->bgw_restart_time = BGW_NEVER_RESTART;
	strlcpy(worker->bgw_library_name, "idempotency", BGW_MAXLEN);
	strlcpy(worker->bgw_function_name, function, BGW_MAXLEN);
	strlcpy(worker->bgw_name, type, BGW_MAXLEN);
	strlcpy(worker->bgw_type, type, BGW_MAXLEN);
}

/*
 * Define the setting, and register the launcher if launch (filters are
 * enabled).  Called from _PG_init while shared_preload_libraries is
 * processed.  Not under pg_upgrade, whose servers must not be written to
 * behind its back.
 */
void
idem_worker_init(bool launch)
{
	BackgroundWorker worker;

	DefineCustomBoolVariable("idempotency.build_filters_at_start",
							 "Builds the known-absent filters of every database with the extension when the server starts, a standby is promoted, or the first call after a crash asks.",
							 "Off, they are built by the next maintenance run or idempotency.build_filters().",
							 &idem_build_filters_at_start,
							 true,
							 PGC_SIGHUP,
							 0,
							 NULL, NULL, NULL);

	if (!launch || IsBinaryUpgrade)
		return;

	idem_worker_fill(&worker, "idem_filter_launcher_main",
					 "idempotency filter launcher");
	RegisterBackgroundWorker(&worker);
}

/*
 * The databases that allow connections and are not templates, read from
 * pg_database into memory that outlives the transaction.
 */
static List *
idem_worker_databases(void)
{
	List	   *result = NIL;
	Relation	rel;
	TableScanDesc scan;
	HeapTuple	tup;

	StartTransactionCommand();
	(void) GetTransactionSnapshot();
	rel = table_open(DatabaseRelationId, AccessShareLock);
	scan = table_beginscan_catalog(rel, 0, NULL);
	while (HeapTupleIsValid(tup = heap_getnext(scan, ForwardScanDirection)))
	{
		Form_pg_database db = (Form_pg_database) GETSTRUCT(tup);
		IdemWorkerDatabase *entry;
		MemoryContext old;

		if (!db->datallowconn || db->datistemplate)
			continue;
#ifdef DATCONNLIMIT_INVALID_DB
		/* left half dropped: connecting would fail */
		if (db->datconnlimit == DATCONNLIMIT_INVALID_DB)
			continue;
#endif
		old = MemoryContextSwitchTo(TopMemoryContext);
		entry = palloc(sizeof(IdemWorkerDatabase));
		entry->oid = db->oid;
		strlcpy(entry->name, NameStr(db->datname), NAMEDATALEN);
		result = lappend(result, entry);
		MemoryContextSwitchTo(old);
	}
	table_endscan(scan);
	table_close(rel, AccessShareLock);
	CommitTransactionCommand();
	return result;
}

/*
 * May this backend start the launcher after a crash?  Not a parallel
 * worker, not in single-user mode, not under pg_upgrade.  Asked before the
 * backend takes the launch on (idem_filter_usable), so that one that may not
 * leaves it to the next.
 */
bool
idem_worker_may_launch(void)
{
	return !IsBinaryUpgrade && !IsParallelWorker() && IsUnderPostmaster;
}

/*
 * After a crash, start the launcher from this backend, which has taken the
 * launch on (the first to get there: filter.c's flag, idem_filter_usable).
 * Without a free worker slot the filters are left to maintenance.
 */
void
idem_worker_launch(void)
{
	BackgroundWorker worker;

	/* taken on: with the setting off, nobody builds until a restart */
	if (!idem_build_filters_at_start)
		return;

	idem_worker_fill(&worker, "idem_filter_launcher_main",
					 "idempotency filter launcher");
	if (!RegisterDynamicBackgroundWorker(&worker, NULL))
		ereport(LOG,
				(errmsg("idempotency could not start a worker to build the filters"),
				 errdetail("No background worker slot is free."),
				 errhint("Raise max_worker_processes, or build them with idempotency.build_filters().")));
}

/*
 * The launcher: one builder per database, one at a time, so that the
 * builds take one background worker slot and one CPU at most.  Registered
 * at server start, or by a backend after a crash.
 */
void
idem_filter_launcher_main(Datum main_arg)
{
	List	   *databases;
	ListCell   *lc;

	pqsignal(SIGTERM, die);
	BackgroundWorkerUnblockSignals();
	if (!idem_build_filters_at_start)
		proc_exit(0);

	BackgroundWorkerInitializeConnection(NULL, NULL, 0);
	databases = idem_worker_databases();

	foreach(lc, databases)
	{
		IdemWorkerDatabase *db = (IdemWorkerDatabase *) lfirst(lc);
		BackgroundWorker worker;
		BackgroundWorkerHandle *handle;
		BgwHandleStatus status;
		pid_t		pid;

		idem_worker_fill(&worker, "idem_filter_builder_main",
						 "idempotency filter builder");
		snprintf(worker.bgw_name, BGW_MAXLEN,
				 "idempotency filter builder for database %u", db->oid);
		worker.bgw_main_arg = ObjectIdGetDatum(db->oid);
		worker.bgw_notify_pid = MyProcPid;

		if (!RegisterDynamicBackgroundWorker(&worker, &handle))
		{
			ereport(LOG,
					(errmsg("idempotency could not start a worker to build the filters of database \"%s\"",
							db->name),
					 errdetail("No background worker slot is free."),
					 errhint("Raise max_worker_processes, or build them with idempotency.build_filters().")));
			break;
		}
		status = WaitForBackgroundWorkerStartup(handle, &pid);
		if (status == BGWH_STARTED)
			status = WaitForBackgroundWorkerShutdown(handle);
		if (status == BGWH_POSTMASTER_DIED)
			proc_exit(1);
	}
	proc_exit(0);
}

/*
 * The extension's own idempotency.build_filters(interval) in this
 * database, or InvalidOid where the extension is not installed or is at a
 * version without it.  Looked up by name, and then checked to be a member
 * of the extension: the builder runs as a superuser, and a function of that
 * name that someone else made in a database without the extension must
 * never run.
 */
static Oid
idem_worker_build_function(void)
{
	Oid			extoid = get_extension_oid("idempotency", true);
	Oid			argtypes[1] = {INTERVALOID};
	Oid			funcoid;

	if (!OidIsValid(extoid))
		return InvalidOid;
	funcoid = LookupFuncName(list_make2(makeString("idempotency"),
										makeString("build_filters")),
							 1, argtypes, true);
	if (!OidIsValid(funcoid) ||
		getExtensionOfObject(ProcedureRelationId, funcoid) != extoid)
		return InvalidOid;
	return funcoid;
}

/*
 * A builder: in its database, the extension's build_filters() if it is
 * there at a version that has it.  It waits a second at most for the
 * transactions writing to a partition when its build begins (prepared ones
 * survive a restart): such a partition is left to maintenance.  An error
 * ends the worker with a LOG entry; the next maintenance run builds what is
 * missing.
 */
void
idem_filter_builder_main(Datum main_arg)
{
	Oid			dboid = DatumGetObjectId(main_arg);
	Oid			funcoid;
	int32		built = 0;
	char		dbname[NAMEDATALEN];

	pqsignal(SIGTERM, die);
	BackgroundWorkerUnblockSignals();
	BackgroundWorkerInitializeConnectionByOid(dboid, InvalidOid, 0);

	/* a build runs at READ COMMITTED, whatever the server's default */
	SetConfigOption("default_transaction_isolation", "read committed",
					PGC_SUSET, PGC_S_OVERRIDE);

	SetCurrentStatementStartTimestamp();
	StartTransactionCommand();
	PushActiveSnapshot(GetTransactionSnapshot());
	pgstat_report_activity(STATE_RUNNING, "building idempotency filters");
	strlcpy(dbname, get_database_name(dboid), NAMEDATALEN);

	funcoid = idem_worker_build_function();
	if (OidIsValid(funcoid))
	{
		Interval	max_wait = {.time = USECS_PER_SEC};

		built = DatumGetInt32(OidFunctionCall1(funcoid,
											   IntervalPGetDatum(&max_wait)));
	}

	PopActiveSnapshot();
	CommitTransactionCommand();
	pgstat_report_activity(STATE_IDLE, NULL);

	if (OidIsValid(funcoid))
		ereport(LOG,
				(errmsg("idempotency built %d known-absent filters in database \"%s\"",
						built, dbname)));
	proc_exit(0);
}
