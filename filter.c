/*-------------------------------------------------------------------------
 *
 * filter.c
 *		Per-partition "known absent" filters in shared memory: a blocked
 *		bloom filter per live partition of idempotency.records, so that
 *		idem_acquire proves a new key absent from a partition without
 *		descending the partition's (scope, key) btree.
 *
 * Only with the library in shared_preload_libraries and
 * idempotency.filters > 0.  Without them every probe descends the index,
 * as before.
 *
 * The one rule.  A filter must never say absent for a key present in its
 * partition: one such answer runs a request twice.  False positives only
 * cost the index descent that would have been made anyway.  So:
 *
 * - Every insert into a partition adds its (scope, key) to the partition's
 *   slot (state BUILDING or READY) before the heap tuple exists, while
 *   holding RowExclusiveLock on the partition: idem_records_insert does so
 *   itself, every other path (SQL INSERT, COPY, UPDATE, logical
 *   replication apply) through the row trigger zz_records_filter, which is
 *   ENABLE ALWAYS and must be the last BEFORE ROW trigger (a later one
 *   could change the key); where it is not, it invalidates the slot.
 *
 * - A build (idem_build_filters) marks the slot BUILDING, waits for every
 *   transaction that held RowExclusiveLock on the partition then (as
 *   CREATE INDEX CONCURRENTLY does; later inserters see BUILDING and add
 *   their keys themselves), then adds every tuple of the heap not dead to
 *   all and marks the slot READY.  Those it waits for are kept in the
 *   slot's wait list: a build that cannot wait for them all in time leaves
 *   the slot BUILDING with the ones still running, and a later build waits
 *   for those only.  It holds ShareUpdateExclusiveLock on the partition,
 *   which keeps the trigger from being disabled, dropped or joined by
 *   another trigger meanwhile, and refuses a partition whose scope or key
 *   is a generated column (computed after the BEFORE ROW triggers, so the
 *   trigger would see NULL).
 *
 * - Anything that could let a key in without the trigger invalidates the
 *   slot, through object_access_hook: a trigger of the partition created
 *   (CREATE OR REPLACE TRIGGER reports a create), altered (ENABLE/DISABLE,
 *   rename) or dropped, the trigger function replaced, the partition
 *   altered or dropped, the database dropped.  A rollback reports nothing,
 *   so a slot made READY by a (sub)transaction that aborts or is prepared
 *   is freed by the transaction callbacks: the build trusted triggers as
 *   that transaction saw them.  Shared memory starts empty after a crash or
 *   a promotion, and nothing is built during recovery.
 *
 * Readers take no lock: a slot's generation (gen) is bumped by every
 * change of identity or invalidation, and a reader trusts the bits only if
 * the slot was READY for its partition with the same generation before and
 * after reading them.  A slot's filled mark says that a key has been added
 * since its bits were cleared: a filter without one, that of a partition
 * made ahead and still empty, rules every key out without a look at its
 * bits.  A (database, partition) pair has at most one slot (the claim
 * looks for the partition's own slot first, under the lock), which lets a
 * reader keep the slot's number as a hint.  Filters are not used under
 * SERIALIZABLE (SSI needs the predicate locks of the index scans) nor
 * during recovery.
 *
 * Slots are shared by every database of the server.  Each build gives back
 * its own database's slots of partitions no longer live; a slot of another
 * database's partition whose range has ended (no call looks in it any
 * more), or of a database that is gone, is taken when no free one is left.
 * A build that finds none says so once in the server log.
 *
 * The LWLock serializes slot assignment, state changes and what only
 * builds read (IdemFilterBuildState, the wait lists).
 *
 * IDENTIFICATION
 *	  filter.c
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <math.h>

#include "access/detoast.h"
#include "access/genam.h"
#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/relation.h"
#include "access/table.h"
#include "access/tableam.h"
#include "access/transam.h"
#include "access/twophase.h"
#include "access/xact.h"
#include "access/xlog.h"
#include "catalog/indexing.h"
#include "catalog/namespace.h"
#include "catalog/objectaccess.h"
#include "catalog/pg_class.h"
#include "catalog/pg_am.h"
#include "catalog/pg_collation.h"
#include "catalog/pg_database.h"
#include "catalog/pg_language.h"
#include "catalog/pg_proc.h"
#include "catalog/pg_trigger.h"
#include "commands/dbcommands.h"
#include "commands/trigger.h"
#include "common/hashfn.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "port/atomics.h"
#include "port/pg_bitutils.h"
#include "storage/ipc.h"
#include "storage/lmgr.h"
#include "storage/lwlock.h"
#include "storage/shmem.h"
#include "utils/builtins.h"
#include "utils/fmgroids.h"
#include "utils/guc.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/rel.h"
#include "utils/snapmgr.h"
#include "utils/syscache.h"
#include "utils/timestamp.h"

#include "compat.h"
#include "idempotency.h"

/* Name of the trigger that notes the keys of every other insert path */
#define IDEM_FILTER_TRIGGER		"zz_records_filter"
#define IDEM_FILTER_FUNCTION	"records_note_key"

/* Slot states */
#define FILTER_FREE			0
#define FILTER_BUILDING		1
#define FILTER_READY		2

/* Blocked bloom filter: 64-byte blocks of 16 words, 8 bits per key */
#define FILTER_BLOCK_BYTES	64
#define FILTER_BLOCK_WORDS	(FILTER_BLOCK_BYTES / sizeof(pg_atomic_uint32))
#define FILTER_K			8

/* A hint to the CPU to start loading a cache line */
#ifdef __GNUC__
#define idem_prefetch(p)	__builtin_prefetch(p)
#else
#define idem_prefetch(p)	((void) (p))
#endif

typedef struct IdemFilterSlot
{
	pg_atomic_uint32 gen;		/* bumped on every invalidation or reuse */
	pg_atomic_uint32 state;		/* FILTER_FREE, _BUILDING, _READY */
	Oid			db;				/* set under the lock, state FREE */
	Oid			relid;
	pg_atomic_uint32 filled;	/* has any key's bits; cleared with them */
} IdemFilterSlot;

/*
 * What only builds read of a slot, apart from the headers that every probe
 * scans; under the lock.  until: the end of the partition's range (DT_NOEND
 * for DEFAULT), after which no call looks in the slot and any database's
 * build may take it.  nwaiting: how many of the transactions that were
 * inserting into the partition when the slot became BUILDING may still be
 * running, their ids in the slot's row of the wait array.  A build that
 * cannot wait for all of them leaves the slot BUILDING with that list, and
 * a later build goes on from it.
 */
typedef struct IdemFilterBuildState
{
	TimestampTz until;
	int			nwaiting;
} IdemFilterBuildState;

/*
 * The slots' headers lie side by side, apart from their bit arrays: every
 * probe looks a partition's slot up by scanning the headers, which then
 * take a few cache lines of one page, not one page per slot.  Each bit
 * array is one block longer than its filter, so that a key's blocks, at
 * the same offset in every filter, do not all fall into one cache set.
 */
typedef struct IdemFilterShared
{
	LWLock	   *lock;
	int			nslots;
	uint32		nblocks;		/* blocks per slot */
	Size		stride;			/* bytes from one bit array to the next */
	IdemFilterSlot *slots;		/* nslots headers */
	IdemFilterBuildState *builds;	/* nslots, under the lock */
	int			maxwaiting;		/* wait array entries per slot */
	VirtualTransactionId *waiting;	/* nslots rows of maxwaiting, under the
									 * lock */
	Oid			starved_db;		/* its build lacked a slot and said so in
								 * the log; under the lock */
	char	   *bits;			/* nslots bit arrays of nblocks blocks */
	pg_atomic_flag launched;	/* set: no backend starts a build */
} IdemFilterShared;

/*
 * In the postmaster's own memory, which outlives a crash: whether the
 * filters' shared memory has been made before (so that making it again is
 * a crash's reinitialization), and when it was last made again (0: never).
 */
#define FILTER_REBUILD_QUIET_MS	(5 * 60 * 1000)
static TimestampTz idem_filter_reinit_at = 0;
static bool idem_filter_made = false;

/* GUC variables */
static int	idem_filters = 16;
static int	idem_filter_size = 1024;	/* kB */
static bool idem_use_filters = true;

/* Saved hook values */
static shmem_request_hook_type prev_shmem_request_hook = NULL;
static shmem_startup_hook_type prev_shmem_startup_hook = NULL;
static object_access_hook_type prev_object_access_hook = NULL;

/* The shared state; NULL unless preloaded with idempotency.filters > 0 */
static IdemFilterShared *idem_filter_shared = NULL;

static void idem_filter_shmem_request(void);
static void idem_filter_shmem_startup(void);
static void idem_filter_object_access(ObjectAccessType access, Oid classId,
									  Oid objectId, int subId, void *arg);
static void idem_filter_xact_callback(XactEvent event, void *arg);
static void idem_filter_subxact_callback(SubXactEvent event,
										 SubTransactionId mySubid,
										 SubTransactionId parentSubid,
										 void *arg);

PG_FUNCTION_INFO_V1(idem_records_note_key);
PG_FUNCTION_INFO_V1(idem_build_filters);
PG_FUNCTION_INFO_V1(idem_filters_sql);


/*
 * Module load: the settings and, when preloaded, the hooks.
 */
void
idem_filter_init(void)
{
	DefineCustomBoolVariable("idempotency.use_filters",
							 "Lets idem_acquire skip the partitions whose known-absent filter rules the key out.",
							 "Off, every live partition's index is descended, as without filters.",
							 &idem_use_filters,
							 true,
							 PGC_USERSET,
							 0,
							 NULL, NULL, NULL);

	if (!process_shared_preload_libraries_in_progress)
		return;

	DefineCustomIntVariable("idempotency.filters",
							"Number of partitions of idempotency.records that can have a known-absent filter.",
							"Zero disables the filters.",
							&idem_filters,
							16, 0, 4096,
							PGC_POSTMASTER,
							0,
							NULL, NULL, NULL);

	DefineCustomIntVariable("idempotency.filter_size",
							"Size of each partition's known-absent filter.",
							"About 1.5 bytes per key for a 1% false-positive rate.",
							&idem_filter_size,
							1024, 64, 1024 * 1024,
							PGC_POSTMASTER,
							GUC_UNIT_KB,
							NULL, NULL, NULL);

	/* the workers that build them when the server starts */
	idem_worker_init(idem_filters > 0);

	if (idem_filters <= 0)
		return;

	prev_shmem_request_hook = shmem_request_hook;
	shmem_request_hook = idem_filter_shmem_request;
	prev_shmem_startup_hook = shmem_startup_hook;
	shmem_startup_hook = idem_filter_shmem_startup;
	prev_object_access_hook = object_access_hook;
	object_access_hook = idem_filter_object_access;
	RegisterXactCallback(idem_filter_xact_callback, NULL);
	RegisterSubXactCallback(idem_filter_subxact_callback, NULL);
}

static Size
idem_filter_stride(void)
{
	return (Size) idem_filter_size * 1024 + FILTER_BLOCK_BYTES;
}

/*
 * Entries of a slot's wait list: as many transactions as can hold a lock
 * (GetLockConflicts), prepared ones included.  MaxBackends is known by the
 * time shared memory is requested.
 */
static int
idem_filter_maxwaiting(void)
{
	return MaxBackends + max_prepared_xacts;
}

static Size
idem_filter_memsize(void)
{
	Size		size = MAXALIGN(sizeof(IdemFilterShared));

	size = add_size(size, MAXALIGN(mul_size(idem_filters,
											sizeof(IdemFilterSlot))));
	size = add_size(size, MAXALIGN(mul_size(idem_filters,
											sizeof(IdemFilterBuildState))));
	size = add_size(size, MAXALIGN(mul_size(mul_size(idem_filters,
													 idem_filter_maxwaiting()),
											sizeof(VirtualTransactionId))));
	size = add_size(size, FILTER_BLOCK_BYTES);
	return add_size(size, mul_size(idem_filters, idem_filter_stride()));
}

static void
idem_filter_shmem_request(void)
{
	if (prev_shmem_request_hook)
		prev_shmem_request_hook();
	RequestAddinShmemSpace(idem_filter_memsize());
	RequestNamedLWLockTranche("idempotency filters", 1);
}

/*
 * Set up the slots, once per server start (and again after a crash, so
 * that nothing survives it).
 */
static void
idem_filter_shmem_startup(void)
{
	bool		found;

	if (prev_shmem_startup_hook)
		prev_shmem_startup_hook();

	LWLockAcquire(AddinShmemInitLock, LW_EXCLUSIVE);
	idem_filter_shared = ShmemInitStruct("idempotency filters",
										 idem_filter_memsize(), &found);
	if (!found)
	{
		char	   *p = (char *) idem_filter_shared;
		int			i;
		TimestampTz now;

		idem_filter_shared->lock =
			&(GetNamedLWLockTranche("idempotency filters"))->lock;
		idem_filter_shared->nslots = idem_filters;
		idem_filter_shared->nblocks =
			(uint32) ((Size) idem_filter_size * 1024 / FILTER_BLOCK_BYTES);
		idem_filter_shared->stride = idem_filter_stride();
		p += MAXALIGN(sizeof(IdemFilterShared));
		idem_filter_shared->slots = (IdemFilterSlot *) p;
		p += MAXALIGN(mul_size(idem_filters, sizeof(IdemFilterSlot)));
		idem_filter_shared->builds = (IdemFilterBuildState *) p;
		p += MAXALIGN(mul_size(idem_filters, sizeof(IdemFilterBuildState)));
		idem_filter_shared->maxwaiting = idem_filter_maxwaiting();
		idem_filter_shared->waiting = (VirtualTransactionId *) p;
		p += MAXALIGN(mul_size(mul_size(idem_filters,
										idem_filter_shared->maxwaiting),
							   sizeof(VirtualTransactionId)));
		idem_filter_shared->starved_db = InvalidOid;
		idem_filter_shared->bits = (char *) TYPEALIGN(FILTER_BLOCK_BYTES, p);
		for (i = 0; i < idem_filters; i++)
		{
			IdemFilterSlot *slot = &idem_filter_shared->slots[i];

			pg_atomic_init_u32(&slot->gen, 0);
			pg_atomic_init_u32(&slot->state, FILTER_FREE);
			pg_atomic_init_u32(&slot->filled, 0);
			slot->db = InvalidOid;
			slot->relid = InvalidOid;
			idem_filter_shared->builds[i].until = DT_NOEND;
			idem_filter_shared->builds[i].nwaiting = 0;
		}

		/*
		 * At server start the launcher registered then builds (worker.c),
		 * so no backend needs to.  After a crash the postmaster has
		 * forgotten it: the first backend to look a key up starts one
		 * (idem_filter_usable), unless the crash before this one was less
		 * than five minutes ago, in case a build is what crashes: then the
		 * filters wait for maintenance.
		 */
		now = GetCurrentTimestamp();
		pg_atomic_init_flag(&idem_filter_shared->launched);
		if (!idem_filter_made ||
			(idem_filter_reinit_at != 0 &&
			 !TimestampDifferenceExceeds(idem_filter_reinit_at, now,
										 FILTER_REBUILD_QUIET_MS)))
			(void) pg_atomic_test_set_flag(&idem_filter_shared->launched);
		if (idem_filter_made)
			idem_filter_reinit_at = now;
		idem_filter_made = true;
	}
	LWLockRelease(AddinShmemInitLock);
}

static inline IdemFilterSlot *
idem_filter_slot(int i)
{
	return &idem_filter_shared->slots[i];
}

static inline pg_atomic_uint32 *
idem_filter_words(IdemFilterSlot *slot)
{
	Size		i = slot - idem_filter_shared->slots;

	return (pg_atomic_uint32 *)
		(idem_filter_shared->bits + i * idem_filter_shared->stride);
}

/*
 * Whether filters exist in this server.
 */
bool
idem_filter_enabled(void)
{
	return idem_filter_shared != NULL;
}

/*
 * The hash of (scope, key) that every path uses: 64 bits over the bytes of
 * the detoasted text values, the key's hash seeded by the scope's.
 */
uint64
idem_filter_hash(text *scope, text *key)
{
	uint64		seed;

	seed = hash_bytes_extended((const unsigned char *) VARDATA_ANY(scope),
							   VARSIZE_ANY_EXHDR(scope),
							   UINT64CONST(0x1de4f17e5c0be5a1));
	return hash_bytes_extended((const unsigned char *) VARDATA_ANY(key),
							   VARSIZE_ANY_EXHDR(key), seed);
}

/*
 * The block of a hash, and the next of its FILTER_K bit positions (0..511)
 * from the state *x.
 */
static inline uint32
idem_filter_block(uint64 hash)
{
	return (uint32) (((hash >> 32) * (uint64) idem_filter_shared->nblocks) >> 32);
}

static inline uint32
idem_filter_next_bit(uint32 *x)
{
	*x = *x * 0x9E3779B1 + 0x7F4A7C15;
	return *x >> 23;
}

/* The block of a slot's bits that holds the key of this hash */
static inline pg_atomic_uint32 *
idem_filter_key_block(IdemFilterSlot *slot, uint64 hash)
{
	return idem_filter_words(slot) +
		(Size) idem_filter_block(hash) * FILTER_BLOCK_WORDS;
}

/*
 * Set the bits of hash in a slot, and mark the slot filled first.  Each
 * fetch_or is a full barrier, so the mark and the bits are set before
 * anything the caller writes next.  The mark is only written while still
 * clear, so that the inserts of many backends do not all write the line of
 * the slots' headers.  Reading a stale 1 left by the slot's previous
 * partition is harmless: the claim that cleared it made the slot BUILDING
 * after clearing, and a build waits for the inserters that saw the slot
 * before that and then adds every row of the heap, marking it again; a
 * READY slot's mark is never cleared.
 */
static void
idem_filter_set(IdemFilterSlot *slot, uint64 hash)
{
	pg_atomic_uint32 *block = idem_filter_key_block(slot, hash);
	uint32		x = (uint32) hash;
	int			i;

	if (pg_atomic_read_u32(&slot->filled) == 0)
		pg_atomic_write_u32(&slot->filled, 1);

	for (i = 0; i < FILTER_K; i++)
	{
		uint32		bit = idem_filter_next_bit(&x);

		pg_atomic_fetch_or_u32(&block[bit >> 5], (uint32) 1 << (bit & 31));
	}
}

/*
 * Find the slot of (MyDatabaseId, relid), or NULL; without the lock, so the
 * answer is a hint the caller checks against the generation or the state.
 */
static IdemFilterSlot *
idem_filter_find(Oid db, Oid relid)
{
	int			i;

	for (i = 0; i < idem_filter_shared->nslots; i++)
	{
		IdemFilterSlot *slot = idem_filter_slot(i);

		if (slot->relid == relid && slot->db == db)
			return slot;
	}
	return NULL;
}

/*
 * The slot numbered hint, if it is partition relid's of this database now;
 * else NULL, without looking further.
 */
static inline IdemFilterSlot *
idem_filter_at_hint(Oid relid, int hint)
{
	IdemFilterSlot *slot;

	if (hint < 0 || hint >= idem_filter_shared->nslots)
		return NULL;
	slot = idem_filter_slot(hint);
	if (slot->relid != relid || slot->db != MyDatabaseId)
		return NULL;
	return slot;
}

/*
 * idem_filter_find for a caller that keeps the slot's number between calls
 * in *hint (-1 at first): the slot is looked at there first, and the scan
 * of every header is made only when it holds another partition now.
 */
static inline IdemFilterSlot *
idem_filter_find_hinted(Oid relid, int *hint)
{
	IdemFilterSlot *slot = idem_filter_at_hint(relid, *hint);

	if (slot != NULL)
		return slot;
	slot = idem_filter_find(MyDatabaseId, relid);
	*hint = slot != NULL ? (int) (slot - idem_filter_shared->slots) : -1;
	return slot;
}

/*
 * Start loading the block of partition relid's filter that idem_filter_check
 * will read for this hash, if the filter has any keys.  A search asks the
 * filters of several partitions one after the other, each block most likely
 * out of the CPU's caches: loaded together, their misses overlap.  Only a
 * hint to the CPU: nothing is read here that an answer depends on.  Only
 * where *hint (idem_filter_find_hinted) names the partition's slot still:
 * looking for the slot of a partition that has none would scan every
 * header on every call, and the check does that once anyway.
 */
void
idem_filter_prefetch(Oid relid, uint64 hash, int *hint)
{
	IdemFilterSlot *slot = idem_filter_at_hint(relid, *hint);

	if (slot != NULL && pg_atomic_read_u32(&slot->filled) != 0)
		idem_prefetch(idem_filter_key_block(slot, hash));
}

/*
 * What does partition relid's filter say of (scope, key) of this hash?  The
 * hot path of a probe: no lock, a few loads.  ABSENT only if the
 * partition's slot was READY with the same generation before and after the
 * bits were read and no key had been added to it (filled clear) or one of
 * the bits is clear; MAYBE if it was READY and all of them are set; UNKNOWN
 * where there is no READY filter to ask.  The caller has checked that
 * filters may be used at all (idem_filter_usable), and keeps the slot's
 * number in *hint (idem_filter_find_hinted).
 */
IdemFilterAnswer
idem_filter_check(Oid relid, uint64 hash, int *hint)
{
	IdemFilterSlot *slot;
	pg_atomic_uint32 *block;
	uint32		gen;
	uint32		x = (uint32) hash;
	bool		absent = false;
	int			i;

	slot = idem_filter_find_hinted(relid, hint);
	if (slot == NULL)
		return IDEM_FILTER_UNKNOWN;

	/*
	 * A seqlock's reader: the generation, then the state, then the bits,
	 * then the generation again, each read after the one before.  Only the
	 * reads need ordering, among themselves (read barriers, free on x86):
	 * whatever made a key's record visible to the caller (the key lock, a
	 * snapshot) was a full barrier taken before this.
	 */
	gen = pg_atomic_read_u32(&slot->gen);
	pg_read_barrier();
	if (pg_atomic_read_u32(&slot->state) != FILTER_READY ||
		slot->db != MyDatabaseId || slot->relid != relid)
		return IDEM_FILTER_UNKNOWN;
	pg_read_barrier();

	/*
	 * A filter that no key has been added to rules every key out without a
	 * look at its bits: partitions made ahead for max_ttl are empty, and a
	 * new key would otherwise pay a cache miss in each of them.
	 */
	if (pg_atomic_read_u32(&slot->filled) == 0)
		absent = true;
	else
	{
		block = idem_filter_key_block(slot, hash);
		for (i = 0; i < FILTER_K; i++)
		{
			uint32		bit = idem_filter_next_bit(&x);

			if ((pg_atomic_read_u32(&block[bit >> 5]) & ((uint32) 1 << (bit & 31))) == 0)
			{
				absent = true;
				break;
			}
		}
	}

	pg_read_barrier();
	if (pg_atomic_read_u32(&slot->gen) != gen)
		return IDEM_FILTER_UNKNOWN;
	return absent ? IDEM_FILTER_ABSENT : IDEM_FILTER_MAYBE;
}

/*
 * May this transaction use the filters?  Not without them, not with
 * idempotency.use_filters off, not during recovery (nothing built before
 * promotion is trusted, nothing is built on a standby), and not under
 * SERIALIZABLE, whose predicate locks come from the index scans.
 *
 * After a crash, the first call to get this far starts the build of every
 * database's filters (worker.c; idem_filter_shmem_startup says when): the
 * launcher registered at server start does not outlive a crash.  One read
 * of a flag otherwise.
 */
bool
idem_filter_usable(void)
{
	if (idem_filter_shared == NULL || !idem_use_filters ||
		IsolationIsSerializable() || RecoveryInProgress())
		return false;
	if (unlikely(pg_atomic_unlocked_test_flag(&idem_filter_shared->launched)))
		idem_worker_launch();
	return true;
}

/*
 * Take on the build of every database's filters after a crash: true for
 * the one backend that gets there first (idem_filter_usable), false for
 * all others and whenever idem_filter_shmem_startup left it to others.
 */
bool
idem_filter_claim_launch(void)
{
	return idem_filter_shared != NULL &&
		pg_atomic_test_set_flag(&idem_filter_shared->launched);
}

/*
 * Note a key being inserted into partition relid, before the heap tuple
 * exists.  The caller holds RowExclusiveLock on the partition: a build
 * that started before the lock was taken waits for this transaction, one
 * that starts later is seen here as BUILDING.
 */
void
idem_filter_note(Oid relid, uint64 hash)
{
	IdemFilterSlot *slot;
	uint32		state;

	if (idem_filter_shared == NULL)
		return;
	pg_memory_barrier();
	slot = idem_filter_find(MyDatabaseId, relid);
	if (slot == NULL)
		return;
	state = pg_atomic_read_u32(&slot->state);
	if (state == FILTER_BUILDING || state == FILTER_READY)
		idem_filter_set(slot, hash);
}

/*
 * Free a slot: state FREE first, then a new generation, so that a reader
 * who read the old generation sees it change.  Caller holds the lock
 * exclusively.
 */
static void
idem_filter_free_slot(IdemFilterSlot *slot)
{
	pg_atomic_write_u32(&slot->state, FILTER_FREE);
	pg_write_barrier();
	pg_atomic_fetch_add_u32(&slot->gen, 1);
}

/*
 * Free a slot and let go of its partition, so that any build may take it.
 * Caller holds the lock exclusively.
 */
static void
idem_filter_release_slot(IdemFilterSlot *slot)
{
	int			i = slot - idem_filter_shared->slots;

	idem_filter_free_slot(slot);
	slot->db = InvalidOid;
	slot->relid = InvalidOid;
	idem_filter_shared->builds[i].until = DT_NOEND;
	idem_filter_shared->builds[i].nwaiting = 0;
}

/*
 * Invalidate the slot of (db, relid), or all slots of db if relid is
 * InvalidOid, or all slots if db is InvalidOid as well.
 */
static void
idem_filter_invalidate(Oid db, Oid relid)
{
	int			i;

	if (idem_filter_shared == NULL)
		return;
	LWLockAcquire(idem_filter_shared->lock, LW_EXCLUSIVE);
	for (i = 0; i < idem_filter_shared->nslots; i++)
	{
		IdemFilterSlot *slot = idem_filter_slot(i);

		if ((!OidIsValid(db) || slot->db == db) &&
			(!OidIsValid(relid) || slot->relid == relid))
			idem_filter_release_slot(slot);
	}
	LWLockRelease(idem_filter_shared->lock);
}

/*
 * Is relid idempotency.records itself?
 */
static bool
idem_filter_is_parent(Oid relid)
{
	Oid			nspoid;

	if (get_rel_relkind(relid) != RELKIND_PARTITIONED_TABLE)
		return false;
	nspoid = get_namespace_oid("idempotency", true);
	return OidIsValid(nspoid) && get_rel_namespace(relid) == nspoid &&
		strcmp(get_rel_name(relid), "records") == 0;
}

/*
 * Invalidate what an event on relation relid may have made wrong: its own
 * slot, and every slot of this database if it is the parent.
 */
static void
idem_filter_invalidate_rel(Oid relid, bool parent_too)
{
	/* most relations have no slot: do not take the lock for them */
	if (idem_filter_find(MyDatabaseId, relid) != NULL)
		idem_filter_invalidate(MyDatabaseId, relid);
	if (parent_too && idem_filter_is_parent(relid))
		idem_filter_invalidate(MyDatabaseId, InvalidOid);
}

/*
 * The relation a trigger belongs to, or InvalidOid if its row is not found.
 */
static Oid
idem_filter_trigger_relid(Oid trigoid)
{
	Relation	tgrel;
	SysScanDesc scan;
	ScanKeyData skey;
	HeapTuple	tup;
	Oid			relid = InvalidOid;

	tgrel = table_open(TriggerRelationId, AccessShareLock);
	ScanKeyInit(&skey, Anum_pg_trigger_oid, BTEqualStrategyNumber, F_OIDEQ,
				ObjectIdGetDatum(trigoid));
	scan = systable_beginscan(tgrel, TriggerOidIndexId, true, SnapshotSelf,
							  1, &skey);
	tup = systable_getnext(scan);
	if (HeapTupleIsValid(tup))
		relid = ((Form_pg_trigger) GETSTRUCT(tup))->tgrelid;
	systable_endscan(scan);
	table_close(tgrel, AccessShareLock);
	return relid;
}

/*
 * Is function funcoid idempotency.records_note_key?  By the catalog row
 * this command sees (for CREATE OR REPLACE, the row being replaced).
 */
static bool
idem_filter_is_note_function(Oid funcoid)
{
	char	   *name = get_func_name(funcoid);
	Oid			nspoid;

	if (name == NULL || strcmp(name, IDEM_FILTER_FUNCTION) != 0)
		return false;
	nspoid = get_namespace_oid("idempotency", true);
	return OidIsValid(nspoid) && get_func_namespace(funcoid) == nspoid;
}

/*
 * object_access_hook: invalidate the filters that a catalog change may
 * leave wrong.  Every trigger made, replaced (CREATE OR REPLACE TRIGGER
 * reports a create), altered (ENABLE, DISABLE, rename) or dropped on a
 * partition; every change of a partition (its columns, say); the drop of a
 * partition or database; the trigger function replaced or altered.
 * Conservative: a change that cannot matter only costs a rebuild.
 */
static void
idem_filter_object_access(ObjectAccessType access, Oid classId,
						  Oid objectId, int subId, void *arg)
{
	if (prev_object_access_hook)
		prev_object_access_hook(access, classId, objectId, subId, arg);

	if (idem_filter_shared == NULL ||
		(access != OAT_POST_CREATE && access != OAT_POST_ALTER &&
		 access != OAT_DROP))
		return;

	if (classId == TriggerRelationId)
	{
		Oid			relid = idem_filter_trigger_relid(objectId);

		if (OidIsValid(relid))
			idem_filter_invalidate_rel(relid, true);
		else if (access != OAT_POST_CREATE)
			idem_filter_invalidate(MyDatabaseId, InvalidOid);
	}
	else if (classId == RelationRelationId && access != OAT_POST_CREATE)
	{
		/*
		 * A column of the parent changed: the partitions' hooks fire too,
		 * but be sure.  Other changes of the parent (ATTACH, DETACH) do not
		 * touch the partitions' rows.
		 */
		idem_filter_invalidate_rel(objectId,
								   access == OAT_DROP || subId != 0);
	}
	else if (classId == ProcedureRelationId && access != OAT_DROP)
	{
		/*
		 * Replacing the function takes no lock on the table, so take one on
		 * the function, which builds take too: a build that trusted the old
		 * function ends (and its filters are dropped below) before this
		 * transaction goes on, and none starts until it ends.
		 */
		if (idem_filter_is_note_function(objectId))
		{
			LockDatabaseObject(ProcedureRelationId, objectId, 0,
							   AccessExclusiveLock);
			idem_filter_invalidate(MyDatabaseId, InvalidOid);
		}
	}
	else if (classId == DatabaseRelationId && access == OAT_DROP)
		idem_filter_invalidate(objectId, InvalidOid);
}

/*
 * Is zz_records_filter, at position i of the relation's triggers (sorted by
 * name, the order they fire in), ENABLE ALWAYS and the last BEFORE ROW
 * trigger on INSERT or UPDATE that can fire?  A disabled later trigger
 * cannot fire until enabled, which invalidates through the hook.
 */
static bool
idem_filter_trigger_is_last(TriggerDesc *trigdesc, int i)
{
	Trigger    *ours = &trigdesc->triggers[i];
	int			j;

	if (ours->tgenabled != TRIGGER_FIRES_ALWAYS ||
		!TRIGGER_FOR_ROW(ours->tgtype) || !TRIGGER_FOR_BEFORE(ours->tgtype) ||
		!TRIGGER_FOR_INSERT(ours->tgtype) || !TRIGGER_FOR_UPDATE(ours->tgtype) ||
		ours->tgqual != NULL || ours->tgnattr != 0)
		return false;
	for (j = i + 1; j < trigdesc->numtriggers; j++)
	{
		Trigger    *t = &trigdesc->triggers[j];

		if (t->tgenabled != TRIGGER_DISABLED &&
			TRIGGER_FOR_ROW(t->tgtype) && TRIGGER_FOR_BEFORE(t->tgtype) &&
			(TRIGGER_FOR_INSERT(t->tgtype) || TRIGGER_FOR_UPDATE(t->tgtype)))
			return false;
	}
	return true;
}

/*
 * Is trigger function funcoid ours: idempotency.records_note_key, in C,
 * our symbol in our library, as committed (not replaced by this
 * transaction, whose other sessions still call the old one)?  Takes a
 * share lock on the function, held to the end of the transaction, that
 * replacing it waits for (the hook); false at once if a replacement holds
 * it.
 */
static bool
idem_filter_function_ok(Oid funcoid)
{
	HeapTuple	tup;
	Form_pg_proc proc;
	bool		ok = false;

	if (!ConditionalLockDatabaseObject(ProcedureRelationId, funcoid, 0,
									   AccessShareLock))
		return false;
	AcceptInvalidationMessages();
	if (!idem_filter_is_note_function(funcoid))
		return false;
	tup = SearchSysCache1(PROCOID, ObjectIdGetDatum(funcoid));
	if (!HeapTupleIsValid(tup))
		return false;
	proc = (Form_pg_proc) GETSTRUCT(tup);
	if (proc->prolang == ClanguageId &&
		!TransactionIdIsCurrentTransactionId(HeapTupleHeaderGetRawXmin(tup->t_data)))
	{
		bool		srcnull;
		bool		binnull;
		Datum		src = SysCacheGetAttr(PROCOID, tup, Anum_pg_proc_prosrc,
										  &srcnull);
		Datum		bin = SysCacheGetAttr(PROCOID, tup, Anum_pg_proc_probin,
										  &binnull);

		ok = !srcnull && !binnull &&
			strcmp(TextDatumGetCString(src), "idem_records_note_key") == 0 &&
			strcmp(TextDatumGetCString(bin), "$libdir/idempotency") == 0;
	}
	ReleaseSysCache(tup);
	return ok;
}

/*
 * Is column name of partition rel one whose value a row trigger sees as
 * it is stored: present and not generated?  PostgreSQL computes generated
 * columns after the BEFORE ROW triggers, so the trigger would see NULL and
 * note nothing.  (Since PostgreSQL 16 a partition cannot have a generated
 * column that its parent's is not; 15 attaches one.)
 */
static bool
idem_filter_column_ok(Relation rel, const char *name)
{
	AttrNumber	att = get_attnum(RelationGetRelid(rel), name);

	return att != InvalidAttrNumber && att > 0 &&
		TupleDescAttr(RelationGetDescr(rel), att - 1)->attgenerated == '\0';
}

/*
 * Can partition rel have a filter?  A heap whose scope and key are stored
 * as written, with our trigger, calling our function, ENABLE ALWAYS,
 * without WHEN or column list, and last.  NULL if so, else why not, for
 * the build's NOTICE.  (Whether its probe index compares by bytes, as the
 * filter's hash does, the reader checks: idem_trusted in records.c.)
 */
static const char *
idem_filter_rel_ok(Relation rel)
{
	TriggerDesc *trigdesc = rel->trigdesc;
	int			i;

	/* a heap to scan: not a partitioned or foreign table attached */
	if (rel->rd_rel->relkind != RELKIND_RELATION ||
		rel->rd_rel->relam != HEAP_TABLE_AM_OID)
		return "It is not a heap table.";
	if (!idem_filter_column_ok(rel, "scope") ||
		!idem_filter_column_ok(rel, "key"))
		return "Its column \"scope\" or \"key\" is missing or generated.";
	for (i = 0; trigdesc != NULL && i < trigdesc->numtriggers; i++)
	{
		Trigger    *t = &trigdesc->triggers[i];

		if (strcmp(t->tgname, IDEM_FILTER_TRIGGER) != 0)
			continue;
		if (idem_filter_function_ok(t->tgfoid) &&
			idem_filter_trigger_is_last(trigdesc, i))
			return NULL;
		break;
	}
	return "Its trigger \"" IDEM_FILTER_TRIGGER "\" is missing, not ENABLE ALWAYS, has a WHEN condition or a column list, does not call idempotency.records_note_key(), or is not its last BEFORE ROW trigger.";
}

/*
 * Is this stored scope or key too long for any call to look up?  Only a
 * value kept out of line is checked, by its toast pointer, without reading
 * the TOAST table: a dead tuple's TOAST rows may already be gone (a build
 * reads dead tuples too), and a value that long cannot be in a filter's
 * answer anyway.
 */
static bool
idem_filter_unprobeable(Datum value)
{
	struct varlena *v = (struct varlena *) DatumGetPointer(value);

	return VARATT_IS_EXTERNAL(v) &&
		toast_raw_datum_size(value) - VARHDRSZ > IDEM_MAX_KEY_BYTES;
}

/*
 * The (scope, key) hash of a heap tuple of a partition, false if either is
 * NULL (no record can be found under it).
 */
static bool
idem_filter_tuple_hash(HeapTuple tuple, TupleDesc desc, AttrNumber scope_att,
					   AttrNumber key_att, uint64 *hash)
{
	Datum		scope;
	Datum		key;
	bool		isnull;
	text	   *s;
	text	   *k;

	scope = heap_getattr(tuple, scope_att, desc, &isnull);
	if (isnull || idem_filter_unprobeable(scope))
		return false;
	key = heap_getattr(tuple, key_att, desc, &isnull);
	if (isnull || idem_filter_unprobeable(key))
		return false;
	s = (text *) pg_detoast_datum_packed((struct varlena *) DatumGetPointer(scope));
	k = (text *) pg_detoast_datum_packed((struct varlena *) DatumGetPointer(key));
	*hash = idem_filter_hash(s, k);
	if ((Pointer) s != DatumGetPointer(scope))
		pfree(s);
	if ((Pointer) k != DatumGetPointer(key))
		pfree(k);
	return true;
}

/*
 * idempotency.records_note_key(): BEFORE INSERT OR UPDATE row trigger of
 * every partition.  Adds NEW's (scope, key) to the partition's filter
 * before the row is written; where this trigger is not ENABLE ALWAYS and
 * the last BEFORE ROW trigger (a later one could change the key), it
 * invalidates the partition's filter instead.
 */
Datum
idem_records_note_key(PG_FUNCTION_ARGS)
{
	TriggerData *trigdata = (TriggerData *) fcinfo->context;
	Relation	rel;
	HeapTuple	newtuple;
	TupleDesc	desc;
	uint64		hash;
	int			i;
	bool		ok = false;

	if (!CALLED_AS_TRIGGER(fcinfo))
		ereport(ERROR,
				(errcode(ERRCODE_E_R_I_E_TRIGGER_PROTOCOL_VIOLATED),
				 errmsg("function \"records_note_key\" was not called by trigger manager")));
	rel = trigdata->tg_relation;
	if (TRIGGER_FIRED_BY_UPDATE(trigdata->tg_event))
		newtuple = trigdata->tg_newtuple;
	else
		newtuple = trigdata->tg_trigtuple;

	if (idem_filter_shared == NULL || !TRIGGER_FIRED_FOR_ROW(trigdata->tg_event) ||
		!TRIGGER_FIRED_BEFORE(trigdata->tg_event) ||
		!(TRIGGER_FIRED_BY_INSERT(trigdata->tg_event) ||
		  TRIGGER_FIRED_BY_UPDATE(trigdata->tg_event)))
	{
		if (idem_filter_shared != NULL)
			idem_filter_invalidate(MyDatabaseId, RelationGetRelid(rel));
		return PointerGetDatum(newtuple);
	}

	/* ours is the trigger being fired; is it last and ALWAYS? */
	if (rel->trigdesc != NULL)
	{
		for (i = 0; i < rel->trigdesc->numtriggers; i++)
		{
			if (rel->trigdesc->triggers[i].tgoid == trigdata->tg_trigger->tgoid)
			{
				ok = idem_filter_trigger_is_last(rel->trigdesc, i);
				break;
			}
		}
	}
	if (!ok)
	{
		if (idem_filter_find(MyDatabaseId, RelationGetRelid(rel)) != NULL)
			idem_filter_invalidate(MyDatabaseId, RelationGetRelid(rel));
		return PointerGetDatum(newtuple);
	}

	desc = RelationGetDescr(rel);
	if (idem_filter_tuple_hash(newtuple, desc,
							   SPI_fnumber(desc, "scope"),
							   SPI_fnumber(desc, "key"), &hash))
		idem_filter_note(RelationGetRelid(rel), hash);
	return PointerGetDatum(newtuple);
}

/*
 * Abort of a build: free its slot, if it is still the build's.
 */
typedef struct IdemFilterBuild
{
	IdemFilterSlot *slot;
	uint32		gen;
} IdemFilterBuild;

/* What idem_filter_build_one did with a partition */
typedef enum IdemFilterOutcome
{
	FILTER_BUILT,				/* its filter is READY */
	FILTER_DEFERRED,			/* BUILDING still, for a later build */
	FILTER_NO_SLOT				/* no slot was left for it */
} IdemFilterOutcome;

static void
idem_filter_build_cleanup(int code, Datum arg)
{
	IdemFilterBuild *build = (IdemFilterBuild *) DatumGetPointer(arg);

	if (build->slot == NULL)
		return;
	LWLockAcquire(idem_filter_shared->lock, LW_EXCLUSIVE);
	if (pg_atomic_read_u32(&build->slot->gen) == build->gen)
		idem_filter_release_slot(build->slot);
	LWLockRelease(idem_filter_shared->lock);
}

/*
 * The filters this transaction made READY, with the subtransaction that
 * made each.  A build trusts the triggers it sees, and this transaction's
 * own changes of them (ENABLE ALWAYS, say) are undone by a rollback that
 * no hook reports: so a filter made READY by a (sub)transaction that does
 * not commit is dropped with it, and so is one made by a transaction that
 * is prepared (its outcome is not known here).
 */
typedef struct IdemFilterMade
{
	IdemFilterSlot *slot;
	uint32		gen;
	SubTransactionId subid;
} IdemFilterMade;

static IdemFilterMade *idem_filters_made = NULL;	/* idem_filters slots */
static int	idem_filters_nmade = 0;

/*
 * Make sure there is room to remember a filter made READY: called before a
 * build, so that remembering cannot fail once a slot is READY.
 */
static void
idem_filter_made_room(void)
{
	if (idem_filters_made == NULL)
		idem_filters_made = MemoryContextAlloc(TopMemoryContext,
											   sizeof(IdemFilterMade) * idem_filter_shared->nslots);
}

/*
 * Remember a slot made READY by this (sub)transaction.  A slot made READY
 * again (invalidated and rebuilt in the same transaction) replaces its
 * entry, with the later subtransaction; an entry whose slot has moved on
 * to another generation is dropped.  So there is at most one entry a slot.
 */
static void
idem_filter_remember(IdemFilterSlot *slot, uint32 gen)
{
	int			i;
	int			kept = 0;

	for (i = 0; i < idem_filters_nmade; i++)
	{
		IdemFilterMade *m = &idem_filters_made[i];

		if (m->slot == slot ||
			pg_atomic_read_u32(&m->slot->gen) != m->gen)
			continue;
		idem_filters_made[kept++] = *m;
	}
	Assert(kept < idem_filter_shared->nslots);
	idem_filters_made[kept].slot = slot;
	idem_filters_made[kept].gen = gen;
	idem_filters_made[kept].subid = GetCurrentSubTransactionId();
	idem_filters_nmade = kept + 1;
}

/*
 * Drop the filters made by subtransaction subid or its children (all of
 * them for InvalidSubTransactionId), if still theirs.
 */
static void
idem_filter_forget_made(SubTransactionId subid)
{
	int			i;
	int			kept = 0;

	for (i = 0; i < idem_filters_nmade; i++)
	{
		IdemFilterMade *m = &idem_filters_made[i];

		if (subid != InvalidSubTransactionId && m->subid < subid)
		{
			idem_filters_made[kept++] = *m;
			continue;
		}
		LWLockAcquire(idem_filter_shared->lock, LW_EXCLUSIVE);
		if (pg_atomic_read_u32(&m->slot->gen) == m->gen)
			idem_filter_release_slot(m->slot);
		LWLockRelease(idem_filter_shared->lock);
	}
	idem_filters_nmade = kept;
}

static void
idem_filter_xact_callback(XactEvent event, void *arg)
{
	if (idem_filters_nmade == 0)
		return;
	switch (event)
	{
		case XACT_EVENT_COMMIT:
		case XACT_EVENT_PARALLEL_COMMIT:
			idem_filters_nmade = 0;
			break;
		case XACT_EVENT_ABORT:
		case XACT_EVENT_PARALLEL_ABORT:
		case XACT_EVENT_PREPARE:
			idem_filter_forget_made(InvalidSubTransactionId);
			break;
		default:
			break;
	}
}

static void
idem_filter_subxact_callback(SubXactEvent event, SubTransactionId mySubid,
							 SubTransactionId parentSubid, void *arg)
{
	if (event == SUBXACT_EVENT_ABORT_SUB && idem_filters_nmade > 0)
		idem_filter_forget_made(mySubid);
}

/*
 * Take a slot for (MyDatabaseId, relid), whose range ends at until, and
 * mark it BUILDING with its bits cleared and its wait list empty: the
 * partition's own slot if it has one, else a free one, else one that no
 * call looks in any more.  NULL when none is left.
 */
static IdemFilterSlot *
idem_filter_claim_slot(Oid relid, TimestampTz until, TimestampTz now,
					   uint32 *gen)
{
	IdemFilterSlot *slot = NULL;
	int			i;

	LWLockAcquire(idem_filter_shared->lock, LW_EXCLUSIVE);
	for (i = 0; i < idem_filter_shared->nslots && slot == NULL; i++)
	{
		IdemFilterSlot *s = idem_filter_slot(i);

		if (s->db == MyDatabaseId && s->relid == relid)
			slot = s;
	}
	for (i = 0; i < idem_filter_shared->nslots && slot == NULL; i++)
	{
		IdemFilterSlot *s = idem_filter_slot(i);

		if (pg_atomic_read_u32(&s->state) == FILTER_FREE &&
			!OidIsValid(s->relid))
			slot = s;
	}

	/*
	 * None free: one of another database whose partition's range has ended
	 * (each database's builds give back its own, but one that builds no
	 * more would keep them), or of a database dropped while a backend of it
	 * was still building (DROP DATABASE's hook runs before its backends are
	 * gone).  A reader still looking at such a slot sees its generation
	 * change, and descends the index.
	 */
	for (i = 0; i < idem_filter_shared->nslots && slot == NULL; i++)
	{
		IdemFilterSlot *s = idem_filter_slot(i);

		if (OidIsValid(s->db) && s->db != MyDatabaseId &&
			(idem_filter_shared->builds[i].until <= now ||
			 !SearchSysCacheExists1(DATABASEOID, ObjectIdGetDatum(s->db))))
			slot = s;
	}
	if (slot != NULL)
	{
		IdemFilterBuildState *b =
			&idem_filter_shared->builds[slot - idem_filter_shared->slots];

		idem_filter_free_slot(slot);
		memset(idem_filter_words(slot), 0,
			   (Size) idem_filter_shared->nblocks * FILTER_BLOCK_BYTES);
		pg_atomic_write_u32(&slot->filled, 0);
		slot->db = MyDatabaseId;
		slot->relid = relid;
		b->until = until;
		b->nwaiting = 0;
		pg_write_barrier();
		pg_atomic_write_u32(&slot->state, FILTER_BUILDING);
		pg_memory_barrier();
		*gen = pg_atomic_read_u32(&slot->gen);
	}
	LWLockRelease(idem_filter_shared->lock);
	return slot;
}

/*
 * The slot of partition relid left BUILDING by an earlier build that could
 * not wait for all its inserters, into *build; false if there is none.  The
 * caller holds SHARE UPDATE EXCLUSIVE on the partition, so no other build
 * of it is running: every key inserted since the slot became BUILDING has
 * been added to it (or it would have been invalidated, hence FREE), and its
 * wait list names the inserters from before that may not have added theirs.
 */
static bool
idem_filter_resume(Oid relid, IdemFilterBuild *build)
{
	IdemFilterSlot *slot;

	LWLockAcquire(idem_filter_shared->lock, LW_SHARED);
	slot = idem_filter_find(MyDatabaseId, relid);
	if (slot != NULL && pg_atomic_read_u32(&slot->state) == FILTER_BUILDING)
	{
		build->slot = slot;
		build->gen = pg_atomic_read_u32(&slot->gen);
	}
	else
		slot = NULL;
	LWLockRelease(idem_filter_shared->lock);
	return slot != NULL;
}

/*
 * Put into the wait list of build's slot, just made BUILDING, the
 * transactions that hold RowExclusiveLock on partition relid now: they may
 * have read the slot as FREE and insert without adding their keys.  Later
 * ones see BUILDING.  Nothing is kept if the slot has moved on.
 */
static void
idem_filter_note_inserters(IdemFilterBuild *build, Oid relid)
{
	LOCKTAG		tag;
	VirtualTransactionId *vxids;
	int			n = 0;
	int			i = build->slot - idem_filter_shared->slots;

	SET_LOCKTAG_RELATION(tag, MyDatabaseId, relid);
	vxids = GetLockConflicts(&tag, ShareLock, &n);
	Assert(n <= idem_filter_shared->maxwaiting);
	LWLockAcquire(idem_filter_shared->lock, LW_EXCLUSIVE);
	if (pg_atomic_read_u32(&build->slot->gen) == build->gen)
	{
		n = Min(n, idem_filter_shared->maxwaiting);
		memcpy(idem_filter_shared->waiting +
			   (Size) i * idem_filter_shared->maxwaiting,
			   vxids, sizeof(VirtualTransactionId) * n);
		idem_filter_shared->builds[i].nwaiting = n;
	}
	LWLockRelease(idem_filter_shared->lock);
}

/*
 * Wait for the transactions in the wait list of build's slot to end, as
 * CREATE INDEX CONCURRENTLY waits for those that held a lock when it began,
 * but polling, so that the wait can end at max_wait_ms (negative: no end).
 * True once none is left; else false, the list cut to those still running,
 * for a later build to wait for: new inserters never join it.  True too if
 * the slot has moved on, which the caller finds before marking it READY.
 */
static bool
idem_filter_wait_inserters(IdemFilterBuild *build, int max_wait_ms)
{
	int			i = build->slot - idem_filter_shared->slots;
	VirtualTransactionId *row;
	VirtualTransactionId *vxids;
	TimestampTz deadline = 0;
	int			n;

	row = idem_filter_shared->waiting + (Size) i * idem_filter_shared->maxwaiting;
	vxids = palloc(sizeof(VirtualTransactionId) * idem_filter_shared->maxwaiting);
	LWLockAcquire(idem_filter_shared->lock, LW_SHARED);
	n = pg_atomic_read_u32(&build->slot->gen) == build->gen ?
		idem_filter_shared->builds[i].nwaiting : 0;
	memcpy(vxids, row, sizeof(VirtualTransactionId) * n);
	LWLockRelease(idem_filter_shared->lock);

	if (max_wait_ms >= 0)
		deadline = TimestampTzPlusMilliseconds(GetCurrentTimestamp(),
											   max_wait_ms);
	while (n > 0)
	{
		int			kept = 0;
		int			j;

		/* without an end, a lock wait that pg_locks and deadlock checks see */
		for (j = 0; j < n; j++)
			if (!VirtualXactLock(vxids[j], max_wait_ms < 0))
				vxids[kept++] = vxids[j];
		n = kept;
		if (n == 0 || GetCurrentTimestamp() >= deadline)
			break;
		CHECK_FOR_INTERRUPTS();
		pg_usleep(5000L);
	}

	LWLockAcquire(idem_filter_shared->lock, LW_EXCLUSIVE);
	if (pg_atomic_read_u32(&build->slot->gen) == build->gen)
	{
		memcpy(row, vxids, sizeof(VirtualTransactionId) * n);
		idem_filter_shared->builds[i].nwaiting = n;
	}
	LWLockRelease(idem_filter_shared->lock);
	pfree(vxids);
	return n == 0;
}

/*
 * Fill a BUILDING slot with every tuple of the partition's heap that is
 * not dead to everyone, in-progress ones too: more bits only cost
 * descents.
 */
static void
idem_filter_fill(Relation rel, IdemFilterSlot *slot)
{
	TableScanDesc scan;
	SnapshotData snap;
	HeapTuple	tuple;
	TupleDesc	desc = RelationGetDescr(rel);
	AttrNumber	scope_att = get_attnum(RelationGetRelid(rel), "scope");
	AttrNumber	key_att = get_attnum(RelationGetRelid(rel), "key");

	/*
	 * Every tuple some snapshot may still see (in progress and recently
	 * dead included): a dead one's TOAST may already be gone.
	 */
	InitNonVacuumableSnapshot(snap, GlobalVisTestFor(rel));
	scan = table_beginscan(rel, &snap, 0, NULL);
	while ((tuple = heap_getnext(scan, ForwardScanDirection)) != NULL)
	{
		uint64		hash;

		CHECK_FOR_INTERRUPTS();
		if (idem_filter_tuple_hash(tuple, desc, scope_att, key_att, &hash))
			idem_filter_set(slot, hash);
	}
	table_endscan(scan);
}

/*
 * Free the slots of this database's partitions that are no longer live
 * (their range has ended, or they are gone): nothing looks in them, and
 * the live ones need the room.
 */
static void
idem_filter_reclaim(List *live)
{
	int			i;

	LWLockAcquire(idem_filter_shared->lock, LW_EXCLUSIVE);
	for (i = 0; i < idem_filter_shared->nslots; i++)
	{
		IdemFilterSlot *slot = idem_filter_slot(i);

		if (slot->db == MyDatabaseId && OidIsValid(slot->relid) &&
			!list_member_oid(live, slot->relid))
			idem_filter_release_slot(slot);
	}
	LWLockRelease(idem_filter_shared->lock);
}

/*
 * Make partition rel's filter, or go on with the one an earlier build left
 * BUILDING: wait (at most max_wait_ms, negative: no end) for the inserters
 * from before its slot became BUILDING, add every tuple of the heap, mark
 * it READY.  The caller holds SHARE UPDATE EXCLUSIVE on rel, which keeps
 * its trigger from changing meanwhile, and has checked it
 * (idem_filter_rel_ok).  A build that cannot wait for all the inserters
 * leaves the slot BUILDING with those still running: new inserters add
 * their keys themselves, so a later build needs to wait for the old ones
 * only, and a partition under a steady stream of long transactions gets
 * its filter all the same.
 */
static IdemFilterOutcome
idem_filter_build_one(Relation rel, TimestampTz until, TimestampTz now,
					  int max_wait_ms)
{
	Oid			relid = RelationGetRelid(rel);
	IdemFilterBuild build;
	IdemFilterOutcome outcome = FILTER_BUILT;

	if (!idem_filter_resume(relid, &build))
	{
		build.slot = idem_filter_claim_slot(relid, until, now, &build.gen);
		if (build.slot == NULL)
			return FILTER_NO_SLOT;
		idem_filter_note_inserters(&build, relid);
	}

	PG_ENSURE_ERROR_CLEANUP(idem_filter_build_cleanup, PointerGetDatum(&build));
	{
		if (idem_filter_wait_inserters(&build, max_wait_ms))
			idem_filter_fill(rel, build.slot);
		else
		{
			ereport(NOTICE,
					(errmsg("idempotency filter of partition \"%s\" is not built yet",
							RelationGetRelationName(rel)),
					 errdetail("Transactions that were inserting into it when its build began were still running after %d ms.",
							   max_wait_ms),
					 errhint("A later run finishes the build once they have ended.")));
			outcome = FILTER_DEFERRED;
		}
	}
	PG_END_ENSURE_ERROR_CLEANUP(idem_filter_build_cleanup, PointerGetDatum(&build));
	if (outcome != FILTER_BUILT)
		return outcome;

	LWLockAcquire(idem_filter_shared->lock, LW_EXCLUSIVE);
	if (pg_atomic_read_u32(&build.slot->gen) == build.gen &&
		pg_atomic_read_u32(&build.slot->state) == FILTER_BUILDING)
	{
		pg_write_barrier();
		pg_atomic_write_u32(&build.slot->state, FILTER_READY);
		idem_filter_remember(build.slot, build.gen);
	}
	else
		outcome = FILTER_DEFERRED;
	LWLockRelease(idem_filter_shared->lock);
	return outcome;
}

/*
 * Say that a build left partition relname without a filter for want of a
 * slot (relname NULL: it lacked none).  To the caller every time; in the
 * server log once, until a build of the database that logged it finds every
 * slot it needs again, so that maintenance every minute does not repeat it.
 */
static void
idem_filter_report_slots(const char *relname)
{
	bool		first = false;

	LWLockAcquire(idem_filter_shared->lock, LW_EXCLUSIVE);
	if (relname != NULL && !OidIsValid(idem_filter_shared->starved_db))
	{
		idem_filter_shared->starved_db = MyDatabaseId;
		first = true;
	}
	else if (relname == NULL && idem_filter_shared->starved_db == MyDatabaseId)
		idem_filter_shared->starved_db = InvalidOid;
	LWLockRelease(idem_filter_shared->lock);
	if (relname == NULL)
		return;

	if (first)
		ereport(LOG,
				(errmsg("no idempotency filter slot left for partition \"%s\" of database \"%s\"",
						relname, get_database_name(MyDatabaseId)),
				 errdetail("All %d slots set by idempotency.filters hold filters of live partitions; every database of the server takes its slots from them.",
						   idem_filter_shared->nslots),
				 errhint("Raise idempotency.filters and restart the server.")));
	ereport(NOTICE,
			(errmsg("no idempotency filter slot left for partition \"%s\"",
					relname),
			 errhint("Raise idempotency.filters and restart the server.")));
}

/*
 * idempotency.build_filters(max_wait interval DEFAULT NULL): build the
 * filters of the live partitions (and DEFAULT) that have none READY, while
 * slots last; returns how many were made READY.  Only the owner of
 * idempotency.records, never during recovery.
 *
 * A partition is skipped, for a later run to build, when another session
 * holds a lock on it that conflicts with SHARE UPDATE EXCLUSIVE (a build,
 * DDL, VACUUM), and when its scope or key is generated or its trigger is
 * missing, not ENABLE ALWAYS or not the last BEFORE ROW trigger.  One whose
 * build began with transactions inserting into it that are still running
 * after max_wait (NULL: wait for them) is left BUILDING, and a later run
 * goes on from there (idem_filter_build_one).  idem_maintain() calls it
 * with maintenance_lock_timeout, so that a long transaction delays a
 * filter, never the partition work.
 */
Datum
idem_build_filters(PG_FUNCTION_ARGS)
{
	Relation	parent;
	List	   *parts;
	ListCell   *lc;
	int32		built = 0;
	int			max_wait_ms = -1;
	TimestampTz now;
	char	   *starved_at = NULL;

	if (idem_filter_shared == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idempotency filters are not enabled"),
				 errhint("Add idempotency to shared_preload_libraries, set idempotency.filters above zero, and restart the server.")));
	if (RecoveryInProgress())
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("idempotency filters cannot be built during recovery")));
	if (IsolationUsesXactSnapshot())
		ereport(ERROR,
				(errcode(ERRCODE_ACTIVE_SQL_TRANSACTION),
				 errmsg("idempotency filters can only be built at isolation level READ COMMITTED")));
	if (!PG_ARGISNULL(0))
	{
		Interval   *wait = PG_GETARG_INTERVAL_P(0);
		double		ms;

		ms = ((double) wait->time / 1000.0 +
			  ((double) wait->month * DAYS_PER_MONTH + wait->day) *
			  (double) SECS_PER_DAY * 1000.0);
		if (ms < 0)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("max_wait must not be negative")));
		max_wait_ms = ms >= INT_MAX ? -1 : (int) ms;
	}

	parent = idem_records_open();
	if (!idem_class_ownercheck(RelationGetRelid(parent), GetUserId()))
		ereport(ERROR,
				(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
				 errmsg("permission denied to build idempotency filters"),
				 errdetail("Only the owner of table \"idempotency.records\" may build them.")));

	now = GetCurrentTimestamp();
	parts = idem_records_live_partitions(parent, now);
	idem_filter_reclaim(parts);
	idem_filter_made_room();
	foreach(lc, parts)
	{
		Oid			relid = lfirst_oid(lc);
		IdemFilterSlot *slot;
		Relation	rel;
		const char *why;
		IdemFilterOutcome outcome;

		slot = idem_filter_find(MyDatabaseId, relid);
		if (slot != NULL && pg_atomic_read_u32(&slot->state) == FILTER_READY)
			continue;

		/*
		 * SHARE UPDATE EXCLUSIVE conflicts with trigger DDL and other builds,
		 * not with inserts.  Never wait for it: whoever holds it may be
		 * waiting for us.
		 */
		if (!ConditionalLockRelationOid(relid, ShareUpdateExclusiveLock))
			continue;
		rel = try_relation_open(relid, NoLock);
		if (rel == NULL)
		{
			UnlockRelationOid(relid, ShareUpdateExclusiveLock);
			continue;
		}
		why = idem_filter_rel_ok(rel);
		if (why != NULL)
		{
			ereport(NOTICE,
					(errmsg("no idempotency filter for partition \"%s\"",
							RelationGetRelationName(rel)),
					 errdetail_internal("%s", why)));
			relation_close(rel, ShareUpdateExclusiveLock);
			continue;
		}

		outcome = idem_filter_build_one(rel,
										idem_records_partition_end(parent, relid),
										now, max_wait_ms);
		if (outcome == FILTER_NO_SLOT)
		{
			starved_at = pstrdup(RelationGetRelationName(rel));
			relation_close(rel, ShareUpdateExclusiveLock);
			break;
		}
		if (outcome == FILTER_BUILT)
			built++;
		relation_close(rel, NoLock);
	}
	idem_filter_report_slots(starved_at);
	idem_records_close(parent);
	PG_RETURN_INT32(built);
}

/*
 * idempotency.idem_filters(): the slots of this database, for operators
 * and tests: partition, state, size in bytes, bits set, and the number of
 * keys that many bits suggest.
 */
Datum
idem_filters_sql(PG_FUNCTION_ARGS)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	int			i;

	InitMaterializedSRF(fcinfo, 0);
	if (idem_filter_shared == NULL)
		return (Datum) 0;

	for (i = 0; i < idem_filter_shared->nslots; i++)
	{
		IdemFilterSlot *slot = idem_filter_slot(i);
		uint32		state = pg_atomic_read_u32(&slot->state);
		Oid			relid = slot->relid;
		Datum		values[5];
		bool		nulls[5] = {0};
		uint64		bits = 0;
		double		m;
		Size		w;
		Size		nwords;

		if (slot->db != MyDatabaseId || !OidIsValid(relid) ||
			state == FILTER_FREE)
			continue;
		nwords = (Size) idem_filter_shared->nblocks * FILTER_BLOCK_WORDS;
		for (w = 0; w < nwords; w++)
			bits += pg_popcount32(pg_atomic_read_u32(&idem_filter_words(slot)[w]));
		m = (double) nwords * 32;

		values[0] = ObjectIdGetDatum(relid);
		values[1] = CStringGetTextDatum(state == FILTER_READY ? "ready" : "building");
		values[2] = Int64GetDatum((int64) idem_filter_shared->nblocks * FILTER_BLOCK_BYTES);
		values[3] = Int64GetDatum((int64) bits);
		values[4] = Int64GetDatum(bits >= m ? PG_INT64_MAX :
								  (int64) rint(-(m / FILTER_K) * log(1.0 - bits / m)));
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	}
	return (Datum) 0;
}
