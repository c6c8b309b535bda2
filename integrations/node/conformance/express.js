// The seed's payment and stock-deduction API on Express, made exactly-once
// by pg-idempotency's middleware (the endpoints of examples/gin/main.go).
//
//   node express.js --listen 127.0.0.1:8080 --dsn 'dbname=shop' [--charge-lease 30] [--replay-200] [--fault-injection]
"use strict";
const express = require("express");
const { idempotency } = require("pg-idempotency");
const shop = require("./shop");

const f = shop.flags(process.argv.slice(2));
const pool = shop.pool(f);
const app = express();
app.set("etag", false);

app.get("/health", (req, res) => res.json({ status: "ok" }));
app.get("/metrics", (req, res) => res.type("text/plain").send("# no metrics in this example\n"));

// X-User-ID stands in for real authentication
app.use((req, res, next) => {
  req.user = shop.userOf(req.headers);
  if (req.user === undefined) return answer(res, shop.problem(401, "unauthenticated", "X-User-ID header missing or not a number"));
  next();
});

// per route, so that an unrouted POST is a plain 404, as in the Gin example
// (app.use(idem) works too, for every POST, PUT, PATCH and DELETE)
const idem = idempotency(pool, {
  replayOk: f.replay200,
  leases: { "POST /api/charges": f.chargeLease },
  // every duplicate logged: the checks link each to its first request in the log
  logDuplicates: "all",
  replayCache: shop.replayCache(),
});

function answer(res, a) {
  res.status(a.status).set(a.headers);
  if (a.status >= 400) res.type("application/problem+json");
  res.send(JSON.stringify(a.body));
}

// wrap an async handler: errors go to next(err), which rolls back (below)
const h = (fn) => (req, res, next) => fn(req, res).then((a) => answer(res, a), next);

app.get("/api/payments/:id", h((req) => shop.getPayment(pool, req.user, req.params.id)));
app.post("/api/payments", idem, h((req) => shop.createPayment(req.idempotency, req.user, req.body)));
app.post("/api/orders", idem, h((req) => shop.createOrder(req.idempotency, req.user, req.body)));
app.post("/api/charges", idem, h((req) => shop.createCharge(pool, req.idempotency, req.user, req.body,
  f.faults ? req.get("X-Fault") : undefined)));

app.use((req, res) => answer(res, shop.problem(404, "not-found", "no such route")));
app.use((err, req, res, next) => {
  if (err instanceof shop.WorkerDied) {
    // no answer: the connection is dropped, as when a worker dies
    console.error(`worker died (X-Fault) on ${req.method} ${req.path}`);
    req.socket.destroy();
    return;
  }
  // an error: roll back and store nothing (the retry runs again)
  if (req.idempotency) req.idempotency.abort();
  answer(res, shop.problem(500, "internal-error", String(err && err.message)));
});

app.listen(f.port, f.host, () => console.error(`listening on ${f.listen}`));
