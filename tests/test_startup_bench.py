"""`localgen bench startup`'s parts: timing a process to its first output and exit with its peak
RSS, finding llama-simple, the report's ratios and targets."""

from __future__ import annotations

import sys
from pathlib import Path

from localgen.bench import startup_bench as sb
from localgen.bench.llama_cpp_peer import find_tool


def test_time_process_sees_first_output_exit_and_memory():
    code = "import sys, time; b = bytearray(64 << 20); sys.stdout.write('x'); sys.stdout.flush(); time.sleep(0.2); sys.exit(3)"
    run = sb.time_process([sys.executable, "-c", code])
    assert run.status == 3
    assert run.first_output_s is not None and run.first_output_s < run.exit_s
    assert run.peak_rss > 64 << 20  # the child's own peak, not this process's


def test_a_silent_process_has_no_first_output():
    run = sb.time_process([sys.executable, "-c", "pass"])
    assert run.first_output_s is None and run.status == 0


def test_llama_simple_from_the_flag_the_environment_or_nowhere(tmp_path, monkeypatch):
    exe = tmp_path / "llama-simple"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    monkeypatch.delenv("LLAMA_CPP_BIN", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert find_tool("llama-simple", tmp_path) == exe
    assert find_tool("llama-simple", exe) == exe
    assert find_tool("llama-simple", None) is None
    monkeypatch.setenv("LLAMA_CPP_BIN", str(tmp_path))
    assert find_tool("llama-simple", None) == exe


def test_report_gives_ratios_and_targets():
    res = sb.StartupResult(model="embedded", prompt="hi")
    res.localgen = [sb.ProcessRun(2.0, 2.5, 500 * 10**6, 0), sb.ProcessRun(4.0, 4.5, 700 * 10**6, 0),
                    sb.ProcessRun(2.5, 3.0, 550 * 10**6, 0)]
    res.llama_simple = [sb.ProcessRun(None, 0.5, 100 * 10**6, 0)] * 3
    lines = sb.report(res)
    assert "exit 6.0x" in lines[-2] and "peak RSS 5.5x" in lines[-2]  # medians 3.0 s, 550 MB
    assert lines[-1] == "targets: first token <= 3 s: met; peak RSS <= 600 MB: met"
    res.localgen[2] = sb.ProcessRun(3.5, 4.0, 650 * 10**6, 0)
    assert sb.report(res)[-1] == "targets: first token <= 3 s: missed; peak RSS <= 600 MB: missed"
    assert not any("load" in line for line in lines)
    res.load_average = (1.5, 2.25)
    assert sb.report(res)[1].startswith("machine load (1-minute average) 1.50 before, 2.25 after")


def test_localgen_command_runs_generate_for_one_token():
    cmd = sb.localgen_cmd("m.gguf", "hi")
    assert cmd[0] == sys.executable and cmd[3:] == ["generate", "hi", "--max-tokens", "1",
                                                    "--temperature", "0", "--model", "m.gguf"]


_FAKE_CHAT = r"""
import os, sys, time, tty
tty.setraw(0)
time.sleep(0.05)
os.write(1, b"\x1b[2J\x1b[1;1H\x1b[38;5;245mMessage (Enter sends, F1 help)\x1b[0m")
time.sleep(0.3)
os.write(1, b"\x1b[24;1Hmodel \xc2\xb7 cpu \xc2\xb7 \x1b[1mready\x1b[0m")
while os.read(0, 1) != b"\x11":
    pass
"""


def test_time_chat_sees_the_box_then_ready_and_quits():
    run = sb.time_chat([sys.executable, "-c", _FAKE_CHAT], limit_s=30)
    assert run.input_shown_s is not None and run.ready_s is not None
    assert run.input_shown_s <= run.ready_s and run.peak_rss > 0


def test_time_chat_gives_up_on_an_app_that_never_gets_ready():
    code = "import os, time, tty; tty.setraw(0); os.write(1, b'Message (Enter sends'); time.sleep(60)"
    run = sb.time_chat([sys.executable, "-c", code], limit_s=1.5)
    assert run.input_shown_s is not None and run.ready_s is None  # killed, not waited for


def test_compile_package_writes_each_folders_bytecode(tmp_path, monkeypatch):
    """Every folder the package is installed from gets its modules' bytecode; a module that
    does not compile makes it report False."""
    import importlib.machinery
    import importlib.util

    pkg, tui = tmp_path / "pkg", tmp_path / "tui"
    for folder in (pkg, tui):
        (folder / "sub").mkdir(parents=True)
        (folder / "sub" / "m.py").write_text("X = 1\n")
    specs = {"localgen": pkg, "localgen.tui": tui}

    def find_spec(name):
        if name not in specs:
            return None
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [str(specs[name])]
        return spec

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert sb.compile_package() is True
    for folder in (pkg, tui):
        assert Path(importlib.util.cache_from_source(str(folder / "sub" / "m.py"))).is_file()
    (tui / "bad.py").write_text("def (:\n")
    assert sb.compile_package() is False
