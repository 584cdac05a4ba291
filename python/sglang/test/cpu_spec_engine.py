"""An ``sglang.Engine`` with EAGLE / EAGLE-3 speculative decoding on a CPU that has
no CPU build of sgl_kernel (no AMX): the CPU tier's end-to-end engine.

Upstream's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) calls a few sgl_kernel CPU ops
on the speculative path. The engine's processes run in Triton's interpreter
(``TRITON_INTERPRET=1``), and each of those ops launches the Triton kernel that
upstream launches on GPUs, with the arguments of upstream's GPU branch. Every other
sgl_kernel op raises when called: unlike upstream's ``maybe_stub_sgl_kernel``
(MagicMocks that silently "succeed"), nothing here fakes a result. Attention for
the speculative forward modes comes from :mod:`sglang.test.cpu_spec_attention`.

The shims reach the engine's subprocesses through upstream's override points for
forks: ``Engine.run_scheduler_process_func`` and ``run_detokenizer_process_func``
are functions of this module, which install the shims and then run upstream's
(a spawned process imports this module to unpickle them). Hence this module imports
nothing from ``sglang.srt`` at its top level: the stub must be in place before
anything imports sgl_kernel.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import logging
import os
import signal
import sys
import types
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, Mapping, Optional
from unittest import mock

from sglang.test.spec_engine_utils import TEST_ENGINE_DEFAULTS

if TYPE_CHECKING:
    import torch

    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

CPU_ENGINE_ENV: Dict[str, str] = {"SGLANG_USE_CPU_ENGINE": "1"}
# Read when a kernel is defined, so it must be set when the engine's processes start.
TRITON_INTERPRETER_ENV: Dict[str, str] = {"TRITON_INTERPRET": "1"}

# Where NCCL would be loaded from: nowhere. The CUDA wheel of torch brings an NCCL
# library, and with it every TP group would build a NCCL communicator on a CUDA
# device; without one, TP ranks all-reduce through torch.distributed (gloo).
NO_NCCL_ENV: Dict[str, str] = {"SGLANG_NCCL_SO_PATH": "/nonexistent/libnccl.so.2"}

# Small engines on a CPU (the synthetic models' context is 512 tokens).
CPU_ENGINE_DEFAULTS: Dict[str, Any] = {
    **TEST_ENGINE_DEFAULTS,
    "device": "cpu",
    "attention_backend": "torch_native",
    "disable_cuda_graph": True,
    "dtype": "bfloat16",
    "max_total_tokens": 4096,
    "max_running_requests": 16,
}


# ---------------------------------------------------------------------------
# sgl_kernel CPU ops: upstream's Triton kernels (interpreted in the engine).
# ---------------------------------------------------------------------------


def _next_power_of_2(n: int) -> int:
    from sglang.srt.utils import next_power_of_2

    return next_power_of_2(n)


def _per_request_slot_kernel(
    kernel_module: str, kernel_name: str, op_name: str
) -> Callable[..., None]:
    """An sgl_kernel op that writes ``[start, end)`` slots per request, as upstream's
    Triton kernel ``kernel_name`` of ``kernel_module`` (one program per request)."""

    def op(
        req_pool_indices: torch.Tensor,
        req_to_token: torch.Tensor,
        start_offset: torch.Tensor,
        end_offset: torch.Tensor,
        out_cache_loc: torch.Tensor,
        pool_len: int,
    ) -> None:
        kernel = getattr(importlib.import_module(kernel_module), kernel_name)
        bs = req_pool_indices.shape[0]
        kernel[(bs,)](
            req_pool_indices,
            req_to_token,
            start_offset,
            end_offset,
            out_cache_loc,
            pool_len,
            _next_power_of_2(bs),
        )

    op.__name__ = op_name
    return op


assign_req_to_token_pool_cpu = _per_request_slot_kernel(
    "sglang.srt.mem_cache.allocation",
    "assign_req_to_token_pool",
    "assign_req_to_token_pool_cpu",
)
assign_extend_cache_locs_cpu = _per_request_slot_kernel(
    "sglang.kernels.ops.speculative.cache_locs",
    "assign_extend_cache_locs",
    "assign_extend_cache_locs_cpu",
)


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
    topk: int,
    num_steps: int,
) -> None:
    from sglang.kernels.ops.speculative.cache_locs import (
        assign_draft_cache_locs_contiguous,
    )

    bs = req_pool_indices.shape[0]
    assign_draft_cache_locs_contiguous[(bs,)](
        req_pool_indices,
        req_to_token,
        seq_lens,
        out_cache_loc,
        pool_len,
        topk,
        num_steps,
    )


def fill_accept_out_cache_loc_cpu(
    accept_index: torch.Tensor,
    out_cache_loc: torch.Tensor,
    accept_out_cache_loc: torch.Tensor,
) -> None:
    from sglang.kernels.ops.speculative.eagle import fill_accept_out_cache_loc

    size = accept_index.numel()
    fill_accept_out_cache_loc[(size,)](
        accept_index, out_cache_loc, accept_out_cache_loc, _next_power_of_2(size)
    )


def fill_bonus_tokens_cpu(
    accept_tokens: torch.Tensor,
    accept_lens: torch.Tensor,
    bonus_tokens: torch.Tensor,
    accept_stride: int,
) -> None:
    from sglang.kernels.ops.speculative.eagle import fill_bonus_tokens

    fill_bonus_tokens[(accept_lens.shape[0],)](
        accept_tokens, accept_lens, bonus_tokens, accept_stride
    )


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    from sglang.kernels.ops.kvcache.cache_move import copy_all_layer_kv_cache_tiled

    # One tile per row: the interpreter's cost is per program, not per byte.
    bytes_per_tile = _next_power_of_2(int(strides.max()))
    num_locs = tgt_loc.numel()
    copy_all_layer_kv_cache_tiled[(data_ptrs.numel(), 1)](
        data_ptrs,
        strides,
        tgt_loc,
        src_loc,
        num_locs,
        _next_power_of_2(num_locs),
        BYTES_PER_TILE=bytes_per_tile,
    )


def build_tree_kernel_efficient_cpu(*args: Any) -> None:
    """Upstream's Triton tree builder (its XPU path)."""
    from sglang.srt.speculative.eagle_utils import sgl_build_tree_kernel_triton

    sgl_build_tree_kernel_triton(*args)


def verify_tree_greedy_cpu(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> None:
    """Upstream's Triton greedy tree verify (its XPU path)."""
    from sglang.srt.speculative.eagle_utils import verify_tree_greedy_triton

    verify_tree_greedy_triton(
        predicts,
        accept_index,
        accept_token_num,
        candidates,
        retrive_index,
        retrive_next_token,
        retrive_next_sibling,
        target_predict,
    )


CPU_KERNELS: Dict[str, Callable[..., None]] = {
    fn.__name__: fn
    for fn in (
        assign_req_to_token_pool_cpu,
        assign_extend_cache_locs_cpu,
        assign_draft_cache_locs_contiguous_cpu,
        fill_accept_out_cache_loc_cpu,
        fill_bonus_tokens_cpu,
        copy_all_layer_kv_cache_cpu,
        build_tree_kernel_efficient_cpu,
        verify_tree_greedy_cpu,
    )
}


# ---------------------------------------------------------------------------
# The sgl_kernel stub.
# ---------------------------------------------------------------------------


class MissingSglKernelOp:
    """An sgl_kernel attribute without a CPU shim: importing and attribute chains
    work (modules import many ops they never call on CPU); calling raises."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> "MissingSglKernelOp":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return MissingSglKernelOp(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"sgl_kernel.{self._name} was called but has no CPU implementation in "
            "sglang.test.cpu_spec_engine (no CPU build of sgl_kernel here)"
        )

    def __repr__(self) -> str:
        return f"<MissingSglKernelOp sgl_kernel.{self._name}>"


class _SglKernelStubLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        prefix = module.__name__.partition(".")[2]

        def getattr_(name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            if not prefix and name in CPU_KERNELS:
                return CPU_KERNELS[name]
            return MissingSglKernelOp(f"{prefix}.{name}" if prefix else name)

        module.__getattr__ = getattr_  # type: ignore[method-assign]


class _SglKernelStubFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Any, target: Any = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname == "sgl_kernel" or fullname.startswith("sgl_kernel."):
            return importlib.machinery.ModuleSpec(
                fullname, _SglKernelStubLoader(), is_package=True
            )
        return None


def _is_stub(module: Any) -> bool:
    spec = getattr(module, "__spec__", None)
    return isinstance(getattr(spec, "loader", None), _SglKernelStubLoader)


def _sgl_kernel_modules() -> Dict[str, Any]:
    return {
        name: module
        for name, module in sys.modules.items()
        if name == "sgl_kernel" or name.startswith("sgl_kernel.")
    }


def install_sgl_kernel_stub() -> None:
    """sgl_kernel (and every submodule) becomes the stub, for imports from now on.

    Drops what a failed import of the real package left in sys.modules (sglang's
    import tries it and catches the error, keeping its submodules)."""
    if not any(isinstance(f, _SglKernelStubFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _SglKernelStubFinder())
    for name, module in _sgl_kernel_modules().items():
        if not _is_stub(module):
            del sys.modules[name]


def uninstall_sgl_kernel_stub() -> None:
    """Undo install_sgl_kernel_stub for later imports (modules that imported ops
    keep them)."""
    sys.meta_path[:] = [
        f for f in sys.meta_path if not isinstance(f, _SglKernelStubFinder)
    ]
    for name, module in _sgl_kernel_modules().items():
        if _is_stub(module):
            del sys.modules[name]


# ---------------------------------------------------------------------------
# Everything a spawned engine process needs.
# ---------------------------------------------------------------------------

_installed = False


def install_cpu_spec_kernels() -> None:
    """Make this process run speculative decoding on a CPU without sgl_kernel: the
    stub with its CPU ops, and the attention of the speculative forward modes.
    The process must have started with TRITON_INTERPRETER_ENV. Idempotent; the
    engine's subprocesses call it before anything else."""
    global _installed
    if _installed:
        return
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "the CPU kernels are Triton kernels: start the process with "
            "TRITON_INTERPRET=1"
        )
    os.environ.update(CPU_ENGINE_ENV)
    install_sgl_kernel_stub()
    _allow_cpu_tensors_in_record_stream()
    _xgrammar_masks_on_cpu()

    from sglang.test import cpu_spec_attention

    cpu_spec_attention.register()
    _installed = True


def _allow_cpu_tensors_in_record_stream() -> None:
    """The overlap scheduler pins tensors to the current stream, which on CPU is a
    ``torch.cpu.Stream`` that ``Tensor.record_stream`` rejects; a CPU tensor needs
    no pinning."""
    import torch

    record_stream = torch.Tensor.record_stream

    def record_stream_unless_cpu(self: torch.Tensor, stream: Any) -> None:
        if self.device.type != "cpu":
            record_stream(self, stream)

    torch.Tensor.record_stream = record_stream_unless_cpu  # type: ignore[method-assign]


def _xgrammar_masks_on_cpu() -> None:
    """xgrammar's vocab masks: allocated in pinned host memory for their copy to
    the GPU (pinning needs a CUDA driver; a CPU engine copies nothing), and applied
    by a Triton kernel that upstream launches on GPUs only; here it runs in the
    interpreter on the CPU logits."""
    import torch

    from sglang.srt.constrained import xgrammar_backend

    def allocate_token_bitmask(vocab_size: int, batch_size: int) -> torch.Tensor:
        return torch.full(
            xgrammar_backend.get_bitmask_shape(batch_size, vocab_size),
            -1,
            dtype=xgrammar_backend.bitmask_dtype,
        )

    def apply_vocab_mask(logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:
        xgrammar_backend.apply_token_bitmask_inplace_triton(logits, vocab_mask)

    xgrammar_backend._allocate_token_bitmask = allocate_token_bitmask
    xgrammar_backend.XGrammarGrammar.apply_vocab_mask = staticmethod(apply_vocab_mask)
    xgrammar_backend.XGrammarGrammarBackend.apply_vocab_mask = staticmethod(
        apply_vocab_mask
    )


def scheduler_process_with_cpu_kernels(*args: Any, **kwargs: Any) -> Any:
    install_cpu_spec_kernels()
    from sglang.srt.managers.scheduler import run_scheduler_process

    return run_scheduler_process(*args, **kwargs)


def detokenizer_process_with_cpu_kernels(*args: Any, **kwargs: Any) -> Any:
    install_cpu_spec_kernels()
    from sglang.srt.managers.detokenizer_manager import run_detokenizer_process

    return run_detokenizer_process(*args, **kwargs)


# ---------------------------------------------------------------------------
# The engine.
# ---------------------------------------------------------------------------


class EngineSubprocessFailed(RuntimeError):
    """A scheduler or detokenizer process of the engine exited with an error."""


def raise_on_sigquit(signum: int, frame: Any) -> None:
    """SIGQUIT handler of the launch phase: upstream's kills the whole process
    tree, the test runner included; this fails the engine's start instead."""
    raise EngineSubprocessFailed("an engine subprocess failed (its log is above)")


def _cpu_spec_engine_class() -> type:
    from sglang.srt.entrypoints.engine import Engine

    class CpuSpecEngine(Engine):
        run_scheduler_process_func = staticmethod(scheduler_process_with_cpu_kernels)
        run_detokenizer_process_func = staticmethod(
            detokenizer_process_with_cpu_kernels
        )

    return CpuSpecEngine


def _server_args(engine_kwargs: Mapping[str, Any]) -> ServerArgs:
    """ServerArgs as given: upstream turns the overlap scheduler off for any
    speculative decoding on CPU, which would leave its path untested here."""
    from sglang.srt.arg_groups import speculative_hook
    from sglang.srt.server_args import ServerArgs

    with mock.patch.object(
        speculative_hook, "_disable_overlap_schedule_for_cpu", lambda server_args: None
    ):
        return ServerArgs(**engine_kwargs)


def _fail_generate_on_child_crash(engine: Engine) -> None:
    """SIGQUIT handler of the running phase: stop the engine's event loop, so the
    pending ``generate`` raises instead of the test runner being killed."""
    from sglang.srt.managers.tokenizer_manager import SignalHandler

    class StopLoopOnSigquit(SignalHandler):
        def running_phase_sigquit_handler(self, signum=None, frame=None) -> None:
            logger.error("SIGQUIT from an engine subprocess: it failed (log above)")
            engine.loop.stop()

    engine.tokenizer_manager.signal_handler_class = StopLoopOnSigquit


def tensor_parallel_env(tp_size: int) -> Dict[str, str]:
    """The environment of TP ranks on this CPU: no NCCL, and this process's cores
    split between the ranks (upstream's CPU engine otherwise wants a NUMA node per
    rank, ``SGLANG_CPU_OMP_THREADS_BIND``)."""
    if tp_size == 1:
        return {}
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tp_size:
        raise ValueError(f"tp_size {tp_size} needs as many cores; this has {cores}")
    shares = [cores[rank::tp_size] for rank in range(tp_size)]
    binding = "|".join(",".join(map(str, share)) for share in shares)
    return {**NO_NCCL_ENV, "SGLANG_CPU_OMP_THREADS_BIND": binding}


@contextlib.contextmanager
def _importable_sgl_kernel() -> Iterator[None]:
    """sgl_kernel for this process, which runs no kernel but imports the engine:
    the real one if it imports (a GPU machine), else the stub."""
    try:
        import sgl_kernel  # noqa: F401
    except (ImportError, OSError):
        install_sgl_kernel_stub()
        try:
            yield
        finally:
            uninstall_sgl_kernel_stub()
    else:
        yield


@contextlib.contextmanager
def _environ(env: Mapping[str, str]) -> Iterator[None]:
    with mock.patch.dict(os.environ, env):
        yield


def _shut_down(engine: Engine) -> None:
    """Engine.shutdown, killing only the engine's own processes: upstream's kills
    every child of this process (a test runner's multiprocessing resource tracker,
    other tests' workers)."""
    import atexit

    from sglang.srt.entrypoints import engine as engine_module
    from sglang.srt.utils import kill_process_tree

    pids = list(engine._scheduler_init_result.all_child_pids)

    def kill_engine_processes(parent_pid: int, **kwargs: Any) -> None:
        for pid in pids:
            kill_process_tree(
                pid, include_parent=True, wait_timeout=kwargs.get("wait_timeout")
            )

    with mock.patch.object(engine_module, "kill_process_tree", kill_engine_processes):
        engine.shutdown()
    atexit.unregister(engine.shutdown)


def _ignore_sigquit(engine: Engine) -> None:
    """From shutdown on: the engine's SIGQUIT handler would act on a dead engine."""
    with contextlib.suppress(Exception):
        engine.loop.remove_signal_handler(signal.SIGQUIT)
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)


@contextlib.contextmanager
def cpu_spec_engine(
    env: Optional[Mapping[str, str]] = None, **engine_kwargs: Any
) -> Iterator[Engine]:
    """A running ``sglang.Engine`` on this CPU (CPU_ENGINE_DEFAULTS, then
    ``engine_kwargs``), its processes started with ``env`` added to the
    environment; shut down on exit. A failing engine process fails the call
    that waits for it. With ``tp_size`` > 1 the ranks share this process's cores."""
    kwargs = {
        **CPU_ENGINE_DEFAULTS,
        "custom_sigquit_handler": raise_on_sigquit,
        **engine_kwargs,
    }
    tp_env = tensor_parallel_env(kwargs.get("tp_size", 1))
    with contextlib.ExitStack() as stack:
        stack.enter_context(_environ({**CPU_ENGINE_ENV, **tp_env, **(env or {})}))
        stack.callback(signal.signal, signal.SIGQUIT, signal.getsignal(signal.SIGQUIT))
        # Imported before TRITON_INTERPRET is set: the kernels this process
        # defines stay compiled ones.
        stack.enter_context(_importable_sgl_kernel())
        engine_class = _cpu_spec_engine_class()
        server_args = _server_args(kwargs)
        with _environ(TRITON_INTERPRETER_ENV):
            engine = engine_class(server_args=server_args)
        stack.callback(_shut_down, engine)
        stack.callback(_ignore_sigquit, engine)
        _fail_generate_on_child_crash(engine)
        yield engine
