"""SGLang's HTTP server for the tests: started from the README's CPU recipe (a plain `python -m
sglang.launch_server --device cpu ...` with the test-only switches), on 127.0.0.1, driven by bounded HTTP requests
(every request has a timeout), stopped by its PID — its own process group: the launcher, the scheduler, the
detokenizer and the torch_shm_manager helpers of tensor clients that the scheduler keeps alive — and never left
running.

`recipe()` reads the README's recipe: the ```bash block right after the `<!-- readme-test: http -->` line, one
command per line (backslash continuations joined, comments dropped).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from .helpers import REPO

README = REPO / "README.md"
HTTP_MARK = "<!-- readme-test: http -->"
#: the literals of the recipe a test replaces with its own (a temporary model directory, a free port)
RECIPE_PORT = "30000"
RECIPE_DIR = "/tmp/tiny-moe"


#: the README's online NVFP4 recipe (a BF16 checkpoint served with --quantization nvfp4_online)
HTTP_ONLINE_MARK = "<!-- readme-test: http-online -->"


#: where the recipes are: the README (the CPU recipe), docs/CPU.md (the online NVFP4 one)
RECIPE_PAGES = (README, REPO / "docs" / "CPU.md")


def recipe(text: str | None = None, mark: str = HTTP_MARK) -> list[str]:
    """The commands of the HTTP recipe after `mark` (in the README or docs/CPU.md), in order."""
    texts = [text] if text is not None else [p.read_text() for p in RECIPE_PAGES]
    m = next((m for t in texts if (m := re.search(re.escape(mark) + r"\s*\n```bash\n(.*?)\n```", t, re.DOTALL))), None)
    if m is None:
        raise AssertionError(f"no ```bash block after {mark!r} in README.md or docs/CPU.md")
    joined = re.sub(r"\\\n\s*", " ", m.group(1))
    out = []
    for line in joined.splitlines():
        code = _strip_comment(line).strip()
        if code:
            out.append(code)
    return out


def _strip_comment(line: str) -> str:
    """The line without a trailing `# ...` comment (outside quotes)."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            if c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HTTPResult:
    def __init__(self, status: int, body):
        self.status = status
        self.body = body

    @property
    def ok(self) -> bool:
        return self.status == 200

    def __repr__(self) -> str:
        text = json.dumps(self.body)[:600] if not isinstance(self.body, str) else self.body[:600]
        return f"HTTP {self.status}: {text}"


def request(url: str, body: dict | None = None, timeout: float = 120, method: str | None = None) -> HTTPResult:
    """One bounded request; the JSON body of any answer (200 or an error status) is returned, not raised."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method or ("GET" if body is None else "POST"))
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return HTTPResult(status, json.loads(raw))
    except ValueError:
        return HTTPResult(status, raw.decode(errors="replace"))


class Server:
    """One `python -m sglang.launch_server` process group."""

    def __init__(self, argv: list[str], env: dict, log_path: Path, port: int):
        self.argv, self.env, self.log_path, self.port = argv, env, Path(log_path), port
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self._shm: set[str] = set()

    def start(self) -> Server:
        log = open(self.log_path, "w")  # noqa: SIM115 - the server writes it until stop()
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            cwd=str(self.log_path.parent),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop() ends exactly the processes it started
        )
        log.close()
        return self

    def log_tail(self, n: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_ready(self, timeout: float = 900) -> float:
        """Until GET /health_generate answers 200 (SGLang's own warm-up done); returns the seconds it took."""
        assert self.proc is not None
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"the server exited with {self.proc.returncode} before it was ready:\n{self.log_tail()}"
                )
            with contextlib.suppress(OSError):
                if request(self.url + "/health_generate", timeout=10).ok:
                    self._remember_shm()
                    return time.monotonic() - t0
            time.sleep(2)
        raise AssertionError(f"the server was not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def post(self, path: str, body: dict | None = None, timeout: float = 120) -> HTTPResult:
        return request(self.url + path, {} if body is None else body, timeout=timeout)

    def get(self, path: str, timeout: float = 60) -> HTTPResult:
        return request(self.url + path, None, timeout=timeout)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _group_pids(self) -> list[int]:
        assert self.proc is not None
        pgid = self.proc.pid
        out = []
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(f"/proc/{d}/stat").read_text()
                fields = stat[stat.rindex(")") + 2 :].split()
                if int(fields[2]) == pgid:  # field 5 of /proc/PID/stat: the process group
                    out.append(int(d))
        return out

    def _remember_shm(self) -> None:
        """SGLang's own /dev/shm segments mapped by this server's processes (`sglang_loads_*`: not unlinked when its
        processes are killed); removed by stop()."""
        for pid in self._group_pids():
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                    path = line.split()[-1] if line.split() else ""
                    if path.startswith("/dev/shm/sglang_loads_"):
                        self._shm.add(path)

    def stop(self, timeout: float = 60) -> list[int]:
        """SIGTERM to the server's process group, SIGKILL to what is left after `timeout`; returns the PIDs still
        alive afterwards (none, or the test fails)."""
        if self.proc is None:
            return []
        pgid = self.proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout and self._group_pids():
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=1)
        if self._group_pids():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            time.sleep(2)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        for path in self._shm:
            with contextlib.suppress(OSError):
                os.unlink(path)
        return self._group_pids()


def gen_body(prompts, n):
    """A /generate body: greedy, `n` new tokens (one number or one per prompt), never stopped early."""

    def params(k):
        return {"temperature": 0, "max_new_tokens": k, "ignore_eos": True}

    return {"input_ids": prompts, "sampling_params": [params(k) for k in n] if isinstance(n, list) else params(n)}


def shm_managers(logs: list[Path]) -> list[int]:
    """PIDs of torch_shm_manager processes whose output is one of our clients' logs (theirs, nobody else's)."""
    wanted = {str(p) for p in logs}
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        with contextlib.suppress(OSError):
            if Path(f"/proc/{d}/comm").read_text().strip() != "torch_shm_manager":
                continue
            if any(os.readlink(f"/proc/{d}/fd/{fd}") in wanted for fd in (1, 2)):
                out.append(int(d))
    return out


def recipe_env(extra: dict | None = None) -> dict:
    """The environment a user's shell would give the recipe: this checkout's plugin first on PYTHONPATH (as an
    installed plugin would be), this env's bin first on PATH (`python`, `sglang-trtllm-moe`), no SGLANG_TRTLLM_MOE_*
    of the test process; one torch thread (a small shared box)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_TRTLLM_MOE_") and k != "SGLANG_PLUGINS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


def entered_env(command: str) -> str:
    """The `sys.prefix` a recipe's `source "$(ci/make-env)/bin/activate"` line enters, run as written (bash, from the
    checkout, this process's environment: its env root)."""
    proc = subprocess.run(
        ["bash", "-c", f'{command} && python -c "import sys; print(sys.prefix)"'],
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, (command, proc.stderr[-3000:])
    return proc.stdout.strip().splitlines()[-1]


def run_shell_line(command: str, timeout: float = 120) -> None:
    """A recipe line that is shell syntax (`until curl ...; do sleep 5; done`), run as written by bash."""
    proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, (command, proc.stdout[-2000:], proc.stderr[-2000:])


def split(command: str, replacements: dict[str, str]) -> list[str]:
    argv = shlex.split(command)
    return [replacements.get(a, a) for a in argv]


# ---- the one harness of both HTTP suites (tests/test_http_server.py, tests/test_http_online.py) ---------------------


class RecipeRun:
    """One recipe's server and what the tests need around it: the checkpoints by key (`dirs`), the reference's fresh
    loads of them (`ref`: support/http_reference.py), the recipe's curl answers, the recipe's environment (its exports
    included), and the checkpoint the server was last updated to (`state`)."""

    def __init__(self, work: Path, arch: str, quant: str, prompts: list[list[int]], new_tokens: int):
        self.work = work
        self.arch, self.quant = arch, quant
        self.prompts, self.new_tokens = prompts, new_tokens
        self.dirs: dict[str, str] = {}
        self.ref: dict = {}
        self.recipe_out: list = []
        self.server: Server | None = None
        self.timings: dict[str, float] = {}
        self.client_logs: list[Path] = []
        self.env: dict = {}
        self.state = "A"

    @property
    def srv(self) -> Server:
        assert self.server is not None
        return self.server

    def generate(self, prompts=None, n=None, timeout=300) -> list[list[int]]:
        """One batched greedy request (the run's prompts and new tokens unless given); its tokens per prompt."""
        body = gen_body(self.prompts if prompts is None else prompts, self.new_tokens if n is None else n)
        r = self.srv.post("/generate", body, timeout=timeout)
        assert r.ok, r
        return [list(o["output_ids"]) for o in r.body]

    def checksums(self) -> dict[str, str]:
        r = self.srv.post("/weights_checker", {"action": "checksum"}, timeout=300)
        assert r.ok, r
        (rank,) = r.body["ranks"]
        return dict(rank["checksums"])

    def serves(self, key: str) -> list[str]:
        """Tensors whose checksum differs from a fresh load of `key` (empty: the server holds those weights)."""
        mine, theirs = self.checksums(), self.ref[key]["checksums"]
        if set(mine) != set(theirs):
            return sorted(set(mine) ^ set(theirs))
        return [n for n in mine if mine[n] != theirs[n]]

    def assert_serves(self, key: str) -> None:
        """The served checksums and greedy tokens are a fresh load's of `key` (the reference process's)."""
        diff = self.serves(key)
        assert not diff, f"served weights differ from a fresh load of {key}: {diff[:8]}"
        assert self.generate() == self.ref[key]["tokens"], key

    def disk(self, key: str, version: str | None = None, timeout=300) -> HTTPResult:
        body = {"model_path": self.dirs[key]}
        if version is not None:
            body["weight_version"] = version
        r = self.srv.post("/update_weights_from_disk", body, timeout=timeout)
        self.state = key if r.ok else "?"
        return r

    def client(self, steps: list[dict], name: str, timeout=600) -> list[dict]:
        """A slime-style tensor client in its own process (tests/support/http_client.py); its output goes to a
        file: the torch_shm_manager it starts inherits it and lives as long as the server holds the tensors."""
        from . import http_client

        spec = {"arch": self.arch, "quant": self.quant}
        return http_client.run(self.srv.url, spec, steps, self.work, name, self.client_logs, timeout=timeout)


def start_reference(work: Path, job: dict) -> tuple[subprocess.Popen, Path, Path]:
    """support/http_reference.py on `job` in its own process group (beside the server while it starts)."""
    (work / "reference.json").write_text(json.dumps(job))
    log = work / "reference.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.http_reference", str(work / "reference.json"), str(work / "ref.out")],
            cwd=str(REPO),
            env=recipe_env(),
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return proc, work / "ref.out", log


def serve_recipe(
    run: RecipeRun,
    mark: str,
    model_dir: str,
    before_server: Callable[[], dict],
    when_ready: Callable[[], None] | None = None,
) -> Iterator[RecipeRun]:
    """The recipe after `mark` run as written, its model directory and port replaced (`model_dir` stands for
    RECIPE_DIR; `run.dirs["A"]` / `["B"]` are the recipe's checkpoints): each line as its kind says — `source`
    (entering the env ci/make-env builds: this test's), `export`, the server line (`... &`: `before_server()` first
    — it writes the other checkpoints and returns the reference's job, started beside the server — then the server,
    until ready, then `when_ready()`), the ready line (`until curl ...`, run by bash), `curl` (its JSON answers in
    `run.recipe_out`; an `/update_weights_from_disk` leaves B served), anything else as a command; the recipe's stop
    (`kill %1`: SIGTERM to the job's process group) is what the harness sends at the end. Yields `run` once the
    reference's fresh loads are in `run.ref`; stops the server, the reference and the tensor clients'
    torch_shm_manager helpers, and fails if any outlived it. A generator: the module fixture of each suite."""
    t0 = time.monotonic()
    port = free_port()
    commands = recipe(mark=mark)
    assert any(RECIPE_DIR in c for c in commands) and any(RECIPE_PORT in c for c in commands), commands
    commands = [c.replace(RECIPE_DIR, model_dir).replace(RECIPE_PORT, str(port)) for c in commands]
    env = recipe_env()
    ref = None
    try:
        assert commands[-1] == "kill %1", commands  # the recipe's stop: what Server.stop sends at the end (the
        # module's tests need the server until then)
        for cmd in commands[:-1]:
            argv = split(cmd, {})
            if argv[0] == "source":  # entering the env ci/make-env builds: this test's (same release, same recipe key;
                # the env root may differ: the harness does not pass SGLANG_TRTLLM_MOE_ENV_ROOT on)
                assert os.path.basename(entered_env(cmd)) == os.path.basename(sys.prefix), cmd
            elif argv[0] == "until":  # waiting for ready, as written (the server answered wait_ready already)
                assert "/health_generate" in cmd and run.server is not None, cmd
                run_shell_line(cmd, timeout=60)
            elif argv[0] == "export":
                env.update(dict(a.split("=", 1) for a in argv[1:]))
            elif cmd.endswith("&"):  # the server, and beside it the reference's fresh loads
                ref = start_reference(run.work, before_server())
                run.env = dict(env)
                run.server = Server(argv[:-1], env, run.work / "server.log", port).start()
                run.timings["server ready"] = run.srv.wait_ready()
                if when_ready is not None:
                    when_ready()
            elif argv[0] == "curl":
                proc = subprocess.run(
                    [*argv, "--max-time", "300"], capture_output=True, text=True, timeout=330, check=False
                )
                assert proc.returncode == 0, (cmd, proc.stderr)
                run.recipe_out.append(json.loads(proc.stdout))
                if "/update_weights_from_disk" in cmd:  # the recipe's update: the server holds the step-1 checkpoint
                    run.state = "B"
            else:
                proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False)
                assert proc.returncode == 0, (cmd, proc.stdout[-2000:], proc.stderr[-4000:])
        assert run.server is not None and ref is not None, f"the recipe after {mark} starts no server"
        proc, out, log = ref
        proc.wait(timeout=900)
        assert proc.returncode == 0 and out.exists(), log.read_text()[-6000:]
        run.ref = json.loads(out.read_text())
        run.timings["setup"] = time.monotonic() - t0
        yield run
    finally:
        left = run.server.stop() if run.server is not None else []
        if ref is not None and ref[0].poll() is None:
            os.killpg(ref[0].pid, 9)
        managers = shm_managers(run.client_logs)
        t1 = time.monotonic()
        while managers and time.monotonic() - t1 < 30:
            time.sleep(1)
            managers = shm_managers(run.client_logs)
        for pid in managers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        run.timings["module"] = time.monotonic() - t0
        (run.work / "timings.json").write_text(json.dumps(run.timings))
        print(f"\n{mark} timings (s): {json.dumps({k: round(v, 1) for k, v in run.timings.items()})}")
        assert not left, f"server processes still running after stop: {left}"
        assert not managers, f"torch_shm_manager helpers outlived the server: {managers}"


__all__ = [
    "HTTPResult",
    "RecipeRun",
    "serve_recipe",
    "start_reference",
    "HTTP_MARK",
    "HTTP_ONLINE_MARK",
    "RECIPE_DIR",
    "RECIPE_PORT",
    "Server",
    "gen_body",
    "shm_managers",
    "free_port",
    "recipe",
    "recipe_env",
    "request",
    "split",
    "entered_env",
    "run_shell_line",
]
