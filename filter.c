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
 * cost the index descent that would have been made anyway.  What keeps it
 * (every insert notes its key first, the builds, the invalidations) is in
 * filterbuild.c; this file holds the slots, their bits and their states,
 * and the lock-free reads of the hot path.  It calls worker.c only, to
 * start the builds after a crash.
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

#include "access/twophase.h"
#include "access/xact.h"
#include "access/xlog.h"
#include "catalog/pg_database.h"
#include "common/hashfn.h"
#include "fmgr.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "port/atomics.h"
#include "port/pg_bitutils.h"
#include "storage/ipc.h"
#include "storage/lwlock.h"
#include "storage/shmem.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/syscache.h"
#include "utils/timestamp.h"

#include "idempotency.h"

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
 * running, their ids in the slot's row of the wait array; -1 until the
 * build that claimed the slot has taken the list (a build that failed
 * before that leaves nothing another may go on from).  A build that cannot
 * wait for all of them leaves the slot BUILDING with that list, and a later
 * build goes on from it.
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

/*
 * GUC variables.  The default number of slots serves four databases with
 * the default partitioning (max_ttl / partition_interval + 3, plus DEFAULT:
 * 11 live partitions each) and a few spare: every database of the server
 * takes its slots from the same ones, and a database left without any
 * pays an index descent per live partition for every new key.  A slot's
 * bit array is touched only once a filter is built in it.
 */
static int	idem_filters = 48;
static int	idem_filter_size = 1024;	/* kB */
static bool idem_use_filters = true;

/* Saved hook values */
static shmem_request_hook_type prev_shmem_request_hook = NULL;
static shmem_startup_hook_type prev_shmem_startup_hook = NULL;

/* The shared state; NULL unless preloaded with idempotency.filters > 0 */
static IdemFilterShared *idem_filter_shared = NULL;

static void idem_filter_shmem_request(void);
static void idem_filter_shmem_startup(void);

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
							48, 0, 4096,
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
	if (unlikely(pg_atomic_unlocked_test_flag(&idem_filter_shared->launched)) &&
		idem_worker_may_launch() &&
		pg_atomic_test_set_flag(&idem_filter_shared->launched))
		idem_worker_launch();
	return true;
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
void
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

/* ----------------------------------------------------------------
 * The slots, for their builds (filterbuild.c)
 *
 * A build names its slot by the slot and the generation it had when the
 * build took it: every call below does nothing (or answers false) once the
 * slot has moved on, invalidated or taken for another partition.
 * ----------------------------------------------------------------
 */

/*
 * Will this server have filters?  For _PG_init, before shared memory
 * exists: preloaded, with idempotency.filters above zero.
 */
bool
idem_filter_configured(void)
{
	return process_shared_preload_libraries_in_progress && idem_filters > 0;
}

/* The number of slots */
int
idem_filter_nslots(void)
{
	return idem_filter_shared->nslots;
}

/* How many transactions a slot's wait list can hold */
int
idem_filter_max_waiting(void)
{
	return idem_filter_shared->maxwaiting;
}

/*
 * Has partition relid of this database a slot, in any state?  Without the
 * lock: a hint, for callers that then take it (idem_filter_invalidate).
 */
bool
idem_filter_has_slot(Oid relid)
{
	return idem_filter_shared != NULL &&
		idem_filter_find(MyDatabaseId, relid) != NULL;
}

/* Has partition relid of this database a READY filter?  A hint, as above. */
bool
idem_filter_is_ready(Oid relid)
{
	IdemFilterSlot *slot = idem_filter_find(MyDatabaseId, relid);

	return slot != NULL && pg_atomic_read_u32(&slot->state) == FILTER_READY;
}

/* Is slot still at generation gen? */
bool
idem_filter_is_current(IdemFilterSlot *slot, uint32 gen)
{
	return pg_atomic_read_u32(&slot->gen) == gen;
}

/* Add a key's bits to a BUILDING slot (a build's fill) */
void
idem_filter_add(IdemFilterSlot *slot, uint64 hash)
{
	idem_filter_set(slot, hash);
}

/*
 * Take a slot for (MyDatabaseId, relid), whose range ends at until, and
 * mark it BUILDING with its bits cleared and its wait list empty: the
 * partition's own slot if it has one, else a free one, else one that no
 * call looks in any more.  NULL when none is left; else the slot, with its
 * generation in *gen, which every later call about this build passes.
 */
IdemFilterSlot *
idem_filter_claim(Oid relid, TimestampTz until, TimestampTz now,
				  uint32 *gen)
{
	IdemFilterSlot *slot = NULL;
	List	   *gone = NIL;
	int			i;

	/* the databases of other slots that have been dropped, without the lock */
	for (i = 0; i < idem_filter_shared->nslots; i++)
	{
		Oid			db = idem_filter_slot(i)->db;

		if (OidIsValid(db) && db != MyDatabaseId &&
			!list_member_oid(gone, db) &&
			!SearchSysCacheExists1(DATABASEOID, ObjectIdGetDatum(db)))
			gone = lappend_oid(gone, db);
	}

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
	 * gone; gone lists those, looked up before the lock was taken, since a
	 * catalog lookup may wait for a lock).  A reader still looking at such
	 * a slot sees its generation change, and descends the index.
	 */
	for (i = 0; i < idem_filter_shared->nslots && slot == NULL; i++)
	{
		IdemFilterSlot *s = idem_filter_slot(i);

		if (OidIsValid(s->db) && s->db != MyDatabaseId &&
			(idem_filter_shared->builds[i].until <= now ||
			 list_member_oid(gone, s->db)))
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
		b->nwaiting = -1;
		pg_write_barrier();
		pg_atomic_write_u32(&slot->state, FILTER_BUILDING);
		pg_memory_barrier();
		*gen = pg_atomic_read_u32(&slot->gen);
	}
	LWLockRelease(idem_filter_shared->lock);
	list_free(gone);
	return slot;
}

/*
 * The slot of partition relid that an earlier build left BUILDING, because
 * it could not wait for all its inserters, with its generation in *gen; NULL
 * if there is none.  The caller holds SHARE UPDATE EXCLUSIVE on the
 * partition, so no other build of it is running: every key inserted since
 * the slot became BUILDING has been added to it (or it would have been
 * invalidated, hence FREE), and its wait list names the inserters from
 * before that may not have added theirs.
 */
IdemFilterSlot *
idem_filter_building(Oid relid, uint32 *gen)
{
	IdemFilterSlot *slot;

	LWLockAcquire(idem_filter_shared->lock, LW_SHARED);
	slot = idem_filter_find(MyDatabaseId, relid);
	if (slot != NULL && pg_atomic_read_u32(&slot->state) == FILTER_BUILDING &&
		idem_filter_shared->builds[slot - idem_filter_shared->slots].nwaiting >= 0)
		*gen = pg_atomic_read_u32(&slot->gen);
	else
		slot = NULL;
	LWLockRelease(idem_filter_shared->lock);
	return slot;
}

/*
 * Copy the wait list of the build (slot, gen) into vxids, room for
 * idem_filter_max_waiting() entries; returns its length (0 if the slot has
 * moved on, -1 if no list was ever put).
 */
int
idem_filter_get_waiting(IdemFilterSlot *slot, uint32 gen,
						VirtualTransactionId *vxids)
{
	int			i = slot - idem_filter_shared->slots;
	int			n = 0;

	LWLockAcquire(idem_filter_shared->lock, LW_SHARED);
	if (pg_atomic_read_u32(&slot->gen) == gen)
	{
		n = idem_filter_shared->builds[i].nwaiting;
		if (n > 0)
			memcpy(vxids, idem_filter_shared->waiting +
				   (Size) i * idem_filter_shared->maxwaiting,
				   sizeof(VirtualTransactionId) * n);
	}
	LWLockRelease(idem_filter_shared->lock);
	return n;
}

/* Make vxids[0 .. n - 1] the wait list of the build (slot, gen) */
void
idem_filter_put_waiting(IdemFilterSlot *slot, uint32 gen,
						const VirtualTransactionId *vxids, int n)
{
	int			i = slot - idem_filter_shared->slots;

	Assert(n >= 0 && n <= idem_filter_shared->maxwaiting);
	LWLockAcquire(idem_filter_shared->lock, LW_EXCLUSIVE);
	if (pg_atomic_read_u32(&slot->gen) == gen)
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
 * Mark the build (slot, gen) READY: its bits hold every key of the
 * partition.  False if the slot has moved on or is not BUILDING.
 */
bool
idem_filter_mark_ready(IdemFilterSlot *slot, uint32 gen)
{
	bool		ready = false;

	LWLockAcquire(idem_filter_shared->lock, LW_EXCLUSIVE);
	if (pg_atomic_read_u32(&slot->gen) == gen &&
		pg_atomic_read_u32(&slot->state) == FILTER_BUILDING)
	{
		pg_write_barrier();
		pg_atomic_write_u32(&slot->state, FILTER_READY);
		ready = true;
	}
	LWLockRelease(idem_filter_shared->lock);
	return ready;
}

/* Free the slot of the build (slot, gen), if it is still that build's */
void
idem_filter_release_if(IdemFilterSlot *slot, uint32 gen)
{
	LWLockAcquire(idem_filter_shared->lock, LW_EXCLUSIVE);
	if (pg_atomic_read_u32(&slot->gen) == gen)
		idem_filter_release_slot(slot);
	LWLockRelease(idem_filter_shared->lock);
}

/*
 * Free the slots of this database's partitions that are no longer live
 * (their range has ended, or they are gone): nothing looks in them, and
 * the live ones need the room.
 */
void
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
 * Note whether a build of this database lacked a slot; true if it did and
 * should say so in the server log: once, until a build of the database
 * that said it lacks none again.
 */
bool
idem_filter_note_starved(bool starved)
{
	bool		first = false;

	LWLockAcquire(idem_filter_shared->lock, LW_EXCLUSIVE);
	if (starved && !OidIsValid(idem_filter_shared->starved_db))
	{
		idem_filter_shared->starved_db = MyDatabaseId;
		first = true;
	}
	else if (!starved && idem_filter_shared->starved_db == MyDatabaseId)
		idem_filter_shared->starved_db = InvalidOid;
	LWLockRelease(idem_filter_shared->lock);
	return first;
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
