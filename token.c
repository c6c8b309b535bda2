/*-------------------------------------------------------------------------
 *
 * token.c
 *		One-time tokens (1.1): made, stored and spent.
 *
 * A token is a record of its own kind (is_token) in idempotency.records,
 * with the token as its key: stored, expired and dropped with the records,
 * invisible to every function of the keys and they to it, with a lock tag
 * class of its own (keylock.c).  Issued, it is 'processing'; consumed,
 * 'completed'.
 *
 * Locking rules.  Issuing takes no key lock: nobody can know the token
 * before it is returned.  Spending follows idem_acquire's protocol through
 * idem_lock_and_read: under the token's lock, a dirty read; where another
 * transaction is writing the token, wait for it to end and read again.
 * This file calls keylock.c and records.c, neither of which calls it.
 *
 * IDENTIFICATION
 *	  token.c
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "utils/builtins.h"
#include "utils/timestamp.h"

#include "idempotency.h"

/* Random bytes of a token: 192 bits, 32 characters of base64url */
#define IDEM_TOKEN_BYTES	24

/*
 * Encode len bytes (a multiple of 3) in the URL-safe base64 alphabet of RFC
 * 4648, without padding, into dst (len / 3 * 4 characters and a NUL).
 */
static void
idem_base64url(const uint8 *src, int len, char *dst)
{
	static const char alphabet[] =
		"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
	int			i;

	Assert(len % 3 == 0);
	for (i = 0; i < len; i += 3)
	{
		uint32		v = ((uint32) src[i] << 16) | ((uint32) src[i + 1] << 8) | src[i + 2];

		*dst++ = alphabet[(v >> 18) & 0x3f];
		*dst++ = alphabet[(v >> 12) & 0x3f];
		*dst++ = alphabet[(v >> 6) & 0x3f];
		*dst++ = alphabet[v & 0x3f];
	}
	*dst = '\0';
}

/*
 * A new token: 192 bits straight from the server's strong random source,
 * as 32 URL-safe characters, palloc'd.  No look for a record of the same
 * token: two equal tokens would take 2^96 of them to be likely.
 */
text *
idem_token_make(void)
{
	uint8		bytes[IDEM_TOKEN_BYTES];
	char		encoded[IDEM_TOKEN_BYTES / 3 * 4 + 1];

	if (!pg_strong_random(bytes, sizeof(bytes)))
		ereport(ERROR,
				(errcode(ERRCODE_INTERNAL_ERROR),
				 errmsg("could not generate a random token")));
	idem_base64url(bytes, sizeof(bytes), encoded);
	explicit_bzero(bytes, sizeof(bytes));
	Assert(strlen(encoded) == IDEM_TOKEN_BYTES / 3 * 4);
	return cstring_to_text(encoded);
}

/*
 * Store a token made by idem_token_make as a live, unconsumed record of
 * scope that expires after ttl, and count it.  parent is open.
 */
void
idem_token_store(Relation parent, text *scope, text *token, int64 ttl)
{
	IdemKey		k = {scope, token, true};
	IdemNewRecord nr;

	nr.request_hash = NULL;
	nr.created_at = GetCurrentTimestamp();
	nr.locked_until = 0;
	nr.expires_at = nr.created_at + ttl;
	nr.claim = NULL;
	idem_records_insert(parent, &k, &nr, NULL);
	idem_stats_add(IDEM_STAT_TOKENS_ISSUED, 1);
}

/*
 * ereport the error of a consume that found another transaction consuming
 * (or issuing) the same token and could not wait for it to end.
 */
static void
idem_token_busy_error(int wait_timeout_ms)
{
	ereport(ERROR,
			(errcode(ERRCODE_LOCK_NOT_AVAILABLE),
			 errmsg("could not consume one-time token: another transaction is still writing it"),
			 errdetail("It waited idempotency.wait_timeout (%d ms) for that transaction, which is consuming or issuing the token, to end.",
					   wait_timeout_ms),
			 errhint("Retry: the token is spent if that transaction commits, and still live if it rolls back.")));
}

/*
 * Consume the live token of scope: true if it was live and is now spent,
 * false if there is none (consumed already, expired, never issued, another
 * scope's).  Another transaction writing the token is waited for up to
 * wait_timeout_ms, then 55P03: never false for a token whose consumer may
 * still roll back.  hint_ttl: see idem_key_read_init.  parent is open.
 */
bool
idem_token_spend(Relation parent, text *scope, text *token,
				 int wait_timeout_ms, int64 hint_ttl)
{
	IdemKey		k = {scope, token, true};
	IdemKeyRead kr;
	IdemRecord *rec = &kr.rec;
	bool		result = false;

	idem_key_read_init(&kr, parent, &k,
					   TimestampTzPlusMilliseconds(GetCurrentTimestamp(),
												   wait_timeout_ms),
					   hint_ttl, NULL);
	if (idem_lock_and_read(&kr) != IDEM_READ_LOCKED)
		idem_token_busy_error(wait_timeout_ms);
	idem_key_read_end(&kr);

	Assert(!rec->found || rec->is_token);
	if (rec->found && !rec->completed)
	{
		idem_records_consume(parent, rec, &k, kr.now);
		result = true;
	}
	idem_unlock(&kr.tag, ExclusiveLock);

	idem_wait_clock_count(&kr.clock);
	if (result)
		idem_stats_add(IDEM_STAT_TOKENS_CONSUMED, 1);
	return result;
}
