// A TypeScript consumer of pg-idempotency as installed: compiled with
// --noEmit --strict by test.sh, so that the shipped .d.ts files resolve
// (both entry points) and type what the README shows.
import { Pool, PoolClient } from "pg";
import express from "express";
import {
  idempotent, idempotency, idempotencyPlugin, Claim, InProgressError, MismatchError, ClaimLostError, HttpIdempotency,
  ReplayCache, ReplayCacheOptions, LogDuplicates, IdempotencyMiddleware, IdempotencyHandle, httpScope, forget,
  Shards, ShardsOptions, ShardsLayout, ShardAnswer, keyHash, poolConfigOf,
} from "pg-idempotency";
import { IdempotencyInterceptor } from "pg-idempotency/nestjs";

const pool = new Pool();
const app = express();
app.use(idempotency(pool, { leases: { "POST /charges": 30 }, replayOk: true, ttl: 86400 }));
app.post("/orders", async (req, res) => {
  const claim: Claim = (req as unknown as { idempotency: Claim }).idempotency;
  const db: PoolClient = await claim.tx();
  await db.query("SELECT 1");
  res.status(201).json({ ok: true });
});

const cacheOpts: ReplayCacheOptions = { maxEntries: 10000, maxEntryBytes: 65536, maxAgeMs: 60000 };
const logging: LogDuplicates = "sampled";
const cached: IdempotencyMiddleware = idempotency(pool, { replayCache: cacheOpts, logDuplicates: logging });
const shared = new ReplayCache();
app.use(idempotency(pool, { replayCache: true, logDuplicates: "off" }), idempotency(pool, { replayCache: shared }));
async function forgetting(): Promise<boolean> {
  const size: number | undefined = cached.replayCache?.size;
  void size;
  const a: boolean = await cached.forget(httpScope("7", "POST", "/orders"), "k");
  const b: boolean = await forget(pool, "q", "k", shared);
  const r: { id: number } = await idempotent(pool, { key: "k", replayCache: shared }, async () => ({ id: 1 }));
  const h: IdempotencyHandle | null = null;
  void h;
  return a && b && r.id === 1 && (await interceptor.forget("s", "k"));
}

async function job(): Promise<number> {
  try {
    const r: { id: number } = await idempotent(pool, { key: "k", request: { a: 1 }, scope: "q", ttl: 60, lease: 0 }, async (claim) => {
      const db = await claim.tx();
      await claim.checkpoint("step", { n: 1 });
      const v = await claim.keepAlive(async () => 42);
      const phase: string | undefined = claim.resumed?.phase;
      void phase;
      await db.query("SELECT $1::int", [v]);
      return { id: v };
    });
    return r.id;
  } catch (e) {
    if (e instanceof InProgressError) return e.retryAfter;
    if (e instanceof MismatchError || e instanceof ClaimLostError) return -1;
    throw e;
  }
}

async function sharded(): Promise<number> {
  const opts: ShardsOptions = { maxAgeMs: 30_000, pool: (connstr) => new Pool({ ...poolConfigOf(connstr), max: 4 }) };
  const shards: Shards = await Shards.connect(pool, opts);
  const a: ShardAnswer = await shards.acquire({ key: "k", scope: "s", request: null, ttl: 60, lease: 30, trace: null });
  const when: Date | null = a.expiresAt;
  void when;
  const done: boolean = await shards.complete({ key: "k", scope: "s", status: 201, body: "{}", claim: a.claim ?? "", headers: null });
  const released: boolean = await shards.release({ key: "k", scope: "s", claim: a.claim ?? "" });
  await shards.reload();
  const l: ShardsLayout = shards.layout();
  await shards.close();
  return (done && released && l.direct ? l.version : l.partitions) + keyHash("s", "k") + shards.keyHash("s", "k");
}

const interceptor = new IdempotencyInterceptor(pool, { leases: { "POST /charges": 30 } });
const core = new HttpIdempotency(pool, {});
export { job, interceptor, core, idempotencyPlugin, forgetting, sharded };
