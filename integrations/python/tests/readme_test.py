#!/usr/bin/env python3
"""integrations/python/tests/readme_test.py README.md DIR -- run the
README's code blocks as written, in order, in DIR (a copy of
integrations/python).

- ```sh: run by bash (set -e) in DIR; the variables it sets carry over to
  the next block (each runs with set -a and leaves `export -p` behind);
  its background processes keep running (until the end: then what the
  README did not stop is).  A ```text block right after it
  is its expected output: each of its lines must match a line of the
  output, in order ("..." matches anything).
- ```python preceded by <!-- file: NAME -->: written to DIR/NAME.
- A block after <!-- docs-test: skip --> is not run (apt-get lines).
Any other block is an error.  Prints "ok - ..." / "not ok - ..." per
sh block; exits 1 if one failed."""

import fnmatch
import os
import re
import signal
import subprocess
import sys


def blocks(text):
    """(line number, language, body, marker) of each fenced block; marker
    is the HTML comment on the line before it, if any."""
    lines = text.split("\n")
    i, out = 0, []
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and lines[j] != "```":
            j += 1
        prev = lines[start - 1].strip() if start > 0 else ""
        marker = prev if prev.startswith("<!--") else None
        out.append((start + 1, lang, "\n".join(lines[start + 1:j]) + "\n", marker))
        i = j + 1
    return out


def matches(expected, output):
    """Whether every expected line matches an output line, in order."""
    got = output.splitlines()
    k = 0
    for want in expected.splitlines():
        pattern = fnmatch.translate(want.replace("[", "[[]").replace("...", "*"))
        while k < len(got) and not re.match(pattern, got[k].rstrip("\r")):
            k += 1
        if k == len(got):
            return False
        k += 1
    return True


def main():
    readme, cwd = sys.argv[1], sys.argv[2]
    state = os.path.join(cwd, ".readme-state")
    failed = 0
    groups = []  # each block's process group: its servers are in it
    try:
        failed = run(readme, cwd, state, groups)
    finally:
        for pgid in groups:
            try:
                os.killpg(pgid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    return 1 if failed else 0


def run(readme, cwd, state, groups):
    failed = 0
    items = blocks(open(readme).read())
    i = 0
    while i < len(items):
        line, lang, body, marker = items[i]
        i += 1
        if marker == "<!-- docs-test: skip -->":
            continue
        if lang == "python" and marker and marker.startswith("<!-- file:"):
            name = marker[len("<!-- file:"):-len("-->")].strip()
            with open(os.path.join(cwd, name), "w") as f:
                f.write(body)
            continue
        if lang != "sh":
            print("not ok - README line %d: a %s block that is not run" % (line, lang or "bare"))
            failed += 1
            continue
        expected = None
        if i < len(items) and items[i][1] == "text":
            expected = items[i][2]
            i += 1
        script = "set -a\n[ -f %s ] && . %s\nset -e\n%s\nexport -p >%s\n" % (state, state, body, state)
        outfile = os.path.join(cwd, ".readme-out")
        with open(outfile, "w") as out:
            # output to a file: a background server keeps no pipe open
            proc = subprocess.Popen(["bash", "-c", script], cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            groups.append(proc.pid)
            rc = proc.wait()
        output = open(outfile).read()
        what = "README line %d: %s" % (line, body.strip().splitlines()[0])
        if rc == 0 and (expected is None or matches(expected, output)):
            print("ok - " + what, flush=True)
        else:
            failed += 1
            print("not ok - " + what + (" (exit %d)" % rc if rc else " (output differs)"), flush=True)
            for text in output.splitlines()[-30:]:
                print("#   " + text)
            if expected is not None:
                print("#   expected:")
                for text in expected.splitlines():
                    print("#   " + text)
    return failed


if __name__ == "__main__":
    sys.exit(main())
