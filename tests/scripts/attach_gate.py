"""Runs SCRIPT as __main__ once the file GO exists, so that a profiler attached by pid
meanwhile sees all of SCRIPT: attach_gate.py GO SCRIPT [ARGS...]. Prints `ready` first and
waits inside the eval loop (a sleep loop: the interpreter reaches safe points).

With GATE_TAKE_TOOLS=1 it first takes sys.monitoring tool ids 3 and 4, as other tools may.
With GATE_AFTER=FILE, once SCRIPT is done it prints `script done`, waits for FILE, then up to
5 s for tool ids 3 and 4 to be free again, and prints `tools after: NAME3 NAME4`."""
import os
import runpy
import sys
import time

go, script = sys.argv[1], os.path.abspath(sys.argv[2])
sys.argv = [script] + sys.argv[3:]
if os.environ.get("GATE_TAKE_TOOLS") == "1":
    sys.monitoring.use_tool_id(3, "gate-a")
    sys.monitoring.use_tool_id(4, "gate-b")
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.005)
runpy.run_path(script, run_name="__main__")
after = os.environ.get("GATE_AFTER")
if after:
    print("script done", flush=True)
    while not os.path.exists(after):
        time.sleep(0.005)
    deadline = time.monotonic() + 5
    tools = lambda: [sys.monitoring.get_tool(t) for t in (3, 4)]
    while any(tools()) and time.monotonic() < deadline:
        time.sleep(0.005)
    print("tools after:", *tools(), flush=True)
