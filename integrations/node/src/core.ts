// The shared core: idem_acquire's outcomes mapped to HTTP answers, the claim
// that an acquired request's handler gets, and the completion that stores
// the handler's answer in the claim's transaction. The framework adapters
// (express.ts, fastify.ts, nestjs.ts) only capture the handler's answer and
// send what the core says; the plain wrapper (wrapper.ts) uses the claim.

import { createHash } from "crypto";
import { performance } from "perf_hooks";
import type { Pool, PoolClient } from "pg";

/** The request header that carries the client's key. */
export const HEADER_KEY = "Idempotency-Key";
/** The response header that marks a replayed answer. */
export const HEADER_REPLAYED = "Idempotent-Replayed";
/** The request header passed on as the claim's trace (W3C Trace Context). */
export const HEADER_TRACE = "traceparent";
/** The response header of a duplicate that carries the first request's trace. */
export const HEADER_ORIGIN_TRACE = "Idempotent-Origin-Trace";
/**
 * The response headers stored with an answer and sent again with its
 * replays, as spelled here. Others (Date, Retry-After, cookies) are not
 * replayed.
 */
export const REPLAYED_HEADERS = ["Location", "ETag", "Content-Type", "Content-Location"];

const SPELLING: Record<string, string> = Object.fromEntries(REPLAYED_HEADERS.map((h) => [h.toLowerCase(), h]));

/** Options of the HTTP adapters. */
export interface HttpOptions {
  /** How long a key lives, in seconds (default: the server's idempotency.default_ttl). */
  ttl?: number;
  /** The seed's rule: a replayed 2xx is answered 200 (the first answer stays as it was). */
  replayOk?: boolean;
  /**
   * Lease mode per route, in seconds: "POST /api/charges" → 30. The claim
   * commits at once, the handler calls out, its writes and the answer commit
   * in a second transaction fenced by the claim.
   */
  leases?: Record<string, number>;
  /** Paths passed through untouched (besides /health and /metrics). */
  skipPaths?: string[];
  /** Prefix of the problem+json "type" (RFC 9457). */
  problemTypeBase?: string;
  /** Where the duplicate lines go (default: console.error). */
  log?: (line: string) => void;
  /**
   * The duplicate lines (replay, in_progress, mismatch): "sampled" (the
   * default) writes at most one a second per process and log function, the
   * next one saying how many were left out; "all" one per duplicate; "off" none.
   */
  logDuplicates?: LogDuplicates;
  /**
   * An in-process cache of completed answers (off by default): `true` for
   * the defaults, options, or a ReplayCache to share between adapters. A
   * cached answer is sent without asking the database, to a request with
   * the same scope, key and request bytes, never past the key's expires_at.
   */
  replayCache?: boolean | ReplayCacheOptions | ReplayCache;
}

/** How duplicate answers are logged: at most one line a second (the default), every one, or none. */
export type LogDuplicates = "sampled" | "all" | "off";

/** Options of a ReplayCache. */
export interface ReplayCacheOptions {
  /** At most this many answers; the least recently used goes first (default 10,000). */
  maxEntries?: number;
  /** An answer whose body and headers take more bytes is not cached (default 65,536). */
  maxEntryBytes?: number;
  /** An entry is served at most this long after it was put in, in ms (default 60,000). */
  maxAgeMs?: number;
}

/** A completed answer as stored: what a replay sends. */
export interface ReplayEntry {
  status: number;
  /** jsonb's text, or null (no body). */
  body: string | null;
  /** The replayed headers, names in lower case (as idem_acquire returns them). */
  headers: Record<string, string> | null;
  /** The trace of the claim that made the record. */
  originTrace: string | null;
}

interface CacheSlot extends ReplayEntry {
  /**
   * The SHA-256 of the request jsonb's text, exactly as sent to
   * idem_acquire (the digest, not the text: an entry's size is its
   * answer's, whatever the request's).
   */
  request: string;
  /** performance.now() after which it is not served. */
  deadline: number;
}

/**
 * The replay cache: completed answers by (scope, key), served only to a
 * byte-identical request and never past the record's expires_at as the
 * database's clock puts it. Bounded: least recently used first out.
 * One per process (or per adapter); nothing is shared between processes.
 */
export class ReplayCache {
  readonly maxEntries: number;
  readonly maxEntryBytes: number;
  readonly maxAgeMs: number;
  private readonly slots = new Map<string, CacheSlot>();
  private gen = 0;

  constructor(opts: ReplayCacheOptions = {}) {
    this.maxEntries = opts.maxEntries ?? 10_000;
    this.maxEntryBytes = opts.maxEntryBytes ?? 65_536;
    this.maxAgeMs = opts.maxAgeMs ?? 60_000;
    for (const [k, v] of Object.entries({ maxEntries: this.maxEntries, maxEntryBytes: this.maxEntryBytes, maxAgeMs: this.maxAgeMs })) {
      if (!(typeof v === "number" && v >= 0 && Number.isFinite(v))) throw new RangeError(`replayCache.${k} must be a number >= 0`);
    }
  }

  /** The number of entries (expired ones included until they are looked up or pushed out). */
  get size(): number {
    return this.slots.size;
  }

  /**
   * A counter that forget() moves: an answer read from the database before
   * a forget is not put in after it (put() compares).
   */
  get generation(): number {
    return this.gen;
  }

  private static digest(request: string): string {
    return createHash("sha256").update(request).digest("base64");
  }

  private static id(scope: string, key: string): string {
    return `${scope}\u0000${key}`;
  }

  /**
   * The cached answer of (scope, key) if its request is byte-identical to
   * `request` and its deadline has not passed; undefined otherwise (then
   * ask the database: it answers replay or mismatch).
   */
  get(scope: string, key: string, request: string): ReplayEntry | undefined {
    const id = ReplayCache.id(scope, key);
    const s = this.slots.get(id);
    if (!s) return undefined;
    if (performance.now() >= s.deadline) {
      this.slots.delete(id);
      return undefined;
    }
    if (s.request !== ReplayCache.digest(request)) return undefined;
    // most recently used: to the end of the Map's order
    this.slots.delete(id);
    this.slots.set(id, s);
    return { status: s.status, body: s.body, headers: s.headers, originTrace: s.originTrace };
  }

  /**
   * Put a completed answer in. expiresInMs: the record's expires_at minus
   * the database's clock_timestamp(), read in the statement that returned
   * it; sentAt: performance.now() taken before that statement was sent;
   * generation: this.generation then. The entry's deadline is sentAt +
   * expiresInMs (never later than the record's expiry, whatever the
   * clocks' offset), and at most maxAgeMs from now. Not put in: a larger
   * answer than maxEntryBytes, one already expired, one read before a
   * forget. Returns whether it was put in.
   */
  put(scope: string, key: string, request: string, e: ReplayEntry, expiresInMs: number | null, sentAt: number, generation: number): boolean {
    if (generation !== this.gen || expiresInMs == null || !Number.isFinite(expiresInMs) || this.maxEntries < 1) return false;
    const bytes = (e.body == null ? 0 : Buffer.byteLength(e.body)) + (e.headers ? Buffer.byteLength(JSON.stringify(e.headers)) : 0);
    if (bytes > this.maxEntryBytes) return false;
    const now = performance.now();
    const deadline = Math.min(sentAt + expiresInMs, now + this.maxAgeMs);
    if (deadline <= now) return false;
    const id = ReplayCache.id(scope, key);
    this.slots.delete(id);
    this.slots.set(id, {
      status: e.status, body: e.body, headers: e.headers ? { ...e.headers } : null, originTrace: e.originTrace,
      request: ReplayCache.digest(request), deadline,
    });
    while (this.slots.size > this.maxEntries) {
      const oldest = this.slots.keys().next().value as string;
      this.slots.delete(oldest);
    }
    return true;
  }

  /** Drop (scope, key), and refuse answers read from the database before now. */
  delete(scope: string, key: string): void {
    this.gen++;
    this.slots.delete(ReplayCache.id(scope, key));
  }

  /** Drop every entry. */
  clear(): void {
    this.gen++;
    this.slots.clear();
  }
}

/** The ReplayCache an option names, or null (off). */
export function replayCacheOf(opt: boolean | ReplayCacheOptions | ReplayCache | undefined): ReplayCache | null {
  if (!opt) return null;
  if (opt instanceof ReplayCache) return opt;
  return new ReplayCache(opt === true ? {} : opt);
}

/**
 * idem_forget(key, scope) on the pool, and the key out of `cache` (if any):
 * this process's cache only; other processes' caches keep their entry
 * until its maxAge (or the record's expiry) passes. true when the database
 * had a live record.
 */
export async function forget(pool: Pool, scope: string, key: string, cache?: ReplayCache | null): Promise<boolean> {
  cache?.delete(scope, key);
  try {
    const r = await pool.query("SELECT idempotency.idem_forget(key => $1::text, scope => $2::text) AS forgotten", [key, scope]);
    return r.rows[0].forgotten === true;
  } finally {
    // and refuse what was read from the database while the forget ran
    cache?.delete(scope, key);
  }
}

/** The default log function: one for the process, so that "sampled" counts every adapter's lines together. */
const consoleLog = (line: string): void => console.error(line);
const sampling = new WeakMap<(line: string) => void, { last: number; since: Date | null; skipped: number }>();

/** HH:MM:SS of d, local time. */
function clock(d: Date): string {
  return [d.getHours(), d.getMinutes(), d.getSeconds()].map((n) => String(n).padStart(2, "0")).join(":");
}

/**
 * The duplicate lines' writer: log as the logDuplicates option says.
 * "sampled": a line when a second has passed since the last one written to
 * the same log function, with "(and N more duplicate answers not logged
 * since HH:MM:SS)" (local time of the first one left out) when some were
 * left out in between.
 */
export function duplicateLogger(
  mode: LogDuplicates = "sampled",
  log: (line: string) => void = consoleLog,
): (line: string | (() => string)) => void {
  const text = (line: string | (() => string)) => (typeof line === "function" ? line() : line);
  if (mode === "off") return () => undefined;
  if (mode === "all") return (line) => log(text(line));
  if (mode !== "sampled") throw new RangeError(`logDuplicates must be "sampled", "all" or "off", not ${JSON.stringify(mode)}`);
  // the line is made only when it is written
  return (line) => {
    const now = performance.now();
    const st = sampling.get(log);
    if (st && now - st.last < 1000) {
      if (st.skipped++ === 0) st.since = new Date();
      return;
    }
    const more = st && st.skipped > 0 && st.since
      ? ` (and ${st.skipped} more duplicate answers not logged since ${clock(st.since)})`
      : "";
    sampling.set(log, { last: now, since: null, skipped: 0 });
    log(text(line) + more);
  };
}

/** The part of an HTTP request the core needs. */
export interface HttpRequestInfo {
  method: string;
  /** The path without the query string. */
  path: string;
  /** The Idempotency-Key header, if any. */
  key: string | undefined;
  /** The raw body (null or empty: none). */
  body: string | Buffer | null;
  /** The traceparent header, if any. */
  trace: string | undefined;
  /** The authenticated user (goes into the scope); empty: "anonymous". */
  user: string | undefined;
}

/**
 * An answer to send. headers: name → value to set, or null to remove (a
 * header the handler set that must not go out with this answer).
 */
export interface Answer {
  status: number;
  headers: Record<string, string | null>;
  body: string | null;
}

/** The handler's answer as the adapter captured it (headers lower-cased or not). */
export interface Captured {
  status: number;
  headers: Record<string, unknown>;
  body: Buffer | string | null;
}

/** The last checkpoint of the claim taken over (idem_acquire's phase and state). */
export interface Resumed {
  phase: string;
  state: unknown;
}

export class IdempotencyError extends Error {}

/** The key's first request is still being processed (HTTP 409). */
export class InProgressError extends IdempotencyError {
  constructor(public readonly retryAfter: number, public readonly originTrace: string | null) {
    super(`a request with this key is being processed; retry after ${retryAfter} s`);
    this.name = "InProgressError";
  }
}

/** The key was used before with another request (HTTP 422). */
export class MismatchError extends IdempotencyError {
  constructor(public readonly originTrace: string | null) {
    super("the key was used before with another request");
    this.name = "MismatchError";
  }
}

/** This claim was taken over after its lease ran out (SQLSTATE 55000 at completion). */
export class ClaimLostError extends IdempotencyError {
  constructor() {
    super("the claim was taken over: it took longer than its lease");
    this.name = "ClaimLostError";
  }
}

/** What idem_acquire answered. */
export interface Acquired {
  outcome: "acquired" | "replay" | "in_progress" | "mismatch";
  status: number | null;
  body: string | null; // jsonb's text
  retryAfter: number | null;
  claim: string | null;
  phase: string | null;
  state: unknown;
  headers: Record<string, string> | null;
  originTrace: string | null;
  /** expires_at minus the database's clock_timestamp() after the call, in ms (null: no record). */
  expiresInMs: number | null;
}

export interface AcquireArgs {
  key: string;
  /** The request as JSON text ("null" for none). */
  request: string;
  scope: string;
  ttl?: number | null;
  lease?: number | null;
  trace?: string | null;
}

/** The result columns read from idem_acquire, with the time left to its record by the database's clock. */
const ACQUIRED_COLUMNS = `outcome, response_status, response_body::text AS response_body, retry_after, claim::text AS claim,
         phase, state, response_headers, origin_trace,
         (extract(epoch FROM expires_at - pg_catalog.clock_timestamp()) * 1000)::float8 AS expires_in_ms`;

const ACQUIRE = `
  SELECT ${ACQUIRED_COLUMNS}
    FROM idempotency.idem_acquire(key => $1::text, request => $2::jsonb, scope => $3::text,
                                  ttl => $4::float8 * interval '1 second',
                                  lease => $5::float8 * interval '1 second',
                                  trace => $6::text)`;

/** Seconds for "$n::float8 * interval '1 second'", or null (the server's default). */
function seconds(s: number | null | undefined): number | null {
  return s && s > 0 ? Math.ceil(s * 1e6) / 1e6 : null;
}

export async function acquire(client: PoolClient, a: AcquireArgs): Promise<Acquired> {
  const r = await client.query(ACQUIRE, [a.key, a.request, a.scope, seconds(a.ttl), seconds(a.lease), a.trace ?? null]);
  return acquired(r.rows[0]);
}

/** A value as an SQL literal (NULL for null), for the one-round-trip statements below. */
function lit(c: PoolClient, v: string | null | undefined): string {
  return v == null ? "NULL" : c.escapeLiteral(v);
}

/** The result of the last statement of a simple query that ran several. */
function lastResult(r: unknown): { rows: any[] } {
  return (Array.isArray(r) ? r[r.length - 1] : r) as { rows: any[] };
}

/**
 * BEGIN and idem_acquire in one round trip: one simple query of two
 * statements, its values as literals (a simple query takes no parameters).
 * The transaction is open when this returns, whatever the outcome.
 */
export async function beginAndAcquire(client: PoolClient, a: AcquireArgs): Promise<Acquired> {
  const secs = (s: number | null | undefined) => {
    const v = seconds(s);
    return v == null ? "NULL::interval" : `${v}::float8 * interval '1 second'`;
  };
  const r = await client.query(`BEGIN;
  SELECT ${ACQUIRED_COLUMNS}
    FROM idempotency.idem_acquire(key => ${lit(client, a.key)}::text, request => ${lit(client, a.request)}::jsonb,
                                  scope => ${lit(client, a.scope)}::text, ttl => ${secs(a.ttl)},
                                  lease => ${secs(a.lease)}, trace => ${lit(client, a.trace)}::text)`);
  return acquired(lastResult(r).rows[0]);
}

function acquired(row: any): Acquired {
  return {
    outcome: row.outcome,
    status: row.response_status,
    body: row.response_body,
    retryAfter: row.retry_after,
    claim: row.claim,
    phase: row.phase,
    state: row.state,
    headers: row.response_headers,
    originTrace: row.origin_trace,
    expiresInMs: row.expires_in_ms,
  };
}

/**
 * What an acquired request's handler gets: the transaction its writes go
 * in (they commit with the stored answer), and the lease-mode tools.
 */
export class Claim {
  /** The claim idem_acquire returned (checkpoints, extends and the completion are fenced by it). */
  readonly id: string | null;
  /** After a takeover: the last checkpoint of the claim taken over; else null. */
  readonly resumed: Resumed | null;
  released = false;
  /** A checkpoint was committed: a failure leaves the claim to its lease. */
  checkpointed = false;
  /** Set by abort(): roll back, store nothing. */
  aborted = false;
  /** For the replay cache: what the acquiring request sent, and its record's expiry (set by HttpIdempotency). */
  cacheNote: { request: string; trace: string | null; expiresInMs: number | null; sentAt: number; generation: number } | null = null;
  private client: PoolClient | null;
  private begun: Promise<PoolClient> | null = null;
  private ended = false;

  constructor(
    readonly pool: Pool,
    readonly key: string,
    readonly scope: string,
    /** Seconds; 0: one transaction. */
    readonly lease: number,
    a: Acquired,
    client: PoolClient | null,
  ) {
    this.id = a.claim;
    this.resumed = a.phase != null ? { phase: a.phase, state: a.state } : null;
    this.client = client;
    if (client) this.begun = Promise.resolve(client);
  }

  /**
   * The pg client whose transaction commits with the stored answer. In
   * lease mode it is begun at the first call: call it after the outside
   * call, not before.
   */
  tx(): Promise<PoolClient> {
    if (this.ended) return Promise.reject(new IdempotencyError("the claim's transaction has ended"));
    if (!this.begun) {
      this.begun = (async () => {
        const c = await this.pool.connect();
        try {
          await c.query("BEGIN");
        } catch (e) {
          c.release(e as Error);
          throw e;
        }
        this.client = c;
        return c;
      })();
    }
    return this.begun;
  }

  /** Run sql in the open transaction if there is one, else on the pool (committed at once). */
  private async run(sql: string, params: unknown[]): Promise<boolean> {
    if (this.begun) {
      const c = await this.begun;
      await c.query(sql, params);
      return true;
    }
    await this.pool.query(sql, params);
    return false;
  }

  /** idem_release: nothing is stored, the next request with this key runs the handler again. */
  async release(): Promise<void> {
    await this.run("SELECT idempotency.idem_release(key => $1, scope => $2, claim => $3::uuid)", [this.key, this.scope, this.id]);
    this.released = true;
  }

  /**
   * idem_checkpoint: record the step done (phase) and what the next attempt
   * needs (state, a JSON value). In the open transaction if there is one,
   * else (lease mode, before tx()) committed at once; after that a failing
   * handler leaves the claim to its lease, and the retry that takes it over
   * finds the checkpoint in `resumed`.
   */
  async checkpoint(phase: string, state?: unknown): Promise<void> {
    const inTx = await this.run(
      "SELECT idempotency.idem_checkpoint(key => $1, scope => $2, claim => $3::uuid, phase => $4, state => $5::jsonb)",
      [this.key, this.scope, this.id, phase, state === undefined ? null : JSON.stringify(state)],
    );
    if (!inTx) this.checkpointed = true;
  }

  /** idem_extend: push the lease out to now + lease (a no-op in one-transaction mode). */
  async extend(): Promise<void> {
    if (!this.lease) return;
    await this.pool.query(
      "SELECT idempotency.idem_extend(key => $1, scope => $2, claim => $3::uuid, lease => $4::float8 * interval '1 second')",
      [this.key, this.scope, this.id, seconds(this.lease)],
    );
  }

  /** Run fn while extending the lease every third of it (for a slow outside call). */
  async keepAlive<T>(fn: () => Promise<T>): Promise<T> {
    if (!this.lease) return fn();
    let beat: Promise<void> = Promise.resolve();
    let stopped = false;
    const timer = setInterval(() => {
      beat = beat.then(() =>
        stopped
          ? undefined
          : this.extend().catch(() => {
              // taken over or expired: the completion will be refused
              clearInterval(timer);
            }),
      );
    }, (this.lease * 1000) / 3);
    try {
      return await fn();
    } finally {
      stopped = true;
      clearInterval(timer);
      await beat;
    }
  }

  /** Roll back and store nothing: the retry runs the handler again. */
  abort(): void {
    this.aborted = true;
  }

  /** Commit or roll back the open transaction, if any, and give its client back. */
  async end(commit: boolean): Promise<void> {
    if (this.ended) return;
    this.ended = true;
    const c = this.begun ? await this.begun.catch(() => null) : null;
    if (!c) return;
    try {
      await c.query(commit ? "COMMIT" : "ROLLBACK");
      c.release();
    } catch (e) {
      c.release(e as Error);
      throw e;
    }
  }

  /**
   * Store (status, body, headers) in the transaction and commit; the stored
   * body's text. idem_complete and COMMIT go in one round trip (one simple
   * query): should idem_complete fail, PostgreSQL runs nothing after it, and
   * the transaction is rolled back here.
   */
  async complete(status: number, body: string | null, headers: Record<string, string> | null): Promise<string | null> {
    let canonical: string | null;
    let c: PoolClient;
    try {
      c = await this.tx();
      const h = headers && Object.keys(headers).length ? JSON.stringify(headers) : null;
      const r = await c.query(`
  SELECT idempotency.idem_complete(key => ${lit(c, this.key)}::text, response_status => ${Math.trunc(status)}::int,
                                   response_body => b.j, scope => ${lit(c, this.scope)}::text,
                                   claim => ${lit(c, this.id)}::uuid, response_headers => ${lit(c, h)}::jsonb) AS done,
         b.j::text AS canonical
    FROM (SELECT ${lit(c, body)}::jsonb AS j) b;
  COMMIT`);
      canonical = (Array.isArray(r) ? r[0] : r).rows[0].canonical;
    } catch (e) {
      await this.end(false).catch(() => undefined);
      if ((e as { code?: string }).code === "55000") throw new ClaimLostError();
      throw e;
    }
    this.ended = true;
    c.release();
    return canonical;
  }

  /**
   * After a failure (an exception, abort()): roll back; in lease mode give
   * the claim up, unless released or checkpointed, so that a retry runs
   * again at once (the outside service is called with the same key and
   * deduplicates it).
   */
  async fail(): Promise<void> {
    await this.end(false).catch(() => undefined);
    if (this.lease && !this.released && !this.checkpointed) {
      await this.pool
        .query("SELECT idempotency.idem_release(key => $1, scope => $2, claim => $3::uuid)", [this.key, this.scope, this.id])
        .catch(() => undefined);
    }
  }
}

/** The scope of a request: the user and the route, hashed when longer than 255 bytes. */
export function httpScope(user: string | undefined, method: string, path: string): string {
  const s = `user:${user || "anonymous"} ${method} ${path}`;
  if (Buffer.byteLength(s) > 255) return "sha256:" + createHash("sha256").update(s).digest("hex");
  return s;
}

/** What a JSON body is sent as, first time and replayed alike. */
export function contentType(status: number): string {
  return status >= 400 ? "application/problem+json" : "application/json; charset=utf-8";
}

function isJSON(s: string): boolean {
  try {
    JSON.parse(s);
    return true;
  } catch {
    return false;
  }
}

function spelling(name: string): string {
  return SPELLING[name.toLowerCase()] ?? name;
}

function headerValue(v: unknown): string | undefined {
  if (v === undefined || v === null) return undefined;
  if (Array.isArray(v)) return v.map(String).join(", ");
  return String(v);
}

/** The first outcome of a request: an answer to send now, or a claim to run the handler with. */
export type Begun = { answer: Answer; claim?: undefined } | { claim: Claim; answer?: undefined };

/**
 * The mapping from idem_acquire's outcomes to HTTP (IETF draft -09): the
 * framework adapters call begin() before the handler and finish() (or
 * failed()) after it.
 */
export class HttpIdempotency {
  readonly skip: Set<string>;
  readonly problemTypeBase: string;
  /** The replay cache (the replayCache option), or null (off). */
  readonly replayCache: ReplayCache | null;
  private readonly log: (line: string | (() => string)) => void;

  constructor(readonly pool: Pool, readonly opts: HttpOptions = {}) {
    this.skip = new Set(["/health", "/metrics", ...(opts.skipPaths ?? [])]);
    this.problemTypeBase = opts.problemTypeBase ?? "https://example.com/problems/";
    this.log = duplicateLogger(opts.logDuplicates ?? "sampled", opts.log ?? consoleLog);
    this.replayCache = replayCacheOf(opts.replayCache);
  }

  /**
   * idem_forget(key, scope) on the pool, and the key out of this process's
   * replay cache. Other processes' caches keep their entry until its maxAge
   * (or the record's expiry) passes. true when the database had a record.
   */
  forget(scope: string, key: string): Promise<boolean> {
    return forget(this.pool, scope, key, this.replayCache);
  }

  /** Whether a request is left alone (GET, HEAD, OPTIONS, skipped paths). */
  skipped(method: string, path: string): boolean {
    return method === "GET" || method === "HEAD" || method === "OPTIONS" || this.skip.has(path);
  }

  /** The lease of a route ("POST /api/charges"), in seconds; 0: one transaction. */
  leaseOf(method: string, route: string): number {
    return this.opts.leases?.[`${method} ${route}`] ?? 0;
  }

  /** An RFC 9457 problem+json answer (never stored). */
  problem(status: number, type: string, title: string, detail: string, headers: Record<string, string | null> = {}): Answer {
    // keys in Go's order (sorted), as the Gin example answers them
    const body = JSON.stringify({ detail, status, title, type: this.problemTypeBase + type });
    return { status, headers: { ...headers, "Content-Type": "application/problem+json" }, body };
  }

  /** A database error: 503 where a retry cures it, 400 for data the database refused, else 500. */
  dbProblem(err: unknown, headers: Record<string, string | null> = {}): Answer {
    const code: string = (err as { code?: string })?.code ?? "";
    const msg = err instanceof Error ? err.message : String(err);
    if (code.startsWith("40") || code === "55P03" || code === "53300") {
      return this.problem(503, "try-again", "Try again", msg, { ...headers, "Retry-After": "1" });
    }
    if (code.startsWith("22")) return this.problem(400, "bad-request", "Request refused by the database", msg, headers);
    return this.problem(500, "database-error", "Database error", msg, headers);
  }

  /** Claim the request's key; an answer to send at once (400, replay, 409, 422, 5xx) or a claim. */
  async begin(req: HttpRequestInfo, lease: number): Promise<Begun> {
    const key = req.key;
    if (!key) {
      return {
        answer: this.problem(400, "idempotency-key-missing", "Idempotency-Key header missing",
          "This operation is idempotent: send an Idempotency-Key header (a UUID that you send again when you retry)."),
      };
    }
    if (Buffer.byteLength(key) > 255) {
      return { answer: this.problem(400, "idempotency-key-invalid", "Idempotency-Key header too long", "The key is at most 255 bytes long.") };
    }
    let request = "null"; // an empty body: compared as JSON null
    const raw = req.body == null ? "" : req.body.toString();
    if (raw.trim() !== "") {
      if (!isJSON(raw)) {
        return { answer: this.problem(400, "body-not-json", "Request body is not JSON", "The request body is compared with the first request's as JSON.") };
      }
      request = raw;
    }
    // for linking duplicates to the first request: one too long to store
    // (255 bytes) is not passed on rather than refused
    const trace = req.trace && Buffer.byteLength(req.trace) <= 255 ? req.trace : null;
    const scope = httpScope(req.user, req.method, req.path);

    const cache = this.replayCache;
    if (cache) {
      const hit = cache.get(scope, key, request);
      if (hit) {
        this.logDuplicate("replay (cached)", key, scope, trace, hit.originTrace);
        return { answer: this.replayAnswer(hit) };
      }
    }
    const generation = cache ? cache.generation : 0;
    const sentAt = performance.now();
    let client: PoolClient;
    try {
      client = await this.pool.connect();
    } catch (e) {
      return { answer: this.dbProblem(e) };
    }
    let a: Acquired;
    try {
      // BEGIN and the claim in one round trip
      a = await beginAndAcquire(client, { key, request, scope, ttl: this.opts.ttl, lease, trace });
      // lease mode: the claim is now visible, as processing
      if (a.outcome === "acquired" && lease > 0) await client.query("COMMIT");
    } catch (e) {
      await client.query("ROLLBACK").catch(() => undefined);
      client.release();
      return { answer: this.dbProblem(e) };
    }
    if (a.outcome === "acquired") {
      if (lease > 0) {
        client.release();
        return { claim: this.noted(new Claim(this.pool, key, scope, lease, a, null), request, trace, a, sentAt, generation) };
      }
      return { claim: this.noted(new Claim(this.pool, key, scope, 0, a, client), request, trace, a, sentAt, generation) };
    }
    // A duplicate wrote nothing: its answer goes out without waiting for
    // the ROLLBACK, and the client goes back to the pool once that is done.
    client.query("ROLLBACK").then(
      () => client.release(),
      (e: Error) => client.release(e),
    );

    // a duplicate: link it to the first request, in the log and for the client
    this.logDuplicate(a.outcome, key, scope, trace, a.originTrace);
    const dup: Record<string, string | null> = {};
    if (a.originTrace != null) dup[HEADER_ORIGIN_TRACE] = a.originTrace;

    if (a.outcome === "replay") {
      const e: ReplayEntry = { status: a.status as number, body: a.body, headers: a.headers, originTrace: a.originTrace };
      cache?.put(scope, key, request, e, a.expiresInMs, sentAt, generation);
      return { answer: this.replayAnswer(e) };
    }
    if (a.outcome === "mismatch") {
      return {
        answer: this.problem(422, "idempotency-key-reused", "Idempotency-Key already used for another request",
          "This key was sent before with a different request body; use a new key for a new request.", dup),
      };
    }
    const wait = a.retryAfter && a.retryAfter > 0 ? a.retryAfter : 1;
    return {
      answer: this.problem(409, "request-in-progress", "A request with this Idempotency-Key is being processed",
        `Send the same request again after ${wait} second(s).`, { ...dup, "Retry-After": String(wait) }),
    };
  }

  private logDuplicate(outcome: string, key: string, scope: string, trace: string | null, origin: string | null): void {
    this.log(() => `idempotency: ${outcome}, key ${JSON.stringify(key)} scope ${JSON.stringify(scope)}: ` +
      `traceparent ${trace ?? "-"}, first request's ${origin ?? "-"}`);
  }

  private noted(claim: Claim, request: string, trace: string | null, a: Acquired, sentAt: number, generation: number): Claim {
    if (this.replayCache) claim.cacheNote = { request, trace, expiresInMs: a.expiresInMs, sentAt, generation };
    return claim;
  }

  /** A stored answer as a replay sends it: the database's or the cache's alike. */
  private replayAnswer(e: ReplayEntry): Answer {
    let status = e.status;
    if (this.opts.replayOk && status >= 200 && status < 300) status = 200;
    const headers: Record<string, string | null> = {};
    let ct = "";
    for (const [name, v] of Object.entries(e.headers ?? {})) {
      // stored in lower case: sent as REPLAYED_HEADERS spell them
      if (name === "content-type") ct = v;
      else headers[spelling(name)] = v;
    }
    if (e.originTrace != null) headers[HEADER_ORIGIN_TRACE] = e.originTrace;
    headers[HEADER_REPLAYED] = "true";
    return this.respond(status, e.body, ct, headers);
  }

  /** status and body (jsonb's text, or null), as Content-Type ct (empty: contentType(status)). */
  private respond(status: number, body: string | null, ct: string, headers: Record<string, string | null>): Answer {
    if (body == null) return { status, headers: { ...headers, "Content-Type": null }, body: null };
    return { status, headers: { ...headers, "Content-Type": ct || contentType(status) }, body };
  }

  /**
   * After the handler answered: store its status, body and allowlisted
   * headers with idem_complete and commit, then the answer to send (the body
   * as the database stores it, so that the first answer and every replay are
   * the same bytes). After release(): commit and send it as it is, unstored.
   * After abort(): roll back and send it as it is.
   */
  async finish(claim: Claim, got: Captured): Promise<Answer> {
    const raw = got.body == null ? "" : got.body.toString();
    const asIs: Answer = { status: got.status, headers: {}, body: raw };
    if (claim.aborted) {
      await claim.fail();
      return asIs;
    }
    if (claim.released) {
      try {
        await claim.end(true);
      } catch (e) {
        return this.dbProblem(e, dropReplayed());
      }
      return asIs;
    }
    let body: string | null = null;
    let ct = "";
    if (raw.length > 0) {
      if (!isJSON(raw)) {
        await claim.fail();
        return this.problem(500, "response-not-json", "Handler answered non-JSON",
          "The idempotency middleware stores JSON responses only.", dropReplayed());
      }
      body = raw;
      ct = contentType(got.status);
    }
    // the headers to replay: those of REPLAYED_HEADERS that this answer
    // has (its Content-Type as it goes out)
    const lower: Record<string, unknown> = {};
    for (const [k, v] of Object.entries(got.headers)) lower[k.toLowerCase()] = v;
    const replayed: Record<string, string> = {};
    for (const name of REPLAYED_HEADERS) {
      const v = headerValue(lower[name.toLowerCase()]);
      if (v && name !== "Content-Type") replayed[name] = v;
    }
    if (ct) replayed["Content-Type"] = ct;
    let canonical: string | null;
    try {
      canonical = await claim.complete(got.status, body, replayed);
    } catch (e) {
      if (e instanceof ClaimLostError) {
        // lease mode: the lease ran out and another request took the claim
        // over; its answer is the one that counts
        return this.problem(409, "idempotency-claim-lost", "This request's claim was taken over",
          "It took longer than its lease; send the same request again to get the stored answer.",
          { ...dropReplayed(), "Retry-After": "1" });
      }
      return this.dbProblem(e, dropReplayed());
    }
    // committed: a replay from now on, so the cache may answer it
    const note = claim.cacheNote;
    if (this.replayCache && note) {
      const stored: Record<string, string> = {};
      for (const [k, v] of Object.entries(replayed)) stored[k.toLowerCase()] = v;
      this.replayCache.put(claim.scope, claim.key, note.request,
        { status: got.status, body: canonical, headers: Object.keys(stored).length ? stored : null, originTrace: note.trace },
        note.expiresInMs, note.sentAt, note.generation);
    }
    return this.respond(got.status, canonical, ct, {});
  }

  /** After the handler failed (threw, or its connection died): roll back, store nothing. */
  async failed(claim: Claim): Promise<void> {
    await claim.fail();
  }
}

/** The handler's replayable headers removed from an answer that is not the handler's. */
function dropReplayed(): Record<string, null> {
  return Object.fromEntries(REPLAYED_HEADERS.map((h) => [h, null]));
}
