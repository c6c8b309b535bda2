// The replay cache (replayCache) and the duplicate lines (logDuplicates),
// driven over HTTP through the Express middleware, and the cache of
// idempotent(). Against the database that the PG* variables name (the
// extension created there, the library preloaded for idempotency.stats);
// makes a table of its own. Prints TAP-style lines and "cache: N of M tests
// passed."; exits 1 if any failed.
//
//   node cache.js
"use strict";
const crypto = require("crypto");
const http = require("http");
const { performance } = require("perf_hooks");
const express = require("express");
const { Pool } = require("pg");
const { idempotency, idempotent, httpScope, forget, ReplayCache } = require("pg-idempotency");

let n = 0;
let failed = 0;
function ok(cond, what, detail) {
  n++;
  if (cond) console.log(`ok ${n} - ${what}`);
  else {
    failed++;
    console.log(`not ok ${n} - ${what}`);
    if (detail !== undefined) console.log("#   " + (typeof detail === "string" ? detail : JSON.stringify(detail)).replace(/\n/g, "\n#   "));
  }
}

// The pool the layer uses, counting what it asks of the database: a cached
// replay asks nothing. (pool.query goes through pool.connect.)
const pool = new Pool({ max: 10 });
let calls = 0;
const connect = pool.connect.bind(pool);
pool.connect = (...a) => {
  calls++;
  return connect(...a);
};
// the test's own questions, not counted
const admin = new Pool({ max: 2 });
const q = async (sql, params) => (await admin.query(sql, params)).rows;
const runs = async (k) => Number((await q("SELECT count(*) FROM cache_runs WHERE k = $1", [k]))[0].count);
const replayed = async () => Number((await q("SELECT replayed FROM idempotency.stats WHERE datname = current_database()"))[0]?.replayed ?? 0);
const newKey = () => crypto.randomUUID();
const SCOPE = (path) => httpScope(undefined, "POST", path);

// An Express app with one middleware instance of opts: POST /orders writes a
// row in the claim's transaction and answers 201 with Location; /big answers
// a body of ~2 kB; /release gives the key up and answers 503.
async function serve(opts) {
  const app = express();
  app.set("etag", false);
  const idem = idempotency(pool, opts);
  app.use(idem);
  app.post("/orders", async (req, res, next) => {
    try {
      const db = await req.idempotency.tx();
      const { rows } = await db.query("INSERT INTO cache_runs (k) VALUES ($1) RETURNING id", [req.get("Idempotency-Key")]);
      res.status(201).set("Location", `/orders/${rows[0].id}`).json({ id: Number(rows[0].id), item: req.body.item });
    } catch (e) {
      next(e);
    }
  });
  app.post("/big", (req, res) => res.status(201).json({ pad: "x".repeat(2000) }));
  app.post("/release", async (req, res) => {
    const db = await req.idempotency.tx();
    await db.query("INSERT INTO cache_runs (k) VALUES ($1)", [req.get("Idempotency-Key")]);
    await req.idempotency.release();
    res.status(503).json({ retry: true });
  });
  const server = await new Promise((resolve) => {
    const s = app.listen(0, "127.0.0.1", () => resolve(s));
  });
  const agent = new http.Agent({ keepAlive: true });
  return {
    idem,
    close: () => new Promise((resolve) => { agent.destroy(); server.close(resolve); }),
    // POST path with key and body (a string, sent as is); answer and how many pool calls it took
    post: (path, key, body) => new Promise((resolve, reject) => {
      const before = calls;
      const req = http.request({
        agent, host: "127.0.0.1", port: server.address().port, path, method: "POST",
        headers: { "Content-Type": "application/json", "Content-Length": Buffer.byteLength(body), "Idempotency-Key": key },
      }, (res) => {
        const chunks = [];
        res.on("data", (c) => chunks.push(c));
        res.on("end", () => resolve({
          status: res.statusCode, body: Buffer.concat(chunks), headers: res.headers, calls: calls - before,
          replayed: res.headers["idempotent-replayed"] === "true",
        }));
      });
      req.on("error", reject);
      req.end(body);
    }),
  };
}

const same = (a, b) => a.status === b.status && a.body.equals(b.body) && a.headers["content-type"] === b.headers["content-type"] &&
  a.headers.location === b.headers.location && a.headers["idempotent-replayed"] === b.headers["idempotent-replayed"];
const show = (...rs) => rs.map((r) => ({ status: r.status, calls: r.calls, replayed: r.replayed, body: r.body.toString().slice(0, 80),
  location: r.headers.location, ct: r.headers["content-type"] }));

async function main() {
  await q("DROP TABLE IF EXISTS cache_runs; CREATE TABLE cache_runs (id bigserial PRIMARY KEY, k text NOT NULL)");
  const quiet = { logDuplicates: "off" };

  // ---- served from the cache: no database call, the same bytes as the database's replay
  const a = await serve({ ...quiet, replayCache: true });
  const plain = await serve(quiet); // no cache: every replay from the database
  const k1 = newKey();
  const body1 = '{"item": "book"}';
  const first = await a.post("/orders", k1, body1);
  const st0 = await replayed();
  const hit = await a.post("/orders", k1, body1);
  const st1 = await replayed();
  ok(first.status === 201 && !first.replayed && hit.calls === 0 && hit.replayed && st1 === st0 && (await runs(k1)) === 1,
    "cache on: the retry after this process's own completion is answered without a database call (idempotency.stats unchanged)",
    { answers: show(first, hit), stats: [st0, st1] });
  const fromDb = await plain.post("/orders", k1, body1);
  ok(fromDb.calls > 0 && fromDb.replayed && same(hit, fromDb) && hit.body.equals(first.body),
    "the cached replay is the database's replay: status, body bytes, Location, Content-Type, Idempotent-Replayed", show(first, hit, fromDb));

  // a replay that idem_acquire returned goes in too (another process: a fresh cache)
  const b = await serve({ ...quiet, replayCache: { maxEntries: 100 } });
  const r1 = await b.post("/orders", k1, body1);
  const r2 = await b.post("/orders", k1, body1);
  ok(r1.calls > 0 && r1.replayed && r2.calls === 0 && same(r1, r2) && same(r2, fromDb),
    "a replay from the database is cached: the next one makes no database call", show(r1, r2));

  // ---- other request bytes: to the database, which answers mismatch (422) or replay
  const mm = await a.post("/orders", k1, '{"item": "pen"}');
  ok(mm.calls > 0 && mm.status === 422 && !mm.replayed && (await runs(k1)) === 1,
    "another request with a cached key goes to the database and gets 422 (the cache never answers it)", show(mm));
  const again = await a.post("/orders", k1, body1);
  ok(again.calls === 0 && same(again, hit), "after the 422 the identical request is still served from the cache", show(again));
  const spaced = await a.post("/orders", k1, '{"item":"book"}');
  ok(spaced.calls > 0 && spaced.replayed && spaced.body.equals(first.body),
    "the same JSON in other bytes is not served from the cache: the database answers the replay", show(spaced));

  // ---- values as the database gets them (one simple query, literals): a key
  // with quotes and backslashes (a header is ASCII), a body with them and unicode
  const odd = `it's a "key" \\ \\' ${newKey()}`;
  const oddBody = '{"item": "it\'s \\"quoted\\" \\\\ ü 🔑"}';
  const o1 = await a.post("/orders", odd, oddBody);
  const o2 = await a.post("/orders", odd, oddBody);
  const o3 = await plain.post("/orders", odd, oddBody);
  const okey = await q("SELECT count(*)::int AS n FROM idempotency.idem_lookup($1, $2)", [odd, SCOPE("/orders")]);
  ok(o1.status === 201 && JSON.parse(o1.body).item === JSON.parse(oddBody).item && o2.calls === 0 && o3.calls > 0 && same(o2, o3) && (await runs(odd)) === 1 && okey[0].n === 1,
    "a key with quotes and backslashes, a body with unicode: stored as sent, replayed from the cache and the database alike", show(o1, o2, o3));

  // ---- never past expires_at by the database's clock
  const t = await serve({ ...quiet, replayCache: true, ttl: 2 });
  const k2 = newKey();
  const e1 = await t.post("/orders", k2, body1);
  const e2 = await t.post("/orders", k2, body1);
  const [{ expires_at: exp }] = await q("SELECT expires_at FROM idempotency.idem_lookup($1, $2)", [k2, SCOPE("/orders")]);
  ok(e1.status === 201 && e2.calls === 0 && e2.replayed, "ttl 2 s: the retry is served from the cache while the key lives", show(e1, e2));
  // wait for the state: the database's clock past the record's expires_at
  let passed = false;
  for (let i = 0; i < 200 && !passed; i++) {
    passed = (await q("SELECT pg_catalog.clock_timestamp() > $1::timestamptz AS p", [exp]))[0].p;
    if (!passed) await new Promise((r) => setTimeout(r, 50));
  }
  const e3 = await t.post("/orders", k2, body1);
  ok(passed && e3.calls > 0 && e3.status === 201 && !e3.replayed && (await runs(k2)) === 2,
    "once the database's clock is past expires_at the cache does not serve it: the handler runs again", show(e3));

  // ---- bounded: least recently used out first
  const lru = await serve({ ...quiet, replayCache: { maxEntries: 2 } });
  const [ka, kb, kc] = [newKey(), newKey(), newKey()];
  await lru.post("/orders", ka, body1);
  await lru.post("/orders", kb, body1);
  const touch = await lru.post("/orders", ka, body1); // a used again: b is now the least recent
  await lru.post("/orders", kc, body1);
  const la = await lru.post("/orders", ka, body1);
  const lc = await lru.post("/orders", kc, body1);
  const lb = await lru.post("/orders", kb, body1);
  ok(touch.calls === 0 && la.calls === 0 && lc.calls === 0 && lb.calls > 0 && lb.replayed && lru.idem.replayCache.size === 2,
    "maxEntries 2, three keys: the least recently used is gone (a database replay), the other two served", show(touch, la, lc, lb));

  // ---- maxEntryBytes: a larger answer is not cached
  const small = await serve({ ...quiet, replayCache: { maxEntryBytes: 512 } });
  const kbig = newKey(), ksmall = newKey();
  await small.post("/big", kbig, "{}");
  const big2 = await small.post("/big", kbig, "{}");
  await small.post("/orders", ksmall, body1);
  const small2 = await small.post("/orders", ksmall, body1);
  ok(big2.calls > 0 && big2.replayed && big2.body.length > 2000 && small2.calls === 0,
    "maxEntryBytes 512: a 2 kB answer is replayed from the database, a small one from the cache", show(big2, small2));

  // ---- what is not cached: a released claim
  const rk = newKey();
  const rel1 = await a.post("/release", rk, "{}");
  const rel2 = await a.post("/release", rk, "{}");
  ok(rel1.status === 503 && rel2.status === 503 && rel2.calls > 0 && !rel2.replayed && (await runs(rk)) === 2,
    "a released claim is not cached: the retry runs the handler again", show(rel1, rel2));

  // ---- forget evicts
  const kf = newKey();
  await a.post("/orders", kf, body1);
  const f1 = await a.post("/orders", kf, body1);
  const forgotten = await a.idem.forget(SCOPE("/orders"), kf);
  const f2 = await a.post("/orders", kf, body1);
  ok(f1.calls === 0 && forgotten === true && f2.calls > 0 && f2.status === 201 && !f2.replayed && (await runs(kf)) === 2,
    "forget(scope, key): idem_forget and the entry evicted; the next request runs the handler again", show(f1, f2));

  // ---- ten concurrent first requests with the cache on: one run, one answer
  const kd = newKey();
  const dups = await Promise.all(Array.from({ length: 10 }, () => a.post("/orders", kd, body1)));
  ok(dups.every((d) => d.status === 201 && d.body.equals(dups[0].body)) && dups.filter((d) => !d.replayed).length === 1 && (await runs(kd)) === 1,
    "ten concurrent duplicates with the cache on: one run, ten 201 with the same body", show(...dups));

  // ---- duplicate lines: sampled (the default), all, off
  const lines = { sampled: [], all: [], off: [] };
  const logs = {};
  for (const mode of ["sampled", "all", "off"]) {
    const sink = (line) => lines[mode].push({ line, at: performance.now() });
    logs[mode] = await serve({ replayCache: true, ...(mode === "sampled" ? {} : { logDuplicates: mode }), log: sink });
  }
  const kl = newKey();
  for (const mode of ["all", "off"]) {
    await logs[mode].post("/orders", kl, body1);
    for (let i = 0; i < 20; i++) await logs[mode].post("/orders", kl, body1);
  }
  ok(lines.all.length === 20 && lines.all.every((l) => /replay/.test(l.line)) && lines.off.length === 0,
    `logDuplicates "all": 20 lines for 20 replays; "off": none (${lines.all.length}, ${lines.off.length})`);
  const s = logs.sampled;
  await s.post("/orders", kl, body1);
  const t0 = performance.now();
  for (let i = 0; i < 100; i++) await s.post("/orders", kl, body1);
  const took = performance.now() - t0;
  const during = lines.sampled.filter((l) => l.at >= t0).length;
  // the next line once a second has passed since the last one written
  while (performance.now() - lines.sampled[lines.sampled.length - 1].at < 1000) await new Promise((r) => setTimeout(r, 50));
  await s.post("/orders", kl, body1);
  const summary = /\(and (\d+) more duplicate answers not logged since \d\d:\d\d:\d\d\)$/;
  // every duplicate is a line or counted in a later line's summary
  const told = lines.sampled.reduce((sum, l) => sum + 1 + Number((summary.exec(l.line) || [0, 0])[1]), 0);
  ok(during <= 1 + Math.floor(took / 1000) && told === 102 && lines.sampled.some((l) => summary.test(l.line)),
    `sampled (the default): 100 replays in ${Math.round(took)} ms wrote ${during} line(s), at most one a second; a later line says how many were left out (${told} of 102 duplicates told)`,
    lines.sampled.map((l) => l.line));

  // ---- idempotent() with a ReplayCache
  const cache = new ReplayCache({ maxEntries: 10 });
  const kw = newKey();
  const job = async (claim) => {
    const db = await claim.tx();
    const { rows } = await db.query("INSERT INTO cache_runs (k) VALUES ($1) RETURNING id", [kw]);
    return { id: Number(rows[0].id) };
  };
  const w1 = await idempotent(pool, { key: kw, request: { n: 1 }, scope: "q", replayCache: cache }, job);
  const before = calls;
  const w2 = await idempotent(pool, { key: kw, request: { n: 1 }, scope: "q", replayCache: cache }, job);
  const w2calls = calls - before;
  const w3 = await idempotent(pool, { key: kw, request: { n: 2 }, scope: "q", replayCache: cache }, job).then(() => "ran", (e) => e.name);
  const gone = await forget(pool, "q", kw, cache);
  const w4 = await idempotent(pool, { key: kw, request: { n: 1 }, scope: "q", replayCache: cache }, job);
  ok(w2calls === 0 && w1.id === w2.id && w3 === "MismatchError" && gone && w4.id !== w1.id && (await runs(kw)) === 2,
    "idempotent() with a ReplayCache: the redelivery from the cache, another request a MismatchError, forget() evicts",
    { w1, w2, w2calls, w3, gone, w4 });

  // ---- an entry keeps its request's digest, not its text
  const big = new ReplayCache({ maxEntryBytes: 100 });
  const bigRequest = JSON.stringify({ pad: "x".repeat(1_000_000) });
  const put = big.put("s", "k", bigRequest, { status: 200, body: "{}", headers: null, originTrace: null }, 60_000, performance.now(), big.generation);
  const kept = big["slots"].get("s\u0000k");
  ok(put && kept && kept.request.length < 64 && big.get("s", "k", bigRequest) !== undefined && big.get("s", "k", bigRequest + " ") === undefined,
    "a 1 MB request: the entry keeps its digest, not its text, and still tells the same request from another",
    { put, kept: kept && kept.request.length });

  for (const app of [a, plain, b, t, lru, small, ...Object.values(logs)]) await app.close();
}

main()
  .catch((e) => ok(false, "cache.js ran to the end", e && e.stack))
  .finally(async () => {
    await pool.end().catch(() => undefined);
    await admin.end().catch(() => undefined);
    console.log(`1..${n}`);
    console.log(`cache: ${n - failed} of ${n} tests passed.`);
    process.exit(failed ? 1 : 0);
  });
