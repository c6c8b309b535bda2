/*-------------------------------------------------------------------------
 *
 * claim.c
 *		Claims (1.1): their random ids, the owner sessions of session-bound
 *		claims, and the errors of a claim or attempt that is not current.
 *
 * A claim id is 122 random bits from the strong random source, as a version
 * 4 UUID, fetched in batches (the pool below) because each call of
 * pg_strong_random costs more than the bytes.  A session-bound claim names
 * its owner by (pid, start of its ownership), and the owner holds a
 * session-level advisory-type lock of that tag for as long as the
 * ownership lasts; the claim is over once nobody holds that lock.
 *
 * Locking rules.  The owner lock is taken (idem_hold_owner_lock) before any
 * key lock, so that nothing waits on a key lock holder for it; the probe of
 * another owner's lock (idem_owner_alive) never waits.  This file calls
 * keylock.c for its transaction-level locks and nothing that calls it back.
 *
 * IDENTIFICATION
 *	  claim.c
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "miscadmin.h"
#include "storage/lock.h"
#include "utils/builtins.h"
#include "utils/timestamp.h"
#include "utils/uuid.h"

#include "idempotency.h"

/* locktag_field4 of the lock a session-bound claim's owner holds */
#define IDEM_OWNER_LOCKTAG_CLASS	0x4945


/*
 * This backend's current ownership: the backend's start time for its first,
 * or when it took the owner lock again after an ownership ended; 0 before
 * its first session-bound claim.  A record's owner_start
 * is this value, so an ownership that ended while the backend lives on
 * (DISCARD ALL from a session pooler handing the connection to another
 * client, pg_advisory_unlock_all()) cannot be taken for the next one.
 */
static TimestampTz idem_owner_since = 0;

/*
 * Build the lock tag of a session-bound claim's owner: the backend's pid and
 * when its ownership began, in this database.  A new backend that gets a
 * dead owner's pid, or a later ownership of the same backend, has another
 * start, hence another tag.
 */
static void
idem_owner_locktag(LOCKTAG *tag, int32 pid, TimestampTz start)
{
	SET_LOCKTAG_ADVISORY(*tag, MyDatabaseId, (uint32) pid, (uint32) start,
						 IDEM_OWNER_LOCKTAG_CLASS);
}

/*
 * Whether this backend still holds the owner lock of its current ownership.
 * One lookup in the backend's local lock table: acquiring a lock already held
 * only counts it again, and the count is given back at once.  A lock that
 * was let go of (by pg_advisory_unlock_all() or DISCARD ALL, which release
 * every session-level advisory lock) is acquired anew here and given back
 * too.
 */
static bool
idem_owner_lock_held(void)
{
	LOCKTAG		tag;
	LockAcquireResult result;

	if (idem_owner_since == 0)
		return false;
	idem_owner_locktag(&tag, MyProcPid, idem_owner_since);
	result = LockAcquire(&tag, ExclusiveLock, true, false);
	LockRelease(&tag, ExclusiveLock, true);
	return result == LOCKACQUIRE_ALREADY_HELD ||
		result == LOCKACQUIRE_ALREADY_CLEAR;
}

/*
 * Make sure this backend holds its owner lock, before it makes a
 * session-bound claim: a session-level lock, held until the backend exits
 * or lets go of its session-level advisory locks.  It is an advisory-type
 * lock because the regular lock method drops session locks at the abort of
 * any transaction.  When the lock of the current ownership was let go of,
 * that ownership has ended (its claims are taken over as their owner's
 * would be after a disconnect) and a new one begins, with a tag of its own.
 */
void
idem_hold_owner_lock(void)
{
	LOCKTAG		tag;
	TimestampTz previous = idem_owner_since;

	if (idem_owner_lock_held())
		return;
	/* the backend's start, or now for an ownership after one that ended */
	idem_owner_since = (previous == 0) ? MyStartTimestamp :
		Max(GetCurrentTimestamp(), previous + 1);
	idem_owner_locktag(&tag, MyProcPid, idem_owner_since);
	(void) LockAcquire(&tag, ExclusiveLock, true, false);
}

/*
 * Whether a session-bound record's owner is this backend's current, unended
 * ownership.  Its own lock would not conflict with the probe of
 * idem_owner_alive, so it is recognised by pid and start instead.
 */
bool
idem_owner_is_me(const IdemRecord *rec)
{
	return idem_owner_since != 0 &&
		rec->owner_pid == MyProcPid &&
		rec->owner_start == idem_owner_since &&
		idem_owner_lock_held();
}

/*
 * Is the owner session of a session-bound record alive?  It is while it
 * holds its owner lock: we try for the lock without waiting and give it
 * back at once.  After the owner's exit, crash or a server restart, or once
 * it let go of its advisory locks, nobody holds it.
 */
bool
idem_owner_alive(const IdemRecord *rec)
{
	LOCKTAG		tag;

	if (idem_owner_is_me(rec))
		return true;
	if (rec->owner_pid == MyProcPid && rec->owner_start == idem_owner_since)
		return false;			/* ours, and let go of */
	idem_owner_locktag(&tag, rec->owner_pid, rec->owner_start);
	if (idem_lock(&tag, ShareLock, true) == LOCKACQUIRE_NOT_AVAIL)
		return true;
	idem_unlock(&tag, ShareLock);
	return false;
}

/*
 * Random bytes for the next claims of this backend, drawn from
 * pg_strong_random IDEM_CLAIM_POOL claims at a time.  Each call of
 * pg_strong_random costs about 8,500 instructions of fixed overhead with
 * OpenSSL 3 (RAND_bytes looks up its DRBG and that DRBG's parameters every
 * time), more than half of what 1.1 added to an acquire of a new key; the
 * bytes themselves are cheap.  The claims are the same bytes of the same
 * source, only fetched in batches: every claim is still 16 bytes straight
 * from pg_strong_random, so as unpredictable as before.
 *
 * Each claim's bytes are handed out once: the position moves past them
 * before they are used, and they are wiped from the pool as they are taken,
 * so that the pool never holds a claim that was already made.  Bytes not
 * yet taken are no more exposed than the state of the DRBG that would
 * produce them, which lives in the same process memory.
 *
 * A pool must never be shared by two processes, or both would hand out the
 * same claims.  Only a backend running idem_acquire fills it, never the
 * postmaster (which may have loaded the library), so a PostgreSQL child
 * starts with an empty one; and a pool filled under another MyProcPid (a
 * process forked after filling it) is thrown away rather than used.
 */
#define IDEM_CLAIM_POOL		32

static uint8 idem_claim_pool[IDEM_CLAIM_POOL * UUID_LEN];
static int	idem_claim_pool_next = IDEM_CLAIM_POOL;	/* empty */
static int	idem_claim_pool_pid = 0;

/*
 * Take the next claim's 16 random bytes from the pool, refilling it from
 * pg_strong_random when it is empty or not this process's.
 */
static void
idem_random_claim(pg_uuid_t *claim)
{
	uint8	   *bytes;

	if (idem_claim_pool_next >= IDEM_CLAIM_POOL ||
		idem_claim_pool_pid != MyProcPid)
	{
		/* empty until filled, should pg_strong_random fail */
		idem_claim_pool_next = IDEM_CLAIM_POOL;
		if (!pg_strong_random(idem_claim_pool, sizeof(idem_claim_pool)))
		{
			explicit_bzero(idem_claim_pool, sizeof(idem_claim_pool));
			ereport(ERROR,
					(errcode(ERRCODE_INTERNAL_ERROR),
					 errmsg("could not generate a random claim")));
		}
		idem_claim_pool_next = 0;
		idem_claim_pool_pid = MyProcPid;
	}
	bytes = idem_claim_pool + idem_claim_pool_next * UUID_LEN;
	idem_claim_pool_next++;
	memcpy(claim->data, bytes, UUID_LEN);
	explicit_bzero(bytes, UUID_LEN);
}

/*
 * Make a new claim: 122 random bits from the strong random source, as a
 * version 4 UUID, with this session as owner if session-bound.
 */
void
idem_new_claim(IdemClaim *claim, bool session_bound)
{
	/* a session-bound claim's owner lock is held before it is made */
	Assert(!session_bound || idem_owner_since != 0);
	idem_random_claim(&claim->claim);
	claim->claim.data[6] = (claim->claim.data[6] & 0x0f) | 0x40;
	claim->claim.data[8] = (claim->claim.data[8] & 0x3f) | 0x80;
	claim->session_bound = session_bound;
	claim->owner_pid = MyProcPid;
	claim->owner_start = idem_owner_since;
}

/*
 * ereport the error for a claim given to complete, release or extend that
 * is not the record's current one.
 */
static void
idem_claim_error(text *key, const IdemRecord *rec)
{
	ereport(ERROR,
			(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
			 errmsg("claim of idempotency key \"%s\" is not the current claim",
					text_to_cstring(key)),
			 rec->claim_null ?
			 errdetail("The record was claimed by version 1.0 and has no claim.") :
			 errdetail("The record is at attempt %d: the claim was taken over, or released and claimed again.",
					   rec->attempt),
			 errhint("Do not report this claim's result; the current claim will.")));
}

/*
 * Check a given claim against the record's: 55000 unless they are equal.
 */
void
idem_check_claim(text *key, bool given, const pg_uuid_t *claim,
				 const IdemRecord *rec)
{
	if (given &&
		(rec->claim_null || memcmp(claim, &rec->claim, sizeof(pg_uuid_t)) != 0))
		idem_claim_error(key, rec);
}


/*
 * ereport the error for a claim that was taken over by a later attempt.
 */
void
idem_attempt_error(text *key, int32 given, const IdemRecord *rec)
{
	ereport(ERROR,
			(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
			 errmsg("attempt %d of idempotency key \"%s\" is no longer current",
					given, text_to_cstring(key)),
			 errdetail("The record is at attempt %d: its lease ran out and the claim was taken over.",
					   rec->attempt),
			 errhint("Do not report this attempt's result; the current attempt will.")));
}


/*
 * ereport the error for a claim whose lease ran out at the largest attempt
 * an integer holds, which therefore cannot be taken over: the record stays
 * as it is.
 */
void
idem_attempt_limit_error(text *key, const IdemRecord *rec)
{
	ereport(ERROR,
			(errcode(ERRCODE_NUMERIC_VALUE_OUT_OF_RANGE),
			 errmsg("attempt of idempotency key \"%s\" is out of range",
					text_to_cstring(key)),
			 errdetail("The claim's lease ran out at attempt %d, the largest value of type integer, so it cannot be taken over again.",
					   rec->attempt),
			 errhint("Release the claim with idem_release to start again at attempt 1, or wait until the record expires.")));
}
