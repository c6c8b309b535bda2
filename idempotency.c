/*-------------------------------------------------------------------------
 *
 * idempotency.c
 *		Exactly-once write endpoints: idempotency keys claimed, completed,
 *		replayed and released from SQL.
 *
 * A record is identified by (scope, key) and lives in idempotency.records, a
 * table range-partitioned on expires_at.  The SQL contract these functions
 * implement is docs/reference.md; this file is the "how".
 *
 * Uniqueness, waiting and snapshots.  Every write of a (scope, key) is made
 * under its key lock, after a read that sees what other transactions are
 * still writing, waiting for them where need be, and checked against the
 * transaction's snapshot under REPEATABLE READ and SERIALIZABLE: keylock.c,
 * whose header says how and why.
 *
 * Replays.  A completed record never changes until it expires, so under
 * READ COMMITTED idem_acquire answers a key whose completed record its
 * statement's snapshot sees without waiting for the key lock: without
 * taking it where the known-absent filters (filter.c) answer for every live
 * partition, else by reading without it whenever it is busy (see
 * idem_acquire_replay_unlocked); everything else is read again under the
 * lock.
 *
 * Clock.  "Now" is the server's clock at the time of the call
 * (clock_timestamp()), not the transaction's start: expiry and leases follow
 * the database's clock even inside long transactions.
 *
 * Storage.  The functions read and write idempotency.records through
 * records.c, which goes to the partitions' indexes and heaps directly, with
 * no SQL at all: nothing here depends on the caller's search_path, and the
 * hot path pays for no planning or executor start-up.
 *
 * IDENTIFICATION
 *	  idempotency.c
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <limits.h>

#include "access/detoast.h"
#include "access/xact.h"
#include "catalog/pg_type.h"
#include "common/int.h"
#include "fmgr.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "storage/lock.h"
#include "tcop/utility.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/json.h"
#include "utils/jsonb.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"
#include "utils/uuid.h"

#include "idempotency.h"

PG_MODULE_MAGIC;

#if PG_VERSION_NUM < 160000
void		_PG_init(void);
#endif

/* Most headers idem_complete stores with a response (1.2) */
#define IDEM_MAX_HEADERS		64

/* retry_after of an in_progress claim that has no lease end to count to */
#define IDEM_RETRY_AFTER_MIN	1

/* Sleep steps while waiting for a committed claim to complete, in ms */
#define IDEM_POLL_MIN_MS		2
#define IDEM_POLL_MAX_MS		50

/* GUC variables */
static int	idem_default_ttl = 24 * 60 * 60;	/* seconds */
static int	idem_max_ttl = 7 * 24 * 60 * 60;	/* seconds */
static int	idem_default_lease = 60;	/* seconds */
static int	idem_wait_timeout = 3000;	/* milliseconds */
static int	idem_max_response_bytes = 1024 * 1024;	/* bytes */
static int	idem_partition_interval = 24 * 60 * 60;	/* seconds */
static int	idem_maintenance_lock_timeout = 100;	/* milliseconds */

/*
 * Where this backend last wrote a new claim, and in which transaction: a
 * hint for idem_complete, which in the usual pattern (acquire, business
 * writes, complete, all in one transaction) then reads the record at that
 * place instead of probing the partitions for it.  idem_records_fetch checks
 * that the row there is still that claim.
 */
static IdemPlace idem_last_claim = {InvalidTransactionId};

/* idempotency.default_ttl in microseconds */
static inline int64
idem_default_ttl_usecs(void)
{
	return (int64) idem_default_ttl * USECS_PER_SEC;
}

/* Outcomes of idem_acquire */
typedef enum IdemOutcome
{
	IDEM_ACQUIRED,
	IDEM_REPLAY,
	IDEM_IN_PROGRESS,
	IDEM_MISMATCH
} IdemOutcome;

static const char *const idem_outcome_names[] = {
	[IDEM_ACQUIRED] = "acquired",
	[IDEM_REPLAY] = "replay",
	[IDEM_IN_PROGRESS] = "in_progress",
	[IDEM_MISMATCH] = "mismatch",
};

/* The counter of each outcome in the statistics */
static const IdemStat idem_outcome_stats[] = {
	[IDEM_ACQUIRED] = IDEM_STAT_ACQUIRED,
	[IDEM_REPLAY] = IDEM_STAT_REPLAYED,
	[IDEM_IN_PROGRESS] = IDEM_STAT_IN_PROGRESS,
	[IDEM_MISMATCH] = IDEM_STAT_MISMATCHED,
};

/*
 * The SQL interface an entry point serves.  A database still at 1.0 (the
 * library was replaced before ALTER EXTENSION idempotency UPDATE) calls the
 * 1.0 symbols, which behave and answer exactly as 1.0 did and never write the
 * 1.1 columns; the 1.1 SQL functions are bound to the _1_1 symbols, so that a
 * backend still running the 1.0 library fails to find them rather than fill
 * 1.0's result shape into 1.1's (as pg_stat_statements does).  1.2 did the
 * same for the functions whose arguments or results it changed (_1_2), and
 * for idem_extend, whose 1.1 library would write a record without its 1.2
 * columns.  A later interface serves everything an earlier one does.
 */
typedef enum IdemApi
{
	IDEM_API_1_0,
	IDEM_API_1_1,
	IDEM_API_1_2
} IdemApi;

PG_FUNCTION_INFO_V1(idem_acquire);
PG_FUNCTION_INFO_V1(idem_acquire_1_1);
PG_FUNCTION_INFO_V1(idem_acquire_1_2);
PG_FUNCTION_INFO_V1(idem_complete);
PG_FUNCTION_INFO_V1(idem_complete_1_1);
PG_FUNCTION_INFO_V1(idem_complete_1_2);
PG_FUNCTION_INFO_V1(idem_release);
PG_FUNCTION_INFO_V1(idem_release_1_1);
PG_FUNCTION_INFO_V1(idem_lookup);
PG_FUNCTION_INFO_V1(idem_lookup_1_1);
PG_FUNCTION_INFO_V1(idem_lookup_1_2);
PG_FUNCTION_INFO_V1(idem_extend);
PG_FUNCTION_INFO_V1(idem_extend_1_2);
PG_FUNCTION_INFO_V1(idem_checkpoint);
PG_FUNCTION_INFO_V1(idem_forget);
PG_FUNCTION_INFO_V1(idem_request_hash);
PG_FUNCTION_INFO_V1(idem_maintenance_settings);
PG_FUNCTION_INFO_V1(idem_token_issue);
PG_FUNCTION_INFO_V1(idem_token_consume);
PG_FUNCTION_INFO_V1(idem_owner_alive_sql);
PG_FUNCTION_INFO_V1(idem_shard_key_hash_sql);
PG_FUNCTION_INFO_V1(idem_shard_refusal_sql);
PG_FUNCTION_INFO_V1(idem_shard_acquire);


/*
 * Module load: define the settings.
 *
 * Time settings take PostgreSQL's units, so '24h' and '7d' work and a bare
 * number means seconds (milliseconds for wait_timeout).  The two limits that
 * protect the server from its users are superuser-only.
 */
void
_PG_init(void)
{
	DefineCustomIntVariable("idempotency.default_ttl",
							"Time to live of a record when idem_acquire is given no ttl.",
							NULL,
							&idem_default_ttl,
							24 * 60 * 60, 1, INT_MAX,
							PGC_USERSET,
							GUC_UNIT_S,
							NULL, NULL, NULL);

	DefineCustomIntVariable("idempotency.max_ttl",
							"Largest time to live that idem_acquire accepts.",
							NULL,
							&idem_max_ttl,
							7 * 24 * 60 * 60, 1, INT_MAX,
							PGC_SUSET,
							GUC_UNIT_S,
							NULL, NULL, NULL);

	DefineCustomIntVariable("idempotency.default_lease",
							"Lease of a claim when idem_acquire is given none.",
							"The lease is capped at the record's time to live.",
							&idem_default_lease,
							60, 1, INT_MAX,
							PGC_USERSET,
							GUC_UNIT_S,
							NULL, NULL, NULL);

	DefineCustomIntVariable("idempotency.wait_timeout",
							"How long idem_acquire waits for a duplicate claim in progress to finish.",
							"Zero answers in_progress at once.",
							&idem_wait_timeout,
							3000, 0, INT_MAX,
							PGC_USERSET,
							GUC_UNIT_MS,
							NULL, NULL, NULL);

	DefineCustomIntVariable("idempotency.max_response_bytes",
							"Largest response_body that idem_complete stores, as pg_column_size() measures it.",
							NULL,
							&idem_max_response_bytes,
							1024 * 1024, 1, MaxAllocSize,
							PGC_SUSET,
							GUC_UNIT_BYTE,
							NULL, NULL, NULL);

	/*
	 * The partition settings are read by idem_maintain (SQL); they are
	 * defined here because the prefix is reserved.
	 */
	DefineCustomIntVariable("idempotency.partition_interval",
							"Width of the partitions of idempotency.records that maintenance creates.",
							"Wider partitions mean fewer partitions for each call to look in, narrower ones free disk sooner after records expire.",
							&idem_partition_interval,
							24 * 60 * 60, 1, 31 * 24 * 60 * 60,
							PGC_SUSET,
							GUC_UNIT_S,
							NULL, NULL, NULL);

	DefineCustomIntVariable("idempotency.maintenance_lock_timeout",
							"How long maintenance waits for a lock on idempotency.records before leaving the work to its next run.",
							NULL,
							&idem_maintenance_lock_timeout,
							100, 1, INT_MAX,
							PGC_SUSET,
							GUC_UNIT_MS,
							NULL, NULL, NULL);

	/* the statistics' settings, and their shared memory if preloaded */
	idem_stats_init();

	/* the known-absent filters' settings and hooks, if preloaded */
	idem_filter_init();
	idem_filterbuild_init();

	MarkGUCPrefixReserved("idempotency");

	idem_records_init();
	idem_shard_init();
}


/* ----------------------------------------------------------------
 * Argument checks
 *
 * Every check runs before anything is locked or written, so bad input leaves
 * no trace.
 * ----------------------------------------------------------------
 */

/*
 * Return string argument argno, named what ("key", "scope", "token") in
 * errors, after checking it: not NULL, at most IDEM_MAX_KEY_BYTES bytes,
 * and not empty if nonempty.  too_long_hint is the hint of the error for
 * one that is too long: what the caller should pass instead.
 */
static text *
idem_check_string(FunctionCallInfo fcinfo, int argno, const char *what,
				  bool nonempty, const char *too_long_hint)
{
	text	   *t;
	size_t		len;

	if (PG_ARGISNULL(argno))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("idempotency %s must not be null", what),
				 nonempty ? 0 : errhint("Use '' for the default scope.")));

	t = PG_GETARG_TEXT_PP(argno);
	len = VARSIZE_ANY_EXHDR(t);

	if (nonempty && len == 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("idempotency %s must not be empty", what)));
	if (len > IDEM_MAX_KEY_BYTES)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("idempotency %s is too long", what),
				 errdetail("It has %zu bytes; the limit is %d.",
						   len, IDEM_MAX_KEY_BYTES),
				 errhint("%s", too_long_hint)));
	return t;
}

/*
 * Return argument argno, the key (is_key) or the scope, after checking it:
 * not NULL, at most IDEM_MAX_KEY_BYTES bytes, and for the key not empty.
 * A longer natural key or scope fits once hashed, which the hint says.
 */
static text *
idem_check_ident(FunctionCallInfo fcinfo, int argno, bool is_key)
{
	if (is_key)
		return idem_check_string(fcinfo, argno, "key", true,
								 "Pass a hash of a longer natural key, such as the hex of its SHA-256 (64 bytes).");
	return idem_check_string(fcinfo, argno, "scope", false,
							 "Pass a hash of a longer scope, such as the hex of its SHA-256 (64 bytes).");
}

/*
 * Length of an interval in microseconds, counting a day as 24 hours and a
 * month as 30 days as interval comparison does.  Returns false on overflow.
 */
static bool
idem_interval_usecs(const Interval *span, int64 *result)
{
	int64		days;
	int64		usecs;

	if (pg_mul_s64_overflow((int64) span->month, DAYS_PER_MONTH, &days) ||
		pg_add_s64_overflow(days, (int64) span->day, &days) ||
		pg_mul_s64_overflow(days, USECS_PER_DAY, &usecs) ||
		pg_add_s64_overflow(usecs, span->time, &usecs))
		return false;
	*result = usecs;
	return true;
}

/*
 * Check the ttl argument (argument number ttl_arg, NULL meaning
 * idempotency.default_ttl) and return it as microseconds.
 */
static int64
idem_check_ttl(FunctionCallInfo fcinfo, int ttl_arg)
{
	int64		max_usecs = (int64) idem_max_ttl * USECS_PER_SEC;
	int64		ttl;

	if (PG_ARGISNULL(ttl_arg))
	{
		ttl = (int64) idem_default_ttl * USECS_PER_SEC;
		if (ttl > max_usecs)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("idempotency.default_ttl is larger than idempotency.max_ttl"),
					 errhint("Pass a ttl, or lower idempotency.default_ttl.")));
	}
	else if (!idem_interval_usecs(PG_GETARG_INTERVAL_P(ttl_arg), &ttl) ||
			 ttl <= 0 || ttl > max_usecs)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("ttl must be greater than zero and at most idempotency.max_ttl"),
				 errdetail("idempotency.max_ttl is %d seconds.", idem_max_ttl)));
	return ttl;
}

/*
 * Check the ttl and lease arguments (argument numbers ttl_arg and lease_arg,
 * NULL meaning the settings) and return both as microseconds.
 */
static void
idem_check_ttl_lease(FunctionCallInfo fcinfo, int ttl_arg, int lease_arg,
					 int64 *ttl_usecs, int64 *lease_usecs)
{
	int64		ttl = idem_check_ttl(fcinfo, ttl_arg);
	int64		lease;

	if (PG_ARGISNULL(lease_arg))
		lease = Min((int64) idem_default_lease * USECS_PER_SEC, ttl);
	else if (!idem_interval_usecs(PG_GETARG_INTERVAL_P(lease_arg), &lease) ||
			 lease <= 0 || lease > ttl)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("lease must be greater than zero and at most the ttl")));

	*ttl_usecs = ttl;
	*lease_usecs = lease;
}

/*
 * Check the attempt argument: NULL (any attempt) or a positive number.
 */
static bool
idem_check_attempt(FunctionCallInfo fcinfo, int argno, int32 *attempt)
{
	if (PG_ARGISNULL(argno))
		return false;
	*attempt = PG_GETARG_INT32(argno);
	if (*attempt < 1)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("attempt must be a positive number")));
	return true;
}

/*
 * The claim argument (1.1): NULL (any claim) or the claim to check.
 */
static bool
idem_check_claim_arg(FunctionCallInfo fcinfo, int argno, pg_uuid_t *claim)
{
	if (PG_ARGISNULL(argno))
		return false;
	memcpy(claim, PG_GETARG_UUID_P(argno), sizeof(pg_uuid_t));
	return true;
}

/*
 * Called by the 1.1 entry points once idempotency.records is open: the
 * table must have the 1.1 columns.  It lacks them only where the 1.1 SQL
 * functions were created without the update script's ALTER TABLE; refuse
 * rather than lose the claims.
 */
static void
idem_require_1_1(void)
{
	if (!idem_records_have_claims())
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("table \"idempotency.records\" has no columns of version 1.1"),
				 errdetail("Some of the columns claim, owner_pid, owner_start and is_token are missing."),
				 errhint("Run ALTER EXTENSION idempotency UPDATE in this database.")));
}

/*
 * Called by the 1.2 entry points once idempotency.records is open: the
 * table must have the 1.2 columns, as idem_require_1_1.
 */
static void
idem_require_1_2(void)
{
	idem_require_1_1();
	if (!idem_records_have_checkpoints())
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("table \"idempotency.records\" has no columns of version 1.2"),
				 errdetail("Some of the columns phase, state, response_headers and trace are missing."),
				 errhint("Run ALTER EXTENSION idempotency UPDATE in this database.")));
}

/*
 * Return optional text argument argno (1.2), named what in errors: NULL, or
 * at most IDEM_MAX_KEY_BYTES bytes and, if nonempty, not empty.
 */
static text *
idem_check_optional_string(FunctionCallInfo fcinfo, int argno,
						   const char *what, bool nonempty)
{
	text	   *t;
	size_t		len;

	if (PG_ARGISNULL(argno))
		return NULL;
	t = PG_GETARG_TEXT_PP(argno);
	len = VARSIZE_ANY_EXHDR(t);
	if (nonempty && len == 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must not be empty", what)));
	if (len > IDEM_MAX_KEY_BYTES)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s is too long", what),
				 errdetail("It has %zu bytes; the limit is %d.",
						   len, IDEM_MAX_KEY_BYTES)));
	return t;
}

/*
 * Whether c may appear in an HTTP field name: an RFC 9110 tchar, a letter,
 * a digit or one of !#$%&'*+-.^_`|~.
 */
static inline bool
idem_is_tchar(unsigned char c)
{
	if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
		(c >= '0' && c <= '9'))
		return true;
	return c != '\0' && strchr("!#$%&'*+-.^_`|~", c) != NULL;
}

/*
 * A header name (len bytes, from a jsonb) as the errors show it: in JSON's
 * quotes and escapes, so that a CR or LF in it shows as \r or \n and cannot
 * break the server log's line.  Error paths only.
 */
static char *
idem_header_display(const char *name, int len)
{
	StringInfoData buf;

	initStringInfo(&buf);
	escape_json(&buf, pnstrdup(name, len));
	return buf.data;
}

/*
 * Check idem_complete's response_headers (1.2) and return them as stored:
 * a JSON object of at most IDEM_MAX_HEADERS names, each an HTTP field name
 * (RFC 9110 token) stored in lower case, no two equal once lower-cased, and
 * string values that hold no CR, LF or NUL (issue 36: a middleware that
 * copies them back into a response can never be made to send a header the
 * application did not set).  Anything else is 22023, raised before
 * anything is locked or written.  (jsonb refuses \u0000 itself, and has
 * kept only the last of names given twice exactly, before we see them.)
 * Costs a pass over the headers' bytes and, for the duplicates, at most
 * IDEM_MAX_HEADERS^2 / 2 comparisons of names of equal length.
 */
static Jsonb *
idem_check_headers(Jsonb *jb)
{
	JsonbIterator *it;
	JsonbValue	v;
	JsonbIteratorToken r;
	JsonbParseState *state = NULL;
	JsonbValue *res = NULL;
	const char *given[IDEM_MAX_HEADERS];	/* the names as given */
	char	   *lower[IDEM_MAX_HEADERS];	/* ... and in lower case */
	int			lens[IDEM_MAX_HEADERS];
	int			n = 0;

	if (JB_ROOT_IS_SCALAR(jb) || !JB_ROOT_IS_OBJECT(jb))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("response_headers must be a JSON object"),
				 errhint("Pass an object of header name and string value, such as '{\"Location\": \"/orders/1\"}'.")));
	if (JB_ROOT_COUNT(jb) > IDEM_MAX_HEADERS)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("too many response headers"),
				 errdetail("response_headers has %u headers; the limit is %d.",
						   (unsigned int) JB_ROOT_COUNT(jb), IDEM_MAX_HEADERS),
				 errhint("Store only the headers a replay needs, such as Location and ETag.")));

	it = JsonbIteratorInit(&jb->root);
	while ((r = JsonbIteratorNext(&it, &v, true)) != WJB_DONE)
	{
		switch (r)
		{
			case WJB_BEGIN_OBJECT:
				res = pushJsonbValue(&state, r, NULL);
				break;
			case WJB_KEY:
				{
					const char *name = v.val.string.val;
					int			len = v.val.string.len;
					char	   *low = palloc(len + 1);
					int			i;

					for (i = 0; i < len && idem_is_tchar((unsigned char) name[i]); i++)
						low[i] = pg_ascii_tolower((unsigned char) name[i]);
					low[i] = '\0';
					if (len == 0 || i < len)
						ereport(ERROR,
								(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
								 errmsg("invalid response header name"),
								 errdetail("Header name %s is not an HTTP field name.",
										   idem_header_display(name, len)),
								 errhint("A header name is one or more letters, digits or characters of !#$%%&'*+-.^_`|~ (an RFC 9110 token).")));
					for (i = 0; i < n; i++)
						if (lens[i] == len && memcmp(lower[i], low, len) == 0)
							ereport(ERROR,
									(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
									 errmsg("duplicate response header name"),
									 errdetail("Header names %s and %s are the same name in lower case.",
											   idem_header_display(given[i], len),
											   idem_header_display(name, len)),
									 errhint("Store each header once.")));
					Assert(n < IDEM_MAX_HEADERS);
					given[n] = name;
					lower[n] = low;
					lens[n] = len;
					n++;
					v.val.string.val = low;
					res = pushJsonbValue(&state, r, &v);
					break;
				}
			case WJB_VALUE:
				if (v.type != jbvString)
					ereport(ERROR,
							(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
							 errmsg("value of response header \"%s\" is not a string",
									n > 0 ? lower[n - 1] : ""),
							 errhint("Store every header value as a JSON string.")));
				for (int i = 0; i < v.val.string.len; i++)
				{
					char		c = v.val.string.val[i];

					if (c == '\r' || c == '\n' || c == '\0')
						ereport(ERROR,
								(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
								 errmsg("invalid response header value"),
								 errdetail("The value of header %s holds a %s.",
										   idem_header_display(given[n - 1], lens[n - 1]),
										   c == '\r' ? "carriage return (CR)" :
										   c == '\n' ? "line feed (LF)" : "NUL byte"),
								 errhint("A header value is one line of text: remove its CR, LF and NUL characters.")));
				}
				res = pushJsonbValue(&state, r, &v);
				break;
			case WJB_END_OBJECT:
				res = pushJsonbValue(&state, r, NULL);
				break;
			default:
				elog(ERROR, "unexpected jsonb token %d in response_headers", (int) r);
		}
	}
	return JsonbValueToJsonb(res);
}

/*
 * Check that the function was declared with the arguments this entry point
 * reads: one declared by hand with fewer must fail cleanly rather than read
 * past them.
 */
static void
idem_check_nargs(FunctionCallInfo fcinfo, int nargs)
{
	if (PG_NARGS() != nargs)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("function takes %d arguments where this entry point of the idempotency library reads %d",
						PG_NARGS(), nargs),
				 errhint("Run ALTER EXTENSION idempotency UPDATE in this database, and reconnect.")));
}

/*
 * Check that the caller expects the result shape of the interface we serve:
 * a 1.0 symbol bound to a 1.1 function (or the reverse) must fail cleanly,
 * never fill a row of one shape into the other.
 */
static void
idem_check_result_natts(FunctionCallInfo fcinfo, int natts)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;

	if (rsinfo->setDesc->natts != natts)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("function returns %d columns where this version of the idempotency library returns %d",
						rsinfo->setDesc->natts, natts),
				 errhint("Run ALTER EXTENSION idempotency UPDATE in this database, and reconnect.")));
}


/* ----------------------------------------------------------------
 * Request hash (reqhash.c)
 * ----------------------------------------------------------------
 */

/*
 * idem_request_hash(request jsonb) returns bytea
 */
Datum
idem_request_hash(PG_FUNCTION_ARGS)
{
	PG_RETURN_BYTEA_P(idem_hash_jsonb(PG_GETARG_JSONB_P(0)));
}


/*
 * ereport the "no live record" error of idem_complete.
 */
static void
idem_no_record_error(text *scope, text *key)
{
	ereport(ERROR,
			(errcode(ERRCODE_NO_DATA_FOUND),
			 errmsg("no live idempotency record for key \"%s\" in scope \"%s\"",
					text_to_cstring(key), text_to_cstring(scope)),
			 errhint("Claim the key with idem_acquire first; a record that has expired or was released cannot be completed.")));
}

/* ----------------------------------------------------------------
 * idem_acquire
 * ----------------------------------------------------------------
 */

/*
 * Decide the outcome of acquire from a committed (or own) record, without
 * writing.  Returns true with *outcome set where the record settles it
 * (replay or mismatch); a processing record with a matching hash does not.
 */
static bool
idem_settled(const IdemRecord *rec, const bytea *hash, IdemOutcome *outcome)
{
	if (!rec->found)
		return false;
	if (idem_hash_mismatch(rec, hash))
	{
		*outcome = IDEM_MISMATCH;
		return true;
	}
	if (rec->completed)
	{
		*outcome = IDEM_REPLAY;
		return true;
	}
	return false;
}

/*
 * The state of one call of idem_acquire, shared by the steps of
 * idem_acquire_common: the checked arguments, the lock-and-read loop, and
 * the answer taking shape.
 */
typedef struct IdemAcquire
{
	IdemApi		api;
	/* the checked arguments */
	IdemKey		key;
	bytea	   *hash;			/* the request's, or NULL: no payload check */
	int64		ttl;
	int64		lease;
	bool		session_bound;
	/* the call */
	Relation	parent;
	IdemClaim	claim;			/* the claim written, from 1.1 on */
	IdemClaim  *newclaim;		/* &claim from 1.1 on, else NULL */
	TimestampTz deadline;		/* of the waits: idempotency.wait_timeout */
	TimestampTz hint;			/* where a new claim's record would go */
	int			poll_ms;		/* the next sleep of a poll */
	bool		locked;			/* the locked passes ran: kr is set up */
	bool		unprobed;		/* the lock-free read passed partitions by
								 * for want of a filter's answer */
	IdemKeyRead kr;				/* kr.rec: the record the answer is about */
	/* the answer */
	IdemOutcome outcome;
	bool		have_record;	/* kr.rec says attempt and expires_at */
	bool		xact_open;		/* in_progress of an open transaction */
	bool		taken_over;
} IdemAcquire;

/* What a locked pass of idem_acquire came to */
typedef enum IdemAcquireStep
{
	IDEM_STEP_DONE,				/* st->outcome is the answer */
	IDEM_STEP_POLL				/* a claim of another session is running */
} IdemAcquireStep;

/*
 * Check idem_acquire's arguments into st, before touching anything.
 */
static void
idem_acquire_check(FunctionCallInfo fcinfo, IdemApi api, IdemAcquire *st)
{
	st->api = api;
	st->key.key = idem_check_ident(fcinfo, 0, true);
	st->key.scope = idem_check_ident(fcinfo, 2, false);
	st->key.token = false;
	idem_check_ttl_lease(fcinfo, 3, 4, &st->ttl, &st->lease);
	st->hash = PG_ARGISNULL(1) ? NULL : idem_hash_jsonb(PG_GETARG_JSONB_P(1));
	st->session_bound = api >= IDEM_API_1_1 && !PG_ARGISNULL(5) &&
		PG_GETARG_BOOL(5);
	st->newclaim = (api >= IDEM_API_1_1) ? &st->claim : NULL;
	st->claim.trace = (api >= IDEM_API_1_2) ?
		idem_check_optional_string(fcinfo, 6, "trace", false) : NULL;
	st->have_record = false;
	st->xact_open = false;
	st->taken_over = false;
	st->poll_ms = IDEM_POLL_MIN_MS;
	st->locked = false;
}

/*
 * Make ready to answer and to write: the result's tuplestore, the table
 * open, and at 1.1 its columns checked and, for a session-bound claim, the
 * owner lock held.
 */
static void
idem_acquire_open(FunctionCallInfo fcinfo, IdemAcquire *st)
{
	/* a standby can neither claim nor wait for the primary's claims */
	PreventCommandDuringRecovery("idem_acquire()");

	InitMaterializedSRF(fcinfo, MAT_SRF_USE_EXPECTED_DESC);
	idem_check_result_natts(fcinfo, st->api == IDEM_API_1_2 ? 11 :
							st->api == IDEM_API_1_1 ? 7 : 5);
	st->parent = idem_records_open();
	if (st->api >= IDEM_API_1_1)
	{
		if (st->api == IDEM_API_1_2)
			idem_require_1_2();
		else
			idem_require_1_1();
		/* taken before any key lock, so that nothing waits on us for it */
		if (st->session_bound)
			idem_hold_owner_lock();
	}
}

/*
 * Answer from a completed record that the statement's snapshot sees,
 * without the key lock; true if that answered (st->outcome and kr.rec set).
 *
 * A completed record is final until it expires: idem_complete and
 * idem_release leave it alone, and maintenance only moves it whole out of
 * the DEFAULT partition or deletes it once expired.  So a live completed
 * record that the statement's snapshot sees already answers, replay or
 * mismatch, as it would under the key lock, and such a replay takes no
 * lock at all.  Anything else (no record seen, or one not completed) is
 * read again under the lock.  Only under READ COMMITTED: a transaction
 * snapshot can be older than a record deleted by hand and claimed anew,
 * which the check after the locked read turns into a serialization
 * failure.
 *
 * The known-absent filters (filter.c) only decide where the read looks,
 * never what it finds: they pass by only partitions that hold no version
 * of the key, so a record found is the one the snapshot sees, with them or
 * without them, and the argument above holds either way.  The first look
 * (everywhere false) probes only the partitions whose filter says "maybe",
 * so that a new key pays no index descent for it; where filters can answer
 * for every live partition, that is the whole read.  Where some cannot
 * (library not preloaded, use_filters off, a filter not built yet or
 * building, no slot left for this database, a partition this backend has
 * not looked at yet), st->unprobed says so, and idem_acquire_replay_busy
 * looks there too (everywhere true) when the key lock is busy.
 */
static bool
idem_acquire_replay_unlocked(IdemAcquire *st, TimestampTz now,
							 bool everywhere)
{
	IdemRecord *rec = &st->kr.rec;

	st->unprobed = false;
	if (IsolationUsesXactSnapshot() || !ActiveSnapshotSet())
		return false;
	st->unprobed = idem_records_find_unlocked(st->parent, &st->key, now,
											  st->hint, GetActiveSnapshot(),
											  everywhere, rec);
	if (!rec->completed || !idem_settled(rec, st->hash, &st->outcome))
		return false;
	st->have_record = true;
	return true;
}

/*
 * After a first lock-free look that passed partitions by for want of a
 * filter's answer (st->unprobed) and settled nothing: take the key lock if
 * it is free, for the first locked pass (false); if another session holds
 * it, look for the completed record in every live partition without it
 * (true if that answered).  So a replay never waits for the key lock, and
 * a new key, whose lock is free, pays no second probe of the partitions
 * that no filter rules out: probing them before the lock cost a new key a
 * fifth more instructions (BENCHMARKS.md), as the locked read probes them
 * again.  A replay that finds the lock free reads under it, as before.
 */
static bool
idem_acquire_replay_busy(IdemAcquire *st, TimestampTz now)
{
	if (!st->unprobed || idem_key_read_try_lock(&st->kr))
		return false;
	return idem_acquire_replay_unlocked(st, now, true);
}

/*
 * writer_settles of idem_acquire's reads: another transaction is still
 * writing the record.  A version it updates or deletes was committed, and a
 * request hash never changes once set, so that can answer mismatch at once.
 * A version it inserts is a claim whose fate, mismatch included, is known
 * when that transaction ends: wait for it.
 */
static bool
idem_acquire_writer_settles(const IdemRecord *rec, void *arg)
{
	return !rec->wait_insert && idem_hash_mismatch(rec, (const bytea *) arg);
}

/*
 * No live record: write a new claim (attempt 1), and let go of the key
 * lock.  Where it went is remembered for idem_complete.
 */
static void
idem_acquire_new_claim(IdemAcquire *st)
{
	IdemRecord *rec = &st->kr.rec;
	IdemNewRecord nr;

	nr.request_hash = st->hash;
	nr.created_at = st->kr.now;
	nr.expires_at = nr.created_at + st->ttl;
	/* never the expires_at of a token under the same strings */
	if (nr.expires_at == rec->shadow_expires)
		nr.expires_at--;
	nr.locked_until = st->session_bound ? nr.expires_at :
		nr.created_at + st->lease;
	nr.claim = st->newclaim;
	if (st->newclaim)
		idem_new_claim(st->newclaim, st->session_bound);
	idem_records_insert(st->parent, &st->key, &nr, &idem_last_claim);
	idem_unlock(&st->kr.tag, ExclusiveLock);
	rec->attempt = 1;
	rec->expires_at = nr.expires_at;
	st->have_record = true;
	st->outcome = IDEM_ACQUIRED;
}

/*
 * Is the processing record's claim over: its lease ran out, or
 * (session-bound) its owner session is gone?
 */
static bool
idem_claim_over(const IdemRecord *rec, TimestampTz now)
{
	if (rec->owner_null)
		return rec->locked_until_null || rec->locked_until <= now;
	return !idem_owner_alive(rec);
}

/*
 * Take over a claim that is over, as the contract says, even when the claim
 * is our own from earlier in this transaction, and let go of the key lock.
 * An attempt number that cannot grow any more is an error, never a negative
 * attempt.  The record keeps its checkpoint (1.2), which kr.rec still holds
 * for the answer; the new claim's trace replaces the old one.
 */
static void
idem_acquire_takeover(IdemAcquire *st)
{
	IdemRecord *rec = &st->kr.rec;
	TimestampTz now = st->kr.now;

	if (rec->attempt >= PG_INT32_MAX)
		idem_attempt_limit_error(st->key.key, rec);
	if (st->newclaim)
		idem_new_claim(st->newclaim, st->session_bound);
	idem_records_takeover(st->parent, rec, &st->key, rec->attempt + 1,
						  st->session_bound ? rec->expires_at :
						  Min(now + st->lease, rec->expires_at),
						  st->hash, st->newclaim);
	idem_unlock(&st->kr.tag, ExclusiveLock);
	rec->attempt++;
	st->taken_over = true;
	st->outcome = IDEM_ACQUIRED;
}

/*
 * One locked pass: lock the key and read (idem_lock_and_read), then act on
 * what was read.  DONE with st->outcome set and the key lock let go of;
 * POLL where a claim of another session, committed, is still running.
 */
static IdemAcquireStep
idem_acquire_locked_pass(IdemAcquire *st)
{
	IdemRecord *rec = &st->kr.rec;

	switch (idem_lock_and_read(&st->kr))
	{
		case IDEM_READ_LOCK_TIMEOUT:
			idem_read_mvcc(st->parent, &st->key, GetCurrentTimestamp(),
						   st->hint, rec);
			st->have_record = rec->found;
			if (!idem_settled(rec, st->hash, &st->outcome))
				st->outcome = IDEM_IN_PROGRESS;
			return IDEM_STEP_DONE;
		case IDEM_READ_WRITER_SETTLES:
			st->have_record = true;
			st->outcome = IDEM_MISMATCH;
			return IDEM_STEP_DONE;
		case IDEM_READ_WRITER_TIMEOUT:
			st->have_record = !rec->wait_insert;
			st->xact_open = true;
			st->outcome = IDEM_IN_PROGRESS;
			return IDEM_STEP_DONE;
		case IDEM_READ_LOCKED:
			break;
	}

	/* Committed or our own: we act on it under the key lock. */
	st->have_record = rec->found;
	if (!rec->found)
	{
		idem_acquire_new_claim(st);
		return IDEM_STEP_DONE;
	}
	if (idem_settled(rec, st->hash, &st->outcome))
	{
		idem_unlock(&st->kr.tag, ExclusiveLock);
		return IDEM_STEP_DONE;
	}
	if (idem_claim_over(rec, st->kr.now))
	{
		idem_acquire_takeover(st);
		return IDEM_STEP_DONE;
	}
	idem_unlock(&st->kr.tag, ExclusiveLock);

	/*
	 * Our own claim, from earlier in this transaction or (session-bound) of
	 * this session, still held: nothing to wait for.
	 */
	if (TransactionIdIsCurrentTransactionId(rec->xmin) ||
		(!rec->owner_null && idem_owner_is_me(rec)))
	{
		st->xact_open = true;
		st->outcome = IDEM_IN_PROGRESS;
		return IDEM_STEP_DONE;
	}
	return IDEM_STEP_POLL;
}

/*
 * Committed, still processing, lease still running (or owner still alive):
 * the holder is working across transactions.  Sleep a moment, longer each
 * time, for the next locked pass; false, with the answer in_progress, once
 * the deadline has come.
 */
static bool
idem_acquire_poll(IdemAcquire *st)
{
	long		remaining_ms;

	remaining_ms = TimestampDifferenceMilliseconds(GetCurrentTimestamp(),
												   st->deadline);
	if (remaining_ms <= 0)
	{
		st->outcome = IDEM_IN_PROGRESS;
		return false;
	}
	idem_key_read_sleep(&st->kr, Min(remaining_ms, st->poll_ms));
	st->poll_ms = Min(st->poll_ms * 2, IDEM_POLL_MAX_MS);
	return true;
}

/*
 * Whole seconds, rounded up and at least 1, from now until the end of the
 * lease of an in_progress record: what retry_after says.  1 where there is
 * no lease end to count to: the claiming transaction is still open
 * (xact_open), or the claim is session-bound.
 */
static int32
idem_retry_after(const IdemRecord *rec, bool have_record, bool xact_open)
{
	TimestampTz now;
	int64		usecs;

	if (xact_open || !have_record || !rec->owner_null ||
		rec->locked_until_null)
		return IDEM_RETRY_AFTER_MIN;
	now = GetCurrentTimestamp();
	if (rec->locked_until <= now)
		return IDEM_RETRY_AFTER_MIN;
	usecs = rec->locked_until - now;
	return (int32) Min((usecs + USECS_PER_SEC - 1) / USECS_PER_SEC, PG_INT32_MAX);
}

/*
 * Put idem_acquire's one row into the result.
 */
static void
idem_acquire_answer(FunctionCallInfo fcinfo, const IdemAcquire *st)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	const IdemRecord *rec = &st->kr.rec;
	Datum		values[11];
	bool		nulls[11];

	memset(nulls, true, sizeof(nulls));
	values[0] = CStringGetTextDatum(idem_outcome_names[st->outcome]);
	nulls[0] = false;
	if (st->outcome == IDEM_REPLAY)
	{
		values[1] = Int32GetDatum(rec->response_status);
		nulls[1] = rec->status_null;
		values[2] = rec->response_body;
		nulls[2] = rec->body_null;
	}
	if (st->have_record)
	{
		values[3] = Int32GetDatum(rec->attempt);
		nulls[3] = false;
		values[4] = TimestampTzGetDatum(rec->expires_at);
		nulls[4] = false;
	}
	if (st->api >= IDEM_API_1_1)
	{
		if (st->outcome == IDEM_ACQUIRED)
		{
			values[5] = UUIDPGetDatum(&st->claim.claim);
			nulls[5] = false;
		}
		if (st->outcome == IDEM_IN_PROGRESS)
		{
			values[6] = Int32GetDatum(idem_retry_after(rec, st->have_record,
													   st->xact_open));
			nulls[6] = false;
		}
	}
	if (st->api >= IDEM_API_1_2)
	{
		/* phase, state: the checkpoint of the claim taken over */
		if (st->taken_over)
		{
			values[7] = rec->phase;
			nulls[7] = rec->phase_null;
			values[8] = rec->state;
			nulls[8] = rec->state_null;
		}
		if (st->outcome == IDEM_REPLAY)
		{
			values[9] = rec->response_headers;
			nulls[9] = rec->headers_null;
		}
		/* origin_trace: of the claim that made the record, if visible */
		if (st->outcome != IDEM_ACQUIRED && st->have_record)
		{
			values[10] = rec->trace;
			nulls[10] = rec->trace_null;
		}
	}
	tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
}

/*
 * Count the call in the statistics: its outcome, a takeover, its waits (a
 * replay answered without the key lock never waited, and never set up the
 * clock) and its duration since start.
 */
static void
idem_acquire_count(const IdemAcquire *st, const instr_time *start)
{
	idem_stats_add(idem_outcome_stats[st->outcome], 1);
	if (st->taken_over)
		idem_stats_add(IDEM_STAT_TAKEN_OVER, 1);
	if (st->locked)
		idem_wait_clock_count(&st->kr.clock);
	idem_stats_acquire_time(start);
}

/*
 * Run one call of idem_acquire up to its answer, into st: the protocol is a
 * replay answered without the key lock where it can be, else locked passes
 * (keylock.c) until one settles the answer, polling between them while
 * another session's committed claim runs.  1.1 writes a new claim with
 * every acquired, and a session-bound claim is taken over as soon as its
 * owner session is gone rather than when its lease runs out.  Returns with
 * the result's tuplestore set up and idempotency.records open (st->parent).
 */
static void
idem_acquire_run(FunctionCallInfo fcinfo, IdemApi api, IdemAcquire *st)
{
	TimestampTz now;

	idem_acquire_check(fcinfo, api, st);
	idem_acquire_open(fcinfo, st);

	now = GetCurrentTimestamp();
	st->deadline = TimestampTzPlusMilliseconds(now, idem_wait_timeout);
	st->hint = now + st->ttl;

	if (!idem_acquire_replay_unlocked(st, now, false))
	{
		idem_key_read_init(&st->kr, st->parent, &st->key, st->deadline,
						   st->ttl, NULL);
		st->locked = true;
		if (!idem_acquire_replay_busy(st, now))
		{
			st->kr.writer_settles = idem_acquire_writer_settles;
			st->kr.settles_arg = st->hash;
			while (idem_acquire_locked_pass(st) == IDEM_STEP_POLL &&
				   idem_acquire_poll(st))
				;
		}
		idem_key_read_end(&st->kr);
	}
}

/*
 * idem_acquire(key, request, scope, ttl, lease)
 *		returns table (outcome, response_status, response_body, attempt,
 *					   expires_at)
 * idem_acquire_1_1(key, request, scope, ttl, lease, session_bound)
 *		returns table (..., expires_at, claim, retry_after)
 * idem_acquire_1_2(..., session_bound, trace)
 *		returns table (..., retry_after, phase, state, response_headers,
 *					   origin_trace)
 *
 * Always exactly one row (idem_acquire_run has the protocol).
 */
static Datum
idem_acquire_common(FunctionCallInfo fcinfo, IdemApi api)
{
	IdemAcquire st;
	instr_time	start;
	bool		counting;

	counting = idem_stats_on();
	if (counting)
		INSTR_TIME_SET_CURRENT(start);

	idem_acquire_run(fcinfo, api, &st);
	idem_acquire_answer(fcinfo, &st);
	idem_records_close(st.parent);
	if (counting)
		idem_acquire_count(&st, &start);
	return (Datum) 0;
}

/* The 1.0 symbol of idem_acquire_common */
Datum
idem_acquire(PG_FUNCTION_ARGS)
{
	return idem_acquire_common(fcinfo, IDEM_API_1_0);
}

/* The 1.1 symbol of idem_acquire_common */
Datum
idem_acquire_1_1(PG_FUNCTION_ARGS)
{
	idem_check_nargs(fcinfo, 6);
	return idem_acquire_common(fcinfo, IDEM_API_1_1);
}

/* The 1.2 symbol of idem_acquire_common */
Datum
idem_acquire_1_2(PG_FUNCTION_ARGS)
{
	idem_check_nargs(fcinfo, 7);
	return idem_acquire_common(fcinfo, IDEM_API_1_2);
}


/* ----------------------------------------------------------------
 * A shard's checks of the routers' layout (shard.c; 1.3)
 * ----------------------------------------------------------------
 */

/*
 * idempotency.shard_key_hash(scope text, key text) returns int
 *
 * idempotency_proxy's hash of a key, which names its partition; NULL hashes
 * as ''.  1.2 wrote it in PL/pgSQL.
 */
Datum
idem_shard_key_hash_sql(PG_FUNCTION_ARGS)
{
	text	   *scope = PG_ARGISNULL(0) ? NULL : PG_GETARG_TEXT_PP(0);
	text	   *key = PG_ARGISNULL(1) ? NULL : PG_GETARG_TEXT_PP(1);

	PG_RETURN_INT32(idem_shard_key_hash(scope, key));
}

/*
 * idempotency.shard_refusal(layout bigint, hash int, fresh boolean,
 *							 OUT message text, OUT detail text)
 *
 * Why this shard may not answer a call for partition hash from a router at
 * layout version layout (idem_shard_refusal), or NULLs when it may.  Used by
 * the PL/pgSQL wrappers other than shard_acquire (shard_check, shard_lookup,
 * shard_token_issue); 1.2 wrote it in PL/pgSQL.
 */
Datum
idem_shard_refusal_sql(PG_FUNCTION_ARGS)
{
	TupleDesc	desc;
	Datum		values[2];
	bool		nulls[2] = {true, true};
	char	   *message;
	const char *detail;

	if (PG_ARGISNULL(1) || PG_ARGISNULL(2))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("hash and fresh must not be null")));
	if (get_call_result_type(fcinfo, NULL, &desc) != TYPEFUNC_COMPOSITE)
		elog(ERROR, "return type must be a row type");
	desc = BlessTupleDesc(desc);

	if (idem_shard_refusal(PG_ARGISNULL(0),
						   PG_ARGISNULL(0) ? 0 : PG_GETARG_INT64(0),
						   PG_GETARG_INT32(1), PG_GETARG_BOOL(2),
						   &message, &detail))
	{
		values[0] = CStringGetTextDatum(message);
		values[1] = CStringGetTextDatum(detail);
		nulls[0] = nulls[1] = false;
	}
	PG_RETURN_DATUM(HeapTupleGetDatum(heap_form_tuple(desc, values, nulls)));
}

/*
 * The response_body of a refused call: {"message": ..., "detail": ...}.
 */
static Jsonb *
idem_refusal_body(const char *message, const char *detail)
{
	JsonbParseState *state = NULL;
	JsonbValue	v;
	const char *const pairs[4] = {"message", message, "detail", detail};

	(void) pushJsonbValue(&state, WJB_BEGIN_OBJECT, NULL);
	for (int i = 0; i < 4; i++)
	{
		v.type = jbvString;
		v.val.string.val = (char *) pairs[i];
		v.val.string.len = strlen(pairs[i]);
		(void) pushJsonbValue(&state, (i % 2 == 0) ? WJB_KEY : WJB_VALUE, &v);
	}
	return JsonbValueToJsonb(pushJsonbValue(&state, WJB_END_OBJECT, NULL));
}

/*
 * idempotency.shard_acquire(layout bigint, key text, request jsonb,
 *							 scope text, ttl interval, lease interval,
 *							 trace text) returns table (idem_acquire's 1.2
 *							 columns)
 *
 * What a router (or an application that calls the owning shard itself)
 * calls on a shard: idem_acquire, then the layout check of shard.c, unless
 * this shard may not answer the key under the caller's layout: then one row
 * with outcome 'refused' and the reason in response_body (message,
 * detail), and nothing is left of the call (a new claim it made is released
 * at once, in this transaction, so no other session ever sees it).  A
 * refusal is a row, not an error, so that PL/Proxy keeps its connection (it
 * drops one after every remote error); the router reloads its layout and
 * retries.  A refused takeover (a record of a key this shard neither owns
 * nor owned, which a forced end of a growth window can leave) raises 55R01,
 * which rolls it back.  Bad input raises what idem_acquire raises, before
 * the check.  1.2 wrote it in PL/pgSQL, with the same answers.
 */
Datum
idem_shard_acquire(PG_FUNCTION_ARGS)
{
	LOCAL_FCINFO(inner, 7);
	IdemAcquire st;
	instr_time	start;
	bool		counting;
	bool		fresh;
	char	   *message;
	const char *detail;

	idem_check_nargs(fcinfo, 7);
	counting = idem_stats_on();
	if (counting)
		INSTR_TIME_SET_CURRENT(start);

	/* idem_acquire_1_2's arguments: ours after layout, never session-bound */
	InitFunctionCallInfoData(*inner, fcinfo->flinfo, 7, fcinfo->fncollation,
							 fcinfo->context, fcinfo->resultinfo);
	for (int i = 0; i < 5; i++)
		inner->args[i] = fcinfo->args[i + 1];
	inner->args[5].value = BoolGetDatum(false);
	inner->args[5].isnull = false;
	inner->args[6] = fcinfo->args[6];

	idem_acquire_run(inner, IDEM_API_1_2, &st);

	fresh = st.outcome == IDEM_ACQUIRED && st.have_record &&
		st.kr.rec.attempt == 1;
	if (!idem_shard_refusal(PG_ARGISNULL(0),
							PG_ARGISNULL(0) ? 0 : PG_GETARG_INT64(0),
							idem_shard_key_hash(st.key.scope, st.key.key),
							fresh, &message, &detail))
		idem_acquire_answer(inner, &st);
	else if (st.outcome == IDEM_ACQUIRED && !fresh)
	{
		/* counted as 1.2 counted it: the takeover ran, then was refused */
		if (counting)
			idem_acquire_count(&st, &start);
		ereport(ERROR,
				(errcode(ERRCODE_IDEM_LAYOUT_REFUSED),
				 errmsg("%s", message),
				 errdetail("%s", detail),
				 errhint("The router reloads its layout from the shards and retries.")));
	}
	else
	{
		ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
		Datum		values[11];
		bool		nulls[11];

		if (fresh)
			(void) DirectFunctionCall4(idem_release_1_1,
									   PointerGetDatum(st.key.key),
									   PointerGetDatum(st.key.scope),
									   Int32GetDatum(1),
									   UUIDPGetDatum(&st.claim.claim));
		memset(nulls, true, sizeof(nulls));
		values[0] = CStringGetTextDatum("refused");
		nulls[0] = false;
		values[2] = JsonbPGetDatum(idem_refusal_body(message, detail));
		nulls[2] = false;
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	}

	idem_records_close(st.parent);
	if (counting)
		idem_acquire_count(&st, &start);
	return (Datum) 0;
}

/* ----------------------------------------------------------------
 * idem_complete, idem_release
 * ----------------------------------------------------------------
 */

/*
 * Lock the key of (scope, key) and read its record, for the functions that
 * change a record a claim already exists for: waiting for any other
 * transaction still writing the record as long as it takes (lock_timeout
 * and cancel apply as to any lock), starting with where this backend wrote
 * its last claim.  Returns with the key lock (kr->tag) held, kr->rec and
 * kr->now set.
 */
static void
idem_lock_claimed(IdemKeyRead *kr, Relation parent, text *scope, text *key)
{
	IdemKey		k = {scope, key, false};
	IdemReadResult result PG_USED_FOR_ASSERTS_ONLY;

	idem_key_read_init(kr, parent, &k, DT_NOEND, idem_default_ttl_usecs(),
					   &idem_last_claim);
	result = idem_lock_and_read(kr);
	/* without a deadline or writer_settles, it always comes back locked */
	Assert(result == IDEM_READ_LOCKED);
	idem_key_read_end(kr);
}

/*
 * idem_complete(key, response_status, response_body, scope, attempt)
 *		returns boolean
 * idem_complete_1_1(..., attempt, claim) returns boolean
 * idem_complete_1_2(..., claim, response_headers) returns boolean
 *
 * True when it turned the processing record into completed; false when the
 * record was completed already.  The body and the headers (1.2, see
 * idem_check_headers) count together against max_response_bytes.  No live record: P0002.  A given attempt
 * or claim that is not the record's: 55000, checked before the completed
 * case.
 */
static Datum
idem_complete_common(FunctionCallInfo fcinfo, IdemApi api)
{
	text	   *key;
	text	   *scope;
	int32		status;
	int32		attempt = 0;
	bool		check_attempt;
	pg_uuid_t	claim;
	bool		check_claim = false;
	IdemKeyRead kr;
	IdemRecord *rec = &kr.rec;
	Relation	parent;
	bool		result = false;
	Jsonb	   *headers = NULL;
	Size		size = 0;

	key = idem_check_ident(fcinfo, 0, true);
	scope = idem_check_ident(fcinfo, 3, false);
	if (PG_ARGISNULL(1))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("response_status must not be null")));
	status = PG_GETARG_INT32(1);
	if (status < 100 || status > 599)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("response_status %d is not an HTTP status code", status),
				 errhint("Use a status from 100 to 599.")));
	if (!PG_ARGISNULL(2))
	{
		size = toast_datum_size(PG_GETARG_DATUM(2));

		if (size > (Size) idem_max_response_bytes)
			ereport(ERROR,
					(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
					 errmsg("response_body is too large"),
					 errdetail("It takes %zu bytes; idempotency.max_response_bytes is %d.",
							   size, idem_max_response_bytes)));
	}
	check_attempt = idem_check_attempt(fcinfo, 4, &attempt);
	if (api >= IDEM_API_1_1)
		check_claim = idem_check_claim_arg(fcinfo, 5, &claim);
	if (api >= IDEM_API_1_2 && !PG_ARGISNULL(6))
	{
		headers = idem_check_headers(PG_GETARG_JSONB_P(6));
		size += VARSIZE(headers);
		if (size > (Size) idem_max_response_bytes)
			ereport(ERROR,
					(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
					 errmsg("response_body and response_headers are too large"),
					 errdetail("They take %zu bytes together; idempotency.max_response_bytes is %d.",
							   size, idem_max_response_bytes)));
	}
	PreventCommandDuringRecovery("idem_complete()");

	parent = idem_records_open();
	if (api == IDEM_API_1_2)
		idem_require_1_2();
	else if (api == IDEM_API_1_1)
		idem_require_1_1();
	idem_lock_claimed(&kr, parent, scope, key);

	if (!rec->found)
		idem_no_record_error(scope, key);
	if (check_attempt && attempt != rec->attempt)
		idem_attempt_error(key, attempt, rec);
	idem_check_claim(key, check_claim, &claim, rec);
	if (!rec->completed)
	{
		idem_records_complete(parent, rec, &kr.key, status,
							  PG_ARGISNULL(2) ? (Datum) 0 :
							  PointerGetDatum(PG_GETARG_JSONB_P(2)),
							  PG_ARGISNULL(2),
							  PointerGetDatum(headers), headers == NULL,
							  kr.now);
		result = true;
		idem_stats_add(IDEM_STAT_COMPLETED, 1);
	}
	idem_unlock(&kr.tag, ExclusiveLock);

	idem_records_close(parent);
	PG_RETURN_BOOL(result);
}

/* The 1.0 symbol of idem_complete_common */
Datum
idem_complete(PG_FUNCTION_ARGS)
{
	return idem_complete_common(fcinfo, IDEM_API_1_0);
}

/* The 1.1 symbol of idem_complete_common */
Datum
idem_complete_1_1(PG_FUNCTION_ARGS)
{
	idem_check_nargs(fcinfo, 6);
	return idem_complete_common(fcinfo, IDEM_API_1_1);
}

/* The 1.2 symbol of idem_complete_common */
Datum
idem_complete_1_2(PG_FUNCTION_ARGS)
{
	idem_check_nargs(fcinfo, 7);
	return idem_complete_common(fcinfo, IDEM_API_1_2);
}

/*
 * idem_release(key, scope, attempt) returns boolean
 * idem_release_1_1(key, scope, attempt, claim) returns boolean
 *
 * Removes a live processing record, so that the next claim is attempt 1.
 * False where there is none; a completed record is never released.  A given
 * attempt or claim that is not the record's: 55000, checked before the
 * completed case.
 */
static Datum
idem_release_common(FunctionCallInfo fcinfo, IdemApi api)
{
	text	   *key;
	text	   *scope;
	int32		attempt = 0;
	bool		check_attempt;
	pg_uuid_t	claim;
	bool		check_claim = false;
	IdemKeyRead kr;
	IdemRecord *rec = &kr.rec;
	Relation	parent;
	bool		result = false;

	key = idem_check_ident(fcinfo, 0, true);
	scope = idem_check_ident(fcinfo, 1, false);
	check_attempt = idem_check_attempt(fcinfo, 2, &attempt);
	if (api >= IDEM_API_1_1)
		check_claim = idem_check_claim_arg(fcinfo, 3, &claim);
	PreventCommandDuringRecovery("idem_release()");

	parent = idem_records_open();
	if (api >= IDEM_API_1_1)
		idem_require_1_1();
	idem_lock_claimed(&kr, parent, scope, key);

	if (rec->found)
	{
		if (check_attempt && attempt != rec->attempt)
			idem_attempt_error(key, attempt, rec);
		idem_check_claim(key, check_claim, &claim, rec);
		if (!rec->completed)
		{
			idem_records_delete(parent, rec);
			result = true;
			idem_stats_add(IDEM_STAT_RELEASED, 1);
		}
	}
	idem_unlock(&kr.tag, ExclusiveLock);

	idem_records_close(parent);
	PG_RETURN_BOOL(result);
}

/* The 1.0 symbol of idem_release_common */
Datum
idem_release(PG_FUNCTION_ARGS)
{
	return idem_release_common(fcinfo, IDEM_API_1_0);
}

/* The 1.1 symbol of idem_release_common */
Datum
idem_release_1_1(PG_FUNCTION_ARGS)
{
	idem_check_nargs(fcinfo, 4);
	return idem_release_common(fcinfo, IDEM_API_1_1);
}

/*
 * Lock the key of (scope, key) and read its record, as idem_lock_claimed,
 * for the functions that only the holder of a processing claim may call
 * (idem_extend, idem_checkpoint); then raise their errors, in this order:
 * no live record (P0002), a given claim that is not the record's (55000,
 * idem_check_claim), a completed record (P0002, with completed_detail, a
 * sentence saying why that call needs a processing claim).  Returns with
 * the key lock (kr->tag) held and kr->rec a live processing record.
 */
static void
idem_lock_processing(IdemKeyRead *kr, Relation parent, text *scope, text *key,
					 bool check_claim, const pg_uuid_t *claim,
					 const char *completed_detail)
{
	IdemRecord *rec = &kr->rec;

	idem_lock_claimed(kr, parent, scope, key);
	if (!rec->found)
		idem_no_record_error(scope, key);
	idem_check_claim(key, check_claim, claim, rec);
	if (rec->completed)
		ereport(ERROR,
				(errcode(ERRCODE_NO_DATA_FOUND),
				 errmsg("idempotency key \"%s\" in scope \"%s\" is completed",
						text_to_cstring(key), text_to_cstring(scope)),
				 errdetail("%s", completed_detail)));
}

/*
 * idem_extend(key, scope, claim, lease) returns timestamptz
 *
 * The holder of a processing claim pushes its lease out: locked_until =
 * now + lease (default idempotency.default_lease), capped at expires_at;
 * returns the new locked_until.  No live record, or a completed one: P0002.
 * A given claim that is not the record's: 55000, checked first, as in
 * idem_complete.  A session-bound claim has no lease to extend: its
 * locked_until is already expires_at, returned as it is, nothing written.
 * The 1.2 SQL function is bound to idem_extend_1_2, the same code: a
 * backend on the 1.1 library, which would write the record without its 1.2
 * columns, fails to find it.
 */
Datum
idem_extend(PG_FUNCTION_ARGS)
{
	text	   *key;
	text	   *scope;
	pg_uuid_t	claim;
	bool		check_claim;
	int64		lease;
	int64		max_usecs = (int64) idem_max_ttl * USECS_PER_SEC;
	IdemKeyRead kr;
	IdemRecord *rec = &kr.rec;
	Relation	parent;
	TimestampTz locked_until;

	idem_check_nargs(fcinfo, 4);
	key = idem_check_ident(fcinfo, 0, true);
	scope = idem_check_ident(fcinfo, 1, false);
	check_claim = idem_check_claim_arg(fcinfo, 2, &claim);
	if (PG_ARGISNULL(3))
		lease = (int64) idem_default_lease * USECS_PER_SEC;
	else if (!idem_interval_usecs(PG_GETARG_INTERVAL_P(3), &lease) ||
			 lease <= 0 || lease > max_usecs)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("lease must be greater than zero and at most idempotency.max_ttl"),
				 errdetail("idempotency.max_ttl is %d seconds.", idem_max_ttl)));
	PreventCommandDuringRecovery("idem_extend()");

	parent = idem_records_open();
	idem_require_1_1();
	idem_lock_processing(&kr, parent, scope, key, check_claim, &claim,
						 "Only a processing claim has a lease to extend.");

	if (!rec->owner_null)
		locked_until = rec->locked_until_null ? rec->expires_at :
			rec->locked_until;
	else
	{
		locked_until = kr.now + Min(lease, rec->expires_at - kr.now);
		idem_records_extend(parent, rec, &kr.key, locked_until);
	}
	idem_unlock(&kr.tag, ExclusiveLock);

	idem_records_close(parent);
	PG_RETURN_TIMESTAMPTZ(locked_until);
}

/* The 1.2 symbol of idem_extend */
Datum
idem_extend_1_2(PG_FUNCTION_ARGS)
{
	return idem_extend(fcinfo);
}

/*
 * idem_checkpoint(key, scope, claim, phase, state) returns timestamptz
 *
 * The holder of a processing claim records how far it got: phase (1 to 255
 * bytes) and state (a jsonb of at most max_response_bytes, or NULL), in the
 * caller's transaction, so that they commit or roll back with its business
 * writes.  A takeover's acquired answers them, and so does idem_lookup.
 * Returns the record's locked_until, unchanged: a checkpoint is not a
 * heartbeat.  The errors are idem_extend's (a claim that is not the
 * record's: 55000, checked before the completed case; no live processing
 * record: P0002).
 *
 * Unlike idem_extend's, the claim is required (issue 36): a checkpoint made
 * without it could overwrite the current holder's, and the next takeover
 * would then be told a step that holder never got to, or not told one it
 * did.  The SQL keeps its DEFAULT NULL (the 1.2 signature), so NULL is
 * refused here, with 22004 as for the other required arguments.
 */
Datum
idem_checkpoint(PG_FUNCTION_ARGS)
{
	text	   *key;
	text	   *scope;
	pg_uuid_t	claim;
	text	   *phase;
	IdemKeyRead kr;
	IdemRecord *rec = &kr.rec;
	Relation	parent;
	TimestampTz locked_until;

	idem_check_nargs(fcinfo, 5);
	key = idem_check_ident(fcinfo, 0, true);
	scope = idem_check_ident(fcinfo, 1, false);
	if (!idem_check_claim_arg(fcinfo, 2, &claim))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("checkpoint claim must not be null"),
				 errdetail("Only the holder of the processing claim records its checkpoint."),
				 errhint("Pass the claim that idem_acquire returned.")));
	if (PG_ARGISNULL(3))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("checkpoint phase must not be null"),
				 errhint("Name the step the claim has got to, such as 'charged'.")));
	phase = idem_check_optional_string(fcinfo, 3, "checkpoint phase", true);
	if (!PG_ARGISNULL(4))
	{
		Size		size = toast_datum_size(PG_GETARG_DATUM(4));

		if (size > (Size) idem_max_response_bytes)
			ereport(ERROR,
					(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
					 errmsg("checkpoint state is too large"),
					 errdetail("It takes %zu bytes; idempotency.max_response_bytes is %d.",
							   size, idem_max_response_bytes)));
	}
	PreventCommandDuringRecovery("idem_checkpoint()");

	parent = idem_records_open();
	idem_require_1_2();
	idem_lock_processing(&kr, parent, scope, key, true, &claim,
						 "Only a processing claim records checkpoints.");

	idem_records_checkpoint(parent, rec, &kr.key, phase,
							PG_ARGISNULL(4) ? (Datum) 0 :
							PointerGetDatum(PG_GETARG_JSONB_P(4)),
							PG_ARGISNULL(4));
	locked_until = rec->locked_until_null ? rec->expires_at :
		rec->locked_until;
	idem_unlock(&kr.tag, ExclusiveLock);

	idem_records_close(parent);
	PG_RETURN_TIMESTAMPTZ(locked_until);
}

/*
 * ereport the error of idem_forget when another transaction still writes
 * the record after idempotency.wait_timeout.
 */
static void
idem_forget_busy_error(text *scope, text *key)
{
	ereport(ERROR,
			(errcode(ERRCODE_LOCK_NOT_AVAILABLE),
			 errmsg("could not forget idempotency key \"%s\" in scope \"%s\": another transaction is still writing its record",
					text_to_cstring(key), text_to_cstring(scope)),
			 errdetail("It waited idempotency.wait_timeout (%d ms) for that transaction to end.",
					   idem_wait_timeout),
			 errhint("Retry once that transaction has ended, or raise idempotency.wait_timeout.")));
}

/*
 * idem_forget(key, scope) returns boolean
 *
 * Removes the live record of (scope, key), whatever its state, so that the
 * next idem_acquire of the key answers acquired at attempt 1; false where
 * there was none.  Never a one-time token.  Waits up to wait_timeout for a
 * transaction still writing the record, then 55P03.
 *
 * Privileges.  The function's EXECUTE privilege (the table's owner, and
 * the roles it is granted to) is all it needs: the table's own privileges
 * are not checked, so an operator role can forget keys without being able
 * to read or change the records.
 *
 * Nothing answers from the record once the delete commits: the lock-free
 * replay read uses the statement's MVCC snapshot, which a statement begun
 * after the commit takes with the delete in it, and the known-absent
 * filters only ever rule keys out (a deleted key stays "maybe"); the reads
 * under the key lock see the delete as every other write.
 */
Datum
idem_forget(PG_FUNCTION_ARGS)
{
	IdemKey		k;
	IdemKeyRead kr;
	IdemRecord *rec = &kr.rec;
	Relation	parent;
	bool		result = false;

	k.key = idem_check_ident(fcinfo, 0, true);
	k.scope = idem_check_ident(fcinfo, 1, false);
	k.token = false;
	PreventCommandDuringRecovery("idem_forget()");

	parent = idem_records_open_unchecked();
	idem_require_1_1();
	idem_key_read_init(&kr, parent, &k,
					   TimestampTzPlusMilliseconds(GetCurrentTimestamp(),
												   idem_wait_timeout),
					   idem_default_ttl_usecs(), NULL);
	if (idem_lock_and_read(&kr) != IDEM_READ_LOCKED)
		idem_forget_busy_error(k.scope, k.key);
	idem_key_read_end(&kr);

	if (rec->found)
	{
		Assert(!rec->is_token);
		idem_records_forget(parent, rec);
		result = true;
	}
	idem_unlock(&kr.tag, ExclusiveLock);
	idem_wait_clock_count(&kr.clock);
	if (result)
		idem_stats_add(IDEM_STAT_FORGOTTEN, 1);

	idem_records_close(parent);
	PG_RETURN_BOOL(result);
}


/* ----------------------------------------------------------------
 * idem_lookup
 * ----------------------------------------------------------------
 */

/*
 * idem_lookup(key, scope) returns table (status, request_hash, ...,
 *		expires_at)
 * idem_lookup_1_1(key, scope) returns table (..., expires_at, owner_pid)
 * idem_lookup_1_2(key, scope) returns table (..., owner_pid, phase, state,
 *		response_headers, origin_trace)
 *
 * The live record, or no row.  Never waits, never writes: a plain read with
 * the caller's snapshot, no key lock.  owner_pid: the owner of a
 * session-bound processing record, else NULL.
 */
static Datum
idem_lookup_common(FunctionCallInfo fcinfo, IdemApi api)
{
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	text	   *key;
	text	   *scope;
	IdemKey		k;
	IdemRecord	rec;
	Relation	parent;
	TimestampTz now;

	key = idem_check_ident(fcinfo, 0, true);
	scope = idem_check_ident(fcinfo, 1, false);
	k.scope = scope;
	k.key = key;
	k.token = false;

	InitMaterializedSRF(fcinfo, MAT_SRF_USE_EXPECTED_DESC);
	idem_check_result_natts(fcinfo, api == IDEM_API_1_2 ? 14 :
							api == IDEM_API_1_1 ? 10 : 9);
	parent = idem_records_open();
	if (api == IDEM_API_1_2)
		idem_require_1_2();
	else if (api == IDEM_API_1_1)
		idem_require_1_1();

	now = GetCurrentTimestamp();
	idem_read_mvcc(parent, &k, now, now + idem_default_ttl_usecs(), &rec);
	if (rec.found)
	{
		Datum		values[14];
		bool		nulls[14];

		memset(nulls, false, sizeof(nulls));
		values[0] = CStringGetTextDatum(rec.completed ? "completed" : "processing");
		values[1] = rec.request_hash;
		nulls[1] = rec.hash_null;
		values[2] = Int32GetDatum(rec.response_status);
		nulls[2] = rec.status_null;
		values[3] = rec.response_body;
		nulls[3] = rec.body_null;
		values[4] = Int32GetDatum(rec.attempt);
		values[5] = TimestampTzGetDatum(rec.created_at);
		values[6] = TimestampTzGetDatum(rec.locked_until);
		nulls[6] = rec.locked_until_null;
		values[7] = TimestampTzGetDatum(rec.completed_at);
		nulls[7] = rec.completed_at_null;
		values[8] = TimestampTzGetDatum(rec.expires_at);
		values[9] = Int32GetDatum(rec.owner_pid);
		nulls[9] = rec.owner_null || rec.completed;
		values[10] = rec.phase;
		nulls[10] = rec.phase_null;
		values[11] = rec.state;
		nulls[11] = rec.state_null;
		values[12] = rec.response_headers;
		nulls[12] = rec.headers_null;
		values[13] = rec.trace;
		nulls[13] = rec.trace_null;
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, values, nulls);
	}

	idem_records_close(parent);
	return (Datum) 0;
}

/* The 1.0 symbol of idem_lookup_common */
Datum
idem_lookup(PG_FUNCTION_ARGS)
{
	return idem_lookup_common(fcinfo, IDEM_API_1_0);
}

/* The 1.1 symbol of idem_lookup_common */
Datum
idem_lookup_1_1(PG_FUNCTION_ARGS)
{
	return idem_lookup_common(fcinfo, IDEM_API_1_1);
}

/* The 1.2 symbol of idem_lookup_common */
Datum
idem_lookup_1_2(PG_FUNCTION_ARGS)
{
	return idem_lookup_common(fcinfo, IDEM_API_1_2);
}


/* ----------------------------------------------------------------
 * One-time tokens (1.1, token.c)
 * ----------------------------------------------------------------
 */

/*
 * idem_token_issue(scope, ttl) returns text
 *
 * A new one-time token of scope, live for ttl (default
 * idempotency.default_ttl); see idem_token_make.
 */
Datum
idem_token_issue(PG_FUNCTION_ARGS)
{
	text	   *scope;
	int64		ttl;
	text	   *token;
	Relation	parent;

	scope = idem_check_ident(fcinfo, 0, false);
	ttl = idem_check_ttl(fcinfo, 1);
	PreventCommandDuringRecovery("idem_token_issue()");

	token = idem_token_make();
	parent = idem_records_open();
	idem_require_1_1();
	idem_token_store(parent, scope, token, ttl);
	idem_records_close(parent);
	PG_RETURN_TEXT_P(token);
}

/*
 * idem_token_consume(token, scope) returns boolean
 *
 * True exactly once for a live token of scope; false when it was consumed
 * already, has expired, never existed or belongs to another scope.  Waits
 * up to idempotency.wait_timeout for another transaction writing the token
 * (idem_token_spend).
 */
Datum
idem_token_consume(PG_FUNCTION_ARGS)
{
	text	   *token;
	text	   *scope;
	Relation	parent;
	bool		result;

	token = idem_check_string(fcinfo, 0, "token", true,
							  "Pass a token as idem_token_issue returned it.");
	scope = idem_check_ident(fcinfo, 1, false);
	PreventCommandDuringRecovery("idem_token_consume()");

	parent = idem_records_open();
	idem_require_1_1();
	result = idem_token_spend(parent, scope, token, idem_wait_timeout,
							  idem_default_ttl_usecs());
	idem_records_close(parent);
	PG_RETURN_BOOL(result);
}


/* ----------------------------------------------------------------
 * Monitoring
 * ----------------------------------------------------------------
 */

/*
 * owner_alive(owner_pid, owner_start) returns boolean
 *
 * Whether the session that owns a session-bound claim with these columns
 * still lives in this database (idempotency.stale_claims).
 */
Datum
idem_owner_alive_sql(PG_FUNCTION_ARGS)
{
	IdemRecord	rec;

	memset(&rec, 0, sizeof(rec));
	rec.owner_null = false;
	rec.owner_pid = PG_GETARG_INT32(0);
	rec.owner_start = PG_GETARG_TIMESTAMPTZ(1);
	PG_RETURN_BOOL(idem_owner_alive(&rec));
}


/* ----------------------------------------------------------------
 * Settings for maintenance
 * ----------------------------------------------------------------
 */

/*
 * Return an interval of the given number of seconds.
 */
static Interval *
idem_seconds_interval(int secs)
{
	Interval   *result = (Interval *) palloc0(sizeof(Interval));

	result->time = (int64) secs * USECS_PER_SEC;
	return result;
}

/*
 * maintenance_settings() returns (partition_interval interval,
 *		max_ttl interval, lock_timeout_ms int)
 *
 * idem_maintain is SQL and may run in a session (a pg_cron job's) that has
 * not loaded this library yet, where current_setting() would not know our
 * settings.  Calling this loads the library and answers with the values in
 * force.
 */
Datum
idem_maintenance_settings(PG_FUNCTION_ARGS)
{
	TupleDesc	tupdesc;
	Datum		values[3];
	bool		nulls[3] = {false, false, false};

	if (get_call_result_type(fcinfo, NULL, &tupdesc) != TYPEFUNC_COMPOSITE)
		elog(ERROR, "return type must be a row type");

	values[0] = IntervalPGetDatum(idem_seconds_interval(idem_partition_interval));
	values[1] = IntervalPGetDatum(idem_seconds_interval(idem_max_ttl));
	values[2] = Int32GetDatum(idem_maintenance_lock_timeout);

	PG_RETURN_DATUM(HeapTupleGetDatum(heap_form_tuple(tupdesc, values, nulls)));
}
