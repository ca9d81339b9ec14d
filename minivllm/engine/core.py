"""EngineCoreProc: the `LLMEngine` in a process of its own, driven over a pipe.

vLLM v1 runs its engine core in a separate process (vllm/v1/engine/core.py `EngineCoreProc`) so
that the server's host work -- HTTP, JSON and SSE encoding, tokenization, the event loop -- never
takes the interpreter (and its GIL) from the model's steps. Here the same split, over one
`multiprocessing` pipe instead of ZeroMQ sockets (no extra dependency; one client, one core):

    frontend (client.py)                        core (this file, a spawned process)
      add / abort / shutdown commands  ------->   applied between steps
      utility calls (add_lora, ...)    ------->   run between steps
      per-step outputs + stats         <-------   after every step (and on an idle tick),
        + the utility calls' results                with each call's result or exception

The loop is `AsyncLLMEngine`'s (async_engine.py) with the pipe in place of
the thread-safe queue: busy -> take the commands that have arrived, then step; idle -> block on
the pipe. Detokenization stays here, in the engine's output processor: the outputs that cross the
pipe already carry their text, the engine stays one unit that the offline `LLM` shares, and the
stop strings (which need the text) are checked where the tokens are made.

No orphan: the core dies with its parent. `PR_SET_PDEATHSIG` has the kernel send SIGKILL when the
parent goes (even in the middle of a step), and the loop also exits on the pipe's EOF.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import pickle
import signal
import sys
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from minivllm.config import EngineConfig
from minivllm.core.outputs import RequestOutput
from minivllm.engine.beam_search import BeamSearchParams
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.stats import EngineStats
from minivllm.inputs import PromptType
from minivllm.lora.request import LoRARequest
from minivllm.pooling.pooling_params import PoolingParams
from minivllm.sampling_params import SamplingParams

logger = logging.getLogger("minivllm")

PR_SET_PDEATHSIG = 1  # linux/prctl.h


# ---------------------------------------------------------------------- the messages
@dataclass
class AddRequest:  # frontend -> core
    request_id: str
    prompt: PromptType
    params: SamplingParams | BeamSearchParams | PoolingParams
    lora_request: LoRARequest | None = None


@dataclass
class AbortRequests:  # frontend -> core
    request_ids: list[str]


@dataclass
class UtilityRequest:  # frontend -> core: run `engine.<method>(*args)` between steps
    call_id: int
    method: str  # an LLMEngine method: add_lora, remove_lora
    args: tuple[Any, ...]


@dataclass
class UtilityResult:  # core -> frontend, in the next `CoreOutputs`
    call_id: int
    result: Any = None
    error: Exception | None = None  # what the method raised (a LoRAError, say)


@dataclass
class Shutdown:  # frontend -> core: abort what runs, answer with a last `CoreOutputs`, exit
    pass


@dataclass
class CoreReady:  # core -> frontend, once: what the frontend needs that only the built engine knows
    pid: int
    max_model_len: int  # after the engine fitted it to the KV cache
    vocab_size: int
    diff_sampling_param: dict[str, Any]
    stop_token_ids: list[int]  # every EOS: what a grammar may end on
    stats: EngineStats


@dataclass
class CoreOutputs:  # core -> frontend, after each step (empty `outputs`: an idle tick)
    outputs: list[RequestOutput]
    stats: EngineStats
    added: list[str] = field(default_factory=list)  # requests the engine took since the last one
    # Requests the engine refused (bad parameters found in the core): request id -> message.
    errors: dict[str, str] = field(default_factory=dict)
    utility_results: list[UtilityResult] = field(default_factory=list)
    final: bool = False  # the answer to `Shutdown`: the core exits after it


@dataclass
class CoreFailed:  # core -> frontend: the engine could not be built, or the loop died
    message: str  # the traceback
    error: Exception | None = (
        None  # the exception itself, when it pickles: the frontend re-raises it
    )


def picklable(exc: BaseException) -> Exception | None:
    """`exc` if it can cross the pipe as itself, else None."""
    error = exc if isinstance(exc, Exception) else None
    try:
        pickle.dumps(error)
    except Exception:
        error = None
    return error


def failure(exc: BaseException) -> CoreFailed:
    return CoreFailed(traceback.format_exc(), picklable(exc))


# ---------------------------------------------------------------------- the process
def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel for SIGKILL when the parent exits (Linux). The signal is tied to the parent
    *thread* that started us: the client starts the core from the thread that lives as long as the
    server (the main thread). If the parent died before the call took effect, exit now."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def run_engine_core(
    conn: Connection,
    config: EngineConfig,
    parent_pid: int,
    torch_threads: int | None,
    visible_devices: str | None = None,
) -> None:
    """The spawned process's entry point: build the engine, say ready, serve the pipe (or a TCP
    connection to another host's API server: the same `Connection` interface).
    `visible_devices`: this core's GPUs, a data-parallel rank's share (`CUDA_VISIBLE_DEVICES`, set
    before CUDA starts here; its tensor-parallel workers inherit it)."""
    die_with_parent(parent_pid)
    if visible_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's: it shuts us down
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s (core): %(message)s")
    try:
        import torch

        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        logger.info("engine core: pid %d, torch threads %d", os.getpid(), torch.get_num_threads())
        core = EngineCoreProc(conn, config)
    except BaseException as exc:  # a config the KV cache cannot hold, say: the frontend says so
        conn.send(failure(exc))
        return
    try:
        core.run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the frontend went away: nothing to tell anyone
    except BaseException as exc:
        logger.exception("the engine core died")
        with contextlib.suppress(OSError):
            conn.send(failure(exc))
    finally:
        core.engine.shutdown()


class EngineCoreProc:
    def __init__(self, conn: Connection, config: EngineConfig, idle_wakeup_s: float = 1.0) -> None:
        self.conn = conn
        self.engine = LLMEngine(config)
        self.idle_wakeup_s = idle_wakeup_s  # an idle core still sends stats this often
        self._added: list[str] = []
        self._errors: dict[str, str] = {}
        self._utility_results: list[UtilityResult] = []
        e = self.engine
        conn.send(
            CoreReady(
                os.getpid(),
                e.max_model_len,
                e.vocab_size,
                e.get_diff_sampling_param(),
                e.structured_output_manager.stop_token_ids,
                e.get_stats(),
            )
        )

    def run(self) -> None:
        engine = self.engine
        while True:
            busy = engine.has_unfinished_requests()
            # Idle: sleep on the pipe (waking now and then so the frontend's stats log stays on
            # schedule). Busy: take what has arrived without waiting, and step.
            commands: list[Any] = []
            if self.conn.poll(0 if busy else self.idle_wakeup_s):
                commands.append(self.conn.recv())  # EOFError: the frontend is gone
                while self.conn.poll(0):
                    commands.append(self.conn.recv())
            for cmd in commands:
                if isinstance(cmd, Shutdown):
                    engine.abort_request(list(engine.requests))
                    self._send(engine.step(), final=True)
                    return
                self._apply(cmd)
            if not (commands or engine.has_unfinished_requests()):
                self._send([])  # idle tick
                continue
            self._send(engine.step())  # also the outputs of the requests aborted above

    def _apply(self, cmd: AddRequest | AbortRequests | UtilityRequest) -> None:
        if isinstance(cmd, AbortRequests):
            self.engine.abort_request(cmd.request_ids)  # frees their blocks now
            return
        if isinstance(cmd, UtilityRequest):
            try:
                result = UtilityResult(cmd.call_id, getattr(self.engine, cmd.method)(*cmd.args))
            except Exception as exc:  # the caller's error; it crosses as itself if it pickles
                error = picklable(exc) or RuntimeError(f"{type(exc).__name__}: {exc}")
                result = UtilityResult(cmd.call_id, error=error)
            self._utility_results.append(result)
            return
        try:
            self.engine.add_request(
                cmd.request_id, cmd.prompt, cmd.params, lora_request=cmd.lora_request
            )
        except Exception as exc:  # a bad request fails alone; the core goes on
            self._errors[cmd.request_id] = str(exc)
            return
        self._added.append(cmd.request_id)

    def _send(self, outputs: list[RequestOutput], final: bool = False) -> None:
        message = CoreOutputs(
            outputs,
            self.engine.get_stats(),
            self._added,
            self._errors,
            self._utility_results,
            final,
        )
        self._added, self._errors, self._utility_results = [], {}, []
        self.conn.send(message)
