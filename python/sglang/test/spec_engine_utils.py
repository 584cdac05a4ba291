"""Helpers for GPU tests of speculative decoding on synthetic checkpoints.

The checkpoints come from :mod:`sglang.test.synthetic_spec_models`: greedy decoding
is decided by a clear margin and the draft acceptance is a parameter, so outputs
of speculative and plain engines can be compared token by token.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import json
import os
import pkgutil
import random
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

SYNTHETIC_MODELS_DIR_ENV = "SGLANG_SYNTHETIC_MODELS_DIR"
# In a cached pair's directory: the digest of the generator source that wrote it.
GENERATOR_DIGEST_FILE = "generator.sha256"
# The checkout this module lies in (python/sglang/test/ -> the repository root).
REPO_ROOT = Path(__file__).resolve().parents[3]

# Small engines: tests run several of them one after another, or side by side, on
# one GPU.
TEST_ENGINE_DEFAULTS: Dict[str, object] = dict(
    skip_tokenizer_init=True,
    grammar_backend="none",
    mem_fraction_static=0.5,
    max_total_tokens=65536,
    cuda_graph_max_bs_decode=32,
    random_seed=0,
    log_level="warning",
)


# Enough for ServerArgs and ModelConfig on CPU (scheduler bookkeeping tests).
TINY_LLAMA_CONFIG: Dict[str, object] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
}


def benchmark_dir_on_path() -> Path:
    """benchmark/dynamic_spec/ of this checkout, put on sys.path (where the scripts
    there import each other from) if it was not."""
    directory = REPO_ROOT / "benchmark" / "dynamic_spec"
    if str(directory) not in sys.path:
        sys.path.insert(0, str(directory))
    return directory


def load_benchmark_script(name: str) -> types.ModuleType:
    """``benchmark/dynamic_spec/<name>.py`` of this checkout, imported as module
    ``name`` (registered in sys.modules: dataclasses resolve annotations there)
    with that directory on sys.path, as when it runs: it imports the others there."""
    path = benchmark_dir_on_path() / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_benchmark_package(name: str) -> types.ModuleType:
    """Package ``name`` of benchmark/dynamic_spec/ of this checkout (e.g. ``sweep``),
    imported as the scripts there import it (with that directory on sys.path), and
    all of its modules: ``sweep.stats`` and the others are attributes of it."""
    benchmark_dir_on_path()
    package = importlib.import_module(name)
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{name}.{module.name}")
    return package


def tiny_llama_config_dir() -> tempfile.TemporaryDirectory:
    """A temporary model directory holding only TINY_LLAMA_CONFIG as config.json."""
    tmpdir = tempfile.TemporaryDirectory()
    with open(os.path.join(tmpdir.name, "config.json"), "w") as f:
        json.dump(TINY_LLAMA_CONFIG, f)
    return tmpdir


def acceptance_label(draft_accept) -> str:
    """0.95, or 0.95-0.3 for a content-shift pair's regions."""
    if isinstance(draft_accept, (int, float)):
        return str(draft_accept)
    return "-".join(str(p) for p in draft_accept)


def synthetic_pair_dir(
    preset: str = "tiny",
    draft_accept: Union[float, Tuple[float, ...]] = 0.8,
    seed: int = 0,
    draft_kv_check: bool = False,
    draft_arch: str = "eagle3",
) -> str:
    """Where synthetic_pair keeps this pair (generated once its spec file is there)."""
    root = os.environ.get(SYNTHETIC_MODELS_DIR_ENV) or os.path.join(
        tempfile.gettempdir(), "sglang-synthetic"
    )
    variant = "-kvcheck" if draft_kv_check else ""
    if draft_arch != "eagle3":
        variant += f"-{draft_arch}"
    return os.path.join(
        root, f"{preset}-p{acceptance_label(draft_accept)}-s{seed}{variant}"
    )


def generator_digest() -> str:
    """The SHA-256 of sglang.test.synthetic_spec_models' source."""
    origin = importlib.util.find_spec("sglang.test.synthetic_spec_models").origin
    return hashlib.sha256(Path(origin).read_bytes()).hexdigest()


def synthetic_pair_is_current(out_dir: str) -> bool:
    """Whether out_dir holds a whole pair that this generator wrote: one written by
    other generator code (another preset shape, another draft) is stale."""
    digest_file = Path(out_dir, GENERATOR_DIGEST_FILE)
    return digest_file.is_file() and digest_file.read_text() == generator_digest()


def synthetic_pair(
    preset: str = "tiny",
    draft_accept: Union[float, Tuple[float, ...]] = 0.8,
    seed: int = 0,
    draft_kv_check: bool = False,
    draft_arch: str = "eagle3",
) -> Tuple[str, str]:
    """(target_dir, draft_dir) of a synthetic pair, generated once per cache directory
    and generator source (``synthetic_pair_is_current``).

    ``draft_kv_check``: the draft variant that proposes right only when its KV cache
    of the previous position is valid (catches stale draft KV after plain steps).
    ``draft_arch`` "eagle": an EAGLE draft that accepts all (draft_accept 1; serve
    it with ``eagle3_args(..., draft_arch="eagle")``).
    """
    import torch
    from sglang.test.synthetic_spec_models import generate

    out_dir = synthetic_pair_dir(preset, draft_accept, seed, draft_kv_check, draft_arch)
    if not synthetic_pair_is_current(out_dir):
        shutil.rmtree(out_dir, ignore_errors=True)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        generate(
            preset,
            out_dir,
            draft_accept,
            seed=seed,
            device=device,
            draft_kv_check=draft_kv_check,
            draft_arch=draft_arch,
        )
        if device == "cuda":
            # Servers launched next by this process need the memory.
            torch.cuda.empty_cache()
        Path(out_dir, GENERATOR_DIGEST_FILE).write_text(generator_digest())
    return os.path.join(out_dir, "target"), os.path.join(out_dir, "draft")


def random_prompts(
    num: int, length: int, vocab_size: int, seed: int = 0
) -> List[List[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(length)] for _ in range(num)]


def greedy_params(max_new_tokens: int, **extra: object) -> Dict[str, object]:
    return dict(
        temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True, **extra
    )


# The two EAGLE-3 shapes the tests and the benchmark use (eagle3_args' step counts):
# a chain (topk 1) and the draft tree of the deployments the load-aware mode is for
# (topk 4, 16 draft tokens).
EAGLE3_CHAIN = dict(num_steps=3, topk=1, num_draft_tokens=4)
EAGLE3_TREE = dict(num_steps=2, topk=4, num_draft_tokens=16)


# synthetic_pair's draft architectures and the algorithm that serves each.
SPECULATIVE_ALGORITHMS = {"eagle3": "EAGLE3", "eagle": "EAGLE"}


def eagle3_args(
    draft_dir: str,
    num_steps: int,
    topk: int,
    num_draft_tokens: int,
    draft_arch: str = "eagle3",
) -> Dict[str, object]:
    """draft_arch: synthetic_pair's, which names the speculative algorithm."""
    return dict(
        speculative_algorithm=SPECULATIVE_ALGORITHMS[draft_arch],
        speculative_draft_model_path=draft_dir,
        speculative_num_steps=num_steps,
        speculative_eagle_topk=topk,
        speculative_num_draft_tokens=num_draft_tokens,
    )


def cli_args(server_args: Dict[str, object]) -> List[str]:
    """ServerArgs keyword arguments as ``launch_server`` flags (True: a bare flag;
    False and None: omitted)."""
    flags: List[str] = []
    for name, value in server_args.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False and value is not None:
            flags += [flag, str(value)]
    return flags


@contextlib.contextmanager
def running_engine(model_path: str, **kwargs: object) -> Iterator["object"]:
    """An ``sglang.Engine`` with test defaults, shut down on exit."""
    import sglang

    engine = sglang.Engine(model_path=model_path, **{**TEST_ENGINE_DEFAULTS, **kwargs})
    try:
        yield engine
    finally:
        engine.shutdown()


def generate_outputs(
    engine, prompts: Sequence[List[int]], params: Dict[str, object], batched: bool
) -> List[dict]:
    """All prompts in one call (one running batch), or one request at a time
    (batch 1)."""
    if batched:
        return engine.generate(input_ids=list(prompts), sampling_params=params)
    return [
        engine.generate(input_ids=prompt, sampling_params=params) for prompt in prompts
    ]


def accept_length(outputs: Sequence[dict]) -> float:
    """Tokens per verify step (accepted drafts + bonus), over the speculative
    steps only."""
    verify = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outputs)
    correct = sum(o["meta_info"].get("spec_num_correct_drafts", 0) for o in outputs)
    if verify == 0:
        raise AssertionError("no speculative step ran")
    return (correct + verify) / verify


def plain_step_tokens(meta: dict) -> int:
    """Output tokens of a request that plain decode steps produced: the first comes
    from prefill, each verify step gives one plus its accepted drafts. Clamped at 0:
    a request that ends inside a verify step counts that step's drafts past its end."""
    spec_tokens = meta.get("spec_verify_ct", 0) + meta.get("spec_num_correct_drafts", 0)
    return max(0, meta["completion_tokens"] - 1 - spec_tokens)


# The scheduler's KV leak checks: at idle (on by default) and after every busy step.
LEAK_CHECK_ENV = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1"}


def with_synthetic_tokenizer(model_path: str, server_args: Sequence[str]) -> List[str]:
    """``server_args`` plus ``--tokenizer-path`` to the tokenizer directory of a
    synthetic target (``synthetic_spec_models.tokenizer_dir``: a qwen2 target's own
    directory would encode the server's warm-up text to no token), unless they name
    a tokenizer already or ``model_path`` is not a synthetic target."""
    from sglang.test.synthetic_spec_models import SPEC_FILE, tokenizer_dir

    args = list(server_args)
    named = any(a.split("=")[0] == "--tokenizer-path" for a in args)
    pair_dir = os.path.dirname(os.path.abspath(model_path))
    if not named and os.path.isfile(os.path.join(pair_dir, SPEC_FILE)):
        args += ["--tokenizer-path", tokenizer_dir(model_path)]
    return args


def run_check_in_child(
    test_file: str, child_arg: str, env: Optional[Dict[str, str]] = None
) -> subprocess.CompletedProcess:
    """``python test_file child_arg PORT`` with a free PORT, its output captured: a
    check that initializes torch.distributed runs in a process of its own."""
    from sglang.srt.utils.network import get_free_port

    return subprocess.run(
        [sys.executable, test_file, child_arg, str(get_free_port())],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
    )


def init_single_rank_model_parallel(port: int, device: str) -> None:
    """What a model is built under in a one-rank process: the process group (nccl
    on CUDA, gloo on the CPU) on PORT, the model parallel groups and the global
    server args."""
    from sglang.srt.distributed import (
        init_distributed_environment,
        initialize_model_parallel,
    )
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    init_distributed_environment(
        world_size=1,
        rank=0,
        local_rank=0,
        distributed_init_method=f"tcp://127.0.0.1:{port}",
        backend="nccl" if device == "cuda" else "gloo",
    )
    initialize_model_parallel(1)
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", device=device))


@contextlib.contextmanager
def running_server(
    model_path: str,
    other_args: Sequence[str],
    env: Optional[Dict[str, str]] = None,
    base_url: Optional[str] = None,
    log_path: Optional[str] = None,
    synthetic_tokenizer: bool = True,
) -> Iterator[Tuple[str, "subprocess.Popen"]]:
    """``python -m sglang.launch_server``, healthy on entry, killed on exit.

    On a free port unless ``base_url`` is given, so that tests can run side by side.
    Launched through the interpreter rather than the ``sglang`` console script so that
    it also runs from a source tree on PYTHONPATH. A synthetic target is served with
    its tokenizer directory (``with_synthetic_tokenizer``) unless
    ``synthetic_tokenizer`` is False. ``log_path``: write the server's output there
    instead of to this process's stdout and stderr.
    """
    from urllib.parse import urlparse

    from sglang.srt.utils import kill_process_tree
    from sglang.test.test_utils import (
        DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH,
        DEFAULT_URL_FOR_TEST,
        _wait_for_server_health,
        find_available_port,
    )

    if base_url is None:
        port = find_available_port(urlparse(DEFAULT_URL_FOR_TEST).port)
        base_url = f"http://127.0.0.1:{port}"
    url = urlparse(base_url)
    command = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path]
    command += ["--host", url.hostname, "--port", str(url.port)]
    if synthetic_tokenizer:
        other_args = with_synthetic_tokenizer(model_path, other_args)
    command += other_args
    with contextlib.ExitStack() as stack:
        log = stack.enter_context(open(log_path, "w")) if log_path else None
        process = subprocess.Popen(
            command,
            env={**os.environ, **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT if log else None,
        )
        try:
            healthy, error = _wait_for_server_health(
                process, base_url, None, DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH
            )
            if not healthy:
                raise RuntimeError(f"server at {base_url}: {error}")
            yield base_url, process
        finally:
            kill_process_tree(process.pid)


def post_generate(
    base_url: str, input_ids: List[int], params: Dict[str, object], **extra: object
) -> dict:
    import requests

    response = requests.post(
        f"{base_url}/generate",
        json=dict(input_ids=input_ids, sampling_params=params, **extra),
        timeout=600,
    )
    response.raise_for_status()
    return response.json()


def post_concurrently(
    base_url: str,
    requests_: Sequence[Tuple[List[int], Dict[str, object]]],
    **extra: object,
) -> List[dict]:
    """Send all requests at once (one thread each); results in request order."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, len(requests_))) as pool:
        futures = [
            pool.submit(post_generate, base_url, ids, params, **extra)
            for ids, params in requests_
        ]
        return [f.result() for f in futures]


def scrape_metrics(base_url: str) -> Dict[str, float]:
    """Prometheus samples as ``name{labels} -> value`` (labels kept verbatim)."""
    import requests

    samples = {}
    for line in requests.get(f"{base_url}/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    return samples


def metric_total(samples: Dict[str, float], name: str, **labels: str) -> float:
    """Sum of a metric's samples whose labels include ``labels``."""
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(
        value
        for key, value in samples.items()
        if key.split("{")[0] == name and all(w in key for w in wanted)
    )
