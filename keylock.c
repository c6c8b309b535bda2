/*-------------------------------------------------------------------------
 *
 * keylock.c
 *		The key lock and the reads made under it: how a record's one live
 *		version is kept unique, and how a call waits for another one.
 *
 * Uniqueness.  A partitioned table cannot carry a unique index on (scope,
 * key) without the partition key, so uniqueness of the live record is this
 * module's job, done the way a unique index does it.  Every write of a
 * (scope, key) -- claim, takeover, complete, release, extend, token consume
 * -- is made while holding an ExclusiveLock on a lock tag derived from
 * (database, hash of scope and key), after a read of the live partitions
 * with a dirty snapshot, which sees committed versions and also the
 * versions other transactions are still writing.  If another transaction is
 * writing the record, we let go of the key lock, wait for that transaction
 * to end, and read again; otherwise the caller writes and lets go of the key
 * lock at once.  The key lock thus covers only the read and the write after
 * it: a transaction that claims many keys holds no lock per key, and a
 * duplicate of a claim made in an open transaction waits on that
 * transaction itself.  The tag is an advisory-type tag whose fourth field is
 * IDEM_LOCKTAG_CLASS (IDEM_TOKEN_LOCKTAG_CLASS for a one-time token); the
 * user-facing pg_advisory_* functions only ever use 1 or 2 there, so they
 * cannot collide with ours.  A hash collision between two keys only makes
 * them take turns.  That loop -- lock, dirty read, wait for the writer, read
 * again -- is idem_lock_and_read, the one every writer goes through.
 *
 * Waiting.  A duplicate of a claim still running waits up to
 * idempotency.wait_timeout.  While the claiming transaction is open, the
 * wait is a real heavyweight-lock wait on that transaction (no CPU, woken at
 * once when it ends, visible in pg_locks, covered by deadlock detection);
 * its timeout is implemented with PostgreSQL's own lock_timeout machinery
 * inside a subtransaction, entered only when there is something to wait
 * for.  Once the claim is committed as 'processing' (lease mode, across
 * transactions) there is no transaction to wait for, so the duplicate sleeps
 * on its latch in short, growing steps (idem_key_read_sleep) and reads
 * again.  Both waits answer query cancel, statement_timeout and
 * lock_timeout.  Every pass of a wait after the first works in a memory
 * context that the next pass resets, so a wait of any length runs in flat
 * memory.  The waits are timed for the statistics (IdemWaitClock); a call
 * that does not wait reads no clock for them.
 *
 * Snapshots.  Under REPEATABLE READ or SERIALIZABLE, the record we act on
 * must also be what the transaction's snapshot sees; if it was claimed,
 * completed, taken over or released by a transaction that committed after
 * the snapshot was taken, acting on it or ignoring it would break either
 * isolation or idempotency, so idem_lock_and_read raises
 * serialization_failure.
 *
 * Locking rules.  The key lock is a transaction lock held by the current
 * transaction level's resource owner, taken only by idem_lock_and_read and
 * let go of by its caller (idem_unlock) right after the write; it is never
 * held across a wait.  Reads go through records.c, which takes its own
 * relation locks; this file calls nothing that calls it back.
 *
 * IDENTIFICATION
 *	  keylock.c
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <limits.h>

#include "access/subtrans.h"
#include "access/xact.h"
#include "common/hashfn.h"
#include "miscadmin.h"
#include "pgstat.h"
#include "storage/latch.h"
#include "storage/lmgr.h"
#include "storage/proc.h"
#include "storage/procarray.h"
#include "utils/builtins.h"
#include "utils/datum.h"
#include "utils/memutils.h"
#include "utils/snapmgr.h"
#include "utils/timeout.h"
#include "utils/timestamp.h"

#include "idempotency.h"

/* locktag_field4 of our key locks; user advisory locks use 1 and 2 */
#define IDEM_LOCKTAG_CLASS		0x4944

/* locktag_field4 of the lock of a one-time token */
#define IDEM_TOKEN_LOCKTAG_CLASS	0x4946


/* ----------------------------------------------------------------
 * Locks and waits
 * ----------------------------------------------------------------
 */

/*
 * Build the lock tag of a record's strings in this database: an idempotency
 * key's, or a one-time token's (k->token), which never conflict.
 */
static void
idem_key_locktag(LOCKTAG *tag, const IdemKey *k)
{
	uint64		h;

	h = hash_bytes_extended((const unsigned char *) VARDATA_ANY(k->scope),
							VARSIZE_ANY_EXHDR(k->scope), 0);
	h = hash_bytes_extended((const unsigned char *) VARDATA_ANY(k->key),
							VARSIZE_ANY_EXHDR(k->key), h);
	SET_LOCKTAG_ADVISORY(*tag, MyDatabaseId, (uint32) (h >> 32), (uint32) h,
						 k->token ? IDEM_TOKEN_LOCKTAG_CLASS : IDEM_LOCKTAG_CLASS);
}

/*
 * Acquire or release a lock on behalf of the current (sub)transaction.
 *
 * The locks are transaction locks, but they are made the current
 * transaction level's resource owner's rather than the running portal's,
 * so that they stay releasable by idem_unlock after the subtransaction of
 * idem_wait_lock has handed them to its parent.
 */
LockAcquireResult
idem_lock(const LOCKTAG *tag, LOCKMODE mode, bool dontWait)
{
	ResourceOwner save_owner = CurrentResourceOwner;
	LockAcquireResult result;

	CurrentResourceOwner = CurTransactionResourceOwner;
	result = LockAcquire(tag, mode, false, dontWait);
	CurrentResourceOwner = save_owner;
	return result;
}

/*
 * Let go of a lock taken by idem_lock (or handed to this level by
 * idem_wait_lock_blocking's subtransaction).
 */
void
idem_unlock(const LOCKTAG *tag, LOCKMODE mode)
{
	ResourceOwner save_owner = CurrentResourceOwner;

	CurrentResourceOwner = CurTransactionResourceOwner;
	LockRelease(tag, mode, false);
	CurrentResourceOwner = save_owner;
}

/*
 * Take a lock that was not free, waiting at most timeout_ms (> 0).  Returns
 * false if it could not be had in time.
 *
 * We wait in the lock manager's own queue (no CPU, woken as soon as the holder lets go,
 * visible in pg_locks, covered by deadlock detection), with lock_timeout
 * temporarily set to our timeout, inside a subtransaction so that the lock
 * timeout error can be caught and turned into "not acquired".  If the
 * caller's own lock_timeout is shorter it is left in charge and its error
 * reaches the caller, as for any lock.  Any other error (cancel,
 * statement_timeout, deadlock) is re-thrown unchanged, and a statement
 * timeout that fired together with our lock timeout is raised rather than
 * lost.  (A query cancel that arrives in the same instant as our timeout is
 * indistinguishable from it and is lost; the caller then sees a timeout.)
 */
static bool
idem_wait_lock_blocking(const LOCKTAG *tag, LOCKMODE mode, long timeout_ms)
{
	MemoryContext oldcontext = CurrentMemoryContext;
	ResourceOwner oldowner = CurrentResourceOwner;
	int			save_lock_timeout = LockTimeout;
	bool		statement_timer_armed;
	volatile bool acquired = false;

	timeout_ms = Min(timeout_ms, INT_MAX);
	if (LockTimeout > 0 && LockTimeout <= timeout_ms)
	{
		(void) idem_lock(tag, mode, false);
		return true;
	}

	statement_timer_armed = get_timeout_active(STATEMENT_TIMEOUT);
	BeginInternalSubTransaction(NULL);
	MemoryContextSwitchTo(oldcontext);

	PG_TRY();
	{
		LockTimeout = (int) timeout_ms;
		(void) idem_lock(tag, mode, false);
		/* a lock timeout that fired just as the lock was granted lands here */
		CHECK_FOR_INTERRUPTS();
		LockTimeout = save_lock_timeout;

		/* the lock passes to the parent transaction */
		ReleaseCurrentSubTransaction();
		MemoryContextSwitchTo(oldcontext);
		CurrentResourceOwner = oldowner;
		acquired = true;
	}
	PG_CATCH();
	{
		ErrorData  *edata;

		LockTimeout = save_lock_timeout;
		MemoryContextSwitchTo(oldcontext);
		edata = CopyErrorData();
		FlushErrorState();

		RollbackAndReleaseCurrentSubTransaction();
		MemoryContextSwitchTo(oldcontext);
		CurrentResourceOwner = oldowner;

		if (edata->sqlerrcode != ERRCODE_LOCK_NOT_AVAILABLE)
			ReThrowError(edata);
		FreeErrorData(edata);

		/*
		 * When the statement timeout fired too, the interrupt handler
		 * reported only the lock timeout, which came first, and cleared
		 * both.  A statement timer that was armed before the wait and is
		 * not any more has fired.
		 */
		if (statement_timer_armed && !get_timeout_active(STATEMENT_TIMEOUT))
			ereport(ERROR,
					(errcode(ERRCODE_QUERY_CANCELED),
					 errmsg("canceling statement due to statement timeout")));
	}
	PG_END_TRY();

	return acquired;
}

/* A clock that has timed no wait yet */
static inline void
idem_wait_clock_init(IdemWaitClock *clock)
{
	clock->waited = false;
	INSTR_TIME_SET_ZERO(clock->total);
}

/* A wait begins, at *start */
static inline void
idem_wait_clock_start(IdemWaitClock *clock, instr_time *start)
{
	clock->waited = true;
	INSTR_TIME_SET_CURRENT(*start);
}

/* The wait that began at *start ends: add its time */
static inline void
idem_wait_clock_stop(IdemWaitClock *clock, const instr_time *start)
{
	instr_time	end;

	INSTR_TIME_SET_CURRENT(end);
	INSTR_TIME_ACCUM_DIFF(clock->total, end, *start);
}

/*
 * Count a call's waits, if it waited.
 */
void
idem_wait_clock_count(const IdemWaitClock *clock)
{
	if (!clock->waited)
		return;
	idem_stats_add(IDEM_STAT_WAITS, 1);
	idem_stats_add(IDEM_STAT_WAIT_USECS,
				   (uint64) INSTR_TIME_GET_MICROSEC(clock->total));
}

/*
 * Take a lock, waiting at most timeout_ms (idem_wait_lock_blocking), after
 * trying for it without waiting; the wait is timed on clock.
 */
static bool
idem_wait_lock(const LOCKTAG *tag, LOCKMODE mode, long timeout_ms,
			   IdemWaitClock *clock)
{
	instr_time	start;
	bool		acquired;

	if (idem_lock(tag, mode, true) != LOCKACQUIRE_NOT_AVAIL)
		return true;
	if (timeout_ms <= 0)
		return false;
	idem_wait_clock_start(clock, &start);
	acquired = idem_wait_lock_blocking(tag, mode, timeout_ms);
	idem_wait_clock_stop(clock, &start);
	return acquired;
}

/*
 * Wait until transaction xid has ended, but not past deadline.  Returns
 * false if it is still running at the deadline.
 *
 * The lock of a subtransaction goes when the subtransaction ends, even when
 * it commits into its parent, whose outcome then decides.  So, once the lock
 * of the transaction we wait on is granted while xid is still in progress,
 * we wait on its parent, and so on up: a rollback to a savepoint at any
 * level ends the wait at once.  (XactLockTableWait jumps to the top-level
 * transaction instead, which would wait past such a rollback.)
 */
static bool
idem_wait_xact(TransactionId xid, TimestampTz deadline, IdemWaitClock *clock)
{
	TransactionId waiton = xid;

	for (;;)
	{
		LOCKTAG		tag;
		TransactionId parent;

		SET_LOCKTAG_TRANSACTION(tag, waiton);
		if (!idem_wait_lock(&tag, ShareLock,
							TimestampDifferenceMilliseconds(GetCurrentTimestamp(),
															deadline),
							clock))
			return false;
		idem_unlock(&tag, ShareLock);
		CHECK_FOR_INTERRUPTS();

		if (!TransactionIdIsInProgress(xid))
			return true;

		parent = SubTransGetParent(waiton);
		if (TransactionIdIsValid(parent))
			waiton = parent;
		else
		{
			/*
			 * A top-level transaction in progress whose lock we could take:
			 * it is just ending.  Look again in a moment, as
			 * XactLockTableWait does.
			 */
			if (GetCurrentTimestamp() >= deadline)
				return false;
			pg_usleep(1000L);
		}
	}
}



/* ----------------------------------------------------------------
 * Reads
 * ----------------------------------------------------------------
 */

/*
 * ereport the serialization failure of a key changed after the transaction's
 * snapshot was taken.
 */
static void
idem_serialization_error(text *key, bool token)
{
	if (token)
		ereport(ERROR,
				(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
				 errmsg("could not serialize access due to concurrent change of a one-time token"),
				 errdetail("The token was consumed or issued by a transaction that committed after this transaction's snapshot was taken."),
				 errhint("Retry the transaction.")));
	ereport(ERROR,
			(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
			 errmsg("could not serialize access due to concurrent change of idempotency key \"%s\"",
					text_to_cstring(key)),
			 errdetail("The key's record was changed by a transaction that committed after this transaction's snapshot was taken."),
			 errhint("Retry the transaction.")));
}

/*
 * Read the live record of (scope, key) with the snapshot a query of the
 * caller would use.  hint is where the record most likely is (see
 * idem_records_find).
 */
void
idem_read_mvcc(Relation parent, const IdemKey *k, TimestampTz now,
			   TimestampTz hint, IdemRecord *rec)
{
	Snapshot	snapshot = RegisterSnapshot(GetTransactionSnapshot());

	idem_records_find(parent, k, now, hint, snapshot, rec);
	UnregisterSnapshot(snapshot);
}

/*
 * Read the live record of (scope, key) as the key lock holder must before it
 * writes: with a dirty snapshot, which sees every committed version and also
 * those that other transactions are still writing (rec->waitxid then names
 * the transaction to wait for).
 */
static void
idem_read_dirty(Relation parent, const IdemKey *k, TimestampTz now,
				TimestampTz hint, IdemRecord *rec)
{
	SnapshotData dirty;

	InitDirtySnapshot(dirty);
	idem_records_find(parent, k, now, hint, &dirty, rec);
}

/*
 * Prepare for the passes of a waiting loop, in the current memory context.
 */
static void
idem_passes_init(IdemPasses *passes)
{
	passes->caller = CurrentMemoryContext;
	passes->pass = NULL;
	passes->npasses = 0;
}

/*
 * Begin a pass of a waiting loop: from the second on, in the passes'
 * context, emptied of what the previous pass allocated.  Nothing allocated
 * by an earlier pass may be used after this.
 */
static void
idem_pass_begin(IdemPasses *passes)
{
	if (passes->npasses++ == 0)
		return;
	if (passes->pass == NULL)
		passes->pass = AllocSetContextCreate(passes->caller,
											 "idempotency wait pass",
											 ALLOCSET_DEFAULT_SIZES);
	else
		MemoryContextReset(passes->pass);
	MemoryContextSwitchTo(passes->pass);
}

/*
 * End a waiting loop: return to the caller's memory context, copy there the
 * pass-by-reference values of the record the last pass read, and free
 * everything else the passes allocated.
 */
static void
idem_passes_end(IdemPasses *passes, IdemRecord *rec)
{
	MemoryContextSwitchTo(passes->caller);
	if (passes->pass == NULL)
		return;
	if (rec->found && !rec->hash_null)
		rec->request_hash = datumCopy(rec->request_hash, false, -1);
	if (rec->found && !rec->body_null)
		rec->response_body = datumCopy(rec->response_body, false, -1);
	/* the 1.2 columns, which a replay or a takeover after a wait returns */
	if (rec->found && !rec->phase_null)
		rec->phase = datumCopy(rec->phase, false, -1);
	if (rec->found && !rec->state_null)
		rec->state = datumCopy(rec->state, false, -1);
	if (rec->found && !rec->headers_null)
		rec->response_headers = datumCopy(rec->response_headers, false, -1);
	if (rec->found && !rec->trace_null)
		rec->trace = datumCopy(rec->trace, false, -1);
	MemoryContextDelete(passes->pass);
	passes->pass = NULL;
}

/*
 * Under REPEATABLE READ or SERIALIZABLE, check that the transaction's
 * snapshot sees the same record (or the same absence of one) that the dirty
 * read found and we are about to act on.  If not, the record was claimed,
 * completed, taken over or released by a transaction that committed after
 * the snapshot: acting on it, or ignoring it, would break isolation or
 * idempotency, so raise serialization_failure.  The read also gives SSI the
 * predicate locks of an ordinary read.
 */
static void
idem_check_snapshot(Relation parent, const IdemKey *k, TimestampTz now,
					TimestampTz hint, const IdemRecord *current)
{
	IdemRecord	seen;

	if (!IsolationUsesXactSnapshot())
		return;
	idem_read_mvcc(parent, k, now, hint, &seen);

	/*
	 * Compare what the record says rather than row versions: maintenance
	 * moving a record out of the DEFAULT partition makes a new version of
	 * an unchanged record.  A claim has its own created_at; a takeover
	 * changes attempt and locked_until; completion changes completed.
	 */
	if (seen.found != current->found ||
		(seen.found &&
		 (seen.created_at != current->created_at ||
		  seen.attempt != current->attempt ||
		  seen.completed != current->completed ||
		  seen.locked_until_null != current->locked_until_null ||
		  (!seen.locked_until_null &&
		   seen.locked_until != current->locked_until))))
		idem_serialization_error(k->key, k->token);
}


/* ----------------------------------------------------------------
 * The lock-and-read loop
 * ----------------------------------------------------------------
 */

/*
 * Prepare kr for idem_lock_and_read of the record of k in parent (open),
 * in the current memory context.  deadline: when to stop waiting for the
 * key lock or for a writer (DT_NOEND: wait as any lock waits, and the waits
 * are not timed out by us); hint_ttl: a record made now with this time to
 * live is where the reads look first (see idem_records_find); place: where
 * this backend last wrote a new claim, read there first if this
 * transaction wrote it (only with DT_NOEND), or NULL.  No writer_settles.
 */
void
idem_key_read_init(IdemKeyRead *kr, Relation parent, const IdemKey *k,
				   TimestampTz deadline, int64 hint_ttl,
				   const IdemPlace *place)
{
	Assert(place == NULL || deadline == DT_NOEND);
	kr->parent = parent;
	kr->key = *k;
	idem_key_locktag(&kr->tag, k);
	kr->deadline = deadline;
	kr->hint_ttl = hint_ttl;
	kr->place = place;
	kr->writer_settles = NULL;
	kr->settles_arg = NULL;
	kr->held = false;
	idem_passes_init(&kr->passes);
	idem_wait_clock_init(&kr->clock);
	kr->now = 0;
}

/*
 * End the reads of kr: back in the memory context of idem_key_read_init,
 * with kr->rec's pass-by-reference values copied there.
 */
void
idem_key_read_end(IdemKeyRead *kr)
{
	idem_passes_end(&kr->passes, &kr->rec);
}

/*
 * Take the key lock of kr: at once or by its deadline, timed on its clock;
 * with no deadline, as any lock is taken.  False if it was not had in time.
 */
static bool
idem_lock_key(IdemKeyRead *kr)
{
	if (kr->held)
	{
		kr->held = false;
		return true;
	}
	if (kr->deadline == DT_NOEND)
	{
		(void) idem_lock(&kr->tag, ExclusiveLock, false);
		return true;
	}
	return idem_wait_lock(&kr->tag, ExclusiveLock,
						  TimestampDifferenceMilliseconds(GetCurrentTimestamp(),
														  kr->deadline),
						  &kr->clock);
}

/*
 * Take the key lock of kr if it is free, without waiting; true if it is
 * held now, for the first pass of idem_lock_and_read to read under (no wait
 * was timed).  Before any pass.
 */
bool
idem_key_read_try_lock(IdemKeyRead *kr)
{
	Assert(kr->passes.npasses == 0 && !kr->held);
	if (idem_lock(&kr->tag, ExclusiveLock, true) == LOCKACQUIRE_NOT_AVAIL)
		return false;
	kr->held = true;
	return true;
}

/*
 * The claim this transaction made last (the usual pattern: acquire,
 * business writes, complete) is read where idem_acquire wrote it, if it is
 * still there and this key's (idem_records_fetch checks), under the key
 * lock.  True with the lock held and kr->rec filled; false with the lock
 * let go of.  A version this transaction wrote needs neither a wait nor the
 * snapshot check.
 */
static bool
idem_read_place(IdemKeyRead *kr)
{
	const IdemPlace *place = kr->place;

	if (!TransactionIdIsValid(place->xid) ||
		place->xid != GetTopTransactionIdIfAny())
		return false;
	(void) idem_lock(&kr->tag, ExclusiveLock, false);
	kr->now = GetCurrentTimestamp();
	if (idem_records_fetch(kr->parent, place, &kr->key, kr->now, &kr->rec))
		return true;
	idem_unlock(&kr->tag, ExclusiveLock);
	return false;
}

/*
 * Lock the key of kr and read its record with a dirty snapshot, waiting for
 * any other transaction still writing the record, until the record found
 * (in kr->rec, read at kr->now) is committed, our own, or absent.
 *
 * IDEM_READ_LOCKED: the key lock is held, for the caller to write under and
 * let go of (idem_unlock of kr->tag); the transaction's snapshot agrees with
 * what was read.  The other answers leave the key lock free:
 * IDEM_READ_LOCK_TIMEOUT, the lock was not had by the deadline (kr->rec
 * not read); IDEM_READ_WRITER_TIMEOUT, a writer of kr->rec was still at it
 * at the deadline; IDEM_READ_WRITER_SETTLES, kr->writer_settles said that
 * the version being written (kr->rec) answers the caller already.
 *
 * Every pass after the first works in a memory context that the next pass
 * resets (see IdemPasses), so the caller may call again, after
 * idem_key_read_sleep, as often as it likes, and ends with
 * idem_key_read_end.
 */
IdemReadResult
idem_lock_and_read(IdemKeyRead *kr)
{
	IdemRecord *rec = &kr->rec;

	if (kr->place != NULL && idem_read_place(kr))
		return IDEM_READ_LOCKED;

	for (;;)
	{
		idem_pass_begin(&kr->passes);

		/*
		 * The key lock is only ever held across a read and the write that
		 * follows it, so a wait for it is short; it runs out only when the
		 * holder is stuck.
		 */
		if (!idem_lock_key(kr))
			return IDEM_READ_LOCK_TIMEOUT;
		kr->now = GetCurrentTimestamp();
		idem_read_dirty(kr->parent, &kr->key, kr->now,
						kr->now + kr->hint_ttl, rec);
		if (!rec->found || !TransactionIdIsValid(rec->waitxid))
			break;

		/* another transaction is still writing the record */
		idem_unlock(&kr->tag, ExclusiveLock);
		if (kr->writer_settles != NULL &&
			kr->writer_settles(rec, kr->settles_arg))
		{
			idem_check_snapshot(kr->parent, &kr->key, kr->now,
								kr->now + kr->hint_ttl, rec);
			return IDEM_READ_WRITER_SETTLES;
		}
		if (!idem_wait_xact(rec->waitxid, kr->deadline, &kr->clock) &&
			kr->deadline != DT_NOEND)
			return IDEM_READ_WRITER_TIMEOUT;
	}

	/* Committed or our own: the caller may act on it under the key lock. */
	Assert(!rec->found || !TransactionIdIsValid(rec->waitxid));
	idem_check_snapshot(kr->parent, &kr->key, kr->now, kr->now + kr->hint_ttl,
						rec);
	return IDEM_READ_LOCKED;
}

/*
 * Sleep on the latch for at most ms milliseconds, between two calls of
 * idem_lock_and_read of kr, timed on kr's clock; the key lock is not held.
 */
void
idem_key_read_sleep(IdemKeyRead *kr, long ms)
{
	instr_time	start;

	idem_wait_clock_start(&kr->clock, &start);
	(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
					 ms, PG_WAIT_EXTENSION);
	idem_wait_clock_stop(&kr->clock, &start);
	ResetLatch(MyLatch);
	CHECK_FOR_INTERRUPTS();
}
