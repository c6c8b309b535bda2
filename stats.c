/*-------------------------------------------------------------------------
 *
 * stats.c
 *		Statistics of the idempotency extension in shared memory: what the
 *		calls answered, how long idem_acquire took, per database.
 *
 * Only with the library in shared_preload_libraries: the shared memory is
 * set up at server start.  Without it every idem_* function works as
 * before, counting nothing, and the functions that read or reset the
 * statistics raise 55000 with a hint giving the setting.
 *
 * Counting.  idem_acquire runs on every request, so counting must not
 * serialize the backends.  Each backend counts in a slot of its own (by
 * its PGPROC number), with plain loads and stores of 64-bit atomics: only
 * the slot's backend ever writes its counters, so there is no lock, no
 * read-modify-write instruction and no cache line shared with another
 * counting backend.  A reader sums the slots of a database with the
 * totals of that database's backends that have exited, which each backend
 * adds to its database's entry when it exits ("folding"), under the
 * exclusive lock; readers take it shared.  A slot is bound to its
 * backend's database the first time the backend counts.
 *
 * Resetting.  A reset cannot zero the slots of live backends, which write
 * them without a lock.  It records the totals at the time of the reset as
 * the database's base instead, and readers subtract it.  Since a slot only
 * grows until its backend folds it, which moves its value into the
 * database's entry, the result never goes down except at a reset.
 *
 * Restarts.  At a clean shutdown the postmaster writes the totals to
 * pg_stat/idempotency.stat and the next start reads them back (and removes
 * the file), so the counters go on; after a crash they start from zero with
 * a new stats_reset, which is how idem_maintain's daily reconciliation
 * tells that a counter went down.
 *
 * IDENTIFICATION
 *	  stats.c
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <unistd.h>

#include "access/xact.h"
#include "catalog/pg_class.h"
#include "catalog/namespace.h"
#include "commands/dbcommands.h"
#include "fmgr.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "port/atomics.h"
#include "storage/fd.h"
#include "storage/ipc.h"
#include "storage/lwlock.h"
#include "storage/proc.h"
#include "storage/shmem.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/float.h"
#include "utils/guc.h"
#include "utils/lsyscache.h"
#include "utils/syscache.h"
#include "utils/timestamp.h"

#include "compat.h"
#include "idempotency.h"

/* Where the totals wait for the next start, and what the file is */
#define IDEM_STATS_FILE		"pg_stat/idempotency.stat"
#define IDEM_STATS_FILE_HEADER	0x49444D53	/* "IDMS" */
#define IDEM_STATS_FILE_VERSION	2	/* raise when IdemStat changes */

/* Counters in a file of version 1 (the library of 1.1): the first ones */
#define IDEM_NSTATS_V1	29

/* Upper bounds of the acquire-duration buckets, in microseconds */
static const int64 idem_bucket_bounds[IDEM_NBUCKETS - 1] = {
	50, 100, 250, 500,
	1000, 2500, 5000, 10000, 25000, 50000, 100000, 250000, 500000,
	1000000, 2500000, 5000000
};

StaticAssertDecl(IDEM_NSTATS == 30,
				 "IdemStat changed: raise IDEM_STATS_FILE_VERSION and fix this check");

/* Counters of one database, as stored in its entry */
typedef struct IdemStatsDb
{
	Oid			dboid;			/* InvalidOid: a free entry */
	TimestampTz stats_reset;
	uint64		folded[IDEM_NSTATS];	/* from backends that have exited */
	uint64		base[IDEM_NSTATS];	/* totals at the last reset */
} IdemStatsDb;

/* A database's entry as the library of 1.1 saved it (file version 1) */
typedef struct IdemStatsDbV1
{
	Oid			dboid;
	TimestampTz stats_reset;
	uint64		folded[IDEM_NSTATS_V1];
	uint64		base[IDEM_NSTATS_V1];
} IdemStatsDbV1;

/* A backend's counters: written by that backend only */
typedef struct IdemStatsSlot
{
	Oid			dboid;			/* set and cleared under the exclusive lock */
	pg_atomic_uint64 counters[IDEM_NSTATS];
} IdemStatsSlot;

/* A slot padded to whole cache lines, so that no two backends share one */
#define IDEM_SLOT_SIZE \
	TYPEALIGN(PG_CACHE_LINE_SIZE, sizeof(IdemStatsSlot))

typedef struct IdemStatsShared
{
	LWLock	   *lock;
	bool		full_reported;	/* the LOG that a database is not counted */
	int			nslots;
	int			ndbs;
	IdemStatsDb *dbs;			/* ndbs entries */
	char	   *slots;			/* nslots slots of IDEM_SLOT_SIZE bytes */
} IdemStatsShared;

/* GUC variables */
static int	idem_stats_max_databases = 64;
static int	idem_stats_retention = 90 * 24 * 60 * 60;	/* seconds */

/* Saved hook values */
static shmem_request_hook_type prev_shmem_request_hook = NULL;
static shmem_startup_hook_type prev_shmem_startup_hook = NULL;

/* The shared state; NULL unless the library was preloaded */
static IdemStatsShared *idem_stats_shared = NULL;

/* This backend's counters once bound; see idempotency.h */
pg_atomic_uint64 *idem_my_stats = NULL;

/* This backend does not count: not preloaded, or no database entry */
bool		idem_stats_never = false;

static void idem_stats_shmem_request(void);
static void idem_stats_shmem_startup(void);
static void idem_stats_shmem_shutdown(int code, Datum arg);
static void idem_stats_backend_exit(int code, Datum arg);

PG_FUNCTION_INFO_V1(idem_stats);
PG_FUNCTION_INFO_V1(idem_stats_1_2);
PG_FUNCTION_INFO_V1(idem_acquire_histogram);
PG_FUNCTION_INFO_V1(idem_stats_reset);
PG_FUNCTION_INFO_V1(idem_stats_enabled);


/*
 * Module load: the settings, and with preloading the shared memory hooks.
 */
void
idem_stats_init(void)
{
	DefineCustomIntVariable("idempotency.stats_retention",
							"How long idempotency.daily keeps a day's statistics.",
							"idem_maintain() deletes the days older than this.",
							&idem_stats_retention,
							90 * 24 * 60 * 60, 24 * 60 * 60, INT_MAX,
							PGC_SUSET,
							GUC_UNIT_S,
							NULL, NULL, NULL);

	/* the rest only when preloaded: a server setting cannot come later */
	if (!process_shared_preload_libraries_in_progress)
		return;

	DefineCustomIntVariable("idempotency.stats_max_databases",
							"Number of databases whose idempotency statistics are kept.",
							"A database beyond it is not counted; the entries of dropped databases are reused.",
							&idem_stats_max_databases,
							64, 1, 100000,
							PGC_POSTMASTER,
							0,
							NULL, NULL, NULL);

	prev_shmem_request_hook = shmem_request_hook;
	shmem_request_hook = idem_stats_shmem_request;
	prev_shmem_startup_hook = shmem_startup_hook;
	shmem_startup_hook = idem_stats_shmem_startup;
}

/*
 * The number of slots: one per PGPROC that can run SQL (MaxBackends) and
 * the auxiliary processes, which never count but keep the arithmetic plain.
 */
static int
idem_stats_nslots(void)
{
	return MaxBackends + NUM_AUXILIARY_PROCS;
}

static Size
idem_stats_memsize(void)
{
	Size		size;

	size = MAXALIGN(sizeof(IdemStatsShared));
	size = add_size(size, mul_size(idem_stats_max_databases, sizeof(IdemStatsDb)));
	size = add_size(size, PG_CACHE_LINE_SIZE);
	size = add_size(size, mul_size(idem_stats_nslots(), IDEM_SLOT_SIZE));
	return size;
}

static void
idem_stats_shmem_request(void)
{
	if (prev_shmem_request_hook)
		prev_shmem_request_hook();
	RequestAddinShmemSpace(idem_stats_memsize());
	RequestNamedLWLockTranche("idempotency", 1);
}

/*
 * Find this database's entry, or NULL.  Caller holds the lock.
 */
static IdemStatsDb *
idem_stats_find_db(Oid dboid)
{
	int			i;

	for (i = 0; i < idem_stats_shared->ndbs; i++)
		if (idem_stats_shared->dbs[i].dboid == dboid)
			return &idem_stats_shared->dbs[i];
	return NULL;
}

/*
 * Take a free entry for dboid, or NULL when there is none.  Caller holds
 * the lock exclusively.
 */
static IdemStatsDb *
idem_stats_new_db(Oid dboid, TimestampTz stats_reset)
{
	IdemStatsDb *db = idem_stats_find_db(InvalidOid);

	if (db != NULL)
	{
		memset(db, 0, sizeof(IdemStatsDb));
		db->dboid = dboid;
		db->stats_reset = stats_reset;
	}
	return db;
}

static inline IdemStatsSlot *
idem_stats_slot(int i)
{
	return (IdemStatsSlot *) (idem_stats_shared->slots + (Size) i * IDEM_SLOT_SIZE);
}

/*
 * Read back the totals a clean shutdown left, then remove the file, so that
 * a crash before the next clean shutdown starts from zero rather than from
 * these totals again.  A file that cannot be read, or of another layout, is
 * ignored with a LOG line.  A file of version 1, which the library of 1.1
 * saved, gives the counters it had; those added since start from zero.
 */
static void
idem_stats_load(void)
{
	FILE	   *file;
	uint32		header[3];
	uint32		i;

	file = AllocateFile(IDEM_STATS_FILE, PG_BINARY_R);
	if (file == NULL)
	{
		if (errno != ENOENT)
			ereport(LOG,
					(errcode_for_file_access(),
					 errmsg("could not read file \"%s\": %m", IDEM_STATS_FILE)));
		return;
	}
	if (fread(header, sizeof(header), 1, file) != 1 ||
		header[0] != IDEM_STATS_FILE_HEADER ||
		(header[1] != IDEM_STATS_FILE_VERSION && header[1] != 1))
	{
		ereport(LOG,
				(errmsg("ignoring idempotency statistics file \"%s\" of another layout",
						IDEM_STATS_FILE)));
		header[2] = 0;
	}
	for (i = 0; i < header[2]; i++)
	{
		IdemStatsDb saved;
		IdemStatsDb *db;
		bool		ok;

		if (header[1] == 1)
		{
			IdemStatsDbV1 v1;

			ok = fread(&v1, sizeof(v1), 1, file) == 1;
			memset(&saved, 0, sizeof(saved));
			saved.dboid = v1.dboid;
			saved.stats_reset = v1.stats_reset;
			memcpy(saved.folded, v1.folded, sizeof(v1.folded));
		}
		else
			ok = fread(&saved, sizeof(saved), 1, file) == 1;
		if (!ok)
		{
			ereport(LOG,
					(errmsg("idempotency statistics file \"%s\" is truncated",
							IDEM_STATS_FILE)));
			break;
		}
		db = idem_stats_new_db(saved.dboid, saved.stats_reset);
		if (db == NULL)
		{
			ereport(LOG,
					(errmsg("idempotency statistics of %u databases saved at shutdown are not kept",
							header[2] - i),
					 errdetail("idempotency.stats_max_databases is %d.",
							   idem_stats_max_databases)));
			break;
		}
		memcpy(db->folded, saved.folded, sizeof(db->folded));
	}
	FreeFile(file);
	unlink(IDEM_STATS_FILE);
}

/*
 * Set up the shared state, once per server start (and again after a crash).
 */
static void
idem_stats_shmem_startup(void)
{
	bool		found;
	char	   *p;

	if (prev_shmem_startup_hook)
		prev_shmem_startup_hook();

	LWLockAcquire(AddinShmemInitLock, LW_EXCLUSIVE);
	idem_stats_shared = ShmemInitStruct("idempotency statistics",
										idem_stats_memsize(), &found);
	if (!found)
	{
		int			i;
		int			j;

		p = (char *) idem_stats_shared;
		memset(p, 0, MAXALIGN(sizeof(IdemStatsShared)));
		idem_stats_shared->lock = &(GetNamedLWLockTranche("idempotency"))->lock;
		idem_stats_shared->nslots = idem_stats_nslots();
		idem_stats_shared->ndbs = idem_stats_max_databases;
		p += MAXALIGN(sizeof(IdemStatsShared));
		idem_stats_shared->dbs = (IdemStatsDb *) p;
		memset(p, 0, sizeof(IdemStatsDb) * idem_stats_max_databases);
		p += sizeof(IdemStatsDb) * idem_stats_max_databases;
		idem_stats_shared->slots = (char *) TYPEALIGN(PG_CACHE_LINE_SIZE, p);
		for (i = 0; i < idem_stats_shared->nslots; i++)
		{
			IdemStatsSlot *slot = idem_stats_slot(i);

			slot->dboid = InvalidOid;
			for (j = 0; j < IDEM_NSTATS; j++)
				pg_atomic_init_u64(&slot->counters[j], 0);
		}
	}
	LWLockRelease(AddinShmemInitLock);

	/* In the postmaster: bring back the totals, and save them at shutdown */
	if (!IsUnderPostmaster)
	{
		if (!found)
			idem_stats_load();
		on_shmem_exit(idem_stats_shmem_shutdown, (Datum) 0);
	}
}

/*
 * The postmaster's shutdown: write every database's totals (the backends
 * are gone and have folded their slots) for the next start.  Only when the
 * totals are whole: not after a crash, nor after an immediate shutdown that
 * killed a backend before it could fold its counters (its slot is still
 * bound); the counters then start again from zero.
 */
static void
idem_stats_shmem_shutdown(int code, Datum arg)
{
	FILE	   *file;
	uint32		header[3];
	int			i;
	uint32		n = 0;

	if (code != 0 || idem_stats_shared == NULL)
		return;
	for (i = 0; i < idem_stats_shared->nslots; i++)
		if (OidIsValid(idem_stats_slot(i)->dboid))
			return;

	for (i = 0; i < idem_stats_shared->ndbs; i++)
		if (OidIsValid(idem_stats_shared->dbs[i].dboid))
			n++;

	file = AllocateFile(IDEM_STATS_FILE ".tmp", PG_BINARY_W);
	if (file == NULL)
		goto error;
	header[0] = IDEM_STATS_FILE_HEADER;
	header[1] = IDEM_STATS_FILE_VERSION;
	header[2] = n;
	if (fwrite(header, sizeof(header), 1, file) != 1)
		goto error;
	for (i = 0; i < idem_stats_shared->ndbs; i++)
	{
		IdemStatsDb saved = idem_stats_shared->dbs[i];
		int			j;

		if (!OidIsValid(saved.dboid))
			continue;
		/* whatever a slot still holds (it should hold nothing) is lost */
		for (j = 0; j < IDEM_NSTATS; j++)
		{
			saved.folded[j] = saved.folded[j] >= saved.base[j] ?
				saved.folded[j] - saved.base[j] : 0;
			saved.base[j] = 0;
		}
		if (fwrite(&saved, sizeof(saved), 1, file) != 1)
			goto error;
	}
	if (FreeFile(file) != 0)
	{
		file = NULL;
		goto error;
	}
	(void) durable_rename(IDEM_STATS_FILE ".tmp", IDEM_STATS_FILE, LOG);
	return;

error:
	ereport(LOG,
			(errcode_for_file_access(),
			 errmsg("could not write file \"%s\": %m", IDEM_STATS_FILE ".tmp")));
	if (file)
		FreeFile(file);
	unlink(IDEM_STATS_FILE ".tmp");
}

/*
 * Add a slot's counters to its database's entry and clear the slot.  Caller
 * holds the lock exclusively.
 */
static void
idem_stats_fold(IdemStatsSlot *slot)
{
	IdemStatsDb *db = idem_stats_find_db(slot->dboid);
	int			i;

	for (i = 0; i < IDEM_NSTATS; i++)
	{
		if (db != NULL)
			db->folded[i] += pg_atomic_read_u64(&slot->counters[i]);
		pg_atomic_write_u64(&slot->counters[i], 0);
	}
	slot->dboid = InvalidOid;
}

/*
 * Backend exit: fold this backend's counters into its database's entry.
 */
static void
idem_stats_backend_exit(int code, Datum arg)
{
	IdemStatsSlot *slot = (IdemStatsSlot *) DatumGetPointer(arg);

	LWLockAcquire(idem_stats_shared->lock, LW_EXCLUSIVE);
	idem_stats_fold(slot);
	LWLockRelease(idem_stats_shared->lock);
	idem_my_stats = NULL;
}

/*
 * Whether the database whose entry this is still exists.  Checked without
 * our lock: a catalog lookup may wait on other locks.
 */
static bool
idem_stats_db_exists(Oid dboid)
{
	return SearchSysCacheExists1(DATABASEOID, ObjectIdGetDatum(dboid));
}

/*
 * Free the entry of one dropped database that no backend counts in, to make
 * room.  Returns whether one was freed.
 */
static bool
idem_stats_evict(void)
{
	Oid		   *candidates;
	int			n = 0;
	int			i;
	bool		freed = false;

	candidates = palloc(sizeof(Oid) * idem_stats_shared->ndbs);
	LWLockAcquire(idem_stats_shared->lock, LW_SHARED);
	for (i = 0; i < idem_stats_shared->ndbs; i++)
		candidates[n++] = idem_stats_shared->dbs[i].dboid;
	LWLockRelease(idem_stats_shared->lock);

	for (i = 0; i < n && !freed; i++)
	{
		IdemStatsDb *db;
		int			j;
		bool		in_use = false;

		if (!OidIsValid(candidates[i]) || idem_stats_db_exists(candidates[i]))
			continue;
		LWLockAcquire(idem_stats_shared->lock, LW_EXCLUSIVE);
		db = idem_stats_find_db(candidates[i]);
		for (j = 0; db != NULL && j < idem_stats_shared->nslots; j++)
			if (idem_stats_slot(j)->dboid == candidates[i])
				in_use = true;
		if (db != NULL && !in_use)
		{
			db->dboid = InvalidOid;
			idem_stats_shared->full_reported = false;
			freed = true;
		}
		LWLockRelease(idem_stats_shared->lock);
	}
	pfree(candidates);
	return freed;
}

/*
 * Bind this backend's slot to its database, making the database's entry if
 * need be.  Returns false where nothing is counted: the library was not
 * preloaded, or no entry could be had (a WARNING says so once).
 */
bool
idem_stats_attach(void)
{
	int			procno;
	IdemStatsSlot *slot;
	bool		ok = false;
	int			round;

	if (idem_stats_shared == NULL || idem_stats_never)
	{
		idem_stats_never = true;
		return false;
	}
	if (MyProc == NULL || !OidIsValid(MyDatabaseId))
		return false;
	procno = idem_my_proc_number();
	if (procno < 0 || procno >= idem_stats_shared->nslots)
	{
		idem_stats_never = true;
		return false;
	}
	slot = idem_stats_slot(procno);

	for (round = 0; round < 2 && !ok; round++)
	{
		LWLockAcquire(idem_stats_shared->lock, LW_EXCLUSIVE);
		/* a slot left bound by a process that died without exiting */
		if (OidIsValid(slot->dboid))
			idem_stats_fold(slot);
		if (idem_stats_find_db(MyDatabaseId) != NULL ||
			idem_stats_new_db(MyDatabaseId, GetCurrentTimestamp()) != NULL)
		{
			slot->dboid = MyDatabaseId;
			ok = true;
		}
		LWLockRelease(idem_stats_shared->lock);
		if (!ok && (round > 0 || !idem_stats_evict()))
			break;
	}

	if (!ok)
	{
		bool		report;

		/* said once in the server log, not to every new session */
		idem_stats_never = true;
		LWLockAcquire(idem_stats_shared->lock, LW_EXCLUSIVE);
		report = !idem_stats_shared->full_reported;
		idem_stats_shared->full_reported = true;
		LWLockRelease(idem_stats_shared->lock);
		if (report)
			ereport(LOG,
					(errcode(ERRCODE_CONFIGURATION_LIMIT_EXCEEDED),
					 errmsg("idempotency statistics of database \"%s\" are not kept",
							get_database_name(MyDatabaseId)),
					 errdetail("Statistics are kept for %d databases, all held by other databases.",
							   idem_stats_max_databases),
					 errhint("Raise \"idempotency.stats_max_databases\" and restart the server.")));
		return false;
	}
	before_shmem_exit(idem_stats_backend_exit, PointerGetDatum(slot));
	idem_my_stats = slot->counters;
	return true;
}

/*
 * Count one idem_acquire of the given duration: its bucket, the number and
 * the sum.
 */
void
idem_stats_acquire_time(const instr_time *start)
{
	instr_time	duration;
	uint64		nsecs;
	int			bucket = 0;

	INSTR_TIME_SET_CURRENT(duration);
	INSTR_TIME_SUBTRACT(duration, *start);
	nsecs = idem_instr_time_nsec(duration);
	while (bucket < IDEM_NBUCKETS - 1 &&
		   nsecs > (uint64) idem_bucket_bounds[bucket] * 1000)
		bucket++;
	idem_stats_add(IDEM_STAT_BUCKET0 + bucket, 1);
	idem_stats_add(IDEM_STAT_ACQUIRE_NSECS, nsecs);
}


/* ----------------------------------------------------------------
 * Reading and resetting
 * ----------------------------------------------------------------
 */

/*
 * ereport the error of a statistics function called without preloading.
 */
static void
idem_stats_require(void)
{
	const char *current;

	if (idem_stats_shared != NULL)
		return;
	current = GetConfigOption("shared_preload_libraries", true, false);
	ereport(ERROR,
			(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
			 errmsg("idempotency statistics are not enabled"),
			 errdetail("The statistics are kept in shared memory, which the library sets up only when the server preloads it."),
			 (current != NULL && current[0] != '\0') ?
			 errhint("Set shared_preload_libraries = '%s, idempotency' in postgresql.conf and restart the server.",
					 current) :
			 errhint("Set shared_preload_libraries = 'idempotency' in postgresql.conf and restart the server.")));
}

/* One database's totals, copied out under the lock */
typedef struct IdemStatsTotals
{
	Oid			dboid;
	TimestampTz stats_reset;
	uint64		counters[IDEM_NSTATS];
} IdemStatsTotals;

/*
 * Sum every database's counters: the folded ones, plus the live slots,
 * minus the base of the last reset.  Returns the number of databases;
 * *result is palloc'd.
 */
static int
idem_stats_collect(IdemStatsTotals **result)
{
	IdemStatsTotals *totals;
	int			n = 0;
	int			i;
	int			j;

	totals = palloc0(sizeof(IdemStatsTotals) * idem_stats_shared->ndbs);
	LWLockAcquire(idem_stats_shared->lock, LW_SHARED);
	for (i = 0; i < idem_stats_shared->ndbs; i++)
	{
		IdemStatsDb *db = &idem_stats_shared->dbs[i];

		if (!OidIsValid(db->dboid))
			continue;
		totals[n].dboid = db->dboid;
		totals[n].stats_reset = db->stats_reset;
		for (j = 0; j < IDEM_NSTATS; j++)
			totals[n].counters[j] = db->folded[j] - db->base[j];
		n++;
	}
	for (i = 0; i < idem_stats_shared->nslots; i++)
	{
		IdemStatsSlot *slot = idem_stats_slot(i);
		int			k;

		if (!OidIsValid(slot->dboid))
			continue;
		for (k = 0; k < n; k++)
			if (totals[k].dboid == slot->dboid)
				break;
		if (k == n)
			continue;
		for (j = 0; j < IDEM_NSTATS; j++)
			totals[k].counters[j] += pg_atomic_read_u64(&slot->counters[j]);
	}
	LWLockRelease(idem_stats_shared->lock);

	*result = totals;
	return n;
}

/*
 * The number of acquires: the sum of the buckets, so that it always equals
 * the count of the last, Infinity, bucket, as Prometheus expects.
 */
static uint64
idem_stats_acquire_count(const uint64 *counters)
{
	uint64		count = 0;
	int			b;

	for (b = 0; b < IDEM_NBUCKETS; b++)
		count += counters[IDEM_STAT_BUCKET0 + b];
	return count;
}

static inline Datum
idem_stats_count_datum(uint64 value)
{
	return Int64GetDatum((int64) Min(value, (uint64) PG_INT64_MAX));
}

/*
 * Start a set-returning function that reads the statistics: check that
 * they are kept, set up its result of natts columns, and sum every
 * database's counters into *totals; returns the number of databases.
 */
static int
idem_stats_begin(FunctionCallInfo fcinfo, int natts, IdemStatsTotals **totals)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;

	idem_stats_require();
	InitMaterializedSRF(fcinfo, 0);
	if (rsinfo->setDesc->natts != natts)
		elog(ERROR, "function returns %d columns where the idempotency library returns %d",
			 rsinfo->setDesc->natts, natts);
	return idem_stats_collect(totals);
}

/*
 * idem_stats() returns table (datname, acquired, taken_over, replayed,
 *		mismatched, in_progress, completed, released, waits, wait_time,
 *		tokens_issued, tokens_consumed, acquire_duration_sum,
 *		acquire_duration_count, stats_reset)
 * idem_stats_1_2() returns table (..., stats_reset, forgotten)
 *
 * One row per database that has counted since its entry was made, the
 * databases that have been dropped left out.  wait_time is in
 * milliseconds, acquire_duration_sum in seconds.  natts: 15 (1.1) or 16.
 */
static Datum
idem_stats_common(FunctionCallInfo fcinfo, int natts)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	IdemStatsTotals *totals;
	int			n;
	int			i;

	n = idem_stats_begin(fcinfo, natts, &totals);
	for (i = 0; i < n; i++)
	{
		Datum		values[16];
		bool		nulls[16];
		char	   *datname = get_database_name(totals[i].dboid);
		const uint64 *c = totals[i].counters;

		if (datname == NULL)
			continue;			/* dropped */
		memset(nulls, false, sizeof(nulls));
		values[0] = CStringGetDatum(datname);
		values[0] = DirectFunctionCall1(namein, values[0]);
		values[1] = idem_stats_count_datum(c[IDEM_STAT_ACQUIRED]);
		values[2] = idem_stats_count_datum(c[IDEM_STAT_TAKEN_OVER]);
		values[3] = idem_stats_count_datum(c[IDEM_STAT_REPLAYED]);
		values[4] = idem_stats_count_datum(c[IDEM_STAT_MISMATCHED]);
		values[5] = idem_stats_count_datum(c[IDEM_STAT_IN_PROGRESS]);
		values[6] = idem_stats_count_datum(c[IDEM_STAT_COMPLETED]);
		values[7] = idem_stats_count_datum(c[IDEM_STAT_RELEASED]);
		values[8] = idem_stats_count_datum(c[IDEM_STAT_WAITS]);
		values[9] = Float8GetDatum((double) c[IDEM_STAT_WAIT_USECS] / 1000.0);
		values[10] = idem_stats_count_datum(c[IDEM_STAT_TOKENS_ISSUED]);
		values[11] = idem_stats_count_datum(c[IDEM_STAT_TOKENS_CONSUMED]);
		values[12] = Float8GetDatum((double) c[IDEM_STAT_ACQUIRE_NSECS] / 1e9);
		values[13] = idem_stats_count_datum(idem_stats_acquire_count(c));
		values[14] = TimestampTzGetDatum(totals[i].stats_reset);
		values[15] = idem_stats_count_datum(c[IDEM_STAT_FORGOTTEN]);
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	}
	return (Datum) 0;
}

/* The 1.1 symbol of idem_stats_common */
Datum
idem_stats(PG_FUNCTION_ARGS)
{
	return idem_stats_common(fcinfo, 15);
}

/* The 1.2 symbol of idem_stats_common: forgotten at the end */
Datum
idem_stats_1_2(PG_FUNCTION_ARGS)
{
	return idem_stats_common(fcinfo, 16);
}

/*
 * idem_acquire_histogram() returns table (datname, le, count)
 *
 * The cumulative histogram of idem_acquire's duration per database, in
 * Prometheus' terms: for each bucket, le is its upper bound in seconds and
 * count the calls that took at most that long; the last bucket's le is
 * Infinity and its count that of all calls.
 */
Datum
idem_acquire_histogram(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	IdemStatsTotals *totals;
	int			n;
	int			i;

	n = idem_stats_begin(fcinfo, 3, &totals);
	for (i = 0; i < n; i++)
	{
		char	   *datname = get_database_name(totals[i].dboid);
		Datum		name;
		uint64		cumulative = 0;
		int			b;

		if (datname == NULL)
			continue;
		name = DirectFunctionCall1(namein, CStringGetDatum(datname));
		for (b = 0; b < IDEM_NBUCKETS; b++)
		{
			Datum		values[3];
			bool		nulls[3] = {false, false, false};

			cumulative += totals[i].counters[IDEM_STAT_BUCKET0 + b];
			values[0] = name;
			values[1] = Float8GetDatum(b < IDEM_NBUCKETS - 1 ?
									   (double) idem_bucket_bounds[b] / 1e6 :
									   get_float8_infinity());
			values[2] = idem_stats_count_datum(cumulative);
			tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
		}
	}
	return (Datum) 0;
}

/*
 * idem_stats_reset() returns timestamptz
 *
 * Zero this database's counters and set its stats_reset, which it returns.
 * Only the owner of idempotency.records (or a superuser) may.
 */
Datum
idem_stats_reset(PG_FUNCTION_ARGS)
{
	Oid			nspoid = get_namespace_oid("idempotency", false);
	Oid			relid = get_relname_relid("records", nspoid);
	IdemStatsDb *db;
	TimestampTz now = GetCurrentTimestamp();
	int			i;

	idem_stats_require();
	if (!OidIsValid(relid))
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_TABLE),
				 errmsg("relation \"idempotency.records\" does not exist")));
	if (!idem_class_ownercheck(relid, GetUserId()))
		ereport(ERROR,
				(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
				 errmsg("permission denied to reset idempotency statistics"),
				 errdetail("Only the owner of table \"idempotency.records\" may reset the statistics of its database.")));

	/*
	 * The base is what a reader would add up now; both run under the
	 * exclusive lock, so that no backend folds in between.
	 */
	LWLockAcquire(idem_stats_shared->lock, LW_EXCLUSIVE);
	db = idem_stats_find_db(MyDatabaseId);
	if (db == NULL)
		db = idem_stats_new_db(MyDatabaseId, now);
	if (db != NULL)
	{
		uint64		live[IDEM_NSTATS];

		memset(live, 0, sizeof(live));
		for (i = 0; i < idem_stats_shared->nslots; i++)
		{
			IdemStatsSlot *slot = idem_stats_slot(i);
			int			j;

			if (slot->dboid != MyDatabaseId)
				continue;
			for (j = 0; j < IDEM_NSTATS; j++)
				live[j] += pg_atomic_read_u64(&slot->counters[j]);
		}
		for (i = 0; i < IDEM_NSTATS; i++)
			live[i] += db->folded[i];
		memcpy(db->base, live, sizeof(db->base));
		db->stats_reset = now;
	}
	LWLockRelease(idem_stats_shared->lock);

	if (db == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_CONFIGURATION_LIMIT_EXCEEDED),
				 errmsg("idempotency statistics of this database are not kept"),
				 errdetail("Statistics are kept for %d databases, all of which are in use.",
						   idem_stats_max_databases),
				 errhint("Raise \"idempotency.stats_max_databases\" and restart the server.")));
	PG_RETURN_TIMESTAMPTZ(now);
}

/*
 * idem_stats_enabled() returns boolean: whether statistics are kept (the
 * library was preloaded).  idem_maintain asks before it reads them.
 */
Datum
idem_stats_enabled(PG_FUNCTION_ARGS)
{
	PG_RETURN_BOOL(idem_stats_shared != NULL);
}
