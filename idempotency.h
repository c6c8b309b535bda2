/*-------------------------------------------------------------------------
 *
 * idempotency.h
 *		Declarations shared by the idempotency extension's C files.
 *
 * idempotency.c holds the SQL-callable functions and the claim protocol;
 * records.c holds the storage access to idempotency.records.
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
#include "storage/itemptr.h"
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
} IdemClaim;

/* records.c */
extern void idem_records_init(void);
extern Relation idem_records_open(void);
extern bool idem_records_have_claims(void);
extern void idem_records_close(Relation parent);
extern void idem_records_find(Relation parent, text *scope, text *key,
							  TimestampTz now, TimestampTz hint,
							  Snapshot snapshot, IdemRecord *rec);
extern void idem_records_insert(Relation parent, text *scope, text *key,
								bytea *request_hash, TimestampTz now,
								TimestampTz locked_until,
								TimestampTz expires_at,
								const IdemClaim *claim);
extern void idem_records_takeover(Relation parent, const IdemRecord *rec,
								  text *scope, text *key, int32 attempt,
								  TimestampTz locked_until,
								  bytea *request_hash,
								  const IdemClaim *claim);
extern void idem_records_extend(Relation parent, const IdemRecord *rec,
								text *scope, text *key,
								TimestampTz locked_until);
extern void idem_records_complete(Relation parent, const IdemRecord *rec,
								  text *scope, text *key, int32 status,
								  Datum body, bool body_null,
								  TimestampTz now);
extern void idem_records_delete(Relation parent, const IdemRecord *rec);

#endif							/* IDEMPOTENCY_H */
