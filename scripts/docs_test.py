#!/usr/bin/env python3
"""scripts/docs_test.py FILE.md -- run the code blocks of one Markdown file

Run by scripts/docs_test.sh, against the throwaway cluster it started for
this file (PGHOST, PGPORT, IDEM_PGDATA, IDEM_SERVER_LOG, PG_BINDIR, REPO_ROOT
in the environment).  The convention is in docs/testing.md:

  ```sql      psql, as the postgres role, from / (never the clone, which it
              may not enter: a clone under /root, say); psql variables
              (\\gset) and the database (\\c) carry over to the next sql
              block of the file
  ```sh       bash -e, as root, in the repository root; variables with
  ```bash     lower-case names carry over to the next shell block; a server
              started with & runs until the end of the file; `systemctl
              restart postgresql` restarts the file's cluster
  ```ini      postgresql.conf lines: appended to the cluster's file, then
              the server is restarted and must come up
  ```text     right after a sql or shell block (blank lines between at
              most): its expected output; "..." in a line matches any
              text, a line of just "..." any number of lines

  <!-- docs-test: skip -->   on the line just before a block: not run
                             (the text must say so too)
  <!-- docs-test: from 1.1 -->  on the line just before a block: first
                             put release 1.1 in place, as on a server that
                             runs it (from_release); the block then
                             installs the new files

Any other language (yaml, go, promql, ...) is not run.  A block fails when
it exits non-zero, prints "ERROR:" that its expected output does not show,
or prints something other than its expected output.  Prints one line per
block and, last, "<name>: N of M tests passed."; exits 1 if any failed.

scripts/docs_test.py --links FILE.md checks, without a cluster, that every
relative link of the file names a file that exists and, with #anchor, a
heading of that Markdown file (GitHub's anchors), and that every section a
sentence cites as `NAME.md, "Heading"` is a heading of NAME.md; it prints
what is broken and exits 1 if anything is.
"""

import os
import re
import signal
import subprocess
import sys
import tempfile
import time

RUN = {"sql", "sh", "bash", "ini"}
MARK = re.compile(r"^\s*<!--\s*docs-test:\s*(skip|from \S+|\S+)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)```\s*([A-Za-z0-9_+-]*)\s*$")


def parse(path):
    """[(line, lang, text, mark, expected or None)]"""
    lines = open(path, encoding="utf-8").read().split("\n")
    blocks = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang = m.group(1), m.group(2).lower()
        start = i
        body = []
        i += 1
        while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        if i >= len(lines):
            raise SystemExit(f"{path}:{start + 1}: code block never closed")
        i += 1
        mark = None
        if start > 0:
            mm = MARK.match(lines[start - 1])
            if mm:
                mark = mm.group(1)
                if mark != "skip" and not mark.startswith("from "):
                    raise SystemExit(f"{path}:{start}: unknown docs-test marker {mark!r}")
        text = "\n".join(body) + "\n"
        if lang == "text" and blocks and blocks[-1][1] in RUN and blocks[-1][4] is None:
            # expected output: only blank lines since the block before
            gap = lines[blocks[-1][5]:start]
            if all(not g.strip() for g in gap):
                b = blocks[-1]
                blocks[-1] = (b[0], b[1], b[2], b[3], text, i)
                continue
        blocks.append((start + 1, lang, text, mark, None, i))
    return [b[:5] for b in blocks]


def matches(expected, actual):
    pat = []
    for line in expected.rstrip("\n").split("\n"):
        if line.strip() == "...":
            pat.append(r"(?:[^\n]*\n)*?")
        else:
            pat.append(".*?".join(re.escape(p) for p in line.rstrip().split("...")) + r"[ \t]*\n")
    act = "\n".join(l.rstrip() for l in actual.rstrip("\n").split("\n")) + "\n"
    return re.fullmatch("".join(pat), act) is not None


ENV = dict(os.environ)
# a fresh Debian root's PATH: no pyenv or other shims of this machine's own
ENV["PATH"] = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PG_BINDIR = ENV.get("PG_BINDIR", "")
REPO = ENV.get("REPO_ROOT") or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TMP = STATE = SH_ENV = None
psql_vars = {}
psql_db = [ENV.get("PGDATABASE", "postgres")]
groups = []


def run_as_postgres(cmd, **kw):
    """subprocess.run of cmd as the postgres OS user, from "/": never from
    the clone, which may be in a folder postgres cannot enter (a clone in
    /root), where PostgreSQL's programs print "could not change directory
    to ..." into the block's output"""
    if os.geteuid() == 0:
        cmd = ["runuser", "-u", "postgres", "--"] + cmd
    return subprocess.run(cmd, cwd="/", **kw)


def run_sql(text):
    script = "".join(f"\\set {k} '{v}'\n" for k, v in psql_vars.items())
    marker = "--docs-test-variables--"
    script += text + f"\n\\echo {marker}\n\\echo :DBNAME\n\\set\n"
    p = run_as_postgres(["stdbuf", "-o0", "-e0", os.path.join(PG_BINDIR, "psql"),
                         "-X", "-q", "-P", "pager=off", "-d", psql_db[0]],
                        input=script, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        text=True, env=ENV, timeout=300)
    out, _, tail = p.stdout.partition(marker + "\n")
    if tail:
        rest = tail.split("\n")
        psql_db[0] = rest[0]
        for line in rest[1:]:
            m = re.match(r"^([a-z_][a-z0-9_]*) = '([^'\\\n]*)'$", line)
            if m:
                psql_vars[m.group(1)] = m.group(2)
    return p.returncode, out


def run_sh(text):
    script = ("set -eo pipefail\n. " + STATE + "\n" + text +
              "\nfor _v in $(compgen -v | grep -E '^[a-z][a-z0-9_]*$'); do declare -p \"$_v\"; done >"
              + STATE + ".new\n")
    # output to a file, not a pipe: a server the block leaves running in the
    # background keeps it open
    log = os.path.join(TMP, "shell-%d.out" % len(groups))
    with open(log, "w") as f:
        p = subprocess.Popen(["bash", "-c", script], stdout=f, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, cwd=REPO, env=SH_ENV, start_new_session=True)
    groups.append(p.pid)
    try:
        p.wait(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        return 124, open(log).read() + "\n(timed out after 300 s)"
    out = open(log, encoding="utf-8", errors="replace").read()
    if p.returncode == 0 and os.path.exists(STATE + ".new"):
        os.replace(STATE + ".new", STATE)
    return p.returncode, out


def run_ini(text):
    conf = os.path.join(ENV["IDEM_PGDATA"], "postgresql.conf")
    with open(conf, "a", encoding="utf-8") as f:
        f.write("\n# docs-test block\n" + text)
    return restart()


def restart():
    """restart the file's cluster; (0, "") or (exit status, what went wrong)"""
    env = {k: v for k, v in ENV.items() if not k.startswith("PG")}
    p = run_as_postgres([os.path.join(PG_BINDIR, "pg_ctl"), "restart", "-w", "-t", "60",
                         "-D", ENV["IDEM_PGDATA"], "-l", ENV["IDEM_SERVER_LOG"],
                         "-o", "-p " + ENV["PGPORT"]],
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    out = p.stdout
    if p.returncode != 0:
        try:
            out += "".join(open(ENV["IDEM_SERVER_LOG"], encoding="utf-8", errors="replace")
                           .readlines()[-15:])
        except OSError:
            pass
        return p.returncode, out
    return 0, ""


def psql_as_postgres(db, sql):
    """(exit status, output) of sql in database db, stopping at an error"""
    p = run_as_postgres([os.path.join(PG_BINDIR, "psql"), "-X", "-q", "-A", "-t",
                         "-v", "ON_ERROR_STOP=1", "-d", db],
                        input=sql, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        text=True, env=ENV, timeout=300)
    return p.returncode, p.stdout


def from_release(version):
    """Put release `version` in place before a block marked
    <!-- docs-test: from VERSION -->, as on a server that runs it with the
    library preloaded: the extension dropped in every database that has
    it, this tree's idempotency files replaced by that release's (built by
    docs_test.sh in IDEM_DOCS_OLD_SRC), the server restarted, the
    extension created again in those databases, at that version.  The
    block then installs the new files over the running server.
    (0, "") or (1, what went wrong); scripts/docs_test.sh installs this
    tree's files again after the file."""
    old = ENV.get("IDEM_DOCS_OLD_SRC", "")
    control = os.path.join(old, "idempotency.control")
    if not old or not os.path.isfile(control):
        return 1, f"no build of release {version} (IDEM_DOCS_OLD_SRC; docs_test.sh makes it from git)"
    m = re.search(r"^default_version\s*=\s*'([^']*)'", open(control).read(), re.M)
    if not m or m.group(1) != version:
        return 1, f"{control} is not release {version}"
    rc, out = psql_as_postgres("postgres", "SELECT datname FROM pg_database WHERE datallowconn")
    if rc != 0:
        return rc, out
    dbs = [d for d in out.split() if psql_as_postgres(
        d, "SELECT 1 FROM pg_extension WHERE extname = 'idempotency'")[1].strip() == "1"]
    for d in dbs:
        rc, out = psql_as_postgres(d, "DROP EXTENSION idempotency")
        if rc != 0:
            return rc, f"DROP EXTENSION in {d}: {out}"
    pg_config = ENV["PG_CONFIG"]
    ext = os.path.join(subprocess.run([pg_config, "--sharedir"], stdout=subprocess.PIPE,
                                      text=True, check=True).stdout.strip(), "extension")
    for f in os.listdir(ext):
        if f == "idempotency.control" or f.startswith("idempotency--"):
            os.remove(os.path.join(ext, f))
    p = subprocess.run(["make", "-s", "-C", old, "install", "PG_CONFIG=" + pg_config],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    if p.returncode != 0:
        return p.returncode, "make install of release " + version + ":\n" + p.stdout
    rc, out = restart()
    if rc != 0:
        return rc, out
    for d in dbs:
        rc, out = psql_as_postgres(d, "CREATE EXTENSION idempotency;\n"
                                   "SELECT extversion FROM pg_extension WHERE extname = 'idempotency'")
        if rc != 0 or out.strip() != version:
            return rc or 1, f"CREATE EXTENSION in {d} at {version}: {out}"
    return 0, ""


# A Debian server restarts with `systemctl restart postgresql`: in a shell
# block, that restarts the file's cluster (as run_ini does), quietly.  Any
# other systemctl call fails: the machine's own services are not the docs
# test's to touch.
SYSTEMCTL = """#!/bin/sh
# scripts/docs_test.py: `systemctl restart postgresql` restarts the file's cluster
case "$*" in
"restart postgresql" | "restart postgresql@"*)
\tcd / && exec env -u PGHOST -u PGPORT -u PGUSER -u PGDATABASE runuser -u postgres -- \\
\t\t"$PG_BINDIR/pg_ctl" restart -s -w -t 60 -D "$IDEM_PGDATA" -l "$IDEM_SERVER_LOG" -o "-p $PGPORT"
\t;;
esac
echo "systemctl $*: in the docs test only 'systemctl restart postgresql' runs" >&2
exit 1
"""


LINK = re.compile(r"\[[^\]]*\]\(([^()\s]+)\)")
CITED = re.compile(r"([A-Za-z0-9_./-]+\.md), \"([^\"]+)\"")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def prose(path):
    """[(line number, text)] of the file's lines outside code blocks, each
    code span emptied"""
    out, fence = [], None
    for n, line in enumerate(open(path, encoding="utf-8").read().split("\n"), 1):
        m = re.match(r"^\s*(```|~~~)", line)
        if m:
            fence = None if fence == m.group(1) else (fence or m.group(1))
            continue
        if fence is None:
            out.append((n, re.sub(r"`[^`]*`", "``", line)))   # not code spans
    return out


def headings(path):
    """(the file's headings, their GitHub anchors, HTML anchors included)"""
    titles, anchors, seen = set(), set(), {}
    for _, line in prose(path):
        anchors.update(HTML_ANCHOR.findall(line))
        m = HEADING.match(line)
        if not m:
            continue
        title = m.group(1)
        titles.add(title)
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return titles, anchors


def check_links(path):
    """the broken links and section citations of the file, as messages"""
    broken, base = [], os.path.dirname(path)
    for n, line in prose(path):
        for target in LINK.findall(line):
            if re.match(r"^[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(base, file)) if file else path
            if not os.path.exists(dest):
                broken.append(f"{path}:{n}: {target}: no such file")
            elif anchor and dest.endswith(".md") and anchor not in headings(dest)[1]:
                broken.append(f"{path}:{n}: {target}: no such heading in {os.path.relpath(dest, REPO)}")
        for file, title in CITED.findall(line):
            dest = next((d for d in (os.path.join(base, file), os.path.join(REPO, file))
                         if os.path.exists(d)), None)
            if dest and title not in headings(dest)[0]:
                broken.append(f"{path}:{n}: {file}, \"{title}\": no such heading")
    return broken


def verdict(rc, out, expected):
    """why a block that exited rc and printed out failed, or None"""
    if rc != 0:
        return f"exit {rc}"
    if "ERROR:" in out and not (expected and "ERROR:" in expected):
        return "an ERROR"
    if expected is not None and not matches(expected, out):
        return "output differs from the text"
    return None


def main():
    global TMP, STATE, SH_ENV
    if sys.argv[1] == "--links":
        broken = [b for f in sys.argv[2:] for b in check_links(f)]
        print("\n".join(broken) if broken else "links ok: " + " ".join(sys.argv[2:]))
        return 1 if broken else 0
    TMP = tempfile.mkdtemp(prefix="docs-test.", dir=os.environ.get("IDEM_TMPDIR") or None)
    os.chmod(TMP, 0o755)
    STATE = os.path.join(TMP, "shell-state")
    open(STATE, "w").close()
    os.mkdir(os.path.join(TMP, "bin"), 0o755)
    with open(os.path.join(TMP, "bin", "systemctl"), "w") as f:
        f.write(SYSTEMCTL)
    os.chmod(os.path.join(TMP, "bin", "systemctl"), 0o755)
    SH_ENV = dict(ENV, PATH=os.path.join(TMP, "bin") + ":" + ENV["PATH"])
    path = sys.argv[1]
    name = "docs (" + os.path.relpath(path, REPO) + ")"
    blocks = parse(path)
    total = passed = 0
    for line, lang, text, mark, expected in blocks:
        if lang not in RUN:
            continue
        where = f"{os.path.relpath(path, REPO)}:{line} ({lang})"
        if mark == "skip":
            print(f"skip   {where}")
            continue
        total += 1
        t0 = time.monotonic()
        why, out = None, ""
        if mark and mark.startswith("from "):
            rc, out = from_release(mark.split()[1])
            if rc != 0:
                why = f"{mark}: could not put that release in place"
        if why is None:
            if lang == "sql":
                rc, out = run_sql(text)
            elif lang == "ini":
                rc, out = run_ini(text)
            else:
                rc, out = run_sh(text)
            why = verdict(rc, out, expected)
        secs = time.monotonic() - t0
        if why:
            print(f"FAILED {where}: {why} ({secs:.1f}s)")
            print("---- block\n" + text.rstrip("\n"))
            if expected is not None:
                print("---- expected\n" + expected.rstrip("\n"))
            print("---- output\n" + out.rstrip("\n") + "\n----")
        else:
            passed += 1
            print(f"ok     {where} ({secs:.1f}s)")
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    print(f"{name}: {passed} of {total} tests passed.")
    return 0 if passed == total else 1


if __name__ == "__main__":
    sys.exit(main())
