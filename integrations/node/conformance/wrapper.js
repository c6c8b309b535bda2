// The plain wrapper, idempotent(), driven directly (no HTTP): what a queue
// consumer or a job sees. Against the database that the PG* variables name
// (the extension created there); makes a table of its own. Prints TAP-style
// lines and "wrapper: N of M tests passed."; exits 1 if any failed.
//
//   node wrapper.js
"use strict";
const crypto = require("crypto");
const { Pool } = require("pg");
const { idempotent, InProgressError, MismatchError } = require("pg-idempotency");

const pool = new Pool({ max: 20 });
let n = 0;
let failed = 0;
function ok(cond, what, detail) {
  n++;
  if (cond) console.log(`ok ${n} - ${what}`);
  else {
    failed++;
    console.log(`not ok ${n} - ${what}`);
    if (detail !== undefined) console.log("#   " + String(detail).replace(/\n/g, "\n#   "));
  }
}
const key = () => crypto.randomUUID();
const runs = async (k) => Number((await pool.query("SELECT count(*) FROM wrapper_runs WHERE k = $1", [k])).rows[0].count);
const settle = (p) => p.then((v) => ({ v }), (e) => ({ e }));

// fn: one row per run, in the claim's transaction; returns the run's id
const job = (k, extra = async () => undefined) => async (claim) => {
  const db = await claim.tx();
  const r = await db.query("INSERT INTO wrapper_runs (k) VALUES ($1) RETURNING id", [k]);
  await extra(claim);
  return { run: Number(r.rows[0].id) };
};

async function main() {
  await pool.query("DROP TABLE IF EXISTS wrapper_runs; CREATE TABLE wrapper_runs (id bigserial PRIMARY KEY, k text NOT NULL)");

  // first call and its redelivery
  const k1 = key();
  const a = await idempotent(pool, { key: k1, request: { n: 1 }, scope: "q" }, job(k1));
  const b = await idempotent(pool, { key: k1, request: { n: 1 }, scope: "q" }, job(k1));
  ok(a && b && a.run === b.run && (await runs(k1)) === 1, "a redelivery gets the stored result; fn ran once", JSON.stringify([a, b]));
  const c = await settle(idempotent(pool, { key: k1, request: { n: 2 }, scope: "q" }, job(k1)));
  ok(c.e instanceof MismatchError && (await runs(k1)) === 1, "the same key with another request: MismatchError, fn not run", c.e || c.v);
  const d = await idempotent(pool, { key: k1, request: { n: 2 }, scope: "other" }, job(k1));
  ok(d.run !== a.run && (await runs(k1)) === 2, "another scope is another key", JSON.stringify(d));

  // fn throws: everything rolls back, the next call runs again
  const k2 = key();
  const e = await settle(idempotent(pool, { key: k2 }, job(k2, async () => { throw new Error("boom"); })));
  ok(e.e && e.e.message === "boom" && (await runs(k2)) === 0, "fn throws: the error is passed on, its writes rolled back", e.e);
  const f = await idempotent(pool, { key: k2 }, job(k2));
  ok(f && (await runs(k2)) === 1, "after a throw the next call runs fn again", JSON.stringify(f));

  // release(): the result is returned, not stored
  const k3 = key();
  const g = await idempotent(pool, { key: k3 }, job(k3, (claim) => claim.release()));
  const h = await idempotent(pool, { key: k3 }, job(k3));
  ok(g && h && g.run !== h.run && (await runs(k3)) === 2, "release(): returned but not stored; the next call runs again", JSON.stringify([g, h]));

  // ten concurrent deliveries: one run
  const k4 = key();
  const all = await Promise.all(Array.from({ length: 10 }, () => settle(idempotent(pool, { key: k4, request: { x: 1 } }, job(k4)))));
  const values = all.filter((x) => !x.e).map((x) => x.v.run);
  const errors = all.filter((x) => x.e && !(x.e instanceof InProgressError));
  ok((await runs(k4)) === 1 && values.length >= 1 && new Set(values).size === 1 && errors.length === 0,
    "10 concurrent deliveries: fn ran once, every result the same (or InProgressError)", JSON.stringify(all));

  // lease mode: a checkpoint, then the worker fails; the retry after the
  // lease resumes at the checkpoint
  const k5 = key();
  let calls = 0;
  const charge = async (claim) => {
    let ref;
    if (claim.resumed && claim.resumed.phase === "charged") ref = claim.resumed.state.ref;
    else {
      ref = await claim.keepAlive(async () => {
        calls++;
        return "ch_" + k5.slice(0, 8);
      });
      await claim.checkpoint("charged", { ref });
      if (calls === 1) throw new Error("worker died");
    }
    const db = await claim.tx();
    await db.query("INSERT INTO wrapper_runs (k) VALUES ($1)", [k5]);
    return { ref };
  };
  const i = await settle(idempotent(pool, { key: k5, lease: 1 }, charge));
  const row = (await pool.query("SELECT status, phase, state FROM idempotency.idem_lookup($1, '')", [k5])).rows[0];
  ok(i.e && i.e.message === "worker died" && row && row.status === "processing" && row.phase === "charged",
    "lease mode: a failure past its checkpoint leaves the claim processing at that checkpoint (not released)", JSON.stringify([i, row]));
  for (let t = 0; t < 300; t++) {
    const r = await pool.query("SELECT count(*) FROM idempotency.idem_lookup($1, '') WHERE locked_until <= clock_timestamp()", [k5]);
    if (Number(r.rows[0].count) === 1) break;
    await new Promise((r) => setTimeout(r, 100));
  }
  const l = await settle(idempotent(pool, { key: k5, lease: 1 }, charge));
  ok(l.v && l.v.ref === "ch_" + k5.slice(0, 8) && calls === 1 && (await runs(k5)) === 1,
    "lease mode: the retry after the lease resumes at the checkpoint; the outside call made once", JSON.stringify([l, calls]));
  const m = await idempotent(pool, { key: k5, lease: 1 }, charge);
  ok(m && m.ref === l.v.ref && (await runs(k5)) === 1, "lease mode: then replayed", JSON.stringify(m));

  // abort(): nothing stored, writes rolled back
  const k6 = key();
  const o = await idempotent(pool, { key: k6 }, job(k6, async (claim) => claim.abort()));
  ok(o && (await runs(k6)) === 0, "abort(): the result is returned, the writes rolled back", JSON.stringify(o));

  await pool.query("DROP TABLE wrapper_runs");
  await pool.end();
  console.log(`1..${n}`);
  console.log(`wrapper: ${n - failed} of ${n} tests passed.`);
  process.exit(failed ? 1 : 0);
}

main().catch((e) => {
  console.log(`not ok ${n + 1} - the run did not finish`);
  console.log("#   " + String(e && e.stack).replace(/\n/g, "\n#   "));
  console.log(`wrapper: ${n - failed} of ${n + 1} tests passed.`);
  process.exit(1);
});
