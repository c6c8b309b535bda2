#!/usr/bin/env bash
# bench/durable.sh -- issue 39's durable-commit figures: bench/run.sh at
# synchronous_commit = on beside off, for each PostgreSQL major given, at
# 2, 8 and 32 clients, then one table of the three ratios the issue sets
# (ext_new / floor_new, ext_new / article, ext_replay / floor_replay_check,
# each the median of the per-round ratios, with their min-max).
#
#   bash bench/durable.sh [--majors 15,18] [--rounds 3] [--duration 5]
#   bash bench/durable.sh --table ON.md OFF.md [MAJOR]   (the table of two reports)
#
# As root (bench/run.sh's needs: IDEM_PG_PREFIX for a private copy of 15,
# scripts/matrix.sh's roots for 17 and 18).  Each run is bench/run.sh
# --quick --request-compare --clients 2,8,32: about 8 minutes a run on 2
# cores, four runs for two majors.  The reports are kept in
# bench/results/durable-MAJOR-on|off.md; the table is printed and written
# to bench/results/durable.md.  On a shared machine the figures say little:
# give the load beside them.
set -euo pipefail
BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

table() {	# table MAJOR ON.md OFF.md
	python3 - "$@" <<-'PY'
		import re, statistics, sys
		major, files = sys.argv[1], {"on": sys.argv[2], "off": sys.argv[3]}
		ratios = [("ext_new", "floor_new"), ("ext_new", "article"), ("ext_replay", "floor_replay_check")]
		def rounds(path):
		    tps = {}
		    for line in open(path):
		        m = re.match(r"^\| (\w+) \| (\d+) \| [\d.]+ \| ([\d., ]+) \|", line)
		        if m and (m.group(1), m.group(2)) not in tps:
		            tps[(m.group(1), m.group(2))] = [float(x) for x in m.group(3).split(", ")]
		    return tps
		print("| PostgreSQL %s | clients | %s |" % (major, " | ".join("%s ÷ %s" % r for r in ratios)))
		print("|---|---:|" + "---|" * len(ratios))
		for sync, path in files.items():
		    tps = rounds(path)
		    for c in sorted({c for _, c in tps}, key=int):
		        cells = []
		        for a, b in ratios:
		            if (a, c) not in tps or (b, c) not in tps:
		                cells.append("—")
		                continue
		            rs = [x / y for x, y in zip(tps[(a, c)], tps[(b, c)])]
		            med = statistics.median(rs)
		            cells.append("%s%.2f%s (%.2f–%.2f)" % ("" if med >= 1 else "**", med, "" if med >= 1 else "**", min(rs), max(rs)))
		        print("| `synchronous_commit = %s` | %s | %s |" % (sync, c, " | ".join(cells)))
	PY
}

if [[ ${1:-} == --table ]]; then
	table "${4:-15}" "${2:?}" "${3:?}"
	exit 0
fi
MAJORS=15,18 ROUNDS=3 DURATION=5
while (($#)); do
	case $1 in
	--majors) MAJORS=$2; shift 2 ;;
	--rounds) ROUNDS=$2; shift 2 ;;
	--duration) DURATION=$2; shift 2 ;;
	*) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 2 ;;
	esac
done
R=$BENCH_DIR/results
mkdir -p "$R"
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)" >"$R/durable.md"
IFS=, read -r -a majors <<<"$MAJORS"
for m in "${majors[@]}"; do
	for s in on off; do
		bash "$BENCH_DIR/run.sh" --pg "$m" --quick --request-compare --clients 2,8,32 \
			--rounds "$ROUNDS" --duration "$DURATION" --sync "$s" >"$R/durable-$m-$s.log" 2>&1
		cp "$R/latest.md" "$R/durable-$m-$s.md"
	done
	table "$m" "$R/durable-$m-on.md" "$R/durable-$m-off.md" | tee -a "$R/durable.md"
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)" >>"$R/durable.md"
