"""The `batchyard` command starts itself again with tcmalloc preloaded (framework.preload)."""

import os
import subprocess
import sys
import textwrap

import pytest

from framework import preload
from framework.cli import main as cli_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def fake_tcmalloc(tmp_path, monkeypatch):
    lib = tmp_path / "libtcmalloc_minimal.so.4"
    lib.write_bytes(b"")
    monkeypatch.setattr(preload, "TCMALLOC_PATHS", ("/nonexistent/libtcmalloc.so.4", str(lib)))
    return str(lib)


def test_preload_env_puts_tcmalloc_first_and_peers_get_the_old_environment_back(fake_tcmalloc):
    base = {"PATH": "/bin", "LD_PRELOAD": "/opt/libother.so"}
    env = preload.preload_env(base)
    assert env["LD_PRELOAD"] == f"{fake_tcmalloc}:/opt/libother.so"
    assert env["PATH"] == "/bin" and int(env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]) >= 1 << 40
    assert preload.preload_env(env) is None  # restarted once: not again
    assert preload.peer_env(env) == base
    alone = preload.preload_env({"PATH": "/bin"})
    assert alone["LD_PRELOAD"] == fake_tcmalloc
    assert preload.peer_env(alone) == {"PATH": "/bin"}
    # The user's own threshold stays, also for the peers.
    mine = preload.preload_env({"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": "5"})
    assert mine["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"] == "5"
    assert preload.peer_env(mine) == {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": "5"}
    # An environment that never went through preload_env is left as it is.
    assert preload.peer_env({"LD_PRELOAD": "/x/libtcmalloc.so.4"}) == {"LD_PRELOAD": "/x/libtcmalloc.so.4"}


def test_preload_env_choices(fake_tcmalloc, monkeypatch):
    assert preload.preload_env({"BATCHYARD_MALLOC": "system"}) is None
    assert preload.preload_env({"BATCHYARD_MALLOC": "TCMalloc"})["LD_PRELOAD"] == fake_tcmalloc
    assert preload.preload_env({"LD_PRELOAD": "/usr/lib/libtcmalloc.so.4"}) is None  # already there
    assert preload.preload_env({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}) is None  # the user's own
    with pytest.raises(ValueError, match="BATCHYARD_MALLOC='jemalloc'"):
        preload.preload_env({"BATCHYARD_MALLOC": "jemalloc"})
    monkeypatch.setattr(preload, "TCMALLOC_PATHS", ("/nonexistent/libtcmalloc.so.4",))
    assert preload.preload_env({}) is None  # auto: glibc where there is no tcmalloc
    with pytest.raises(ValueError, match="libtcmalloc-minimal4"):
        preload.preload_env({"BATCHYARD_MALLOC": "tcmalloc"})


def test_a_bad_choice_is_a_usage_error_of_the_command(monkeypatch, capsys):
    """Only the command itself (argv from the command line) restarts; a bad choice exits 2."""
    monkeypatch.setenv("BATCHYARD_MALLOC", "jemalloc")
    monkeypatch.setattr(sys, "argv", ["batchyard", "config", "--defaults"])
    assert cli_main() == 2
    assert "BATCHYARD_MALLOC" in capsys.readouterr().err
    # Called from Python with its own argv, main never restarts the caller's process.
    assert cli_main(["config", "--defaults"]) == 0


def _allocator_of_the_command(choice: str | None) -> list[str]:
    """Run `batchyard config --defaults` through cli.main in a child Python; then, in that process:
    the allocator it runs on, what tune_allocator did, and the MiB trim_heap gave back of 400 MiB of
    freed tensors."""
    script = textwrap.dedent("""
        import sys
        sys.argv = ["batchyard", "config", "--defaults"]
        from framework import cli, preload
        rc = cli.main()
        import torch
        from framework.model import cpu

        def rss_mib():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * 4096 / 2**20

        tuned = cpu.tune_allocator()
        blocks = [torch.ones(1 << 18) for _ in range(400)]  # 1 MiB each, written
        keep = torch.ones(16)
        del blocks
        before = rss_mib()
        cpu.trim_heap()
        print(rc, preload.running_allocator(), tuned, int(before - rss_mib()))
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("BATCHYARD_MALLOC", "LD_PRELOAD")}
    env = preload.peer_env(env)
    if choice is not None:
        env["BATCHYARD_MALLOC"] = choice
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()[-4:]


@pytest.mark.skipif(preload.tcmalloc_path() is None, reason="no tcmalloc on this system")
def test_the_command_runs_on_tcmalloc_where_the_system_has_it_and_the_trims_work_on_both():
    rc, allocator, tuned, released = _allocator_of_the_command(None)
    assert (rc, allocator, tuned) == ("0", "tcmalloc", "True") and int(released) > 300
    rc, allocator, tuned, released = _allocator_of_the_command("system")
    assert (rc, allocator, tuned) == ("0", "glibc", "True") and int(released) > 300


def test_without_tcmalloc_the_command_runs_on_glibc(monkeypatch):
    monkeypatch.setattr(preload, "TCMALLOC_PATHS", ("/nonexistent/libtcmalloc.so.4",))
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("restarted without tcmalloc"))
    monkeypatch.delenv("BATCHYARD_MALLOC", raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    preload.restart_with_tcmalloc()  # returns: nothing to preload


def test_llama_cpp_is_started_without_the_engines_preload(tmp_path, monkeypatch, fake_tcmalloc):
    """The peers run as they are set up on their own: llama-server without our tcmalloc."""
    from framework.bench import peers

    for key, value in preload.preload_env({"LD_PRELOAD": "/opt/libmine.so"}).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("BATCHYARD_PEERS_HOME", str(tmp_path))
    paths = peers.PeerPaths.default()
    for path in (paths.llamacpp_server, paths.llamacpp_bf16_gguf):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w"):
            pass
    os.chmod(paths.llamacpp_server, 0o755)
    _, env = peers.serve_command("llamacpp", 30006)
    assert env["LD_PRELOAD"] == "/opt/libmine.so" and "_BATCHYARD_MALLOC_PRELOADED" not in env
