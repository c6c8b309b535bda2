module github.com/idempotency-pg/idempotency-go

go 1.19

require (
	github.com/gin-gonic/gin v1.8.1
	github.com/jackc/pgconn v1.11.0
	github.com/jackc/pgx/v4 v4.15.0
)
