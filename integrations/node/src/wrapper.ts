// idempotent(): exactly-once for queue consumers and jobs (what Powertools'
// makeIdempotent does), with the function's writes in the claim's transaction.

import { performance } from "perf_hooks";
import type { Pool, PoolClient } from "pg";
import { acquire, Acquired, Claim, InProgressError, MismatchError, ReplayCache } from "./core";

export interface IdempotentOptions {
  /** The key: a message id, a job id, a client's Idempotency-Key. At most 255 bytes. */
  key: string;
  /** What the call says (any JSON value): the same key with another request is a MismatchError. Omitted: no check. */
  request?: unknown;
  /** Where the key is unique (a queue, a job type, a tenant). Default "". */
  scope?: string;
  /** How long the key lives, in seconds (default: idempotency.default_ttl). */
  ttl?: number;
  /**
   * Lease mode, in seconds: the claim commits at once, fn calls out (use
   * claim.keepAlive and claim.checkpoint), and its writes and the result
   * commit in a second transaction fenced by the claim. 0 or omitted: fn
   * runs inside the claim's transaction.
   */
  lease?: number;
  /** The caller's W3C traceparent, stored with the claim. */
  trace?: string;
  /**
   * A replay cache shared by the calls (new ReplayCache(...)): a stored
   * result is returned from it, without the database, to a call with the
   * same scope, key and request; forget(pool, scope, key, cache) evicts.
   */
  replayCache?: ReplayCache | null;
}

/**
 * Run fn once for key: the first call runs it inside the transaction that
 * claimed the key (claim.tx() gives that transaction's pg client) and stores
 * its result (any JSON value) with it; a later call with the same key gets
 * the stored result back without running fn. A call while the first is
 * still running throws InProgressError; the same key with another request
 * throws MismatchError. If fn throws, everything rolls back, nothing is
 * stored, and the next call runs fn again. If fn calls claim.release(), its
 * result is returned but not stored.
 */
export async function idempotent<T>(pool: Pool, opts: IdempotentOptions, fn: (claim: Claim) => Promise<T>): Promise<T> {
  const lease = opts.lease && opts.lease > 0 ? opts.lease : 0;
  const scope = opts.scope ?? "";
  const request = opts.request === undefined ? null : JSON.stringify(opts.request);
  const cache = opts.replayCache ?? null;
  // no request (no check): "" in the cache, which no JSON text equals
  const cached = cache?.get(scope, opts.key, request ?? "");
  if (cached) return (cached.body == null ? undefined : JSON.parse(cached.body)) as T;
  const generation = cache ? cache.generation : 0;
  const sentAt = performance.now();
  const client: PoolClient = await pool.connect();
  let a: Acquired;
  try {
    await client.query("BEGIN");
    a = await acquire(client, { key: opts.key, request: request as string, scope, ttl: opts.ttl, lease, trace: opts.trace });
    if (a.outcome !== "acquired" || lease > 0) await client.query(a.outcome === "acquired" ? "COMMIT" : "ROLLBACK");
  } catch (e) {
    await client.query("ROLLBACK").catch(() => undefined);
    client.release();
    throw e;
  }
  if (a.outcome !== "acquired" || lease > 0) client.release();
  switch (a.outcome) {
    case "replay":
      cache?.put(scope, opts.key, request ?? "", { status: a.status as number, body: a.body, headers: a.headers, originTrace: a.originTrace },
        a.expiresInMs, sentAt, generation);
      return (a.body == null ? undefined : JSON.parse(a.body)) as T;
    case "in_progress":
      throw new InProgressError(a.retryAfter && a.retryAfter > 0 ? a.retryAfter : 1, a.originTrace);
    case "mismatch":
      throw new MismatchError(a.originTrace);
  }
  const claim = new Claim(pool, opts.key, scope, lease, a, lease > 0 ? null : client);
  let result: T;
  try {
    result = await fn(claim);
  } catch (e) {
    await claim.fail();
    throw e;
  }
  if (claim.aborted) {
    await claim.fail();
    return result;
  }
  if (claim.released) {
    await claim.end(true);
    return result;
  }
  const body = result === undefined ? null : JSON.stringify(result);
  const canonical = await claim.complete(200, body ?? null, null);
  cache?.put(scope, opts.key, request ?? "", { status: 200, body: canonical, headers: null, originTrace: opts.trace ?? null },
    a.expiresInMs, sentAt, generation);
  return (canonical == null ? undefined : JSON.parse(canonical)) as T;
}
