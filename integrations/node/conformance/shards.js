// Shards against a real idempotency_proxy cluster (the port of the Go
// package's TestShards, integrations/go/shards_db_test.go): on the server
// that PGHOST, PGPORT and PGUSER name, test.sh makes (make_shard_dbs) the
// router database PREFIX_router (idempotency_proxy) and the shard
// databases PREFIX_shard0, 1 and 2 (idempotency), all empty; PREFIX is
// $IDEM_NODE_SHARDS (default idem_node). The steps in order: the cluster
// grows half way through. Prints TAP-style lines and "shards: N of M tests
// passed."; exits 1 if any failed.
//
//   IDEM_NODE_SHARDS=idem_node node shards.js
"use strict";
const crypto = require("crypto");
const { Pool } = require("pg");
const { Shards, keyHash, poolConfigOf } = require("pg-idempotency");

const prefix = process.env.IDEM_NODE_SHARDS || "idem_node";
let n = 0;
let failed = 0;
function ok(cond, what, detail) {
  n++;
  if (cond) console.log(`ok ${n} - ${what}`);
  else {
    failed++;
    console.log(`not ok ${n} - ${what}`);
    if (detail !== undefined) console.log("#   " + String(typeof detail === "string" ? detail : JSON.stringify(detail)).replace(/\n/g, "\n#   "));
  }
}
const settle = (p) => p.then((v) => ({ v }), (e) => ({ e }));

// The shards' connection strings, as the router's layout holds them and
// PL/Proxy's libpq reads them: keyword/value, one value quoted with an
// escaped quote and a space, so that Shards' own reading of them
// (poolConfigOf) is tried on the real thing.
const base = `host=${process.env.PGHOST || "127.0.0.1"} port=${process.env.PGPORT || 5432} user=${process.env.PGUSER || "postgres"}`;
const conn = [0, 1, 2].map((i) => `${base} dbname=${prefix}_shard${i} application_name='idem node\\'s shard ${i}'`);

const pools = [];
const pool = (config) => {
  const p = new Pool(config);
  pools.push(p);
  return p;
};
const router = pool({ ...poolConfigOf(base), database: `${prefix}_router` });
const shards = [0, 1, 2].map((i) => pool({ ...poolConfigOf(base), database: `${prefix}_shard${i}` }));

// which of the shards hold a record of (scope, key): their indexes, comma-separated
async function on(scope, key) {
  const at = [];
  for (const [i, p] of shards.entries()) {
    const r = await p.query("SELECT count(*)::int AS n FROM idempotency.records WHERE scope = $1 AND key = $2", [scope, key]);
    if (r.rows[0].n > 0) at.push(String(i));
  }
  return at.join(",");
}

// the first key prefix-0, prefix-1, ... of scope "node" in partition p of parts
function keyIn(p, parts, pfx) {
  for (let i = 0; ; i++) {
    const k = `${pfx}-${i}`;
    if ((keyHash("node", k) & (parts - 1)) === p) return k;
  }
}

const acquire = (s, key, request) => s.acquire({ key, request, scope: "node", ttl: 3600, lease: 60 });

async function main() {
  // ---- poolConfigOf: libpq's keyword/value strings, which pg does not read
  const c = poolConfigOf(String.raw`host = /tmp/sock port=6543  dbname='my db' user=u\ v password='it\'s \\ x' application_name='' connect_timeout=5`);
  ok(c.host === "/tmp/sock" && c.port === 6543 && c.database === "my db" && c.user === "u v" && c.password === "it's \\ x" &&
    !("application_name" in c) && c.connectionTimeoutMillis === 5000,
  "poolConfigOf reads keyword/value pairs: spaces around =, quoted values, backslash escapes, an empty value left out", c);
  const uri = poolConfigOf("postgresql://u@h:5433/db");
  const unknown = (() => { try { return poolConfigOf("host=h target_session_attrs=any"); } catch (e) { return e; } })();
  const unterminated = (() => { try { return poolConfigOf("host='h"); } catch (e) { return e; } })();
  ok(uri.connectionString === "postgresql://u@h:5433/db" && unknown instanceof Error && /target_session_attrs/.test(unknown.message) &&
    unterminated instanceof Error, "poolConfigOf: a URI is pg's connectionString; an unknown keyword and an open quote are errors",
  [uri, String(unknown), String(unterminated)]);

  await router.query("SELECT count(*) FROM idempotency.cluster_create(ARRAY[$1, $2])", [conn[0], conn[1]]);

  // ---- keyHash is key_hash()
  const cases = [["", ""], ["node", "k"], ["user-7:/payments", "ключ-ü-€-😀"], ["a\tb", "x".repeat(300)], ["scope", "it's $$ \\ \"q\""]];
  const wrong = [];
  for (const [scope, key] of cases) {
    const onShard = (await shards[0].query("SELECT idempotency.shard_key_hash($1, $2) AS h", [scope, key])).rows[0].h;
    const onRouter = (await router.query("SELECT idempotency.key_hash($1, $2) AS h", [scope, key])).rows[0].h;
    const got = keyHash(scope, key);
    if (got !== onShard || got !== onRouter) wrong.push({ scope, key, got, onShard, onRouter });
  }
  ok(wrong.length === 0, "keyHash(scope, key) is the shards' shard_key_hash() and the router's key_hash(), UTF-8 and all", wrong);

  // ---- the application's Shards: its router pool counts the queries sent
  // through it, its shards' pools have one connection each (so that the
  // prepared statements are seen where they were prepared)
  let routerCalls = 0;
  const counted = pool({ ...poolConfigOf(base), database: `${prefix}_router` });
  const query = counted.query.bind(counted);
  counted.query = (...args) => {
    routerCalls++;
    return query(...args);
  };
  const made = new Map();
  const s = await Shards.connect(counted, {
    maxAgeMs: 3600_000,
    pool: (connstr) => {
      const p = new Pool({ ...poolConfigOf(connstr), max: 1 });
      made.set(connstr, p);
      return p;
    },
  });
  // two more applications, whose layout the growth below leaves behind
  const stale = await Shards.connect(router, { maxAgeMs: 3600_000 });
  const staleComplete = await Shards.connect(router, { maxAgeMs: 3600_000 });

  let l = s.layout();
  ok(l.direct && l.version === 1 && l.partitions === 2 && l.why === "", "direct over layout 1, 2 partitions", l);
  ok(made.size === 2 && made.has(conn[0]) && made.has(conn[1]), "a pool per shard, made by the pool option from the router's connection strings",
    [...made.keys()]);

  // ---- each key on its owner, replayed and mismatched there
  const callsBefore = routerCalls;
  const problems = { acquired: [], owner: [], complete: [], replay: [], mismatch: [], router: [] };
  for (let i = 0; i < 16; i++) {
    const key = `k${i}`;
    const a = await acquire(s, key, `{"n": ${i}}`);
    if (a.outcome !== "acquired" || typeof a.claim !== "string" || a.attempt !== 1 || !(a.expiresAt instanceof Date)) problems.acquired.push([key, a]);
    const owner = String(keyHash("node", key) & 1);
    const at = await on("node", key);
    if (at !== owner) problems.owner.push([key, at, owner]);
    const done = await settle(s.complete({ key, scope: "node", status: 201, body: `{"id": ${i}}`, claim: a.claim, headers: '{"Location": "/x"}' }));
    if (done.v !== true) problems.complete.push([key, done.v, String(done.e)]);
    const r = await acquire(s, key, `{"n": ${i}}`);
    if (r.outcome !== "replay" || r.responseStatus !== 201 || r.responseBody !== `{"id": ${i}}` || r.responseHeaders !== '{"location": "/x"}') {
      problems.replay.push([key, r]);
    }
    const m = await acquire(s, key, '{"n": -1}');
    if (m.outcome !== "mismatch") problems.mismatch.push([key, m.outcome]);
    // the router finds the same record
    const t = await router.query("SELECT outcome FROM idempotency.idem_acquire($1, $2::jsonb, 'node')", [key, `{"n": ${i}}`]);
    if (t.rows[0].outcome !== "replay") problems.router.push([key, t.rows[0].outcome]);
  }
  ok(problems.acquired.length === 0, "16 new keys: acquired directly, a claim, attempt 1, expires_at a Date", problems.acquired);
  ok(problems.owner.length === 0, "each key's record on exactly its owning shard (keyHash & 1)", problems.owner);
  ok(problems.complete.length === 0, "complete() with the claim, on the owner: true", problems.complete);
  ok(problems.replay.length === 0, "the retry: replay, 201, the stored body and headers", problems.replay);
  ok(problems.mismatch.length === 0, "another request with the key: mismatch", problems.mismatch);
  ok(problems.router.length === 0, "through the router, idem_acquire finds the same records: replay", problems.router);
  const held = [];
  for (const p of shards.slice(0, 2)) {
    held.push((await p.query("SELECT count(*)::int AS n FROM idempotency.records WHERE scope = 'node'")).rows[0].n);
  }
  ok(held.every((h) => h > 0 && h < 16) && held[0] + held[1] === 16, "the 16 records are spread over both shards", held);
  ok(routerCalls === callsBefore, "none of these calls (acquire, complete, replay, mismatch) went through the router's pool",
    `${routerCalls - callsBefore} router queries`);
  const prepared = [];
  for (const c of [conn[0], conn[1]]) {
    const r = await made.get(c).query("SELECT name FROM pg_prepared_statements ORDER BY name");
    prepared.push(r.rows.map((x) => x.name).join(" "));
  }
  ok(prepared.every((p) => /pg_idempotency\.shards\.shard_acquire/.test(p) && /pg_idempotency\.shards\.complete/.test(p) &&
    /pg_idempotency\.shards\.layout/.test(p)), "on each shard's connection, the calls are named prepared statements", prepared);

  // ---- in progress, released, acquired again
  {
    const a = await acquire(s, "held", "{}");
    const b = await acquire(s, "held", "{}");
    const rel = await s.release({ key: "held", scope: "node", claim: a.claim });
    const c2 = await acquire(s, "held", "{}");
    const done = await s.complete({ key: "held", scope: "node", status: 200, body: null, claim: c2.claim });
    const r = await acquire(s, "held", "{}");
    ok(a.outcome === "acquired" && b.outcome === "in_progress" && b.retryAfter > 0 && rel === true && c2.outcome === "acquired" &&
      c2.claim !== a.claim && done === true && r.outcome === "replay" && r.responseStatus === 200 && r.responseBody === null,
    "a held key: in_progress, release() true, acquired again, completed without a body, replayed",
    [a.outcome, b.outcome, b.retryAfter, rel, c2.outcome, done, r.outcome, r.responseStatus, r.responseBody]);
  }
  {
    const gone = await settle(s.complete({ key: "never-claimed", scope: "node", status: 200, claim: crypto.randomUUID() }));
    ok(gone.e && gone.e.code === "P0002" && s.layout().direct && s.layout().version === 1,
      "complete() of a key without a record: its owner's P0002, after reading the layout again (unchanged: still direct)",
      [String(gone.e), gone.e && gone.e.code, s.layout()]);
  }

  // ---- growth. Keys of partitions 2 and 3 of 4 move: 2 from shard 0 to
  // 2, 3 from shard 1 to 0.
  let moved = -1; // one of k0..k15, completed before the growth, that moves
  for (let i = 0; i < 16 && moved < 0; i++) if ((keyHash("node", `k${i}`) & 3) === 2) moved = i;
  ok(moved >= 0, "one of k0..k15 is in partition 2 of 4 (moves from shard 0 to 2)", moved);
  const doneMoved = `k${moved}`;
  const before = await on("node", doneMoved);
  ok(before === "0", `${doneMoved}: on shard 0 before the growth`, before);
  await router.query("SELECT count(*) FROM idempotency.cluster_grow(ARRAY[$1, $2, $3], 4)", [conn[0], conn[1], conn[2]]);

  // a moved key's record, from layout 1: its previous shard refuses a
  // layout it has left behind; the router answers, from there
  {
    const r = await acquire(stale, doneMoved, `{"n": ${moved}}`);
    ok(r.outcome === "replay" && r.responseBody === `{"id": ${moved}}`, `stale layout: ${doneMoved}, refused by shard 0, replayed through the router`, r);
    l = stale.layout();
    ok(!l.direct && l.version === 2 && l.partitions === 4, "after the refusal, the stale Shards read the layout again: version 2, through the router", l);
    const at = await on("node", doneMoved);
    ok(at === "0", `${doneMoved}: on shard 0 only after its replay (the refusal left nothing)`, at);
  }
  // a key that stays: answered at layout 1, no refusal
  {
    const stays = keyIn(0, 4, "stays");
    const a = await acquire(staleComplete, stays, "{}");
    l = staleComplete.layout();
    ok(a.outcome === "acquired" && l.direct && l.version === 1, `a key that does not move (${stays}): acquired at layout 1, not refused`, [a.outcome, l]);
  }
  // a new key that moves: refused by its old owner, then claimed through
  // the router on its new one
  const fresh = keyIn(2, 4, "fresh");
  const beforeRefusal = routerCalls;
  const a = await acquire(s, fresh, "{}");
  l = s.layout();
  ok(a.outcome === "acquired" && !l.direct && l.version === 2 && /window/.test(l.why),
    `a new key that moves (${fresh}): refused, then acquired through the router; the layout read again (version 2, the window open)`, [a.outcome, l]);
  ok(routerCalls > beforeRefusal, "that call went through the router's pool", `${routerCalls - beforeRefusal} router queries`);
  {
    const at = await on("node", fresh);
    ok(at === "2", `${fresh}: on shard 2 (its new owner) only`, at);
  }
  // the stale application completes it: its layout's owner has no record
  // (P0002), so it reads the layout again and asks the router
  {
    const done = await settle(staleComplete.complete({ key: fresh, scope: "node", status: 201, body: '{"ok": true}', claim: a.claim }));
    l = staleComplete.layout();
    ok(done.v === true && !l.direct && l.version === 2, "a claim made through the router, completed by a stale Shards: P0002 on its old owner, then the router",
      [done.v, String(done.e), l]);
    const r1 = await acquire(s, fresh, "{}");
    const r2 = await acquire(stale, fresh, "{}");
    ok(r1.outcome === "replay" && r2.outcome === "replay" && r1.responseBody === '{"ok": true}', `${fresh}: replayed to both applications`, [r1, r2]);
  }

  // ---- window closed: direct over layout 2
  await router.query("SELECT idempotency.cluster_growth_finish(force => true)");
  ok(s.layout().direct === false, "before reload(), Shards still routes through the router (its layout is an hour fresh)", s.layout());
  await s.reload();
  l = s.layout();
  ok(l.direct && l.version === 2 && l.partitions === 4 && l.why === "", "after the window closed and reload(): direct, version 2, 4 partitions", l);
  const placed = [];
  const callsAfter = routerCalls;
  for (const [p, shard] of ["0", "1", "2", "0"].entries()) {
    const key = keyIn(p, 4, "after");
    const r = await acquire(s, key, "{}");
    const at = await on("node", key);
    if (r.outcome !== "acquired" || at !== shard) placed.push({ key, partition: p, outcome: r.outcome, at, want: shard });
  }
  ok(placed.length === 0, "a new key of each of the 4 partitions: acquired on its shard under layout 2 (0, 1, 2, 0)", placed);
  ok(routerCalls === callsAfter, "and none through the router's pool", `${routerCalls - callsAfter} router queries`);

  // ---- one reading of the layout at a time, shared by the calls that
  // find it stale
  {
    const quick = await Shards.connect(counted, { maxAgeMs: 1 });
    await new Promise((resolve) => setTimeout(resolve, 20));
    const calls0 = routerCalls;
    const all = await Promise.all(Array.from({ length: 10 }, (_, i) => acquire(quick, `concurrent-${i}`, "{}")));
    const reads = routerCalls - calls0;
    ok(reads === 1 && all.every((r) => r.outcome === "acquired") && quick.layout().direct,
      "10 concurrent calls on a stale layout (maxAgeMs 1): one reading of it (one query to the router), all direct",
      [reads, all.map((r) => r.outcome)]);
    await quick.close();
  }

  // ---- close
  await Promise.all([s.close(), stale.close(), staleComplete.close()]);
  const closed = await settle(acquire(s, "after-close", "{}"));
  ok(closed.e instanceof Error && /closed/.test(closed.e.message) && made.get(conn[0]).ended === true,
    "close() ends the shards' pools; a call after it is an error", [String(closed.e), made.get(conn[0]).ended]);
}

main()
  .catch((e) => {
    ok(false, "shards.js ran to the end", (e && e.stack) || e);
  })
  .finally(async () => {
    await Promise.all(pools.map((p) => p.end().catch(() => undefined)));
    console.log(`1..${n}`);
    console.log(`shards: ${n - failed} of ${n} tests passed.`);
    process.exit(failed ? 1 : 0);
  });
