#!/usr/bin/env bash
# scripts/demo.sh -- the idempotency extension at work, on a throwaway cluster
#
# Installs what is missing of what it needs (apt: the server, its headers,
# pg_cron, gcc, make; scripts/test.sh installs the rest), builds and
# installs the extension, starts a
# cluster of its own (scripts/common.sh), runs the scenarios of the article
# this project started from (SQL and pgbench scripts in demo/), prints a short
# report and stops the cluster.  Each line of the report ends in "ok" or in
# "UNEXPECTED: ..." (then the script exits 1).
#
#   bash scripts/demo.sh          (as root on Debian 12; well under a minute)
set -euo pipefail

# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
# shellcheck disable=SC2034  # read by common.sh
IDEM_QUIET=1
DEMO=$REPO_ROOT/demo
DB=idempotency_demo
t0=$EPOCHREALTIME

install_deps demo
build_install
# durable settings: no "fast"
# shellcheck disable=SC2119
start_cluster

# q: psql on the demo database, unaligned, tuples only, stop at the first error
q() { "$PG_BINDIR/psql" -X -q -A -t -v ON_ERROR_STOP=1 -d "$DB" "$@"; }

# bench NAME PGBENCH-ARGS...: run pgbench, keep its output, fail loudly.
bench() {
	local name=$1 out rc=0
	shift
	out=$IDEM_TMPDIR/pgbench-$name.out
	"$PG_BINDIR/pgbench" -n "$@" "$DB" >"$out" 2>&1 || rc=$?
	if ((rc != 0)); then
		cat "$out" >&2
		die "pgbench ($name) exit $rc"
	fi
}

# check LABEL ACTUAL EXPECTED ...: sets VERDICT to "ok" or to the mismatches.
problems=0
check() {
	local bad=()
	while (($# >= 3)); do
		[[ $2 == "$3" ]] || bad+=("$1 = $2, expected $3")
		shift 3
	done
	if ((${#bad[@]} == 0)); then
		VERDICT=ok
	else
		VERDICT="UNEXPECTED: $(IFS=';'; echo "${bad[*]}")"
		problems=$((problems + 1))
	fi
}

# say TEXT: one line of the report, with the verdict of the last check.
# say LINE...: a scenario's lines of the report; the verdict of the last check
# ends the last one.
say() {
	while (($# > 1)); do
		printf '%s\n' "$1"
		shift
	done
	printf '%s  [%s]\n' "$1" "$VERDICT"
}

"$PG_BINDIR/createdb" "$DB"
q -f "$DEMO/setup.sql" >/dev/null

echo
echo "idempotency demo: PostgreSQL $(q -c 'SHOW server_version' | cut -d' ' -f1)," \
	"database $DB on 127.0.0.1:$PGPORT"
echo

# a. the payments table's own unique business key
res=$(q -f "$DEMO/unique_key.sql")
check "raw duplicate INSERT" "${res:0:14}" "SQLSTATE 23505"
say "a. payments.idempotency_key is UNIQUE: a raw duplicate INSERT that skips the claim -> ${res%%:*} (last line of defence)"

# b. first POST
key=7f1c9e2a-5b3d-4c1e-9a77-payment0001
IFS='|' read -r outcome status body < <(q -f "$DEMO/post_payment.sql" -v key="$key" -v user_id=42 -v amount=4200)
first_body=$body
rows=$(q -c "SELECT count(*) FROM payments")
check outcome "$outcome" acquired "HTTP status" "$status" 201 "payments rows" "$rows" 1
say "b. first POST (42.00 EUR) -> $outcome, HTTP $status $body; payments rows: $rows"

# c. the same POST again
IFS='|' read -r outcome status body < <(q -f "$DEMO/post_payment.sql" -v key="$key" -v user_id=42 -v amount=4200)
rows=$(q -c "SELECT count(*) FROM payments")
same=no
[[ $body == "$first_body" ]] && same=yes
check outcome "$outcome" replay "HTTP status" "$status" 201 "same body" "$same" yes "payments rows" "$rows" 1
say "c. repeat, same key and request -> $outcome, HTTP $status, same body: $same; payments rows: $rows"

# d. the same key, another amount
IFS='|' read -r outcome status body < <(q -f "$DEMO/post_payment.sql" -v key="$key" -v user_id=42 -v amount=5000)
rows=$(q -c "SELECT count(*) FROM payments")
check outcome "$outcome" mismatch "HTTP status" "$status" 422 "payments rows" "$rows" 1
say "d. same key, 50.00 EUR instead -> $outcome, HTTP $status; payments rows: $rows"

# e. ten concurrent duplicates
key=0c5d2b8e-91aa-4f0e-b3c4-payment0002
bench duplicates -c 10 -j 10 -t 1 -D key="$key" -D amount=1999 -f "$DEMO/duplicates.pgbench"
IFS='|' read -r rows logged acq rep inp mis ans201 bodies waited < <(q -v key="$key" <<-'EOF'
	SELECT (SELECT count(*) FROM payments WHERE idempotency_key = :'key'),
	       count(*),
	       count(*) FILTER (WHERE outcome = 'acquired'),
	       count(*) FILTER (WHERE outcome = 'replay'),
	       count(*) FILTER (WHERE outcome = 'in_progress'),
	       count(*) FILTER (WHERE outcome = 'mismatch'),
	       count(*) FILTER (WHERE http_status = 201),
	       count(DISTINCT body),
	       coalesce(round(extract(epoch FROM max(answered_at - started_at)
	                      FILTER (WHERE outcome <> 'acquired')), 2), 0)
	  FROM outcomes WHERE scenario = 'duplicates';
EOF
)
check "payments rows" "$rows" 1 "clients" "$logged" 10 acquired "$acq" 1 "replay + in_progress" "$((rep + inp))" 9 \
	mismatch "$mis" 0 "distinct response bodies" "$bodies" 1
say "e. 10 concurrent duplicates (pgbench -c 10 -j 10, one key) -> payments rows: $rows, outcomes: acquired $acq / replay $rep / in_progress $inp; HTTP 201 to $ans201 clients, $bodies distinct body; duplicates waited up to ${waited}s"

# f. stock deduction under concurrent distinct keys
initial=100 qty=3 clients=10 per_client=6
q -c "INSERT INTO stock VALUES ('sku-42', $initial)"
bench stock -c "$clients" -j "$clients" -t "$per_client" -D qty="$qty" -f "$DEMO/stock_order.pgbench"
IFS='|' read -r orders acq deducted refused left moved < <(q <<-'EOF'
	SELECT count(*),
	       count(*) FILTER (WHERE outcome = 'acquired'),
	       count(*) FILTER (WHERE http_status = 201),
	       count(*) FILTER (WHERE http_status = 409),
	       (SELECT quantity FROM stock WHERE sku = 'sku-42'),
	       (SELECT coalesce(-sum(quantity), 0) FROM stock_moves)
	  FROM outcomes WHERE scenario = 'stock';
EOF
)
IFS='|' read -r replays r201 r409 other left_after < <(q -v qty="$qty" -f "$DEMO/stock_resend.sql")
below_zero=never
((left >= 0)) || below_zero=yes
check "stock below zero" "$below_zero" never orders "$orders" $((clients * per_client)) acquired "$acq" "$orders" deducted "$deducted" $((initial / qty)) \
	"stock left" "$left" $((initial % qty)) "stock + moved" $((left + moved)) "$initial" \
	"resent: replay" "$replays" "$orders" "resent: other outcomes" "$other" 0 \
	"replayed 201" "$r201" "$deducted" "stock after resend" "$left_after" "$left"
say "f. $orders orders of $qty from stock $initial ($clients pgbench clients, distinct keys) -> $deducted deducted (= $initial/$qty), $refused refused 409 out of stock, stock left $left (below zero: $below_zero)" \
	"   all $orders orders resent -> $replays replay ($r201 x 201, $r409 x 409), stock still $left_after"

# g. queue consumer deduplicating redelivered events, NULL request
IFS='|' read -r deliveries events expected_sum < <(q -v events=20 -f "$DEMO/queue_fill.sql")
rounds=0
while :; do
	bench consumer -c 4 -j 4 -t 20 -f "$DEMO/consumer.pgbench"
	rounds=$((rounds + 1))
	[[ $(q -c "SELECT count(*) FROM queue") == 0 || $rounds == 3 ]] && break
done
IFS='|' read -r handled acq rep inp ledger balance queued < <(q <<-'EOF'
	SELECT count(*),
	       count(*) FILTER (WHERE outcome = 'acquired'),
	       count(*) FILTER (WHERE outcome = 'replay'),
	       count(*) FILTER (WHERE outcome = 'in_progress'),
	       (SELECT count(*) FROM ledger),
	       (SELECT balance FROM account WHERE id = 1),
	       (SELECT count(*) FROM queue)
	  FROM outcomes WHERE scenario = 'consumer';
EOF
)
check "deliveries handled" "$handled" "$deliveries" "processed (acquired)" "$acq" "$events" \
	"skipped (replay)" "$rep" $((deliveries - events)) in_progress "$inp" 0 "ledger rows" "$ledger" "$events" \
	balance "$balance" "$expected_sum" "left in queue" "$queued" 0
say "g. queue: $deliveries deliveries of $events events (each 2-3 times), 4 consumers, key = event id, NULL request -> processed $acq, redeliveries skipped (replay) $rep; ledger rows $ledger, balance $balance (sum of the events: $expected_sum)"

# h. lease mode: the caller dies during a slow outside call
key=3a9f0d6c-2e71-4b8a-8c55-transfer0001
request='{"to": "acme-bank", "amount_cents": 9900}'
PGAPPNAME=demo-lease-caller-1 q -v key="$key" -v request="$request" -f "$DEMO/lease_caller.sql" \
	>"$IDEM_TMPDIR/lease-caller.out" 2>&1 &
caller_pid=$!
in_call=0
for _ in $(seq 1 100); do
	in_call=$(q -c "SELECT count(*) FROM pg_stat_activity
	                 WHERE application_name = 'demo-lease-caller-1'
	                   AND state = 'active' AND query LIKE '%pg_sleep%'")
	[[ $in_call == 1 ]] && break
	sleep 0.1
done
[[ $in_call == 1 ]] || { cat "$IDEM_TMPDIR/lease-caller.out" >&2; die "lease caller never reached its slow call"; }
# the caller dies: its connection goes away without idem_complete
q -c "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
       WHERE application_name = 'demo-lease-caller-1'" >/dev/null
wait "$caller_pid" || true
IFS='|' read -r c1_outcome c1_attempt <"$IDEM_TMPDIR/lease-caller.out"
IFS='|' read -r r1_outcome _ r1_status r1_ms < <(q -v key="$key" -v request="$request" -f "$DEMO/lease_retry.sql")
slept=$(q -v key="$key" -f "$DEMO/lease_wait.sql")
IFS='|' read -r r2_outcome r2_attempt _ < <(q -v key="$key" -v request="$request" -f "$DEMO/lease_retry.sql")
late=$(q -v key="$key" -v attempt=1 -f "$DEMO/lease_complete.sql")
done2=$(q -v key="$key" -v attempt="${r2_attempt:-2}" -f "$DEMO/lease_complete.sql")
IFS='|' read -r r3_outcome _ r3_status _ < <(q -v key="$key" -v request="$request" -f "$DEMO/lease_retry.sql")
check "caller 1" "$c1_outcome/$c1_attempt" acquired/1 "retry at once" "$r1_outcome/$r1_status" in_progress/409 \
	"retry after the lease" "$r2_outcome/$r2_attempt" acquired/2 "late complete (attempt 1)" "${late:0:14}" "SQLSTATE 55000" \
	"complete (attempt 2)" "$done2" "ok: true" "last retry" "$r3_outcome/$r3_status" replay/201
say "h. lease 2s: caller 1 $c1_outcome (attempt $c1_attempt) and died in its slow call; retry at once -> $r1_outcome after ${r1_ms} ms (HTTP $r1_status); ${slept}s later -> $r2_outcome, attempt $r2_attempt" \
	"   caller 1's late idem_complete(attempt => 1) -> ${late%%:*} caught (${late#*: }); attempt 2 completes -> ${done2#ok: }; next retry -> $r3_outcome $r3_status"

# i. form submit with a one-time token (the seed's second document)
token=$(q -c "SELECT idempotency.idem_token_issue('user:7/checkout', '30 minutes')")
bench form -c 5 -j 5 -t 1 -D token="$token" -f "$DEMO/form_submit.pgbench"
IFS='|' read -r submits placed spent orders again < <(q -v token="$token" <<-'EOF'
	SELECT count(*),
	       count(*) FILTER (WHERE outcome = 'consumed'),
	       count(*) FILTER (WHERE http_status = 409),
	       (SELECT count(*) FROM payments WHERE idempotency_key = 'form-' || :'token'),
	       idempotency.idem_token_consume(:'token', 'user:7/checkout')
	  FROM outcomes WHERE scenario = 'form';
EOF
)
check submits "$submits" 5 "orders placed" "$placed" 1 "409 duplicate submit" "$spent" 4 "order rows" "$orders" 1 \
	"token again" "$again" f
say "i. form token (${#token} URL-safe chars) posted by 5 clicks at once (pgbench -c 5) -> order placed $placed time(s), $spent answered 409; order rows: $orders; token spent: $([[ $again == f ]] && echo yes || echo no)"

# j. what the operator sees: the seed's metrics, from idempotency.stats
IFS='|' read -r s_acq s_rep s_inp s_mis s_tok s_p99 < <(q <<-'EOF'
	SELECT s.acquired, s.replayed, s.in_progress, s.mismatched, s.tokens_consumed,
	       (SELECT min(h.le) FROM idempotency.acquire_duration h
	         WHERE h.datname = s.datname
	           AND h.count >= 0.99 * (SELECT max(count) FROM idempotency.acquire_duration x
	                                   WHERE x.datname = s.datname))
	  FROM idempotency.stats s WHERE s.datname = current_database();
EOF
)
VERDICT=ok
if [[ -z $s_acq || $s_acq -le 0 || $s_rep -le 0 ]]; then
	VERDICT="UNEXPECTED: no statistics"
	problems=$((problems + 1))
fi
say "j. idempotency.stats: acquired $s_acq, replayed (idempotency_cache_hit_total) $s_rep, in_progress $s_inp, mismatched $s_mis, tokens consumed $s_tok; P99 of idem_acquire <= ${s_p99} s"

# k. a resumed payment (1.2): the worker dies after the provider charged
key=5e2a7c1d-8b4f-4d3a-a6e0-payment0003
request='{"amount_cents": 2500, "currency": "EUR"}'
PGAPPNAME=demo-resume-worker q -v key="$key" -v request="$request" -f "$DEMO/resume_worker.sql" \
	>"$IDEM_TMPDIR/resume-worker.out" 2>&1 &
worker_pid=$!
in_call=0
for _ in $(seq 1 100); do
	in_call=$(q -c "SELECT count(*) FROM pg_stat_activity
	                 WHERE application_name = 'demo-resume-worker'
	                   AND state = 'active' AND query LIKE '%pg_sleep%'")
	[[ $in_call == 1 ]] && break
	sleep 0.1
done
[[ $in_call == 1 ]] || { cat "$IDEM_TMPDIR/resume-worker.out" >&2; die "the payment worker never charged"; }
q -c "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
       WHERE application_name = 'demo-resume-worker'" >/dev/null
wait "$worker_pid" || true
charged=$(head -n 1 "$IDEM_TMPDIR/resume-worker.out")
IFS='|' read -r t_outcome t_attempt t_phase t_charge t_done t_calls < <(q -v key="$key" -v request="$request" \
	-f "$DEMO/resume_takeover.sql")
check takeover "$t_outcome/$t_attempt" acquired/2 "resumed at" "$t_phase" charged "charge id" "$t_charge" "$charged" \
	completed "$t_done" t "provider charges" "$t_calls" 1
say "k. resumed payment (1.2): the worker charged $charged, checkpointed 'charged' and died; the takeover -> $t_outcome, attempt $t_attempt, at '$t_phase' with $t_charge" \
	"   it completes without charging again -> completed: $t_done; the provider charged $t_calls time(s)"

stop_cluster
echo
printf 'demo finished in %s s: ' "$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')"
if ((problems == 0)); then
	echo "every scenario behaved as the contract says"
else
	echo "$problems scenario(s) UNEXPECTED (see above)"
	exit 1
fi
