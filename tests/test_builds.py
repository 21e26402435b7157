"""A package's object files compiled side by side (``model.runtime.builds``)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from torch._inductor import cpp_builder

from model.runtime import builds

REPO = Path(__file__).resolve().parents[1]


class Build:
    """What a CppBuilder is to the patch: compile-only or not."""

    def __init__(self, name: str, *, compile_only: bool) -> None:
        self.name = name
        self._compile_only = compile_only


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """``CppBuilder.build`` replaced by one that records, on which thread and when, each build
    ran; objects named "a" and "b" each wait for the other (a barrier: they fail unless they run at
    once), "bad" raises."""
    state: dict[str, Any] = {"done": [], "threads": {}, "seen_by_link": None}
    meet = threading.Barrier(2, timeout=10)

    def build(builder: Build) -> None:
        state["threads"][builder.name] = threading.get_ident()
        if builder.name in ("a", "b"):
            meet.wait()
        if builder.name == "slow":
            time.sleep(0.3)
        if builder.name == "bad":
            raise RuntimeError("g++ failed")
        if not builder._compile_only:
            state["seen_by_link"] = list(state["done"])
        state["done"].append(builder.name)

    monkeypatch.setattr(cpp_builder.CppBuilder, "build", build)
    return state


def test_the_first_object_compiles_beside_the_next_and_the_link_waits_for_it(
    recorded: dict[str, Any],
) -> None:
    with builds.side_by_side():
        cpp_builder.CppBuilder.build(Build("a", compile_only=True))  # type: ignore[arg-type]
        cpp_builder.CppBuilder.build(Build("b", compile_only=True))  # type: ignore[arg-type]
        cpp_builder.CppBuilder.build(Build("slow", compile_only=True))  # type: ignore[arg-type]
        cpp_builder.CppBuilder.build(Build("link", compile_only=False))  # type: ignore[arg-type]
    assert sorted(recorded["seen_by_link"]) == ["a", "b", "slow"]
    assert recorded["threads"]["a"] != threading.get_ident()
    # One behind at a time: torch removes the constants' source as soon as their build returns.
    assert recorded["threads"]["b"] == recorded["threads"]["slow"] == threading.get_ident()
    assert recorded["threads"]["link"] == threading.get_ident()


def test_a_failed_object_behind_fails_the_block_before_the_link(
    recorded: dict[str, Any],
) -> None:
    with pytest.raises(RuntimeError, match="g\\+\\+ failed"), builds.side_by_side():
        cpp_builder.CppBuilder.build(Build("bad", compile_only=True))  # type: ignore[arg-type]
        cpp_builder.CppBuilder.build(Build("slow", compile_only=True))  # type: ignore[arg-type]
        cpp_builder.CppBuilder.build(Build("link", compile_only=False))  # type: ignore[arg-type]
    assert recorded["done"] == ["slow"]  # the link never ran


def test_objects_left_without_a_link_are_done_when_the_block_ends(recorded: dict[str, Any]) -> None:
    with builds.side_by_side():
        cpp_builder.CppBuilder.build(Build("slow", compile_only=True))  # type: ignore[arg-type]
    assert recorded["done"] == ["slow"]


def test_another_threads_builds_run_on_that_thread_one_at_a_time(recorded: dict[str, Any]) -> None:
    caller: list[int] = []

    def elsewhere() -> None:
        caller.append(threading.get_ident())
        cpp_builder.CppBuilder.build(Build("slow", compile_only=True))  # type: ignore[arg-type]
        assert recorded["done"] == ["slow"]  # already done: not handed to a pool

    with builds.side_by_side():
        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
    assert recorded["threads"]["slow"] == caller[0]


def test_torch_build_is_restored_when_the_last_block_ends(recorded: dict[str, Any]) -> None:
    mine = cpp_builder.CppBuilder.build
    with builds.side_by_side():
        assert cpp_builder.CppBuilder.build is not mine
        with builds.side_by_side():
            pass
        assert cpp_builder.CppBuilder.build is not mine  # the outer block still open
    assert cpp_builder.CppBuilder.build is mine


def test_real_objects_compiled_side_by_side_link_into_a_working_library(tmp_path: Path) -> None:
    """torch's own CppBuilder: its compile-only builds are recognized (the first compiled
    behind), and the linked library holds both objects."""
    (tmp_path / "one.cpp").write_text('extern "C" int one() { return 1; }\n')
    (tmp_path / "two.cpp").write_text('extern "C" int two() { return 2; }\n')
    objects = [
        cpp_builder.CppBuilder(
            name=name,
            sources=str(tmp_path / f"{name}.cpp"),
            BuildOption=cpp_builder.CppOptions(compile_only=True),
            output_dir=str(tmp_path),
        )
        for name in ("one", "two")
    ]
    assert all(o._compile_only for o in objects)  # what the patch looks at, in this torch
    library = cpp_builder.CppBuilder(
        name="both",
        sources=[o.get_target_file_path() for o in objects],
        BuildOption=cpp_builder.CppOptions(),
        output_dir=str(tmp_path),
    )
    threads: list[str] = []
    original = cpp_builder.CppBuilder.build

    def build(builder: Any) -> None:
        threads.append(threading.current_thread().name)
        original(builder)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpp_builder.CppBuilder, "build", build)
        with builds.side_by_side():
            for o in objects:
                o.build()
            library.build()
    assert [t.startswith("compile-object") for t in threads] == [True, False, False]
    lib = ctypes.CDLL(library.get_target_file_path())
    assert (lib.one(), lib.two()) == (1, 2)


def test_importing_the_runtime_leaves_torchinductors_cache_directory_unchosen() -> None:
    """``load_runner`` points TorchInductor's cache into the compile cache (TORCHINDUCTOR_CACHE_DIR)
    before compiling: importing TorchInductor earlier would have fixed it to the default."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    code = "import os, model.runtime.runners; print(os.environ.get('TORCHINDUCTOR_CACHE_DIR'))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, cwd=REPO
    )
    assert done.stdout.strip() == "None"


def test_the_instruction_set_checks_run_on_a_thread_and_are_kept_for_lowering(tmp_path: Path) -> None:
    """In a fresh process (torch caches the checks for the process): the thread started by
    ``probe_isa_beside`` runs them, and the call that lowering makes afterwards finds them done."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    code = (
        "import threading\n"
        "from model.runtime import builds\n"
        "from torch._inductor import cpu_vec_isa\n"
        "thread = builds.probe_isa_beside()\n"
        "assert thread is not threading.current_thread()\n"
        "thread.join()\n"
        "before = cpu_vec_isa.valid_vec_isa_list.cache_info()\n"
        "cpu_vec_isa.valid_vec_isa_list()\n"
        "after = cpu_vec_isa.valid_vec_isa_list.cache_info()\n"
        "print(before.misses, before.currsize, after.hits - before.hits)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, cwd=REPO
    )
    assert done.stdout.split() == ["1", "1", "1"]
