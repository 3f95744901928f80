"""What a fork of the warm interpreter (warm.py) does to become the rank that asked: `become` takes
the asker's descriptors, environment (also where /proc/PID/environ shows it), directory, umask,
command line and module path, draws its own random state, runs the hook as a fresh rank's
interpreter does, then the script as `python` would, and exits as Python exits. Stdlib only.
"""
import os
import signal
import sys

from .warm_client import is_torchrun

ZYGOTE_PATH = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]  # a rank's replaces it


def _stat_pair(at):
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # fields[0] is proc(5)'s field 3
    return int(fields[at]), int(fields[at + 1])


def env_block():
    """(start, end) of this process's exec-time environment: what a fork's must fit in."""
    return _stat_pair(47)  # env_start, env_end (proc(5) fields 50 and 51)


def arg_block():
    """(start, end) of this process's exec-time arguments (proc(5) fields 48 and 49)."""
    return _stat_pair(45)


def _write_over(start, end, block):
    import ctypes

    buf = (ctypes.c_char * (end - start)).from_address(start)
    buf[:] = block.ljust(end - start, b"\0")


def env_bytes(env):
    return sum(len(k.encode()) + len(v.encode()) + 2 for k, v in env.items())


def own_environ(env):
    """os.environ becomes `env`, and so does the block /proc/self/environ reads (the exec-time
    strings, which the zygote's padding makes room for): the fork is found by its run key."""
    os.environ.clear()
    os.environ.update(env)
    start, end = env_block()
    block = b"".join(k.encode() + b"=" + v.encode() + b"\0" for k, v in env.items())
    if len(block) > end - start:
        raise OSError(f"the rank's environment ({len(block)} bytes) does not fit the zygote's ({end - start})")
    _write_over(start, end, block)


TITLE_MAX = 4095  # Linux shows a title written over the arguments up to its first NUL within a page


def own_cmdline(argv):
    """/proc/PID/cmdline shows the rank's command line, not the zygote's (`ps`, `top`, `pgrep -f
    train.py`, psutil, the GPU check's list of who holds a GPU): written over the zygote's exec-time
    arguments (its padding argument makes room) as setproctitle(3) does, the arguments joined by
    blanks and the area's last byte not NUL, so Linux shows the title up to its NUL and not the
    NULs after it. An argument that does not fit is left out with those after it."""
    start, end = arg_block()
    room = min(end - start - 2, TITLE_MAX)  # a NUL after it, always: Linux would read on into the environment
    title = b""
    for a in argv:
        part = (b" " if title else b"") + os.fsencode(a)
        if len(title) + len(part) > room:
            break
        title += part
    _write_over(start, end - 1, title)  # NULs after it
    _write_over(end - 1, end, b" ")  # the sign of a title (fs/proc/base.c get_mm_cmdline)


def target(orig_argv):
    """(kind, what, argv, unbuffered) of `python [-u] SCRIPT|-m MODULE|-c CODE ARGS`, None for any
    other form (another option: the asker starts cold, as it would have)."""
    args, unbuffered = list(orig_argv[1:]), False
    while args and args[0] == "-u":
        unbuffered = True
        args.pop(0)
    if not args:
        return None
    if args[0] in ("-m", "-c"):
        if len(args) < 2:
            return None
        kind, what = args[0], args[1]
        return kind, what, [kind if kind == "-c" else what, *args[2:]], unbuffered
    if args[0].startswith("-"):
        return None
    return "script", args[0], list(args), unbuffered


def become(req, fds):
    """In the fork: be the rank the request describes, run its script, exit as Python would."""
    os.setsid()
    for fd, new in zip(fds, (0, 1, 2)):
        os.dup2(fd, new)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    # the zygote's handlers undone (SIGPIPE stays ignored, as Python leaves it in any process)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
    os.umask(int(req["umask"]))
    env = dict(req["env"])
    warm = env.pop("CLUSTERCTL_WARM", None)  # the hook, run again in here, runs the rank itself
    own_environ(env)
    own_cmdline(req["argv"])
    os.chdir(req["cwd"])
    kind, what, argv, unbuffered = target(req["argv"])
    unbuffered = unbuffered or bool(os.environ.get("PYTHONUNBUFFERED"))  # as `python` reads its environment
    import io

    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    for n, name in ((1, "stdout"), (2, "stderr")):
        raw = io.FileIO(n, "w", closefd=False)
        setattr(sys, name, io.TextIOWrapper(raw if unbuffered or n == 2 else io.BufferedWriter(raw),
                                            write_through=unbuffered or n == 2, line_buffering=n == 2,
                                            errors="backslashreplace" if n == 2 else "strict"))
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    sys.argv, sys.orig_argv = argv, list(req["argv"])
    mine = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.path.dirname(os.path.abspath(what)) if kind == "script" else os.getcwd(), *mine,
                   *[p for p in sys.path[1:] if p not in ZYGOTE_PATH and p not in mine]]
    reseed()
    hook()
    if warm and is_torchrun(req["argv"]):
        os.environ["CLUSTERCTL_WARM"] = warm  # torchrun forked: its workers ask in turn
    run(kind, what)


def reseed():
    """Draws the forks would otherwise share with the zygote and each other: numpy's global
    random state (Python's `random` redraws itself after a fork), torch's intra-op threads."""
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()
    torch = sys.modules.get("torch")
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def hook():
    """The rank's hook, run as a fresh rank's interpreter runs it at start: the first
    sitecustomize on the rank's PYTHONPATH (the run directory's), made `sitecustomize`."""
    import importlib.machinery
    import importlib.util

    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", paths)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


def run(kind, what):
    """The script as `python` runs it, then Python's exit: atexit handlers, the streams flushed,
    the exit code (an uncaught exception: sys.excepthook, 1)."""
    import atexit
    import runpy

    code, interrupted = 0, False
    try:
        if kind == "-m":
            runpy.run_module(what, run_name="__main__", alter_sys=True)
        elif kind == "-c":
            exec(compile(what, "<string>", "exec"), {"__name__": "__main__"})
        else:
            runpy.run_path(what, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else (print(e.code, file=sys.stderr) or 1))
    except BaseException as e:  # noqa: BLE001 - as the interpreter does: the hook, then exit 1
        sys.excepthook(*sys.exc_info())
        code, interrupted = 1, isinstance(e, KeyboardInterrupt)  # that one ends by SIGINT (Python >= 3.8)
    try:
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)
