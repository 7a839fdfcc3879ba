"""Drives libtracer_pycount.so as tracerd's script would, for tests/pycount.rs.

usage: pycount_workload.py MODE [ARGS...]

plain OUT                the workload alone (its stdout is the reference)
count SO FILE OUT        the workload counted, with ground truth from sys.setprofile and
                         threading.setprofile (the events cProfile counts) in OUT/gt.<pid>
                         for this process and its forked child
profile SO FILE          the workload counted by the profile function (3.10, 3.11), which
                         takes the place of sys.setprofile: no ground truth in this run
handover SO FILE         wl_fib(10) counted by the profile function, then the program sets
                         a profile function of its own: the counter hands over and holds
                         it until tracerd answers (prints how long, in seconds)
truth OUT                the workload under the ground truth alone, into OUT/gt.parent and
                         OUT/gt.child (to compare with a profile run)
cprofile SO FILE OUT     the single-threaded part counted while cProfile runs too; its
                         stats in OUT/cprofile
cancelled SO FILE        start() on a cancelled file
refuse SO FILE WHY       refuse()
orphan SO FILE N         start() (refused if no tracerd holds the file's lock), then, after
                         a line on stdin, N calls counted
bad SO FILE...           start() on each FILE must raise RuntimeError
twice SO FILE1 FILE2     wl_fib(10) counted into FILE1, which tracerd then stops (no stop()),
                         and wl_fib(12) into FILE2 by a second start()

Ground-truth lines: `call FILE LINE QUALNAME NCALLS PRIMITIVE` and `edge CALLER... CALLEE...
NCALLS PRIMITIVE` (tab-separated; a caller or callee is FILE LINE NAME). Workload functions
are named wl_*."""
import importlib.machinery
import importlib.util
import mmap
import os
import struct
import sys
import threading
import warnings

# The workload's threads are joined before it forks, but one may not have left the kernel yet.
warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)
# None before 3.12: the counter is a profile function there (modes profile and truth).
MON = getattr(sys, "monitoring", None)
EV = MON.events if MON else None
EVENTS = ("PY_START", "PY_RESUME", "PY_THROW", "PY_RETURN", "PY_YIELD", "PY_UNWIND")
STATE_OFFSET = 12
STOPPED = 3


# --- the workload -------------------------------------------------------------------------

def wl_fib(n):
    return n if n < 2 else wl_fib(n - 1) + wl_fib(n - 2)


def wl_even(n):
    return True if n == 0 else wl_odd(n - 1)


def wl_odd(n):
    return False if n == 0 else wl_even(n - 1)


def wl_leaf(x):
    return x + 1


def wl_key(x):
    return -x


def wl_gen(n):
    for i in range(n):
        yield wl_leaf(i)


def wl_delegate(n):
    yield from wl_gen(n)
    yield from wl_gen(n)


def wl_consume(n):
    total = 0
    for v in wl_delegate(n):
        total += v
    return total


def wl_raise(depth):
    if depth == 0:
        raise ValueError("deep")
    return wl_raise(depth - 1)


def wl_catch(depth):
    try:
        wl_raise(depth)
    except ValueError:
        return 1
    return 0


def wl_gen_catch():
    n = 0
    while True:
        try:
            yield n
        except KeyError:
            n += 1
            wl_leaf(n)


def wl_throw(k):
    g = wl_gen_catch()
    next(g)
    for _ in range(k):
        g.throw(KeyError())
    g.close()
    return k


class WlThing:
    def wl_method(self, x):
        return wl_leaf(x) * 2


def wl_outer(n):
    def wl_inner(i):
        return wl_leaf(i)

    return sum(wl_inner(i) for i in range(n))


def wl_café(n):
    return wl_leaf(n)


def wl_sorted(n):
    return sorted(range(n), key=wl_key)[0]


def wl_single():
    return [wl_fib(21), wl_even(30), wl_consume(50), wl_catch(20), wl_throw(5),
            WlThing().wl_method(3), wl_outer(10), wl_café(1), wl_sorted(10)]


def wl_thread_work(k):
    return wl_fib(12 + k) + wl_consume(10 * k) + wl_catch(k)


def wl_threads():
    out = [None] * 4

    def wl_run(i):
        out[i] = wl_thread_work(i)

    threads = [threading.Thread(target=wl_run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def wl_child_work():
    r = wl_fib(14) + wl_consume(20) + wl_catch(5)
    t = threading.Thread(target=wl_thread_work, args=(2,))
    t.start()
    t.join()
    return r


def wl_fork(hooks):
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        hooks.forked()
        r = wl_child_work()
        os.write(1, f"child {r}\n".encode())
        hooks.child_done()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def workload(hooks):
    return [wl_single(), wl_threads(), wl_fork(hooks)]


# --- ground truth -------------------------------------------------------------------------

class GroundTruth:
    """Counts calls and caller pairs as the counter should: per thread, a call is primitive
    when its code is not on the thread's stack, a pair when no frame of the callee called by
    the same caller is; pairs count when the callee leaves; a leave that is not the top's is
    a frame that began before counting and is ignored."""

    def __init__(self):
        self.gen = 0
        self.lock = threading.Lock()
        self.states = []
        self.codes = {}
        self.local = threading.local()

    def state(self):
        st = getattr(self.local, "st", None)
        if st is None or st[0] != self.gen:
            st = (self.gen, [], {}, {})
            self.local.st = st
            with self.lock:
                self.states.append(st)
        return st

    def hook(self, frame, event, arg):
        if event == "call":
            _, stack, calls, _ = self.state()
            code = frame.f_code
            self.codes[id(code)] = code
            caller = stack[-1][0] if stack else None
            primitive = pair = True
            for c, cl, _ in stack:
                if c is code:
                    primitive = False
                    if cl is caller:
                        pair = False
            c = calls.setdefault(id(code), [0, 0])
            c[0] += 1
            c[1] += primitive
            stack.append((code, caller, pair))
        elif event == "return":
            _, stack, _, edges = self.state()
            if stack and stack[-1][0] is frame.f_code:
                code, caller, pair = stack.pop()
                if caller is not None:
                    e = edges.setdefault((id(caller), id(code)), [0, 0])
                    e[0] += 1
                    e[1] += pair

    def install(self):
        threading.setprofile(self.hook)
        sys.setprofile(self.hook)

    def uninstall(self):
        sys.setprofile(None)
        threading.setprofile(None)

    def forked(self):
        # The child counts afresh: the frames it inherited are the parent's calls.
        self.gen += 1
        self.states = []

    def write(self, path):
        calls, edges = {}, {}
        for gen, _, c, e in self.states:
            if gen != self.gen:
                continue
            for k, v in c.items():
                s = calls.setdefault(name(self.codes[k]), [0, 0])
                s[0] += v[0]
                s[1] += v[1]
            for (a, b), v in e.items():
                s = edges.setdefault((name(self.codes[a]), name(self.codes[b])), [0, 0])
                s[0] += v[0]
                s[1] += v[1]
        with open(path, "w", encoding="utf-8") as f:
            for k, v in calls.items():
                f.write("\t".join(["call", *k, str(v[0]), str(v[1])]) + "\n")
            for (a, b), v in edges.items():
                f.write("\t".join(["edge", *a, *b, str(v[0]), str(v[1])]) + "\n")


def name(code):
    # 3.10 has no co_qualname: the counter (like cProfile) names functions by co_name there.
    return (code.co_filename, str(code.co_firstlineno), getattr(code, "co_qualname", code.co_name))


# --- the counter, as tracerd's script drives it -------------------------------------------

def load(so):
    loader = importlib.machinery.ExtensionFileLoader("_tracer_pycount", so)
    spec = importlib.util.spec_from_file_location("_tracer_pycount", so, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def free_tool_id():
    return next(i for i in range(3, 6) if MON.get_tool(i) is None)


def callbacks(m):
    return [(getattr(EV, e), getattr(m, e.lower())) for e in EVENTS]


def turn_on(m, tool):
    MON.use_tool_id(tool, "tracer-pycount")
    mask = 0
    for event, f in callbacks(m):
        MON.register_callback(tool, event, f)
        mask |= event
    MON.set_events(tool, mask)


def turn_off(m, tool):
    MON.set_events(tool, 0)
    for event, _ in callbacks(m):
        MON.register_callback(tool, event, None)
    MON.free_tool_id(tool)


def set_state(path, value):
    # What tracerd does to end a session.
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 4096) as mm:
        struct.pack_into("<I", mm, STATE_OFFSET, value)


class NoHooks:
    def forked(self):
        pass

    def child_done(self):
        pass


class CountHooks:
    def __init__(self, m, out, gt):
        self.m, self.out, self.gt = m, out, gt

    def forked(self):
        self.gt.forked()

    def child_done(self):
        self.gt.uninstall()
        self.gt.write(os.path.join(self.out, f"gt.{os.getpid()}"))
        self.m.stop()
        # Callbacks after stop() do nothing (and must not crash).
        wl_fib(5)


class ProfileHooks:
    def __init__(self, m):
        self.m = m

    def forked(self):
        pass

    def child_done(self):
        assert self.m.stop() == PROFILE_FUNCTION
        # Not counted (the profile function takes itself off at its next event).
        wl_fib(5)


class TruthHooks:
    def __init__(self, gt, out):
        self.gt, self.out = gt, out

    def forked(self):
        self.gt.forked()

    def child_done(self):
        self.gt.uninstall()
        self.gt.write(os.path.join(self.out, "gt.child"))


PROFILE_FUNCTION = 0x100


def main():
    mode = sys.argv[1]
    if mode == "plain":
        print(workload(NoHooks()))
    elif mode == "count":
        so, path, out = sys.argv[2:5]
        m = load(so)
        tool = free_tool_id()
        assert m.start(path, tool, MON.DISABLE) is True
        turn_on(m, tool)
        gt = GroundTruth()
        gt.install()
        # Recursion from the bottom of the counter's stack (this frame began before it).
        wl_even(6)
        result = workload(CountHooks(m, out, gt))
        gt.uninstall()
        set_state(path, STOPPED)
        code = wl_leaf.__code__
        assert m.py_start(code, 0) is MON.DISABLE
        assert m.py_return(code, 0, None) is MON.DISABLE
        assert m.py_unwind(code, 0, ValueError()) is None
        wl_fib(10)  # after tracerd stopped the session: not counted
        turn_off(m, tool)
        assert m.stop() == tool
        gt.write(os.path.join(out, f"gt.{os.getpid()}"))
        print(result)
    elif mode == "profile":
        so, path = sys.argv[2:4]
        m = load(so)
        assert m.start_profile(path) is True
        # Recursion from the bottom of the counter's stack (this frame began before it).
        wl_even(6)
        result = workload(ProfileHooks(m))
        set_state(path, STOPPED)
        wl_fib(10)  # after tracerd stopped the session: not counted
        assert m.stop() == PROFILE_FUNCTION
        print(result)
    elif mode == "handover":
        import time
        so, path = sys.argv[2:4]
        m = load(so)
        assert m.start_profile(path) is True
        wl_fib(10)
        t0 = time.monotonic()
        sys.setprofile(lambda frame, event, arg: None)
        held = time.monotonic() - t0
        sys.setprofile(None)
        wl_fib(8)  # the probes' now
        assert m.stop() == PROFILE_FUNCTION
        print("held", held)
    elif mode == "truth":
        out = sys.argv[2]
        gt = GroundTruth()
        gt.install()
        wl_even(6)
        result = workload(TruthHooks(gt, out))
        gt.uninstall()
        gt.write(os.path.join(out, "gt.parent"))
        print(result)
    elif mode == "cprofile":
        import cProfile
        import pstats
        so, path, out = sys.argv[2:5]
        m = load(so)
        tool = free_tool_id()
        assert m.start(path, tool, MON.DISABLE)
        turn_on(m, tool)
        prof = cProfile.Profile()
        prof.enable()
        wl_even(6)
        wl_single()
        prof.disable()
        turn_off(m, tool)
        assert m.stop() == tool
        with open(os.path.join(out, "cprofile"), "w", encoding="utf-8") as f:
            for (file, line, fn), (cc, nc, _, _, callers) in pstats.Stats(prof).stats.items():
                callee = [file, str(line), fn]
                f.write("\t".join(["call", *callee, str(nc), str(cc)]) + "\n")
                for (cf, cl, cn), v in callers.items():
                    f.write("\t".join(["edge", cf, str(cl), cn, *callee, str(v[0]), str(v[1])]) + "\n")
    elif mode == "cancelled":
        so, path = sys.argv[2:4]
        m = load(so)
        print("start", m.start(path, free_tool_id(), MON.DISABLE))
        # Never started: the callbacks do nothing.
        code = wl_leaf.__code__
        print("callbacks", m.py_start(code, 0), m.py_return(code, 0, 1), m.py_unwind(code, 0, None))
        print("stop", m.stop())
    elif mode == "refuse":
        so, path, why = sys.argv[2:5]
        load(so).refuse(path, why)
        print("refused")
    elif mode == "orphan":
        so, path, n = sys.argv[2], sys.argv[3], int(sys.argv[4])
        m = load(so)
        tool = free_tool_id()
        started = m.start(path, tool, MON.DISABLE)
        print("started", started, flush=True)
        if not started:
            print("stop", m.stop())
            return
        # tracerd lets go of the file now.
        sys.stdin.readline()
        turn_on(m, tool)
        for i in range(n):
            wl_leaf(i)
        turn_off(m, tool)
        print("stop", m.stop())
    elif mode == "bad":
        m = load(sys.argv[2])
        for path in sys.argv[3:]:
            try:
                m.start(path, 3, MON.DISABLE)
            except RuntimeError as e:
                print("RuntimeError", e)
            else:
                print("no error for", path)
        print("stop", m.stop())
    elif mode == "twice":
        so, first, second = sys.argv[2:5]
        m = load(so)
        tool = free_tool_id()
        assert m.start(first, tool, MON.DISABLE)
        turn_on(m, tool)
        wl_fib(10)
        set_state(first, STOPPED)
        turn_off(m, tool)
        # Locations a stopped counter disabled stay so, for every later user of the tool id.
        MON.restart_events()
        tool = free_tool_id()
        assert m.start(second, tool, MON.DISABLE)
        turn_on(m, tool)
        wl_fib(12)
        turn_off(m, tool)
        print("stop", m.stop() == tool)
    else:
        sys.exit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
