"""Kernels and bytes of one exact-stream SNAC step per stream, counted on the CPU, for each way of running it:

    .venv/bin/python -m gateway.benchmarks.snac_work --out snac_work.json    # eager and compiled (~2 min on 2 cores)
    .venv/bin/python -m gateway.benchmarks.snac_work --out snac_work.json --no-compiled

Why bytes: the decoder is bound by its passes over activations and its kernels, not by arithmetic (a GPU step
runs at ~1.5% of the card's bf16 peak; docs/decisions/exact-streaming-snac-decoder.md). So this counts, per step, the
kernels launched and, per stream, the bytes they read and write. Per-stream bytes are the difference of two batch
sizes (`--batches`), so the weights, read once per kernel whatever the batch, drop out.

- eager: the aten ops `DecoderLayers.stream` runs (views excluded; snac's Snake counted as one kernel, as TorchScript's
  fuser makes it on CUDA), each reading its inputs and writing its outputs once;
- compiled: `StreamingSnac(compile=True)` (depthwise convolutions as shifted products), from the code Inductor
  generates: its fused kernels and the convolutions it leaves to aten, each reading its argument buffers and
  writing its outputs once, plus the step's eager ops around it (state gather and scatter, PCM). Inductor's CPU
  kernels stand in for its GPU ones: one fusion scheduler for both, though the GPU's may split more kernels;
- windows: a 3-frame window (`DecoderLayers.full`: the work per new frame of the gateway's old windows decoder, the
  benchmarks' baseline in tools/device/windows_baseline.py, and of a bridge decode), 3 frames per new one.

The predicted GPU gain of a variant, if the step stays bound by memory traffic, is the ratio of bytes per stream.

Bytes miss what a fused kernel computes, so for the compiled step this also counts what Inductor's fused kernels
evaluate (`evaluated_ops`).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from snac import SNAC
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import gateway.speech.snac.layers as snac_layers
from gateway.devtools.devmodels import SNAC_24KHZ_CONFIG
from gateway.orpheus import SLOTS_PER_FRAME
from gateway.speech.snac import DTYPES, OPEN_END, StreamingSnac

# Views and allocations move no data.
NO_TRAFFIC = {"slice", "reshape", "view", "unsqueeze", "squeeze", "transpose", "select", "expand", "_unsafe_view",
              "alias", "t", "permute", "as_strided", "detach", "lift_fresh", "empty_like", "empty", "empty_strided"}
WINDOW_FRAMES = 3


def _bytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


class OpCounter(TorchDispatchMode):
    """Each non-view aten op: (kind, bytes of its tensor inputs + outputs). Inside `one_kernel` ops are not
    counted one by one: the region counts as one kernel reading its input and writing its output."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int]] = []
        self._inside = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name == "reshape" and not self._inside and out.untyped_storage().data_ptr() != \
                args[0].untyped_storage().data_ptr():
            name = "copy_"  # a reshape that cannot be a view copies (as clone + view)
        if self._inside or name in NO_TRAFFIC:
            return out
        if name == "conv1d":  # (input, weight, bias, stride, padding, dilation, groups)
            name = "conv depthwise" if len(args) > 6 and args[6] > 1 else "conv"
        elif name == "conv_transpose1d":
            name = "conv transposed"
        writes = sum(_bytes(o) for o in tree_leaves(out))
        if name == "index":  # a gather reads the rows it returns, not its whole table
            reads = writes
        elif name == "copy_":  # writes its destination (the output), reads its source
            reads = _bytes(args[1])
        else:
            reads = sum(_bytes(a) for a in tree_leaves((args, kwargs)))
        self.ops.append((name, reads + writes))
        return out

    def one_kernel(self, name: str | None, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` counted as one kernel `name` (reading its first argument, writing its output), or not at all
        (`name` None)."""
        def run(x: torch.Tensor, *rest: Any) -> Any:
            self._inside += 1
            try:
                out = fn(x, *rest)
            finally:
                self._inside -= 1
            if name is not None and not self._inside:
                self.ops.append((name, _bytes(x) + _bytes(out)))
            return out
        return run


def _inputs(snac: StreamingSnac, batch: int) -> tuple[torch.Tensor, ...]:
    """`DecoderLayers.stream`'s arguments for `batch` streams mid-utterance."""
    gen = torch.Generator().manual_seed(batch)
    return (torch.zeros(batch, snac.decoder.state_size, dtype=snac.dtype),
            torch.randint(0, 4096, (batch, 1, SLOTS_PER_FRAME), generator=gen),
            torch.full((batch,), 10), torch.full((batch,), OPEN_END), torch.arange(batch))


def _packed(batch: int) -> torch.Tensor:
    """`StreamingSnac._run_packed`'s rows for `batch` streams in slots 0..batch-1, mid-utterance."""
    gen = torch.Generator().manual_seed(batch)
    codes = torch.randint(0, 4096, (batch, SLOTS_PER_FRAME), generator=gen)
    rest = torch.tensor([[slot, 10, OPEN_END, slot] for slot in range(batch)])
    return torch.cat([codes, rest], dim=1)


def count_eager(snac: StreamingSnac, batch: int, what: str) -> list[tuple[str, int]]:
    """The ops of one window decode (`windows`) or of one whole step (`stream`, `stream masked`: the state's
    gather and scatter and the PCM conversion included); `around` counts only what the step runs outside
    `DecoderLayers.stream` (the part a compiled step leaves eager)."""
    counter = OpCounter()
    snake, stream = snac_layers.snake, snac._stream
    snac_layers.snake = counter.one_kernel("snake", snake)  # type: ignore[assignment]
    if what == "around":
        snac._stream = counter.one_kernel(None, stream)
    _, _, frame, _, seeds = _inputs(snac, batch)
    window = torch.randint(0, 4096, (batch, WINDOW_FRAMES, SLOTS_PER_FRAME))
    packed = _packed(batch)
    try:
        with torch.inference_mode(), counter:
            if what == "windows":
                snac.decoder.full(window, frame - 1, seeds)
            else:
                snac._run_packed(packed, masked=what == "stream masked")
    finally:
        snac_layers.snake, snac._stream = snake, stream  # type: ignore[assignment]
    return counter.ops


_SHAPE = re.compile(r"^\s*(\w+) = (?:empty_strided_\w+|reinterpret_tensor)\((?:\w+, )?\(([\d, ]*)\)")
_ASSERT = re.compile(r"assert_size_stride\((\w+), \(([\d, ]*)\)")
_CALL = re.compile(r"^\s*(?:(\w+) = )?(cpp_fused_\w+|triton_\w+|extern_kernels\.\w+)(?:\.run)?\((.*)\)\s*$")


def _numel(dims: str) -> int:
    n = 1
    for d in dims.replace(" ", "").strip(",").split(","):
        n *= int(d) if d else 1
    return n


def _distinct_ops(graph: torch.fx.Graph) -> collections.Counter[str]:
    """Operations of a loop body's graph by kind, each distinct one once (the kernel's CSE): Inductor traces a body
    as a tree, so a value used twice (as the noise hash's x in x ^ (x >> 16)) appears twice."""
    canonical: dict[torch.fx.Node, Any] = {}
    seen: dict[tuple[Any, ...], torch.fx.Node] = {}
    count: collections.Counter[str] = collections.Counter()
    for node in graph.nodes:
        args = tuple(canonical.get(a, a) if isinstance(a, torch.fx.Node) else repr(a) for a in node.args)
        key = (node.op, str(node.target), args, repr(sorted(node.kwargs.items())))
        if node.op == "call_method" and key not in seen and node.target not in NOT_COUNTED_OPS:
            count[str(node.target)] += 1
        canonical[node] = seen.setdefault(key, node)
    return count


# Loop-body entries that are not arithmetic or memory operations of the generated kernel.
NOT_COUNTED_OPS = {"get_index", "constant", "index_expr", "output"}


@dataclass
class NodeWork:
    """What one Inductor scheduler node computes (`evaluated_ops`)."""

    values: int  # values computed (its loop's size)
    ops: int  # distinct operations per value, masked sub-blocks included
    sins: int  # of them, sines per value (Snake's; recomputed ones show here)
    written: int  # values written to memory (buffers it realizes)
    kernel: str  # the fused kernel it belongs to


def evaluated_ops(nodes: list[Any]) -> list[NodeWork]:
    """Each Inductor scheduler node's work: its loop body and masked sub-blocks (a select's branches) all
    counted, as a GPU kernel evaluates every branch for every value (Triton masks loads, it does not skip them).

    Bytes miss this, and a value inlined into several users is recomputed in each (the compiled step's old state
    write was a third of its GPU time). Counted per stream and new frame with the step's cats lowered as for a GPU
    (`cuda_cat_lowering`; on the CPU every cat is a copy, on a GPU a small one is a select inlined into its users):
    each node's values times the distinct operations of its loop body and masked sub-blocks, the sines among them
    (a Snake's, once per activation value unless recomputed), the values written, and the largest kernels."""
    rows = []
    for group in nodes:
        for node in group.get_nodes():
            body = getattr(node, "_body", None)
            if body is None:  # convolutions and other kernels left to aten
                continue
            values = math.prod(int(n) for sizes in node._sizes for n in sizes)
            graphs = [body.root_block.graph, *(block.graph for block in body.subblocks.values())]
            ops = sum((_distinct_ops(g) for g in graphs), collections.Counter())
            rows.append(NodeWork(values, ops.total(), ops["sin"], values * len(node.read_writes.writes),
                                 group.get_name()))
    return rows


@contextlib.contextmanager
def cuda_cat_lowering() -> Iterator[None]:
    """Inductor lowers a `cat` of CPU tensors always as copies into slices of one buffer; of CUDA tensors, a cat
    of up to 8 inputs whose users are pointwise becomes a select per value inlined into each user
    (`pointwise_cat`), which decides, e.g., whether a convolution's 7 taps recompute their input. Within the
    block CPU tensors' cats are lowered as CUDA ones would be: Inductor's own `cat` lowering with its CPU test
    off (a private hook; it refuses a torch whose lowering reads otherwise)."""
    import inspect

    from torch._inductor import lowering

    source = inspect.getsource(lowering.cat)
    cpu_test = 'cpu_device = inputs[0].get_device().type == "cpu"'
    if cpu_test not in source:
        raise RuntimeError(f"this torch's Inductor cat lowering has no `{cpu_test}`: update cuda_cat_lowering")
    source = "\n".join(line for line in source.splitlines() if not line.startswith("@"))  # its registration
    namespace = dict(vars(lowering))
    exec(source.replace(cpu_test, "cpu_device = False"), namespace)  # Inductor's own source, one line changed
    ops = [op for op in (torch.ops.aten.cat.default, torch.ops.aten.cat) if op in lowering.lowerings]
    saved = {op: lowering.lowerings[op] for op in ops}
    lowering.lowerings.update({op: namespace["cat"] for op in ops})
    try:
        yield
    finally:
        lowering.lowerings.update(saved)


@contextlib.contextmanager
def scheduler_nodes() -> Iterator[list[list[Any]]]:
    """The scheduler nodes of each graph Inductor compiles inside the block (a private hook: the scheduler's
    node list after fusion)."""
    from torch._inductor import scheduler

    captured: list[list[Any]] = []
    init = scheduler.Scheduler.__init__

    def capture(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        captured.append(list(self.nodes))

    scheduler.Scheduler.__init__ = capture  # type: ignore[method-assign]
    try:
        yield captured
    finally:
        scheduler.Scheduler.__init__ = init  # type: ignore[method-assign]


def count_compiled(snac: StreamingSnac, batch: int) -> list[tuple[str, int]]:
    """Kernels of Inductor's code for the unmasked step at `batch` rows, each with the bytes of its buffer
    arguments and its output (element size: the decoder's dtype; the int64 positions count as that too)."""
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    step = torch.compile(snac.decoder.stream, fullgraph=True, dynamic=False)
    with torch.inference_mode(), inductor_config.patch(fx_graph_cache=False):
        _, sources = run_and_get_code(step, *_inputs(snac, batch), False)
    code = "\n".join(sources)
    call = code[code.index("def call("):]
    shapes: dict[str, int] = {}
    for line in call.splitlines():
        for pattern in (_SHAPE, _ASSERT):
            match = pattern.search(line)
            if match:
                shapes.setdefault(match.group(1), _numel(match.group(2)))
    size = torch.empty(0, dtype=snac.dtype).element_size()
    ops = []
    for line in call.splitlines():
        match = _CALL.match(line)
        if not match:
            continue
        target, kernel, args = match.groups()
        names = set(re.findall(r"\b(buf\d+|arg\d+_\d+)\b", args)) | ({target} if target else set())
        kind = "conv (aten)" if kernel.startswith("extern_kernels.conv") else (
            "other (aten)" if kernel.startswith("extern") else "fused (Inductor)")
        ops.append((kind, sum(shapes.get(n, 0) for n in names) * size))
    return ops


def count_evaluated(snac: StreamingSnac, batch: int) -> list[NodeWork]:
    """`evaluated_ops` of the unmasked step at `batch` rows, compiled with its cats lowered as for a GPU."""
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    step = torch.compile(snac.decoder.stream, fullgraph=True, dynamic=False)
    with (torch.inference_mode(), inductor_config.patch(fx_graph_cache=False), cuda_cat_lowering(),
          scheduler_nodes() as graphs):
        step(*_inputs(snac, batch), False)
    return evaluated_ops(graphs[-1])


def per_stream(small: list[tuple[str, int]], large: list[tuple[str, int]], batches: tuple[int, int],
               per_frame: int = 1) -> dict[str, Any]:
    """Kernels per step and bytes per stream and new frame, by kind: (large - small) / (batch difference)."""
    rows = batches[1] - batches[0]
    kinds: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    for at, ops in enumerate((small, large)):
        for kind, moved in ops:
            kinds[kind][0] += at  # kernels: counted on the large batch
            kinds[kind][1 + at] += moved
    table = {k: {"kernels": n, "mb_per_frame": round((big - little) / rows / per_frame / 1e6, 3)}
             for k, (n, little, big) in sorted(kinds.items(), key=lambda kv: kv[1][1] - kv[1][2])}
    return {"kernels": sum(v["kernels"] for v in table.values()),
            "mb_per_frame": round(sum(v["mb_per_frame"] for v in table.values()), 3), "by_kind": table}


def evaluated_per_stream(small: list[NodeWork], large: list[NodeWork], rows: int, top: int = 6) -> dict[str, Any]:
    """Operations, sines and values written per stream and new frame, in all and by fused kernel (the largest
    `top` by operations), as the difference of two batch sizes (the two compiles fuse alike)."""
    def per_kernel(nodes: list[NodeWork]) -> dict[str, list[int]]:
        kernels: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0, 0])  # ops, sins, written, values
        for n in nodes:
            for at, amount in enumerate((n.values * n.ops, n.values * n.sins, n.written, n.values)):
                kernels[n.kernel][at] += amount
        return kernels

    a, b = per_kernel(small), per_kernel(large)

    def per_frame(kernel: str | None, at: int) -> float:
        names = [kernel] if kernel else list(b)
        return sum(b[k][at] - a.get(k, [0, 0, 0, 0])[at] for k in names) / rows

    largest = sorted(b, key=lambda k: -per_frame(k, 0))[:top]
    return {"mops_per_frame": round(per_frame(None, 0) / 1e6, 2), "msin_per_frame": round(per_frame(None, 1) / 1e6, 2),
            "mvalues_written_per_frame": round(per_frame(None, 2) / 1e6, 2), "fused_kernels": len(b),
            "largest": [{"kernel": k, "mops_per_frame": round(per_frame(k, 0) / 1e6, 2),
                         "values_per_frame": int(per_frame(k, 3)),
                         "ops_per_value": round(per_frame(k, 0) / max(per_frame(k, 3), 1), 1),
                         "sin_per_value": round(per_frame(k, 1) / max(per_frame(k, 3), 1), 1)} for k in largest]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON results file")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--batches", default="2,4", help="two batch sizes, comma-separated")
    parser.add_argument("--no-compiled", action="store_true", help="skip the compiled step (~2 min on 2 cores)")
    args = parser.parse_args(argv)
    small, large = (int(b) for b in args.batches.split(","))
    torch.manual_seed(0)
    model = SNAC(**SNAC_24KHZ_CONFIG).eval()
    eager = StreamingSnac(model, "cpu", args.dtype, max_streams=large)
    report: dict[str, Any] = {"dtype": args.dtype, "batches": [small, large], "variants": {}}
    for what in ("windows", "stream masked", "stream"):
        per_frame = WINDOW_FRAMES if what == "windows" else 1
        counts = [count_eager(eager, b, what) for b in (small, large)]
        report["variants"][what] = per_stream(*counts, (small, large))
        report["variants"][what]["decoded_frames"] = per_frame
    if not args.no_compiled:
        compiled = StreamingSnac(model, "cpu", args.dtype, max_streams=large, compile=True)
        counts = [count_compiled(compiled, b) + count_eager(eager, b, "around") for b in (small, large)]
        report["variants"]["stream compiled"] = per_stream(*counts, (small, large))
        report["variants"]["stream compiled"]["decoded_frames"] = 1
        report["evaluated_as_on_gpu"] = evaluated_per_stream(*(count_evaluated(compiled, b) for b in (small, large)),
                                                             large - small)
    base = report["variants"]["stream"]["mb_per_frame"]
    print(f"{'variant':18} {'kernels/step':>12} {'MB/new frame':>12} {'vs stream':>9}   largest kinds (MB/new frame)")
    for name, v in report["variants"].items():
        v["vs_stream"] = round(v["mb_per_frame"] / base, 2)
        top = ", ".join(f"{k} {d['mb_per_frame']:.2f}" for k, d in list(v["by_kind"].items())[:4])
        print(f"{name:18} {v['kernels']:>12} {v['mb_per_frame']:>12.2f} {v['vs_stream']:>9.2f}   {top}")
    if "evaluated_as_on_gpu" in report:
        ev = report["evaluated_as_on_gpu"]
        print(f"\ncompiled step, cats lowered as for a GPU, per stream and new frame: {ev['mops_per_frame']:.1f} M "
              f"operations evaluated (masked branches included), {ev['msin_per_frame']:.2f} M sines, "
              f"{ev['mvalues_written_per_frame']:.2f} M values written, {ev['fused_kernels']} fused kernels; largest:")
        for k in ev["largest"]:
            print(f"  {k['mops_per_frame']:7.2f} M  {k['values_per_frame']:>7} values x {k['ops_per_value']:>5} ops "
                  f"({k['sin_per_value']} sin)  {k['kernel']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
