// Shards: the calls of an idempotency_proxy cluster sent by the
// application straight to the shard that owns each key, so that no router
// backend spends its CPU on them (issue 39: a PL/Proxy router costs about
// what a shard does, whatever it routes). The router stays, for SQL-only
// clients and for the growth window, when only it knows where a moved
// key's records are. The port of the Go package's idempotency.Shards
// (integrations/go/shards.go): the same routing, the same statements.

import { createHash } from "crypto";
import { readFileSync } from "fs";
import { Pool } from "pg";
import type { PoolConfig, QueryConfig } from "pg";

/** Options of Shards.connect(). */
export interface ShardsOptions {
  /**
   * Makes the pool of one shard from its connection string, as the
   * router's layout spells it (idempotency.cluster_state.connstrs): a pg
   * Pool, or the config to make one with. Default: poolConfigOf(connstr),
   * so that the user and the password come from the environment (PGUSER,
   * PGPASSWORD) where the string has none. Use it where the application
   * reaches the shards by other addresses or credentials than the router.
   * Shards.close() ends the pools made by it.
   */
  pool?: (connstr: string) => Pool | PoolConfig;
  /**
   * How long a layout is used before it is read again, in ms (default
   * 30,000). A shard refuses a call from a layout it has left behind, and
   * Shards then reads the layout again at once, so maxAgeMs only bounds
   * how long Shards keeps sending calls through the router after a
   * growth's window has closed.
   */
  maxAgeMs?: number;
}

/** What Shards.acquire() sends: idem_acquire's arguments. */
export interface ShardAcquireArgs {
  key: string;
  /** The request as JSON text; null or omitted: no payload check. */
  request?: string | null;
  scope: string;
  /** How long the key lives, in seconds (omitted, null or 0: the server's default). */
  ttl?: number | null;
  /** The claim's lease, in seconds (omitted, null or 0: the server's default). */
  lease?: number | null;
  /** The caller's W3C traceparent, stored with the claim (null: none). */
  trace?: string | null;
}

/** What Shards.complete() sends: idem_complete's arguments. */
export interface ShardCompleteArgs {
  key: string;
  scope: string;
  /** The claim that acquire() answered. */
  claim: string;
  status: number;
  /** The answer's body as JSON text (null: none). */
  body?: string | null;
  /** The headers to replay, as JSON text ('{"Location": "/x"}'; null: none). */
  headers?: string | null;
}

/** What Shards.release() sends: idem_release's arguments. */
export interface ShardReleaseArgs {
  key: string;
  scope: string;
  /** The claim that acquire() answered. */
  claim: string;
}

/**
 * idem_acquire's answer (the columns of idempotency 1.2's idem_acquire),
 * through Shards. JSON values are their text, as the database wrote them.
 */
export interface ShardAnswer {
  outcome: "acquired" | "replay" | "in_progress" | "mismatch";
  responseStatus: number | null;
  responseBody: string | null;
  attempt: number | null;
  expiresAt: Date | null;
  claim: string | null;
  retryAfter: number | null;
  phase: string | null;
  /** The last checkpoint's state, JSON text. */
  state: string | null;
  /** The stored headers, JSON text (their names in lower case). */
  responseHeaders: string | null;
  originTrace: string | null;
}

/**
 * How Shards routes now: direct (to the owning shard), or through the
 * router (why says why), at layout version over partitions partitions.
 */
export interface ShardsLayout {
  version: number;
  partitions: number;
  direct: boolean;
  why: string;
}

/** The layout as Shards last read it. */
interface ShardLayout {
  version: number;
  /** partition i is servers[i] */
  servers: string[];
  /** false: every call goes through the router */
  direct: boolean;
  /** why not direct */
  why: string;
  /** Date.now() when it was read */
  read: number;
}

// The statements, the same text as the Go package's (and on a shard and on
// the router where the call is the same: complete, release); each is a
// named prepared statement, prepared once a connection.
const shardAcquireSQL = `SELECT outcome, response_status, response_body::text, attempt, expires_at,
       claim::text, retry_after, phase, state::text, response_headers::text, origin_trace
  FROM idempotency.shard_acquire($1::bigint, $2::text, $3::jsonb, $4::text, $5::interval, $6::interval, $7::text)`;
const routerAcquireSQL = `SELECT outcome, response_status, response_body::text, attempt, expires_at,
       claim::text, retry_after, phase, state::text, response_headers::text, origin_trace
  FROM idempotency.idem_acquire($1::text, $2::jsonb, $3::text, $4::interval, $5::interval, false, $6::text)`;
const completeSQL = `SELECT idempotency.idem_complete($1::text, $2::int, $3::jsonb, $4::text, NULL::int, $5::uuid, $6::jsonb)`;
const releaseSQL = `SELECT idempotency.idem_release($1::text, $2::text, NULL::int, $3::uuid)`;
const layoutSQL = `SELECT s.version, s.active, s.map, s.previous_map IS NOT NULL FROM idempotency.shard_layout s`;
const clusterSQL = `SELECT s.connstrs FROM idempotency.cluster_state s`;

/** A named prepared statement: pg prepares it once a connection. */
function stmt(name: string, text: string, values: unknown[]): QueryConfig {
  // rowMode "array": the columns by position (two are called ?column?)
  return { name: `pg_idempotency.shards.${name}`, text, values, rowMode: "array" } as QueryConfig;
}

/**
 * idempotency.key_hash(scope, key): the first 32 bits of SHA-256 over
 * scope, a zero byte and key (their UTF-8), as a signed integer. The
 * partition of a key is keyHash(scope, key) & (partitions - 1).
 */
export function keyHash(scope: string, key: string): number {
  const h = createHash("sha256").update(scope, "utf8").update(Buffer.from([0])).update(key, "utf8").digest();
  return h.readInt32BE(0);
}

/** A number of seconds as an interval parameter: null (the default) for none or 0. */
function intervalParam(s: number | null | undefined): string | null {
  if (s == null || !(s > 0)) return null;
  return `${Math.ceil(s * 1e6)} microseconds`;
}

function sqlState(e: unknown): string {
  const code = (e as { code?: unknown } | null)?.code;
  return typeof code === "string" ? code : "";
}

function answerOf(row: unknown[]): ShardAnswer {
  const [outcome, responseStatus, responseBody, attempt, expiresAt, claim, retryAfter, phase, state, responseHeaders, originTrace] = row;
  return {
    outcome, responseStatus, responseBody, attempt, expiresAt, claim, retryAfter, phase, state, responseHeaders, originTrace,
  } as ShardAnswer;
}

/** libpq's keywords that map one to one onto a pg client's config. */
const KEYWORDS: Record<string, string> = {
  host: "host", dbname: "database", user: "user", password: "password",
  application_name: "application_name", options: "options", client_encoding: "client_encoding",
};

/** The others understood (see poolConfigOf). */
const OTHER_KEYWORDS = ["hostaddr", "port", "connect_timeout", "keepalives", "sslmode", "sslrootcert", "sslcert", "sslkey"];

/**
 * A pg Pool config from a libpq connection string: a URI
 * (postgresql://...) as pg reads it, or keyword/value pairs ("host=10.0.0.5
 * port=5432 dbname=idem password='a b'"), values quoted or not, as libpq
 * reads them. What a pair leaves out comes from pg's defaults: the PG*
 * environment variables. Understood: host (one; a socket directory too),
 * hostaddr, port, dbname, user, password, application_name, options,
 * client_encoding, connect_timeout, keepalives, sslmode (disable, allow and
 * prefer: no TLS; require: TLS, the certificate not checked; verify-ca,
 * verify-full: checked), sslrootcert, sslcert, sslkey. Another keyword is
 * an error: make the pool yourself (ShardsOptions.pool).
 */
export function poolConfigOf(connstr: string): PoolConfig {
  if (/^postgres(ql)?:\/\//.test(connstr)) return { connectionString: connstr };
  const pairs = new Map<string, string>();
  let i = 0;
  const n = connstr.length;
  const space = (c: string) => c === " " || c === "\t" || c === "\n" || c === "\r" || c === "\f" || c === "\v";
  const bad = (why: string) => new Error(`idempotency: the connection string ${JSON.stringify(connstr)}: ${why}`);
  for (;;) {
    while (i < n && space(connstr[i])) i++;
    if (i >= n) break;
    let name = "";
    while (i < n && connstr[i] !== "=" && !space(connstr[i])) name += connstr[i++];
    while (i < n && space(connstr[i])) i++;
    if (connstr[i] !== "=") throw bad(`missing "=" after "${name}"`);
    i++;
    while (i < n && space(connstr[i])) i++;
    let value = "";
    if (connstr[i] === "'") {
      i++;
      for (;;) {
        if (i >= n) throw bad("unterminated quoted string");
        const c = connstr[i++];
        if (c === "'") break;
        if (c === "\\" && i < n) value += connstr[i++];
        else value += c;
      }
    } else {
      while (i < n && !space(connstr[i])) {
        const c = connstr[i++];
        if (c === "\\" && i < n) value += connstr[i++];
        else value += c;
      }
    }
    pairs.set(name, value);
  }
  const config: Record<string, unknown> = {};
  let sslmode = "";
  const files: Record<string, string> = {};
  for (const [name, value] of pairs) {
    const mapped = Object.prototype.hasOwnProperty.call(KEYWORDS, name);
    if (!mapped && !OTHER_KEYWORDS.includes(name)) {
      throw bad(`the keyword "${name}" is not understood here; make the pool with ShardsOptions.pool`);
    }
    // an empty value is as if left out (libpq)
    if (value === "") continue;
    if (mapped) {
      if (name === "host" && value.includes(",")) throw bad("pg connects to one host; make the pool with ShardsOptions.pool");
      config[KEYWORDS[name]] = value;
    } else if (name === "hostaddr") {
      config.host = value;
    } else if (name === "port") {
      if (!/^[0-9]+$/.test(value)) throw bad(`port ${JSON.stringify(value)}`);
      config.port = Number(value);
    } else if (name === "connect_timeout") {
      if (!/^[0-9]+$/.test(value)) throw bad(`connect_timeout ${JSON.stringify(value)}`);
      if (Number(value) > 0) config.connectionTimeoutMillis = Number(value) * 1000;
    } else if (name === "keepalives") {
      config.keepAlive = value !== "0";
    } else if (name === "sslmode") {
      sslmode = value;
    } else {
      files[name] = value; // sslrootcert, sslcert, sslkey
    }
  }
  if (pairs.get("hostaddr")) config.host = pairs.get("hostaddr");
  const tls: Record<string, unknown> = {};
  if (files.sslrootcert) tls.ca = readFileSync(files.sslrootcert, "utf8");
  if (files.sslcert) tls.cert = readFileSync(files.sslcert, "utf8");
  if (files.sslkey) tls.key = readFileSync(files.sslkey, "utf8");
  switch (sslmode) {
    case "":
      if (Object.keys(tls).length) config.ssl = tls;
      break;
    case "disable":
    case "allow":
    case "prefer":
      config.ssl = false;
      break;
    case "require":
      config.ssl = { ...tls, rejectUnauthorized: false };
      break;
    case "verify-ca":
    case "verify-full":
      config.ssl = tls;
      break;
    default:
      throw bad(`sslmode ${JSON.stringify(sslmode)}`);
  }
  return config as PoolConfig;
}

/**
 * Sends idem_acquire, idem_complete and idem_release to the shard that
 * owns the key under the cluster's layout, as the router's
 * idempotency.idem_acquire would, without the router: it hashes (scope,
 * key) as idempotency.key_hash() does, and calls the owning shard's
 * idempotency.shard_acquire with the layout version. A shard checks both
 * (it refuses, with a row or with SQLSTATE 55R01, a key it does not own or
 * a claim from a layout it has left behind), so a Shards, however stale its
 * layout, never makes a key run on two shards: on a refusal it reads the
 * layout again and sends the call through the router. While a growth's
 * window is open (the layout has a previous placement), or while the
 * shards do not all agree on one layout in force, every call goes through
 * the router, which looks at a moved key's previous shard first.
 *
 * Claims are lease claims, committed at once (across transactions, as
 * through the router): acquire, do the work, then complete() with the
 * claim, or release() it.
 *
 * The role it connects as needs on each shard what the router's role has
 * (proxy/README.md, its grants on the shards), and on the router SELECT on
 * idempotency.cluster_state and what the router's README grants.
 */
export class Shards {
  /** The layout as last read (null: none yet). */
  private current_: ShardLayout | null = null;
  /** The reading of the layout in progress: one at a time, shared by the callers. */
  private reading: Promise<{ layout: ShardLayout; error: unknown }> | null = null;
  private readonly pools = new Map<string, Pool>();
  private closed = false;
  private readonly makePool: (connstr: string) => Pool | PoolConfig;
  readonly maxAgeMs: number;

  private constructor(readonly router: Pool, opts: ShardsOptions) {
    this.makePool = opts.pool ?? poolConfigOf;
    this.maxAgeMs = opts.maxAgeMs != null && opts.maxAgeMs > 0 ? opts.maxAgeMs : 30_000;
  }

  /**
   * Reads the cluster's layout from the router (its pool, which Shards uses
   * but does not end) and from every shard, and answers a Shards that
   * routes by it.
   */
  static async connect(router: Pool, opts: ShardsOptions = {}): Promise<Shards> {
    if (!router) throw new Error("idempotency: Shards.connect needs the router's pool");
    const s = new Shards(router, opts);
    try {
      await s.readLayout(null);
    } catch (e) {
      await s.close();
      throw e;
    }
    return s;
  }

  /** Ends the shards' pools (not the router's). */
  async close(): Promise<void> {
    this.closed = true;
    const pools = [...this.pools.values()];
    this.pools.clear();
    await Promise.all(pools.map((p) => p.end().catch(() => undefined)));
  }

  /** How Shards routes now (without reading the layout again). */
  layout(): ShardsLayout {
    const l = this.current_;
    if (!l) return { version: 0, partitions: 0, direct: false, why: "no layout read" };
    return { version: l.version, partitions: l.servers.length, direct: l.direct, why: l.why };
  }

  /** Reads the layout again now. */
  async reload(): Promise<void> {
    await this.readLayout(null);
  }

  /** keyHash(scope, key): idempotency.key_hash(). */
  keyHash(scope: string, key: string): number {
    return keyHash(scope, key);
  }

  /**
   * idempotency.idem_acquire(key, request, scope, ttl, lease, trace) of
   * the cluster. On the owning shard when the layout allows, else through
   * the router; a shard's refusal (it does not own the key under its newer
   * layout) reads the layout again and sends the call through the router.
   */
  async acquire(a: ShardAcquireArgs): Promise<ShardAnswer> {
    const l = await this.current();
    if (l.direct) {
      const pool = this.owner(l, a.scope, a.key);
      let row: unknown[] | undefined;
      try {
        const r = await pool.query(stmt("shard_acquire", shardAcquireSQL, [
          l.version, a.key, a.request ?? null, a.scope, intervalParam(a.ttl), intervalParam(a.lease), a.trace ?? null]));
        row = r.rows[0];
      } catch (e) {
        if (sqlState(e) !== "55R01") throw e;
      }
      if (row && row[0] !== "refused") return answerOf(row);
      // refused: nothing of the call is left on the shard
      await this.readLayout(l);
    }
    const r = await this.router.query(stmt("router_acquire", routerAcquireSQL, [
      a.key, a.request ?? null, a.scope, intervalParam(a.ttl), intervalParam(a.lease), a.trace ?? null]));
    return answerOf(r.rows[0]);
  }

  /**
   * idempotency.idem_complete(key, status, body, scope, claim => claim,
   * response_headers => headers) of the cluster: its boolean.
   */
  async complete(a: ShardCompleteArgs): Promise<boolean> {
    return this.onOwner(a.scope, a.key, async (q) => {
      const r = await q.query(stmt("complete", completeSQL, [
        a.key, Math.trunc(a.status), a.body ?? null, a.scope, a.claim, a.headers ?? null]));
      return r.rows[0][0] === true;
    });
  }

  /** idempotency.idem_release(key, scope, claim => claim) of the cluster: its boolean. */
  async release(a: ShardReleaseArgs): Promise<boolean> {
    return this.onOwner(a.scope, a.key, async (q) => {
      const r = await q.query(stmt("release", releaseSQL, [a.key, a.scope, a.claim]));
      return r.rows[0][0] === true;
    });
  }

  /** The layout to route by, read again when older than maxAgeMs. */
  private async current(): Promise<ShardLayout> {
    if (this.closed) throw new Error("idempotency: Shards is closed");
    const l = this.current_;
    if (l && Date.now() - l.read < this.maxAgeMs) return l;
    return this.readLayout(l);
  }

  /**
   * Reads the layout from the router and the shards, one reading at a
   * time: a caller that found seen stale (or refused) takes the reading in
   * progress, or one made since seen; connect() and reload() (seen null)
   * wait for one that starts after their call, and hear its error. Where
   * the layout cannot be read, the calls go through the router until it
   * can.
   */
  private async readLayout(seen: ShardLayout | null): Promise<ShardLayout> {
    if (seen) {
      const l = this.current_;
      if (l && l !== seen && Date.now() - l.read < this.maxAgeMs) return l;
      return (await (this.reading ?? this.startReading())).layout;
    }
    const before = this.reading;
    if (before) await before;
    // one started since this call, by another caller, will do
    const r = await (this.reading ?? this.startReading());
    if (r.error) throw r.error;
    return r.layout;
  }

  private startReading(): Promise<{ layout: ShardLayout; error: unknown }> {
    const p: Promise<{ layout: ShardLayout; error: unknown }> = this.load().then(
      (layout) => ({ layout, error: null }),
      (error: unknown) => ({
        layout: { version: 0, servers: [], direct: false, why: error instanceof Error ? error.message : String(error), read: Date.now() },
        error,
      }),
    ).then((r) => {
      this.current_ = r.layout;
      if (this.reading === p) this.reading = null;
      return r;
    });
    this.reading = p;
    return p;
  }

  /**
   * The placement from the router, then each shard's layout: direct when
   * every shard has one layout, in force, with no growth window open, over
   * the router's placement.
   */
  private async load(): Promise<ShardLayout> {
    const l: ShardLayout = { version: 0, servers: [], direct: false, why: "", read: Date.now() };
    let servers: unknown;
    try {
      servers = (await this.router.query(stmt("cluster", clusterSQL, []))).rows[0]?.[0];
    } catch (e) {
      throw wrap("the router's placement", e);
    }
    if (servers != null && !Array.isArray(servers)) throw new Error("idempotency: the router's placement is not an array");
    l.servers = (servers ?? []) as string[];
    const n = l.servers.length;
    if (n === 0 || (n & (n - 1)) !== 0) {
      throw new Error(`idempotency: the router has ${n} partitions; idempotency.cluster_create() declares them`);
    }
    let first = true;
    const read = new Set<string>();
    for (const c of l.servers) {
      if (read.has(c)) continue;
      read.add(c);
      const pool = this.pool(c);
      let row: unknown[] | undefined;
      try {
        row = (await pool.query(stmt("layout", layoutSQL, []))).rows[0];
      } catch (e) {
        throw wrap(`the layout of the shard ${JSON.stringify(c)}`, e);
      }
      if (!row) {
        l.why = `the shard ${JSON.stringify(c)} has no layout`;
        return l;
      }
      const version = Number(row[0]);
      const active = row[1] === true;
      const map = (row[2] ?? []) as string[];
      const window = row[3] === true;
      if (first) {
        l.version = version;
        first = false;
      }
      if (version !== l.version) l.why = `the shards have layouts ${l.version} and ${version}`;
      else if (!active) l.why = `layout ${version} is not in force on the shard ${JSON.stringify(c)}`;
      else if (window) l.why = `the window of the growth to layout ${version} is open`;
      else if (!sameServers(map, l.servers)) l.why = `the shard ${JSON.stringify(c)} has another placement than the router`;
      if (l.why) return l;
    }
    l.direct = true;
    return l;
  }

  /** The pool of the shard connstr, made on first use. */
  private pool(connstr: string): Pool {
    if (this.closed) throw new Error("idempotency: Shards is closed");
    let p = this.pools.get(connstr);
    if (p) return p;
    let made: Pool | PoolConfig;
    try {
      made = this.makePool(connstr);
    } catch (e) {
      throw wrap(`the shard ${JSON.stringify(connstr)}`, e);
    }
    p = isPool(made) ? made : new Pool(made);
    // an idle connection's error (the shard restarted) is the next query's
    // to see, not the process's to die of
    p.on("error", () => undefined);
    this.pools.set(connstr, p);
    return p;
  }

  /** The pool of the shard that owns (scope, key) under l. */
  private owner(l: ShardLayout, scope: string, key: string): Pool {
    return this.pool(l.servers[keyHash(scope, key) & (l.servers.length - 1)]);
  }

  /**
   * Runs f on the key's shard when the layout is direct, else on the
   * router. A claim made under a direct layout is on its owner under that
   * layout: a growth that moves the key keeps its window open while the
   * claim is live (cluster_growth_pending counts it), so the layout that
   * Shards reads meanwhile sends f through the router, which finds it.
   */
  private async onOwner<T>(scope: string, key: string, f: (q: Pool) => Promise<T>): Promise<T> {
    const l = await this.current();
    if (!l.direct) return f(this.router);
    try {
      return await f(this.owner(l, scope, key));
    } catch (e) {
      if (sqlState(e) !== "P0002") throw e;
      // No live record there: the claim may have been made through the
      // router on the key's new shard, during a growth that this layout
      // has not heard of. Read the layout again; where it has changed, ask
      // there.
      const m = await this.readLayout(l);
      if (m.direct && m.version === l.version) throw e;
      if (!m.direct) return f(this.router);
      return f(this.owner(m, scope, key));
    }
  }
}

function isPool(p: Pool | PoolConfig): p is Pool {
  return typeof (p as Pool).query === "function" && typeof (p as Pool).connect === "function";
}

function sameServers(a: string[], b: string[]): boolean {
  return a.length === b.length && a.every((x, i) => x === b[i]);
}

/** e with what was being done in front of its message; its SQLSTATE (code) kept. */
function wrap(what: string, e: unknown): Error {
  const err = new Error(`idempotency: ${what}: ${e instanceof Error ? e.message : String(e)}`);
  (err as Error & { code?: unknown; cause?: unknown }).code = (e as { code?: unknown } | null)?.code;
  (err as Error & { cause?: unknown }).cause = e;
  return err;
}
