/*-------------------------------------------------------------------------
 *
 * filterbuild.c
 *		What keeps the known-absent filters (filter.c) true: the trigger
 *		that notes the keys of every insert path but the extension's own,
 *		the builds, and the invalidation of every filter that a catalog
 *		change or a rollback may have made wrong.
 *
 * The one rule (filter.c) is that a READY filter never says absent for a
 * key present in its partition.  So:
 *
 * - Every insert into a partition adds its (scope, key) to the partition's
 *   slot (state BUILDING or READY) before the heap tuple exists, while
 *   holding RowExclusiveLock on the partition: idem_records_insert does so
 *   itself (filter.c's idem_filter_note), every other path (SQL INSERT,
 *   COPY, UPDATE, logical replication apply) through the row trigger
 *   zz_records_filter, which is ENABLE ALWAYS and must be the last BEFORE
 *   ROW trigger (a later one could change the key); where it is not, it
 *   invalidates the slot.
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
 * This file calls filter.c (the slots) and records.c (the partitions); no
 * file calls back into it but through SQL and the hooks it registers.
 *
 * IDENTIFICATION
 *	  filterbuild.c
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/detoast.h"
#include "access/genam.h"
#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/relation.h"
#include "access/table.h"
#include "access/tableam.h"
#include "access/transam.h"
#include "access/xact.h"
#include "access/xlog.h"
#include "catalog/indexing.h"
#include "catalog/namespace.h"
#include "catalog/objectaccess.h"
#include "catalog/pg_am.h"
#include "catalog/pg_class.h"
#include "catalog/pg_database.h"
#include "catalog/pg_language.h"
#include "catalog/pg_proc.h"
#include "catalog/pg_trigger.h"
#include "commands/dbcommands.h"
#include "commands/trigger.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "miscadmin.h"
#include "storage/ipc.h"
#include "storage/lmgr.h"
#include "storage/lock.h"
#include "storage/proc.h"
#include "utils/builtins.h"
#include "utils/fmgroids.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/rel.h"
#include "utils/snapmgr.h"
#include "utils/syscache.h"
#include "utils/timestamp.h"

#include "compat.h"
#include "idempotency.h"

/* Name of the trigger that notes the keys of every other insert path */
#define IDEM_FILTER_TRIGGER		"zz_records_filter"
#define IDEM_FILTER_FUNCTION	"records_note_key"

/* Saved hook value */
static object_access_hook_type prev_object_access_hook = NULL;

static void idem_filter_object_access(ObjectAccessType access, Oid classId,
									  Oid objectId, int subId, void *arg);
static void idem_filter_xact_callback(XactEvent event, void *arg);
static void idem_filter_subxact_callback(SubXactEvent event,
										 SubTransactionId mySubid,
										 SubTransactionId parentSubid,
										 void *arg);

PG_FUNCTION_INFO_V1(idem_records_note_key);
PG_FUNCTION_INFO_V1(idem_build_filters);


/*
 * Module load: the hook and the transaction callbacks, when the library is
 * preloaded with filters (filter.c has defined the settings by then).
 */
void
idem_filterbuild_init(void)
{
	if (!idem_filter_configured())
		return;
	prev_object_access_hook = object_access_hook;
	object_access_hook = idem_filter_object_access;
	RegisterXactCallback(idem_filter_xact_callback, NULL);
	RegisterSubXactCallback(idem_filter_subxact_callback, NULL);
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
	if (idem_filter_has_slot(relid))
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

	if (!idem_filter_enabled() ||
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

	if (!idem_filter_enabled() || !TRIGGER_FIRED_FOR_ROW(trigdata->tg_event) ||
		!TRIGGER_FIRED_BEFORE(trigdata->tg_event) ||
		!(TRIGGER_FIRED_BY_INSERT(trigdata->tg_event) ||
		  TRIGGER_FIRED_BY_UPDATE(trigdata->tg_event)))
	{
		if (idem_filter_enabled())
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
		if (idem_filter_has_slot(RelationGetRelid(rel)))
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

	if (build->slot != NULL)
		idem_filter_release_if(build->slot, build->gen);
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
											   sizeof(IdemFilterMade) * idem_filter_nslots());
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

		if (m->slot == slot || !idem_filter_is_current(m->slot, m->gen))
			continue;
		idem_filters_made[kept++] = *m;
	}
	Assert(kept < idem_filter_nslots());
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
		idem_filter_release_if(m->slot, m->gen);
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

	SET_LOCKTAG_RELATION(tag, MyDatabaseId, relid);
	vxids = GetLockConflicts(&tag, ShareLock, &n);
	idem_filter_put_waiting(build->slot, build->gen, vxids, n);
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
	VirtualTransactionId *vxids;
	VirtualTransactionId mine;
	TimestampTz deadline = 0;
	int			n;

	vxids = palloc(sizeof(VirtualTransactionId) * idem_filter_max_waiting());
	n = idem_filter_get_waiting(build->slot, build->gen, vxids);
	if (n < 0)
	{
		/* no list was ever put (idem_filter_building refuses such a slot) */
		pfree(vxids);
		return false;
	}
	GET_VXID_FROM_PGPROC(mine, *MyProc);

	if (max_wait_ms >= 0)
		deadline = TimestampTzPlusMilliseconds(GetCurrentTimestamp(),
											   max_wait_ms);
	while (n > 0)
	{
		int			kept = 0;
		int			j;

		/*
		 * Without an end, a lock wait that pg_locks and deadlock checks see.
		 * This transaction, where another build listed it, is not waited
		 * for: the rows it has inserted are in the heap for the fill to see,
		 * and it adds the keys of those it inserts from now on.
		 */
		for (j = 0; j < n; j++)
			if (!VirtualTransactionIdEquals(vxids[j], mine) &&
				!VirtualXactLock(vxids[j], max_wait_ms < 0))
				vxids[kept++] = vxids[j];
		n = kept;
		if (n == 0 || GetCurrentTimestamp() >= deadline)
			break;
		CHECK_FOR_INTERRUPTS();
		pg_usleep(5000L);
	}

	idem_filter_put_waiting(build->slot, build->gen, vxids, n);
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
			idem_filter_add(slot, hash);
	}
	table_endscan(scan);
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

	/*
	 * From the claim on, an error frees the slot: one left BUILDING without
	 * its wait list would let a later build go on without waiting.
	 */
	build.slot = NULL;
	PG_ENSURE_ERROR_CLEANUP(idem_filter_build_cleanup, PointerGetDatum(&build));
	{
		build.slot = idem_filter_building(relid, &build.gen);
		if (build.slot == NULL)
		{
			build.slot = idem_filter_claim(relid, until, now, &build.gen);
			if (build.slot != NULL)
				idem_filter_note_inserters(&build, relid);
		}
		if (build.slot == NULL)
			outcome = FILTER_NO_SLOT;
		else if (idem_filter_wait_inserters(&build, max_wait_ms))
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

	/* nothing between the two can fail: the room was made beforehand */
	if (!idem_filter_mark_ready(build.slot, build.gen))
		return FILTER_DEFERRED;
	idem_filter_remember(build.slot, build.gen);
	return FILTER_BUILT;
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
	bool		first = idem_filter_note_starved(relname != NULL);

	if (relname == NULL)
		return;

	if (first)
		ereport(LOG,
				(errmsg("no idempotency filter slot left for partition \"%s\" of database \"%s\"",
						relname, get_database_name(MyDatabaseId)),
				 errdetail("All %d slots set by idempotency.filters hold filters of live partitions; every database of the server takes its slots from them.",
						   idem_filter_nslots()),
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

	if (!idem_filter_enabled())
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
		Relation	rel;
		const char *why;
		IdemFilterOutcome outcome;

		if (idem_filter_is_ready(relid))
			continue;

		/*
		 * SHARE UPDATE EXCLUSIVE conflicts with trigger DDL and other builds,
		 * not with inserts.  Never wait for it: whoever holds it may be
		 * waiting for us.
		 */
		if (!ConditionalLockRelationOid(relid, ShareUpdateExclusiveLock))
			continue;
		/* a build that held the lock may have made it READY meanwhile */
		if (idem_filter_is_ready(relid))
		{
			UnlockRelationOid(relid, ShareUpdateExclusiveLock);
			continue;
		}
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
