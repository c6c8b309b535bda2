/*-------------------------------------------------------------------------
 *
 * shard.c
 *		A shard's side of idempotency_proxy: the key hash that names a key's
 *		partition, and whether this shard may answer a call for it under the
 *		router's layout.
 *
 * A shard behind idempotency_proxy routers knows, in the one row of
 * idempotency.shard_layout, which hash partitions it owns at which layout
 * version (proxy/README.md).  Every routed claim checks that row after its
 * claim is written and before it commits, so that no router, however stale,
 * makes a key run on two shards; the argument is in proxy/README.md, "Why a
 * key never runs on two shards".  1.2 did the check in PL/pgSQL
 * (shard_key_hash, shard_refusal, shard_acquire); from 1.3 on those three
 * SQL functions are bound to this file's C, through idempotency.c, which
 * spares each routed call three PL/pgSQL frames and their search_path
 * switches (issue 39: the shard's share of a routed call's cost).
 *
 * The check reads the row as the PL/pgSQL did: ACCESS SHARE on the table,
 * held to the caller's commit (a layout is written under ACCESS EXCLUSIVE,
 * so it waits for the claims in flight and they for it), then a snapshot
 * taken after the lock, so that a layout committed while the call waited
 * for the lock is the one read.  The table's OID is kept between calls
 * (forgotten on its relcache invalidation); its row is read on every call,
 * because a change of the row sends no invalidation that would tell a
 * cached copy it is stale.
 *
 * IDENTIFICATION
 *	  shard.c
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/table.h"
#include "access/tableam.h"
#include "access/xact.h"
#include "catalog/namespace.h"
#include "catalog/pg_type.h"
#include "executor/tuptable.h"
#include "mb/pg_wchar.h"
#include "miscadmin.h"
#include "utils/acl.h"
#include "utils/array.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/rel.h"
#include "utils/snapmgr.h"

#include "idempotency.h"

/* The columns of idempotency.shard_layout that the check reads */
typedef enum IdemLayoutColumn
{
	LAYOUT_VERSION,
	LAYOUT_ACTIVE,
	LAYOUT_MAP,
	LAYOUT_OWNED,
	LAYOUT_PREVIOUS_MAP,
	LAYOUT_PREVIOUS_OWNED,
	LAYOUT_NCOLUMNS
} IdemLayoutColumn;

static const char *const idem_layout_column_names[LAYOUT_NCOLUMNS] = {
	[LAYOUT_VERSION] = "version",
	[LAYOUT_ACTIVE] = "active",
	[LAYOUT_MAP] = "map",
	[LAYOUT_OWNED] = "owned",
	[LAYOUT_PREVIOUS_MAP] = "previous_map",
	[LAYOUT_PREVIOUS_OWNED] = "previous_owned",
};

/* OID of idempotency.shard_layout, or InvalidOid until looked up */
static Oid	idem_layout_relid = InvalidOid;

/* Where its columns are; valid with the OID */
static AttrNumber idem_layout_attnum[LAYOUT_NCOLUMNS];

/* The layout row as the check needs it */
typedef struct IdemLayout
{
	int64		version;
	bool		active;
	int32		nmap;			/* partitions of the layout */
	ArrayType  *owned;			/* int[] of those this shard owns */
	bool		has_previous;	/* a growth window is open */
	int32		nprevious;
	ArrayType  *previous_owned; /* or NULL */
} IdemLayout;


/*
 * Relcache invalidation: forget the table's OID when it, or everything, is
 * invalidated (DROP EXTENSION, ALTER EXTENSION UPDATE).
 */
static void
idem_shard_relcache_callback(Datum arg, Oid relid)
{
	if (!OidIsValid(relid) || relid == idem_layout_relid)
		idem_layout_relid = InvalidOid;
}

/*
 * Module load: set up the invalidation of the table's OID.
 */
void
idem_shard_init(void)
{
	CacheRegisterRelcacheCallback(idem_shard_relcache_callback, (Datum) 0);
}

/*
 * idempotency_proxy's key hash of (scope, key): the first four bytes of the
 * SHA-256 of scope's UTF-8, a zero byte and key's UTF-8, read as a signed
 * big-endian integer (what the router computes, and 1.2's PL/pgSQL did).  A
 * NULL scope or key hashes as the empty string.  The shard computes it
 * itself rather than take the router's word for a key's partition.
 */
int32
idem_shard_key_hash(text *scope, text *key)
{
	const char *parts[2];
	int			lens[2];
	StringInfoData buf;
	uint8		digest[SHA256_DIGEST_BYTES];

	parts[0] = scope ? VARDATA_ANY(scope) : "";
	lens[0] = scope ? VARSIZE_ANY_EXHDR(scope) : 0;
	parts[1] = key ? VARDATA_ANY(key) : "";
	lens[1] = key ? VARSIZE_ANY_EXHDR(key) : 0;

	initStringInfo(&buf);
	for (int i = 0; i < 2; i++)
	{
		char	   *utf8;

		if (i > 0)
			appendStringInfoChar(&buf, '\0');
		utf8 = pg_server_to_any(parts[i], lens[i], PG_UTF8);
		appendBinaryStringInfo(&buf, utf8, utf8 == parts[i] ? lens[i] :
							   (int) strlen(utf8));
		if (utf8 != parts[i])
			pfree(utf8);
	}
	idem_sha256((const uint8 *) buf.data, buf.len, digest);
	pfree(buf.data);

	return (int32) (((uint32) digest[0] << 24) | ((uint32) digest[1] << 16) |
					((uint32) digest[2] << 8) | (uint32) digest[3]);
}

/*
 * Open idempotency.shard_layout (ACCESS SHARE, held to the transaction's
 * end), after checking that the caller may SELECT from it, as the
 * PL/pgSQL's SELECT did: the role a router connects as is granted it
 * (proxy/README.md, "Grants on the shards").
 */
static Relation
idem_layout_open(void)
{
	Relation	rel = NULL;
	AclResult	aclresult;

	if (OidIsValid(idem_layout_relid))
		rel = try_table_open(idem_layout_relid, AccessShareLock);
	if (rel == NULL)
	{
		Oid			nspoid = get_namespace_oid("idempotency", true);
		Oid			relid = InvalidOid;

		if (OidIsValid(nspoid))
			relid = get_relname_relid("shard_layout", nspoid);
		if (!OidIsValid(relid))
			ereport(ERROR,
					(errcode(ERRCODE_UNDEFINED_TABLE),
					 errmsg("relation \"idempotency.shard_layout\" does not exist"),
					 errhint("Run ALTER EXTENSION idempotency UPDATE in this database.")));
		rel = table_open(relid, AccessShareLock);
		idem_layout_relid = InvalidOid;
	}

	/* opening may have processed an invalidation: look the columns up again */
	if (!OidIsValid(idem_layout_relid))
	{
		TupleDesc	desc = RelationGetDescr(rel);

		for (int c = 0; c < LAYOUT_NCOLUMNS; c++)
		{
			idem_layout_attnum[c] = InvalidAttrNumber;
			for (int i = 0; i < desc->natts; i++)
			{
				Form_pg_attribute att = TupleDescAttr(desc, i);

				if (!att->attisdropped &&
					strcmp(NameStr(att->attname), idem_layout_column_names[c]) == 0)
					idem_layout_attnum[c] = att->attnum;
			}
			if (idem_layout_attnum[c] == InvalidAttrNumber)
				ereport(ERROR,
						(errcode(ERRCODE_UNDEFINED_COLUMN),
						 errmsg("column \"%s\" of relation \"%s\" does not exist",
								idem_layout_column_names[c], "idempotency.shard_layout"),
						 errhint("Run ALTER EXTENSION idempotency UPDATE in this database.")));
		}
		idem_layout_relid = RelationGetRelid(rel);
	}

	aclresult = pg_class_aclcheck(RelationGetRelid(rel), GetUserId(), ACL_SELECT);
	if (aclresult != ACLCHECK_OK)
		aclcheck_error(aclresult, OBJECT_TABLE, RelationGetRelationName(rel));
	return rel;
}

/* Number of elements of a one-dimensional array, 0 for an empty one */
static int32
idem_array_length(ArrayType *a)
{
	return ArrayGetNItems(ARR_NDIM(a), ARR_DIMS(a));
}

/*
 * Whether int[] a holds part (a NULL element matches nothing; a NULL array,
 * passed as NULL, holds nothing).
 */
static bool
idem_array_holds(ArrayType *a, int32 part)
{
	Datum	   *elems;
	bool	   *nulls;
	int			n;
	bool		found = false;

	if (a == NULL)
		return false;
	deconstruct_array(a, INT4OID, sizeof(int32), true, TYPALIGN_INT,
					  &elems, &nulls, &n);
	for (int i = 0; i < n && !found; i++)
		found = !nulls[i] && DatumGetInt32(elems[i]) == part;
	pfree(elems);
	pfree(nulls);
	return found;
}

/*
 * Read the first row of rel under snapshot into slot; false if none.
 */
static bool
idem_layout_scan(Relation rel, Snapshot snapshot, TupleTableSlot *slot)
{
	TableScanDesc scan = table_beginscan(rel, snapshot, 0, NULL);
	bool		found;

	found = table_scan_getnextslot(scan, ForwardScanDirection, slot);
	table_endscan(scan);
	return found;
}

/*
 * Read the layout row into *l, under a snapshot taken now (after the lock).
 * False when the table has no row.  The table stays locked.
 *
 * Under REPEATABLE READ and SERIALIZABLE the snapshot is the transaction's,
 * which may predate a layout committed since (a claim that waited for the
 * lock of a layout install, or a transaction that began before it): a claim
 * checked against the layout it replaced could commit after it, which the
 * argument of proxy/README.md rules out.  So there the row is read again
 * under the latest snapshot, and a change since the transaction's snapshot
 * is a serialization failure (40001): the caller retries the transaction,
 * which then sees the new layout.
 */
static bool
idem_layout_read(IdemLayout *l)
{
	Relation	rel = idem_layout_open();
	Snapshot	snapshot = RegisterSnapshot(GetTransactionSnapshot());
	TupleTableSlot *slot = table_slot_create(rel, NULL);
	bool		found;

	found = idem_layout_scan(rel, snapshot, slot);
	if (found)
	{
		Datum		d;
		bool		isnull;

		d = slot_getattr(slot, idem_layout_attnum[LAYOUT_VERSION], &isnull);
		l->version = isnull ? 0 : DatumGetInt64(d);
		d = slot_getattr(slot, idem_layout_attnum[LAYOUT_ACTIVE], &isnull);
		l->active = !isnull && DatumGetBool(d);
		d = slot_getattr(slot, idem_layout_attnum[LAYOUT_MAP], &isnull);
		l->nmap = isnull ? 0 : idem_array_length(DatumGetArrayTypeP(d));
		d = slot_getattr(slot, idem_layout_attnum[LAYOUT_OWNED], &isnull);
		l->owned = isnull ? NULL : DatumGetArrayTypePCopy(d);
		d = slot_getattr(slot, idem_layout_attnum[LAYOUT_PREVIOUS_MAP], &isnull);
		l->has_previous = !isnull;
		l->nprevious = isnull ? 0 : idem_array_length(DatumGetArrayTypeP(d));
		d = slot_getattr(slot, idem_layout_attnum[LAYOUT_PREVIOUS_OWNED], &isnull);
		l->previous_owned = isnull ? NULL : DatumGetArrayTypePCopy(d);
	}
	UnregisterSnapshot(snapshot);

	if (IsolationUsesXactSnapshot())
	{
		ItemPointerData tid = slot->tts_tid;
		Snapshot	latest = RegisterSnapshot(GetLatestSnapshot());
		bool		found_now;

		found_now = idem_layout_scan(rel, latest, slot);
		UnregisterSnapshot(latest);
		if (found_now != found ||
			(found && !ItemPointerEquals(&tid, &slot->tts_tid)))
			ereport(ERROR,
					(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
					 errmsg("could not serialize access due to a concurrent change of the shard layout"),
					 errdetail("This shard's layout changed after the transaction's snapshot was taken."),
					 errhint("Retry the transaction.")));
	}

	ExecDropSingleTupleTableSlot(slot);
	table_close(rel, NoLock);
	return found;
}

/*
 * Why this shard may not answer a call for partition hash from a router at
 * layout version layout (NULL: the router sent none): true with *message
 * and *detail set (the 55R01's), or false when it may.  fresh: the call
 * makes a new record (a new claim, a token), which needs the partition
 * owned under the layout in force; otherwise (an existing record answered:
 * replay, in_progress, mismatch, a takeover) owning it under the previous
 * layout is enough.  The router's version matters only where the argument
 * of proxy/README.md needs it: a new claim of a key that moved here in the
 * newest growth is taken only from a router at this shard's version (that
 * router looked at the key's previous shard first); a key this shard owned
 * before the growth and owns now is taken from a router at any version, so
 * a growth refuses no call of a key that does not move.  A shard without a
 * layout answers routers that send none, as 1.1 did.
 *
 * A NULL element of owned or previous_owned, or a NULL previous_owned beside
 * a previous_map, owns nothing here, where 1.2's SQL let some of those
 * calls through on its NULL logic; the routers never write such a row
 * (shard_layout_install takes what they computed).
 */
bool
idem_shard_refusal(bool layout_null, int64 layout, int32 hash, bool fresh,
				   char **message, const char **detail)
{
	IdemLayout	l = {0};
	int32		part;
	bool		now_own;
	bool		was_own;

	if (!idem_layout_read(&l))
	{
		if (layout_null)
			return false;
		*message = psprintf("this shard has no layout, the router sent layout " INT64_FORMAT,
							layout);
		*detail = "Declare the shards on the router again with idempotency.cluster_create(), which writes the layout to each.";
		return true;
	}

	part = hash & (l.nmap - 1);
	now_own = idem_array_holds(l.owned, part);
	was_own = l.has_previous &&
		idem_array_holds(l.previous_owned, hash & (l.nprevious - 1));

	if (layout_null ||
		(layout != l.version && !(now_own && (was_own || !l.has_previous))))
	{
		*message = psprintf("the router's layout %s is not this shard's layout " INT64_FORMAT,
							layout_null ? "none" : psprintf(INT64_FORMAT, layout),
							l.version);
		*detail = (layout_null || layout < l.version) ?
			"The router has not heard of the newest growth." :
			"This shard has not been told of the router's growth.";
		return true;
	}
	if (now_own && (l.active || was_own))
		return false;
	if ((was_own || now_own) && !fresh)
		return false;

	*message = psprintf("partition %d of layout " INT64_FORMAT " is not owned by this shard",
						part, l.version);
	*detail = was_own ?
		"It moved to another shard: only its existing records are answered here." :
		now_own ? "It moves here once the growth is in force." :
		"Another shard owns it.";
	return true;
}
