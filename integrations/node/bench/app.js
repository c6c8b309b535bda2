// The seed's payment endpoint (POST /api/payments with an Idempotency-Key)
// on Express, one of five ways, for peers.sh:
//
//   node app.js --mode pg|pgc|ei|ni|none --listen 127.0.0.1:PORT --dsn 'host=... port=... dbname=...' [--redis URL]
//
//   pg    pg-idempotency (installed from its .tgz): the payment's rows, the
//         claim and the stored answer in one transaction (conformance/shop.js)
//   pgc   the same with its replay cache on (replayCache: true, the defaults):
//         a completed answer is replayed from the process
//   ei    express-idempotency with express-idempotency-redis-adapter (its
//         Redis store), the handler as its README shows (isHit)
//   ni    @node-idempotency/core with @node-idempotency/storage-adapter-redis;
//         the @node-idempotency/express its README names is not on npm, so the
//         few lines of Express glue below follow core's README (onRequest
//         before the handler, onResponse with the answer before it is sent)
//   none  no idempotency
//
// In every mode the handler writes the same rows in one transaction:
// shop.payment_attempts (a run of the handler) and shop.payments.
"use strict";
const express = require("express");
const shop = require("./shop");

const argv = process.argv.slice(2);
let mode = "", redisUrl = "";
const rest = [];
for (let i = 0; i < argv.length; i++) {
  if (argv[i] === "--mode") mode = argv[++i];
  else if (argv[i] === "--redis") redisUrl = argv[++i];
  else rest.push(argv[i]);
}
const f = shop.flags(rest);
const pool = shop.pool(f);
const app = express();
app.set("etag", false);
app.get("/health", (req, res) => res.json({ status: "ok" }));

// X-User-ID stands in for real authentication (as in conformance/express.js)
app.use((req, res, next) => {
  req.user = shop.userOf(req.headers);
  if (req.user === undefined) return answer(res, shop.problem(401, "unauthenticated", "X-User-ID header missing or not a number"));
  next();
});

function answer(res, a) {
  res.status(a.status).set(a.headers);
  if (a.status >= 400) res.type("application/problem+json");
  res.send(JSON.stringify(a.body));
}

// The payment without pg-idempotency: the same two rows in one transaction
// of the handler's own (what the peers' docs show: the business write in the
// handler, the key in their store).
async function createPaymentPlain(key, user, p) {
  if (!p || typeof p !== "object" || !p.order_id || !Number.isInteger(p.amount) || p.amount < 1) {
    return shop.problem(400, "invalid-payment", "order_id and a positive amount are required");
  }
  const currency = p.currency || "EUR";
  const db = await pool.connect();
  try {
    await db.query("BEGIN");
    await db.query("INSERT INTO shop.payment_attempts (idempotency_key, user_id, source) VALUES ($1, $2, $3)",
      [key ?? "", user, p.source ?? null]);
    const r = await db.query(
      "INSERT INTO shop.payments (idempotency_key, user_id, order_id, amount, currency) VALUES ($1, $2, $3, $4, $5) RETURNING id",
      [key ?? "", user, p.order_id, p.amount, currency]);
    await db.query("COMMIT");
    const id = Number(r.rows[0].id);
    return {
      status: 201,
      body: { payment_id: id, order_id: p.order_id, amount: p.amount, currency, status: "succeeded" },
      headers: { Location: `/api/payments/${id}`, ETag: `"payment-${id}-1"` },
    };
  } catch (err) {
    await db.query("ROLLBACK").catch(() => {});
    throw err;
  } finally {
    db.release();
  }
}

const h = (fn) => (req, res, next) => fn(req, res).then((a) => a && answer(res, a), next);

async function main() {
  if (mode === "pg" || mode === "pgc") {
    const { idempotency } = require("pg-idempotency");
    const idem = idempotency(pool, mode === "pgc" ? { replayCache: true } : {});
    app.post("/api/payments", idem, h((req) => shop.createPayment(req.idempotency, req.user, req.body)));
  } else if (mode === "ei") {
    const ei = require("express-idempotency");
    const RedisAdapter = require("express-idempotency-redis-adapter").default;
    const adapter = new RedisAdapter({ connectionConfig: { url: redisUrl } });
    await adapter.connect();
    app.use(express.json());
    app.post("/api/payments", ei.idempotency({ dataAdapter: adapter }), h(async (req) => {
      if (ei.getSharedIdempotencyService().isHit(req)) return undefined; // answered by the middleware
      return createPaymentPlain(req.get("Idempotency-Key"), req.user, req.body);
    }));
  } else if (mode === "ni") {
    const { Idempotency, IdempotencyError, IdempotencyErrorCodes } = require("@node-idempotency/core");
    const { RedisStorageAdapter } = require("@node-idempotency/storage-adapter-redis");
    const storage = new RedisStorageAdapter({ url: redisUrl });
    await storage.connect();
    const idem = new Idempotency(storage, { enforceIdempotency: true });
    const codes = {
      [IdempotencyErrorCodes.IDEMPOTENCY_FINGERPRINT_MISSMATCH]: 422,
      [IdempotencyErrorCodes.IDEMPOTENCY_KEY_LEN_EXEEDED]: 400,
      [IdempotencyErrorCodes.IDEMPOTENCY_KEY_MISSING]: 400,
      [IdempotencyErrorCodes.REQUEST_IN_PROGRESS]: 409,
    };
    const params = (req) => ({ method: req.method, headers: req.headers, body: req.body, path: req.path });
    app.use(express.json());
    app.post("/api/payments", h(async (req, res) => {
      let stored;
      try {
        stored = await idem.onRequest(params(req));
      } catch (err) {
        if (!(err instanceof IdempotencyError)) throw err;
        const a = shop.problem(codes[err.code] || 400, "idempotency", err.message);
        if (a.status === 409) a.headers["Retry-After"] = "1";
        return a;
      }
      if (stored) {
        const a = { status: stored.additional.status, body: stored.body, headers: { ...stored.additional.headers } };
        a.headers["Idempotent-Replayed"] = "true";
        return a;
      }
      const a = await createPaymentPlain(req.get("Idempotency-Key"), req.user, req.body);
      await idem.onResponse(params(req), { body: a.body, additional: { status: a.status, headers: a.headers } });
      return a;
    }));
  } else if (mode === "none") {
    app.use(express.json());
    app.post("/api/payments", h((req) => createPaymentPlain(req.get("Idempotency-Key"), req.user, req.body)));
  } else {
    throw new Error("--mode pg|pgc|ei|ni|none");
  }
  app.use((req, res) => answer(res, shop.problem(404, "not-found", "no such route")));
  app.use((err, req, res, next) => {
    if (req.idempotency) req.idempotency.abort();
    if (res.headersSent) return;
    // express-idempotency sets 409 (in progress) or 417 (misuse), then passes an error on
    const status = res.statusCode >= 400 ? res.statusCode : 500;
    answer(res, shop.problem(status, status === 500 ? "internal-error" : "idempotency", String(err && err.message)));
  });
  app.listen(f.port, f.host, () => console.error(`${mode}: listening on ${f.listen}`));
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
