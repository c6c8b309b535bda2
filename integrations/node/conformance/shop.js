// The sample apps' shared parts: flags, the seed's business logic over the
// pg client a handler is given (examples/schema.sql), and the answers. The
// same endpoints, flags and log lines as examples/gin/main.go.
"use strict";
const crypto = require("crypto");
const { Pool } = require("pg");

const PROBLEMS = "https://example.com/problems/";

// --listen HOST:PORT --dsn DSN --charge-lease SECONDS --replay-200 --fault-injection --max-conns N
function flags(argv) {
  const f = { listen: "127.0.0.1:8080", dsn: "", chargeLease: 30, replay200: false, faults: false, maxConns: 20 };
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    if (a === "--listen") f.listen = argv[++i];
    else if (a === "--dsn") f.dsn = argv[++i];
    else if (a === "--charge-lease") f.chargeLease = Number(argv[++i]);
    else if (a === "--max-conns") f.maxConns = Number(argv[++i]);
    else if (a === "--replay-200") f.replay200 = true;
    else if (a === "--fault-injection") f.faults = true;
    else throw new Error("unknown flag " + a);
  }
  const i = f.listen.lastIndexOf(":");
  f.host = f.listen.slice(0, i);
  f.port = Number(f.listen.slice(i + 1));
  return f;
}

// IDEM_REPLAY_CACHE=1 in the environment: the replay cache on, with its defaults
function replayCache() {
  return process.env.IDEM_REPLAY_CACHE === "1";
}

function pool(f) {
  // a libpq-style "host=... port=... dbname=..." string
  const cfg = { max: f.maxConns };
  const names = { host: "host", port: "port", user: "user", dbname: "database", password: "password" };
  for (const m of f.dsn.matchAll(/(\w+)=(\S+)/g)) if (names[m[1]]) cfg[names[m[1]]] = m[2];
  return new Pool(cfg);
}

// An answer of the handlers: status, JSON body, headers.
function problem(status, type, title) {
  return { status, body: { type: PROBLEMS + type, title, status }, headers: {} };
}

class WorkerDied extends Error {}

function positiveInt(v) {
  return Number.isInteger(v) && v >= 1;
}

// The seed's payment: the payment row, the claim and the stored answer
// commit together. tok_fail fails for good (500, stored), tok_retry finds
// the processor unavailable (503, claim released).
async function createPayment(claim, user, p) {
  if (!p || typeof p !== "object" || !p.order_id || !positiveInt(p.amount)) {
    return problem(400, "invalid-payment", "order_id and a positive amount are required");
  }
  const currency = p.currency || "EUR";
  const tx = await claim.tx();
  await tx.query("INSERT INTO shop.payment_attempts (idempotency_key, user_id, source) VALUES ($1, $2, $3)",
    [claim.key, user, p.source ?? null]);
  if (p.source === "tok_fail") return problem(500, "processor-error", "the payment processor failed");
  if (p.source === "tok_retry") {
    await claim.release();
    const a = problem(503, "processor-unavailable", "the payment processor is unavailable, try again");
    a.headers["Retry-After"] = "1";
    return a;
  }
  const r = await tx.query(
    "INSERT INTO shop.payments (idempotency_key, user_id, order_id, amount, currency) VALUES ($1, $2, $3, $4, $5) RETURNING id",
    [claim.key, user, p.order_id, p.amount, currency]);
  const id = Number(r.rows[0].id);
  return {
    status: 201,
    body: { payment_id: id, order_id: p.order_id, amount: p.amount, currency, status: "succeeded" },
    // stored with the answer and sent again with its replays
    headers: { Location: `/api/payments/${id}`, ETag: `"payment-${id}-1"` },
  };
}

async function getPayment(db, user, id) {
  if (!/^[0-9]+$/.test(id)) return problem(404, "not-found", "no such payment");
  const r = await db.query("SELECT order_id, amount, currency FROM shop.payments WHERE id = $1 AND user_id = $2", [id, user]);
  if (!r.rows.length) return problem(404, "not-found", "no such payment");
  const row = r.rows[0];
  return { status: 200, body: { order_id: row.order_id, amount: Number(row.amount), currency: row.currency }, headers: {} };
}

// The seed's stock deduction: the guarded UPDATE keeps the stock from going
// below zero, the claim keeps a retried order from deducting twice.
async function createOrder(claim, user, o) {
  if (!o || typeof o !== "object" || !o.sku || !positiveInt(o.quantity)) {
    return problem(400, "invalid-order", "sku and a positive quantity are required");
  }
  const tx = await claim.tx();
  const r = await tx.query("UPDATE shop.stock SET quantity = quantity - $1 WHERE sku = $2 AND quantity >= $1 RETURNING quantity",
    [o.quantity, o.sku]);
  if (!r.rows.length) return problem(409, "out-of-stock", "not enough stock of " + o.sku);
  const m = await tx.query(
    "INSERT INTO shop.stock_moves (idempotency_key, user_id, sku, quantity) VALUES ($1, $2, $3, $4) RETURNING id",
    [claim.key, user, o.sku, -o.quantity]);
  return { status: 201, body: { order_id: Number(m.rows[0].id), sku: o.sku, quantity: o.quantity, stock_left: r.rows[0].quantity }, headers: {} };
}

// Lease mode: the claim is committed before the slow outside call, kept
// alive during it; the charge and the answer commit after it. Once the
// provider has charged, the charge id is the checkpoint "charged": if this
// worker dies before it completes, the retry that takes the claim over
// resumes there, and the provider is not called again.
async function createCharge(db, claim, user, c, fault) {
  if (!c || typeof c !== "object" || !c.order_id || !positiveInt(c.amount)) {
    return problem(400, "invalid-charge", "order_id and a positive amount are required");
  }
  let ref;
  if (claim.resumed && claim.resumed.phase === "charged") {
    ref = claim.resumed.state && claim.resumed.state.charge_id;
    if (!ref) throw new Error("checkpoint charged without a charge id");
  } else {
    ref = await claim.keepAlive(() => callProvider(db, claim.key, c.amount, c.delay_ms || 0));
    await claim.checkpoint("charged", { charge_id: ref });
    if (fault === "die-after-charge") throw new WorkerDied("simulated worker death (X-Fault: die-after-charge)");
  }
  const tx = await claim.tx();
  const r = await tx.query(
    "INSERT INTO shop.charges (idempotency_key, user_id, order_id, amount, provider_ref) VALUES ($1, $2, $3, $4, $5) RETURNING id",
    [claim.key, user, c.order_id, c.amount, ref]);
  return { status: 201, body: { charge_id: Number(r.rows[0].id), order_id: c.order_id, amount: c.amount, provider_ref: ref }, headers: {} };
}

// Stands in for the outside service: logs the call (a table standing for
// the provider's records), takes its time, answers a reference derived
// from the key (a provider that deduplicates on the request id).
async function callProvider(db, key, amount, delayMs) {
  await db.query("INSERT INTO shop.provider_calls (idempotency_key, amount) VALUES ($1, $2)", [key, amount]);
  await new Promise((r) => setTimeout(r, delayMs));
  return "ch_" + crypto.createHash("sha256").update(key).digest("hex").slice(0, 16);
}

// X-User-ID stands in for real authentication.
function userOf(headers) {
  const u = headers["x-user-id"];
  return typeof u === "string" && /^[0-9]+$/.test(u) ? u : undefined;
}

module.exports = { flags, pool, replayCache, problem, WorkerDied, createPayment, getPayment, createOrder, createCharge, userOf };
