package idempotency

import (
	"context"
	"errors"
	"reflect"
	"strconv"
	"strings"
	"unsafe"

	"github.com/jackc/pgconn"
	"github.com/jackc/pgproto3/v2"
	"github.com/jackc/pgx/v4"
	"github.com/jackc/pgx/v4/pgxpool"
)

// One round trip each way (issue 39): BEGIN goes with idem_acquire, and
// idem_complete with COMMIT, as one simple-protocol query of two statements
// (pgconn's Exec: the simple query protocol, which takes no parameters, so
// the values go in as literals quoted by the driver's own EscapeString).
// PostgreSQL runs nothing of such a query after a statement that failed.
// The transaction that BEGIN opened is then a claimTx: pgx.Tx over the
// pool's connection, which goes back to the pool at its end.

// errNUL is what a value holding a NUL byte gets: PostgreSQL's text cannot
// hold one (and a query string ends at it). The middleware refuses such a
// request (400) before it gets here.
var errNUL = errors.New("idempotency: a value holds a NUL byte")

// literal is s as an SQL literal ('...', NULL for nil), quoted by pgconn's
// EscapeString (which requires standard_conforming_strings on and UTF8).
func literal(pc *pgconn.PgConn, s *string) (string, error) {
	if s == nil {
		return "NULL", nil
	}
	if strings.IndexByte(*s, 0) >= 0 {
		return "", errNUL
	}
	e, err := pc.EscapeString(*s)
	if err != nil {
		return "", err
	}
	return "'" + e + "'", nil
}

// interval is seconds(d) as an interval literal expression, or
// NULL::interval (the server's default).
func interval(d *float64) string {
	if d == nil {
		return "NULL::interval"
	}
	return strconv.FormatFloat(*d, 'f', -1, 64) + "::float8 * interval '1 second'"
}

// claimTx is the transaction that the middleware opened on conn, as a
// pgx.Tx: the handler's writes (Tx) go in it, and Commit or Rollback end it
// and put the connection back in the pool (which closes it if it is not
// idle then).
type claimTx struct {
	conn   *pgxpool.Conn
	closed bool
	sp     int64 // savepoints made (Begin)
}

// beginTx opens a claimTx on a connection of pool (lease mode's second
// transaction).
func beginTx(ctx context.Context, pool *pgxpool.Pool) (*claimTx, error) {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	if _, err := conn.Exec(ctx, "begin"); err != nil {
		conn.Release()
		return nil, err
	}
	return &claimTx{conn: conn}, nil
}

// end marks the transaction done and gives the connection back.
func (t *claimTx) end() {
	if !t.closed {
		t.closed = true
		t.conn.Release()
	}
}

// completeAndCommit runs query (idem_complete's SELECT of (done, canonical),
// then COMMIT) and ends the transaction; it answers the canonical body.
func (t *claimTx) completeAndCommit(ctx context.Context, query string) (*string, error) {
	if t.closed {
		return nil, pgx.ErrTxClosed
	}
	pc := t.conn.Conn().PgConn()
	res, err := pc.Exec(ctx, query).ReadAll()
	if err == nil && (len(res) != 2 || len(res[0].Rows) != 1 || len(res[0].Rows[0]) != 2 ||
		string(res[1].CommandTag) != "COMMIT") {
		err = errors.New("idempotency: unexpected answer to idem_complete and COMMIT")
	}
	if err != nil {
		if !pc.IsClosed() && pc.TxStatus() != 'I' {
			_, _ = t.conn.Exec(ctx, "rollback")
		}
		t.end()
		return nil, err
	}
	t.end()
	if v := res[0].Rows[0][1]; v != nil {
		s := string(v)
		return &s, nil
	}
	return nil, nil
}

// rollbackLater rolls the duplicate's transaction (which wrote nothing)
// back, then gives the connection back, without the answer waiting for it.
func rollbackLater(conn *pgxpool.Conn) {
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), dbTimeout)
		defer cancel()
		_, _ = conn.Exec(ctx, "rollback")
		conn.Release()
	}()
}

// Begin starts a pseudo nested transaction (a savepoint), as pgx's does.
func (t *claimTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if t.closed {
		return nil, pgx.ErrTxClosed
	}
	t.sp++
	if _, err := t.conn.Exec(ctx, "savepoint sp_"+strconv.FormatInt(t.sp, 10)); err != nil {
		return nil, err
	}
	return &savepoint{claimTx: t, n: t.sp}, nil
}

// BeginFunc runs f in a savepoint: released if f returns nil, else rolled
// back to.
func (t *claimTx) BeginFunc(ctx context.Context, f func(pgx.Tx) error) error {
	return beginFunc(ctx, t, f)
}

func beginFunc(ctx context.Context, t pgx.Tx, f func(pgx.Tx) error) (err error) {
	sp, err := t.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() {
		if rerr := sp.Rollback(ctx); rerr != nil && !errors.Is(rerr, pgx.ErrTxClosed) {
			err = rerr
		}
	}()
	if ferr := f(sp); ferr != nil {
		_ = sp.Rollback(ctx)
		return ferr
	}
	return sp.Commit(ctx)
}

// Commit commits the transaction (the middleware commits it itself, with
// the stored answer: a handler does not call this).
func (t *claimTx) Commit(ctx context.Context) error {
	if t.closed {
		return pgx.ErrTxClosed
	}
	tag, err := t.conn.Exec(ctx, "commit")
	t.end()
	if err != nil {
		return err
	}
	if string(tag) == "ROLLBACK" {
		return pgx.ErrTxCommitRollback
	}
	return nil
}

// Rollback rolls the transaction back; ErrTxClosed once it has ended.
func (t *claimTx) Rollback(ctx context.Context) error {
	if t.closed {
		return pgx.ErrTxClosed
	}
	_, err := t.conn.Exec(ctx, "rollback")
	t.end()
	return err
}

func (t *claimTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	if t.closed {
		return 0, pgx.ErrTxClosed
	}
	return t.conn.CopyFrom(ctx, table, columns, src)
}

func (t *claimTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if t.closed {
		return errBatch{}
	}
	return t.conn.SendBatch(ctx, b)
}

// LargeObjects is pgx's large-object API in this transaction. pgx builds
// it for its own transactions only (its one field, the Tx, is unexported):
// it is set here through reflection, checked to be that one field.
func (t *claimTx) LargeObjects() pgx.LargeObjects {
	var lo pgx.LargeObjects
	v := reflect.ValueOf(&lo).Elem()
	txType := reflect.TypeOf((*pgx.Tx)(nil)).Elem()
	if v.NumField() == 1 && v.Field(0).Type() == txType {
		f := v.Field(0)
		reflect.NewAt(txType, unsafe.Pointer(f.UnsafeAddr())).Elem().Set(reflect.ValueOf(t))
	}
	return lo
}

func (t *claimTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if t.closed {
		return nil, pgx.ErrTxClosed
	}
	return t.conn.Conn().Prepare(ctx, name, sql)
}

func (t *claimTx) Exec(ctx context.Context, sql string, args ...interface{}) (pgconn.CommandTag, error) {
	if t.closed {
		return nil, pgx.ErrTxClosed
	}
	return t.conn.Exec(ctx, sql, args...)
}

func (t *claimTx) Query(ctx context.Context, sql string, args ...interface{}) (pgx.Rows, error) {
	if t.closed {
		return errRows{}, pgx.ErrTxClosed
	}
	return t.conn.Query(ctx, sql, args...)
}

func (t *claimTx) QueryRow(ctx context.Context, sql string, args ...interface{}) pgx.Row {
	if t.closed {
		return errRows{}
	}
	return t.conn.QueryRow(ctx, sql, args...)
}

func (t *claimTx) QueryFunc(ctx context.Context, sql string, args []interface{}, scans []interface{}, f func(pgx.QueryFuncRow) error) (pgconn.CommandTag, error) {
	if t.closed {
		return nil, pgx.ErrTxClosed
	}
	return t.conn.QueryFunc(ctx, sql, args, scans, f)
}

// Conn is the underlying connection (nil once the transaction has ended).
func (t *claimTx) Conn() *pgx.Conn {
	if t.closed {
		return nil
	}
	return t.conn.Conn()
}

// savepoint is a claimTx's pseudo nested transaction.
type savepoint struct {
	*claimTx
	n    int64
	done bool
}

func (s *savepoint) BeginFunc(ctx context.Context, f func(pgx.Tx) error) error {
	return beginFunc(ctx, s, f)
}

func (s *savepoint) Commit(ctx context.Context) error {
	if s.done || s.closed {
		return pgx.ErrTxClosed
	}
	_, err := s.claimTx.Exec(ctx, "release savepoint sp_"+strconv.FormatInt(s.n, 10))
	s.done = true
	return err
}

func (s *savepoint) Rollback(ctx context.Context) error {
	if s.done || s.closed {
		return pgx.ErrTxClosed
	}
	_, err := s.claimTx.Exec(ctx, "rollback to savepoint sp_"+strconv.FormatInt(s.n, 10))
	s.done = true
	return err
}

// errRows is the answer of a query on an ended transaction.
type errRows struct{}

func (errRows) Close()                                         {}
func (errRows) Err() error                                     { return pgx.ErrTxClosed }
func (errRows) CommandTag() pgconn.CommandTag                  { return nil }
func (errRows) FieldDescriptions() []pgproto3.FieldDescription { return nil }
func (errRows) Next() bool                                     { return false }
func (errRows) Scan(...interface{}) error                      { return pgx.ErrTxClosed }
func (errRows) Values() ([]interface{}, error)                 { return nil, pgx.ErrTxClosed }
func (errRows) RawValues() [][]byte                            { return nil }

// errBatch is the answer of a batch on an ended transaction.
type errBatch struct{}

func (errBatch) Exec() (pgconn.CommandTag, error) { return nil, pgx.ErrTxClosed }
func (errBatch) Query() (pgx.Rows, error)         { return errRows{}, pgx.ErrTxClosed }
func (errBatch) QueryRow() pgx.Row                { return errRows{} }
func (errBatch) QueryFunc([]interface{}, func(pgx.QueryFuncRow) error) (pgconn.CommandTag, error) {
	return nil, pgx.ErrTxClosed
}
func (errBatch) Close() error { return pgx.ErrTxClosed }
