"""Where a training step's host (Python) time goes: runs pretrain_gpt.py in this process (one
rank) while a thread samples the main thread's stack every --interval seconds, and prints the
functions most often on the stack (inclusive) and at its top (self), counted over the samples
taken inside train_step after --skip-iters calls of it (compilation and warm-up excluded).
A step whose GPU is mostly idle (issue 38: model M-small FP8 at 25% busy) is bounded by this.

    python dev/host_sampler.py [--skip-iters 8] [--top 40] [--sync-debug] -- pretrain_gpt.py ...

--sync-debug also counts, from the same iteration on, the CUDA operations that make the host
wait for the GPU (torch.cuda.set_sync_debug_mode), by the line of Python that called them.

(sets RANK/WORLD_SIZE/MASTER_* for one rank when torchrun did not).
"""

from __future__ import annotations

import argparse
import collections
import os
import runpy
import sys
import threading
import time
import warnings

_STEP = "train_step"


def _frames(frame):
    while frame is not None:
        yield frame
        frame = frame.f_back


def _label(frame) -> str:
    code = frame.f_code
    path = code.co_filename
    for marker in ("/megatron/", "/torch/", "/triton/", "torchinductor"):
        if marker in path:
            path = marker.strip("/") + "/" + path.split(marker, 1)[1]
            break
    return f"{path}:{code.co_name}"


class Sampler:
    """Samples every Python thread (a CUDA backward's Python runs in autograd's device thread,
    not the main one) while the main thread is inside a counted train_step."""

    def __init__(self, thread_id: int, interval: float, skip: int, sync_debug: bool = False):
        self.thread_id, self.interval, self.skip = thread_id, interval, skip
        self.sync_debug, self.syncs = sync_debug, collections.Counter()
        self.inclusive = collections.Counter()
        self.leaf = {"main": collections.Counter(), "other threads": collections.Counter()}
        self.samples, self.steps_seen = 0, 0
        self.stop = threading.Event()

    def run(self) -> None:
        me = threading.get_ident()
        while not self.stop.is_set():
            time.sleep(self.interval)
            frames = sys._current_frames()
            main = frames.get(self.thread_id)
            stack = list(_frames(main))
            step = next((f for f in stack if f.f_code.co_name == _STEP), None)
            # train_step(..., state=TrainState): its iteration counts the finished steps.
            done = getattr(step.f_locals.get("state"), "iteration", 0) if step else 0
            self.steps_seen = max(self.steps_seen, done)
            if step is None or done < self.skip:
                continue
            if self.sync_debug and not self.samples:
                self._count_syncs()
            self.samples += 1
            for ident, frame in frames.items():
                if ident == me:
                    continue
                stack = list(_frames(frame))
                kind = "main" if ident == self.thread_id else "other threads"
                self.leaf[kind][_label(stack[0])] += 1
                for name in {_label(f) for f in stack}:
                    self.inclusive[name] += 1

    def _count_syncs(self) -> None:
        import torch

        def count(message, category, filename, lineno, file=None, line=None):
            if "synchronizing" in str(message):
                self.syncs[f"{filename}:{lineno}"] += 1

        warnings.simplefilter("always")
        warnings.showwarning = count
        torch.cuda.set_sync_debug_mode("warn")

    def report(self, top: int) -> str:
        lines = [f"samples in {_STEP} after {self.skip} steps: {self.samples} (all threads)"]
        every = [(n, c) for n, c in self.inclusive.most_common() if c < self.samples]
        blocks = [("inclusive, below the training loop", every[:top])]
        blocks += [(f"self, {kind}", c.most_common(top)) for kind, c in self.leaf.items()]
        if self.sync_debug:
            lines.append("--- synchronizing CUDA calls (count, caller)")
            lines += [f"{count:6d}  {where}" for where, count in self.syncs.most_common(top)]
        for title, rows in blocks:
            lines.append(f"--- {title} (% of the main thread's samples)")
            lines += [f"{100 * count / max(self.samples, 1):6.1f}  {name}" for name, count in rows]
        return "\n".join(lines)


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skip-iters", type=int, default=8)
    parser.add_argument("--interval", type=float, default=0.0005)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--sync-debug", action="store_true")
    args = parser.parse_args(argv[:split])
    script, *script_args = argv[split + 1 :]
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    sys.setswitchinterval(args.interval)  # the sampler runs between bytecodes too
    sampler = Sampler(threading.get_ident(), args.interval, args.skip_iters, args.sync_debug)
    thread = threading.Thread(target=sampler.run, daemon=True)
    thread.start()
    sys.argv = [script, *script_args]
    leave = os._exit

    def report_then_exit(code: int) -> None:  # pretrain_gpt.py leaves with os._exit
        sampler.stop.set()
        thread.join()
        print(sampler.report(args.top), flush=True)
        leave(code)

    os._exit = report_then_exit
    runpy.run_path(script, run_name="__main__")
    report_then_exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
