"""Every CLI subcommand against hostile arguments: a short error and a non-zero exit,
never a Python traceback.

The subcommands and their arguments are enumerated from the argparse tree
(``kspeedfs.cli.app.build_parser``), so a new subcommand or option is covered without
editing this file: every positional gets hostile values, every option a table of bad
values chosen by its name (or, for an unknown one, by its ``type``). Each case runs
``kspeedfs`` as a subprocess with base arguments that keep it off the network and off
this host's configuration: etcd at a closed loopback port with a 1 s timeout, a
secret file and an arena directory that do not exist, and paths under ``/nonexistent``.
Nothing is sent to the non-local addresses (198.18.99.99): NICs are checked by a bind
test.

A bug a hostile argument reaches is one line too (``cli/app.py`` turns it into "internal
error", exit ``EX_SOFTWARE``), so that is a failure here as a traceback is.

The options every command shares (``cli/options.py`` add_common: one code path, through
``load_config``) get their whole table on ``kspeedfs config`` and a rotating quarter of
it on each other command. Each case is a process of its own, forked 8 at a time from one
that has imported the CLI and every command's modules: a fresh interpreter spent ~0.2 s
of each case importing them (etcd3's gRPC the most), 54 s for the 508 cases on two cores.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kspeedfs.cli.app import EX_SOFTWARE, build_parser
from kspeedfs.cli.options import add_common

LONG = "x" * 300
HUGE = "9" * 5000
BASE = ["--etcd", "http://127.0.0.1:1", "--set", "store.etcd_timeout=1",
        "--set", "cluster.secret_file=/nonexistent/secret",
        "--set", "cluster.arena_dir=/nonexistent/arena"]
NUMBERS = ["-1", "0", "nan", "inf", "-inf", "1e400", "99999999999999999999999", "abc", ""]
SIZES = ["1PiB", "1TiB", "-5", "0", "nan", "1e400", "abc", "", HUGE]
NAMES = [LONG, "../x", "", "a/b", "日本語", "-x", "\t", ".hidden/../../etc"]

# option → values it must refuse (the command must fail with each of them)
BAD_OPTION_VALUES: dict[str, list[str]] = {
    "--etcd": ["ftp://x", "http://", "http://127.0.0.1:70000", "", "☃", "http://a b", LONG],
    "--set": ["nope.key=1", "cache.memroy=1", "cache.memory", "=", "cache.memory=",
              "cache.memory=1PiB", "cache.memory=-5", "store.etcd_timeout=inf",
              "store.etcd_timeout=nan", "cluster.port=70000", "cluster.port=-1", "cluster.port=0",
              "cluster.rpc_port=7470", "cluster.slot_size=0", "cluster.nics=198.18.99.99x",
              "fuse.workers=1e400", f"cache.memory={HUGE}", "log.level=☃", "store.etcd_prefix=",
              "fuse.allow_other=maybe", "cluster.replicas=-1", "import.threads=-1"],
    "--config": ["/nonexistent/k.toml", "/etc/passwd", "/dev/zero", "/", ""],
    "--log-level": ["LOUD", "", "☃"],
    "--name": NAMES,
    "--nic": ["198.18.99.99", "::1::", "eth0", "", "999.1.1.1"],
    "--version": NUMBERS,
    "--timeout": ["-1", "nan", "inf", "1e400", "abc", ""],
    "--interval": ["0", "0.01", "-1", "nan", "inf", "1e400", "abc", ""],   # stats
    "--count": ["-1", "1.5", "nan", "abc", "", HUGE],
    "--priority": ["1001", "-1001", "1.5", "abc", "", HUGE],          # preload, mount
    "--keep": ["0", "-1", "abc", ""],                                   # gc
    "--threads": NUMBERS[:1] + ["100000", "nan", "abc", ""],
    "-o": ["rw", "version=abc", "version=-1", "bogus", "cache_mem=-1", "etcd=ftp://x",
           "cluster.port=70000", "nope.x=1", "priority=abc", "priority=5000"],
}
for _opt in ("--cache-mem", "--cache-disk", "--chunk-size", "--block-size"):
    BAD_OPTION_VALUES[_opt] = SIZES


def _commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()
              ) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Leaf subcommands: (("mount",), parser), (("secret", "generate"), parser), ..."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [(prefix, parser)]
    return [leaf for name, p in subs[0].choices.items() for leaf in _commands(p, prefix + (name,))]


def _positional_default(a: argparse.Action) -> str:
    """Plausible but failing: a valid name of what it names, else a path that does not
    exist; each must pass argparse, so that the cases of the other arguments reach them."""
    kind = getattr(a.type, "__name__", "")
    if a.choices:
        return str(next(iter(a.choices)))
    if kind == "dataset_version":
        return "hostile-ds@1"
    if kind == "node_name":
        return "hostile-node"
    return "hostile-ds" if kind == "dataset_name" or a.dest == "name" else f"/nonexistent/{a.dest}"


def _common_options() -> set[str]:
    p = argparse.ArgumentParser()
    add_common(p)
    return {o for a in p._actions for o in a.option_strings}


def _cases() -> list[tuple[str, list[str], bool]]:
    """(id, argv, must_fail)."""
    out: list[tuple[str, list[str], bool]] = []
    common = _common_options()
    for n, (words, parser) in enumerate(_commands(build_parser())):
        cmd = " ".join(words)
        positionals = [a for a in parser._actions if not a.option_strings
                       and not isinstance(a, argparse._SubParsersAction)]
        base = [_positional_default(a) for a in positionals]
        for a in parser._actions:                 # required options (import --name) too
            if a.option_strings and a.required:
                base += [a.option_strings[0], _positional_default(a)]
        for i, a in enumerate(positionals):
            for v in NAMES + ["/nonexistent/" + LONG, HUGE]:
                argv = list(words) + base[:i] + [v] + base[i + 1:] + BASE
                out.append((f"{cmd} <{a.dest}>={v[:12]!r}", argv, True))
        for a in parser._actions:
            if not a.option_strings or a.nargs == 0 or a.dest == "help":
                continue
            opt = next((o for o in a.option_strings if o in BAD_OPTION_VALUES), None)
            if opt:
                values, must_fail = BAD_OPTION_VALUES[opt], True
            elif a.type in (int, float) or callable(a.type):
                values, must_fail = NUMBERS, False      # a new option: no traceback at least
            else:
                values, must_fail = ["", HUGE, "☃"], False
            if words != ("config",) and set(a.option_strings) & common:
                values = values[n % 4::4]
            for v in values:
                argv = list(words) + base + BASE + [opt or a.option_strings[0], v]
                out.append((f"{cmd} {a.option_strings[0]}={v[:12]!r}", argv, must_fail))
    return out


CASES = _cases()


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KSPEEDFS_")}
    return subprocess.run([sys.executable, "-m", "kspeedfs.cli.app", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)


def test_every_subcommand_is_covered() -> None:
    commands = {" ".join(w) for w, _ in _commands(build_parser())}
    assert {"import", "mount", "umount", "ls", "config", "node", "preload", "status", "stats",
            "unload", "rm", "gc", "secret generate"} <= commands
    assert len(CASES) > 150


# Reads a JSON list of argv on stdin; forks a child for each (8 at once), which runs the
# CLI's main() as ``python -m kspeedfs.cli.app`` would, its stdout and stderr to files;
# prints [index, exit status, stdout, stderr] a line per child. A child past 30 s is killed.
FORK_SERVER = r"""
import json, os, signal, sys, tempfile, time, traceback
from kspeedfs.cli import app
import kspeedfs.manifest.store.etcd     # etcd3 and gRPC, which cluster commands import
app.build_parser()                      # every command's module
cases, running, outdir = json.load(sys.stdin), {}, tempfile.mkdtemp(prefix="kst-hostile-")

def child(argv, out, err):
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.argv = ["kspeedfs", *argv]
    try:
        code = app.main(argv)
    except SystemExit as e:
        code = e.code
    except BaseException:
        traceback.print_exc()
        code = 1
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(code or 0)

def read(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    os.unlink(path)
    return text

pending = list(enumerate(cases))[::-1]
while pending or running:
    while pending and len(running) < 8:
        i, argv = pending.pop()
        out, err = f"{outdir}/{i}.out", f"{outdir}/{i}.err"
        pid = os.fork()
        if pid == 0:
            child(argv, out, err)
        running[pid] = (i, out, err, time.monotonic())
    pid, status = os.waitpid(-1, os.WNOHANG)
    if pid == 0:
        for p, (_, _, _, t) in running.items():
            if time.monotonic() - t > 30:
                os.kill(p, signal.SIGKILL)
        time.sleep(0.002)
        continue
    i, out, err, _ = running.pop(pid)
    print(json.dumps([i, os.waitstatus_to_exitcode(status), read(out), read(err)]), flush=True)
os.rmdir(outdir)
"""


def _run_all(argvs: list[list[str]], cwd: Path) -> list[subprocess.CompletedProcess[str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KSPEEDFS_")}
    server = subprocess.run([sys.executable, "-c", FORK_SERVER], cwd=cwd, env=env,
                            input=json.dumps(argvs), capture_output=True, text=True,
                            timeout=300)
    assert server.returncode == 0, server.stderr[-2000:]
    results: dict[int, subprocess.CompletedProcess[str]] = {}
    for line in server.stdout.splitlines():
        i, rc, out, err = json.loads(line)
        results[i] = subprocess.CompletedProcess(argvs[i], rc, out, err)
    assert len(results) == len(argvs), server.stderr[-2000:]
    return [results[i] for i in range(len(argvs))]


def test_hostile_arguments(tmp_path: Path) -> None:
    results = _run_all([argv for _, argv, _ in CASES], tmp_path)
    problems = []
    for (case_id, _argv, must_fail), r in zip(CASES, results, strict=True):
        out = r.stdout + r.stderr
        lines = r.stderr.strip().splitlines()
        if "Traceback" in out:
            problems.append(f"{case_id}: traceback\n{out[-2000:]}")
        elif r.returncode == EX_SOFTWARE or "internal error" in out:
            problems.append(f"{case_id}: internal error\n{out[-2000:]}")
        elif r.returncode and len(lines) > 3:
            problems.append(f"{case_id}: {len(lines)} lines of error output\n{r.stderr[-1000:]}")
        elif must_fail and r.returncode == 0:
            problems.append(f"{case_id}: exit 0\n{out[-500:]}")
        elif must_fail and r.returncode != 0 and not r.stderr.strip():
            problems.append(f"{case_id}: exit {r.returncode} without a message")
    assert not problems, f"{len(problems)} of {len(CASES)} cases:\n" + "\n".join(problems[:20])
    assert not list(tmp_path.iterdir()), "a hostile command wrote into its working directory"


@pytest.mark.parametrize("argv, needle", [
    (["config", "--set", "cluster.port=70000"], "cluster.port: 70000 must be in 1..65535"),
    # (a request thread's fd each, handed over in one SCM_RIGHTS message: 254 failed the
    # supervisor's start with a traceback)
    (["config", "--set", "fuse.threads=254"], "fuse.threads: 254 must be in 0..253"),
    (["config", "--set", "cache.memory=1PiB"], "physical memory"),
    (["config", "--etcd", "ftp://x"], "store.etcd"),
    (["mount", LONG, "/nonexistent/m"], "invalid dataset name"),
    (["node", "--nic", "198.18.99.99", *BASE], "198.18.99.99 is not an address of this host"),
    (["stats", "/proc"], "/proc is not a kspeedfs mount (it is a proc mount)"),
    (["stats", "/nonexistent/m"], "/nonexistent/m: no such directory"),
    (["stats"], "one of the arguments mountpoint --cluster is required"),
    (["stats", "--cluster"], "stats --cluster needs the cluster's etcd store (--etcd URL)"),
    (["rm", "imgs@abc"], "the version after @ must be a positive integer"),
    (["unload", "imgs"], "unload needs the cluster's etcd store (--etcd URL)"),
    (["gc", "--keep", "0"], "keep at least 1 version"),
    (["preload", "imgs", "--priority", "5000"], "invalid priority '5000': an integer in -1000..1000"),
    (["mount", "imgs", "/nonexistent/m", "--unload-on-exit", "--store", "/nonexistent/s"],
     "--preload/--unload-on-exit need a cluster"),
])
def test_errors_say_what_is_wrong(tmp_path: Path, argv: list[str], needle: str) -> None:
    r = _run(argv, tmp_path)
    assert r.returncode != 0 and needle in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
