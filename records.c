/*-------------------------------------------------------------------------
 *
 * records.c
 *		Storage access to idempotency.records: probing the live partitions
 *		for a (scope, key) and writing record versions.
 *
 * idem_acquire runs on every request, so this file goes to the table
 * without the executor: no planning, no executor start-up per partition, no
 * tuple routing.  A probe walks the partition bounds that the relcache keeps
 * for the parent, skips every partition whose range has ended (it can hold
 * no live record), and looks up (scope, key) in each remaining partition's
 * btree index, starting with the one most likely to hold the key.  Writes
 * route by expires_at through the same bounds, go to the heap with
 * simple_heap_insert/update/delete, and maintain the indexes the way catalog
 * updates do.  A partition whose known-absent filter (filter.c) rules the
 * key out is skipped without being opened, and every insert adds its key
 * to the partition's filter first.
 *
 * What the executor would have done and we therefore do here: take the same
 * locks (AccessShareLock on the parent, partitions and indexes read,
 * RowExclusiveLock on what is written), check the caller's privileges on
 * idempotency.records, and make our writes visible to the next command with
 * CommandCounterIncrement, and refuse UPDATE and DELETE where a publication
 * needs a replica identity the table lacks.  What we do not do: fire triggers, apply
 * row-level security, or evaluate CHECK constraints.  The table is the
 * extension's own; the values written are checked by idempotency.c before
 * they get here.
 *
 * Callers hold the (scope, key) lock of keylock.c for every write, and
 * hold the parent open (idem_records_open) across a probe and the writes
 * that follow it, so the TID a probe returns is still the current version
 * when it is updated or deleted.
 *
 * IDENTIFICATION
 *	  records.c
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/genam.h"
#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/nbtree.h"
#include "access/relation.h"
#include "access/table.h"
#include "access/tableam.h"
#include "access/xact.h"
#include "catalog/index.h"
#include "catalog/namespace.h"
#include "catalog/pg_am.h"
#include "catalog/pg_class.h"
#include "catalog/pg_index.h"
#include "catalog/pg_opfamily.h"
#include "executor/executor.h"
#include "executor/tuptable.h"
#include "miscadmin.h"
#include "nodes/execnodes.h"
#include "partitioning/partbounds.h"
#include "partitioning/partdesc.h"
#include "storage/bufmgr.h"
#include "storage/lmgr.h"
#include "tcop/utility.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/fmgroids.h"
#include "utils/hsearch.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/rel.h"
#include "utils/syscache.h"

#include "compat.h"
#include "idempotency.h"

/* The columns of idempotency.records, by name */
typedef enum IdemColumn
{
	COL_SCOPE,
	COL_KEY,
	COL_STATUS,
	COL_REQUEST_HASH,
	COL_RESPONSE_STATUS,
	COL_RESPONSE_BODY,
	COL_ATTEMPT,
	COL_CREATED_AT,
	COL_LOCKED_UNTIL,
	COL_COMPLETED_AT,
	COL_EXPIRES_AT,
	/* added by 1.1: absent while the database is still at 1.0 */
	COL_CLAIM,
	COL_OWNER_PID,
	COL_OWNER_START,
	COL_IS_TOKEN,
	/* added by 1.2: absent while the database is still at 1.0 or 1.1 */
	COL_PHASE,
	COL_STATE,
	COL_RESPONSE_HEADERS,
	COL_TRACE,
	IDEM_NCOLUMNS
} IdemColumn;

/* Columns before this one are required; the rest may be missing */
#define IDEM_NREQUIRED	COL_CLAIM

static const char *const idem_column_names[IDEM_NCOLUMNS] = {
	[COL_SCOPE] = "scope",
	[COL_KEY] = "key",
	[COL_STATUS] = "status",
	[COL_REQUEST_HASH] = "request_hash",
	[COL_RESPONSE_STATUS] = "response_status",
	[COL_RESPONSE_BODY] = "response_body",
	[COL_ATTEMPT] = "attempt",
	[COL_CREATED_AT] = "created_at",
	[COL_LOCKED_UNTIL] = "locked_until",
	[COL_COMPLETED_AT] = "completed_at",
	[COL_EXPIRES_AT] = "expires_at",
	[COL_CLAIM] = "claim",
	[COL_OWNER_PID] = "owner_pid",
	[COL_OWNER_START] = "owner_start",
	[COL_IS_TOKEN] = "is_token",
	[COL_PHASE] = "phase",
	[COL_STATE] = "state",
	[COL_RESPONSE_HEADERS] = "response_headers",
	[COL_TRACE] = "trace",
};

/*
 * What we need to know of a partition, cached per backend: its index on
 * (scope, key) and where each column is (InvalidAttrNumber for a 1.1 column
 * of a database still at 1.0).  Entries go when the relcache entry
 * of the partition is invalidated (an index made or dropped, a column
 * changed, the partition dropped).
 *
 * clear_lease: a completion of this partition's records sets locked_until
 * to NULL.  A completed record has no lease; its 8 bytes are what makes a
 * sixteenth 300-byte record fit on a page beside the reserve of the
 * fillfactor (BENCHMARKS.md, issue 30).  Only partitions that 1.2's
 * make_partition laid out do so: there locked_until comes right before
 * status, at the start of what a completion writes, so that clearing it
 * moves none of the bytes the HOT update's WAL leaves out.  Partitions of
 * the parent's column order keep the lease a completion found, as before.
 */
typedef struct IdemPartition
{
	Oid			relid;			/* hash key */
	Oid			indexoid;
	bool		bytewise;		/* index compares scope and key by bytes */
	bool		clear_lease;	/* a completion sets locked_until NULL */
	AttrNumber	attnum[IDEM_NCOLUMNS];
} IdemPartition;

static HTAB *idem_partitions = NULL;

/* OID of idempotency.records, or InvalidOid until looked up */
static Oid	idem_records_relid = InvalidOid;

/* Whether idempotency.records has the 1.1 columns; valid with the OID */
static bool idem_records_v11 = false;

/* Whether it has the 1.2 columns (phase, state, response_headers, trace) */
static bool idem_records_v12 = false;

/*
 * The partitions a search goes through, in the order of their ranges, with
 * what the search asks of each: made from the parent's partition
 * descriptor and the partition cache on the first search after either
 * changed (idem_partitions_gen counts the changes), so that a search reads
 * neither the bounds nor the hash table per partition.  The DEFAULT
 * partition, if any, is not in the list.
 */
typedef struct IdemSearchPart
{
	Oid			relid;
	TimestampTz upper;			/* end of its range */
	bool		trusted;		/* cached, bytewise: its filter may be asked */
	int			filter_slot;	/* where its filter was last found, or -1 */
} IdemSearchPart;

static uint64 idem_partitions_gen = 1;
static uint64 idem_search_gen = 0;	/* generation the list was made at */
static PartitionDesc idem_search_pd = NULL; /* descriptor it was made from */
static Oid	idem_search_parent = InvalidOid;	/* whose descriptor that is */
static IdemSearchPart *idem_search_parts = NULL;	/* in TopMemoryContext */
static int	idem_search_nparts = 0;
static int	idem_search_maxparts = 0;
static Oid	idem_search_default = InvalidOid;

/*
 * One search of the partitions for a record (idem_search): what is looked
 * for, how, and where the answer goes.
 */
typedef struct IdemSearch
{
	const IdemKey *k;			/* the strings and the kind looked for */
	TimestampTz now;			/* records that expire by then are dead */
	Snapshot	snapshot;
	bool		use_filter;		/* filters may be asked */
	bool		probe_unknown;	/* probe where no filter answers */
	bool		passed_unknown; /* passed one by for want of an answer */
	uint64		hash;			/* the key's filter hash, if use_filter */
	IdemRecord *rec;			/* the answer */
} IdemSearch;


/*
 * Relcache invalidation: forget what we know of the relation, or of all.
 */
static void
idem_relcache_callback(Datum arg, Oid relid)
{
	bool		found = false;

	/* the search's list goes with the parent's descriptor, or an entry */
	if (!OidIsValid(relid) || relid == idem_search_parent)
		idem_partitions_gen++;
	if (!OidIsValid(relid) || relid == idem_records_relid)
		idem_records_relid = InvalidOid;

	if (idem_partitions == NULL)
		return;
	if (OidIsValid(relid))
	{
		(void) hash_search(idem_partitions, &relid, HASH_REMOVE, &found);
		if (found)
			idem_partitions_gen++;
	}
	else
	{
		HASH_SEQ_STATUS status;
		IdemPartition *entry;

		hash_seq_init(&status, idem_partitions);
		while ((entry = hash_seq_search(&status)) != NULL)
			(void) hash_search(idem_partitions, &entry->relid, HASH_REMOVE, NULL);
	}
}

/*
 * Module load: set up the partition cache's invalidation.
 */
void
idem_records_init(void)
{
	CacheRegisterRelcacheCallback(idem_relcache_callback, (Datum) 0);
}

/*
 * Whether the index whose pg_index row is tup compares scope and key (its
 * first two columns) by bytes: text's own btree operator families, and
 * deterministic collations.  Only then may the known-absent filters, which
 * hash the bytes, be asked about the partition.
 */
static bool
idem_index_bytewise(HeapTuple tup)
{
	Datum		d;
	bool		isnull;
	oidvector  *colls;
	oidvector  *classes;
	bool		bytewise;

	d = SysCacheGetAttr(INDEXRELID, tup, Anum_pg_index_indcollation, &isnull);
	colls = isnull ? NULL : (oidvector *) DatumGetPointer(d);
	d = SysCacheGetAttr(INDEXRELID, tup, Anum_pg_index_indclass, &isnull);
	classes = isnull ? NULL : (oidvector *) DatumGetPointer(d);
	bytewise = colls != NULL && classes != NULL;
	for (int c = 0; bytewise && c < 2; c++)
	{
		Oid			family = get_opclass_family(classes->values[c]);

		bytewise = (family == TEXT_BTREE_FAM_OID ||
					family == TEXT_PATTERN_BTREE_FAM_OID) &&
			(!OidIsValid(colls->values[c]) ||
			 get_collation_isdeterministic(colls->values[c]));
	}
	return bytewise;
}

/*
 * Is the index indexoid a valid btree index whose first two key columns
 * are scope and key (at attnum), with no expressions and no predicate?
 * *bytewise: see idem_index_bytewise.
 */
static bool
idem_index_usable(Oid indexoid, const AttrNumber *attnum, bool *bytewise)
{
	HeapTuple	tup;
	Form_pg_index index;
	bool		usable;

	tup = SearchSysCache1(INDEXRELID, ObjectIdGetDatum(indexoid));
	if (!HeapTupleIsValid(tup))
		return false;
	index = (Form_pg_index) GETSTRUCT(tup);
	usable = index->indisvalid && index->indisready &&
		index->indnkeyatts >= 2 &&
		index->indkey.values[0] == attnum[COL_SCOPE] &&
		index->indkey.values[1] == attnum[COL_KEY] &&
		heap_attisnull(tup, Anum_pg_index_indexprs, NULL) &&
		heap_attisnull(tup, Anum_pg_index_indpred, NULL);
	*bytewise = usable && idem_index_bytewise(tup);
	ReleaseSysCache(tup);
	if (!usable)
		return false;

	tup = SearchSysCache1(RELOID, ObjectIdGetDatum(indexoid));
	if (!HeapTupleIsValid(tup))
		return false;
	usable = ((Form_pg_class) GETSTRUCT(tup))->relam == BTREE_AM_OID;
	ReleaseSysCache(tup);
	return usable;
}

/*
 * The index a probe of partition rel goes through: the first of its indexes
 * that idem_index_usable accepts; an error if it has none.
 */
static void
idem_choose_index(Relation rel, IdemPartition *info)
{
	List	   *indexes = RelationGetIndexList(rel);
	ListCell   *lc;

	info->indexoid = InvalidOid;
	info->bytewise = false;
	foreach(lc, indexes)
	{
		bool		bytewise;

		if (idem_index_usable(lfirst_oid(lc), info->attnum, &bytewise))
		{
			info->indexoid = lfirst_oid(lc);
			info->bytewise = bytewise;
			break;
		}
	}
	list_free(indexes);

	if (!OidIsValid(info->indexoid))
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("partition \"%s\" of \"idempotency.records\" has no btree index on (scope, key)",
						RelationGetRelationName(rel))));
}

/*
 * Fill *info for an open, locked partition from the cache, building the
 * cache entry if need be.  A copy, since the entry may go as soon as the
 * next lock is taken and invalidations are processed.
 */
static void
idem_partition_info(Relation rel, IdemPartition *result)
{
	Oid			relid = RelationGetRelid(rel);
	IdemPartition *entry;
	IdemPartition info;
	bool		found;
	int			i;

	if (idem_partitions == NULL)
	{
		HASHCTL		ctl;

		ctl.keysize = sizeof(Oid);
		ctl.entrysize = sizeof(IdemPartition);
		idem_partitions = hash_create("idempotency partitions", 64, &ctl,
									  HASH_ELEM | HASH_BLOBS);
	}

	entry = hash_search(idem_partitions, &relid, HASH_FIND, NULL);
	if (entry != NULL)
	{
		*result = *entry;
		return;
	}

	/* Build it in locals first: a catalog lookup may run our callback. */
	info.relid = relid;
	for (i = 0; i < IDEM_NCOLUMNS; i++)
	{
		info.attnum[i] = get_attnum(relid, idem_column_names[i]);
		if (info.attnum[i] == InvalidAttrNumber && i < IDEM_NREQUIRED)
			ereport(ERROR,
					(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
					 errmsg("partition \"%s\" of \"idempotency.records\" has no column \"%s\"",
							RelationGetRelationName(rel), idem_column_names[i])));
	}
	info.clear_lease = info.attnum[COL_STATUS] > 1 &&
		info.attnum[COL_LOCKED_UNTIL] == info.attnum[COL_STATUS] - 1;
	idem_choose_index(rel, &info);

	entry = hash_search(idem_partitions, &relid, HASH_ENTER, &found);
	*entry = info;
	*result = info;
	idem_partitions_gen++;
}


/* ----------------------------------------------------------------
 * Opening the table
 * ----------------------------------------------------------------
 */

/*
 * Check one privilege of the current user on idempotency.records.
 */
static void
idem_check_privilege(Relation parent, AclMode mode)
{
	AclResult	result;

	result = pg_class_aclcheck(RelationGetRelid(parent), GetUserId(), mode);
	if (result != ACLCHECK_OK)
		aclcheck_error(result, OBJECT_TABLE, RelationGetRelationName(parent));
}

/*
 * Open idempotency.records for reading (AccessShareLock); check_acl: after
 * checking that the caller may SELECT from it, as the executor would.
 */
static Relation
idem_records_open_internal(bool check_acl)
{
	Relation	parent = NULL;

	if (OidIsValid(idem_records_relid))
		parent = try_table_open(idem_records_relid, AccessShareLock);
	if (parent == NULL)
	{
		Oid			nspoid = get_namespace_oid("idempotency", true);
		Oid			relid = InvalidOid;

		if (OidIsValid(nspoid))
			relid = get_relname_relid("records", nspoid);
		if (!OidIsValid(relid))
			ereport(ERROR,
					(errcode(ERRCODE_UNDEFINED_TABLE),
					 errmsg("relation \"idempotency.records\" does not exist"),
					 errhint("Run CREATE EXTENSION idempotency in this database.")));
		parent = table_open(relid, AccessShareLock);
		idem_records_relid = InvalidOid;
	}

	/*
	 * Opening may have processed an invalidation of the table (ALTER
	 * EXTENSION UPDATE adding the 1.1 columns): look its columns up again.
	 * Under our lock they cannot change until the transaction ends.
	 */
	if (!OidIsValid(idem_records_relid))
	{
		Oid			relid = RelationGetRelid(parent);

		idem_records_v11 =
			get_attnum(relid, idem_column_names[COL_CLAIM]) != InvalidAttrNumber &&
			get_attnum(relid, idem_column_names[COL_OWNER_PID]) != InvalidAttrNumber &&
			get_attnum(relid, idem_column_names[COL_OWNER_START]) != InvalidAttrNumber &&
			get_attnum(relid, idem_column_names[COL_IS_TOKEN]) != InvalidAttrNumber;
		idem_records_v12 = idem_records_v11 &&
			get_attnum(relid, idem_column_names[COL_PHASE]) != InvalidAttrNumber &&
			get_attnum(relid, idem_column_names[COL_STATE]) != InvalidAttrNumber &&
			get_attnum(relid, idem_column_names[COL_RESPONSE_HEADERS]) != InvalidAttrNumber &&
			get_attnum(relid, idem_column_names[COL_TRACE]) != InvalidAttrNumber;
		idem_records_relid = relid;
	}
	if (parent->rd_rel->relkind != RELKIND_PARTITIONED_TABLE)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("\"idempotency.records\" is not a partitioned table")));

	if (check_acl)
		idem_check_privilege(parent, ACL_SELECT);
	return parent;
}

/*
 * Open idempotency.records for reading, as a SELECT from it would.
 */
Relation
idem_records_open(void)
{
	return idem_records_open_internal(true);
}

/*
 * Open idempotency.records without checking the caller's privileges on it:
 * for idem_forget, whose EXECUTE privilege is what lets an operator role
 * forget keys without any privilege on the table.
 */
Relation
idem_records_open_unchecked(void)
{
	return idem_records_open_internal(false);
}

/*
 * Does idempotency.records have the columns of version 1.1?  Valid after
 * idem_records_open, while the table is open: false in a database whose
 * extension is still at 1.0 (the library was replaced before ALTER
 * EXTENSION idempotency UPDATE).
 */
bool
idem_records_have_claims(void)
{
	return idem_records_v11;
}

/*
 * Does idempotency.records have the columns of version 1.2?  As
 * idem_records_have_claims.
 */
bool
idem_records_have_checkpoints(void)
{
	return idem_records_v12;
}

/*
 * Before writing: what the executor would refuse, take and check for an
 * INSERT, UPDATE or DELETE on the parent.
 */
static void
idem_prepare_write_acl(Relation parent, AclMode mode, bool check_acl)
{
	const char *cmd = (mode == ACL_INSERT) ? "INSERT" :
		(mode == ACL_UPDATE) ? "UPDATE" : "DELETE";

	/* the caller holds the parent open across its probe and this write */
	Assert(CheckRelationLockedByMe(parent, AccessShareLock, true));
	PreventCommandIfReadOnly(cmd);
	PreventCommandDuringRecovery(cmd);
	LockRelationOid(RelationGetRelid(parent), RowExclusiveLock);
	if (check_acl)
		idem_check_privilege(parent, mode);
}

/*
 * idem_prepare_write_acl, checking the caller's privilege as the executor
 * would.
 */
static void
idem_prepare_write(Relation parent, AclMode mode)
{
	idem_prepare_write_acl(parent, mode, true);
}

/*
 * Close the parent; its lock is kept to the end of the transaction.
 */
void
idem_records_close(Relation parent)
{
	table_close(parent, NoLock);
}


/* ----------------------------------------------------------------
 * Probing
 * ----------------------------------------------------------------
 */

/*
 * Upper bound of range datum i of a range partition bound.
 */
static TimestampTz
idem_bound_value(PartitionBoundInfo bi, int i)
{
	switch (bi->kind[i][0])
	{
		case PARTITION_RANGE_DATUM_MINVALUE:
			return DT_NOBEGIN;
		case PARTITION_RANGE_DATUM_MAXVALUE:
			return DT_NOEND;
		default:
			return DatumGetTimestampTz(bi->datums[i][0]);
	}
}

/*
 * Copy the record in slot into *rec.
 */
static void
idem_fill_record(IdemRecord *rec, Relation rel, const IdemPartition *part,
				 TupleTableSlot *slot)
{
	HeapTuple	tuple;
	bool		should_free;
	bool		isnull;
	Datum		d;

	slot_getallattrs(slot);

	rec->found = true;
	rec->partoid = RelationGetRelid(rel);
	rec->tid = slot->tts_tid;
	tuple = ExecFetchSlotHeapTuple(slot, false, &should_free);
	rec->xmin = HeapTupleHeaderGetXmin(tuple->t_data);
	if (should_free)
		heap_freetuple(tuple);

#define ATT(col)	(part->attnum[(col)] - 1)
	d = slot->tts_values[ATT(COL_STATUS)];
	rec->completed = !slot->tts_isnull[ATT(COL_STATUS)] &&
		VARSIZE_ANY_EXHDR(DatumGetPointer(d)) > 0 &&
		VARDATA_ANY(DatumGetPointer(d))[0] == 'c';

	rec->hash_null = slot->tts_isnull[ATT(COL_REQUEST_HASH)];
	if (!rec->hash_null)
		rec->request_hash =
			PointerGetDatum(PG_DETOAST_DATUM_COPY(slot->tts_values[ATT(COL_REQUEST_HASH)]));

	rec->status_null = slot->tts_isnull[ATT(COL_RESPONSE_STATUS)];
	if (!rec->status_null)
		rec->response_status = DatumGetInt32(slot->tts_values[ATT(COL_RESPONSE_STATUS)]);

	rec->body_null = slot->tts_isnull[ATT(COL_RESPONSE_BODY)];
	if (!rec->body_null)
		rec->response_body =
			PointerGetDatum(PG_DETOAST_DATUM_COPY(slot->tts_values[ATT(COL_RESPONSE_BODY)]));

	rec->attempt = DatumGetInt32(slot->tts_values[ATT(COL_ATTEMPT)]);
	rec->created_at = DatumGetTimestampTz(slot->tts_values[ATT(COL_CREATED_AT)]);
	rec->locked_until_null = slot->tts_isnull[ATT(COL_LOCKED_UNTIL)];
	if (!rec->locked_until_null)
		rec->locked_until = DatumGetTimestampTz(slot->tts_values[ATT(COL_LOCKED_UNTIL)]);
	rec->completed_at_null = slot->tts_isnull[ATT(COL_COMPLETED_AT)];
	if (!rec->completed_at_null)
		rec->completed_at = DatumGetTimestampTz(slot->tts_values[ATT(COL_COMPLETED_AT)]);
	rec->expires_at = DatumGetTimestampTz(slot_getattr(slot, part->attnum[COL_EXPIRES_AT], &isnull));

	/* the 1.1 columns, NULL where the table does not have them yet */
	rec->claim_null = part->attnum[COL_CLAIM] == InvalidAttrNumber ||
		slot->tts_isnull[ATT(COL_CLAIM)];
	if (!rec->claim_null)
		memcpy(&rec->claim, DatumGetUUIDP(slot->tts_values[ATT(COL_CLAIM)]),
			   sizeof(pg_uuid_t));
	rec->owner_null = part->attnum[COL_OWNER_PID] == InvalidAttrNumber ||
		part->attnum[COL_OWNER_START] == InvalidAttrNumber ||
		slot->tts_isnull[ATT(COL_OWNER_PID)] ||
		slot->tts_isnull[ATT(COL_OWNER_START)];
	if (!rec->owner_null)
	{
		rec->owner_pid = DatumGetInt32(slot->tts_values[ATT(COL_OWNER_PID)]);
		rec->owner_start = DatumGetTimestampTz(slot->tts_values[ATT(COL_OWNER_START)]);
	}
	rec->is_token = part->attnum[COL_IS_TOKEN] != InvalidAttrNumber &&
		!slot->tts_isnull[ATT(COL_IS_TOKEN)] &&
		DatumGetBool(slot->tts_values[ATT(COL_IS_TOKEN)]);

	/* the 1.2 columns, likewise; NULL in nearly every record but a replay's */
#define COPY_OPTIONAL(col, isnull, value) \
	do { \
		(isnull) = part->attnum[(col)] == InvalidAttrNumber || \
			slot->tts_isnull[ATT(col)]; \
		if (!(isnull)) \
			(value) = PointerGetDatum(PG_DETOAST_DATUM_COPY(slot->tts_values[ATT(col)])); \
	} while (0)
	COPY_OPTIONAL(COL_PHASE, rec->phase_null, rec->phase);
	COPY_OPTIONAL(COL_STATE, rec->state_null, rec->state);
	COPY_OPTIONAL(COL_RESPONSE_HEADERS, rec->headers_null, rec->response_headers);
	COPY_OPTIONAL(COL_TRACE, rec->trace_null, rec->trace);
#undef COPY_OPTIONAL
#undef ATT
}

/*
 * The index scan of idem_probe: the live record of the search's kind that
 * partition rel (open and locked, described by part) holds for the
 * search's (scope, key), through its index (open and locked), into
 * s->rec; true if found.
 */
static bool
idem_probe_scan(const IdemSearch *s, Relation rel, Relation index,
				const IdemPartition *part)
{
	Snapshot	snapshot = s->snapshot;
	IdemRecord *rec = s->rec;
	bool		token = s->k->token;
	IndexScanDesc scan;
	TupleTableSlot *slot;
	ScanKeyData skey[2];
	bool		found = false;

	ScanKeyEntryInitialize(&skey[0], 0, 1, BTEqualStrategyNumber, InvalidOid,
						   index->rd_indcollation[0], F_TEXTEQ,
						   PointerGetDatum(s->k->scope));
	ScanKeyEntryInitialize(&skey[1], 0, 2, BTEqualStrategyNumber, InvalidOid,
						   index->rd_indcollation[1], F_TEXTEQ,
						   PointerGetDatum(s->k->key));

	slot = table_slot_create(rel, NULL);
	scan = idem_index_beginscan(rel, index, snapshot, 2, 0);
	index_rescan(scan, skey, 2, NULL, 0);
	while (index_getnext_slot(scan, ForwardScanDirection, slot))
	{
		bool		isnull;
		TimestampTz expires_at;
		bool		inserting;

		expires_at = DatumGetTimestampTz(slot_getattr(slot,
													  part->attnum[COL_EXPIRES_AT],
													  &isnull));
		if (isnull || expires_at <= s->now)
			continue;

		/*
		 * A live record of the other kind under the same strings is passed
		 * over; its expires_at is noted, so that a record written next to it
		 * does not collide with it in the unique index.
		 */
		if (part->attnum[COL_IS_TOKEN] == InvalidAttrNumber ? token :
			DatumGetBool(slot_getattr(slot, part->attnum[COL_IS_TOKEN],
									  &isnull)) != token)
		{
			rec->shadow_expires = expires_at;
			continue;
		}

		if (snapshot->snapshot_type != SNAPSHOT_DIRTY)
		{
			idem_fill_record(rec, rel, part, slot);
			found = true;
			break;
		}

		/*
		 * A dirty snapshot also returns versions whose inserting, updating
		 * or deleting transaction is still open, and says which transaction
		 * that is.  A transaction updating a committed record makes a new
		 * version it is inserting; the index may return either first, and
		 * the committed one is what the caller must judge (its hash answers
		 * mismatch at once), so keep looking past a version being inserted.
		 */
		inserting = TransactionIdIsValid(snapshot->xmin);
		if (found && inserting)
			continue;
		idem_fill_record(rec, rel, part, slot);
		rec->wait_insert = inserting;
		rec->waitxid = inserting ? snapshot->xmin : snapshot->xmax;
		found = true;
		if (!inserting)
			break;
	}
	index_endscan(scan);
	ExecDropSingleTupleTableSlot(slot);
	return found;
}

/*
 * Look for the live record of the search's (scope, key), of the kind asked
 * for (a one-time token, or an idempotency key), in one partition.  maybe:
 * the partition's filter says the key may be there.
 */
static bool
idem_probe(const IdemSearch *s, Oid relid, bool maybe)
{
	Relation	rel;
	Relation	index;
	IdemPartition part;
	bool		found;
	bool		empty;

	rel = table_open(relid, AccessShareLock);

	/*
	 * Partitions made ahead for future ranges are empty: one lseek says so,
	 * where an index probe costs much more.  A version of this key can only
	 * have been written under the key lock, after its page was added.
	 *
	 * The lock on an empty partition is given back at once, so that a call
	 * holds locks only on the partitions that hold records: with hourly
	 * partitions and a week's max_ttl there are some 170 live ones, which
	 * would otherwise fill the shared lock table with a few dozen open
	 * claim transactions, and even with daily ones take every fast-path
	 * slot before the application's own tables are touched.  Letting go
	 * early is safe: nothing of the partition is kept, a version of our key
	 * can only be added under the key lock we hold, and maintenance cannot
	 * drop or detach the partition while we hold the parent's lock.  Without
	 * the key lock (idem_acquire's unlocked read, MVCC snapshot), an empty
	 * partition holds no version that the snapshot sees either: such a
	 * version was committed before the snapshot was taken, on a page added
	 * before it was written, and no vacuum takes that page away while the
	 * snapshot may see its tuple.
	 *
	 * A partition whose filter has every bit of the key (maybe) most likely
	 * holds the key's record: the lseek, a system call on every replay, is
	 * skipped.  Should the partition be empty all the same (the insert that
	 * set the bits failed, or the rows are gone), the probe ends at the
	 * index's metapage and the locks are kept to the end of the
	 * transaction, as for a partition that holds records.
	 */
	empty = !maybe && RelationGetNumberOfBlocks(rel) == 0;
	if (empty && !(IsMVCCSnapshot(s->snapshot) && IsolationIsSerializable()))
	{
		/*
		 * Cache what idem_trusted needs, so that from the next call on the
		 * partition's filter rules the key out without this open and lseek.
		 * Partitions are made up to max_ttl ahead, so a new key passes
		 * several empty ones, and opening each on every call cost a tenth
		 * of ext_new's instructions.
		 */
		if (idem_filter_usable())
			idem_partition_info(rel, &part);
		table_close(rel, NoLock);
		UnlockRelationOid(relid, AccessShareLock);
		return false;
	}

	idem_partition_info(rel, &part);
	index = index_open(part.indexoid, AccessShareLock);

	found = idem_probe_scan(s, rel, index, &part);

	/*
	 * Under SERIALIZABLE an empty partition was probed all the same, for the
	 * predicate lock the index scan takes; that lock outlives the relation
	 * locks, which go as above.
	 */
	index_close(index, NoLock);
	table_close(rel, NoLock);
	if (empty)
	{
		UnlockRelationOid(part.indexoid, AccessShareLock);
		UnlockRelationOid(relid, AccessShareLock);
	}
	return found;
}

/*
 * Is partition relid's filter to be asked: has this backend looked at the
 * partition before, and does its probe index compare scope and key by
 * bytes, as the filter's hash does?  Under a nondeterministic collation the
 * index finds keys of other bytes.  The cache entry goes with any change of
 * the partition's indexes, and then the next probe opens the partition and
 * looks again.
 */
static bool
idem_trusted(Oid relid)
{
	IdemPartition *entry;

	if (idem_partitions == NULL)
		return false;
	entry = hash_search(idem_partitions, &relid, HASH_FIND, NULL);
	return entry != NULL && entry->bytewise;
}

/*
 * The search's step at partition relid: pass it by, without opening it,
 * where its filter, if it may be asked (s->use_filter, and trusted, see
 * idem_trusted), rules the key out, or where no filter answers and the
 * search probes only where one does (!s->probe_unknown: noted in
 * s->passed_unknown); else probe it.  True if the probe found the record.
 * *filter_slot: the hint of idem_filter_check.
 */
static inline bool
idem_search_step(IdemSearch *s, Oid relid, bool trusted, int *filter_slot)
{
	IdemFilterAnswer answer = IDEM_FILTER_UNKNOWN;

	if (s->use_filter)
	{
		if (trusted)
			answer = idem_filter_check(relid, s->hash, filter_slot);
		if (answer == IDEM_FILTER_ABSENT)
			return false;
	}
	if (answer == IDEM_FILTER_UNKNOWN && !s->probe_unknown)
	{
		s->passed_unknown = true;
		return false;
	}
	return idem_probe(s, relid, answer == IDEM_FILTER_MAYBE);
}

/*
 * The search's step at the i-th partition of idem_search_parts.  Whether
 * its filter may be asked comes from the list while nothing has changed
 * since it was made, and from the partition cache itself once a probe has
 * let an invalidation in.
 */
static inline bool
idem_search_part(IdemSearch *s, int i)
{
	IdemSearchPart *part = &idem_search_parts[i];
	bool		trusted;

	trusted = (idem_search_gen == idem_partitions_gen) ? part->trusted :
		idem_trusted(part->relid);
	return idem_search_step(s, part->relid, trusted, &part->filter_slot);
}

/*
 * Make idem_search_parts for parent's partition descriptor pd, unless it is
 * made for pd already and nothing changed since.  While a DETACH
 * CONCURRENTLY is pending, the descriptor is made anew for each snapshot
 * that sees the detach differently, without an invalidation, so a new one
 * may take an old one's address: the list is then made for every search.
 */
static void
idem_search_list(Relation parent, PartitionDesc pd)
{
	PartitionBoundInfo bi = pd->boundinfo;
	uint64		gen = idem_partitions_gen;
	int			i;

	if (idem_search_pd == pd && idem_search_gen == gen)
		return;

	/* not valid until it is complete */
	idem_search_pd = NULL;
	if (bi->ndatums > idem_search_maxparts)
	{
		int			n = Max(bi->ndatums, 64);
		IdemSearchPart *parts;

		parts = MemoryContextAlloc(TopMemoryContext,
								   sizeof(IdemSearchPart) * n);
		if (idem_search_parts != NULL)
			pfree(idem_search_parts);
		idem_search_parts = parts;
		idem_search_maxparts = n;
	}

	idem_search_nparts = 0;
	for (i = 0; i < bi->ndatums; i++)
	{
		IdemSearchPart *part;

		if (bi->indexes[i] < 0)
			continue;
		part = &idem_search_parts[idem_search_nparts++];
		part->relid = pd->oids[bi->indexes[i]];
		part->upper = idem_bound_value(bi, i);
		part->trusted = idem_trusted(part->relid);
		part->filter_slot = -1;
	}
	idem_search_default = bi->default_index >= 0 ?
		pd->oids[bi->default_index] : InvalidOid;
	idem_search_parent = RelationGetRelid(parent);
	idem_search_gen = gen;
	idem_search_pd = pd->detached_exist ? NULL : pd;
}

/*
 * The search of idem_records_find and idem_records_find_unlocked, for the
 * record of k into *rec.
 *
 * A partition whose known-absent filter (filter.c) rules the key out is
 * not opened at all; the filter covers both kinds of record, so such a
 * partition holds no shadow either.  Every other live partition is probed,
 * unless probe_unknown is false: then only those whose filter says
 * "maybe".  True if a partition was passed by for want of a filter's
 * answer.
 */
static bool
idem_search(Relation parent, const IdemKey *k, TimestampTz now,
			TimestampTz hint, Snapshot snapshot, bool probe_unknown,
			IdemRecord *rec)
{
	PartitionDesc pd = RelationGetPartitionDesc(parent, true);
	IdemSearch	s;
	int			lo;
	int			start;
	int			n;
	int			i;

	memset(rec, 0, sizeof(IdemRecord));
	if (pd->boundinfo == NULL)
		return false;
	s.k = k;
	s.now = now;
	s.snapshot = snapshot;
	s.use_filter = idem_filter_usable();
	s.probe_unknown = probe_unknown;
	s.passed_unknown = false;
	s.hash = 0;
	s.rec = rec;
	/* no filter to ask: every partition would be passed by */
	if (!probe_unknown && !s.use_filter)
		return true;
	if (s.use_filter)
		s.hash = idem_filter_hash(k->scope, k->key);

	idem_search_list(parent, pd);
	n = idem_search_nparts;

	/*
	 * Only ranges that end after now can hold a live record; start with the
	 * one that holds expires_at = hint, or the last.
	 */
	for (lo = 0; lo < n && idem_search_parts[lo].upper <= now; lo++)
		;
	for (start = lo; start < n - 1 && idem_search_parts[start].upper <= hint; start++)
		;

	/*
	 * The filters of the live ranges are asked one after the other until
	 * the record turns up, the key's block of each most likely not in the
	 * CPU's caches: have them all loaded at once.
	 */
	if (s.use_filter)
	{
		for (i = lo; i < n; i++)
		{
			if (idem_search_parts[i].trusted)
				idem_filter_prefetch(idem_search_parts[i].relid, s.hash,
									 &idem_search_parts[i].filter_slot);
		}
	}

	/* start, then down to the oldest live range, then up */
	if (lo < n)
	{
		for (i = start; i >= lo; i--)
			if (idem_search_part(&s, i))
				return false;
		for (i = start + 1; i < n; i++)
			if (idem_search_part(&s, i))
				return false;
	}
	if (OidIsValid(idem_search_default))
	{
		Oid			relid = idem_search_default;
		int			filter_slot = -1;

		(void) idem_search_step(&s, relid, idem_trusted(relid), &filter_slot);
	}
	return s.passed_unknown;
}

/*
 * Find the live record of (scope, key) as of now, as seen by snapshot: a
 * one-time token's if token, else an idempotency key's; the two kinds never
 * see each other.  rec->shadow_expires is the expires_at of a live record of
 * the other kind with the same scope and key, where the search passed one.
 * With a dirty snapshot (InitDirtySnapshot), a version that another
 * transaction is still writing is found too, and rec->waitxid names it.
 *
 * Only partitions whose range ends after now can hold a live record.  They
 * are probed starting with the one that holds expires_at = hint (where a
 * record claimed just now with the default ttl would be), then towards the
 * older ranges, then the newer ones, and the DEFAULT partition last; the
 * first live record found ends the search, since there is at most one.
 */
void
idem_records_find(Relation parent, const IdemKey *k, TimestampTz now,
				  TimestampTz hint, Snapshot snapshot, IdemRecord *rec)
{
	(void) idem_search(parent, k, now, hint, snapshot, true, rec);
}

/*
 * idem_records_find for an idempotency key, without the key lock and with
 * an MVCC snapshot (idem_acquire's read of a completed record).  everywhere:
 * probe every live partition that no filter rules the key out of, as
 * idem_records_find does; else only those whose READY filter says "maybe",
 * so that a new key costs no index descent at all.  The filters only ever
 * pass by partitions that hold no version of the key, so a record found is
 * the key's live record as the snapshot sees it, with filters or without
 * (not preloaded, not built, no slot left, use_filters off).  True if a
 * partition was passed by for want of a filter's answer (never when
 * everywhere): not finding a record then proves even less.
 */
bool
idem_records_find_unlocked(Relation parent, const IdemKey *k,
						   TimestampTz now, TimestampTz hint,
						   Snapshot snapshot, bool everywhere,
						   IdemRecord *rec)
{
	Assert(!k->token);
	return idem_search(parent, k, now, hint, snapshot, everywhere, rec);
}

/*
 * The partitions that can hold a live record as of now: those whose range
 * ends after now, and the DEFAULT partition.  For building their filters.
 */
List *
idem_records_live_partitions(Relation parent, TimestampTz now)
{
	PartitionDesc pd = RelationGetPartitionDesc(parent, true);
	PartitionBoundInfo bi = pd->boundinfo;
	List	   *result = NIL;
	int			i;

	if (bi == NULL)
		return NIL;
	for (i = 0; i < bi->ndatums; i++)
	{
		if (bi->indexes[i] < 0 || idem_bound_value(bi, i) <= now)
			continue;
		result = lappend_oid(result, pd->oids[bi->indexes[i]]);
	}
	if (bi->default_index >= 0)
		result = lappend_oid(result, pd->oids[bi->default_index]);
	return result;
}

/*
 * The end of partition relid's range, DT_NOEND for the DEFAULT partition
 * (or one no longer attached).  A filter slot keeps it: once the range has
 * ended, no call looks in the slot and any database's build may take it.
 */
TimestampTz
idem_records_partition_end(Relation parent, Oid relid)
{
	PartitionDesc pd = RelationGetPartitionDesc(parent, true);
	PartitionBoundInfo bi = pd->boundinfo;
	int			i;

	if (bi == NULL)
		return DT_NOEND;
	for (i = 0; i < bi->ndatums; i++)
	{
		if (bi->indexes[i] >= 0 && pd->oids[bi->indexes[i]] == relid)
			return idem_bound_value(bi, i);
	}
	return DT_NOEND;
}


/*
 * Are a stored text value and a text the same bytes?  Stricter than the
 * index's equality under a nondeterministic collation, which only sends
 * idem_records_fetch's caller to the probe.
 */
static bool
idem_same_text(Datum stored, text *t)
{
	text	   *v = (text *) pg_detoast_datum_packed((struct varlena *) DatumGetPointer(stored));

	return VARSIZE_ANY_EXHDR(v) == VARSIZE_ANY_EXHDR(t) &&
		memcmp(VARDATA_ANY(v), VARDATA_ANY(t), VARSIZE_ANY_EXHDR(t)) == 0;
}

/*
 * Read the record of (scope, key) at a known place, without probing: the row
 * version this transaction inserted at tid in partition partoid, when the
 * caller remembers one (idem_acquire's new claim, read again by
 * idem_complete in the same transaction).  The place is only a hint, checked
 * here: the version must still be the current one (a dirty snapshot sees it:
 * not updated or deleted since, its subtransaction not rolled back), written
 * by this transaction, a live key record (not a token) of exactly this
 * scope and key.  Such a version is the key's one live record, since this
 * transaction wrote it under the key lock after finding none, and the
 * caller holds the key lock again.  Returns false, with *rec not found,
 * when any of that does not hold; the caller then probes as usual.
 */
bool
idem_records_fetch(Relation parent, const IdemPlace *place, const IdemKey *k,
				   TimestampTz now, IdemRecord *rec)
{
	Oid			partoid = place->partoid;
	ItemPointer tid = (ItemPointer) &place->tid;
	Relation	rel;
	IdemPartition part;
	TupleTableSlot *slot;
	SnapshotData dirty;
	bool		ok = false;

	Assert(!k->token);
	memset(rec, 0, sizeof(IdemRecord));

	/*
	 * Usually the partition has been locked since the insert.  Not when the
	 * insert's subtransaction was rolled back: its locks went with it, so
	 * the partition may have been dropped since (then it cannot be opened),
	 * or vacuumed and truncated below the remembered block, which heap_fetch
	 * does not check for.  Either way the claim is gone; the caller probes.
	 */
	rel = try_table_open(partoid, AccessShareLock);
	if (rel == NULL)
		return false;
	if (rel->rd_rel->relkind != RELKIND_RELATION ||
		ItemPointerGetBlockNumber(tid) >= RelationGetNumberOfBlocks(rel))
	{
		table_close(rel, NoLock);
		return false;
	}
	idem_partition_info(rel, &part);
	InitDirtySnapshot(dirty);
	slot = table_slot_create(rel, NULL);
	if (table_tuple_fetch_row_version(rel, tid, &dirty, slot))
	{
		HeapTuple	tuple;
		bool		should_free;
		bool		mine;
		bool		isnull;
		Datum		d;

		tuple = ExecFetchSlotHeapTuple(slot, false, &should_free);
		mine = !TransactionIdIsValid(dirty.xmin) &&
			!TransactionIdIsValid(dirty.xmax) &&
			TransactionIdIsCurrentTransactionId(HeapTupleHeaderGetXmin(tuple->t_data));
		if (should_free)
			heap_freetuple(tuple);

		if (mine)
		{
			d = slot_getattr(slot, part.attnum[COL_SCOPE], &isnull);
			mine = !isnull && idem_same_text(d, k->scope);
		}
		if (mine)
		{
			d = slot_getattr(slot, part.attnum[COL_KEY], &isnull);
			mine = !isnull && idem_same_text(d, k->key);
		}
		if (mine)
		{
			idem_fill_record(rec, rel, &part, slot);
			ok = !rec->is_token && rec->expires_at > now;
			if (!ok)
				memset(rec, 0, sizeof(IdemRecord));
		}
	}
	ExecDropSingleTupleTableSlot(slot);
	table_close(rel, NoLock);
	return ok;
}


/* ----------------------------------------------------------------
 * Writing
 * ----------------------------------------------------------------
 */

/*
 * The partition a record with this expires_at belongs in.
 */
static Oid
idem_route(Relation parent, TimestampTz expires_at)
{
	PartitionDesc pd = RelationGetPartitionDesc(parent, true);
	PartitionBoundInfo bi = pd->boundinfo;
	int			index = -1;
	int			i;

	if (bi != NULL)
	{
		for (i = 0; i < bi->ndatums; i++)
		{
			if (expires_at < idem_bound_value(bi, i))
			{
				index = bi->indexes[i];
				break;
			}
		}
		if (index < 0)
			index = bi->default_index;
	}
	if (index < 0)
		ereport(ERROR,
				(errcode(ERRCODE_CHECK_VIOLATION),
				 errmsg("no partition of relation \"%s\" found for row",
						RelationGetRelationName(parent)),
				 errhint("Run idempotency.idem_maintain() to create the partitions, or re-create the DEFAULT partition.")));
	return pd->oids[index];
}

/*
 * Insert the index entries of a new heap tuple, as CatalogIndexInsert does
 * for catalogs, with expression and partial indexes handled too.  update:
 * the tuple is a new version of a row (its indexed columns unchanged);
 * summarizing_only: only summarizing (BRIN) indexes need the entry, after a
 * HOT update on PostgreSQL 16 and later.
 */
static void
idem_insert_index_entries(Relation rel, HeapTuple tuple, bool update,
						  bool summarizing_only)
{
	List	   *indexes = RelationGetIndexList(rel);
	ListCell   *lc;
	TupleTableSlot *slot;
	EState	   *estate = NULL;

	slot = MakeSingleTupleTableSlot(RelationGetDescr(rel), &TTSOpsHeapTuple);
	ExecStoreHeapTuple(tuple, slot, false);

	foreach(lc, indexes)
	{
		Relation	index = index_open(lfirst_oid(lc), RowExclusiveLock);
		IndexInfo  *info = BuildIndexInfo(index);
		Datum		values[INDEX_MAX_KEYS];
		bool		isnull[INDEX_MAX_KEYS];

		if (summarizing_only && !idem_index_is_summarizing(info))
		{
			index_close(index, NoLock);
			continue;
		}
		if (info->ii_ReadyForInserts)
		{
			bool		wanted = true;

			if (estate == NULL &&
				(info->ii_Expressions != NIL || info->ii_Predicate != NIL))
			{
				estate = CreateExecutorState();
				GetPerTupleExprContext(estate)->ecxt_scantuple = slot;
			}
			if (info->ii_Predicate != NIL)
				wanted = ExecQual(ExecPrepareQual(info->ii_Predicate, estate),
								  GetPerTupleExprContext(estate));
			if (wanted)
			{
				FormIndexDatum(info, slot, estate, values, isnull);
				(void) index_insert(index, values, isnull, &tuple->t_self, rel,
									info->ii_Unique ? UNIQUE_CHECK_YES : UNIQUE_CHECK_NO,
									update, info);
			}
		}
		index_close(index, NoLock);
	}

	if (estate != NULL)
		FreeExecutorState(estate);
	ExecDropSingleTupleTableSlot(slot);
	list_free(indexes);
}

/*
 * Form a heap tuple of partition rel from the record's column values.
 */
static HeapTuple
idem_form_tuple(Relation rel, const IdemPartition *part,
				const Datum *colvalues, const bool *colnulls)
{
	TupleDesc	desc = RelationGetDescr(rel);
	Datum	   *values = palloc(sizeof(Datum) * desc->natts);
	bool	   *nulls = palloc(sizeof(bool) * desc->natts);
	int			i;

	for (i = 0; i < desc->natts; i++)
		nulls[i] = true;		/* dropped columns stay NULL */
	for (i = 0; i < IDEM_NCOLUMNS; i++)
	{
		if (part->attnum[i] == InvalidAttrNumber)
		{
			/* a 1.1 column of a table still at 1.0: nothing may go there */
			if (!colnulls[i] &&
				!(i == COL_IS_TOKEN && !DatumGetBool(colvalues[i])))
				elog(ERROR, "partition \"%s\" of \"idempotency.records\" has no column \"%s\"",
					 RelationGetRelationName(rel), idem_column_names[i]);
			continue;
		}
		values[part->attnum[i] - 1] = colvalues[i];
		nulls[part->attnum[i] - 1] = colnulls[i];
	}
	return heap_form_tuple(desc, values, nulls);
}

/*
 * Column values of an existing record, for an update to start from.
 */
static void
idem_record_columns(const IdemRecord *rec, const IdemKey *k, Datum *values,
					bool *nulls)
{
	values[COL_SCOPE] = PointerGetDatum(k->scope);
	nulls[COL_SCOPE] = false;
	values[COL_KEY] = PointerGetDatum(k->key);
	nulls[COL_KEY] = false;
	values[COL_STATUS] = CStringGetTextDatum(rec->completed ? "completed" : "processing");
	nulls[COL_STATUS] = false;
	values[COL_REQUEST_HASH] = rec->request_hash;
	nulls[COL_REQUEST_HASH] = rec->hash_null;
	values[COL_RESPONSE_STATUS] = Int32GetDatum(rec->response_status);
	nulls[COL_RESPONSE_STATUS] = rec->status_null;
	values[COL_RESPONSE_BODY] = rec->response_body;
	nulls[COL_RESPONSE_BODY] = rec->body_null;
	values[COL_ATTEMPT] = Int32GetDatum(rec->attempt);
	nulls[COL_ATTEMPT] = false;
	values[COL_CREATED_AT] = TimestampTzGetDatum(rec->created_at);
	nulls[COL_CREATED_AT] = false;
	values[COL_LOCKED_UNTIL] = TimestampTzGetDatum(rec->locked_until);
	nulls[COL_LOCKED_UNTIL] = rec->locked_until_null;
	values[COL_COMPLETED_AT] = TimestampTzGetDatum(rec->completed_at);
	nulls[COL_COMPLETED_AT] = rec->completed_at_null;
	values[COL_EXPIRES_AT] = TimestampTzGetDatum(rec->expires_at);
	nulls[COL_EXPIRES_AT] = false;
	values[COL_CLAIM] = UUIDPGetDatum(&rec->claim);
	nulls[COL_CLAIM] = rec->claim_null;
	values[COL_OWNER_PID] = Int32GetDatum(rec->owner_pid);
	nulls[COL_OWNER_PID] = rec->owner_null;
	values[COL_OWNER_START] = TimestampTzGetDatum(rec->owner_start);
	nulls[COL_OWNER_START] = rec->owner_null;
	values[COL_IS_TOKEN] = BoolGetDatum(rec->is_token);
	nulls[COL_IS_TOKEN] = false;
	values[COL_PHASE] = rec->phase;
	nulls[COL_PHASE] = rec->phase_null;
	values[COL_STATE] = rec->state;
	nulls[COL_STATE] = rec->state_null;
	values[COL_RESPONSE_HEADERS] = rec->response_headers;
	nulls[COL_RESPONSE_HEADERS] = rec->headers_null;
	values[COL_TRACE] = rec->trace;
	nulls[COL_TRACE] = rec->trace_null;
}

/*
 * Set the 1.1 columns of a claim being written: claim NULL (a 1.0 entry
 * point) leaves all three NULL; a lease claim has no owner.  The claim's
 * trace (1.2) replaces the record's: NULL where it has none.
 */
static void
idem_claim_columns(const IdemClaim *claim, Datum *values, bool *nulls)
{
	values[COL_TRACE] = (claim && claim->trace) ?
		PointerGetDatum(claim->trace) : (Datum) 0;
	nulls[COL_TRACE] = !(claim && claim->trace);
	values[COL_CLAIM] = claim ? UUIDPGetDatum(&claim->claim) : (Datum) 0;
	nulls[COL_CLAIM] = (claim == NULL);
	if (claim != NULL && claim->session_bound)
	{
		values[COL_OWNER_PID] = Int32GetDatum(claim->owner_pid);
		values[COL_OWNER_START] = TimestampTzGetDatum(claim->owner_start);
		nulls[COL_OWNER_PID] = nulls[COL_OWNER_START] = false;
	}
	else
		nulls[COL_OWNER_PID] = nulls[COL_OWNER_START] = true;
}

/*
 * Prune the page of a version about to be replaced, as an index fetch of it
 * would (heap_page_prune_opt: only when the page is nearly full, only what
 * no snapshot can see, and only if no other backend pins the page; else
 * nothing).  The complete step reaches its claim by TID and the new-key
 * probe finds nothing in the index, so without this the page a partition
 * inserts into is never pruned: the dead processing versions of earlier
 * completions pile up until a completion no longer fits beside its claim
 * and is no HOT update.  Pruning keeps line pointers of live tuples where
 * they are, so rec->tid stays the version to replace.  The caller holds
 * no pin of the page (or the prune is skipped).
 */
static void
idem_prune_page(Relation rel, ItemPointer tid)
{
	Buffer		buffer;

	buffer = ReadBuffer(rel, ItemPointerGetBlockNumber(tid));
	heap_page_prune_opt(rel, buffer);
	ReleaseBuffer(buffer);
}

/*
 * Prune the page the next insert into rel will try first (the relation's
 * target block, if it has one), for the same reason: with a fillfactor, an
 * insert skips a page whose free space is below the reserve without
 * pruning it, and a completion prunes only a page whose free space is
 * already below it.  So the dead processing versions of a page would stay
 * until the partition is dropped, and every record would take the room of
 * its claim twice.  RelationGetBufferForTuple reads the same block first.
 */
static void
idem_prune_target(Relation rel)
{
	BlockNumber blkno = RelationGetTargetBlock(rel);
	Buffer		buffer;

	if (blkno == InvalidBlockNumber)
		return;
	buffer = ReadBuffer(rel, blkno);
	heap_page_prune_opt(rel, buffer);
	ReleaseBuffer(buffer);
}

/*
 * Insert a new processing record (attempt 1) of k, or an unconsumed
 * one-time token (k->token; no hash, lease or claim).  The caller holds the
 * key lock and has found no live record of that kind.  Where place is not
 * NULL, it is set to where the new row version is and by which transaction
 * (for idem_records_fetch).
 */
void
idem_records_insert(Relation parent, const IdemKey *k,
					const IdemNewRecord *nr, IdemPlace *place)
{
	Relation	rel;
	IdemPartition part;
	HeapTuple	tuple;
	Datum		values[IDEM_NCOLUMNS];
	bool		nulls[IDEM_NCOLUMNS];
	IdemRecord	rec;

	Assert(!k->token || (nr->request_hash == NULL && nr->claim == NULL));
	Assert(nr->expires_at >= nr->created_at);
	memset(&rec, 0, sizeof(rec));
	rec.hash_null = (nr->request_hash == NULL);
	rec.request_hash = PointerGetDatum(nr->request_hash);
	rec.status_null = true;
	rec.body_null = true;
	rec.attempt = 1;
	rec.created_at = nr->created_at;
	rec.locked_until = nr->locked_until;
	rec.locked_until_null = k->token;
	rec.completed_at_null = true;
	rec.expires_at = nr->expires_at;
	rec.is_token = k->token;
	rec.phase_null = rec.state_null = rec.headers_null = rec.trace_null = true;
	idem_record_columns(&rec, k, values, nulls);
	idem_claim_columns(nr->claim, values, nulls);

	idem_prepare_write(parent, ACL_INSERT);
	rel = table_open(idem_route(parent, nr->expires_at), RowExclusiveLock);
	idem_partition_info(rel, &part);
	tuple = idem_form_tuple(rel, &part, values, nulls);

	/*
	 * Into the partition's known-absent filter before the tuple exists,
	 * under the RowExclusiveLock a filter build waits for (filter.c).
	 */
	if (idem_filter_enabled())
		idem_filter_note(RelationGetRelid(rel),
						 idem_filter_hash(k->scope, k->key));
	idem_prune_target(rel);
	simple_heap_insert(rel, tuple);
	idem_insert_index_entries(rel, tuple, false, false);
	if (place != NULL)
	{
		place->partoid = RelationGetRelid(rel);
		place->tid = tuple->t_self;
		place->xid = GetTopTransactionIdIfAny();
	}
	table_close(rel, NoLock);

	CommandCounterIncrement();
}

/*
 * Replace the record version rec points at by one with the given columns.
 * completes: the new version is the record's completion, which clears the
 * lease where the partition's layout says so (IdemPartition.clear_lease).
 */
static void
idem_update(const IdemRecord *rec, const Datum *values, bool *nulls,
			bool completes)
{
	Relation	rel;
	IdemPartition part;
	HeapTuple	tuple;
	TU_UpdateIndexes update_indexes;

	rel = table_open(rec->partoid, RowExclusiveLock);
	CheckCmdReplicaIdentity(rel, CMD_UPDATE);
	idem_partition_info(rel, &part);
	if (completes && part.clear_lease)
		nulls[COL_LOCKED_UNTIL] = true;
	tuple = idem_form_tuple(rel, &part, values, nulls);

	/*
	 * The row gets the caller's scope and key, which the probe's index found
	 * equal to the stored ones but which may differ in bytes (under a
	 * nondeterministic collation): into the filter too, as an insert.
	 */
	if (idem_filter_enabled())
		idem_filter_note(rec->partoid,
						 idem_filter_hash(DatumGetTextPP(values[COL_SCOPE]),
										  DatumGetTextPP(values[COL_KEY])));
	idem_prune_page(rel, (ItemPointer) &rec->tid);
	idem_simple_heap_update(rel, (ItemPointer) &rec->tid, tuple,
							&update_indexes);
	if (update_indexes != TU_None)
		idem_insert_index_entries(rel, tuple, true,
								  update_indexes == TU_Summarizing);
	table_close(rel, NoLock);

	CommandCounterIncrement();
}

/*
 * Take over a processing record whose lease ran out (or whose owner session
 * is gone): the next attempt, a new lease, the new claim's 1.1 columns, and
 * the request hash if the record had none.
 */
void
idem_records_takeover(Relation parent, const IdemRecord *rec,
					  const IdemKey *k, int32 attempt,
					  TimestampTz locked_until, bytea *request_hash,
					  const IdemClaim *claim)
{
	Datum		values[IDEM_NCOLUMNS];
	bool		nulls[IDEM_NCOLUMNS];

	Assert(rec->found && !rec->completed && !k->token);
	Assert(attempt == rec->attempt + 1);
	idem_prepare_write(parent, ACL_UPDATE);
	idem_record_columns(rec, k, values, nulls);
	values[COL_ATTEMPT] = Int32GetDatum(attempt);
	values[COL_LOCKED_UNTIL] = TimestampTzGetDatum(locked_until);
	nulls[COL_LOCKED_UNTIL] = false;
	if (rec->hash_null && request_hash != NULL)
	{
		values[COL_REQUEST_HASH] = PointerGetDatum(request_hash);
		nulls[COL_REQUEST_HASH] = false;
	}
	idem_claim_columns(claim, values, nulls);
	idem_update(rec, values, nulls, false);
}

/*
 * Push the lease of a processing record out to locked_until (idem_extend);
 * everything else stays.
 */
void
idem_records_extend(Relation parent, const IdemRecord *rec,
					const IdemKey *k, TimestampTz locked_until)
{
	Datum		values[IDEM_NCOLUMNS];
	bool		nulls[IDEM_NCOLUMNS];

	Assert(rec->found && !rec->completed && !k->token);
	idem_prepare_write(parent, ACL_UPDATE);
	idem_record_columns(rec, k, values, nulls);
	values[COL_LOCKED_UNTIL] = TimestampTzGetDatum(locked_until);
	nulls[COL_LOCKED_UNTIL] = false;
	idem_update(rec, values, nulls, false);
}

/*
 * Write a record completed at now: a processing record with its response
 * (status not NULL), or a consumed one-time token (status NULL, no body).
 */
static void
idem_update_completed(Relation parent, const IdemRecord *rec,
					  const IdemKey *k, const int32 *status, Datum body,
					  bool body_null, Datum headers, bool headers_null,
					  TimestampTz now)
{
	Datum		values[IDEM_NCOLUMNS];
	bool		nulls[IDEM_NCOLUMNS];

	Assert(rec->found && !rec->completed);
	Assert(rec->is_token == k->token && (status == NULL) == k->token);
	idem_prepare_write(parent, ACL_UPDATE);
	idem_record_columns(rec, k, values, nulls);
	values[COL_STATUS] = CStringGetTextDatum("completed");
	if (status != NULL)
	{
		values[COL_RESPONSE_STATUS] = Int32GetDatum(*status);
		nulls[COL_RESPONSE_STATUS] = false;
		values[COL_RESPONSE_BODY] = body;
		nulls[COL_RESPONSE_BODY] = body_null;
		values[COL_RESPONSE_HEADERS] = headers;
		nulls[COL_RESPONSE_HEADERS] = headers_null;
	}
	values[COL_COMPLETED_AT] = TimestampTzGetDatum(now);
	nulls[COL_COMPLETED_AT] = false;
	idem_update(rec, values, nulls, true);
}

/*
 * Turn a processing record into completed with its response: status, body
 * and (1.2) headers.  Its checkpoint stays as it was.
 */
void
idem_records_complete(Relation parent, const IdemRecord *rec,
					  const IdemKey *k, int32 status, Datum body,
					  bool body_null, Datum headers, bool headers_null,
					  TimestampTz now)
{
	idem_update_completed(parent, rec, k, &status, body, body_null,
						  headers, headers_null, now);
}

/*
 * Record a processing record's checkpoint (1.2): its phase and state;
 * everything else, the lease included, stays.
 */
void
idem_records_checkpoint(Relation parent, const IdemRecord *rec,
						const IdemKey *k, text *phase, Datum state,
						bool state_null)
{
	Datum		values[IDEM_NCOLUMNS];
	bool		nulls[IDEM_NCOLUMNS];

	Assert(rec->found && !rec->completed && !k->token);
	idem_prepare_write(parent, ACL_UPDATE);
	idem_record_columns(rec, k, values, nulls);
	values[COL_PHASE] = PointerGetDatum(phase);
	nulls[COL_PHASE] = false;
	values[COL_STATE] = state;
	nulls[COL_STATE] = state_null;
	idem_update(rec, values, nulls, false);
}

/*
 * Mark a one-time token consumed.
 */
void
idem_records_consume(Relation parent, const IdemRecord *rec,
					 const IdemKey *k, TimestampTz now)
{
	idem_update_completed(parent, rec, k, NULL, (Datum) 0, true,
						  (Datum) 0, true, now);
}

/*
 * Remove a record version; check_acl: after checking the caller's DELETE
 * privilege, as the executor would.
 */
static void
idem_delete(Relation parent, const IdemRecord *rec, bool check_acl)
{
	Relation	rel;

	idem_prepare_write_acl(parent, ACL_DELETE, check_acl);
	rel = table_open(rec->partoid, RowExclusiveLock);
	CheckCmdReplicaIdentity(rel, CMD_DELETE);
	simple_heap_delete(rel, (ItemPointer) &rec->tid);
	table_close(rel, NoLock);

	CommandCounterIncrement();
}

/*
 * Remove a record version (idem_release, and maintenance's callers).
 */
void
idem_records_delete(Relation parent, const IdemRecord *rec)
{
	idem_delete(parent, rec, true);
}

/*
 * Remove a key's live record for idem_forget, whose EXECUTE privilege
 * stands for the table's: no privilege on idempotency.records is checked.
 */
void
idem_records_forget(Relation parent, const IdemRecord *rec)
{
	Assert(rec->found && !rec->is_token);
	idem_delete(parent, rec, false);
}
