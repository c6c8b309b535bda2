#!/usr/bin/env python3
"""sql-edition/generate.py -- build the SQL edition's install files.

The SQL that the C extension and the SQL edition share (the table, its
partitions and their maintenance, the views, the daily reconciliation, the
grants) is written once, in the C extension's released scripts
idempotency--1.1.sql and idempotency--1.1--1.2.sql: CREATE EXTENSION
idempotency runs the one and then the other.  This script reads both, drops
what only the C library can serve (every statement bound to MODULE_PATHNAME,
the known-absent filters' trigger, the update's renames and privilege
copies), and puts the edition's own SQL and PL/pgSQL around what is left:

    header, prelude.sql   stand-ins for the C helpers the shared SQL calls
                          (maintenance_settings, the statistics, owner_alive)
    shared SQL            1.1's script, then 1.2's update, filtered
    core.sql              the API in PL/pgSQL (idem_acquire, ...)
    the first partitions  maintain_partitions(), as CREATE EXTENSION does

Every rule below must match exactly as often as it says, or the build
fails: a new released script (a 1.3 update, say) makes the build stop
rather than quietly ship something else.

It writes, into the output folder:
    idempotency_sql.control, idempotency_sql--1.2.sql   CREATE EXTENSION
    idempotency_sql.psql                                psql -f (no extension)
    idempotency_sql.pgtle.sql                           pgtle.install_extension

Usage: generate.py REPO_ROOT OUT_DIR
"""
import os
import re
import sys

EXT = 'idempotency_sql'
VERSION = '1.2'


def split_statements(text):
    """Split SQL text into statements, each with the comments before it.
    Knows '...' strings, "..." identifiers, -- and /* */ comments and
    dollar quotes; psql meta-commands (a line starting with a backslash)
    are statements of their own."""
    out, cur, i, n = [], [], 0, len(text)
    start = 0
    while i < n:
        c = text[i]
        if c == '-' and text.startswith('--', i):
            j = text.find('\n', i)
            i = n if j < 0 else j + 1
            continue
        if c == '/' and text.startswith('/*', i):
            j = text.find('*/', i + 2)
            i = n if j < 0 else j + 2
            continue
        if c == '\\' and (i == 0 or text[i - 1] == '\n'):
            j = text.find('\n', i)
            j = n if j < 0 else j + 1
            out.append(text[start:j])
            start = i = j
            continue
        if c in "'\"":
            j = i + 1
            while j < n:
                if text[j] == c:
                    if j + 1 < n and text[j + 1] == c:
                        j += 2
                        continue
                    break
                j += 1
            i = j + 1
            continue
        if c == '$':
            m = re.match(r'\$([A-Za-z_][A-Za-z_0-9]*)?\$', text[i:])
            if m:
                tag = m.group(0)
                j = text.find(tag, i + len(tag))
                i = n if j < 0 else j + len(tag)
                continue
        if c == ';':
            j = i + 1
            if j < n and text[j] == '\n':
                j += 1
            out.append(text[start:j])
            start = i = j
            continue
        i += 1
    if text[start:].strip():
        out.append(text[start:])
    return out


def body(stmt):
    """The statement without its leading comments and white space."""
    stmt = re.sub(r'^\s*/\*.*?\*/', '', stmt, flags=re.S)
    lines = stmt.split('\n')
    k = 0
    while k < len(lines) and (lines[k].strip() == '' or lines[k].lstrip().startswith('--')):
        k += 1
    return '\n'.join(lines[k:]).strip()


# (file, pattern on the statement's body, expected count, why)
DROP_RULES = [
    ('both', r'^\\echo ', None, "the C scripts' guard; the edition has its own"),
    ('both', r"MODULE_PATHNAME", None, 'a C function: core.sql or prelude.sql has it in PL/pgSQL'),
    ('1.1', r'^CREATE TRIGGER zz_records_filter', 1, 'the known-absent filters (C only)'),
    ('1.1', r'^ALTER TABLE idempotency\.records ENABLE ALWAYS TRIGGER zz_records_filter', 1, 'the filters'),
    ('1.1', r'^SELECT idempotency\.maintain_partitions\(\);', 1, 'run at the end instead, with 1.2\'s layout'),
    ('1.1', r'^DO \$\$.*ALTER EXTENSION idempotency DROP TABLE', 1, 'done at the end instead (extension only)'),
    ('1.2', r"^DO \$\$.*cannot update extension", 1, 'an update check; the edition is installed whole'),
    ('1.2', r'^DO \$\$.*make_partition\(p\.relname', 1, 'no 1.1-layout partitions to remake: none were made'),
    ('1.2', r'^ALTER FUNCTION idempotency\.\w+\(.*RENAME TO \w+_1_1', 4, "the update's renames of C functions"),
    ('1.2', r'^DO \$\$.*aclexplode', 1, "the update's copy of privileges between C functions"),
    ('1.2', r'^DROP FUNCTION idempotency\.\w+_1_1\(', 4, "the update's drops of the renamed C functions"),
]


def c_function_names(stmts):
    """Signatures (name) of the functions a script binds to the library."""
    names = set()
    for s in stmts:
        b = body(s)
        if 'MODULE_PATHNAME' in b:
            m = re.match(r'CREATE (?:OR REPLACE )?FUNCTION idempotency\.(\w+)\(', b)
            if m:
                names.add(m.group(1))
    return names


def filter_script(name, text, c_names, counts):
    kept = []
    for s in split_statements(text):
        b = body(s)
        if not b:
            kept.append(s)
            continue
        dropped = False
        for i, (where, pat, _, _) in enumerate(DROP_RULES):
            if where not in ('both', name):
                continue
            if re.search(pat, b, re.S):
                counts[i] += 1
                dropped = True
                break
        if not dropped:
            m = re.match(r'REVOKE ALL ON FUNCTION idempotency\.(\w+)\(', b)
            if m and m.group(1) in c_names:
                counts['revoke'] = counts.get('revoke', 0) + 1
                dropped = True
        if dropped:
            # keep the comments before a dropped statement out too, but
            # leave a trace of where it was
            kept.append('-- [sql edition: not here] %s\n' % b.split('\n')[0][:100])
        else:
            kept.append(s)
    return ''.join(kept)


def main():
    root, out = sys.argv[1], sys.argv[2]
    here = os.path.join(root, 'sql-edition')
    read = lambda p: open(p, encoding='utf-8').read()
    v11 = read(os.path.join(root, 'idempotency--1.1.sql'))
    v12 = read(os.path.join(root, 'idempotency--1.1--1.2.sql'))
    prelude = read(os.path.join(here, 'prelude.sql'))
    core = read(os.path.join(here, 'core.sql'))

    c_names = c_function_names(split_statements(v11)) | c_function_names(split_statements(v12))
    counts = {i: 0 for i in range(len(DROP_RULES))}
    shared = ('\n-- ======== shared: idempotency--1.1.sql, filtered ========\n\n'
              + filter_script('1.1', v11, c_names, counts)
              + '\n-- ======== shared: idempotency--1.1--1.2.sql, filtered ========\n\n'
              + filter_script('1.2', v12, c_names, counts))
    bad = [(DROP_RULES[i][1], DROP_RULES[i][2], counts[i]) for i in range(len(DROP_RULES))
           if (DROP_RULES[i][2] is None and counts[i] == 0)
           or (DROP_RULES[i][2] is not None and counts[i] != DROP_RULES[i][2])]
    if bad:
        for pat, want, got in bad:
            sys.stderr.write('generate.py: rule %r matched %d times, expected %s\n'
                             % (pat, got, want if want is not None else 'at least 1'))
        sys.exit(1)
    # Only ALTER EXTENSION idempotency in the shared SQL is the one above.
    if re.search(r'ALTER EXTENSION idempotency\b', re.sub(r'--[^\n]*', '', shared)):
        sys.stderr.write('generate.py: ALTER EXTENSION idempotency left in the shared SQL\n')
        sys.exit(1)

    def script(mode):
        ext = mode != 'plain'
        head = ('/* %s--%s.sql: the SQL edition of idempotency, generated by '
                'sql-edition/generate.py; do not edit */\n\n' % (EXT, VERSION))
        if ext:
            head += '\\echo Use "CREATE EXTENSION %s" to load this file. \\quit\n\n' % EXT
        else:
            head = ('/* %s.psql: the SQL edition of idempotency for psql -f, generated by '
                    'sql-edition/generate.py; do not edit */\n\n'
                    '\\set ON_ERROR_STOP on\n'
                    'BEGIN;\n'
                    'CREATE SCHEMA idempotency;\n'
                    "COMMENT ON SCHEMA idempotency IS 'idempotency keys (SQL edition %s)';\n\n" % (EXT, VERSION))
        text = head + prelude + shared + core
        text += '\n-- ======== the partitions for the coming period ========\n'
        text += 'SELECT idempotency.maintain_partitions();\n'
        if ext:
            text += ('\nDO $$\nDECLARE\n    part regclass;\nBEGIN\n'
                     '    FOR part IN SELECT p.partition FROM idempotency.partitions p WHERE NOT p.is_default LOOP\n'
                     "        EXECUTE format('ALTER EXTENSION %s DROP TABLE %%s', part);\n"
                     '    END LOOP;\nEND\n$$;\n' % EXT)
        else:
            # pg_extension_config_dump only works in an extension script
            text = re.sub(r"^SELECT pg_catalog\.pg_extension_config_dump\([^;]*\);\n",
                          '-- (pg_dump keeps these tables anyway: no extension)\n', text, flags=re.M)
            text += ("\nCOMMENT ON SCHEMA idempotency IS 'idempotency keys (SQL edition %s, installed by psql -f)';\n"
                     'COMMIT;\n' % VERSION)
        return text

    os.makedirs(out, exist_ok=True)
    ext_sql = script('extension')
    with open(os.path.join(out, '%s--%s.sql' % (EXT, VERSION)), 'w') as f:
        f.write(ext_sql)
    with open(os.path.join(out, '%s.control' % EXT), 'w') as f:
        f.write("# %s: the SQL edition of idempotency (generated by sql-edition/generate.py)\n"
                "comment = 'exactly-once write endpoints in SQL and PL/pgSQL: idempotency keys with claim, replay and lease'\n"
                "default_version = '%s'\n"
                "relocatable = false\n"
                "schema = idempotency\n"
                "superuser = false\n"
                "trusted = true\n" % (EXT, VERSION))
    with open(os.path.join(out, '%s.psql' % EXT), 'w') as f:
        f.write(script('plain'))
    # pg_tle: the same script, without the psql guard, as the argument of
    # pgtle.install_extension (a dollar quote that the script never uses)
    # pg_tle takes no control file: no schema = idempotency to make the
    # schema, so the script makes it
    tle_body = re.sub(r'^\\echo [^\n]*\n', 'CREATE SCHEMA idempotency;\n', ext_sql, count=1, flags=re.M)
    if '$_idem_tle_$' in tle_body:
        sys.stderr.write('generate.py: the pg_tle quote occurs in the script\n')
        sys.exit(1)
    with open(os.path.join(out, '%s.pgtle.sql' % EXT), 'w') as f:
        f.write("/* %s.pgtle.sql: install the SQL edition through pg_tle (generated; checked against a stand-in of pgtle.install_extension by sql-edition/pgtle_test.sh: pg_tle itself is not installed on the build machine) */\n"
                "SELECT pgtle.install_extension(\n    '%s',\n    '%s',\n"
                "    'exactly-once write endpoints in SQL and PL/pgSQL',\n$_idem_tle_$\n%s$_idem_tle_$\n);\n"
                % (EXT, EXT, VERSION, tle_body))


if __name__ == '__main__':
    main()
