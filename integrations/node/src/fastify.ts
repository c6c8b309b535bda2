// The Fastify plugin. No runtime import of fastify: it adds hooks to the
// instance it is registered on (not encapsulated, as fastify-plugin would).

import { Transform } from "stream";
import type { Pool } from "pg";
import { Answer, Claim, HEADER_KEY, HEADER_TRACE, HttpIdempotency, HttpOptions, ReplayCache } from "./core";

export interface FastifyOptions extends HttpOptions {
  pool: Pool;
  /** The authenticated user, for the scope (default: request.user?.id ?? request.user). */
  user?: (request: any) => string | undefined;
}

/** What the plugin puts on the instance as `fastify.idempotency`. */
export interface IdempotencyHandle {
  /** idem_forget(key, scope), and the key out of this plugin's replay cache (scope: httpScope(user, method, path)). */
  forget(scope: string, key: string): Promise<boolean>;
  /** The replayCache option's cache, or null. */
  readonly replayCache: ReplayCache | null;
}

const STATE = Symbol("pg-idempotency");

interface State {
  raw: Buffer[];
  claim?: Claim;
  failed?: boolean;
}

function header(request: any, name: string): string | undefined {
  const v = request.headers[name.toLowerCase()];
  return Array.isArray(v) ? v[0] : v;
}

function defaultUser(request: any): string | undefined {
  const u = request.user;
  if (u == null) return undefined;
  if (typeof u === "object") return u.id != null ? String(u.id) : undefined;
  return String(u);
}

function apply(reply: any, a: Answer): void {
  for (const [name, v] of Object.entries(a.headers)) {
    if (v === null) reply.removeHeader(name);
    else reply.header(name, v);
  }
  reply.code(a.status);
}

/**
 * The Fastify plugin: `await app.register(idempotencyPlugin, { pool })`.
 * For every routed request but GET, HEAD and OPTIONS (and routes with
 * `config: { idempotency: false }`) it claims the Idempotency-Key in a
 * transaction, runs the handler with `request.idempotency` (a Claim: `await
 * request.idempotency.tx()` is the transaction's pg client), stores the
 * handler's answer and commits in onSend, and only then lets it go out. A
 * handler that throws rolls back: nothing is stored. A route's lease:
 * `config: { idempotency: { lease: 30 } }`, or the leases option.
 */
export async function idempotencyPlugin(fastify: any, opts: FastifyOptions): Promise<void> {
  const core = new HttpIdempotency(opts.pool, opts);
  const userOf = opts.user ?? defaultUser;
  fastify.decorateRequest("idempotency", null);
  const handle: IdempotencyHandle = {
    forget: (scope: string, key: string) => core.forget(scope, key),
    replayCache: core.replayCache,
  };
  fastify.decorate("idempotency", handle);

  const routeOf = (request: any): { url: string; config: any } => {
    const ro = request.routeOptions ?? {};
    return { url: ro.url ?? request.routerPath ?? "", config: ro.config ?? request.routeConfig ?? {} };
  };
  const path = (request: any): string => String(request.raw.url ?? "/").split("?")[0];
  const wanted = (request: any): boolean => {
    if (request.is404 || core.skipped(request.method, path(request))) return false;
    return routeOf(request).config.idempotency !== false;
  };

  // keep the raw body, compared as JSON with the first request's
  fastify.addHook("preParsing", async (request: any, _reply: any, payload: any) => {
    if (!wanted(request)) return payload;
    const st: State = { raw: [] };
    request[STATE] = st;
    const tee = new Transform({
      transform(chunk, _enc, cb) {
        st.raw.push(Buffer.from(chunk));
        cb(null, chunk);
      },
    });
    (tee as any).receivedEncodedLength = 0;
    payload.on("data", (c: Buffer) => ((tee as any).receivedEncodedLength += c.length));
    payload.on("error", (e: Error) => tee.destroy(e));
    return payload.pipe(tee);
  });

  fastify.addHook("preHandler", async (request: any, reply: any) => {
    if (!wanted(request)) return;
    const st: State = request[STATE] ?? { raw: [] };
    request[STATE] = st;
    const { url, config } = routeOf(request);
    const lease = (config.idempotency && config.idempotency.lease) || core.leaseOf(request.method, url);
    const raw = st.raw.length ? Buffer.concat(st.raw) : request.body === undefined ? null : JSON.stringify(request.body);
    const begun = await core.begin(
      { method: request.method, path: path(request), key: header(request, HEADER_KEY), body: raw,
        trace: header(request, HEADER_TRACE), user: userOf(request) },
      lease,
    );
    if (begun.answer) {
      apply(reply, begun.answer);
      return reply.send(begun.answer.body ?? undefined);
    }
    st.claim = begun.claim;
    request.idempotency = begun.claim;
    // the connection closed before an answer (a worker that died, a
    // hijacked reply, a client gone): roll back, nothing is stored
    reply.raw.once("close", () => {
      if (st.claim && !reply.raw.writableFinished) {
        const c = st.claim;
        st.claim = undefined;
        void core.failed(c);
      }
    });
  });

  fastify.addHook("onError", async (request: any) => {
    const st: State | undefined = request[STATE];
    if (st) st.failed = true;
  });

  fastify.addHook("onSend", async (request: any, reply: any, payload: any) => {
    const st: State | undefined = request[STATE];
    if (!st || !st.claim) return payload;
    const claim = st.claim;
    st.claim = undefined;
    if (st.failed) {
      // the handler threw: roll back, store nothing (the retry runs again)
      await core.failed(claim);
      return payload;
    }
    if (payload != null && typeof payload !== "string" && !Buffer.isBuffer(payload)) {
      // a stream: not storable; roll back and let it go out as it is
      await core.failed(claim);
      return payload;
    }
    const a = await core.finish(claim, { status: reply.statusCode, headers: reply.getHeaders(), body: payload ?? null });
    apply(reply, a);
    reply.removeHeader("content-length");
    return a.body;
  });
}

// registered on the instance itself, not in a child context (fastify-plugin's skip-override)
(idempotencyPlugin as any)[Symbol.for("skip-override")] = true;
(idempotencyPlugin as any)[Symbol.for("fastify.display-name")] = "pg-idempotency";
