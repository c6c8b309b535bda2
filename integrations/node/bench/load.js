// The load generator of peers.sh: POST /api/payments over keep-alive
// connections, each request with its own Idempotency-Key header.
//
//   node load.js new    URL PREFIX SECONDS CONNS KEYFILE   new keys PREFIX-1, PREFIX-2, ...;
//                                                     the keys answered 201 are written to KEYFILE
//   node load.js replay URL PREFIX SECONDS CONNS KEYFILE   the keys of KEYFILE again, in turn
//   node load.js dup    URL KEY N                      N identical POSTs with KEY at once
//
// Prints one JSON line: requests, seconds, rps, p50/p99 in ms, statuses.
"use strict";
const http = require("http");
const fs = require("fs");

const [cmd, url, prefix] = process.argv.slice(2);
const u = new URL(url);

function body(key) {
  return JSON.stringify({ order_id: "order-" + key, amount: 1000, currency: "EUR" });
}

function post(agent, key) {
  const b = body(key);
  return new Promise((resolve) => {
    const t0 = process.hrtime.bigint();
    const req = http.request({
      agent, host: u.hostname, port: u.port, path: "/api/payments", method: "POST",
      headers: { "Content-Type": "application/json", "Content-Length": Buffer.byteLength(b), "Idempotency-Key": key, "X-User-ID": "7" },
    }, (res) => {
      res.on("data", () => {});
      res.on("end", () => resolve({ status: res.statusCode, ms: Number(process.hrtime.bigint() - t0) / 1e6, replayed: res.headers["idempotent-replayed"] }));
    });
    req.on("error", (err) => resolve({ status: "error:" + err.code, ms: Number(process.hrtime.bigint() - t0) / 1e6 }));
    req.end(b);
  });
}

function pct(sorted, p) {
  if (!sorted.length) return null;
  return sorted[Math.min(sorted.length - 1, Math.ceil((p / 100) * sorted.length) - 1)];
}

async function run(mode, seconds, conns, keyfile) {
  const agent = new http.Agent({ keepAlive: true, maxSockets: conns });
  const keys = mode === "replay" ? fs.readFileSync(keyfile, "utf8").split("\n").filter(Boolean) : null;
  if (keys && !keys.length) throw new Error("no completed keys in " + keyfile);
  let n = 0;
  const lat = [], statuses = {}, done = [];
  const t0 = Date.now(), end = t0 + seconds * 1000;
  async function worker() {
    while (Date.now() < end) {
      const key = keys ? keys[n++ % keys.length] : `${prefix}-${++n}`;
      const r = await post(agent, key);
      lat.push(r.ms);
      statuses[r.status] = (statuses[r.status] || 0) + 1;
      if (!keys && r.status === 201) done.push(key);
    }
  }
  await Promise.all(Array.from({ length: conns }, worker));
  const secs = (Date.now() - t0) / 1000;
  agent.destroy();
  if (!keys) fs.writeFileSync(keyfile, done.join("\n") + "\n");
  lat.sort((a, b) => a - b);
  return { mode, requests: lat.length, seconds: secs, rps: lat.length / secs, p50_ms: pct(lat, 50), p99_ms: pct(lat, 99), statuses };
}

async function dup(key, count) {
  // one connection each, all sent before any answer is read
  const agent = new http.Agent({ keepAlive: false, maxSockets: count });
  const rs = await Promise.all(Array.from({ length: count }, () => post(agent, key)));
  const statuses = {};
  let replayed = 0;
  for (const r of rs) {
    statuses[r.status] = (statuses[r.status] || 0) + 1;
    if (r.replayed === "true") replayed++;
  }
  return { mode: "dup", key, statuses, replayed };
}

(async () => {
  let out;
  if (cmd === "new" || cmd === "replay") {
    const [, , , seconds, conns, keyfile] = process.argv.slice(2);
    out = await run(cmd, Number(seconds), Number(conns), keyfile);
  } else if (cmd === "dup") {
    out = await dup(prefix, Number(process.argv[5]));
  } else throw new Error("usage: load.js new|replay|dup ...");
  console.log(JSON.stringify(out));
})().catch((err) => {
  console.error(err);
  process.exit(1);
});
