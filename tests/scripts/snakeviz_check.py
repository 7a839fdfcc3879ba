"""Opens a pstats file the way snakeviz does, in snakeviz's own code, and through its server.

usage: snakeviz_check.py PROF SCRIPT
Prints JSON: the table's row count, the call graph's children of each function of SCRIPT
(after snakeviz drops functions that neither call nor are called), and whether the page
snakeviz serves for the file names SCRIPT's functions."""
import json
import os
import pstats
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

from snakeviz.stats import json_stats, table_rows

prof, script = sys.argv[1], sys.argv[2]
stats = pstats.Stats(prof)
rows = table_rows(stats)
graph = json_stats(stats)
children = {k.split(":", 1)[1]: sorted(c.split(":", 1)[1] for c in v["children"])
            for k, v in graph.items() if k.startswith(script + ":")}

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
server = subprocess.Popen([sys.executable, "-m", "snakeviz", "--server", "-H", "127.0.0.1",
                           "-p", str(port), prof], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
page = ""
try:
    url = f"http://127.0.0.1:{port}/snakeviz/{urllib.parse.quote(os.path.abspath(prof), safe='')}"
    for _ in range(100):
        try:
            page = urllib.request.urlopen(url, timeout=5).read().decode()
            break
        except OSError:
            time.sleep(0.1)
finally:
    server.kill()
    server.wait()
print(json.dumps({"rows": len(rows), "children": children,
                  "page_names_fib": "py_workload.py:8(fib)" in page}))
