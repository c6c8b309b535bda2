/*-------------------------------------------------------------------------
 *
 * reqhash.c
 *		The request hash: SHA-256 of a request's canonical jsonb text, and
 *		the comparison of a stored hash with a request's.
 *
 * idem_acquire hashes every request it is given, so the hash is on the hot
 * path: with OpenSSL the digest and its context are made once per backend
 * and kept (idem_sha256_setup), rather than made and looked up again per
 * call as pg_cryptohash does.  Without OpenSSL, or should it fail, the hash
 * goes through pg_cryptohash.  The hash is the contract's
 * sha256(convert_to(request::text, 'UTF8')), whatever the database
 * encoding.
 *
 * Nothing here takes a lock or touches a table; the kept OpenSSL objects
 * are the backend's own.
 *
 * IDENTIFICATION
 *	  reqhash.c
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#ifdef USE_OPENSSL
#include <openssl/err.h>
#include <openssl/evp.h>
#endif

#include "common/cryptohash.h"
#include "mb/pg_wchar.h"
#include "utils/jsonb.h"

#include "idempotency.h"

#ifdef USE_OPENSSL
/*
 * The digest and context of idem_sha256, made on first use and kept for the
 * backend's life.  pg_cryptohash makes a context and, under OpenSSL 3,
 * looks the algorithm up in the provider store on every call: together
 * some 8,000 instructions, as much as hashing the request itself, on every
 * idem_acquire.
 */
#if OPENSSL_VERSION_NUMBER >= 0x30000000L
static EVP_MD *idem_sha256_md = NULL;
#else
static const EVP_MD *idem_sha256_md = NULL;
#endif
static EVP_MD_CTX *idem_sha256_ctx = NULL;
static bool idem_sha256_failed = false; /* OpenSSL could not make them */

/*
 * Make the kept digest and context; false if OpenSSL cannot, and then it is
 * not asked again.
 */
static bool
idem_sha256_setup(void)
{
	if (idem_sha256_ctx != NULL)
		return true;
	if (idem_sha256_failed)
		return false;
#if OPENSSL_VERSION_NUMBER >= 0x30000000L
	idem_sha256_md = EVP_MD_fetch(NULL, "SHA256", NULL);
#else
	idem_sha256_md = EVP_sha256();
#endif
	if (idem_sha256_md != NULL)
	{
#if OPENSSL_VERSION_NUMBER >= 0x10100000L
		idem_sha256_ctx = EVP_MD_CTX_new();
#else
		idem_sha256_ctx = EVP_MD_CTX_create();
#endif
	}
	if (idem_sha256_ctx == NULL)
	{
#if OPENSSL_VERSION_NUMBER >= 0x30000000L
		EVP_MD_free(idem_sha256_md);
#endif
		idem_sha256_md = NULL;
		idem_sha256_failed = true;
		ERR_clear_error();
		return false;
	}
	return true;
}
#endif

/*
 * SHA-256 of len bytes at data into digest.  With OpenSSL, through the kept
 * context; without it (or should OpenSSL fail), through pg_cryptohash,
 * whose errors are then reported.
 */
void
idem_sha256(const uint8 *data, size_t len, uint8 *digest)
{
	pg_cryptohash_ctx *ctx;

#ifdef USE_OPENSSL
	if (idem_sha256_setup())
	{
		unsigned int outlen;

		if (EVP_DigestInit_ex(idem_sha256_ctx, idem_sha256_md, NULL) == 1 &&
			EVP_DigestUpdate(idem_sha256_ctx, data, len) == 1 &&
			EVP_DigestFinal_ex(idem_sha256_ctx, digest, &outlen) == 1 &&
			outlen == SHA256_DIGEST_BYTES)
			return;
		/* leave no error of ours for pg_cryptohash to report */
		ERR_clear_error();
	}
#endif

	ctx = pg_cryptohash_create(PG_SHA256);
	if (pg_cryptohash_init(ctx) < 0 ||
		pg_cryptohash_update(ctx, data, len) < 0 ||
		pg_cryptohash_final(ctx, digest, SHA256_DIGEST_BYTES) < 0)
		elog(ERROR, "could not compute SHA-256 hash: %s",
			 pg_cryptohash_error(ctx));
	pg_cryptohash_free(ctx);
}

/*
 * SHA-256 of jsonb's canonical text, as a freshly palloc'd bytea.
 *
 * JsonbToCString produces exactly jsonb_out's text, which is what the
 * contract hashes, so the result equals
 * sha256(convert_to(request::text, 'UTF8')).  jsonb text is in the database
 * encoding; in a non-UTF-8 database it is converted first.
 */
bytea *
idem_hash_jsonb(Jsonb *jb)
{
	StringInfoData buf;
	char	   *text;
	size_t		len;
	bytea	   *result;

	initStringInfo(&buf);
	JsonbToCString(&buf, &jb->root, VARSIZE(jb));
	text = pg_server_to_any(buf.data, buf.len, PG_UTF8);
	len = (text == buf.data) ? (size_t) buf.len : strlen(text);

	result = (bytea *) palloc(VARHDRSZ + SHA256_DIGEST_BYTES);
	SET_VARSIZE(result, VARHDRSZ + SHA256_DIGEST_BYTES);
	idem_sha256((const uint8 *) text, len, (uint8 *) VARDATA(result));

	if (text != buf.data)
		pfree(text);
	pfree(buf.data);
	return result;
}

/*
 * Do a stored hash and a request's hash disagree?  Where either is NULL
 * (no payload check asked for) there is no mismatch.
 */
bool
idem_hash_mismatch(const IdemRecord *rec, const bytea *hash)
{
	bytea	   *stored;

	if (rec->hash_null || hash == NULL)
		return false;
	stored = DatumGetByteaPP(rec->request_hash);
	return VARSIZE_ANY_EXHDR(stored) != VARSIZE_ANY_EXHDR(hash) ||
		memcmp(VARDATA_ANY(stored), VARDATA_ANY(hash),
			   VARSIZE_ANY_EXHDR(hash)) != 0;
}
