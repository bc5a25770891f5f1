"""Forward-step times of a Llama-3.1-8B-shaped transformer on a GPU, to cross-check the fleet
simulator's engine profiles against a measurement rather than only published coefficients.

No model server runs on the lent GPU machines, so this times the work of one engine step
directly: 32 decoder layers (RMSNorm, fused QKV projection, grouped-query attention through
PyTorch's scaled-dot-product attention, output projection, SwiGLU MLP) plus the LM head for
the sampled positions, in bf16 with random weights. Decode steps are replayed from a CUDA
graph, as vLLM does; prefill runs eagerly, as vLLM does for large token counts. Left out:
rotary embeddings and KV-cache writes (elementwise, a few percent), sampling, and the
scheduler's CPU time — so these are a floor for vLLM's step times on the same GPU.

One layer's weights serve all 32 layers (each far larger than the L2 cache, so every layer
still streams its weights from memory); each layer has its own KV cache.

``python -m sim.fitting.gpu_step_times --out DIR`` writes ``gpu_step_times.json``. ``--tiny`` runs
a toy shape on the CPU, to check the script without a GPU.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Shape:
    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 14336
    vocab: int = 128256


TINY = Shape(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=1000)


KvCaches = list[tuple[torch.Tensor, torch.Tensor]]


class Layers:
    def __init__(self, shape: Shape, device: str, dtype: torch.dtype) -> None:
        s, kw = shape, {"device": device, "dtype": dtype}
        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        self.shape = s
        self.qkv = torch.randn(s.hidden, q + 2 * kv, **kw) * 0.02
        self.o = torch.randn(q, s.hidden, **kw) * 0.02
        self.gate_up = torch.randn(s.hidden, 2 * s.intermediate, **kw) * 0.02
        self.down = torch.randn(s.intermediate, s.hidden, **kw) * 0.02
        self.lm_head = torch.randn(s.hidden, s.vocab, **kw) * 0.02
        self.norm = torch.ones(s.hidden, **kw)

    def forward(
        self, x: torch.Tensor, caches: list[tuple[torch.Tensor, torch.Tensor]] | None
    ) -> torch.Tensor:
        """``x``: (batch, new tokens, hidden). With ``caches`` (one (k, v) per layer, each
        (batch, kv heads, context, head dim)) the new tokens attend to the cache (decode);
        without, causally to each other (prefill). Returns the last position's logits."""
        s = self.shape
        b, t, _ = x.shape
        q_width, kv_width = s.heads * s.head_dim, s.kv_heads * s.head_dim
        for layer in range(s.layers):
            h = F.rms_norm(x, (s.hidden,), self.norm)
            q, k, v = (h @ self.qkv).split([q_width, kv_width, kv_width], dim=-1)
            q = q.view(b, t, s.heads, s.head_dim).transpose(1, 2)
            if caches is None:
                k = k.view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
                v = v.view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            else:
                k, v = caches[layer]
                a = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            x = x + a.transpose(1, 2).reshape(b, t, q_width) @ self.o
            gate, up = (F.rms_norm(x, (s.hidden,), self.norm) @ self.gate_up).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ self.down
        return F.rms_norm(x[:, -1], (s.hidden,), self.norm) @ self.lm_head


def timed_ms(step: Callable[[], object], device: str, repeats: int) -> float:
    """Median wall time of ``step`` after two warm-ups, synchronising the device each time."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(2):
        step()
    sync()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - started) * 1e3)
    return sorted(times)[len(times) // 2]


def graphed(step: Callable[[], object], device: str) -> Callable[[], object]:
    """``step`` captured once in a CUDA graph and replayed (on the CPU: ``step`` itself)."""
    if device != "cuda":
        return step
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def measure(
    shape: Shape, device: str, prefill_tokens: list[int], decode_points: list[tuple[int, int]], repeats: int
) -> dict[str, object]:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = Layers(shape, device, dtype)
    kw = {"device": device, "dtype": dtype}
    prefill = []
    with torch.inference_mode():
        for n in prefill_tokens:
            x = torch.randn(1, n, shape.hidden, **kw)
            prefill.append(
                {"tokens": n, "ms": round(timed_ms(lambda x=x: model.forward(x, None), device, repeats), 3)}
            )
            print("prefill", prefill[-1], flush=True)
        decode = []
        for batch, context in decode_points:
            caches = [
                (
                    torch.randn(batch, shape.kv_heads, context, shape.head_dim, **kw),
                    torch.randn(batch, shape.kv_heads, context, shape.head_dim, **kw),
                )
                for _ in range(shape.layers)
            ]
            x = torch.randn(batch, 1, shape.hidden, **kw)
            step = graphed(lambda x=x, caches=caches: model.forward(x, caches), device)
            decode.append(
                {"batch": batch, "context": context, "ms": round(timed_ms(step, device, repeats), 3)}
            )
            print("decode", decode[-1], flush=True)
            del caches, step
            if device == "cuda":
                torch.cuda.empty_cache()
    return {
        "shape": asdict(shape),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": str(dtype),
        "prefill": prefill,
        "decode": decode,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m sim.fitting.gpu_step_times", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true", help="a toy shape on the CPU")
    args = parser.parse_args(argv)
    if args.tiny:
        data = measure(TINY, "cpu", [16, 64], [(2, 32), (4, 64)], repeats=3)
    else:
        points = [(b, c) for b in (1, 8, 32, 64, 128, 256) for c in (512, 2048, 8192) if b * c <= 2**19]
        data = measure(Shape(), "cuda", [128, 256, 512, 1024, 2048, 4096, 8192, 16384], points, repeats=10)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_step_times.json").write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
