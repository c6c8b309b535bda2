// The seed's payment and stock-deduction API on NestJS (platform-express),
// made exactly-once by pg-idempotency's interceptor (the endpoints of
// examples/gin/main.go). Plain JavaScript: the decorators are applied by
// hand, as TypeScript's output would.
//
//   node nestjs.js --listen 127.0.0.1:8080 --dsn 'dbname=shop' [--charge-lease 30] [--replay-200] [--fault-injection]
"use strict";
require("reflect-metadata");
const { Module, Controller, Get, Post, Req, Res, HttpException } = require("@nestjs/common");
const { NestFactory } = require("@nestjs/core");
const { IdempotencyInterceptor } = require("pg-idempotency/nestjs");
const shop = require("./shop");

const f = shop.flags(process.argv.slice(2));
const pool = shop.pool(f);

// A handler's answer: 2xx returned, the rest thrown as HttpException (stored
// and replayed all the same); headers set on the response.
function reply(res, a) {
  res.set(a.headers);
  if (a.status >= 300) throw new HttpException(a.body, a.status);
  res.status(a.status);
  return a.body;
}

class ShopController {
  health() {
    return { status: "ok" };
  }
  metrics(res) {
    res.type("text/plain").send("# no metrics in this example\n");
  }
  async getPayment(req, res) {
    return reply(res, await shop.getPayment(pool, req.user, req.params.id));
  }
  async createPayment(req, res) {
    return reply(res, await shop.createPayment(req.idempotency, req.user, req.body));
  }
  async createOrder(req, res) {
    return reply(res, await shop.createOrder(req.idempotency, req.user, req.body));
  }
  async createCharge(req, res) {
    const fault = f.faults ? req.get("X-Fault") : undefined;
    try {
      return reply(res, await shop.createCharge(pool, req.idempotency, req.user, req.body, fault));
    } catch (e) {
      if (e instanceof shop.WorkerDied) {
        // no answer: the connection is dropped, as when a worker dies
        console.error(`worker died (X-Fault) on ${req.method} ${req.path}`);
        req.socket.destroy();
      }
      throw e;
    }
  }
}
const P = ShopController.prototype;
const route = (name, method, ...params) => {
  params.forEach((p, i) => p(P, name, i));
  Reflect.decorate([method], P, name, Object.getOwnPropertyDescriptor(P, name));
};
route("health", Get("health"));
route("metrics", Get("metrics"), Res());
route("getPayment", Get("api/payments/:id"), Req(), Res({ passthrough: true }));
route("createPayment", Post("api/payments"), Req(), Res({ passthrough: true }));
route("createOrder", Post("api/orders"), Req(), Res({ passthrough: true }));
route("createCharge", Post("api/charges"), Req(), Res({ passthrough: true }));
Reflect.decorate([Controller()], ShopController);

class AppModule {}
Reflect.decorate([Module({ controllers: [ShopController] })], AppModule);

async function main() {
  const app = await NestFactory.create(AppModule, { rawBody: true, logger: ["error"] });
  // X-User-ID stands in for real authentication
  app.use((req, res, next) => {
    const path = req.path;
    if (path === "/health" || path === "/metrics") return next();
    req.user = shop.userOf(req.headers);
    if (req.user === undefined) {
      const a = shop.problem(401, "unauthenticated", "X-User-ID header missing or not a number");
      return res.status(401).type("application/problem+json").send(JSON.stringify(a.body));
    }
    next();
  });
  app.getHttpAdapter().getInstance().set("etag", false);
  app.useGlobalInterceptors(new IdempotencyInterceptor(pool, {
    replayOk: f.replay200,
    leases: { "POST /api/charges": f.chargeLease },
    // every duplicate logged: the checks link each to its first request in the log
    logDuplicates: "all",
    replayCache: shop.replayCache(),
  }));
  await app.listen(f.port, f.host);
  console.error(`listening on ${f.listen}`);
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
