// The Express middleware. No runtime import of express: it works on the
// request and response objects it is given.

import { createHash } from "crypto";
import type { IncomingMessage, ServerResponse } from "http";
import type { Pool } from "pg";
import { Answer, Claim, HEADER_KEY, HEADER_TRACE, HttpIdempotency, HttpOptions, ReplayCache } from "./core";

export interface ExpressOptions extends HttpOptions {
  /** The authenticated user, for the scope (default: req.user?.id ?? req.user). */
  user?: (req: any) => string | undefined;
}

type Req = IncomingMessage & { [k: string]: any };
type Res = ServerResponse & { [k: string]: any };

/** The user that authentication middleware left on the request. */
function defaultUser(req: Req): string | undefined {
  const u = req.user;
  if (u == null) return undefined;
  if (typeof u === "object") return u.id != null ? String(u.id) : undefined;
  return String(u);
}

function readBody(req: Req): Promise<Buffer> {
  return new Promise((resolve, reject) => {
    const chunks: Buffer[] = [];
    req.on("data", (c: Buffer) => chunks.push(c));
    req.on("end", () => resolve(Buffer.concat(chunks)));
    req.on("error", reject);
  });
}

/** Express's own weak ETag of a body (the etag package's), which is not the sent body's once stored. */
function expressETag(body: Buffer): string {
  const hash = createHash("sha1").update(body).digest("base64").substring(0, 27);
  return `W/"${body.length.toString(16)}-${hash}"`;
}

function send(res: Res, end: (...a: any[]) => any, a: Answer): void {
  for (const [name, v] of Object.entries(a.headers)) {
    if (v === null) res.removeHeader(name);
    else res.setHeader(name, v);
  }
  res.statusCode = a.status;
  if (a.body == null) {
    res.removeHeader("Content-Length");
    end.call(res);
    return;
  }
  const buf = Buffer.from(a.body);
  res.setHeader("Content-Length", String(buf.length));
  end.call(res, buf);
}

/** The middleware, with forget() (idem_forget and the key out of its replay cache) and its cache. */
export interface IdempotencyMiddleware {
  (req: any, res: any, next: (err?: unknown) => void): void;
  /** idem_forget(key, scope), and the key out of this middleware's replay cache (scope: httpScope(user, method, path)). */
  forget(scope: string, key: string): Promise<boolean>;
  /** The replayCache option's cache, or null. */
  readonly replayCache: ReplayCache | null;
}

/**
 * The Express middleware: `app.use(idempotency(pool, opts))` before the
 * routes, or per route. For a POST (any method but GET, HEAD and OPTIONS)
 * it claims the Idempotency-Key in a transaction, runs the handler with
 * `req.idempotency` (a Claim: `await req.idempotency.tx()` is the
 * transaction's pg client), stores the handler's answer and commits, and
 * only then sends it. It reads the JSON body itself (req.body is set as
 * express.json() would).
 */
export function idempotency(pool: Pool, opts: ExpressOptions = {}): IdempotencyMiddleware {
  const core = new HttpIdempotency(pool, opts);
  const userOf = opts.user ?? defaultUser;
  const middleware = function idempotencyMiddleware(req: Req, res: Res, next: (err?: unknown) => void): void {
    const path = (req.originalUrl ?? req.url ?? "/").split("?")[0];
    if (core.skipped(req.method ?? "GET", path)) return next();
    run(req, res, next, path).catch(next);
  };
  return Object.assign(middleware, {
    forget: (scope: string, key: string) => core.forget(scope, key),
    replayCache: core.replayCache,
  });

  async function run(req: Req, res: Res, next: (err?: unknown) => void, path: string): Promise<void> {
    let raw: Buffer | string | null = null;
    if (req.rawBody != null) raw = req.rawBody;
    else if (req._body) raw = req.body === undefined ? null : JSON.stringify(req.body);
    else {
      raw = await readBody(req);
      // as express.json() would leave it (it then skips the request)
      req._body = true;
      const text = raw.toString();
      if (text.trim() !== "") {
        try {
          req.body = JSON.parse(text);
        } catch {
          // begin() answers 400 body-not-json
        }
      } else req.body = {};
    }
    const method = req.method as string;
    const route = req.route ? (req.baseUrl ?? "") + req.route.path : path;
    const begun = await core.begin(
      {
        method,
        path,
        key: header(req, HEADER_KEY),
        body: raw,
        trace: header(req, HEADER_TRACE),
        user: userOf(req),
      },
      core.leaseOf(method, route),
    );
    if (begun.answer) {
      send(res, res.end, begun.answer);
      return;
    }
    req.idempotency = begun.claim;
    holdResponse(res, core, begun.claim);
    next();
  }
}

/**
 * Hold the answer that res is given back until it is stored and committed
 * (claim), or send `fixed` in its place (an answer decided before the
 * handler: NestJS still writes a response of its own).
 */
export function holdResponse(res: Res, core: HttpIdempotency, claim: Claim | null, fixed?: Answer): void {
  const end = res.end;
  const write = res.write;
  const writeHead = res.writeHead;
  const chunks: Buffer[] = [];
  let done = false;
  const restore = () => {
    res.end = end;
    res.write = write;
    res.writeHead = writeHead;
  };
  const toBuf = (c: unknown, enc?: unknown) =>
    Buffer.isBuffer(c) ? c : Buffer.from(c as string, typeof enc === "string" ? (enc as BufferEncoding) : "utf8");
  res.writeHead = function (status: number, ...rest: any[]) {
    res.statusCode = status;
    const h = rest.find((x) => x && typeof x === "object");
    if (h) for (const [k, v] of Object.entries(h)) res.setHeader(k, v as string);
    return res;
  } as any;
  res.write = function (chunk: unknown, enc?: unknown, cb?: unknown) {
    if (chunk != null) chunks.push(toBuf(chunk, enc));
    const f = typeof enc === "function" ? enc : cb;
    if (typeof f === "function") process.nextTick(f as () => void);
    return true;
  } as any;
  res.end = function (chunk?: unknown, enc?: unknown) {
    if (done) return res;
    done = true;
    if (chunk != null && typeof chunk !== "function") chunks.push(toBuf(chunk, enc));
    restore();
    if (!claim) {
      send(res, end, fixed as Answer);
      return res;
    }
    const body = Buffer.concat(chunks);
    const headers = res.getHeaders() as Record<string, unknown>;
    // express's generated ETag hashes the handler's bytes, not the stored ones
    if (typeof headers.etag === "string" && headers.etag === expressETag(body)) {
      res.removeHeader("ETag");
      delete headers.etag;
    }
    core
      .finish(claim, { status: res.statusCode, headers, body: chunks.length ? body : null })
      .then((a) => send(res, end, a))
      .catch((e) => send(res, end, core.dbProblem(e)));
    return res;
  } as any;
  // the connection closed before the answer (a worker that died, a client
  // gone): roll back, nothing is stored
  res.on("close", () => {
    if (!done) {
      done = true;
      restore();
      if (claim) void core.failed(claim);
    }
  });
}

function header(req: Req, name: string): string | undefined {
  const v = req.headers[name.toLowerCase()];
  return Array.isArray(v) ? v[0] : v;
}
