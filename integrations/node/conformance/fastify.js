// The seed's payment and stock-deduction API on Fastify, made exactly-once
// by pg-idempotency's plugin (the endpoints of examples/gin/main.go).
//
//   node fastify.js --listen 127.0.0.1:8080 --dsn 'dbname=shop' [--charge-lease 30] [--replay-200] [--fault-injection]
"use strict";
const Fastify = require("fastify");
const { idempotencyPlugin } = require("pg-idempotency");
const shop = require("./shop");

const f = shop.flags(process.argv.slice(2));
const pool = shop.pool(f);

async function main() {
  const app = Fastify({ logger: false });

  // X-User-ID stands in for real authentication
  app.decorateRequest("user", null);
  app.addHook("onRequest", async (request, reply) => {
    const path = request.raw.url.split("?")[0];
    if (path === "/health" || path === "/metrics") return;
    request.user = shop.userOf(request.headers);
    if (request.user === undefined) {
      return answer(reply, shop.problem(401, "unauthenticated", "X-User-ID header missing or not a number"));
    }
  });

  await app.register(idempotencyPlugin, {
    pool,
    replayOk: f.replay200,
    leases: { "POST /api/charges": f.chargeLease },
    // every duplicate logged: the checks link each to its first request in the log
    logDuplicates: "all",
    replayCache: shop.replayCache(),
  });

  function answer(reply, a) {
    reply.code(a.status).headers(a.headers);
    if (a.status >= 400) reply.type("application/problem+json");
    return reply.send(JSON.stringify(a.body));
  }

  app.get("/health", async () => ({ status: "ok" }));
  app.get("/metrics", async (request, reply) => reply.type("text/plain").send("# no metrics in this example\n"));
  app.get("/api/payments/:id", async (request, reply) => answer(reply, await shop.getPayment(pool, request.user, request.params.id)));
  app.post("/api/payments", async (request, reply) =>
    answer(reply, await shop.createPayment(request.idempotency, request.user, request.body)));
  app.post("/api/orders", async (request, reply) =>
    answer(reply, await shop.createOrder(request.idempotency, request.user, request.body)));
  app.post("/api/charges", async (request, reply) =>
    answer(reply, await shop.createCharge(pool, request.idempotency, request.user, request.body,
      f.faults ? request.headers["x-fault"] : undefined)));

  app.setNotFoundHandler((request, reply) => answer(reply, shop.problem(404, "not-found", "no such route")));
  app.setErrorHandler((err, request, reply) => {
    if (err instanceof shop.WorkerDied) {
      // no answer: the connection is dropped, as when a worker dies
      console.error(`worker died (X-Fault) on ${request.method} ${request.raw.url}`);
      reply.hijack();
      request.raw.socket.destroy();
      return;
    }
    // the plugin has rolled back: nothing is stored (the retry runs again)
    return answer(reply, shop.problem(err.statusCode || 500, "internal-error", String(err.message)));
  });

  await app.listen({ port: f.port, host: f.host });
  console.error(`listening on ${f.listen}`);
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
