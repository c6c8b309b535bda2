/*-------------------------------------------------------------------------
 *
 * compat.h
 *		One name for each PostgreSQL API that changed between the majors
 *		the extension builds on (15 to 18).
 *
 * The C files call the names defined here and read the same on every
 * major; each guard tests PG_VERSION_NUM and says which release changed
 * the API.  Keep every such guard here rather than in the code that uses
 * it.
 *
 * IDENTIFICATION
 *	  compat.h
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_COMPAT_H
#define IDEMPOTENCY_COMPAT_H

#include "access/genam.h"
#include "access/heapam.h"
#include "access/htup_details.h"
#include "catalog/pg_class.h"
#include "miscadmin.h"
#include "nodes/execnodes.h"
#include "portability/instr_time.h"
#include "storage/proc.h"
#include "utils/acl.h"

#if PG_VERSION_NUM < 160000
/*
 * What a heap update needs in the indexes (16 added this to tableam.h).
 * Before 16 there were no summarizing indexes, and an update needed new
 * entries in every index unless it was a HOT update.
 */
typedef enum TU_UpdateIndexes
{
	TU_None,					/* no index entries needed (HOT update) */
	TU_All,						/* entries needed in every index */
	TU_Summarizing				/* only in summarizing indexes */
} TU_UpdateIndexes;
#endif

/*
 * idem_index_beginscan
 *		index_beginscan without instrumentation.
 *
 * PostgreSQL 18 added an IndexScanInstrumentation argument, through which
 * EXPLAIN ANALYZE counts index searches; nothing of ours is counted there.
 */
static inline IndexScanDesc
idem_index_beginscan(Relation heapRelation, Relation indexRelation,
					 Snapshot snapshot, int nkeys, int norderbys)
{
#if PG_VERSION_NUM >= 180000
	return index_beginscan(heapRelation, indexRelation, snapshot, NULL,
						   nkeys, norderbys);
#else
	return index_beginscan(heapRelation, indexRelation, snapshot,
						   nkeys, norderbys);
#endif
}

/*
 * idem_simple_heap_update
 *		simple_heap_update, also telling which index entries the new
 *		version needs.
 *
 * PostgreSQL 16 made simple_heap_update report that itself, in
 * *update_indexes; before 16 it is told by whether the new version is
 * heap-only (HOT).
 */
static inline void
idem_simple_heap_update(Relation relation, ItemPointer otid, HeapTuple tup,
						TU_UpdateIndexes *update_indexes)
{
#if PG_VERSION_NUM >= 160000
	simple_heap_update(relation, otid, tup, update_indexes);
#else
	simple_heap_update(relation, otid, tup);
	*update_indexes = HeapTupleIsHeapOnly(tup) ? TU_None : TU_All;
#endif
}

/*
 * idem_index_is_summarizing
 *		Whether an index is summarizing (BRIN): it needs entries even for a
 *		HOT update.  Such indexes exist since PostgreSQL 16.
 */
static inline bool
idem_index_is_summarizing(const IndexInfo *info)
{
#if PG_VERSION_NUM >= 160000
	return info->ii_Summarizing;
#else
	return false;
#endif
}

/*
 * idem_my_proc_number
 *		This backend's index among the PGPROCs.
 *
 * PostgreSQL 17 replaced PGPROC's pgprocno by the global MyProcNumber.
 */
static inline int
idem_my_proc_number(void)
{
#if PG_VERSION_NUM >= 170000
	return MyProcNumber;
#else
	return MyProc->pgprocno;
#endif
}

/*
 * idem_class_ownercheck
 *		Whether role owns relation relid (or is a superuser).
 *
 * PostgreSQL 16 replaced pg_class_ownercheck by object_ownercheck.
 */
static inline bool
idem_class_ownercheck(Oid relid, Oid roleid)
{
#if PG_VERSION_NUM >= 160000
	return object_ownercheck(RelationRelationId, relid, roleid);
#else
	return pg_class_ownercheck(relid, roleid);
#endif
}

/*
 * idem_instr_time_nsec
 *		An instr_time interval in nanoseconds.
 *
 * PostgreSQL 16 made instr_time a count of nanoseconds and added
 * INSTR_TIME_GET_NANOSEC; before, on Unix, it is a struct timespec.
 */
static inline uint64
idem_instr_time_nsec(instr_time t)
{
#if PG_VERSION_NUM >= 160000
	return (uint64) INSTR_TIME_GET_NANOSEC(t);
#else
	return (uint64) t.tv_sec * UINT64CONST(1000000000) + (uint64) t.tv_nsec;
#endif
}

#endif							/* IDEMPOTENCY_COMPAT_H */
