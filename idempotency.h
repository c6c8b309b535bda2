/*-------------------------------------------------------------------------
 *
 * idempotency.h
 *		Declarations shared by the idempotency extension's C files.
 *
 * The C files, each calling only files listed after it (and stats.c,
 * which every file may count in, and which calls none of them):
 *
 *	idempotency.c	the SQL contract: _PG_init, settings, argument checks,
 *					the SQL-callable functions and idem_acquire's protocol
 *	token.c			one-time tokens: made, stored, spent
 *	claim.c			claim ids, owner sessions of session-bound claims,
 *					claim and attempt errors
 *	keylock.c		key locks, waits, and the reads made under the key lock
 *	reqhash.c		the request hash (SHA-256 of canonical jsonb)
 *	filterbuild.c	what keeps the filters true: their trigger, builds,
 *					invalidations (object_access_hook, transaction callbacks)
 *	records.c		storage access to idempotency.records, without SQL
 *	filter.c		per-partition known-absent filters in shared memory:
 *					the slots and the lock-free reads of the hot path
 *	worker.c		background workers that build the filters
 *	stats.c			statistics in shared memory
 *
 * IDENTIFICATION
 *	  idempotency.h
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_H
#define IDEMPOTENCY_H

#include "access/htup.h"
#include "datatype/timestamp.h"
#include "nodes/pg_list.h"
#include "port/atomics.h"
#include "portability/instr_time.h"
#include "storage/itemptr.h"
#include "storage/lock.h"
#include "utils/jsonb.h"
#include "utils/relcache.h"
#include "utils/snapshot.h"
#include "utils/uuid.h"

/*
 * The live record of a (scope, key), as a probe found it.  Pass-by-reference
 * values are copies in the caller's memory context, detoasted.  partoid and
 * tid say where the row version is, for idem_records_update/_delete, and are
 * valid while the caller holds the key lock and waitxid is invalid.
 */
typedef struct IdemRecord
{
	bool		found;
	TransactionId waitxid;		/* with a dirty snapshot: the transaction
								 * still inserting, updating or deleting this
								 * version, else InvalidTransactionId */
	bool		wait_insert;	/* waitxid is inserting it (a claim not yet
								 * committed), not updating or deleting it */
	Oid			partoid;
	ItemPointerData tid;
	TransactionId xmin;
	bool		completed;
	bool		hash_null;
	Datum		request_hash;
	bool		status_null;
	int32		response_status;
	bool		body_null;
	Datum		response_body;
	int32		attempt;
	TimestampTz created_at;
	bool		locked_until_null;
	TimestampTz locked_until;
	bool		completed_at_null;
	TimestampTz completed_at;
	TimestampTz expires_at;
	/* 1.1 columns; NULL (true) for records made by 1.0 or at 1.0 */
	bool		claim_null;
	pg_uuid_t	claim;
	bool		owner_null;		/* not session-bound */
	int32		owner_pid;
	TimestampTz owner_start;
	bool		is_token;		/* a one-time token, not a key */
	/* 1.2 columns; NULL (true) where the table does not have them yet */
	bool		phase_null;
	Datum		phase;			/* text: the last checkpoint's phase */
	bool		state_null;
	Datum		state;			/* jsonb: the last checkpoint's state */
	bool		headers_null;
	Datum		response_headers;	/* jsonb object, names in lower case */
	bool		trace_null;
	Datum		trace;			/* text: the trace of the current claim */
	TimestampTz shadow_expires; /* see idem_records_find; 0 if none */
} IdemRecord;

/*
 * The 1.1 columns of a claim being written: its claim id and, for a
 * session-bound claim, the owner session.  Writers made by the 1.0 entry
 * points pass NULL instead and leave those columns NULL.
 */
typedef struct IdemClaim
{
	pg_uuid_t	claim;
	bool		session_bound;
	int32		owner_pid;
	TimestampTz owner_start;
	text	   *trace;			/* 1.2: the claiming request's trace, or NULL */
} IdemClaim;

/*
 * What a record is looked up and locked by: its scope and key, and its
 * kind (a one-time token's record, with the token as its key, or an
 * idempotency key's); the two kinds never see each other.
 */
typedef struct IdemKey
{
	text	   *scope;
	text	   *key;
	bool		token;
} IdemKey;

/*
 * Where a transaction wrote a new claim: a hint for reading it again in the
 * same transaction (idem_records_fetch checks it).
 */
typedef struct IdemPlace
{
	TransactionId xid;			/* top-level transaction that wrote it */
	Oid			partoid;
	ItemPointerData tid;
} IdemPlace;

/* keylock.c: key locks, waits, and the reads under the key lock */

/*
 * The time a call spends waiting for other sessions, for the statistics
 * (waits, wait_time).
 */
typedef struct IdemWaitClock
{
	bool		waited;
	instr_time	total;
} IdemWaitClock;

/*
 * Memory of the loops that wait.  Each pass of such a loop reads the record
 * again, and a read allocates a few kilobytes (more with many partitions);
 * a duplicate of a committed processing claim polls every 50 ms for as long
 * as idempotency.wait_timeout, which any user may raise.  So that a wait of
 * any length runs in flat memory, every pass after the first works in a
 * child of the caller's memory context that the next pass resets.  The
 * first pass, all that a call which does not wait ever runs, works in the
 * caller's context and pays nothing for this.
 */
typedef struct IdemPasses
{
	MemoryContext caller;		/* the caller's context, to return to */
	MemoryContext pass;			/* the passes' context, made for pass 2 */
	int			npasses;		/* passes begun so far */
} IdemPasses;


/* What idem_lock_and_read came to; see there */
typedef enum IdemReadResult
{
	IDEM_READ_LOCKED,
	IDEM_READ_LOCK_TIMEOUT,
	IDEM_READ_WRITER_TIMEOUT,
	IDEM_READ_WRITER_SETTLES
} IdemReadResult;

/*
 * The state of one call's lock-and-read loop (idem_key_read_init,
 * idem_lock_and_read, idem_key_read_end).
 */
typedef struct IdemKeyRead
{
	Relation	parent;			/* idempotency.records, open */
	IdemKey		key;
	LOCKTAG		tag;			/* the key lock */
	TimestampTz deadline;		/* DT_NOEND: no timeout of ours */
	int64		hint_ttl;		/* where to look first, see there */
	const IdemPlace *place;		/* this backend's last claim, or NULL */
	bool		held;			/* the key lock is held for the first pass
								 * (idem_key_read_try_lock) */

	/*
	 * Optional: does a version that another transaction is still writing
	 * already answer the caller?  Then idem_lock_and_read does not wait.
	 */
	bool		(*writer_settles) (const IdemRecord *rec, void *arg);
	void	   *settles_arg;

	IdemPasses	passes;
	IdemWaitClock clock;
	TimestampTz now;			/* the clock when kr->rec was read */
	IdemRecord	rec;			/* what the last read found */
} IdemKeyRead;

extern LockAcquireResult idem_lock(const LOCKTAG *tag, LOCKMODE mode,
								   bool dontWait);
extern void idem_unlock(const LOCKTAG *tag, LOCKMODE mode);
extern void idem_wait_clock_count(const IdemWaitClock *clock);
extern bool idem_key_read_try_lock(IdemKeyRead *kr);
extern void idem_read_mvcc(Relation parent, const IdemKey *k,
						   TimestampTz now, TimestampTz hint, IdemRecord *rec);
extern void idem_key_read_init(IdemKeyRead *kr, Relation parent,
							   const IdemKey *k, TimestampTz deadline,
							   int64 hint_ttl, const IdemPlace *place);
extern IdemReadResult idem_lock_and_read(IdemKeyRead *kr);
extern void idem_key_read_sleep(IdemKeyRead *kr, long ms);
extern void idem_key_read_end(IdemKeyRead *kr);

/* claim.c: claim ids, owner sessions, claim and attempt errors */
extern void idem_hold_owner_lock(void);
extern bool idem_owner_is_me(const IdemRecord *rec);
extern bool idem_owner_alive(const IdemRecord *rec);
extern void idem_new_claim(IdemClaim *claim, bool session_bound);
extern void idem_check_claim(text *key, bool given, const pg_uuid_t *claim,
							 const IdemRecord *rec);
extern void idem_attempt_error(text *key, int32 given, const IdemRecord *rec);
extern void idem_attempt_limit_error(text *key, const IdemRecord *rec);

/* token.c: one-time tokens */
extern text *idem_token_make(void);
extern void idem_token_store(Relation parent, text *scope, text *token,
							 int64 ttl);
extern bool idem_token_spend(Relation parent, text *scope, text *token,
							 int wait_timeout_ms, int64 hint_ttl);

/*
 * The values of a record being inserted (idem_records_insert), beside its
 * key: a processing record at attempt 1, or an unconsumed token.
 */
typedef struct IdemNewRecord
{
	bytea	   *request_hash;	/* or NULL: no payload check (tokens) */
	TimestampTz created_at;
	TimestampTz locked_until;	/* not written for a token */
	TimestampTz expires_at;
	const IdemClaim *claim;		/* the 1.1 columns, or NULL */
} IdemNewRecord;

/* records.c */
extern void idem_records_init(void);
extern Relation idem_records_open(void);
extern Relation idem_records_open_unchecked(void);
extern bool idem_records_have_claims(void);
extern bool idem_records_have_checkpoints(void);
extern void idem_records_close(Relation parent);
extern void idem_records_find(Relation parent, const IdemKey *k,
							  TimestampTz now, TimestampTz hint,
							  Snapshot snapshot, IdemRecord *rec);
extern bool idem_records_find_unlocked(Relation parent, const IdemKey *k,
									   TimestampTz now, TimestampTz hint,
									   Snapshot snapshot, bool everywhere,
									   IdemRecord *rec);
extern void idem_records_insert(Relation parent, const IdemKey *k,
								const IdemNewRecord *nr, IdemPlace *place);
extern bool idem_records_fetch(Relation parent, const IdemPlace *place,
							   const IdemKey *k, TimestampTz now,
							   IdemRecord *rec);
extern void idem_records_takeover(Relation parent, const IdemRecord *rec,
								  const IdemKey *k, int32 attempt,
								  TimestampTz locked_until,
								  bytea *request_hash,
								  const IdemClaim *claim);
extern void idem_records_extend(Relation parent, const IdemRecord *rec,
								const IdemKey *k, TimestampTz locked_until);
extern void idem_records_complete(Relation parent, const IdemRecord *rec,
								  const IdemKey *k, int32 status,
								  Datum body, bool body_null,
								  Datum headers, bool headers_null,
								  TimestampTz now);
extern void idem_records_checkpoint(Relation parent, const IdemRecord *rec,
									const IdemKey *k, text *phase,
									Datum state, bool state_null);
extern void idem_records_consume(Relation parent, const IdemRecord *rec,
								 const IdemKey *k, TimestampTz now);
extern void idem_records_delete(Relation parent, const IdemRecord *rec);
extern void idem_records_forget(Relation parent, const IdemRecord *rec);
extern List *idem_records_live_partitions(Relation parent, TimestampTz now);
extern TimestampTz idem_records_partition_end(Relation parent, Oid relid);

/* reqhash.c */
#define SHA256_DIGEST_BYTES		32
extern void idem_sha256(const uint8 *data, size_t len, uint8 *digest);
extern bytea *idem_hash_jsonb(Jsonb *jb);
extern bool idem_hash_mismatch(const IdemRecord *rec, const bytea *hash);

/* filter.c: per-partition known-absent filters (preloaded only) */
extern void idem_filter_init(void);
extern bool idem_filter_enabled(void);
extern bool idem_filter_usable(void);
extern uint64 idem_filter_hash(text *scope, text *key);
typedef enum IdemFilterAnswer
{
	IDEM_FILTER_UNKNOWN,		/* no READY filter for the partition */
	IDEM_FILTER_MAYBE,			/* the filter has every bit of the key */
	IDEM_FILTER_ABSENT			/* the key is certainly not in the partition */
} IdemFilterAnswer;
extern IdemFilterAnswer idem_filter_check(Oid relid, uint64 hash, int *hint);
extern void idem_filter_prefetch(Oid relid, uint64 hash, int *hint);
extern void idem_filter_note(Oid relid, uint64 hash);
extern void idem_filter_invalidate(Oid db, Oid relid);

/* filter.c: the slots, for their builds (filterbuild.c) */
typedef struct IdemFilterSlot IdemFilterSlot;
extern bool idem_filter_configured(void);
extern int	idem_filter_nslots(void);
extern int	idem_filter_max_waiting(void);
extern bool idem_filter_has_slot(Oid relid);
extern bool idem_filter_is_ready(Oid relid);
extern bool idem_filter_is_current(IdemFilterSlot *slot, uint32 gen);
extern IdemFilterSlot *idem_filter_claim(Oid relid, TimestampTz until,
										 TimestampTz now, uint32 *gen);
extern IdemFilterSlot *idem_filter_building(Oid relid, uint32 *gen);
extern void idem_filter_add(IdemFilterSlot *slot, uint64 hash);
extern int	idem_filter_get_waiting(IdemFilterSlot *slot, uint32 gen,
									VirtualTransactionId *vxids);
extern void idem_filter_put_waiting(IdemFilterSlot *slot, uint32 gen,
									const VirtualTransactionId *vxids, int n);
extern bool idem_filter_mark_ready(IdemFilterSlot *slot, uint32 gen);
extern void idem_filter_release_if(IdemFilterSlot *slot, uint32 gen);
extern void idem_filter_reclaim(List *live);
extern bool idem_filter_note_starved(bool starved);

/* filterbuild.c: what keeps the filters true (preloaded only) */
extern void idem_filterbuild_init(void);

/* shard.c: a shard's check of the routers' layout (idempotency_proxy) */
#define ERRCODE_IDEM_LAYOUT_REFUSED	MAKE_SQLSTATE('5','5','R','0','1')
extern void idem_shard_init(void);
extern int32 idem_shard_key_hash(text *scope, text *key);
extern bool idem_shard_refusal(bool layout_null, int64 layout, int32 hash,
							   bool fresh, char **message,
							   const char **detail);

/* worker.c: filters built at server start and after a crash (preloaded) */
extern void idem_worker_init(bool launch);
extern bool idem_worker_may_launch(void);
extern void idem_worker_launch(void);

/* Largest key and scope, in bytes (idempotency.c checks, filter.c relies on it) */
#define IDEM_MAX_KEY_BYTES		255

/*
 * The statistics counted per backend (stats.c): the counters, then the
 * buckets of the acquire-duration histogram, not cumulative, the last one
 * for calls longer than the largest bound.
 */
#define IDEM_NBUCKETS	17

typedef enum IdemStat
{
	IDEM_STAT_ACQUIRED,			/* acquired: new claims and takeovers */
	IDEM_STAT_TAKEN_OVER,
	IDEM_STAT_REPLAYED,
	IDEM_STAT_MISMATCHED,
	IDEM_STAT_IN_PROGRESS,
	IDEM_STAT_COMPLETED,
	IDEM_STAT_RELEASED,
	IDEM_STAT_WAITS,			/* calls that waited for another session */
	IDEM_STAT_WAIT_USECS,		/* how long they waited, in all */
	IDEM_STAT_TOKENS_ISSUED,
	IDEM_STAT_TOKENS_CONSUMED,
	IDEM_STAT_ACQUIRE_NSECS,
	IDEM_STAT_BUCKET0,
	/* 1.2: after the buckets, so that a file saved by 1.1 still reads */
	IDEM_STAT_FORGOTTEN = IDEM_STAT_BUCKET0 + IDEM_NBUCKETS,
	IDEM_NSTATS
} IdemStat;

/* stats.c */
extern PGDLLIMPORT pg_atomic_uint64 *idem_my_stats;
extern PGDLLIMPORT bool idem_stats_never;
extern void idem_stats_init(void);
extern bool idem_stats_attach(void);
extern void idem_stats_acquire_time(const instr_time *start);

/*
 * Whether this backend counts: the library was preloaded and the backend's
 * slot is bound to its database (bound here on first use).
 */
static inline bool
idem_stats_on(void)
{
	return likely(idem_my_stats != NULL) ||
		(!idem_stats_never && idem_stats_attach());
}

/*
 * Add n to one of this backend's counters.  Only this backend writes its
 * slot, so a plain load and store do; readers see either value.
 */
static inline void
idem_stats_add(IdemStat stat, uint64 n)
{
	if (idem_stats_on())
		pg_atomic_write_u64(&idem_my_stats[stat],
							pg_atomic_read_u64(&idem_my_stats[stat]) + n);
}

#endif							/* IDEMPOTENCY_H */
