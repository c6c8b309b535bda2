// pg-idempotency: exactly-once write endpoints and jobs over the idempotency
// PostgreSQL extension. The NestJS interceptor is in "pg-idempotency/nestjs".
export * from "./core";
export { idempotent, IdempotentOptions } from "./wrapper";
export { idempotency, ExpressOptions, IdempotencyMiddleware } from "./express";
export { idempotencyPlugin, FastifyOptions, IdempotencyHandle } from "./fastify";
export {
  Shards, ShardsOptions, ShardsLayout, ShardAnswer, ShardAcquireArgs, ShardCompleteArgs, ShardReleaseArgs, keyHash, poolConfigOf,
} from "./shards";
