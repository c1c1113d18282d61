"""End-to-end decode benchmark: a random-weight Llama-3-8B-shaped model (bf16, fewer layers) generating with
HF eager, HF's compiled static cache, HF's QuantizedCache (optimum-quanto), kvq_backend with several presets and
the HF-native KVQCache, in one run.

    python bench/bench_generate.py --layers 8 --shapes 8x8192,32x4096 --presets fp16,int8,kivi-4,kivi-2

Decode tokens/s = batch / median time between consecutive generated tokens (a logits processor timestamps each
token after a device sync; the prefill and the first three steps, which compile and record CUDA graphs, are left
out). Peak memory is torch.cuda.max_memory_allocated over the whole generate. Roofline tokens/s = copy bandwidth /
(weight bytes + KV bytes read per step), with the KV bytes of each preset from its store size at the mean context
and the weight bytes without the input embedding table (a step gathers B of its rows; until session 8 the table,
1 GiB, was counted, which put every "% of roofline" too high). --gpu-time adds the GPU time of a step (the union of
the kernels' intervals over 8 profiled decode steps; until session 20 their durations summed), which leaves out
HF's Python between steps: generate syncs every step, so the GPU
idles meanwhile (bench/host_overhead.py measures that part: 1.5-2.2 ms on an H100).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth (bytes read + written per second) of a 2 GiB bf16 copy."""
    import triton.testing as tt

    x = torch.empty(2 ** 29, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() * 2 / (tt.do_bench(lambda: y.copy_(x), return_mode="median") * 1e-3)


def weight_bytes(model) -> int:
    """Weight bytes a decode step reads: all parameters but the input embedding table (a step gathers B of its rows;
    until session 8 the table, 1 GiB, was counted, which put every "% of roofline" too high)."""
    wbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    if emb is not head:
        wbytes -= emb.numel() * emb.element_size()
    return wbytes


def roofline_tok_s(model, preset: str | None, layers: int, B: int, ctx: int, bw: float) -> float:
    """Tokens/s of a step that reads the weights and the KV cache (kvq's store of `preset` at ctx tokens, or None:
    an fp16 cache of the valid length; HF reads its whole static buffer, more) once at copy bandwidth."""
    from kvq_compile import KVQConfig
    from kvq_compile import store as st

    if preset is not None:
        kv_bytes = st.model_store_bytes(KVQConfig.preset(preset), layers, B, 8, ctx, 128)
    else:
        kv_bytes = 2 * layers * B * 8 * ctx * 128 * 2
    return B / ((weight_bytes(model) + kv_bytes) / bw)


def write_rows(path: str, bw: float, layers: int, rows: list) -> None:
    """The run's rows as JSON, with the device, torch version, copy bandwidth and date."""
    with open(path, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, copy_bw=bw, layers=layers,
                       rows=rows, date=time.strftime("%Y-%m-%d")), f, indent=1)


def build(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=65536,
                      rope_theta=500000.0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    return model


class StepClock:
    """A logits processor that timestamps every generated token (after a device sync)."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores):
        torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        return scores


def timed_generate(model, ids, new, **kw):
    """(median seconds per decode step, steps timed): the intervals between tokens 3..new, so neither the
    prefill nor the first compiled steps (compilation, CUDA-graph recording) are counted."""
    from transformers import LogitsProcessorList

    clock = StepClock()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, logits_processor=LogitsProcessorList([clock]), **kw)
    dts = sorted(b - a for a, b in zip(clock.times[3:], clock.times[4:]))
    return dts[len(dts) // 2], len(dts)


class ProfileWindow:
    """A logits processor that runs the torch profiler over generated tokens [start, start + steps) only, so
    that neither the prefill nor the compiling steps are in the trace. cpu: host ops too, not only CUDA kernels."""

    def __init__(self, start: int = 8, steps: int = 8, cpu: bool = False):
        from torch.profiler import ProfilerActivity, profile

        self.start, self.steps, self.n = start, steps, 0
        self.prof = profile(activities=[ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if cpu else []))

    def __call__(self, input_ids, scores):
        if self.n == self.start:
            torch.cuda.synchronize()
            self.prof.start()
        elif self.n == self.start + self.steps:
            torch.cuda.synchronize()
            self.prof.stop()
        self.n += 1
        return scores


def profiled_decode(model, ids, steps: int = 8, new: int | None = None, cpu: bool = False, **kw):
    """The torch profiler over `steps` decode steps of one generate (tokens 8 .. 8 + steps: no prefill, no
    compiling step); the generate runs `new` tokens (at least 8 + steps + 2; default that many): give it the
    timed generate's length, so that the profiled one runs the same static cache shape. cpu: host ops too."""
    from transformers import LogitsProcessorList

    n = max(new or 0, 8 + steps + 2)
    win = ProfileWindow(8, steps, cpu)
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                   logits_processor=LogitsProcessorList([win]), **kw)
    return win.prof


def gpu_ms_per_step(model, ids, steps: int = 8, new: int | None = None, **kw) -> tuple[float, float]:
    """GPU time of one decode step over `steps` profiled decode steps of a generate of `new` tokens (the timed
    one's: `profiled_decode`): (busy, summed) ms, busy the union of the CUDA kernels' intervals, summed their
    durations added up. They differ where kernels overlap: on sm_90 kvq's launches after the quantized region go
    out as programmatic dependent launches, which start early and wait on the GPU (`griddepcontrol.wait`), so their
    durations hold time the region's kernel also holds (until session 20 this reported the sum). The wall-clock step
    also holds HF's Python between steps, during which the GPU idles: generate syncs every step."""
    from torch.autograd import DeviceType

    spans = sorted((e.time_range.start, e.time_range.end) for e in profiled_decode(model, ids, steps, new, **kw).events()
                   if e.device_type == DeviceType.CUDA)
    summed = sum(b - a for a, b in spans)
    busy, end = 0.0, float("-inf")
    for a, b in spans:   # the union: each interval's part past the furthest end so far
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    return busy / 1e3 / steps, summed / 1e3 / steps


KERNEL_GROUPS = (   # (group, name pattern) of a decode step's CUDA kernels, first match wins (`kernel_groups`)
    ("GEMMs", r"nvjet|gemm|cublas|cutlass|splitK|sm90_xmma|ampere_|_grouped_linear_kernel"),
    ("decode attention", r"_kivi_decode_kernel|_post_decode_kernel|_lut_decode_kernel|_sym8_decode_kernel|"
                         r"_decode_kernel|_combine_kernel|_temperature_kernel|flash|attention"),
    ("append", r"_append_kernel"),
)


# kvq_backend runs with Inductor options (reduce-overhead's CUDA graphs as an option: torch.compile takes a mode or
# options, not both). frozen: the weights constants, so that Inductor's patterns may concatenate same-input GEMMs;
# gemm-tuned: Inductor autotunes every GEMM (`max_autotune_gemm`: its Triton templates against cuBLAS), while the
# kvq::attend lowering keeps its default launch (it widens its choices under `max_autotune` alone)
# combo: Inductor's horizontal fusion of independent small kernels (`combo_kernels`: the RoPE of q and k and the
# append's input copies are separate launches of 1-3 us each, per layer)
KVQ_OPTIONS = {"kvq-frozen": {"freezing": True}, "kvq-gemm-tuned": {"max_autotune_gemm": True},
               "kvq-combo": {"combo_kernels": True}}
KVQ_COMPILED = ("kvq", "kvq-opaque", *KVQ_OPTIONS)   # the runs compiled by kvq_backend in `generate`


def kernel_groups(rows, steps: int) -> dict:
    """ms per decode step of each `KERNEL_GROUPS` group (and "other") from (kernel name, self device time in us)
    rows of `steps` profiled steps."""
    import re

    out = {g: 0.0 for g, _ in KERNEL_GROUPS} | {"other": 0.0}
    for name, us in rows:
        group = next((g for g, pat in KERNEL_GROUPS if re.search(pat, name)), "other")
        out[group] += us / 1e3 / steps
    return out


def profile_step(model, preset, B: int = 8, P: int = 2048, order: int = 0):
    """Top CUDA kernels of 8 kvq decode steps at (B, P), after warm-up (decode steps only: `profiled_decode`); with
    order, also the first `order` of them in the order they ran (name, start and duration in us)."""
    from transformers import CompileConfig

    from kvq_compile import kvq_backend, lowering

    torch._dynamo.reset()
    lowering.DEVICES.clear()
    lowering.DEVICES.add("cuda")
    ids = torch.randint(100, 120000, (B, P), device="cuda")
    kw = dict(cache_implementation="static", compile_config=CompileConfig(backend=kvq_backend(preset), fullgraph=True))
    timed_generate(model, ids, 18, **kw)  # the profiled generate's length: the same static cache
    prof = profiled_decode(model, ids, 8, **kw)
    print(f"{preset} B={B} P={P}: kernels of 8 decode steps")
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=70))
    if order:
        runs = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA)[:order]
        t0 = runs[0][0] if runs else 0
        for start, end, name in runs:
            print(f"  {start - t0:9.1f} {end - start:7.1f}  {name[:90]}")
    groups = kernel_groups([(e.key, e.self_device_time_total) for e in prof.key_averages()
                            if e.self_device_time_total > 0], 8)
    print("per decode step (self device time, ms): " + ", ".join(f"{g} {ms:.3f}" for g, ms in groups.items())
          + f"; total {sum(groups.values()):.3f}")


def run_specs(args) -> list:
    """The (kind, preset) runs of one shape, in order: the baselines, then kvq's presets and their variants."""
    runs = [(b, None) for b in args.baselines.split(",") if b] + [("kvq", p) for p in args.presets.split(",") if p]
    runs += [("kvq-opaque", p) for p in args.opaque.split(",") if p]
    runs += [("kvqcache", p) for p in args.kvqcache.split(",") if p]
    runs += [("kvq-frozen", p) for p in args.frozen.split(",") if p]
    runs += [("kvq-gemm-tuned", p) for p in args.gemm_tuned.split(",") if p]
    runs += [("kvq-combo", p) for p in args.combo.split(",") if p]
    return runs


def per_shape(args, shapes: list) -> None:
    """Each shape in its own process (this script again with --shapes SHAPE --one-process; --profile in the last
    one only), the rows gathered into --out; with --process-per-run each run of each shape in its own process
    (--only KIND:PRESET), so that no run's wall-clock depends on the runs before it in a process (session 30, H200:
    at (32, 4096) the first three kvq runs of a process took 3.68-3.73 ms per step, the later five 4.56-5.28). In
    one process HF's compiled static cache at (32, 4096), compiled after (8, 8192) despite `torch._dynamo.reset()`,
    took 28.2 ms of GPU time and 31.7 ms wall-clock per step against 15.2 and 17.5 in a process of its own (H100,
    session 18); the cause (likely dynamo's dynamic-shape state outliving the reset) was not pinned down."""
    import subprocess
    import tempfile

    rows, head = [], None
    jobs = [(shape, spec) for shape in shapes for spec in (run_specs(args) if args.process_per_run else [None])]
    for i, (shape, spec) in enumerate(jobs):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            only = [] if spec is None else ["--only", f"{spec[0]}:{spec[1] or ''}"]
            argv = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--shapes", shape, "--one-process",
                    "--out", out, *only] + ([] if i == len(jobs) - 1 else ["--profile", ""])
            if os.environ.get("KVQ_WITH_FLAGS"):   # started by bench/debug/with_flags.py: the same flags here
                print(f"shape {shape}: its process runs with the flags {os.environ['KVQ_WITH_FLAGS']!r}", flush=True)
                argv[1:1] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "debug", "with_flags.py"),
                             os.environ["KVQ_WITH_FLAGS"]]
            rc = subprocess.run(argv).returncode
            if rc != 0 or not os.path.exists(out):   # report and go on, as one process does with a failed run
                print(f"shape {shape}{'' if spec is None else f' run {spec}'}: its process failed (exit code {rc}); "
                      "no rows", flush=True)
                continue
            with open(out) as f:
                head = json.load(f)
            rows += head["rows"]
        # after every process, so that a run stopped by a time limit keeps the rows before it (session 34, call 5,
        # lost a whole shape's); copy_bw: the last process's (each row's roofline used its own process's)
        if args.out and head is not None:
            write_rows(args.out, head["copy_bw"], args.layers, rows)


def _has_quanto() -> bool:
    """Whether this interpreter can import optimum-quanto (HF's QuantizedCache backend for the quanto baselines)."""
    import importlib.util

    try:
        return importlib.util.find_spec("optimum.quanto") is not None
    except ModuleNotFoundError:   # no `optimum` package at all
        return False


def main():
    from transformers import CompileConfig

    from kvq_compile import kvq_backend, lowering

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--shapes", default="1x16384,8x8192,32x4096")
    ap.add_argument("--presets", default="fp16,int8,kivi-4,kivi-2")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--baselines", default="eager,hf-compiled",
                    help="of eager, hf-compiled, quanto-2, quanto-4 (HF QuantizedCache: needs optimum-quanto); '' for none")
    ap.add_argument("--opaque", default="", help="presets also run with kvq::attend not lowered (default launch)")
    ap.add_argument("--kvqcache", default="", help="presets also run through KVQCache (no fp16 cache at all)")
    ap.add_argument("--frozen", default="",
                    help="presets also run with Inductor's freezing (the weights constants, so that its patterns "
                         "may concatenate same-input GEMMs' weights). Session 29, H200: GPU time per step unchanged "
                         "(2.25 against 2.23 ms at (32, 4096)), 0.4-0.9 GiB more peak memory, and wall-clock 4x "
                         "slower (its CUDA graphs were skipped): not recommended")
    ap.add_argument("--gemm-tuned", default="",
                    help="presets also run with Inductor's GEMM autotuning (`max_autotune_gemm`; kvq::attend keeps "
                         "its default launch). Session 30, H200: its Triton picks made the step slower (2.56 against "
                         "2.25 ms of GPU time at (32, 4096)): not recommended")
    ap.add_argument("--combo", default="",
                    help="presets also run with Inductor's combo kernels (`combo_kernels`: independent small kernels "
                         "fused horizontally into one launch). Session 33, H100: slower (2.65 against 2.59 ms of GPU "
                         "time per step, xquant-1.38 at (32, 4096)): not recommended")
    ap.add_argument("--process-per-run", action="store_true",
                    help="each run (baseline or preset) of each shape in a process of its own (fairer wall-clock)")
    ap.add_argument("--only", default=None, help=argparse.SUPPRESS)   # KIND:PRESET, set by --process-per-run
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", default=None,
                    help="presets whose decode steps are profiled (top kernels, and ms per step by group)")
    ap.add_argument("--profile-shape", default="8x2048", help="(batch)x(prompt) of the profiled steps")
    ap.add_argument("--profile-order", type=int, default=0, help="with --profile: print the first N kernels in order")
    ap.add_argument("--gpu-time", action="store_true",
                    help="also the GPU time of a decode step (kernels of 8 profiled steps), for compiled runs")
    ap.add_argument("--one-process", action="store_true",
                    help="all shapes in this process (default: one child process per shape, see `per_shape`)")
    ap.add_argument("--flags", default="",
                    help="NAME=INT,... module flags of kvq_compile.templates.decode_attention set for every run "
                         "(e.g. WINDOW_ONE_WAIT=0), for A/Bs")
    args = ap.parse_args()
    from kvq_compile.templates import decode_attention as da

    for kv in filter(None, args.flags.split(",")):
        name, _, val = kv.partition("=")
        if not name.isupper() or not hasattr(da, name) or not val.lstrip("-").isdigit():
            ap.error(f"--flags: {kv!r} is not NAME=INT of a flag of kvq_compile.templates.decode_attention")
        setattr(da, name, int(val))
    baselines = [b for b in args.baselines.split(",") if b]
    bad = [b for b in baselines if b not in ("eager", "hf-compiled") and not re.fullmatch(r"quanto-[24]", b)]
    if bad:   # an unknown name would run HF's default dynamic cache under that label
        ap.error(f"unknown baselines {bad}: of eager, hf-compiled, quanto-2, quanto-4 ('' for none)")
    if any(b.startswith("quanto-") for b in baselines) and not _has_quanto():
        # before any run: session 37's device call 3 installed the wheel with another interpreter's pip and found out
        # only at the quanto runs
        ap.error(f"the quanto baselines need optimum-quanto importable by {sys.executable}: "
                 f"{sys.executable} -m pip install --no-deps <optimum_quanto wheel> (its pure-Python wheel: "
                 f"bench/device_call.sh installs any carried in .whl/)")
    shapes = [sh for sh in args.shapes.split(",") if sh]
    if (len(shapes) > 1 or args.process_per_run) and not args.one_process:
        return per_shape(args, shapes)
    bw = copy_bandwidth()
    model = build(args.layers)
    wbytes = weight_bytes(model)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} copy {bw / 1e12:.2f} TB/s, "
          f"{args.layers} layers, weights read per step {wbytes / 2**30:.1f} GiB", flush=True)
    rows = []
    for shape in shapes:
        B, P = map(int, shape.split("x"))
        ids = torch.randint(100, 120000, (B, P), device="cuda")
        runs = run_specs(args)
        if args.only is not None:   # one run of this shape (--process-per-run)
            kind, _, preset = args.only.partition(":")
            runs = [r for r in runs if r == (kind, preset or None)]
        for kind, preset in runs:
            torch._dynamo.reset()
            torch.cuda.empty_cache()
            kw = {}
            if kind == "hf-compiled":
                kw = dict(cache_implementation="static", compile_config=CompileConfig())
            elif kind in KVQ_COMPILED:  # opaque: kvq::attend not lowered (untuned kernel)
                lowering.DEVICES.clear()
                lowering.DEVICES.update(set() if kind == "kvq-opaque" else {"cuda"})
                lowering.SELECTED.clear()
                opts = dict(mode=None, options={"triton.cudagraphs": True, **KVQ_OPTIONS[kind]}) \
                    if kind in KVQ_OPTIONS else {}
                cc = CompileConfig(backend=kvq_backend(preset), fullgraph=True, **opts)
                kw = dict(cache_implementation="static", compile_config=cc)
            elif kind == "kvqcache":  # the HF-native path: a Cache made of the packed store alone
                from kvq_compile.hf import KVQCache

                # room for the profiled generate too (`profiled_decode`: at least 18 new tokens)
                cache = KVQCache(model, preset, batch_size=B, max_cache_len=P + max(args.new, 18))
                kw = dict(past_key_values=cache, compile_config=CompileConfig(fullgraph=True))
            elif kind.startswith("quanto-"):  # HF's QuantizedCache, optimum-quanto backend (eager: not compileable)
                kw = dict(cache_implementation="quantized", disable_compile=True,
                          cache_config={"backend": "quanto", "nbits": int(kind.split("-")[1])})
            elif kind == "eager":
                kw = dict(cache_implementation="static", disable_compile=True)
            try:
                torch.cuda.reset_peak_memory_stats()
                step, _ = timed_generate(model, ids, args.new, **kw)
                peak = torch.cuda.max_memory_allocated()
                gpu = gpu_summed = None
                if args.gpu_time and kind in ("hf-compiled", "kvqcache", *KVQ_COMPILED):
                    if kind == "kvqcache":
                        cache.reset()   # a used KVQCache is full
                    gpu, gpu_summed = gpu_ms_per_step(model, ids, new=args.new, **kw)
            except Exception as e:  # noqa: BLE001  report and go on
                print(f"{kind} {preset} B={B} P={P}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            tps = B / step
            if lowering.SELECTED and kind != "kvq-opaque" and kind in KVQ_COMPILED:
                picks = collections.Counter(str(c) for _, c in lowering.SELECTED)
                print(f"  autotuned kvq::attend launches: {dict(picks)}", flush=True)
            roof = roofline_tok_s(model, preset if kind in (*KVQ_COMPILED, "kvqcache") else None, args.layers,
                                  B, P + args.new // 2, bw)
            row = dict(kind=kind, preset=preset, batch=B, prompt=P, tok_s=tps, ms_step=1e3 * step,
                       peak_gib=peak / 2**30, roofline_tok_s=roof, frac_roofline=tps / roof, gpu_ms_step=gpu,
                       gpu_ms_step_summed=gpu_summed)
            rows.append(row)
            kw.pop("past_key_values", None)
            print(f"{kind:12s} {str(preset):12s} B={B:2d} P={P:6d}  {tps:9.1f} tok/s  {row['ms_step']:7.2f} ms/step  "
                  f"peak {row['peak_gib']:6.1f} GiB  roofline {roof:9.1f} tok/s ({100 * tps / roof:5.1f}%)"
                  + (f"  GPU {gpu:6.2f} ms/step ({100 * B / roof / (gpu * 1e-3):5.1f}% of roofline; kernels summed "
                     f"{gpu_summed:.2f})" if gpu else ""),
                  flush=True)
    for preset in (args.profile or "").split(","):
        if preset:
            profile_step(model, preset, *map(int, args.profile_shape.split("x")), order=args.profile_order)
    if args.out:
        write_rows(args.out, bw, args.layers, rows)


if __name__ == "__main__":
    main()
