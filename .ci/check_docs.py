"""Run every ```python block of the given Markdown files and compare with the ```text block after it.

Blocks of one file run in order in one namespace; a block with title="NAME.py" is written to
/tmp/deferax-docs/NAME.py and run there as a script (`python NAME.py`). Prints a diff for
every output block that does not match.
"""

import contextlib
import difflib
import io
import linecache
import os
import re
import subprocess
import sys
import traceback

FENCE = re.compile(r"^```(\w*)([^\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)
SCRIPT_DIR = "/tmp/deferax-docs"
bad = 0
fill = "--fill" in sys.argv  # write the outputs into empty ```text blocks
update = "--update" in sys.argv  # ... and over differing ones (review the diff before committing)
for path in [a for a in sys.argv[1:] if a not in ("--fill", "--update")]:
    fills = []
    text = open(path).read()
    blocks = [(m.group(1), m.group(2), m.group(3), m.start(), m.end()) for m in FENCE.finditer(text)]
    ns = {"__name__": "__main__"}
    print(f"== {path}: {len(blocks)} fenced blocks")
    for i, (lang, attrs, code, _start, end) in enumerate(blocks):
        if lang != "python":
            continue
        title = re.search(r'title="([^"]+)"', attrs)
        if title:
            os.makedirs(SCRIPT_DIR, exist_ok=True)
            name = title.group(1)
            with open(os.path.join(SCRIPT_DIR, name), "w") as f:
                f.write(code)
            r = subprocess.run([sys.executable, name], cwd=SCRIPT_DIR, capture_output=True, text=True)
            out = r.stdout + r.stderr
            if r.returncode:
                print(f"!! {path} block {i} ({name}) failed:\n{out}")
                bad += 1
        else:
            buf = io.StringIO()
            # Named after the page, its source known to linecache: a reason that quotes the
            # reader's line (`explain`) shows `forward-reverse.py:2 `loss = ...``, as it would
            # for a reader's own script, not a made-up path without the code.
            filename = os.path.basename(path).replace(".md", ".py")
            linecache.cache[filename] = (len(code), None, code.splitlines(keepends=True), filename)
            try:
                with contextlib.redirect_stdout(buf):
                    exec(compile(code, filename, "exec"), ns)
            except Exception:
                print(f"!! {path} block {i} raised:\n{code}\n{traceback.format_exc()}")
                bad += 1
            out = buf.getvalue()
        nxt = blocks[i + 1] if i + 1 < len(blocks) else None
        if nxt and nxt[0] == "text" and text[end : nxt[3]].strip() == "":
            want = [line.rstrip() for line in nxt[2].rstrip("\n").split("\n")]
            got = [line.rstrip() for line in out.rstrip("\n").split("\n")]
            if (fill and nxt[2].strip() == "") or (update and want != got):
                fills.append((nxt[3], nxt[4], "```text\n" + "\n".join(got) + "\n```"))
            elif want != got:
                bad += 1
                print(f"!! {path} block {i}: output differs")
                print("\n".join(difflib.unified_diff(want, got, "doc", "run", lineterm="")))
            else:
                print(f"ok {path} block {i}: output matches")
        else:
            print(f"ok {path} block {i}: ran" + (f"\n--- output:\n{out}" if out.strip() else ""))
    if fills:
        for s0, e0, rep in reversed(fills):
            text = text[:s0] + rep + text[e0:]
        open(path, "w").write(text)
        print(f"filled {len(fills)} blocks in {path}")
print("FAILURES:", bad)
sys.exit(1 if bad else 0)
