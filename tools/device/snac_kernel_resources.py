"""What SNAC's Triton kernels ask of a Hopper card, read here without one: each kernel is compiled ahead of time
for sm_90 (Triton's own ptxas) in the tiles the gateway would launch, and cuobjdump reports its registers a thread,
the stack it spills to and its shared memory:

    python tools/device/snac_kernel_resources.py --out kernel_resources.json [--sweep]

Rows: the twelve residual units in `unit_tiles`' choice and the four block heads in `head_tiles`' (with `--sweep`,
every tile of `snac_head_variants.SWEEP` too), bfloat16 as on the card. A tile whose kernel spills (stack > 0) or
asks more shared memory than the card has (232,448 bytes a block) is one a lease need not time. The compile is
the card's except for the integer arguments' divisibility hints the launch adds (they change vectorised loads,
rarely the register count). Why: docs/decisions/snac-kernels.md.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from snac_head_variants import BLOCKS, sweep_tiles  # the block heads' shapes and their tile grid
from snac_unit_tiles import DILATIONS, UNIT_SHAPES  # the residual units' shapes

from gateway.speech.snac.kernels import TAPS, head_tiles, unit_tiles

ARCH = 90  # Hopper (H100, H200)
SHARED_LIMIT = 232_448  # bytes of shared memory a block may ask on sm_90
INT64_POINTERS = ("frame_ptr", "end_ptr")  # the unit kernel's per-stream positions


def compile_sm90(fn: Any, constants: dict[str, Any], warps: int, stages: int) -> dict[str, Any]:
    """Compile the @triton.jit `fn` for sm_90 with `constants` as its constexprs (pointers bfloat16, the rest i32):
    registers a thread, spilled stack bytes and shared memory bytes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name in inspect.signature(fn.fn).parameters:
        if name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*i64" if name in INT64_POINTERS else "*bf16"
        else:
            signature[name] = "i32"
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants),
                            target=GPUTarget("cuda", ARCH, 32), options={"num_warps": warps, "num_stages": stages})
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([str(tools / "cuobjdump"), "--dump-resource-usage", cubin.name], capture_output=True,
                               text=True, check=True).stdout
    found = dict(re.findall(r"(REG|STACK):(\d+)", usage))
    return {"registers": int(found["REG"]), "stack_bytes": int(found["STACK"]), "shared_bytes": kernel.metadata.shared}


def unit_rows() -> list[dict[str, Any]]:
    from gateway.speech.snac.unit_kernel import unit_kernel

    rows = []
    for channels, length in UNIT_SHAPES:
        for dilation in DILATIONS:
            block_r, block_t, block_co, block_ci, warps = unit_tiles(channels, length)
            constants = dict(C=channels, K=TAPS, DIL=dilation, MASKED=True, HAS_DW_BIAS=True, HAS_PW_BIAS=True,
                             LOW_PRECISION=True, BLOCK_R=block_r, BLOCK_T=block_t, BLOCK_CO=block_co,
                             BLOCK_CI=block_ci)
            rows.append({"kernel": "unit", "shape": [channels, length, dilation],
                         "tiles": [block_r, block_t, block_co, block_ci, warps, 1],
                         **compile_sm90(unit_kernel, constants, warps, 1)})
    return rows


def head_rows(sweep: bool) -> list[dict[str, Any]]:
    from gateway.speech.snac.head_kernel import head_kernel

    rows = []
    for channels, stride, new in BLOCKS:
        chosen = head_tiles(channels, channels // 2, stride, new)
        for tiles in sorted({chosen, *(sweep_tiles(channels, stride, new) if sweep else ())}):
            block_r, block_t, block_o, block_ci, warps, stages = tiles
            constants = dict(C_IN=channels, C_OUT=channels // 2, S=stride, HAS_BIAS=True, LOW_PRECISION=True,
                             BLOCK_R=block_r, BLOCK_T=block_t, BLOCK_O=block_o, BLOCK_CI=block_ci)
            rows.append({"kernel": "head", "shape": [channels, stride, new], "tiles": list(tiles),
                         "chosen": tiles == chosen, **compile_sm90(head_kernel, constants, warps, stages)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON rows")
    parser.add_argument("--sweep", action="store_true", help="also every tile of the block heads' sweep")
    args = parser.parse_args(argv)
    rows = unit_rows() + head_rows(args.sweep)
    args.out.write_text(json.dumps({"arch": f"sm_{ARCH}", "rows": rows}, indent=1))
    print(f"{'kernel':6} {'shape':16} {'tiles (R, T, CO/O, CI, warps, stages)':40} {'regs':>5} {'stack':>6} "
          f"{'shared':>7}")
    for r in rows:
        flag = " spills" if r["stack_bytes"] else ""
        flag += " over shared" if r["shared_bytes"] > SHARED_LIMIT else ""
        mark = "*" if r.get("chosen") else " "
        print(f"{r['kernel']:6} {r['shape']!s:16} {mark}{r['tiles']!s:39} {r['registers']:>5} "
              f"{r['stack_bytes']:>6} {r['shared_bytes']:>7}{flag}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
