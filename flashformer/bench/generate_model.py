"""`flashformer bench generate --model PATH [--quantize MODE]`: a real model, timed as its users run it.

The model (a GGUF file, a Hugging Face folder or a flashformer run) answers
one chat message, rendered through its own chat template: greedy, batch 1,
`new_tokens` new tokens whatever the model would say (no stop token).
Contenders, timed in turns in one fresh process with the same thread count:

- transformers on the same weights in float32 (its GGUF loader for a GGUF file);
- flashformer (float32, or quantized by --quantize) as a user runs it: the default path (the
  native decoder, nothing compiled), and with --compile also its decode step under torch.compile;
- llama.cpp through llama-cpp-python on the same GGUF file (when installed);
- llama.cpp's own `llama-bench` of each --llama-cpp-dir build, run before and after the
  worker (its pp512 and tg128 on an empty context, 3 repetitions: llama_cpp_binaries.py),
  the better of the two kept; our decode and 512-token prompt tokens/s are given as its ratios.

--isa avx2 (or scalar) forces our C++ kernels and PyTorch's own (FLASHFORMER_CPU_ISA, and the
ATEN_CPU_CAPABILITY it matches, clamped to the CPU: kernels/machine.py) onto that instruction set, to compare
like with like against a llama.cpp built for it; the JSON records the CPU's flags and the
path the kernels ran.

Reported per contender: the load time; decode tokens/s (the steps after the
first token) and the prefill time of the chat prompt; prompt-processing
tokens/s on a 512-token prompt; the bytes of weights a decode step reads and
the GB/s that makes, against the memory bandwidth measured in the same run
(a large float32 sum). With --batches, flashformer's aggregate decode
tokens/s at each batch size (the same prompt in every row) too, every size
(batch 1 included) timed in the same turns: their ratios are the batch gains.
The cold start is flashformer's first answer in the fresh process: the seconds from the
process's start (imports included) to the end of the load, and to its first token (the chat
prompt's prefill, the decoder's first call), before anything else ran. The process's memory
(/proc/self/status: VmRSS, VmHWM, RssAnon, RssFile; smaps_rollup's huge pages) is read before
the load, after it and after that first token: weights used in place from the file's map are
RssFile, and resident only once a first step has read them.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from flashformer.bench import cold_start
from flashformer.bench.common import memory_status, peak_memory, rss_bytes, time_in_turns
from flashformer.bench.llama_cpp_binaries import REPETITIONS, llama_bench_binary, run_llama_bench
from flashformer.kernels.machine import aten_capability, process_seconds

QUESTION = "Write a short story about a lighthouse keeper who finds a message in a bottle."
PROMPT_PROCESSING_TOKENS = 512
# --isa: our kernels' paths a run may force (machine.aten_capability gives PyTorch's to match)
ISAS = ("best", "avx2", "scalar")


def load_transformers(path: Path):
    """transformers' model of the same weights: its GGUF loader for a .gguf file (dequantized by
    the same gguf library), from_pretrained for a folder."""
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    if path.is_file():
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    if (path / "hf").is_dir():  # a flashformer run: its Hugging Face export
        path = path / "hf"
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def weight_bytes_per_token(model) -> int:
    """The bytes of weights one decode step reads: every parameter and buffer storage once
    (a tied head shares the embedding's), less the embedding tables a step only reads a row of."""
    seen, total = set(), 0
    looked_up = {id(t) for t in model.embeddings.state_dict().values()}
    head = model.lm_head.state_dict().values() if model.lm_head is not None else []
    shared = {t.untyped_storage().data_ptr() for t in head}
    if model.lm_head is None:  # tied float head: the embedding matrix is read as the head
        shared.add(model.embeddings.tokens.weight.untyped_storage().data_ptr())
    for tensor in list(model.parameters()) + list(model.buffers()):
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        if id(tensor) in looked_up and storage.data_ptr() not in shared:
            continue
        total += storage.nbytes()
    return total


def memory_bandwidth() -> float:
    """GB/s of a sum over 512 MiB of float32 (best of 5), with torch's threads."""
    data = torch.ones(128 * 2**20)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return data.nbytes / best / 1e9


def gguf_bytes(path: Path) -> int:
    from flashformer.checkpoints.gguf import read_file

    return sum(raw.data.nbytes for raw in read_file(path).tensors.values())


def llama_cpp_contender(path: Path, threads: int, context: int):
    """(generate(ids, n) -> tokens, process(ids) -> None) of llama.cpp on the file, or None."""
    import importlib.util

    if not path.is_file() or importlib.util.find_spec("llama_cpp") is None:
        return None
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=context, verbose=False
    )

    def generate(ids: list[int], n: int) -> list[int]:
        llm.reset()  # else llama-cpp-python reuses the prompt it evaluated last (a prefix cache)
        out = []
        for token in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(token)
            if len(out) == n:
                break
        return out

    def process(ids: list[int]) -> None:
        llm.reset()
        llm.eval(ids)

    return generate, process


def timing_worker(point: dict) -> dict:
    import flashformer

    if point.get("threads"):
        torch.set_num_threads(point["threads"])
    threads = torch.get_num_threads()
    path = Path(point["model"])
    quantize = point.get("quantize")
    result = {"load_before": os.getloadavg()[0], "threads": threads, "quantize": quantize}
    status_before = memory_status()
    rss_before = rss_bytes()
    started = time.perf_counter()
    ours, tokenizer = flashformer.load(path, quantize=quantize, activations=point.get("activations", "int8"))
    result["load_s"] = {"flashformer": time.perf_counter() - started}
    result["cold_start_s"] = {"loaded": process_seconds()}
    result["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    if quantize:  # the code the quantized kernels run: the best this CPU has, or --isa's
        from flashformer.kernels.quantized import kernel_isa

        result["kernel_isa"] = kernel_isa(point.get("isa") or "best")
    # the memory the model holds: RSS after the load less the process's before it (Python, torch)
    result["memory"] = {
        "rss_before_load": rss_before,
        "rss_after_load": rss_bytes(),
        "peak_rss_during_load": peak_memory(),
        "file_bytes": path.stat().st_size if path.is_file() else None,
        "status": {"before_load": status_before, "after_load": memory_status()},
    }
    new = point["new_tokens"]
    if getattr(tokenizer, "chat_template", None) is not None:
        messages = [{"role": "user", "content": point["question"]}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        result["prompt_kind"] = "chat"
    else:  # a base model: the question as plain text
        prompt = tokenizer.encode(point["question"])
        result["prompt_kind"] = "plain"
    ids = torch.tensor([prompt])  # (1, P)
    rounds = point["rounds"]

    def flashformer_generate(n: int = new, compile: bool = False, batch_ids: torch.Tensor = ids) -> list[int]:
        """flashformer's greedy tokens of row 0 (the default path, or compiled)."""
        out = ours.generate(batch_ids, max_new_tokens=n, eos_token_id=[], compile=compile)
        return out[0, batch_ids.shape[1] :].tolist()

    flashformer_generate(1)  # the first token, cold: nothing ran before it
    result["cold_start_s"]["first_token"] = process_seconds()
    result["memory"]["status"]["after_first_token"] = memory_status()
    result["native"] = ours.native_decoder() is not None

    # flashformer's batch sizes first, before the other contenders share the process
    # (llama.cpp's runtime brings threads of its own)
    if len(point.get("batches", [1])) > 1:
        # every batch size timed in the same turns (its full generation and its prefill alone), so
        # that a noisy neighbour weighs on their ratio's two sides alike
        sizes = sorted(set(point["batches"]) | {1})
        batch_works = {}
        for batch in sizes:
            batch_ids = ids.expand(batch, -1).contiguous()
            batch_works[f"{batch} one"] = lambda b=batch_ids: flashformer_generate(1, False, b)
            batch_works[f"{batch} full"] = lambda b=batch_ids: flashformer_generate(new, False, b)
        batch_times = time_in_turns(batch_works, rounds=rounds)
        result["batch_decode_tokens_per_s"] = {
            str(batch): batch * (new - 1) / (batch_times[f"{batch} full"] - batch_times[f"{batch} one"])
            for batch in sizes
        }
        tokens_by_batch = [
            flashformer_generate(24, False, ids.expand(b, -1).contiguous()) for b in point["batches"]
        ]
        result["same_tokens_every_batch"] = all(t == tokens_by_batch[0] for t in tokens_by_batch)

    theirs = None
    if point.get("transformers", True):
        started = time.perf_counter()
        theirs = load_transformers(path).eval()
        result["load_s"]["transformers"] = time.perf_counter() - started
        theirs.generation_config.eos_token_id = None  # no early stop: every run makes all its tokens
    started = time.perf_counter()
    llama = llama_cpp_contender(path, threads, PROMPT_PROCESSING_TOKENS + new + 64)
    if llama is not None:  # llama-cpp-python's Llama(...): its file is memory-mapped, as ours is read
        result["load_s"]["llama.cpp"] = time.perf_counter() - started
    long_prompt = (prompt * (PROMPT_PROCESSING_TOKENS // len(prompt) + 1))[:PROMPT_PROCESSING_TOKENS]
    long_ids = torch.tensor([long_prompt])
    result["prompt_tokens"] = len(prompt)

    def transformers_generate(n=new, batch_ids=ids):
        with torch.no_grad():
            out = theirs.generate(
                batch_ids, attention_mask=torch.ones_like(batch_ids), max_new_tokens=n, do_sample=False
            )
        return out[0, batch_ids.shape[1] :].tolist()

    works = {"transformers": transformers_generate, "flashformer": flashformer_generate}
    if point.get("compile"):
        works["flashformer+compile"] = lambda n=new, batch_ids=ids: flashformer_generate(n, True, batch_ids)
        started = time.perf_counter()
        flashformer_generate(3, compile=True)  # the compile it waits for, once per process
        result["compile_s"] = time.perf_counter() - started
    if theirs is None:
        del works["transformers"]
    if llama is not None:
        works["llama.cpp"] = lambda n=new, batch_ids=ids: llama[0](batch_ids[0].tolist(), n)
    for work in works.values():  # warm: allocator, caches, lazy initialization
        work(3)
    outputs = {name: work() for name, work in works.items()}
    # tokens equal to the reference's: transformers' float32 model, else (a random-weight model
    # too large for it) llama.cpp's
    result["reference"] = "transformers" if theirs is not None else "llama.cpp" if llama is not None else None
    reference = outputs.get(result["reference"])
    result["same_prefix_tokens"] = {
        name: None
        if reference is None
        else next((i for i, (a, b) in enumerate(zip(reference, tokens)) if a != b), len(reference))
        for name, tokens in outputs.items()
    }
    result["text"] = {name: tokenizer.decode(tokens)[:300] for name, tokens in outputs.items()}

    prefill = time_in_turns({name: lambda w=work: w(1) for name, work in works.items()}, rounds=rounds)
    times = time_in_turns(works, rounds=rounds, warmup=False)
    processing = {"flashformer": lambda: flashformer_generate(1, False, long_ids)}
    if theirs is not None:
        processing["transformers"] = lambda: transformers_generate(1, long_ids)
    if llama is not None:
        processing["llama.cpp"] = lambda: llama[1](long_prompt)
    processed = time_in_turns(processing, rounds=rounds)
    result["seconds"], result["prefill_s"] = times, prefill
    result["tokens_per_s"] = {name: new / t for name, t in times.items()}
    result["decode_tokens_per_s"] = {name: (new - 1) / (t - prefill[name]) for name, t in times.items()}
    result["prompt_tokens_per_s"] = {name: PROMPT_PROCESSING_TOKENS / t for name, t in processed.items()}

    ours_bytes = weight_bytes_per_token(ours)
    result["weight_bytes_per_token"] = {"flashformer": ours_bytes, "flashformer+compile": ours_bytes}
    if theirs is not None:
        result["weight_bytes_per_token"]["transformers"] = sum(
            p.numel() * p.element_size() for p in theirs.parameters()
        ) - theirs.get_input_embeddings().weight.nbytes * (not theirs.config.tie_word_embeddings)
    if llama is not None:
        result["weight_bytes_per_token"]["llama.cpp"] = gguf_bytes(path)
    result["bandwidth_gb_s"] = memory_bandwidth()
    result["achieved_gb_s"] = {
        name: result["weight_bytes_per_token"][name] * rate / 1e9
        for name, rate in result["decode_tokens_per_s"].items()
    }
    result["load_after"] = os.getloadavg()[0]
    return result


def run(model: str, config: dict, out_dir: Path, threads: int | None, timeout_s: float) -> dict:
    from flashformer.bench.common import run_worker
    from flashformer.files import write_json
    from flashformer.kernels.machine import machine_info

    point = {
        "model": str(Path(model).resolve()),
        "question": config["question"],
        "new_tokens": config["new_tokens"],
        "rounds": config["rounds"],
        "threads": threads,
        "quantize": config.get("quantize"),
        "activations": config.get("activations", "int8"),
        "batches": config.get("batches", [1]),
        "transformers": config.get("transformers", True),
        "isa": config.get("isa") or "best",
        "compile": config.get("compile", False),
    }
    folders = config.get("llama_cpp_dirs") or []
    for folder in folders:  # refused before any work when missing
        llama_bench_binary(folder)
    bench_threads = threads or torch.get_num_threads()
    repetitions = config.get("llama_bench_repetitions", REPETITIONS)

    def llama_bench(folder: str) -> dict:
        return run_llama_bench(folder, point["model"], bench_threads, repetitions=repetitions)

    before = {folder: llama_bench(folder) for folder in folders}
    env = None
    if point["isa"] != "best":  # both set here: an ATEN_CPU_CAPABILITY inherited would win in the worker
        env = {"FLASHFORMER_CPU_ISA": point["isa"], "ATEN_CPU_CAPABILITY": aten_capability(point["isa"])}
    # memory=False: it only times
    point.update(run_worker("flashformer.bench.generate", point, timeout_s, memory=False, env=env))
    if folders:
        point["llama_bench"] = {
            build_name(folder): best_run(before[folder], llama_bench(folder)) for folder in folders
        }
    if folders and config.get("cold_starts"):  # after the worker: the C++ extension is built by then
        point["cold_starts"] = cold_start.run(point["model"], folders[0], config["cold_starts"])
    payload = {"benchmark": "generate-model", "machine": machine_info(), "config": config, "points": [point]}
    stem = "generate-model" + (f"-{config['quantize']}" if config.get("quantize") else "")
    stem += "" if point["isa"] == "best" else f"-{point['isa']}"
    write_json(out_dir / f"{stem}.json", payload)
    plot(payload, out_dir / f"{stem}.png")
    return payload


def build_name(folder: str) -> str:
    """A llama.cpp build's name in the table: its folder's (the one above bin/)."""
    path = Path(folder).resolve()
    return path.parent.name if path.name == "bin" else path.name


def best_run(*runs: dict) -> dict:
    """Of llama-bench's runs of one build (before and after the worker), the one of the best
    tg128, with every run's pp512 and tg128 kept."""
    measured = [run for run in runs if "error" not in run]
    if not measured:
        return runs[-1]
    best = max(measured, key=lambda run: run["tg128"]["tokens_per_s"])
    return {**best, "runs": [{key: run.get(key) for key in ("pp512", "tg128", "error")} for run in runs]}


def llama_bench_ratios(point: dict) -> dict:
    """name of the build -> flashformer's decode (its default path) and 512-token prompt tokens/s
    over that build's tg128 and pp512."""
    found = {}
    for name, bench in point.get("llama_bench", {}).items():
        if "error" in bench or "error" in point:
            continue
        decode = point["decode_tokens_per_s"].get("flashformer")
        prompt = point["prompt_tokens_per_s"].get("flashformer")
        found[name] = {
            "decode / tg128": None if decode is None else decode / bench["tg128"]["tokens_per_s"],
            "prompt / pp512": None if prompt is None else prompt / bench["pp512"]["tokens_per_s"],
        }
    return found


def table(payload: dict) -> str:
    from flashformer.formatting import markdown_table

    rows = []
    p = payload["points"][0]
    if "error" in p:
        return f"{Path(p['model']).name}: not measured: {p['error']}"
    for name in p["tokens_per_s"]:
        load = p["load_s"].get(name.split("+")[0])
        rows.append(
            [
                name,
                "-" if load is None else f"{load:.1f}",
                f"{1e3 * p['prefill_s'][name]:.0f}",
                f"{p['decode_tokens_per_s'][name]:.1f}",
                _ratio(p["decode_tokens_per_s"][name], p["decode_tokens_per_s"].get("llama.cpp")),
                "-"
                if name.split("+")[0] not in p["prompt_tokens_per_s"]
                else f"{p['prompt_tokens_per_s'][name.split('+')[0]]:.0f}",
                f"{p['weight_bytes_per_token'][name] / 1e6:.0f}",
                f"{p['achieved_gb_s'][name]:.1f}",
                "-" if p["same_prefix_tokens"][name] is None else str(p["same_prefix_tokens"][name]),
            ]
        )
    quantized = f"flashformer {p['quantize']}" if p.get("quantize") else "flashformer float32"
    reference = p.get("reference", "transformers")
    head = (
        f"{Path(p['model']).name} ({quantized}"
        + ("; transformers float32" if reference == "transformers" else "")
        + f"), {p.get('prompt_tokens', '?')}-token "
        f"{p.get('prompt_kind', 'chat')} prompt, "
        f"{payload['config']['new_tokens']} new tokens, greedy, batch 1, {p['threads']} threads; memory bandwidth in "
        f"the same run {p['bandwidth_gb_s']:.1f} GB/s (a float32 sum)"
        + (f"; our kernels' path {p['kernel_isa']}" if p.get("kernel_isa") else "")
        + (f", PyTorch's {p['torch_cpu_capability']}" if p.get("torch_cpu_capability") else "")
        + (f"; load average {p['load_before']:.1f} -> {p['load_after']:.1f}" if "load_after" in p else "")
        + "\n\n"
    )
    header = [
        "contender",
        "load s",
        "prefill ms",
        "decode tokens/s",
        "/ llama.cpp",
        f"prompt tokens/s ({PROMPT_PROCESSING_TOKENS})",
        "MB read / token",
        "GB/s",
        "tokens equal to a reference's (none ran)"
        if reference is None
        else f"tokens equal to {reference}'" + ("" if reference.endswith("s") else "s"),
    ]
    for name, bench in p.get("llama_bench", {}).items():
        if "error" in bench:
            rows.append([f"llama-bench ({name})", f"not measured: {bench['error'][:80]}"] + ["-"] * 7)
            continue
        tg, pp = bench["tg128"], bench["pp512"]
        rows.append([f"llama-bench ({name})", "-", "-", f"{tg['tokens_per_s']:.1f} ± {tg['stddev']:.1f}",
                     _ratio(tg["tokens_per_s"], p["decode_tokens_per_s"].get("llama.cpp")),
                     f"{pp['tokens_per_s']:.0f} ± {pp['stddev']:.0f}", "-", "-", "-"])  # fmt: skip
    text = head + markdown_table(header, rows)
    # runs from before the native decoder (no "native" key): their default was the modules, eagerly,
    # and their batches were timed compiled
    path = {True: "its default path, native", False: "its default path here: the modules, eagerly"}.get(
        p.get("native"), "its default path then: the modules, eagerly"
    )
    ratios = llama_bench_ratios(p)
    if ratios:
        text += (
            f"\n\nflashformer ({path}: decode, 512-token prompt) / llama-bench (tg128, pp512): "
            + "; ".join(
                f"{name}: decode {r['decode / tg128']:.2f}x, prompt {r['prompt / pp512']:.2f}x"
                for name, r in ratios.items()
            )
        )
    cold = p.get("cold_start_s")
    if cold:
        runs = "natively, nothing compiled" if p.get("native") else "through its PyTorch modules"
        text += (
            f"\n\nflashformer's cold start ({runs}): the model loaded {cold['loaded']:.1f} s after the process "
            f"started, its first token at {cold['first_token']:.1f} s"
        )
        if "compile_s" in p:
            text += f"; --compile then waited {p['compile_s']:.0f} s for torch.compile"
    memory = p.get("memory")
    if memory and memory.get("file_bytes"):
        held = memory["rss_after_load"] - memory["rss_before_load"]
        text += (
            f"\n\nflashformer's load: RSS {memory['rss_after_load'] / 1e6:.0f} MB after it, "
            f"{held / 1e6:.0f} MB more than before it = {held / memory['file_bytes']:.2f}x the file "
            f"({memory['file_bytes'] / 1e6:.0f} MB); peak {memory['peak_rss_during_load'] / 1e6:.0f} MB"
        )
        for when, status in memory.get("status", {}).items():
            text += f"\n- {when.replace('_', ' ')}: " + ", ".join(
                f"{key} {value / 1e6:.0f} MB" for key, value in status.items()
            )
    starts = p.get("cold_starts", {}).get("summary", {})
    if len(starts) == 2:
        runs = len(p["cold_starts"]["runs"]["flashformer"])
        text += (
            f"\n\nLoad to first token, {runs} fresh processes each in turns (cold_start.py), seconds "
            + "; ".join(
                f"{name}: best {s['best']:.2f}, median {s['median']:.2f} ({s['best']:.2f}-{s['worst']:.2f}), "
                f"peak RSS {s['max_rss_of_best'] / 1e6:.0f} MB"
                for name, s in starts.items()
            )
        )
    found = targets(p)
    if found:
        text += "\n\nTargets: " + "; ".join(
            f"{name} {value:.2f} ({'<=' if below else '>='} {limit}: {'reached' if (value <= limit) == below else 'not reached'})"
            for name, (value, limit, below) in found.items()
        )
    if "batch_decode_tokens_per_s" in p:
        rates = p["batch_decode_tokens_per_s"]
        batches = "flashformer" if "native" in p else "flashformer compiled"
        text += f"\n\n{batches}, aggregate decode tokens/s by batch: " + ", ".join(
            f"{b}: {r:.1f}" for b, r in sorted(rates.items(), key=lambda kv: int(kv[0]))
        )
        text += f"; the same tokens at every batch size: {p['same_tokens_every_batch']}"
    return text


def targets(p: dict) -> dict[str, tuple[float, float, bool]]:
    """The memory-bound targets (issue "memory at the sizes people run"), where this run measured
    them, in the runs that timed cold starts (--cold-starts: the ones asked for these figures):
    name -> (value, limit, True where the value must be at most the limit)."""
    found = {}
    if "cold_starts" not in p:
        return found
    starts = p["cold_starts"]["summary"]
    if len(starts) == 2:
        found["load to first token, ours / llama.cpp's (best)"] = (
            starts["flashformer"]["best"] / starts["llama.cpp"]["best"], 1.5, True)  # fmt: skip
    memory = p.get("memory") or {}
    if memory.get("file_bytes") and "after_first_token" in memory.get("status", {}):
        after = memory["status"]["after_first_token"]["VmRSS"] - memory["rss_before_load"]
        found["RSS the model holds after its first token / the file"] = (
            after / memory["file_bytes"],
            1.1,
            True,
        )
    for name, bench in p.get("llama_bench", {}).items():
        if "error" not in bench and "flashformer" in p.get("decode_tokens_per_s", {}):
            found[f"decode / tg128 of {name}"] = (
                p["decode_tokens_per_s"]["flashformer"] / bench["tg128"]["tokens_per_s"], 1.1, False)  # fmt: skip
    if "flashformer" in p.get("achieved_gb_s", {}):
        found["decode GB/s / the bandwidth measured"] = (
            p["achieved_gb_s"]["flashformer"] / p["bandwidth_gb_s"],
            0.75,
            False,
        )
    return found


def _ratio(rate: float, peer: float | None) -> str:
    """rate / the peer's, or "-" where the peer did not run (llama-cpp-python not installed)."""
    return "-" if peer is None else f"{rate / peer:.2f}"


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    point = payload["points"][0]
    fig, (rate, stream) = plt.subplots(1, 2, figsize=(11, 3.8))
    if "error" in point:
        rate.text(0.5, 0.5, f"not measured: {point['error'][:80]}", ha="center", va="center")
    else:
        names = list(point["decode_tokens_per_s"])
        rate.barh(names, [point["decode_tokens_per_s"][n] for n in names], color="tab:blue")
        benches = {
            f"llama-bench ({name})": b for name, b in point.get("llama_bench", {}).items() if "error" not in b
        }
        rate.barh(list(benches), [b["tg128"]["tokens_per_s"] for b in benches.values()], color="tab:orange")
        rate.set_xlabel("decode tokens/s (batch 1, greedy; llama-bench: tg128)")
        stream.barh(names, [point["achieved_gb_s"][n] for n in names], color="tab:green")
        stream.axvline(point["bandwidth_gb_s"], color="gray", linestyle="--", label="memory bandwidth")
        stream.set_xlabel("GB/s of weights read")
        stream.legend(fontsize=8)
    fig.suptitle(f"{Path(point['model']).name}, {point.get('quantize') or 'float32'}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
