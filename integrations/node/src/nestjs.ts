// The NestJS interceptor (platform-express). Imports rxjs at run time, not
// @nestjs/common: it is used as an instance,
//   app.useGlobalInterceptors(new IdempotencyInterceptor(pool, opts))

import { from, Observable, of, throwError } from "rxjs";
import { catchError, mergeMap } from "rxjs/operators";
import type { Pool } from "pg";
import { Claim, HEADER_KEY, HEADER_TRACE, HttpIdempotency, HttpOptions, ReplayCache } from "./core";
import { holdResponse } from "./express";

export interface NestOptions extends HttpOptions {
  /** The authenticated user, for the scope (default: req.user?.id ?? req.user). */
  user?: (req: any) => string | undefined;
}

/** The parts of Nest's ExecutionContext and CallHandler used here. */
interface ExecutionContextLike {
  getType(): string;
  switchToHttp(): { getRequest(): any; getResponse(): any };
}
interface CallHandlerLike {
  handle(): Observable<unknown>;
}

function header(req: any, name: string): string | undefined {
  const v = req.headers[name.toLowerCase()];
  return Array.isArray(v) ? v[0] : v;
}

function defaultUser(req: any): string | undefined {
  const u = req.user;
  if (u == null) return undefined;
  if (typeof u === "object") return u.id != null ? String(u.id) : undefined;
  return String(u);
}

/** An HttpException: an answer of the handler (stored), not a failure. */
function isHttpException(err: unknown): boolean {
  return !!err && typeof (err as any).getStatus === "function" && typeof (err as any).getResponse === "function";
}

/**
 * The NestJS interceptor, over the Express platform. For every request but
 * GET, HEAD and OPTIONS it claims the Idempotency-Key in a transaction, runs
 * the handler with `req.idempotency` (a Claim: `await req.idempotency.tx()`
 * is the transaction's pg client), stores the answer and commits, and only
 * then sends it. A handler's answer is what it returns or an HttpException it
 * throws (both stored and replayed); any other exception rolls back and
 * stores nothing. Create the app with `{ rawBody: true }` so that the body is
 * compared as sent.
 */
export class IdempotencyInterceptor {
  private readonly core: HttpIdempotency;
  private readonly userOf: (req: any) => string | undefined;

  constructor(pool: Pool, opts: NestOptions = {}) {
    this.core = new HttpIdempotency(pool, opts);
    this.userOf = opts.user ?? defaultUser;
  }

  /** idem_forget(key, scope), and the key out of this interceptor's replay cache (scope: httpScope(user, method, path)). */
  forget(scope: string, key: string): Promise<boolean> {
    return this.core.forget(scope, key);
  }

  /** The replayCache option's cache, or null. */
  get replayCache(): ReplayCache | null {
    return this.core.replayCache;
  }

  intercept(context: ExecutionContextLike, next: CallHandlerLike): Observable<unknown> {
    if (context.getType() !== "http") return next.handle();
    const http = context.switchToHttp();
    const req = http.getRequest();
    const res = http.getResponse();
    const path = String(req.originalUrl ?? req.url ?? "/").split("?")[0];
    if (this.core.skipped(req.method, path)) return next.handle();
    return from(this.begin(req, res, path)).pipe(
      mergeMap((claim) => {
        if (!claim) return of(undefined); // answered: whatever Nest sends is replaced
        return next.handle().pipe(
          catchError((err) => {
            if (!isHttpException(err)) claim.abort();
            return throwError(() => err);
          }),
        );
      }),
    );
  }

  private async begin(req: any, res: any, path: string): Promise<Claim | null> {
    const raw = req.rawBody != null ? req.rawBody : req.body === undefined ? null : JSON.stringify(req.body);
    const route = req.route ? (req.baseUrl ?? "") + req.route.path : path;
    const begun = await this.core.begin(
      { method: req.method, path, key: header(req, HEADER_KEY), body: raw, trace: header(req, HEADER_TRACE), user: this.userOf(req) },
      this.core.leaseOf(req.method, route),
    );
    if (begun.answer) {
      holdResponse(res, this.core, null, begun.answer);
      return null;
    }
    req.idempotency = begun.claim;
    holdResponse(res, this.core, begun.claim);
    return begun.claim;
  }
}
