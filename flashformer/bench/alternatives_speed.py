"""The speed and memory points of the alternatives study, each in a fresh process.

    decode at context n: a prefill of n tokens (in chunks of 512, so the prompt's activations
        do not hide the state), then new tokens one at a time; decode tokens/s (of the median
        step, after two warm-up steps: robust to a neighbour's process taking the core), the bytes of the
        tensors the decoding session keeps (a Transformer's KV cache, a recurrent model's state),
        and the peak RSS the whole decode added;
    train at length n: one sequence of n tokens forward and backward; tokens/s and peak RSS.

Random weights: speed and memory do not depend on what a model learned.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from flashformer.bench.common import bench_main, measure_peak, run_worker
from flashformer.generate.sampling import GenerationSettings
from flashformer.generate.session import make_session
from flashformer.model.config import ModelConfig
from flashformer.model.models import build, cross_entropy

MODULE = "flashformer.bench.alternatives_speed"
PREFILL_CHUNK = 512
WARMUP_STEPS = 2  # decode steps left out of the rate (first calls allocate and warm caches)


def tensor_bytes(value, seen: set[int] | None = None) -> int:
    """Bytes of the distinct tensors reachable from `value` (attributes, lists, tuples, dicts),
    each storage counted once: what a decoding session holds between steps."""
    seen = set() if seen is None else seen
    if isinstance(value, torch.Tensor):
        key = value.untyped_storage().data_ptr()
        if key in seen or value.device.type == "meta":
            return 0
        seen.add(key)
        return value.untyped_storage().nbytes()
    if isinstance(value, torch.nn.Module):
        return 0  # the weights are not state
    if isinstance(value, dict):
        return sum(tensor_bytes(v, seen) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v, seen) for v in value)
    if hasattr(value, "__dict__"):
        return sum(tensor_bytes(v, seen) for v in vars(value).values())
    return 0


def session_state_bytes(session) -> int:
    """The session's own tensors, without its prompt (input_ids): KV caches, masks, states."""
    state = {name: v for name, v in vars(session).items() if name != "input_ids"}
    return tensor_bytes(state)


def decode_worker(point: dict) -> dict:
    """point: config (ModelConfig as a dict), n, new_tokens."""
    torch.manual_seed(0)
    model = build(ModelConfig.from_dict(point["config"])).eval()
    n, new = point["n"], point["new_tokens"]
    prompt = torch.randint(2, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
    settings = GenerationSettings(max_new_tokens=new, prefill_chunk_size=PREFILL_CHUNK)
    found = {}

    @torch.no_grad()
    def decode():
        session = make_session(model, prompt, None, settings)
        started = time.perf_counter()
        token = session.prefill().argmax(-1)  # (1,)
        prefill_s = time.perf_counter() - started
        steps = []
        for _ in range(new):
            began = time.perf_counter()
            token = session.step(token).argmax(-1)
            steps.append(time.perf_counter() - began)
        # the median step: one step preempted by a neighbour's process must not set the rate
        found.update(
            prefill_s=prefill_s,
            decode_tokens_per_s=1 / statistics.median(steps[WARMUP_STEPS:]),
            state_bytes=session_state_bytes(session),
        )

    peak = measure_peak(decode)
    return dict(found, **peak, load=os.getloadavg()[0])


def train_worker(point: dict) -> dict:
    """point: config, n, repeats: forward + backward of one sequence of n tokens."""
    torch.manual_seed(0)
    model = build(ModelConfig.from_dict(point["config"])).train()
    n = point["n"]
    tokens = torch.randint(2, model.config.vocab_size, (1, n + 1), generator=torch.Generator().manual_seed(n))

    def step():
        loss = cross_entropy(model(input_ids=tokens[:, :-1]).logits, tokens[:, 1:])
        loss.backward()
        model.zero_grad(set_to_none=True)

    peak = measure_peak(step)  # also the warm-up
    times = []
    for _ in range(point["repeats"]):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return dict(peak, tokens_per_s=n / min(times), load=os.getloadavg()[0])


WORKERS = {"decode": decode_worker, "train": train_worker}


def worker(point: dict) -> dict:
    if point.get("threads"):
        torch.set_num_threads(point["threads"])
    return WORKERS[point["kind"]](point)


def measure(point: dict, fresh_process: bool, timeout_s: float) -> dict:
    """One point, in a fresh process (the study) or in this one (the tests' tiny version)."""
    if fresh_process:
        return run_worker(MODULE, point, timeout_s)
    return worker(point)


def main(argv: list[str] | None = None) -> None:
    bench_main(MODULE, __doc__, lambda parser: None, lambda args: None, worker, argv)


if __name__ == "__main__":
    main()
