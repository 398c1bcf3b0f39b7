"""Where the memory of a GGUF load goes: the model alone against the model and its tokenizer;
with a llama.cpp tree and build, the load time against llama.cpp's in the same run.

    python scripts/gguf_memory.py FILE.gguf [--runs 3] [--llama-cpp-src SRC --llama-cpp-build BUILD]
                                  [--cold-starts N] [--out JSON]

Each load runs in a fresh process (a process's heap remembers what came before); "held" is
the RSS after the load less the RSS before it, as `bench generate` reports it. The model alone
is `_load_gguf(..., with_tokenizer=False)`, the same read of the file without building the
tokenizer, so the difference is what the tokenizer holds.

llama.cpp's side is a small C++ program compiled here against the build's static libraries
(BUILD_SHARED_LIBS=OFF, as scripts' llama.cpp builds are): llama_model_load_from_file and
llama_init_from_model with a 768-token context and 2 threads, what llama-cpp-python's
`Llama(...)` calls beneath its Python. The two loads alternate, a fresh process each.
--cold-starts N adds the whole wait of a user, process start to first token (bench/cold_start.py:
`flashformer generate` against the build's llama-simple), and --out keeps both as JSON, which
docs/benchmarks.md's load-time table is drawn from (scripts/docs.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from flashformer.bench import cold_start
from flashformer.files import write_json
from flashformer.kernels.machine import machine_info

WORKER = """
import json, sys, time
from pathlib import Path
import torch
from flashformer.bench.common import rss_bytes
from flashformer.checkpoints import loading

torch.set_num_threads(2)
path, with_tokenizer = Path(sys.argv[1]), sys.argv[2] == "1"
before, started = rss_bytes(), time.perf_counter()
model, _ = loading._load_gguf(path, None, "gguf", "int8", with_tokenizer=with_tokenizer)
seconds = time.perf_counter() - started
weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
print(json.dumps({"held": rss_bytes() - before, "weights": weights, "load_s": seconds}))
"""

LLAMA_LOAD = r"""
#include "llama.h"
#include <chrono>
#include <cstdio>
int main(int argc, char ** argv) {
    auto start = std::chrono::steady_clock::now();
    llama_backend_init();
    llama_model * model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (model == nullptr) return 1;
    llama_context_params params = llama_context_default_params();
    params.n_ctx = 768;
    params.n_threads = params.n_threads_batch = 2;
    llama_context * context = llama_init_from_model(model, params);
    if (context == nullptr) return 1;
    double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    printf("{\"load_s\": %.4f}\n", seconds);
    llama_free(context);
    llama_model_free(model);
}
"""


def llama_cpp_loader(source: Path, build: Path, folder: Path) -> Path:
    """The C++ load timer above, compiled against llama.cpp's headers and static libraries."""
    code, binary = folder / "llama_load.cpp", folder / "llama_load"
    code.write_text(LLAMA_LOAD)
    libraries = [build / "src/libllama.a"] + [build / f"ggml/src/libggml{s}.a" for s in ("", "-cpu", "-base")]
    missing = [str(path) for path in libraries if not path.is_file()]
    if missing:
        raise SystemExit(
            f"--llama-cpp-build {build}: no {', '.join(missing)} (a BUILD_SHARED_LIBS=OFF build)"
        )
    includes = [f"-I{source / 'include'}", f"-I{source / 'ggml/include'}"]
    compile_ = ["g++", "-O2", "-std=c++17", str(code), *includes, *map(str, libraries)]
    subprocess.run([*compile_, "-fopenmp", "-lpthread", "-ldl", "-o", str(binary)], check=True)
    return binary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--llama-cpp-src", type=Path, help="llama.cpp's source tree (its include/)")
    parser.add_argument("--llama-cpp-build", type=Path, help="its cmake build folder (static libraries)")
    parser.add_argument(
        "--cold-starts", type=int, default=0, help="with llama.cpp: also N fresh processes to first token"
    )
    parser.add_argument("--out", type=Path, help="with llama.cpp: write the runs here as JSON")
    args = parser.parse_args()
    if (args.llama_cpp_src is None) != (args.llama_cpp_build is None):
        parser.error("--llama-cpp-src and --llama-cpp-build go together")
    if args.llama_cpp_src is not None:
        compare_load_time(args)
        return
    size = args.file.stat().st_size
    print(f"{args.file.name}: {size / 1e6:.1f} MB")
    for with_tokenizer in (False, True):
        runs = [
            json.loads(
                subprocess.check_output(
                    [sys.executable, "-c", WORKER, str(args.file), str(int(with_tokenizer))]
                )
            )
            for _ in range(args.runs)
        ]
        low, high = min(r["held"] for r in runs), max(r["held"] for r in runs)
        load = [r["load_s"] for r in runs]
        what = "model and tokenizer" if with_tokenizer else "model alone"
        print(
            f"{what:20s} held {low / 1e6:.0f}-{high / 1e6:.0f} MB = {low / size:.2f}-{high / size:.2f}x "
            f"the file; weights {runs[0]['weights'] / 1e6:.0f} MB; load {min(load):.2f}-{max(load):.2f} s"
        )


def compare_load_time(args) -> None:
    """Our load (model and tokenizer) and llama.cpp's, in turns, a fresh process each."""
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as folder:
        binary = llama_cpp_loader(args.llama_cpp_src, args.llama_cpp_build, Path(folder))
        ours, theirs = [], []
        for _ in range(args.runs):
            worker = [sys.executable, "-c", WORKER, str(args.file), "1"]
            ours.append(json.loads(subprocess.check_output(worker))["load_s"])
            out = subprocess.check_output([str(binary), str(args.file)], stderr=subprocess.DEVNULL)
            theirs.append(json.loads(out)["load_s"])
    print(f"{args.file.name}: load in {args.runs} fresh processes each, in turns")
    print(f"flashformer (model and tokenizer) {min(ours):.2f}-{max(ours):.2f} s")
    print(f"llama.cpp (model and context)     {min(theirs):.2f}-{max(theirs):.2f} s")
    print(f"best against best: {min(ours) / min(theirs):.2f}x llama.cpp's")
    found = {"file": args.file.name, "file_bytes": args.file.stat().st_size, "runs": args.runs,
             "load_s": {"flashformer": ours, "llama.cpp": theirs}, "machine": machine_info(), "load_average": [load_before]}  # fmt: skip
    if args.cold_starts:
        found["cold_start"] = cold_start.run(str(args.file), str(args.llama_cpp_build), args.cold_starts)
        for name, figures in found["cold_start"]["summary"].items():
            print(f"{name} to first token: best {figures['best']:.2f} s, worst {figures['worst']:.2f} s")
    found["load_average"].append(os.getloadavg()[0])
    if args.out is not None:
        write_json(args.out, found)


if __name__ == "__main__":
    main()
