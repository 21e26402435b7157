"""Can two threads of one process run the compiled decoding step at once (one copy of the weights)?

Two runners of one model (``load_runner`` twice: one package loaded twice, both handed the same
weights) each run ``--steps`` beam steps at ``--rows`` rows, one after the other and then in two
threads at once, two ways:

- through torch's own binding of the package (``AOTIModelPackageLoader.run``);
- through a ~15-line C++ extension (built here with ``torch.utils.cpp_extension.load_inline``, so
  g++ is needed, as for the package itself) that calls the same loader with the GIL released.

Two threads can only beat one after the other where the step runs without the GIL.

    .venv/bin/python -m benchmarks.opus_size --precisions int8 --runs 1   # makes the model, once
    .venv/bin/python -m benchmarks.threads_step --model /tmp/nmt-opus-size/ours
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.cpp_extension import load_inline

from model.runtime.runners import PackagedRunner, _example_cache, constant_names, load_runner
from model.translator import Translator

SOURCE = r"""
#include <torch/extension.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
struct Step {
  torch::inductor::AOTIModelPackageLoader loader;
  explicit Step(const std::string& path) : loader(path) {}
  void hand(std::unordered_map<std::string, at::Tensor> tensors) {
    loader.update_constant_buffer(tensors, false, true, true);  // user-managed: not copied
  }
  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs) {
    py::gil_scoped_release release;
    return loader.run(inputs);
  }
};
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Step>(m, "Step").def(py::init<const std::string&>()).def("hand", &Step::hand)
      .def("run", &Step::run);
}
"""


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--quantization", default="int8", choices=["int8", "none"])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "nmt-threads-step")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    tr = Translator.load(
        args.model, device="cpu", quantization=args.quantization, compile=True, cache_dir=args.cache_dir
    )
    model, positions = tr.model, tr.options.positions(tr.model.cfg.max_positions)
    top = tr.options.candidates(tr.max_beam_size)
    runners = [
        load_runner(
            model, top=top, capacity=tr.capacity, positions=positions, compile=True, cache_dir=args.cache_dir
        )
        for _ in range(2)
    ]
    assert all(isinstance(r, PackagedRunner) for r in runners), "the step did not compile"
    ext: Any = load_inline(name="nmt_threads_step", cpp_sources=[SOURCE], verbose=False)

    def native(runner: Any) -> Any:
        step = ext.Step(str(args.cache_dir / f"step-{runner.key()}.pt2"))
        tensors = {**runner.tensors(), **runner._scalars}
        step.hand(
            {name: tensors[fqn] for name, fqn in constant_names(runner._loader.get_constant_fqns()).items()}
        )
        return step

    def steps(call: Callable[[list[torch.Tensor]], Any]) -> None:
        with torch.inference_mode():
            cache = _example_cache(model, args.rows, capacity=tr.capacity, positions=positions, align=1)
            tokens = torch.full((args.rows,), model.cfg.bos_id, dtype=torch.long)
            beam_rows = torch.arange(args.rows)
            forced = torch.full((args.rows, 2), model.cfg.eos_id, dtype=torch.long)
            for _ in range(args.steps):
                call([tokens, *cache.views(), beam_rows, forced])

    ways = {
        "torch's binding": [lambda x, r=r: r(*x) for r in runners],
        "GIL released": [n.run for n in (native(r) for r in runners)],
    }
    for name, calls in ways.items():
        for call in calls:
            steps(call)  # warm-up
        started = time.perf_counter()
        for call in calls:
            steps(call)
        one_after_other = time.perf_counter() - started
        threads = [threading.Thread(target=steps, args=(call,)) for call in calls]
        started = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        together = time.perf_counter() - started
        print(
            f"{name}: 2 x {args.steps} beam steps at {args.rows} rows, one after the other "
            f"{one_after_other:.2f} s, in two threads {together:.2f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
